"""The acceptance rule as a value (``genspec.acceptance.Rule``), the request's randomness as one object
(``genspec.randomness.Noise``) and ``GenerationConfig`` as typed parts (``genspec.config``), issue 48."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
from tiny_models import peaked, tiny_llama

import genspec
from genspec.acceptance import Residual, Rule, RuleKind
from genspec.config import GenerationConfig, Speculation, Stopping
from genspec.draft_length import DraftLengthPolicy
from genspec.drafters import DraftModelDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.randomness import RequestRandomness, block_noise
from genspec.sampling import SamplingConfig


# ------------------------------------------------------------------------------ Rule
@pytest.mark.parametrize("arguments, message", [
    (dict(kind="best"), "unknown acceptance rule 'best'; choose from overaccept, typical, coupled"),
    (dict(kind="auto"), "unknown acceptance rule 'auto'"),  # "auto" is a request setting, resolved at admission
    (dict(residual="xyz"), "unknown residual 'xyz'; choose from opt, uno"),
    (dict(epsilon=-0.1), "epsilon must be >= 0, got -0.1"),
    (dict(epsilon=float("inf")), "epsilon must be a finite number, got inf"),
    (dict(epsilon="a lot"), "epsilon must be a number, got 'a lot'"),
    (dict(delta=float("nan")), "delta must be a finite number, got nan"),
    (dict(delta=-1), "delta must be >= 0, got -1"),
    (dict(epsilon=torch.tensor([0.0, -0.5])), "epsilon must be >= 0"),
    (dict(kind="coupled", epsilon=0.1), "the coupled rule is lossless and takes no epsilon, got 0.1"),
])
def test_a_bad_rule_is_a_one_line_config_error(arguments, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")) as caught:
        Rule(**arguments)
    assert "\n" not in str(caught.value)


def test_rule_kinds_and_residuals_are_enums_that_take_their_strings():
    rule = Rule("typical", 0.09, "uno", 0.5)
    assert rule.kind is RuleKind.TYPICAL and rule.residual is Residual.UNO
    assert rule == Rule(RuleKind.TYPICAL, 0.09, Residual.UNO, 0.5)
    assert rule.kind == "typical" and isinstance(rule.epsilon, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.epsilon = 0.2


@pytest.mark.parametrize("rule, lossless", [
    (Rule(), True), (Rule("coupled"), True), (Rule("coupled", residual="uno"), True),
    (Rule(residual="uno"), False), (Rule(epsilon=0.1), False), (Rule("typical", 0.0), False),
    (Rule(epsilon=torch.tensor([0.0, 0.0])), True), (Rule(epsilon=torch.tensor([0.0, 0.2])), False)])
def test_only_the_standard_and_coupled_rules_are_lossless(rule, lossless):
    assert rule.lossless is lossless


def test_the_report_of_a_rule_is_the_stats_acceptance_dict():
    assert Rule().report() == {"rule": "overaccept", "epsilon": 0.0, "delta": None, "residual": "opt", "lossless": True}
    assert Rule("typical", 0.09, "uno", 0.5).report() == {"rule": "typical", "epsilon": 0.09, "delta": 0.5,
                                                          "residual": "uno", "lossless": False}
    assert Rule("coupled").report() == {"rule": "coupled", "epsilon": 0.0, "delta": None, "residual": None,
                                        "lossless": True}
    assert all(type(value) is not RuleKind and type(value) is not Residual for value in Rule().report().values())


def test_a_batched_rule_holds_each_rows_epsilon_and_delta():
    rule = Rule.batch([Rule("typical", 0.1, "uno", 0.3), Rule("typical", 0.2, "uno", 0.5)])
    assert rule.kind is RuleKind.TYPICAL and rule.residual is Residual.UNO
    assert rule.epsilon.tolist() == [0.1, 0.2] and rule.delta.tolist() == [0.3, 0.5]
    assert rule.per_row(lambda values: values.unsqueeze(1)).epsilon.shape == (2, 1)
    with pytest.raises(ValueError, match="share a rule kind and residual"):
        Rule.batch([Rule(), Rule(residual="uno")])


# ------------------------------------------------------------------------------ GenerationConfig and its parts
def test_the_flat_constructor_builds_typed_parts_and_reads_back_flat():
    config = GenerationConfig(max_new_tokens=12, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.1,
                              seed=3, stop_strings="END", eos_token_ids=[2], num_draft_tokens=4,
                              draft_length="fixed", drafter="none", drafter_options={"a": 1}, rule="typical",
                              epsilon=0.09, residual="uno", delta=0.5)
    assert config.sampling == SamplingConfig(0.7, 5, 0.9, 1.1)
    assert config.stopping == Stopping(12, ("END",), (2,))
    assert config.speculation == Speculation("none", {"a": 1}, 4, DraftLengthPolicy.FIXED)
    assert config.acceptance_rule == Rule("typical", 0.09, "uno", 0.5) and not config.auto_rule
    assert (config.max_new_tokens, config.temperature, config.top_k, config.stop_strings, config.eos_token_ids,
            config.num_draft_tokens, config.draft_length, config.drafter, config.seed) == (
        12, 0.7, 5, ("END",), (2,), 4, "fixed", "none", 3)
    assert (config.rule, config.epsilon, config.residual, config.delta) == ("typical", 0.09, "uno", 0.5)
    assert GenerationConfig(temperature=0.5) == GenerationConfig(sampling=SamplingConfig(0.5))
    assert GenerationConfig(temperature=0.7, rule=Rule("typical", 0.09)).acceptance_rule == Rule("typical", 0.09)
    assert GenerationConfig(temperature=0.7, rule=Rule("typical"), epsilon=0.2).epsilon == 0.2
    assert genspec.GenerationConfig is GenerationConfig and genspec.engine.GenerationConfig is GenerationConfig


def test_flat_replacements_change_one_setting_and_keep_the_rest():
    config = GenerationConfig(temperature=0.7, rule="typical", epsilon=0.09, residual="uno", delta=0.5)
    assert replace(config, rule="overaccept").acceptance_rule == Rule("overaccept", 0.09, "uno", 0.5)
    assert replace(config, epsilon=0.2).acceptance_rule == Rule("typical", 0.2, "uno", 0.5)
    assert replace(config, top_k=3).sampling == SamplingConfig(0.7, 3)
    assert replace(config, max_new_tokens=5).stopping.max_new_tokens == 5
    assert replace(config, rule="auto", epsilon=0.0, residual="opt").rule == "auto"


@pytest.mark.parametrize("settings, message", [
    (dict(draft_length="sometimes"), "draft_length must be one of ('fixed', 'heuristic', 'cost'), got 'sometimes'"),
    (dict(num_draft_tokens=0), "num_draft_tokens (k) must be an integer >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(stop_strings=("",)), "stop strings must be non-empty text"),
    (dict(eos_token_ids="2"), "eos_token_ids must be a sequence of token ids"),
    (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(rule="nope"), "unknown acceptance rule 'nope'"),
    (dict(rule="auto", epsilon=-0.5), "epsilon must be >= 0"),
    (dict(temperature=0.0, epsilon=0.1), "a lossy acceptance rule needs temperature > 0"),
    (dict(temperature=0.0, measure_bias=True), "bias measurement needs temperature > 0"),
    (dict(temperature=0.7, rule="coupled", measure_bias=True), "bias measurement needs the overaccept or typical"),
    (dict(temprature=0.7), "unknown generation setting(s) temprature; GenerationConfig takes"),
])
def test_each_part_refuses_bad_values_in_one_line(settings, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as caught:
        GenerationConfig(**settings)
    assert "\n" not in str(caught.value)


def test_draft_length_is_an_enum_that_takes_its_string():
    assert GenerationConfig(draft_length="heuristic").draft_length is DraftLengthPolicy.HEURISTIC
    assert GenerationConfig().draft_length == "cost"


def test_auto_is_resolved_once_to_a_concrete_rule():
    auto = GenerationConfig(temperature=0.7, seed=1)
    assert auto.rule == "auto" and auto.auto_rule and auto.acceptance["rule"] == "auto"
    coupled, standard = auto.resolved(True), auto.resolved(False)
    assert not coupled.auto_rule and coupled.acceptance_rule == Rule("coupled")
    assert not standard.auto_rule and standard.acceptance_rule == Rule()
    assert replace(coupled, seed=2).rule == "coupled"  # resolved stays resolved
    lossy = GenerationConfig(temperature=0.7, epsilon=0.1)  # "auto" chooses between lossless rules only
    assert lossy.rule == "overaccept" and not lossy.auto_rule


def test_the_stats_report_the_rule_the_engine_resolved_at_admission():
    target = HFCausalLM(peaked(tiny_llama(0), 16.0))
    engine = SpeculativeEngine(target, DraftModelDrafter(HFCausalLM(peaked(tiny_llama(0), 6.0))))
    seeded = engine.generate_ids([[5, 6, 7]], max_new_tokens=4, temperature=0.7, seed=1, eos_token_ids=())[0]
    unseeded = engine.generate_ids([[5, 6, 7]], max_new_tokens=4, temperature=0.7, eos_token_ids=())[0]
    assert seeded.stats.acceptance == {"rule": "coupled", "epsilon": 0.0, "delta": None, "residual": None,
                                       "lossless": True}
    assert unseeded.stats.acceptance == {"rule": "overaccept", "epsilon": 0.0, "delta": None, "residual": "opt",
                                         "lossless": True}


# ------------------------------------------------------------------------------ Noise
def test_block_noise_holds_each_rows_uniforms_and_race_by_position():
    first, second = RequestRandomness(7, num_candidates=2), RequestRandomness(8)
    noise = block_noise([first, None, second], [3, 0, 5], [False, False, True], depth=2, num_chains=1, vocab_size=6)
    sample, accept = RequestRandomness(7, num_candidates=2).uniforms(3, 3)
    assert torch.equal(noise.sample[0], sample) and torch.equal(noise.accept[0], accept[:2])
    assert not noise.sample[1].any() and not noise.accept[1].any()  # a greedy row draws nothing
    assert torch.equal(noise.race[2], RequestRandomness(8).races(5, 3, 6)) and not noise.race[0].any()
    assert noise.coupled.tolist() == [False, False, True]
    assert noise.accept.shape == (3, 2, 2)  # as wide as the widest row's candidates
    assert block_noise([None, None], [0, 0], [False, False], 2, 1, 6) is None


# ------------------------------------------------------------------------------ rows verified together
def test_a_standard_row_keeps_the_opt_residual_beside_a_coupled_row_that_names_uno():
    """Lossless rows share a group; the group's standard rows follow the standard rule whatever the first
    row's residual says (a coupled row named with residual "uno" first in the group made its standard
    neighbours resample from q, a lossy rule). A seeded standard request under the fixed policy gives the
    same tokens alone and beside such a coupled one."""
    target = HFCausalLM(peaked(tiny_llama(0), 16.0))

    def engine():
        return SpeculativeEngine(target, DraftModelDrafter(HFCausalLM(peaked(tiny_llama(0), 6.0))))

    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    standard = GenerationConfig(max_new_tokens=40, temperature=0.7, seed=11, num_draft_tokens=3,
                                draft_length="fixed", eos_token_ids=(), rule="overaccept")
    coupled = replace(standard, rule="coupled", residual="uno", seed=4)
    alone = engine().generate_ids([prompt], standard)[0]
    assert 0 < alone.stats.accepted_tokens < alone.stats.drafted_tokens  # drafts were rejected: residual draws
    together = engine()
    together.add_request(prompt, coupled)
    mine = together.add_request(prompt, standard)
    tokens = []
    while together.has_unfinished():
        step = together.step().requests.get(mine)
        tokens += step.new_tokens if step is not None else []
    assert tokens == alone.token_ids
