"""The acceptance rules of speculative decoding, from one position to a whole draft block.

A draft is ``M`` candidate chains per row (:class:`Candidates`; M = 1 for a single chain). The target
scored it in one pass over a block whose node 0 is the row's last committed token and whose other nodes
are the draft tokens, chains that share a prefix sharing nodes. :func:`verify` returns which nodes to
keep and the token after them (:class:`Verdict`): chains by the vectorised :func:`verify_chain`, trees by
:func:`verify_tree`, which applies :func:`verify_multidraft` one depth at a time.

Shapes: ``B`` rows (sequences or Monte-Carlo runs), ``k`` draft positions, ``M`` candidates, ``V``
vocabulary. Probabilities are any float dtype (float64 in the theory, float32 in the engine).

Rules (docs/theory.md; p = draft, q = target):
- standard (lossless): keep draft token y with probability min{1, q(y)/p(y)}; at the first rejection
  draw from the residual norm([q - p]+); if every draft token is kept, draw a bonus token from q.
- relaxed over-acceptance (lossy, opt-in; rule "overaccept" with eps > 0): keep y with probability
  min{1, (q(y) + eps)/p(y)} and resample from the OPT residual norm([q - p]+) (minimal bias, Thm 4)
  or from q itself (UNO).
- typical acceptance (lossy, opt-in; rule "typical", Medusa's): keep y iff q(y) > min(eps, delta *
  exp(-H(q))), H the target's entropy; resample from Theorem 4's optimum norm([q - b p]+) ("opt") or
  from q ("uno", what Medusa does). Its b can fall below min{1, q/p}, so it is not in the relaxed family.

- coupled (lossless, rule "coupled"): draft and target draw with the same noise of the position (i.i.d.
  exponentials e, i.e. Gumbel-max), y = argmax(p / e) and x = argmax(q / e) (:func:`coupled_tokens`); keep
  y iff y == x, else emit x. The emitted token is x whatever was drafted, an exact draw from q, so a seeded request's
  tokens depend on its noise alone, not on where its drafts stop (:mod:`genspec.randomness`). The price:
  P(keep) = P(argmax agree) >= (1 - TV) / (1 + TV) instead of 1 - TV. On the embedded model's own laws it
  keeps a little less than 1 - TV, where an inverse-CDF coupling with one uniform keeps far less (vocabulary
  order scatters the mass; the manual's Acceptance rules page has the measurements).

Over-acceptance at eps = 0 with the OPT residual and the coupled rule are lossless (:attr:`Rule.lossless`):
UNO at eps = 0 keeps min{1, q/p} but resamples from q, which is biased (docs/theory.md, Decoding-UNO).
- greedy: keep draft tokens while they equal the target's argmax.
- multi-draft (Algorithm 4's recursive residual verifier): try M candidates in turn against a
  residual that shrinks after every rejection; the output is still exactly q.

Randomness is explicit: every function takes a :class:`~genspec.randomness.Noise`, its ``accept``
uniforms (for the keep tests) and ``sample`` uniforms (one per emitted position, for residual and bonus
draws), or draws them from its ``generator``. Draws use the inverse CDF, so the token emitted at a
position is a function of that position's uniform: the engine gives every request its own stream of
uniforms, indexed by position, and a seeded request then produces the same tokens whatever shares its batch.

A deterministic draft (prompt lookup, retrieval, ...) passes ``draft_probs=None``: its law is the point
mass on the proposed token. For it the standard rule is carried out as the equivalent coupling
"draw x from q with the position's uniform; keep y iff x == y": P(keep) = q(y) = min{1, q(y)/1}, and
after a rejection x is q conditioned on x != y, which is the residual norm([q - delta_y]+). So the
output law is the rule's, and the output itself equals plain sampling's with the same uniforms,
whatever was drafted (several candidates: keep the one equal to x).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from genspec.acceptance.rule import STANDARD, Rule, RuleKind
from genspec.kernels import most_likely
from genspec.randomness import Noise


@dataclass
class ChainVerdict:
    """Outcome of verifying one chain of draft tokens per row.

    ``accepted_length[b]`` draft tokens of row b are kept (0..k); ``next_token[b]`` is the token
    emitted right after them (a residual draw after a rejection, or the bonus token).
    """

    accepted_length: torch.Tensor  # [B] long
    next_token: torch.Tensor  # [B] long


@dataclass
class MultiDraftVerdict:
    """Outcome of verifying M candidates for one position per row.

    ``accepted_index[b]`` is the candidate that was kept, or -1 if all were rejected;
    ``token[b]`` is the emitted token (the kept candidate, or a draw from the final residual).
    """

    accepted_index: torch.Tensor  # [B] long
    token: torch.Tensor  # [B] long


def acceptance_probability(target_prob_of_draft: torch.Tensor, draft_prob_of_draft: torch.Tensor,
                           epsilon=0.0) -> torch.Tensor:
    """b(y) = min{1, (q(y) + eps) / p(y)}, elementwise. eps = 0 is the lossless rule (``epsilon`` may be
    a tensor that broadcasts, e.g. one value per row).

    A token the draft could not have produced (p(y) = 0) is kept iff q(y) + eps > 0.
    """
    numerator = target_prob_of_draft + epsilon
    safe = torch.where(draft_prob_of_draft > 0, draft_prob_of_draft, torch.ones_like(draft_prob_of_draft))
    ratio = torch.where(draft_prob_of_draft > 0, numerator / safe, (numerator > 0).to(numerator.dtype))
    return ratio.clamp(max=1.0)


def typical_threshold(target_probs: torch.Tensor, epsilon=0.09, delta=0.3) -> torch.Tensor:
    """Medusa's typical-acceptance threshold min(eps, delta * exp(-H(q))) of each law ``[..., V] -> [...]``
    (H in nats, 0 log 0 = 0); ``epsilon`` and ``delta`` are numbers or tensors broadcasting against
    ``[...]``. A confident target (low entropy) gets the cap eps, an uncertain one a lower bar."""
    logs = torch.where(target_probs > 0, target_probs.log(), torch.zeros_like(target_probs))
    entropy = -(target_probs * logs).sum(-1)
    epsilon = torch.as_tensor(epsilon, dtype=target_probs.dtype, device=target_probs.device)
    return torch.minimum(epsilon, delta * torch.exp(-entropy))


def keep_probabilities(target_probs: torch.Tensor, draft_probs: torch.Tensor, rule: Rule = STANDARD) -> torch.Tensor:
    """b(x) for every token x: the probability that the rule keeps x if it was drafted, ``[..., V]``.

    "overaccept": min{1, (q + eps)/p} (:func:`acceptance_probability`); "typical": 1 where
    q > :func:`typical_threshold`, else 0. The rule's ``epsilon`` / ``delta``: numbers or tensors
    broadcasting against ``target_probs.shape[:-1]`` (one value per law)."""
    if rule.kind is RuleKind.TYPICAL:
        threshold = typical_threshold(target_probs, rule.epsilon, rule.delta)
        return (target_probs > threshold.unsqueeze(-1)).to(target_probs.dtype)
    if rule.kind is not RuleKind.OVERACCEPT:
        raise ValueError(f"the {rule.kind} rule has no keep probability")
    epsilon = rule.epsilon.unsqueeze(-1) if isinstance(rule.epsilon, torch.Tensor) else rule.epsilon
    return acceptance_probability(target_probs, draft_probs, epsilon)


def _keep_of_draft(target_of_draft: torch.Tensor, draft_of_draft: torch.Tensor, target_probs: torch.Tensor,
                   rule: Rule) -> torch.Tensor:
    """b(y) of the drafted tokens only (``[...]``; ``target_probs`` ``[..., V]`` is the law they are
    judged against, needed by "typical" for its entropy): the same rule as :func:`keep_probabilities`
    without building b over the whole vocabulary."""
    epsilon = _by_row(rule.epsilon, target_of_draft)
    if rule.kind is RuleKind.TYPICAL:
        threshold = typical_threshold(target_probs, epsilon, _by_row(rule.delta, target_of_draft))
        return (target_of_draft > threshold).to(target_of_draft.dtype)
    return acceptance_probability(target_of_draft, draft_of_draft, epsilon)


def _by_row(value, like: torch.Tensor):
    """A rule's parameter applied to ``like`` ``[B, ...]``: a number as it is; one value per row (``[B]``,
    :meth:`Rule.batch`) shaped ``[B, 1, ...]`` to broadcast, in ``like``'s dtype (float32 laws are judged
    in float32)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(like.dtype).reshape(-1, *[1] * (like.dim() - 1))


def resampling_law(target_probs: torch.Tensor, draft_probs: torch.Tensor, rule: Rule = STANDARD) -> torch.Tensor:
    """The law a rule draws from after rejecting a token drafted from ``draft_probs`` ``[..., V]``
    (the rule's ``epsilon`` / ``delta`` as in :func:`keep_probabilities`): :func:`residual_distribution`
    with the rule's own b where the OPT law needs it (typical acceptance)."""
    keep = None
    if rule.kind is RuleKind.TYPICAL and rule.residual == "opt":
        keep = keep_probabilities(target_probs, draft_probs, rule)
    return residual_distribution(target_probs, draft_probs, rule.residual, keep)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                          residual: str = "opt", keep_probs: torch.Tensor | None = None) -> torch.Tensor:
    """The law to resample from after a rejection, ``[..., V]``.

    "opt": Theorem 4's minimal-bias law norm([q - b p]+) for the keep probabilities ``keep_probs`` b
    ``[..., V]``; without them, norm([q - p]+), the standard residual, which is that law for every rule
    of the over-acceptance family (lossless one included: where b < 1, b p >= q). "uno": q.
    Where the positive part is all zero (p == q, so a rejection had probability 0 and only rounding
    got us here) q is returned, which keeps the output law exact.
    """
    if residual == "uno":
        return target_probs
    if residual != "opt":
        raise ValueError(f"unknown residual {residual!r}; choose from opt, uno")
    kept = draft_probs if keep_probs is None else keep_probs * draft_probs
    positive = (target_probs - kept).clamp(min=0)
    total = positive.sum(-1, keepdim=True)
    return torch.where(total > 0, positive / total.clamp(min=torch.finfo(total.dtype).tiny), target_probs)


def sample_with_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: one token per row of ``probs`` ``[..., V]`` from ``uniforms`` ``[...]`` in [0, 1).

    Rows need not be normalised exactly (the uniform is scaled by the row total); a token with zero
    probability is never drawn, even when rounding puts the scaled uniform on the last cumulative value.
    """
    cumulative = probs.cumsum(-1)
    total = cumulative[..., -1:]
    scaled = uniforms.to(cumulative.dtype).unsqueeze(-1) * total
    index = torch.searchsorted(cumulative.contiguous(), scaled.contiguous(), right=True).squeeze(-1)
    # where the cumulative sum first exceeds the scaled uniform it rose, so the token drawn has probability > 0;
    # only a uniform rounded up onto the total finds no token (index V) or, with a scan that rounds, one past the
    # last positive: those rows take their last token of positive probability. Looked for only then (a search
    # over a large vocabulary is a draw's whole cost again)
    vocab = probs.shape[-1]
    drawn = probs.gather(-1, index.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1)
    past = (index >= vocab) | (drawn <= 0)
    if bool(past.any()):
        last_positive = vocab - 1 - most_likely((probs > 0).flip(-1))
        index = torch.where(past, torch.minimum(index, last_positive), index)
    return index


def coupled_tokens(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """The coupled rule's draw: argmax(probs / race) over the last axis, ``[..., V] -> [...]``.

    With ``race`` i.i.d. standard exponentials (:meth:`genspec.randomness.RequestRandomness.race`) this is
    an exact draw from ``probs`` (the exponential race, i.e. Gumbel-max: argmax(log p + g) with g = -log e);
    a token of probability 0 is never drawn. Draft and target call it with the same noise of a position:
    that is the whole coupling."""
    scores = torch.where(probs > 0, probs.to(race.dtype) / race, torch.zeros_like(race))
    return most_likely(scores)


def _uniforms(shape, like: torch.Tensor, given: torch.Tensor | None, generator: torch.Generator | None):
    if given is not None:
        return given.to(like.device)
    return torch.rand(shape, generator=generator, dtype=torch.float64).to(like.device)


def _point_mass(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like).scatter_(-1, tokens.unsqueeze(-1), 1.0)


def verify_chain(draft_tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                 draft_lengths: torch.Tensor | None = None, rule: Rule = STANDARD,
                 noise: Noise | None = None) -> ChainVerdict:
    """Verify a chain of drafts per row with the standard (or relaxed) rule.

    Args:
        draft_tokens: ``[B, k]`` proposed tokens.
        target_probs: ``[B, k + 1, V]``; row i is the target's law for the token at draft position i
            (row k is the bonus position).
        draft_probs: ``[B, k, V]`` the draft's law at each position, or None for deterministic drafts.
        draft_lengths: ``[B]`` valid drafts per row (defaults to k); positions beyond are ignored and
            the token at the first ignored position is drawn from q, like a bonus token.
        rule: "overaccept" (eps = 0 with residual "opt": the lossless standard rule) or "typical", its
            epsilon and delta numbers or ``[B]`` (:meth:`Rule.batch`).
        noise: ``accept`` ``[B, k, 1]``, ``sample`` ``[B, k + 1]`` (:class:`~genspec.randomness.Noise`; what
            it lacks is drawn from its ``generator``).
    """
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(batch, device=device)
    if draft_lengths is None:
        draft_lengths = torch.full((batch,), k, dtype=torch.long, device=device)
    valid = torch.arange(k, device=device) < draft_lengths.unsqueeze(1)  # [B, k]
    noise = noise or Noise()
    sample_uniforms = _uniforms((batch, k + 1), target_probs, noise.sample, noise.generator)

    if draft_probs is None and rule.lossless:  # point masses: the coupling (module docstring)
        drawn = sample_with_uniforms(target_probs, sample_uniforms)  # [B, k + 1]
        kept = (drawn[:, :k] == draft_tokens) & valid
        accepted_length = kept.long().cumprod(-1).sum(-1)
        return ChainVerdict(accepted_length, drawn[rows, accepted_length])

    target_of_draft = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        draft_of_draft = torch.ones_like(target_of_draft)
    else:
        draft_of_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    keep_prob = _keep_of_draft(target_of_draft, draft_of_draft, target_probs[:, :k], rule)
    accept_uniforms = _uniforms((batch, k), keep_prob, None if noise.accept is None else noise.accept[:, :, 0],
                                noise.generator)
    kept = (accept_uniforms.to(keep_prob.dtype) < keep_prob) & valid
    accepted_length = kept.long().cumprod(-1).sum(-1)

    # the token after the kept prefix: residual at a rejected draft, q at a bonus / unused position
    target_row = target_probs[rows, accepted_length]  # [B, V]
    rejected_a_draft = accepted_length < draft_lengths
    at = accepted_length.clamp(max=max(k - 1, 0))
    if k == 0:
        draft_row = torch.zeros_like(target_row)
    elif draft_probs is None:
        draft_row = _point_mass(draft_tokens[rows, at], target_row)
    else:
        draft_row = draft_probs[rows, at]
    draft_row = draft_row * rejected_a_draft.unsqueeze(-1).to(draft_row.dtype)
    resample_law = torch.where(rejected_a_draft.unsqueeze(-1),
                               resampling_law(target_row, draft_row, rule),
                               target_row)
    return ChainVerdict(accepted_length, sample_with_uniforms(resample_law, sample_uniforms[rows, accepted_length]))


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
                  draft_lengths: torch.Tensor | None = None) -> ChainVerdict:
    """Greedy verification: keep drafts while they equal the target's argmax.

    ``target_argmax`` is ``[B, k + 1]``: the target's greedy token at each draft position plus the bonus.
    """
    batch, k = draft_tokens.shape
    if k == 0:  # nothing drafted (plain decoding): the target's token
        return ChainVerdict(torch.zeros(batch, dtype=torch.long, device=target_argmax.device), target_argmax[:, 0])
    matches = draft_tokens == target_argmax[:, :k]
    if draft_lengths is not None:
        matches &= torch.arange(k, device=draft_tokens.device) < draft_lengths.unsqueeze(1)
    accepted_length = matches.long().cumprod(-1).sum(-1)
    rows = torch.arange(batch, device=draft_tokens.device)
    return ChainVerdict(accepted_length, target_argmax[rows, accepted_length])


def verify_multidraft(candidate_tokens: torch.Tensor, target_probs: torch.Tensor,
                      draft_probs: torch.Tensor | None = None, candidate_mask: torch.Tensor | None = None,
                      rule: Rule = STANDARD, noise: Noise | None = None) -> MultiDraftVerdict:
    """Recursive residual verification of M candidates for one position (docs/theory.md, Algorithm 4).

    Stage j keeps candidate j with probability min{1, q^j(y_j) / p_j(y_j)}; after a rejection
    q^{j+1} = norm([q^j - p_j]+). If all are rejected the token is drawn from the last residual.
    Lossless when the candidates are independent draws y_j ~ p_j (i.i.d. from one draft, or from
    several drafts), including duplicates: a rejected token has zero residual mass afterwards.

    Args:
        candidate_tokens: ``[B, M]``.
        target_probs: ``[B, V]`` the target's law at this position.
        draft_probs: ``[B, V]`` (all candidates from one law), ``[B, M, V]`` (one law each), or None
            (deterministic candidates: point masses).
        candidate_mask: ``[B, M]`` which columns are real (default all; they are tried in column order).
        noise: ``accept`` ``[B, M]``, ``sample`` ``[B]`` (what it lacks is drawn from its ``generator``).
        rule: as in :func:`verify_chain`. The lossy rules run the same stages: "overaccept" judges candidate j against q^j; "typical" judges every
        candidate against q itself (Medusa's test of a tree's candidates), its "opt" residual removing
        b p after each rejection (Theorem 4's law, stage by stage).
    """
    batch, num_cols = candidate_tokens.shape
    device = candidate_tokens.device
    if candidate_mask is None:
        candidate_mask = torch.ones(batch, num_cols, dtype=torch.bool, device=device)
    noise = noise or Noise()
    sample_uniforms = _uniforms((batch,), target_probs, noise.sample, noise.generator)
    if draft_probs is None and rule.lossless:  # point masses: the coupling (module docstring)
        token = sample_with_uniforms(target_probs, sample_uniforms)
        hits = candidate_mask & (candidate_tokens == token.unsqueeze(1))
        first = hits.to(torch.uint8).argmax(1)
        return MultiDraftVerdict(torch.where(hits.any(1), first, torch.full_like(first, -1)), token)

    accept_uniforms = _uniforms((batch, num_cols), target_probs, noise.accept, noise.generator)
    law = target_probs
    accepted_index = torch.full((batch,), -1, dtype=torch.long, device=device)
    token = torch.zeros(batch, dtype=torch.long, device=device)
    open_rows = torch.ones(batch, dtype=torch.bool, device=device)
    for j in range(num_cols):
        live = open_rows & candidate_mask[:, j]
        if not bool(live.any()):
            continue
        candidate = candidate_tokens[:, j]
        if draft_probs is None:
            stage_draft = _point_mass(candidate, law)
        else:
            stage_draft = draft_probs if draft_probs.dim() == 2 else draft_probs[:, j]
        judged_law = target_probs if rule.kind is RuleKind.TYPICAL else law
        target_of_candidate = judged_law.gather(-1, candidate.unsqueeze(-1)).squeeze(-1)
        draft_of_candidate = stage_draft.gather(-1, candidate.unsqueeze(-1)).squeeze(-1)
        keep_prob = _keep_of_draft(target_of_candidate, draft_of_candidate, judged_law, rule)
        kept = live & (accept_uniforms[:, j].to(keep_prob.dtype) < keep_prob)
        accepted_index = torch.where(kept, torch.full_like(accepted_index, j), accepted_index)
        token = torch.where(kept, candidate, token)
        open_rows &= ~kept
        rejected = live & ~kept
        keep_all = None
        if rule.kind is RuleKind.TYPICAL and rule.residual == "opt":
            keep_all = keep_probabilities(target_probs, stage_draft, rule)
        law = torch.where(rejected.unsqueeze(-1), residual_distribution(law, stage_draft, rule.residual, keep_all), law)
    if bool(open_rows.any()):  # draw only for the rows that rejected every candidate
        token = torch.where(open_rows, sample_with_uniforms(law, sample_uniforms), token)
    return MultiDraftVerdict(accepted_index, token)


# ------------------------------------------------------------------------------ a whole block
@dataclass
class Candidates:
    """A draft block's candidates, per row: ``chains`` ``[B, M, k]`` tokens, ``lengths`` ``[B, M]`` the
    real ones per chain; ``node_of`` ``[B, M, k]`` the block node of chain m's token at depth d (None: a
    chain block, M = 1, ``[last, d_1 .. d_k]``); ``probs`` ``[B, M, k, V]`` the draft's law at each token,
    or None (deterministic drafts: point masses)."""

    chains: torch.Tensor
    lengths: torch.Tensor
    node_of: torch.Tensor | None = None
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class TargetLaw:
    """What the target said at a block's ``N`` nodes, processed exactly like the draft
    (:func:`genspec.sampling.target_law`): ``probs`` ``[B, N, V]``, the laws its tokens are drawn from (a
    greedy row's is the one-hot of its argmax), or, when every row is greedy, only ``tokens`` ``[B, N]``
    (no law is built)."""

    probs: torch.Tensor | None = None
    tokens: torch.Tensor | None = None

    def __post_init__(self):
        if (self.probs is None) == (self.tokens is None):
            raise ValueError("a TargetLaw holds either probs or tokens")


@dataclass
class Verdict:
    """What a verification keeps, per row.

    ``path`` ``[B, k + 1]``: block nodes to keep, in order: node 0 (the last committed token), then the
    accepted draft tokens' nodes; -1 after them. ``accepted_length`` ``[B]``: accepted draft tokens.
    ``next_token`` ``[B]``: the token emitted after them (a residual or greedy correction, or the bonus).
    ``target_probs`` ``[B, N, V]``: the target's processed laws at the block's nodes, which the rule
    judged against (None when every row was greedy and no law was built).
    """

    path: torch.Tensor
    accepted_length: torch.Tensor
    next_token: torch.Tensor
    target_probs: torch.Tensor | None = None

    @classmethod
    def of_chain(cls, verdict, k: int) -> "Verdict":
        positions = torch.arange(k + 1, device=verdict.accepted_length.device).expand(len(verdict.accepted_length), -1)
        path = torch.where(positions <= verdict.accepted_length.unsqueeze(1), positions, torch.full_like(positions, -1))
        return cls(path, verdict.accepted_length, verdict.next_token)


def verify_tree(draft: Candidates, target_probs: torch.Tensor | None = None, target_argmax: torch.Tensor | None = None,
                rule: Rule = STANDARD, noise: Noise | None = None) -> Verdict:
    """Walk a token tree one depth at a time, all rows at once.

    At depth d each row's candidates are its live chains (those whose first d tokens are the accepted
    path): greedy rows (``target_argmax`` ``[B, N]`` given) keep the candidate equal to the target's
    argmax; sampled rows (``target_probs`` ``[B, N, V]``) run the recursive residual verifier with
    ``rule`` (``draft.probs`` or point masses). The first rejection emits the verifier's token; a row that
    runs out of candidates emits a bonus token from the target's law at its node. ``noise``: ``accept``
    ``[B, k, M]``, ``sample`` ``[B, k + 1]`` (depth d emits the token at position d).
    """
    chains, lengths, node_of, draft_probs = draft.chains, draft.lengths, draft.node_of, draft.probs
    batch, num_chains, k = chains.shape
    device = chains.device
    rows = torch.arange(batch, device=device)
    greedy = target_probs is None
    noise = noise or Noise()
    accept_uniforms = noise.accept
    if not greedy:
        sample_uniforms = _uniforms((batch, k + 1), target_probs, noise.sample, noise.generator)
        if draft_probs is not None or not rule.lossless:
            accept_uniforms = _uniforms((batch, k, num_chains), target_probs, accept_uniforms, noise.generator)

    def bonus(node, depth):
        if greedy:
            return target_argmax[rows, node]
        return sample_with_uniforms(target_probs[rows, node], sample_uniforms[:, depth])

    node = torch.zeros(batch, dtype=torch.long, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    live = lengths > 0
    path = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    for depth in range(k):
        live &= lengths > depth
        out_of_candidates = walking & ~live.any(1)
        if bool(out_of_candidates.any()):
            next_token = torch.where(out_of_candidates, bonus(node, depth), next_token)
            walking &= ~out_of_candidates
        if not bool(walking.any()):
            break
        candidates = chains[:, :, depth]
        if greedy:
            token = target_argmax[rows, node]
            hits = live & (candidates == token.unsqueeze(1))
            chosen = torch.where(hits.any(1), hits.to(torch.uint8).argmax(1), torch.full_like(token, -1))
        else:
            verdict = verify_multidraft(
                candidates, target_probs[rows, node], None if draft_probs is None else draft_probs[:, :, depth],
                live & walking.unsqueeze(1), rule,
                Noise(sample_uniforms[:, depth], None if accept_uniforms is None else accept_uniforms[:, depth],
                      generator=noise.generator))
            chosen, token = verdict.accepted_index, verdict.token
        kept = walking & (chosen >= 0)
        next_token = torch.where(walking & ~kept, token, next_token)
        walking &= kept
        node = torch.where(kept, node_of[rows, chosen.clamp(min=0), depth], node)
        path[:, depth + 1] = torch.where(kept, node, torch.full_like(node, -1))
        accepted += kept.long()
        live &= candidates == token.unsqueeze(1)
    if bool(walking.any()):  # every depth accepted: the bonus token
        next_token = torch.where(walking, bonus(node, k), next_token)
    return Verdict(path, accepted, next_token)


def verify(draft: Candidates, target: TargetLaw, rule: Rule = STANDARD, noise: Noise | None = None) -> Verdict:
    """Verify a draft block against the target's processed law at its nodes.

    A chain block (``draft.node_of`` None: M = 1, N = k + 1) is verified with the vectorised chain rules,
    a tree by the tree walk. A ``target`` of tokens only (every row greedy) is token match; in a sampled
    batch a greedy row's law is the one-hot of its argmax, under which the standard rule is token match.
    ``rule`` is the acceptance rule of the sampled rows (:func:`genspec.acceptance.verify_chain`); greedy
    rows always match tokens, so lossy rules are for sampled rows only (``GenerationConfig`` refuses them
    at temperature 0). ``noise.coupled`` ``[B]`` (bool) marks the rows verified by the coupled rule
    instead, with ``noise.race`` ``[B, k + 1, V]`` their noise at each depth (the target's token at a node
    of depth d is :func:`~genspec.acceptance.coupled_tokens` of its law and ``race[:, d]``; then token match).
    """
    chains, lengths, node_of = draft.chains, draft.lengths, draft.node_of
    k = chains.shape[2]
    if target.probs is None:
        return _token_match(draft, target.tokens, k)
    target_probs = target.probs
    noise = noise or Noise()
    coupled = noise.coupled
    coupled = None if coupled is None or not bool(coupled.any()) else coupled.to(target_probs.device)
    if coupled is not None:
        depth = node_depths(node_of, lengths, target_probs.shape[1])  # [B, N]
        race = noise.race.to(target_probs.device).gather(1, depth.unsqueeze(-1).expand(-1, -1, noise.race.shape[-1]))
        matched = _token_match(draft, coupled_tokens(target_probs, race), k)
        if bool(coupled.all()):
            matched.target_probs = target_probs
            return matched
    if isinstance(rule.epsilon, torch.Tensor) and not bool(rule.epsilon.any()):
        rule = rule.per_row(lambda _: 0.0, names=("epsilon",))  # no over-acceptance: float32 laws are judged in float32
    if node_of is None:
        verdict = verify_chain(chains[:, 0], target_probs, None if draft.probs is None else draft.probs[:, 0],
                               lengths[:, 0], rule, noise)
        verdict = Verdict.of_chain(verdict, k)
    else:
        verdict = verify_tree(draft, target_probs=target_probs, rule=rule, noise=noise)
    if coupled is not None:
        verdict = Verdict(torch.where(coupled.unsqueeze(1), matched.path, verdict.path),
                          torch.where(coupled, matched.accepted_length, verdict.accepted_length),
                          torch.where(coupled, matched.next_token, verdict.next_token))
    verdict.target_probs = target_probs
    return verdict


def _token_match(draft: Candidates, target_tokens: torch.Tensor, k: int) -> Verdict:
    """Keep draft tokens while they equal ``target_tokens`` ``[B, N]`` (the target's token at each node)."""
    if draft.node_of is None:
        return Verdict.of_chain(verify_greedy(draft.chains[:, 0], target_tokens, draft.lengths[:, 0]), k)
    return verify_tree(draft, target_argmax=target_tokens)


def node_depths(node_of: torch.Tensor | None, lengths: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``[B, N]``: each block node's depth (node 0, the last committed token: 0; a chain's token at index
    d: d + 1). ``node_of`` None: a chain block, node n at depth n. Nodes past every chain: 0."""
    batch = lengths.shape[0]
    if node_of is None:
        return torch.arange(num_nodes, device=lengths.device).expand(batch, -1)
    depth = torch.zeros(batch, num_nodes, dtype=torch.long, device=lengths.device)
    steps = torch.arange(1, node_of.shape[2] + 1, device=lengths.device).expand_as(node_of)
    real = steps <= lengths.unsqueeze(-1)
    depth.scatter_(1, torch.where(real, node_of, 0).flatten(1), torch.where(real, steps, 0).flatten(1))
    return depth
