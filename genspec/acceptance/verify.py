"""Verifying a whole draft block: one entry for chains and token trees, greedy and sampled rows.

A draft is ``M`` candidate chains per row (:class:`Candidates`; M = 1 for a single chain). The target
scored it in one pass over a block whose node 0 is the row's last committed token and whose other nodes
are the draft tokens, chains that share a prefix sharing nodes. :func:`verify` returns which
nodes to keep and the token after them, by the rules of :mod:`genspec.acceptance.rules`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from genspec.acceptance.rule import STANDARD, Rule
from genspec.acceptance.rules import (
    _uniforms,
    coupled_tokens,
    sample_with_uniforms,
    verify_chain,
    verify_greedy,
    verify_multidraft,
)
from genspec.randomness import Noise
from genspec.sampling import SamplingConfig, apply_repetition_penalty, per_row, process_logits


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


def verify(draft: Candidates, target_logits: torch.Tensor, sampling: SamplingConfig | list[SamplingConfig],
           rule: Rule = STANDARD, noise: Noise | None = None, seen: torch.Tensor | None = None) -> Verdict:
    """Verify a draft block against the target's raw logits ``[B, N, V]`` at its nodes.

    A chain block (``draft.node_of`` None: M = 1, N = k + 1) is verified with the vectorised chain rules,
    a tree by the tree walk. The target's logits are processed per row with
    :func:`genspec.sampling.process_logits` (``seen`` ``[B, N, V]``: the repetition-penalty mask of each
    node); if every row is greedy only the argmax is needed and no law is built. Greedy rows in a
    sampled batch get the one-hot law of their argmax, under which the standard rule is token match.
    ``rule`` is the acceptance rule of the sampled rows (:func:`genspec.acceptance.verify_chain`); greedy
    rows always match tokens, so lossy rules are for sampled rows only (``GenerationConfig`` refuses them
    at temperature 0). ``noise.coupled`` ``[B]`` (bool) marks the rows verified by the coupled rule
    instead, with ``noise.race`` ``[B, k + 1, V]`` their noise at each depth (the target's token at a node
    of depth d is :func:`~genspec.acceptance.coupled_tokens` of its law and ``race[:, d]``; then token match).
    """
    chains, lengths, node_of = draft.chains, draft.lengths, draft.node_of
    batch, num_chains, k = chains.shape
    rows = per_row(sampling, batch)
    if all(c.greedy for c in rows):
        scores = target_logits
        if seen is not None:
            scores = apply_repetition_penalty(scores, seen, [c.repetition_penalty for c in rows])
        return _token_match(draft, scores.argmax(-1), k)
    target_probs = process_logits(target_logits, rows, seen)
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
        rule = replace(rule, epsilon=0.0)  # no over-acceptance: float32 laws are judged in float32
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
