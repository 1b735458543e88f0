"""The target's first L layers over each request's committed tokens, for a draft head that reads them.

A head with ``token_layers`` = L (:class:`genspec.speculators.head.DraftHead`) pairs the target's feature
at i with the target's own state after its first L layers over token i + 1, where an EAGLE head reads that
token's embedding. The state of the token the target has just chosen (the one after the last accepted
draft) is computed by nobody else: the target's verify pass reaches it only at the next step. So the
drafter runs those L layers itself, sharing the target's weights, over every committed token (the prompt
when a request starts drafting, then each step's new tokens, one batched pass per step), with its own KV
cache (L of the target's layers: L / num_layers of its cache).
"""
from __future__ import annotations

import torch

from genspec.drafters.base import ragged_tokens
from genspec.models.variants import first_layers


class LayerStates:
    """Per request, the states after the target's first ``layers`` layers of the tokens it has read."""

    def __init__(self, target, layers: int):
        self.model = first_layers(target, layers)
        self.model.reset(0)
        self._order: list[int] = []  # request ids, in the model's row order
        self._read: dict[int, int] = {}  # tokens each row holds in the model's cache

    def start(self, request_ids: list[int]) -> None:
        fresh = [i for i in request_ids if i not in self._read]
        if fresh:
            self.model.add_rows([[] for _ in fresh])
            self._order += fresh
            self._read.update({i: 0 for i in fresh})

    def finish(self, request_ids: list[int]) -> None:
        gone = set(request_ids) & set(self._read)
        if gone:
            self.model.remove_rows([row for row, i in enumerate(self._order) if i in gone])
            self._order = [i for i in self._order if i not in gone]
            for request_id in gone:
                del self._read[request_id]

    def unread(self, request_id: int, sequence: list[int]) -> int:
        """Tokens of ``sequence`` not read yet (all of them for a request never read)."""
        return len(sequence) - self._read.get(request_id, 0)

    @torch.inference_mode()
    def read(self, request_ids: list[int], sequences: list[list[int]]) -> list[torch.Tensor]:
        """The states ``[n_r, H]`` of each request's tokens not read yet (``sequences`` are committed
        tokens: they only grow), in one pass over all rows; a request not started is started."""
        self.start(request_ids)
        new = dict(zip(request_ids, sequences))
        chunks = [list(new[i][self._read[i]:]) if i in new else [] for i in self._order]
        if not any(chunks):
            return [self._empty() for _ in request_ids]
        tokens, valid = ragged_tokens(chunks)
        hidden, _ = self.model.hidden_states(tokens, valid)
        self.model.commit_all(valid)
        row_of = {request_id: row for row, request_id in enumerate(self._order)}
        out = []
        for request_id in request_ids:
            row = row_of[request_id]
            out.append(hidden[row, :len(chunks[row])])
            self._read[request_id] += len(chunks[row])
        return out

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, self.model.config.hidden_size, dtype=self.model.dtype, device=self.model.device)
