"""The trained draft head (EAGLE / Hydra style): one small decoder layer (or a few) on the target's own features.

At position i it reads the pair (the target's feature f_i, the embedding of token i + 1) and predicts
f_{i+1}, the target's feature one position on; the target's own output layer, cut to a truncated
vocabulary (the most frequent tokens of the target's outputs, FR-Spec style), turns a predicted feature
into draft logits. Drafting further feeds the head's own prediction back, paired with the token just
drafted. A "feature" is what :meth:`genspec.models.hf.HFCausalLM.hidden_states` returns: the input of
the target's LM head.

The layer is written out here (RMSNorm, grouped-query attention with rotary positions, a gated MLP)
rather than borrowed from a transformers model class, because the drafter attends per row over caches
of different lengths and the trainer over whole sequences, and both go through :meth:`DraftHead.run`,
which leaves each layer's attention to its caller. ``HeadConfig.num_layers`` stacks layers (EAGLE's
head is one; the shipped head is one).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape. ``hidden_size`` is the target's; the rest is the head's own."""

    hidden_size: int
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 1024
    num_layers: int = 1
    rope_theta: float = 10_000.0
    eps: float = 1e-6
    #: 0: a committed pair's second part is the embedding of token i + 1 (EAGLE's); L > 0: the target's
    #: state after its first L layers over token i + 1 (drafted pairs keep the embedding: see DraftHead)
    token_layers: int = 0
    #: (): a committed pair's first part is the target's final feature at i (EAGLE's); layers l1, l2, ...: a
    #: fusion of the final feature and the outputs of those target layers at i (EAGLE-3's; drafted pairs read
    #: the head's own predicted feature: see DraftHead)
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(layer) for layer in self.feature_layers))

    @property
    def feature_width(self) -> int:
        """Columns of a committed pair's target features (the final feature, then ``feature_layers``')."""
        return self.hidden_size * (1 + len(self.feature_layers))

    def as_dict(self) -> dict:
        return asdict(self)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[B, heads, n, d]`` at ``positions`` ``[B, n]``."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.to(torch.float32).unsqueeze(-1) * frequencies  # [B, n, half]
    cos, sin = angles.cos().unsqueeze(1).to(x.dtype), angles.sin().unsqueeze(1).to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class HeadLayer(nn.Module):
    """One decoder layer of the head: attention (its inputs from :meth:`project`, the attention itself
    left to the caller: whole sequences in training, per-row caches in the drafter) and a gated MLP."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        hidden, inner = config.hidden_size, config.num_heads * config.head_dim
        self.attention_norm = nn.RMSNorm(hidden, eps=config.eps)
        self.q = nn.Linear(hidden, inner, bias=False)
        self.k = nn.Linear(hidden, config.num_kv_heads * config.head_dim, bias=False)
        self.v = nn.Linear(hidden, config.num_kv_heads * config.head_dim, bias=False)
        self.o = nn.Linear(inner, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=config.eps)
        self.gate = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, hidden, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """Queries ``[B, heads, n, d]``, keys and values ``[B, kv_heads, n, d]`` (rotated) of inputs ``x``."""
        c = self.config
        batch, n, _ = x.shape
        h = self.attention_norm(x)
        q = self.q(h).view(batch, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k(h).view(batch, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(h).view(batch, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[B, n, H]`` from its inputs ``x`` and their attention outputs."""
        batch, _, n, _ = attended.shape
        x = x + self.o(attended.transpose(1, 2).reshape(batch, n, -1))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


#: how a caller attends: ``(layer index, q, k, v) -> attention outputs`` (see :meth:`DraftHead.run`)
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftHead(nn.Module):
    """The network. ``forward`` runs whole sequences (training); the drafter runs :meth:`inputs` (or
    :meth:`state_inputs`) -> :meth:`run` with its own cached attention per layer.

    With ``config.token_layers`` = L > 0 a *committed* pair reads, instead of the embedding of token i + 1,
    the target's own state after its first L layers over that token (which has attended over the whole
    context; the drafter runs those layers over each token it is handed, :class:`genspec.drafters.layer_states.LayerStates`).
    The first draft token comes from the last committed pair, so it gains; a *drafted* token has no such
    state (the target never ran over it), so drafted pairs keep the embedding, through their own input
    projection, and attend over the committed pairs as at run time (:meth:`forward` with ``states``). With the
    same data and steps, a middle layer's state lifts the first token's agreement with the target's answers
    (the manual's Training speculators page has the measurements).

    With ``config.feature_layers`` a committed pair's first part fuses the target's final feature with the
    outputs of those of its layers (EAGLE-3: ``Linear(concat(RMSNorm(part)))``, the engine hands them over,
    :attr:`genspec.drafters.base.DrafterCapabilities.target_hidden_layers`); a drafted pair, where the target never ran,
    reads the head's own predicted feature instead, so such a head too trains committed and drafted pairs
    apart. With the same data and steps, fusing a few layers lifts held-out top-1 agreement too (the manual's
    Training speculators page)."""

    kind = "head"

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.feature_norm = nn.RMSNorm(hidden, eps=config.eps)
        self.embedding_norm = nn.RMSNorm(hidden, eps=config.eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        if config.token_layers:
            self.state_norm = nn.RMSNorm(hidden, eps=config.eps)
            self.state_fc = nn.Linear(2 * hidden, hidden, bias=False)
        if config.feature_layers:
            parts = 1 + len(config.feature_layers)
            self.part_norms = nn.ModuleList(nn.RMSNorm(hidden, eps=config.eps) for _ in range(parts))
            self.fuse = nn.Linear(parts * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(HeadLayer(config) for _ in range(config.num_layers))
        self.out_norm = nn.RMSNorm(hidden, eps=config.eps)

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """The first layer's input ``[B, n, H]`` from the pairs (feature, next token's embedding)."""
        return self.fc(torch.cat([self.feature_norm(features), self.embedding_norm(embeddings)], dim=-1))

    def state_inputs(self, features: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The first layer's input ``[B, n, H]`` from committed pairs (feature, next token's layer state),
        for a head with ``token_layers``."""
        return self.state_fc(torch.cat([self.feature_norm(features), self.state_norm(states)], dim=-1))

    @property
    def splits(self) -> bool:
        """Committed and drafted pairs read different inputs (:meth:`committed_inputs`), so training runs both."""
        return bool(self.config.token_layers or self.config.feature_layers)

    def committed_inputs(self, features: torch.Tensor, embeddings: torch.Tensor,
                         states: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input ``[B, n, H]`` from committed pairs: the target's features at i ``[B, n,
        config.feature_width]`` (fused with ``feature_layers``) and the next token's embedding, or its layer
        state (``states``, with ``token_layers``)."""
        if self.config.feature_layers:
            parts = features.split(self.config.hidden_size, dim=-1)
            features = self.fuse(torch.cat([norm(part) for norm, part in zip(self.part_norms, parts)], dim=-1))
        if self.config.token_layers:
            return self.state_inputs(features, states)
        return self.inputs(features, embeddings)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of ``q`` ``[B, heads, n, d]`` over ``k`` / ``v`` ``[B, kv_heads, T, d]`` with a bool
        ``mask`` ``[B or 1, 1, n, T]`` (True: may attend) or causal when None (T = n)."""
        groups = self.config.num_heads // self.config.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

    def run(self, x: torch.Tensor, positions: torch.Tensor, attention: Attention):
        """The layers over inputs ``x`` ``[B, n, H]`` at ``positions`` ``[B, n]``, each layer's queries, keys
        and values attended by ``attention``: the predicted features ``[B, n, H]`` and the block's keys and
        values of every layer, ``[L, B, kv_heads, n, d]`` (what a cache keeps)."""
        keys, values = [], []
        for index, layer in enumerate(self.layers):
            q, k, v = layer.project(x, positions)
            x = layer.finish(x, attention(index, q, k, v))
            keys.append(k)
            values.append(v)
        return self.out_norm(x), torch.stack(keys), torch.stack(values)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, states: torch.Tensor | None = None,
                drafted_features: torch.Tensor | None = None, own_predictions: bool = False):
        """Whole sequences (causal; right padding is never attended by real positions): the predicted
        feature of position i + 1 for each pair i, ``[B, n, H]``. A head that :attr:`splits` returns
        ``(from committed pairs, from drafted pairs)``, each ``[B, n, H]``: pair i as committed
        (:meth:`committed_inputs` of ``features`` ``[B, n, config.feature_width]``, ``embeddings`` and
        ``states``, the next tokens' layer states for a head with ``token_layers``) after committed pairs
        0..i-1, and as drafted (its embedding, and ``drafted_features`` if given, else the final features)
        after the same committed pairs: what the drafter's first and later draft tokens see.
        ``own_predictions``: drafted pair i > 0 reads instead the committed half's prediction of feature i
        (from pair i - 1, not differentiated), as the first drafted pair does at run time (EAGLE-3's
        training-time test)."""
        n = features.shape[1]
        positions = torch.arange(n, device=features.device).expand(features.shape[0], -1)
        if not self.splits:
            return self.run(self.inputs(features, embeddings), positions, lambda _, q, k, v: self.attend(q, k, v, None))[0]
        committed, keys, values = self.run(self.committed_inputs(features, embeddings, states), positions,
                                           lambda _, q, k, v: self.attend(q, k, v, None))
        read = features[..., :self.config.hidden_size] if drafted_features is None else drafted_features
        if own_predictions:
            read = torch.cat([read[:, :1], committed[:, :-1].detach()], dim=1)
        causal = torch.ones(n, n, dtype=torch.bool, device=features.device).tril()
        mask = torch.cat([causal.tril(-1), torch.eye(n, dtype=torch.bool, device=features.device)], 1).view(1, 1, n, 2 * n)
        drafted = self.run(self.inputs(read, embeddings), positions, lambda layer, q, k, v: self.attend(
            q, torch.cat([keys[layer], k], dim=2), torch.cat([values[layer], v], dim=2), mask))[0]
        return committed, drafted
