"""The graphed (static-cache) forward, run here without capture (`capture=False`): the same forward on the same
buffers as on a GPU, where only the capture and replay are added."""

import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specframe import cuda_graphs, kv_cache
from specframe import decoder as decoder_module
from specframe.config import load_config
from specframe.cuda_graphs import MAX_QUERY, GraphedTarget, GraphsWarning, graphed_target, graphs_refusal
from specframe.decoder import SpeculativeDecoder, target_info
from specframe.plugins import get_registry
from specframe.proposer import seeded
from specframe.proposers.none import NoneConfig, NoneProposer
from specframe.testing import conformance
from specframe.testing.tiny import tiny_llama
from specframe.testing.tree_proposer import TreeConfig, TreeTestProposer


def llama(**overrides) -> LlamaForCausalLM:
    """A tiny Llama with grouped-query attention (4 heads, 2 key/value heads) and a bias in attention."""
    fields = dict(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, attention_bias=True, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    with seeded(0):
        return LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).eval().requires_grad_(False)


@pytest.fixture
def static_graphs(monkeypatch):
    """Decoders built while this is active run their steps on the static buffers (no capture: a CPU)."""

    def build(model, enabled, output_hidden_states=False):
        return (GraphedTarget(model, capture=False) if enabled and graphs_refusal(model) is None else None), None

    monkeypatch.setattr(decoder_module, "graphed_target", build)


@pytest.mark.parametrize(
    "model",
    [
        lambda: tiny_llama(vocab_size=32, hidden_size=32),
        lambda: llama(),
        lambda: llama(head_dim=16, attn_implementation="eager"),  # head_dim != hidden / heads
        lambda: llama(num_key_value_heads=4, attention_bias=False),  # no grouping
        lambda: llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        lambda: llama().to(torch.bfloat16),
    ],
    ids=["tiny", "gqa-bias", "head-dim", "mha", "linear-rope", "bfloat16"],
)
def test_static_forward_matches_the_eager_forward(model):
    assert GraphedTarget(model(), capture=False).check() is None


@pytest.mark.parametrize("broken", ["tree block", "cache slots", "padding row", "positions"])
def test_check_catches_a_wrong_static_forward(monkeypatch, broken):
    graphed = GraphedTarget(llama(), capture=False)
    if broken == "tree block":  # a tree verified as a chain: a node sees its sibling
        block = GraphedTarget._block
        monkeypatch.setattr(GraphedTarget, "_block", lambda self, rows, parents: block(self, rows, None))
    elif broken == "cache slots":  # the step's keys written one slot late
        forward = cuda_graphs.static_llama_forward

        def late(model, buffers, rows):
            buffers.slots[:rows] += 1
            return forward(model, buffers, rows)

        monkeypatch.setattr(cuda_graphs, "static_llama_forward", late)
    elif broken == "padding row":  # padding rows see the whole buffer, and are seen: a real row reads them
        write = GraphedTarget._write_mask

        def open_padding(self, past, rows, bucket, parents):
            write(self, past, rows, bucket, parents)
            self.buffers.mask[0, 0, :bucket, past + rows : past + bucket] = 0

        monkeypatch.setattr(GraphedTarget, "_write_mask", open_padding)
    else:  # rotary positions off by one
        forward = cuda_graphs.static_llama_forward

        def shifted(model, buffers, rows):
            buffers.positions[:, :rows] += 1
            return forward(model, buffers, rows)

        monkeypatch.setattr(cuda_graphs, "static_llama_forward", shifted)
    assert graphed.check() is not None


def test_refusals():
    assert graphs_refusal(llama()) is None
    dynamic = llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "changes with the sequence length" in graphs_refusal(dynamic)
    assert graphs_refusal(llama().train()) == "it is in training mode"
    assert "attention implementation 'flex_attention'" in graphs_refusal(llama(attn_implementation="flex_attention"))
    hooked = llama()
    hooked.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert (
        graphs_refusal(hooked) == "it has hooks or replaced modules or forwards, which the graphed forward would skip"
    )
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2)).eval()  # fmt: skip
    assert (
        graphs_refusal(mistral)
        == "it is a MistralForCausalLM; they are written for transformers' LlamaForCausalLM only"
    )
    with pytest.raises(ValueError, match="cannot be graphed: its rotary embedding"):
        GraphedTarget(dynamic, capture=False)
    with pytest.raises(ValueError, match="need a CUDA target; this one is on cpu"):
        GraphedTarget(llama())
    # graphs are for CUDA: nothing is built (or said) on a CPU, nor when they are off
    assert graphed_target(llama(), enabled=True) == (None, None)
    assert SpeculativeDecoder(llama(), NoneProposer(NoneConfig(), target_info(llama()))).graphs is None
    assert "CUDA graphs" not in conformance.check_greedy(NoneProposer, "cpu").detail


class Uncaptured(GraphedTarget):
    def __init__(self, model):
        super().__init__(model, capture=False)


class CaptureFails(GraphedTarget):
    def __init__(self, model):
        super().__init__(model, capture=False)
        self.capture = True  # (as on CUDA, where each capture raises)

    def _capture(self, bucket, output_hidden_states):
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors might be reported")


@pytest.mark.parametrize("case", ["applies", "dynamic rope", "longrope", "differs", "check fails", "capture fails"])
def test_graphed_target_on_cuda_says_why_it_is_off(monkeypatch, case):
    """As on a CUDA target (the device test faked, the capture left out): what `graphed_target` returns and says."""
    monkeypatch.setattr(cuda_graphs, "on_cuda", lambda model: True)
    monkeypatch.setattr(cuda_graphs, "GraphedTarget", Uncaptured)
    model = llama()
    if case == "dynamic rope":
        model = llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    elif case == "differs":
        monkeypatch.setattr(Uncaptured, "check", lambda self: "logits differ by 3")
    elif case == "longrope":  # (a target the decoder also treats specially: its RoPE switch; still said)
        half = 4  # head_dim 8 / 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                "long_factor": [2.0] * half, "original_max_position_embeddings": 128}  # fmt: skip
        model = llama(rope_parameters=rope, max_position_embeddings=512)
    elif case == "check fails":

        def fails(self, *args):
            raise RuntimeError("shapes do not match")

        monkeypatch.setattr(Uncaptured, "forward", fails)
    elif case == "capture fails":
        monkeypatch.setattr(cuda_graphs, "GraphedTarget", CaptureFails)
    if case == "applies":
        graphed, why = graphed_target(model, enabled=True)
        assert isinstance(graphed, Uncaptured) and why is None
        assert graphed_target(model, enabled=False) == (None, None)
        return
    with pytest.warns(GraphsWarning, match="CUDA graphs off for this target: ") as said:
        graphed, why = graphed_target(model, enabled=True)
    assert graphed is None and why in str(said[0].message)
    expected = {
        "dynamic rope": "its rotary embedding (dynamic) changes with the sequence length",
        "longrope": "its rotary embedding (longrope) changes with the sequence length",
        "differs": "logits differ by 3",
        "check fails": "checking them against the eager forward failed: RuntimeError: shapes do not match",
        "capture fails": "capturing failed: RuntimeError: operation not permitted when stream is capturing CUDA kernel "
        "errors might be reported",  # (one line)
    }
    assert why == expected[case]
    with pytest.warns(GraphsWarning, match=re.escape(expected[case])):
        decoder = SpeculativeDecoder(model, NoneProposer(NoneConfig(), target_info(model)))
    assert decoder.graphs is None and decoder.graphs_off == expected[case]


def test_config_key():
    assert load_config().target.cuda_graphs is True
    assert load_config(overrides=["target.cuda_graphs=false"]).target.cuda_graphs is False
    with pytest.raises(Exception, match="cuda_graphs"):
        load_config(overrides=["target.cuda_graphs=maybe"])


def test_static_layer_refuses_an_overflow():
    graphed = GraphedTarget(llama(), capture=False)
    cache = graphed.new_cache(4)
    layer = cache.layers[0]
    room = layer.key_buffer.shape[-2]
    too_long = torch.zeros(1, 2, room + 1, 8)
    with pytest.raises(RuntimeError, match="do not fit its buffers"):
        layer.update(too_long, too_long)


def test_mask_blocks_are_made_once_per_tree_shape(monkeypatch):
    graphed = GraphedTarget(llama(), capture=False)
    graphed.new_cache(8)
    tree, other = (-1, -1, 0, 2), (-1, 0, 0, 1)
    first = graphed._block(5, tree)
    assert graphed._block(5, tree) is first  # (a fixed tree: no host work, no upload again)
    assert not torch.equal(graphed._block(5, other), first)
    assert graphed._block(3, None) is graphed._block(3, None)
    expected = torch.where(kv_cache.tree_visibility(list(tree)), 0.0, graphed.buffers.mask_minimum)
    assert torch.equal(first, expected.to(first.dtype))
    monkeypatch.setattr(cuda_graphs, "MASK_BLOCKS", 3)
    for n in range(1, 8):  # (bounded: dynamic trees seldom repeat)
        graphed._block(n + 1, tuple(range(-1, n - 1)))
    assert len(graphed.blocks) <= 3


def proposers(model):
    info = target_info(model)
    registry = get_registry()
    built = {"tree": TreeTestProposer.random(info, TreeConfig(width=2, depth=3), seed=1)}
    for name in ("none", "draft", "medusa", "eagle"):
        built[name] = registry.get(name).cls.random(info, seed=1)
    return built


@pytest.mark.parametrize("name", ["none", "draft", "medusa", "eagle", "tree"])
def test_decoding_on_static_buffers_is_the_targets_greedy_decoding(static_graphs, name):
    model = tiny_llama(vocab_size=32, hidden_size=32)
    decoder = SpeculativeDecoder(model, proposers(model)[name], max_new_tokens=40)
    assert isinstance(decoder.graphs, GraphedTarget)
    prompt = [1, 5, 2, 7, 3]
    out = decoder.generate(prompt).token_ids
    assert out == conformance.reference_greedy(tiny_llama(vocab_size=32, hidden_size=32), prompt, 40)
    # sampled: the same tokens as the eager forwards give with the same seed (logits equal up to rounding)
    eager = SpeculativeDecoder(model, proposers(model)[name], max_new_tokens=40, cuda_graphs=False)
    for seed in (1, 2):
        graphed = decoder.generate(prompt, temperature=1.0, top_p=0.9, seed=seed).token_ids
        assert graphed == eager.generate(prompt, temperature=1.0, top_p=0.9, seed=seed).token_ids


def test_graphs_off_by_config(static_graphs):
    model = tiny_llama(vocab_size=32, hidden_size=32)
    assert SpeculativeDecoder(model, NoneProposer.random(target_info(model)), cuda_graphs=False).graphs is None


def test_buffers_grow_for_a_longer_generation(static_graphs):
    model = tiny_llama(vocab_size=32, hidden_size=32, max_position_embeddings=4096)
    decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=8)
    decoder.generate([1, 2, 3])
    first = decoder.graphs.buffers
    assert decoder.graphs.new_cache(100) is not None and decoder.graphs.buffers is first  # (room enough: kept)
    prompt = [i % 31 + 1 for i in range(first.capacity)]  # longer than the buffers hold
    out = decoder.generate(prompt, max_new_tokens=3).token_ids
    assert decoder.graphs.buffers is not first and decoder.graphs.buffers.capacity > len(prompt) + 3
    assert out == conformance.reference_greedy(model, prompt, 3)


def test_a_verification_past_the_largest_graph_runs_eagerly(static_graphs, monkeypatch):
    model = tiny_llama(vocab_size=32, hidden_size=32)
    config = TreeConfig(width=12, depth=2)  # sampled: 12 + 144 nodes
    decoder = SpeculativeDecoder(model, TreeTestProposer.random(target_info(model), config, seed=1))
    rows = []
    forward = GraphedTarget.forward

    def counted(self, cache, input_ids, *args, **kwargs):
        rows.append(input_ids.shape[1])
        return forward(self, cache, input_ids, *args, **kwargs)

    monkeypatch.setattr(GraphedTarget, "forward", counted)
    result = decoder.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=4)
    eager = SpeculativeDecoder(model, TreeTestProposer.random(target_info(model), config, seed=1), cuda_graphs=False)
    assert result.token_ids == eager.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=4).token_ids
    # the 157-token steps ran eagerly (the last steps, with budget for one level only, on the static buffers)
    assert result.stats["proposed_nodes"] >= 156 and all(r <= MAX_QUERY for r in rows)
    assert len(rows) < result.stats["target_forwards"] - 1


def test_the_greedy_check_says_whether_graphs_ran(emulated, monkeypatch):
    cls = get_registry().get("none").cls
    result = conformance.check_greedy(cls, "cpu")
    assert result.passed and result.detail.endswith("; verification forwards as CUDA graphs")
    monkeypatch.setattr(EmulatedGraphs, "fail_after", 0)
    with pytest.warns(GraphsWarning):
        result = conformance.check_greedy(cls, "cpu")
    off = "; CUDA graphs off: capturing failed: RuntimeError: CUDA error: out of memory"
    assert result.passed and result.detail.endswith(off)


@pytest.mark.parametrize("name", ["none", "medusa", "eagle", "union"])
def test_conformance_on_static_buffers(static_graphs, name):
    cls = get_registry().get(name).cls
    for check in (conformance.check_greedy, conformance.check_rollback):
        result = check(cls, "cpu")
        assert result.passed, result.detail


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle", "union"])
def test_sampling_conformance_on_static_buffers(static_graphs, name):
    result = conformance.check_sampling(get_registry().get(name).cls, "cpu", "temperature=0.7,top_p=0.9")
    assert result.passed, result.detail


def test_copies_of_a_decoder_do_not_share_its_static_cache(static_graphs):
    import copy

    model = tiny_llama(vocab_size=32, hidden_size=32)
    decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=6)
    for other in (copy.copy(decoder), copy.deepcopy(decoder)):
        assert other.graphs is None and "copied or unpickled decoder runs eager forwards" in other.graphs_off
        assert other.generate([1, 2, 3]).token_ids == decoder.generate([1, 2, 3]).token_ids
    assert isinstance(decoder.graphs, GraphedTarget)


class EmulatedGraphs(GraphedTarget):
    """Capture and replay emulated on a CPU: a "graph" is the forward run again on the buffers it was captured
    on, its results written into the tensors its capture returned (NaN until then: a capture computes nothing),
    as a replay overwrites a graph's outputs. What it pins down is the bookkeeping around them: which graphs
    are captured when, that a graph reads the buffers it was captured on (grown ones need new graphs), and that
    outputs are read after their replay and before the next one overwrites them. `fail_after`: captures that
    succeed before one raises."""

    fail_after = None

    def __init__(self, model):
        super().__init__(model, capture=False)
        self.capture = True
        self.captures = []
        self.replays = 0

    def _capture(self, bucket, output_hidden_states):
        if self.fail_after is not None and len(self.captures) >= self.fail_after:
            raise RuntimeError("CUDA error: out of memory")
        self.captures.append((bucket, output_hidden_states))
        out = cuda_graphs.static_llama_forward(self.model, self.buffers, bucket)
        for t in (out.logits, *out.hidden_states):
            t.fill_(float("nan"))
        if not output_hidden_states:
            out = cuda_graphs.LeanOutput(out.logits, None)
        return EmulatedGraph(self, self.buffers, bucket, out), out

    def _replay(self, graph):
        graph.replay()


class EmulatedGraph:
    def __init__(self, owner, buffers, bucket, out):
        self.owner, self.buffers, self.bucket, self.out = owner, buffers, bucket, out

    def replay(self):
        self.owner.replays += 1
        new = cuda_graphs.static_llama_forward(self.owner.model, self.buffers, self.bucket)
        self.out.logits.copy_(new.logits)
        for kept, fresh in zip(self.out.hidden_states or (), new.hidden_states, strict=False):
            kept.copy_(fresh)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "on_cuda", lambda model: True)
    monkeypatch.setattr(cuda_graphs, "GraphedTarget", EmulatedGraphs)
    monkeypatch.setattr(EmulatedGraphs, "fail_after", None)
    return EmulatedGraphs


@pytest.mark.parametrize("name", ["none", "draft", "medusa", "eagle", "tree"])
def test_every_graph_is_captured_at_build_and_replayed(emulated, name):
    model = tiny_llama(vocab_size=32, hidden_size=32, max_position_embeddings=4096)  # (room for a long prompt)
    proposer = proposers(model)[name]
    decoder = SpeculativeDecoder(model, proposer, max_new_tokens=40)
    hidden = bool(proposer.hidden_state_layers)
    graphs = decoder.graphs
    assert isinstance(graphs, EmulatedGraphs)
    built = list(graphs.captures)  # the check's bucket (4, with hidden states), then every other bucket
    assert sorted(built) == sorted({(4, True)} | {(b, hidden) for b in cuda_graphs.QUERY_BUCKETS})
    prompt = [1, 5, 2, 7, 3]
    replays = graphs.replays
    result = decoder.generate(prompt)
    assert result.token_ids == conformance.reference_greedy(model, prompt, 40)
    assert graphs.replays - replays == result.stats["target_forwards"] - 1  # (every step but the prefill)
    eager = SpeculativeDecoder(model, proposers(model)[name], max_new_tokens=40, cuda_graphs=False)
    sampled = decoder.generate(prompt, temperature=1.0, seed=3).token_ids
    assert sampled == eager.generate(prompt, temperature=1.0, seed=3).token_ids
    assert graphs.captures == built  # (nothing captured while generating)
    # a prompt longer than the buffers: they grow, every graph is captured again on the new ones and replayed
    long_prompt = [i % 31 + 1 for i in range(1000)]
    assert len(long_prompt) + 40 > graphs.buffers.capacity
    result = decoder.generate(long_prompt)
    assert result.token_ids == conformance.reference_greedy(model, long_prompt, 40)
    assert len(graphs.captures) > len(built) and graphs.buffers.capacity >= len(long_prompt) + 40
    assert graphs.off is None


def test_a_capture_that_fails_turns_graphs_off(emulated, monkeypatch):
    model = tiny_llama(vocab_size=32, hidden_size=32, max_position_embeddings=4096)
    monkeypatch.setattr(EmulatedGraphs, "fail_after", 3)  # at build: the check's, then two buckets
    with pytest.warns(GraphsWarning, match="capturing failed: RuntimeError: CUDA error: out of memory"):
        decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=8)
    assert decoder.graphs is None and decoder.graphs_off.startswith("capturing failed")

    # every graph at build (the check's and each bucket's), none for larger buffers
    monkeypatch.setattr(EmulatedGraphs, "fail_after", 1 + len(cuda_graphs.QUERY_BUCKETS))
    decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=8)
    graphs = decoder.graphs
    assert decoder.generate([1, 2, 3]).token_ids == conformance.reference_greedy(model, [1, 2, 3], 8)
    prompt = [i % 31 + 1 for i in range(graphs.buffers.capacity)]  # larger buffers: their captures fail
    with pytest.warns(GraphsWarning, match="capturing failed"):
        out = decoder.generate(prompt, max_new_tokens=3).token_ids
    assert out == conformance.reference_greedy(model, prompt, 3)
    assert decoder.graphs is None and graphs.off.startswith("capturing failed") and decoder.graphs_off == graphs.off
    assert decoder.generate([1, 2, 3]).token_ids == conformance.reference_greedy(model, [1, 2, 3], 8)


def test_a_target_moved_off_the_gpu_turns_graphs_off(emulated, monkeypatch):
    model = tiny_llama(vocab_size=32, hidden_size=32)
    decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=8)
    assert decoder.graphs is not None
    monkeypatch.setattr(cuda_graphs, "on_cuda", lambda model: False)
    model.to(torch.float64)  # (moved: the weights are other tensors)
    with pytest.warns(GraphsWarning, match="the target changed since its graphs were made: it is no longer on CUDA"):
        decoder.generate([1, 2, 3])
    assert decoder.graphs is None


def test_replaced_weights_make_new_buffers_and_graphs(emulated):
    model = tiny_llama(vocab_size=32, hidden_size=32)
    decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=8)
    graphs, buffers = decoder.graphs, decoder.graphs.buffers
    built = len(graphs.captures)
    model.lm_head.weight.data = model.lm_head.weight.data * 2
    assert decoder.generate([1, 2, 3]).token_ids == conformance.reference_greedy(model, [1, 2, 3], 8)
    assert graphs.buffers is not buffers and len(graphs.captures) == built + len(cuda_graphs.QUERY_BUCKETS)


def test_a_hook_added_later_turns_graphs_off(emulated):
    model = tiny_llama(vocab_size=32, hidden_size=32)
    decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=8)
    seen = []
    model.model.layers[1].register_forward_hook(lambda *args: seen.append(1))
    with pytest.warns(GraphsWarning, match="the target changed since its graphs were made: it has hooks"):
        out = decoder.generate([1, 2, 3]).token_ids
    assert decoder.graphs is None and len(seen) == 8  # (the hook ran in every forward: prefill and 7 steps)
    assert out == conformance.reference_greedy(model, [1, 2, 3], 8)


def test_a_verification_too_long_for_the_buffers_goes_on_eagerly(static_graphs):
    model = tiny_llama(vocab_size=32, hidden_size=32, max_position_embeddings=2048)
    config = TreeConfig(width=12, depth=2)  # sampled: 157 tokens a verification, more than the buffers' margin
    prompt = [i % 31 + 1 for i in range(880)]  # 880 + 16 + 128 = 1,024: the buffers' room, no more
    decoder = SpeculativeDecoder(model, TreeTestProposer.random(target_info(model), config, seed=1))
    eager = SpeculativeDecoder(model, TreeTestProposer.random(target_info(model), config, seed=1), cuda_graphs=False)
    got = decoder.generate(prompt, max_new_tokens=16, temperature=1.0, seed=4)
    assert decoder.graphs.buffers.capacity == 1024 and got.stats["proposed_nodes"] > 156
    assert got.token_ids == eager.generate(prompt, max_new_tokens=16, temperature=1.0, seed=4).token_ids
    assert decoder.graphs is not None  # (kept for the next generation)


def test_the_bench_says_when_graphs_were_turned_off_while_it_ran(emulated, monkeypatch):
    from specframe import bench

    model = tiny_llama(vocab_size=32, hidden_size=32, max_position_embeddings=4096)
    monkeypatch.setattr(EmulatedGraphs, "fail_after", 1 + len(cuda_graphs.QUERY_BUCKETS))  # none for new buffers
    decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=3)
    methods = [bench.Method("none", "specframe", "specframe proposer 'none'", None, decoder)]
    bench.note_graphs_turned_off(methods)
    assert methods[0].description == "specframe proposer 'none'"
    with pytest.warns(GraphsWarning):
        decoder.generate([i % 31 + 1 for i in range(decoder.graphs.buffers.capacity)])  # larger buffers
    bench.note_graphs_turned_off(methods)
    bench.note_graphs_turned_off(methods)  # (said once)
    assert methods[0].description == (
        "specframe proposer 'none'; CUDA graphs off during the run: capturing failed: RuntimeError: CUDA error: out "
        "of memory"
    )


def test_the_bench_makes_graph_buffers_for_its_longest_conversation_before_timing(emulated):
    # (else the first prompt to outgrow them captured every graph again inside its timed run)
    from types import SimpleNamespace

    from tqdm import tqdm

    from specframe import bench

    model = tiny_llama(vocab_size=32, hidden_size=32, max_position_embeddings=4096)
    decoder = SpeculativeDecoder(model, NoneProposer.random(target_info(model)), max_new_tokens=4)
    graphs = decoder.graphs
    short = graphs.buffers.capacity
    captures_when_timed = []

    def run(ids, max_new, seed):
        out = decoder.generate(ids, max_new_tokens=max_new)
        captures_when_timed.append(len(graphs.captures))  # (after each run)
        return bench.Output(out.token_ids, out.stats["target_forwards"], 0.01, out.stats)

    words = lambda n: " ".join(["w"] * n)  # noqa: E731 (a token a word here)
    setup = SimpleNamespace(
        methods=[bench.Method("none", "specframe", "", run, decoder)],
        encoder=SimpleNamespace(  # (no chat template: a conversation is its texts one a line)
            encode=lambda text, **kw: torch.tensor([i % 31 + 1 for i in range(len(text.split()))]),
            tokenizer=SimpleNamespace(chat_template=None),
        ),
        tokenizer=SimpleNamespace(decode=lambda ids, **kw: words(len(ids))),
    )
    # A two-turn question whose second turn holds the first (1,000 tokens), its answer (200) and 620 more: with
    # its own answer and a verification's room (128), 2,148 positions, past 2,048 only with the first answer.
    questions = [bench.Question(1, "qa", "qa", [words(8)]), bench.Question(2, "mt", "mt", [words(1000), words(620)])]
    options = bench.BenchOptions(proposers=[], baselines=[], max_new_tokens=200, progress=False)
    records, failed, _ = bench.timed_loop(setup, questions, options, lambda line: None, tqdm)  # (bar disabled)
    assert not failed and [r["new_tokens"] for r in records] == [200] * 3
    assert records[-1]["prompt_tokens"] + 200 + cuda_graphs.MAX_QUERY > 2048 == 2 * cuda_graphs.CAPACITY_STEP
    assert graphs.buffers.capacity > short and graphs.off is None
    assert len(set(captures_when_timed[1:])) == 1  # (after the warm-up: nothing captured in a timed run)
