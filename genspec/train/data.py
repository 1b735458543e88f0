"""Training data for speculators: token sequences, kept in the output directory so that a resumed run,
or another kind trained for the same model (``--sequences``), skips the slow part (the target's
continuations: about 15 minutes for 415 prompts x 128 tokens on a 2-core CPU).

Sources: the target's own greedy continuations of Spec-Bench prompts that ``genspec bench`` never
measures (prompts longer than ``max_prompt_tokens`` are teacher-forced only: decoding after them is
slow on a CPU), and teacher-forced text. 1 in 10 sequences (by a seeded permutation) is held out.
The target's features over them (:func:`record_features`) are what the speculators learn from.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from genspec.calibration import most_frequent_tokens
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models.variants import first_layers

#: the sequences of a run, in its output directory
SEQUENCES = "sequences.json"
#: teacher-forced sequences are cut to this many tokens (attention cost grows with length)
MAX_SEQUENCE_TOKENS = 1024


@dataclass
class Sequences:
    """Token sequences with, per sequence, the length of its prompt when its tail is the target's own
    continuation (0: teacher-forced text), the held-out indices, and how they were made."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    held_out: list[int] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def split(self, seed: int) -> None:
        """Hold out 1 in 10 continuations and 1 in 10 teacher-forced sequences (at least one of each
        kind there is), by a permutation seeded with ``seed``."""
        order = torch.randperm(len(self.sequences), generator=torch.Generator().manual_seed(seed)).tolist()
        held = []
        for continued in (True, False):
            kind = [i for i in order if bool(self.prompt_lengths[i]) == continued]
            held += kind[:max(1, len(kind) // 10)] if len(kind) > 1 else []
        self.held_out = sorted(held or order[:1])

    @property
    def train(self) -> list[int]:
        held = set(self.held_out)
        return [i for i in range(len(self.sequences)) if i not in held]

    def held_out_prompts(self) -> list[list[int]]:
        """The prompts of held-out continuations: what the trained speculator is measured on."""
        return [self.sequences[i][:self.prompt_lengths[i]] for i in self.held_out if self.prompt_lengths[i]]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str | Path) -> "Sequences":
        try:
            return cls(**json.loads(Path(path).read_text()))
        except FileNotFoundError as exc:
            raise InputFileError(f"no training sequences at {path}") from exc
        except (OSError, ValueError, TypeError) as exc:
            raise InputFileError(f"cannot read the training sequences at {path}: {exc}") from exc


def read_texts(paths: list[str]) -> list[str]:
    """Teacher-forced text: UTF-8 files (paragraphs split at blank lines), or .jsonl with a "text" field."""
    texts = []
    for path in paths:
        try:
            raw = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise InputFileError(f"training data not found: {path}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise InputFileError(f"cannot read {path} as UTF-8 text: {exc}") from exc
        if path.endswith(".jsonl"):
            try:
                texts += [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
            except (ValueError, KeyError, TypeError) as exc:
                raise InputFileError(f"{path}: expected one JSON object with a \"text\" field per line") from exc
        else:
            texts += [part for part in raw.split("\n\n") if part.strip()]
    return texts


def collect_sequences(target, prompts: list[list[int]], texts: list[str], max_new_tokens: int,
                      max_prompt_tokens: int, batch_size: int = 16,
                      progress: Callable[[int, int], None] | None = None) -> Sequences:
    """The target's greedy continuations of ``prompts`` (batched; shortest first, for less padding)
    and ``texts`` teacher-forced. ``progress(done, total)`` after each batch of continuations."""
    context = target.max_context or 1 << 30
    limit = min(max_prompt_tokens, context - max_new_tokens)
    ordered = sorted(prompts, key=len)
    continued, long_prompts = [p for p in ordered if len(p) <= limit], [p for p in ordered if len(p) > limit]
    engine = SpeculativeEngine(target, max_batch_size=batch_size)
    sequences, prompt_lengths = [], []
    for start in range(0, len(continued), batch_size):
        batch = continued[start:start + batch_size]
        results = engine.generate_ids(batch, max_new_tokens=max_new_tokens, temperature=0.0)
        sequences += [prompt + r.token_ids for prompt, r in zip(batch, results)]
        prompt_lengths += [len(prompt) for prompt in batch]
        if progress is not None:
            progress(start + len(batch), len(continued))
    generated = sum(len(s) for s in sequences) - sum(prompt_lengths)
    forced = teacher_forced(target, long_prompts, texts)
    if len(sequences) + len(forced) < 2:
        raise ConfigError("too little training data: no prompt fits the model's context and no --data given")
    info = {"continued_prompts": len(continued), "generated_tokens": generated, "continuation_tokens": max_new_tokens,
            "teacher_forced_sequences": len(forced), "teacher_forced_tokens": sum(map(len, forced))}
    return Sequences(sequences + forced, prompt_lengths + [0] * len(forced), info=info)


def teacher_forced(target, prompts: list[list[int]], texts: list[str]) -> list[list[int]]:
    """Teacher-forced sequences: token-id ``prompts`` and ``texts``, each cut to ``MAX_SEQUENCE_TOKENS`` (and
    the model's context); those shorter than 3 tokens teach nothing and are dropped."""
    cut = min(MAX_SEQUENCE_TOKENS, target.max_context or 1 << 30)
    forced = [p[:cut] for p in prompts] + [target.tokenizer(text)["input_ids"][:cut] for text in texts]
    return [s for s in forced if len(s) >= 3]


def held_out_acceptance(target, drafter, prompts: list[list[int]], max_new_tokens: int = 64,
                        num_draft_tokens: int = 5) -> dict:
    """What a trained drafter achieves where it was not trained: greedy generation through the engine
    on held-out prompts at a fixed draft length; per-position acceptance from the engine's records."""
    if not prompts:
        return {}
    engine = SpeculativeEngine(target, drafter, max_batch_size=len(prompts))
    results = engine.generate_ids(prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                                  num_draft_tokens=num_draft_tokens, draft_length="fixed")
    drafted, accepted = [0] * num_draft_tokens, [0] * num_draft_tokens
    calls = kept = 0
    for r in results:
        for i, (d, a) in enumerate(zip(r.stats.drafted_per_position, r.stats.accepted_per_position + [0] * num_draft_tokens)):
            drafted[i] += d
            accepted[i] += a
        calls, kept = calls + r.stats.target_calls, kept + r.stats.accepted_tokens
    per_position = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "num_draft_tokens": num_draft_tokens,
            "first_token_acceptance": per_position[0], "acceptance_per_position": per_position,
            "mean_accepted_length": 1 + kept / calls if calls else 0.0}


def record_features(target, sequences: list[list[int]], batch_size: int = 8,
                    progress: Callable[[int], None] | None = None,
                    token_layers: int = 0, feature_layers: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tokens [n], features [n, H])`` per sequence: the target's feature at every position but the
    last (whose successor is unknown, so it teaches nothing), as the engine hands them to drafters.
    With ``feature_layers``, the outputs of those target layers follow it (``[n, H * (1 + len)]``, as the
    engine hands them to a head with ``feature_layers``); with ``token_layers`` = L, then the state after
    the target's first L layers at each position, as :class:`genspec.drafters.layer_states.LayerStates`
    computes it at run time."""
    models = [target] + ([first_layers(target, token_layers)] if token_layers else [])
    layers = [tuple(feature_layers)] + [()] * (len(models) - 1)
    out = []
    for start in range(0, len(sequences), batch_size):
        batch = [s for s in sequences[start:start + batch_size] if len(s) >= 3]
        if not batch:
            continue
        parts = []
        for model, wanted in zip(models, layers):
            model.reset(0)
            parts.append(model.add_rows([s[:-1] for s in batch], return_hidden=True, hidden_layers=wanted))
        for n, seq in enumerate(batch):
            features = torch.cat([part[n].detach().to(torch.float32) for part in parts], -1).clone()
            out.append((torch.tensor(seq, dtype=torch.long), features))
        if progress is not None:
            progress(len(batch))
    for model in models:
        model.reset(0)
    return out


def choose_vocabulary(sequences: list[list[int]], size: int, always: tuple[int, ...] = ()) -> list[int]:
    """The head's vocabulary: the ``size`` most frequent tokens of ``sequences``, plus ``always`` (EOS)."""
    return most_frequent_tokens(Counter(t for s in sequences for t in s), size, always)[0]
