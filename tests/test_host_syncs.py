"""How often the generation loop reads a tensor's value on the host, per step (issue #8: on a GPU each read
waits for every queued kernel). Counted on the CPU, where the same calls happen: `.tolist()`, `.item()`,
`bool`/`int`/`float` of a tensor, `nonzero`, `.cpu()`, `.numpy()` and boolean-mask indexing, from the first
proposal to the end. Needed per step: the proposal's structure (one read, `validate_proposal`) and the
acceptance's outcome (greedy: one read of the argmax row; sampled: one per row walked and one draw)."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specframe.decoder import SpeculativeDecoder, target_info
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.eagle import EagleConfig, EagleProposer
from specframe.proposers.medusa import MedusaProposer
from specframe.proposers.none import NoneConfig, NoneProposer
from specframe.proposers.union import UnionConfig, UnionProposer
from specframe.sampling import SamplingParams
from specframe.testing.tiny import tiny_llama

READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}


class CountReads(TorchFunctionMode):
    """Counts host reads of tensor values while `on`, by the specframe line that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.on and (func in READS or (func is torch.Tensor.__getitem__ and _bool_mask(args[1]))):
            frames = [f for f in traceback.extract_stack()[:-1] if "/specframe/" in f.filename]
            self.sites[f"{frames[-1].filename.split('/specframe/')[-1]}:{frames[-1].lineno}" if frames else "?"] += 1
        return func(*args, **(kwargs or {}))


def _bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in items)


def reads_per_generation(decoder: SpeculativeDecoder, **kwargs) -> tuple[collections.Counter, dict]:
    """(reads by site from the first proposal on, the generation's stats)."""
    counter = CountReads()
    propose = decoder.proposer.propose

    def counted(state):
        counter.on = True
        return propose(state)

    decoder.proposer.propose = counted
    with counter:
        result = decoder.generate([1, 2, 3, 4, 5, 6], max_new_tokens=48, **kwargs)
    return counter.sites, result.stats


def target():
    return tiny_llama(vocab_size=64, hidden_size=32, seed=1)


PROPOSERS = {
    "none": lambda info: NoneProposer(NoneConfig(), info),
    "draft": lambda info: DraftProposer.random(info, DraftConfig(num_speculative_tokens=4)),
    "eagle tree": lambda info: EagleProposer.random(info, EagleConfig(depth=6, top_k=10, total_tokens=60)),
    "eagle chain": lambda info: EagleProposer.random(info, EagleConfig(depth=4, tree=False)),
    "medusa": lambda info: MedusaProposer.random(info),
}


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_steps_read_the_host_twice(name):
    model = target()
    decoder = SpeculativeDecoder(model, PROPOSERS[name](target_info(model)))
    sites, stats = reads_per_generation(decoder)
    steps = stats["target_forwards"] - 1
    assert steps > 5
    # The proposal's structure once (an empty one: not at all) and the target's argmax once: never per node or
    # per tree level.
    budget = steps * (1 if name == "none" else 2)
    assert sum(sites.values()) <= budget, dict(sites)


def test_eagle_with_a_confidence_threshold_reads_once_more_per_level():
    model = target()
    config = EagleConfig(depth=5, top_k=4, total_tokens=20, confidence_threshold=0.01)
    decoder = SpeculativeDecoder(model, EagleProposer.random(target_info(model), config))
    sites, stats = reads_per_generation(decoder)
    steps = stats["target_forwards"] - 1
    # The structure, the argmax and, to stop early, the count of nodes that reach the threshold at each level
    # drafted (the root's and at most depth - 1 more).
    assert sum(sites.values()) <= steps * (2 + config.depth), dict(sites)
    assert sum(sites.values()) > steps * 2, "the threshold's counts were not read: is it applied?"


def test_a_union_reads_each_members_proposal_once():
    model = target()
    info = target_info(model)
    members = [EagleProposer.random(info, EagleConfig(depth=4, top_k=4, total_tokens=12)), MedusaProposer.random(info)]
    decoder = SpeculativeDecoder(model, UnionProposer(UnionConfig(members=["eagle", "medusa"]), info, members))
    sites, stats = reads_per_generation(decoder)
    steps = stats["target_forwards"] - 1
    assert sum(sites.values()) <= steps * 4, dict(sites)  # two members', the union's, the argmax


@pytest.mark.parametrize("name", ["eagle tree", "medusa", "draft"])
def test_sampled_steps_read_once_per_row_walked_not_per_child_tried(name):
    model = target()
    decoder = SpeculativeDecoder(model, PROPOSERS[name](target_info(model)), sampling=SamplingParams(1.0, 0, 0.9))
    sites, stats = reads_per_generation(decoder, seed=0)
    steps = stats["target_forwards"] - 1
    # Per step: the structure (sampled q rows: one more, their checks), one read per row walked (the accepted
    # path and its end) and the draw of the emitted token.
    structure = 2 if name == "draft" else 1
    budget = steps * (structure + 2) + stats["accepted_tokens"]
    assert sum(sites.values()) <= budget, dict(sites)
