import pytest
import torch

from specframe.errors import ConfigError
from specframe.sampling import SamplingParams, sampling_probs


def test_greedy_is_one_hot_argmax_lowest_index_on_ties():
    p = sampling_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams(0.0))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_then_normalise():
    logits = torch.tensor([0.0, 1.0, 2.0])
    p = sampling_probs(logits, SamplingParams(0.5))
    assert torch.allclose(p, (logits / 0.5).softmax(-1))
    assert p.dtype == torch.float32


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 5e-324])
def test_a_tiny_temperature_is_near_greedy_not_nan(temperature):
    # (dividing the raw logits by 1e-40 overflows to inf, and softmax of inf is nan; below float32's smallest
    # number the temperature itself rounds to 0 in float32, and the top logit's 0 / 0 is nan)
    p = sampling_probs(torch.tensor([3.0, 1.0, 0.5, 3.0 - 1e-6]), SamplingParams(temperature))
    assert torch.equal(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("temperature", [1e39, 1e300])
def test_a_huge_temperature_is_near_uniform_not_nan(temperature):
    # (past float32's largest number the temperature rounds to inf there, and a masked token's -inf / inf is
    # nan: a draft over a reduced vocabulary masks every token outside it)
    p = sampling_probs(torch.tensor([3.0, float("-inf"), 0.5, 1.0]), SamplingParams(temperature, top_k=2))
    assert torch.equal(p, torch.tensor([0.5, 0.0, 0.0, 0.5]))


def test_top_k_keeps_k_largest():
    p = sampling_probs(torch.tensor([0.0, 4.0, 1.0, 3.0, 2.0]), SamplingParams(1.0, top_k=2))
    assert (p > 0).tolist() == [False, True, False, True, False]
    assert abs(p.sum().item() - 1) < 1e-6


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = sampling_probs(probs.log(), SamplingParams(1.0, top_p=0.8))
    assert (p > 0).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    p = sampling_probs(probs.log(), SamplingParams(1.0, top_p=0.81))
    assert (p > 0).tolist() == [True, True, True, False]
    assert torch.allclose(p[:3], probs[:3] / 0.95)


def test_ties_at_a_cut_top_k_keeps_them_all_top_p_keeps_the_lower_ids():
    p = sampling_probs(torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0]), SamplingParams(1.0, top_k=2))
    assert (p > 0).tolist() == [False, True, True, True, False]  # (every token tied with the 2nd)
    for logits in ([1.0, 1.0, 1.0, 0.0, -5.0], [0.0, 2.0, 2.0, 2.0, 2.0, -1.0] * 40):  # (the second: past 16 ties)
        p = sampling_probs(torch.tensor(logits), SamplingParams(1.0, top_p=0.5))
        kept = (p > 0).nonzero().flatten().tolist()
        tied = [i for i, x in enumerate(logits) if x == max(logits)]
        assert kept == tied[: len(kept)] and 0 < len(kept) < len(tied)  # (a prefix of the tied ids, by index)


def test_top_p_always_keeps_the_top_token():
    p = sampling_probs(torch.tensor([5.0, 0.0]), SamplingParams(1.0, top_p=1e-9))
    assert p.tolist() == [1.0, 0.0]


def test_bf16_logits_are_computed_in_float32():
    p = sampling_probs(torch.tensor([0.0, -20.0, 1.0], dtype=torch.bfloat16), SamplingParams(0.7))
    assert p.dtype == torch.float32 and torch.isfinite(p).all() and p[1] > 0


def test_transform_applies_row_wise_to_batches():
    logits = torch.randn(3, 10)
    params = SamplingParams(0.8, top_k=4, top_p=0.9)
    batch = sampling_probs(logits, params)
    for i in range(3):
        assert torch.allclose(batch[i], sampling_probs(logits[i], params))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),  # (inf / inf is nan where a draft's logit is -inf)
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "0.5"}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"min_p": "0.1"}, "min_p"),
        ({"min_p": True}, "min_p"),
    ],
)
def test_bad_values_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=f"sampling.{key}"):
        SamplingParams(**kwargs)


def test_temperature_comes_before_top_k_and_top_p():
    # DESIGN's order: temperature, then top-k, then top-p. At T = 0.5 the top token holds 0.87 of the mass, so
    # top-p 0.8 keeps it alone; cutting before the temperature (0.64 at T = 1) would keep two tokens.
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    assert sampling_probs(logits, SamplingParams(0.5, top_p=0.8)).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert (sampling_probs(logits, SamplingParams(1.0, top_p=0.8)) > 0).tolist() == [True, True, False, False]
    # All three: top-k 3 renormalises [0.865, 0.117, 0.016] before top-p 0.95 (0.865 + 0.117 = 0.982 reaches it).
    p = sampling_probs(logits, SamplingParams(0.5, top_k=3, top_p=0.95))
    assert (p > 0).tolist() == [True, True, False, False]
    assert torch.allclose(p[:2], (logits[:2] / 0.5).softmax(-1))


def test_top_p_is_taken_over_what_top_k_kept():
    """temperature, then top-k, then top-p over the renormalised survivors (transformers' and vLLM's order):
    [.5, .3, .2] with top_k=2 is [.625, .375], where 0.55 is reached by the first token alone (top-p over the
    mass before top-k's cut would keep two)."""
    p = sampling_probs(torch.tensor([0.5, 0.3, 0.2]).log(), SamplingParams(1.0, top_k=2, top_p=0.55))
    assert p.tolist() == [1.0, 0.0, 0.0]


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one():
    # [.5, .3, .15, .05]: min_p 0.3 keeps p >= 0.15 (the third at the cut, kept), drops 0.05; renormalised.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).log()
    p = sampling_probs(logits, SamplingParams(1.0, min_p=0.3))
    assert (p > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(p[:3], torch.tensor([0.5, 0.3, 0.15], dtype=torch.float64) / 0.95)
    # after the temperature: at T = 0.5 the ratios square ([.25, .09, .0225, .0025] before normalising): 0.3 of the
    # top's keeps only the first two
    assert (sampling_probs(logits, SamplingParams(0.5, min_p=0.3)) > 0).tolist() == [True, True, False, False]
    # 0 is off; 1 keeps the top token and those tied with it
    assert (sampling_probs(logits, SamplingParams(1.0, min_p=0.0)) > 0).all()
    tied = torch.tensor([1.0, 3.0, 3.0, 2.999])
    assert sampling_probs(tied, SamplingParams(1.0, min_p=1.0)).tolist() == [0.0, 0.5, 0.5, 0.0]


def test_min_p_is_taken_relative_to_the_top_token_after_top_k_and_top_p():
    # top-k and top-p never drop the top token and renormalising keeps ratios, so min-p after them is their
    # intersection with min-p alone, in any batch shape and in 16-bit logits
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 2
    both = sampling_probs(logits, SamplingParams(0.9, top_k=10, top_p=0.9, min_p=0.2))
    cuts = sampling_probs(logits, SamplingParams(0.9, top_k=10, top_p=0.9))
    alone = sampling_probs(logits, SamplingParams(0.9, min_p=0.2))
    assert torch.equal(both > 0, (cuts > 0) & (alone > 0))
    half = sampling_probs(logits.bfloat16(), SamplingParams(0.9, min_p=0.2))
    assert half.dtype == torch.float32 and torch.equal(
        half > 0, sampling_probs(logits.bfloat16().float(), SamplingParams(0.9, min_p=0.2)) > 0
    )


def test_top_p_stops_at_the_token_whose_mass_before_reaches_it_exactly():
    # Four equal tokens: the mass before the third is exactly 0.5, which reaches top_p 0.5: two are kept (a
    # strict comparison kept three). Ties are common with 16-bit logits.
    p = sampling_probs(torch.zeros(4), SamplingParams(1.0, top_p=0.5))
    assert p.tolist() == [0.5, 0.5, 0.0, 0.0]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (0.7, 0, 1.0, 0.0),
        (1.0, 5, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (0.6, 20, 0.9, 0.0),
        (1.0, 0, 1.0, 0.05),
        (1.5, 0, 1.0, 0.3),
        (1.2, 30, 0.95, 0.02),  # (all four: min-p after top-k and top-p, transformers' order)
        (0.8, 0, 0.97, 0.1),
    ],
)
def test_the_distribution_is_transformers_warpers(temperature, top_k, top_p, min_p):
    """Against an implementation of its own: transformers' temperature, top-k, top-p and min-p warpers in that
    order (the conformance suite's reference distribution is `sampling_probs` itself, so a fault in it would move
    the engine and the reference together). Random logits: no ties, where the two may keep different tokens."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0)) * 3
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    if min_p:
        warped = MinPLogitsWarper(min_p)(None, warped)
    ours = sampling_probs(logits, SamplingParams(temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    if min_p:  # (the cut falls inside the rows: some tokens kept and some dropped by min-p itself)
        before = sampling_probs(logits, SamplingParams(temperature, top_k=top_k, top_p=top_p))
        assert ((before > 0) & (ours == 0)).any(-1).float().mean() > 0.5
    assert torch.equal(ours > 0, warped.softmax(-1) > 0)  # (the same tokens kept)
    torch.testing.assert_close(ours, warped.softmax(-1), rtol=1e-5, atol=1e-6)


def test_top_p_over_the_largest_logits_cuts_where_the_full_sort_does():
    # (the full sort of a 49,152-token row costs ~4 ms on a 2-core CPU; the candidates' cut must be the same one)
    from specframe.sampling import _nucleus_drop, _nucleus_drop_among_candidates

    gen = torch.Generator().manual_seed(0)
    ran = 0
    for case in range(120):
        scale = (0.5, 2.0, 4.0, 8.0)[case % 4]
        x = torch.randn(4096, generator=gen) * scale
        if case % 3 == 0:  # (ties, among them at the cut)
            x = (x * 2).round() / 2
        if case % 5 == 0:  # (top-k's -inf before it, fewer finite logits than candidates)
            x = x.masked_fill(x < torch.topk(x, 40).values[-1], float("-inf"))
        top_p = (0.5, 0.8, 0.9, 0.95, 0.99)[case % 5]
        fast = _nucleus_drop_among_candidates(x, top_p)
        if fast is not None:
            ran += 1
            assert torch.equal(fast, _nucleus_drop(x, top_p)), case
    assert ran >= 50  # (the peaked rows take the candidates' path)
    flat = torch.zeros(4096)  # (the nucleus reaches past the candidates: the full sort decides)
    assert _nucleus_drop_among_candidates(flat, 0.9) is None
    assert _nucleus_drop_among_candidates(torch.randn(2, 4096), 0.9) is None  # (rows: the full sort)


def test_penalties_are_transformers_repetition_penalty_and_vllm_presence_and_frequency():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from specframe.sampling import apply_penalties

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, generator=gen) * 3
    prompt, outputs = [1, 2, 2], [[3, 3, 4], [], [1, 5, 5, 5]]
    seen = torch.zeros(20, dtype=torch.bool)
    seen[prompt] = True
    counts = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.long), minlength=20) for o in outputs])
    rep = apply_penalties(logits, seen, counts, SamplingParams(repetition_penalty=1.7))
    for row, output in enumerate(outputs):  # (transformers' penalty over the prompt and the output together)
        want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[row : row + 1].clone())
        torch.testing.assert_close(rep[row], want[0])
    both = apply_penalties(logits, seen, counts, SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25))
    torch.testing.assert_close(both, logits - 0.5 * (counts > 0) + 0.25 * counts)  # (the output only, not the prompt)
    assert torch.equal(apply_penalties(logits, seen, counts, SamplingParams()), logits)  # (all off)
    assert not SamplingParams().penalised and SamplingParams(frequency_penalty=0.1).penalised
