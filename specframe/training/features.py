"""The target's features on self-distillation data, computed once and cached on disk for every trainer.

A *feature* is the target's last hidden state after the final norm (`hidden_states[-1]`, what its LM head
reads) at one position. Medusa heads and the EAGLE drafter both learn from features, and the target is frozen
while they train, so one teacher-forced pass over the data serves every epoch and every trainer.

Cache file: `<cache_dir>/features-<key>.safetensors` holding `features` ([sum of lengths, hidden], stored in
bfloat16), `ids` (the token ids, concatenated), and `offsets`/`first_target` per sequence. `key` hashes the
examples' ids and tokens, the target's fingerprint, `max_length` and the extraction dtype, so changed data or
a different target never reuses a stale file.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specframe.data import DistillExample
from specframe.shared_draft import target_fingerprint
from specframe.training.common import collate, to_sequences


@dataclass
class FeatureSequence:
    ids: torch.Tensor  # [T] long: prompt + response tokens
    first_target: int  # ids[first_target:] is the response
    features: torch.Tensor  # [T, hidden] bfloat16: the target's last hidden state (after the norm) per position
    id: str = ""  # the example's id (split train / held-out by it)


def cache_key(examples: list[DistillExample], target: torch.nn.Module, max_length: int, dtype: torch.dtype) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(target_fingerprint(target), sort_keys=True).encode())
    h.update(f"{max_length}:{dtype}".encode())
    for e in examples:
        h.update(f"{e.id}:{e.prompt_ids}:{e.response_ids}".encode())
    return h.hexdigest()[:16]


@torch.no_grad()
def extract_features(
    target: torch.nn.Module,
    examples: list[DistillExample],
    max_length: int = 512,
    batch_size: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | Path | None = None,
    quiet: bool = False,
) -> list[FeatureSequence]:
    """Features of every example (prompt + response, cut at `max_length`), in id order, from the cache when present.

    `dtype` is the precision of the teacher-forced pass: bfloat16 is about twice as fast on CPU and its
    features differ from float32's by far less than the noise the trainers add on purpose."""
    from tqdm import tqdm

    # Sorted by id, so any order of the same examples shares one cache; dropped: those with no response token.
    examples = sorted((e for e in examples if to_sequences([e], max_length)), key=lambda e: e.id)
    seqs = to_sequences(examples, max_length)
    example_ids = [e.id for e in examples]
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"features-{cache_key(examples, target, max_length, dtype)}.safetensors"
        if path.is_file():
            return _load(path, example_ids)
    model = target if target.dtype == dtype else copy.deepcopy(target).to(dtype)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))  # similar lengths: little padding
    feats: list[torch.Tensor | None] = [None] * len(seqs)
    bar = tqdm(total=sum(len(s.ids) for s in seqs), desc="target features", unit="tok", file=sys.stderr, disable=quiet)
    for start in range(0, len(order), batch_size):
        batch = [seqs[i] for i in order[start : start + batch_size]]
        ids, attn, _ = collate(batch, pad=0)
        hidden = model.model(input_ids=ids.to(model.device), attention_mask=attn.to(model.device)).last_hidden_state
        for row, i in enumerate(order[start : start + batch_size]):
            feats[i] = hidden[row, : len(seqs[i].ids)].to(torch.bfloat16).cpu()
        bar.update(sum(len(s.ids) for s in batch))
    bar.close()
    out = [
        FeatureSequence(torch.tensor(s.ids), s.first_target, f, i)
        for s, f, i in zip(seqs, feats, example_ids, strict=True)
    ]
    if path is not None:
        _save(path, out)
    return out


def split_features(cfg, target: torch.nn.Module, train_ex: list, held_ex: list):
    """(training, held-out) feature sequences for a trainer's split, from one extraction over all of its examples,
    so every trainer with the same data, `max_length` and target shares one cache file (`cfg.features_cache`,
    "" = no cache)."""
    feats = extract_features(target, train_ex + held_ex, cfg.max_length, cache_dir=cfg.features_cache or None)
    held_ids = {e.id for e in held_ex}
    return [s for s in feats if s.id not in held_ids], [s for s in feats if s.id in held_ids]


def _save(path: Path, seqs: list[FeatureSequence]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = torch.tensor([s.ids.numel() for s in seqs])
    tensors = {
        "features": torch.cat([s.features for s in seqs]).contiguous(),
        "ids": torch.cat([s.ids for s in seqs]).contiguous(),
        "lengths": lengths,
        "first_target": torch.tensor([s.first_target for s in seqs]),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp)
    tmp.rename(path)  # atomic: an interrupted run never leaves a half-written cache behind


def _load(path: Path, ids: list[str]) -> list[FeatureSequence]:
    t = load_file(path)
    out, at = [], 0
    for n, first, i in zip(t["lengths"].tolist(), t["first_target"].tolist(), ids, strict=True):
        out.append(FeatureSequence(t["ids"][at : at + n], first, t["features"][at : at + n], i))
        at += n
    return out
