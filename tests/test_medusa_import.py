"""Heads trained with the Medusa repository (config.json + medusa_lm_head.safetensors, or a Medusa-2 model's own
safetensors under `medusa_head.`), loaded as `proposer.model` of `medusa`: tiny random ones, written here."""

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specframe import SpeculativeDecoder
from specframe.cli import main
from specframe.decoder import target_info
from specframe.errors import ConfigError, ModelLoadError
from specframe.proposers.medusa import DEFAULT_TREE, MedusaConfig, MedusaProposer, load_heads
from specframe.testing.conformance import reference_greedy
from specframe.testing.replay import fresh_proposal
from specframe.testing.suite import VARIANT_SETTINGS, ProposerConformance
from specframe.testing.tiny import tiny_llama, write_distill_data

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


def repository_tensors(hidden=16, vocab=8, num_heads=3, layers=2, seed=0) -> dict[str, torch.Tensor]:
    """Random heads in the Medusa repository's keys: `{k}.{j}.linear.weight/bias`, `{k}.{layers}.weight`."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k in range(num_heads):
        for j in range(layers):
            tensors[f"{k}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.5
            tensors[f"{k}.{j}.linear.bias"] = torch.randn(hidden, generator=g) * 0.5
        tensors[f"{k}.{layers}.weight"] = torch.randn(vocab, hidden, generator=g)
    return tensors


def write_repository_heads(folder, tensors=None, num_heads=3, layers=2, config=None, **sizes) -> Path:
    """A folder as the Medusa repository's trainer writes it: config.json and medusa_lm_head.safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = repository_tensors(num_heads=num_heads, layers=layers, **sizes)
    meta = {"medusa_num_heads": num_heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny-llama"}
    (folder / "config.json").write_text(json.dumps(config if config is not None else meta))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "medusa_lm_head.safetensors")
    return folder


def by_hand(tensors, h, num_heads, layers):
    """Each head's logits by the original formula: x <- x + SiLU(W_j x + b_j) for each block, then W_k x."""
    out = []
    for k in range(num_heads):
        x = h.double()
        for j in range(layers):
            w, b = tensors[f"{k}.{j}.linear.weight"].double(), tensors[f"{k}.{j}.linear.bias"].double()
            x = x + torch.nn.functional.silu(w @ x + b)
        out.append(tensors[f"{k}.{layers}.weight"].double() @ x)
    return torch.stack(out)


def test_repository_heads_propose_the_original_formula(tmp_path):
    target = tiny_llama(vocab_size=12, seed=0)
    tensors = repository_tensors(vocab=12)
    folder = write_repository_heads(tmp_path / "heads", tensors)
    proposer = MedusaProposer.from_config(
        MedusaConfig(model=str(folder), tree=TREE, dtype="float32"), target_info(target)
    )
    assert proposer.lm_rows is None and proposer.heads.projection.shape == (3, 12, 16)
    for tokens in ([1, 2, 3, 4], [5, 9, 2, 2, 7, 11]):
        tokens = torch.tensor(tokens)
        proposal = fresh_proposal(proposer, target, tokens)
        with torch.no_grad():
            h = target(input_ids=tokens[:-1][None], output_hidden_states=True).hidden_states[-1][0, -1]
        ranked = by_hand(tensors, h, 3, 2).argsort(dim=-1, descending=True)  # [heads, vocab]
        expected = [int(ranked[len(c) - 1, c[-1]]) for c in TREE]  # (TREE is sorted parents first)
        assert proposal.tokens.tolist() == expected
        assert proposal.parents.tolist() == [-1, -1, -1, 0, 0, 1, 3, 4]
        assert torch.allclose(proposer.heads.logits(h).double(), by_hand(tensors, h, 3, 2), atol=1e-4)


def test_repository_heads_decode_exactly_with_the_default_tree(tmp_path, changes_global_rng):
    target = tiny_llama(vocab_size=8, seed=0)
    folder = write_repository_heads(tmp_path / "heads", num_heads=4, layers=1)
    info = target_info(target)
    proposer = MedusaProposer.from_config(MedusaConfig(model=str(folder)), info)
    assert proposer.tree == [c for c in DEFAULT_TREE if len(c) <= 4]  # (nothing saved: the default tree)
    assert not changes_global_rng(lambda: MedusaProposer.from_config(MedusaConfig(model=str(folder)), info))
    dec = SpeculativeDecoder(target, proposer, max_new_tokens=24)
    proposed = 0
    for prompt in ([1, 2, 3], [5, 1, 2, 2, 7]):
        res = dec.generate(prompt)
        assert res.token_ids == reference_greedy(target, prompt, 24)
        proposed += res.stats["proposed_tokens"]
    assert proposed > 0
    with pytest.raises(ConfigError, match="carry no path statistics"):
        MedusaProposer.from_config(MedusaConfig(model=str(folder), tree_nodes=4), info)
    # proposer.dtype: the heads and their own projections in that dtype, on the target's device.
    half = MedusaProposer.from_config(MedusaConfig(model=str(folder), dtype="bfloat16"), info)
    assert (
        half.heads.projection.dtype == torch.bfloat16 and half.heads.heads[0][0].linear.weight.dtype == torch.bfloat16
    )
    assert half.heads.projection.device == info.device
    res = SpeculativeDecoder(target, half, max_new_tokens=16).generate([1, 2, 3])
    assert res.token_ids == reference_greedy(target, [1, 2, 3], 16)


class RepositoryHeads(MedusaProposer):
    """`medusa` whose random build writes random heads in the Medusa repository's layout and loads them."""

    @classmethod
    def random(cls, target, config=None, seed=0):
        config = config or MedusaConfig()
        depth = max(len(c) for c in config.tree) if config.tree else 5
        tensors = repository_tensors(target.hidden_size, target.vocab_size, num_heads=depth, layers=1, seed=seed)
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_repository_heads(tmp, tensors, num_heads=depth, layers=1)
            return cls.from_config(dataclasses.replace(config, model=str(folder)), target)


class TestRepositoryHeadsConformance(ProposerConformance):
    proposer_class = RepositoryHeads
    proposer_config = MedusaConfig(tree=TREE)
    sampling_settings = VARIANT_SETTINGS


def test_pickled_heads_are_refused_with_a_conversion_recipe(tmp_path):
    target = tiny_llama(vocab_size=8, seed=0)
    for name in ("medusa_lm_head.pt", "pytorch_model.bin"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
        (folder / name).write_bytes(b"never unpickled")  # (not a pickle at all: reading it would fail otherwise)
        with pytest.raises(ModelLoadError, match=f"{name} is a pickle, and specframe loads weights only from") as e:
            MedusaProposer.from_config(MedusaConfig(model=str(folder)), target_info(target))
        assert f"torch.load('{name}', map_location='cpu', weights_only=True)" in str(e.value)
        assert "save_file(" in str(e.value) and "'medusa_lm_head.safetensors'" in str(e.value)


def test_the_conversion_recipe_makes_heads_that_load(tmp_path):
    """The command the refusal gives, run on a pickle of heads whose blocks share one module (the repository's
    `[ResBlock] * n`), writes heads that load and equal the original."""
    import subprocess
    import sys

    target = tiny_llama(vocab_size=8, seed=0)
    tensors = repository_tensors(num_heads=2, layers=2)
    for k in range(2):  # (one module repeated: block 1 is block 0)
        for p in ("weight", "bias"):
            tensors[f"{k}.1.linear.{p}"] = tensors[f"{k}.0.linear.{p}"]
    folder = tmp_path / "heads"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2}))
    torch.save(tensors, folder / "medusa_lm_head.pt")
    with pytest.raises(ModelLoadError) as e:
        load_heads(folder, target)
    command = str(e.value).split(": python -c ")[1]
    subprocess.run([sys.executable, "-c", json.loads(command)], cwd=folder, check=True)
    heads, vocab_ids, meta = load_heads(folder, target)
    h = torch.randn(16)
    assert torch.allclose(heads.logits(h).double(), by_hand(tensors, h, 2, 2), atol=1e-4)
    assert meta["file"].endswith("medusa_lm_head.safetensors") and vocab_ids.tolist() == list(range(8))


def _drop(key):
    def change(t):
        del t[key]

    return change


def _set(key, value):
    def change(t):
        t[key] = value

    return change


@pytest.mark.parametrize(
    "sizes, change, config, message",
    [
        ({"hidden": 24}, None, None, r"hidden size 24 and 8 logits; this target has 16 and 8 \(hidden size 24 there"),
        ({"vocab": 12}, None, None, r"hidden size 16 and 12 logits; this target has 16 and 8 \(logits 12 there, 8"),
        ({}, None, {"medusa_num_heads": 2, "medusa_num_layers": 2}, "holds 3 heads .*medusa_num_heads says 2"),
        ({}, None, {"medusa_num_heads": 3, "medusa_num_layers": 1}, r"lacks '0.1.weight', head 0's projection"),
        ({}, None, {"medusa_num_heads": 3, "medusa_num_layers": 3}, r"lacks '0.3.weight', head 0's projection"),
        ({}, None, {"medusa_num_heads": 3}, "config.json's medusa_num_layers must be an integer >= 0, got 'nothing'"),
        ({}, None, {"medusa_num_heads": "3", "medusa_num_layers": 2}, "medusa_num_heads must be an integer >= 1"),
        ({}, _drop("1.0.linear.bias"), None, r"lacks '1.0.linear.bias' \(config.json: 3 heads of 2 block"),
        ({}, _set("1.1.linear.weight", torch.zeros(16, 8)), None, r"'1.1.linear.weight' has shape \[16, 8\], expected"),
        ({}, _set("2.2.weight", torch.zeros(9, 16)), None, r"'2.2.weight' has shape \[9, 16\], expected \[8, 16\]"),
        ({}, _set("0.extra", torch.zeros(1)), None, "holds '0.extra', which config.json's 3 heads of 2 block"),
        ({}, _set("0.0.linear.weight", torch.full((16, 16), float("nan"))), None, r"not finite \(in '0.0.linear"),
    ],
)
def test_malformed_repository_heads_are_refused(tmp_path, sizes, change, config, message):
    target = tiny_llama(vocab_size=8, seed=0)
    tensors = repository_tensors(**sizes)
    if change is not None:
        change(tensors)
    folder = write_repository_heads(tmp_path / "heads", tensors, config=config)
    with pytest.raises(ModelLoadError, match=f"medusa heads '{folder}'(: medusa_lm_head.safetensors)?.*{message}"):
        MedusaProposer.from_config(MedusaConfig(model=str(folder)), target_info(target))


def test_a_model_folder_is_not_taken_for_heads(tmp_path, tiny_dirs):
    with pytest.raises(ModelLoadError, match="nor a config.json with medusa_num_heads"):
        load_heads(tiny_dirs["target"], tiny_llama(vocab_size=8, seed=0))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    with pytest.raises(ModelLoadError, match="config.json names Medusa heads, but the folder holds no medusa_lm_head"):
        load_heads(tmp_path, tiny_llama(vocab_size=8, seed=0))


def test_the_cli_decodes_with_repository_heads_and_names_a_mismatch(tmp_path, tiny_dirs, capsys):
    target = str(tiny_dirs["target"])  # (tiny_llama(vocab_size=8, seed=0), saved)
    good = write_repository_heads(tmp_path / "good")
    args = ["generate", "--proposer", "medusa", "--target", target, "--raw", "--json", "--max-new-tokens", "12"]
    assert main([*args, "--prompt", "a b c", f"proposer.model={good}"]) == 0
    out = json.loads(capsys.readouterr().out)
    plain = main([*args, "--prompt", "a b c", "--proposer", "none"])
    assert plain == 0 and json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    wide = write_repository_heads(tmp_path / "wide", vocab=12)
    assert main([*args, "--prompt", "a b c", f"proposer.model={wide}"]) == 2
    err = capsys.readouterr().err
    assert "medusa_lm_head.safetensors holds heads for a target with hidden size 16 and 12 logits" in err
    assert "Traceback" not in err


def write_medusa2_model(folder, tensors, shard=False):
    """A Medusa-2 "full model" folder: the (fine-tuned) model's own files, its config.json naming the heads, and the
    heads' tensors under `medusa_head.` in its safetensors (with `shard`, in a second file listed by an index)."""
    model = tiny_llama(vocab_size=8, seed=0)
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 3, "medusa_num_layers": 2}))
    heads = {f"medusa_head.{k}": v for k, v in tensors.items()}
    if not shard:
        save_file({**load_file(folder / "model.safetensors"), **heads}, folder / "model.safetensors", {"format": "pt"})
        return model
    base = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file(base, folder / "model-00001-of-00002.safetensors", {"format": "pt"})
    save_file(heads, folder / "model-00002-of-00002.safetensors", {"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in base} | {
        k: "model-00002-of-00002.safetensors" for k in heads
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model


@pytest.mark.parametrize("shard", [False, True], ids=["one-file", "sharded"])
def test_medusa2_model_folders_give_their_heads(tmp_path, shard):
    from specframe.models import load_model

    tensors = repository_tensors()
    model = write_medusa2_model(tmp_path / "m2", tensors, shard=shard)
    # The folder is also the target (its medusa_head.* tensors are not the model's, and are left out there).
    target = load_model(str(tmp_path / "m2"), dtype="float32", device="cpu", quiet=True).model
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), model.parameters(), strict=True))
    heads, _, meta = load_heads(tmp_path / "m2", target)
    h = torch.randn(16)
    assert torch.allclose(heads.logits(h).double(), by_hand(tensors, h, 3, 2), atol=1e-4)
    proposer = MedusaProposer.from_config(MedusaConfig(model=str(tmp_path / "m2"), tree=TREE), target_info(target))
    res = SpeculativeDecoder(target, proposer, max_new_tokens=16).generate([1, 2, 3])
    assert res.token_ids == reference_greedy(target, [1, 2, 3], 16)
    bare = tmp_path / "bare"
    tiny_llama(vocab_size=8, seed=0).save_pretrained(bare)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 3, "medusa_num_layers": 2}))
    with pytest.raises(ModelLoadError, match=r"model.safetensors holds no Medusa heads \(medusa_head.\* tensors\)"):
        load_heads(bare, target)
    if shard:  # (an index naming a file outside the folder is refused, as transformers reads shards in it)
        index = tmp_path / "m2" / "model.safetensors.index.json"
        listed = json.loads(index.read_text())
        listed["weight_map"]["medusa_head.0.0.linear.weight"] = "../elsewhere.safetensors"
        index.write_text(json.dumps(listed))
        with pytest.raises(ModelLoadError, match=r"index.json names '../elsewhere.safetensors', not a file of the"):
            load_heads(tmp_path / "m2", target)


def test_training_does_not_start_from_repository_heads(tmp_path):
    from specframe.training.medusa import MedusaTrainConfig, train_medusa

    target = tiny_llama(vocab_size=8, seed=0, hidden_size=16)
    write_distill_data(tmp_path / "d.jsonl", target, n=20)
    folder = write_repository_heads(tmp_path / "heads")
    cfg = MedusaTrainConfig(
        data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "out"), epochs=1, num_heads=3, layers=2,
        heldout_fraction=0.25, init_heads=str(folder), features_cache=str(tmp_path / "features"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="holds heads from the Medusa repository, each with its own projection"):
        train_medusa(cfg, target, None, log=lambda m: None)
