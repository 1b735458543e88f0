"""``head``: a trained draft head (EAGLE / Hydra style) drafts from the target's own features.

The engine hands the drafter the target's features (the LM head's inputs) of every committed token:
those of the prompt when a request starts, those of the tokens kept since at every proposal
(:attr:`Drafter.reads_target_hidden`). The head (:class:`genspec.models.draft_head.DraftHead`) keeps a
one-layer KV cache per request over the pairs (target feature at i, token i + 1), fed with the target's
exact features once tokens are committed (its own guesses are never kept: EAGLE's rule), and drafts a
chain by feeding its predicted feature back with each drafted token. Logits come from the target's own
output layer cut to the head's vocabulary; a sampled request draws from that law after the same
temperature / top-k / top-p processing as the target (one ``process_logits``), and the law goes to the
verifier, so the standard rule stays exact.
"""
from __future__ import annotations

import torch

from genspec.acceptance import sample_with_uniforms
from genspec.drafters.base import Draft, Drafter, DraftRequest, RequestContext, request_uniforms
from genspec.errors import ConfigError
from genspec.models.draft_head import DraftHead, load_head, target_fingerprint
from genspec.sampling import process_logits, seen_mask


class _Row:
    """One request: its context, the target's features by position, the head's cache of committed pairs."""

    def __init__(self, context: RequestContext, hidden_size: int, kv_shape: tuple[int, int], dtype):
        self.context = context
        self.features = context.hidden if context.hidden is not None else torch.zeros(0, hidden_size, dtype=dtype)
        self.keys = torch.zeros(kv_shape[0], 0, kv_shape[1], dtype=dtype)
        self.values = torch.zeros_like(self.keys)

    @property
    def cached(self) -> int:
        return int(self.keys.shape[1])


class HeadDrafter(Drafter):
    """Drafts with a trained head (``genspec train head``); option ``path``: the head's directory."""

    name = "head"
    free = False
    reads_target_hidden = True

    def __init__(self, target, head: DraftHead, vocab_ids: list[int]):
        self.device, self.dtype = target.device, target.dtype
        self.head = head.to(self.device, self.dtype).eval()
        self.embed = target.model.get_input_embeddings()
        self.vocab = torch.as_tensor(vocab_ids, dtype=torch.long, device=self.device)
        self.logits_of = target.subset_head(self.vocab)
        self.vocab_size = target.vocab_size
        config = head.config
        self._kv_shape = (config.num_kv_heads, config.head_dim)
        self._rows: dict[int, _Row] = {}

    @classmethod
    def for_target(cls, target, path: str | None = None) -> "HeadDrafter":
        from genspec.models.hf import HFCausalLM

        if not isinstance(target, HFCausalLM):
            raise ConfigError("drafter 'head' needs a Hugging Face target model: it reads the target's hidden states")
        if path is None:
            raise ConfigError("drafter 'head' needs a trained head: -O path=DIR (genspec train head writes one)")
        head, vocab_ids, fingerprint, _ = load_head(path)
        if fingerprint != target_fingerprint(target):
            raise ConfigError(f"the draft head at {path} was trained for another model (fingerprint {fingerprint}, "
                              f"this model's is {target_fingerprint(target)}); train one for it with genspec train head")
        if head.config.hidden_size != target.config.hidden_size:
            raise ConfigError(f"the draft head at {path} expects hidden size {head.config.hidden_size}, the model has "
                              f"{target.config.hidden_size}")
        return cls(target, head, vocab_ids)

    # --------------------------------------------------------------- life cycle
    def start(self, contexts: list[RequestContext]) -> None:
        for context in contexts:
            self._rows[context.request_id] = _Row(context, self.head.config.hidden_size, self._kv_shape, self.dtype)

    def finish(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    # --------------------------------------------------------------- the head, per row over its cache
    def _run(self, rows: list[_Row], features: torch.Tensor, tokens: torch.Tensor, starts: list[int],
             counts: list[int], extra: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """The head on a block of pairs per row (``features`` ``[R, n, H]``, ``tokens`` ``[R, n]``, the
        first ``counts[r]`` real, at positions ``starts[r]`` on), attending over each row's cache (and
        ``extra`` keys / values after it: the chain drafted so far). Returns the predicted features
        ``[R, n, H]`` and the block's keys and values per row."""
        n = tokens.shape[1]
        x = self.head.inputs(features, self.embed(tokens).to(self.dtype))
        positions = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(n)
        q, k, v = self.head.project(x, positions)
        attended = torch.zeros_like(q)
        for r, row in enumerate(rows):
            count = counts[r]
            if not count:
                continue
            keys = [row.keys, *( [extra[r][0]] if extra else [] ), k[r, :, :count]]
            values = [row.values, *( [extra[r][1]] if extra else [] ), v[r, :, :count]]
            keys, values = torch.cat(keys, dim=1), torch.cat(values, dim=1)
            before = keys.shape[1] - count
            mask = torch.ones(count, keys.shape[1], dtype=torch.bool)
            mask[:, before:] = torch.ones(count, count, dtype=torch.bool).tril()
            attended[r:r + 1, :, :count] = self.head.attend(q[r:r + 1, :, :count], keys.unsqueeze(0),
                                                            values.unsqueeze(0), mask.view(1, 1, count, -1))
        return self.head.finish(x, attended), k, v

    def _sync(self, rows: list[_Row], sequences: list[list[int]]) -> torch.Tensor:
        """Feed each row's committed pairs not in its cache yet (always at least its last one, whose
        output is the first draft's feature); returns that predicted feature per row ``[R, H]``."""
        starts = [min(row.cached, len(seq) - 2) for row, seq in zip(rows, sequences)]
        counts = [len(seq) - 1 - s for seq, s in zip(sequences, starts)]
        n = max(counts)
        features = torch.zeros(len(rows), n, self.head.config.hidden_size, dtype=self.dtype)
        tokens = torch.zeros(len(rows), n, dtype=torch.long)
        for r, (row, seq, start, count) in enumerate(zip(rows, sequences, starts, counts)):
            row.keys, row.values = row.keys[:, :start], row.values[:, :start]
            features[r, :count] = row.features[start:start + count]
            tokens[r, :count] = torch.tensor(seq[start + 1:start + 1 + count], dtype=torch.long)
        out, k, v = self._run(rows, features, tokens, starts, counts)
        for r, (row, count) in enumerate(zip(rows, counts)):
            row.keys = torch.cat([row.keys, k[r, :, :count]], dim=1)
            row.values = torch.cat([row.values, v[r, :, :count]], dim=1)
        return out[torch.arange(len(rows)), torch.tensor(counts) - 1]

    # --------------------------------------------------------------- interface
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> Draft:
        for request in requests:
            if request.request_id not in self._rows:  # proposed for without start: no features yet
                self.start([RequestContext(request.request_id, list(request.sequence))])
            row = self._rows[request.request_id]
            if request.hidden is not None and len(request.hidden):
                row.features = torch.cat([row.features, request.hidden.to(self.dtype)])
        # a row can draft once the target's feature of every committed token but the last is known
        able = [r.max_tokens > 0 and len(r.sequence) >= 2 and len(self._rows[r.request_id].features) == len(r.sequence) - 1
                for r in requests]
        chains: list[list[int]] = [[] for _ in requests]
        laws: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, ok in enumerate(able) if ok]
        if active:
            self._draft([requests[i] for i in active], [chains[i] for i in active], [laws[i] for i in active])
        tokens = Draft.from_chains([[c] for c in chains])
        if not any(laws):
            return tokens
        probs = torch.zeros(len(requests), 1, tokens.width, self.vocab_size, dtype=laws[active[0]][0].dtype)
        for i, row_laws in enumerate(laws):
            if row_laws:
                probs[i, 0, :len(row_laws)] = torch.stack(row_laws)
        return Draft(tokens.tokens, tokens.lengths, probs)

    def _draft(self, requests: list[DraftRequest], chains: list[list[int]], laws: list[list[torch.Tensor]]) -> None:
        """Fill ``chains`` (and, for a sampled batch, ``laws``) for rows that can draft."""
        rows = [self._rows[r.request_id] for r in requests]
        contexts = [row.context for row in rows]
        sampling = [c.sampling for c in contexts]
        keep_laws = not all(s.greedy for s in sampling)
        penalised = any(s.repetition_penalty != 1.0 for s in sampling)
        sequences = [list(r.sequence) for r in requests]
        predicted = self._sync(rows, sequences)  # [R, H]
        need = [r.max_tokens for r in requests]
        extra = [(torch.zeros(*self._kv_shape[:1], 0, self._kv_shape[1], dtype=self.dtype),) * 2 for _ in rows]
        for depth in range(max(need)):
            drawing = [depth < n for n in need]
            subset_logits = self.logits_of(predicted)  # [R, S]
            if keep_laws or penalised:
                logits = subset_logits.new_full((len(rows), self.vocab_size), -torch.inf)
                logits[:, self.vocab] = subset_logits
                seen = seen_mask([s + c for s, c in zip(sequences, chains)], self.vocab_size) if penalised else None
                law = process_logits(logits, sampling, seen)
                greedy = torch.tensor([s.greedy for s in sampling])
                uniforms = request_uniforms(contexts, 1, drawing)[:, 0]
                tokens = torch.where(greedy, law.argmax(-1), sample_with_uniforms(law, uniforms))
            else:
                law, tokens = None, self.vocab[subset_logits.argmax(-1)]
            for r in range(len(rows)):
                if drawing[r]:
                    chains[r].append(int(tokens[r]))
                    if keep_laws:
                        laws[r].append(law[r])
            if depth + 1 >= max(need):
                break
            starts = [len(seq) - 1 + depth for seq in sequences]  # the pair (predicted, drafted token)
            counts = [1 if depth + 1 < n else 0 for n in need]
            out, k, v = self._run(rows, predicted.unsqueeze(1), tokens.unsqueeze(1), starts, counts, extra)
            extra = [(torch.cat([e[0], k[r, :, :1]], dim=1), torch.cat([e[1], v[r, :, :1]], dim=1))
                     for r, e in enumerate(extra)]
            predicted = out[:, 0]
