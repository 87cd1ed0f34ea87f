"""`draft`: a separate, smaller causal LM that drafts a chain of tokens with its own KV cache.

Vocabulary: the draft must use the target's tokenizer (same token -> id map; checked when both have one).
Its logits are mapped onto the target's V logit rows: rows the draft lacks get q = 0 (it cannot propose
them; exactness is unaffected), rows past the target's V are dropped. Padding rows (ids past the tokenizer's
length but inside the logit matrix) are kept as each model scores them, so p is exactly the target's.
Without tokenizers the two logit widths must be equal.

Context: the draft never feeds a position at or past its own context window, its max_position_embeddings or,
for a sliding-window draft of a type served only inside its window (`kv_cache.context_window`), that window where
it is smaller (inside it, sliding layers see what full attention does). Near it a step drafts fewer tokens, and
from it on none: those steps are plain decoding steps of the target. Exactness is unaffected either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specframe.cpu_kernels import use_fast_cpu_kernels
from specframe.errors import (
    BadInputError,
    ConfigError,
    ModelLoadError,
    check_field_types,
    is_count,
    is_number,
    user_path,
)
from specframe.fingerprint import is_checkpoint, not_an_artifact
from specframe.kv_cache import context_window, new_cache
from specframe.lean_forward import engine_forward
from specframe.models import check_proposer_dtype, check_proposer_quantize, proposer_dtype, quantize_proposer
from specframe.proposer import (
    Acceptance,
    DecodeState,
    Proposal,
    Proposer,
    TargetInfo,
    check_confidence_threshold,
    resolve_confidence_threshold,
    saved_shape_applies,
    seeded,
)
from specframe.sampling import sampling_probs
from specframe.step_costs import (
    CONTEXT,
    MAX_VERIFY_TOKENS,
    OnlineShapeChoice,
    ShapeCandidate,
    check_shape_choice,
    choose_measured,
    measure_step_costs,
    relative_cost,
)
from specframe.training.draft import DraftTrainConfig

DEFAULT_GAMMA = 4  # γ when neither the config nor the draft's folder gives one


@dataclass
class DraftConfig:
    # The draft model: alias, local Hugging Face directory, hub id or .gguf file (see specframe.models).
    model: str | None = None
    # γ: tokens drafted per step. More pays off when the draft agrees often and is cheap. None: the γ saved with
    # a trained draft (`num_speculative_tokens` in its draft_config.json, tuned on held-out prompts), else 4; on
    # a CPU, a draft saved with `"shape_choice": "measured"` drafts the γ timed fastest at load (`measured_gammas`).
    num_speculative_tokens: int | None = None
    # Draft the draft's argmax (q one-hot) instead of sampling from q. Exact either way; under sampling,
    # greedy drafts are accepted with probability p(x) rather than min(1, p/q).
    greedy: bool = False
    # Draft the next token (after the first, always drafted) only while the chain's cumulative draft
    # probability (the product of its tokens' draft probabilities) times the next token's best probability
    # reaches this; for a greedy chain, the chain is then exactly the tokens whose cumulative probability
    # reaches it. 0 = off, always γ tokens. None: the value saved with a trained draft, else 0. Exactness
    # does not depend on it.
    confidence_threshold: float | None = None
    # Draft weights' dtype: auto (the target's, but bfloat16 for a float32 target on a CPU with native bf16
    # matmuls that does not run specframe's CPU kernels; see specframe.models.proposer_dtype), float32,
    # bfloat16 or float16.
    dtype: str = "auto"
    # The draft's own linear weights rounded at load to 8-bit blocks (GGUF Q8_0: each 32 weights of a row share
    # one 16-bit scale), which specframe's CPU block kernel multiplies reading a quarter of the bytes: auto (where
    # the target runs specframe's CPU kernels and the weights are float32), none (as saved) or q8_0. It changes
    # which tokens are drafted slightly, never the output; see specframe.models.quantize_proposer.
    quantize: str = "auto"
    # With γ chosen at load from this CPU's timings (above), re-choose it every step from the acceptance this
    # generation has had so far, 0 (a plain step) included where drafts are seldom accepted
    # (specframe.step_costs.OnlineShapeChoice). false: the γ chosen at load, every step. Exact either way.
    adapt_shape: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, "proposer.")
        gamma = self.num_speculative_tokens
        if gamma is not None and not is_count(gamma):
            raise ConfigError(f"proposer.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        check_confidence_threshold(self.confidence_threshold)
        check_proposer_dtype(self.dtype)
        check_proposer_quantize(self.quantize)


class DraftProposer(Proposer):
    name = "draft"
    config_class = DraftConfig
    train_config_class = DraftTrainConfig

    @classmethod
    def train(cls, config: DraftTrainConfig, target: torch.nn.Module, tokenizer, resume: bool = False) -> dict:
        from specframe.training.draft import train_draft

        return train_draft(config, target, tokenizer, resume=resume)

    def __init__(
        self,
        config: DraftConfig,
        target: TargetInfo,
        model: torch.nn.Module,
        tokenizer=None,
        vocab_ids: torch.Tensor | None = None,
        saved_gamma: int | None = None,
        saved_threshold: float | None = None,
    ) -> None:
        super().__init__(config, target)
        self.gamma = config.num_speculative_tokens or saved_gamma or DEFAULT_GAMMA  # tokens drafted per step
        self.threshold = resolve_confidence_threshold(
            config.confidence_threshold, saved_threshold, "the confidence_threshold saved with the draft"
        )  # minimum cumulative draft probability of a drafted chain
        if vocab_ids is None:
            check_same_vocabulary(model, tokenizer, target)
        self.model = model
        self.vocab_ids = vocab_ids  # target ids of the draft's logit columns (a reduced vocabulary), or None
        self.width = min(model.get_output_embeddings().weight.shape[0], target.vocab_size)
        # The draft's own context window: past it the draft proposes nothing and the target decodes alone (a
        # model with learned positions, e.g. GPT-2, would fail there; a sliding window counts only for a type not
        # checked past it, kv_cache.PAST_WINDOW_MODEL_TYPES: the draft's chains past it are masked by the model's
        # own windowed mask). Refuses, when it is built, a draft whose cache cannot be rolled back.
        self.window = context_window(model)
        self.cache = None
        self.forward = self.model  # (set by `begin`)
        self.cached = 0  # how many leading tokens of the sequence the draft's cache holds
        self.fed_drafts = 0  # drafted tokens of the last proposal that were fed into the draft's cache
        self.shape_choice: str | None = None  # how γ was measured on this machine (use_fastest_gamma)
        self.measured_shape: str | None = None  # that γ in a few words, "γ = 2" (None: not measured)
        self.online: OnlineShapeChoice | None = None  # γ re-chosen every step (config.adapt_shape)

    @classmethod
    def from_config(cls, config: DraftConfig, target: TargetInfo) -> DraftProposer:
        from specframe.artifacts import shipped
        from specframe.models import load_model
        from specframe.shared_draft import is_shared_draft, load_shared_draft, saved_gamma, saved_threshold

        path = config.model or shipped("draft", target.name, target.model)
        dtype = proposer_dtype(config.dtype, target.dtype, target.device, target.fast_cpu_kernels)
        if not path:
            raise ConfigError(
                f"proposer.model is required: no draft ships for target '{target.name}'; give a draft model "
                "(alias, directory, hub id or .gguf) or train one with `specframe train --proposer draft`"
            )
        folder = user_path(str(path))  # (`~` is the home folder: load_model reads a model name so too)
        if is_shared_draft(folder):
            model, vocab_ids, meta = load_shared_draft(folder, target.model, dtype)
            on_target_kernels(model, config, target)
            threshold = saved_threshold(meta)
            check_confidence_threshold(threshold, f"confidence_threshold in {folder}/draft_config.json")
            applies = saved_shape_applies(meta, target.device, f"{folder}/draft_config.json")
            gamma = saved_gamma(meta, folder) if applies else None
            measure = check_shape_choice(meta.get("shape_choice"), f"{folder}/draft_config.json") == "measured"
            candidates = measured_gammas(meta, f"in {folder}/draft_config.json") if measure else []
            proposer = cls(config, target, model, vocab_ids=vocab_ids, saved_gamma=gamma, saved_threshold=threshold)
            if measure and target.device.type == "cpu" and config.num_speculative_tokens is None:
                proposer.use_fastest_gamma(candidates)
            return proposer
        if is_checkpoint(Path(folder) / "checkpoint") and not (Path(folder) / "config.json").is_file():
            raise ModelLoadError(f"proposer.model '{folder}' {not_an_artifact(folder, 'draft')}")
        try:
            loaded = load_model(path, dtype=dtype, device=str(target.device), quiet=True, fast_cpu_kernels=False)
        except ModelLoadError as e:  # (say which model: the draft, not the target)
            raise ModelLoadError(f"proposer.model (the draft model): {e}") from e
        return cls(config, target, on_target_kernels(loaded.model, config, target), loaded.tokenizer)

    @classmethod
    def random(cls, target: TargetInfo, config: DraftConfig | None = None, seed: int = 0) -> DraftProposer:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=target.vocab_size,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            initializer_range=0.5,
        )  # wide init: peaky, varied q, so acceptance rules are exercised
        with seeded(seed):
            model = LlamaForCausalLM(cfg)
        config = config or DraftConfig()
        model = model.to(
            device=target.device,
            dtype=proposer_dtype(config.dtype, target.dtype, target.device, target.fast_cpu_kernels),
        )
        quantize_proposer(model, config.quantize, target.fast_cpu_kernels)
        return cls(config, target, model.eval(), None)

    def use_fastest_gamma(self, candidates: list[ShapeCandidate]) -> ShapeCandidate:
        """Draft the γ of `candidates` that is fastest on this machine (specframe/step_costs.py): the target's
        forwards and one draft step (a one-token forward over a cached context, and its logits) timed here."""
        costs = measure_step_costs(self.target.model)
        cache, forward = new_cache(self.model), engine_forward(self.model)
        device = self.target.device
        with torch.no_grad():
            forward(input_ids=torch.zeros(1, CONTEXT, dtype=torch.long, device=device), cache=cache, use_cache=True)

            def step() -> None:
                out = forward(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), cache=cache, use_cache=True)
                out.logits[0, -1].float()
                cache.crop(-1)

            draft_cost = relative_cost(step, self.target.model)
        words, searched, adapt = lambda gamma: f"γ = {gamma}", f"γ of 1-{len(candidates)}", self.config.adapt_shape
        choice = choose_measured(candidates, costs, draft_cost, adapt, words, searched, "a draft step")
        self.gamma, self.online = choice.best.shape, choice.online
        self.measured_shape, self.shape_choice = choice.measured_shape, choice.shape_choice
        return choice.best

    def begin(self, prompt: torch.Tensor, hidden_states: dict[int, torch.Tensor]) -> None:
        self.cache = new_cache(self.model)
        self.forward = engine_forward(self.model)  # (the lean forward where it gives the same result)
        self.cached = 0
        if self.online is not None:
            self.online.reset()

    def end(self) -> None:
        self.cache = None

    def _next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed `tokens` ([k]) into the draft; logits at the last one mapped onto the target's rows."""
        out = self.forward(input_ids=tokens[None], cache=self.cache, use_cache=True)
        self.cached += tokens.numel()
        logits = out.logits[0, -1, : self.width].float()
        if self.vocab_ids is not None:  # reduced vocabulary: q = 0 outside it
            return logits.new_full((self.target.vocab_size,), float("-inf")).index_copy_(0, self.vocab_ids, logits)
        if self.width < self.target.vocab_size:
            logits = torch.cat([logits, logits.new_full((self.target.vocab_size - self.width,), float("-inf"))])
        return logits

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Proposal:
        # Drafted token i is predicted at position len(tokens) - 1 + i, which must lie inside the draft's window.
        gamma = self.gamma
        if self.online is not None:  # (γ 0, a plain step: the tokens since are fed with the next draft's)
            gamma = self.online.choose().shape or 0
        gamma = max(min(gamma, state.max_depth, self.window - len(state.tokens) + 1), 0)
        self.fed_drafts = 0
        if gamma == 0:
            return Proposal.empty(state.tokens.device)
        greedy = self.config.greedy or state.sampling.greedy
        logits = state.penalised(self._next_logits(state.tokens[self.cached :]))  # (penalties: as the target's)
        tokens, qs = [], []
        confidence = 1.0  # the chain's cumulative draft probability
        for i in range(gamma):
            if self.threshold > 0:
                # Decided before the token is drawn, from its distribution alone: a sampled token kept only
                # when its own probability is high would no longer be a draw from q, and the acceptance
                # rule would be biased (specframe.testing.broken.KeepIfLikelyDraft).
                dist = torch.softmax(logits, -1) if greedy else sampling_probs(logits, state.sampling)
                best = float(dist.max())
                if i > 0 and confidence * best < self.threshold:  # the first token is always drafted
                    break
            if greedy:
                x = logits.argmax().view(1)
                if self.threshold > 0:
                    confidence *= best  # the argmax's own probability
            else:  # (with a threshold, q is the distribution just computed to decide)
                x, q = self.draw(logits, state, dist if self.threshold > 0 else None)
                if self.threshold > 0:  # (a host sync: only when a threshold needs it)
                    confidence *= float(q[x])
                qs.append(q)
            tokens.append(x)
            if i == gamma - 1 or confidence < self.threshold:  # no next token could reach the threshold
                break
            logits = state.penalised(self._next_logits(x), torch.cat(tokens))
            self.fed_drafts += 1
        drafted = torch.cat(tokens)
        if self.online is not None:  # (fewer than γ where the token budget or the threshold cut the chain)
            self.online.drafted(len(tokens), gamma)
        return Proposal.chain(drafted, None if greedy else torch.stack(qs), deterministic=greedy)

    def draw(
        self, logits: torch.Tensor, state: DecodeState, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one draft token; return it ([1]) and q, the exact distribution it was drawn from (`q` when the
        caller already has `sampling_probs(logits, state.sampling)`)."""
        if q is None:
            q = sampling_probs(logits, state.sampling)
        return torch.multinomial(q, 1, generator=state.generator), q

    def accepted(self, result: Acceptance) -> None:
        # The cache holds the sequence up to the root plus the fed drafts; keep the root and the accepted drafts.
        if self.online is not None:
            self.online.observe(len(result.accepted_nodes))
        keep = min(len(result.accepted_nodes), self.fed_drafts)
        if self.fed_drafts > keep:
            self.cache.crop(-(self.fed_drafts - keep))
            self.cached -= self.fed_drafts - keep


def measured_gammas(meta: dict, where: str) -> list[ShapeCandidate]:
    """The γs a shared draft saved with `"shape_choice": "measured"` chooses from on a CPU: chains of 1 to
    MAX_VERIFY_TOKENS - 1 drafted tokens (the verified counts the target's forwards are timed on). Their expected
    accepted lengths come from the draft's held-out top-1 agreement a with the target (`metrics.heldout`, the
    trainer's): 1 + a + ... + a^γ, each drafted token taken as accepted with chance a once those before it
    were. (Agreement comes in runs, so a token is accepted more often after accepted ones: the estimate is low
    for longer chains, as EAGLE's per-level one is.)"""
    a = ((meta.get("metrics") or {}).get("heldout") or {}).get("top1_agreement")
    if not (is_number(a) and 0 <= a <= 1):
        raise ModelLoadError(
            f'shape_choice "measured" {where} needs metrics.heldout.top1_agreement (the trainer\'s held-out top-1 '
            f"agreement with the target, in [0, 1]), got {a!r}"
        )
    return [
        ShapeCandidate(
            gamma,
            sum(a**i for i in range(gamma + 1)),
            verify_tokens=gamma + 1,
            drafter_forwards=gamma,
            reach=tuple(a**i for i in range(1, gamma + 1)),
        )
        for gamma in range(1, MAX_VERIFY_TOKENS)
    ]


def on_target_kernels(model: torch.nn.Module, config: DraftConfig, target: TargetInfo) -> torch.nn.Module:
    """A loaded draft with its weights rounded as `config.quantize` says, then on specframe's CPU kernels where the
    target runs them (in that order: the kernels look for the rounded weights' blocks); returns it."""
    quantize_proposer(model, config.quantize, target.fast_cpu_kernels)
    if target.fast_cpu_kernels:
        use_fast_cpu_kernels(model)
    return model


def check_same_vocabulary(model: torch.nn.Module, tokenizer, target: TargetInfo) -> None:
    """Refuse a draft whose token ids do not mean what the target's mean."""
    width = model.get_output_embeddings().weight.shape[0]
    if tokenizer is not None and target.tokenizer is not None:
        if tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise BadInputError(
                f"draft/target vocabulary mismatch: the draft's tokenizer ({len(tokenizer)} tokens) does not map "
                f"tokens to the same ids as the target's ({len(target.tokenizer)} tokens)"
            )
        # The draft must be able to propose every token the target can emit (a tokenizer may list more, e.g. a
        # GGUF's added end-of-text token that neither model's logits reach: not a mismatch).
        if width < min(target.vocab_size, len(target.tokenizer)):
            raise BadInputError(
                f"draft/target vocabulary mismatch: the draft's {width} logit rows do not cover the "
                f"{min(target.vocab_size, len(target.tokenizer))} tokens the target can emit"
            )
    elif width != target.vocab_size:
        raise BadInputError(
            f"draft/target vocabulary mismatch: the draft has {width} logit rows, the target {target.vocab_size}"
        )
