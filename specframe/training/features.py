"""The target's features on self-distillation data, computed once and cached on disk for every trainer.

A *feature* is the target's last hidden state after the final norm (`hidden_states[-1]`, what its LM head
reads) at one position. Medusa heads and the EAGLE drafter both learn from features, and the target is frozen
while they train, so one teacher-forced pass over the data serves every epoch and every trainer. A trainer
may also ask for *extra layers* (indices into the target's `hidden_states`: 0 = embeddings, i = the output
of decoder layer i), e.g. EAGLE's fused low/middle/high features.

Cache file: `<cache_dir>/features-<key>.safetensors` holding `features` ([sum of lengths, hidden], stored in
bfloat16), with extra layers also `extra` ([sum of lengths, len(layers) * hidden], bfloat16, the layers
side by side in the order asked), `ids` (the token ids, concatenated), and `lengths`/`first_target` per
sequence. `key` hashes the examples' ids and tokens, the target's fingerprint, `max_length`, the extraction
dtype and the extra layers, so changed data, a different target or other layers never reuse a stale file.
The file's metadata records `base_key` (the key without extra layers), `context` (the key of the target,
`max_length` and dtype alone) and `extra_layers`, so that the target never runs twice on the same text:

- a trainer that asks for fewer layers (Medusa and the draft ask for none) reads its columns from a file made
  for more (EAGLE's fused features) for the same examples;
- data that grew (another `distill --tag` pass appended to a copy of the file) runs the target on the new
  sequences only and copies the others' rows from the cache files that hold the same token sequences (the
  feature of a position depends on the tokens up to it alone; the rows agree with a fresh pass to the
  rounding of a different batch), then writes the whole file under its own key.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specframe.data import DistillExample
from specframe.errors import BadInputError, ConfigError
from specframe.fingerprint import save_weights, sync_to_disk, target_fingerprint
from specframe.training.common import collate, to_sequences


@dataclass
class FeatureSequence:
    ids: torch.Tensor  # [T] long: prompt + response tokens
    first_target: int  # ids[first_target:] is the response
    features: torch.Tensor  # [T, hidden] bfloat16: the target's last hidden state (after the norm) per position
    id: str = ""  # the example's id (split train / held-out by it)
    extra: torch.Tensor | None = None  # [T, len(layers) * hidden] bfloat16: the extra layers asked for, or None


STALE_SAVE_S = 3600  # a cache file's temp file untouched this long is a killed save's (removed at the next save)

# Config keys that name or describe the model rather than change its forward pass (and "_"-private ones).
_CONFIG_NOT_IN_FORWARD = frozenset(
    {"transformers_version", "dtype", "torch_dtype", "architectures", "use_cache", "return_dict",
     "output_hidden_states", "output_attentions"}
)  # fmt: skip


def cache_keys(
    examples: list[DistillExample],
    target: torch.nn.Module,
    max_length: int,
    dtype: torch.dtype,
    extra_layers: tuple[int, ...] = (),
) -> tuple[str, str, str]:
    """(key, base key, context) of a cache file: the key hashes the target's fingerprint and its config,
    `max_length`, the dtype, the extra layers and the examples; the base key the same without extra layers (equal
    to the key when there are none); the context only what the features of one token sequence depend on besides
    its tokens (the target, the cut and the dtype)."""
    context = hashlib.sha256()
    context.update(json.dumps(target_fingerprint(target), sort_keys=True).encode())
    # The weights' fingerprint does not see the config, which the forward reads too (rope_theta, rms_norm_eps...).
    config = {k: v for k, v in target.config.to_dict().items() if k not in _CONFIG_NOT_IN_FORWARD and k[0] != "_"}
    context.update(json.dumps(config, sort_keys=True, default=str).encode())
    context.update(f"{max_length}:{dtype}".encode())
    key, base = context.copy(), context.copy()
    if extra_layers:  # (absent for none: files cached before extra layers existed keep their key)
        key.update(f"extra:{list(extra_layers)}".encode())
    for e in examples:
        text = f"{e.id}:{e.prompt_ids}:{e.response_ids}".encode()
        key.update(text)
        base.update(text)
    return key.hexdigest()[:16], base.hexdigest()[:16], context.hexdigest()[:16]


@torch.no_grad()
def extract_features(
    target: torch.nn.Module,
    examples: list[DistillExample],
    max_length: int = 512,
    batch_size: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | Path | None = None,
    quiet: bool = False,
    extra_layers: tuple[int, ...] | list[int] = (),
) -> list[FeatureSequence]:
    """Features of every example (prompt + response, cut at `max_length`), in id order, from the cache when present;
    with `extra_layers`, those hidden states too (`FeatureSequence.extra`).

    `dtype` is the precision of the teacher-forced pass: bfloat16 is about twice as fast on CPU and its
    features differ from float32's by far less than the noise the trainers add on purpose."""
    from tqdm import tqdm

    extra_layers = tuple(extra_layers)
    check_extra_layers(extra_layers, target.config.num_hidden_layers, "extra_layers")

    # Sorted by id, so any order of the same examples shares one cache; dropped: those with no response token.
    examples = sorted((e for e in examples if to_sequences([e], max_length)), key=lambda e: e.id)
    seqs = to_sequences(examples, max_length)
    example_ids = [e.id for e in examples]
    path = None
    if cache_dir is not None:
        key, base_key, context = cache_keys(examples, target, max_length, dtype, extra_layers)
        path = Path(cache_dir) / f"features-{key}.safetensors"
        if path.is_file():
            return _load(path, example_ids, extra_layers, extra_layers)
        cached = list(_cache_files(Path(cache_dir), context, extra_layers))
        for other, meta, layers in cached:
            if meta.get("base_key") == base_key:  # the same examples, with at least these layers
                if not quiet:
                    print(f"target features: reading the layers asked for from {other}", file=sys.stderr)
                return _load(other, example_ids, layers, extra_layers)
    # Every sequence's rows go straight into one buffer per tensor (saved as they are: the largest caches are
    # several GB, so nothing is concatenated afterwards), in id order.
    starts = [0, *itertools.accumulate(len(s.ids) for s in seqs)]
    hidden = target.config.hidden_size
    feats = torch.empty(starts[-1], hidden, dtype=torch.bfloat16)
    extra = torch.empty(starts[-1], len(extra_layers) * hidden, dtype=torch.bfloat16) if extra_layers else None
    done = [False] * len(seqs)
    if cache_dir is not None:
        copied = _copy_cached_rows(cached, seqs, starts, extra_layers, feats, extra, done)
        if copied and not quiet:
            print(
                f"target features: {copied} of {len(seqs)} sequences copied from earlier cache files; "
                f"running the target on the other {len(seqs) - copied}",
                file=sys.stderr,
            )
    todo = [i for i in range(len(seqs)) if not done[i]]
    model = target if target.dtype == dtype or not todo else copy.deepcopy(target).to(dtype)
    order = sorted(todo, key=lambda i: len(seqs[i].ids))  # similar lengths: little padding
    total = sum(len(seqs[i].ids) for i in todo)
    bar = tqdm(total=total, desc="target features", unit="tok", file=sys.stderr, disable=quiet)
    for at in range(0, len(order), batch_size):
        batch = order[at : at + batch_size]
        ids, attn, _ = collate([seqs[i] for i in batch], pad=0)
        device = model.device
        out = model.model(
            input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=bool(extra_layers)
        )
        more = torch.cat([out.hidden_states[layer] for layer in extra_layers], -1) if extra_layers else None
        for row, i in enumerate(batch):
            a, b = starts[i], starts[i + 1]
            feats[a:b] = out.last_hidden_state[row, : b - a].to(torch.bfloat16).cpu()
            if more is not None:
                extra[a:b] = more[row, : b - a].to(torch.bfloat16).cpu()
        bar.update(sum(len(seqs[i].ids) for i in batch))
    bar.close()
    ids = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.long)
    if path is not None:
        tensors = {
            "features": feats,
            "ids": ids,
            "lengths": torch.tensor([len(s.ids) for s in seqs]),
            "first_target": torch.tensor([s.first_target for s in seqs]),
            **({"extra": extra} if extra is not None else {}),
        }
        meta = {"base_key": base_key, "context": context, "extra_layers": json.dumps(list(extra_layers))}
        _save(path, tensors, meta)
    return [
        FeatureSequence(ids[a:b], s.first_target, feats[a:b], i, extra[a:b] if extra is not None else None)
        for s, i, a, b in zip(seqs, example_ids, starts[:-1], starts[1:], strict=True)
    ]


def check_extra_layers(layers, num_layers: int, what: str) -> None:
    """Extra layers are hidden-state indices 0 .. num_layers - 1 (the last, index num_layers, is the feature)."""
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ConfigError(
                f"{what} must list target layers 0..{num_layers - 1} (0 = the embeddings, i = the output of "
                f"decoder layer i; the last layer is the feature itself), got {layer!r}"
            )
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{what} lists a layer twice: {list(layers)}")


def split_features(cfg, target: torch.nn.Module, train_ex: list, held_ex: list, extra_layers=()):
    """(training, held-out) feature sequences for a trainer's split, from one extraction over all of its examples,
    so every trainer with the same data, `max_length` and target shares one cache file (one holding at least the
    extra layers it asks for; `cfg.features_cache`, "" = no cache)."""
    feats = extract_features(
        target, train_ex + held_ex, cfg.max_length, cache_dir=cfg.features_cache or None, extra_layers=extra_layers
    )
    held_ids = {e.id for e in held_ex}
    return [s for s in feats if s.id not in held_ids], [s for s in feats if s.id in held_ids]


def _save(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Written beside `path` under a name of its own, then renamed to it: a reader never sees a half-written file,
    and trainers saving the same key at once (a sweep sharing the cache) do not write into one file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob("features-*.tmp"):  # a killed save's (a writer's file is younger: it writes)
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > STALE_SAVE_S:
                stale.unlink()
    fd, name = tempfile.mkstemp(prefix=f"{path.stem}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        save_weights(tensors, tmp, metadata=meta)
        sync_to_disk(tmp)  # (a power cut after the rename must not leave a torn cache file under the key's name)
        os.replace(tmp, path)  # (another trainer's file of the same key holds the same features)
    except BaseException:  # an interrupted save leaves nothing behind
        tmp.unlink(missing_ok=True)
        raise


def _cache_files(cache_dir: Path, context: str, wanted: tuple[int, ...]):
    """(path, metadata, its extra layers) of each cache file made with this target, `max_length` and dtype whose
    extra layers include every one in `wanted` (files without that record, from before it existed, are skipped)."""
    for path in sorted(cache_dir.glob("features-*.safetensors")):
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
            layers = tuple(json.loads(meta.get("extra_layers", "[]")))
        except Exception:  # (not a readable cache file: ignored, as a missing one would be)
            continue
        if meta.get("context") == context and set(wanted) <= set(layers):
            yield path, meta, layers


def _copy_cached_rows(
    cached: list,
    seqs: list,
    starts: list[int],
    wanted: tuple[int, ...],
    feats: torch.Tensor,
    extra: torch.Tensor | None,
    done: list[bool],
) -> int:
    """Copy into `feats` and `extra` (rows `starts[i]:starts[i + 1]` for sequence i) the rows of every sequence
    whose token ids a cached file holds, marking it done; returns how many were copied."""
    need: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(seqs):
        need.setdefault(tuple(s.ids), []).append(i)
    copied = 0
    for path, _, layers in cached:
        with safe_open(path, "pt") as f:
            ids, lengths = f.get_tensor("ids"), f.get_tensor("lengths").tolist()
            rows, more = f.get_slice("features"), f.get_slice("extra") if wanted else None
            hidden = rows.get_shape()[1]
            at = 0
            for n in lengths:
                for i in need.pop(tuple(ids[at : at + n].tolist()), []):
                    a, b = starts[i], starts[i + 1]
                    feats[a:b] = rows[at : at + n]
                    if extra is not None:
                        extra[a:b] = _columns(more[at : at + n], layers, wanted, hidden)
                    done[i] = True
                    copied += 1
                at += n
        if not need:
            break
    return copied


def _columns(block: torch.Tensor, stored: tuple[int, ...], wanted: tuple[int, ...], hidden: int) -> torch.Tensor:
    """The columns of the layers `wanted`, in that order, from `block` holding the layers `stored` side by side."""
    if tuple(stored) == tuple(wanted):
        return block
    return torch.cat([block[:, c * hidden : (c + 1) * hidden] for c in (stored.index(x) for x in wanted)], -1)


def _load(path: Path, ids: list[str], stored: tuple[int, ...], wanted: tuple[int, ...]) -> list[FeatureSequence]:
    """The sequences in a cache file that holds the extra layers `stored`, keeping the columns of `wanted`."""
    try:
        with safe_open(path, "pt") as f:
            t = {k: f.get_tensor(k) for k in ("features", "ids", "lengths", "first_target")}
            extra = _columns(f.get_tensor("extra"), stored, wanted, t["features"].shape[1]) if wanted else None
    except Exception as e:  # (written atomically: only damage from outside gets here)
        raise BadInputError(
            f"the features cache file {path} cannot be read ({type(e).__name__}: {e}); delete it to compute the "
            "features again"
        ) from e
    out, at = [], 0
    for n, first, i in zip(t["lengths"].tolist(), t["first_target"].tolist(), ids, strict=True):
        more = extra[at : at + n] if extra is not None else None
        out.append(FeatureSequence(t["ids"][at : at + n], first, t["features"][at : at + n], i, more))
        at += n
    return out
