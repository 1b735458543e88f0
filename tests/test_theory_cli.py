"""Chain files (loading, validation, random pairs) and the ``genspec theory`` command line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from genspec.cli import main
from genspec.errors import ConfigError, InputFileError
from genspec.theory import exact
from genspec.theory.chains import ChainPair, load_chain, random_chain, save_chain


@pytest.fixture
def chain_file(tmp_path):
    path = tmp_path / "chain.json"
    save_chain(random_chain(4, 6, 0), path)
    return path


def run(argv, capsys):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------- random pairs


def test_random_pair_follows_the_rng_order_of_theory_md():
    rng = np.random.default_rng(42)
    ones = np.ones(5)
    initial = rng.dirichlet(ones)
    draft = rng.dirichlet(ones, size=(3, 5))
    target = rng.dirichlet(ones, size=(3, 5))
    chain = random_chain(5, 3, 42)
    np.testing.assert_array_equal(chain.initial, initial)
    np.testing.assert_array_equal(chain.draft, draft)
    np.testing.assert_array_equal(chain.target, target)


def test_random_chain_command_writes_a_loadable_file_that_round_trips(tmp_path, capsys):
    path = tmp_path / "pair.json"
    code, out, _ = run(["theory", "random-chain", "--vocab", "7", "--horizon", "50", "--seed", "3",
                        "--out", str(path)], capsys)
    assert code == 0 and str(path) in out
    loaded = load_chain(path)
    expected = random_chain(7, 50, 3)
    assert (loaded.vocab_size, loaded.horizon) == (7, 50)
    np.testing.assert_array_equal(loaded.draft, expected.draft)  # floats round-trip exactly
    np.testing.assert_array_equal(loaded.target, expected.target)


# ----------------------------------------------------------------------- malformed chain files


def _chain_dict():
    return random_chain(3, 4, 1).to_json_dict()


def _malformed(kind):
    data = _chain_dict()
    if kind == "row_sum":
        data["draft"][3][2] = [0.5, 0.4, 0.07]
        return data, "draft[3][2] sums to 0.97, not 1"
    if kind == "negative":
        data["target"][1][0] = [1.2, -0.2, 0.0]
        return data, "target[1][0][1] = -0.2 is negative"
    if kind == "initial_sum":
        data["initial"] = [0.5, 0.5, 0.5]
        return data, "initial sums to 1.5, not 1"
    if kind == "rows":
        data["draft"][2] = data["draft"][2][:2]
        return data, "draft[2] has 2 entries, draft[0] has 3"
    if kind == "columns":
        data["target"] = [[row[:2] for row in matrix] for matrix in data["target"]]
        return data, "target[0][0] has 2 entries, expected 3"
    if kind == "ragged":
        data["target"][0][1] = [0.5, 0.5]
        return data, "target[0][1] has 2 entries, target[0][0] has 3"
    if kind == "horizon":
        data["target"] = data["target"][:3]
        return data, "draft has horizon 4 but target has 3"
    if kind == "not_number":
        data["draft"][0][0][0] = "x"
        return data, "draft[0][0][0] is the string 'x', expected a number"
    if kind == "missing_key":
        del data["target"]
        return data, "missing key 'target'"
    if kind == "flat":
        data["draft"] = [0.2, 0.8]
        return data, "draft[0] is 0.2, expected a list"
    raise AssertionError(kind)


KINDS = ["row_sum", "negative", "initial_sum", "rows", "columns", "ragged", "horizon", "not_number",
         "missing_key", "flat"]


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_chain_files_name_the_bad_entry(tmp_path, kind):
    data, message = _malformed(kind)
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputFileError) as info:
        load_chain(path)
    assert message in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("kind", KINDS + ["bad_json", "missing_file", "directory"])
@pytest.mark.parametrize("command", ["rejections", "limit"])
def test_malformed_chain_files_fail_cleanly_on_the_command_line(tmp_path, capsys, kind, command):
    """Exit code 2, one line on stderr naming the problem, no traceback."""
    if kind == "bad_json":
        path, message = tmp_path / "bad.json", "not valid JSON"
        path.write_text('{"initial": [0.5, 0.5], "draft": [[[0.5, 0.5], [0.5, 0.5]]')
    elif kind == "missing_file":
        path, message = tmp_path / "nowhere.json", "chain file not found"
    elif kind == "directory":
        path, message = tmp_path, "is a directory"
    else:
        data, message = _malformed(kind)
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps(data))
    code, out, err = run(["theory", command, str(path)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("genspec: error: ") and message in err
    assert "Traceback" not in err


def test_row_sum_tolerance_is_1e_9():
    data = _chain_dict()
    data["draft"][0][0] = [0.5, 0.5 + 5e-10, 0.0]
    ChainPair.from_arrays(data["initial"], data["draft"], data["target"])
    data["draft"][0][0] = [0.5, 0.5 + 5e-9, 0.0]
    with pytest.raises(ConfigError, match=r"draft\[0\]\[0\] sums to"):
        ChainPair.from_arrays(data["initial"], data["draft"], data["target"])


# ----------------------------------------------------------------------------------- rejections


REJECTION_KEYS = {"expected_rejections", "horizon", "batch", "variant", "speedup"}


@pytest.mark.parametrize("variant", ["batch", "multidraft"])
def test_rejections_json_has_the_exact_keys(chain_file, capsys, variant):
    code, out, _ = run(["theory", "rejections", str(chain_file), "--batch", "3", "--variant", variant, "--json"],
                       capsys)
    payload = json.loads(out)
    assert code == 0 and set(payload) == REJECTION_KEYS
    value = exact.expected_rejections(load_chain(chain_file), 3, variant)
    assert payload["expected_rejections"] == pytest.approx(value, rel=1e-15)
    assert (payload["horizon"], payload["batch"], payload["variant"]) == (6, 3, variant)
    assert payload["speedup"] == pytest.approx(6 / value)


def test_rejections_with_simulation_adds_the_simulated_fields(chain_file, capsys):
    code, out, _ = run(["theory", "rejections", str(chain_file), "--batch", "2", "--simulate", "4000",
                        "--seed", "1", "--json"], capsys)
    payload = json.loads(out)
    assert code == 0 and set(payload) == REJECTION_KEYS | {"simulated_mean", "simulated_stderr"}
    assert abs(payload["simulated_mean"] - payload["expected_rejections"]) < 4 * payload["simulated_stderr"]


def test_rejections_text_output_is_one_readable_line(chain_file, capsys):
    code, out, _ = run(["theory", "rejections", str(chain_file)], capsys)
    assert code == 0 and out.count("\n") == 1
    assert out.startswith("E[N_rej] = ") and "speedup" in out and "M = 1" in out


def test_identical_pair_prints_null_speedup(tmp_path, capsys):
    chain = random_chain(3, 4, 0)
    path = tmp_path / "same.json"
    save_chain(ChainPair.from_arrays(chain.initial, chain.target, chain.target), path)
    payload = json.loads(run(["theory", "rejections", str(path), "--batch", "2", "--json"], capsys)[1])
    assert payload["expected_rejections"] == 0.0 and payload["speedup"] is None


def test_bad_batch_is_a_one_line_error(chain_file, capsys):
    code, _, err = run(["theory", "rejections", str(chain_file), "--batch", "0"], capsys)
    assert code == 2 and "--batch" in err and err.count("\n") == 1


# -------------------------------------------------------------------------------- other commands


def test_limit_command(chain_file, capsys):
    code, out, _ = run(["theory", "limit", str(chain_file), "--max-batch", "8", "--json"], capsys)
    payload = json.loads(out)
    assert code == 0 and set(payload["variants"]) == {"batch", "multidraft"}
    batch = payload["variants"]["batch"]
    assert list(batch["curve"]) == ["1", "2", "4", "8"]
    assert batch["curve"]["1"] == pytest.approx(payload["sd"])
    assert batch["limit"] <= batch["curve"]["8"] + 1e-12


def test_leviathan_command(capsys):
    code, out, _ = run(["theory", "leviathan", "--alpha", "0.9", "--gamma", "10", "--cost", "0.1", "--json"],
                       capsys)
    payload = json.loads(out)
    assert code == 0
    assert payload["tokens_per_call"] == pytest.approx(6.862, abs=5e-4)
    assert payload["speedup"] == pytest.approx(3.431, abs=5e-4)
    assert payload["optimal_gamma"] >= 1
    code, out, _ = run(["theory", "leviathan", "--alpha", "0.8", "--gamma", "5"], capsys)
    assert code == 0 and "3.6893 tokens per target call" in out


@pytest.mark.parametrize("argv", [["--cost", "nan"], ["--verify-cost", "nan"], ["--cost", "inf"],
                                  ["--verify-cost", "Infinity"], ["--alpha", "nan"]])
def test_leviathan_refuses_non_finite_numbers(capsys, argv):
    """Issue 46 item 9: ``--cost nan --json`` printed ``NaN`` (not JSON), ``--verify-cost nan`` "speedup nan"."""
    with pytest.raises(SystemExit) as exit:
        main(["theory", "leviathan", *(["--alpha", "0.8"] if argv[0] != "--alpha" else []), *argv, "--json"])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    assert f"argument {argv[0]}: must be a finite number, got '{argv[1]}'" in err and "Traceback" not in err


def test_random_chain_seed_must_not_be_negative(capsys, tmp_path):
    code, _, err = run(["theory", "random-chain", "-V", "3", "-T", "2", "--seed", "-1", "--out", "-"], capsys)
    assert code == 2 and "seed must be an integer >= 0, got -1" in err and "Traceback" not in err
    code, _, err = run(["theory", "figures", "--out", str(tmp_path), "--seed", "-1", "--no-progress"], capsys)
    assert code == 2 and "seed must be an integer >= 0, got -1" in err and "Traceback" not in err


def test_leviathan_formulas_refuse_non_finite_costs():
    from genspec.theory import leviathan

    for kwargs in ({"cost_ratio": float("nan")}, {"cost_ratio": float("inf")},
                   {"cost_ratio": 0.1, "verify_cost": float("nan")}):
        with pytest.raises(ConfigError, match="must be a finite number"):
            leviathan.optimal_gamma(0.8, **kwargs)


@pytest.mark.parametrize("argv", [["pareto", "--eps", "0,nan"], ["pareto", "--draft", "0.5,nan", "--target", "0.5,0.5"]])
def test_number_lists_refuse_non_finite_numbers(capsys, argv):
    code, out, err = run(["theory", *argv, "--json"], capsys)
    assert code == 2 and out == "" and "must be comma-separated finite numbers" in err and "Traceback" not in err


def test_pareto_command_default_is_the_worked_example(capsys):
    code, out, _ = run(["theory", "pareto", "--json"], capsys)
    payload = json.loads(out)
    assert code == 0 and payload["draft"] == [0.3, 0.7] and payload["target"] == [0.5, 0.5]
    assert payload["tv"] == pytest.approx(0.2)
    by_eps = {round(pt["epsilon"], 6): pt for pt in payload["points"]}
    assert set(by_eps[0.1]) == {"epsilon", "rejection", "loss_star", "opt_bias", "uno_bias"}
    assert by_eps[0.1]["uno_bias"] == pytest.approx(0.15)
    assert by_eps[0.0]["uno_bias"] == pytest.approx(0.1)


def test_pareto_command_with_flags_and_file(tmp_path, capsys):
    code, out, _ = run(["theory", "pareto", "--draft", "0.2,0.3,0.5", "--target", "0.5,0.25,0.25",
                        "--eps", "0,0.1"], capsys)
    assert code == 0 and "Loss*" in out and len(out.strip().splitlines()) == 4
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"draft": [0.3, 0.7], "target": [0.5, 0.6]}))
    code, _, err = run(["theory", "pareto", "--pair", str(path)], capsys)
    assert code == 2 and "target sums to 1.1" in err and err.count("\n") == 1


def test_figures_command_writes_readable_pngs(tmp_path, capsys):
    code, out, _ = run(["theory", "figures", "--out", str(tmp_path / "figs"), "--runs", "300",
                        "--horizon", "8", "--no-progress"], capsys)
    paths = out.split()
    assert code == 0 and len(paths) == 5
    for path in paths:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_theory_without_subcommand_prints_help(capsys):
    code, out, _ = run(["theory"], capsys)
    assert code == 2 and "random-chain" in out


# ----------------------------------------------------------------------------------- Theorem 2 (issue 17)


def test_optimality_no_unbiased_rule_rejects_less_than_sd(tmp_path, capsys):
    """Exact and simulated (N = 20,000 runs, seed 0) on a V = 7, T = 50 pair: every rival that keeps
    the output exact (scaled, power) has more expected rejections than SD, its simulation agrees within
    4 standard errors, and its last token passes a chi-square test against the target chain (p > 1e-3);
    over-acceptance rejects less but is biased and fails it."""
    path = tmp_path / "pair.json"
    save_chain(random_chain(7, 50, 0), path)
    code, out, err = run(["theory", "optimality", str(path), "--json"], capsys)
    assert code == 0, err
    payload = json.loads(out)
    rules = {r["name"]: r for r in payload["rules"]}
    standard = rules["standard"]
    assert standard["expected_rejections"] == pytest.approx(exact.expected_rejections_sd(load_chain(path)), rel=1e-12)
    assert payload["unbiased_with_fewer_rejections"] == []
    assert set(rules) == {"standard", "scaled 0.9", "scaled 0.75", "scaled 0.5", "power 2", "overaccept 0.1"}
    for name, rule in rules.items():
        assert abs(rule["simulated_mean"] - rule["expected_rejections"]) < 4 * rule["simulated_stderr"]
        if name == "overaccept 0.1":
            assert not rule["unbiased"] and rule["max_bias"] > 0.01
            assert rule["expected_rejections"] < standard["expected_rejections"]
            assert rule["chi_square_pvalue"] < 1e-3
        else:
            assert rule["unbiased"] and rule["max_bias"] < 1e-12 and rule["chi_square_pvalue"] > 1e-3
            if name != "standard":
                assert rule["expected_rejections"] > standard["expected_rejections"] + 0.5
    # R(c) = 1 - c (1 - TV) at every step, and the states follow the target chain: E = T - c (T - E_SD)
    horizon = payload["horizon"]
    assert rules["scaled 0.5"]["expected_rejections"] == pytest.approx(
        horizon - 0.5 * (horizon - standard["expected_rejections"]), rel=1e-12)


def test_optimality_takes_a_one_step_pair_and_reports_text(tmp_path, capsys):
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"draft": [0.3, 0.7], "target": [0.5, 0.5]}))
    code, out, _ = run(["theory", "optimality", str(path), "--simulate", "0", "--factors", "0.8", "--powers", "3"], capsys)
    assert code == 0
    assert "no unbiased rule rejects less than standard SD" in out
    assert "scaled 0.8" in out and "power 3" in out
    code, out, _ = run(["theory", "optimality", str(path), "--simulate", "0", "--json"], capsys)
    rules = {r["name"]: r for r in json.loads(out)["rules"]}
    assert rules["standard"]["expected_rejections"] == pytest.approx(0.2)  # TV of the worked example
    assert rules["scaled 0.5"]["expected_rejections"] == pytest.approx(1 - 0.5 * 0.8)


@pytest.mark.parametrize("argv, fragment", [
    (["--factors", "1.5"], "scaling factors"), (["--powers", "0.5"], "powers"), (["--simulate", "-1"], "--simulate"),
    (["--epsilon", "-0.1"], "epsilon")])
def test_optimality_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, fragment):
    path = tmp_path / "pair.json"
    save_chain(random_chain(3, 2, 0), path)
    code, out, err = run(["theory", "optimality", str(path), *argv], capsys)
    assert code == 2 and fragment in err and "Traceback" not in err
    code, _, err = run(["theory", "optimality", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "not found" in err
