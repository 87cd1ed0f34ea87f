"""The conformance suite on tiny targets of other model types than Llama (`specframe check --arch`)."""

import pytest
import torch

from specframe import decoder as decoder_module
from specframe.errors import BadInputError
from specframe.kv_cache import attention_window, sliding_layout
from specframe.plugins import get_registry
from specframe.proposers.eagle import EagleProposer
from specframe.testing import conformance
from specframe.testing.suite import VARIANT_SETTINGS, ProposerConformance
from specframe.testing.tiny import TINY_CONFIGS, TINY_WINDOW, tiny_target

# Model types without sliding windows, on transformers' defaults and the shared tiny shape.
PLAIN_TYPES = ["gpt2", "opt", "falcon", "phi", "cohere", "granite", "olmo2", "stablelm", "gpt_neox"]
# Types whose attention reads positions from cache slots (ALiBi, GPT-Neo's local windows): trees are refused.
CHAINS_ONLY = {"bloom", "mpt", "gpt_neo"}


def test_tiny_targets_of_each_type_with_their_sliding_windows():
    for model_type in ["llama", *TINY_CONFIGS, *PLAIN_TYPES]:
        model = tiny_target(model_type, vocab_size=8, seed=0)
        assert model.config.model_type == model_type and model.get_output_embeddings().weight.shape[0] == 8
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]])).logits
        assert logits.shape == (1, 6, 8) and torch.isfinite(logits).all(), model_type
        slides = "sliding_window" in TINY_CONFIGS.get(model_type, {})
        assert (attention_window(model) == TINY_WINDOW) == slides, model_type
        if slides and model_type != "gpt_neo":  # (its local window is kept by slot: chains only)
            assert sliding_layout(model) is not None, model_type  # (served past the window: trees are masked)
    again = tiny_target("qwen2", vocab_size=8, seed=0)
    assert all(
        torch.equal(a, b) for a, b in zip(again.parameters(), tiny_target("qwen2", 8, 0).parameters(), strict=True)
    )
    assert tiny_target("qwen2", 8, 0, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(BadInputError, match="knows no model type 'qwen9'"):
        tiny_target("qwen9")
    with pytest.raises(BadInputError, match="knows no model type 'qwen9'"):
        conformance.run_suite(EagleProposer, devices=["cpu"], quick=True, archs=["qwen2", "qwen9"])
    # types it cannot check on, refused before anything runs, each saying why
    for model_type, why in (
        ("t5", "has no causal LM for model type 't5'"),
        ("gemma3", "does not take a tiny shape .* give the type of its text decoder"),  # (not a 2.7B model built)
        ("bert", "a tiny 'bert' model is not a causal decoder"),  # (an encoder: attends to later tokens)
        ("openai-gpt", "a tiny 'openai-gpt' model returns no KV cache"),
    ):
        with pytest.raises(BadInputError, match=why):
            conformance.suite_archs(["qwen2", model_type])
    assert conformance.suite_archs("qwen2") == ["qwen2"]  # (one type: not its letters)


def test_a_type_whose_config_fails_a_step_of_several_tokens_is_refused(monkeypatch):
    # (DeepSeek's multi-head latent attention with fewer key-value heads than query heads: a one-token step
    # runs, a verification's several tokens fail in its attention; before, every proposer's checks failed with it)
    assert tiny_target("deepseek_v3").config.num_key_value_heads == 2
    monkeypatch.setitem(TINY_CONFIGS, "deepseek_v3", {**TINY_CONFIGS["deepseek_v3"], "num_key_value_heads": 1})
    with pytest.raises(BadInputError, match="a tiny 'deepseek_v3' model fails a cached step of several tokens"):
        tiny_target("deepseek_v3")


def test_the_suite_on_other_types_catches_a_tree_mask_without_the_window(monkeypatch):
    archs = ["mistral", "qwen2", "gemma3_text", "gpt2"]
    report = conformance.run_suite(EagleProposer, devices=["cpu"], quick=True, archs=archs)
    assert report.passed and [r.arch for r in report.results] == [a for a in archs for _ in range(3)]
    assert report.results[0].where == "cpu, mistral" and report.results[0].line().startswith("  PASS  greedy [cpu, ")
    real = decoder_module.tree_attention_mask
    monkeypatch.setattr(decoder_module, "tree_attention_mask", lambda *a: real(*a[:4], None))  # (window dropped)
    report = conformance.run_suite(EagleProposer, devices=["cpu"], quick=True, archs=archs)
    failed = {(r.check, r.arch) for r in report.results if not r.passed}
    assert {("greedy", "mistral"), ("greedy", "qwen2"), ("greedy", "gemma3_text")} <= failed
    assert not any(arch == "gpt2" for _, arch in failed)  # (no window, nothing to drop)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(get_registry().proposers))
@pytest.mark.parametrize("model_type", [*TINY_CONFIGS, *PLAIN_TYPES])
def test_registered_proposers_quick_checks_on_every_tiny_type(name, model_type):
    cls = get_registry().get(name).cls
    if model_type in CHAINS_ONLY and name in ("medusa", "eagle", "union", "ngram"):
        with pytest.raises(BadInputError, match="by cache slot"):  # (said, not run wrong)
            conformance.check_greedy(cls, "cpu", arch=model_type)
        return
    report = conformance.run_suite(cls, devices=["cpu"], quick=True, archs=[model_type])
    assert report.passed, "\n".join(r.line() for r in report.results)


class TestEagleOnQwen2(ProposerConformance):
    proposer_class = EagleProposer
    target_arch = "qwen2"  # (a sliding window of 4 on the sliding layers: trees verified past it)
    sampling_settings = VARIANT_SETTINGS


class TestEagleOnGemma3(ProposerConformance):
    proposer_class = EagleProposer
    target_arch = "gemma3_text"  # (a sliding and a full-attention layer)
    sampling_settings = VARIANT_SETTINGS
