"""The losses of the trained speculators, one per kind (:data:`LOSSES`), on a padded batch of the target's
recorded features; each returns ``(loss, regression, classification, top-1 agreement)``.

Draft head (:func:`head_loss`), EAGLE's: at pair i (feature f_i, token i + 1) the head predicts f_{i+1}; a
smooth-L1 regression to the true f_{i+1} plus 0.1 x the cross-entropy of the head's draft law against the
target's law at i + 1, both over the head's vocabulary (the target's logits of the true f_{i+1} through the
same rows of its output layer). Uniform noise on the input features (EAGLE's) teaches the head to draft from
its own imperfect predictions.

An EAGLE-3 head (:class:`genspec.speculators.head.Eagle3Head`, ``predicts_features`` False) predicts its own
state, not the target's feature: no regression, only the cross-entropy of its own draft law against the
target's (weight 1), on committed pairs and on drafted ones reading its own previous prediction (EAGLE-3's
training-time test).

Medusa heads (:func:`medusa_loss`): head j, from feature f_i, learns the target's law at i + 2 + j
(self-distillation: the cross-entropy against the law of the true f_{i+1+j}), weighted 0.8^j as in Medusa.

Distilled draft (:func:`draft_loss`): the target's law of each next token, soft labels (DistillSpec-style),
whatever the draft's network (a transformer, or a GRU or LSTM stack).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from genspec.speculators.distilled import DistilledDraft
from genspec.speculators.head import HeadNetwork
from genspec.speculators.medusa import MedusaHeads
from genspec.speculators.recurrent import RecurrentDraft
from genspec.train.settings import TrainSettings


@dataclass(frozen=True)
class Teacher:
    """What a loss reads of the target: its logits of the speculator's vocabulary from a feature
    (``logits_of``, the target's own output rows), its input embedding, and the table from its token
    ids to the vocabulary's indices (the last index for tokens outside it)."""

    logits_of: Callable[[torch.Tensor], torch.Tensor]
    embed: Callable[[torch.Tensor], torch.Tensor]
    to_local: torch.Tensor


def head_loss(head: HeadNetwork, teacher: Teacher, tokens: torch.Tensor, features: torch.Tensor,
              mask: torch.Tensor, settings: TrainSettings, generator: torch.Generator | None = None):
    """``(loss, regression, classification, top-1 agreement)`` on a padded batch: ``tokens`` ``[B, n + 1]``,
    ``features`` ``[B, n, H]`` (f_0..f_{n-1}), ``mask`` ``[B, n - 1]`` the pairs with a known next feature.
    A head with ``token_layers`` or ``feature_layers`` takes wider ``features``
    (:func:`genspec.train.data.record_features`) and learns its committed pairs (exact features, fused with
    ``feature_layers``; the next token's embedding or layer state) and its drafted pairs (its own predicted features, or noisy ones, and the
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
        return feature_loss(head, head(inputs, embeddings), wanted, teacher, mask, settings)  # predicts f_1..f_{n-1}
    # own_drafted_features: EAGLE-3's training-time test (pair 0 has no prediction: its noisy feature stays). A
    # head predicting its own states always reads them: the target's features are not states of its kind
    own = settings.own_drafted_features or not head.predicts_features
    states = features[:, 1:, width:] if head.config.token_layers else None
    committed, drafted = head(exact, embeddings, states, drafted_features=inputs, own_predictions=own)
    with torch.no_grad():
        target_logits = teacher.logits_of(wanted).float()
    first = feature_loss(head, committed, wanted, teacher, mask, settings, target_logits)
    # drafted pair 0 has no earlier prediction to read: for a head of its own states it teaches nothing
    drafted_mask = mask if head.predicts_features else torch.cat([torch.zeros_like(mask[:, :1]), mask[:, 1:]], dim=1)
    later = feature_loss(head, drafted, wanted, teacher, drafted_mask, settings, target_logits)
    return (first[0] + later[0],) + first[1:]


def feature_loss(head: HeadNetwork, predicted: torch.Tensor, wanted: torch.Tensor, teacher: Teacher, mask: torch.Tensor,
                 settings: TrainSettings, target_logits: torch.Tensor | None = None):
    """EAGLE's loss of ``head``'s predicted states ``[B, n, H]`` against the target's ``wanted`` features, over
    the pairs in ``mask``: ``(loss, regression, classification, top-1 agreement)`` as :func:`head_loss` returns
    them. ``target_logits``: those of ``wanted`` if already computed. A head that does not predict the target's
    features (:attr:`~genspec.speculators.head.HeadNetwork.predicts_features`) is not regressed: its loss is the
    cross-entropy alone."""
    draft = head.draft_logits(predicted, teacher.logits_of).float().log_softmax(-1)
    if target_logits is None:
        with torch.no_grad():
            target_logits = teacher.logits_of(wanted).float()
    classification = -(target_logits.softmax(-1) * draft).sum(-1)
    weight = mask.to(classification.dtype)
    total = weight.sum().clamp(min=1)
    classification = (classification * weight).sum() / total
    agree = ((draft.argmax(-1) == target_logits.argmax(-1)).to(weight.dtype) * weight).sum() / total
    if not head.predicts_features:
        return classification, classification.new_zeros(()), classification, agree
    regression = torch.nn.functional.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1)
    regression = (regression * weight).sum() / total
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


def draft_loss(draft: DistilledDraft | RecurrentDraft, teacher: Teacher, tokens: torch.Tensor, features: torch.Tensor,
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
