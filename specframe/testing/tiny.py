"""Tiny random-weight models for tests: fast, no downloads, peaky enough that acceptance rules matter."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specframe.proposer import seeded


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """PyTorch on one thread for the duration: tiny models gain nothing from threads but synchronisation cost
    (and a busy second core would stall every matmul). The previous count is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_llama(
    vocab_size: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    hidden_size: int = 16,
    num_layers: int = 2,
    initializer_range: float = 0.5,  # large: logits spread over a few tokens, not uniform
    max_position_embeddings: int = 256,
    rope_parameters: dict | None = None,  # (None: transformers' default RoPE)
) -> LlamaForCausalLM:
    extra = {"rope_parameters": rope_parameters} if rope_parameters is not None else {}
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    with seeded(seed):
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# The window of the tiny targets' sliding-window layers: shorter than the conformance checks' sequences, so
# their drafts and trees are verified past it.
TINY_WINDOW = 4
_HYBRID = ["sliding_attention", "full_attention"]
_MOE = {"num_experts_per_tok": 1}
_MLA = {
    "num_key_value_heads": 2, "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
    "v_head_dim": 8, "n_routed_experts": 2, **_MOE, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
}  # fmt: skip
# What a tiny target of a model type needs besides the shared shape (`tiny_target`): sliding windows where the
# type has them, small experts, head sizes and rotary dimensions that fit the 16-wide hidden state.
TINY_CONFIGS: dict[str, dict] = {
    "mistral": {"sliding_window": TINY_WINDOW},
    "mixtral": {"sliding_window": TINY_WINDOW, "num_local_experts": 2, **_MOE},
    "qwen2": {"use_sliding_window": True, "sliding_window": TINY_WINDOW, "max_window_layers": 1},
    "qwen2_moe": {
        "use_sliding_window": True, "sliding_window": TINY_WINDOW, "max_window_layers": 1, "num_experts": 2, **_MOE,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
    },
    "qwen3": {"head_dim": 8, "use_sliding_window": True, "sliding_window": TINY_WINDOW, "max_window_layers": 1},
    "qwen3_moe": {"head_dim": 8, "num_experts": 2, **_MOE, "moe_intermediate_size": 16},
    # (Gemma: untied embeddings, with which a tiny one does not just repeat the prompt's last token; Gemma 2 has no
    # SDPA attention in transformers: eager, as specframe.models loads it)
    "gemma": {"head_dim": 8, "tie_word_embeddings": False},
    "gemma2": {
        "head_dim": 8, "sliding_window": TINY_WINDOW, "attn_implementation": "eager", "tie_word_embeddings": False,
    },
    "gemma3_text": {"head_dim": 8, "sliding_window": TINY_WINDOW, "layer_types": _HYBRID, "tie_word_embeddings": False},
    "starcoder2": {"sliding_window": TINY_WINDOW},
    "phi3": {"sliding_window": TINY_WINDOW},
    "olmo3": {"sliding_window": TINY_WINDOW, "layer_types": _HYBRID},
    "smollm3": {"use_sliding_window": True, "sliding_window": TINY_WINDOW, "layer_types": _HYBRID},
    "gpt_oss": {"head_dim": 8, "sliding_window": TINY_WINDOW, "num_local_experts": 2, **_MOE, "layer_types": _HYBRID},
    "gptj": {"rotary_dim": 4},
    "codegen": {"rotary_dim": 4},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": TINY_WINDOW},
    # (multi-head latent attention: keys and values from an 8-wide latent, 4 of each head's 8 query/key dimensions
    # rotated; as many key-value heads as query heads, which transformers' MLA expects: with fewer, a step of
    # several tokens fails in its attention)
    "deepseek_v2": {**_MLA, "q_lora_rank": None},
    "deepseek_v3": _MLA,
}  # fmt: skip


def tiny_target(
    model_type: str = "llama",
    vocab_size: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """A tiny random-weight causal LM of any transformers model type (`llama`: `tiny_llama`): 2 layers, hidden
    size 16, 2 attention heads sharing 1 key-value head where the type has the notion, weights as large as
    `tiny_llama`'s, plus what TINY_CONFIGS gives the type (a 4-token sliding window where it has one). It must be
    a causal decoder with a working cache (`_check_causal_and_cached`). A type transformers does not know, has no
    causal LM for, keeps its text model's shape in a sub-config (a multimodal type: its text model's type is the
    one to give), or cannot build or run this small is a BadInputError, said before anything runs."""
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from specframe.errors import BadInputError, brief

    if model_type == "llama":
        return tiny_llama(vocab_size, seed=seed, device=device, dtype=dtype)
    if model_type not in CONFIG_MAPPING:
        raise BadInputError(f"transformers {__version__} knows no model type '{model_type}'")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise BadInputError(
            f"transformers {__version__} has no causal LM for model type '{model_type}' (an encoder, an "
            "encoder-decoder or a multimodal type? give the type of a text decoder, e.g. gemma3_text, not gemma3)"
        )
    shape = dict(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.5, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    try:
        config = AutoConfig.for_model(model_type, **{**shape, **TINY_CONFIGS.get(model_type, {})})
    except Exception as e:
        raise BadInputError(f"a tiny '{model_type}' config could not be made: {brief(e, 300, typed=True)}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config or getattr(config, "hidden_size", None) != 16 or config.vocab_size != vocab_size:
        raise BadInputError(
            f"model type '{model_type}' does not take a tiny shape (its text model's sizes are in a sub-config: a "
            "multimodal type?): give the type of its text decoder (e.g. gemma3_text, not gemma3)"
        )
    try:
        with seeded(seed):
            model = AutoModelForCausalLM.from_config(config)
        model.generation_config.eos_token_id = None
        model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        _check_causal_and_cached(model, vocab_size)
    except BadInputError:
        raise
    except Exception as e:
        raise BadInputError(
            f"a tiny random '{model_type}' causal LM could not be built and run: {brief(e, 300, typed=True)}"
        ) from None
    return model


@torch.inference_mode()
def _check_causal_and_cached(model: torch.nn.Module, vocab_size: int) -> None:
    """Raise BadInputError unless `model` is a causal decoder whose cache gives a step of several tokens, and one
    of one token, the logits of a forward over the whole sequence (an encoder built as a "causal LM" attends to
    later tokens; a model that ignores its cache, GPT-1's, forgets the prompt; a verification is a step of
    several tokens, which some configs cannot take: DeepSeek's attention with fewer key-value heads than query
    heads)."""
    from specframe.errors import BadInputError, brief
    from specframe.kv_cache import new_cache

    device = next(model.parameters()).device
    ids = torch.arange(1, 6, device=device)[None] % vocab_size
    full = model(input_ids=ids).logits.float()
    cache = new_cache(model)  # (refuses, clearly, a cache specframe cannot roll back)
    shorter = model(input_ids=ids[:, :2], cache=cache, use_cache=True).logits.float()
    kind = model.config.model_type
    if not torch.allclose(full[:, :2], shorter, atol=1e-3, rtol=1e-3):
        raise BadInputError(f"a tiny '{kind}' model is not a causal decoder: its logits depend on later tokens")
    if cache.get_seq_length() != 2:
        raise BadInputError(f"a tiny '{kind}' model returns no KV cache: specframe verifies with one")
    try:
        steps = [model(input_ids=ids[:, 2:4], cache=cache, use_cache=True).logits.float()]
    except Exception as e:
        raise BadInputError(
            f"a tiny '{kind}' model fails a cached step of several tokens (a verification is one): "
            f"{brief(e, 300, typed=True)}"
        ) from None
    steps.append(model(input_ids=ids[:, 4:], cache=cache, use_cache=True).logits.float())
    if not torch.allclose(full[:, 2:], torch.cat(steps, 1), atol=1e-3, rtol=1e-3):
        raise BadInputError(f"a tiny '{kind}' model's cache does not give its steps the logits of the whole sequence")


def available_devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def write_distill_data(path, target: torch.nn.Module, n: int = 40, seed: int = 0, response_length: int = 6) -> None:
    """Self-distillation data for tests: random prompts and the tiny target's own greedy responses (JSONL), each
    row naming its target as `specframe data distill` does."""
    import json

    from specframe.fingerprint import data_fingerprint
    from specframe.testing.conformance import reference_greedy

    written_by = data_fingerprint(target)
    g = torch.Generator().manual_seed(seed)
    vocab = target.get_output_embeddings().weight.shape[0]
    with open(path, "w") as f:
        for i in range(n):
            length = int(torch.randint(3, 8, (1,), generator=g))
            prompt = torch.randint(0, vocab, (length,), generator=g).tolist()
            row = {
                "id": f"p{i}",
                "source": "test",
                "prompt_ids": prompt,
                "response_ids": reference_greedy(target, prompt, response_length),
                "finished": False,
                "target": written_by,
            }
            f.write(json.dumps(row) + "\n")
