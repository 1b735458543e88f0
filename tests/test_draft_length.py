"""Draft-length policies: fixed, heuristic schedule, cost-aware choice."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama

from genspec.draft_length import (EXPLORE_EVERY, MAX_PROBE_WAIT, CostModel, DraftCost, DraftLength, RowPlan, decide, plan,
                                  probe_affordable)
from genspec.drafters import DraftModelDrafter, PromptLookupDrafter
from genspec.drafters.base import DraftRequest, RequestContext
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.models.base import equal_split


def test_heuristic_schedule():
    policy = DraftLength("heuristic", k_max=10)
    policy.current = 5
    policy.update(drafted=5, accepted=5)
    assert policy.limit() == 7
    policy.update(drafted=7, accepted=3)
    assert policy.limit() == 6
    for _ in range(20):
        policy.update(drafted=1, accepted=0)
    assert policy.limit() == 1


def test_cost_policy_turns_speculation_off_when_it_cannot_pay():
    costs = CostModel()
    costs.observe_verify(1, 0.100)
    for width in range(2, 10):
        costs.observe_verify(width, 0.200)  # verifying 2+ tokens costs twice a plain step
    good, bad = DraftLength("cost", k_max=8, cost_model=costs), DraftLength("cost", k_max=8, cost_model=costs)
    for _ in range(30):
        good.update(drafted=8, accepted=8)  # everything accepted
        bad.update(drafted=8, accepted=0)  # nothing accepted
    assert good.limit() == 8
    assert bad.limit() == 0


def test_cost_policy_uses_draft_cost():
    costs = CostModel()
    for width in range(1, 10):
        costs.observe_verify(width, 0.1)
    draft_cost = DraftCost()
    draft_cost.observe(positions=1, seconds=0.05)  # each draft token costs half a target step
    policy = DraftLength("cost", k_max=8, cost_model=costs, draft_cost=draft_cost)
    for _ in range(30):
        policy.update(drafted=4, accepted=2)  # first token always right, later ones 1 in 2
    k = policy.limit()
    estimate = policy.estimate()
    rates = {j: estimate.expected_tokens(j) / (0.1 + 0.05 * j) for j in range(9)}
    assert k == max(rates, key=rates.get)
    assert 0 < k < 8


def test_unknown_policy():
    with pytest.raises(ConfigError, match="draft length policy"):
        DraftLength("magic", 4)


@pytest.mark.parametrize("policy", ["heuristic", "cost"])
def test_adaptive_policies_keep_greedy_output(policy):
    target = HFCausalLM(tiny_llama(0))
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]]
    plain = SpeculativeEngine(target).generate_ids(prompts, max_new_tokens=30, eos_token_ids=())
    for drafter in (PromptLookupDrafter(), DraftModelDrafter(HFCausalLM(tiny_llama(1, layers=1)))):
        spec = SpeculativeEngine(target, drafter).generate_ids(prompts, max_new_tokens=30, eos_token_ids=(),
                                                                draft_length=policy, num_draft_tokens=6)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


def _probes(policy: DraftLength, steps: int, kept=lambda n: False) -> list[int]:
    """The steps at which a switched-off ``policy`` probes (one token each, verified: the ``n``-th probe
    kept if ``kept(n)``), over ``steps`` steps."""
    at = []
    for i in range(steps):
        k = policy.limit()
        if k:
            assert k == 1
            policy.update(drafted=1, accepted=int(kept(len(at))))
            at.append(i)
    return at


def test_switched_off_drafter_is_probed_at_its_price_with_backoff():
    """Probes spend 3% of the idle time at their price: verifying 2 tokens costs 2 plain steps here (one
    step more), so the first probe comes after 34 idle steps; each failed probe doubles the wait."""
    costs = CostModel()
    costs.observe_verify(1, 0.1)
    for width in range(2, 10):
        costs.observe_verify(width, 0.2)
    policy = DraftLength("cost", k_max=8, cost_model=costs)
    for _ in range(30):
        policy.update(drafted=8, accepted=0)
    assert _probes(policy, 34 + 68 + 136) == [33, 33 + 68, 33 + 68 + 136]


def _probe_waits(policy: DraftLength, kept: list[bool]) -> list[int]:
    """Idle steps before each probe of a drafter the plan keeps switched off (``after_plan(0)``), whose
    probes are kept as ``kept`` says."""
    waits, idle = [], 0
    for outcome in kept:
        while not policy.after_plan(0, probe=True):
            idle += 1
        waits.append(idle + 1)
        idle = 0
        policy.update(drafted=1, accepted=int(outcome))
    return waits


def test_a_cheap_drafter_is_probed_often_and_its_backoff_follows_break_even():
    """A head costing 0.08 of a plain step per token, with one token more verified at 0.1 of a step: a
    probe costs 0.18 steps, which is also the break-even acceptance of a one-token draft, so one comes
    every 6 idle steps, and the backoff moves by 2^0.18 per failed probe and 2^-0.82 per kept one. Probes
    kept half the time (above break-even) keep the wait at 6 or 7; probes never kept, or kept 1 time in 10
    (below break-even), thin out to the longest wait. A drafter at the prior (half a step per position)
    waits 20."""
    costs = CostModel()
    for width in range(1, 10):
        costs.observe_verify(width, 0.1 * (1 + 0.1 * (width - 1)))
    head = DraftCost()
    head.observe(positions=1, seconds=0.008)

    def policy() -> DraftLength:
        return DraftLength("cost", k_max=8, cost_model=costs, draft_cost=head)

    assert policy().probe_price() == pytest.approx(0.18)
    assert policy().probe_wait() == 6
    failing = _probe_waits(policy(), [False] * 80)
    expected = [6] + [min(MAX_PROBE_WAIT, math.ceil(6 * 2 ** (0.18 * n) - 1e-9)) for n in range(1, 80)]
    assert failing == expected and failing[-1] == MAX_PROBE_WAIT
    assert set(_probe_waits(policy(), [n % 2 == 0 for n in range(80)])) == {6, 7}  # 7 after a failed one
    rare = _probe_waits(policy(), [n % 10 == 9 for n in range(300)])
    assert rare[:10] == failing[:10] and rare[10] < rare[9] and rare[-1] == MAX_PROBE_WAIT
    prior = DraftLength("cost", k_max=8, cost_model=costs, draft_cost=DraftCost())
    assert prior.probe_wait() == 20


@pytest.mark.parametrize("policy, seed", [("heuristic", 41), ("cost", 42)])
def test_adaptive_policies_stay_lossless(policy, seed):
    """Chi-square of the first 3 tokens vs the exact target law with adaptive draft lengths
    (T=0.7, top-k 8, top-p 0.9), N = 20,000, fail if p < 1e-3."""
    from stats_helpers import lossless_pvalue

    from genspec.models import variants
    from genspec.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)
    pvalue, _ = lossless_pvalue(lambda t: DraftModelDrafter(variants.early_exit(t, 1)), sampling, k=3,
                                seed=seed, draft_length=policy)
    assert pvalue > 1e-3


def test_cost_policy_needs_a_margin_over_plain_decoding():
    """A break-even draft (predicted gain below MARGIN) is not worth the overhead: k = 0."""
    from genspec.draft_length import MARGIN, CostModel, DraftLength

    costs = CostModel()
    for width in range(1, 10):
        costs.observe_verify(width, 1.0 + 0.1 * (width - 1))
    policy = DraftLength("cost", k_max=8, cost_model=costs, prior_alpha=0.2, prior_later=0.2,
                         prior_weight=1000)
    # alpha 0.2: one draft gives 1.2 tokens for 1.1 the cost, +9% < MARGIN - 1
    assert 1.2 / 1.1 < MARGIN and policy.best_k() == 0
    rich = DraftLength("cost", k_max=8, cost_model=costs, prior_alpha=0.6, prior_weight=1000)
    assert rich.best_k() > 0


def test_acceptance_counts_first_and_later_tokens():
    """E[tokens](k) = 1 + first * (1 + later + ... + later^(k-1)), the rates counted from verdicts."""
    from genspec.draft_length import Acceptance

    counts = Acceptance(prior_first=0.5, prior_later=0.5, prior_weight=1e-9, decay=1.0)
    counts.record(drafted=4, accepted=0)   # first tested, rejected
    counts.record(drafted=4, accepted=4)   # first accepted; later 3 tested, 3 accepted
    counts.record(drafted=4, accepted=2)   # first accepted; later 2 tested (1 accepted, 1 rejected)
    assert counts.rate_first == pytest.approx(2 / 3)
    assert counts.rate_later == pytest.approx(4 / 5)
    assert counts.expected_tokens(3) == pytest.approx(1 + 2 / 3 * (1 + 0.8 + 0.64))
    assert counts.expected_tokens(0) == 1.0


def test_cost_policy_learns_per_evidence_level():
    """Weak proposals (evidence 1, first token right 1 time in 10) are not verified; strong ones
    (evidence 4, always right) are drafted to k_max, in the same row."""
    costs = CostModel()
    for width in range(1, 10):
        costs.observe_verify(width, 0.1 * (1 + 0.1 * (width - 1)))
    policy = DraftLength("cost", k_max=8, cost_model=costs)
    for step in range(40):
        policy.update(drafted=3, accepted=int(step % 10 == 0), evidence=1)
        policy.update(drafted=8, accepted=8, evidence=4)
    assert policy.limit(evidence=1, probe=False) == 0
    assert policy.limit(evidence=4) == 8
    # a new level starts from the prior, or lower where the row's levels so far did worse
    assert policy.estimate(2).rate_first == 0.5
    assert DraftLength("cost", k_max=8).estimate(2).rate_first == 0.5  # nothing seen: the prior
    bad = DraftLength("cost", k_max=8)
    for _ in range(5):
        bad.update(drafted=3, accepted=0, evidence=1)
    assert bad.estimate(3).rate_first < 0.2


def test_free_proposals_are_scored_when_not_verified():
    policy = DraftLength("cost", k_max=8)
    before = policy.estimate(2).rate_first
    policy.shadow([7, 8], [7], evidence=2)
    assert policy.estimate(2).rate_first > before
    policy.shadow([9, 8], [7], evidence=3)
    assert policy.estimate(3).rate_first < before


def test_a_plan_that_stopped_drafting_learns_later_positions_from_the_steps_that_follow():
    """Where a 2-token block costs two plain steps and a 4-token one 2.5, a policy whose drafts failed past their
    first token drafts nothing, and nothing drafted tests a later position again. The unverified proposals'
    later tokens are scored against the tokens the following plain steps emit: an answer that goes on as
    proposed brings drafting back; one that does not keeps it off."""
    costs = CostModel()
    for width, seconds in ((1, 0.014), (2, 0.029), (3, 0.033), (4, 0.035), (5, 0.050), (9, 0.067)):
        costs.observe_verify(width, seconds)

    def locked_out():
        policy = DraftLength("cost", k_max=8, cost_model=costs)
        for _ in range(8):
            policy.update(drafted=4, accepted=1, evidence=4)  # first tokens kept, later ones not
        assert policy.best_k(evidence=4) == 0
        return policy

    text = list(range(100, 160))  # what the target emits, one token a plain step
    right, wrong = locked_out(), locked_out()
    for step in range(40):
        # each step: the proposal made before it, the token it emitted
        right.learn(0, 0, [text[step]], 4, proposal=text[step:step + 6])
        wrong.learn(0, 0, [text[step]], 4, proposal=[text[step], 7, 7, 7, 7, 7])  # right first token only
    assert right.best_k(evidence=4) >= 3
    assert wrong.best_k(evidence=4) == 0
    assert wrong.estimate(4).rate_later < 0.1 and right.estimate(4).rate_later > 0.9


def test_a_draft_kept_whole_scores_the_proposals_next_token_so_one_token_drafts_are_not_a_trap():
    """Drafts of one token never test a later position: a policy that has come to distrust later tokens
    drafts one at a time for good, however often they are kept. The free proposal's next token, scored
    against the target's own next token, is the later outcome that frees it."""
    costs = CostModel()
    for width in range(1, 10):
        costs.observe_verify(width, 1 + 0.1 * (width - 1))

    def distrustful():
        policy = DraftLength("cost", k_max=8, cost_model=costs)
        for _ in range(6):
            policy.update(drafted=3, accepted=1, evidence=4)  # later tokens failed
        assert policy.best_k(evidence=4) == 1
        return policy

    stuck, freed = distrustful(), distrustful()
    for _ in range(20):  # a repeating answer: each one-token draft kept, and the proposal right beyond it
        for policy in (stuck, freed):
            policy.update(drafted=1, accepted=1, evidence=4)
        freed.shadow([7, 8, 9], [7, 8], evidence=4, drafted=1)
    assert stuck.best_k(evidence=4) == 1
    assert freed.best_k(evidence=4) > 2
    # nothing is scored where the draft was not kept whole or the kept path was another chain
    before = freed.estimate(4).later[:]
    freed.shadow([7, 8, 9], [5, 8], evidence=4, drafted=1)
    freed.shadow([7, 8, 9], [7, 8, 9], evidence=4, drafted=3)
    assert freed.estimate(4).later == before


def _plain_run(tokens: int) -> tuple[HFCausalLM, list[list[int]], list[int]]:
    """A tiny target, a one-prompt batch and its plain greedy continuation (what oracle drafters copy)."""
    target = HFCausalLM(tiny_llama(0))
    prompt = [[5, 6, 7, 8, 9, 5, 6, 7]]
    return target, prompt, SpeculativeEngine(target).generate_ids(prompt, max_new_tokens=tokens,
                                                                  eos_token_ids=())[0].token_ids


def _oracle(prompt: list[int], plain: list[int], free: bool = True, block=None):
    """A drafter proposing the plain continuation (always right): free, or costly (cost prior 0.01 of a
    step per position) and declaring ``block(depth)`` verify tokens if given."""
    from genspec.drafters.base import Draft, Drafter, DrafterCapabilities

    class Oracle(Drafter):
        name, capabilities = "oracle", DrafterCapabilities(free=free, draft_cost_prior=0.01)

        def propose(self, requests):
            done = len(requests[0].sequence) - len(prompt)
            return Draft.from_chains([[plain[done:done + requests[0].max_tokens]]])

        def block_tokens(self, depth):
            return depth if block is None else block(depth)

    return Oracle()


def test_first_step_drafts_a_few_tokens_not_k_max():
    """Nothing measured yet: the prior costs (1 + 0.1 k) and the prior acceptance pick a short draft."""
    policy = DraftLength("cost", k_max=16)
    assert 1 <= policy.limit() <= 4


def test_engine_drops_weak_free_drafts_and_stays_exact():
    """A drafter whose weak proposals are always wrong and strong ones always right: the cost policy
    ends up verifying (nearly) only the strong ones, and the output equals plain decoding. Costs are
    made deterministic (verifying w tokens costs 1 + 0.1 (w - 1), drafting nothing) so the test does
    not depend on this machine's timings."""
    from genspec.drafters.base import Draft, Drafter, DrafterCapabilities

    class Synthetic(CostModel):
        def observe_verify(self, width, seconds, batch=1):
            super().observe_verify(width, 1 + 0.1 * (width - 1), batch)

    target, prompt, plain = _plain_run(60)

    class Oracle(Drafter):
        name, capabilities = "oracle", DrafterCapabilities(free=True)

        def propose(self, requests):
            done = len(requests[0].sequence) - len(prompt[0])
            strong = done % 3 == 0
            truth = plain[done:done + requests[0].max_tokens]
            tokens = truth if strong else [(t + 1) % 256 for t in truth]
            return Draft.from_chains([[tokens]], evidence=[4 if strong else 1])

    result = SpeculativeEngine(target, Oracle(), cost_model=Synthetic()).generate_ids(prompt, max_new_tokens=60, eos_token_ids=(),
                                                               num_draft_tokens=4)[0]
    assert result.token_ids == plain
    stats = result.stats
    verified, first_right = stats.drafted_per_position[0], stats.accepted_per_position[0]
    # weak drafts (always wrong) are verified only while the prior still trusts them
    assert verified - first_right <= 3
    assert first_right >= 10  # strong ones (always right) keep being verified


def test_policies_learn_a_trees_depth_not_its_node_count():
    """A free drafter proposing two candidate chains of 4 tokens (a tree of 8 nodes, 4 deep): the true
    continuation and a wrong one. Every draft's path is kept whole, so the heuristic policy (+2 after a
    fully kept draft, -1 otherwise) must stay at k = 4; counting the 8 nodes as 8 positions would call
    each draft half rejected and shrink k to 1."""
    from genspec.drafters.base import Draft, Drafter, DrafterCapabilities

    target, prompt, plain = _plain_run(40)

    class OracleTree(Drafter):
        name, capabilities = "oracle-tree", DrafterCapabilities(free=True, max_candidates=2)

        def propose(self, requests):
            done = len(requests[0].sequence) - len(prompt[0])
            truth = plain[done:done + requests[0].max_tokens]
            return Draft.from_chains([[truth, [(t + 1) % 64 for t in truth]]], num_chains=2)

    result = SpeculativeEngine(target, OracleTree()).generate_ids(prompt, max_new_tokens=40, eos_token_ids=(),
                                                                  num_draft_tokens=4, draft_length="heuristic")[0]
    assert result.token_ids == plain
    stats = result.stats
    assert stats.drafted_per_position[3] >= stats.target_calls - 2  # (the last steps are cut by the budget)
    assert stats.accepted_tokens == stats.accepted_per_position[0] + sum(stats.accepted_per_position[1:])


# ------------------------------------------------------------------------------ a batch's plan
def _costs(step: float = 0.1, per_token: float = 0.01) -> CostModel:
    """Verify costs that grow linearly with the block's rows x width, as on a compute-bound CPU."""
    costs = CostModel()
    for batch in (1, 3, 8):
        for width in range(1, 10):
            costs.observe_verify(width, step + per_token * (batch * width - 1), batch)
    return costs


def _policy(first: float, later: float, costs=None, k_max: int = 8) -> DraftLength:
    """A cost policy whose acceptance estimates are (almost exactly) ``first`` / ``later``."""
    return DraftLength("cost", k_max=k_max, cost_model=costs, prior_alpha=first, prior_later=later,
                       prior_weight=1e6)


def test_a_batch_drafts_less_than_one_request_and_switches_off_when_verifying_costs_too_much():
    """The same requests: alone they draft k_max; in a batch of 8, whose block costs grow with rows x
    width, they draft less; with steeper costs the plan switches speculation off."""
    costs = _costs(step=0.1, per_token=0.005)
    assert plan([RowPlan(_policy(0.8, 0.8), None, 8)], costs) == [8]
    batch = plan([RowPlan(_policy(0.8, 0.8), None, 8) for _ in range(8)], costs)
    assert len(set(batch)) == 1 and 0 < batch[0] < 8
    steep = _costs(step=0.1, per_token=0.02)
    assert plan([RowPlan(_policy(0.8, 0.8), None, 8) for _ in range(8)], steep) == [0] * 8


def test_weak_drafts_fill_the_block_a_strong_one_pays_for():
    """One request sure of its draft among seven doubtful ones: the block is as wide as the sure one
    needs, and the doubtful free drafts fill it (padding costs the same as their tokens)."""
    costs = _costs(step=0.1, per_token=0.0005)
    rows = [RowPlan(_policy(0.95, 0.95), None, 8)] + [RowPlan(_policy(0.1, 0.5), None, 8) for _ in range(7)]
    lengths = plan(rows, costs)
    assert lengths[0] > 0 and lengths[1:] == [lengths[0]] * 7
    doubtful = [RowPlan(_policy(0.1, 0.5), None, 8) for _ in range(8)]
    assert plan(doubtful, costs) == [0] * 8  # without the sure one, the block is not worth widening


def test_unpadded_rows_are_priced_by_the_blocks_they_run_as_so_weak_drafts_stay_out():
    """Where rows are not padded (llama.cpp with a cache stream per row), 8 sure rows among 8 doubtful ones draft
    and the doubtful ones do not: their tokens would cost their own positions. Padded, the sure rows pay for a
    block every row fills, narrower, since each position of it costs all 16 rows."""
    costs = CostModel()
    for batch in (1, 2, 4, 8, 16):
        for width in range(1, 10):
            costs.observe_verify(width, 0.05 + 0.002 * batch * width, batch)  # a pass, and each position
    rows = [RowPlan(_policy(0.95, 0.95), None, 8) for _ in range(8)] + [RowPlan(_policy(0.1, 0.5), None, 8)
                                                                        for _ in range(8)]
    assert plan(rows, costs, equal_split) == [8] * 8 + [0] * 8
    padded = plan(rows, costs)
    assert len(set(padded)) == 1 and 0 < padded[0] < 8
    # 16 plain rows and 8 of 9 tokens run as 16 x 1 then 8 x 8: 0.082 + 0.178 s, 3.17 plain steps
    assert costs.shapes_relative(equal_split([9] * 8 + [1] * 8), 16) == pytest.approx((0.082 + 0.178) / 0.082)
    assert costs.shapes_relative([(16, 9)], 16) == pytest.approx(costs.relative(9, 16))  # one block: as before


def test_a_step_that_is_no_longer_worth_it_row_by_row_is_not_drafted():
    """Unpadded, a single sure row beside 15 plain ones pays nothing where every block costs a pass of its
    own and each position about a row's plain token (a compute-bound CPU): the plan drafts none."""
    costs = CostModel()
    for batch in (1, 16):
        for width in range(1, 10):
            costs.observe_verify(width, 0.01 + 0.005 * batch * width, batch)
    rows = [RowPlan(_policy(0.95, 0.95), None, 8)] + [RowPlan(None) for _ in range(15)]
    assert plan(rows, costs, equal_split) == [0] * 16


def test_split_steps_are_priced_at_what_they_were_seen_to_cost_over_their_blocks():
    costs = CostModel()
    for batch, seconds in ((1, 0.02), (16, 0.09)):
        for width in range(1, 6):
            costs.observe_verify(width, seconds * width, batch)
    shapes = equal_split([5] + [1] * 15)  # 16 x 1 + 1 x 4
    assert costs.shapes_relative(shapes, 16) == pytest.approx((0.09 + 0.08) / 0.09)
    costs.observe_split(shapes, 0.17 * 1.5, 16)  # took 1.5x its blocks' sum
    assert costs.shapes_relative(shapes, 16) == pytest.approx(1.5 * (0.09 + 0.08) / 0.09)
    costs.observe_split([(16, 1)], 1.0, 16)  # one block is no split step: nothing learned
    assert costs.split_factor == {16: pytest.approx(1.5)}
    costs.observe_verify(1, 0.18, 16)  # a dearer plain step: the step's price in plain steps is priced anew
    plain = costs.verify_cost(1, 16)
    assert costs.shapes_relative(shapes, 16) == pytest.approx(1.5 * (plain + 0.08) / plain)


def test_equal_split_gives_a_list_of_its_own_each_call():
    """Splits are remembered (a plan asks for the same ones many times): a caller's change to one it was given
    does not reach the next caller."""
    first = equal_split([3, 1], sequences=[4, 5])
    first.append((9, 9))
    assert equal_split([3, 1], sequences=[4, 5]) == [(2, 1), (1, 2)]


def test_an_unpadded_step_that_explores_a_block_measures_it():
    """Where rows are not padded, a step that drafts a block wider than any measured at its rows learns its
    cost from what the step's other blocks leave of its time, so the plan drafts it once, then by its
    measured cost (the step is never one uniform block the engine could record)."""
    costs = CostModel()
    for batch in (1, 8, 16):
        for width in (1, 2):
            costs.observe_verify(width, 0.05 + 0.002 * batch * width, batch)
    rows = [RowPlan(_policy(0.95, 0.95), None, 8) for _ in range(8)] + [RowPlan(None) for _ in range(8)]
    first = plan(rows, costs, equal_split)
    assert first == [8] * 8 + [0] * 8  # priced by extrapolation, at the growth prior's slope
    shapes = equal_split([9] * 8 + [1] * 8)
    assert shapes == [(16, 1), (8, 8)]
    costs.observe_split(shapes, costs.verify_cost(1, 16) + 2.0, 16)  # the 8 x 8 block turned out dear: 2 s
    assert costs.verify[(8, 8)] == pytest.approx(2.0)
    later = [plan(rows, costs, equal_split) for _ in range(2 * EXPLORE_EVERY)]
    assert all(lengths[0] < 8 for lengths in later) and len({tuple(lengths) for lengths in later}) == 1


def test_a_step_that_explores_several_blocks_measures_each_of_them():
    """A ragged step of 16 rows x 1, 3 x 6 and 8 x 6 tokens, the last two beyond every measured block: what the
    plain block leaves of the step's time is shared between them in proportion to their guessed costs, so both
    are measured (one exploration, not one per plan in ``EXPLORE_EVERY`` for as long as the step repeats)."""
    costs = CostModel()
    for width in range(1, 10):
        costs.observe_verify(width, _compute_bound(width))
    costs.observe_verify(1, _compute_bound(16), batch=16)
    shapes = [(16, 1), (3, 6), (8, 6)]
    assert [costs.extrapolated(tokens, rows) for rows, tokens in shapes] == [False, True, True]
    guesses = [costs.verify_cost(6, 3), costs.verify_cost(6, 8)]
    costs.observe_split(shapes, _compute_bound(16) + 0.6, 16)
    assert costs.verify[(3, 6)] == pytest.approx(0.6 * guesses[0] / sum(guesses))
    assert costs.verify[(8, 6)] == pytest.approx(0.6 * guesses[1] / sum(guesses))
    assert not costs.extrapolated(6, 3) and not costs.extrapolated(6, 8)


def test_a_block_between_measured_batch_sizes_is_priced_not_explored():
    """A 12 x 8 block of a ragged step lies between the measured 8 x 8 and 16 x 8 blocks: its cost is
    interpolated, not guessed, so the plan does not explore it at the growth prior's price (where a wide block
    costs several plain steps of a full batch, each such exploration would cost those steps)."""
    costs = CostModel()
    for batch in (1, 8, 16):
        for width in range(1, 10):
            costs.observe_verify(width, 0.01 * batch * width, batch)
    assert not costs.extrapolated(8, 12) and costs.extrapolated(10, 16) and costs.extrapolated(8, 20)
    assert costs.verify_cost(8, 12) == pytest.approx(0.96)
    # 12 x 10 is wider than any block measured between those batch sizes, but its 120 tokens are fewer than the
    # 144 of a measured 16 x 9 block: priced by its token count, not guessed
    assert not costs.extrapolated(10, 12) and costs.verify_cost(10, 12) == pytest.approx(1.2)
    rows = [RowPlan(_policy(0.8, 0.8), None, 8) for _ in range(12)] + [RowPlan(None) for _ in range(4)]
    assert equal_split([9] * 12 + [1] * 4) == [(16, 1), (12, 8)]
    assert all(plan(rows, costs, equal_split) == [0] * 16 for _ in range(2 * EXPLORE_EVERY))


def _compute_bound(tokens: int) -> float:
    """Seconds for a block of ``tokens`` tokens (any rows) where every token after the first costs a third of
    a one-row step (the embedded model on the 2-core AMD EPYC VM: 15 ms, then about 5 ms a token)."""
    return 0.015 + 0.005 * (tokens - 1)


def test_a_batch_size_with_only_its_plain_step_measured_is_priced_by_token_count():
    """An engine calibrated at one row (widths 1-9, as ``genspec.load`` does) that then runs 16 rows has timed
    only their plain step. Priced by one row's relative curve, 16 rows of 9 tokens would cost 3.4 plain steps of
    16 rows (its 9-token block's 0.055 s over 0.015) and look worth drafting; priced by their 144 tokens they
    cost 8.7, their real cost on a machine whose matrix products are already compute-bound. Over 64 plans of
    16 rows whose free drafts are kept at 0.7 / 0.8, the plan explores one wide block at most (the widest, at
    the growth prior's price: once measured, every block of fewer tokens is priced by interpolation), and the
    steps cost no more than plain decoding's and that one block."""
    costs = CostModel()
    for width in range(1, 10):
        costs.observe_verify(width, _compute_bound(width))
    costs.observe_verify(1, _compute_bound(16), batch=16)
    assert costs.verify_cost(9, 16) == pytest.approx(_compute_bound(16) + 128 * 0.005)
    rows = [RowPlan(_policy(0.7, 0.8, costs), "match", 8) for _ in range(16)]
    seconds, drafting = 0.0, 0
    for _ in range(64):
        lengths = plan(rows, costs, equal_split)
        shapes = equal_split([1 + k for k in lengths])
        step = sum(_compute_bound(n * w) for n, w in shapes)
        seconds, drafting = seconds + step, drafting + any(lengths)
        if len(shapes) > 1:
            costs.observe_split(shapes, step, 16)
        else:
            costs.observe_verify(shapes[0][1], step, 16)
    assert drafting <= 1
    assert seconds <= 64 * _compute_bound(16) + _compute_bound(16 * 9) + 1e-9


def test_a_width_is_priced_against_the_plain_step_it_was_timed_beside():
    """Plain steps are timed every step, wider blocks rarely: when the plain step's cost doubles (longer
    contexts, a slower shared machine), a width timed before is priced at double too, so drafting does not look
    cheap only because the plain step it is compared with was timed later."""
    costs = CostModel(decay=0.0)  # each observation replaces the last: the figures below are exact
    costs.observe_verify(1, 0.10, 16)
    costs.observe_verify(3, 0.30, 16)
    assert costs.relative(3, 16) == pytest.approx(3.0)
    costs.observe_verify(1, 0.20, 16)  # the plain step is now twice as dear
    assert costs.verify_cost(3, 16) == pytest.approx(0.60)
    assert costs.relative(3, 16) == pytest.approx(3.0)
    costs.observe_verify(3, 0.40, 16)  # timed again beside the 0.20 s plain step
    assert costs.verify_cost(3, 16) == pytest.approx(0.40) and costs.relative(3, 16) == pytest.approx(2.0)


def test_cost_model_interpolates_between_batch_sizes():
    costs = CostModel()
    costs.observe_verify(1, 0.08, batch=8)
    costs.observe_verify(1, 0.16, batch=16)
    assert costs.verify_cost(1, batch=12) == pytest.approx(0.12)
    assert costs.verify_cost(1, batch=10) == pytest.approx(0.10)
    costs.observe_verify(1, 0.20, batch=16)  # an observation prices again
    assert costs.verify_cost(1, batch=12) == pytest.approx(0.08 + 0.5 * (0.8 * 0.16 + 0.2 * 0.20 - 0.08))


def test_equal_split_takes_the_same_tokens_from_every_row_left():
    assert equal_split([5, 2, 1, 1]) == [(4, 1), (2, 1), (1, 3)]
    assert equal_split([3, 3]) == [(2, 3)]
    assert equal_split([1]) == [(1, 1)]
    assert equal_split([0, 2]) == [(1, 2)]
    assert equal_split([]) == []
    assert sum(rows * tokens for rows, tokens in equal_split([7, 1, 4, 4, 2])) == 18  # every token once


def test_equal_split_runs_only_rows_whose_sequences_are_consecutive():
    """llama.cpp's sequential split: a micro-batch is a run of consecutive sequence ids, each with tokens left."""
    assert equal_split([5, 1, 5]) == [(3, 1), (1, 4), (1, 4)]  # the middle row ran out: no run of the outer two
    assert equal_split([1, 1, 1], sequences=[0, 1, 3]) == [(2, 1), (1, 1)]  # sequence 2 missing
    assert equal_split([1, 1, 1], sequences=[2, 0, 1]) == [(3, 1)]  # the batch holds them in id order
    assert equal_split([0, 4, 4], sequences=[1, 0, 2]) == [(1, 4), (1, 4)]  # sequence 1 has no tokens


def test_a_costly_drafter_drafts_only_for_rows_that_pay_its_time():
    costs = _costs(step=0.1, per_token=0.002)
    draft_cost = DraftCost()
    draft_cost.observe(positions=1, seconds=0.03)
    rows = [RowPlan(_policy(0.95, 0.95), None, 8, draft_cost), RowPlan(_policy(0.01, 0.5), None, 8, draft_cost)]
    sure_only = plan(rows, costs)
    assert sure_only[0] > 0
    weak_alone = plan([RowPlan(_policy(0.01, 0.5), None, 8, draft_cost), RowPlan(None)], costs)
    assert weak_alone == [0, 0]


def test_a_tree_is_priced_by_its_nodes_so_its_shallow_drafts_are_not_cheap():
    """A head drafting a 4-node tree verifies a 5-token block at every depth: a one-token draft costs the
    verify of a four-deep one, so the plan drafts the tree deeper than it would a chain with the same
    acceptance. Block cost 1 + 0.1 per token (plain steps), a draft position 0.076, first / later 0.6:
    the chain's rates peak at depth 2 (1.96 / 1.35), the tree's (block 5 at every depth) at depth 4
    (2.31 / 1.70 against 1.60 / 1.48 at depth 1)."""
    costs = _costs(step=0.1, per_token=0.01)
    draft_cost = DraftCost(prior_steps=0.076)
    chain = RowPlan(_policy(0.6, 0.6, k_max=4), None, 4, draft_cost)
    tree = RowPlan(_policy(0.6, 0.6, k_max=4), None, 4, draft_cost, block=lambda depth: 4)
    assert plan([chain], costs) == [2]
    assert plan([tree], costs) == [4]
    assert tree.width(0) == 0 and tree.width(1) == 4 and chain.width(3) == 3


def test_a_drafts_reading_is_priced_once_and_its_positions_each():
    """A head with token layers reads the tokens just committed before it drafts (0.18 of a plain step, as
    the fused + 3-token-layer head measured) and then pays 0.04 a position: a 3-deep draft costs 0.30, not
    3 x 0.22. Priced so, its 4-node tree (a 5-token block at every depth, 1.02 plain steps; first / later
    0.6 / 0.45) is drafted 3 deep (rates 1.29 / 1.46 / 1.51 / 1.51 at depths 1-4); with the same 0.22 of a
    one-token draft priced per position (one measurement mixing the two, as before), 1 deep (1.29 / 1.28 /
    1.19 / 1.08)."""
    costs = _costs(step=0.1, per_token=0.0005)
    step = costs.verify_cost(1)
    split, mixed = DraftCost(), DraftCost()
    split.observe(1, 0.004, read_seconds=0.018)
    mixed.observe(1, 0.022)
    assert split.draft_steps(step, 3) == pytest.approx(0.18 + 3 * 0.04)
    assert mixed.draft_steps(step, 3) == pytest.approx(3 * 0.22)
    assert split.draft_steps(step, 0) == 0.0
    tree = lambda depth: 4  # noqa: E731
    assert plan([RowPlan(_policy(0.6, 0.45, k_max=4), None, 4, split, block=tree)], costs) == [3]
    assert plan([RowPlan(_policy(0.6, 0.45, k_max=4), None, 4, mixed, block=tree)], costs) == [1]


def test_a_trees_probe_is_priced_by_its_first_level():
    """A one-token probe of a 4-node tree verifies its 4 first tokens: a 5-token block (1.4 plain steps
    here against 1.1 for a chain's 2), so it is priced, and waited for, accordingly."""
    costs = _costs(step=0.1, per_token=0.01)
    chain = DraftLength("cost", k_max=4, cost_model=costs, draft_cost=DraftCost(prior_steps=0.05))
    tree = DraftLength("cost", k_max=4, cost_model=costs, draft_cost=DraftCost(prior_steps=0.05), probe_tokens=4)
    assert chain.probe_price() == pytest.approx(0.15) and tree.probe_price() == pytest.approx(0.45)
    assert (chain.probe_wait(), tree.probe_wait()) == (5, 15)  # their prices over PROBE_SHARE (3%)


def test_fixed_rows_draft_their_own_k_and_cost_rows_join_when_it_pays():
    costs = _costs(step=0.1, per_token=0.5)  # a block token costs half a plain step
    fixed = DraftLength("fixed", k_max=5, cost_model=costs)
    lengths = plan([RowPlan(fixed, None, 8), RowPlan(_policy(0.3, 0.3, costs), None, 8), RowPlan(None)], costs)
    assert lengths[0] == 5 and lengths[2] == 0
    assert lengths[1] in (0, 5)  # free tokens in a 6-wide block: it drafts if its gain is positive
    assert plan([RowPlan(_policy(0.3, 0.3, costs), None, 8), RowPlan(None), RowPlan(None)], costs) == [0, 0, 0]


def test_cost_model_interpolates_extrapolates_and_prices_other_batches_by_token_count():
    costs = CostModel()
    costs.observe_verify(1, 0.1, batch=4)
    costs.observe_verify(3, 0.3, batch=4)
    assert costs.verify_cost(2, batch=4) == pytest.approx(0.2)  # interpolated
    # extrapolated from widths 1 and 3 alone: the measured slope or the growth prior's, the lower
    assert costs.verify_cost(5, batch=4) == pytest.approx(0.3 + 2 * 0.1 * 0.1)
    costs.observe_verify(4, 0.35, batch=4)  # two widths >= 2: their own slope
    assert costs.verify_cost(6, batch=4) == pytest.approx(0.45)
    assert costs.relative(3, batch=4) == pytest.approx(3.0)
    # a plain step only: priced by token count, 24 tokens beyond the measured 4 (0.1 s), 8 (0.2: this plain
    # step), 12 (0.3) and 16 (0.35): their least-squares slope, 0.02125 s per token
    costs.observe_verify(1, 0.2, batch=8)
    assert costs.token_curve() == {4: 0.1, 8: 0.2, 12: 0.3, 16: 0.35}
    assert costs.verify_cost(3, batch=8) == pytest.approx(0.35 + 8 * 0.02125)
    assert costs.relative(3, batch=8) == pytest.approx((0.35 + 8 * 0.02125) / 0.2)
    single = CostModel()
    single.observe_verify(1, 0.1)
    assert single.relative(3) == pytest.approx(1.2)  # nothing to borrow: the growth prior


def test_a_slow_sample_does_not_make_a_width_dearer_than_a_wider_one():
    """Noise only adds time: a width measured slower than a wider one costs what the wider one did,
    so the plan can still pick it (and correct it by observing it)."""
    costs = CostModel()
    for width, seconds in ((1, 0.068), (2, 0.113), (3, 0.183), (5, 0.153), (9, 0.209)):
        costs.observe_verify(width, seconds, batch=4)
    assert costs.verify_cost(3, 4) == pytest.approx(0.153)
    assert costs.verify_cost(2, 4) == pytest.approx(0.113)
    assert costs.verify_cost(4, 4) == pytest.approx(0.153)
    for _ in range(5):  # observed again (cheaper): its own running average takes over
        costs.observe_verify(3, 0.090, batch=4)
    assert costs.verify_cost(3, 4) == pytest.approx(0.8 ** 5 * 0.183 + (1 - 0.8 ** 5) * 0.090)


# ------------------------------------------------------------------------------ a first sample that misleads
# On the 2-core Intel Xeon VM the embedded model verified 1 token in 48 ms, 2 in 121 ms and 3 to 9 in
# 103-124 ms (``python benchmarks/costs/verify_width_cost.py``): the 2-token block is a jump, not a slope.
FIRST_SAMPLE = {1: 0.048, 2: 0.121}
LATER_WIDTHS = {3: 0.103, 4: 0.124, 5: 0.112, 6: 0.110, 7: 0.118, 8: 0.120, 9: 0.114}


def _observed(widths: dict[int, float]) -> CostModel:
    costs = CostModel()
    for width, seconds in widths.items():
        costs.observe_verify(width, seconds)
    return costs


def test_a_slope_steeper_than_a_plain_step_is_not_extrapolated():
    """1 -> 2 tokens costing 73 ms more than a 48 ms plain step is a jump: beyond width 2 each token adds
    the growth prior's 0.1 plain step, not 73 ms (which priced 9 tokens at 632 ms)."""
    costs = _observed(FIRST_SAMPLE)
    assert costs.verify_cost(9) == pytest.approx(0.121 + 7 * 0.1 * 0.048)
    assert costs.relative(5) == pytest.approx((0.121 + 3 * 0.1 * 0.048) / 0.048)
    gentle = _observed({1: 0.048, 2: 0.060})  # 1 -> 2 alone: the lower of its slope and the prior's
    assert gentle.verify_cost(9) == pytest.approx(0.060 + 7 * 0.0048)
    flat = _observed({1: 0.048, 2: 0.049})
    assert flat.verify_cost(9) == pytest.approx(0.049 + 7 * 0.001)


def test_the_jump_from_one_token_to_two_is_not_extrapolated_as_a_per_token_cost():
    """Widths 1, 2 and 4 measured on the Xeon VM at T 0.7 (50, 92, 127 ms): beyond 4 the slope is that of
    widths 2 and 4 (17.5 ms per token; 9 tokens: 214 ms), not the least-squares slope through width 1
    (24 ms per token: 248 ms); 9 tokens measured 143 ms there, so even this errs on the dear side."""
    costs = _observed({1: 0.050, 2: 0.092, 4: 0.127})
    assert costs.verify_cost(9) == pytest.approx(0.127 + 5 * 0.0175)


def test_a_sure_draft_is_drafted_wide_after_a_slow_two_token_block():
    """Acceptance 0.9: at 121 ms + 4.8 ms per token, 8 tokens pay (6.1 tokens for 3.2 plain steps)."""
    costs = _observed(FIRST_SAMPLE)
    assert plan([RowPlan(_policy(0.9, 0.9), None, 8)], costs) == [8]


def test_the_policy_explores_a_wider_width_within_a_bounded_number_of_steps():
    """Acceptance 0.6 / 0.6: with widths 3+ priced from the 121 ms 2-token block no draft pays (8 tokens:
    2.5 tokens for 3.2 plain steps), but at the growth prior's price (1.2 plain steps for 3 tokens) it would.
    The plan drafts an unmeasured wider width at once and then once in EXPLORE_EVERY plans, and not at
    all once measurements show it does not pay."""
    costs = _observed(FIRST_SAMPLE)
    policy = _policy(0.6, 0.6, costs)
    lengths = [plan([RowPlan(policy, None, 8)], costs)[0] for _ in range(2 * EXPLORE_EVERY)]
    explored = [k for k in lengths if k]
    assert lengths[0] >= 2  # at once: a block of 3 tokens or more
    assert len(explored) == 2 and all(k >= 2 for k in explored)  # then one plan in 16
    for width, seconds in LATER_WIDTHS.items():  # measured: 103-124 ms, too dear for acceptance 0.6
        costs.observe_verify(width, seconds)
    assert [plan([RowPlan(policy, None, 8)], costs)[0] for _ in range(2 * EXPLORE_EVERY)] == [0] * (2 * EXPLORE_EVERY)


def test_exploring_measures_the_widest_winning_block_so_one_exploration_prices_every_width():
    """Widths 1-3 measured dear (48, 121, 135 ms: the 2- and 3-token blocks of the Xeon VM at T 0.7), so
    their slope (14 ms per token) prices 9 tokens at 219 ms: no draft pays at acceptance 0.6 / 0.6. At
    the growth prior's price several unmeasured widths would; the plan explores the widest of them (8
    draft tokens), and once that is measured (146 ms) every narrower width is interpolated: no more
    exploring."""
    costs = _observed({1: 0.048, 2: 0.121, 3: 0.135})
    policy = _policy(0.6, 0.6, costs)
    assert plan([RowPlan(policy, None, 8)], costs) == [8]
    costs.observe_verify(9, 0.146)
    assert [plan([RowPlan(policy, None, 8)], costs)[0] for _ in range(2 * EXPLORE_EVERY)] == [0] * (2 * EXPLORE_EVERY)


def test_useless_drafts_are_never_explored():
    costs = _observed(FIRST_SAMPLE)
    policy = _policy(0.05, 0.5, costs)
    assert [plan([RowPlan(policy, None, 8)], costs)[0] for _ in range(4 * EXPLORE_EVERY)] == [0] * (4 * EXPLORE_EVERY)


def test_measured_wider_blocks_cheaper_than_the_extrapolation_are_used():
    """Once widths 3-9 are measured (103-124 ms), a 0.8 / 0.8 draft is drafted long even though its
    first sample's 2-token block was dearer than all of them."""
    costs = _observed(FIRST_SAMPLE)
    for width, seconds in LATER_WIDTHS.items():
        costs.observe_verify(width, seconds)
    assert costs.verify_cost(2) == pytest.approx(0.103)  # no dearer than the wider 3-token block
    policy = _policy(0.8, 0.8, costs)
    rates = {k: policy.expected_tokens(k) / (costs.verify_cost(k + 1) / 0.048) for k in range(1, 9)}
    assert plan([RowPlan(policy, None, 8)], costs) == [max(rates, key=rates.get)]
    assert max(rates, key=rates.get) >= 2


def test_an_engine_whose_first_sample_is_a_slow_two_token_block_still_drafts():
    """The engine starts with w1 = 48 ms, w2 = 121 ms measured (what kept the suffix drafter from
    drafting in a whole benchmark); an always-right free drafter must still get wide blocks verified.
    Costs are synthetic (the VM's, by width) so the test does not read this machine's clock."""
    true_costs = {**FIRST_SAMPLE, **LATER_WIDTHS}

    class Synthetic(CostModel):
        def observe_verify(self, width, seconds, batch=1):
            super().observe_verify(width, true_costs[width], batch)

    costs = Synthetic()
    for width, seconds in FIRST_SAMPLE.items():
        costs.observe_verify(width, seconds)
    target, prompt, plain = _plain_run(40)
    result = SpeculativeEngine(target, _oracle(prompt[0], plain), cost_model=costs).generate_ids(
        prompt, max_new_tokens=40, eos_token_ids=(), num_draft_tokens=8)[0]
    assert result.token_ids == plain
    assert result.stats.drafted_per_position[2] > 0  # blocks of 4 tokens or more were verified
    assert result.stats.target_calls <= 20  # 40 tokens in at most 20 calls: drafting, not plain decoding


@pytest.mark.parametrize("declared_block", [None, 8])
def test_the_engine_prices_a_costly_drafters_draft_by_the_block_it_declares(declared_block):
    """An always-right costly drafter whose every draft, whatever its depth, fills a 9-token block when it
    says so (a tree of 8 nodes), on a machine where 9 tokens cost 10 plain steps and 2-5 tokens barely
    more than one (synthetic costs, not this machine's clock): priced as the chain it would be, it drafts
    at most steps; priced by the block it declares, neither drafting nor probing pays."""
    true_costs = {1: 0.050, 2: 0.052, 3: 0.053, 4: 0.054, 5: 0.055, 9: 0.5}

    class Synthetic(CostModel):
        def observe_verify(self, width, seconds, batch=1):
            super().observe_verify(width, true_costs.get(width, 0.5), batch)

    costs = Synthetic()
    for width, seconds in true_costs.items():
        costs.observe_verify(width, seconds)
    target, prompt, plain = _plain_run(40)
    oracle = _oracle(prompt[0], plain, free=False,
                     block=None if declared_block is None else lambda depth: declared_block if depth else 0)
    result = SpeculativeEngine(target, oracle, cost_model=costs).generate_ids(
        prompt, max_new_tokens=40, eos_token_ids=(), num_draft_tokens=4)[0]
    assert result.token_ids == plain
    drafting_steps = (result.stats.drafted_per_position or [0])[0]
    if declared_block is None:
        assert drafting_steps >= result.stats.target_calls - 2
    else:  # a probe costs 9 plain steps here, so none is due within 40 tokens (PROBE_SHARE: 300 idle steps)
        assert drafting_steps == 0 and result.stats.target_calls == 40


def test_the_first_verify_of_each_block_shape_is_not_taken_for_its_price():
    """A shape's first call pays one-time costs (kernels picked, weights packed), so the engine's cost model
    is told every verify time but the first of each (batch, width): an always-right draft of 2 tokens
    verifies 3-token blocks, and all of them but the first are measured."""
    observed: list[int] = []

    class Recording(CostModel):
        def observe_verify(self, width, seconds, batch=1):
            observed.append(width)
            super().observe_verify(width, seconds, batch)

    target, prompt, plain = _plain_run(20)
    engine = SpeculativeEngine(target, _oracle(prompt[0], plain), cost_model=Recording())
    widths = []
    engine.add_request(prompt[0], GenerationConfig(max_new_tokens=20, num_draft_tokens=2, draft_length="fixed",
                                                   eos_token_ids=()))
    while engine.has_unfinished():
        widths.append(engine.step().block_width)
    widths = [w for w in widths if w]
    assert widths.count(3) >= 3
    for width in set(widths):
        assert observed.count(width) == widths.count(width) - 1


def test_a_new_request_starts_from_what_earlier_requests_saw_of_each_evidence_level():
    from genspec.draft_length import AcceptanceMemory

    memory = AcceptanceMemory()
    first = DraftLength("cost", k_max=8, memory=memory)
    for _ in range(20):
        first.update(drafted=4, accepted=0, evidence=1)  # weak lookups: always wrong
        first.update(drafted=4, accepted=4, evidence=4)  # strong ones: always right
    fresh = DraftLength("cost", k_max=8)
    later = DraftLength("cost", k_max=8, memory=memory)
    assert fresh.estimate(1).rate_first == pytest.approx(0.5)
    assert later.estimate(1).rate_first < 0.05
    assert later.estimate(4).rate_first > 0.95 and later.estimate(4).rate_later > 0.95
    assert memory.rates("never seen") == (None, None)
    later.shadow([7], [8], evidence=2)  # shadows teach the memory too
    assert memory.rates(2) == (0.0, None)


def test_an_engine_does_not_pay_again_for_weak_drafts_an_earlier_request_showed_to_fail():
    """The weak proposals of the Oracle below are always wrong. A fresh engine verifies a few of them
    before its estimate drops; the same engine's next request starts from that experience and verifies
    none (a free drafter's unverified proposals are scored all the same). Outputs equal plain decoding."""
    from genspec.drafters.base import Draft, Drafter, DrafterCapabilities

    class Synthetic(CostModel):
        def observe_verify(self, width, seconds, batch=1):
            super().observe_verify(width, 1 + 0.1 * (width - 1), batch)

    target, prompt, plain = _plain_run(40)

    class Oracle(Drafter):
        name, capabilities = "oracle", DrafterCapabilities(free=True)

        def propose(self, requests):
            done = len(requests[0].sequence) - len(prompt[0])
            truth = plain[done:done + requests[0].max_tokens]
            strong = done % 3 == 0
            return Draft.from_chains([[truth if strong else [(t + 1) % 256 for t in truth]]],
                                     evidence=[4 if strong else 1])

    engine = SpeculativeEngine(target, Oracle(), cost_model=Synthetic())

    def weak_drafts_verified() -> int:
        result = engine.generate_ids(prompt, max_new_tokens=40, eos_token_ids=(), num_draft_tokens=4)[0]
        assert result.token_ids == plain
        return result.stats.drafted_per_position[0] - result.stats.accepted_per_position[0]

    assert weak_drafts_verified() >= 1
    assert weak_drafts_verified() == 0


def test_acceptance_rates_stay_probabilities_when_every_draft_is_kept():
    """Discounted counts round separately: with every draft kept, 'accepted / tested' rounded to
    1.0000000000000002 in the memory, the next request's estimate started above 1 and Leviathan's formula
    refused it, failing every later request of the suffix drafter in a repeated-traffic benchmark."""
    from genspec.draft_length import Acceptance, AcceptanceMemory

    memory = AcceptanceMemory()
    for i in range(2000):
        drafted = (3, 7, 9, 12, 5)[i % 5]
        memory.record(16, drafted, drafted)
        first, later = memory.rates(16)
        assert 0.0 <= first <= 1.0 and 0.0 <= later <= 1.0
    policy = DraftLength("cost", 24, memory=memory)
    assert policy.estimate(16).rate_later <= 1.0
    assert policy.expected_tokens(24, 16) == pytest.approx(25.0)  # all kept: 1 + 24
    counts = Acceptance(0.0, 0.0, 0.0, 0.98)
    for i in range(2000):
        counts.record((3, 7, 9)[i % 3], (3, 7, 9)[i % 3])
        assert counts.rate_later <= 1.0 and counts.expected_tokens(8) <= 9.0


def test_an_unmeasured_costly_drafter_is_priced_at_its_prior_not_free():
    """A new engine knows nothing of its drafter's cost. Priced at nothing, its first step drafted as if the
    drafter were free (early exit and layer skip, accepting nothing, ran at 0.82-0.88x plain on 32-token
    answers on a fresh engine: ``python benchmarks/policy/fresh_request_cost.py``). At the prior (half a plain
    step per position) the prior acceptance does not pay: no blind draft, a one-token probe later; once
    measured cheap, the same acceptance drafts."""
    costs = CostModel()
    costs.observe_verify(1, 0.1)
    free, costly = DraftLength("cost", 8, costs), DraftLength("cost", 8, costs, DraftCost())
    assert free.limit(probe=False) > 0  # the prior acceptance pays for a drafter that costs nothing
    assert costly.limit(probe=False) == 0
    assert [costly.limit() for _ in range(20)] == [0] * 19 + [1]  # a probe costs 0.5 + 0.1 steps: after 20 idle ones
    assert DraftCost().steps(0.1) == 0.5
    cheap = DraftCost()
    cheap.observe(positions=4, seconds=0.04)  # a tenth of a plain step per position
    assert cheap.steps(0.1) == pytest.approx(0.1)
    assert DraftLength("cost", 8, costs, cheap).limit(probe=False) > 0


def test_a_probe_is_made_only_when_its_reading_costs_a_tenth_of_the_time_left_at_most():
    """A probe of a switched-off costly drafter pays its draft position and the prompt tokens the drafter
    has not read, each at the drafter's cost per position (prefill per token measured by the target).
    Plain step 0.1 s, prefill 2 ms per token (a fiftieth of a step), prior 0.5 step per position: a
    60-token prompt costs 0.5 x (1 + 1.2) = 1.1 steps, affordable with 11 tokens left or more; a 1,500-token
    prompt costs 15.5 steps, not affordable within a 128-token answer."""
    costs = CostModel()
    costs.observe_verify(1, 0.1)
    costs.observe_prefill(500, 1.0)
    prior = DraftCost()
    assert probe_affordable(prior, costs, 1, read_tokens=60, room=11)
    assert not probe_affordable(prior, costs, 1, read_tokens=60, room=10)
    assert not probe_affordable(prior, costs, 1, read_tokens=1500, room=128)
    assert probe_affordable(prior, costs, 1, read_tokens=1500, room=160)
    assert probe_affordable(prior, costs, 1, read_tokens=0, room=5)  # a drafter that is up to date: its position
    unmeasured = CostModel()  # nothing known: the probe is not refused
    assert probe_affordable(prior, unmeasured, 1, read_tokens=10_000, room=1)


def test_decide_probes_a_switched_off_costly_row_when_affordable_and_never_a_free_one():
    """``decide``: the plan, then the cost policy's probes (as ``limit`` makes them for one request alone): a
    costly row the plan switched off drafts one token after 20 idle steps (a probe costs 0.5 + 0.1 steps) if
    its reading is affordable, asked only then; never if it is not (a million tokens to read); a free row
    that proposed nothing is not probed; a fixed policy's costly row drafts its k (up to its cap), unprobed."""
    costs = CostModel()
    costs.observe_verify(1, 0.1)
    costs.observe_verify(2, 0.11)  # a 2-token block: 1.1 plain steps
    costs.observe_verify(1, 0.1, batch=3)
    asked = []

    def reading(tokens):
        return lambda: asked.append(tokens) or tokens

    rows = [RowPlan(DraftLength("cost", 8, costs, DraftCost()), None, 8, DraftCost(), None, 8, reading(0)),
            RowPlan(DraftLength("cost", 8, costs, DraftCost()), None, 8, DraftCost(), None, 8, reading(10 ** 6)),
            RowPlan(DraftLength("cost", 8, costs), None, 0, None, None, 8, reading(0))]
    steps = [decide(rows, costs) for _ in range(20)]
    assert steps == [[0, 0, 0]] * 19 + [[1, 0, 0]]
    assert asked == [0, 10 ** 6]  # each costly row's reading asked once, when its probe was due
    tight = RowPlan(DraftLength("fixed", 8, costs), None, 3, DraftCost(), None, 3)
    assert decide([tight], costs) == [3]


def test_a_draft_model_reads_a_prompt_at_its_first_draft_and_a_useless_one_is_not_probed_on_a_short_answer():
    """The draft model's rows start empty (``catch_up_tokens`` is the whole sequence) and catch up when it
    drafts; an engine whose plan never drafts and whose probes are unaffordable (a long prompt, a short
    answer) never runs the draft model at all, and its output is plain decoding's."""
    target = HFCausalLM(tiny_llama(seed=3))
    drafter = DraftModelDrafter(HFCausalLM(tiny_llama(seed=4)))
    prompt = [(7 * i) % 60 + 3 for i in range(200)]
    plain = SpeculativeEngine(target).generate_ids([prompt], max_new_tokens=12, eos_token_ids=())[0]
    engine = SpeculativeEngine(target, drafter)
    request = engine.add_request(prompt, max_new_tokens=12, eos_token_ids=())
    tokens, drafted = [], 0
    while engine.has_unfinished():
        step = engine.step().requests[request]
        tokens += step.new_tokens
        drafted += step.drafted
        if step.finish_reason is None:
            assert drafter.catch_up_tokens(request, prompt) == len(prompt)  # nothing read
    assert tokens == plain.token_ids and drafted == 0
    # the same drafter forced to draft reads the prompt then, and is up to date after its draft
    fixed = engine.generate_ids([prompt], max_new_tokens=12, eos_token_ids=(), draft_length="fixed")[0]
    assert fixed.token_ids == plain.token_ids and fixed.stats.drafted_tokens > 0
    drafter.start([RequestContext(99, prompt)])
    assert drafter.catch_up_tokens(99, prompt) == len(prompt)
    drafter.propose([DraftRequest(99, prompt, 2)])
    assert drafter.catch_up_tokens(99, prompt) <= 1  # (the last token is fed again with the next draft)
    drafter.finish([99])


def test_the_engine_times_a_drafters_reading_apart_from_its_positions():
    """The engine calls :meth:`Drafter.read` before ``propose`` on the same rows and hands its time to the
    drafter's cost apart (priced once per draft): a costly oracle whose reading sleeps 20 ms and whose
    drafting does not is recorded with at least 20 ms of reading at every draft."""
    import time

    target, prompt, plain = _plain_run(12)
    oracle = _oracle(prompt[0], plain, free=False)
    calls: list[tuple[str, list[int]]] = []
    propose = oracle.propose

    def read(requests):
        calls.append(("read", [r.request_id for r in requests]))
        time.sleep(0.02)

    def proposing(requests):
        calls.append(("propose", [r.request_id for r in requests]))
        return propose(requests)

    oracle.read, oracle.propose = read, proposing
    engine = SpeculativeEngine(target, oracle)
    observed: list[tuple[int, float, float]] = []

    class Spy(DraftCost):
        def observe(self, positions, seconds, read_seconds=0.0):
            observed.append((positions, seconds, read_seconds))
            super().observe(positions, seconds, read_seconds)

    engine.draft_costs["oracle"] = Spy(prior_steps=0.01)
    result = engine.generate_ids(prompt, max_new_tokens=12, eos_token_ids=(), num_draft_tokens=3,
                                 draft_length="fixed")[0]
    assert result.token_ids == plain
    assert observed and all(read_seconds >= 0.02 for _, _, read_seconds in observed)
    assert [name for name, _ in calls] == ["read", "propose"] * len(observed)
    assert engine.draft_costs["oracle"].per_read >= 0.02


def test_a_kept_branch_with_no_child_tests_no_later_position():
    """A tree of two first tokens, a wrong one with a child and the right one alone: every step keeps the
    right first token, whose branch drafted nothing after it, so no later position was tested (counted as
    missed, the tree's other, deeper branch made the later-position rate fall to nothing). Its chain twin,
    the right token then a wrong one, tests (and misses) the second position at every step."""
    from genspec.drafters.base import Draft, Drafter, DrafterCapabilities

    target, prompt, plain = _plain_run(12)

    class Branches(Drafter):
        name, capabilities = "oracle", DrafterCapabilities(max_candidates=2)

        def __init__(self, tree: bool):
            self.tree = tree

        def propose(self, requests):
            done = len(requests[0].sequence) - len(prompt[0])
            right = plain[done]
            wrong = (right + 1) % 256
            chains = [[wrong, right], [right]] if self.tree else [[right, wrong]]
            return Draft.from_chains([chains], num_chains=2)

    for tree in (True, False):
        engine = SpeculativeEngine(target, Branches(tree))
        result = engine.generate_ids(prompt, max_new_tokens=12, eos_token_ids=(), num_draft_tokens=2,
                                     draft_length="fixed")[0]
        assert result.token_ids == plain and result.stats.accepted_per_position[0] == result.stats.target_calls
        seen = engine.acceptance_memory[("oracle", True)].levels[None]
        assert seen.rate_first == 1.0
        assert (seen.later[1] == 0) if tree else (seen.later[1] > 0 and seen.later[0] == 0)


def test_a_drafter_is_offered_no_more_room_than_its_policy_can_plan():
    """The room a free drafter is asked to fill is the request's budget capped at its policy's k_max: a
    500-token budget with k = 6 asks for at most 6 tokens (a lookup asked for the whole budget copied
    continuations of hundreds of tokens, all cut to k_max but those); near the end, the budget caps it."""
    from genspec.drafters.base import Draft, Drafter, DrafterCapabilities

    target, prompt, _ = _plain_run(1)
    asked: list[int] = []

    class Recording(Drafter):
        name, capabilities = "recording", DrafterCapabilities(free=True)

        def propose(self, requests):
            asked.extend(r.max_tokens for r in requests)
            return Draft.from_chains([[[7] * r.max_tokens] for r in requests])

    engine = SpeculativeEngine(target, Recording())
    engine.generate_ids(prompt, max_new_tokens=500, num_draft_tokens=6, eos_token_ids=())
    assert asked and max(asked) == 6
    asked.clear()
    engine.generate_ids(prompt, max_new_tokens=4, num_draft_tokens=6, eos_token_ids=())
    assert asked[0] == 3  # 4 tokens left: 3 drafts and the token after them


# ------------------------------------------------------------------------------ prices are never zero
_SHAPES = st.tuples(st.integers(1, 16), st.integers(1, 17))  # (rows, tokens)
_OBSERVATION = st.one_of(
    st.tuples(st.just("verify"), _SHAPES, st.floats(1e-6, 1.0)),
    st.tuples(st.just("split"), st.lists(_SHAPES, min_size=2, max_size=4), st.floats(1e-6, 1.0)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_OBSERVATION, min_size=1, max_size=12))
def test_no_measured_timings_make_a_block_free(observations):
    """Whatever positive timings the engine observed (a tiny model's steps are noisy microseconds: a wide block
    can be timed ten times a narrow one), every block the cost model prices costs more than nothing, so a plan's
    rate (expected tokens over the step's cost) is always defined. A price of zero once failed a server's step
    with a division by zero."""
    costs = CostModel()
    for kind, shape, seconds in observations:
        if kind == "verify":
            rows, tokens = shape
            costs.observe_verify(tokens, seconds, batch=rows)
        else:
            costs.observe_split(shape, seconds, batch=sum(rows for rows, _ in shape))
    for batch in (1, 2, 3, 4, 7, 8, 16):
        for width in (1, 2, 3, 5, 9, 17):
            price = costs.verify_cost(width, batch)
            assert price is None or price > 0, (width, batch, price)
            assert costs.relative(width, batch) > 0, (width, batch)
        assert costs.shapes_relative([(1, 5), (batch, 1)], batch + 1) > 0
        assert costs.shapes_relative([(batch, 3), (2, 9)], batch + 2) > 0
