"""The training loop of every trained speculator kind (``genspec train head | medusa | draft``): batches of
recorded features (:func:`genspec.train.data.record_features`) through the kind's loss
(:data:`genspec.train.losses.LOSSES`), AdamW with warm-up and a cosine schedule, a resumable checkpoint,
held-out figures before, during and after, and the trained speculator saved
(:func:`genspec.speculators.store.save_head`).
"""
from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import torch

from genspec.errors import ConfigError, InputFileError
from genspec.speculators.distilled import local_ids
from genspec.speculators.store import HEAD_CONFIG, KINDS, save_head, target_fingerprint
from genspec.train.losses import LOSSES, Teacher, head_loss
from genspec.train.settings import TrainSettings

#: the training state, beside the saved head in the output directory
CHECKPOINT = "checkpoint.pt"


def cut_pieces(data: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences cut into pieces of at most ``length`` pairs (features f_0..f_{n-1}, tokens 0..n)."""
    out = []
    for tokens, features in data:
        for start in range(0, len(features) - 1, length):
            stop = min(start + length, len(features))
            if stop - start >= 2:
                out.append((tokens[start:stop + 1], features[start:stop]))
    return out


def pad_batch(pieces, indices):
    """``(tokens [B, n + 1], features [B, n, H], mask [B, n - 1])`` of the pieces at ``indices``, right-padded
    with zeros; ``mask`` marks the pairs with a known next feature (what the losses read)."""
    n = max(len(pieces[i][1]) for i in indices)
    hidden = pieces[indices[0]][1].shape[-1]
    tokens = torch.zeros(len(indices), n + 1, dtype=torch.long)
    features = torch.zeros(len(indices), n, hidden)
    mask = torch.zeros(len(indices), n - 1, dtype=torch.bool)
    for b, i in enumerate(indices):
        t, f = pieces[i]
        tokens[b, :len(t)], features[b, :len(f)], mask[b, :len(f) - 1] = t, f, True
    return tokens, features, mask


def load_checkpoint(path: Path) -> dict:
    """A training checkpoint, read without running any of its code: tensors, numbers, strings, lists and
    dicts only (``torch.load(weights_only=True)``). A file that needs pickle to load (any other object in
    it) is refused: unpickling runs code the file names, and a checkpoint may come from anywhere."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise InputFileError(f"{path} holds objects that only pickle can load (loading them would run code the "
                             "file names); genspec reads checkpoints as tensors and plain data only, so it will "
                             "not load this one: train from scratch into a new --out") from exc


def train_head(target, train: list[tuple[torch.Tensor, torch.Tensor]], held_out: list[tuple[torch.Tensor, torch.Tensor]],
               vocab_ids: list[int], out: str | Path, config=None, settings: TrainSettings = TrainSettings(),
               resume: bool = False, progress: Callable[[int, dict], None] | None = None, info: dict | None = None,
               kind: str = "head") -> dict:
    """Train a speculator of ``kind`` ("head" or "medusa"; ``config`` its shape, default the kind's
    own) on recorded features (:func:`genspec.train.data.record_features`); saves it to ``out`` (with a resumable
    checkpoint every ``checkpoint_every`` steps) and returns the training log: loss per step, held-out
    figures before and after, time."""
    out = Path(out)
    if not resume and ((out / CHECKPOINT).exists() or (out / HEAD_CONFIG).exists()):
        raise ConfigError(f"{out} holds a trained speculator; choose another --out or pass --resume")
    module, config_class = KINDS[kind]
    config = config or config_class(hidden_size=target.config.hidden_size)
    state = resumable_state(out, config) if resume else None
    torch.manual_seed(settings.seed)
    head = module(config).to(torch.float32).train()
    if kind == "head":
        head.start_from(target, vocab_ids)
    loss_of = LOSSES[kind]
    vocab = torch.as_tensor(vocab_ids, dtype=torch.long)
    embedding = target.model.get_input_embeddings()
    # detached: the target's weights require grad (transformers' default), and backward would otherwise build
    # the whole embedding table's gradient every step (262,144 x 640 floats, 671 MB, on the embedded model),
    # which nothing learns from
    teacher = Teacher(target.subset_head(vocab), lambda tokens: embedding(tokens).detach(),
                      local_ids(vocab_ids, target.vocab_size))
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / settings.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(step, settings.steps) / settings.steps)))
    generator = torch.Generator().manual_seed(settings.seed)
    log = {"settings": asdict(settings), "config": config.as_dict(), "loss": [], "seconds": 0.0}
    step = 0
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        generator.set_state(state["generator"])
        step, log = state["step"], state["log"]
    pieces, held = cut_pieces(train, settings.sequence_length), cut_pieces(held_out, settings.sequence_length)
    if not pieces:
        raise ConfigError("no training data: every sequence is shorter than 3 tokens")
    if "held_out_before" not in log:
        log["held_out_before"] = evaluate(head, teacher, held, settings, loss_of)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter() - log["seconds"]
    while step < settings.steps:
        order = torch.randint(len(pieces), (settings.batch_size,), generator=generator).tolist()
        tokens, features, mask = pad_batch(pieces, order)
        loss, regression, classification, agree = loss_of(head, teacher, tokens, features, mask, settings,
                                                           generator)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        entry = {"step": step, "loss": loss.item(), "regression": regression.item(),
                 "classification": classification.item(), "agreement": agree.item()}
        log["loss"].append(entry)
        if settings.held_out_every and step % settings.held_out_every == 0 and step < settings.steps:
            log.setdefault("held_out_curve", []).append({"step": step, **evaluate(head, teacher, held, settings, loss_of)})
        if progress is not None:
            progress(step, entry)
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            log["seconds"] = time.perf_counter() - started
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                        "generator": generator.get_state(), "step": step, "log": log}, out / CHECKPOINT)
    log["held_out_after"] = evaluate(head, teacher, held, settings, loss_of)
    log.setdefault("held_out_curve", []).append({"step": step, **log["held_out_after"]})
    log["seconds"] = time.perf_counter() - started
    save_head(out, head.eval(), vocab_ids, target_fingerprint(target), {**(info or {}), "log": log})
    return log


def resumable_state(out: str | Path, config=None) -> dict:
    """The training state in ``out``'s :data:`CHECKPOINT`, checked before any work starts: there is one, it
    loads whole (not truncated), and (given ``config``, the kind's ``HeadConfig``, ``MedusaConfig`` or
    ``DraftConfig``) it trains a speculator of that shape. Otherwise :class:`InputFileError` or
    :class:`ConfigError` naming the file and the difference."""
    path = Path(out) / CHECKPOINT
    if not path.is_file():
        raise InputFileError(f"nothing to resume in {out} (no {CHECKPOINT})")
    try:
        state = load_checkpoint(path)
    except InputFileError:  # it needs pickle: refused, whole or not
        raise
    except Exception as exc:  # noqa: BLE001 - truncated: RuntimeError (PytorchStreamReader); garbage: ValueError, EOFError...
        detail = str(exc).split(". ")[0].splitlines()[0] if str(exc) else "no detail"
        raise InputFileError(f"{path} is damaged or truncated, so training cannot resume from it ({type(exc).__name__}: "
                             f"{detail}); start over in an empty --out") from None
    keys = {"head", "optimizer", "schedule", "generator", "step", "log"}
    if not isinstance(state, dict) or not keys <= set(state) or not isinstance(state["log"], dict):
        raise InputFileError(f"{path} is not a genspec training checkpoint (it lacks {', '.join(sorted(keys))})")
    if config is None:
        return state
    # a field the checkpoint lacks was added after it was written: it trained with the field's default
    defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
    saved, wanted = {**defaults, **(state["log"].get("config") or {})}, config.as_dict()
    differences = [f"{key}: {saved.get(key)!r} in the checkpoint, {value!r} asked" for key, value in wanted.items()
                   if _plain(saved.get(key)) != _plain(value)]
    if differences:
        raise ConfigError(f"{path} trains a speculator of another shape ({'; '.join(differences)}): resume with the "
                          f"options it was started with, or train into another --out")
    return state


def _plain(value):
    """Tuples as lists, so that a setting compares equal however it was stored."""
    return list(value) if isinstance(value, tuple) else value


@torch.no_grad()
def evaluate(head, teacher: Teacher, pieces, settings: TrainSettings,
             loss_of=head_loss, batch_size: int = 16) -> dict:
    """Held-out loss and first-token agreement (draft argmax = target argmax, over the head's vocabulary)."""
    if not pieces:
        return {}
    was_training = head.training
    head.eval()
    totals = {"loss": 0.0, "agreement": 0.0, "pairs": 0}
    quiet = TrainSettings(**{**asdict(settings), "noise": 0.0})
    for start in range(0, len(pieces), batch_size):
        tokens, features, mask = pad_batch(pieces, list(range(start, min(start + batch_size, len(pieces)))))
        loss, _, _, agree = loss_of(head, teacher, tokens, features, mask, quiet)
        pairs = int(mask.sum())
        totals["loss"] += float(loss) * pairs
        totals["agreement"] += float(agree) * pairs
        totals["pairs"] += pairs
    head.train(was_training)
    return {"loss": totals["loss"] / max(1, totals["pairs"]), "agreement": totals["agreement"] / max(1, totals["pairs"]),
            "pairs": totals["pairs"]}
