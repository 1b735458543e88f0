"""Healing a pruned copy of the target (``genspec calibrate prune --heal-steps N``): a short distillation of
the copy's own weights, the projections pruning made smaller (everything it shares with the target stays as
it is), towards the target's next-token laws on the calibration sequences: KL(target || copy) over the
positions of a piece of one sequence per step, AdamW at a constant rate, gradients clipped to norm 1, and a
checkpoint every few steps from which an interrupted run resumes exactly (each step's piece is drawn from the
seed and the step number alone). What the copy drafts is still checked by the target: healing changes how
often its drafts are kept, never the law of the output.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from genspec.errors import ConfigError, InputFileError
from genspec.models.variants import load_weights, own_weights
from genspec.train.loop import load_checkpoint

#: steps between two checkpoints
CHECKPOINT_EVERY = 20


def distillation_loss(target, draft, tokens: list[int]) -> torch.Tensor:
    """The mean over the positions of ``tokens`` of KL(the target's next-token law || the copy's), with a
    gradient in the copy's weights (the target runs without one)."""
    ids = torch.tensor([tokens], device=draft.device)
    target.reset(1)
    logits = target.forward(ids)
    target.reset(0)
    precision = torch.promote_types(logits.dtype, torch.float32)
    wanted = torch.log_softmax(logits.to(precision), -1).clone()  # out of inference mode: a constant of the loss
    hidden = draft.decoder(input_ids=ids, use_cache=False).last_hidden_state
    got = torch.log_softmax(draft.head(hidden).to(precision), -1)
    return (wanted.exp() * (wanted - got)).sum(-1).mean()


def held_out_kl(target, draft, sequences: list[list[int]], piece_tokens: int) -> float:
    """:func:`distillation_loss` averaged over the first ``piece_tokens`` of each of ``sequences``."""
    with torch.no_grad():
        losses = [float(distillation_loss(target, draft, s[:piece_tokens])) for s in sequences if len(s) >= 2]
    return sum(losses) / len(losses) if losses else float("nan")


def heal(target, draft, train: list[list[int]], held_out: list[list[int]], steps: int, learning_rate: float = 1e-4,
         piece_tokens: int = 128, seed: int = 0, checkpoint: str | Path | None = None, resume: dict | None = None,
         saved_with: dict | None = None, checkpoint_every: int = CHECKPOINT_EVERY,
         progress: Callable[[int, float], None] | None = None) -> dict:
    """Distil ``draft``'s own weights (:func:`own_weights`) towards ``target`` on pieces of at most
    ``piece_tokens`` tokens of the ``train`` sequences, ``steps`` steps in all. Every ``checkpoint_every``
    steps and at the end the state goes to ``checkpoint`` with ``saved_with`` (what the caller needs to
    resume: the plan, the sequences); ``resume`` is such a state (:func:`read_checkpoint`), from which the run
    continues. ``progress(step, loss)`` after each step. Returns what was done: ``{"steps", "learning_rate",
    "piece_tokens", "seed", "held_out_kl_before", "held_out_kl_after", "losses"}``."""
    if steps < 1 or piece_tokens < 2 or not learning_rate > 0:
        raise ConfigError(f"healing needs steps >= 1, pieces of >= 2 tokens and a learning rate > 0, got "
                          f"{steps}, {piece_tokens}, {learning_rate}")
    train = [s for s in train if len(s) >= 2]
    if not train:
        raise ConfigError("nothing to heal on: no calibration sequence of 2 tokens or more")
    weights = own_weights(draft, target)
    if not weights:
        raise ConfigError("nothing to heal: the plan removes no head and no MLP channel")
    frozen = {p: p.requires_grad for p in target.model.parameters()}
    optimizer = torch.optim.AdamW(list(weights.values()), lr=learning_rate, weight_decay=0.0)
    try:
        for p in frozen:  # the target's weights (shared ones included) take no gradient
            p.requires_grad_(False)
        for p in weights.values():
            p.requires_grad_(True)
        if resume is not None:
            load_weights(weights, resume["weights"], "the healing checkpoint")
            optimizer.load_state_dict(resume["optimizer"])
            start, log = int(resume["step"]), dict(resume["log"])
        else:
            start = 0
            log = {"held_out_kl_before": held_out_kl(target, draft, held_out, piece_tokens), "losses": []}
        for step in range(start, steps):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
            sequence = train[int(torch.randint(len(train), (1,), generator=generator))]
            first = int(torch.randint(max(1, len(sequence) - piece_tokens + 1), (1,), generator=generator))
            loss = distillation_loss(target, draft, sequence[first:first + piece_tokens])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(weights.values()), 1.0)
            optimizer.step()
            log["losses"].append(float(loss.detach()))
            if progress is not None:
                progress(step + 1, log["losses"][-1])
            if checkpoint is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
                torch.save({**(saved_with or {}), "step": step + 1, "log": log, "optimizer": optimizer.state_dict(),
                            "weights": {name: p.detach().clone() for name, p in weights.items()}}, checkpoint)
    finally:
        for p in weights.values():
            p.requires_grad_(False)
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    return {"steps": steps, "learning_rate": learning_rate, "piece_tokens": piece_tokens, "seed": seed,
            "held_out_kl_before": log["held_out_kl_before"],
            "held_out_kl_after": held_out_kl(target, draft, held_out, piece_tokens), "losses": log["losses"]}


def read_checkpoint(path: str | Path) -> dict:
    """A healing checkpoint written by :func:`heal` (tensors and plain values only, read without pickle)."""
    if not Path(path).is_file():
        raise InputFileError(f"no healing checkpoint at {path} to resume from")
    state = load_checkpoint(Path(path))
    if not isinstance(state, dict) or not {"step", "log", "optimizer", "weights"} <= set(state):
        raise InputFileError(f"{path} is not a healing checkpoint of genspec calibrate prune")
    return state
