"""A separate (smaller) language model with the target's tokenizer drafts autoregressively.

The draft model keeps its own KV cache, one row per request. Before drafting it syncs each row with the
committed sequence the llama.cpp way: keep the longest common prefix of what it holds and what the
target committed, drop the rest, and feed the difference in one ragged block. A request's prompt is
read at its first draft, not when it joins: a request the draft-length policy never drafts for costs the
drafter nothing (layer skip, which accepts nothing on the embedded model, reads a prompt at half the
target's cost: read at once, long prompts would cost a fresh engine a good share of plain speed on short
answers; the manual's Self-speculation page), and :meth:`catch_up_tokens` tells the policy what a
first draft would have to read. Each row samples with its request's settings and random stream.

Hierarchical speculation (TriForce-style): with an ``inner`` drafter the draft model's own drafting
is speculative too: the inner drafter proposes, the draft model verifies with the same lossless
rules (:func:`genspec.acceptance.verify`), and every token it emits is an exact sample of its own
law, which is passed up as the draft law. Drafters stack to any depth.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from genspec.acceptance import Candidates, verify
from genspec.drafters.base import (MAX_CANDIDATES, PATH, Draft, Drafter, DrafterCapabilities, DraftRequest, Option,
                                   RequestContext, check_options, draw_tokens, ragged_tokens, request_uniforms)
from genspec.drafters.ngrams import common_prefix_length
from genspec.errors import ConfigError
from genspec.models.base import CausalLM
from genspec.models.hf import HFCausalLM
from genspec.randomness import Noise
from genspec.sampling import TokenHistory, adjust_logits, process_logits, target_law


#: the options every draft-model drafter takes: independent chains sampled per row (several: verified as a
#: tree), and the least draft probability a drafted token may have without ending the draft
NUM_DRAFTS = Option("num_drafts", int, 1, MAX_CANDIDATES)
CONFIDENCE_THRESHOLD = Option("confidence_threshold", float, 0.0, 1.0, high_open=True)
#: the model a ``draft-model`` drafter drafts with: a directory, or a loaded model
DRAFT_MODEL = Option("draft_model", (*PATH, CausalLM), needed="a draft model (--draft-model PATH)")


def sync_rows(model: CausalLM, held: list[list[int]], sequences: list[list[int]], active: list[bool],
              logits: bool = True) -> tuple[list[list[int]], torch.Tensor | None]:
    """Bring a draft model's rows, holding ``held``, to ``sequences`` the llama.cpp way: keep the longest
    common prefix, drop the rest, feed the difference of the ``active`` rows in one ragged block (in pieces of
    the model's :attr:`~genspec.models.base.CausalLM.max_block_tokens`: a draft that did not draft for a while
    catches up on every token committed since). Returns what each row holds then, and the logits ``[R, V]`` of
    each row's next token (the last token is then always fed again, for its logits), or None with
    ``logits=False``."""
    # (never below 0: a row that holds nothing and reads nothing stays empty, not at length -1)
    keep = [max(0, min(common_prefix_length(h, seq), len(seq) - (1 if logits else 0)))
            for h, seq in zip(held, sequences)]
    model.truncate(torch.tensor(keep, dtype=torch.long))
    new = [seq[k:] if on else [] for seq, k, on in zip(sequences, keep, active)]
    now = [seq[:k] + chunk for seq, k, chunk in zip(sequences, keep, new)]
    if not logits and not any(new):
        return now, None
    longest = max(1, max(len(chunk) for chunk in new))
    piece = model.max_block_tokens or longest
    out = None
    for start in range(0, longest, piece):
        tokens, valid = ragged_tokens([chunk[start:start + piece] for chunk in new])
        if logits:
            last = model.forward(tokens, valid, last_only=True)[:, 0]
            ends_here = torch.tensor([start < len(chunk) <= start + piece or (not chunk and start == 0) for chunk in new])
            out = last if out is None else torch.where(ends_here[:, None], last, out)
        else:
            model.hidden_states(tokens, valid)
        model.commit_all(valid)
    return now, out


class DraftModelDrafter(Drafter):
    """Drafts with ``model``.

    ``num_drafts`` > 1 samples that many independent chains (multi-draft, verified as a tree);
    ``confidence_threshold`` ends a row's draft with the first token whose draft probability is below
    it (Hugging Face's assistant_confidence_threshold: that token is drafted, the ones after it are not; a
    sampled draft that left out its unsure token would be drawn from the law cut to its sure tokens, not
    from the law the verifier is given, and the standard rule would no longer be exact); ``inner`` makes drafting hierarchical;
    ``reuse_layers`` (early exit) hands the layers the draft computed to the target's verify pass.
    """

    name = "draft-model"
    capabilities = DrafterCapabilities(samples_drafts=True)
    options = (DRAFT_MODEL, NUM_DRAFTS, CONFIDENCE_THRESHOLD)

    def __init__(self, model: CausalLM, num_drafts: int = 1, confidence_threshold: float = 0.0,
                 inner: Drafter | None = None, reuse_layers: bool = True):
        given = {"num_drafts": num_drafts, "confidence_threshold": confidence_threshold}
        check_options((NUM_DRAFTS, CONFIDENCE_THRESHOLD), given, f"drafter {self.name!r}")
        self.model = model
        self.confidence_threshold = float(confidence_threshold)
        self.inner = inner
        self.reuse_layers = reuse_layers
        self.reuses = model.prefix_source if reuse_layers else None  # the target its drafts' layers serve
        self.capabilities = replace(self.capabilities, max_candidates=int(num_drafts),
                                    early_exit=self.reuses is not None)
        self._order: list[int] = []  # request ids, in the model's row order
        self._held: dict[int, list[int]] = {}  # the tokens each row holds in the model's cache
        self._contexts: dict[int, RequestContext] = {}
        model.reset(0)

    @classmethod
    def for_target(cls, target: CausalLM, draft_model: str | CausalLM | None = None, num_drafts: int = 1,
                   confidence_threshold: float = 0.0) -> "DraftModelDrafter":
        """``draft_model``: a local model directory (or a loaded :class:`CausalLM`) sharing the target's
        tokenizer (the registry's ``draft-model`` hands a distilled draft's directory to :class:`DistilledDrafter`
        instead: :class:`genspec.drafters.registry.AnyDraftModel`)."""
        DRAFT_MODEL.check(draft_model, f"drafter {cls.name!r}")
        if not isinstance(draft_model, CausalLM):
            draft_model = HFCausalLM.from_pretrained(draft_model)
        if draft_model.vocab_size != target.vocab_size:
            raise ConfigError(f"draft and target vocabularies differ ({draft_model.vocab_size} vs "
                              f"{target.vocab_size}); they must share the tokenizer")
        return cls(draft_model, num_drafts=num_drafts, confidence_threshold=confidence_threshold)

    # --------------------------------------------------------------- life cycle
    def start(self, contexts: list[RequestContext]) -> None:
        self.model.add_rows([[] for _ in contexts])  # empty rows: the prompt is read at the first draft
        for context in contexts:
            self._order.append(context.request_id)
            self._held[context.request_id] = []
            self._contexts[context.request_id] = context
        if self.inner is not None:
            self.inner.start(contexts)

    def finish(self, request_ids: list[int]) -> None:
        gone = set(request_ids) & set(self._held)
        self.model.remove_rows([row for row, i in enumerate(self._order) if i in gone])
        self._order = [i for i in self._order if i not in gone]
        for request_id in gone:
            del self._held[request_id], self._contexts[request_id]
        if self.inner is not None:
            self.inner.finish(request_ids)

    def catch_up_tokens(self, request_id: int, sequence: list[int]) -> int:
        """The tokens of ``sequence`` this model has not read yet (all of them for a request it never drafted for)."""
        return len(sequence) - common_prefix_length(self._held.get(request_id, []), sequence)

    # --------------------------------------------------------------- helpers (rows in the model's order)
    def _sync(self, sequences: list[list[int]], active: list[bool], logits: bool = True) -> torch.Tensor | None:
        """Bring the model's cache to ``sequences`` (:func:`sync_rows`)."""
        held, out = sync_rows(self.model, [self._held[i] for i in self._order], sequences, active, logits)
        self._held.update(zip(self._order, held))
        return out

    def _choose(self, logits: torch.Tensor, history: TokenHistory | None, contexts: list[RequestContext],
                drawing: list[bool], positions: list[int]):
        """A token per row from logits ``[R, V]`` (for output ``positions``), the law it was drawn from,
        and whether it is confident."""
        probs = process_logits(logits, [c.sampling for c in contexts], history)
        tokens = draw_tokens(probs, contexts, positions, drawing)
        return tokens, probs, self._confident(logits, history, tokens, probs, contexts)

    @staticmethod
    def _coupling(contexts: list[RequestContext], current: list[list[int]], drawing: list[bool], width: int,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For a level's own verification of its inner drafts: which rows are coupled ``[R]`` and their
        noise ``[R, width + 1, V]`` from output position ``len(current[r]) - len(prompt)`` on (None if none)."""
        coupled = torch.tensor([on and c.noise is not None and not c.sampling.greedy
                                for on, c in zip(drawing, contexts)])
        if not bool(coupled.any()):
            return coupled, None
        race = torch.zeros(len(contexts), width + 1, vocab_size, dtype=torch.float64)
        for r in coupled.nonzero().flatten().tolist():
            race[r] = contexts[r].noise.races(len(current[r]) - len(contexts[r].prompt), width + 1, vocab_size)
        return coupled, race

    def _confident(self, logits, history, tokens, probs, contexts) -> list[bool]:
        """Per row: is the drawn token's probability at least ``confidence_threshold``? (Greedy laws are
        one-hot: those rows are judged by the softmax of their penalised logits.)"""
        if self.confidence_threshold <= 0:
            return [True] * len(contexts)
        if probs is None:
            probs = process_logits(logits, [c.sampling for c in contexts], history)
        logits = adjust_logits(logits, [c.sampling for c in contexts], history)
        raw = logits.float().softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        drawn = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).to(raw.dtype)
        greedy = torch.tensor([c.sampling.greedy for c in contexts])
        return (torch.where(greedy, raw, drawn) >= self.confidence_threshold).tolist()

    def _history(self, contexts, sequences, vocab: int, block: torch.Tensor | None = None) -> TokenHistory | None:
        """What the rows' penalties read (:class:`TokenHistory`), at ``block``'s positions if given."""
        history = TokenHistory.of(sequences, [len(c.prompt) for c in contexts], [c.sampling for c in contexts], vocab)
        return history if history is None or block is None else history.along(block)

    def _draft_chain(self, sequences: list[list[int]], need: list[int]) -> Draft:
        """One chain per model row. Each round feeds ``[pending, inner drafts...]``; without an inner
        drafter that is one token, i.e. plain autoregressive drafting."""
        batch = len(sequences)
        contexts = [self._contexts[i] for i in self._order]
        sampling = [c.sampling for c in contexts]
        greedy = all(s.greedy for s in sampling)  # then no law is kept: verification is token match
        out_tokens: list[list[int]] = [[] for _ in range(batch)]
        out_laws: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        current = [list(s) for s in sequences]
        logits = self._sync(sequences, [n > 0 for n in need])
        drawing = [n > 0 for n in need]
        pending, pending_law, confident = self._choose(logits, self._history(contexts, current, logits.shape[-1]),
                                                       contexts, drawing,
                                                       [len(c) - len(ctx.prompt) for c, ctx in zip(current, contexts)])
        running = list(drawing)
        rows = torch.arange(batch)
        while True:
            for row in range(batch):  # emit the pending token of every running row; an unsure one ends its draft
                if running[row]:
                    out_tokens[row].append(int(pending[row]))
                    if not greedy:
                        out_laws[row].append(pending_law[row])
                    current[row].append(int(pending[row]))
                    running[row] = len(out_tokens[row]) < need[row] and confident[row]
            if not any(running):
                break
            drawing = list(running)
            room = [need[r] - len(out_tokens[r]) - 1 if running[r] else 0 for r in range(batch)]
            inner = self._inner_proposal(current, room)
            chunks = [[int(pending[r])] + inner.first_chain(r) if running[r] else [] for r in range(batch)]
            block, valid = ragged_tokens(chunks)
            # the pending token (block[0]) is already in ``current``; the history adds the proposals
            block_logits = self.model.forward(block, valid)
            history = self._history(contexts, current, block_logits.shape[-1], block)
            width = block.shape[1] - 1
            coupled, race = self._coupling(contexts, current, drawing, width, block_logits.shape[-1])
            standard = [on and not c for on, c in zip(drawing, coupled.tolist())]
            drafted = Candidates(block[:, 1:].unsqueeze(1), valid[:, 1:].sum(1, keepdim=True),
                                 probs=None if inner.probs is None else inner.probs[:, :, :width])
            noise = Noise(request_uniforms(contexts, width + 1, standard),
                          request_uniforms(contexts, width, standard).unsqueeze(-1), coupled, race)
            judged = target_law(block_logits, sampling, history)
            verdict = verify(drafted, judged, noise=noise)
            accepted = verdict.accepted_length
            self.model.keep_block(torch.where(valid[:, :1], verdict.path, torch.full_like(verdict.path, -1)))
            laws = judged.probs  # [R, n, V]; None when every row is greedy
            for r in range(batch):
                if not running[r]:
                    continue
                self._held[self._order[r]] = self._held[self._order[r]] + chunks[r][:int(accepted[r]) + 1]
                for i in range(int(accepted[r])):  # accepted inner proposals are emitted with their laws
                    if len(out_tokens[r]) >= need[r]:
                        break
                    out_tokens[r].append(chunks[r][1 + i])
                    if not greedy:
                        out_laws[r].append(laws[r, i])
                    current[r].append(chunks[r][1 + i])
                running[r] = len(out_tokens[r]) < need[r]
            pending = verdict.next_token
            pending_law = None if greedy else laws[rows, accepted]
            confident = self._confident(block_logits[rows, accepted],
                                        None if history is None else history.at((rows, accepted)),
                                        pending, pending_law, contexts)
        return self._as_draft(out_tokens, out_laws)

    @staticmethod
    def _as_draft(out_tokens: list[list[int]], out_laws: list[list[torch.Tensor]]) -> Draft:
        """A one-chain draft; with laws (a sampled batch), ``probs`` ``[R, 1, k, V]``."""
        tokens, _ = ragged_tokens(out_tokens)
        tokens = tokens[:, :max((len(t) for t in out_tokens), default=0)]
        lengths = torch.tensor([len(t) for t in out_tokens], dtype=torch.long)
        probs = None
        if any(out_laws):
            laws = [law for row in out_laws for law in row]
            probs = torch.zeros(len(out_tokens), tokens.shape[1], laws[0].shape[-1], dtype=laws[0].dtype)
            for r, row in enumerate(out_laws):
                if row:
                    probs[r, :len(row)] = torch.stack(row)
        return Draft(tokens.unsqueeze(1), lengths.unsqueeze(1), None if probs is None else probs.unsqueeze(1))

    def _inner_proposal(self, current: list[list[int]], room: list[int]) -> Draft:
        if self.inner is None or not any(room):
            return Draft.empty(len(current))
        proposal = self.inner.propose([DraftRequest(i, seq, n) for i, seq, n in zip(self._order, current, room)])
        if proposal.num_chains != 1:
            raise ConfigError("a hierarchical level needs a chain drafter as its inner drafter")
        return proposal

    # --------------------------------------------------------------- interface
    def propose(self, requests: list[DraftRequest]) -> Draft:
        by_id = {r.request_id: r for r in requests}
        unknown = [r for r in requests if r.request_id not in self._held]
        if unknown:  # proposed for without start: its sequence is its prompt
            self.start([RequestContext(r.request_id, list(r.sequence)) for r in unknown])
        sequences = [by_id[i].sequence if i in by_id else self._held[i] for i in self._order]
        need = [by_id[i].max_tokens if i in by_id else 0 for i in self._order]
        contexts = [self._contexts[i] for i in self._order]
        candidates = self.capabilities.max_candidates
        if candidates == 1 or all(c.sampling.greedy for c in contexts):
            draft = self._draft_chain(sequences, need)
        else:
            chains = [self._draft_chain(sequences, need) for _ in range(candidates)]
            width = max(c.width for c in chains)
            tokens = torch.cat([torch.nn.functional.pad(c.tokens, (0, width - c.width)) for c in chains], 1)
            probs = None
            if chains[0].probs is not None:
                probs = torch.cat([torch.nn.functional.pad(c.probs, (0, 0, 0, width - c.width)) for c in chains], 1)
            draft = Draft(tokens, torch.cat([c.lengths for c in chains], dim=1), probs)
        row_of = {request_id: row for row, request_id in enumerate(self._order)}
        order = torch.tensor([row_of[r.request_id] for r in requests], dtype=torch.long)
        return self._with_prefix(requests, Draft(draft.tokens[order], draft.lengths[order],
                                                 None if draft.probs is None else draft.probs[order]))

    def _with_prefix(self, requests: list[DraftRequest], draft: Draft) -> Draft:
        """For an early-exit draft of a chain for every row this model holds: the draft with the first target
        layers of its verify block ``[last, drafts]`` (:attr:`Draft.prefix`), already computed while drafting
        (only the last draft token is still fed)."""
        if (self.reuses is None or draft.num_chains != 1 or not draft.width
                or [r.request_id for r in requests] != self._order):
            return draft
        valid = torch.arange(draft.width + 1) <= draft.lengths[:, :1]
        self._sync([r.sequence + draft.first_chain(i) for i, r in enumerate(requests)], [True] * len(requests),
                   logits=False)
        start = torch.tensor([len(r.sequence) - 1 for r in requests], dtype=torch.long)
        return replace(draft, prefix=self.model.prefix_for(self.reuses, start, valid))
