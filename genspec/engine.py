"""The decode loop: draft -> verify in one target pass -> accept -> roll back -> emit.

Requests join and leave between steps (continuous batching): :meth:`SpeculativeEngine.add_request`
queues one, :meth:`SpeculativeEngine.step` admits the queued ones (their prefill runs then; the other
rows keep their caches), runs one speculative step for every running request and returns a
:class:`StepRecord`; a request leaves when it finishes or is cancelled. ``generate``, ``generate_ids``
and ``stream`` are loops over these.

Every step feeds the target one block per row, ``[last token, draft tokens...]`` (a chain, or a token
tree); the logits at a block node are the target's law for the token after it, so one pass verifies
every draft and yields the bonus token. Plain decoding is the same loop with an empty draft, so
baseline and speculation share one code path and one numerics. Each request has its own sampling
settings, drafter (among those the engine holds, or none), draft-length policy, random streams and
statistics.

Stop strings follow OpenAI: a request ends at the token that completes one, and its text ends before
it (:func:`visible_text`: the stop string is not returned); its token ids keep the tokens generated, up
to that token.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping

import torch

from genspec import drafting
from genspec.acceptance.rules import Verdict, verify
from genspec.checks import integer
from genspec.config import GenerationConfig, with_overrides  # noqa: F401 (GenerationConfig: re-exported)
from genspec.draft_length import AcceptanceMemory, CostModel, DraftCost, RowPlan, decide
from genspec.drafters.base import DEFAULT_DRAFT_TOKENS, Draft, Drafter, DraftOffer, RequestContext, check_options
from genspec.drafting import unusable_rows
from genspec.errors import ConfigError, GenerationError, GenspecError, NumericalError
from genspec.kernels import most_likely
from genspec.models.base import CausalLM
# the records are part of the engine's API: ``from genspec.engine import StepRecord`` keeps working
from genspec.records import (IncrementalText, RequestResult, RequestStats, RequestStep, StepRecord,  # noqa: F401
                             visible_text)
from genspec.requests import (Group, Request, by_drafter, check_prompt, encode_prompts, hidden_layers_of,
                              kept_logprobs, own_hidden, prompt_states_of)
from genspec.sampling import target_law
from genspec.theory.pareto import chain_step_statistics

NO_DRAFTER = "none"


class SpeculativeEngine:
    """Generates with ``target``, drafting with ``drafter`` (None = plain decoding).

    ``drafters`` adds more drafters by name (a request picks one with ``GenerationConfig.drafter``);
    ``drafter``, if given, is the default and is also reachable under its ``name``.
    ``max_batch_size`` caps the running batch (None: everything queued runs at once, up to the target's
    ``max_rows``). ``cost_model``:
    the target's verify costs the draft-length plan uses (default: measured as the engine runs).
    """

    def __init__(self, target: CausalLM, drafter: Drafter | None = None, tokenizer=None, *,
                 drafters: Mapping[str, Drafter] | None = None, max_batch_size: int | None = None,
                 cost_model: CostModel | None = None):
        if max_batch_size is not None:
            max_batch_size = integer("max_batch_size", max_batch_size, minimum=1)
        self.target = target
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.drafters: dict[str, Drafter] = dict(drafters or {})
        if NO_DRAFTER in self.drafters:
            raise ConfigError(f"{NO_DRAFTER!r} means no speculation; it cannot name a drafter")
        self.default_drafter = NO_DRAFTER
        if drafter is not None:
            self.drafters.setdefault(drafter.name, drafter)
            self.default_drafter = next(name for name, d in self.drafters.items() if d is drafter)
        self.drafter = drafter
        if target.max_rows is not None:
            max_batch_size = min(max_batch_size or target.max_rows, target.max_rows)
        self.max_batch_size = max_batch_size
        self.costs = cost_model or CostModel()  # the target's verify costs, by block size
        self._timed_shapes: set[tuple[int, int]] = set()  # (rows, tokens) verified once at least
        # each costly drafter's time per draft position
        self.draft_costs = {name: DraftCost(prior_steps=d.capabilities.draft_cost_prior)
                            for name, d in self.drafters.items() if d.capabilities.costly}
        # what each drafter's proposals achieved in earlier requests, greedy and sampled apart
        self.acceptance_memory = {(name, greedy): AcceptanceMemory() for name in self.drafters for greedy in (True, False)}
        self._waiting: list[Request] = []
        self._running: list[Request] = []  # in the target's row order
        self._cancelled: list[Request] = []
        # requests of generate / stream calls -> their steps not yet read by that call: whichever call steps
        # the engine, each request's steps reach its own reader (a paused stream misses nothing)
        self._inboxes: dict[int, list[tuple[RequestStep, Exception | None]]] = {}
        self._ids = itertools.count()
        # the most candidate chains per row the target verifies: each draft's first ones
        self.max_candidates = self.target.reserve_candidates(
            max((d.capabilities.max_candidates for d in self.drafters.values()), default=1))
        self.target.reset(0)

    # ------------------------------------------------------------------ the step API
    def add_request(self, prompt_ids: list[int], config: GenerationConfig | None = None, *,
                    sample_index: int = 0, **overrides) -> int:
        """Queue a request; it joins the batch at the next :meth:`step`. ``sample_index`` picks one of
        the independent random streams of the config's seed (sample i of a seeded ``n``-sample call)."""
        config = with_overrides(config, overrides)
        name = config.drafter if config.drafter is not None else self.default_drafter
        if name != NO_DRAFTER and name not in self.drafters:
            raise ConfigError(f"unknown drafter {name!r} for this engine; it holds: "
                              f"{', '.join([NO_DRAFTER, *self.drafters])}")
        drafter = self.drafters.get(name)
        capabilities = drafter.capabilities if drafter is not None else None
        # names and values, by the drafter's declarations (a value it would only refuse once the request started)
        check_options(capabilities.request_options if drafter else (), config.drafter_options, f"drafter {name!r}",
                      "per-request option")
        if config.measure_bias and drafter is not None and capabilities.max_candidates > 1:
            raise ConfigError(f"bias is measured on chain drafts only; drafter {name!r} drafts trees of up to "
                              f"{capabilities.max_candidates} candidates")
        prompt_ids = check_prompt(self.target, prompt_ids)
        outside = [token for token, _ in config.sampling.logit_bias if token >= self.target.vocab_size]
        if outside:
            raise ConfigError(f"logit_bias token id {outside[0]} is not in the model's vocabulary "
                              f"[0, {self.target.vocab_size})")
        config = config.resolved(drafter is not None and capabilities.samples_drafts,
                                 capabilities.default_draft_tokens if drafter is not None else DEFAULT_DRAFT_TOKENS)
        eos = set(config.eos_token_ids if config.eos_token_ids is not None else self.target.eos_token_ids)
        request = Request(next(self._ids), prompt_ids, config, drafter, name, self.costs, self.draft_costs.get(name),
                           eos, sample_index, self.acceptance_memory.get((name, config.sampling.greedy)))
        self._waiting.append(request)
        return request.id

    def cancel(self, request_id: int) -> None:
        """Stop a request now: it leaves the batch (its cache row is freed) and the next
        :class:`StepRecord` reports it with ``finish_reason == "cancelled"``. Unknown ids are ignored."""
        for queue in (self._waiting, self._running):
            for request in queue:
                if request.id == request_id and request.finish_reason is None:
                    request.finish_reason = "cancelled"
                    self._cancelled.append(request)
        self._release([r for r in self._running if r.finish_reason == "cancelled"])
        self._waiting = [r for r in self._waiting if r.finish_reason is None]

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._cancelled)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> StepRecord:
        """Admit queued requests, then draft, verify, accept, roll back and emit for every running one (after the
        roll back, drafters that read them get the target's predictions over their blocks)."""
        started = time.perf_counter()
        record = StepRecord()
        for request in self._cancelled:
            record.requests[request.id] = RequestStep([], 0, 0, [], "cancelled", request.stats)
        self._cancelled = []
        self._admit(record)
        failures: dict[int, Exception | None] = {}
        if self._running:
            groups = self._draft(record)
            self._verify(groups, record)
            self._commit(groups)
            self._predictions(groups, record)
            self._emit(groups, record)
            leaving = [r for r in self._running if r.finish_reason is not None]
            failures = {r.id: r.exception for r in leaving}
            self._release(leaving)
        for request_id, request_step in record.requests.items():
            if request_id in self._inboxes:
                self._inboxes[request_id].append((request_step, failures.get(request_id)))
        record.total_time_s = time.perf_counter() - started
        record.outside_model_time_s = (record.total_time_s - record.prefill_time_s - record.target_time_s
                                       - record.draft_model_time_s)
        return record

    # ------------------------------------------------------------------ thin loops over the step API
    def generate_ids(self, prompts: list[list[int]], config: GenerationConfig | None = None,
                     **overrides) -> list[RequestResult]:
        """Generate for a batch of token-id prompts; returns one result per prompt. With a seed, prompt i
        uses the seed's i-th random stream. A request that fails (its drafter raised, or NaN / inf
        logits) raises :class:`~genspec.errors.GenerationError` (or its subclass
        :class:`~genspec.errors.NumericalError`), and the call's other requests are cancelled."""
        config = with_overrides(config, overrides)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
            raise ConfigError(f"prompts must be a list of token-id lists, got {prompts!r:.60}")
        prompts = [check_prompt(self.target, prompt) for prompt in prompts]
        if not prompts:
            raise ConfigError("no prompts given")
        ids = self._add_own([(p, config, i) for i, p in enumerate(prompts)])
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        logprobs: dict[int, list] = {i: [] for i in ids}
        finished: dict[int, RequestStep] = {}
        try:
            while len(finished) < len(ids):
                if not any(self._inboxes[i] for i in ids if i not in finished):
                    self.step()
                for i in ids:
                    for step in self._read(i) if i not in finished else ():
                        tokens[i].extend(step.new_tokens)
                        logprobs[i].extend(step.logprobs or ())
                        if step.finish_reason is not None:
                            finished[i] = step
        finally:
            self._disown([i for i in ids if i not in finished])
        return [RequestResult(tokens[i], finished[i].stats, finished[i].finish_reason,
                              visible_text(self._decode(tokens[i]), config.stop_strings, finished=True)
                              if self.tokenizer is not None else None,
                              logprobs[i] if config.logprobs is not None else None) for i in ids]

    def generate(self, prompts: str | list[str], config: GenerationConfig | None = None,
                 **overrides) -> list[RequestResult]:
        """Generate from text prompts (needs a tokenizer). ``prompts`` may be one string."""
        return self.generate_ids(encode_prompts(self.tokenizer, prompts), config, **overrides)

    def stream(self, prompt: str, config: GenerationConfig | None = None, **overrides) -> Iterator[str]:
        """Yield the text of one request in chunks, as tokens are accepted. Streams and ``generate`` calls
        may interleave on one engine: each reads only its own request's steps, whoever ran them."""
        config = with_overrides(config, overrides)
        request_id = self._add_own([(encode_prompts(self.tokenizer, prompt)[0], config, 0)])[0]
        streamed, shown, done = IncrementalText(self._decode), "", False
        try:
            while not done:
                if not self._inboxes[request_id]:
                    self.step()
                for step in self._read(request_id):
                    streamed.extend(step.new_tokens)
                    done = step.finish_reason is not None
                text = visible_text(streamed.final() if done else streamed.text, config.stop_strings, done)
                if len(text) > len(shown):
                    yield text[len(shown):]
                    shown = text
        finally:
            if not done:  # the caller stopped reading: free the request's row
                self._disown([request_id])

    def _add_own(self, requests: list[tuple[list[int], GenerationConfig, int]]) -> list[int]:
        """Queue requests whose steps a thin loop reads (``(prompt, config, sample_index)`` each). Refused
        while requests added with :meth:`add_request` run: the loop's steps would take theirs from
        their caller."""
        foreign = [r.id for r in self._waiting + self._running if r.id not in self._inboxes]
        if foreign:
            raise ConfigError(f"requests added with add_request are running ({len(foreign)}): step them to the end "
                              "(or cancel them) before calling generate or stream, which step the whole engine")
        ids = []
        try:
            for prompt, config, index in requests:
                ids.append(self.add_request(prompt, config, sample_index=index))
                self._inboxes[ids[-1]] = []
        except Exception:
            self._disown(ids)
            raise
        return ids

    def _read(self, request_id: int) -> list[RequestStep]:
        """The steps of a thin loop's request not yet read (its inbox closes after the last one); raises
        the request's error if it failed."""
        entries, self._inboxes[request_id] = self._inboxes[request_id], []
        for step, exception in entries:
            if step.finish_reason is not None:
                del self._inboxes[request_id]
            if step.finish_reason == "error":
                raise exception if isinstance(exception, GenspecError) else GenerationError(step.error)
        return [step for step, _ in entries]

    def _disown(self, request_ids: list[int]) -> None:
        """A thin loop stops reading these requests: those still running are cancelled."""
        for request_id in request_ids:
            self.cancel(request_id)
            self._inboxes.pop(request_id, None)

    # ------------------------------------------------------------------ the step's parts
    def _admit(self, record: StepRecord) -> None:
        """Move queued requests into the batch: prefill every prompt token but the last (the last starts
        the first verify block) in new target rows, and start them in their drafters."""
        room = len(self._waiting) if self.max_batch_size is None else self.max_batch_size - len(self._running)
        joining, self._waiting = self._waiting[:max(room, 0)], self._waiting[max(room, 0):]
        if not joining:
            return
        started = time.perf_counter()
        layers = hidden_layers_of(joining)
        hidden = self.target.add_rows([r.prompt[:-1] for r in joining], return_hidden=any(r.reads_hidden for r in joining),
                                      hidden_layers=layers, hidden_last=prompt_states_of(joining))
        self.costs.observe_prefill(sum(len(r.prompt) - 1 for r in joining), time.perf_counter() - started)
        hidden_of = ({r.id: own_hidden(h if r.prompt_states is None else h[max(len(h) - r.prompt_states, 0):],
                                       layers, r.hidden_layers) for r, h in zip(joining, hidden)}
                     if hidden is not None else {})
        for drafter, requests in by_drafter(joining):
            drafter.start([RequestContext(r.id, list(r.prompt), r.sampling, r.random.draft_generator,
                                          dict(r.config.drafter_options), hidden_of.get(r.id) if r.reads_hidden else None,
                                          r.random if r.coupled else None)
                           for r in requests])
        for request in joining:
            request.started_at = started
        self._running += joining
        record.joined = [r.id for r in joining]
        record.prefill_time_s = time.perf_counter() - started

    def _draft(self, record: StepRecord) -> list[Group]:
        """Every running request's draft, its length planned for the whole batch: each drafter offers its
        rows (free tokens, or a costly draft to come), the plan decides every row's length
        (``draft_length.decide``), then free proposals are cut to it and costly rows drafted."""
        by_group: dict[tuple, list[int]] = {}
        for row, request in enumerate(self._running):
            by_group.setdefault(request.group, []).append(row)
        groups, rows_plan = [], [RowPlan(None)] * len(self._running)
        for rows in by_group.values():
            requests = [self._running[row] for row in rows]
            # a row's room is what its policy can plan at most (k_max): a lookup asked for the whole token budget
            # would copy a continuation of thousands of tokens to have all but k_max of them cut
            drafter = requests[0].drafter
            room = [min(self._room(r), r.policy.k_max) if r.policy is not None else self._room(r) for r in requests]
            offer = DraftOffer.free(Draft.empty(len(rows)))  # no drafter: nothing to draft
            if drafter is not None:
                started = time.perf_counter()
                offer = drafting.offer(drafter, requests, room)
                record.draft_time_s += time.perf_counter() - started
                for i, (row, request) in enumerate(zip(rows, requests)):
                    costly = offer.costly[i]
                    rows_plan[row] = RowPlan(
                        request.policy, offer.evidence_of(i), offer.cap(i, room[i]),
                        self.draft_costs[request.drafter_name] if costly else None,
                        drafter.block_tokens if costly else None, room[i],
                        lambda r=request: r.drafter.catch_up_tokens(r.id, r.sequence))
            groups.append(Group(rows, requests, offer))
        planned = decide(rows_plan, self.costs, self.target.block_shapes)
        for group in groups:
            group.draft = self._draft_planned(group, [planned[row] for row in group.rows], record)
        return groups

    def _draft_planned(self, group: Group, planned: list[int], record: StepRecord) -> Draft:
        """The group's draft of the planned lengths: its free proposals cut to them, and its costly rows drafted
        (if any drafts), their time measured."""
        offer, draft = group.offer, group.offer.proposal.clipped(planned).first_chains(self.max_candidates)
        costly = [i for i, c in enumerate(offer.costly) if c]
        if not any(planned[i] for i in costly):
            return draft
        requests = [group.requests[i] for i in costly]
        started = time.perf_counter()
        drafted, reading = drafting.propose(group.drafter, requests, [planned[i] for i in costly])
        seconds = time.perf_counter() - started
        self.draft_costs[requests[0].drafter_name].observe(max(planned[i] for i in costly), seconds - reading, reading)
        record.draft_model_time_s += seconds
        record.draft_time_s += seconds
        drafted = drafted.first_chains(self.max_candidates)
        if len(costly) == offer.batch:
            return drafted
        at = {i: j for j, i in enumerate(costly)}
        return Draft.stack([drafted.rows([at[i]]) if i in at else draft.rows([i]) for i in range(offer.batch)])

    def _verify(self, groups: list[Group], record: StepRecord) -> None:
        """One target pass over every row's block, then each group's acceptance rule."""
        started = time.perf_counter()
        for group in groups:
            group.take_block(self.target.vocab_size, self.target.device)
        batch = len(self._running)
        width = max(g.block.tokens.shape[1] for g in groups)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        valid = torch.zeros(batch, width, dtype=torch.bool)
        trees = any(g.block.tree_mask is not None for g in groups)
        tree_mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1) if trees else None
        for group in groups:
            rows, n = torch.tensor(group.rows), group.block.tokens.shape[1]
            tokens[rows, :n], valid[rows, :n] = group.block.tokens, group.block.valid
            if trees:
                own = group.block.tree_mask
                tree_mask[rows, :n, :n] = own if own is not None else torch.ones(n, n, dtype=torch.bool).tril()
        # an early-exit draft's first layers of its block: the batch's block if it is the only draft (the
        # target runs every layer where they do not fit)
        prefix = groups[0].draft.prefix if len(groups) == 1 else None
        forward_started = time.perf_counter()
        reads_hidden = any(r.reads_hidden for g in groups for r in g.requests)
        layers = hidden_layers_of([r for g in groups for r in g.requests])
        # read before the target's next call: its own buffer will do (forward_transient)
        logits = self.target.forward_transient(tokens, valid, tree_mask, prefix=prefix, return_hidden=reads_hidden,
                                               hidden_layers=layers)
        if reads_hidden:
            logits, hidden = logits
        bad = unusable_rows(logits, valid)
        if bad:  # those requests fail; their rows are verified on zeros so that the others go on
            for row in bad:
                request = self._running[row]
                request.fail(NumericalError(
                    f"the target model's logits contain NaN or inf (computed in "
                    f"{str(logits.dtype).replace('torch.', '')}) at output position {len(request.generated)}: "
                    "nothing can be sampled from them; a model whose activations overflow its dtype works in "
                    "float32 (or bfloat16)"))
            logits = logits.masked_fill(torch.isin(torch.arange(batch), torch.tensor(bad))[:, None, None], 0.0)
        record.target_time_s = time.perf_counter() - forward_started
        for group in groups:
            rows, width = group.rows, group.block.tokens.shape[1]
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))  # a view, not a copy of [rows, width, V]
            group.verdict = self._accept(group, logits[rows[0]:rows[0] + len(rows), :width] if contiguous
                                         else logits[torch.tensor(rows), :width])
            for request, row, path in zip(group.requests, group.rows, group.verdict.path):
                if request.reads_hidden:  # the kept path's states: those of the tokens now committed
                    request.pending_hidden.append(own_hidden(hidden[row, path[path >= 0]], layers, request.hidden_layers))
        record.verify_time_s = time.perf_counter() - started
        record.batch_size, record.block_width = batch, width
        # the costs are kept by uniform block: a step the target ran as several (unpadded rows of different
        # widths) is priced from them, and its time tells only how far off that price is
        shapes = self.target.block_shapes(valid.sum(1).tolist())
        if len(shapes) > 1:
            self.costs.observe_split(shapes, record.verify_time_s, batch)
        elif shapes and shapes[0] in self._timed_shapes:
            self.costs.observe_verify(shapes[0][1], record.verify_time_s, shapes[0][0])
        elif shapes:  # a shape's first call pays one-time costs (kernels picked, the packed head weight made), several
            # times a later call's; averaged in, it would price a head's tree at several plain steps and switch it off
            # within a short answer (the manual's Draft length page). Calibration drops its first timing too
            self._timed_shapes.add(shapes[0])
        for group in groups:  # after the verify time is taken: measuring and reporting are not verifying
            if any(r.config.logprobs is not None for r in group.requests):
                group.logprobs = self._logprobs(group, logits)
            if any(r.config.measure_bias for r in group.requests) and group.draft.width:
                self._measure_bias(group)

    @staticmethod
    def _measure_bias(group: Group) -> None:
        """Add the rule's exact statistics at this step's judged draft positions (``genspec.theory.pareto``)
        to the stats of the group's requests that measure them."""
        started = time.perf_counter()
        totals = chain_step_statistics(
            group.draft.tokens[:, 0], None if group.draft.probs is None else group.draft.probs[:, 0],
            group.verdict.target_probs, group.verdict.accepted_length, group.block.lengths[:, 0],
            group.rule)
        seconds = time.perf_counter() - started
        for i, request in enumerate(group.requests):
            if request.config.measure_bias:
                request.stats.bias.add(totals.row(i))
                request.stats.bias_time_s += seconds

    @staticmethod
    def _logprobs(group: Group, logits: torch.Tensor) -> list:
        """Per row of ``group`` that asked for them, the target's log-probabilities of the tokens its verdict
        keeps (the accepted draft tokens and the next token; ``logits`` the whole batch's)."""
        verdict, out = group.verdict, []
        for i, (request, row) in enumerate(zip(group.requests, group.rows)):
            if request.config.logprobs is None:
                out.append(None)
                continue
            accepted = int(verdict.accepted_length[i])
            nodes = verdict.path[i, :accepted + 1].tolist()  # node j's logits judged kept token j
            tokens = group.block.tokens[i, nodes[1:]].tolist() + [int(verdict.next_token[i])]
            out.append(kept_logprobs(logits[row], tokens, nodes, request.config.logprobs))
        return out

    def _accept(self, group: Group, logits: torch.Tensor) -> Verdict:
        """Judge one group's block: the target's logits processed as the draft's were, by the group's rule
        with each row's noise (and, for a drafter that reads them, keep the target's predictions at the
        block's nodes)."""
        target = target_law(logits, group.sampling, group.history, group.block.valid)
        if group.reads_predictions:  # the argmax of what is already built: the tokens, or the laws
            group.predicted = target.tokens if target.tokens is not None else most_likely(target.probs)
        return verify(group.candidates, target, group.rule, group.noise)

    def _commit(self, groups: list[Group]) -> None:
        """Keep the accepted path of every row in the target's cache; drop the rest of the block."""
        depth = max(g.verdict.path.shape[1] for g in groups)
        keep = torch.full((len(self._running), depth), -1, dtype=torch.long)
        for group in groups:
            keep[torch.tensor(group.rows), :group.verdict.path.shape[1]] = group.verdict.path
        self.target.keep_block(keep)

    @staticmethod
    def _predictions(groups: list[Group], record: StepRecord) -> None:
        """Hand the drafters that read them the target's predictions over their blocks (their time is drafting
        time: it is not the target's verify cost)."""
        reading = [g for g in groups if g.predicted is not None]
        if reading:
            started = time.perf_counter()
            for group in reading:
                drafting.hand_predictions(group.drafter, group.requests, group.block, group.predicted)
            record.draft_time_s += time.perf_counter() - started

    def _emit(self, groups: list[Group], record: StepRecord) -> None:
        """Append each row's accepted tokens and its next token; stop checks; statistics; policies."""
        now = time.perf_counter()
        for group in groups:
            drafted = group.draft.drafted_tokens()
            depths = group.block.lengths.amax(dim=1).tolist()
            for i, request in enumerate(group.requests):
                if request.finish_reason == "error":  # its drafter failed on it: nothing of this step is kept
                    record.requests[request.id] = RequestStep([], 0, 0, [], "error", request.stats, error=request.error)
                    continue
                accepted = int(group.verdict.accepted_length[i])
                path = group.verdict.path[i, 1:accepted + 1]
                tokens = [int(t) for t in group.block.tokens[i, path]] + [int(group.verdict.next_token[i])]
                evidence = group.offer.evidence_of(i)
                if request.policy is not None:
                    # the policy learns per draft position along the kept path: a tree's depth there, not its node
                    # count (a tree of 8 nodes 4 deep whose path was kept whole had no rejection at positions
                    # 5..8), nor the depth of its other branches (a kept first token with no child tested nothing
                    # after it, and counted as a miss it pulled the later-position rate of wide trees down)
                    request.policy.learn(group.block.reached(i, path.tolist()), accepted, tokens, evidence,
                                         group.offer.first_chain(i), depths[i])
                request.stats.record(drafted[i], accepted, depths[i])
                request.stats.draft_time_s += record.draft_time_s
                request.stats.verify_time_s += record.verify_time_s
                kept = self._append(request, tokens)
                request.random.advance(len(request.generated))
                request.stats.total_time_s = now - request.started_at
                logprobs = group.logprobs[i] if group.logprobs is not None else None
                record.requests[request.id] = RequestStep(
                    kept, drafted[i], accepted, [j < accepted for j in range(depths[i])], request.finish_reason,
                    request.stats, evidence, logprobs=None if logprobs is None else logprobs[:len(kept)])

    def _append(self, request: Request, tokens: list[int]) -> list[int]:
        """Append tokens, stopping at EOS, a stop string, the token budget or the context; returns the
        tokens kept."""
        before = len(request.generated)
        config = request.config
        for token in tokens:
            request.generated.append(token)
            if token in request.eos:
                request.finish_reason = "eos"
                break
            if len(request.generated) >= config.max_new_tokens:
                request.finish_reason = "length"
                break
        if config.stop_strings and self.tokenizer is not None and request.finish_reason != "eos":
            text = self._decode(request.generated)
            if any(s in text for s in config.stop_strings):
                # cut at the first token whose prefix contains a stop string (it is one of this step's)
                for n in range(before + 1, len(request.generated) + 1):
                    if any(s in self._decode(request.generated[:n]) for s in config.stop_strings):
                        del request.generated[n:]
                        break
                request.finish_reason = "stop"
        if request.finish_reason is None and self._context_left(request) <= 0:
            request.finish_reason = "length"
        kept = request.generated[before:]
        request.stats.new_tokens += len(kept)
        return kept

    def _release(self, leaving: list[Request]) -> None:
        """Finished or cancelled requests leave: their target rows are freed, their drafters forget them."""
        if not leaving:
            return
        gone = {r.id for r in leaving}
        self.target.remove_rows([row for row, r in enumerate(self._running) if r.id in gone])
        for drafter, requests in by_drafter(leaving):
            drafter.finish([r.id for r in requests])
        self._running = [r for r in self._running if r.id not in gone]

    # ------------------------------------------------------------------ helpers
    def _room(self, request: Request) -> int:
        """Draft tokens this request may still verify: the budget and the context leave room for them
        and the token after them."""
        budget = request.config.max_new_tokens - len(request.generated) - 1
        return max(0, min(budget, self._context_left(request) - 1))

    def _context_left(self, request: Request) -> int:
        limit = self.target.max_context
        return limit - len(request.prompt) - len(request.generated) if limit is not None else 1 << 30

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

