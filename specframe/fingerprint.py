"""Which target an artifact was made for: a fingerprint of its weights that survives a change of dtype.

Trained artifacts (a shared draft, Medusa heads, an EAGLE drafter) and the trainers' features cache record the
fingerprint of the target they were made with, and loading one on another target is refused. Training runs in
float32, but the same target is then used in float32, bfloat16 or float16, on CPU or CUDA; so the fingerprint
holds one hash per dtype of the same sample of weights, each taken after rounding the sample to that dtype, and
a target matches when the hash for its own dtype does. The sample is 64 evenly spaced values of every
parameter (embeddings, every decoder layer, norms, head), with the parameters' names and shapes: another
model, or the same embeddings with other layers, does not match.

A PEFT adapter merged at load time (`target.adapter`) is fingerprinted as the base model's weights plus the
sha256 of the adapter's weights file and config: merging in bfloat16 rounds differently from merging in
float32, so the merged weights themselves could not be matched across dtypes.

`read_artifact` reads such an artifact's folder, and `check_vocab_ids` the target's token ids that its reduced
output vocabulary lists, refusing a list that does not fit the target.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLE = 64  # values per parameter
ADAPTER_KEY = "adapter_sha256"
_OWN = "_specframe_fingerprint"  # attribute a model loaded with a merged adapter carries (see `mark_adapter`)


def file_sha256(path: str | Path, h: Any = None) -> str:
    """The sha256 of a file's bytes, read a MiB at a time; with `h`, a hashlib object, the file goes into it (after
    what it already holds) and its hex digest is returned."""
    h = hashlib.sha256() if h is None else h
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def target_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """{vocab_size, hidden_size, weights_sha256: {dtype: hash}} (+ adapter_sha256 when an adapter is merged)."""
    own = getattr(model, _OWN, None)
    if own is not None:
        return dict(own)
    emb = model.get_input_embeddings().weight
    hashes = {name: hashlib.sha256() for name in DTYPES}
    for name, w in model.named_parameters():  # (tied parameters are listed once)
        flat = w.detach().reshape(-1)
        k = min(SAMPLE, flat.numel())
        index = torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)  # (exact in int64)
        sample = flat[index].cpu()
        for dtype_name, dtype in DTYPES.items():
            h = hashes[dtype_name]
            h.update(f"{name}:{tuple(w.shape)}:".encode())
            h.update(sample.to(dtype).float().numpy().tobytes())
    return {
        "vocab_size": emb.shape[0],
        "hidden_size": emb.shape[1],
        "weights_sha256": {name: h.hexdigest() for name, h in hashes.items()},
    }


def data_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """A short form of `target_fingerprint` for every row of self-distillation data: {dtype: 16 hex digits}, each
    a hash of the sizes, the merged adapter and that dtype's weights hash. Data written by the target in bfloat16
    and a run training it in float32 share the bfloat16 entry (`same_data_target`)."""
    full = target_fingerprint(model)
    sizes = f"{full['vocab_size']}:{full['hidden_size']}:{full.get(ADAPTER_KEY)}:"
    return {
        name: hashlib.sha256((sizes + digest).encode()).hexdigest()[:16]
        for name, digest in full["weights_sha256"].items()
    }


def same_data_target(recorded: dict[str, str], model_print: dict[str, str]) -> bool:
    """Whether data whose rows record `recorded` (a `data_fingerprint`) was written by the target fingerprinted
    `model_print`: some dtype's entry is equal. (The same weights in another dtype round to the same values in
    the coarser dtype; other weights essentially never do.)"""
    return any(recorded.get(name) == digest for name, digest in model_print.items())


# adapter_config.json's fields that say where an adapter came from, not what model it makes
ADAPTER_PROVENANCE = ("base_model_name_or_path", "revision", "inference_mode", "peft_version", "auto_mapping")


def adapter_digest(folder: str | Path) -> str:
    """sha256 of a PEFT adapter folder's weights file and of its config's other fields than ADAPTER_PROVENANCE: the
    same weights with another `lora_alpha` (or rank pattern, rsLoRA...) merge into another model."""
    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    # (lists of names sorted: PEFT saves `target_modules` from a set, so one adapter saved twice lists them in
    # two orders)
    kept = {
        k: sorted(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else v
        for k, v in config.items()
        if k not in ADAPTER_PROVENANCE
    }
    h = hashlib.sha256()
    file_sha256(folder / "adapter_model.safetensors", h)
    h.update(json.dumps(kept, sort_keys=True).encode())
    return h.hexdigest()


def mark_adapter(merged: torch.nn.Module, base: dict[str, Any], adapter_folder: str | Path) -> None:
    """Record on `merged` that it is the model fingerprinted `base` with the adapter in `adapter_folder` merged."""
    object.__setattr__(merged, _OWN, {**base, ADAPTER_KEY: adapter_digest(adapter_folder)})


def fingerprint_mismatch(saved: Any, model: torch.nn.Module, adapter: bool = True) -> str | None:
    """Why `saved` (a `target_fingerprint`) is not `model`'s, in words; None when it is. With `adapter` False a
    merged adapter is not compared (the base model's weights are): for artifacts that only propose, whose
    exactness never depends on the target, while Medusa-2 heads are trained together with their adapter."""
    dtype = model.get_input_embeddings().weight.dtype
    name = next((n for n, d in DTYPES.items() if d == dtype), "float32")
    return fingerprint_difference(saved, target_fingerprint(model), name, adapter)


def fingerprint_difference(saved: Any, have: dict[str, Any], dtype: str, adapter: bool = True) -> str | None:
    """Why the fingerprint `saved` is not `have` (a target in `dtype`), in words; None when they match."""
    if not isinstance(saved, dict) or not isinstance(saved.get("weights_sha256"), dict):
        return "its target fingerprint is missing or in an older format (retrain it with this specframe)"
    for key in ("vocab_size", "hidden_size"):
        if saved.get(key) != have[key]:
            return f"{key.replace('_', ' ')} {saved.get(key)} there, {have[key]} here"
    if adapter and saved.get(ADAPTER_KEY) != have.get(ADAPTER_KEY):
        if saved.get(ADAPTER_KEY) is None:
            return "it was made for the target without an adapter, and this target has one merged"
        if have.get(ADAPTER_KEY) is None:
            return "it was made for the target with a PEFT adapter merged (target.adapter), and this one has none"
        return (
            "it was made for the target with another PEFT adapter merged (or before 2026-12-06, when the adapter's "
            "config joined its fingerprint: remake it)"
        )
    if saved["weights_sha256"].get(dtype) != have["weights_sha256"][dtype]:
        return f"the weights differ (compared in {dtype})"
    return None


def check_fingerprint(saved: Any, model: torch.nn.Module, what: str, adapter: bool = True) -> None:
    """Raise ModelLoadError naming `what` unless `saved` is `model`'s fingerprint (see `fingerprint_mismatch`)."""
    from specframe.errors import ModelLoadError

    why = fingerprint_mismatch(saved, model, adapter)
    if why is not None:
        raise ModelLoadError(f"{what} was made for another target: {why}")


def save_weights(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, leaving the file readable as the process's umask allows (as the JSON files beside
    it): safetensors creates it owner-only (0600), so another user or container could read an artifact's config
    but not its weights."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    readable(path)


def _process_umask() -> int:
    """The process's umask, read once at import. Linux shows it in /proc; elsewhere it is set to read it, and put
    back (a thread making a file in between would make it with no umask: the reason to read it once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


_UMASK = _process_umask()


def readable(path: str | Path) -> None:
    """Give `path` the permissions a new file gets from the umask (0644 under the usual 022); where the file
    system keeps no such modes (vfat, some network mounts), leave it as it is."""
    try:
        os.chmod(path, 0o666 & ~_UMASK)
    except OSError:
        pass


ARTIFACT_KINDS = ("draft", "medusa", "eagle")  # a trained artifact's folder holds `<kind>_config.json`


def artifact_kind(folder: str | Path) -> str | None:
    """The kind of trained artifact `folder` holds (one of ARTIFACT_KINDS, by its `<kind>_config.json`), or None."""
    return next((k for k in ARTIFACT_KINDS if (Path(folder) / f"{k}_config.json").is_file()), None)


def begin_artifact(out: Path, kind: str) -> None:
    """Before a trained `kind` artifact's files are written into `out` (a new run's, or a resumed one's over its
    old ones): its `<kind>_config.json`, what makes the folder an artifact, goes first and comes back last
    (`write_artifact`), so a run killed in between leaves a folder that is no artifact (named as an unfinished
    run's), never one whose weights and config come from two runs."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{kind}_config.json").unlink(missing_ok=True)


def sync_to_disk(path: str | Path) -> None:
    """Flush a file's (or a folder's entries') writes to the disk, so that a rename after it never exposes a file
    that a power cut would leave empty or torn."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_artifact(
    out: Path, kind: str, tensors: dict[str, torch.Tensor], vocab_ids: torch.Tensor, meta: dict[str, Any], indent: int
) -> None:
    """A trained `kind` artifact's files, as `read_artifact` reads them: `model.safetensors` (`tensors` in
    float16), `{kind}_vocab.json` and, last and whole (a temp file renamed in), `{kind}_config.json` (`meta`)."""
    begin_artifact(out, kind)
    save_weights(
        {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in tensors.items()}, out / "model.safetensors"
    )
    (out / f"{kind}_vocab.json").write_text(json.dumps(vocab_ids.tolist()))
    path = out / f"{kind}_config.json"
    part = path.with_name(f".{path.name}.part")
    part.write_text(json.dumps(meta, indent=indent))
    for name in ("model.safetensors", f"{kind}_vocab.json", part.name):
        sync_to_disk(out / name)  # (on disk before the rename that makes the folder an artifact)
    os.replace(part, path)
    sync_to_disk(out)


def is_checkpoint(folder: Path) -> bool:
    """Whether `folder` is a training run's checkpoint (`specframe.training.common.save_checkpoint` writes its
    state.json last: a folder with one is a whole checkpoint)."""
    return (folder / "state.json").is_file()


def not_an_artifact(folder: str | Path, kind: str) -> str:
    """Why `folder` holds no trained `kind` artifact, in words that follow its name in an error: it does not
    exist, is a file, holds another kind, or only an unfinished training run's checkpoint."""
    p = Path(folder)
    if not p.exists():
        return "does not exist"
    if not p.is_dir():
        return "is a file, not an artifact folder"
    other = artifact_kind(p)
    if other is not None and other != kind:
        return (
            f"holds a trained {other} artifact ({other}_config.json), not {'an' if kind == 'eagle' else 'a'} {kind} one"
        )
    if is_checkpoint(p / "checkpoint"):
        return (
            f"holds only the checkpoint of an unfinished training run (`specframe train --proposer {kind} out={p} "
            "--resume`, with that run's other options, finishes it)"
        )
    return f"holds no {kind}_config.json"


def read_artifact(folder: Path, kind: str, what: str) -> tuple[dict[str, Any], Any, dict[str, torch.Tensor]]:
    """(metadata, listed vocabulary, tensors) of a trained artifact's folder: `{kind}_config.json`,
    `{kind}_vocab.json` (JSON, checked by `check_vocab_ids` once the target is known to fit) and
    `model.safetensors`. ModelLoadError naming `what` when a file is missing or corrupt, or a weight is not
    finite."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specframe.errors import ModelLoadError

    try:
        meta = json.loads((folder / f"{kind}_config.json").read_text())
        listed = json.loads((folder / f"{kind}_vocab.json").read_text())
        tensors = load_file(folder / "model.safetensors")
    except (OSError, ValueError, RecursionError, SafetensorError) as e:  # (JSONDecodeError is a ValueError; a
        # RecursionError: JSON nested too deeply for Python's parser)
        raise ModelLoadError(f"{what} is incomplete or corrupt: {type(e).__name__}: {e}") from e
    if not isinstance(meta, dict):
        raise ModelLoadError(f"{what} is incomplete or corrupt: {kind}_config.json holds no JSON object")
    checked = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # (isfinite has no float8 kernels)
    broken = next((k for k, t in tensors.items() if t.dtype in checked and not torch.isfinite(t).all()), None)
    if broken is not None:  # (a run that diverged, or a damaged file: it would draft nothing, or garbage)
        raise ModelLoadError(f"{what}: model.safetensors holds values that are not finite (in {broken!r})")
    return meta, listed, tensors


def check_vocab_ids(listed: Any, vocab_size: int, what: str, file: str) -> torch.Tensor:
    """The token ids an artifact's vocabulary file `file` lists, as a LongTensor; ModelLoadError naming `what`
    unless they are a non-empty list of distinct integers in [0, vocab_size). (A float would be truncated by
    `torch.tensor`, and a repeated id would give one token two rows of a draft distribution.)"""
    from specframe.errors import ModelLoadError

    if not isinstance(listed, list) or not listed or not all(type(t) is int for t in listed):
        raise ModelLoadError(f"{what}: {file} must be a non-empty JSON list of token ids (integers)")
    if min(listed) < 0 or max(listed) >= vocab_size:
        raise ModelLoadError(f"{what}: {file} lists token ids outside the target's vocabulary [0, {vocab_size})")
    if len(set(listed)) != len(listed):
        raise ModelLoadError(f"{what}: {file} lists a token id more than once")
    return torch.tensor(listed, dtype=torch.long)
