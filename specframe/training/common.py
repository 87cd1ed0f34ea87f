"""What every trainer shares: sequences from self-distillation data, batching, checkpoints, progress."""

from __future__ import annotations

import base64
import functools
import json
import math
import os
import random
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specframe.data import DISTILL_HINT, DistillExample, existing_file, only_writer
from specframe.errors import (
    BadInputError,
    ConfigError,
    ModelLoadError,
    TrainingError,
    brief,
    check_field_types,
    check_output_path,
    is_number,
    user_path,
)
from specframe.fingerprint import artifact_kind, save_weights, sync_to_disk
from specframe.kv_cache import context_limit
from specframe.sampling import check_seed

# Options naming files or folders (those a trainer has), where a leading `~` is the home folder.
PATH_OPTIONS = ("data", "out", "features_cache", "init_from", "init_heads")


# Logged when a trained artifact is saved without `"shape_choice": "measured"` (its held-out split was too small to
# give the statistics the choice needs): then on a CPU it drafts the device's default shape, a GPU-sized one.
NO_MEASURED_SHAPE = (
    "note: the held-out split gave no {what} statistics, so this artifact's CPU shape cannot be chosen at load: on a "
    "CPU it drafts the default shape, slower than plain decoding there; set {keys} when using it, or train with "
    "more held-out text (heldout_fraction)"
)


@dataclass
class TrainRunConfig:
    """The options every `specframe train --proposer NAME` shares; each trainer extends it (and may change a
    default by declaring the field again)."""

    artifact: ClassVar[str] = ""  # the kind of artifact this trainer writes (one of fingerprint.ARTIFACT_KINDS)

    # Self-distillation data from `specframe data distill` (JSONL of prompt/response token ids).
    data: str = "runs/distill/smollm2-135m-instruct.jsonl"
    # Output folder (the trained artifact, its checkpoint/ and, for some trainers, more; see the docs).
    out: str = "runs/out"
    # Passes over the training split.
    epochs: int = 3
    # Peak AdamW learning rate (linear warm-up, cosine decay).
    lr: float = 5e-4
    # Sequences per optimisation step.
    batch_size: int = 8
    # Longest prompt + response used (tokens).
    max_length: int = 512
    # Output vocabulary: the most frequent response tokens (rows of the target's LM head). Smaller is cheaper;
    # tokens outside it are never drafted (q = 0; exactness is unaffected).
    vocab_size: int = 8192
    # Fraction of prompts held out for the reported metrics (split by prompt id: stable across runs and resumes).
    heldout_fraction: float = 0.05
    # Seed for the split, initialisation and batching order.
    seed: int = 0
    # Folder caching the target's features over the data, shared by every trainer ("" = recompute each run).
    features_cache: str = "runs/features"
    # Checkpoints within an epoch (besides the one at each epoch's end), when this many minutes have passed since
    # the last one (0 = none by time): a run stopped mid-epoch and resumed loses at most that much work, and ends
    # with the weights it would have had, never stopped. By time, so that fast steps (a GPU) are not slowed by saves.
    checkpoint_minutes: float = 10.0
    # ...and/or every this many optimizer steps (0 = none by steps), as transformers' Trainer's save_steps.
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        check_field_types(self, "train.")
        for key in PATH_OPTIONS:  # (a YAML value or an override is not expanded by the shell)
            if isinstance(getattr(self, key, None), str):
                setattr(self, key, user_path(getattr(self, key)))
        for key in ("epochs", "batch_size", "max_length", "vocab_size"):
            value = getattr(self, key)
            if value < 1:  # (an integer: checked first)
                raise ConfigError(f"train.{key} must be >= 1, got {value}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"train.checkpoint_every must be >= 0 (0: none by steps), got {self.checkpoint_every}")
        if not (self.checkpoint_minutes >= 0 and math.isfinite(self.checkpoint_minutes)):
            raise ConfigError(
                f"train.checkpoint_minutes must be a finite number >= 0 (0: none by time), got "
                f"{self.checkpoint_minutes}"
            )
        check_seed(self.seed, "train.seed", unset="")  # (torch.manual_seed's range)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"train.lr must be a finite number > 0, got {self.lr}")
        if not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"train.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if not str(self.out).strip():
            raise ConfigError("train.out must name a folder (it would write the artifact into the current one)")
        try:
            check_output_path(self.out, "train.out", folder=True)
            if self.features_cache:
                check_output_path(self.features_cache, "train.features_cache", folder=True)
        except BadInputError as e:
            raise ConfigError(str(e)) from None
        other = artifact_kind(self.out)
        if other is not None and other != self.artifact:
            raise ConfigError(
                f"train.out '{self.out}' holds a trained {other} artifact ({other}_config.json): training "
                f"{'an' if self.artifact == 'eagle' else 'a'} {self.artifact} there would mix the two; train into "
                "another folder"
            )


@dataclass
class Sequence:
    ids: list[int]  # prompt + response, truncated to max_length
    first_target: int  # positions t >= first_target - 1 predict response tokens (loss positions)
    features: torch.Tensor | None = None  # the target's cached features over `ids` [len(ids), hidden], if any


def to_sequences(examples: list[DistillExample], max_length: int) -> list[Sequence]:
    out = []
    for e in examples:
        ids = (e.prompt_ids + e.response_ids)[:max_length]
        if len(ids) > len(e.prompt_ids):  # at least one response token to learn
            out.append(Sequence(ids, len(e.prompt_ids)))
    return out


def split_heldout(examples: list[DistillExample], fraction: float, seed: int = 0):
    """Deterministic split by prompt id, so the held-out set is the same across runs and resumes, and every
    response to one prompt (several `distill --tag` passes) falls on the same side."""
    import hashlib

    def bucket(e: DistillExample) -> float:
        h = hashlib.sha256(f"{seed}:{e.prompt_id}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64

    train = [e for e in examples if bucket(e) >= fraction]
    heldout = [e for e in examples if bucket(e) < fraction]
    return train, heldout


def make_batches(seqs: list[Sequence], batch_size: int, seed: int) -> list[list[Sequence]]:
    """Batches of similar lengths (little padding), in a seeded random order."""
    ordered = sorted(seqs, key=lambda s: len(s.ids))
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    random.Random(seed).shuffle(batches)
    return batches


def collate(
    batch: list[Sequence], pad: int, prompt_positions: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention_mask [B, T], loss_mask [B, T]): loss at positions predicting the response
    (with `prompt_positions`: predicting any token of the sequence)."""
    width = max(len(s.ids) for s in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(batch):  # right padding
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        attn[i, : len(s.ids)] = 1
        loss[i, 0 if prompt_positions else s.first_target - 1 : len(s.ids) - 1] = True
    return ids, attn, loss


def on_device(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """A batch (e.g. `collate`'s, built on the CPU) moved to the model's device."""
    return tuple(t.to(device) for t in tensors)


HALF_MAX = torch.finfo(torch.float16).max  # the largest float16, the dtype trained artifacts are saved in


def check_fits_half_precision(params: dict[str, torch.Tensor]) -> None:
    """Trained artifacts keep their weights in float16: a weight beyond its range (65504) would be saved as inf,
    and the artifact refused at load. Such a run has diverged (a learning rate too high) though its loss may
    have stayed finite, so it stops here, before the epoch's checkpoint: the one before stays."""
    for name, p in params.items():
        if p.is_floating_point() and p.numel():
            peak = p.detach().abs().max().item()
            if not peak <= HALF_MAX:  # (nan too)
                raise TrainingError(
                    f"training diverged: the weight '{name}' reached {peak:.3g}, beyond the range of float16 "
                    f"({HALF_MAX:g}) that trained artifacts are saved in (a learning rate too high); nothing more "
                    "is saved: lower train.lr, and resume from the last checkpoint or start again"
                )


def save_checkpoint(
    folder: Path, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Weights and optimizer moments as safetensors (never pickle), progress as JSON. Written whole into
    `<folder>.tmp` (state.json last), then swapped in by renames: a run killed at any point leaves a whole
    checkpoint, the new or the old one, which `recovered` puts back in place. Weights that outgrew float16 stop
    the run first (`check_fits_half_precision`)."""
    check_fits_half_precision(params)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():  # (a save that was cut short: never mixed with this one's files)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    save_weights({k: v.detach().contiguous().cpu() for k, v in params.items()}, tmp / "model.safetensors")
    moments = {}
    for i, st in optimizer.state_dict()["state"].items():
        for k, v in st.items():
            moments[f"{i}.{k}"] = v.detach().reshape(-1).contiguous().cpu() if v.dim() == 0 else v.detach().cpu()
    save_weights(moments, tmp / "optim.safetensors")
    (tmp / "state.json.part").write_text(json.dumps(state, indent=2))
    for name in ("model.safetensors", "optim.safetensors", "state.json.part"):
        sync_to_disk(tmp / name)  # (on disk before the renames that make them the checkpoint: a power cut too)
    os.replace(tmp / "state.json.part", tmp / "state.json")  # (so a state.json is always a whole one)
    sync_to_disk(tmp)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    sync_to_disk(folder.parent)
    if old.exists():
        shutil.rmtree(old)


def recovered(folder: Path) -> Path:
    """`folder`, a checkpoint's, after putting back what a run killed while `save_checkpoint` swapped folders
    left: the new checkpoint when it was written whole (its state.json, written last and whole by a rename, is
    there), else the old one. (The files and renames are synced to disk, so this holds after a power cut too.)"""
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    if not folder.exists():
        if (tmp / "state.json").is_file():
            tmp.rename(folder)
        elif old.exists():
            old.rename(folder)
    if old.exists() and folder.exists():
        shutil.rmtree(old)
    return folder


def damaged_checkpoint(folder: Path, what: str) -> ConfigError:
    return ConfigError(
        f"the checkpoint in {folder} is damaged ({what}): it cannot be resumed; train into a new out folder, or "
        "remove that checkpoint folder and train without --resume"
    )


def checkpoint_state(folder: Path) -> dict:
    """A checkpoint's state.json (its progress and run identity); a damaged one is named as such."""
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # (not UTF-8, not JSON, nested too deeply)
        raise damaged_checkpoint(folder, f"state.json: {e}") from None
    epoch = state.get("epoch") if isinstance(state, dict) else None
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise damaged_checkpoint(folder, f"state.json holds no epoch count: {str(state)[:80]}")
    if not isinstance(state.get("history"), list):
        raise damaged_checkpoint(folder, "state.json holds no metrics history")
    try:
        progress_of(state)
    except (TypeError, ValueError) as e:
        raise damaged_checkpoint(folder, f"state.json: {e}") from None
    return state


def _count(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is not a count: {value!r}")
    return value


@dataclass
class Progress:
    """Where a run stands, as a checkpoint's state.json records it: `epoch` epochs done and `batches` batches of
    the next one (0 at an epoch's end); `steps` optimizer steps in all (the schedule's position); and for a
    checkpoint within an epoch, that epoch's running loss, its seconds so far, the state of its random
    generator (EAGLE draws its feature noise from it) and the sums behind its epoch means (`run_epochs`'s `means`:
    name -> [sum, batches])."""

    epoch: int = 0
    batches: int = 0
    steps: int | None = None  # (None: a checkpoint from before 2026-12-06, made at an epoch's end)
    running: float | None = None
    seconds: float = 0.0
    generator: bytes = b""
    means: dict = field(default_factory=dict)

    def steps_done(self, steps_per_epoch: int) -> int:
        return self.steps if self.steps is not None else self.epoch * steps_per_epoch

    def words(self) -> str:
        if self.batches:
            return f"after {self.batches} batches of epoch {self.epoch + 1}"
        return f"after epoch {self.epoch}"


def checkpoint_progress(folder: Path) -> str | None:
    """Where the checkpoint in `folder` stands, in words ("after epoch 2"), after putting back one a run killed
    while saving it left aside (`recovered`); None when there is none, or it is damaged."""
    try:
        return progress_of(checkpoint_state(recovered(folder))).words()
    except (ConfigError, OSError):
        return None


def progress_of(state: dict) -> Progress:
    """A checkpoint state's `Progress` (ValueError / TypeError when a field is not what it should be)."""
    steps = state.get("steps")
    progress = Progress(state["epoch"], steps=None if steps is None else _count(steps, "steps"))
    within = state.get("within")
    if within is not None:
        if not isinstance(within, dict):
            raise ValueError(f"within is not an object: {str(within)[:40]}")
        running, seconds = within.get("running"), within.get("seconds", 0.0)
        if running is not None and not (is_number(running) and math.isfinite(running)):
            raise ValueError(f"within.running is not a number: {running!r}")
        if not (is_number(seconds) and 0 <= seconds < math.inf):
            raise ValueError(f"within.seconds is not a duration: {seconds!r}")
        progress.batches = _count(within.get("batches"), "within.batches")
        progress.running, progress.seconds = running, float(seconds)
        progress.generator = base64.b64decode(within.get("generator", ""), validate=True)
        means = within.get("means", {})  # (none in checkpoints from before run_epochs kept them)
        if not isinstance(means, dict) or not all(
            isinstance(v, list) and len(v) == 2 and is_number(v[0]) and math.isfinite(v[0]) for v in means.values()
        ):
            raise ValueError(f"within.means is not finite sums and counts: {str(means)[:40]}")
        progress.means = {k: [float(total), _count(n, "a count in within.means")] for k, (total, n) in means.items()}
        if any(n > progress.batches for _, n in progress.means.values()):
            raise ValueError(f"within.means counts more batches than the {progress.batches} done")
    return progress


def check_checkpoint_params(folder: Path, named_params: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint saved with other parameters (names or shapes) than this run trains, or whose weight or
    optimizer file is missing or cut short; reads only the files' headers, so trainers call it before their
    feature extraction (`resuming_from`)."""
    try:
        with safe_open(folder / "optim.safetensors", "pt") as f:
            f.keys()
        with safe_open(folder / "model.safetensors", "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # (OSError, or safetensors' own error for a damaged header)
        raise damaged_checkpoint(folder, brief(e)) from None
    wanted = {k: tuple(p.shape) for k, p in named_params.items()}
    differ = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
    if differ:
        raise ConfigError(
            f"the checkpoint in {folder} was saved with other parameters ({differ[0]!r} and {len(differ) - 1} "
            "more differ): resume with the options it was trained with, or train into a new out folder"
        )


NO_CHECKPOINT = "--resume: no checkpoint in {ckpt} (train without --resume to start a new run)"

RUN_PARTS = {  # what a resumed run must share with its checkpoint (`run_identity`), in words, most specific first
    "target": "target",  # (said in words by fingerprint_difference)
    "seed": "seed (it splits the data and orders the batches)",
    "max_length": "max_length",
    "heldout": "held-out split (data or heldout_fraction)",
    "train": "training data",
    "vocabulary": "vocabulary (vocab_size, data, or the init_from/init_heads it started from)",
}


# Options a resumed run may change: the schedule's length and peak, EAGLE's self-fed steps (a curriculum; the log
# says so), the tree chosen from the heads at the end, and where things are (the data's content is checked, and
# init_from/init_heads only choose a start, which the checkpoint replaces). Every other option must match.
RESUME_MAY_CHANGE = frozenset(
    {
        "epochs",
        "lr",
        "self_fed_steps",
        "tree_nodes",
        "checkpoint_every",
        "checkpoint_minutes",
        "data",
        "out",
        "features_cache",
        "init_from",
        "init_heads",
    }
)


def run_identity(
    cfg: TrainRunConfig, train_ex: list, held_ex: list, vocab_ids: torch.Tensor, target_print: dict
) -> dict:
    """What a resumed run must share with the checkpoint it continues: the target (`target_print`, its
    `target_fingerprint`), the examples on each side of the split, the cut, the seed, the vocabulary, and every
    option outside RESUME_MAY_CHANGE."""
    import hashlib

    def digest(lines) -> str:
        h = hashlib.sha256()
        for line in lines:
            h.update(line.encode())
        return h.hexdigest()[:16]

    def examples(split: list) -> str:
        return digest(f"{e.id}:{e.prompt_ids}:{e.response_ids}\n" for e in sorted(split, key=lambda e: e.id))

    return {
        "target": target_print,
        "train": examples(train_ex),
        "heldout": examples(held_ex),
        "max_length": cfg.max_length,
        "seed": cfg.seed,
        "vocabulary": digest([",".join(str(int(t)) for t in vocab_ids.tolist())]),
        "options": {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in ((k, getattr(cfg, k)) for k in cfg.__dataclass_fields__)
            if k not in RESUME_MAY_CHANGE
        },
    }


def only_run_in_out(train: Callable[..., dict]) -> Callable[..., dict]:
    """A trainer `train(cfg, ...)` as the only training run writing into `cfg.out` while it runs: another one is
    refused (two runs in one folder both finished, one's weights beside the other's config and metrics). The
    command takes the same lock before the target loads; this one holds for a trainer called from Python."""

    @functools.wraps(train)
    def one_run(cfg: TrainRunConfig, *args, **kwargs) -> dict:
        with only_writer(cfg.out, "train.out", "training run"):
            return train(cfg, *args, **kwargs)

    return one_run


def check_run_inputs(cfg: TrainRunConfig, resume: bool) -> None:
    """What a run needs that is cheap to check before the target loads (`specframe train`): its data file, and
    with `resume`, a checkpoint in its out folder (both checked again, in full, by the trainer)."""
    existing_file(cfg.data, "distillation data", DISTILL_HINT)
    ckpt = recovered(Path(cfg.out) / "checkpoint")
    if resume and not (ckpt / "state.json").is_file():
        raise ConfigError(NO_CHECKPOINT.format(ckpt=ckpt))


def resuming_from(
    ckpt: Path, named_params: dict[str, torch.Tensor], resume: bool, run: dict, epochs: int | None = None
) -> bool:
    """Whether this run resumes from `ckpt`; if so its parameters, its `run_identity` and `epochs` (no fewer
    than the checkpoint has done) are checked first, so a run with other options or data is refused before the
    costly feature extraction."""
    if not resume:
        check_new_run(ckpt)
        return False
    if not (ckpt / "state.json").is_file():  # (a mistyped `out` never silently starts a new run)
        raise ConfigError(NO_CHECKPOINT.format(ckpt=ckpt))
    state = checkpoint_state(ckpt)
    saved = state.get("run")
    again = "resume with the same data and options, or train into a new out folder"
    if saved is not None:  # (checkpoints from before this check carry none)
        # (checkpoints from before 2026-12-05 record no target)
        differ = [k for k in RUN_PARTS if (k in saved or k != "target") and saved.get(k) != run.get(k)]
        if differ:
            k = differ[0]
            if k == "target":  # (in words: the weights, or an adapter merged or not)
                from specframe.fingerprint import fingerprint_difference

                why = fingerprint_difference(saved[k], run[k], "float32") or "another fingerprint"
                why = why.replace("(target.adapter)", "(--adapter)").replace("this target", "this run's target")
                raise ConfigError(f"the checkpoint in {ckpt} was trained with another target: {why}; {again}")
            values = f": {saved[k]!r} then, {run.get(k)!r} now;" if k in ("seed", "max_length") else ":"
            raise ConfigError(f"the checkpoint in {ckpt} was trained with another {RUN_PARTS[k]}{values} {again}")
        old, new = saved.get("options", {}), run.get("options", {})  # (checkpoints from before 2026-12-02: none)
        for k in sorted(old.keys() & new.keys()):
            if old[k] != new[k]:
                raise ConfigError(
                    f"the checkpoint in {ckpt} was trained with train.{k}={old[k]!r}, not {new[k]!r}: {again} "
                    f"(a resume may change only {', '.join(sorted(RESUME_MAY_CHANGE))})"
                )
    check_checkpoint_params(ckpt, named_params)  # (after the options: a changed one is named as such)
    progress = progress_of(state)
    done = progress.epoch + (1 if progress.batches else 0)  # (a checkpoint within an epoch: that epoch must end)
    if epochs is not None and epochs < done:
        raise ConfigError(
            f"the checkpoint in {ckpt} was saved {progress.words()}: train.epochs={epochs} would "
            f"{'not finish that epoch' if progress.batches else f'train none and record {epochs}'}; "
            f"give train.epochs >= {done}"
        )
    return True


def check_new_run(ckpt: Path) -> None:
    """A run that does not resume must not overwrite another one's checkpoint or saved weights in its out folder."""
    out = ckpt.parent
    if (ckpt / "state.json").is_file():
        try:
            done = progress_of(checkpoint_state(ckpt)).words()
        except ConfigError:  # (a damaged state is still another run's)
            done = "damaged"
        raise ConfigError(
            f"train.out '{out}' already holds the checkpoint of another run ({done}): add --resume to continue "
            "that run, or train into another train.out"
        )
    if (out / "model.safetensors").is_file():  # (a finished artifact, or one copied there: nothing to resume)
        raise ConfigError(
            f"train.out '{out}' already holds trained weights (model.safetensors), which this run would overwrite: "
            "train into another train.out (init_from / init_heads may name this one to start from its weights)"
        )


def load_checkpoint(
    folder: Path, named_params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> dict:
    """Weights and optimizer moments from `folder` (its parameters already checked by `resuming_from`)."""
    try:
        weights = load_file(folder / "model.safetensors")
        moments = load_file(folder / "optim.safetensors")
    except Exception as e:  # (a file cut short past its header: its tensors cannot be read)
        raise damaged_checkpoint(folder, brief(e)) from None
    with torch.no_grad():
        for k, p in named_params.items():
            p.copy_(weights[k])
    sd = optimizer.state_dict()
    params = sd["param_groups"][0]["params"]
    state = {}
    for i in params:
        keys = [k for k in moments if k.split(".", 1)[0] == str(i)]
        if keys:
            state[i] = {
                k.split(".", 1)[1]: (moments[k].reshape(()) if k.endswith("step") else moments[k]) for k in keys
            }
    sd["state"] = state
    optimizer.load_state_dict(sd)
    return checkpoint_state(folder)


def resume_from(
    ckpt: Path,
    params: dict,
    optimizer: torch.optim.Optimizer,
    cfg: TrainRunConfig,
    *,
    resuming: bool,
    run: dict,
    log,
    extra: dict | None = None,
) -> Checkpoints:
    """The run's `Checkpoints` (as often as `cfg` says), starting from `ckpt`'s weights, moments, progress and
    metrics history when `resuming` (which must be the answer of `resuming_from`: it checks the checkpoint's
    parameters; this does not), else from the start with no history."""
    if not resuming:
        return Checkpoints(ckpt, params, optimizer, run, cfg, Progress(), [], extra)
    state = load_checkpoint(ckpt, params, optimizer)
    progress = progress_of(state)
    log(f"resumed from {ckpt} {progress.words()}")
    return Checkpoints(ckpt, params, optimizer, run, cfg, progress, state["history"], extra)


class Checkpoints:
    """A run's checkpoints into `ckpt`: at each epoch's end (`epoch_done`), and within an epoch (`batches`) every
    `cfg.checkpoint_minutes` and every `cfg.checkpoint_every` optimizer steps. Each holds the weights, the
    optimizer's moments and the `Progress`, so a resumed run continues at the batch after it with all that an
    uninterrupted run would have had. `start` is where this run started; `history` its metrics list, which the
    trainer appends to; `extra` goes into every state.json."""

    def __init__(
        self,
        ckpt: Path,
        params: dict,
        optimizer: torch.optim.Optimizer,
        run: dict,
        cfg: TrainRunConfig,
        start: Progress,
        history: list,
        extra: dict | None = None,
    ) -> None:
        self.ckpt, self.params, self.optimizer, self.run = ckpt, params, optimizer, run
        self.every, self.seconds = cfg.checkpoint_every, cfg.checkpoint_minutes * 60
        self.start, self.history, self.extra = start, history, extra or {}
        self.schedule: torch.optim.lr_scheduler.LambdaLR | None = None
        self.first_step = self.saved_at = 0
        self.saved_time = time.perf_counter()

    def make_schedule(self, steps_per_epoch: int, epochs: int) -> torch.optim.lr_scheduler.LambdaLR:
        """The learning-rate schedule (`warmup_cosine`) over `epochs`, at the step this run starts from."""
        self.first_step = self.saved_at = self.start.steps_done(steps_per_epoch)
        self.schedule = warmup_cosine(self.optimizer, steps_per_epoch * epochs, self.first_step)
        return self.schedule

    def steps(self) -> int:
        return self.first_step + self.schedule.last_epoch  # (LambdaLR counts its steps in last_epoch)

    def _save(self, epoch: int, within: dict | None) -> None:
        state = {"epoch": epoch, "history": self.history, "run": self.run, **self.extra, "steps": self.steps()}
        if within is not None:
            state["within"] = within
        save_checkpoint(self.ckpt, self.params, self.optimizer, state)
        self.saved_at, self.saved_time = self.steps(), time.perf_counter()

    def due(self) -> bool:
        """Whether a checkpoint within an epoch is due: optimizer steps were taken since the last one, and as many
        as `checkpoint_every` or `checkpoint_minutes`' worth."""
        taken = self.steps() - self.saved_at
        by_steps = self.every and taken >= self.every
        return taken > 0 and bool(by_steps or (self.seconds and time.perf_counter() - self.saved_time >= self.seconds))

    def epoch_done(self, epochs: int) -> None:
        """The checkpoint after `epochs` epochs (the history holds the last one's metrics)."""
        self._save(epochs, None)

    def batches(self, epoch: int, order: list, generator: torch.Generator | None = None) -> EpochBatches:
        """Epoch `epoch` (from 0)'s batches in `order`; see `EpochBatches`."""
        return EpochBatches(self, epoch, order, generator)


class EpochBatches:
    """The batches of one epoch (items of `order`), from the batch after the checkpoint a resumed run started
    from when that checkpoint is within this epoch (then its running loss, seconds and `generator`'s state are
    restored too). After each batch, a checkpoint when one is due (`Checkpoints.due`) and batches remain. The
    trainer keeps its running loss in `running`, and the sums behind its epoch means in `means` (name ->
    [sum, batches]); `seconds()` is the epoch's time."""

    def __init__(self, owner: Checkpoints, epoch: int, order: list, generator: torch.Generator | None) -> None:
        start = owner.start
        within = start.batches > 0 and start.epoch == epoch
        if within and start.batches >= len(order):
            raise damaged_checkpoint(owner.ckpt, f"it is {start.words()}, which has {len(order)}")
        if within and generator is not None:
            try:
                generator.set_state(torch.frombuffer(bytearray(start.generator), dtype=torch.uint8))
            except (RuntimeError, ValueError) as e:
                raise damaged_checkpoint(owner.ckpt, f"its generator state: {brief(e)}") from None
        self.owner, self.epoch, self.order, self.generator = owner, epoch, order, generator
        self.done = start.batches if within else 0
        self.running: float | None = start.running if within else None
        self.means: dict[str, list] = {k: list(v) for k, v in start.means.items()} if within else {}
        self.started = time.perf_counter() - (start.seconds if within else 0.0)

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def bar(self, desc: str, unit: str = "batch"):
        """A progress bar over these batches (starting at those already done)."""
        from tqdm import tqdm

        return tqdm(self, desc=desc, file=sys.stderr, unit=unit, initial=self.done, total=len(self.order))

    def __iter__(self):
        owner = self.owner
        for i in range(self.done, len(self.order)):
            yield self.order[i]
            self.done = i + 1  # (reached when the trainer asks for the next batch: this one is done)
            if self.done < len(self.order) and owner.due():
                state = self.generator.get_state().numpy().tobytes() if self.generator is not None else b""
                within = {
                    "batches": self.done,
                    "running": self.running,
                    "seconds": self.seconds(),
                    "generator": base64.b64encode(state).decode(),
                    **({"means": self.means} if self.means else {}),
                }
                owner._save(self.epoch, within)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, done_steps: int = 0):
    """Linear warm-up (at most 50 steps), then cosine decay to 0 at `total_steps`; a resumed run passes the
    steps already done, so with unchanged epochs the schedule continues where the checkpoint stopped (with more,
    the cosine is stretched over the new total and the rate rises again at the resume point)."""
    warmup = min(50, total_steps // 10 + 1)

    def factor(s: int) -> float:
        s += done_steps
        return min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total_steps))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def choose_vocab(examples, size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent token ids in the responses (then prompts), plus `always` (e.g. EOS)."""
    counts: Counter[int] = Counter()
    for e in examples:
        counts.update(e.response_ids)
    for e in examples:  # prompt tokens break ties, so the list fills up even with little data
        counts.update({t: 1e-6 for t in e.prompt_ids})
    chosen = [t for t in always if 0 <= t < vocab_size]
    for t, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def check_same_split(cfg: TrainRunConfig) -> None:
    """A run that starts from a trained artifact (init_from / init_heads) must hold out the prompts it held out:
    the split is a hash of (seed, prompt id) against heldout_fraction, and with another seed or a larger fraction
    some prompts the start was trained on would be reported as held out. (Artifacts that do not record them are
    not checked.)"""
    start = getattr(cfg, "init_from", "") or getattr(cfg, "init_heads", "") or ""
    kind = artifact_kind(start) if start else None
    if kind is None:
        return  # (a missing or foreign start is the trainer's own error to name)
    try:
        trained = json.loads((Path(start) / f"{kind}_config.json").read_text()).get("train_config") or {}
    except (OSError, ValueError, RecursionError, AttributeError):
        return  # (likewise: a damaged start is named when it is loaded)
    if not isinstance(trained, dict):
        return
    option = "train.init_from" if getattr(cfg, "init_from", "") else "train.init_heads"
    seed, fraction = trained.get("seed", cfg.seed), trained.get("heldout_fraction", cfg.heldout_fraction)
    # (a smaller fraction with the same seed holds out a subset of the start's held-out prompts: allowed)
    if seed != cfg.seed or (isinstance(fraction, float | int) and cfg.heldout_fraction > fraction):
        key, value = ("seed", seed) if seed != cfg.seed else ("heldout_fraction", fraction)
        raise ConfigError(
            f"{option} '{start}' was trained with {key}={value}, this run has train.{key}={getattr(cfg, key)}: "
            "its held-out prompts (a hash of seed and prompt id) would include prompts the start was trained on; "
            f"set train.{key}={value}{' or less' if key == 'heldout_fraction' else ''}"
        )


def start_run(cfg: TrainRunConfig, target: torch.nn.Module, tokenizer, log=print) -> tuple[list, list, torch.Tensor]:
    """Seed, read the data, split it (by id) and choose the reduced vocabulary: (train, held-out, vocab_ids).
    `log` is told when the data was written by another model or the vocabulary asked for is the whole one."""
    from specframe.data import read_distill
    from specframe.fingerprint import data_fingerprint, same_data_target

    if not isinstance(getattr(target, "model", None), torch.nn.Module) or target.get_output_embeddings() is None:
        raise ModelLoadError(
            f"training needs a decoder-only target laid out like Llama (a `.model` body and an LM head); "
            f"{type(target).__name__} is not"
        )
    # (refuses a target that speculative decoding refuses, e.g. a recurrent one: nothing trained for it could be used)
    window, kind = context_limit(target)
    if cfg.max_length > window and kind != "context window":  # (positions past it: trained, never drafted for)
        log(
            f"note: train.max_length={cfg.max_length} is longer than the target's {kind} ({window} tokens), past "
            f"which specframe never decodes: the positions past it train for contexts never drafted for (their "
            f"features come from the model's own windowed attention); train.max_length={window} would not"
        )
    check_same_split(cfg)
    torch.manual_seed(cfg.seed)
    examples = read_distill(cfg.data)
    if not examples:
        raise ConfigError(f"train.data '{cfg.data}' holds no examples (make it with `specframe data distill`)")
    own = data_fingerprint(target)
    others = sum(e.target is not None and not same_data_target(e.target, own) for e in examples)
    if others:  # (still a valid distillation: the target's own distributions are the labels, on another's text)
        log(
            f"note: {others} of the {len(examples)} responses in train.data '{cfg.data}' were written by another "
            "model than this target: it learns the target's predictions on text that is not the target's own"
        )
    train_ex, held_ex = split_heldout(examples, cfg.heldout_fraction, cfg.seed)
    if not train_ex or not held_ex:
        side = "training" if not train_ex else "held-out"
        raise ConfigError(
            f"train.data '{cfg.data}' has {len(examples)} examples, and heldout_fraction={cfg.heldout_fraction} "
            f"leaves no {side} example: give more data or another heldout_fraction"
        )
    vocab_size = target.get_output_embeddings().weight.shape[0]
    for e in examples:
        top = max(e.prompt_ids + e.response_ids)
        if top >= vocab_size:
            raise ConfigError(
                f"train.data '{cfg.data}': example '{e.id}' has token id {top}, outside the target's vocabulary "
                f"of {vocab_size} (was the data made with another target's tokenizer?)"
            )
    for name, split in (("training", train_ex), ("held-out", held_ex)):
        if not to_sequences(split, cfg.max_length):
            raise ConfigError(
                f"train.data '{cfg.data}': no {name} example keeps a response token within max_length={cfg.max_length}"
            )
    eos = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
    started_from = getattr(cfg, "init_from", "") or getattr(cfg, "init_heads", "")  # (its vocabulary is used)
    if cfg.vocab_size >= vocab_size and not started_from:
        log(f"train.vocab_size={cfg.vocab_size} covers the target's whole vocabulary of {vocab_size} tokens")
    return train_ex, held_ex, choose_vocab(train_ex, min(cfg.vocab_size, vocab_size), vocab_size, eos)


def optimizer_step(
    loss: torch.Tensor, params: dict, optimizer, schedule, running: float | None, decay: float = 0.95
) -> float:
    """Backward, clip the gradient norm to 1, step the optimizer and the schedule; return the running
    (exponentially smoothed) loss for the progress bar."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
    value, norm_value = torch.stack([loss.detach().float(), norm.float()]).tolist()  # (one read of the device)
    if not (math.isfinite(value) and math.isfinite(norm_value)):  # (before the step: the weights stay as they were)
        optimizer.zero_grad(set_to_none=True)
        what = f"the loss is {value}" if not math.isfinite(value) else f"the gradient's norm is {norm_value}"
        raise TrainingError(
            f"training diverged: {what} (a learning rate too high, or data that overflows); nothing more is "
            "saved: lower train.lr, and resume from the last checkpoint or start again"
        )
    optimizer.step()
    schedule.step()
    return value if running is None else decay * running + (1 - decay) * value


def forward_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) from log-probabilities [positions, vocabulary], averaged over the positions."""
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean()


def run_epochs(
    cfg: TrainRunConfig,
    checkpoints: Checkpoints,
    modules: tuple[torch.nn.Module, ...],
    order: Callable[[torch.Generator], list],
    batch_loss: Callable,
    evaluate: Callable[[], dict],
    describe: Callable[[dict], str],
    log,
    *,
    loss_name: str = "loss",
    means: dict[str, str] | None = None,
    draws: bool = False,
    baseline: bool = True,
    decay: float = 0.95,
    unit: str = "batch",
    postfix_every: int = 1,
) -> list:
    """Every trainer's epochs, from where `checkpoints` starts to `cfg.epochs`; returns the metrics history.

    A new run (with `baseline`) first evaluates the untrained weights (history entry 0). Each epoch: `modules` in
    train mode; the items `order(gen)`, `gen` seeded `cfg.seed + epoch` (`checkpoints.batches` skips those done
    before a resumed checkpoint, and with `draws` keeps `gen`'s state: `batch_loss` draws from it); per item,
    `batch_loss(item, gen)`: the loss to step on, None to skip the item, or (loss, {name: value}) for `means`
    (name -> its words in the log), averaged over the epoch's batches (a resumed run's too: checkpoints keep the
    sums). Then `evaluate()` (it sets eval mode), the history entry {"epoch", "train_<loss_name>" (the running
    loss, smoothed by `decay`), **means, "seconds", **metrics}, its log line, and the epoch's checkpoint."""
    history, means = checkpoints.history, means or {}
    if baseline and not history:  # (a new run: a resumed one has these in its checkpoint's history)
        metrics = evaluate()
        history.append({"epoch": 0, **metrics})
        log(f"before training: {describe(metrics)}")
    key = loss_name.lower()
    for epoch in range(checkpoints.start.epoch, cfg.epochs):
        for module in modules:
            module.train()
        gen = torch.Generator().manual_seed(cfg.seed + epoch)
        epoch_batches = checkpoints.batches(epoch, order(gen), gen if draws else None)
        bar = epoch_batches.bar(f"epoch {epoch + 1}/{cfg.epochs}", unit=unit)
        for s, item in enumerate(bar, start=epoch_batches.done):
            loss = batch_loss(item, gen)
            if loss is None:  # (nothing to learn from in this batch)
                continue
            loss, seen = loss if isinstance(loss, tuple) else (loss, {})
            running = epoch_batches.running = optimizer_step(
                loss, checkpoints.params, checkpoints.optimizer, checkpoints.schedule, epoch_batches.running, decay
            )
            seen = {name: float(value) for name, value in seen.items()}
            for name, value in seen.items():
                sums = epoch_batches.means.setdefault(name, [0.0, 0])
                sums[:] = sums[0] + value, sums[1] + 1
            if s % postfix_every == 0:
                shown = {key: f"{running:.3f}", **{k: f"{v:.4f}" for k, v in seen.items()}}
                bar.set_postfix(shown, lr=f"{checkpoints.schedule.get_last_lr()[0]:.1e}")
        metrics = evaluate()
        running = epoch_batches.running
        averages = {name: total / max(1, n) for name, (total, n) in epoch_batches.means.items()}
        history.append(
            {"epoch": epoch + 1, f"train_{key}": running, **averages, "seconds": epoch_batches.seconds(), **metrics}
        )
        said = "".join(
            f", {words} {f'{averages[name]:.4f}' if name in averages else 'none'} (epoch mean)"
            for name, words in means.items()
        )
        trained = "none (no batch had a position to learn from)" if running is None else f"{running:.3f}"
        log(f"epoch {epoch + 1}: train {loss_name} {trained}{said}; {describe(metrics)}")
        checkpoints.epoch_done(epoch + 1)
    return history
