import json
import shutil

import pytest
import torch

from specframe import SpeculativeDecoder
from specframe.cli import main
from specframe.data import read_distill
from specframe.decoder import target_info
from specframe.errors import ConfigError, ModelLoadError
from specframe.proposers.medusa import DEFAULT_TREE, MedusaConfig, MedusaHeads, MedusaProposer, check_tree, load_heads
from specframe.testing.conformance import reference_greedy
from specframe.testing.replay import fresh_proposal, recorded_proposals
from specframe.testing.suite import VARIANT_SETTINGS, ProposerConformance
from specframe.testing.tiny import one_thread, tiny_llama, write_distill_data
from specframe.training.common import split_heldout
from specframe.training.medusa import MedusaTrainConfig, best_tree, expected_accepted_length, train_medusa


class TestMedusaDeepNarrowTree(ProposerConformance):
    proposer_class = MedusaProposer
    proposer_config = MedusaConfig(tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])
    sampling_settings = VARIANT_SETTINGS


def test_heads_do_not_share_weights():
    heads = MedusaHeads(8, num_heads=3, layers=2)
    assert len({id(p) for p in heads.parameters()}) == 3 * 2 * 2
    with torch.no_grad():
        heads.heads[0][0].linear.weight.fill_(1.0)
    assert float(heads.heads[1][0].linear.weight.detach().abs().sum()) == 0.0
    assert float(heads.heads[0][1].linear.weight.detach().abs().sum()) == 0.0


def test_untrained_heads_are_the_target_lm_head():
    heads = MedusaHeads(8, num_heads=2, layers=1)
    h, rows = torch.randn(3, 8), torch.randn(5, 8)
    expected = h + torch.nn.functional.silu(torch.zeros(3, 8))
    assert torch.allclose(heads.logits(h, rows), (expected @ rows.T).expand(2, 3, 5))


@pytest.mark.parametrize(
    "tree, message",
    [
        ([[0], [0, 1], [1, 1]], "no parent"),
        ([[0], [0]], "repeated"),
        ([[0], [-1]], "ranks >= 0"),
        ([], "empty"),
        ([[0], [0, 0], [0, 0, 0]], "deeper than the 2 heads"),
        ([[0]] + [[0, r] for r in range(1024)], "has 1025 choices, more than the 1024 a tree may have"),
    ],
)
def test_bad_trees_are_refused(tree, message):
    with pytest.raises(ConfigError, match=message):
        check_tree(tree, num_heads=2)


def test_random_heads_refuse_tree_nodes_instead_of_ignoring_it():
    info = target_info(tiny_llama(vocab_size=8, seed=0))
    with pytest.raises(ConfigError, match="random heads lack: give proposer.tree instead"):
        MedusaProposer.random(info, MedusaConfig(tree_nodes=4))
    assert MedusaProposer.random(info, MedusaConfig(tree=[[0], [1], [0, 0]])).tree == [(0,), (1,), (0, 0)]
    # a given tree that the target's vocabulary cannot hold is refused (before: cut down to [[0]] and checked so)
    with pytest.raises(ConfigError, match=r"proposer.tree: the choice \[9\] asks for the candidate of rank 9"):
        MedusaProposer.random(info, MedusaConfig(tree=[[0], [9], [9, 0]]))


def test_tree_nodes_are_ordered_parents_first_and_cut_at_max_depth():
    target = tiny_llama(vocab_size=16, hidden_size=32)
    p = MedusaProposer.random(target_info(target), MedusaConfig(tree=[[0, 0, 0], [0, 0], [1], [0], [0, 1]]))
    assert p.tree == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    p.begin(torch.tensor([1, 2]), {-1: torch.randn(2, 32)})
    from specframe.proposer import DecodeState
    from specframe.sampling import SamplingParams

    state = DecodeState(torch.tensor([1, 2, 3]), 2, SamplingParams(), torch.Generator(), max_depth=2)
    prop = p.propose(state)
    assert prop.parents.tolist() == [-1, -1, 0, 0] and prop.depths() == [1, 1, 2, 2]
    assert bool(prop.deterministic.all())
    state.max_depth = 0
    assert len(p.propose(state)) == 0


def test_best_tree_is_ancestor_closed_and_scores_its_nodes():
    counts = {"positions": 100, "counts": {"0": 60, "1": 20, "0,0": 40, "0,1": 10, "0,0,0": 30, "1,0": 15, "2": 5}}
    tree = best_tree(counts, 4)
    assert tree == [(0,), (1,), (0, 0), (0, 0, 0)]
    assert expected_accepted_length(counts, tree) == pytest.approx(1 + (60 + 20 + 40 + 30) / 100)
    assert all(p[:-1] in tree for p in tree if len(p) > 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    with one_thread():  # (a module fixture sets up before the per-test one_thread fixture)
        return train_tiny_heads(tmp_path_factory.mktemp("medusa"))


def train_tiny_heads(tmp):
    # A smooth (small-init) target: its greedy text is learnable from 80 prompts.
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2, initializer_range=0.1)
    write_distill_data(tmp / "d.jsonl", target, n=80, response_length=12)
    cfg = MedusaTrainConfig(
        data=str(tmp / "d.jsonl"),
        out=str(tmp / "heads"),
        num_heads=3,
        vocab_size=12,
        epochs=3,
        lr=3e-2,
        batch_size=32,
        heldout_fraction=0.2,
        tree_nodes=6,
        features_cache=str(tmp / "features"),
    )
    metrics = train_medusa(cfg, target, None, log=lambda m: None)
    return target, cfg, metrics


def test_training_improves_heads_and_saves_a_tree(trained):
    target, cfg, metrics = trained
    hist = metrics["history"]
    assert hist[-1]["top1"][0] > hist[0]["top1"][0] + 0.1
    assert hist[-1]["train_loss"] < hist[1]["train_loss"]
    meta = json.loads(open(f"{cfg.out}/medusa_config.json").read())
    assert meta["format"] == "specframe-medusa-heads" and len(meta["tree"]) == 6
    assert meta["metrics"]["heldout"]["expected_accepted_length"] > 1.0
    from safetensors.torch import load_file

    weights = load_file(f"{cfg.out}/model.safetensors")
    assert set(weights) == {f"heads.{k}.0.linear.{w}" for k in range(3) for w in ("weight", "bias")}
    assert all(v.dtype == torch.float16 for v in weights.values())


def test_a_batch_without_labels_is_skipped(tmp_path):
    # batch_size 1: some batches hold only a response's last position (no head-1 label) or labels outside the
    # reduced vocabulary. Stage 1 once stopped there with torch's "element 0 of tensors does not require grad".
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    write_distill_data(tmp_path / "d.jsonl", target, n=40)
    cfg = MedusaTrainConfig(
        data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "heads"), epochs=1, num_heads=2, tree_nodes=4,
        vocab_size=12, heldout_fraction=0.2, batch_size=1, features_cache=str(tmp_path / "features"),
    )  # fmt: skip
    assert train_medusa(cfg, target, None, log=lambda m: None)["heldout"]["tree_nodes"] == 4


def test_saved_heads_round_trip_and_decode_exactly(trained, changes_global_rng):
    target, cfg, _ = trained
    info = target_info(target)
    heads, vocab_ids, meta = load_heads(cfg.out, target)
    saved = MedusaHeads(32, 3, 1)
    from safetensors.torch import load_file

    saved.load_state_dict({k: v.float() for k, v in load_file(f"{cfg.out}/model.safetensors").items()})
    h = torch.randn(4, 32)
    assert torch.equal(heads.logits(h, torch.eye(32)), saved.logits(h, torch.eye(32)))
    # The trainer saves `"shape_choice": "measured"`: on a CPU the tree of 1-3 nodes timed fastest at load.
    measured = MedusaProposer.from_config(MedusaConfig(model=cfg.out), info)
    assert not changes_global_rng(lambda: MedusaProposer.from_config(MedusaConfig(model=cfg.out), info))
    assert meta["shape_choice"] == "measured"
    assert measured.shape_choice.startswith(f"{len(measured.tree)}-node tree (measured: trees of 1-3 nodes, ")
    assert measured.tree == best_tree(meta["path_counts"], len(measured.tree))
    assert 1 <= len(measured.tree) <= 3
    proposer = MedusaProposer.from_config(MedusaConfig(model=cfg.out, tree=meta["tree"]), info)  # (the saved tree)
    assert proposer.tree == [tuple(p) for p in meta["tree"]]
    dec = SpeculativeDecoder(target, proposer, max_new_tokens=24)
    for prompt in ([1, 2, 3], [5, 9, 2, 2, 7]):
        res = dec.generate(prompt)
        assert res.token_ids == reference_greedy(target, prompt, 24)
    # Trained on the target's own greedy text, the heads must be accepted often.
    assert res.stats["mean_accepted_length"] > 1.5
    paths = len(meta["path_counts"]["counts"])
    bigger = MedusaProposer.from_config(MedusaConfig(model=cfg.out, tree_nodes=min(10, paths)), info)
    assert len(bigger.tree) == min(10, paths)
    with pytest.raises(ConfigError, match=f"tree_nodes={paths + 1}: heads .* hold statistics for {paths} paths"):
        MedusaProposer.from_config(MedusaConfig(model=cfg.out, tree_nodes=paths + 1), info)  # (not fewer, unsaid)


def test_heads_for_another_target_are_refused(trained, tmp_path):
    _, cfg, _ = trained
    other = tiny_llama(vocab_size=16, seed=5, hidden_size=32, num_layers=2)
    with pytest.raises(ModelLoadError, match="made for another target: the weights differ"):
        MedusaProposer.from_config(MedusaConfig(model=cfg.out), target_info(other))
    with pytest.raises(ModelLoadError, match="does not exist|do not exist"):
        MedusaProposer.from_config(MedusaConfig(model=str(tmp_path / "nope")), target_info(other))
    with pytest.raises(ConfigError, match="proposer.model is required"):
        MedusaProposer.from_config(MedusaConfig(), target_info(other))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="model.gguf' is a file, not a folder of Medusa heads"):
        MedusaProposer.from_config(MedusaConfig(model=str(tmp_path / "model.gguf")), target_info(other))
    (tmp_path / "medusa_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="incomplete or corrupt"):
        load_heads(tmp_path, other)
    shutil.copytree(cfg.out, tmp_path / "dup")
    (tmp_path / "dup" / "medusa_vocab.json").write_text("[1, 2, 2]")
    with pytest.raises(ModelLoadError, match="medusa heads .*dup': medusa_vocab.json lists a token id more than once"):
        load_heads(tmp_path / "dup", trained[0])
    meta = json.loads((tmp_path / "dup" / "medusa_config.json").read_text())
    del meta["num_heads"]
    (tmp_path / "dup" / "medusa_config.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="dup' are incomplete or corrupt: medusa_config.json lacks 'num_heads'"):
        load_heads(tmp_path / "dup", trained[0])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_heads": 1000000000}, r"holds \d+ tensors; medusa_config.json's 1000000000 heads"),  # (not built first)
        ({"hidden_size": "32"}, "hidden_size must be an integer >= 1, got '32'"),
        ({"version": 9}, "version 9; this specframe reads 1"),
        ({"tree": 5}, "medusa_config.json's tree: must be a list of choices, got 5"),
        ({"tree": [[0, 1]]}, r"medusa_config.json's tree: choice \[0, 1\] has no parent"),
        ({"tree": [[r] for r in range(1025)]}, "medusa_config.json's tree: has 1025 choices, more than the 1024"),
        ({"path_counts": "x"}, "path_counts must be"),
        ({"path_counts": {"positions": 3, "counts": {"0": -5}}}, "path_counts must be"),
    ],
)
def test_a_tampered_medusa_config_is_a_load_error(trained, tmp_path, change, message):
    target, cfg, _ = trained
    shutil.copytree(cfg.out, tmp_path / "heads")
    meta = json.loads((tmp_path / "heads" / "medusa_config.json").read_text())
    (tmp_path / "heads" / "medusa_config.json").write_text(json.dumps({**meta, **change}))
    options = {"tree_nodes": 3} if "path_counts" in change else {}
    with pytest.raises(ModelLoadError, match=message):
        MedusaProposer.from_config(MedusaConfig(model=str(tmp_path / "heads"), **options), target_info(target))


def test_resume_continues_after_the_last_epoch(trained, tmp_path):
    # (In a copy: the module's trained heads stay as trained for the other tests. That an interrupted run
    # resumes to the same weights is tests/test_resume.py's.)
    from dataclasses import replace

    target, cfg, metrics = trained
    shutil.copytree(cfg.out, tmp_path / "heads")
    more = replace(cfg, epochs=4, out=str(tmp_path / "heads"))
    resumed = train_medusa(more, target, None, resume=True, log=lambda m: None)
    assert [h["epoch"] for h in resumed["history"]] == [0, 1, 2, 3, 4]
    assert resumed["history"][:4] == metrics["history"]  # (the first three epochs' metrics from the checkpoint)


def test_resume_with_other_heads_is_refused_before_the_features_are_extracted(trained, tmp_path):
    from dataclasses import replace

    target, cfg, _ = trained
    other = replace(cfg, num_heads=2, features_cache=str(tmp_path / "fresh"))
    with pytest.raises(ConfigError, match="checkpoint in .* was trained with train.num_heads=3, not 2"):
        train_medusa(other, target, None, resume=True, log=lambda m: None)
    assert not (tmp_path / "fresh").exists()


def test_init_heads_continues_stage1_from_trained_heads(trained, tmp_path):
    # With a learning rate too small to move anything, training further (e.g. on new data) starts where the
    # heads ended, keeps their vocabulary (not the 16 tokens its own vocab_size would choose) and saves them
    # unchanged.
    from dataclasses import replace

    from safetensors.torch import load_file

    target, cfg, metrics = trained
    more = replace(cfg, out=str(tmp_path / "more"), init_heads=cfg.out, vocab_size=16, epochs=1, lr=1e-12)
    again = train_medusa(more, target, None, log=lambda m: None)
    assert again["history"][0]["top1"] == pytest.approx(metrics["history"][-1]["top1"], abs=0.02)
    assert again["history"][0]["top1"][0] > metrics["history"][0]["top1"][0] + 0.1  # (not a fresh start)
    before, after = load_file(f"{cfg.out}/model.safetensors"), load_file(f"{more.out}/model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    vocab = json.loads(open(f"{more.out}/medusa_vocab.json").read())
    assert vocab == json.loads(open(f"{cfg.out}/medusa_vocab.json").read()) and len(vocab) == 12
    with pytest.raises(ConfigError, match="has 3 heads of 1 blocks; the config asks for 2 of 1"):
        train_medusa(replace(more, num_heads=2), target, None, log=lambda m: None)
    # A folder that holds no heads is named under the option that gave it (exit 2 from the CLI).
    with pytest.raises(ConfigError, match=r"train.init_heads: .*medusa_config.json"):
        train_medusa(replace(more, init_heads=str(tmp_path)), target, None, log=lambda m: None)
    with pytest.raises(ConfigError, match=r"train.init_heads: medusa heads '.*nowhere' does not exist"):
        train_medusa(replace(more, init_heads=str(tmp_path / "nowhere")), target, None, log=lambda m: None)


def test_prompt_positions_add_the_prompt_to_the_training_positions_only():
    """A sequence of 7 tokens whose response starts at token 3. By default the roots are positions 2..5 (position
    2, the last prompt token's, produced response token 3); with prompt_positions positions 0..5. Head k's label
    is always the token k + 1 places after the root; held-out evaluation calls the default."""
    from specframe.training.common import Sequence, collate
    from specframe.training.features import FeatureSequence
    from specframe.training.medusa import stack_features

    seq = FeatureSequence(torch.arange(10, 17), 3, torch.arange(7.0)[:, None].repeat(1, 4))
    x, y = stack_features([seq], num_heads=2)
    assert x[:, 0].tolist() == [2, 3, 4, 5] and y.tolist() == [[14, 15], [15, 16], [16, -1], [-1, -1]]
    x, y = stack_features([seq], num_heads=2, prompt_positions=True)
    assert x[:, 0].tolist() == [0, 1, 2, 3, 4, 5] and y[:2].tolist() == [[12, 13], [13, 14]]
    # Medusa-2 (and the draft trainer) take their loss positions from collate: the same roots.
    seqs = [Sequence(list(range(10, 17)), 3), Sequence([10, 11, 12, 13], 2)]
    assert collate(seqs, 0)[2].tolist() == [[False, False] + [True] * 4 + [False], [False, True, True] + [False] * 4]
    assert collate(seqs, 0, prompt_positions=True)[2].tolist() == [[True] * 6 + [False], [True] * 3 + [False] * 4]


@pytest.mark.parametrize(
    "field, value",
    [
        ("stage", 3),
        ("num_heads", 0),
        ("head_decay", 0.0),
        ("tree_nodes", 0),
        ("prompt_positions", "yes"),
        ("keep_weight", -1.0),
        ("lora_modules", ()),
        ("out", ""),
    ],
)
def test_bad_training_options(field, value):
    with pytest.raises(ConfigError, match=f"train.{field}"):
        MedusaTrainConfig(**{field: value})


def stage2_with_lora_on(modules, tmp_path, tied=False):
    """Medusa-2 training of a tiny target (its LM head tied to its embeddings, as SmolLM2's, with `tied`) with
    LoRA on `modules`."""
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    if tied:
        target.lm_head.weight = target.model.embed_tokens.weight
        target.config.tie_word_embeddings = True
    write_distill_data(tmp_path / "d.jsonl", target, n=20)
    cfg = MedusaTrainConfig(
        data=str(tmp_path / "d.jsonl"),
        out=str(tmp_path / "m"),
        stage=2,
        num_heads=2,
        heldout_fraction=0.2,
        lora_modules=modules,
        features_cache="",
    )
    return train_medusa(cfg, target, None, log=lambda m: None)


def test_stage2_lora_modules_the_target_lacks_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"train.lora_modules \['qq_proj'\]"):
        stage2_with_lora_on(("qq_proj",), tmp_path)


@pytest.mark.parametrize("modules, named", [(("q_proj", "lm_head"), "lm_head"), (("model.embed_tokens",), "embed")])
def test_stage2_lora_on_tied_embeddings_is_refused(tmp_path, modules, named):
    # (trained unmerged, on the LM head alone; merged into the weight it shares with the embeddings, both change)
    with pytest.raises(ConfigError, match=rf"train.lora_modules names '[a-z_.]*{named}[a-z_]*', which shares"):
        stage2_with_lora_on(modules, tmp_path, tied=True)


def test_a_target_not_laid_out_like_llama_is_refused_by_the_trainers(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    write_distill_data(tmp_path / "d.jsonl", gpt2, n=10)
    cfg = MedusaTrainConfig(data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "m"), features_cache="")
    with pytest.raises(ModelLoadError, match="laid out like Llama .*GPT2LMHeadModel is not"):
        train_medusa(cfg, gpt2, None, log=lambda m: None)


def test_medusa2_trains_lora_with_peft_and_heads_require_the_adapter(tmp_path, tiny_dirs):
    from specframe.models import load_model

    base = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True).model
    write_distill_data(tmp_path / "d.jsonl", base, n=30, response_length=8)
    cfg = MedusaTrainConfig(
        data=str(tmp_path / "d.jsonl"),
        out=str(tmp_path / "m2"),
        stage=2,
        num_heads=2,
        epochs=1,
        lr=5e-3,
        batch_size=8,
        heldout_fraction=0.2,
        tree_nodes=4,
        lora_rank=2,
        prompt_positions=True,
    )
    metrics = train_medusa(cfg, base, None, log=lambda m: None)
    assert metrics["history"][-1]["keep_kl"] >= 0
    assert (tmp_path / "m2" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "m2" / "adapter" / "adapter_model.safetensors").is_file()
    plain = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True).model
    with pytest.raises(ModelLoadError, match="target.adapter"):
        MedusaProposer.from_config(MedusaConfig(model=cfg.out), target_info(plain))
    adapted = load_model(
        str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True, adapter=str(tmp_path / "m2" / "adapter")
    ).model
    proposer = MedusaProposer.from_config(MedusaConfig(model=cfg.out), target_info(adapted))
    res = SpeculativeDecoder(adapted, proposer, max_new_tokens=16).generate([1, 2, 3])
    assert res.token_ids == reference_greedy(adapted, [1, 2, 3], 16)
    # The adapter merged in bfloat16 rounds unlike the float32 merge the heads were saved with: still recognised.
    adapted16 = load_model(
        str(tiny_dirs["target"]), dtype="bfloat16", device="cpu", quiet=True, adapter=str(tmp_path / "m2" / "adapter")
    ).model
    MedusaProposer.from_config(MedusaConfig(model=cfg.out), target_info(adapted16))


def test_medusa2_records_the_epoch_mean_of_the_keep_kl(tmp_path, monkeypatch):
    """Stage 2's `keep_kl` in the history (and the log) is the mean over the epoch's batches of KL(p_original ||
    p_adapted), not the last batch's."""
    from specframe.training import medusa

    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    write_distill_data(tmp_path / "d.jsonl", target, n=40)
    seen: list[float] = []  # each batch's KL, in order
    per_epoch: list[list[float]] = []  # the batches' values when each epoch's line is logged

    def spy(p_log, q_log):
        kl = real(p_log, q_log)
        seen.append(kl.item())
        return kl

    def log(message: str) -> None:
        if message.startswith("epoch "):
            per_epoch.append(seen[sum(map(len, per_epoch)) :])
            logs.append(message)

    real, logs = medusa.forward_kl, []
    monkeypatch.setattr(medusa, "forward_kl", spy)
    cfg = MedusaTrainConfig(
        data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "m2"), features_cache="", stage=2, num_heads=2, epochs=2,
        lr=1e-2, batch_size=4, heldout_fraction=0.2, tree_nodes=4, lora_rank=2,
    )  # fmt: skip
    history = train_medusa(cfg, target, None, log=log)["history"]
    assert [h["epoch"] for h in history] == [1, 2] and [len(v) for v in per_epoch] == [8, 8]
    for h, values, line in zip(history, per_epoch, logs, strict=True):
        assert h["keep_kl"] == pytest.approx(sum(values) / len(values), rel=1e-12)
        assert abs(h["keep_kl"] - values[-1]) > 1e-6  # (not vacuous: the last batch's value differs)
        assert f"KL to the original {h['keep_kl']:.4f} (epoch mean)" in line


def test_cli_trains_medusa(tmp_path, tiny_dirs, capsys):
    from specframe.models import load_model

    base = load_model(str(tiny_dirs["target"]), dtype="float32", device="cpu", quiet=True).model
    write_distill_data(tmp_path / "d.jsonl", base, n=20)
    # Options from a config file (the packaged recipe), KEY=VALUE arguments winning over it.
    code = main(
        [
            "train",
            "--proposer",
            "medusa",
            "--target",
            str(tiny_dirs["target"]),
            "--config",
            "train-medusa.yaml",
            f"data={tmp_path}/d.jsonl",
            f"out={tmp_path}/heads",
            "epochs=1",
            "num_heads=2",
            "vocab_size=6",
            "heldout_fraction=0.25",
            f"features_cache={tmp_path}/f",
        ]
    )
    assert code == 0
    out, err = capsys.readouterr()
    assert "top1" in json.loads(out.strip().splitlines()[-1])
    # (the target it trains for is named: a forgotten --target trained for the default model without a word)
    assert f"specframe: training medusa for target {tiny_dirs['target'].resolve()}\n" in err, err
    saved = json.loads((tmp_path / "heads" / "medusa_config.json").read_text())["train_config"]
    assert saved["num_heads"] == 2 and saved["tree_nodes"] == 16 and saved["epochs"] == 1
    assert main(["train", "--proposer", "medusa", "--target", str(tiny_dirs["target"]), "stage=5"]) == 2
    assert main(["train", "--proposer", "medusa", "target.model=x", "epochs=1"]) == 2
    assert "target.model=x: train takes its target as --target MODEL" in capsys.readouterr().err
    capsys.readouterr()
    # another trainer's recipe (it names its trainer) is refused before the target loads
    code = main(["train", "--proposer", "medusa", "--target", "/nonexistent", "--config", "train-draft.yaml"])
    err = capsys.readouterr().err
    assert code == 2 and "for proposer 'draft' (their `proposer` key), not 'medusa'" in err, err
    # so are a missing data file and, with --resume, a missing checkpoint (the target at /nonexistent never loads)
    nowhere = ["train", "--proposer", "medusa", "--target", "/nonexistent", f"out={tmp_path / 'none'}"]
    assert main([*nowhere, f"data={tmp_path / 'no.jsonl'}"]) == 2
    assert "distillation data '" in capsys.readouterr().err
    assert main([*nowhere, f"data={tmp_path / 'd.jsonl'}", "--resume"]) == 2
    assert "--resume: no checkpoint in " in capsys.readouterr().err


def test_a_tree_tuned_on_a_cpu_is_rebuilt_for_other_devices(trained, tmp_path):
    # On another device type than the one the saved tree was chosen on, the tree is rebuilt from the heads'
    # path statistics with ACCELERATOR_TREE_NODES nodes. ("meta" stands in for a GPU here.)
    import dataclasses

    from specframe.proposers.medusa import ACCELERATOR_TREE_NODES

    target, cfg, _ = trained
    shutil.copytree(cfg.out, tmp_path / "tuned")
    meta = json.loads((tmp_path / "tuned" / "medusa_config.json").read_text())
    meta.update(tree=[[0]], shape_tuned_on="cpu")
    assert meta.pop("shape_choice") == "measured"  # (saved trees here: the measured one has its own test)
    (tmp_path / "tuned" / "medusa_config.json").write_text(json.dumps(meta))
    info = target_info(target)
    config = MedusaConfig(model=str(tmp_path / "tuned"))
    assert MedusaProposer.from_config(config, info).tree == [(0,)]
    elsewhere = MedusaProposer.from_config(config, dataclasses.replace(info, device=torch.device("meta")))
    assert elsewhere.tree == best_tree(meta["path_counts"], ACCELERATOR_TREE_NODES) and len(elsewhere.tree) > 1
    # Tuned on a GPU ("cuda:0" names the type cuda), used on a CPU: the CPU default tree, not the 64-node one.
    (tmp_path / "tuned" / "medusa_config.json").write_text(json.dumps({**meta, "shape_tuned_on": "cuda:0"}))
    on_cpu = MedusaProposer.from_config(config, info)
    assert on_cpu.tree == [c for c in DEFAULT_TREE if len(c) <= 3]


def test_heads_may_have_their_cpu_tree_measured_on_the_machine(trained, tmp_path, monkeypatch):
    # `"shape_choice": "measured"`: on a CPU, of the best trees of 1-3 nodes by held-out path counts, the one
    # fastest with this machine's timings of the target (specframe/step_costs.py).
    import dataclasses

    from specframe.proposers import medusa
    from specframe.step_costs import StepCosts

    target, cfg, _ = trained
    shutil.copytree(cfg.out, tmp_path / "tuned")
    meta = json.loads((tmp_path / "tuned" / "medusa_config.json").read_text())
    counts = meta["path_counts"]
    write = lambda m: (tmp_path / "tuned" / "medusa_config.json").write_text(json.dumps(m))  # noqa: E731
    write({**meta, "shape_choice": "measured", "tree": [[0]], "shape_tuned_on": "cpu"})
    info = target_info(target)
    config = MedusaConfig(model=str(tmp_path / "tuned"))
    monkeypatch.setattr(medusa, "relative_cost", lambda call, model: call() is None or 0.0)  # (a head: free)
    for relative, nodes in (((1.0, 1.0, 1.0, 1.0), 3), ((1.0, 1.0, 9.0, 9.0), 1)):
        monkeypatch.setattr(medusa, "measure_step_costs", lambda model, r=relative: StepCosts(0.01, r))
        p = MedusaProposer.from_config(config, info)
        assert p.tree == best_tree(counts, nodes) and p.shape_choice.startswith(f"{nodes}-node tree (measured"), nodes
        assert p.measured_shape == f"{nodes}-node tree at first (re-chosen each step by the acceptance so far)"
        assert p.online.choose().shape == tuple(p.tree) and p.online.candidates[0].shape is None
        assert len(p.online.candidates) == 4 and p.shape_choice.endswith(p.online.describe())
        dec = SpeculativeDecoder(target, p)
        assert dec.generate([1, 2, 3], max_new_tokens=10).token_ids == reference_greedy(target, [1, 2, 3], 10)
        fixed = MedusaProposer.from_config(dataclasses.replace(config, adapt_shape=False), info)
        assert fixed.online is None and fixed.tree == p.tree and fixed.measured_shape == f"{nodes}-node tree"
        dec = SpeculativeDecoder(target, fixed)
        assert dec.generate([1, 2, 3], max_new_tokens=10).token_ids == reference_greedy(target, [1, 2, 3], 10)
    # Each candidate's chance of acceptance at each depth is the held-out share of its paths there.
    candidates = medusa.tree_candidates(counts, StepCosts(0.01, (1.0, 1.0, 1.0, 1.0)))
    for c in candidates:
        shares = [0] * len(c.shape[-1])
        for path in c.shape:
            shares[len(path) - 1] += counts["counts"].get(",".join(map(str, path)), 0) / counts["positions"]
        assert c.reach == pytest.approx(shares) and [len(c.shape) for c in candidates] == [1, 2, 3]
        assert c.accepted_length == pytest.approx(1 + sum(c.reach)) and c.verify_tokens == len(c.shape) + 1
    # A head's product is timed (its logits' top candidate), and weighed once per level of a tree, in the load-time
    # choice and in each step's.
    timed = []
    monkeypatch.setattr(medusa, "measure_step_costs", lambda model: StepCosts(0.01, (1.0, 1.0, 1.0, 1.0)))
    monkeypatch.setattr(medusa, "relative_cost", lambda call, model: timed.append(call()) or 0.5)
    p = MedusaProposer.from_config(config, info)
    assert len(timed) == 1 and timed[0].indices.shape == (1, 1) and ", a head 0.50) at first" in p.shape_choice
    assert [c.drafter_forwards for c in candidates] == [len(c.shape[-1]) for c in candidates]
    assert p.online.cost[1:] == [1.0 + 0.5 * c.drafter_forwards for c in candidates]
    monkeypatch.setattr(medusa, "relative_cost", lambda call, model: 0.0)
    # Two nodes win when a third token costs more than its expected gain and a second one costs nothing.
    one, two, three = (expected_accepted_length(counts, best_tree(counts, n)) for n in (1, 2, 3))
    monkeypatch.setattr(medusa, "measure_step_costs", lambda model: StepCosts(0.01, (1.0, 1.0, 1.0, 2 * three / two)))
    assert len(MedusaProposer.from_config(config, info).tree) == (2 if two > one else 1)

    def refuse(model):
        raise AssertionError("timed")

    monkeypatch.setattr(medusa, "measure_step_costs", refuse)
    # A configured tree (or size) wins; on another device ("meta" stands in for a GPU) nothing is timed either.
    assert MedusaProposer.from_config(MedusaConfig(model=config.model, tree_nodes=2), info).shape_choice is None
    assert MedusaProposer.from_config(MedusaConfig(model=config.model, tree=[[0], [1]]), info).tree == [(0,), (1,)]
    far = MedusaProposer.from_config(config, dataclasses.replace(info, device=torch.device("meta")))
    assert far.shape_choice is None and len(far.tree) > 3
    write({**meta, "shape_choice": "measured", "path_counts": None})
    with pytest.raises(ModelLoadError, match='shape_choice "measured" needs the heads\' path_counts'):
        MedusaProposer.from_config(config, info)
    write({**meta, "shape_choice": 1})
    with pytest.raises(ModelLoadError, match=r"shape_choice in .*medusa_config.json must be one of saved, measured"):
        MedusaProposer.from_config(config, info)


def test_stage2_resumed_with_no_epoch_left_still_counts_its_heldout(tmp_path):
    # (it saves again; n_held was set only inside the epoch loop, so the saved metrics said 0 held-out positions)
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    write_distill_data(tmp_path / "d.jsonl", target, n=20)
    cfg = MedusaTrainConfig(
        data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "m"), stage=2, num_heads=2, heldout_fraction=0.2,
        epochs=1, features_cache="",
    )  # fmt: skip
    first = train_medusa(cfg, target, None, log=lambda m: None)
    again = train_medusa(cfg, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), None, resume=True,
                         log=lambda m: None)  # fmt: skip
    assert first["heldout_positions"] > 0 and again["heldout_positions"] == first["heldout_positions"]


@torch.no_grad()
def test_after_steps_it_drafts_as_a_fresh_proposer_on_the_same_tokens():
    # (heads fed the root's row instead of the last accepted token's stayed exact and passed every test: only
    # acceptance fell)
    target = tiny_llama(vocab_size=8, seed=0)
    info = target_info(target)
    proposer = MedusaProposer.random(info, seed=1)
    steps = recorded_proposals(proposer)
    out = SpeculativeDecoder(target, proposer).generate([1, 2, 3], max_new_tokens=30, temperature=0.0)
    assert out.stats["accepted_tokens"] > 0  # (some step kept drafts: the next one reads a later row)
    assert len(steps) == out.stats["target_forwards"] - 1  # (a proposal before every verification)
    for step in steps:
        again = fresh_proposal(MedusaProposer.random(info, seed=1), target, step.tokens, step.max_depth)
        assert again.tokens.tolist() == step.proposal.tokens.tolist()


# (tests from a mutation review of training, 2026-12-06: each fails on the mutation it is named for)


def test_held_out_top5_counts_rank_five_and_not_rank_six():
    from specframe.training.medusa import evaluate

    class Heads:
        num_heads = 1

        def logits(self, x, lm_rows):  # [K, B, V]: column c scores -c, so column c is rank c
            return -torch.arange(8.0).repeat(x.shape[0], 1)[None]

    vocab_ids = torch.arange(100, 108)
    x = torch.zeros(3, 4)
    y = torch.tensor([[104], [105], [100]])  # ranks 4 (5th), 5 (6th), 0 (1st)
    m = evaluate(Heads(), torch.zeros(8, 4), vocab_ids, x, y)
    assert m["top1"] == [pytest.approx(1 / 3)] and m["top5"] == [pytest.approx(2 / 3)]
    assert m["path_counts"]["counts"] == {"4": 1, "5": 1, "0": 1} and m["positions"] == 3


def test_held_out_metrics_count_response_positions_even_with_prompt_positions(tmp_path):
    from specframe.training.common import to_sequences

    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=20)
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    cfg = MedusaTrainConfig(data=str(data), out=str(tmp_path / "out"), num_heads=2, tree_nodes=4, epochs=1,
                            batch_size=8, heldout_fraction=0.2, vocab_size=12, prompt_positions=True)  # fmt: skip
    final = train_medusa(cfg, target, None, log=lambda m: None)
    held = split_heldout(read_distill(data), 0.2, 0)[1]
    want = sum(len(s.ids) - s.first_target for s in to_sequences(held, cfg.max_length))
    assert final["heldout_positions"] == want and final["heldout"]["positions"] == want


def one_token_heldout_data(tmp, target):
    """Distilled data whose held-out responses are one token each: no held-out position has a head label."""
    write_distill_data(tmp / "d.jsonl", target, n=60, response_length=8)
    _, held = split_heldout(read_distill(str(tmp / "d.jsonl")), 0.2, 0)
    held_ids = {e.id for e in held}
    rows = [json.loads(line) for line in (tmp / "d.jsonl").read_text().splitlines()]
    for r in rows:
        r["response_ids"] = r["response_ids"][:1] if r["id"] in held_ids else r["response_ids"]
    (tmp / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("stage", [1, 2])
def test_heads_without_heldout_path_statistics_train_and_use_the_default_tree(tmp_path, stage):
    # (the first epoch's log asked for a tree from empty statistics and raised, before the epoch's checkpoint)
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2, initializer_range=0.1)
    one_token_heldout_data(tmp_path, target)
    cfg = MedusaTrainConfig(
        data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "heads"), stage=stage, num_heads=2, vocab_size=12,
        epochs=1, heldout_fraction=0.2, tree_nodes=4, features_cache="", lora_rank=2,
    )  # fmt: skip
    logs: list[str] = []
    metrics = train_medusa(cfg, target, None, log=logs.append)
    assert metrics["heldout"]["tree_nodes"] == 0 and metrics["heldout"]["expected_accepted_length"] is None
    assert any("no held-out path statistics" in m for m in logs)
    assert any("the held-out split gave no path statistics" in m for m in logs)
    assert json.loads((tmp_path / "heads" / "medusa_config.json").read_text())["tree"] is None
    proposer = MedusaProposer.from_config(MedusaConfig(model=cfg.out), target_info(target))
    assert proposer.tree == [c for c in DEFAULT_TREE if len(c) <= 2]


def test_stage2_counts_training_positions_as_stage1_and_batches_8_sequences(tmp_path):
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2, initializer_range=0.1)
    write_distill_data(tmp_path / "d.jsonl", target, n=30, response_length=8)
    counted = {}
    for stage in (1, 2):
        cfg = MedusaTrainConfig(
            data=str(tmp_path / "d.jsonl"), out=str(tmp_path / f"s{stage}"), stage=stage, num_heads=2,
            vocab_size=12, epochs=1, heldout_fraction=0.2, tree_nodes=4, features_cache="", lora_rank=2,
        )  # fmt: skip
        assert cfg.batch_size == (512 if stage == 1 else 8)  # (positions, or sequences, per step)
        counted[stage] = train_medusa(cfg, target, None, log=lambda m: None)["train_positions"]
    assert counted[1] == counted[2] > 0  # (stage 2 counted every token, prompts included)


def test_a_stopped_stage2_run_leaves_the_callers_target_as_it_was(tmp_path):
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2, initializer_range=0.1)
    write_distill_data(tmp_path / "d.jsonl", target, n=30, response_length=8)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    cfg = MedusaTrainConfig(
        data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "m2"), stage=2, num_heads=2, vocab_size=12, epochs=2,
        heldout_fraction=0.2, features_cache="", lora_rank=2, lr=1e-2,
    )  # fmt: skip

    def stop_after_an_epoch(message):
        if message.startswith("epoch 1:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_medusa(cfg, target, None, log=stop_after_an_epoch)
    assert not any("lora" in name for name, _ in target.named_modules())
    assert target.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
