"""Typed configuration: schema dataclasses -> YAML file -> dotlist overrides -> validated objects.

`proposer.*` is validated by the chosen proposer's own `config_class`, picked by `proposer.name`.
YAML files may live anywhere; a bare name such as `medusa.yaml` or `medusa` (or `configs/medusa.yaml` when no
such file exists in the working directory) resolves to the copy shipped inside the installed package.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from specframe.errors import BadInputError, ConfigError, brief, check_field_types, is_integer, user_path
from specframe.sampling import check_penalties, check_sampling, check_seed, top_k_off_as_zero

# target.dtype's values, in any case (fp32, bf16 and fp16 are read as float32, bfloat16 and float16).
TARGET_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


@dataclass
class TargetConfig:
    # The target model: an alias (`specframe models list`), local Hugging Face directory, hub id or .gguf file.
    model: str = "smollm2-135m-instruct"
    # Weights dtype: auto (bfloat16 on CUDA; the faster exact choice on CPU), float32, bfloat16, float16.
    dtype: str = "auto"
    # auto (CUDA when present), cpu, cuda, cuda:N.
    device: str = "auto"
    # Optional PEFT adapter directory, merged into the target; exactness is then w.r.t. the adapted model.
    adapter: str | None = None
    # Run model code shipped with a hub model. Off: only turn it on for models you trust.
    trust_remote_code: bool = False
    # On CPU in float32, faster kernels for 1-64-token forwards (decoding and verification): matmuls as W @ X.T
    # where this machine runs that layout clearly faster (timed at load, per weight shape and row count) and
    # grouped-query attention without copying the cache; same results up to float rounding
    # (specframe/cpu_kernels.py has the numbers). False: PyTorch's and transformers' own kernels.
    fast_cpu_kernels: bool = True
    # On CUDA, replay the target's verification forwards (1-128 tokens) as CUDA graphs over a static KV cache,
    # one launch instead of hundreds; same results up to float rounding, checked against the eager forward when
    # the decoder is built (docs/gpu.md). transformers' LlamaForCausalLM targets; ignored on CPU. False: eager.
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, "target.")
        # (the spelling only: whether CUDA is there is known when the model loads, specframe.models.resolve_device)
        dtype = self.dtype if isinstance(self.dtype, str) else str(self.dtype).removeprefix("torch.")  # (torch.dtype)
        if dtype.strip().lower() not in TARGET_DTYPES:
            raise ConfigError(f"target.dtype must be one of auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device).strip().lower()):
            raise ConfigError(f"target.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass
class SamplingConfig:
    # 0 = greedy; otherwise logits are divided by it before top-k/top-p/min-p.
    temperature: float = 0.0
    # Nucleus sampling mass in (0, 1]; 1 = off.
    top_p: float = 1.0
    # Keep only the k most likely tokens; 0 = off (-1, as vLLM writes off, is read as 0).
    top_k: int = 0
    # Keep only tokens at least min_p times as likely as the most likely one, in [0, 1]; 0 = off (after top-p).
    min_p: float = 0.0
    # > 0; 1 = off. Tokens in the prompt or the output so far: a positive logit divided by it, a negative one
    # multiplied (transformers' and vLLM's repetition_penalty; before the temperature, in greedy decoding too).
    repetition_penalty: float = 1.0
    # In [-2, 2]; 0 = off. Subtracted from the logit of each token the output holds (vLLM's presence_penalty).
    presence_penalty: float = 0.0
    # In [-2, 2]; 0 = off. Times how often the output holds a token, subtracted from its logit (vLLM's).
    frequency_penalty: float = 0.0
    # Seed for every random draw (target and proposer); None = a fresh random seed per call.
    seed: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "sampling.")
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        check_penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        self.top_k = top_k_off_as_zero(self.top_k)
        check_seed(self.seed)


@dataclass
class GenerationConfig:
    # Stop after this many new tokens.
    max_new_tokens: int = 128
    # Stop when the generated text contains any of these; the text is cut before it (one string: one stop string).
    stop: list[str] = field(default_factory=list, metadata={"one_or_many": True})
    # Also stop at these token ids: the last of token_ids, its text left out (vLLM's stop_token_ids; one id: one id).
    stop_token_ids: list[int] = field(default_factory=list, metadata={"one_or_many": True})
    # Do not stop at the model's EOS tokens: go on to max_new_tokens (vLLM's ignore_eos; stop_token_ids and stop
    # strings still stop). For benchmarks of a fixed length; the text after an EOS is the model's, unended.
    ignore_eos: bool = False
    # Return each new token's log-probability under the target (raw logits): `logprobs` in the result and --json.
    logprobs: bool = False
    # Also return, for each new token, this many of the target's most likely tokens there with their
    # log-probabilities (OpenAI's top_logprobs, vLLM's logprobs=N): `top_logprobs` in the result and --json. > 0
    # turns logprobs on too; 0 = none.
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        check_field_types(self, "generation.")
        if self.max_new_tokens < 1:
            raise ConfigError(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop = stop_strings(self.stop, key="generation.stop")
        self.stop_token_ids = stop_token_ids(self.stop_token_ids, key="generation.stop_token_ids")
        if self.top_logprobs < 0:
            raise ConfigError(f"generation.top_logprobs must be >= 0, got {self.top_logprobs}")


def stop_strings(stop: str | list[str] | None, key: str = "stop") -> list[str]:
    """Stop strings as a list (one string is one stop string, not its characters); each must be non-empty text.
    The error names `key`: the config key, or the Python API's `stop` argument."""
    if stop is not None and not isinstance(stop, str | list | tuple | ListConfig):
        raise ConfigError(f"{key} must be a string or a list of strings, got {stop!r}")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ConfigError(f"{key} must hold non-empty strings, got {s!r}")
    return stop


def stop_token_ids(ids: int | list[int] | None, key: str = "stop_token_ids") -> list[int]:
    """Stop token ids as a list (one id is a list of one); each must be an integer >= 0 (the decoder checks them
    against its target's vocabulary). The error names `key`."""
    if ids is None:
        return []
    listed = [ids] if is_integer(ids) else list(ids) if isinstance(ids, list | tuple | ListConfig) else None
    if listed is None:
        raise ConfigError(f"{key} must be a token id or a list of token ids, got {ids!r}")
    for i in listed:
        if not is_integer(i) or i < 0:
            raise ConfigError(f"{key} must hold token ids (integers >= 0), got {i!r}")
    return [int(i) for i in listed]


def greedy_note(unused: list[str]) -> str | None:
    """What to say of sampling settings that greedy decoding ignores (`unused`, as the user typed them), or None
    for none: generate and bench both say it rather than ignore them, as transformers warns."""
    if not unused:
        return None
    verb = "has" if len(unused) == 1 else "have"
    listed = " and ".join([", ".join(unused[:-1]), unused[-1]] if len(unused) > 2 else unused)
    return f"{listed} {verb} no effect at temperature 0 (greedy decoding)"


@dataclass
class SpecframeConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    proposer_name: str = "none"  # `proposer.name` in YAML and overrides
    proposer: Any = None  # an instance of the chosen proposer's config_class
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


def find_config(path: str | Path) -> Path:
    p = Path(user_path(str(path)))
    if p.is_file():
        return p
    if p.is_dir():
        raise ConfigError(f"config file '{path}' is a folder, not a YAML file")
    # A bare name (`eagle`, `eagle.yaml`), or `configs/<name>` as the repository lays them out (DESIGN's example,
    # from any folder); not another folder's: `typo/eagle.yaml` is not `eagle.yaml`.
    if str(path) == p.name or Path(str(path)).parts == ("configs", p.name):
        for name in (p.name, p.name + ".yaml"):
            packaged = resources.files("specframe.configs") / name
            if packaged.is_file():
                return Path(str(packaged))
    raise ConfigError(f"config file '{path}' does not exist (packaged configs: {', '.join(packaged_configs())})")


def packaged_configs() -> list[str]:
    folder = resources.files("specframe.configs")
    return sorted(f.name for f in folder.iterdir() if f.name.endswith(".yaml")) if folder.is_dir() else []


@functools.cache
def text_keeping_loader() -> type:
    """OmegaConf's YAML loader, except that a scalar YAML would read as a boolean or a number stays the text as
    typed unless it is that value's own spelling (`true`, `False`, `5`, `0.7`, `.inf`; YAML 1.2's booleans, not
    YAML 1.1's `yes`, `no`, `on`, `off`): `No`, `on`, `TRUE`, `1.10`, `0x10`, `01` and `1e3` stay text. A typed field
    converts the text (OmegaConf does): a bool field `yes`, `off`; a float field `1e3`, `1.10`; an int field
    decimal text (`1_000`, `+5`, `010`: 10, not YAML 1.1's octal 8), refusing `0x10` or `1:00`. A text field (a stop
    string, a model path) gets exactly what was typed, never `False`, `1.1`, `16` or `1000.0`. A field typed `Any`
    (e.g. in a plugin's config) gets the text too: type a plugin's fields."""
    try:  # (OmegaConf's own loader: its float rule, no timestamps, duplicate keys and alias bombs refused)
        from omegaconf._yaml import get_yaml_loader
    except ImportError:  # (OmegaConf 2.3)
        from omegaconf._utils import get_yaml_loader

    class TextKeepingLoader(get_yaml_loader()):
        pass

    for kind in ("bool", "int", "float"):
        tag = f"tag:yaml.org,2002:{kind}"
        construct = TextKeepingLoader.yaml_constructors[tag]

        def keep_text(loader: Any, node: yaml.ScalarNode, construct: Any = construct) -> Any:
            value = construct(loader, node)
            # (`true`, `True`, `false`, `False`: `TRUE` or `tRUE` stays text, as typed, in a text field; so does
            # `.inf`, which a float field reads as infinity in `structured`, to say it must be finite)
            own_spelling = str(value) == node.value or (isinstance(value, bool) and str(value).lower() == node.value)
            return value if own_spelling else node.value

        TextKeepingLoader.add_constructor(tag, keep_text)
    return TextKeepingLoader


def load_yaml(path: str | Path) -> DictConfig:
    """A YAML config file (or a packaged config by name) holding a mapping; errors name the file."""
    found = find_config(path)
    try:
        with found.open(encoding="utf-8") as f:
            parsed = yaml.load(f, Loader=text_keeping_loader())  # (text kept as typed: `text_keeping_loader`)
        if parsed is not None and not isinstance(parsed, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping, not {type(parsed).__name__} {parsed!r:.40}")
        raw = OmegaConf.create(parsed if parsed is not None else {})
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config: {brief(e, lines=1)}") from e
    except (yaml.YAMLError, UnicodeDecodeError) as e:  # (OmegaConf passes a file's YAML and encoding errors on)
        raise ConfigError(f"config file '{path}' is not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"config file '{path}' must hold a mapping")
    return raw


def split_override(item: str) -> tuple[str, str]:
    """A `KEY=VALUE` override's key and value text, split at the first `=` that is not escaped (`a\\=b=1` sets
    the key "a=b", as OmegaConf reads it)."""
    parts = re.split(r"(?<!\\)=", item, maxsplit=1)
    if len(parts) != 2:
        raise ConfigError(f"override {item!r} is not a 'KEY=VALUE' string (its only '=' is escaped)")
    return parts[0], parts[1]


def literal(value: Any) -> str:
    """`value` as a dotlist value that OmegaConf reads back as exactly it: a string YAML-quoted and with its
    interpolations escaped (a path may hold ' #', ': ' or '${'), a number as it prints."""
    if not isinstance(value, str):
        return str(value)
    return "'" + escape_interpolations(value).replace("'", "''") + "'"


def flag_overrides(flags: dict[str, tuple[str, Any]], overrides: list[str]) -> list[str]:
    """The dotlist overrides that command-line flags make, {config key: (flag as typed, value or None when not
    given)}, after checking them against the KEY=VALUE `overrides`: a flag and an override that set one key
    to different values are refused (which one the user meant is not known)."""
    given = {key: (flag, value) for key, (flag, value) in flags.items() if value is not None}
    for item in overrides:
        key, value = (part.strip() for part in split_override(item))
        parsed = _parsed(value)
        for flag_key, (flag_name, flag_value) in given.items():
            flag = f"{flag_name} {flag_value}"
            if flag_key == key:
                if not _same_value(parsed, flag_value):
                    raise BadInputError(f"{flag} and the override {item} set {key} differently: give one of them")
            elif flag_key.startswith(key + "."):  # the override sets a whole section the flag sets a key of
                if not isinstance(parsed, dict):
                    raise BadInputError(
                        f"the override {item} sets {key} to something that is not a mapping of its keys, and "
                        f"{flag} sets {flag_key} in it: give {key}'s keys one at a time ({flag_key}=...)"
                    )
                inner = flag_key[len(key) + 1 :]
                if inner in parsed and not _same_value(parsed[inner], flag_value):
                    raise BadInputError(f"{flag} and the override {item} set {flag_key} differently: give one of them")
    return [f"{key}={literal(value)}" for key, (_, value) in given.items()]


_UNPARSED = object()


def _parsed(text: str) -> Any:
    """An override's value `text` as the config reads it (YAML, text kept as typed: `text_keeping_loader`);
    `_UNPARSED` when it is not YAML."""
    try:
        return yaml.load(text, Loader=text_keeping_loader())
    except yaml.YAMLError:
        return _UNPARSED


def _yaml_anchor(text: str) -> str | None:
    """The name of the first YAML anchor (`&name`) in an override's value `text`, None when it has none (or is
    not YAML: that error is said where it is parsed)."""
    try:
        return next(
            (e.anchor for e in yaml.parse(text) if getattr(e, "anchor", None) and not isinstance(e, yaml.AliasEvent)),
            None,
        )
    except yaml.YAMLError:
        return None


def _same_value(parsed: Any, value: Any) -> bool:
    """Whether an override's parsed value gives the flag's `value` in its field (a text field takes a number's
    spelling, a number field converts text: `target.model=12`, `sampling.temperature=1e-1`)."""
    if type(parsed) is bool or parsed is None:
        return False
    if isinstance(value, str):
        return parsed == value or (isinstance(parsed, int | float) and str(parsed) == value)
    if isinstance(parsed, str):
        try:
            return float(parsed) == value
        except ValueError:
            return False
    return parsed == value


def with_overrides(raw: DictConfig, overrides: list[str]) -> DictConfig:
    """`raw` with KEY=VALUE overrides merged in, one at a time, so that an error names the override."""
    if not isinstance(overrides, list | tuple):
        raise ConfigError(
            f"overrides must be a list of 'KEY=VALUE' strings, got a {type(overrides).__name__} "
            "(e.g. overrides=['sampling.temperature=0.7'])"
        )
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {item!r} is not a 'KEY=VALUE' string")
        key, text = split_override(item)
        if text.lstrip().startswith("#"):  # (YAML reads it as a comment: nothing, not the text)
            raise ConfigError(f"override '{item}': the value is a YAML comment; quote text that starts with '#'")
        if text.startswith("- "):  # (a YAML block list's item: `stop=- a` was ['a'] without a word)
            raise ConfigError(f"override '{item}': '- ' starts a YAML list item; give a list as [a,b], quote text")
        if anchor := _yaml_anchor(text):  # (`stop=[&a]` was [None]: YAML reads `&a` as a label for what follows)
            raise ConfigError(
                f"override '{item}': '&{anchor}' is a YAML anchor, a label that YAML drops, not text; "
                f"quote text that starts with '&' (\"&{anchor}\", the whole override in single quotes on a shell)"
            )
        try:
            # (as OmegaConf.from_dotlist, but the value's text kept as typed where YAML would change it)
            override = OmegaConf.create()
            value = yaml.load(text, Loader=text_keeping_loader())
            if re.search(r"\s#", text) and "#" not in repr(value):  # (`stop=a #b` was 'a': the rest a comment)
                raise ConfigError(f"override '{item}': ' #' starts a YAML comment, dropping the rest; quote the text")
            OmegaConf.update(override, key, value)
            raw = OmegaConf.merge(raw, override)
        except TypeError as e:  # OmegaConf's "Cannot merge incompatible container types": a list over a mapping
            raise ConfigError(f"override '{item}': {container_clash(raw, override, key)}") from e
        except OmegaConfBaseException as e:  # (e.g. `stop=[?]`: YAML reads a mapping with no key)
            raise ConfigError(
                f"override '{item}': {brief(e, lines=1)} (the value is read as YAML: quote text that YAML reads as "
                "something else, e.g. KEY='[\"?\"]')"
            ) from e
        except yaml.YAMLError as e:  # (a value is parsed as YAML)
            hint = "; quote text that holds ':' or '#', e.g. KEY='\"a: b\"'" if any(c in text for c in ":#") else ""
            why = " ".join(str(e).split())
            raise ConfigError(f"override '{item}': the value is not valid YAML ({why}){hint}") from e
    return raw


def container_clash(raw: DictConfig, override: DictConfig, key: str) -> str:
    """Which key of `raw` is a mapping (or list) that the `override` of `key` gives as a list (or mapping)."""
    path: list[str] = []
    for part in key.split("."):
        path.append(part)
        where = ".".join(path)
        before, after = OmegaConf.select(raw, where), OmegaConf.select(override, where)
        if isinstance(before, DictConfig) and not isinstance(after, DictConfig):
            return f"{where} is a mapping; set its keys one by one ({where}.KEY=VALUE)"
        if isinstance(before, ListConfig) and not isinstance(after, ListConfig):
            return f"{where} is a list; set it whole ({where}=[a,b])"
    return f"{key} cannot take this value here"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> SpecframeConfig:
    """Merge defaults, an optional YAML file and `KEY=VALUE` overrides into a validated SpecframeConfig."""
    if path is not None and not isinstance(path, str | os.PathLike):
        raise ConfigError(
            f"load_config takes a YAML file's path (or None) and a list of 'KEY=VALUE' overrides, got a "
            f"{type(path).__name__} for the path (e.g. load_config(None, ['proposer.name=eagle']))"
        )
    from_file = load_yaml(path) if path else OmegaConf.create({})
    raw = with_overrides(from_file, overrides or [])
    try:
        return build_config(from_file, raw, overrides or [])
    except OmegaConfBaseException as e:  # a whole section that cannot be resolved, e.g. `sampling: ${oops}`
        key = getattr(e, "full_key", None) or next((k for k in raw if not resolves(raw, k)), None)
        raise ConfigError(f"{f'{key}: ' if key else 'bad config: '}{brief(e, lines=1)}") from e


def resolves(raw: DictConfig, key: Any) -> bool:
    """Whether `raw[key]`, interpolations included, can be resolved."""
    try:
        OmegaConf.to_container(OmegaConf.masked_copy(raw, [key]), resolve=True)
        return True
    except OmegaConfBaseException:
        return False


def build_config(from_file: DictConfig, raw: DictConfig, overrides: list[str]) -> SpecframeConfig:
    """`load_config`'s second half: the merged `raw` (a file's `from_file` plus `overrides`) validated."""
    from specframe.plugins import get_registry

    # Another proposer named over the one the file names (`--config eagle.yaml --proposer none`): the file's
    # proposer options belong to its own proposer, so only the overrides' apply to the one chosen. (A file whose
    # proposer section names none keeps its options for whichever proposer is named.)
    named, chosen = from_file.get("proposer"), raw.get("proposer")
    if isinstance(named, DictConfig) and "name" in named and isinstance(chosen, DictConfig):
        if named.name != chosen.get("name", "none"):
            raw = with_overrides(OmegaConf.merge(from_file, {"proposer": None}), overrides)
    unknown = [k for k in raw.keys() if k not in ("target", "proposer", "sampling", "generation")]
    if unknown:
        raise ConfigError(f"unknown config key '{unknown[0]}' (known: target, proposer, sampling, generation)")
    raw = with_defaults(raw)
    proposer_raw = raw.pop("proposer", None) or OmegaConf.create({})
    if not isinstance(proposer_raw, DictConfig):
        raise ConfigError("proposer must be a mapping with at least 'name'")
    name = proposer_raw.pop("name", "none")
    if not isinstance(name, str):
        raise ConfigError(f"proposer.name must be a string, got {name!r}")
    entry = get_registry().get(name)
    cfg = SpecframeConfig(proposer_name=name)
    cfg.target, cfg.sampling, cfg.generation = (
        structured(TargetConfig, raw.pop("target", None), "target"),
        structured(SamplingConfig, raw.pop("sampling", None), "sampling"),
        structured(GenerationConfig, raw.pop("generation", None), "generation"),
    )
    cfg.proposer = structured(entry.cls.config_class, proposer_raw, "proposer")
    return cfg


def with_defaults(raw: DictConfig) -> DictConfig:
    """`raw` with every schema default it does not give (the proposer's too, once it names one), interpolations
    resolved: they may cross sections (`proposer: {model: ${target.model}}`) and name defaults, so they are
    resolved on the whole config before each section is validated on its own. A key given in any form (`???`
    included) keeps it, and a section given as something other than a mapping is left for its own validation to
    name."""
    from specframe.plugins import get_registry

    schemas: dict[str, Any] = {"target": TargetConfig, "sampling": SamplingConfig, "generation": GenerationConfig}
    proposer = raw.get("proposer")
    if isinstance(proposer, DictConfig) and isinstance(proposer.get("name", "none"), str):
        schemas["proposer"] = get_registry().get(proposer.get("name", "none")).cls.config_class
    defaults = {}
    for key, schema in schemas.items():
        given = raw.get(key)
        if given is None or isinstance(given, DictConfig):
            keys = set(given.keys()) if given is not None else set()
            every = OmegaConf.to_container(OmegaConf.structured(schema))  # (`???` for a field with no default)
            defaults[key] = {k: v for k, v in every.items() if k not in keys}
    raw = OmegaConf.merge(OmegaConf.create(defaults), raw)
    # Resolved once, here: a value's escaped "${" (a path holding one) is text afterwards, so it is escaped again
    # (OmegaConf.resolve would leave it to be read as an interpolation by the section's own validation).
    return OmegaConf.create(_escaped(OmegaConf.to_container(raw, resolve=True)))


def escape_interpolations(text: str) -> str:
    """`text` with every "${" escaped, so that OmegaConf reads it as text, not an interpolation (backslashes before
    one doubled: each stays a backslash)."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return escape_interpolations(value)
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):  # (a tuple default as a list: the form every list field is read in)
        return [_escaped(v) for v in value]
    return value


def user_set(config: Any, key: str) -> bool:
    """Whether a proposer config's `key` holds something other than its class default and is not empty (the
    user set it: a plugin whose default names a model has not been given one)."""
    value = getattr(config, key, None)
    if not value:
        return False
    default = next((f.default for f in fields(config) if f.name == key), None) if is_dataclass(config) else None
    return value != default


def models_named(config: Any) -> list[str]:
    """The models a proposer config names that the user set (`user_set`), as `proposer.<key>=<value>`: its own
    `model`, and for a union-style config (`members` with one validated `member_configs` entry each) every
    member's `proposer.options.<member>.model`."""
    named = [f"proposer.model={config.model}"] if user_set(config, "model") else []
    members = getattr(config, "members", None) or []
    for name, member in zip(members, getattr(config, "member_configs", None) or [], strict=False):
        key = f"proposer.options.{name}.model={getattr(member, 'model', None)}"
        if user_set(member, "model") and key not in named:  # (a repeated member shares its options)
            named.append(key)
    return named


def recipe_for(proposer: str, options: DictConfig, schema: type | None = None) -> DictConfig:
    """Training options for `proposer`'s trainer, less their optional `proposer` key: a recipe that names another
    trainer (configs/train-*.yaml name theirs) is refused, so its keys are never read as another trainer's. (A
    trainer `schema` with a `proposer` field of its own keeps the key.)"""
    if schema is not None and is_dataclass(schema) and "proposer" in {f.name for f in fields(schema)}:
        return options
    meant_for = options.pop("proposer", None)
    if isinstance(meant_for, DictConfig):  # (e.g. configs/draft.yaml: `proposer: {name: ..., model: ...}`)
        raise ConfigError(
            "the training options hold a `proposer` mapping, as a `specframe generate` config does: give a "
            f"training recipe (e.g. train-{proposer}.yaml; every key: docs/training.md)"
        )
    if meant_for is not None and meant_for != proposer:
        raise ConfigError(
            f"the training options are for proposer '{meant_for}' (their `proposer` key), not '{proposer}': give "
            f"--proposer {meant_for}, or a recipe for {proposer}"
        )
    return options


def structured(schema: type, values: Any, prefix: str) -> Any:
    """Validate `values` against a dataclass schema; errors name the full key (`prefix.key`)."""
    try:
        base = OmegaConf.structured(schema)
        if values is not None:
            if not isinstance(values, DictConfig):
                raise ConfigError(f"{prefix} must be a mapping, got {values!r}")
            schema_fields = fields(schema) if is_dataclass(schema) else ()
            text_fields = {f.name for f in schema_fields if f.type in ("str", str)}
            flag_fields = {f.name for f in schema_fields if f.type in ("bool", bool, "bool | None")}
            float_fields = {f.name for f in schema_fields if f.type in ("float", float, "float | None")}
            one_or_many = {f.name for f in schema_fields if f.metadata.get("one_or_many")}  # text alone: a list of one
            text_lists = {f.name for f in schema_fields if str(f.type).removeprefix("typing.") in ("list[str]",)}
            list_fields = {
                f.name
                for f in schema_fields
                if str(f.type).removeprefix("typing.").startswith(("list[", "tuple[", "List[", "Tuple["))
            }
            lists_of_lists = {  # (e.g. Medusa's tree: a list of paths)
                f.name
                for f in schema_fields
                if str(f.type).removeprefix("typing.").startswith(("list[list[", "list[tuple[", "List[List["))
            }
            mapping_fields = {  # {name: an example key below it, from the field's metadata, or ""}
                f.name: f.metadata.get("example", "")
                for f in schema_fields
                if str(f.type).removeprefix("typing.").startswith(("dict[", "Dict["))
            }
            mappings_of_mappings = {
                f.name for f in schema_fields if str(f.type).removeprefix("typing.").startswith(("dict[str, dict[",))
            }
            for key in values:
                if OmegaConf.is_missing(values, key):  # `???` in YAML: the user must set it
                    raise ConfigError(f"{prefix}.{key}: missing mandatory value (set it with {prefix}.{key}=...)")
                if key in flag_fields and type(values[key]) in (int, float) and values[key] not in (0, 1):
                    raise ConfigError(f"{prefix}.{key} must be true or false, got {values[key]!r}")  # (not "true")
                given = values[key]
                if key in float_fields and isinstance(given, str) and given.lower().lstrip("+-") in (".inf", ".nan"):
                    values[key] = float(given.replace(".", "", 1))  # (YAML's spelling, kept as text by the loader)
                if key in text_fields and values[key] is None:  # `KEY=` (a shell's KEY="") is the empty string
                    values[key] = ""
                if key in one_or_many and isinstance(values[key], str | int | float):  # (`stop=5`: ["5"])
                    values[key] = [values[key]]
                if key in one_or_many and values[key] is None:  # (`stop=`: none, as `KEY=` is "" for text)
                    values[key] = []
                if key in list_fields and not isinstance(values[key], ListConfig | None):
                    given = values[key]
                    words = OmegaConf.to_container(given) if isinstance(given, DictConfig) else {}
                    typed = key in text_lists and len(words) == 1 and not str(next(iter(words))).isdigit()
                    if typed and list(words.values()) == [None]:  # (`stop=User:` is YAML's mapping {'User': None}:
                        meant = f"{next(iter(words))}:"  # the user meant the text; `stop.0=` is a dotlist's index)
                        raise ConfigError(
                            f"{prefix}.{key}: {meant} reads as a YAML mapping; quote text that ends in ':' or holds "
                            f"': ', e.g. '{prefix}.{key}=\"{meant}\"'"
                        )
                    if isinstance(given, DictConfig):  # (e.g. from `KEY.0=x`: a dotlist index makes a mapping)
                        text = ""
                        if typed:  # (`stop=User: hi`: perhaps meant as text; `stop.0=x`: not)
                            ((word, after),) = words.items()
                            text = f"; for the text '{word}: {after}', quote it: {prefix}.{key}='\"{word}: {after}\"'"
                        raise ConfigError(
                            f"{prefix}.{key} must be a list, got {words!r} "
                            f"(set a list field whole, e.g. {prefix}.{key}=[a,b]{text})"
                        )
                    example = "[[0],[1],[0,0]]" if key in lists_of_lists else f"[{given}]"
                    raise ConfigError(f"{prefix}.{key} must be a list, e.g. {prefix}.{key}={example}, got {given!r}")
                if key in lists_of_lists and isinstance(values[key], ListConfig):
                    for i, item in enumerate(values[key]):
                        if not isinstance(item, ListConfig):
                            raise ConfigError(
                                f"{prefix}.{key}[{i}] must be a list too ({prefix}.{key} is a list of lists, e.g. "
                                f"{prefix}.{key}=[[0],[1],[0,0]]), got {item!r}"
                            )
                if key in mapping_fields and not isinstance(values[key], DictConfig | None):
                    given = values[key]
                    given = OmegaConf.to_container(given) if isinstance(given, ListConfig) else given
                    example = f" (e.g. {prefix}.{key}.{mapping_fields[key]})" if mapping_fields[key] else ""
                    raise ConfigError(f"{prefix}.{key} must be a mapping{example}, got {given!r}")
                if key in mappings_of_mappings and isinstance(values[key], DictConfig):
                    for name in values[key]:  # (e.g. union's `options.ngram`: that member's options)
                        given = values[key][name]
                        if given is None:  # (`options.ngram=`: no options of its own)
                            values[key][name] = {}
                        elif not isinstance(given, DictConfig):
                            given = OmegaConf.to_container(given) if isinstance(given, ListConfig) else given
                            raise ConfigError(
                                f"{prefix}.{key}.{name} must be a mapping of {name}'s options, got {given!r} "
                                f"(e.g. {prefix}.{key}.{name}.OPTION=VALUE)"
                            )
            base = OmegaConf.merge(base, values)
        unset = [key for key in base if OmegaConf.is_missing(base, key)]  # (a schema field with no default)
        if unset:
            raise ConfigError(f"{prefix}.{unset[0]}: missing mandatory value (set it with {prefix}.{unset[0]}=...)")
        return OmegaConf.to_object(base)
    except ConfigError:  # raised by a schema's __post_init__, already naming its full key
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        where = key if key == prefix or key.startswith(prefix + ".") else f"{prefix}.{key}" if key else prefix
        hint = getattr(schema, "unknown_key_hint", None)  # (a schema's own word on a key it does not have)
        more = hint(str(e.key), prefix) if isinstance(e, ConfigKeyError) and hint and e.key is not None else ""
        raise ConfigError(f"{where}: {brief(e, lines=1)}{more}") from e
    except (TypeError, ValueError, AssertionError, LookupError) as e:  # a plugin's checks raising these, not
        # ConfigError (other exceptions are bugs, not bad input: they stay what they are)
        raise ConfigError(f"{prefix} ({schema.__name__}): {brief(e, lines=1, typed=True)}") from e


def to_yaml(cfg: SpecframeConfig) -> str:
    """Show a loaded config as YAML (with `proposer.name` folded back in)."""
    d = {
        "target": OmegaConf.to_container(OmegaConf.structured(cfg.target)),
        "proposer": {"name": cfg.proposer_name, **OmegaConf.to_container(OmegaConf.structured(cfg.proposer))},
        "sampling": OmegaConf.to_container(OmegaConf.structured(cfg.sampling)),
        "generation": OmegaConf.to_container(OmegaConf.structured(cfg.generation)),
    }
    return OmegaConf.to_yaml(d)
