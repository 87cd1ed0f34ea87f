"""The engine: prefill, then propose -> verify in one target forward -> accept -> roll back, until done."""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from specframe.acceptance import TreeAcceptance
from specframe.architectures import (
    RECOMPUTE_AT_LONGROPE_SWITCH,
    check_tree_attention,
    eos_token_ids,
    longrope_switch,
)
from specframe.config import stop_strings
from specframe.config import stop_token_ids as stop_token_ids_list
from specframe.cpu_kernels import fast_kernels_on
from specframe.cuda_graphs import graphed_target
from specframe.errors import (
    BadInputError,
    ConfigError,
    ProposerError,
    SpecframeError,
    brief,
    is_count,
    is_flag,
    is_integer,
    is_number,
)
from specframe.kv_cache import context_limit, keep_positions, new_cache, sliding_layout, tree_attention_mask
from specframe.lean_forward import engine_forward
from specframe.proposer import (
    MAX_PROPOSAL_NODES,
    Acceptance,
    DecodeState,
    Proposal,
    ProposalStructure,
    Proposer,
    TargetInfo,
    built_proposer,
    given_in_words,
    validate_proposal,
)
from specframe.sampling import History, SamplingParams, check_penalties, check_sampling, check_seed
from specframe.streaming import TextStream

Prompt = str | list[int] | list[dict[str, str]] | torch.Tensor


@dataclass(frozen=True)
class Ends:
    """The token ids that end one call's generation: the model's EOS ids (none with ignore_eos), and its
    stop_token_ids."""

    eos: frozenset[int]
    stop: frozenset[int]

    @property
    def ids(self) -> frozenset[int]:
        return self.eos | self.stop


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None  # decoded new tokens (special tokens skipped), None without a tokenizer
    stats: dict[str, Any] = field(default_factory=dict)  # see docs/architecture.md "Stats"
    # With logprobs: each new token's log-probability under the target's raw logits (before temperature, top-k,
    # top-p, min-p), as vLLM's logprobs report it by default; the same whichever proposer drafted it.
    logprobs: list[float] | None = None
    # With top_logprobs N: for each new token, the target's N most likely tokens at its position, {token id:
    # log-probability} from the most likely down (the same raw logits as logprobs; the chosen token need not be
    # among them).
    top_logprobs: list[dict[int, float]] | None = None


def target_info(model: torch.nn.Module, tokenizer: Any = None, name: str = "") -> TargetInfo:
    emb = model.get_output_embeddings()
    return TargetInfo(
        vocab_size=emb.weight.shape[0],
        hidden_size=model.config.hidden_size,
        num_layers=model.config.num_hidden_layers,
        device=emb.weight.device,
        dtype=emb.weight.dtype,
        model=model,
        tokenizer=tokenizer,
        name=name,
        fast_cpu_kernels=fast_kernels_on(model),
    )


def _sampling_field(key: str) -> property:
    """A decoder attribute that reads one field of its `sampling` and sets it (checked as SamplingParams checks
    it; a number of any library read as Python's)."""

    def set_field(self: SpeculativeDecoder, value: object) -> None:
        self.sampling = replace(self.sampling, **{key: _sampling_value(key, value)})

    return property(lambda self: getattr(self.sampling, key), set_field)


def _sampling_value(key: str, value: object) -> object:
    """A value for SamplingParams field `key`, a number of any library read as Python's (top_k an int, the others
    floats; anything else is left for the checks to name)."""
    return _as_int(value) if key == "top_k" else _as_float(value)


class SpeculativeDecoder:
    """Speculative decoding of one target model with one proposer (batch 1). Building one also prepares the
    target's forward (`specframe.lean_forward.engine_forward`: its first-use check, on a few tokens, and on
    specframe's CPU kernels its stacked products and their layouts), so that the first call's time is decoding.
    The layouts are timed for torch's thread count at the build: a call after `torch.set_num_threads` changed it
    to a count this machine has not timed yet times them first (a few seconds, said on stderr; once per machine
    and count, kept in ~/.cache/specframe/layouts)."""

    def __init__(
        self,
        model: torch.nn.Module,
        proposer: Proposer,
        tokenizer: Any = None,
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 128,
        stop: list[str] | None = None,
        seed: int | None = None,
        acceptance: TreeAcceptance | None = None,
        plugin: str = "",
        cuda_graphs: bool = True,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> None:
        if not isinstance(proposer, Proposer):
            raise BadInputError(
                f"SpeculativeDecoder takes a Proposer instance, got {given_in_words(proposer)}: build one, e.g. "
                "with its class's from_config(config, specframe.decoder.target_info(model, tokenizer))"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.sampling = sampling or SamplingParams()  # defaults: greedy
        self.max_new_tokens = max_new_tokens
        self.stop = stop_strings(stop)
        self.stop_token_ids = stop_token_ids  # (checked per call: `dec.stop_token_ids = 7` is set the same way)
        self.ignore_eos = ignore_eos
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs  # (checked per call, as logprobs is)
        check_seed(seed, key="seed")
        self.seed = seed
        self.acceptance = acceptance or TreeAcceptance()
        self.info = target_info(model, tokenizer)
        self.device = self.info.device
        # The dtype of the hidden states the attention adds a tree mask to (an LM head may be kept in another).
        self.mask_dtype = model.get_input_embeddings().weight.dtype
        self.who = proposer_who(proposer.name, plugin)
        built_for = getattr(proposer, "target", None)
        if isinstance(built_for, TargetInfo):  # (a proposer built for another target fails later on a shape)
            # (what a proposer's drafts depend on: the vocabulary always, the hidden size where it reads features)
            keys = ("vocab_size", "hidden_size") if proposer.hidden_state_layers else ("vocab_size",)
            differ = [
                f"{key} {getattr(built_for, key)} (this target's: {getattr(self.info, key)})"
                for key in keys
                if getattr(built_for, key) != getattr(self.info, key)
            ]
            if differ:
                raise ProposerError(
                    f"{self.who} was built for another target: {', '.join(differ)}; build it with this target's "
                    "specframe.decoder.target_info(model, tokenizer)"
                )
        states = getattr(model.config, "num_hidden_layers", None)  # hidden states: the embeddings + each layer
        for asked in proposer.hidden_state_layers:
            try:
                layer = None if isinstance(asked, bool) else operator.index(asked)  # (numpy and torch integers too)
            except TypeError:
                layer = None
            if layer is None:
                raise ProposerError(f"{self.who} asks for hidden_state_layers {asked!r}: not a layer index")
            if states is not None and not -(states + 1) <= layer <= states:
                raise ProposerError(
                    f"{self.who} asks for hidden state {layer}; the target has {states + 1} (indices 0 to {states})"
                )
        self.eos_ids = eos_token_ids(model, tokenizer)
        # The most tokens a sequence may hold: max_position_embeddings, or a sliding-window target's attention
        # window where that is smaller and specframe serves its type only inside it (`kv_cache.sliding_layout`:
        # past it, a token tree's mask applies the window). Also refuses, before any generation, a target whose
        # cache cannot be rolled back (`specframe.kv_cache.new_cache`).
        self.context_window, self.context_kind = context_limit(model)  # (the kind in words, for messages)
        self.sliding = sliding_layout(model)
        self.rope_switch = longrope_switch(model.config)
        # Whether the target's own generation recomputes its whole cache when the sequence reaches the switch
        # (transformers' Phi-3 family does, in its prepare_inputs_for_generation): then the engine does too.
        self.recompute_at_switch = self.rope_switch is not None and getattr(model.config, "model_type", None) in (
            RECOMPUTE_AT_LONGROPE_SWITCH
        )
        engine_forward(model)  # (its first-use check and stacked products made here, not in the first call's time)
        # On CUDA, the verification forwards as CUDA graphs over a static cache (specframe/cuda_graphs.py): built
        # and checked against the eager forward here; None where off or not on CUDA, and where they do not apply
        # or failed the check (then `graphs_off` says why, as a warning does).
        hidden = bool(proposer.hidden_state_layers)
        self.graphs, self.graphs_off = graphed_target(model, cuda_graphs, hidden)
        self.cache = None  # the target's KV cache, during a generate call
        self._one_call = threading.Lock()  # held by the running generate call
        self._caller: int | None = None  # that call's thread

    # `dec.temperature = 0.7` (and top_k, top_p, min_p, the penalties) sets the decoder's sampling, as the generate
    # arguments of those names do for one call: without these, the assignment would make an attribute that nothing
    # reads.
    temperature = _sampling_field("temperature")
    top_k = _sampling_field("top_k")
    top_p = _sampling_field("top_p")
    min_p = _sampling_field("min_p")
    repetition_penalty = _sampling_field("repetition_penalty")
    presence_penalty = _sampling_field("presence_penalty")
    frequency_penalty = _sampling_field("frequency_penalty")

    def graphs_status(self) -> str:
        """Whether the verification forwards run as CUDA graphs, in words for reports: "verification forwards as
        CUDA graphs", "CUDA graphs off: <why>" (refused at build, or turned off since), or "" (off or not on
        CUDA: nothing to say)."""
        off = self.graphs_off or getattr(self.graphs, "off", None)
        if off:
            return f"CUDA graphs off: {off}"
        return "verification forwards as CUDA graphs" if self.graphs is not None else ""

    def __getstate__(self) -> dict[str, Any]:  # (copies and pickles get a lock of their own, not this one)
        state = {**self.__dict__, "_caller": None}
        del state["_one_call"]
        if state.get("graphs") is not None:  # (not shared: two decoders would write one static cache)
            state.update(graphs=None, graphs_off=GRAPHS_NOT_COPIED)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _one_call=threading.Lock())

    @classmethod
    def from_config(cls, cfg: Any) -> SpeculativeDecoder:
        """Build from a `SpecframeConfig` (see `specframe.config.load_config`): load the target, build the proposer."""
        from specframe.config import SpecframeConfig
        from specframe.models import load_target
        from specframe.plugins import get_registry

        if not isinstance(cfg, SpecframeConfig):
            raise BadInputError(
                f"SpeculativeDecoder.from_config takes a SpecframeConfig, got a {type(cfg).__name__}: make one with "
                "specframe.config.load_config(path, ['proposer.name=eagle', ...])"
            )
        entry = get_registry().get(cfg.proposer_name)
        options = entry.cls.config_class() if cfg.proposer is None else cfg.proposer  # (a hand-built config)
        if not isinstance(options, entry.cls.config_class):
            raise ConfigError(
                f"SpecframeConfig.proposer must be proposer '{entry.name}''s {entry.cls.config_class.__name__} "
                f"(or None for its defaults), got a {type(options).__name__}"
            )
        t = cfg.target
        loaded = load_target(t)
        info = target_info(loaded.model, loaded.tokenizer, t.model)
        # (checked here too, so that a wrong value is named by its config key before the proposer is built)
        in_vocabulary(cfg.generation.stop_token_ids, info.vocab_size, "generation.stop_token_ids")
        if cfg.generation.top_logprobs > info.vocab_size:
            raise ConfigError(
                f"generation.top_logprobs must be at most the target's vocabulary ({info.vocab_size}), got "
                f"{cfg.generation.top_logprobs}"
            )
        who = proposer_who(entry.name, entry.plugin)
        try:
            proposer = built_proposer(entry.cls.from_config(options, info), who, "from_config")
        except SpecframeError:
            raise
        except Exception as e:  # a plugin's own bug: name it
            raise ProposerError(f"{who} failed to build: {e}") from e
        s = cfg.sampling
        return cls(
            loaded.model,
            proposer,
            tokenizer=loaded.tokenizer,
            sampling=SamplingParams(
                s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty
            ),
            max_new_tokens=cfg.generation.max_new_tokens,
            stop=list(cfg.generation.stop),
            stop_token_ids=list(cfg.generation.stop_token_ids),
            ignore_eos=cfg.generation.ignore_eos,
            logprobs=cfg.generation.logprobs,
            top_logprobs=cfg.generation.top_logprobs,
            seed=s.seed,
            plugin=entry.plugin,
            cuda_graphs=t.cuda_graphs,
        )

    # ---------------------------------------------------------------- prompt handling

    def encode(self, prompt: Prompt, raw: bool = False) -> torch.Tensor:
        """Token ids of `prompt`: ids verbatim; strings and message lists through the chat template."""
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:  # (a batch of one, as a tokenizer's return_tensors="pt")
                prompt = prompt[0]
            if prompt.dim() != 1:
                raise BadInputError(
                    f"a tensor prompt must be a 1-D tensor of token ids (or [1, N]: one prompt per call), got shape "
                    f"{tuple(prompt.shape)}"
                )
            if prompt.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
                raise BadInputError(f"a tensor prompt must hold integer token ids, got dtype {prompt.dtype}")
            ids = prompt.long().tolist()
        elif isinstance(prompt, list) and all(is_integer(t) for t in prompt):
            ids = [int(t) for t in prompt]  # (NumPy integers too)
        elif isinstance(prompt, list) and prompt and all(is_number(t) or isinstance(t, bool) for t in prompt):
            i, bad = next((i, t) for i, t in enumerate(prompt) if not is_integer(t))
            raise BadInputError(
                f"a prompt of token ids must hold integers only: item {i} is {bad!r} ({type(bad).__name__})"
            )
        elif isinstance(prompt, str | list):
            ids = self._ids_of_text(prompt, raw)
        else:
            raise BadInputError(
                f"unsupported prompt type {type(prompt).__name__}: give text (str), a list of messages or of token "
                "ids, or a 1-D tensor of token ids"
            )
        if not ids:
            raise BadInputError(
                "the prompt is empty" if not isinstance(prompt, str) else "the prompt's text gives no tokens"
            )
        if min(ids) < 0 or max(ids) >= self.info.vocab_size:
            wrong = min(ids) if min(ids) < 0 else max(ids)
            why = f"prompt token id {wrong} out of range [0, {self.info.vocab_size})"
            from_text = isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], dict))
            if from_text and wrong >= self.info.vocab_size:
                why += (  # (the tokenizer made these ids)
                    f": the tokenizer has {len(self.tokenizer)} tokens, more than the model's "
                    f"{self.info.vocab_size} (are they from different models?)"
                )
            raise BadInputError(why)
        if len(ids) >= self.context_window:
            sliding = self.context_kind == "sliding attention window"
            raise BadInputError(
                f"the prompt has {len(ids)} tokens; the target's {self.context_kind} is {self.context_window}, which "
                "leaves no room for a new token"
                + (
                    f" (specframe serves a sliding-window model of type '{self.model.config.model_type}' only inside "
                    "its window: its tree masks are not checked past it)"
                    if sliding
                    else ""
                )
            )
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _ids_of_text(self, prompt: str | list, raw: bool) -> list[int]:
        """Token ids of a text prompt or a list of messages: through the tokenizer's chat template, unless `raw`
        or the tokenizer has none (then text only, as it is)."""
        if self.tokenizer is None:
            raise BadInputError("the target has no tokenizer: pass the prompt as a list of token ids")
        if isinstance(prompt, str) and not prompt:  # (white space is text: a raw "\n" is a prompt)
            raise BadInputError("the prompt is empty")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if isinstance(prompt, list) and prompt and all(isinstance(m, str) for m in prompt):
            raise BadInputError(
                f"generate takes one prompt per call, got a list of {len(prompt)} strings (batches are not "
                "supported: call generate once per prompt)"
            )
        if isinstance(prompt, list) and not all(isinstance(m, dict) and "content" in m for m in prompt):
            raise BadInputError("a list prompt must hold token ids (int) or messages ({'role', 'content'})")
        messages = [{**m, "content": message_text(i, m["content"])} for i, m in enumerate(messages)]
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(prompt, list) and (raw or not template):  # (joining the contents would drop the roles)
            raise BadInputError(
                "a list of messages needs the tokenizer's chat template, and "
                + ("raw=True skips it" if raw else "this target's tokenizer has none")
                + ": give the prompt as text (a string) or as token ids"
            )
        if not raw and template:
            return chat_ids(self.tokenizer, messages)
        return self.tokenizer(prompt)["input_ids"]

    # ---------------------------------------------------------------- the loop

    @torch.inference_mode()
    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        raw: bool = False,
        stream: Callable[[str], object] | None = None,
        min_p: float | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool | None = None,
        logprobs: bool | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        top_logprobs: int | None = None,
    ) -> GenerationResult:
        """Generate a continuation of `prompt`. `stream`, a function of one string, is handed the text in pieces
        as it is generated (specframe/streaming.py); they add up to the result's text. `stop_token_ids` also end
        it (the id kept as the last token, as an EOS is, its text left out as vLLM leaves it out); `ignore_eos`
        goes on past the model's EOS tokens;
        `logprobs` fills the result's `logprobs` (each new token's log-probability under the target);
        `top_logprobs` N > 0 also its `top_logprobs` (the target's N most likely tokens at each new token's
        position), and turns `logprobs` on. A
        decoder runs one call at a time (the target's cache and the proposer's state are the call's): calls from
        several threads wait their turn; for parallel requests, build one decoder per thread (they may share the
        target model)."""
        if self._caller == threading.get_ident():
            raise SpecframeError(
                "SpeculativeDecoder.generate was called from inside a generate call of the same decoder (by its "
                f"{self.who}, or the function given as stream?): a decoder runs one call at a time; use another "
                "decoder"
            )
        with self._one_call, proposer_in_use(self.proposer, self.who):
            self._caller = threading.get_ident()
            try:
                sampling = {
                    "temperature": temperature,
                    "top_k": top_k,
                    "top_p": top_p,
                    "min_p": min_p,
                    "repetition_penalty": repetition_penalty,
                    "presence_penalty": presence_penalty,
                    "frequency_penalty": frequency_penalty,
                }
                params, max_new, stop_strings, generator = self._settings(max_new_tokens, seed, stop, sampling)
                ends = self._ends(stop_token_ids, ignore_eos)
                want, top = self._logprobs(logprobs, top_logprobs)
                text_stream = self._text_stream(stream, stop_strings)
                result = self._generate(
                    prompt, raw, params, max_new, stop_strings, generator, text_stream, ends, want, top
                )
            except BaseException:
                with contextlib.suppress(Exception):  # (the call's own error is the one to report)
                    self.proposer.end()
                raise
            else:  # (still within the call: an end() that calls generate is refused, as a propose() that does)
                self._call(self.proposer.end)  # (the proposer's per-call state, as the target's cache below)
            finally:
                self._caller = None
                self.cache = None  # (the call's cache; with CUDA graphs their static buffers are kept for the next)
            return result

    def _generate(
        self,
        prompt: Prompt,
        raw: bool,
        params: SamplingParams,
        max_new: int,
        stop: list[str],
        generator: torch.Generator,
        text_stream: TextStream | None,
        ends: Ends,
        logprobs: bool,
        top_logprobs: int,
    ) -> GenerationResult:
        """One call's generation, with its settings as `_settings`, `_ends` and `_logprobs` checked them."""
        start = time.perf_counter()
        prompt_ids = self.encode(prompt, raw=raw)
        model, proposer, layers = self.model, self.proposer, tuple(self.proposer.hidden_state_layers)
        limit = min(max_new, self.context_window - prompt_ids.numel())
        graphs = self.graphs
        cache = graphs.new_cache(prompt_ids.numel() + limit) if graphs is not None else None
        if cache is None:
            if graphs is not None:  # (turned off in use: graphs.off says why, as a warning did)
                self.graphs, self.graphs_off, graphs = None, graphs.off, None
            cache = new_cache(model)
        self.cache = cache  # on self for inspection during the call (the rollback check)
        forward = engine_forward(model)  # (the model itself, or its lean forward where that is the same)
        stats = StepStats()

        out = self._prefill(forward, prompt_ids, cache, layers)
        stats.target_forwards += 1
        if cache.get_seq_length() != prompt_ids.numel():  # (GPT-1's forward ignores the cache: every step would
            raise BadInputError(  # then see its one token alone, silently; checked once, on the prompt)
                f"the target ({type(model).__name__}) did not fill the KV cache it was given for the prompt "
                f"({cache.get_seq_length()} of {prompt_ids.numel()} positions): specframe verifies drafts against "
                "a cache, and cannot serve a model that keeps none"
            )
        history = History(prompt_ids, self.info.vocab_size) if params.penalised else None
        scored = out.logits[0, -1:] if history is None else history.penalised(out.logits[0, -1:], params)
        _, first = self.acceptance(scored, Proposal.empty(self.device), params, generator)
        # (each step's (chosen, top values, top ids), on the device until the end: no wait for the GPU beyond the
        # acceptance's own)
        logged = [token_logprobs(out.logits[0, -1:], [first], top_logprobs)] if logprobs else []
        # The proposer gets its own copies of the engine's token tensors: an in-place edit of them (a contract
        # breach) must not reach what the target is fed.
        self._call(proposer.begin, prompt_ids.clone(), pick_hidden(out, layers, slice(None)))
        generated = [first]
        if history is not None:
            history.add([first])
        new = 1  # tokens the last step emitted
        done = self._finished(generated, limit, stop, new, ends)
        # The sequence on the device, extended by each step's tokens right after its acceptance (the GPU has just
        # been waited for: the upload does not stall it); each proposal gets a copy of its own.
        sequence = torch.cat([prompt_ids, torch.tensor(generated, device=self.device)])

        while not done:
            if text_stream is not None:
                text_stream.update(generated)
            past = cache.get_seq_length()
            tokens = sequence.clone()  # (the proposer's edits of state.tokens stay its own)
            max_depth = limit - len(generated) - 1  # a step emits depth + 1 tokens; limit respects the window
            max_depth = min(max_depth, MAX_PROPOSAL_NODES)  # (a chain that deep still fits one verification)
            if self.rope_switch is not None and past < self.rope_switch:  # (no verification across the switch)
                max_depth = min(max_depth, self.rope_switch - 1 - past)
            recompute = self.recompute_at_switch and past == self.rope_switch  # (then a step without drafts)
            max_depth = 0 if recompute else max_depth
            state = DecodeState(tokens, prompt_ids.numel(), params, generator, max_depth, history)
            t0 = time.perf_counter()
            proposal = self._call(proposer.propose, state)
            structure = validate_proposal(proposal, self.info.vocab_size, max_depth, self.who, self.device)
            t1 = time.perf_counter()

            n = len(proposal)
            if recompute:  # as the target's own generation does: the whole sequence again, in a fresh cache
                cache = self.cache = new_cache(model)
                graphs = None  # (never graphed, LongRoPE targets: `graphs_refusal`; not on this cache in any case)
                out = self._prefill(forward, sequence, cache, layers)  # (the engine's own sequence, not the proposer's)
                rows_before = past  # rows of this forward before the root's
            else:
                out, cache, graphs = self._verify(
                    forward, cache, past, graphs, sequence[-1:], proposal, structure, layers
                )
                rows_before = 0
            stats.target_forwards += 1
            if history is None:
                scored = out.logits[0]
            else:  # (each row with its own history: the output, and its node's tree path)
                scored = history.penalised(out.logits[0], params, *path_entries(structure, self.device))
            path, nxt = self.acceptance(scored, proposal, params, generator, structure)
            keep = [0] + [c + 1 for c in path]
            keep_positions(cache, past, keep, n + 1)
            accepted_tokens = [structure.tokens[c] for c in path]
            if logprobs:  # (the rows that predicted the emitted tokens: the root's, then each accepted node's)
                logged.append(token_logprobs(out.logits[0, keep], accepted_tokens + [nxt], top_logprobs))
            generated += accepted_tokens + [nxt]
            if history is not None:
                history.add(accepted_tokens + [nxt])
            stats.record(structure.depths, len(path), t1 - t0, time.perf_counter() - t1)
            new = len(path) + 1
            done = self._finished(generated, limit, stop, new, ends)
            if not done:
                sequence = torch.cat([sequence, torch.tensor(accepted_tokens + [nxt], device=self.device)])
                hidden = pick_hidden(out, layers, rows_before + torch.tensor(keep, device=self.device))
                self._call(proposer.accepted, Acceptance(path, accepted_tokens, nxt, hidden))

        token_ids, text, finish_reason = self._truncate(generated, limit, max_new, stop, new, ends)
        # Only the last step's block can be cut (every step checks EOS and stop strings): count as proposed and
        # accepted only the depths it kept, so that accepted_tokens never counts tokens the caller does not get.
        stats.keep_only(len(token_ids) - (len(generated) - stats.last_accepted - 1))
        if text_stream is not None:
            text_stream.finish(text)
        wall = time.perf_counter() - start
        chosen = top = None
        if logprobs:
            chosen, values, ids = (torch.cat(part)[: len(token_ids)].tolist() for part in zip(*logged, strict=True))
            top = [dict(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)] if top_logprobs else None
        return GenerationResult(token_ids, text, stats.as_dict(len(token_ids), wall, finish_reason), chosen, top)

    def _logprobs(self, logprobs: object, top_logprobs: object) -> tuple[bool, int]:
        """One call's (logprobs, top_logprobs), its arguments over the decoder's own, checked: top_logprobs > 0
        turns logprobs on, and is refused beside a call's logprobs=False."""
        want = self.logprobs if logprobs is None else logprobs
        if not is_flag(want):
            raise BadInputError(f"logprobs must be True or False, got {want!r}")
        top = _as_int(self.top_logprobs if top_logprobs is None else top_logprobs)
        vocab = self.info.vocab_size
        if not is_integer(top) or not 0 <= top <= vocab:
            raise BadInputError(f"top_logprobs must be an integer in [0, {vocab}] (the vocabulary), got {top!r}")
        if top and logprobs is not None and not logprobs:
            whose = "" if top_logprobs is not None else " (the decoder's: give top_logprobs=0 too)"
            raise BadInputError(f"top_logprobs={top}{whose} needs logprobs, and this call gives logprobs=False")
        return bool(want) or top > 0, int(top)

    def _text_stream(self, stream: Any, stop: list[str]) -> TextStream | None:
        """The call's TextStream for a `stream` function, checked (None without one)."""
        if stream is None:
            return None
        if not callable(stream):
            raise BadInputError(f"stream must be a function taking the text's pieces, got {given_in_words(stream)}")
        if self.tokenizer is None:
            raise BadInputError("stream needs the target's tokenizer to decode the tokens, and this target has none")
        return TextStream(stream, self._decode, stop)

    def _settings(
        self, max_new_tokens: int | None, seed: int | None, stop: list[str] | None, sampling: dict[str, object]
    ) -> tuple[SamplingParams, int, list[str], torch.Generator]:
        """One call's settings, its arguments over the decoder's own, checked: (sampling, max_new_tokens, stop
        strings, the random generator seeded with the call's seed or a fresh one). `sampling`: the call's
        sampling arguments by SamplingParams field, None where the decoder's own holds."""
        max_new_tokens, seed = _as_int(max_new_tokens), _as_int(seed)
        given = {key: _sampling_value(key, value) for key, value in sampling.items() if value is not None}
        if given:  # (checked here so that errors name the argument: top_k, not sampling.top_k)
            s = {**asdict(self.sampling), **given}
            check_sampling(s["temperature"], s["top_k"], s["top_p"], s["min_p"], prefix="")
            check_penalties(s["repetition_penalty"], s["presence_penalty"], s["frequency_penalty"], prefix="")
        params = replace(self.sampling, **given)
        max_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not is_count(max_new):
            raise BadInputError(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
        stop = stop_strings(self.stop if stop is None else stop)  # (`dec.stop = "x"` too: one string, not its letters)
        if stop and self.tokenizer is None:
            raise BadInputError(f"stop strings {stop!r} need the target's tokenizer to match text, and it has none")
        seed = self.seed if seed is None else seed
        check_seed(seed, key="seed")
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()  # a fresh random seed
        else:
            generator.manual_seed(seed)
        return params, max_new, stop, generator

    @staticmethod
    def _prefill(forward: Any, ids: torch.Tensor, cache: Any, layers: tuple[int, ...]) -> Any:
        """The target's forward over the sequence `ids` ([T]) into an empty `cache`; logits of the last row only."""
        return forward(
            input_ids=ids[None], cache=cache, use_cache=True, output_hidden_states=bool(layers), logits_to_keep=1
        )

    def _verify(
        self,
        forward: Any,
        cache: Any,
        past: int,
        graphs: Any,
        root: torch.Tensor,
        proposal: Proposal,
        structure: ProposalStructure,
        layers: tuple[int, ...],
    ) -> tuple[Any, Any, Any]:
        """The target's one forward over the root ([1]) and the proposal's nodes, after the `past` positions `cache`
        holds: a chain under the model's own causal mask or a tree under its 4-D mask (each node sees the prefix and
        its ancestors, at position prefix length + depth). Returns (its output, the cache and the CUDA graphs to go
        on with: a verification larger than any graph, too long for their static buffers, moves this generation to
        eager forwards on a cache of the usual kind)."""
        n, depths = len(proposal), structure.depths
        inputs = torch.cat([root, proposal.tokens.to(self.device)])[None]
        parents = None  # a chain: the model's own causal mask is the tree mask
        if structure.is_chain():
            positions = torch.arange(past, past + n + 1, device=self.device)[None]
        else:
            check_tree_attention(self.model)
            positions = (past + torch.tensor([0, *depths], device=self.device))[None]
            parents = structure.parents
        if graphs is not None and not graphs.takes(n + 1) and not graphs.holds(past + n + 1):
            cache = self.cache = graphs.detached(cache)
            graphs = None
        if graphs is not None and graphs.takes(n + 1):
            return graphs.forward(cache, inputs, positions, parents, output_hidden_states=bool(layers)), cache, graphs
        mask = (
            None if parents is None else tree_attention_mask(parents, past, self.mask_dtype, self.device, self.sliding)
        )
        out = forward(
            input_ids=inputs,
            position_ids=positions,
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(layers),
        )
        return out, cache, graphs

    def _call(self, fn: Any, *args: Any) -> Any:
        """Call a proposer method; any exception becomes a ProposerError that names the proposer, but running out
        of memory stays itself (what a caller catches to retry smaller, and no fault of the proposer's)."""
        try:
            return fn(*args)
        except (ProposerError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            raise ProposerError(f"{self.who} raised {type(e).__name__}: {e}") from e

    # ---------------------------------------------------------------- stopping

    def _ends(self, stop_token_ids: list[int] | None, ignore_eos: bool | None) -> Ends:
        """One call's token ids that end generation (its arguments over the decoder's own), checked."""
        ids = in_vocabulary(self.stop_token_ids if stop_token_ids is None else stop_token_ids, self.info.vocab_size)
        ignore = self.ignore_eos if ignore_eos is None else ignore_eos
        if not is_flag(ignore):
            raise BadInputError(f"ignore_eos must be True or False, got {ignore!r}")
        return Ends(frozenset() if ignore else frozenset(self.eos_ids), frozenset(ids))

    def _finished(self, generated: list[int], limit: int, stop: list[str], new: int, ends: Ends) -> bool:
        """Whether to stop, given that the last `new` tokens of `generated` were just emitted."""
        if len(generated) >= limit or any(t in ends.ids for t in generated[-new:]):
            return True
        return self._stop_prefix(generated, stop, len(generated) - new + 1) is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _in_context(self, ids: list[int]) -> str:
        """The text of new tokens `ids` as it reads after the prompt's, which stop strings are matched in (as vLLM's
        and transformers' stop strings see it): a tokenizer that drops the leading space of a text's first token
        (SentencePiece's, e.g. Llama 2's or Mistral's) keeps it here, decoded after an anchor ("a") then cut off.
        (The result's text is `_decode`'s, as `tokenizer.decode` gives it: without that space.)"""
        if getattr(self, "_anchor_of", None) is not self.tokenizer:
            encode = getattr(self.tokenizer, "encode", None)
            anchor = encode("a", add_special_tokens=False) if encode is not None else []
            self._anchor, self._anchor_of = (anchor if anchor and self._decode(anchor) == "a" else []), self.tokenizer
        if self._anchor:
            text = self._decode([*self._anchor, *ids])
            if text.startswith("a"):
                return text[1:]
        return self._decode(ids)

    def _stop_prefix(self, ids: list[int], stop: list[str], first: int) -> int | None:
        """The shortest prefix of `ids`, of at least `first` tokens, whose text holds a stop string (None: none).
        Where decoding one token at a time would stop. Every prefix is decoded on its own: text need not grow
        by appending as tokens are added (a tokenizer's clean-up turns "s '" into "s's" one token later), so a
        step that emits several tokens can pass a stop string that its last prefix no longer shows."""
        if not stop or self.tokenizer is None:
            return None
        hits = (n for n in range(max(1, first), len(ids) + 1) if self._completes_stop(ids, n, stop))
        return next(hits, None)

    def _completes_stop(self, ids: list[int], n: int, stop: list[str]) -> bool:
        """Whether the text of `ids[:n]` holds a stop string, given that every shorter prefix was checked and held
        none: one found now ends in (or, after a clean-up, a few characters before) the text of its last
        token, so only a tail is decoded, its tokens before the last one reaching at least STOP_TAIL_CHARS
        characters further back than the longest stop string. Decoding the whole prefix instead made the check
        grow with the output's length (about 4 ms a token by 8,000 tokens). A tail too short (tokens without
        text) falls back on the whole prefix, and so does a hit, to confirm it."""
        longest = max(len(s) for s in stop)
        window = longest + STOP_TAIL_CHARS + 1  # (tokens: most hold a character or more; no copy of the prefix)
        if n > window and len(self._decode(ids[n - window : n - 1])) >= longest + STOP_TAIL_CHARS:
            tail = self._decode(ids[n - window : n])
            if not any(s in tail for s in stop):
                return False
        return any(s in self._in_context(ids[:n]) for s in stop)

    def _truncate(
        self, generated: list[int], limit: int, max_new: int, stop: list[str], new: int, ends: Ends
    ) -> tuple[list[int], str | None, str]:
        """Cut at `limit` (max_new_tokens, or fewer where the context window ends first), after the first EOS or
        stop token id, and before the first stop string to be completed; the last step emitted `new` tokens (every
        earlier prefix was checked for stop strings by `_finished`). Returns the tokens, their text and why
        generation ended."""
        ids = generated[:limit]
        end_at = next((i for i, t in enumerate(ids) if t in ends.ids), None)
        if end_at is not None:
            ids = ids[: end_at + 1]
        n = self._stop_prefix(ids, stop, len(generated) - new + 1) if self.tokenizer is not None else None
        if n is not None:
            # (a step that accepts several tokens may complete two stop strings, and the one that starts first in
            # the text need not be the one completed first: the text is cut before the earliest one in that prefix)
            ids = ids[:n]
            text, seen = self._decode(ids), self._in_context(ids)
            if seen.endswith(text):  # (`seen` may have a leading space more: `text`'s first word's)
                at = min(seen.index(s) for s in stop if s in seen) - (len(seen) - len(text))
            else:  # (a clean-up that joins text across the anchor, "a ' s" to "a's": no mapping of places)
                at = min((text.index(s) for s in stop if s in text), default=len(text))
            return ids, text[: max(0, at)], "stop"
        if end_at is not None:  # (an id that is both an EOS and a stop token id: "eos", unless EOS is ignored)
            eos = ids[-1] in ends.eos
            # (a stop token id's text is left out, as vLLM leaves it out: its id stays in the tokens)
            text = self._decode(ids if eos else ids[:-1]) if self.tokenizer is not None else None
            return ids, text, "eos" if eos else "stop"
        reason = "length" if len(ids) >= max_new else "context"
        return ids, self._decode(ids) if self.tokenizer is not None else None, reason


# Characters of text, beyond the longest stop string, that a stop-string check decodes before a prefix's last
# token: the start of a decoded tail can differ from the whole text's (a leading space dropped, the rest of a
# character whose first bytes are cut off), so the tail reaches well past where a stop string could start.
STOP_TAIL_CHARS = 16

GRAPHS_NOT_COPIED = "a copied or unpickled decoder runs eager forwards (CUDA graphs are tied to their static cache)"


def path_entries(structure: ProposalStructure | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For a verification's rows (the root's at row 0, node i's at row i + 1), the draft tokens each row's
    penalties count beyond the output so far, as `History.penalised` takes them: (rows, tokens), every node's own
    token and its ancestors' once in the node's row (none with no structure or no nodes: the root's row alone)."""
    rows, tokens = [], []
    for node in range(len(structure.tokens) if structure is not None else 0):
        at = node
        while at >= 0:  # (the node and its ancestors, each once)
            rows.append(node + 1)
            tokens.append(structure.tokens[at])
            at = structure.parents[at]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(tokens, dtype=torch.long, device=device)


def in_vocabulary(ids: object, vocab_size: int, key: str = "stop_token_ids") -> list[int]:
    """Stop token ids as a list (`specframe.config.stop_token_ids`), each checked to be a token id of a target with
    `vocab_size` tokens; errors name `key`."""
    listed = stop_token_ids_list(ids, key)
    if any(i >= vocab_size for i in listed):
        raise BadInputError(f"{key} holds {max(listed)}: not a token id of this target (vocabulary {vocab_size})")
    return listed


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], top: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of `logits` ([rows, V], raw) with its token `tokens[i]`, in float32 (float64 if they are):
    (log softmax(row)[token] [rows], the `top` largest log-probabilities of each row [rows, top] and their token
    ids [rows, top], most likely first; those two are empty with top 0)."""
    x = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    index = torch.tensor(tokens, device=x.device)[:, None]
    norm = torch.logsumexp(x, -1, keepdim=True)
    values, ids = x.topk(top, -1)  # (sorted: most likely first)
    return (x.gather(-1, index) - norm)[:, 0], values - norm, ids


def proposer_who(name: str, plugin: str = "") -> str:
    """How errors name a proposer: "proposer 'x' (plugin 'p')", without the plugin when it is not known."""
    return f"proposer '{name}'" + (f" (plugin '{plugin}')" if plugin else "")


def _as_int(value: object) -> object:
    """Integer scalars of any library (a 0-d integer tensor's too, as `_as_float` takes one) as Python ints;
    anything else unchanged, for the checks to name."""
    if isinstance(value, torch.Tensor) and is_number(value) and not value.is_floating_point():
        return int(value)
    return int(value) if is_integer(value) else value


def _as_float(value: object) -> object:
    """A 0-d tensor's number as a Python float; anything else unchanged, for the checks to name."""
    return float(value) if isinstance(value, torch.Tensor) and is_number(value) else value


def message_text(index: int, content: object) -> str:
    """A message's content as text: a string, or OpenAI-style content parts (`[{"type": "text", "text": ...}]`,
    as vLLM's chat API takes them) whose texts are joined with newlines, as vLLM joins them for a chat template
    that reads content as a string. Parts of other types (images, audio) are refused: the targets read text."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and not isinstance(part.get("text"), str):
                raise BadInputError(f"message {index}'s content part {j} is of type 'text' but has no text")
            if kind != "text":
                what = f"of type {kind!r}" if isinstance(part, dict) else f"a {type(part).__name__}"
                raise BadInputError(
                    f"message {index}'s content part {j} is {what}: only text parts "
                    "({'type': 'text', 'text': ...}) are supported"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    if content is None:
        raise BadInputError(f"message {index} has no content (None): give it text")
    check_text(content)
    return content


def chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, with the prompt for the assistant's turn
    (or a last assistant message continued)."""
    from jinja2 import TemplateError

    for m in messages:  # (the template reads roles)
        if not isinstance(m.get("role"), str) or not m["role"].strip():
            raise BadInputError(f"a message needs a 'role' (user, assistant...), got {m.get('role')!r}")

    # A last message of the assistant's is continued, not closed and answered (as transformers'
    # text-generation pipeline does): the model writes on from its last word.
    go_on = {"continue_final_message": True} if messages[-1].get("role") == "assistant" else {}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=not go_on, tokenize=True, **go_on)
    except TemplateError as e:  # (e.g. a template that wants user and assistant turns to alternate)
        raise BadInputError(f"the tokenizer's chat template refused these messages: {brief(e)}") from e
    except (ValueError, TypeError) as e:  # (transformers' words for a last message not shown as it is;
        if not go_on:  # a tokenizer of another library's that cannot continue one)
            raise
        raise BadInputError(f"the last (assistant) message cannot be continued: {brief(e)}") from e
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return ids


def check_text(text: object) -> None:
    """Prompt text must be a string of valid Unicode: bytes that are not UTF-8 (on the command line or stdin,
    Python keeps them as lone surrogates) are bad input, not a tokenizer error."""
    if not isinstance(text, str):
        raise BadInputError(f"a message's content must be text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadInputError(f"the prompt is not valid UTF-8 text (bad byte at character {e.start})") from e


def pick_hidden(out: Any, layers: tuple[int, ...], rows: slice | torch.Tensor) -> dict[int, torch.Tensor]:
    """The requested layers' hidden states ([rows, hidden]) from a model output."""
    if not layers:
        return {}
    return {layer: out.hidden_states[layer][0, rows] for layer in layers}


_PROPOSERS_IN_USE: dict[int, object] = {}  # id() of each proposer a generate call runs with -> that call's mark
_IN_USE_LOCK = threading.Lock()


@contextlib.contextmanager
def proposer_in_use(proposer: Proposer, who: str) -> Iterator[None]:
    """Mark `proposer`, and a union's members, as running a call for the duration; a ProposerError if another call
    already runs with one of them (two decoders, or a decoder and its copy, given one proposer: its state is one
    sequence's, and calls at once would mix two). Only this call's marks are removed, so an interrupt anywhere
    leaves none behind."""
    within, mark = [proposer], object()
    for p in within:  # (a union's members, and theirs)
        within += [m for m in getattr(p, "members", ()) if isinstance(m, Proposer) and all(m is not q for q in within)]
    try:
        with _IN_USE_LOCK:
            busy = next((p for p in within if id(p) in _PROPOSERS_IN_USE), None)
            if busy is not None:
                raise ProposerError(
                    f"{who}{'' if busy is proposer else f' (its member {busy.name!r})'} is already running a generate "
                    "call of another decoder: a proposer holds one sequence's state, so decoders used at the same "
                    "time need a proposer each (build one per decoder)"
                )
            for p in within:
                _PROPOSERS_IN_USE[id(p)] = mark
        yield
    finally:
        with _IN_USE_LOCK:
            for p in within:
                if _PROPOSERS_IN_USE.get(id(p)) is mark:
                    del _PROPOSERS_IN_USE[id(p)]


class StepStats:
    """Accumulates the per-step numbers behind the stats (docs/architecture.md "Stats")."""

    def __init__(self) -> None:
        self.target_forwards = 0
        self.proposed_tokens = 0  # tree depth proposed, summed over steps
        self.proposed_nodes = 0
        self.accepted_tokens = 0
        self.proposed_by_position: list[int] = []  # [d] = steps that proposed a node at depth d + 1
        self.accepted_by_position: list[int] = []  # [d] = steps that accepted a node at depth d + 1
        self.propose_time = 0.0
        self.verify_time = 0.0
        self.last_accepted = 0  # draft tokens accepted by the latest step
        self.last_depths: list[int] = []  # the depth of each node the latest step proposed

    def record(self, depths: list[int], accepted: int, propose_s: float, verify_s: float) -> None:
        """One verification step: `depths` of its proposal's nodes, `accepted` of them on the path kept."""
        depth = max(depths, default=0)
        self.proposed_tokens += depth
        self.proposed_nodes += len(depths)
        self.accepted_tokens += accepted
        self.last_accepted, self.last_depths = accepted, depths
        for counts, k in ((self.proposed_by_position, depth), (self.accepted_by_position, accepted)):
            counts.extend([0] * (k - len(counts)))
            for d in range(k):
                counts[d] += 1
        self.propose_time += propose_s
        self.verify_time += verify_s

    def keep_only(self, emitted: int) -> None:
        """The output keeps only `emitted` (possibly <= 0) tokens of the latest step's block. When that cuts into
        its accepted drafts (an EOS or stop string among them), the depths past the cut count as neither proposed
        nor accepted, and their nodes not as proposed: the output ended before them, so they say nothing of the
        proposer."""
        kept = max(emitted, 0)
        if kept > self.last_accepted:  # (the block's own token, or more: nothing cut)
            return
        depth = max(self.last_depths, default=0)
        for counts, k in ((self.accepted_by_position, self.last_accepted), (self.proposed_by_position, depth)):
            for d in range(kept, k):
                counts[d] -= 1
        self.accepted_tokens -= self.last_accepted - kept
        self.proposed_tokens -= depth - kept
        self.proposed_nodes -= sum(d > kept for d in self.last_depths)
        while self.proposed_by_position and not self.proposed_by_position[-1]:  # (depths no step kept)
            self.proposed_by_position.pop()
        del self.accepted_by_position[len(self.proposed_by_position) :]
        self.last_accepted = kept
        self.last_depths = [d for d in self.last_depths if d <= kept]

    def as_dict(self, new_tokens: int, wall: float, finish_reason: str) -> dict[str, Any]:
        return {
            "new_tokens": new_tokens,
            "finish_reason": finish_reason,
            "target_forwards": self.target_forwards,
            "mean_accepted_length": new_tokens / self.target_forwards,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None,
            "proposed_nodes": self.proposed_nodes,
            "proposed_by_position": self.proposed_by_position,
            # (as long as proposed_by_position: depths proposed and never accepted count 0)
            "accepted_by_position": self.accepted_by_position
            + [0] * (len(self.proposed_by_position) - len(self.accepted_by_position)),
            "propose_time_s": self.propose_time,
            "verify_time_s": self.verify_time,
            "wall_time_s": wall,
            "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
        }
