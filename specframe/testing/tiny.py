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
