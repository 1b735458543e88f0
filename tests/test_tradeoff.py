"""``genspec tradeoff`` (issue 17): settings, prompts, WinRate and its scorers, the command end to end on
tiny models; one bounded smoke test on the embedded model (slow)."""
from __future__ import annotations

import json

import pytest
import torch
from tiny_models import byte_tokenizer, save_tiny_model, tiny_llama

from genspec.bench import tradeoff
from genspec.bench.prompts import load_spec_bench
from genspec.bench.winrate import Response, RewardModel, TargetLogLikelihood, load_scorer, win_rate
from genspec.cli import main
from genspec.engine import GenerationConfig
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.theory.stats import wilson_interval


def response_length(response: Response) -> float:
    """A tiny scorer for the plumbing tests: longer responses score higher."""
    return float(len(response.token_ids))


@pytest.fixture(scope="module")
def long_context_dirs(tmp_path_factory):
    """Target and draft tiny Llamas with the byte tokenizer and a 2048-token context (Spec-Bench prompts
    are long in bytes)."""
    root = tmp_path_factory.mktemp("tradeoff_models")
    return (save_tiny_model(root / "target", seed=0, context=2048),
            save_tiny_model(root / "draft", seed=1, layers=1, context=2048))


# ------------------------------------------------------------------------------ settings and prompts
def test_settings_grid_nests_rules_eps_delta_residuals():
    grid = tradeoff.settings_grid(["overaccept", "typical"], [0.0, 0.1], ["opt", "uno"], [0.3, 0.5], [0.09])
    assert [s.label for s in grid] == [
        "overaccept eps=0 opt", "overaccept eps=0 uno", "overaccept eps=0.1 opt", "overaccept eps=0.1 uno",
        "typical:delta=0.3 eps=0.09 opt", "typical:delta=0.3 eps=0.09 uno",
        "typical:delta=0.5 eps=0.09 opt", "typical:delta=0.5 eps=0.09 uno"]
    config = grid[5].config(GenerationConfig(temperature=1.0))
    assert (config.rule, config.epsilon, config.delta, config.residual, config.measure_bias) == (
        "typical", 0.09, 0.3, "uno", True)


@pytest.mark.parametrize("args, message", [
    ((["nope"], [0.0], ["opt"], [0.3]), "unknown rule"), ((["overaccept"], [0.0], ["xyz"], [0.3]), "unknown residual"),
    ((["overaccept"], [-0.1], ["opt"], [0.3]), "epsilon must be >= 0"),
    ((["overaccept"], [0.1, 0.1], ["opt"], [0.3]), "twice"), ((["typical"], [0.1], ["opt"], []), "delta"),
    (([], [0.1], ["opt"], [0.3]), "at least one")])
def test_bad_settings_are_config_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        tradeoff.settings_grid(*args)


def test_prompts_are_neither_benchmarked_nor_trained_on():
    """The 3rd-5th Spec-Bench prompt of each category: genspec bench measures the first 2 by default and
    genspec train continues the 6th on; one category after another."""
    prompts = tradeoff.tradeoff_prompts(39)
    benched = {p.question_id for p in load_spec_bench(per_category=2)}
    first_five = {p.question_id for p in load_spec_bench(per_category=5)}
    ids = [p.question_id for p in prompts]
    assert len(set(ids)) == 39 and not set(ids) & benched and set(ids) <= first_five
    assert len({p.category for p in prompts[:13]}) == 13
    with pytest.raises(ConfigError, match="1..39"):
        tradeoff.tradeoff_prompts(40)


# ------------------------------------------------------------------------------ WinRate and scorers
def test_win_rate_counts_ties_half_with_a_wilson_interval():
    result = win_rate([3.0, 2.0, 1.0, 5.0, 0.5], [1.0, 2.0, 2.0, 4.0, 0.1], identical=[False, False, False, False, True])
    assert (result.comparisons, result.wins, result.ties, result.losses) == (5, 2, 2, 1)
    assert result.rate == pytest.approx(3 / 5)
    low, high = result.ci95
    assert low < 0.6 < high
    from scipy.stats import binomtest

    reference = binomtest(7, 20).proportion_ci(method="wilson")
    assert wilson_interval(7, 20) == pytest.approx((reference.low, reference.high), abs=1e-9)
    with pytest.raises(ConfigError):
        win_rate([1.0], [1.0, 2.0])


def test_target_log_likelihood_is_the_untempered_mean_log_probability():
    model = tiny_llama(0)
    scorer = TargetLogLikelihood(HFCausalLM(model))
    prompt, tokens = [5, 6, 7, 8], [9, 10, 11]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    expected = logits.log_softmax(-1)[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens).unsqueeze(-1)).mean()
    assert scorer(Response("", prompt, "", tokens)) == pytest.approx(float(expected), abs=1e-10)
    assert scorer.target.num_rows == 0  # the scoring row is gone again


def test_scorers_load_by_name_path_or_callable(tmp_path, tiny_target):
    scorer, name = load_scorer("test_tradeoff:response_length", tiny_target)
    assert scorer(Response("q", [1], "ab", [4, 5])) == 2.0 and name == "test_tradeoff:response_length"
    assert load_scorer(response_length, tiny_target)[0] is response_length
    assert isinstance(load_scorer("loglik", tiny_target)[0], TargetLogLikelihood)
    for bad in ("nonsense", "no_such_module:f", "test_tradeoff:missing"):
        with pytest.raises(ConfigError):
            load_scorer(bad, tiny_target)
    # a local reward model: a tiny sequence classifier with one output, scoring prompt + response text
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    reward, name = load_scorer(str(tmp_path / "rm"), tiny_target)
    assert isinstance(reward, RewardModel) and "rm" in name
    first, second = reward(Response("Q: hi", [1], " A: yes", [2])), reward(Response("Q: hi", [1], " A: no way", [2]))
    assert isinstance(first, float) and first != second


# ------------------------------------------------------------------------------ the command
def test_tradeoff_command_on_tiny_models(long_context_dirs, tmp_path, capsys):
    """--json prints one object per setting with exactly the issue's keys; OPT at eps 0 measures no bias;
    UNO at eps 0 does; the WinRate pairs OPT and UNO responses; --out writes results, report and plot."""
    target, draft = long_context_dirs
    out = tmp_path / "out"
    code = main(["tradeoff", "--model", str(target), "--drafter", "draft-model", "--draft-model", str(draft),
                 "--num-prompts", "2", "--samples", "2", "--max-new-tokens", "10", "--eps", "0,0.05",
                 "--rule", "overaccept,typical", "--typical-eps", "0.02", "--scorer", "test_tradeoff:response_length",
                 "-k", "3", "--draft-length", "fixed", "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    records = json.loads(captured.out)
    assert [tuple(r) for r in records] == [tradeoff.KEYS] * 6
    by = {(r["rule"], r["eps"], r["residual"]): r for r in records}
    assert by[("overaccept", 0.0, "opt")]["bias_tv"] < 1e-6
    assert by[("overaccept", 0.0, "uno")]["bias_tv"] > 1e-3
    assert ("typical:delta=0.3", 0.02, "uno") in by
    for r in records:
        assert r["pareto_bias"] <= r["bias_tv"] + 1e-6 and 0 <= r["rejection_rate"] <= 1
        assert r["mean_accepted_length"] >= 1 and r["tokens_per_second"] > 0
        assert r["win_rate"]["comparisons"] == 4 and r["win_rate"]["of"] == "opt over uno"
    results = json.loads((out / "results.json").read_text())
    assert len(results["generations"]) == 2 * 2 * 6 and results["scorer"] == "test_tradeoff:response_length"
    assert results["command"].startswith("genspec tradeoff --model")
    assert (out / "tradeoff.png").stat().st_size > 1000 and "WinRate" in (out / "report.md").read_text()


@pytest.mark.parametrize("drafter", ["quantized", "early-exit", "layer-skip", "draft-model"])
def test_costly_drafters_draft_by_default(long_context_dirs, capsys, drafter):
    """Issue 46 item 7: a costly drafter is measured at the fixed draft length unless told otherwise (the cost
    policy drafted nothing for it and the rows were nulls with exit 0): every setting has numbers."""
    target, draft = long_context_dirs
    code = main(["tradeoff", "--model", str(target), "--drafter", drafter, "--num-prompts", "1", "--max-new-tokens",
                 "6", "--eps", "0", "--residual", "opt,uno", "-k", "3", "--no-win-rate", "--json",
                 *(["--draft-model", str(draft)] if drafter == "draft-model" else [])])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for record in json.loads(captured.out):
        assert None not in (record["rejection_rate"], record["bias_tv"], record["pareto_bias"]), record
        assert record["mean_accepted_length"] > 1


def test_settings_that_drafted_nothing_are_an_error_naming_the_cause(long_context_dirs, capsys):
    """A drafter that proposed nothing (prompt lookup finds no 6-gram of the prompt in the tiny model's
    output) gives no rejection or bias: a one-line error, not rows of nulls with exit 0."""
    target, _ = long_context_dirs
    code = main(["tradeoff", "--model", str(target), "--drafter", "prompt-lookup", "-O", "min_ngram=6", "-O",
                 "max_ngram=8", "--num-prompts", "1", "--max-new-tokens", "6", "--eps", "0", "--residual", "opt",
                 "--no-win-rate", "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "no draft token was verified under 1 of 1 settings (overaccept eps=0 opt)" in captured.err
    assert "'prompt-lookup' proposed no draft token" in captured.err and "Traceback" not in captured.err


def test_check_drafted_names_the_cost_policy_when_it_drafted_nothing():
    records = [{"rule": "overaccept", "eps": eps, "residual": "opt",
                "details": {"generations": 2, "judged_positions": judged}} for eps, judged in ((0.0, 0), (0.1, 7))]
    with pytest.raises(ConfigError, match=r"1 of 2 settings \(overaccept eps=0 opt\).*cost draft-length policy.*"
                                          r"'quantized'.*--draft-length fixed"):
        tradeoff.check_drafted(records, "quantized", "cost")
    tradeoff.check_drafted(records[1:], "quantized", "cost")  # every setting drafted: nothing to say
    tradeoff.check_drafted([{**records[0], "details": {"generations": 0, "judged_positions": 0}}], "quantized", "cost")


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0"], "temperature"), (["--rule", "nope"], "unknown rule"), (["--eps", "-1"], "epsilon"),
    (["--num-prompts", "100"], "1..39"), (["--eps", "a,b"], "comma-separated"), (["--drafter", "none"], "nothing"),
    (["--samples", "0"], "samples"), (["--eps", "0,nan"], "finite numbers"), (["--delta", "inf"], "finite numbers")])
def test_bad_tradeoff_arguments_fail_before_loading_a_model(capsys, argv, message):
    code = main(["tradeoff", "--model", "/nonexistent/model", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and "nonexistent" not in err


@pytest.mark.parametrize("argv", [["--temperature", "nan"], ["--top-p", "inf"]])
def test_non_finite_numbers_are_refused_by_the_parser(capsys, argv):
    with pytest.raises(SystemExit) as exit:  # argparse's own error: usage, then one line
        main(["tradeoff", "--model", "/nonexistent/model", *argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and f"argument {argv[0]}: must be a finite number, got '{argv[1]}'" in err
    assert "Traceback" not in err


def test_tree_drafters_are_refused(long_context_dirs, capsys):
    target, _ = long_context_dirs
    code = main(["tradeoff", "--model", str(target), "--drafter", "prompt-lookup", "-O", "num_candidates=3",
                 "--num-prompts", "1", "--no-win-rate"])
    assert code == 2 and "trees" in capsys.readouterr().err


@pytest.mark.slow
def test_tradeoff_smoke_on_the_embedded_model(capsys):
    """The shipped head on Gemma 3 270M: 1 prompt x 8 tokens, eps 0 and 0.5, OPT and UNO (a few minutes)."""
    code = main(["tradeoff", "--num-prompts", "1", "--max-new-tokens", "8", "--eps", "0,0.5", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    records = json.loads(captured.out)
    assert len(records) == 4 and all(tuple(r) == tradeoff.KEYS for r in records)
    assert records[0]["bias_tv"] < 1e-4  # OPT at eps 0: standard speculative decoding
