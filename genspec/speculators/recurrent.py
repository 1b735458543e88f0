"""The recurrent distilled draft (``genspec train draft --arch gru|lstm``): the target's tokens through an
embedding, a stack of GRU or LSTM layers and an output layer over the draft's vocabulary, trained as the
transformer draft is (:func:`genspec.train.losses.draft_loss`, the target's own laws as soft labels).

A recurrent draft's cost per token does not grow with the context: a token is one step of each layer from
the state after the previous one. At the engine's interface (:class:`RecurrentLM`) it is a
:class:`genspec.models.base.CausalLM` whose per-row "cache" is the recurrent state after every token the row
holds, so rolling back (``truncate``, ``keep_block`` of a chain after a rejection) is picking the state at
the last kept position: nothing is recomputed.
"""
from __future__ import annotations

import torch
from torch import nn

from genspec.errors import ConfigError
from genspec.kernels import LMHead
from genspec.models.base import CausalLM, PrefixKV, states_kept
from genspec.speculators.distilled import DistilledDraft, DraftConfig, local_ids

#: the recurrent layers of each recurrent arch
LAYERS = {"gru": nn.GRU, "lstm": nn.LSTM}


class RecurrentDraft(nn.Module):
    """The network over the draft's own token ids. Its state is one vector per position: each layer's
    hidden state (an LSTM's followed by its cell state), layer after layer, ``[state_size]``."""

    kind = "draft"

    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.arch not in LAYERS:
            raise ConfigError(f"a recurrent draft's arch is one of {', '.join(LAYERS)}, got {config.arch!r}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.layers = nn.ModuleList([LAYERS[config.arch](config.width, config.width, batch_first=True)
                                     for _ in range(config.num_layers)])
        self.head = nn.Linear(config.width, config.vocab_size - 1)  # "other" is never drafted

    @property
    def lstm(self) -> bool:
        return self.config.arch == "lstm"

    @property
    def layer_state_size(self) -> int:
        return self.config.width * (2 if self.lstm else 1)

    @property
    def state_size(self) -> int:
        return self.layer_state_size * self.config.num_layers

    def forward(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n, S]`` over the draft's vocabulary ("other" left out) from the zero state: what
        training reads (the layers' fused kernels over whole sequences)."""
        x = self.embed(local_ids)
        for layer in self.layers:
            x, _ = layer(x)
        return self.head(x)

    def output(self, states: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden state ``[..., width]`` of states ``[..., state_size]`` (the head's input)."""
        start = self.layer_state_size * (self.config.num_layers - 1)
        return states[..., start:start + self.config.width]

    def step(self, local_ids: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The states ``[B, state_size]`` after tokens ``[B]`` read from states ``[B, state_size]``."""
        x = self.embed(local_ids).unsqueeze(1)
        width, size = self.config.width, self.layer_state_size
        out = []
        for index, layer in enumerate(self.layers):
            own = state[:, index * size:(index + 1) * size].unsqueeze(0)
            if self.lstm:
                x, (h, c) = layer(x, (own[..., :width].contiguous(), own[..., width:].contiguous()))
                out += [h[0], c[0]]
            else:
                x, h = layer(x, own.contiguous())
                out.append(h[0])
        return torch.cat(out, -1)

    def run(self, local_ids: torch.Tensor, start: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        """The states ``[B, n, state_size]`` after each token of a block ``[B, n]``: token i is read from the
        state after its parent (``parents`` ``[B, n]``, an index before i, or -1 for the row's ``start``
        state ``[B, state_size]``); None: a chain, each token after the previous one, which runs each layer's
        fused kernel over the whole block (:meth:`_chain`). A tree's tokens have different predecessors: they
        step token by token."""
        batch, n = local_ids.shape
        if not n:
            return start.new_zeros(batch, 0, self.state_size)
        if parents is None:
            return self._chain(local_ids, start)
        states = start.new_zeros(batch, n, self.state_size)
        rows = torch.arange(batch)
        for i in range(n):
            parent = parents[:, i]
            before = torch.where((parent >= 0).unsqueeze(-1), states[rows, parent.clamp(min=0)], start)
            states[:, i] = self.step(local_ids[:, i], before)
        return states

    def _chain(self, local_ids: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """:meth:`run` of a chain, a layer at a time over the whole block. A GRU layer's outputs are its states.
        An LSTM layer's outputs are its hidden states only: its cell states follow from them, c_t = f_t c_{t-1} +
        i_t g_t with the gates of (x_t, h_{t-1}) in one product, a scan of one elementwise product a token (far
        quicker than a token-by-token run of the layer on a long prompt: the manual's Draft models page), and the
        last one is the kernel's own."""
        x, out = self.embed(local_ids), []
        size, width = self.layer_state_size, self.config.width
        for index, layer in enumerate(self.layers):
            own = start[:, index * size:(index + 1) * size]
            if not self.lstm:
                x, _ = layer(x, own.unsqueeze(0).contiguous())
                out.append(x)
                continue
            h0, c0 = own[:, :width], own[:, width:]
            hidden, (_, last) = layer(x, (h0.unsqueeze(0).contiguous(), c0.unsqueeze(0).contiguous()))
            cells = torch.empty_like(hidden)
            if x.shape[1] > 1:  # a one-token block (a draft step) has the kernel's cell state only
                before = torch.cat([h0.unsqueeze(1), hidden[:, :-2]], 1)
                gates = (nn.functional.linear(x[:, :-1], layer.weight_ih_l0, layer.bias_ih_l0)
                         + nn.functional.linear(before, layer.weight_hh_l0, layer.bias_hh_l0))
                i, f, g, _ = gates.chunk(4, -1)  # PyTorch's order: input, forget, cell, output
                keep, write = f.sigmoid(), i.sigmoid() * g.tanh()
                c = c0
                for t in range(x.shape[1] - 1):
                    c = torch.addcmul(write[:, t], keep[:, t], c)
                    cells[:, t] = c
            cells[:, -1] = last[0]
            out += [hidden, cells]
            x = hidden
        return torch.cat(out, -1)

    def as_model(self, vocab_ids: list[int], full_vocab_size: int, tokenizer=None) -> "RecurrentLM":
        """This draft as a :class:`genspec.models.base.CausalLM` over the target's vocabulary."""
        return RecurrentLM(self, vocab_ids, full_vocab_size, tokenizer)


def draft_network(config: DraftConfig) -> nn.Module:
    """The distilled draft network of ``config``'s arch (how a saved draft is rebuilt and a new one made)."""
    return RecurrentDraft(config) if config.arch in LAYERS else DistilledDraft(config)


class RecurrentLM(CausalLM):
    """A :class:`RecurrentDraft` as a :class:`genspec.models.base.CausalLM` over the target's full vocabulary
    (ids mapped in, logits mapped out, as :class:`genspec.speculators.distilled.DistilledLM` does).

    Rows hold ``[B, C, state_size]``: row b's state after each of its ``lengths[b]`` tokens (C, the capacity,
    grows by doubling). A block's states wait in ``_block`` until ``keep_block`` / ``commit_all`` copy the kept
    ones after the row's; ``truncate`` only shortens ``lengths``. Any block shape works: a chain, a ragged batch
    of chains, or a token tree (each node read from its parent's state)."""

    def __init__(self, draft: RecurrentDraft, vocab_ids: list[int], full_vocab_size: int, tokenizer=None):
        self.draft = draft.eval()
        self.tokenizer = tokenizer
        self.vocab_size = full_vocab_size
        self.dtype = next(draft.parameters()).dtype
        self.vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long)
        self._to_local = local_ids(vocab_ids, full_vocab_size)
        # the fastest exact kernel for the row count, as the target's head (one draft token's logits: one row)
        self._head = LMHead(draft.head.weight, draft.head.bias)
        self.reset(0)

    # ------------------------------------------------------------------ rows
    @torch.inference_mode()
    def reset(self, batch_size: int = 0) -> None:
        self._states = torch.zeros(batch_size, 0, self.draft.state_size, dtype=self.dtype)
        self._lengths = torch.zeros(batch_size, dtype=torch.long)
        self._block: torch.Tensor | None = None

    @torch.inference_mode()
    def add_rows(self, prefixes: list[list[int]], return_hidden: bool = False,
                 hidden_layers: tuple[int, ...] = (), hidden_last: int | None = None) -> list[torch.Tensor] | None:
        self._no_layers(hidden_layers)
        if not prefixes:
            return [] if return_hidden else None
        held_states, held_lengths = self._states, self._lengths
        self.reset(len(prefixes))
        longest = max(len(p) for p in prefixes)
        hidden = [torch.zeros(0, self.draft.config.width, dtype=self.dtype)] * len(prefixes)
        if longest:
            tokens = torch.zeros(len(prefixes), longest, dtype=torch.long)
            valid = torch.zeros(len(prefixes), longest, dtype=torch.bool)
            for row, prefix in enumerate(prefixes):
                tokens[row, :len(prefix)] = torch.as_tensor(prefix, dtype=torch.long)
                valid[row, :len(prefix)] = True
            states, _ = self.hidden_states(tokens, valid)
            self.commit_all(valid)
            hidden = [states[row, len(prefix) - states_kept(len(prefix), hidden_last):len(prefix)]
                      for row, prefix in enumerate(prefixes)]
        capacity = max(held_states.shape[1], self._states.shape[1])
        self._states = torch.cat([self._padded(held_states, capacity), self._padded(self._states, capacity)])
        self._lengths = torch.cat([held_lengths, self._lengths])
        self._block = None
        return hidden if return_hidden else None

    @torch.inference_mode()
    def remove_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        gone = set(rows)
        kept = torch.tensor([r for r in range(self.num_rows) if r not in gone], dtype=torch.long)
        longest = int(self._lengths[kept].max()) if len(kept) else 0
        self._states = self._states[kept, :longest]
        self._lengths = self._lengths[kept]
        self._block = None

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    # ------------------------------------------------------------------ blocks
    def _no_layers(self, hidden_layers) -> None:
        if tuple(hidden_layers):
            raise ConfigError("a recurrent draft has no decoder layers to return the hidden states of")

    @staticmethod
    def _padded(states: torch.Tensor, capacity: int) -> torch.Tensor:
        return torch.nn.functional.pad(states, (0, 0, 0, capacity - states.shape[1]))

    def _current(self) -> torch.Tensor:
        """``[B, state_size]``: each row's state after its last token (zeros for an empty row)."""
        rows = torch.arange(self.num_rows)
        if not self._states.shape[1]:
            return self._states.new_zeros(self.num_rows, self.draft.state_size)
        last = self._states[rows, (self._lengths - 1).clamp(min=0)]
        return torch.where((self._lengths > 0).unsqueeze(-1), last, torch.zeros_like(last))

    @staticmethod
    def _parents(tree_mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``[B, n]``: each node's parent in the block (its deepest ancestor there), or -1 for a root."""
        n = tree_mask.shape[-1]
        seen = tree_mask & valid.unsqueeze(1)
        depth = seen.sum(-1) - 1
        ancestors = seen & ~torch.eye(n, dtype=torch.bool)
        scored = torch.where(ancestors, depth.unsqueeze(1).expand(-1, n, -1),
                             torch.full_like(ancestors, -1, dtype=torch.long))
        best, parent = scored.max(-1)
        parent = torch.where(best >= 0, parent, torch.full_like(parent, -1))
        if bool((parent >= torch.arange(n)).any()):
            raise ValueError("a tree block's nodes must come after their ancestors")
        return parent

    @torch.inference_mode()
    def hidden_states(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                      tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch = tokens.shape[0]
        if batch != self.num_rows:
            raise ValueError(f"model holds {self.num_rows} rows, got a block of {batch}")
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
        parents = None if tree_mask is None else self._parents(tree_mask, valid)
        self._block = self.draft.run(self._to_local[tokens], self._current(), parents)
        return self.draft.output(self._block), valid

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` over the target's vocabulary (-inf outside the draft's) from hidden states."""
        local = self._head(hidden)
        full = local.new_full((*local.shape[:-1], self.vocab_size), -torch.inf)
        full[..., self.vocab_ids] = local
        return full

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, last_only: bool = False,
                prefix: PrefixKV | None = None, return_hidden: bool = False, hidden_layers: tuple[int, ...] = ()):
        self._no_layers(hidden_layers)
        if prefix is not None:
            raise ConfigError("a recurrent draft has no decoder layers to take a prefix of")
        hidden, valid = self.hidden_states(tokens, valid, tree_mask)
        if last_only:
            last = valid.long().cumsum(-1).argmax(-1)  # index of the last valid token
            logits = self.head(hidden[torch.arange(hidden.shape[0]), last].unsqueeze(1))
        else:
            logits = self.head(hidden)
        return (logits, hidden) if return_hidden else logits

    @torch.inference_mode()
    def keep_block(self, keep: torch.Tensor) -> None:
        """Copy the kept tokens' states after each row's own (the kept tokens form a chain, so the last one's
        state is the row's state after it)."""
        kept = keep >= 0
        width = int(kept.sum(-1).max()) if keep.numel() else 0
        keep, kept = keep[:, :width], kept[:, :width]
        needed = int((self._lengths + kept.sum(-1)).max()) if width else 0
        if needed > self._states.shape[1]:
            self._states = self._padded(self._states, max(needed, 2 * self._states.shape[1]))
        if width:
            rows = torch.arange(self.num_rows).unsqueeze(1).expand(-1, width)
            positions = self._lengths.unsqueeze(1) + torch.arange(width)
            picked = self._block[rows, keep.clamp(min=0)]
            self._states[rows[kept], positions[kept]] = picked[kept]
            self._lengths = self._lengths + kept.sum(-1)
        self._block = None

    @torch.inference_mode()
    def commit_all(self, valid: torch.Tensor | None = None) -> None:
        n = 0 if self._block is None else self._block.shape[1]
        keep = torch.arange(n).expand(self.num_rows, n).clone()
        if valid is not None:
            keep = keep.masked_fill(~valid, -1)
            keep = keep.gather(1, (keep < 0).long().argsort(dim=1, stable=True))  # valid first, in order
        self.keep_block(keep)

    @torch.inference_mode()
    def truncate(self, lengths: torch.Tensor) -> None:
        self._lengths = torch.minimum(self._lengths, lengths.to(self._lengths.device))
