"""Sliding-window targets and drafts (Mistral, Gemma 2 and 3, Qwen2 with use_sliding_window, ...): the types in
PAST_WINDOW_MODEL_TYPES served exactly past their window (trees included); other types served inside it, stopped at
its end, and a prompt that fills it refused."""

import pytest
import torch

from specframe import SpeculativeDecoder, cpu_kernels, kv_cache
from specframe.cpu_kernels import FAST_ATTENTION_MODEL_TYPES
from specframe.decoder import target_info
from specframe.errors import BadInputError
from specframe.kv_cache import (
    PAST_WINDOW_MODEL_TYPES,
    GrowingLayer,
    SlidingLayout,
    attention_window,
    context_window,
    new_cache,
    sliding_layout,
    tree_attention_mask,
)
from specframe.proposer import seeded
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.eagle import EagleConfig, EagleProposer
from specframe.proposers.medusa import MedusaProposer
from specframe.proposers.none import NoneConfig, NoneProposer
from specframe.testing.tiny import available_devices

WINDOW = 48  # every tiny model's smallest sliding window; their max_position_embeddings is 512
SHAPE = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.5, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)  # fmt: skip
ARCHS = ["mistral", "qwen2", "gemma2", "gemma3"]
SEEDS = {"mistral": 0, "qwen2": 2, "gemma2": 2, "gemma3": 1}  # (weights whose greedy output varies)
HYBRID = ["sliding_attention", "full_attention"]
# Every type served past its window, by the name tiny_sliding builds it under: (model type, every layer slides)
PAST_ARCHS = {
    "mistral": ("mistral", True),
    "mixtral": ("mixtral", True),
    "qwen2": ("qwen2", False),
    "qwen2_moe": ("qwen2_moe", False),
    "qwen3": ("qwen3", False),
    "gemma2": ("gemma2", False),
    "gemma3": ("gemma3_text", False),
    "starcoder2": ("starcoder2", True),
    "phi3": ("phi3", True),
    "olmo3": ("olmo3", False),
    "smollm3": ("smollm3", False),
    "gpt_oss": ("gpt_oss", False),
}


def tiny_sliding(arch, window=WINDOW, seed=None, vocab_size=32):
    """A tiny random model of `arch` with sliding-window layers (all of them, or some: hybrid); by default with
    weights whose greedy output is not one token repeated."""
    import transformers as t

    moe = dict(num_experts_per_tok=1)
    shape = {**SHAPE, "vocab_size": vocab_size}
    if arch == "mistral":
        model_class, config = t.MistralForCausalLM, t.MistralConfig(**shape, sliding_window=window)
    elif arch == "mixtral":
        config = t.MixtralConfig(**shape, sliding_window=window, num_local_experts=2, **moe)
        model_class = t.MixtralForCausalLM
    elif arch == "qwen2":  # (layers from max_window_layers on slide)
        config = t.Qwen2Config(**shape, use_sliding_window=True, sliding_window=window, max_window_layers=1)
        model_class = t.Qwen2ForCausalLM
    elif arch == "qwen2_moe":
        config = t.Qwen2MoeConfig(
            **shape, use_sliding_window=True, sliding_window=window, max_window_layers=1, num_experts=2, **moe,
            moe_intermediate_size=16, shared_expert_intermediate_size=16,
        )  # fmt: skip
        model_class = t.Qwen2MoeForCausalLM
    elif arch == "qwen3":
        config = t.Qwen3Config(**shape, head_dim=8, use_sliding_window=True, sliding_window=window, max_window_layers=1)
        model_class = t.Qwen3ForCausalLM
    elif arch == "gemma2":  # (no SDPA attention in transformers: eager, as specframe.models loads it; untied
        # embeddings: with tied ones, a tiny Gemma repeats the prompt's last token)
        config = t.Gemma2Config(
            **shape, head_dim=8, sliding_window=window, attn_implementation="eager", tie_word_embeddings=False
        )
        model_class = t.Gemma2ForCausalLM
    elif arch == "gemma3":  # layers 0 and 2 slide, 1 attends to everything; the larger window is not the one that
        # counts
        layers = ["sliding_attention", "full_attention", "sliding_attention"]
        shape = {**shape, "num_hidden_layers": 3}
        config = t.Gemma3TextConfig(
            **shape, head_dim=8, sliding_window=window, layer_types=layers, tie_word_embeddings=False
        )
        model_class = t.Gemma3ForCausalLM
    elif arch == "starcoder2":
        model_class, config = t.Starcoder2ForCausalLM, t.Starcoder2Config(**shape, sliding_window=window)
    elif arch == "phi3":
        model_class, config = t.Phi3ForCausalLM, t.Phi3Config(**shape, sliding_window=window)
    elif arch == "olmo3":
        model_class, config = t.Olmo3ForCausalLM, t.Olmo3Config(**shape, sliding_window=window, layer_types=HYBRID)
    elif arch == "smollm3":
        config = t.SmolLM3Config(**shape, use_sliding_window=True, sliding_window=window, layer_types=HYBRID)
        model_class = t.SmolLM3ForCausalLM
    else:  # gpt_oss
        config = t.GptOssConfig(
            **shape, head_dim=8, sliding_window=window, num_local_experts=2, **moe, layer_types=HYBRID
        )
        model_class = t.GptOssForCausalLM
    with seeded(SEEDS.get(arch, 0) if seed is None else seed):
        model = model_class(config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture
def inside_only(monkeypatch):
    """Every sliding-window model served inside its window only, as a type not in PAST_WINDOW_MODEL_TYPES is."""
    monkeypatch.setattr(kv_cache, "PAST_WINDOW_MODEL_TYPES", frozenset())


def transformers_greedy(model, prompt, n):
    """transformers' own greedy generation, with its own (sliding-window) cache."""
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def proposer_for(name, model):
    from specframe.plugins import get_registry

    info = target_info(model)
    if name == "none":
        return NoneProposer(NoneConfig(), info)
    if name == "self-draft":  # the target drafting for itself: a sliding-window draft, every draft accepted
        return DraftProposer(DraftConfig(num_speculative_tokens=4), info, model)
    if name == "draft":
        return DraftProposer.random(info, DraftConfig(num_speculative_tokens=3), seed=1)
    if name == "medusa":
        return MedusaProposer.random(info, seed=1)
    if name == "eagle":
        return EagleProposer.random(info, EagleConfig(depth=3, top_k=2, total_tokens=6), seed=1)
    return get_registry().get(name).cls.random(info)  # ngram: token trees from the repeated prompt


PROMPT = [3, 5, 7, 3, 5, 7, 3, 5, 9, 11]  # (repeats: n-gram drafts, some accepted)
PROPOSERS = ["none", "self-draft", "draft", "medusa", "eagle", "ngram"]


def test_the_attention_window_is_the_smallest_sliding_window_and_the_cache_keeps_every_position(monkeypatch):
    assert PAST_WINDOW_MODEL_TYPES == {model_type for model_type, _ in PAST_ARCHS.values()}  # (each one tested)
    for arch, (model_type, every_layer) in PAST_ARCHS.items():
        model = tiny_sliding(arch)
        assert model.config.model_type == model_type
        assert attention_window(model) == WINDOW and context_window(model) == 512, arch  # (served past it)
        assert sliding_layout(model) == SlidingLayout(WINDOW, every_layer), arch
        assert all(type(layer) is GrowingLayer for layer in new_cache(model).layers), arch
    monkeypatch.setattr(kv_cache, "PAST_WINDOW_MODEL_TYPES", frozenset())  # (types served inside it only)
    for arch in ARCHS:
        model = tiny_sliding(arch)
        assert attention_window(model) == context_window(model) == WINDOW and sliding_layout(model) is None, arch
    mistral = tiny_sliding("mistral", window=1000)  # (a window past max_position_embeddings: the latter counts)
    assert attention_window(mistral) == 1000 and context_window(mistral) == 512
    monkeypatch.undo()
    gemma = tiny_sliding("gemma3")  # (sliding layers of two windows: a mask per layer type cannot tell them apart)
    gemma.config.layer_types = ["sliding_attention", "sliding_attention", "sliding_attention"]
    windows = iter([WINDOW, WINDOW, 2 * WINDOW])
    monkeypatch.setattr(kv_cache.DynamicSlidingWindowLayer, "__init__", lambda self, sliding_window, **kw: (
        kv_cache.DynamicLayer.__init__(self), setattr(self, "sliding_window", next(windows))
    )[0])  # fmt: skip
    assert sliding_layout(gemma) is None
    from specframe.testing.tiny import tiny_llama

    assert attention_window(tiny_llama()) is None and context_window(tiny_llama(max_position_embeddings=64)) == 64


def test_a_one_mask_type_whose_layer_types_are_not_all_sliding_is_served_inside_its_window_only():
    # (Mistral, Mixtral, Starcoder2 and Phi-3 give every layer the one sliding mask whatever `layer_types` says: a
    # mask per layer type, as a tree past the window would get, fails in their forward, 'dict' has no 'ndim')
    import transformers as t

    from specframe.kv_cache import ONE_MASK_MODEL_TYPES
    from specframe.testing.conformance import reference_greedy

    assert ONE_MASK_MODEL_TYPES == {kind for kind, every_layer in PAST_ARCHS.values() if every_layer}
    for arch in ["mistral", "mixtral", "starcoder2", "phi3"]:
        model = tiny_sliding(arch, window=16)
        model.config.layer_types = ["sliding_attention", "full_attention"]
        assert sliding_layout(model) is None and context_window(model) == 16, arch
    with seeded(0):
        model = t.MistralForCausalLM(t.MistralConfig(**SHAPE, sliding_window=16, layer_types=HYBRID)).eval()
    res = SpeculativeDecoder(model, proposer_for("ngram", model)).generate(PROMPT, max_new_tokens=20)
    assert res.stats["finish_reason"] == "context" and res.token_ids == reference_greedy(model, PROMPT, 6)


def test_an_eagle_drafter_for_gemma_3_rotates_as_its_full_attention_layers_do():
    # (Gemma 3 gives each layer type its own rotary parameters; the drafter's one layer attends to everything)
    from specframe.proposers.eagle import drafter_config

    config = tiny_sliding("gemma3").config
    assert drafter_config(config, 32).rope_parameters == config.rope_parameters["full_attention"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_output_inside_the_window_is_transformers_own(arch, proposer):
    model = tiny_sliding(arch)
    want = transformers_greedy(model, PROMPT, 20)
    res = SpeculativeDecoder(model, proposer_for(proposer, model)).generate(PROMPT, max_new_tokens=20)
    assert res.token_ids == want and res.stats["finish_reason"] == "length"
    assert len(set(want)) > 1  # (not one token repeated)


@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("arch", list(PAST_ARCHS))
def test_a_token_tree_past_the_window_scores_each_node_as_the_model_scores_its_path(arch, device):
    # (a window of 4 after 12 cached tokens: every row's window cuts into the cache; the chain 0-5 is deeper than
    # the window, so its deepest nodes must not see their first ancestors either)
    model = tiny_sliding(arch, window=4).to(device)
    ids = lambda tokens: torch.tensor([tokens], device=device)  # noqa: E731
    sequence = [3, 5, 7, 3, 5, 7, 3, 5, 9, 11, 2, 4]
    parents = [-1, 0, 1, 2, 3, 4, -1, 6, 0]  # (depths 1-6 along the chain; 1-2 on the branch; 2 off node 0)
    nodes = [6, 8, 10, 12, 14, 16, 7, 9, 13]
    cache, past = new_cache(model), len(sequence) - 1
    with torch.no_grad():
        model(input_ids=ids(sequence[:-1]), cache=cache, use_cache=True)
        depths = [0]
        for parent in parents:
            depths.append(depths[parent + 1] + 1)
        mask = tree_attention_mask(parents, past, torch.float32, torch.device(device), sliding_layout(model))
        tree = model(
            input_ids=ids([sequence[-1], *nodes]), position_ids=ids([past + d for d in depths]), attention_mask=mask,
            cache=cache, use_cache=True,
        ).logits[0]  # fmt: skip
        for row in range(len(nodes) + 1):
            path, node = [], row - 1
            while node >= 0:
                path.insert(0, nodes[node])
                node = parents[node]
            alone = model(input_ids=ids(sequence + path)).logits[0, -1]  # (the model's own masks)
            assert torch.allclose(tree[row], alone, atol=1e-5 if device == "cpu" else 1e-4), (arch, row)


@pytest.mark.parametrize("device", available_devices())
@pytest.mark.parametrize("arch", list(PAST_ARCHS))
def test_greedy_output_past_the_window_is_transformers_own(arch, device):
    # (a window of 8, a 10-token prompt, 40 new tokens: every proposer's verifications, trees and chains, past it)
    model = tiny_sliding(arch, window=8).to(device)
    want = transformers_greedy(model, PROMPT, 40)
    assert len(set(want)) > 2  # (not one token repeated)
    for proposer in PROPOSERS:
        res = SpeculativeDecoder(model, proposer_for(proposer, model)).generate(PROMPT, max_new_tokens=40)
        assert res.token_ids == want and res.stats["finish_reason"] == "length", (arch, proposer)
        if proposer == "self-draft":  # (the target as its own draft: it drafts past its window, all accepted)
            assert res.stats["accepted_tokens"] == res.stats["proposed_tokens"] > 30, res.stats


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sampling_past_the_window_is_the_target_s_distribution(arch):
    # (a window of 3 behind a 7-token prompt, a vocabulary of 8: every verification past it, Medusa's and EAGLE's
    # trees included; a chi-square against the distribution enumerated from the model's own no-cache forwards, as
    # the conformance suite checks it: a p-value below ALPHA is sampled again on fresh seeds)
    from specframe.sampling import SamplingParams
    from specframe.testing.conformance import (
        ALPHA,
        CONTINUATION,
        SamplingCase,
        chi_square,
        exact_distribution,
        sample_counts,
    )

    model = tiny_sliding(arch, window=3, seed=0, vocab_size=8)
    case = SamplingCase(SamplingParams(1.0, 0, 1.0), prompt=(5, 1, 7, 2, 6, 3, 1), extra=2, samples=3000)
    probs = exact_distribution(model, list(case.prompt), case.lead + CONTINUATION, case.params)
    probs = probs.reshape(8**case.lead, 8**CONTINUATION).sum(0)
    for proposer in ("medusa", "eagle"):
        decoder, drafts = SpeculativeDecoder(model, proposer_for(proposer, model)), [0, 0]
        p = chi_square(sample_counts(decoder, case, case.samples, drafts=drafts), probs)[2]
        if p < ALPHA:
            p = max(p, chi_square(sample_counts(decoder, case, case.samples, seed=case.samples), probs)[2])
        assert p >= ALPHA and drafts[1] > 100, (arch, proposer, p, drafts)


@pytest.mark.parametrize("arch", sorted(FAST_ATTENTION_MODEL_TYPES & set(PAST_ARCHS)))
def test_past_the_window_on_specframe_s_cpu_kernels_too(arch, monkeypatch):
    # (their attention, specframe_sdpa, takes the masks as transformers' sdpa does)
    monkeypatch.setattr(cpu_kernels, "layout_choice", cpu_kernels.FEW_ROWS)  # (every linear layer rerouted)
    model = tiny_sliding(arch, window=8)
    want = transformers_greedy(model, PROMPT, 40)
    cpu_kernels.use_fast_cpu_kernels(model)
    assert model.config._attn_implementation == cpu_kernels.ATTENTION
    for proposer in ["none", "medusa", "eagle", "ngram"]:
        res = SpeculativeDecoder(model, proposer_for(proposer, model)).generate(PROMPT, max_new_tokens=40)
        assert res.token_ids == want, (arch, proposer)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("proposer", ["none", "self-draft", "eagle", "ngram"])
def test_generation_stops_at_the_sliding_window_and_never_verifies_past_it(arch, proposer, inside_only):
    model = tiny_sliding(arch)
    dec = SpeculativeDecoder(model, proposer_for(proposer, model))
    positions = []  # the largest position each forward fed (a tree's nodes: past + depth)
    verify = dec.acceptance

    def record(logits, proposal, *rest):
        past = dec.cache.get_seq_length() - len(proposal) - 1  # (the forward's rows are in the cache by now)
        positions.append(past + max(rest[2].depths if len(rest) > 2 else [], default=0))
        return verify(logits, proposal, *rest)

    dec.acceptance = record
    res = dec.generate(PROMPT, max_new_tokens=100)
    assert res.stats["finish_reason"] == "context" and len(PROMPT) + len(res.token_ids) == WINDOW
    assert res.token_ids == transformers_greedy(model, PROMPT, WINDOW - len(PROMPT))
    assert max(positions) == WINDOW - 2, positions  # (the window's last token is emitted, never fed)
    if proposer in ("self-draft", "ngram"):
        assert res.stats["accepted_tokens"] > 0  # (verification blocks of several tokens reached the window's end)


def test_a_prompt_that_fills_the_window_is_refused_by_name(inside_only):
    model = tiny_sliding("mistral")
    dec = SpeculativeDecoder(model, NoneProposer(NoneConfig(), target_info(model)))
    with pytest.raises(BadInputError, match=f"the prompt has {WINDOW} tokens; the target's sliding attention window "
                       f"is {WINDOW}, which leaves no room for a new token") as e:  # fmt: skip
        dec.generate([1] * WINDOW)
    assert "sliding-window model of type 'mistral' only inside its window" in str(e.value)
    assert len(dec.generate([1] * (WINDOW - 1), max_new_tokens=5).token_ids) == 1


def test_a_sliding_window_draft_drafts_nothing_from_its_window_on(inside_only):
    # A Llama target with room to spare and a draft (its own vocabulary) whose sliding window is 16: the draft
    # never feeds a position at or past 16; from there on the steps are plain decoding steps, and the output is the
    # target's all along.
    from specframe.testing.conformance import reference_greedy
    from specframe.testing.tiny import tiny_llama

    target = tiny_llama(vocab_size=32, seed=0, max_position_embeddings=256)
    draft_model = tiny_sliding("mistral", window=16, seed=2)
    draft = DraftProposer(DraftConfig(num_speculative_tokens=4), target_info(target), draft_model)
    fed, proposed = [], []  # the draft cache's length after each feed; (sequence length, tokens drafted)
    forward, propose = draft._next_logits, draft.propose
    draft._next_logits = lambda tokens: [forward(tokens), fed.append(draft.cache.get_seq_length())][0]
    draft.propose = lambda state: [p := propose(state), proposed.append((state.tokens.numel(), len(p)))][0]
    res = SpeculativeDecoder(target, draft).generate(PROMPT, max_new_tokens=30)
    assert res.token_ids == reference_greedy(target, PROMPT, 30)
    assert max(fed) == 16  # (positions 0-15 fed, the last of them inside the window)
    assert all(n == 0 for length, n in proposed if length > 16) and any(n > 0 for _, n in proposed), proposed


def test_distill_and_training_take_a_sliding_window_target_and_distill_stops_at_its_window(
    tiny_dirs, tmp_path, capsys, inside_only
):
    # (as the decoder does: prompts that fill the window are skipped, responses end where it is full)
    import json

    from transformers import AutoTokenizer

    from specframe.data import distill, read_distill
    from specframe.training.common import start_run
    from specframe.training.eagle import EagleTrainConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["target"])  # (words a-f are ids 2-7)
    model = tiny_sliding("mistral", window=8)
    prompts = [{"id": f"q{n}", "prompt": " ".join("abcdef"[:n])} for n in range(1, 7)]
    out = tmp_path / "d.jsonl"
    assert distill(model, tokenizer, prompts, out, max_new_tokens=10, batch_size=2, raw=True) == 6
    rows = {r.id: r for r in read_distill(out)}
    # (a batch's prompts are padded to its longest: that one's response fills the window)
    assert max(len(r.prompt_ids) + len(r.response_ids) for r in rows.values()) == 8
    for r in rows.values():  # (unfinished: the window, not max_new_tokens, ended each response)
        assert len(r.prompt_ids) + len(r.response_ids) <= 8 and not r.finished
        assert r.response_ids == transformers_greedy(model, r.prompt_ids, len(r.response_ids))
    distill(model, tokenizer, [{"id": "long", "prompt": "a b c d e f a b"}], out, max_new_tokens=10, raw=True)
    assert "longer than 7 tokens (the target's sliding attention window is 8)" in capsys.readouterr().err
    rows = [{"id": f"p{i}", "prompt_ids": [2, 3], "response_ids": [4, 5, 6]} for i in range(10)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = EagleTrainConfig(data=str(tmp_path / "t.jsonl"), out=str(tmp_path / "o"), heldout_fraction=0.3)
    logs: list[str] = []
    train, held, _ = start_run(config, model, None, log=logs.append)
    assert train and held
    # (its max_length, 512, reaches past the window: said, as those positions are never drafted for)
    assert any(
        "train.max_length=512 is longer than the target's sliding attention window (8 tokens)" in m for m in logs
    )
    logs.clear()
    start_run(EagleTrainConfig(**{**config.__dict__, "max_length": 8}), model, None, log=logs.append)
    assert not any("max_length" in m for m in logs), logs


def test_the_command_line_names_the_sliding_window(tiny_dirs, tmp_path, capsys, inside_only):
    import json

    from transformers import AutoTokenizer

    from specframe.cli import main

    tiny_sliding("mistral", window=8).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_dirs["target"]).save_pretrained(tmp_path)
    args = ["generate", "--target", str(tmp_path), "--proposer", "none", "--raw", "--prompt"]
    code = main([*args, "a b c d e", "--max-new-tokens", "6", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["stats"]["finish_reason"] == "context"
    assert "stopped after 3 of generation.max_new_tokens=6 tokens: the target's sliding attention window (8" in err
    assert main([*args, " ".join(["a"] * 8)]) == 2
    err = capsys.readouterr().err
    assert "the prompt has 8 tokens; the target's sliding attention window is 8" in err and "Traceback" not in err


def test_the_command_line_generates_past_the_window_of_a_type_served_past_it(tiny_dirs, tmp_path, capsys):
    import json

    from transformers import AutoTokenizer

    from specframe.cli import main

    model = tiny_sliding("mistral", window=8)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_dirs["target"]).save_pretrained(tmp_path)
    args = ["generate", "--target", str(tmp_path), "--proposer", "none", "--raw", "--json", "--prompt"]
    assert main([*args, " ".join(["a"] * 12), "--max-new-tokens", "20"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["finish_reason"] == "length" and len(out["token_ids"]) == 20
    assert out["token_ids"] == transformers_greedy(model, [2] * 12, 20)


def test_the_bench_s_transformers_baselines_stop_at_the_sliding_window_too(inside_only):
    # (a turn of every method ends at the same token, so their outputs and speeds compare)
    from specframe import bench

    model = tiny_sliding("mistral")
    hf = bench.hf_method("hf", model, bench.ForwardCounter(model), [], bench.BenchOptions(), "plain")
    plain = SpeculativeDecoder(model, NoneProposer(NoneConfig(), target_info(model)))
    assert hf.run(PROMPT, 100, 0).token_ids == plain.generate(PROMPT, max_new_tokens=100).token_ids
    assert len(hf.run(PROMPT, 100, 0).token_ids) == WINDOW - len(PROMPT)
    with pytest.raises(BadInputError, match=f"the target's sliding attention window is {WINDOW}"):
        hf.run([1] * WINDOW, 4, 0)
