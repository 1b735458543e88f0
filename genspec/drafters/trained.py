"""What the drafters on the target's own features (``head``, ``medusa``) share: drawing a draft token
from a law over a truncated vocabulary, and draft trees chosen by cumulative draft probability."""
from __future__ import annotations

from pathlib import Path

import torch

from genspec.drafters.base import MAX_CANDIDATES, MAX_TREE_NODES, PATH, Draft, Option, RequestContext, draw_tokens
from genspec.errors import ConfigError
from genspec.sampling import TokenHistory, process_logits
from genspec.speculators.store import load_head, target_fingerprint


#: the assumed time per draft position of a head on the target's features (head, medusa, hybrid) until the
#: engine measures it (:attr:`genspec.drafters.base.DrafterCapabilities.draft_cost_prior`): one small layer or a few
#: residual blocks and a truncated head cost a few hundredths of a plain step; 0.1 errs on the dear side
FEATURE_HEAD_COST_PRIOR = 0.1
#: the options of a drafter on the target's features: its directory (default: the one shipped for the embedded
#: model), its tree's node budget (0: a chain) and the tokens each node is expanded into
TRAINED_PATH = Option("path", (*PATH, None))
TREE_NODES = Option("tree_nodes", int, 0, MAX_TREE_NODES)
TREE_TOP_K = Option("tree_top_k", int, 1, MAX_CANDIDATES)


def draw(subset_logits: torch.Tensor, vocab: torch.Tensor, vocab_size: int, contexts: list[RequestContext],
         previous: list[list[int]], drawing: list[bool]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One draft token per row from logits ``[R, S]`` over the vocabulary ``vocab`` (token ids): the
    argmax for a greedy batch without penalties (no law needed); otherwise the full-vocabulary law after
    the request's own processing (one ``process_logits``, as the target's), drawn with :func:`draw_tokens`
    and returned so the verifier can apply its rule. ``previous``: each row's tokens
    so far (for the repetition penalty); ``drawing``: which rows draw (their random streams advance)."""
    sampling = [c.sampling for c in contexts]
    if all(s.greedy and not s.reads_history and not s.logit_bias for s in sampling):
        return None, vocab[subset_logits.argmax(-1)]
    logits = subset_logits.new_full((len(contexts), vocab_size), -torch.inf)
    logits[:, vocab] = subset_logits
    law = process_logits(logits, sampling, TokenHistory.of(previous, [len(c.prompt) for c in contexts], sampling,
                                                           vocab_size))
    positions = [len(seq) - len(c.prompt) for seq, c in zip(previous, contexts)]
    return law, draw_tokens(law, contexts, positions, drawing)


def chains_draft(chains: list[list[int]], laws: list[list[torch.Tensor]], vocab_size: int) -> Draft:
    """One chain per row, with its draft laws when it was sampled (``laws[r]`` empty: deterministic)."""
    tokens = Draft.from_chains([[c] for c in chains])
    if not any(laws):
        return tokens
    dtype = next(law for row in laws for law in row).dtype
    probs = torch.zeros(len(chains), 1, tokens.width, vocab_size, dtype=dtype)
    for r, row_laws in enumerate(laws):
        if row_laws:
            probs[r, 0, :len(row_laws)] = torch.stack(row_laws)
    return Draft(tokens.tokens, tokens.lengths, probs)


class TreeNode:
    """A node of a draft tree: its token, parent (-1: a child of the last committed token), depth,
    cumulative draft log-probability, and what the drafter keeps to expand it (``state``)."""

    __slots__ = ("token", "parent", "depth", "score", "state")

    def __init__(self, token: int, parent: int, depth: int, score: float):
        self.token, self.parent, self.depth, self.score = token, parent, depth, score
        self.state = None


def tree_block(budget: int, top_k: int, depth: int) -> int:
    """The nodes of a ``budget``-node tree ``depth`` deep whose first level holds ``top_k`` tokens and
    each deeper level ``top_k`` children of each of ``top_k`` nodes (the heads' trees), or a chain's
    ``depth`` tokens when ``budget`` is 0: what the draft adds to the verify block
    (:meth:`Drafter.block_tokens`)."""
    if not budget or depth <= 0:
        return max(depth, 0)
    return min(budget, top_k + (depth - 1) * top_k * top_k)


def ancestors(nodes: list[TreeNode], index: int) -> set[int]:
    out, parent = set(), nodes[index].parent
    while parent >= 0:
        out.add(parent)
        parent = nodes[parent].parent
    return out


def best_paths(nodes: list[TreeNode], budget: int, first: int = 0) -> list[list[int]]:
    """The ``budget`` most likely nodes (each kept with its parent: a tree), as root-to-leaf token
    paths, most likely leaf first; the ``first`` most likely first tokens are kept whatever deeper nodes
    score (a wide first level: see :class:`genspec.drafters.head.HeadDrafter`'s ``tree_first``)."""
    ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth))
    kept = set([i for i in ranked if nodes[i].parent < 0][:min(first, budget)])
    for i in ranked:
        if len(kept) == budget:
            break
        if nodes[i].parent < 0 or nodes[i].parent in kept:
            kept.add(i)
    parents = {nodes[i].parent for i in kept}
    paths = []
    for leaf in (i for i in ranked if i in kept and i not in parents):
        path, at = [], leaf
        while at >= 0:
            path.append(nodes[at].token)
            at = nodes[at].parent
        paths.append(path[::-1])
    return paths


#: speculators shipped with the package for the embedded default model, one directory per kind
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "speculators"


def require_hidden_states(target, drafter: str, layer_states: bool = False) -> None:
    """Refuse a target that gives no hidden states (:attr:`~genspec.models.base.CausalLM.hidden_size`), or, with
    ``layer_states``, none of its layers' (:attr:`~genspec.models.base.CausalLM.gives_layer_states`: the torch
    backend's models), naming ``drafter``: the drafter asked for, which may hold a trained one (the hybrid holds
    a head)."""
    if target.hidden_size is None:
        raise ConfigError(f"drafter {drafter!r} needs a target model that gives its hidden states (a GGUF model on "
                          f"the llamacpp backend, or one on the torch backend): this {target.backend} model gives none")
    if layer_states and not target.gives_layer_states:
        raise ConfigError(f"drafter {drafter!r} reads the states of the target's layers, which only the torch "
                          f"backend's models give (--backend torch); a head trained without token or feature "
                          f"layers drafts for a {target.backend} model")


def load_for_target(target, path: str | None, kind: str, drafter: str | None = None):
    """``(module, vocab_ids)`` of the trained ``kind`` at ``path`` (default: the one shipped for the
    embedded model), checked against ``target`` by its fingerprint; refusals name ``drafter`` (default: ``kind``),
    the drafter asked for (the hybrid holds a head)."""
    drafter = drafter or kind
    require_hidden_states(target, drafter)
    fingerprint = target_fingerprint(target)
    if path is None:
        shipped = SHIPPED / kind
        if not shipped.is_dir() or load_head(shipped, kind)[2] != fingerprint:
            raise ConfigError(f"drafter {drafter!r} needs a trained {kind} for this model: -O path=DIR "
                              f"(genspec train {kind} writes one; the package ships one for the embedded model only)")
        path = str(shipped)
    module, vocab_ids, saved, _ = load_head(path, kind)
    if saved != fingerprint:
        raise ConfigError(f"the {kind} at {path} was trained for another model (fingerprint {saved}, this model's "
                          f"is {fingerprint}); train one for it with genspec train {kind}")
    if module.config.hidden_size != target.hidden_size:
        raise ConfigError(f"the {kind} at {path} expects hidden size {module.config.hidden_size}, the model has "
                          f"{target.hidden_size}")
    return module, vocab_ids
