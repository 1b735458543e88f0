"""A separate (smaller) language model with the target's tokenizer drafts autoregressively.

The draft model keeps its own KV cache. Before drafting it syncs with the committed sequence the
llama.cpp way: keep the longest common prefix of what it holds and what the target committed,
drop the rest, and feed the difference in one ragged block.

Hierarchical speculation (TriForce-style): with an ``inner`` drafter the draft model's own drafting
is speculative too: the inner drafter proposes, the draft model verifies with the same lossless
rules, and every token it emits is an exact sample of its own law, which is passed up as the draft
law. Drafters stack to any depth (an inner drafter may itself have an inner drafter).
"""
from __future__ import annotations

import torch

from genspec.acceptance import verify_chain, verify_greedy
from genspec.drafters.base import Draft, Drafter, TreeDraft
from genspec.errors import ConfigError
from genspec.models.base import CausalLM
from genspec.sampling import apply_repetition_penalty, block_seen_mask, process_logits, seen_mask


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _ragged(chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, width]`` tokens and their validity mask."""
    width = max(1, max(len(c) for c in chunks))
    tokens = torch.zeros(len(chunks), width, dtype=torch.long)
    valid = torch.zeros(len(chunks), width, dtype=torch.bool)
    for row, chunk in enumerate(chunks):
        tokens[row, :len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        valid[row, :len(chunk)] = True
    return tokens, valid


class DraftModelDrafter(Drafter):
    """Drafts with ``model``.

    ``num_drafts`` > 1 samples that many independent chains (multi-draft, verified as a tree);
    ``confidence_threshold`` stops a row's draft at the first token whose draft probability is below
    it (Hugging Face's assistant_confidence_threshold); ``inner`` makes drafting hierarchical.
    """

    name = "draft-model"

    def __init__(self, model: CausalLM, num_drafts: int = 1, confidence_threshold: float = 0.0,
                 inner: Drafter | None = None):
        if num_drafts < 1:
            raise ConfigError(f"num_drafts must be >= 1, got {num_drafts}")
        if not 0.0 <= confidence_threshold < 1.0:
            raise ConfigError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model
        self.num_drafts = num_drafts
        self.confidence_threshold = confidence_threshold
        self.inner = inner
        self._held: list[list[int]] = []

    def begin(self, prompts, sampling, generator=None):
        super().begin(prompts, sampling, generator)
        self.model.reset(len(prompts))
        self._held = [[] for _ in prompts]
        if self.inner is not None:
            self.inner.begin(prompts, sampling, generator)

    # --------------------------------------------------------------- helpers
    def _sync(self, sequences: list[list[int]], active: list[bool], logits: bool = True) -> torch.Tensor | None:
        """Bring the model's cache to ``sequences``; return the logits ``[B, V]`` of the next token
        (then the last token is always fed again, for its logits), or None with ``logits=False``."""
        keep = [min(_common_prefix(held, seq), len(seq) - (1 if logits else 0))
                for held, seq in zip(self._held, sequences)]
        self.model.truncate(torch.tensor(keep, dtype=torch.long))
        new = [seq[k:] if on else [] for seq, k, on in zip(sequences, keep, active)]
        self._held = [seq[:k] + chunk for seq, k, chunk in zip(sequences, keep, new)]
        if not logits and not any(new):
            return None
        tokens, valid = _ragged(new)
        if logits:
            out = self.model.forward(tokens, valid, last_only=True)[:, 0]
        else:
            self.model.hidden_states(tokens, valid)
            out = None
        self.model.commit_all(valid)
        return out

    def _scores(self, logits: torch.Tensor, sequences: list[list[int]], block: torch.Tensor | None = None):
        """Repetition-penalised logits (``[B, V]``, or ``[B, n, V]`` for a block after ``sequences``)."""
        if self.sampling.repetition_penalty == 1.0:
            return logits
        seen = seen_mask(sequences, logits.shape[-1], logits.device)
        if block is not None:
            seen = block_seen_mask(seen, block)
        return apply_repetition_penalty(logits, seen, self.sampling.repetition_penalty)

    def _choose(self, scores: torch.Tensor):
        """A token per row from scores ``[B, V]`` and the law it was drawn from (greedy: one-hot)."""
        probs = process_logits(scores, self.sampling)
        if self.sampling.greedy:
            return scores.argmax(-1), probs
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1), probs

    def _confident(self, probs: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.confidence_threshold <= 0:
            return torch.ones_like(tokens, dtype=torch.bool)
        if self.sampling.greedy:  # the processed greedy law is one-hot; judge the raw softmax instead
            probs = scores.float().softmax(-1)
        return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) >= self.confidence_threshold

    def _draft_chain(self, sequences, max_tokens) -> Draft:
        """One chain per row. Each round feeds ``[pending, inner drafts...]``; without an inner drafter
        that is one token, i.e. plain autoregressive drafting."""
        batch = len(sequences)
        need = list(max_tokens)
        out_tokens: list[list[int]] = [[] for _ in range(batch)]
        out_laws: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        current = [list(s) for s in sequences]
        scores = self._scores(self._sync(sequences, [n > 0 for n in need]), current)
        pending, pending_law = self._choose(scores)
        running = [n > 0 for n in need]
        confident = self._confident(pending_law, pending, scores)
        for row in range(batch):
            running[row] = running[row] and bool(confident[row])
        while True:
            for row in range(batch):  # emit the pending token of every running row
                if running[row]:
                    out_tokens[row].append(int(pending[row]))
                    out_laws[row].append(pending_law[row])
                    current[row].append(int(pending[row]))
                    running[row] = len(out_tokens[row]) < need[row]
            if not any(running):
                break
            room = [need[r] - len(out_tokens[r]) - 1 if running[r] else 0 for r in range(batch)]
            inner = self._inner_proposal(current, room)
            chunks = [[int(pending[r])] + inner.tokens[r, :int(inner.lengths[r])].tolist() if running[r] else []
                      for r in range(batch)]
            block, valid = _ragged(chunks)
            # the pending token (block[0]) is already in ``current``; the seen-mask adds the proposals
            logits = self.model.forward(block, valid)
            block_scores = self._scores(logits, current, block)
            accepted, pending, pending_law = self._verify_inner(inner, block_scores, valid)
            keep = torch.arange(block.shape[1]).expand(batch, -1)
            keep = torch.where((keep <= accepted.unsqueeze(1)) & valid[:, :1], keep, -1)
            self.model.keep_block(keep)
            for r in range(batch):
                if not running[r]:
                    continue
                self._held[r] = self._held[r] + chunks[r][:int(accepted[r]) + 1]
                for i in range(int(accepted[r])):  # accepted inner proposals are emitted with their laws
                    if len(out_tokens[r]) >= need[r]:
                        break
                    token = chunks[r][1 + i]
                    out_tokens[r].append(token)
                    out_laws[r].append(process_logits(block_scores[r, i], self.sampling))
                    current[r].append(token)
                running[r] = len(out_tokens[r]) < need[r]
            confident = self._confident(pending_law, pending, block_scores[torch.arange(batch), accepted])
            running = [run and bool(ok) for run, ok in zip(running, confident)]
        tokens, _ = _ragged(out_tokens)
        lengths = torch.tensor([len(t) for t in out_tokens], dtype=torch.long)
        probs = None
        if not self.sampling.greedy and any(out_laws):
            width = tokens.shape[1]
            probs = torch.zeros(batch, width, scores.shape[-1], dtype=scores.dtype if scores.is_floating_point()
                                else torch.float32)
            for r, laws in enumerate(out_laws):
                if laws:
                    probs[r, :len(laws)] = torch.stack(laws)
        return Draft(tokens, lengths, probs)

    def _inner_proposal(self, current, room) -> Draft:
        if self.inner is None or not any(room):
            return Draft(torch.zeros(len(current), 0, dtype=torch.long), torch.zeros(len(current), dtype=torch.long))
        proposal = self.inner.propose(current, room)
        if isinstance(proposal, TreeDraft):
            raise ConfigError("a hierarchical level needs a chain drafter as its inner drafter")
        return proposal

    def _verify_inner(self, inner: Draft, block_scores: torch.Tensor, valid: torch.Tensor):
        """Verify the inner drafter's tokens against this model; returns accepted counts ``[B]``, the
        next token per row (an exact sample of this model's law) and that law ``[B, V]``."""
        batch = block_scores.shape[0]
        width = int(inner.lengths.max()) if inner.tokens.numel() else 0
        drafts, lengths = inner.tokens[:, :width], inner.lengths * valid[:, 0].long()
        rows = torch.arange(batch)
        if self.sampling.greedy:
            verdict = verify_greedy(drafts, block_scores[:, :width + 1].argmax(-1), lengths)
            law = process_logits(block_scores[rows, verdict.accepted_length], self.sampling)
            return verdict.accepted_length, verdict.next_token, law
        probs = process_logits(block_scores[:, :width + 1], self.sampling)
        inner_probs = None if inner.probs is None else inner.probs[:, :width]
        verdict = verify_chain(drafts, probs, inner_probs, lengths, generator=self.generator)
        return verdict.accepted_length, verdict.next_token, probs[rows, verdict.accepted_length]

    # --------------------------------------------------------------- interface
    def propose(self, sequences, max_tokens):
        if self.num_drafts == 1 or self.sampling.greedy:
            return self._draft_chain(sequences, max_tokens)
        chains = [self._draft_chain(sequences, max_tokens) for _ in range(self.num_drafts)]
        width = max(c.tokens.shape[1] for c in chains)
        tokens = torch.stack([torch.nn.functional.pad(c.tokens, (0, width - c.tokens.shape[1])) for c in chains], 1)
        probs = None
        if chains[0].probs is not None:
            probs = torch.stack([torch.nn.functional.pad(c.probs, (0, 0, 0, width - c.probs.shape[1]))
                                 for c in chains], 1)
        return TreeDraft(tokens, torch.stack([c.lengths for c in chains], dim=1), probs)

    def verify_prefix(self, target, sequences: list[list[int]], block: torch.Tensor, valid: torch.Tensor):
        """For an early-exit draft of ``target``: the first layers of the verify block ``[last, drafts]``,
        already computed while drafting (only the last draft token is still fed), as a
        :class:`genspec.models.hf.PrefixKV`; None when this drafter cannot provide them."""
        if getattr(self.model, "source", None) is not target or not hasattr(self.model, "prefix_kv"):
            return None
        lengths = valid.sum(1).tolist()
        needed = [seq + block[r, 1:lengths[r]].tolist() for r, seq in enumerate(sequences)]
        self._sync(needed, [n > 0 for n in lengths], logits=False)
        start = torch.tensor([len(seq) - 1 for seq in sequences], dtype=torch.long)
        return self.model.prefix_kv(start, valid)

    def feedback(self, accepted_lengths):
        if self.inner is not None:
            self.inner.feedback(accepted_lengths)
