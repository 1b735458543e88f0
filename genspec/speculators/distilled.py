"""The distilled draft model (``genspec train draft``): a tiny standalone transformer (or a recurrent
network, ``--arch gru|lstm``: :mod:`genspec.speculators.recurrent`) with the target's tokenizer, trained on the
target's own laws (soft labels, DistillSpec-style), usable wherever a draft model is (``--drafter draft``,
``--draft-model DIR``, a level of ``hierarchical``).

Its vocabulary is the target's most frequent output tokens (as the heads'), plus one "other" input
token for the rest: a 262k-row embedding would be 67 MB at width 128 and mostly untrained. At the
engine's interface it is a model over the target's full vocabulary: ids are mapped in, logits are
mapped out (tokens outside its vocabulary get probability 0, which the standard rule allows).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from genspec.errors import ConfigError
from genspec.models.hf import HFCausalLM

#: the networks a distilled draft can be: a Llama, or a stack of GRU or LSTM layers
DRAFT_ARCHS = ("transformer", "gru", "lstm")


@dataclass(frozen=True)
class DraftConfig:
    """The draft's shape. ``hidden_size`` is the target's (unused: recorded so loading can check).
    ``arch``: one of :data:`DRAFT_ARCHS` (a draft saved without one is a transformer); a recurrent draft
    reads ``width`` and ``num_layers`` only."""

    hidden_size: int
    vocab_size: int  # the draft's own vocabulary, "other" included
    width: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    max_positions: int = 2048
    arch: str = "transformer"

    def __post_init__(self):
        if self.arch not in DRAFT_ARCHS:
            raise ConfigError(f"a draft's arch is one of {', '.join(DRAFT_ARCHS)}, got {self.arch!r}")

    def as_dict(self) -> dict:
        return asdict(self)

    def llama(self):
        from transformers import LlamaConfig  # here: 3 s that `import genspec` does not spend otherwise

        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.width, num_hidden_layers=self.num_layers,
                           num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                           intermediate_size=self.intermediate_size, max_position_embeddings=self.max_positions,
                           tie_word_embeddings=False)  # separate tensors: safetensors stores no shared ones


class DistilledDraft(nn.Module):
    """The network: a Llama of :class:`DraftConfig` over the draft's own token ids."""

    kind = "draft"

    def __init__(self, config: DraftConfig):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.config = config
        self.model = LlamaForCausalLM(config.llama())

    def forward(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n, S]`` over the draft's vocabulary, "other" left out (it is never drafted)."""
        return self.model(input_ids=local_ids).logits[..., :-1]

    def as_model(self, vocab_ids: list[int], full_vocab_size: int, tokenizer=None) -> "DistilledLM":
        """This draft as a :class:`genspec.models.base.CausalLM` over the target's vocabulary."""
        return DistilledLM(self, vocab_ids, full_vocab_size, tokenizer)


def local_ids(vocab_ids: list[int], full_vocab_size: int, device=None) -> torch.Tensor:
    """A table from the target's token ids to the draft's (the last one, "other", for the rest)."""
    table = torch.full((full_vocab_size,), len(vocab_ids), dtype=torch.long, device=device)
    table[torch.as_tensor(vocab_ids, dtype=torch.long, device=device)] = torch.arange(len(vocab_ids), device=device)
    return table


class DistilledLM(HFCausalLM):
    """A :class:`DistilledDraft` as a :class:`genspec.models.base.CausalLM` over the target's vocabulary."""

    def __init__(self, draft: DistilledDraft, vocab_ids: list[int], full_vocab_size: int, tokenizer=None):
        super().__init__(draft.model, tokenizer)
        self.vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long, device=self.device)
        self._to_local = local_ids(vocab_ids, full_vocab_size, self.device)
        self.vocab_size = full_vocab_size

    def hidden_states(self, tokens, valid=None, tree_mask=None, prefix=None, layers=()):
        return super().hidden_states(self._to_local[tokens.to(self.device)], valid, tree_mask, prefix, layers)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        local = super().head(hidden)[..., :-1]
        full = local.new_full((*local.shape[:-1], self.vocab_size), -torch.inf)
        full[..., self.vocab_ids] = local
        return full
