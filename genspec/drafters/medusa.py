"""``medusa``: Medusa-1 heads (``genspec train medusa``), the baseline of the trained drafters.

From the target's feature of the last committed token but one (the feature that chose the last token)
head j drafts the token j + 1 positions after the last one, all heads at once and none seeing what the
others drafted. A chain takes each head's top token (or a sample of its law, processed as the target's
is, when the request samples; the law goes to the verifier, so the standard rule stays exact); a tree
takes the ``tree_top_k`` best tokens of each head, expanding the best nodes of each depth by cumulative
draft probability, and verifies the ``tree_nodes`` best (Medusa's tree, chosen per step rather than
fixed).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from genspec.drafters.base import Draft, Drafter, DrafterCapabilities, DraftRequest, RequestContext
from genspec.drafters.trained import (FEATURE_HEAD_COST_PRIOR, TRAINED_PATH, TREE_NODES, TREE_TOP_K, TreeNode, best_paths,
                                      chains_draft, draw, load_for_target, tree_block)
from genspec.speculators.medusa import MedusaHeads


class MedusaDrafter(Drafter):
    """Options: ``path`` (the heads' directory; default: the ones shipped for the embedded model),
    ``tree_nodes`` (0: a chain) and ``tree_top_k``."""

    name = "medusa"
    # the heads read the newest state only: of the prompt, its last
    capabilities = DrafterCapabilities(reads_target_hidden=True, prompt_states=1, draft_cost_prior=FEATURE_HEAD_COST_PRIOR)
    options = (TRAINED_PATH, TREE_NODES, TREE_TOP_K)

    def __init__(self, target, heads: MedusaHeads, vocab_ids: list[int], tree_nodes: int = 0, tree_top_k: int = 4):
        self.check_options({"tree_nodes": tree_nodes, "tree_top_k": tree_top_k})
        self.tree_nodes, self.tree_top_k = int(tree_nodes), int(tree_top_k)
        # a chain is drawn from the draft law; a tree is deterministic
        self.capabilities = replace(self.capabilities, max_candidates=max(1, self.tree_nodes),
                                    samples_drafts=not self.tree_nodes)
        self.dtype = target.dtype
        self.heads = heads.to(target.device, self.dtype).eval()
        self.vocab = torch.as_tensor(vocab_ids, dtype=torch.long, device=target.device)
        self.logits_of = target.subset_head(self.vocab)
        self.vocab_size = target.vocab_size
        self._rows: dict[int, tuple[RequestContext, int, torch.Tensor | None]] = {}  # context, features seen, last

    @classmethod
    def for_target(cls, target, path: str | None = None, tree_nodes: int = 0, tree_top_k: int = 4) -> "MedusaDrafter":
        heads, vocab_ids = load_for_target(target, path, "medusa")
        return cls(target, heads, vocab_ids, tree_nodes=tree_nodes, tree_top_k=tree_top_k)

    def block_tokens(self, depth: int) -> int:
        return tree_block(self.tree_nodes, self.tree_top_k, depth)

    def start(self, contexts: list[RequestContext]) -> None:
        for context in contexts:
            known = len(context.prompt) - 1  # the prompt's states end at its last token but one
            hidden = context.hidden
            self._rows[context.request_id] = ((context, known, hidden[-1].to(self.dtype)) if hidden is not None and len(hidden)
                                              else (context, 0, None))

    def finish(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    def _see(self, request_id: int, hidden: torch.Tensor | None, known: int) -> None:
        """Keep only the newest of the target's features (the heads read no other); at most ``known``
        (the committed tokens but the last) are counted seen: the same states may come twice (:class:`DraftRequest`)."""
        if hidden is not None and len(hidden):
            context, seen, _ = self._rows[request_id]
            self._rows[request_id] = (context, min(seen + len(hidden), known), hidden[-1].to(self.dtype))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> Draft:
        for request in requests:
            if request.request_id not in self._rows:  # proposed for without start: no features yet
                self.start([RequestContext(request.request_id, list(request.sequence))])
            self._see(request.request_id, request.hidden, len(request.sequence) - 1)
        active = [i for i, r in enumerate(requests)
                  if r.max_tokens > 0 and self._rows[r.request_id][1] == len(r.sequence) - 1 >= 1]
        width = self.capabilities.max_candidates
        if not active:
            return Draft.from_chains([[] for _ in requests], num_chains=width)
        rows = [self._rows[requests[i].request_id] for i in active]
        logits = self.logits_of(self.heads(torch.stack([row[2] for row in rows])))  # [R, K, S]
        need = [min(requests[i].max_tokens, self.heads.config.num_heads) for i in active]
        if self.tree_nodes:
            trees: list[list[list[int]]] = [[] for _ in requests]
            for i, paths in zip(active, self._trees(logits, need)):
                trees[i] = paths
            return Draft.from_chains(trees, num_chains=width)
        contexts = [row[0] for row in rows]
        sequences = [list(requests[i].sequence) for i in active]
        keep_laws = not all(c.sampling.greedy for c in contexts)
        chains: list[list[int]] = [[] for _ in active]
        laws: list[list[torch.Tensor]] = [[] for _ in active]
        for depth in range(max(need)):
            drawing = [depth < n for n in need]
            law, tokens = draw(logits[:, depth], self.vocab, self.vocab_size, contexts,
                               [s + c for s, c in zip(sequences, chains)], drawing)
            for r, drawn in enumerate(drawing):
                if drawn:
                    chains[r].append(int(tokens[r]))
                    if keep_laws:
                        laws[r].append(law[r])
        all_chains: list[list[int]] = [[] for _ in requests]
        all_laws: list[list[torch.Tensor]] = [[] for _ in requests]
        for j, i in enumerate(active):
            all_chains[i], all_laws[i] = chains[j], laws[j]
        return chains_draft(all_chains, all_laws, self.vocab_size)

    def _trees(self, logits: torch.Tensor, need: list[int]) -> list[list[list[int]]]:
        """Per row, the best paths of the tree whose depth-d nodes are the ``tree_top_k`` best tokens of
        head d under each of the ``tree_top_k`` best nodes of depth d - 1."""
        top = logits.float().log_softmax(-1).topk(min(self.tree_top_k, len(self.vocab)))
        values, indices = top.values.tolist(), top.indices.tolist()  # [R][K][top_k]
        out = []
        for r, depth_limit in enumerate(need):
            nodes: list[TreeNode] = []
            parents = [(-1, 0.0)]
            for depth in range(depth_limit):
                start = len(nodes)
                for parent, score in parents:
                    nodes += [TreeNode(int(self.vocab[i]), parent, depth + 1, score + v)
                              for v, i in zip(values[r][depth], indices[r][depth])]
                best = sorted(range(start, len(nodes)), key=lambda i: -nodes[i].score)[:self.tree_top_k]
                parents = [(i, nodes[i].score) for i in best]
            out.append(best_paths(nodes, self.tree_nodes))
        return out
