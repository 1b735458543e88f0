"""The engine's book-keeping of a request (:class:`Request`) and of the rows one drafter verifies together in a
step (:class:`Group`), with the small functions the step loop applies to them."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from genspec.acceptance import Candidates, Rule, RuleKind, Verdict
from genspec.config import GenerationConfig
from genspec.draft_length import AcceptanceMemory, CostModel, DraftCost, DraftLength
from genspec.drafters.base import Draft, DraftBlock, Drafter, DraftOffer
from genspec.models.base import CausalLM
from genspec.checks import integer
from genspec.errors import ConfigError, ContextLengthError, GenspecError
from genspec.randomness import Noise, RequestRandomness, block_noise
from genspec.records import RequestStats, TokenLogprob
from genspec.sampling import SamplingConfig, TokenHistory
from genspec.theory.pareto import StepStatistics


def group_rule(requests: list[Request]) -> Rule:
    """The rule a group's rows that are not coupled follow, with each row's epsilon and delta: lossless rows
    (standard and coupled share a group, :meth:`Request.group`) follow the standard rule, lossy groups
    their own."""
    return Rule.batch([r.rule for r in requests])


class Request:
    """Book-keeping of one request."""

    def __init__(self, request_id: int, prompt: list[int], config: GenerationConfig, drafter: Drafter | None,
                 drafter_name: str, costs: CostModel, draft_cost: DraftCost | None, eos: set[int], sample_index: int,
                 memory: AcceptanceMemory | None = None):
        self.id = request_id
        self.prompt = list(prompt)
        self.config = config
        self.sampling = config.sampling
        self.drafter = drafter
        self.drafter_name = drafter_name
        capabilities = drafter.capabilities if drafter is not None else None
        self.policy = (DraftLength(config.draft_length, config.num_draft_tokens, costs, draft_cost, memory=memory,
                                   probe_tokens=drafter.block_tokens(1) if capabilities.costly else 1)  # what a probe drafts
                       if drafter else None)
        self.random = RequestRandomness(config.seed, sample_index, capabilities.max_candidates if drafter else 1)
        self.eos = eos
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.exception: Exception | None = None  # why it failed (finish_reason "error")
        self.stats = RequestStats(acceptance=config.acceptance,
                                  bias=StepStatistics.zero() if config.measure_bias else None)
        self.started_at = 0.0
        self.reads_hidden = drafter is not None and capabilities.reads_target_hidden
        self.hidden_layers = capabilities.target_hidden_layers if self.reads_hidden else ()  # beyond the final states
        self.prompt_states = capabilities.prompt_states if self.reads_hidden else None  # how many of the prompt's last states it reads (None: all)
        self.coupled = config.acceptance_rule.kind is RuleKind.COUPLED and not self.sampling.greedy  # the coupled rule verifies it
        rule = config.acceptance_rule
        self.rule = Rule(delta=rule.delta) if rule.lossless else rule  # its row of its group's rule (group_rule)
        self.pending_hidden: list[torch.Tensor] = []  # the target's hidden states not yet handed to the drafter

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.generated

    def fail(self, exception: Exception) -> None:
        """The request ends with ``finish_reason`` "error"; nothing of the current step is kept."""
        self.finish_reason, self.exception = "error", exception
        self.error = str(exception) if isinstance(exception, GenspecError) else f"{type(exception).__name__}: {exception}"

    def take_hidden(self) -> torch.Tensor | None:
        """The target's hidden states of the tokens committed since the drafter last saw any (None when
        the drafter does not read them)."""
        if not self.reads_hidden:
            return None
        hidden, self.pending_hidden = self.pending_hidden, []
        return torch.cat(hidden) if len(hidden) > 1 else hidden[0] if hidden else None

    @property
    def group(self) -> tuple:
        """Rows verified together: one drafter, and lossless rows (standard and coupled: ``verify`` takes a
        per-row mask) apart from each lossy (rule, residual)."""
        rule = self.config.acceptance_rule
        return self.drafter_name, (None if rule.lossless else (rule.kind, rule.residual))


@dataclass
class Group:
    """The running requests of one drafter in one step: its offer, their draft, the block the target scores
    with what judging it takes, and the verdict."""

    rows: list[int]  # indices into the running batch
    requests: list[Request]
    offer: DraftOffer
    draft: Draft | None = None
    block: DraftBlock | None = None
    candidates: Candidates | None = None  # the block's draft, as the acceptance rule reads it
    history: TokenHistory | None = None  # [B, N, V] what each node's penalties read (None: no row penalises)
    noise: Noise | None = None  # the rows' randomness at the block's positions (None: every row is greedy)
    verdict: Verdict | None = None
    predicted: torch.Tensor | None = None  # [B, N] the target's most likely token at each node, if the drafter reads it
    logprobs: list[list[TokenLogprob] | None] | None = None  # per row, its kept tokens' (None: no row asked)
    sampling: list[SamplingConfig] = field(init=False)  # each row's, from its request
    rule: Rule = field(init=False)  # the group's acceptance rule (:func:`group_rule`), once

    def __post_init__(self):
        self.sampling = [r.sampling for r in self.requests]
        self.rule = group_rule(self.requests)

    @property
    def drafter(self) -> Drafter | None:
        return self.requests[0].drafter

    @property
    def reads_predictions(self) -> bool:
        """Does the group's drafter read the target's predictions over its blocks?"""
        return self.drafter is not None and self.drafter.capabilities.reads_block_predictions

    def take_block(self, vocab_size: int, device: torch.device) -> None:
        """Form the block the target scores (node 0 each row's last token, then its draft) and what judging
        it takes: the penalties' history at its nodes and the rows' noise, by position."""
        requests, draft = self.requests, self.draft
        self.block = block = draft.block([r.sequence[-1] for r in requests], [True] * len(requests))
        self.candidates = Candidates(draft.tokens, block.lengths, block.node_of, draft.probs)
        history = TokenHistory.of([r.sequence for r in requests], [len(r.prompt) for r in requests], self.sampling,
                                  vocab_size, device)
        if history is not None:
            self.history = history.along(block.tokens, block.tree_mask)
        self.noise = block_noise([None if r.sampling.greedy else r.random for r in requests],
                                 [len(r.generated) for r in requests], [r.coupled for r in requests],
                                 draft.width, draft.num_chains, vocab_size)


def kept_logprobs(logits: torch.Tensor, tokens: list[int], nodes: list[int], top: int) -> list[TokenLogprob]:
    """The target's log-probabilities (:class:`~genspec.records.TokenLogprob`) of a row's kept ``tokens``: token j
    was judged by the row's raw ``logits`` ``[N, V]`` at block node ``nodes[j]``, with the ``top`` likeliest there."""
    laws = logits[nodes].float().log_softmax(-1)
    chosen = laws.gather(-1, torch.tensor(tokens, device=laws.device).unsqueeze(-1)).squeeze(-1).tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = laws.topk(min(top, laws.shape[-1]), dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


def by_drafter(requests: list[Request]) -> list[tuple[Drafter, list[Request]]]:
    """The requests that use a drafter, per drafter (requests without one are left out)."""
    groups: dict[int, tuple[Drafter, list[Request]]] = {}
    for request in requests:
        if request.drafter is not None:
            groups.setdefault(id(request.drafter), (request.drafter, []))[1].append(request)
    return list(groups.values())


def hidden_layers_of(requests: list[Request]) -> tuple[int, ...]:
    """The target layers whose states some of these requests' drafters read with the final ones."""
    return tuple(sorted({layer for r in requests for layer in r.hidden_layers}))


def prompt_states_of(requests: list[Request]) -> int | None:
    """How many of their prompts' last states these requests' drafters read: the most any reads (None: all)."""
    wanted = [r.prompt_states for r in requests if r.reads_hidden]
    return None if not wanted or None in wanted else max(wanted)


def own_hidden(hidden: torch.Tensor, layers: tuple[int, ...], own: tuple[int, ...]) -> torch.Tensor:
    """A request's part of hidden states ``[..., H * (1 + len(layers))]`` (final, then ``layers``): the
    final states, then those of its drafter's layers ``own``."""
    if tuple(own) == layers:
        return hidden
    parts = hidden.chunk(1 + len(layers), dim=-1)
    return torch.cat([parts[0]] + [parts[1 + layers.index(layer)] for layer in own], -1)


def check_prompt(target: CausalLM, prompt: list[int]) -> list[int]:
    """``prompt`` as a list of ints, checked: token ids of ``target``'s vocabulary, at least one, fewer
    than its context holds."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
        raise ConfigError(f"a prompt must be a list of token ids, got {prompt!r:.60}"
                          + ("; text prompts go to generate or stream" if isinstance(prompt, str) else ""))
    prompt = list(prompt)
    if not all(type(token) is int for token in prompt):  # the common case checked at C speed
        prompt = [integer("prompt token id", token) for token in prompt]
    if not prompt:
        raise ConfigError("empty prompt: give at least one token")
    vocab = target.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ConfigError(f"prompt token ids must be in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
    limit = target.max_context
    if limit is not None and len(prompt) >= limit:
        raise ContextLengthError(f"prompt has {len(prompt)} tokens but the model's context is {limit}")
    return prompt

def encode_prompts(tokenizer, prompts: str | list[str]) -> list[list[int]]:
    """Text prompts (one, or a list) as token ids, each checked to be text that can be encoded."""
    if tokenizer is None:
        raise ConfigError("text prompts need a tokenizer; pass token ids to generate_ids instead")
    if isinstance(prompts, str):
        prompts = [prompts]
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise ConfigError(f"a text prompt must be a str, got {prompt!r:.60}; token ids go to generate_ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (e.g. undecodable bytes read with surrogateescape)
            raise ConfigError(f"the prompt is not valid Unicode text: {exc.object[exc.start]!r} at character "
                              f"{exc.start} is a lone surrogate") from None
    return [tokenizer(p)["input_ids"] for p in prompts]
