"""``head``: a trained draft head (EAGLE / Hydra style) drafts from the target's own features.

The engine hands the drafter the target's features (the LM head's inputs) of every committed token:
those of the prompt when a request starts, those of the tokens kept since at every proposal
(:attr:`DrafterCapabilities.reads_target_hidden`). The head (:class:`genspec.speculators.head.DraftHead`) keeps a
KV cache per request (per layer) over the pairs (target feature at i, token i + 1), fed with the target's
exact features once tokens are committed (its own guesses are never kept: EAGLE's rule), and drafts a
chain by feeding its predicted feature back with each drafted token. Logits come from the target's own
output layer cut to the head's vocabulary (an EAGLE-3 head, :class:`genspec.speculators.head.Eagle3Head`,
feeds back its own state and has its own output layer:
:meth:`~genspec.speculators.head.HeadNetwork.draft_logits`); a sampled request draws from that law after the same
temperature / top-k / top-p processing as the target (one ``process_logits``), and the law goes to the
verifier, so the standard rule stays exact.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace

import torch

from genspec.drafters.base import (MAX_CANDIDATES, Draft, Drafter, DrafterCapabilities, DraftRequest, Option,
                                   RequestContext)
from genspec.drafters.trained import (FEATURE_HEAD_COST_PRIOR, TRAINED_PATH, TREE_NODES, TREE_TOP_K, TreeNode, ancestors,
                                      best_paths, chains_draft, draw, load_for_target, require_hidden_states,
                                      tree_block)
from genspec.drafters.layer_states import LayerStates
from genspec.errors import ConfigError
from genspec.models.hf import transpose_linears
from genspec.speculators.head import HeadNetwork


class _Row:
    """One request: its context, the target's features by position from ``first`` on (the prompt's last ones when
    the drafter reads only those: ``prompt_states``), the states of its tokens (a head with ``token_layers``), the
    head's cache of committed pairs from position ``first`` on."""

    def __init__(self, context: RequestContext, hidden_size: int, feature_width: int, empty: torch.Tensor):
        self.context = context
        self.features = (context.hidden if context.hidden is not None
                         else torch.zeros(0, feature_width, dtype=empty.dtype, device=empty.device))
        # the prompt's states handed over are its last ones; without any, the features start at the beginning
        self.first = max(len(context.prompt) - 1 - len(self.features), 0) if context.hidden is not None else 0
        self.states = torch.zeros(0, hidden_size, dtype=empty.dtype, device=empty.device)
        self.keys, self.values = empty, empty  # [layers, kv_heads, cached pairs, head_dim]
        self.root: torch.Tensor | None = None  # the head's feature after the last committed pair: drafts start there
        self.root_length = -1  # the committed length ``root`` was read at

    @property
    def cached(self) -> int:
        return int(self.keys.shape[2])

    @property
    def known(self) -> int:
        """The position after the last feature held: every committed token's but the last when it is the
        sequence's length - 1."""
        return self.first + len(self.features)


#: the head drafts a tree of this many nodes unless told otherwise (``tree_nodes=0``: a chain). Where a
#: verify block of 5 tokens costs what one of 2 does (oneDNN's packed GEMM, genspec/kernels.py), a
#: 4-node tree beats the cost policy's chain, for the head and the suffix hybrid, greedy and sampled; 6 nodes
#: and ``tree_top_k=2`` are slower (the manual's Trained heads and Hybrid pages have the measurements).
DEFAULT_TREE_NODES = 4
#: the tree keeps this many of the most likely first tokens whatever deeper nodes score (a wide first
#: level, as Sequoia's trees have). Off by default: it hardly lifts the shipped head's first token, whose
#: misses are mostly tokens outside its top 4 (the manual's Trained heads page)
DEFAULT_TREE_FIRST = 0
#: the head drafts nothing at a step where its likeliest first token is less likely than this (by its own
#: probability, before any sampling processing: a choice made before anything is drawn, so the standard rule
#: stays exact for sampled chains; trees are point masses). The head is calibrated: where that probability is
#: below 0.1 its token is seldom the target's, so those drafts hardly ever pay, and skipping them costs next to
#: nothing in speed while the first level is kept more often (the manual's Trained heads page).
DEFAULT_FIRST_THRESHOLD = 0.1
#: the tokens each tree node is expanded into by default
DEFAULT_TREE_TOP_K = 4
#: the head reads the target's features of the prompt's last this many tokens (None: all of them), so its
#: attention over the prompt starts there. A target on llama.cpp runs its output layer for every feature it
#: gives, which for a long prompt costs more than the prefill itself; the shipped head, a single layer, drafts
#: about as well from the last few features as from all of them (the manual's Trained heads page).
DEFAULT_PROMPT_STATES: int | None = 4
#: the most prompt states the option takes
MAX_PROMPT_STATES = 1 << 20


class HeadDrafter(Drafter):
    """Drafts with a trained head (``genspec train head``). Options: ``path``, the head's directory;
    ``tree_nodes`` (default :data:`DEFAULT_TREE_NODES`; 0: a chain), the node budget of a dynamic draft
    tree (EAGLE-2): at each depth the
    ``tree_top_k`` most likely nodes so far (by cumulative draft probability) are expanded into their
    ``tree_top_k`` most likely tokens, and the ``tree_nodes`` most likely nodes are verified, each
    root-to-leaf path a candidate; ``tree_first`` (default 0) of them are the most likely first tokens
    whatever deeper nodes score; ``first_threshold``: no draft at a step where the head's likeliest first
    token is less likely than that (by name, :data:`DEFAULT_FIRST_THRESHOLD` for the shipped head; for a head
    given by ``path``, or built directly, 0: a head of unknown calibration drafts at every step). Tree candidates are deterministic (lossless under sampling too, as
    lookup trees are); chains are sampled from the draft law when the request samples.

    A head trained with ``token_layers`` = L reads the target's first L layers over each committed token
    (:class:`genspec.drafters.layer_states.LayerStates`, run here before drafting: part of the draft cost);
    one trained with ``feature_layers`` reads those target layers' outputs with the final features (they
    come with the verify pass: :attr:`DrafterCapabilities.target_hidden_layers`)."""

    name = "head"
    capabilities = DrafterCapabilities(reads_target_hidden=True, draft_cost_prior=FEATURE_HEAD_COST_PRIOR)
    options = (TRAINED_PATH, TREE_NODES, TREE_TOP_K, Option("tree_first", int, 0, MAX_CANDIDATES),
               Option("first_threshold", (float, None), 0.0, 1.0, high_open=True),
               Option("prompt_states", (int, None), 1, MAX_PROMPT_STATES))

    def __init__(self, target, head: HeadNetwork, vocab_ids: list[int], tree_nodes: int = DEFAULT_TREE_NODES,
                 tree_top_k: int = DEFAULT_TREE_TOP_K, tree_first: int = DEFAULT_TREE_FIRST, first_threshold: float = 0.0,
                 prompt_states: int | None = DEFAULT_PROMPT_STATES, fast_kernels: bool = True):
        self.check_options({"tree_nodes": tree_nodes, "tree_top_k": tree_top_k, "tree_first": tree_first,
                            "first_threshold": first_threshold, "prompt_states": prompt_states})
        self.tree_nodes, self.tree_top_k, self.tree_first = int(tree_nodes), int(tree_top_k), int(tree_first)
        self.first_threshold = float(first_threshold)
        require_hidden_states(target, self.name, layer_states=bool(head.config.token_layers or head.config.feature_layers))
        self.device, self.dtype = target.device, target.dtype
        # a copy (the caller's module is left as it was) whose linears run as TransposedLinear, as the
        # target's do (``fast_kernels``): a cheaper draft step than ``nn.Linear``'s, with the same drafts
        # (the manual's Trained heads page)
        self.head = copy.deepcopy(head).to(self.device, self.dtype).eval()
        if fast_kernels:
            transpose_linears(self.head)
        self.embed = target.token_embeddings
        if head.config.vocab_size and len(vocab_ids) != head.config.vocab_size:
            raise ConfigError(f"the head's output layer has {head.config.vocab_size} rows, its vocabulary "
                              f"{len(vocab_ids)} tokens")
        self.vocab = torch.as_tensor(vocab_ids, dtype=torch.long, device=self.device)
        # the target's rows of the head's vocabulary: what a head predicting the target's features drafts from
        # (an EAGLE-3 head has its own output layer: HeadNetwork.draft_logits)
        self.target_logits = target.subset_head(self.vocab)
        self.vocab_size = target.vocab_size
        config = head.config
        self._empty = torch.zeros(config.num_layers, config.num_kv_heads, 0, config.head_dim, dtype=self.dtype,
                                  device=self.device)
        # a chain is drawn from the draft law; a tree is deterministic
        self.capabilities = replace(self.capabilities, max_candidates=max(1, self.tree_nodes),
                                    samples_drafts=not self.tree_nodes, target_hidden_layers=config.feature_layers,
                                    prompt_states=prompt_states)
        self._rows: dict[int, _Row] = {}
        self.layer_states = LayerStates(target, config.token_layers) if config.token_layers else None

    @classmethod
    def check_options(cls, options: Mapping[str, object], owner: str | None = None) -> None:
        super().check_options(options, owner)
        nodes, top_k = options.get("tree_nodes", DEFAULT_TREE_NODES), options.get("tree_top_k", DEFAULT_TREE_TOP_K)
        first = options.get("tree_first", DEFAULT_TREE_FIRST)
        if first > min(top_k, max(nodes, 1)):
            raise ConfigError(f"tree_first must be an integer from 0 to min(tree_top_k, tree_nodes), got {first}")

    @classmethod
    def for_target(cls, target, path: str | None = None, tree_nodes: int = DEFAULT_TREE_NODES,
                   tree_top_k: int = DEFAULT_TREE_TOP_K, tree_first: int = DEFAULT_TREE_FIRST,
                   first_threshold: float | None = None, prompt_states: int | None = DEFAULT_PROMPT_STATES) -> "HeadDrafter":
        """``first_threshold`` unset: :data:`DEFAULT_FIRST_THRESHOLD` for the shipped head, whose calibration
        it was chosen on; 0 for a head given by ``path`` (a few training steps leave a head unsure everywhere)."""
        if first_threshold is None:
            first_threshold = DEFAULT_FIRST_THRESHOLD if path is None else 0.0
        head, vocab_ids = load_for_target(target, path, "head")
        return cls(target, head, vocab_ids, tree_nodes=tree_nodes, tree_top_k=tree_top_k, tree_first=tree_first,
                   first_threshold=first_threshold, prompt_states=prompt_states)

    def block_tokens(self, depth: int) -> int:
        return tree_block(self.tree_nodes, self.tree_top_k, depth)

    # --------------------------------------------------------------- life cycle
    def start(self, contexts: list[RequestContext]) -> None:
        for context in contexts:
            self._rows[context.request_id] = _Row(context, self.head.config.hidden_size, self.head.config.feature_width,
                                                  self._empty)

    def finish(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)
        if self.layer_states is not None:
            self.layer_states.finish(request_ids)

    def catch_up_tokens(self, request_id: int, sequence: list[int]) -> int:
        """The tokens the target's first layers must still read (a head with ``token_layers``), else 0."""
        return 0 if self.layer_states is None else self.layer_states.unread(request_id, sequence)

    # --------------------------------------------------------------- the head, per row over its cache
    def _run(self, rows: list[_Row], x: torch.Tensor, positions: torch.Tensor,
             counts: list[int], extra: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None):
        """The head on a block of pairs per row (their first-layer inputs ``x`` ``[R, n, H]``, from
        :meth:`_drafted`, or ``HeadNetwork.committed_inputs`` for committed pairs;
        ``positions`` ``[R, n]``; the first ``counts[r]`` real),
        attending over each row's cache and, with
        ``extra``, per row ``(keys, values, mask)``: drafted pairs after the cache (``[L, kv_heads, E, d]``)
        and which of them each block pair sees (``[count, E]``; then a block pair sees itself only: tree
        nodes of one depth); without, a block pair sees the earlier ones (a chain). Returns the predicted
        features ``[R, n, H]`` and the block's keys and values ``[L, R, kv_heads, n, d]``."""
        masks = []
        for r, row in enumerate(rows):
            count = counts[r]
            own = torch.ones(count, count, dtype=torch.bool).tril() if extra is None else torch.eye(count, dtype=torch.bool)
            masks.append(torch.cat([torch.ones(count, row.cached, dtype=torch.bool)]
                                   + ([extra[r][2]] if extra is not None else []) + [own], dim=1))

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            attended = torch.zeros_like(q)
            for r, row in enumerate(rows):
                count = counts[r]
                if not count:
                    continue
                keys, values = [row.keys[layer]], [row.values[layer]]
                if extra is not None:
                    keys.append(extra[r][0][layer])
                    values.append(extra[r][1][layer])
                keys, values = torch.cat(keys + [k[r, :, :count]], dim=1), torch.cat(values + [v[r, :, :count]], dim=1)
                attended[r:r + 1, :, :count] = self.head.attend(q[r:r + 1, :, :count], keys.unsqueeze(0),
                                                                values.unsqueeze(0), masks[r].view(1, 1, count, -1))
            return attended

        return self.head.run(x, positions, attention)

    def _logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """The draft logits over the head's vocabulary of predicted states ``[..., H]``."""
        return self.head.draft_logits(predicted, self.target_logits)

    def _drafted(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """First-layer inputs of drafted pairs (predicted features ``[R, n, H]``, drafted ``tokens`` ``[R, n]``)."""
        return self.head.inputs(features, self.embed(tokens).to(self.dtype))

    def _sync(self, rows: list[_Row], sequences: list[list[int]]) -> torch.Tensor:
        """Feed each row's committed pairs not in its cache yet (always at least its last one, whose
        output is the first draft's feature); returns that predicted feature per row ``[R, H]``."""
        starts = [row.first + min(row.cached, len(seq) - 2 - row.first) for row, seq in zip(rows, sequences)]
        counts = [len(seq) - 1 - s for seq, s in zip(sequences, starts)]
        n = max(counts)
        hidden = self.head.config.hidden_size
        features = torch.zeros(len(rows), n, self.head.config.feature_width, dtype=self.dtype, device=self.device)
        tokens = torch.zeros(len(rows), n, dtype=torch.long, device=self.device)
        states = (torch.zeros(len(rows), n, hidden, dtype=self.dtype, device=self.device)
                  if self.layer_states is not None else None)
        for r, (row, seq, start, count) in enumerate(zip(rows, sequences, starts, counts)):
            row.keys, row.values = row.keys[:, :, :start - row.first], row.values[:, :, :start - row.first]
            features[r, :count] = row.features[start - row.first:start - row.first + count]
            tokens[r, :count] = torch.tensor(seq[start + 1:start + 1 + count], dtype=torch.long)
            if states is not None:
                states[r, :count] = row.states[start + 1:start + 1 + count]
        positions = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(n)
        x = self.head.committed_inputs(features, self.embed(tokens).to(self.dtype), states)
        out, k, v = self._run(rows, x, positions, counts)
        for r, (row, count) in enumerate(zip(rows, counts)):
            row.keys = torch.cat([row.keys, k[:, r, :, :count]], dim=2)
            row.values = torch.cat([row.values, v[:, r, :, :count]], dim=2)
        return out[torch.arange(len(rows)), torch.tensor(counts) - 1]

    # --------------------------------------------------------------- interface
    @torch.inference_mode()
    def read(self, requests: list[DraftRequest]) -> None:
        """Take in the target's new features, run the token layers (if any) over the tokens committed since
        and feed the head the new committed pairs, for each row that will draft; its first feature waits in
        ``_Row.root``."""
        for request in requests:
            if request.request_id not in self._rows:  # proposed for without start: no features yet
                self.start([RequestContext(request.request_id, list(request.sequence))])
            row = self._rows[request.request_id]
            if request.hidden is not None and len(request.hidden) and row.known < len(request.sequence) - 1:
                # cut to the committed tokens but the last; taken once: propose reads again after the engine's
                # read, and a request proposed for again after its batch's proposal failed (the engine retries
                # each alone) hands the same states twice
                row.features = torch.cat([row.features, request.hidden.to(self.dtype)])[:len(request.sequence) - 1 - row.first]
        if self.layer_states is not None:
            reading = [r for r in requests if r.max_tokens > 0]
            for request, states in zip(reading, self.layer_states.read([r.request_id for r in reading],
                                                                        [r.sequence for r in reading])):
                row = self._rows[request.request_id]
                row.states = torch.cat([row.states, states.to(self.dtype)])
        unread = [r for r in requests if self._able(r) and self._rows[r.request_id].root_length != len(r.sequence)]
        if unread:
            rows = [self._rows[r.request_id] for r in unread]
            for row, request, root in zip(rows, unread, self._sync(rows, [list(r.sequence) for r in unread])):
                row.root, row.root_length = root, len(request.sequence)

    def _able(self, request: DraftRequest) -> bool:
        """A row can draft once the target's feature of every committed token but the last is known."""
        return (request.max_tokens > 0 and len(request.sequence) >= 2
                and self._rows[request.request_id].known == len(request.sequence) - 1)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> Draft:
        self.read(requests)
        active = [i for i, r in enumerate(requests) if self._able(r)]
        # the first draft tokens' logits, once: for the threshold and for drafting
        first = self._logits(torch.stack([self._rows[requests[i].request_id].root for i in active])) if active else None
        if self.first_threshold > 0 and active:
            sure = first.float().softmax(-1).amax(-1) >= self.first_threshold
            active, first = [i for i, ok in zip(active, sure.tolist()) if ok], first[sure]
        if self.tree_nodes:
            trees: list[list[list[int]]] = [[] for _ in requests]
            if active:
                for i, paths in zip(active, self._draft_tree([requests[i] for i in active], first)):
                    trees[i] = paths
            return Draft.from_chains(trees, num_chains=self.capabilities.max_candidates)
        chains: list[list[int]] = [[] for _ in requests]
        laws: list[list[torch.Tensor]] = [[] for _ in requests]
        if active:
            self._draft([requests[i] for i in active], first, [chains[i] for i in active], [laws[i] for i in active])
        return chains_draft(chains, laws, self.vocab_size)

    def _draft(self, requests: list[DraftRequest], first: torch.Tensor, chains: list[list[int]],
               laws: list[list[torch.Tensor]]) -> None:
        """Fill ``chains`` (and, for a sampled batch, ``laws``) for rows that can draft (``first``: their first
        draft tokens' logits)."""
        rows = [self._rows[r.request_id] for r in requests]
        contexts = [row.context for row in rows]
        keep_laws = not all(c.sampling.greedy for c in contexts)
        sequences = [list(r.sequence) for r in requests]
        predicted = torch.stack([row.root for row in rows])  # [R, H]
        need = [r.max_tokens for r in requests]
        drafted_k, drafted_v = [self._empty] * len(rows), [self._empty] * len(rows)
        for depth in range(max(need)):
            drawing = [depth < n for n in need]
            law, tokens = draw(first if depth == 0 else self._logits(predicted), self.vocab, self.vocab_size, contexts,
                               [s + c for s, c in zip(sequences, chains)], drawing)
            for r in range(len(rows)):
                if drawing[r]:
                    chains[r].append(int(tokens[r]))
                    if keep_laws:
                        laws[r].append(law[r])
            if depth + 1 >= max(need):
                break
            # the pair (predicted feature, drafted token), seeing the chain's earlier pairs
            positions = torch.tensor([[len(seq) - 1 + depth] for seq in sequences], dtype=torch.long)
            counts = [1 if depth + 1 < n else 0 for n in need]  # a row wanting fewer tokens stops drafting
            extra = [(dk, dv, torch.ones(c, dk.shape[2], dtype=torch.bool)) for dk, dv, c in zip(drafted_k, drafted_v, counts)]
            out, k, v = self._run(rows, self._drafted(predicted.unsqueeze(1), tokens.unsqueeze(1)), positions, counts, extra)
            drafted_k = [torch.cat([dk, k[:, r, :, :1]], dim=2) for r, dk in enumerate(drafted_k)]
            drafted_v = [torch.cat([dv, v[:, r, :, :1]], dim=2) for r, dv in enumerate(drafted_v)]
            predicted = out[:, 0]

    def promising(self, nodes: list[TreeNode], index: int) -> bool:
        """Whether node ``index`` may still have a descendant among the ``tree_nodes`` kept: fewer than
        that many nodes rank above it (:func:`best_paths` keeps the best-ranked nodes, by score, then
        depth; a descendant ranks below its ancestors and nodes only get added). Expanding only such
        nodes leaves the tree as it was and stops the depth loop early: unpruned, a small tree's drafting is a
        noticeable share of its verify block's time (the manual's Trained heads page)."""
        node = nodes[index]
        above = sum((other.score, -other.depth) > (node.score, -node.depth) for other in nodes)
        return above < self.tree_nodes

    def _draft_tree(self, requests: list[DraftRequest], first: torch.Tensor) -> list[list[list[int]]]:
        """Per row, the root-to-leaf paths of its dynamic draft tree, most likely first (``first``: the first
        draft tokens' logits)."""
        rows = [self._rows[r.request_id] for r in requests]
        sequences = [list(r.sequence) for r in requests]
        need = [r.max_tokens for r in requests]
        top_k, hidden = self.tree_top_k, self.head.config.hidden_size
        root = torch.stack([row.root for row in rows])  # [R, H]: the feature the first draft tokens come from
        nodes: list[list[TreeNode]] = [[] for _ in rows]
        expanded: list[list[int]] = [[] for _ in rows]  # nodes whose pairs ran, in order

        def best(logits: torch.Tensor):
            """The ``tree_top_k`` most likely tokens of each row of ``logits`` ``[..., S]`` (the head's
            vocabulary): (log-probs, vocabulary indices) as nested lists, for all nodes of a depth at once."""
            scores = logits.float().log_softmax(-1).topk(min(top_k, len(self.vocab)))
            return scores.values.tolist(), scores.indices.tolist()

        def grow(r: int, parent: int, values: list[float], indices: list[int], base: float, depth: int) -> list[int]:
            start = len(nodes[r])
            nodes[r] += [TreeNode(int(self.vocab[i]), parent, depth, base + v) for v, i in zip(values, indices)]
            return list(range(start, len(nodes[r])))

        values, indices = best(first)
        frontier = [grow(r, -1, values[r], indices[r], 0.0, 1) if need[r] >= 1 else [] for r in range(len(rows))]
        for depth in range(2, max(need) + 1):
            chosen = [[i for i in sorted(f, key=lambda i, r=r: -nodes[r][i].score)[:top_k] if self.promising(nodes[r], i)]
                      if need[r] >= depth else [] for r, f in enumerate(frontier)]
            width = max(len(c) for c in chosen)
            if not width:
                break
            features = torch.zeros(len(rows), width, hidden, dtype=self.dtype)
            tokens = torch.zeros(len(rows), width, dtype=torch.long)
            positions = torch.zeros(len(rows), width, dtype=torch.long)
            extra = []
            for r, picked in enumerate(chosen):
                for j, i in enumerate(picked):
                    node = nodes[r][i]
                    features[r, j] = root[r] if node.parent < 0 else nodes[r][node.parent].state[0]
                    tokens[r, j], positions[r, j] = node.token, len(sequences[r]) - 2 + node.depth
                ran = expanded[r]
                lines = [ancestors(nodes[r], i) for i in picked]
                mask = torch.tensor([[a in line for a in ran] for line in lines], dtype=torch.bool)
                mask = mask.reshape(len(picked), len(ran))
                extra.append((torch.cat([nodes[r][a].state[1] for a in ran], dim=2) if ran else self._empty,
                              torch.cat([nodes[r][a].state[2] for a in ran], dim=2) if ran else self._empty, mask))
            out, k, v = self._run(rows, self._drafted(features, tokens), positions, [len(c) for c in chosen], extra)
            values, indices = best(self._logits(out))
            for r, picked in enumerate(chosen):
                frontier[r] = []
                for j, i in enumerate(picked):
                    node = nodes[r][i]
                    node.state = (out[r, j], k[:, r, :, j:j + 1], v[:, r, :, j:j + 1])  # predicted feature, keys, values
                    expanded[r].append(i)
                    frontier[r] += grow(r, i, values[r][j], indices[r][j], node.score, depth)
        return [best_paths(row_nodes, self.tree_nodes, self.tree_first) for row_nodes in nodes]
