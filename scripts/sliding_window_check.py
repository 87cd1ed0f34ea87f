"""Serving past a sliding window, on real weights: the default target's weights in a Mistral model with a window.

    python scripts/sliding_window_check.py [--window 128] [--new-tokens 300]

SmolLM2-135M-Instruct is a Llama model; a Mistral model is a Llama model with a sliding attention window, so the
same weights under a MistralConfig with `sliding_window` make a real sliding-window model whose output past the
window differs from the Llama one's. This decodes one chat prompt greedily, well past the window, with `none`,
n-gram lookup and the Medusa heads and EAGLE drafter shipped for those weights (a 16-node tree: verifications whose
trees reach past the window), and compares each output with transformers' own `generate`, which keeps its own
sliding-window cache. Prints, per proposer, whether the output is identical (else the first differing position),
the mean accepted length and the time. The weights are the default target's, so the shipped artifacts load
(`specframe.artifacts.shipped` matches a copy by its weights). Stock kernels throughout (transformers' forward for
both sides).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def main() -> None:
    import transformers as t

    from specframe import SpeculativeDecoder
    from specframe.artifacts import shipped
    from specframe.decoder import chat_ids, target_info
    from specframe.models import load_model
    from specframe.plugins import get_registry
    from specframe.proposers.eagle import EagleConfig, EagleProposer
    from specframe.proposers.medusa import MedusaConfig, MedusaProposer
    from specframe.proposers.none import NoneConfig, NoneProposer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=128, help="the sliding window, in positions")
    parser.add_argument("--new-tokens", type=int, default=300, help="tokens to generate")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)

    loaded = load_model("smollm2-135m-instruct", dtype="float32", device="cpu", fast_cpu_kernels=False)
    llama, tokenizer = loaded.model, loaded.tokenizer
    keys = t.MistralConfig().to_dict()
    config = t.MistralConfig(**{k: v for k, v in llama.config.to_dict().items() if k in keys and k != "model_type"})
    config.sliding_window = args.window
    config.head_dim = llama.config.hidden_size // llama.config.num_attention_heads
    model = t.MistralForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict())
    model.generation_config.eos_token_id = None
    prompt = list(chat_ids(tokenizer, [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]))
    print(f"prompt {len(prompt)} tokens, window {args.window}, {args.new_tokens} new tokens")
    with torch.no_grad():
        ids = torch.tensor([prompt])  # (a mask of ones: without it, generate masks the prompt's pad-id tokens)
        reference = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False
        )
    want = reference[0, len(prompt) :].tolist()

    info = target_info(model, tokenizer)
    proposers = {
        "none": lambda: NoneProposer(NoneConfig(), info),
        "ngram": lambda: get_registry().get("ngram").cls.random(info),
        "medusa": lambda: MedusaProposer.from_config(MedusaConfig(model=str(shipped("medusa", "", model))), info),
        "eagle": lambda: EagleProposer.from_config(
            EagleConfig(model=str(shipped("eagle", "", model)), depth=4, top_k=4, total_tokens=16), info
        ),
    }
    for name, build in proposers.items():
        decoder = SpeculativeDecoder(model, build(), tokenizer)
        decoder.eos_ids = set()
        start = time.perf_counter()
        res = decoder.generate(prompt, max_new_tokens=args.new_tokens)
        first = next((i for i, (a, b) in enumerate(zip(res.token_ids, want, strict=False)) if a != b), None)
        if res.token_ids == want:
            verdict = "identical"
        elif first is None:
            verdict = f"{len(res.token_ids)} tokens ({res.stats['finish_reason']}), transformers' {len(want)}"
        else:
            verdict = f"differs from token {first}"
        print(
            f"{name}: {verdict}; mean accepted length {res.stats['mean_accepted_length']:.2f}; "
            f"{time.perf_counter() - start:.0f} s"
        )


if __name__ == "__main__":
    main()
