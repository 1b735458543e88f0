"""The trained draft head (``--drafter head``) on tiny random-weight models: the engine hands drafters
the target's features exactly; the head's cached drafting equals its whole-sequence forward; greedy
output equals plain decoding; sampled output follows the exact target law (chi-square); training lowers
the loss; saved heads load, and wrong ones are refused with one-line errors."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from stats_helpers import lossless_pvalue
from tiny_models import peaked, sampled_continuations, tiny_llama

from genspec.drafters.base import Draft, Drafter, DrafterCapabilities, DraftOffer
from genspec.drafters.head import HeadDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models import HFCausalLM
from genspec.models.hf import TransposedLinear
from genspec.sampling import SamplingConfig
from genspec.speculators.head import DraftHead, HeadConfig
from genspec.speculators.store import load_head, save_head, target_fingerprint
from genspec.train.data import choose_vocabulary, record_features
from genspec.train.loop import train_head
from genspec.train.settings import TrainSettings

SMALL = HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


def _head(seed: int = 0, dtype=torch.float64, layers: int = 1, token_layers: int = 0,
          feature_layers: tuple[int, ...] = ()) -> DraftHead:
    """A random head; with ``token_layers`` its committed pairs read the target's first layers
    (tests/test_token_layers.py tests that reading itself), with ``feature_layers`` a fusion of the target's
    final feature and those layers' outputs (tests/test_feature_layers.py)."""
    torch.manual_seed(seed)
    return DraftHead(replace(SMALL, num_layers=layers, token_layers=token_layers,
                             feature_layers=feature_layers)).to(dtype).eval()


class _Recorder(Drafter):
    """Reads the target's features and proposes the last token repeated (so drafts are partly kept)."""

    name = "recorder"
    capabilities = DrafterCapabilities(reads_target_hidden=True)

    def __init__(self):
        self.features: dict[int, list[torch.Tensor]] = {}
        self.checked = 0

    def start(self, contexts):
        for c in contexts:
            self.features[c.request_id] = [c.hidden]

    def propose(self, requests):
        for r in requests:
            if r.hidden is not None:
                self.features[r.request_id].append(r.hidden)
            known = sum(len(f) for f in self.features[r.request_id])
            assert known == len(r.sequence) - 1  # every committed token's feature but the last one's
            self.checked += 1
        return Draft.from_chains([[[r.sequence[-1]] * r.max_tokens] for r in requests])


def test_the_engine_hands_drafters_the_exact_target_features(tiny_target):
    recorder = _Recorder()
    engine = SpeculativeEngine(tiny_target, recorder)
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9], [3, 4]]
    results = engine.generate_ids(prompts, max_new_tokens=17, num_draft_tokens=3, draft_length="fixed",
                                  eos_token_ids=())
    assert all(r.finish_reason == "length" for r in results)  # (a failing check would fail the request)
    assert recorder.checked > 3 and sum(r.stats.accepted_tokens for r in results) > 0
    reference = HFCausalLM(tiny_llama(0))
    for request_id, (prompt, result) in enumerate(zip(prompts, results)):
        sequence = prompt + result.token_ids
        got = torch.cat(recorder.features[request_id])
        reference.reset(0)
        [expected] = reference.add_rows([sequence[:-1]], return_hidden=True)
        assert torch.allclose(got, expected[:len(got)], atol=1e-9)  # the last step's features came with no proposal


@pytest.mark.parametrize("layers", [1, 2])
def test_cached_drafting_equals_the_whole_sequence_forward(tiny_target, layers):
    """The drafter's per-row cache (committed pairs fed in two chunks, then a drafted pair) gives the
    same predicted features as the head's forward over the whole sequence, for a head of 1 or 2 layers
    (a cache per layer)."""
    head = _head(layers=layers)
    drafter = HeadDrafter(tiny_target, head, list(range(64)), tree_nodes=0)
    # the drafter runs a copy on the target's fast kernels; the caller's head keeps its stock layers
    assert type(head.layers[0].q) is torch.nn.Linear and type(drafter.head.layers[0].q) is TransposedLinear
    sequence = [5, 9, 11, 3, 7, 7, 2, 40, 41, 13]
    tiny_target.reset(0)
    [features] = tiny_target.add_rows([sequence[:-1]], return_hidden=True)
    tiny_target.reset(0)
    embed = tiny_target.model.get_input_embeddings()
    with torch.no_grad():
        whole = head(features.unsqueeze(0), embed(torch.tensor([sequence[1:]])))[0]  # predicts f_1..f_9
    from genspec.drafters.base import RequestContext

    drafter.start([RequestContext(0, sequence[:4], hidden=features[:3])])
    row = drafter._rows[0]
    with torch.no_grad():
        first = drafter._sync([row], [sequence[:4]])  # pairs 0..2
        row.features = features
        second = drafter._sync([row], [sequence])  # pairs 3..8 (the cache is reused)
    assert torch.allclose(first[0], whole[2], atol=1e-9)
    assert torch.allclose(second[0], whole[8], atol=1e-9)
    # drafted pairs (predicted feature, drafted token) after the cache: each sees the committed pairs and
    # the earlier drafted ones in every layer, as the whole-sequence forward over the extended pairs does
    pairs, tokens, predicted = features, list(sequence[1:]), second[0]
    drafted_k = drafted_v = drafter._empty
    with torch.no_grad():
        for depth, token in enumerate([17, 4, 29]):
            pairs, tokens = torch.cat([pairs, predicted.unsqueeze(0)]), tokens + [token]
            seen = torch.ones(1, drafted_k.shape[2], dtype=torch.bool)
            out, k, v = drafter._run([row], drafter._drafted(predicted.view(1, 1, -1), torch.tensor([[token]])),
                                     torch.tensor([[len(sequence) - 1 + depth]]), [1], [(drafted_k, drafted_v, seen)])
            drafted_k, drafted_v = torch.cat([drafted_k, k[:, 0]], dim=2), torch.cat([drafted_v, v[:, 0]], dim=2)
            predicted = out[0, 0]
            assert torch.allclose(predicted, head(pairs.unsqueeze(0), embed(torch.tensor([tokens])))[0, -1], atol=1e-9)
    assert row.cached == 9


@pytest.mark.parametrize("batch, layers, token_layers, fused", [(1, 1, 0, ()), (4, 1, 0, ()), (4, 2, 0, ()), (1, 1, 1, ()),
                                                                 (3, 1, 1, ()), (3, 1, 0, (1,)), (3, 1, 1, (1,))])
def test_greedy_head_drafting_equals_plain_decoding(tiny_target, batch, layers, token_layers, fused):
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4], [11, 12, 13, 14, 15, 16]][:batch]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())
    # a head that copies the target's features would agree everywhere; a random one mostly disagrees:
    # equality must hold either way
    drafter = HeadDrafter(tiny_target, _head(layers=layers, token_layers=token_layers, feature_layers=fused),
                          choose_vocabulary([p.token_ids for p in plain], 40), tree_nodes=0)
    spec = SpeculativeEngine(tiny_target, drafter).generate_ids(prompts, max_new_tokens=24, num_draft_tokens=3,
                                                                eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0


@pytest.mark.parametrize("layers", [1, 2])
def test_a_one_branch_tree_is_the_greedy_chain(tiny_target, layers):
    """With tree_top_k = 1 the dynamic tree is the chain greedy drafting gives (its nodes see their
    ancestors exactly as chain tokens see the earlier ones, in every layer)."""
    from genspec.drafters.base import DraftRequest, RequestContext

    vocab = list(range(3, 60))
    chain = HeadDrafter(tiny_target, _head(layers=layers), vocab, tree_nodes=0)
    tree = HeadDrafter(tiny_target, _head(layers=layers), vocab, tree_nodes=5, tree_top_k=1)
    sequence = [5, 9, 11, 3, 7, 7, 2]
    tiny_target.reset(0)
    [features] = tiny_target.add_rows([sequence[:-1]], return_hidden=True)
    tiny_target.reset(0)
    drafts = []
    for drafter in (chain, tree):
        drafter.start([RequestContext(0, sequence, hidden=features)])
        drafts.append(drafter.propose([DraftRequest(0, sequence, 5)]))
    assert drafts[1].num_chains == 5 and drafts[1].first_chain(0) == drafts[0].first_chain(0)
    assert len(drafts[0].first_chain(0)) == 5


@pytest.mark.parametrize("token_layers", [0, 1])
def test_a_batch_wanting_different_lengths_drafts_each_row_as_alone(tiny_target, token_layers):
    """Rows near their end want fewer draft tokens than the others: the batched chain drafts each row as
    that row's own proposal would (once, a row wanting fewer raised, and after the engine's one-by-one
    retry the head held features twice and never drafted again: half the target calls of 8 held-out
    prompts drafted nothing). A proposal repeated with the same states (that retry) changes nothing, nor
    does reading first (:meth:`HeadDrafter.read`, as the engine does), once or twice."""
    from genspec.drafters.base import DraftRequest, RequestContext

    sequences = [[5, 9, 11, 3, 7, 7, 2], [4, 8, 15, 16], [23, 42, 4, 8, 15]]
    want = [5, 2, 0]
    features = []
    for sequence in sequences:
        tiny_target.reset(0)
        features.append(tiny_target.add_rows([sequence[:-1]], return_hidden=True)[0])
    tiny_target.reset(0)

    def drafter_for(ids):
        drafter = HeadDrafter(tiny_target, _head(token_layers=token_layers), list(range(3, 60)), tree_nodes=0)
        drafter.start([RequestContext(i, sequences[i][:2], hidden=features[i][:1]) for i in ids])
        return drafter

    batched = drafter_for(range(3))
    requests = [DraftRequest(i, sequences[i], want[i], features[i][1:]) for i in range(3)]
    together = [batched.propose(requests).first_chain(i) for i in range(3)]
    alone = []
    for i in range(3):
        drafter = drafter_for([i])
        alone.append(drafter.propose([requests[i]]).first_chain(0))
        assert drafter.propose([requests[i]]).first_chain(0) == alone[-1]  # the same states again
        reader = drafter_for([i])  # the engine reads first (timed apart from drafting); reading twice changes nothing
        reader.read([requests[i]])
        reader.read([requests[i]])
        assert reader.propose([requests[i]]).first_chain(0) == alone[-1]
    assert together == alone and [len(c) for c in together] == want


class _Unpruned(HeadDrafter):
    """The tree drafter expanding every frontier node its ``tree_top_k`` allows (no pruning)."""

    def promising(self, nodes, index):
        return True



def _fails_once(cls):
    """``cls`` whose first proposal for several rows handing states raises after it has taken them."""

    class FailsOnce(cls):
        failed = False

        def propose(self, requests):
            draft = super().propose(requests)
            if len(requests) > 1 and all(r.hidden is not None for r in requests) and not self.failed:
                self.failed = True
                raise RuntimeError("once")
            return draft

    return FailsOnce


@pytest.mark.parametrize("kind", ["head", "medusa"])
def test_a_failed_batch_proposal_leaves_drafting_as_it_was(tiny_target, kind):
    """The engine proposes for each row alone after a batch's proposal raises, handing the same states
    again: the drafters reading them draft on exactly as without the failure (same drafts, same kept)."""
    from genspec.drafters.medusa import MedusaDrafter
    from test_medusa import _heads

    def make(cls):
        if kind == "head":
            return cls(tiny_target, _head(), list(range(3, 60)), tree_nodes=0)
        return cls(tiny_target, _heads(), list(range(3, 60)))

    base = {"head": HeadDrafter, "medusa": MedusaDrafter}[kind]
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4]]
    runs = []
    for drafter in (make(base), make(_fails_once(base))):
        results = SpeculativeEngine(tiny_target, drafter).generate_ids(
            prompts, max_new_tokens=20, num_draft_tokens=3, draft_length="fixed", eos_token_ids=())
        runs.append([(r.token_ids, r.stats.drafted_per_position, r.stats.accepted_per_position) for r in results])
    assert drafter.failed and runs[1] == runs[0]
    assert all(sum(drafted) > 0 for _, drafted, _ in runs[0])


@pytest.mark.parametrize("tree_nodes, top_k", [(2, 2), (4, 3), (8, 4)])
def test_pruned_tree_drafting_gives_the_unpruned_tree_with_fewer_head_runs(tiny_target, tree_nodes, top_k):
    """Expanding only nodes that may still have a descendant among the kept ones leaves every tree as it
    was (for 3 rows, several budgets) and runs the head over fewer pairs."""
    from genspec.drafters.base import DraftRequest, RequestContext

    vocab = list(range(3, 60))
    sequences = [[5, 9, 11, 3, 7, 7, 2], [4, 4, 8, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    trees, pairs = [], []
    for cls in (HeadDrafter, _Unpruned):
        drafter = cls(tiny_target, _head(), vocab, tree_nodes=tree_nodes, tree_top_k=top_k)
        ran = []  # rows through the head's first projection (committed pairs alike in both, then tree nodes)
        drafter.head.layers[0].q.register_forward_hook(lambda module, args, out: ran.append(out.shape[:-1].numel()))
        contexts = []
        for request_id, sequence in enumerate(sequences):
            tiny_target.reset(0)
            [features] = tiny_target.add_rows([sequence[:-1]], return_hidden=True)
            contexts.append(RequestContext(request_id, sequence, hidden=features))
        tiny_target.reset(0)
        drafter.start(contexts)
        draft = drafter.propose([DraftRequest(i, s, 6) for i, s in enumerate(sequences)])
        trees.append((draft.tokens.tolist(), draft.lengths.tolist()))
        pairs.append(sum(ran))
    assert trees[0] == trees[1]
    assert pairs[0] < pairs[1]


@pytest.mark.parametrize("batch, layers, token_layers, fused", [(1, 1, 0, ()), (3, 1, 0, ()), (3, 2, 0, ()), (3, 1, 1, ()),
                                                                 (3, 1, 0, (1,))])
def test_greedy_tree_drafting_equals_plain_decoding(tiny_target, batch, layers, token_layers, fused):
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4]][:batch]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=20, eos_token_ids=())
    drafter = HeadDrafter(tiny_target, _head(layers=layers, token_layers=token_layers, feature_layers=fused),
                          list(range(3, 64)), tree_nodes=8, tree_top_k=3)
    spec = SpeculativeEngine(tiny_target, drafter).generate_ids(prompts, max_new_tokens=20, num_draft_tokens=4,
                                                                eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0


def test_a_wide_first_level_keeps_the_most_likely_first_tokens_and_stays_a_tree():
    """``best_paths(..., first=3)``: the 3 most likely first tokens are kept although a deeper node outranks
    the third; the rest of the budget goes by rank; every kept node's parent is kept; leaves by rank."""
    from genspec.drafters.trained import TreeNode, best_paths

    log = torch.tensor([0.5, 0.2, 0.1, 0.05, 0.9, 0.8]).log().tolist()
    nodes = [TreeNode(10 + i, -1, 1, log[i]) for i in range(4)]  # first tokens, scores 0.5 .. 0.05
    nodes += [TreeNode(20, 0, 2, log[0] + log[4]), TreeNode(21, 4, 3, log[0] + log[4] + log[5])]  # 0.45, 0.36
    assert best_paths(nodes, 4) == [[10, 20, 21], [11]]
    assert best_paths(nodes, 4, first=3) == [[10, 20], [11], [12]]
    assert best_paths(nodes, 5, first=3) == [[10, 20, 21], [11], [12]]
    assert best_paths(nodes, 2, first=3) == [[10], [11]]  # never more than the budget


@pytest.mark.parametrize("nodes, top_k, first", [(4, 4, 3), (6, 3, 2)])
def test_greedy_wide_first_level_trees_equal_plain_decoding(tiny_target, nodes, top_k, first):
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4]]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=20, eos_token_ids=())
    drafter = HeadDrafter(tiny_target, _head(), list(range(3, 64)), tree_nodes=nodes, tree_top_k=top_k, tree_first=first)
    spec = SpeculativeEngine(tiny_target, drafter).generate_ids(prompts, max_new_tokens=20, num_draft_tokens=4,
                                                                eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0
    assert drafter.block_tokens(1) == min(nodes, top_k) and drafter.block_tokens(4) == nodes


@pytest.mark.parametrize("tree_nodes", [0, 4])
def test_a_first_threshold_drafts_only_where_the_head_is_sure_and_stays_exact(tiny_target, tree_nodes):
    """Greedy output equals plain decoding with any ``first_threshold``; at 0.999 (a random head is never
    that sure) nothing is drafted, in between fewer steps draft than at 0."""
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4]]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=16, eos_token_ids=())
    drafted = {}
    for threshold in (0.0, 0.0236, 0.999):  # (this head's likeliest first tokens: 0.021-0.027, median 0.0236)
        drafter = HeadDrafter(tiny_target, _head(), list(range(3, 64)), tree_nodes=tree_nodes,
                              first_threshold=threshold)
        spec = SpeculativeEngine(tiny_target, drafter).generate_ids(prompts, max_new_tokens=16, num_draft_tokens=3,
                                                                    draft_length="fixed", eos_token_ids=())
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
        drafted[threshold] = sum((s.stats.drafted_per_position or [0])[0] for s in spec)
    assert drafted[0.999] == 0 and 0 < drafted[0.0236] < drafted[0.0]


def test_tree_blocks_count_the_nodes_a_depth_can_hold():
    from genspec.drafters.trained import tree_block

    assert [tree_block(0, 4, d) for d in (0, 1, 5)] == [0, 1, 5]  # a chain: its depth
    assert [tree_block(8, 4, d) for d in (1, 2, 3)] == [4, 8, 8]
    assert [tree_block(30, 2, d) for d in (1, 2, 3)] == [2, 6, 10]


@pytest.mark.parametrize("options", [dict(tree_first=5), dict(tree_first=-1), dict(tree_nodes=2, tree_first=3),
                                     dict(tree_first=1.5), dict(first_threshold=1.0), dict(first_threshold=-0.1)])
def test_a_first_level_wider_than_the_tree_is_a_clear_error(tiny_target, options):
    with pytest.raises(ConfigError, match="tree_first|first_threshold"):
        HeadDrafter(tiny_target, _head(), list(range(3, 64)), **options)


@pytest.mark.parametrize("tree_nodes, seed, token_layers, fused, first_threshold",
                         [(0, 21, 0, (), 0.0), (6, 22, 0, (), 0.0), (0, 31, 1, (), 0.0), (6, 32, 1, (), 0.0),
                          (0, 41, 0, (1,), 0.0), (0, 23, 0, (), 0.35), (6, 24, 0, (), 0.35)])
def test_head_sampling_is_lossless(tree_nodes, seed, token_layers, fused, first_threshold):
    """Chi-square of the joint law of the first 3 generated tokens against the exact target law
    (temperature 0.7, top-k 8, top-p 0.9 on draft and target alike; N = 20,000, cells with expected
    count < 5 pooled; fail if p < 1e-3), sampled chains and dynamic trees of 6 deterministic nodes, a head
    over 8 of the 12 tokens (so its law differs: rejections really happen); heads on the embedding, on
    the target's first layer, and (a sampled chain) on its final feature fused with its first layer's output;
    and with ``first_threshold`` 0.35, where this head's likeliest first token has probability 0.25-0.54 (0.40
    after the prompt): some steps draft, some do not."""
    head = DraftHead(HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                                token_layers=token_layers, feature_layers=fused))
    pvalue, acceptance = lossless_pvalue(
        lambda target: HeadDrafter(target, head.to(torch.float64), list(range(8)), tree_nodes=tree_nodes, tree_top_k=3,
                                   first_threshold=first_threshold),
        SamplingConfig(temperature=0.7, top_k=8, top_p=0.9), seed=seed, layers=2)
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


def test_hybrid_sampling_is_lossless():
    """The same chi-square (N = 20,000, fail if p < 1e-3) for the hybrid at min_match 1 on a 12-token
    vocabulary, so both kinds of step happen in the 3 tokens: lookup's point masses after a match, the
    head's sampled chain (through the engine's fallback) elsewhere."""
    from genspec.drafters.hybrid import HybridDrafter
    from genspec.drafters.prompt_lookup import PromptLookupDrafter

    head = DraftHead(HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128))
    pvalue, acceptance = lossless_pvalue(
        lambda target: HybridDrafter(PromptLookupDrafter(max_ngram=2),
                                     HeadDrafter(target, head.to(torch.float64), list(range(8)), tree_nodes=0), min_match=1),
        SamplingConfig(temperature=0.7, top_k=8, top_p=0.9), seed=23, layers=2)
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


def test_hybrid_merging_weak_lookups_into_the_heads_tree_is_lossless():
    """The same chi-square (N = 20,000, fail if p < 1e-3) for the hybrid whose head drafts a tree and
    takes, where lookup matched fewer than ``min_match`` (4) tokens, the lookup's chain as one more
    candidate of that tree (``merge_weak``)."""
    from genspec.drafters.hybrid import HybridDrafter
    from genspec.drafters.prompt_lookup import PromptLookupDrafter

    head = DraftHead(HeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128))
    pvalue, acceptance = lossless_pvalue(
        lambda target: HybridDrafter(PromptLookupDrafter(max_ngram=2),
                                     HeadDrafter(target, head.to(torch.float64), list(range(8)), tree_nodes=3, tree_top_k=2),
                                     min_match=4, merge_weak=True),
        SamplingConfig(temperature=0.7, top_k=8, top_p=0.9), seed=23, layers=2)
    assert 0.02 < acceptance < 0.95
    assert pvalue > 1e-3


def test_the_weak_lookup_joins_the_heads_tree_as_one_more_candidate(tiny_target):
    from genspec.drafters.base import DraftRequest, RequestContext
    from genspec.drafters.hybrid import HeadAndWeakLookup, HybridDrafter
    from genspec.drafters.prompt_lookup import PromptLookupDrafter

    head = HeadDrafter(tiny_target, _head(), list(range(3, 64)), tree_nodes=3, tree_top_k=2)
    hybrid = HybridDrafter(PromptLookupDrafter(), head, min_match=3, merge_weak=True)
    weak, fresh = [5, 6, 7, 8, 9, 30, 6, 7], [20, 21, 22, 23, 24, 25]  # "6 7" matched: lookup says 8 9 30
    tiny_target.reset(0)
    hidden = tiny_target.add_rows([weak[:-1], fresh[:-1]], return_hidden=True)
    tiny_target.reset(0)
    hybrid.start([RequestContext(0, weak, hidden=hidden[0]), RequestContext(1, fresh, hidden=hidden[1])])
    offer = hybrid.offer([DraftRequest(0, weak, 3), DraftRequest(1, fresh, 3)])
    draft = offer.proposal
    assert offer.costly == (True, True)  # a 2-token match is weak: the fallback's
    assert draft.chains(0) == [] and draft.evidence_of(0) == "head"
    assert isinstance(hybrid.fallback, HeadAndWeakLookup) and hybrid.capabilities.max_candidates == 4
    merged = hybrid.fallback.propose([DraftRequest(0, weak, 2), DraftRequest(1, fresh, 2)])
    alone = head.propose([DraftRequest(0, weak, 2), DraftRequest(1, fresh, 2)])
    assert merged.chains(0)[-1] == [8, 9] and merged.chains(0)[:-1] == alone.chains(0)
    assert merged.chains(1) == alone.chains(1)  # no match at all: the head's tree alone
    # the draft-length policy prices the merged fallback's drafts as the head's tree, not as a chain
    assert [hybrid.fallback.block_tokens(d) for d in (1, 2, 3)] == [head.block_tokens(d) for d in (1, 2, 3)] == [2, 3, 3]


@pytest.mark.parametrize("token_layers, fused", [(0, ()), (1, ()), (0, (1,))])
def test_training_lowers_the_loss_and_the_saved_head_drafts(tmp_path, token_layers, fused):
    """Also for a head whose committed pairs read the target's first layer (features recorded with it;
    the saved head runs those layers when it drafts), and one whose committed pairs fuse the target's first
    layer's output with its final feature (the engine hands them over)."""
    target = HFCausalLM(peaked(tiny_llama(0, dtype=torch.float32), scale=4.0))
    sequences = sampled_continuations(target)
    data = record_features(target, sequences, token_layers=token_layers, feature_layers=fused)
    vocab = choose_vocabulary(sequences, 48)
    config = replace(SMALL, token_layers=token_layers, feature_layers=fused)
    settings = TrainSettings(steps=60, batch_size=8, sequence_length=32, learning_rate=3e-3, warmup=5,
                             checkpoint_every=30, held_out_every=25)
    log = train_head(target, data[:20], data[20:], vocab, tmp_path / "head", config=config, settings=settings)
    losses = [entry["loss"] for entry in log["loss"]]
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    assert log["held_out_after"]["loss"] < log["held_out_before"]["loss"]
    assert log["held_out_after"]["agreement"] > log["held_out_before"]["agreement"]
    # the held-out curve: every 25 steps and at the end, the end's figures those of held_out_after
    assert [e["step"] for e in log["held_out_curve"]] == [25, 50, 60]
    assert log["held_out_curve"][-1]["loss"] == log["held_out_after"]["loss"]
    head, vocab_ids, fingerprint, info = load_head(tmp_path / "head")
    assert vocab_ids == vocab and fingerprint == target_fingerprint(target) and info["log"]["settings"]["steps"] == 60
    assert head.config.token_layers == token_layers and head.config.feature_layers == fused
    drafter = HeadDrafter.for_target(target, path=str(tmp_path / "head"))
    assert (drafter.layer_states is not None) == bool(token_layers) and drafter.capabilities.target_hidden_layers == fused
    prompts = [s[:6] for s in sequences[20:]]
    plain = SpeculativeEngine(target).generate_ids(prompts, max_new_tokens=20, eos_token_ids=())
    # fixed draft lengths: the cost policy reads the clock, and on a loaded machine it may stop drafting
    spec = SpeculativeEngine(target, drafter).generate_ids(prompts, max_new_tokens=20, num_draft_tokens=3,
                                                           draft_length="fixed", eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.accepted_tokens for s in spec) > 0

    # --resume continues from the checkpoint; without it an existing directory is refused
    with pytest.raises(ConfigError, match="holds a trained speculator"):
        train_head(target, data[:20], data[20:], vocab, tmp_path / "head", config=config, settings=settings)
    longer = TrainSettings(**{**settings.__dict__, "steps": 70})
    log = train_head(target, data[:20], data[20:], vocab, tmp_path / "head", config=config, settings=longer, resume=True)
    assert [e["step"] for e in log["loss"]] == list(range(1, 71))


def test_a_head_for_another_model_or_no_head_is_a_clear_error(tmp_path, tiny_target):
    other = HFCausalLM(tiny_llama(5))
    save_head(tmp_path / "other", _head(), list(range(64)), target_fingerprint(other))
    with pytest.raises(ConfigError, match="trained for another model"):
        HeadDrafter.for_target(tiny_target, path=str(tmp_path / "other"))
    with pytest.raises(InputFileError, match="no trained head at"):
        HeadDrafter.for_target(tiny_target, path=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="needs a trained head"):
        HeadDrafter.for_target(tiny_target)


def test_the_hybrid_looks_up_with_the_suffix_drafter_unless_told_otherwise(tmp_path, tiny_target):
    """The default lookup (chosen on unmeasured prompts: genspec.drafters.hybrid.DEFAULT_LOOKUP) is the
    suffix drafter; ``lookup=prompt-lookup`` keeps the other; an unknown lookup is a clear error."""
    from genspec.drafters import PromptLookupDrafter
    from genspec.drafters.hybrid import HybridDrafter
    from genspec.drafters.suffix import SuffixDrafter

    save_head(tmp_path / "head", _head(), list(range(3, 64)), target_fingerprint(tiny_target))
    path = str(tmp_path / "head")
    assert isinstance(HybridDrafter.for_target(tiny_target, path=path).lookup, SuffixDrafter)
    assert isinstance(HybridDrafter.for_target(tiny_target, path=path, lookup="prompt-lookup").lookup, PromptLookupDrafter)
    with pytest.raises(ConfigError, match="unknown lookup"):
        HybridDrafter.for_target(tiny_target, path=path, lookup="nope")


def test_genspec_train_head_then_generate_with_it(capsys, tmp_path, tiny_model_dir):
    """The command end to end on the tiny model (a few steps): a head is written, ``--drafter head``
    loads it and greedy output equals plain; a second run into the same directory is refused."""
    from genspec.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"the cat sat on mat number {i} and the dog sat too" for i in range(30)))
    out = tmp_path / "head"
    argv = ["train", "head", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "6", "--prompts", "4",
            "--max-new-tokens", "16", "--vocab-size", "64", "--data", str(corpus), "--layers", "2",
            "--token-layers", "1", "--feature-layers", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "head written to" in err and "held-out acceptance" in err
    head, _, _, info = load_head(out)
    assert head.config.num_layers == 2 and len(head.layers) == 2 and head.config.token_layers == 1
    assert head.config.feature_layers == (1,)
    assert info["training_tokens"] > 0 and 0.0 <= info["held_out_acceptance"]["first_token_acceptance"] <= 1.0
    assert len(info["held_out_acceptance"]["acceptance_per_position"]) == 5
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "the cat sat", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--drafter", "none"]) == 0
    import json

    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "head", "-O", f"path={out}", "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert spec["stats"]["drafted_tokens"] > 0

    assert main(argv) == 2
    assert "exists and is not empty" in capsys.readouterr().err

    # a resumed run reads the saved sequences (it never regenerates them) and trains on to --steps
    (out / "sequences.json").write_text((out / "sequences.json").read_text().replace('"model"', '"model_"'))
    assert main(argv[:argv.index("--steps") + 1] + ["9"] + argv[argv.index("--steps") + 2:] + ["--resume"]) == 0
    capsys.readouterr()
    assert len(load_head(out)[3]["log"]["loss"]) == 9 and "model_" in load_head(out)[3]


def test_genspec_train_checks_every_path_and_the_checkpoint_before_any_work(capsys, tmp_path, tiny_model_dir):
    """Issue 46 item 12. A file as --out, an --out that cannot be made, --resume with nothing to resume and a
    truncated checkpoint are refused before the model loads (--model names no model: its error would come
    first otherwise); a checkpoint of another shape (--layers) before the target's features are recorded.
    Each is one line, exit 2."""
    from genspec.cli import main

    def refused(argv, message):
        assert main(["train", "head", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err

    (tmp_path / "file.txt").write_text("not a directory")
    nowhere = ["--model", str(tmp_path / "no-model"), "--steps", "2"]
    refused(nowhere + ["--out", str(tmp_path / "file.txt")], "is a file; give a directory")
    refused(nowhere + ["--out", str(tmp_path / "file.txt" / "head")], "cannot write to output directory")
    refused(nowhere + ["--out", str(tmp_path / "empty"), "--resume"], "nothing to resume in")
    out = tmp_path / "head"
    argv = ["--model", str(tiny_model_dir), "--out", str(out), "--steps", "2", "--prompts", "2", "--max-new-tokens",
            "8", "--vocab-size", "64"]
    assert main(["train", "head", *argv]) == 0
    capsys.readouterr()
    refused(argv + ["--resume", "--layers", "2"], "another shape (num_layers: 1 in the checkpoint, 2 asked)")
    whole = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(whole[:len(whole) // 2])
    refused(nowhere + ["--out", str(out), "--resume"], "checkpoint.pt is damaged or truncated")


@pytest.mark.parametrize("extra, message", [(["--steps", "0"], "--steps must be >= 1"),
                                            (["--layers", "0"], "--layers must be from 1 to 64, got 0"),
                                            (["--token-layers", "-1"], "--token-layers must be from 0 to 1"),
                                            (["--token-layers", "2"], "--token-layers must be from 0 to 1 (the target has 2 layers), got 2"),
                                            (["--feature-layers", "2"], "--feature-layers must be distinct layers in 1..1"),
                                            (["--feature-layers", "1,x"], "comma-separated layer numbers"),
                                            (["--data", "/no/such/file.txt"], "training data not found")])
def test_genspec_train_head_bad_input_is_one_line(capsys, tmp_path, tiny_model_dir, extra, message):
    from genspec.cli import main

    assert main(["train", "head", "--model", str(tiny_model_dir), "--out", str(tmp_path / "h"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_hybrid_takes_lookup_after_a_strong_match_and_the_head_elsewhere(tiny_target):
    from genspec.drafters.base import DraftRequest, RequestContext
    from genspec.drafters.hybrid import HybridDrafter
    from genspec.drafters.prompt_lookup import PromptLookupDrafter

    hybrid = HybridDrafter(PromptLookupDrafter(), HeadDrafter(tiny_target, _head(), list(range(3, 64)), tree_nodes=0),
                           min_match=3, merge_weak=False)
    repeated, fresh = [5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 23, 24, 25]  # "5 6 7" matched: lookup says 8 9 ...
    tiny_target.reset(0)
    hidden = tiny_target.add_rows([repeated[:-1], fresh[:-1]], return_hidden=True)
    tiny_target.reset(0)
    hybrid.start([RequestContext(0, repeated, hidden=hidden[0]), RequestContext(1, fresh, hidden=hidden[1])])
    offer = hybrid.offer([DraftRequest(0, repeated, 3), DraftRequest(1, fresh, 3)])
    draft = offer.proposal
    assert draft.first_chain(0) == [8, 9, 5] and draft.evidence_of(0) == 3 and not offer.costly[0]
    assert draft.first_chain(1) == [] and draft.evidence_of(1) == "head" and offer.costly[1]  # left to the head
    assert hybrid.fallback is hybrid.head and hybrid.capabilities.free
    assert len(hybrid.fallback.propose([DraftRequest(1, fresh, 3)]).first_chain(0)) == 3


def test_the_engine_hands_the_rows_lookup_leaves_to_the_hybrids_head(tiny_target):
    """Through the engine: steps without a strong match are drafted by the head (evidence "head"), steps
    after one by lookup, and the output is plain decoding's."""
    from genspec.drafters.hybrid import HybridDrafter
    from genspec.drafters.prompt_lookup import PromptLookupDrafter

    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 40, 41]
    plain = SpeculativeEngine(tiny_target).generate_ids([prompt], max_new_tokens=24, eos_token_ids=())
    hybrid = HybridDrafter(PromptLookupDrafter(), HeadDrafter(tiny_target, _head(), list(range(3, 64)), tree_nodes=0), min_match=2)
    engine = SpeculativeEngine(tiny_target, hybrid)
    request = engine.add_request(prompt, max_new_tokens=24, eos_token_ids=(), draft_length="fixed", num_draft_tokens=3)
    grades, tokens = [], []
    while engine.has_unfinished():
        step = engine.step().requests[request]
        grades.append((step.evidence, step.drafted))
        tokens += step.new_tokens
    assert tokens == plain[0].token_ids
    assert any(grade == "head" and drafted == 3 for grade, drafted in grades)  # the head drafted
    assert all(drafted == 0 or grade == "head" or grade >= 2 for grade, drafted in grades)


@pytest.mark.parametrize("tree_nodes,merge_weak", [(0, False), (6, False), (0, True), (6, True)])
def test_greedy_hybrid_equals_plain_decoding(tiny_target, tree_nodes, merge_weak):
    from genspec.drafters.hybrid import HybridDrafter
    from genspec.drafters.prompt_lookup import PromptLookupDrafter

    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2], [3, 4]]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())
    head = HeadDrafter(tiny_target, _head(), list(range(3, 64)), tree_nodes=tree_nodes, tree_top_k=3)
    hybrid = HybridDrafter(PromptLookupDrafter(), head, min_match=2 + merge_weak, merge_weak=merge_weak)
    spec = SpeculativeEngine(tiny_target, hybrid).generate_ids(prompts, max_new_tokens=24, num_draft_tokens=3,
                                                               eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.drafted_tokens for s in spec) > 0


def test_the_shipped_head_is_small_and_for_the_embedded_model():
    from genspec.drafters.trained import SHIPPED

    files = list((SHIPPED / "head").iterdir())
    assert sum(f.stat().st_size for f in files) < 20e6
    head, vocab_ids, fingerprint, info = load_head(SHIPPED / "head")
    assert head.config.hidden_size == 640 and len(vocab_ids) >= 8192 and info["model"] == "embedded default"
    assert info["held_out_acceptance"]["prompts"] == 8  # measured at the end of the run that made it


@pytest.mark.smoke
@pytest.mark.parametrize("drafter", ["head", "hybrid"])
def test_the_shipped_head_drafts_for_the_embedded_model(capsys, drafter):
    """``--drafter head`` / ``hybrid`` right after install (the shipped head, no path): greedy output
    equals plain decoding on the real model, and some drafts are kept."""
    import json

    from genspec.cli import main

    base = ["generate", "--prompt", "List three uses of a paperclip.", "--max-new-tokens", "24", "--json",
            "--backend", "torch"]  # the head reads the target's hidden states
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", drafter]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert spec["stats"]["accepted_tokens"] > 0


class _Reader(Drafter):
    """A costly drafter that must read the whole request before drafting (its catch-up counted)."""

    name = "reader"

    def __init__(self):
        self.asked = 0

    def propose(self, requests):
        return Draft.from_chains([[[0] * r.max_tokens] for r in requests])  # token 0: never the tiny target's

    def catch_up_tokens(self, request_id, sequence):
        self.asked += 1
        return 10 ** 6


class _Empty(Drafter):
    """A composite whose free part never proposes: it offers every row as a costly draft of its fallback,
    which drafts, reads and catches up for it."""

    name = "empty"
    capabilities = DrafterCapabilities(free=True, costly=True)

    def __init__(self, fallback):
        self.fallback = fallback

    def offer(self, requests):
        return DraftOffer.to_draft(len(requests), evidence=["head"] * len(requests))

    def propose(self, requests):
        return self.fallback.propose(requests)

    def catch_up_tokens(self, request_id, sequence):
        return self.fallback.catch_up_tokens(request_id, sequence)


def test_the_cost_policy_asks_the_fallback_what_a_probe_must_read(tiny_target):
    """A fallback switched off by the cost policy is probed only if the probe's reading is affordable, and
    that reading is the fallback's (here a million tokens: never affordable), not the free part's (0)."""
    reader = _Reader()
    engine = SpeculativeEngine(tiny_target, _Empty(reader))
    results = engine.generate_ids([[5, 6, 7]], max_new_tokens=96, eos_token_ids=())
    assert results[0].finish_reason == "length"
    assert reader.asked > 0
    assert results[0].stats.drafted_tokens < 40  # switched off, and no probe after that
