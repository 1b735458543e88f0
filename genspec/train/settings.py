"""The settings of a training run (``genspec train``): the loop's and the weights the losses read."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from genspec.errors import ConfigError

#: the least value of each setting (every one is a count or a weight: none is negative)
_LEAST = {"steps": 1, "batch_size": 1, "sequence_length": 1, "checkpoint_every": 1}


@dataclass(frozen=True)
class TrainSettings:
    """The loop's settings, checked when made (a number of the wrong type, negative, NaN, or a count below 1
    raises :class:`~genspec.errors.ConfigError` naming it)."""

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

    def __post_init__(self):
        for setting in fields(self):
            value = getattr(self, setting.name)
            least = _LEAST.get(setting.name, 0)
            if setting.type == "bool":
                if not isinstance(value, bool):
                    raise ConfigError(f"training setting {setting.name} must be true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or (setting.type == "int" and not isinstance(value, int)) or value < least:
                kind = "an integer" if setting.type == "int" else "a number"
                raise ConfigError(f"training setting {setting.name} must be {kind} >= {least}, got {value!r}")
        if self.learning_rate <= 0:
            raise ConfigError(f"training setting learning_rate must be > 0, got {self.learning_rate}")
