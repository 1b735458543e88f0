"""Medusa heads (Medusa-1, Cai et al. 2024): residual blocks on the target's last feature, each predicting
the feature of a token further on; the target's own (truncated) output layer turns them into draft logits."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa-1 heads: ``num_heads`` residual blocks on the target's last feature; block j predicts the
    feature whose token comes j + 1 positions after the target's own next token."""

    hidden_size: int
    num_heads: int = 4

    def as_dict(self) -> dict:
        return asdict(self)


class MedusaHeads(nn.Module):
    """K independent heads (Medusa-1, Cai et al. 2024): each a residual block x + SiLU(W x) whose output
    goes through the target's own (truncated) output layer. W starts at zero, so each head starts as
    "the target's next token again". Unlike the draft head they never see the tokens they draft."""

    kind = "medusa"

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Predicted features ``[..., K, H]`` from the target's features ``[..., H]``."""
        return torch.stack([features + nn.functional.silu(block(features)) for block in self.blocks], dim=-2)
