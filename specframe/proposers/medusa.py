"""`medusa`: K heads on the target's last hidden state propose a token tree (Medusa-1, Cai et al. 2024).

Head k (1-based) reads the feature h_t that produced the root token (the target's hidden state after its final
norm, what its LM head reads) and predicts the token k positions after the root. Each head is a stack of
residual blocks `x + SiLU(W x + b)` (separate modules, never one module repeated) followed by the target's own
LM head, restricted to a reduced vocabulary `vocab_ids` (the most frequent tokens of the training data): the
LM head is shared, so a head stores only its residual blocks.

The tree is a list of *choices*, as in Medusa's `medusa_choices`: the path (r1, ..., rd) is the node at depth d
whose token is head d's rank-r_d candidate, under the node (r1, ..., r_{d-1}). Every node is a deterministic
draft (a top-k choice; q one-hot), verified by the core's exact tree acceptance, greedy or sampled. Medusa's
lossy "typical acceptance" is not offered.

Saved heads (a folder): `medusa_config.json` (format, sizes, the target's fingerprint, the tree chosen on
held-out training data, its path statistics and the training metrics; `"shape_choice": "measured"` has a CPU
use instead the tree of 1-3 nodes fastest on the machine, re-chosen every step by the acceptance so far,
specframe/step_costs.py), `medusa_vocab.json` (the reduced
vocabulary) and `model.safetensors` (float16 residual blocks only). Heads trained with Medusa-2 also name the
PEFT adapter they were trained with; load that adapter as `target.adapter` (see docs/medusa.md). Heads trained
with the Medusa repository load too (`load_repository_heads`): each head then has its own full-vocabulary
projection, and only their sizes can be checked against the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specframe.cpu_kernels import few_rows_linear, forget_outdated
from specframe.errors import ConfigError, ModelLoadError, check_field_types, is_count, user_path
from specframe.fingerprint import (
    artifact_kind,
    check_vocab_ids,
    fingerprint_mismatch,
    not_an_artifact,
    read_artifact,
    target_fingerprint,
    write_artifact,
)
from specframe.models import check_proposer_dtype, proposer_dtype
from specframe.proposer import (
    MAX_TREE_NODES,
    Acceptance,
    DecodeState,
    Proposal,
    Proposer,
    TargetInfo,
    check_confidence_threshold,
    resolve_confidence_threshold,
    rng_untouched,
    saved_shape_applies,
    seeded,
)
from specframe.step_costs import (
    OnlineShapeChoice,
    ShapeCandidate,
    StepCosts,
    check_shape_choice,
    choose_measured,
    measure_step_costs,
    relative_cost,
)
from specframe.training.medusa import MedusaTrainConfig

FORMAT = "specframe-medusa-heads"
# Used when neither the config nor the heads' folder gives a tree: 25 nodes up to 5 deep (24 with 4 heads,
# which drop the 5-deep node).
DEFAULT_TREE: list[tuple[int, ...]] = (
    [(i,) for i in range(5)]
    + [(0, i) for i in range(4)]
    + [(1, i) for i in range(3)]
    + [(2, i) for i in range(2)]
    + [(0, 0, i) for i in range(3)]
    + [(0, 1, i) for i in range(2)]
    + [(1, 0, 0)]
    + [(0, 0, 0, i) for i in range(2)]
    + [(0, 0, 1, 0), (0, 1, 0, 0)]
    + [(0, 0, 0, 0, 0)]
)
# Nodes of the tree built from the heads' path statistics on a device other than the one their saved tree was
# chosen on (`shape_tuned_on`): on a GPU, verifying ~64 tokens costs what 1 does (Medusa's own trees have 63).
ACCELERATOR_TREE_NODES = 64


@dataclass
class MedusaConfig:
    # Folder of trained heads (see `specframe train --proposer medusa`); None = the heads shipped for the target.
    model: str | None = None
    # The tree as Medusa-style choices, e.g. [[0], [1], [0, 0]]; None = the tree saved with the heads (on a CPU,
    # heads saved with `"shape_choice": "measured"`: the 1-3 node tree timed fastest at load, step_costs.py).
    tree: list[list[int]] | None = None
    # Rebuild the tree with this many nodes from the path statistics saved with the heads; None = as saved. A tree
    # (this, `tree` or the saved one) has at most MAX_TREE_NODES (1024) nodes.
    tree_nodes: int | None = None
    # Drop tree nodes whose path probability (the product of each head's probability for the node's token along
    # the path) is below this: the tree shrinks, to its first node (always kept; head 1's best token unless
    # the tree lacks [0]), where the heads are unsure. 0 = off. None: the value saved with the heads, else 0.
    # Exactness does not depend on it.
    confidence_threshold: float | None = None
    # With a tree measured at load (above): re-choose it every step, among those trees and no draft at all, by how
    # often this generation's drafts were accepted so far (step_costs.OnlineShapeChoice); false: the tree chosen
    # at load throughout. Exactness does not depend on it.
    adapt_shape: bool = True
    # Heads' dtype: auto (the target's, but bfloat16 for a float32 target on a CPU with native bf16 matmuls
    # that does not run specframe's CPU kernels; see specframe.models.proposer_dtype), float32, bfloat16 or
    # float16.
    dtype: str = "auto"

    def __post_init__(self) -> None:
        check_field_types(self, "proposer.")
        if self.tree is not None:
            check_tree(self.tree, num_heads=None)
        if self.tree_nodes is not None and not 1 <= self.tree_nodes <= MAX_TREE_NODES:  # (an integer: checked above)
            raise ConfigError(f"proposer.tree_nodes must be in [1, {MAX_TREE_NODES}], got {self.tree_nodes!r}")
        if self.tree is not None and self.tree_nodes is not None:
            raise ConfigError("proposer.tree and proposer.tree_nodes are exclusive: give one")
        check_confidence_threshold(self.confidence_threshold)
        check_proposer_dtype(self.dtype)


def check_tree(tree: list, num_heads: int | None) -> list[tuple[int, ...]]:
    """Validate Medusa-style choices; return them as tuples sorted by depth, then ranks (parents first)."""
    paths = []
    for c in tree:
        if not isinstance(c, list | tuple) or not c or not all(is_count(r, 0) for r in c):
            raise ConfigError(f"proposer.tree: each choice must be a non-empty list of ranks >= 0, got {c!r}")
        paths.append(tuple(c))
    if not paths:
        raise ConfigError("proposer.tree is empty")
    if len(paths) > MAX_TREE_NODES:  # (each one verified every step)
        raise ConfigError(f"proposer.tree has {len(paths)} choices, more than the {MAX_TREE_NODES} a tree may have")
    if len(set(paths)) != len(paths):
        raise ConfigError("proposer.tree has a repeated choice")
    present = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in present:
            raise ConfigError(f"proposer.tree: choice {list(p)} has no parent {list(p[:-1])} in the tree")
        if num_heads is not None and len(p) > num_heads:
            raise ConfigError(f"proposer.tree: choice {list(p)} is deeper than the {num_heads} heads")
    return sorted(paths, key=lambda p: (len(p), p))


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero, so an untrained head is the target's own next-token head."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of `layers` residual blocks each; logits through the shared LM-head rows `lm_rows` ([Vr, H]), or,
    for heads with a `projection` (those of the Medusa repository, set by `load_repository_heads`), each head's own
    projection onto the target's full vocabulary: [K, V, H], no bias."""

    def __init__(self, hidden: int, num_heads: int, layers: int) -> None:
        super().__init__()
        # Built one by one: `[ResBlock(h)] * n` would repeat one module (shared weights), Medusa's own bug.
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(layers))) for _ in range(num_heads))
        self.register_parameter("projection", None)  # (none: the target's LM-head rows serve)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [K, ..., H]: each head's transformed feature."""
        return torch.stack([head(h) for head in self.heads])

    def logits(self, h: torch.Tensor, lm_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] -> [K, ..., Vr] logits over the reduced vocabulary (with `projection`: [K, ..., V] over the full
        one, and `lm_rows` is not used)."""
        feats = self.features(h)
        if self.projection is None:
            return feats @ lm_rows.T
        return own_logits(feats, self.projection)


def own_logits(feats: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """[k, ..., H] features of heads 1..k through their own projections (the first k of `projection`, [K, V, H]):
    [k, ..., V]."""
    k = feats.shape[0]
    flat = feats.reshape(k, -1, feats.shape[-1])  # [k, n, H]
    return torch.bmm(flat, projection[:k].transpose(1, 2)).reshape(*feats.shape[:-1], projection.shape[1])


def save_heads(
    heads: MedusaHeads, vocab_ids: torch.Tensor, target: torch.nn.Module, out: str | Path, tree, extra: dict
) -> None:
    """Save `heads` for `target` (fingerprinted as it will be verified with: with its adapter, in stage 2), with
    `tree` (a list of choices; None: none saved, the default tree applies)."""
    meta = {
        "format": FORMAT,
        "version": 1,
        "hidden_size": heads.heads[0][0].linear.in_features,
        "num_heads": heads.num_heads,
        "layers": len(heads.heads[0]),
        "target_vocab_size": target.get_output_embeddings().weight.shape[0],
        "target": target_fingerprint(target),
        "tree": None if tree is None else [list(p) for p in tree],  # (None: the default tree applies)
        **extra,
    }
    write_artifact(Path(out), "medusa", heads.state_dict(), vocab_ids, meta, indent=1)


def load_heads(path: str | Path, target: torch.nn.Module) -> tuple[MedusaHeads, torch.Tensor, dict]:
    """(heads, vocab_ids, metadata) from a saved folder; refuses heads trained for another target. A folder of heads
    from the Medusa repository (config.json with `medusa_num_heads`) is read by `load_repository_heads`."""
    path = Path(user_path(str(path)))
    cfg_file = path / "medusa_config.json"
    if not cfg_file.is_file():
        if (path / "config.json").is_file() and artifact_kind(path) is None:
            return load_repository_heads(path, target)
        raise ModelLoadError(
            f"medusa heads '{path}' {not_an_artifact(path, 'medusa')} (train heads with specframe train --proposer "
            "medusa, or give a folder of heads from the Medusa repository: config.json and "
            f"{REPOSITORY_FILE})"
        )
    meta, listed, state = read_artifact(path, "medusa", f"medusa heads '{path}'")
    vocab = target.get_output_embeddings().weight.shape[0]
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"medusa heads '{path}': format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("version") != 1:
        raise ModelLoadError(f"medusa heads '{path}': {FORMAT} version {meta.get('version')!r}; this specframe reads 1")
    hidden = target.config.hidden_size
    sizes = ("hidden_size", "target_vocab_size", "num_heads", "layers")
    for key in sizes:
        if key not in meta:
            raise ModelLoadError(f"medusa heads '{path}' are incomplete or corrupt: medusa_config.json lacks {key!r}")
        if not is_count(meta[key]):
            raise ModelLoadError(
                f"medusa heads '{path}' are corrupt: medusa_config.json's {key} must be an integer >= 1, "
                f"got {meta[key]!r}"
            )
    trained_hidden, trained_vocab, num_heads, layers = (meta[k] for k in sizes)
    if num_heads * layers * 2 != len(state):  # (a weight and a bias per residual block; checked before building)
        raise ModelLoadError(
            f"medusa heads '{path}': model.safetensors holds {len(state)} tensors; medusa_config.json's "
            f"{num_heads} heads of {layers} layer(s) need {num_heads * layers * 2}"
        )
    if trained_hidden != hidden or trained_vocab != vocab:
        raise ModelLoadError(
            f"medusa heads '{path}' were trained for a target with hidden size {trained_hidden} and "
            f"{trained_vocab} logits; this target has {hidden} and {vocab}"
        )
    why = fingerprint_mismatch(meta.get("target"), target)
    if why is not None:
        adapter = meta.get("adapter")
        if adapter and (Path(path) / "adapter" / "adapter_config.json").is_file():  # (a copied run folder: its own)
            adapter = str(Path(path) / "adapter")
        hint = f" (they were trained with the Medusa-2 adapter '{adapter}': target.adapter=...)" if adapter else ""
        raise ModelLoadError(f"medusa heads '{path}' were made for another target: {why}{hint}")
    vocab_ids = check_vocab_ids(listed, vocab, f"medusa heads '{path}'", "medusa_vocab.json")
    try:
        with rng_untouched():  # (random weights, replaced at once)
            heads = MedusaHeads(hidden, num_heads, layers)
        heads.load_state_dict({k: v.float() for k, v in state.items()})
    except (RuntimeError, TypeError, ValueError) as e:
        raise ModelLoadError(f"medusa heads '{path}': weights do not match medusa_config.json: {e}") from e
    return heads, vocab_ids, meta


# Heads trained with the Medusa repository (github.com/FasterDecoding/Medusa): a folder with config.json
# (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`) and the heads' weights, head k's residual
# block j as `{k}.{j}.linear.weight` / `.bias` and its own full-vocabulary projection as `{k}.{L}.weight` (L the
# number of blocks). Medusa-2 "full model" folders hold the same tensors under `medusa_head.` in the model's own
# safetensors, beside the fine-tuned model's weights (which load as target.model, not from here).
REPOSITORY_FILE = "medusa_lm_head.safetensors"
FULL_MODEL_PREFIX = "medusa_head."
REPOSITORY_FORMAT = "medusa-repository"
_PICKLES = ("medusa_lm_head.pt", "medusa_lm_head.pth", "medusa_lm_head.bin", "pytorch_model.bin")


def _conversion(pickle: str) -> str:
    """A command that writes medusa_lm_head.safetensors from the pickle `pickle` (its heads' tensors only)."""
    prefix = FULL_MODEL_PREFIX if pickle == "pytorch_model.bin" else ""
    return (
        'python -c "import torch; from safetensors.torch import save_file; '
        f"sd = torch.load('{pickle}', map_location='cpu', weights_only=True); "
        f"save_file({{k[{len(prefix)}:]: v.contiguous().clone() for k, v in sd.items() if k.startswith('{prefix}')}}, "
        "'medusa_lm_head.safetensors')\""
    )


def repository_tensors(path: Path, what: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file, its head tensors with any `medusa_head.` prefix removed) of a Medusa-repository folder:
    medusa_lm_head.safetensors, else the `medusa_head.*` tensors of a Medusa-2 model's own safetensors (one file or
    shards listed by model.safetensors.index.json; only those tensors are read). Pickles are refused."""
    from safetensors import SafetensorError, safe_open

    if (path / REPOSITORY_FILE).is_file():
        files, prefix = [path / REPOSITORY_FILE], ""
    elif (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        prefix = FULL_MODEL_PREFIX
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted({f for k, f in weight_map.items() if k.startswith(prefix)})
            except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
                raise ModelLoadError(f"{what}: model.safetensors.index.json is unreadable: {type(e).__name__}") from e
            outside = next((n for n in names if not isinstance(n, str) or Path(n).name != n), None)
            if outside is not None:  # (a shard is a file of this folder, as transformers reads the index)
                raise ModelLoadError(
                    f"{what}: model.safetensors.index.json names {outside!r}, not a file of the folder"
                )
            files = [path / n for n in names]
        else:
            files = [path / "model.safetensors"]
    else:
        pickle = next((path / n for n in _PICKLES if (path / n).is_file()), None)
        if pickle is not None:
            raise ModelLoadError(
                f"{what}: {pickle.name} is a pickle, and specframe loads weights only from safetensors or GGUF "
                "(unpickling can run arbitrary code). Convert it yourself, where you trust the file, to "
                f'{REPOSITORY_FILE} in the same folder (docs/medusa.md, "Heads from the Medusa repository"): '
                + _conversion(pickle.name)
            )
        raise ModelLoadError(
            f"{what}: config.json names Medusa heads, but the folder holds no {REPOSITORY_FILE} (nor a Medusa-2 "
            "model.safetensors with medusa_head.* tensors)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    if key.startswith(prefix):
                        tensors[key.removeprefix(prefix)] = f.get_tensor(key)
        except (OSError, SafetensorError, ValueError) as e:
            raise ModelLoadError(f"{what}: {file.name} is incomplete or corrupt: {type(e).__name__}: {e}") from e
    if not tensors:
        raise ModelLoadError(
            f"{what}: {files[0].name if files else 'model.safetensors.index.json'} holds no Medusa heads "
            f"({prefix}* tensors): a Medusa-2 model folder whose heads were saved elsewhere? Give that folder"
        )
    return (files[0] if len(files) == 1 else path / "model.safetensors.index.json"), tensors


def load_repository_heads(path: str | Path, target: torch.nn.Module) -> tuple[MedusaHeads, torch.Tensor, dict]:
    """(heads, vocab_ids, metadata) from a folder of heads trained with the Medusa repository, each head with its
    own projection onto the target's full vocabulary (`MedusaHeads.projection`). Nothing records which target
    they were trained for: the hidden size and vocabulary size must be the target's, and a file whose tensors
    do not make config.json's heads is refused, as are weights that are not finite and pickled weights."""
    path = Path(user_path(str(path)))
    what = f"medusa heads '{path}'"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{what}: config.json is unreadable: {type(e).__name__}: {e}") from e
    if not isinstance(config, dict) or "medusa_num_heads" not in config:
        raise ModelLoadError(
            f"{what} holds neither medusa_config.json (heads trained by specframe) nor a config.json with "
            "medusa_num_heads (heads from the Medusa repository); train heads with specframe train --proposer medusa"
        )
    for key, least in (("medusa_num_heads", 1), ("medusa_num_layers", 0)):
        if not is_count(config.get(key), least):
            raise ModelLoadError(
                f"{what}: config.json's {key} must be an integer >= {least}, got {config.get(key, 'nothing')!r}"
            )
    num_heads, layers = config["medusa_num_heads"], config["medusa_num_layers"]
    file, state = repository_tensors(path, what)
    where = f"{what}: {file.name}"
    heads_in_file = sorted({int(k.split(".")[0]) for k in state if k.split(".")[0].isdigit()})
    if len(heads_in_file) != num_heads or (heads_in_file and heads_in_file[-1] != num_heads - 1):
        raise ModelLoadError(
            f"{where} holds {len(heads_in_file)} heads ({', '.join(map(str, heads_in_file)) or 'none'}); "
            f"config.json's medusa_num_heads says {num_heads} (make them agree: set medusa_num_heads to the "
            "file's count)"
        )
    proj = state.get(f"0.{layers}.weight")
    if proj is None or proj.dim() != 2:
        raise ModelLoadError(
            f"{where} lacks '0.{layers}.weight', head 0's projection after config.json's {layers} block(s) "
            "(medusa_num_layers), or it is not a matrix"
        )
    vocab, hidden = proj.shape
    expected = {}
    for k in range(num_heads):
        for j in range(layers):
            expected[f"{k}.{j}.linear.weight"] = (hidden, hidden)
            expected[f"{k}.{j}.linear.bias"] = (hidden,)
        expected[f"{k}.{layers}.weight"] = (vocab, hidden)
    missing = next((k for k in expected if k not in state), None)
    if missing is not None:
        raise ModelLoadError(
            f"{where} lacks {missing!r} (config.json: {num_heads} heads of {layers} block(s) and a projection)"
        )
    extra = next((k for k in state if k not in expected), None)
    if extra is not None:
        raise ModelLoadError(
            f"{where} holds {extra!r}, which config.json's {num_heads} heads of {layers} block(s) do not have "
            "(medusa_num_layers wrong?)"
        )
    wrong = next((k for k, shape in expected.items() if tuple(state[k].shape) != shape), None)
    if wrong is not None:
        raise ModelLoadError(
            f"{where}: {wrong!r} has shape {list(state[wrong].shape)}, expected {list(expected[wrong])} (hidden size "
            f"{hidden} and {vocab} logits, from '0.{layers}.weight')"
        )
    target_hidden = target.config.hidden_size
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if (hidden, vocab) != (target_hidden, target_vocab):
        differ = [
            f"{name} {mine} there, {theirs} here"
            for name, mine, theirs in (("hidden size", hidden, target_hidden), ("logits", vocab, target_vocab))
            if mine != theirs
        ]
        raise ModelLoadError(
            f"{where} holds heads for a target with hidden size {hidden} and {vocab} logits; this target has "
            f"{target_hidden} and {target_vocab} ({'; '.join(differ)}). They were trained for "
            f"{config.get('base_model_name_or_path', 'a model config.json does not name')!r}"
        )
    checked = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    broken = next((k for k in expected if state[k].dtype in checked and not torch.isfinite(state[k]).all()), None)
    if broken is not None:
        raise ModelLoadError(f"{where} holds values that are not finite (in {broken!r})")
    if not all(state[k].is_floating_point() for k in expected):
        raise ModelLoadError(f"{where}: the heads' weights must be floating point")
    with rng_untouched():  # (random weights, replaced at once)
        heads = MedusaHeads(hidden, num_heads, layers)
    heads.load_state_dict(
        {f"heads.{k}.{j}.linear.{p}": state[f"{k}.{j}.linear.{p}"].float() for k in range(num_heads)
         for j in range(layers) for p in ("weight", "bias")}
    )  # fmt: skip
    heads.projection = nn.Parameter(torch.stack([state.pop(f"{k}.{layers}.weight") for k in range(num_heads)]).float())
    meta = {
        "format": REPOSITORY_FORMAT,
        "num_heads": num_heads,
        "layers": layers,
        "file": str(file),
        "base_model_name_or_path": config.get("base_model_name_or_path"),
    }
    return heads, torch.arange(vocab), meta


def saved_tree(meta: dict, path: str | Path, num_heads: int) -> list[tuple[int, ...]] | None:
    """The tree saved in medusa_config.json (None when there is none), checked like proposer.tree."""
    tree = meta.get("tree")
    if tree is None:
        return None
    try:
        if not isinstance(tree, list):
            raise ConfigError(f"must be a list of choices, got {tree!r}")
        return check_tree(tree, num_heads)
    except ConfigError as e:
        why = str(e).removeprefix("proposer.tree").removeprefix(":").strip()
        raise ModelLoadError(f"medusa heads '{path}' are corrupt: medusa_config.json's tree: {why}") from e


def saved_path_counts(meta: dict, path: str | Path, num_heads: int) -> dict:
    """The held-out path statistics saved in medusa_config.json: {"positions": n, "counts": {"0,1": n, ...}}."""
    stats = meta.get("path_counts")
    counts = stats.get("counts") if isinstance(stats, dict) else None
    good = (
        isinstance(counts, dict)
        and is_count(stats.get("positions"), 0)
        and all(isinstance(k, str) and all(r.isdigit() for r in k.split(",")) for k in counts)
        and all(len(k.split(",")) <= num_heads for k in counts)
        and all(is_count(v, 0) for v in counts.values())
    )
    if not good:
        raise ModelLoadError(
            f"medusa heads '{path}' are corrupt: medusa_config.json's path_counts must be "
            '{"positions": n, "counts": {"0,1": n, ...}} with counts >= 0, paths no deeper than the heads'
        )
    return stats


def tree_candidates(path_counts: dict, costs: StepCosts) -> list[ShapeCandidate]:
    """The trees a CPU chooses from (`MedusaProposer.use_fastest_tree`): the best of each size from 1 to
    MAX_VERIFY_TOKENS - 1 nodes by held-out path counts (`shape`: the tree, a tuple of paths), each with its
    expected accepted length, a head's product per level (`drafter_forwards`) and, for
    step_costs.OnlineShapeChoice, each depth's held-out chance of acceptance (the paths at one depth are
    distinct candidates of the same head: at most one of them matches)."""
    from specframe.training.medusa import best_tree, expected_accepted_length, key

    positions = max(1, path_counts["positions"])
    candidates = []
    for nodes in range(1, len(costs.relative)):
        tree = best_tree(path_counts, nodes)
        reach = tuple(
            sum(path_counts["counts"].get(key(p), 0) for p in tree if len(p) == depth) / positions
            for depth in range(1, len(tree[-1]) + 1)
        )
        accepted = expected_accepted_length(path_counts, tree)
        candidates.append(ShapeCandidate(tuple(tree), accepted, len(tree) + 1, len(reach), reach))
    return candidates


@dataclass(frozen=True)
class TreeLayout:
    """A tree as `propose` reads it: its paths sorted by depth, each node's parent index, head and rank."""

    tree: list[tuple[int, ...]]  # the paths, sorted by depth then ranks (check_tree)
    parents: torch.Tensor  # each node's parent index (-1: the root)
    node_head: torch.Tensor  # each node's head (depth - 1)
    node_rank: torch.Tensor  # each node's rank among its head's candidates
    depth_ends: list[int]  # [d]: how many nodes are at most d deep
    top: int  # candidates needed per head
    used_heads: int  # the tree's depth

    @classmethod
    def of(cls, tree: list[tuple[int, ...]], vocab: int, device: torch.device) -> TreeLayout:
        """The layout of `tree` (checked), for heads over `vocab` tokens."""
        if max(max(p) for p in tree) >= vocab:
            raise ConfigError(f"proposer.tree uses rank {max(max(p) for p in tree)}; the heads have {vocab} tokens")
        index = {p: i for i, p in enumerate(tree)}
        parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in tree], device=device)
        heads = torch.tensor([len(p) - 1 for p in tree], device=device)
        ranks = torch.tensor([p[-1] for p in tree], device=device)
        depth_ends = [sum(1 for p in tree if len(p) <= d) for d in range(len(tree[-1]) + 1)]
        return cls(tree, parents, heads, ranks, depth_ends, max(p[-1] for p in tree) + 1, len(tree[-1]))


class MedusaProposer(Proposer):
    name = "medusa"
    config_class = MedusaConfig
    train_config_class = MedusaTrainConfig
    hidden_state_layers = (-1,)

    def __init__(
        self,
        config: MedusaConfig,
        target: TargetInfo,
        heads: MedusaHeads,
        vocab_ids: torch.Tensor,
        tree: list[tuple[int, ...]],
        saved_threshold: float | None = None,
    ) -> None:
        super().__init__(config, target)
        dtype = proposer_dtype(config.dtype, target.dtype, target.device, target.fast_cpu_kernels)
        self.heads = heads.to(device=target.device, dtype=dtype).eval().requires_grad_(False)
        self.vocab_ids = vocab_ids.to(target.device)
        self.dtype = dtype
        self.lm_rows: torch.Tensor | None = None  # [Vr, H] the target's own LM-head rows (heads without their own)
        if heads.projection is None:
            self.lm_rows = target.model.get_output_embeddings().weight.detach()[self.vocab_ids].to(dtype)
        self.num_heads = heads.num_heads
        self._layouts: dict[tuple, TreeLayout] = {}  # tree (a tuple of paths) -> its layout, made once
        self.layout: TreeLayout  # the tree drafted now (`_use_tree`)
        self._use_tree(tree)
        self.feature: torch.Tensor | None = None  # h at the position that produced the current root
        self.shape_choice: str | None = None  # how the tree was measured on this machine (from_config)
        self.measured_shape: str | None = None  # that tree in a few words, "2-node tree" (None: not measured)
        self.online: OnlineShapeChoice | None = None  # the tree re-chosen every step (config.adapt_shape)
        self.threshold = resolve_confidence_threshold(
            config.confidence_threshold, saved_threshold, "the confidence_threshold saved with the heads"
        )  # minimum path probability of a proposed node

    def _use_tree(self, tree: list[tuple[int, ...]] | tuple[tuple[int, ...], ...]) -> None:
        """Draft `tree` (checked, and laid out once per tree) from the next step on."""
        key = tuple(map(tuple, tree))  # (paths given as lists too)
        layout = self._layouts.get(key)
        if layout is None:
            layout = TreeLayout.of(check_tree(list(tree), self.num_heads), len(self.vocab_ids), self.target.device)
            self._layouts[key] = layout
        self.layout = layout

    @property
    def tree(self) -> list[tuple[int, ...]]:
        """The tree drafted now (its paths, sorted by depth then ranks)."""
        return self.layout.tree

    @property
    def used_heads(self) -> int:
        """The heads the tree drafted now reads: its depth."""
        return self.layout.used_heads

    def use_fastest_tree(self, path_counts: dict) -> None:
        """Draft the tree of `tree_candidates` that is fastest on this machine (specframe/step_costs.py): the
        target's forwards and a head's product (its residual blocks and its logits, the top candidate) timed here;
        with `config.adapt_shape`, re-chosen every step among those trees and no draft."""
        costs = measure_step_costs(self.target.model)
        feature = torch.zeros(self.target.hidden_size, dtype=self.dtype, device=self.target.device)
        with torch.no_grad():
            head_cost = relative_cost(lambda: self._head_logits(feature, 1).topk(1), self.target.model)
        candidates = tree_candidates(path_counts, costs)
        for candidate in candidates:
            self._use_tree(candidate.shape)  # (each checked and laid out now, not in a step)
        words, searched = lambda tree: f"{len(tree)}-node tree", f"trees of 1-{len(candidates)} nodes"
        choice = choose_measured(candidates, costs, head_cost, self.config.adapt_shape, words, searched, "a head")
        self._use_tree(choice.best.shape)
        self.online, self.measured_shape, self.shape_choice = choice.online, choice.measured_shape, choice.shape_choice

    @classmethod
    def train(cls, config: MedusaTrainConfig, target: torch.nn.Module, tokenizer, resume: bool = False) -> dict:
        from specframe.training.medusa import train_medusa

        return train_medusa(config, target, tokenizer, resume=resume)

    @classmethod
    def from_config(cls, config: MedusaConfig, target: TargetInfo) -> MedusaProposer:
        from specframe.artifacts import shipped
        from specframe.training.medusa import best_tree

        path = config.model or shipped("medusa", target.name, target.model)
        if not path:
            raise ConfigError(
                f"proposer.model is required: no Medusa heads ship for target '{target.name}'; train them with "
                "`specframe train --proposer medusa` and pass proposer.model=<folder>"
            )
        if not Path(path).is_dir():
            what = "do not exist" if not Path(path).exists() else "is a file, not a folder of Medusa heads"
            raise ModelLoadError(f"medusa heads '{path}' {what}")
        heads, vocab_ids, meta = load_heads(path, target.model)
        saved_applies = saved_shape_applies(meta, target.device, f"{path}/medusa_config.json")
        if config.tree is not None:
            tree = [tuple(c) for c in config.tree]
        elif config.tree_nodes is not None:
            if not meta.get("path_counts"):
                raise ConfigError(f"proposer.tree_nodes: heads '{path}' carry no path statistics; give proposer.tree")
            counts = saved_path_counts(meta, path, heads.num_heads)
            if config.tree_nodes > len(counts["counts"]):  # (best_tree would quietly give fewer nodes)
                raise ConfigError(
                    f"proposer.tree_nodes={config.tree_nodes}: heads '{path}' hold statistics for "
                    f"{len(counts['counts'])} paths, so a tree from them has at most that many nodes"
                )
            tree = best_tree(counts, config.tree_nodes)
        elif not saved_applies and target.device.type != "cpu" and meta.get("path_counts"):
            # (the saved tree was chosen elsewhere)
            tree = best_tree(saved_path_counts(meta, path, heads.num_heads), ACCELERATOR_TREE_NODES)
        else:
            saved = saved_tree(meta, path, heads.num_heads) if saved_applies else None
            tree = saved or [c for c in DEFAULT_TREE if len(c) <= heads.num_heads]
        choice = check_shape_choice(meta.get("shape_choice"), f"{path}/medusa_config.json")
        configured = config.tree is not None or config.tree_nodes is not None
        measured = choice == "measured" and not configured and target.device.type == "cpu"
        if measured and not meta.get("path_counts"):
            raise ModelLoadError(
                f"medusa heads '{path}': shape_choice \"measured\" needs the heads' path_counts to choose from"
            )
        saved = meta.get("confidence_threshold")
        check_confidence_threshold(saved, f"confidence_threshold in {path}/medusa_config.json")
        proposer = cls(config, target, heads, vocab_ids, tree, saved)
        if measured:
            proposer.use_fastest_tree(saved_path_counts(meta, path, heads.num_heads))
        return proposer

    @classmethod
    def random(cls, target: TargetInfo, config: MedusaConfig | None = None, seed: int = 0) -> MedusaProposer:
        config = config or MedusaConfig()
        if config.tree_nodes is not None:
            raise ConfigError(
                "proposer.tree_nodes builds a tree from trained heads' path statistics, which random heads lack: "
                "give proposer.tree instead"
            )
        tree = [tuple(c) for c in config.tree] if config.tree is not None else DEFAULT_TREE
        depth = max(len(p) for p in tree)
        with seeded(seed):  # (the heads' own initialisers draw too)
            heads = MedusaHeads(target.hidden_size, depth, 1)
            for p in heads.parameters():
                nn.init.normal_(p, std=1.0)  # untrained heads would all copy the LM head; vary them
        vocab_ids = torch.arange(target.vocab_size)
        beyond = [p for p in tree if max(p) >= target.vocab_size]
        if beyond and config.tree is not None:  # (a tree given: checked as given, or refused; never another one)
            raise ConfigError(
                f"proposer.tree: the choice {list(beyond[0])} asks for the candidate of rank {max(beyond[0])}, and "
                f"this target has {target.vocab_size} tokens (ranks 0-{target.vocab_size - 1}; `specframe check` "
                "runs on tiny 8-token targets)"
            )
        tree = [p for p in tree if max(p) < target.vocab_size] or [(0,)]  # (the default tree, on a tiny target)
        return cls(config, target, heads, vocab_ids, tree)

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        if self.target.fast_cpu_kernels and self.lm_rows is not None:  # (their copies of the LM-head rows follow a
            # change through `.data`)
            forget_outdated([self.lm_rows])
        self.feature = hidden_states[-1][-1]
        if self.online is not None:
            self.online.reset()

    def accepted(self, result: Acceptance) -> None:
        self.feature = result.hidden_states[-1][-1]
        if self.online is not None:
            self.online.observe(len(result.accepted_nodes))

    def end(self) -> None:
        self.feature = None

    def propose(self, state: DecodeState) -> Proposal:
        if self.online is not None:
            shape = self.online.choose().shape
            if shape is None:  # (a plain step)
                return Proposal.empty(state.tokens.device)
            self._use_tree(shape)
        layout = self.layout
        depth = min(layout.used_heads, state.max_depth)
        if depth == 0 or self.feature is None:
            return Proposal.empty(state.tokens.device)
        n = layout.depth_ends[depth]  # nodes are sorted by depth: the first n are those within reach
        logits = self._head_logits(self.feature.to(self.dtype), depth)
        # (with penalties, every head's as the target's row after the root has them: its history, not the tree's
        # paths, as the tree is one shape for all heads' candidates)
        logits = state.penalised(logits, columns=self.vocab_ids)
        top = logits.topk(layout.top, dim=-1).indices  # [depth, top] positions in the reduced vocabulary
        cand = self.vocab_ids[top]
        tokens = cand[layout.node_head[:n], layout.node_rank[:n]]
        parents = layout.parents[:n].clone()
        if self.threshold > 0:
            tokens, parents = self._confident(logits, top, tokens, parents, depth)
        if self.online is not None:  # (fewer where the token budget or the threshold cut the tree)
            self.online.drafted(tokens.numel(), depth)
        det = torch.ones(tokens.numel(), dtype=torch.bool, device=tokens.device)
        return Proposal(tokens, parents, det)

    def _head_logits(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """Heads 1..`depth`'s logits ([depth, Vr]; heads from the Medusa repository: [depth, V]) from the feature
        `h` ([H])."""
        feats = torch.stack([self.heads.heads[k](h) for k in range(depth)])  # [depth, H]
        if self.lm_rows is None:  # heads from the Medusa repository: each its own projection, [depth, V]
            return own_logits(feats, self.heads.projection)
        if self.target.fast_cpu_kernels:  # [depth, Vr]; on the target's CPU kernels, the faster layout for few rows
            return few_rows_linear(feats, self.lm_rows)
        return feats @ self.lm_rows.T

    def _confident(self, logits, top, tokens, parents, depth):
        """Keep the tree's first node and the nodes whose path probability reaches the threshold (a set closed
        under ancestors, since a path's probability only falls as it deepens), re-indexing their parents."""
        n = tokens.numel()
        probs = logits.float().softmax(-1).gather(1, top)  # [depth, top] each head's candidate probabilities
        layout = self.layout
        path = probs[layout.node_head[:n], layout.node_rank[:n]]
        for d in range(1, depth):  # nodes are sorted by depth; multiply in each parent's path probability
            lo, hi = layout.depth_ends[d], layout.depth_ends[d + 1]
            path[lo:hi] = path[lo:hi] * path[parents[lo:hi]]
        keep = path >= self.threshold
        keep[0] = True  # the tree's first node: its best-ranked depth-1 choice ((0,), head 1's best, by default)
        new_index = torch.cumsum(keep, 0) - 1
        kept_parents = parents[keep]
        kept_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], kept_parents)
        return tokens[keep], kept_parents
