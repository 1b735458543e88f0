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

:class:`HeadNetwork` declares what the drafter and the trainer ask of a head; :class:`DraftHead` is genspec's own
layout above, :class:`Eagle3Head` EAGLE-3's as llama.cpp and vLLM run it (``HeadConfig.shape``, :class:`HeadShape`):
it predicts its own state rather than the target's feature, feeds that state back, and has its own output layer over
the draft vocabulary, so that :mod:`genspec.speculators.export` can write it for them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum

import torch
from torch import nn

from genspec.errors import ConfigError


class HeadShape(StrEnum):
    """The layouts a trained head comes in (``genspec train head --shape``)."""

    #: genspec's own (:class:`DraftHead`): it predicts the target's next feature, read by the target's output layer
    EAGLE = "eagle"
    #: EAGLE-3's as llama.cpp and vLLM run it (:class:`Eagle3Head`): three target layers fused, one decoder layer
    #: over (embedding, state), its own output layer over a reduced draft vocabulary
    EAGLE3 = "eagle3"


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
    #: the network's layout; :attr:`HeadShape.EAGLE3` takes exactly three ``feature_layers``, one layer, no token layers
    shape: HeadShape = HeadShape.EAGLE
    #: the draft vocabulary's size, for a head with its own output layer (:attr:`HeadShape.EAGLE3`); 0 otherwise
    vocab_size: int = 0

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(layer) for layer in self.feature_layers))
        try:
            object.__setattr__(self, "shape", HeadShape(self.shape))
        except ValueError:
            raise ConfigError(f"a head's shape is one of {', '.join(HeadShape)}, got {self.shape!r}") from None
        if self.shape is HeadShape.EAGLE3:
            if len(self.feature_layers) != 3 or self.num_layers != 1 or self.token_layers:
                raise ConfigError("an EAGLE-3 head reads exactly three target layers (feature_layers) with one decoder "
                                  f"layer and no token layers, got feature_layers={self.feature_layers}, "
                                  f"num_layers={self.num_layers}, token_layers={self.token_layers}")
            if self.vocab_size < 1:
                raise ConfigError(f"an EAGLE-3 head needs its draft vocabulary's size (vocab_size >= 1), got {self.vocab_size}")

    @property
    def feature_width(self) -> int:
        """Columns of a committed pair's target features (the final feature, then ``feature_layers``')."""
        return self.hidden_size * (1 + len(self.feature_layers))

    def as_dict(self) -> dict:
        """Plain values only (the shape by its name): a training checkpoint holding this loads without pickle."""
        return {**asdict(self), "shape": self.shape.value}


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


#: how a caller attends: ``(layer index, q, k, v) -> attention outputs`` (see :meth:`HeadNetwork.run`)
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: the target's logits of the head's vocabulary from its final features (``target.subset_head(vocab)``)
TargetLogits = Callable[[torch.Tensor], torch.Tensor]


class HeadNetwork(nn.Module):
    """What the drafter (:class:`genspec.drafters.head.HeadDrafter`), the trainer and the store ask of a head,
    whatever its layout (:class:`HeadShape`): pairs of (a state at position i, token i + 1) through its
    ``layers`` (each with ``project(x, positions) -> q, k, v`` and ``finish(x, attended) -> x``), the state each
    pair predicts for position i + 1, and the draft logits of such a state.

    A *committed* pair reads the target's features at i (:meth:`committed_inputs`); a *drafted* pair reads the
    head's own prediction from the pair before it (:meth:`inputs`). ``forward`` runs whole sequences (training);
    the drafter runs :meth:`committed_inputs` / :meth:`inputs` -> :meth:`run` with its own cached attention."""

    kind = "head"
    #: whether the predicted state is the target's next feature (trained by regression to it, read by the target's
    #: own output layer), or the head's own state (trained through its draft law only)
    predicts_features = True

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """The first layer's input ``[B, n, W]`` from drafted pairs (predicted state ``[B, n, H]``, next token's embedding)."""
        raise NotImplementedError

    def committed_inputs(self, features: torch.Tensor, embeddings: torch.Tensor,
                         states: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input from committed pairs: the target's features at i ``[B, n, config.feature_width]``
        and the next token's embedding (or its layer state, ``states``, for a head with ``token_layers``)."""
        raise NotImplementedError

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The predicted state ``[B, n, H]`` from the last layer's output ``x``."""
        raise NotImplementedError

    def draft_logits(self, predicted: torch.Tensor, target_logits: TargetLogits) -> torch.Tensor:
        """The draft logits ``[..., S]`` over the head's vocabulary of predicted states ``[..., H]``;
        ``target_logits``: the target's own output rows of that vocabulary (what a head predicting features reads)."""
        raise NotImplementedError

    def start_from(self, target, vocab_ids: list[int]) -> None:
        """Initialise what the head may take from its target before training (nothing, unless a layout says)."""

    @property
    def splits(self) -> bool:
        """Committed and drafted pairs read different inputs (:meth:`committed_inputs`), so training runs both."""
        return bool(self.config.token_layers or self.config.feature_layers)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of ``q`` ``[B, heads, n, d]`` over ``k`` / ``v`` ``[B, kv_heads, T, d]`` with a bool
        ``mask`` ``[B or 1, 1, n, T]`` (True: may attend) or causal when None (T = n)."""
        groups = self.config.num_heads // self.config.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)

    def run(self, x: torch.Tensor, positions: torch.Tensor, attention: Attention):
        """The layers over inputs ``x`` ``[B, n, W]`` at ``positions`` ``[B, n]``, each layer's queries, keys
        and values attended by ``attention``: the predicted states ``[B, n, H]`` (:meth:`output`) and the block's
        keys and values of every layer, ``[L, B, kv_heads, n, d]`` (what a cache keeps)."""
        keys, values = [], []
        for index, layer in enumerate(self.layers):
            q, k, v = layer.project(x, positions)
            x = layer.finish(x, attention(index, q, k, v))
            keys.append(k)
            values.append(v)
        return self.output(x), torch.stack(keys), torch.stack(values)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, states: torch.Tensor | None = None,
                drafted_features: torch.Tensor | None = None, own_predictions: bool = False):
        """Whole sequences (causal; right padding is never attended by real positions): the predicted
        state of position i + 1 for each pair i, ``[B, n, H]``. A head that :attr:`splits` returns
        ``(from committed pairs, from drafted pairs)``, each ``[B, n, H]``: pair i as committed
        (:meth:`committed_inputs` of ``features`` ``[B, n, config.feature_width]``, ``embeddings`` and
        ``states``, the next tokens' layer states for a head with ``token_layers``) after committed pairs
        0..i-1, and as drafted (its embedding, and ``drafted_features`` if given, else the final features)
        after the same committed pairs: what the drafter's first and later draft tokens see.
        ``own_predictions``: drafted pair i > 0 reads instead the committed half's prediction of state i
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


class DraftHead(HeadNetwork):
    """genspec's own layout (:attr:`HeadShape.EAGLE`): it predicts the target's next feature, which the target's
    output layer turns into draft logits. ``forward`` runs whole sequences (training); the drafter runs
    :meth:`inputs` (or :meth:`state_inputs`) -> :meth:`run` with its own cached attention per layer.

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

    def __init__(self, config: HeadConfig):
        super().__init__(config)
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

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The predicted feature: the last layer's output through the head's final norm (as the target's are)."""
        return self.out_norm(x)

    def draft_logits(self, predicted: torch.Tensor, target_logits: TargetLogits) -> torch.Tensor:
        """The target's own output layer, cut to the head's vocabulary, over the predicted feature."""
        return target_logits(predicted)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer as llama.cpp (``src/models/eagle3.cpp``) and vLLM (``llama_eagle3.py``) run it. Its
    input ``x`` ``[B, n, 2H]`` is a pair ``(e, g)``: the next token's embedding, then the state at i (the fused
    target layers for a committed pair, the previous step's output for a drafted one). Queries, keys and values
    come from ``concat(input_layernorm(e), hidden_norm(g))`` (2H wide, the embedding first); the residual is the
    raw ``g``; a gated SiLU MLP follows. The names are the checkpoints' (``self_attn.`` and ``mlp.`` dropped)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        hidden, inner = config.hidden_size, config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        self.input_layernorm = nn.RMSNorm(hidden, eps=config.eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=config.eps)
        self.q_proj = nn.Linear(2 * hidden, inner, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv, bias=False)
        self.o_proj = nn.Linear(inner, hidden, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=config.eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """Queries ``[B, heads, n, d]``, keys and values ``[B, kv_heads, n, d]`` (rotated) of pairs ``x``."""
        c = self.config
        batch, n, _ = x.shape
        embedding, state = x.split(c.hidden_size, dim=-1)
        h = torch.cat([self.input_layernorm(embedding), self.hidden_norm(state)], dim=-1)
        q = self.q_proj(h).view(batch, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[B, n, H]`` (before any norm: what a drafted pair reads back as its state)."""
        batch, _, n, _ = attended.shape
        h = x[..., self.config.hidden_size:] + self.o_proj(attended.transpose(1, 2).reshape(batch, n, -1))
        m = self.post_attention_layernorm(h)
        return h + self.down_proj(nn.functional.silu(self.gate_proj(m)) * self.up_proj(m))


class Eagle3Head(HeadNetwork):
    """EAGLE-3's layout (:attr:`HeadShape.EAGLE3`), exactly as llama.cpp's ``eagle3`` architecture and vLLM's
    ``Eagle3LlamaForCausalLM`` compute it, so that it exports to either (:mod:`genspec.speculators.export`).

    A committed pair's state is ``fc`` (no bias, no norm before it) over the target's three ``feature_layers``
    states at i, concatenated in their order (the engine hands ``[final, l1, l2, l3]``; the final feature is not
    read); a drafted pair's is the previous step's output. One :class:`Eagle3Layer` turns the pair into the
    predicted state, before any norm, which the next drafted pair reads; the draft logits are its own
    ``lm_head(norm(state))`` over the ``config.vocab_size`` tokens of its vocabulary (the vocabulary's ids are
    the store's ``vocab_ids``: llama.cpp's ``d2t``). The embedding is the target's own and is not stored."""

    predicts_features = False

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = nn.RMSNorm(hidden, eps=config.eps)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Drafted pairs: ``(embedding, previous output)`` ``[B, n, 2H]``."""
        return torch.cat([embeddings, features], dim=-1)

    def committed_inputs(self, features: torch.Tensor, embeddings: torch.Tensor,
                         states: torch.Tensor | None = None) -> torch.Tensor:
        """Committed pairs: ``(embedding, fc(the three layers' states))`` ``[B, n, 2H]``."""
        return torch.cat([embeddings, self.fc(features[..., self.config.hidden_size:])], dim=-1)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def draft_logits(self, predicted: torch.Tensor, target_logits: TargetLogits) -> torch.Tensor:
        """Its own norm and output layer (``target_logits`` is not read)."""
        return self.lm_head(self.norm(predicted))

    @torch.no_grad()
    def start_from(self, target, vocab_ids: list[int]) -> None:
        """The output layer starts as the target's rows of the draft vocabulary (EAGLE-3 checkpoints' common start):
        the predicted state then only has to come near the target's own final states."""
        self.lm_head.weight.copy_(target.output_rows(torch.as_tensor(vocab_ids, dtype=torch.long)).to(self.lm_head.weight))


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads unless told: llama.cpp's converter's default ``[2, n // 2, n - 3]``
    clipped to the layers whose inputs are hidden states (1 .. n - 1), or, where that repeats a layer, the first,
    middle and last of them."""
    if num_layers < 4:
        raise ConfigError(f"an EAGLE-3 head reads three distinct target layers from 1 to n - 1: a {num_layers}-layer "
                          f"target has too few")
    layers = tuple(min(max(layer, 1), num_layers - 1) for layer in (2, num_layers // 2, num_layers - 3))
    return layers if len(set(layers)) == 3 else (1, num_layers // 2, num_layers - 1)


def head_network(config: HeadConfig) -> HeadNetwork:
    """The network of ``config``'s shape (how a saved head is rebuilt and a new one made)."""
    return Eagle3Head(config) if config.shape is HeadShape.EAGLE3 else DraftHead(config)
