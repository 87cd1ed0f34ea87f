"""The target's verification forwards as CUDA graphs over a static KV cache.

On a GPU a small target is bound by kernel launches, not by reading its weights: a SmolLM2-135M forward is
~30 layers of ~15 kernels each, every one launched from Python (the H200 run of 2026-12-04, docs/gpu.md, spent
~38 ms a token in transformers' `generate` on a model whose weights read in well under a millisecond). A CUDA
graph records one forward's kernels once and replays them with one launch. A graph replays the same kernels on
the same memory, so everything that changes between steps must live in fixed buffers (`StaticBuffers`):

- the KV cache: one zero-initialised buffer per layer with room for the whole generation (`StaticLayer`, a
  `GrowingLayer` that never reallocates), so rollback stays the crop or gather of `specframe.kv_cache`;
- the step's tokens, positions and cache slots, and an additive attention mask over the buffer's full length:
  the past is visible, the new block as a chain or a tree, everything after it hidden;
- the output logits and hidden states.

A verification of m tokens replays the graph of the smallest bucket size (`QUERY_BUCKETS`) holding m; the rows
past m are padding: they see the past and their own slot (finite rows, never NaN) and write keys and values
past the sequence, which no real row sees and the next step overwrites. Larger verifications (over MAX_QUERY
tokens) and the prefill run the eager forward on the same cache (or, where such a verification would not fit
the buffers, on a copy of the usual kind for the rest of that generation: `detached`). Every bucket's graph
is captured when the decoder is built (`prepare`), and again before the prefill when a generation needs larger
buffers; a capture that fails turns graphs off (`turn_off`, with a warning) and the steps run the same forward
uncaptured.

The graphed forward is `static_llama_forward`, written out as transformers' Llama computes it, but attending
over the whole buffer through PyTorch's SDPA with the mask above and reading rotary cos/sin from a table made
by the model's own rotary embedding (the same elementwise numbers for each position). So it gives the eager
forward's result up to float rounding (the attention's reduction runs over more, masked, keys); exactness is
unaffected, as it is by any change of kernels: acceptance uses whatever distribution the verification forward
computed. `GraphedTarget.check` compares it with the eager forward when a decoder is built and turns graphs
off (with a warning saying why) where they differ by more than rounding or cannot be captured.

Off the GPU, `GraphedTarget(..., capture=False)` runs the same forward on the same buffers without capturing:
that is how the tests pin it down on a CPU.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from specframe.errors import brief
from specframe.kv_cache import GrowingLayer, new_cache, tree_attention_mask, tree_visibility
from specframe.lean_forward import LeanOutput, engine_forward, lean_forward_applies

# Token counts a graph is captured for; a step takes the smallest that holds it. Up to 128: on a GPU the default
# shapes verify ~61-65 tokens (EAGLE-2's 60 nodes, Medusa's 64) and a union of EAGLE and n-gram up to ~81.
QUERY_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
MASK_BLOCKS = 256  # tree shapes whose mask blocks are kept on the device
MAX_QUERY = QUERY_BUCKETS[-1]  # larger verifications run the eager forward
CAPACITY_STEP = 1024  # the KV buffers' length is a multiple of this (fewer reallocations, fewer recaptures)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (as PyTorch's docs ask: lazy inits happen there)


class GraphsWarning(RuntimeWarning):
    """CUDA graphs turned off for a target that is on CUDA with graphs on (the CLI prints it as one line)."""


def graphs_refusal(model: torch.nn.Module) -> str | None:
    """Why `model`'s forwards cannot be graphed here (a sentence), or None when they can: a Llama model that the
    lean forward applies to (eval mode, no hooks or replaced forwards), whose rotary embedding depends on the
    position only (not the dynamic or LongRoPE kinds, which rescale with the sequence length)."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from specframe.lean_forward import ATTENTIONS

    if type(model) is not LlamaForCausalLM:
        return f"it is a {type(model).__name__}; they are written for transformers' LlamaForCausalLM only"
    if model.training:
        return "it is in training mode"
    if model.config._attn_implementation not in ATTENTIONS:
        return f"its attention implementation {model.config._attn_implementation!r} is not eager or SDPA"
    if not lean_forward_applies(model):
        return "it has hooks or replaced modules or forwards, which the graphed forward would skip"
    rope = str(getattr(model.model.rotary_emb, "rope_type", "default"))
    if "dynamic" in rope or rope == "longrope":
        return f"its rotary embedding ({rope}) changes with the sequence length"
    return None


class StaticLayer(GrowingLayer):
    """A cache layer over fixed buffers ([batch, kv heads, capacity, head dim]): `keys` and `values` are views
    of their first positions; forwards write in place and never reallocate, so graphs captured on the buffers
    stay valid. Crop and gather (rollback) work on the views as for `GrowingLayer`."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> None:
        super().__init__()
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self.keys, self.values = key_buffer[..., :0, :], value_buffer[..., :0, :]
        self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2] or key_states.shape[:-2] != self.key_buffer.shape[:-2]:
            raise RuntimeError(
                f"static KV cache: {end} positions of shape {tuple(key_states.shape[:-2])} do not fit its buffers "
                f"{tuple(self.key_buffer.shape)} (GraphedTarget.new_cache reserves room for the whole generation)"
            )
        self.key_buffer[..., length:end, :] = key_states
        self.value_buffer[..., length:end, :] = value_states
        self.set_length(end)
        return self.keys, self.values

    def set_length(self, length: int) -> None:
        self.keys = self.key_buffer[..., :length, :]
        self.values = self.value_buffer[..., :length, :]


class StaticBuffers:
    """Everything a graphed forward reads or writes, at fixed addresses: the KV cache of every layer, the step's
    inputs (for the largest bucket; a smaller one uses their first rows) and the rotary tables."""

    def __init__(self, model: torch.nn.Module, capacity: int) -> None:
        config, weight = model.config, model.get_input_embeddings().weight
        device, dtype = weight.device, weight.dtype
        layers = model.model.layers[: config.num_hidden_layers]
        attn = layers[0].self_attn
        kv_heads = config.num_key_value_heads
        self.capacity = capacity
        shape = (len(layers), 2, 1, kv_heads, capacity, attn.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)  # zeros: masked slots must hold finite numbers
        self.input_ids = torch.zeros(1, MAX_QUERY, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, MAX_QUERY, dtype=torch.long, device=device)
        self.slots = torch.zeros(MAX_QUERY, dtype=torch.long, device=device)  # cache positions written
        self.mask = torch.zeros(1, 1, MAX_QUERY, capacity, dtype=dtype, device=device)
        self.offsets = torch.arange(MAX_QUERY, device=device)
        self.mask_minimum = torch.finfo(dtype).min  # (the mask's value for a hidden position)
        # The rotary embedding's cos and sin at every position the buffers can hold: the module's own numbers
        # (elementwise in the position), read by position in the graph instead of computed there.
        probe = torch.zeros(1, 1, attn.head_dim, dtype=dtype, device=device)
        cos, sin = model.model.rotary_emb(probe, position_ids=torch.arange(capacity + MAX_QUERY, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]
        self.graphs: dict[tuple[int, bool], tuple[Any, LeanOutput]] = {}  # (bucket, hidden states) -> graph
        self.weights = weight_addresses(model)  # where the graphs read the weights (`GraphedTarget.new_cache`)

    def layer(self, i: int) -> StaticLayer:
        return StaticLayer(self.kv[i, 0], self.kv[i, 1])


def static_llama_forward(model: torch.nn.Module, buffers: StaticBuffers, rows: int) -> LeanOutput:
    """One forward of `rows` tokens (`buffers.input_ids[:, :rows]`, at `positions`, written to cache `slots`),
    attending over the whole KV buffer through `buffers.mask`: transformers' Llama decoder layers written out with
    tensor operations only (no host reads, no allocation that depends on values), so that it can be captured."""
    import torch.nn.functional as F

    inner, config = model.model, model.config
    positions = buffers.positions[0, :rows]
    slots = buffers.slots[:rows]
    mask = buffers.mask[:, :, :rows]
    hidden = inner.embed_tokens(buffers.input_ids[:, :rows])
    cos = buffers.cos.index_select(0, positions)[None, None]
    sin = buffers.sin.index_select(0, positions)[None, None]
    states = [hidden]
    with attention_kernels(hidden.device):
        for i, layer in enumerate(inner.layers[: config.num_hidden_layers]):
            attn = layer.self_attn
            residual = hidden
            x = layer.input_layernorm(hidden)
            heads = (1, rows, -1, attn.head_dim)
            query = attn.q_proj(x).view(heads).transpose(1, 2)
            key = attn.k_proj(x).view(heads).transpose(1, 2)
            value = attn.v_proj(x).view(heads).transpose(1, 2)
            query, key = _rotated(query, cos, sin), _rotated(key, cos, sin)
            keys, values = buffers.kv[i, 0], buffers.kv[i, 1]
            keys.index_copy_(2, slots, key)
            values.index_copy_(2, slots, value)
            groups = attn.num_key_value_groups
            if groups > 1:  # (as transformers' repeat_kv: each key/value head serves `groups` query heads in a row)
                b, h, n, d = keys.shape
                keys = keys[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
                values = values[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=attn.scaling)
            hidden = residual + attn.o_proj(out.transpose(1, 2).reshape(1, rows, -1))
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
            states.append(hidden)
    hidden = inner.norm(hidden)
    states[-1] = hidden  # (transformers returns the last layer's output after the final norm)
    return LeanOutput(model.lm_head(hidden), tuple(states))


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """On CUDA, SDPA's memory-efficient kernel (or its math fallback): it takes an arbitrary additive mask and
    is long used under CUDA graphs; left to itself PyTorch may pick cuDNN's attention for a masked bfloat16
    query on recent GPUs, which some cuDNN versions get wrong under graphs for long keys (TransformerEngine
    turns it off there). Elsewhere, PyTorch's own choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _rotated(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, as transformers' Llama applies rotary embeddings."""
    half = heads.shape[-1] // 2
    return heads * cos + torch.cat((-heads[..., half:], heads[..., :half]), dim=-1) * sin


class GraphedTarget:
    """A Llama target's verification forwards replayed as CUDA graphs (`capture=True`, on CUDA) or run on the
    same static buffers without capture (`capture=False`: any device; the tests' way). Use: `new_cache` for a
    generation, the eager forward for the prefill on that cache, then `forward` for each step of at most
    MAX_QUERY tokens."""

    def __init__(self, model: torch.nn.Module, capture: bool = True) -> None:
        refusal = graphs_refusal(model)
        if refusal is not None:
            raise ValueError(f"{type(model).__name__} cannot be graphed: {refusal}")
        self.model = model
        self.capture = capture
        self.device = model.get_input_embeddings().weight.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA target; this one is on {self.device}")
        self.buffers: StaticBuffers | None = None
        # Additive blocks among a step's tokens, on the device, by tree shape (a chain of r rows: the key r): a
        # fixed tree (Medusa's) or a chain then costs no host work and no upload; at most MASK_BLOCKS kept.
        self.blocks: dict[int | tuple[int, ...], torch.Tensor] = {}
        self.prepared: set[bool] = set()  # output_hidden_states values whose graphs `prepare` captures
        self.off: str | None = None  # why graphs were turned off while in use (then `new_cache` gives None)

    def new_cache(self, length: int) -> DynamicCache | None:
        """An empty cache over the static buffers, with room for `length` positions and a padded verification
        after them: the buffers are made again (larger, or for a target whose weights were replaced since, not
        changed in place: graphs read them where they were), with their graphs captured before the prefill.
        None once graphs are off (`off`), or when they no longer apply to the target (then turned off, said)."""
        if self.off is not None:
            return None
        need = length + MAX_QUERY
        refusal = graphs_refusal(self.model)  # (a hook added since, say: the graphs would skip it)
        if refusal is None and self.capture and not on_cuda(self.model):
            refusal = "it is no longer on CUDA"
        if refusal is not None:
            self.turn_off(f"the target changed since its graphs were made: {refusal}")
            return None
        replaced = self.buffers is not None and self.buffers.weights != weight_addresses(self.model)
        if self.buffers is None or replaced or self.buffers.capacity < need:
            capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP
            self.buffers = None  # (the old buffers and graphs freed before the new ones are made)
            self.blocks.clear()  # (in the old buffers' mask dtype)
            self.buffers = StaticBuffers(self.model, capacity)
            for hidden in sorted(self.prepared):
                self.prepare(hidden)
                if self.off is not None:
                    return None
        cache = DynamicCache(config=self.model.config)
        cache.layers = [self.buffers.layer(i) for i in range(len(cache.layers))]
        return cache

    def detached(self, cache: DynamicCache) -> DynamicCache:
        """A cache of the engine's own kind (`specframe.kv_cache.new_cache`) holding `cache`'s positions, for a
        verification that would not fit the static buffers (more than MAX_QUERY tokens near their end): the rest
        of that generation runs eager forwards on it."""
        plain = new_cache(self.model)
        for mine, theirs in zip(plain.layers, cache.layers, strict=True):
            mine.update(theirs.keys, theirs.values)  # (copied into buffers of its own)
        return plain

    def prepare(self, output_hidden_states: bool) -> None:
        """Capture every bucket's graph now (at build, or as new buffers are made, before their prefill: not in
        a timed step, and not while other threads may be running kernels on the model), with or without the
        hidden states; a failure turns graphs off (`turn_off`). Their warm-up runs write keys and values into
        the cache's slots from the static inputs as they are: nothing a later prefill and step do not
        overwrite, or mask."""
        self.prepared.add(output_hidden_states)
        if not self.capture:
            return
        for bucket in QUERY_BUCKETS:
            if self._graph(bucket, output_hidden_states) is None:
                return

    def turn_off(self, why: str) -> None:
        """No graphs from now on (the steps run `static_llama_forward` uncaptured until this generation ends;
        the next one eager forwards), said as a warning."""
        self.off = why
        if self.buffers is not None:
            self.buffers.graphs.clear()
        warnings.warn(f"CUDA graphs off for this target: {why}", GraphsWarning, stacklevel=4)

    def _graph(self, bucket: int, output_hidden_states: bool) -> tuple[Any, LeanOutput] | None:
        """The bucket's graph, captured now if it was not (None when capturing failed: graphs then turned off)."""
        key = (bucket, output_hidden_states)
        if key not in self.buffers.graphs:
            try:
                self.buffers.graphs[key] = self._capture(bucket, output_hidden_states)
            except Exception as e:
                self.turn_off(f"capturing failed: {brief(e, typed=True)}")
                return None
        return self.buffers.graphs[key]

    def takes(self, rows: int) -> bool:
        """Whether a forward of `rows` tokens runs here (else the caller runs the eager one)."""
        return 1 <= rows <= MAX_QUERY

    def holds(self, length: int) -> bool:
        """Whether the static buffers have room for `length` positions (else the caller `detached` its cache)."""
        return length <= self.buffers.capacity

    def forward(
        self,
        cache: DynamicCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        parents: Sequence[int] | None,
        output_hidden_states: bool,
    ) -> LeanOutput:
        """The verification forward of `input_ids` ([1, m]: the root, then the proposal) at `position_ids`, after
        the `cache`'s positions; `parents`: the proposal's tree (each node's parent index, -1 for the root), or
        None for a chain. Writes the m new positions into the cache, as the eager forward does."""
        buffers = self.buffers
        rows = input_ids.shape[1]
        past = cache.get_seq_length()
        if not self.takes(rows) or past + MAX_QUERY > buffers.capacity:
            raise ValueError(f"{rows} tokens after {past} do not fit the static buffers ({buffers.capacity})")
        bucket = next(b for b in QUERY_BUCKETS if b >= rows)
        buffers.input_ids[:, :rows].copy_(input_ids)
        buffers.positions[:, :rows].copy_(position_ids)
        torch.add(buffers.offsets[:bucket], past, out=buffers.slots[:bucket])
        self._write_mask(past, rows, bucket, parents)
        graphed = self._graph(bucket, output_hidden_states) if self.capture and self.off is None else None
        if graphed is None:  # (without capture, or after a capture failed: the same forward, launched from Python)
            out = static_llama_forward(self.model, buffers, bucket)
        else:
            graph, out = graphed
            self._replay(graph)
        for layer in cache.layers:
            layer.set_length(past + rows)
        hidden = tuple(h[:, :rows] for h in out.hidden_states) if output_hidden_states else None
        # (logits copied: the next replay overwrites the graph's output. The hidden states are views of it, valid
        # until the next forward: the engine copies the rows it keeps before then)
        return LeanOutput(out.logits[:, :rows].clone(), hidden)

    def _write_mask(self, past: int, rows: int, bucket: int, parents: Sequence[int] | None) -> None:
        """The additive mask of the step's `bucket` rows over the buffer: each real row sees the past and its
        block's ancestors (a chain's earlier tokens, or a tree node's path to the root) and itself; a padding
        row sees the past and its own slot; nothing sees the positions after the step."""
        buffers = self.buffers
        mask = buffers.mask[0, 0, :bucket]
        mask.fill_(buffers.mask_minimum)
        mask[:, :past] = 0
        mask[:rows, past : past + rows] = self._block(rows, parents)
        pad = buffers.offsets[rows:bucket]
        mask[pad, past + pad] = 0

    def _block(self, rows: int, parents: Sequence[int] | None) -> torch.Tensor:
        """The additive mask among the step's `rows` tokens: a tree's, or a chain's (a tree whose node i has
        parent i - 1), kept on the device by shape."""
        key = rows if parents is None else tuple(parents)
        block = self.blocks.get(key)
        if block is None:
            allowed = tree_visibility(list(range(-1, rows - 2)) if parents is None else parents)
            block = torch.where(allowed, 0.0, self.buffers.mask_minimum).to(self.buffers.mask.dtype)
            block = block.to(self.device, non_blocking=True)
            if len(self.blocks) >= MASK_BLOCKS:  # (dynamic trees seldom repeat: start again)
                self.blocks.clear()
            self.blocks[key] = block
        return block

    def _capture(self, bucket: int, output_hidden_states: bool) -> tuple[Any, LeanOutput]:
        """A graph of `static_llama_forward` on `bucket` rows, its inputs already written for this step (the warm-up
        runs compute this step's keys and values, as the replay that follows does)."""
        model, buffers = self.model, self.buffers
        with torch.cuda.device(self.device):  # (a target on another GPU than the current one)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    static_llama_forward(model, buffers, bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # (a memory pool of its own: graphs replay in any order; other threads' work does not break it)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = static_llama_forward(model, buffers, bucket)
        if not output_hidden_states:
            out = LeanOutput(out.logits, None)
        return graph, out

    def _replay(self, graph: Any) -> None:
        with torch.cuda.device(self.device):
            graph.replay()

    def check(self) -> str | None:
        """Whether this forward gives the eager forward's results on this model and device, up to rounding: a
        prefill of 3 tokens, then a chain of 3 (a padded bucket) and a tree of 4 nodes, each compared with the
        eager forward on a cache of its own (logits and hidden states within max(8 x the dtype's eps, 1e-4) x the
        row's largest magnitude, and the same top token where the eager one leads by more than that). Returns
        what differed, or None."""
        eager = engine_forward(self.model)
        vocab = self.model.config.vocab_size
        ids = (torch.arange(10, device=self.device)[None] * 7 + 3) % vocab
        with torch.inference_mode():
            graphed_cache, eager_cache = self.new_cache(10), new_cache(self.model)
            for cache in (graphed_cache, eager_cache):
                eager(input_ids=ids[:, :3], cache=cache, use_cache=True)
            # (then the first chain token is kept, as after an acceptance of one token: a crop of both caches)
            steps = (([3, 4, 5], [[3, 4, 5]], None), ([6, 7, 8, 9], [[4, 5, 5, 6]], [-1, -1, 0]))
            for taken, positions, parents in steps:
                inputs, positions = ids[:, taken], torch.tensor(positions, device=self.device)
                got = self.forward(graphed_cache, inputs, positions, parents, True)
                mask = None
                if parents is not None:
                    past = eager_cache.get_seq_length()
                    mask = tree_attention_mask(list(parents), past, self.buffers.mask.dtype, self.device)
                want = eager(
                    input_ids=inputs, position_ids=positions, attention_mask=mask, cache=eager_cache,
                    use_cache=True, output_hidden_states=True,
                )  # fmt: skip
                differs = _differs(got, want)
                if differs:
                    return f"{differs} (a {'tree' if parents else 'chain'} of {len(taken)} after 3 tokens)"
                for cache in (graphed_cache, eager_cache):
                    cache.crop(-(len(taken) - 1))
        return None


def _differs(got: LeanOutput, want: LeanOutput) -> str | None:
    """What differs between two forwards' outputs by more than rounding, or None."""
    # (a relative tolerance: rounding moves float32 by ~1e-6 of a row's scale on tiny random models; a wrong
    # mask, position or cache slot moves it by far more than the 16-bit dtypes' 8 eps)
    relative = max(8 * torch.finfo(got.logits.dtype).eps, 1e-4)
    pairs = [("logits", got.logits, want.logits)]
    states = enumerate(zip(got.hidden_states, want.hidden_states, strict=True))
    pairs += [(f"hidden state {i}", g, w) for i, (g, w) in states]
    for name, g, w in pairs:
        g, w = g.float(), w.float()
        tolerance = relative * w.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
        if not torch.isfinite(g).all() or ((g - w).abs() > tolerance).any():
            return f"{name} differ by {(g - w).abs().max().item():.3g}"
    top2 = want.logits.float().topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > relative * top2[..., 0].abs().clamp_min(1.0)
    same = got.logits.argmax(-1) == want.logits.argmax(-1)
    if not (same | ~clear).all():
        return "the top token differs"
    return None


def graphed_target(
    model: torch.nn.Module, enabled: bool, output_hidden_states: bool = False
) -> tuple[GraphedTarget | None, str | None]:
    """The decoder's graphed forward for `model` and, where there is none on a CUDA target with graphs on, why (also
    said as a warning): None and no reason when graphs are off or the model is not on CUDA; None and a reason when
    it cannot be graphed (`graphs_refusal`), or failed to capture or to match the eager forward (`check`). Every
    bucket's graph is captured here, with the hidden states or without (`output_hidden_states`: what the
    decoder's proposer asks for)."""
    if not enabled or not on_cuda(model):
        return None, None
    differs = graphs_refusal(model)
    if differs is None:
        try:
            graphed = GraphedTarget(model)
            with warnings.catch_warnings():  # (a capture that fails turns graphs off: said once, below)
                warnings.simplefilter("ignore", GraphsWarning)
                differs = graphed.check() or graphed.off
                if differs is None:
                    with torch.inference_mode():
                        graphed.prepare(output_hidden_states)
                    differs = graphed.off
        except Exception as e:  # (a capture that fails is caught inside: this is the check's own failure)
            differs = f"checking them against the eager forward failed: {brief(e, typed=True)}"
    if differs is not None:
        warnings.warn(f"CUDA graphs off for this target: {differs}", GraphsWarning, stacklevel=3)
        return None, differs
    return graphed, None


def weight_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    """Where each parameter and buffer of `model` is (a captured graph reads them there)."""
    return tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))


def on_cuda(model: torch.nn.Module) -> bool:
    return model.get_input_embeddings().weight.device.type == "cuda"
