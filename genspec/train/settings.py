"""The settings of a training run (``genspec train``): the loop's and the weights the losses read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 2000
    batch_size: int = 8  # sequences per step
    sequence_length: int = 256  # tokens per sequence (longer ones are cut into pieces)
    learning_rate: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    classification_weight: float = 0.1
    noise: float = 0.1  # uniform noise on input features, in units of their RMS
    #: a head with ``token_layers`` or ``feature_layers``: its drafted pairs read its own predictions of their
    #: features (EAGLE-3's training-time test) rather than the target's with noise
    own_drafted_features: bool = True
    checkpoint_every: int = 100
    held_out_every: int = 250  # steps between held-out evaluations (the curve that shows over-fitting; 0: none)
    seed: int = 0
