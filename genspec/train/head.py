"""Training a draft head or Medusa heads (:mod:`genspec.speculators.head`) on the target's own features.

Data: token sequences (the target's own continuations of prompts the benchmark never measures, and
teacher-forced text); the target runs over each once and its features (the LM head's inputs) are kept.
Loss, EAGLE's: at pair i (feature f_i, token i + 1) the head predicts f_{i+1}; a smooth-L1 regression
to the true f_{i+1} plus 0.1 x the cross-entropy of the head's draft law against the target's law at
i + 1, both over the head's vocabulary (the target's logits of the true f_{i+1} through the same rows
of its output layer). Uniform noise on the input features (EAGLE's) teaches the head to draft from
its own imperfect predictions.

Medusa heads (:func:`medusa_loss`): head j, from feature f_i, learns the target's law at i + 2 + j
(self-distillation: the cross-entropy against the law of the true f_{i+1+j}), weighted 0.8^j as in Medusa.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from genspec.errors import ConfigError, InputFileError
from genspec.speculators.distilled import DistilledDraft, local_ids
from genspec.speculators.head import DraftHead
from genspec.speculators.medusa import MedusaHeads
from genspec.speculators.store import HEAD_CONFIG, KINDS, save_head, target_fingerprint

#: the training state, beside the saved head in the output directory
CHECKPOINT = "checkpoint.pt"


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


@dataclass(frozen=True)
class Teacher:
    """What a loss reads of the target: its logits of the speculator's vocabulary from a feature
    (``logits_of``, the target's own output rows), its input embedding, and the table from its token
    ids to the vocabulary's indices (the last index for tokens outside it)."""

    logits_of: Callable[[torch.Tensor], torch.Tensor]
    embed: Callable[[torch.Tensor], torch.Tensor]
    to_local: torch.Tensor


def record_features(target, sequences: list[list[int]], batch_size: int = 8,
                    progress: Callable[[int], None] | None = None,
                    token_layers: int = 0, feature_layers: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tokens [n], features [n, H])`` per sequence: the target's feature at every position but the
    last (whose successor is unknown, so it teaches nothing), as the engine hands them to drafters.
    With ``feature_layers``, the outputs of those target layers follow it (``[n, H * (1 + len)]``, as the
    engine hands them to a head with ``feature_layers``); with ``token_layers`` = L, then the state after
    the target's first L layers at each position, as :class:`genspec.drafters.layer_states.LayerStates`
    computes it at run time."""
    from genspec.models.variants import first_layers

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
    from genspec.calibration import most_frequent_tokens

    return most_frequent_tokens(Counter(t for s in sequences for t in s), size, always)[0]


def cut_pieces(data: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences cut into pieces of at most ``length`` pairs (features f_0..f_{n-1}, tokens 0..n)."""
    out = []
    for tokens, features in data:
        for start in range(0, len(features) - 1, length):
            stop = min(start + length, len(features))
            if stop - start >= 2:
                out.append((tokens[start:stop + 1], features[start:stop]))
    return out


def head_loss(head: DraftHead, teacher: Teacher, tokens: torch.Tensor, features: torch.Tensor,
              mask: torch.Tensor, settings: TrainSettings, generator: torch.Generator | None = None):
    """``(loss, regression, classification, top-1 agreement)`` on a padded batch: ``tokens`` ``[B, n + 1]``,
    ``features`` ``[B, n, H]`` (f_0..f_{n-1}), ``mask`` ``[B, n - 1]`` the pairs with a known next feature.
    A head with ``token_layers`` or ``feature_layers`` takes wider ``features`` (:func:`record_features`)
    and learns its committed pairs (exact features, fused with ``feature_layers``; the next token's
    embedding or layer state) and its drafted pairs (its own predicted features, or noisy ones, and the
    embedding) at once; the figures but the loss are then its committed pairs' (the first draft token)."""
    hidden, width = head.config.hidden_size, head.config.feature_width
    exact, wanted = features[:, :-1, :width], features[:, 1:, :hidden]
    inputs = exact[..., :hidden]
    if settings.noise and generator is not None:
        scale = inputs.pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.rand(inputs.shape, generator=generator, dtype=inputs.dtype) * 2 - 1
        inputs = inputs + settings.noise * scale * noise
    embeddings = teacher.embed(tokens[:, 1:-1]).to(features.dtype)
    if not head.splits:
        return feature_loss(head(inputs, embeddings), wanted, teacher, mask, settings)  # predicts f_1..f_{n-1}
    # own_drafted_features: EAGLE-3's training-time test (pair 0 has no prediction: its noisy feature stays)
    states = features[:, 1:, width:] if head.config.token_layers else None
    committed, drafted = head(exact, embeddings, states, drafted_features=inputs,
                              own_predictions=settings.own_drafted_features)
    with torch.no_grad():
        target_logits = teacher.logits_of(wanted).float()
    first = feature_loss(committed, wanted, teacher, mask, settings, target_logits)
    later = feature_loss(drafted, wanted, teacher, mask, settings, target_logits)
    return (first[0] + later[0],) + first[1:]


def feature_loss(predicted: torch.Tensor, wanted: torch.Tensor, teacher: Teacher, mask: torch.Tensor,
                 settings: TrainSettings, target_logits: torch.Tensor | None = None):
    """EAGLE's loss of predicted features ``[B, n, H]`` against the target's ``wanted`` ones, over the pairs
    in ``mask``: ``(loss, regression, classification, top-1 agreement)`` as :func:`head_loss` returns them.
    ``target_logits``: those of ``wanted`` if already computed."""
    regression = torch.nn.functional.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1)
    draft = teacher.logits_of(predicted).float().log_softmax(-1)
    if target_logits is None:
        with torch.no_grad():
            target_logits = teacher.logits_of(wanted).float()
    classification = -(target_logits.softmax(-1) * draft).sum(-1)
    weight = mask.to(regression.dtype)
    total = weight.sum().clamp(min=1)
    regression, classification = (regression * weight).sum() / total, (classification * weight).sum() / total
    agree = ((draft.argmax(-1) == target_logits.argmax(-1)).to(weight.dtype) * weight).sum() / total
    return regression + settings.classification_weight * classification, regression, classification, agree


def medusa_loss(heads: MedusaHeads, teacher: Teacher, tokens: torch.Tensor, features: torch.Tensor,
                mask: torch.Tensor, settings: TrainSettings, generator: torch.Generator | None = None):
    """Like :func:`head_loss` for Medusa heads (no regression, exact input features): the weighted sum
    of the heads' cross-entropies; the classification and agreement reported are head 0's."""
    n = features.shape[1]
    predicted = heads(features[:, :-1])  # [B, n - 1, K, H]: from f_0..f_{n-2}
    with torch.no_grad():
        laws = teacher.logits_of(features[:, 1:]).float().softmax(-1)  # the target's law at f_1..f_{n-1}, once for all heads
    total = features.new_zeros(())
    first = agree = features.new_zeros(())
    for j in range(min(heads.config.num_heads, n - 1)):
        draft = teacher.logits_of(predicted[:, :n - 1 - j, j]).float().log_softmax(-1)
        law = laws[:, j:]  # head j's: the law j + 1 positions after its feature's
        weight = mask[:, j:].to(draft.dtype)
        pairs = weight.sum().clamp(min=1)
        entropy = (-(law * draft).sum(-1) * weight).sum() / pairs
        total = total + 0.8 ** j * entropy
        if j == 0:
            first = entropy
            agree = ((draft.argmax(-1) == law.argmax(-1)).to(weight.dtype) * weight).sum() / pairs
    return total, features.new_zeros(()), first, agree


def draft_loss(draft: DistilledDraft, teacher: Teacher, tokens: torch.Tensor, features: torch.Tensor,
               mask: torch.Tensor, settings: TrainSettings, generator: torch.Generator | None = None):
    """Like :func:`head_loss` for the distilled draft model (no regression): reading tokens 0..n-2 it
    learns the target's law of tokens 1..n-1 (from f_0..f_{n-2}) over its vocabulary, soft labels."""
    n = features.shape[1]
    logits = draft(teacher.to_local[tokens[:, :n - 1]]).float().log_softmax(-1)
    with torch.no_grad():
        law = teacher.logits_of(features[:, :n - 1]).float().softmax(-1)
    weight = mask.to(logits.dtype)
    pairs = weight.sum().clamp(min=1)
    entropy = (-(law * logits).sum(-1) * weight).sum() / pairs
    agree = ((logits.argmax(-1) == law.argmax(-1)).to(weight.dtype) * weight).sum() / pairs
    return entropy, features.new_zeros(()), entropy, agree


#: the loss of each kind
LOSSES = {"head": head_loss, "medusa": medusa_loss, "draft": draft_loss}


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
    import pickle

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
    own) on recorded features (:func:`record_features`); saves it to ``out`` (with a resumable
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
    saved, wanted = state["log"].get("config") or {}, config.as_dict()
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
