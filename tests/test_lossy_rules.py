"""Lossy acceptance rules (issue 17): honesty (only the standard rule is lossless; UNO at eps 0 is not),
Medusa's typical acceptance as a rule of genspec.acceptance usable by every drafter, and the engine's
bias measurement (GenerationConfig.measure_bias) against the exact laws of tiny models."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_helpers import chi_square_pvalue, lossless_pvalue
from tiny_models import peaked, tiny_llama

from genspec.acceptance import Rule, keep_probabilities, resampling_law, typical_threshold, verify_chain
from genspec.drafters import DraftModelDrafter, PromptLookupDrafter
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.randomness import Noise
from genspec.sampling import SamplingConfig, process_logits
from genspec.theory import pareto

SAMPLING = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)
PROMPT = [3, 5, 7]


# ------------------------------------------------------------------------------ honesty
def test_only_the_standard_rule_is_lossless():
    assert Rule("overaccept", 0.0, "opt").lossless
    assert not Rule("overaccept", 0.0, "uno").lossless  # UNO resamples from q: biased even at eps 0
    assert not Rule("overaccept", 0.1, "opt").lossless
    assert not Rule("typical", 0.0, "opt").lossless
    assert not Rule("overaccept", torch.tensor([0.0, 0.2]), "opt").lossless
    config = GenerationConfig(temperature=1.0, residual="uno")
    assert not config.lossless
    assert config.acceptance == {"rule": "overaccept", "epsilon": 0.0, "delta": None, "residual": "uno",
                                 "lossless": False}
    assert GenerationConfig().acceptance["lossless"] is True
    typical = GenerationConfig(temperature=1.0, rule="typical", epsilon=0.09)
    assert typical.acceptance["delta"] == 0.3 and typical.acceptance["lossless"] is False


@pytest.mark.parametrize("kwargs, message", [
    ({"epsilon": 0.1}, "temperature > 0"),
    ({"residual": "uno"}, "temperature > 0"),
    ({"rule": "typical"}, "temperature > 0"),
    ({"measure_bias": True}, "temperature > 0"),
    ({"rule": "nope", "temperature": 1.0}, "unknown acceptance rule"),
    ({"delta": -1.0, "temperature": 1.0}, "delta must be >= 0"),
    ({"epsilon": -0.1, "temperature": 1.0}, "epsilon must be >= 0"),
])
def test_bad_or_greedy_lossy_settings_are_config_errors(kwargs, message):
    """Greedy decoding is exact token matching: a lossy rule there would be silently ignored, so it is refused."""
    with pytest.raises(ConfigError, match=message):
        GenerationConfig(**kwargs)


def test_stats_carry_the_rule_and_lossless_flag(tiny_target):
    engine = SpeculativeEngine(tiny_target, PromptLookupDrafter())
    lossy = engine.generate_ids([[5, 6, 7, 5, 6]], max_new_tokens=6, temperature=1.0, seed=1, epsilon=0.2,
                                residual="uno")[0]
    assert lossy.stats.as_dict()["acceptance"] == {"rule": "overaccept", "epsilon": 0.2, "delta": None,
                                                   "residual": "uno", "lossless": False}
    plain = engine.generate_ids([[5, 6, 7, 5, 6]], max_new_tokens=6)[0].stats.as_dict()
    assert plain["acceptance"]["lossless"] is True and plain["bias"] is None


def test_opt_at_eps_zero_is_lossless_and_uno_at_eps_zero_is_not():
    """Chi-square of the joint law of 3 tokens against the exact target law (temperature 0.7, top-k 8,
    top-p 0.9), a draft model that samples its drafts: N = 20,000 sequences each, fail below p = 1e-3.
    OPT at eps 0 (standard SD) passes; UNO at eps 0 (min{1, q/p}, then resampling from q) fails."""
    def make(target):
        return DraftModelDrafter(HFCausalLM(peaked(tiny_llama(1, vocab=12, layers=1))))

    opt, acceptance = lossless_pvalue(make, SAMPLING, seed=21, layers=2, epsilon=0.0, residual="opt")
    uno, _ = lossless_pvalue(make, SAMPLING, seed=21, layers=2, epsilon=0.0, residual="uno")
    assert 0.05 < acceptance < 0.95  # rejections happen, so the residual matters
    assert opt > 1e-3
    assert uno < 1e-3


# ------------------------------------------------------------------------------ typical acceptance
def test_typical_keep_rule_is_medusas_formula():
    """keep y iff q(y) > min(eps, delta exp(-H(q))), H in nats; checked against NumPy on random laws."""
    rng = np.random.default_rng(3)
    target = rng.dirichlet(np.full(50, 0.3), size=20)
    draft = rng.dirichlet(np.ones(50), size=20)
    for eps, delta in ((0.09, 0.3), (0.01, 0.3), (0.5, 2.0)):
        entropy = -(target * np.log(target)).sum(-1)
        threshold = np.minimum(eps, delta * np.exp(-entropy))
        expected = (target > threshold[:, None]).astype(float)
        got = keep_probabilities(torch.from_numpy(target), torch.from_numpy(draft), Rule("typical", eps, delta=delta)).numpy()
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_allclose(typical_threshold(torch.from_numpy(target), eps, delta).numpy(), threshold,
                                   rtol=1e-12)
    # a point mass has entropy 0: the threshold is min(eps, delta)
    assert float(typical_threshold(torch.tensor([0.0, 1.0, 0.0]), 0.09, 0.3)) == pytest.approx(0.09)


@pytest.mark.parametrize("rule, epsilon, residual", [("typical", 0.09, "opt"), ("typical", 0.09, "uno"),
                                                     ("overaccept", 0.1, "uno")])
def test_verify_chain_samples_the_rules_predicted_law(rule, epsilon, residual):
    """N = 20,000 single-position verifications (V = 10) pass a chi-square test (threshold 1e-3) against
    the law the theory predicts for the rule, b p + R P (genspec.theory.pareto), and fail it against q."""
    rng = np.random.default_rng(0)  # a pair where every rule here is clearly biased (TV 0.27-0.45 from q)
    draft = torch.from_numpy(rng.dirichlet(np.full(10, 0.5)))
    target = torch.from_numpy(rng.dirichlet(np.full(10, 0.5)))
    n = 20_000
    generator = torch.Generator().manual_seed(7)
    tokens = torch.multinomial(draft, n, replacement=True, generator=generator).unsqueeze(1)
    rule = Rule(rule, epsilon, residual, 0.3)
    verdict = verify_chain(tokens, torch.stack([target, target]).expand(n, 2, 10), draft.expand(n, 1, 10), rule=rule,
                           noise=Noise(generator=generator))
    emitted = torch.where(verdict.accepted_length > 0, tokens[:, 0], verdict.next_token)
    counts = np.bincount(emitted.numpy(), minlength=10)
    keep = keep_probabilities(target, draft, rule)
    predicted = pareto.output_law(draft, keep, resampling_law(target, draft, rule)).numpy()
    assert chi_square_pvalue(counts, predicted) > 1e-3
    assert chi_square_pvalue(counts, target.numpy()) < 1e-3


def _drafters():
    def draft_model(target, num_drafts=1):
        return DraftModelDrafter(HFCausalLM(peaked(tiny_llama(1, vocab=12, layers=1))), num_drafts=num_drafts)

    return {
        "prompt-lookup (point masses)": lambda target: PromptLookupDrafter(max_ngram=1),
        "prompt-lookup tree": lambda target: PromptLookupDrafter(max_ngram=1, num_candidates=3),
        "draft-model chain": draft_model,
        "draft-model tree of 3": lambda target: draft_model(target, 3),
    }


@pytest.mark.parametrize("name", list(_drafters()))
def test_typical_acceptance_works_with_every_kind_of_draft(name):
    """Threshold 1 (eps = 1, huge delta) keeps nothing; threshold 0 (eps = 0) keeps every token the
    target gives any mass (no top-k / top-p here, so all of them): chains and trees, sampled and
    deterministic drafts go through the same rule."""
    target = HFCausalLM(peaked(tiny_llama(0, vocab=12)))
    engine = SpeculativeEngine(target, _drafters()[name](target))
    prompt = [3, 5, 3, 5, 3, 5, 7]
    common = dict(max_new_tokens=24, num_draft_tokens=3, temperature=1.0, draft_length="fixed", eos_token_ids=(),
                  rule="typical")
    strict = engine.generate_ids([prompt] * 4, seed=1, epsilon=1.0, delta=1e9, **common)
    loose = engine.generate_ids([prompt] * 4, seed=1, epsilon=0.0, **common)
    assert sum(r.stats.drafted_tokens for r in strict) > 0 and sum(r.stats.accepted_tokens for r in strict) == 0
    assert sum(r.stats.drafted_tokens for r in loose) > 0
    for r in loose:  # every depth verified was accepted (a tree's acceptance *rate* counts all its nodes)
        assert r.stats.accepted_per_position == r.stats.drafted_per_position


# ------------------------------------------------------------------------------ the engine's bias measurement
def _first_position_laws(target_model, draft_model):
    """The processed laws (draft p, target q) of the first generated token after PROMPT, float64 ``[V]``."""
    with torch.no_grad():
        q = process_logits(target_model(torch.tensor([PROMPT])).logits[:, -1].double(), SAMPLING)[0]
        p = process_logits(draft_model(torch.tensor([PROMPT])).logits[:, -1].double(), SAMPLING)[0]
    return p, q


@pytest.mark.parametrize("rule, epsilon, residual", [("overaccept", 0.0, "opt"), ("overaccept", 0.2, "opt"),
                                                     ("overaccept", 0.0, "uno"), ("typical", 0.09, "uno")])
def test_measured_bias_is_the_rules_exact_law_at_the_judged_position(rule, epsilon, residual):
    """One draft token per request (k = 1, 2 new tokens): the only judged position is the first, whose
    laws are known exactly, so the measured means must equal the theory's statistics there (1e-9), OPT's
    bias must be Loss* (Theorem 4) and 0 at eps 0; and over N = 4,000 requests the empirical rejection
    frequency must be within 4 standard errors of the measured R."""
    target_model, draft_model = peaked(tiny_llama(0, vocab=12)), peaked(tiny_llama(1, vocab=12, layers=1))
    engine = SpeculativeEngine(HFCausalLM(target_model), DraftModelDrafter(HFCausalLM(draft_model)))
    n = 4_000
    results = engine.generate_ids([PROMPT] * n, max_new_tokens=2, num_draft_tokens=1, draft_length="fixed",
                                  temperature=0.7, top_k=8, top_p=0.9, seed=5, eos_token_ids=(), rule=rule,
                                  epsilon=epsilon, residual=residual, measure_bias=True)
    p, q = _first_position_laws(target_model, draft_model)
    exact = pareto.rule_statistics(p, q, Rule(rule, epsilon, residual, 0.3))
    bias = results[0].stats.as_dict()["bias"]
    assert bias["judged_positions"] == 1
    for key, field in (("rejection_rate", "rejection"), ("bias_tv", "bias"), ("tv", "tv"),
                       ("loss_star", "loss_star"), ("pareto_bias", "pareto_bias")):
        assert bias[key] == pytest.approx(float(getattr(exact, field)), abs=1e-9)
    if residual == "opt":
        assert bias["bias_tv"] == pytest.approx(bias["loss_star"], abs=1e-9)
    if residual == "opt" and epsilon == 0.0:
        assert bias["bias_tv"] < 1e-9 and bias["rejection_rate"] == pytest.approx(bias["tv"], abs=1e-9)
    assert bias["pareto_bias"] <= bias["bias_tv"] + 1e-9
    rejected = np.array([r.stats.accepted_tokens == 0 for r in results], dtype=float)
    stderr = max(rejected.std(ddof=1) / np.sqrt(n), 1e-3)
    assert abs(rejected.mean() - bias["rejection_rate"]) < 4 * stderr


def test_judged_positions_stop_at_the_first_rejection(tiny_target):
    """Longer drafts: a step with L drafted and a accepted judges min(a + 1, L) positions (the accepted
    ones and the first rejected one, never those after it), summed over the steps."""
    engine = SpeculativeEngine(tiny_target, DraftModelDrafter(HFCausalLM(tiny_llama(1, layers=1))))
    request = engine.add_request([5, 6, 7], GenerationConfig(max_new_tokens=40, num_draft_tokens=4, draft_length="fixed",
                                                             temperature=1.0, seed=2, eos_token_ids=(), residual="uno",
                                                             measure_bias=True))
    expected, final = 0, None
    while engine.has_unfinished():
        step = engine.step().requests.get(request)
        if step is not None:
            expected += min(step.accepted + 1, step.drafted)
            final = step
    assert final.stats.as_dict()["bias"]["judged_positions"] == expected
    assert final.stats.accepted_tokens < expected < final.stats.drafted_tokens  # some rejections, some unjudged


def test_bias_is_measured_on_chains_only(tiny_target):
    engine = SpeculativeEngine(tiny_target, PromptLookupDrafter(num_candidates=3))
    with pytest.raises(ConfigError, match="chain drafts only"):
        engine.add_request([5, 6, 7], GenerationConfig(temperature=1.0, measure_bias=True))
