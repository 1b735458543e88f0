"""The decode loop: draft -> verify in one target pass -> accept -> roll back -> emit.

Every step feeds the target one block per row, ``[last token, draft_1 .. draft_k]``; the logits at
block position i are the target's law for the token after draft_i, so one pass verifies every draft
and yields the bonus token. Plain decoding is the same loop with no drafter (k = 0), so baseline and
speculation share one code path and one numerics.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from genspec.acceptance import RESIDUALS, verify_chain, verify_greedy, verify_multidraft
from genspec.draft_length import POLICIES, DraftLength
from genspec.drafters.base import Draft, Drafter, TreeDraft
from genspec.errors import ConfigError, ContextLengthError
from genspec.models.base import CausalLM
from genspec.sampling import SamplingConfig, apply_repetition_penalty, block_seen_mask, process_logits, seen_mask


@dataclass
class GenerationConfig:
    """What to generate. ``temperature == 0`` is greedy. ``epsilon > 0`` switches to the lossy
    over-acceptance rule b = min{1, (q + eps)/p} with the ``residual`` ("opt" or "uno")."""

    max_new_tokens: int = 64
    num_draft_tokens: int = 8
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None
    epsilon: float = 0.0
    residual: str = "opt"
    draft_length: str = "cost"

    def __post_init__(self):
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if int(self.num_draft_tokens) != self.num_draft_tokens or self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens (k) must be an integer >= 1, got {self.num_draft_tokens}")
        if self.epsilon < 0:
            raise ConfigError(f"epsilon must be >= 0, got {self.epsilon}")
        if self.draft_length not in POLICIES:
            raise ConfigError(f"draft_length must be one of {POLICIES}, got {self.draft_length!r}")
        if self.residual not in RESIDUALS:
            raise ConfigError(f"residual must be one of {RESIDUALS}, got {self.residual!r}")
        self.stop_strings = tuple(self.stop_strings or ())
        self.sampling  # validates temperature, top-k, top-p, penalty

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.repetition_penalty)


@dataclass
class RequestStats:
    """Per-request statistics. The key names of :meth:`as_dict` are a stable interface."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_calls: int = 0
    new_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    accepted_length_histogram: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.target_calls += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        for histogram, index in ((self.accepted_length_histogram, accepted),):
            histogram.extend([0] * (index + 1 - len(histogram)))
            histogram[index] += 1
        for counts, upto in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for i in range(upto):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target call: 1 + accepted / target calls (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_length_histogram": list(self.accepted_length_histogram),
            "target_calls": self.target_calls,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "total_time_s": self.total_time_s,
            "tokens_per_second": self.tokens_per_second,
            "new_tokens": self.new_tokens,
            "acceptance_per_position": [a / d if d else 0.0 for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position)],
        }


@dataclass
class RequestResult:
    token_ids: list[int]
    stats: RequestStats
    finish_reason: str  # "length", "eos" or "stop"
    text: str | None = None


class _Row:
    """Book-keeping of one sequence in the batch."""

    def __init__(self, prompt: list[int]):
        self.prompt = list(prompt)
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.stats = RequestStats()

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.generated


class SpeculativeEngine:
    """Generates with ``target``, drafting with ``drafter`` (None = plain decoding)."""

    def __init__(self, target: CausalLM, drafter: Drafter | None = None, tokenizer=None):
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)

    # ------------------------------------------------------------------ public API
    def generate_ids(self, prompts: list[list[int]], config: GenerationConfig | None = None,
                     **overrides) -> list[RequestResult]:
        """Generate for a batch of token-id prompts; returns one result per prompt."""
        rows = None
        for rows, _ in self._steps(prompts, _config(config, overrides)):
            pass
        return [self._result(row) for row in rows]

    def generate(self, prompts: str | list[str], config: GenerationConfig | None = None,
                 **overrides) -> list[RequestResult]:
        """Generate from text prompts (needs a tokenizer). ``prompts`` may be one string."""
        return self.generate_ids(self._encode(prompts), config, **overrides)

    def stream(self, prompt: str, config: GenerationConfig | None = None, **overrides) -> Iterator[str]:
        """Yield the text of one request in chunks, as tokens are accepted."""
        shown, text = "", ""
        for rows, _ in self._steps(self._encode([prompt]), _config(config, overrides)):
            text = self._decode(rows[0])
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
                continue
            if len(text) > len(shown):
                yield text[len(shown):]
                shown = text
        if len(text) > len(shown):  # the end: whatever was held back
            yield text[len(shown):]

    # ------------------------------------------------------------------ the loop
    def _steps(self, prompts: list[list[int]], config: GenerationConfig):
        """Run the decode loop; yields ``(rows, new_tokens_per_row)`` after every target call."""
        rows = [_Row(p) for p in prompts]
        self._check_prompts(rows, config)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(config.seed if config.seed is not None else int(torch.seed() % (2 ** 63)))
        sampling = config.sampling
        eos = set(config.eos_token_ids if config.eos_token_ids is not None else self._default_eos())
        started = time.perf_counter()
        self._prefill(rows)
        if self.drafter is not None:
            self.drafter.begin([r.prompt for r in rows], sampling, generator)
        lengths = DraftLength(config.draft_length, config.num_draft_tokens, len(rows))
        free_drafts = self.drafter is not None and getattr(self.drafter, "deterministic", False)
        while True:
            active = [r.finish_reason is None for r in rows]
            if not any(active):
                break
            room = [max(0, min(config.max_new_tokens - len(r.generated) - 1, self._context_room(r) - 1))
                    if on else 0 for r, on in zip(rows, active)]
            tick = time.perf_counter()
            sequences = [r.sequence for r in rows]
            if free_drafts:  # a free drafter proposes first, so the policy can weigh its evidence
                asked = room
                draft = self._draft(sequences, asked)
                evidence = self._evidence(draft, len(rows))
                proposed = self._proposed(draft, len(rows))
                wanted = [min(lengths.limit(i, evidence[i], probe=False), room[i]) if proposed[i] else 0
                          for i in range(len(rows))]
            else:
                wanted = asked = [min(lengths.limit(i), room[i]) for i in range(len(rows))]
                draft = self._draft(sequences, asked)
                evidence = [None] * len(rows)  # drafted before the policy could weigh evidence
            drafted_at = time.perf_counter()
            shadows = self._clip(draft, wanted)
            new_tokens, accepted, drafted = self._verify(rows, active, draft, config, generator)
            verified_at = time.perf_counter()
            lengths.costs.observe_verify(1 + max(drafted), verified_at - drafted_at)
            lengths.costs.observe_draft(sum(asked), drafted_at - tick)
            if self.drafter is not None and draft is not None:
                self.drafter.feedback(accepted)
            for i, (row, on, tokens, acc, dr) in enumerate(zip(rows, active, new_tokens, accepted, drafted)):
                if not on:
                    continue
                lengths.update(i, dr, acc, evidence[i])
                lengths.shadow(i, shadows[i], tokens, evidence[i])
                row.stats.record(dr, acc)
                row.stats.draft_time_s += drafted_at - tick
                row.stats.verify_time_s += verified_at - drafted_at
                self._emit(row, tokens, config, eos)
                row.stats.total_time_s = time.perf_counter() - started
            yield rows, new_tokens

    @staticmethod
    def _evidence(draft, batch: int) -> list:
        evidence = getattr(draft, "evidence", None)
        return list(evidence) if evidence is not None else [None] * batch

    @staticmethod
    def _proposed(draft, batch: int) -> list[bool]:
        if draft is None:
            return [False] * batch
        lengths = draft.lengths if isinstance(draft, Draft) else draft.lengths.amax(dim=1)
        return (lengths > 0).tolist()

    @staticmethod
    def _clip(draft, wanted: list[int]) -> list[list[int]]:
        """Cut drafts to the wanted lengths; return per row the (first) chain cut off where nothing
        was wanted, to be scored against what the target emitted instead."""
        shadows = [[] for _ in wanted]
        if draft is None:
            return shadows
        chain = draft.tokens if isinstance(draft, Draft) else draft.chains[:, 0]
        chain_lengths = draft.lengths if isinstance(draft, Draft) else draft.lengths[:, 0]
        for i, w in enumerate(wanted):
            if w == 0 and int(chain_lengths[i]) > 0:
                shadows[i] = chain[i, :int(chain_lengths[i])].tolist()
        limit = torch.tensor(wanted, dtype=torch.long)
        draft.lengths = torch.minimum(draft.lengths, limit if isinstance(draft, Draft) else limit.unsqueeze(1))
        return shadows

    def _prefill(self, rows: list[_Row]) -> None:
        """Put every prompt token but the last in the target's cache (the last starts the first block)."""
        self.target.reset(len(rows))
        width = max(len(r.prompt) for r in rows) - 1
        if width <= 0:
            return
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, row in enumerate(rows):
            tokens[i, :len(row.prompt) - 1] = torch.tensor(row.prompt[:-1])
            valid[i, :len(row.prompt) - 1] = True
        self.target.forward(tokens, valid, last_only=True)
        self.target.commit_all(valid)

    def _draft(self, sequences, max_tokens):
        if self.drafter is None or not any(max_tokens):
            return None
        return self.drafter.propose(sequences, max_tokens)

    def _verify(self, rows, active, draft, config, generator):
        """One target pass over [last token, drafts]; returns per row the emitted tokens, the number of
        accepted draft tokens and the number of drafted tokens."""
        if isinstance(draft, TreeDraft):
            return self._verify_tree(rows, active, draft, config, generator)
        batch = len(rows)
        if draft is None:
            draft = Draft(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))
        lengths = draft.lengths * torch.tensor(active, dtype=torch.long)
        k = int(lengths.max()) if batch else 0  # no compute spent on padding columns
        draft = Draft(draft.tokens[:, :k], lengths, None if draft.probs is None else draft.probs[:, :k])
        last = torch.tensor([r.sequence[-1] for r in rows], dtype=torch.long).unsqueeze(1)
        block = torch.cat([last, draft.tokens], dim=1)
        valid = torch.arange(k + 1).unsqueeze(0) <= lengths.unsqueeze(1)
        valid &= torch.tensor(active).unsqueeze(1)
        prefix = None
        if k > 0 and hasattr(self.drafter, "verify_prefix"):  # early exit: reuse the draft's layers
            prefix = self.drafter.verify_prefix(self.target, [r.sequence for r in rows], block, valid)
        if prefix is not None:
            logits = self.target.forward(block, valid, prefix=prefix)
        else:
            logits = self.target.forward(block, valid)
        target_scores = self._penalised(logits, rows, block, config.sampling)
        if config.sampling.greedy:
            verdict = verify_greedy(draft.tokens, target_scores.argmax(-1), lengths)
        else:
            target_probs = process_logits(target_scores, config.sampling)
            verdict = verify_chain(draft.tokens, target_probs, draft.probs, lengths, config.epsilon,
                                   config.residual, generator)
        accepted = verdict.accepted_length
        keep = torch.arange(k + 1).unsqueeze(0).expand(batch, -1)
        keep = torch.where((keep <= accepted.unsqueeze(1)) & torch.tensor(active).unsqueeze(1), keep, -1)
        self.target.keep_block(keep)
        new_tokens = [draft.tokens[i, :int(accepted[i])].tolist() + [int(verdict.next_token[i])] if on else []
                      for i, on in enumerate(active)]
        return new_tokens, accepted.tolist(), lengths.tolist()

    def _verify_tree(self, rows, active, draft: TreeDraft, config, generator):
        """Multi-draft: merge the chains into a token tree, score it in one target pass, then walk it
        with the recursive residual verifier (one depth at a time, the live chains as candidates)."""
        batch, num_chains, k = draft.chains.shape
        nodes, paths = [], []  # per row: list of (token, parent); per chain the node index per depth
        for b in range(batch):
            row_nodes, index, row_paths = [], {}, []
            for m in range(num_chains):
                parent, path = 0, []
                for d in range(int(draft.lengths[b, m]) if active[b] else 0):
                    key = (parent, int(draft.chains[b, m, d]))
                    if key not in index:
                        row_nodes.append(key)
                        index[key] = len(row_nodes)  # block index (0 is the last committed token)
                    parent = index[key]
                    path.append(parent)
                row_paths.append(path)
            nodes.append(row_nodes)
            paths.append(row_paths)
        width = 1 + max(len(n) for n in nodes)
        block = torch.zeros(batch, width, dtype=torch.long)
        valid = torch.zeros(batch, width, dtype=torch.bool)
        tree_mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
        for b, row in enumerate(rows):
            block[b, 0] = row.sequence[-1]
            valid[b, 0] = active[b]
            for i, (parent, token) in enumerate(nodes[b], start=1):
                block[b, i], valid[b, i] = token, True
                tree_mask[b, i] |= tree_mask[b, parent]
        logits = self.target.forward(block, valid, tree_mask)
        scores = self._penalised_tree(logits, rows, block, tree_mask, config.sampling)
        target_probs = None if config.sampling.greedy else process_logits(scores, config.sampling)
        keep = torch.full((batch, k + 1), -1, dtype=torch.long)
        new_tokens, accepted, drafted = [], [], []
        for b in range(batch):
            if not active[b]:
                new_tokens.append([]), accepted.append(0), drafted.append(0)
                continue
            node, live, path_tokens, emitted = 0, list(range(num_chains)), [0], None
            for depth in range(k):
                live = [m for m in live if len(paths[b][m]) > depth]
                if not live:
                    break
                candidates = torch.tensor([int(draft.chains[b, m, depth]) for m in live])
                if config.sampling.greedy:
                    best = int(scores[b, node].argmax())
                    hit = [i for i, t in enumerate(candidates.tolist()) if t == best]
                    choice, token = (hit[0] if hit else -1), best
                else:
                    laws = None if draft.probs is None else draft.probs[b, live, depth].unsqueeze(0)
                    verdict = verify_multidraft(candidates.unsqueeze(0), target_probs[b, node].unsqueeze(0), laws,
                                                epsilon=config.epsilon, residual=config.residual, generator=generator)
                    choice, token = int(verdict.accepted_index[0]), int(verdict.token[0])
                if choice < 0:
                    emitted = token
                    break
                node = paths[b][live[choice]][depth]
                live = [m for m in live if int(draft.chains[b, m, depth]) == token]
                path_tokens.append(node)
            if emitted is None:  # every level accepted (or nothing left to try): the bonus token
                emitted = (int(scores[b, node].argmax()) if config.sampling.greedy else
                           int(torch.multinomial(target_probs[b, node], 1, generator=generator)))
            keep[b, :len(path_tokens)] = torch.tensor(path_tokens)
            new_tokens.append([int(block[b, i]) for i in path_tokens[1:]] + [emitted])
            accepted.append(len(path_tokens) - 1)
            drafted.append(len(nodes[b]))
        self.target.keep_block(keep)
        return new_tokens, accepted, drafted

    def _penalised(self, logits, rows, block, sampling: SamplingConfig):
        if sampling.repetition_penalty == 1.0:
            return logits
        base = seen_mask([r.sequence for r in rows], logits.shape[-1], logits.device)
        return apply_repetition_penalty(logits, block_seen_mask(base, block), sampling.repetition_penalty)

    def _penalised_tree(self, logits, rows, block, tree_mask, sampling: SamplingConfig):
        if sampling.repetition_penalty == 1.0:
            return logits
        base = seen_mask([r.sequence for r in rows], logits.shape[-1], logits.device)
        one_hot = torch.zeros(*block.shape, logits.shape[-1], dtype=torch.bool)
        one_hot.scatter_(-1, block.unsqueeze(-1), True)
        one_hot[:, 0] = False
        seen = base.unsqueeze(1) | (tree_mask.to(torch.float32) @ one_hot.to(torch.float32) > 0)
        return apply_repetition_penalty(logits, seen, sampling.repetition_penalty)

    def _emit(self, row: _Row, tokens: list[int], config: GenerationConfig, eos: set[int]) -> None:
        """Append accepted tokens, stopping at EOS, a stop string or the token budget."""
        for token in tokens:
            row.generated.append(token)
            row.stats.new_tokens += 1
            if token in eos:
                row.finish_reason = "eos"
                return
            if len(row.generated) >= config.max_new_tokens:
                row.finish_reason = "length"
                return
        if config.stop_strings and self.tokenizer is not None:
            text = self._decode(row)
            if any(s in text for s in config.stop_strings):
                # cut at the first token whose prefix contains a stop string
                for n in range(len(row.generated) - len(tokens) + 1, len(row.generated) + 1):
                    prefix = self.tokenizer.decode(row.generated[:n], skip_special_tokens=True)
                    if any(s in prefix for s in config.stop_strings):
                        row.stats.new_tokens -= len(row.generated) - n
                        del row.generated[n:]
                        break
                row.finish_reason = "stop"
        if self._context_room(row) <= 0 and row.finish_reason is None:
            row.finish_reason = "length"

    # ------------------------------------------------------------------ helpers
    def _context_room(self, row: _Row) -> int:
        limit = self.target.max_context
        return limit - len(row.sequence) if limit is not None else 1 << 30

    def _check_prompts(self, rows: list[_Row], config: GenerationConfig) -> None:
        if not rows:
            raise ConfigError("no prompts given")
        vocab = self.target.vocab_size
        for row in rows:
            if not row.prompt:
                raise ConfigError("empty prompt: give at least one token")
            if min(row.prompt) < 0 or max(row.prompt) >= vocab:
                raise ConfigError(f"prompt token ids must be in [0, {vocab}), got {min(row.prompt)}..{max(row.prompt)}")
            limit = self.target.max_context
            if limit is not None and len(row.prompt) >= limit:
                raise ContextLengthError(f"prompt has {len(row.prompt)} tokens but the model's context is {limit}")

    def _default_eos(self) -> list[int]:
        ids = getattr(self.tokenizer, "eos_token_id", None)
        if ids is None:
            config = getattr(getattr(self.target, "model", None), "generation_config", None)
            ids = getattr(config, "eos_token_id", None)
        if ids is None:
            return []
        return list(ids) if isinstance(ids, (list, tuple)) else [ids]

    def _encode(self, prompts: str | list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise ConfigError("text prompts need a tokenizer; pass token ids to generate_ids instead")
        if isinstance(prompts, str):
            prompts = [prompts]
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def _decode(self, row: _Row) -> str:
        return self.tokenizer.decode(row.generated, skip_special_tokens=True)

    def _result(self, row: _Row) -> RequestResult:
        text = self._decode(row) if self.tokenizer is not None else None
        return RequestResult(list(row.generated), row.stats, row.finish_reason or "length", text)


def _config(config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    if config is None:
        return GenerationConfig(**overrides)
    if overrides:
        from dataclasses import replace

        return replace(config, **overrides)
    return config
