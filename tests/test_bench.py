"""``genspec bench``: method syntax, statistics and theory on synthetic results, the report and plots,
clear one-line errors, and a full run on tiny models saved to disk (plus a real-model smoke run)."""
from __future__ import annotations

import gzip
import json
import math

import pytest
from tiny_models import save_tiny_model

from genspec.bench import analysis
from genspec.cli.bench import QUICK
from genspec.bench.methods import HF_PLAIN, PLAIN, REFERENCES, parse_method, parse_methods, split_top_level, sweep_methods
from genspec.bench.plots import write_plots
from genspec.bench.report import write_report
from genspec.cli import main
from genspec.errors import ConfigError
from genspec.theory.leviathan import expected_tokens_per_call as expected_tokens

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_KEYS = {"phase", "repeat", "method", "kind", "category", "question_id", "prompt_tokens", "new_tokens",
            "wall_time_s", "tokens_per_second", "token_ids", "stats", "steps", "forward", "error",
            "matches_plain", "matches_reference"}


# ------------------------------------------------------------------------------------------ methods
def test_method_syntax():
    spec = parse_method("hierarchical:levels=prompt-lookup+quantized")
    assert (spec.kind, spec.base, spec.options) == ("genspec", "hierarchical", {"levels": ["prompt-lookup", "quantized"]})
    spec = parse_method("layer-skip:skip=[3,5,7]:k=4:draft_length=fixed")
    assert spec.options == {"skip": [3, 5, 7]}
    assert spec.config_overrides == {"num_draft_tokens": 4, "draft_length": "fixed"}
    spec = parse_method("hf-prompt-lookup:prompt_lookup_num_tokens=5")
    assert (spec.kind, spec.options) == ("hf", {"prompt_lookup_num_tokens": 5})
    assert parse_method("none").name == PLAIN
    assert split_top_level("a,layer-skip:skip=[1,2],b") == ["a", "layer-skip:skip=[1,2]", "b"]


def test_methods_always_start_with_both_baselines_without_duplicates():
    names = [m.name for m in parse_methods("prompt-lookup,hf-plain,plain,hf-prompt-lookup")]
    assert names == [PLAIN, HF_PLAIN, "prompt-lookup", "hf-prompt-lookup"]
    sweep = sweep_methods(parse_method("prompt-lookup"), [2, 4])
    assert [m.name for m in sweep] == ["prompt-lookup@k=2", "prompt-lookup@k=4"]
    assert sweep[0].config_overrides == {"num_draft_tokens": 2, "draft_length": "fixed"}


def test_bench_gives_each_learning_method_its_own_memory():
    from genspec.bench.methods import drafter_options, parse_method, sweep_methods

    a, b = parse_method("ngram-cache"), parse_method("ngram-cache:corpus=x")
    sweep = sweep_methods(a, [2, 4])
    namespaces = {drafter_options(m)["namespace"] for m in [a, b] + sweep}
    assert len(namespaces) == 4
    assert drafter_options(parse_method("ngram-cache:namespace=mine"))["namespace"] == "mine"
    assert "namespace" not in drafter_options(parse_method("prompt-lookup"))
    assert drafter_options(parse_method("suffix"))["namespace"] == "genspec-bench:suffix"
    hybrids = [parse_method(m) for m in ("hybrid", "hybrid:tree_nodes=4", "hybrid:lookup=suffix")]
    assert len({drafter_options(m)["namespace"] for m in hybrids}) == 3  # a suffix lookup learns
    assert "namespace" not in drafter_options(parse_method("hybrid:lookup=prompt-lookup"))


@pytest.mark.parametrize("text, message", [
    ("nope", "unknown method 'nope'"),
    ("prompt-lookup:max_ngram", "KEY=VALUE"),
    ("prompt-lookup:k=0", "k must be an integer >= 1"),
    ("prompt-lookup:draft_length=soon", "draft_length must be one of"),
    ("hf-prompt-lookup:not_an_option=1", "not a transformers generate() option"),
    ("hf-assisted", "needs a draft model"),
    ("draft-model", "needs a draft model"),
    ("plain:k=3", "takes no options"),
])
def test_bad_methods(text, message):
    with pytest.raises(ConfigError) as info:
        parse_methods(text)
    assert message in str(info.value)


# ------------------------------------------------------------------------------ synthetic results
def _genspec_stats(steps, draft_time, verify_time, wall):
    drafted = sum(d for d, _ in steps)
    accepted = sum(a for _, a in steps)
    width = max([d for d, _ in steps] + [0])
    return {"drafted_tokens": drafted, "accepted_tokens": accepted, "target_calls": len(steps),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / len(steps), "draft_time_s": draft_time,
            "verify_time_s": verify_time, "total_time_s": wall, "new_tokens": sum(a + 1 for _, a in steps),
            "drafted_per_position": [sum(1 for d, _ in steps if d > i) for i in range(width)],
            "accepted_per_position": [sum(1 for _, a in steps if a > i) for i in range(width)]}


def _run(method, kind, category, qid, repeat, wall, phase="main", k=None, error=None):
    slow = 1 + 0.1 * repeat  # the whole machine is 10% slower in the second repeat
    wall *= slow
    run = {"phase": phase, "repeat": repeat, "method": method, "kind": kind, "category": category,
           "question_id": qid, "prompt_tokens": 20, "new_tokens": 10, "wall_time_s": wall,
           "tokens_per_second": 10 / wall, "token_ids": list(range(10)), "stats": None, "steps": None,
           "forward": None, "error": error, "matches_plain": None if method == PLAIN else True,
           "matches_reference": True if kind == "hf" and method != HF_PLAIN else None, "k": k}
    if method == PLAIN:
        run["stats"] = _genspec_stats([(0, 0)] * 10, 0.0, 0.9 * slow, wall)
        run["steps"] = [[0, 0]] * 10
        run["forward"] = {"target_s": 1.0 * slow, "prefill_s": 0.1 * slow, "verify_by_width": {"1": [10, 0.9 * slow]},
                          "draft_model_s": 0.0, "model_s": 1.0 * slow}
    elif kind == "genspec":  # 5 steps drafting 4, accepting 1: alpha = 0.5
        steps = [[4, 1]] * 5
        run["stats"] = _genspec_stats(steps, 0.02 * slow, 0.4 * slow, wall)
        run["steps"] = steps
        run["forward"] = {"target_s": 0.45 * slow, "prefill_s": 0.05 * slow, "verify_by_width": {"5": [5, 0.4 * slow]},
                          "draft_model_s": 0.0, "model_s": 0.45 * slow}
    elif method != HF_PLAIN:
        steps = [[10, 1]] * 5
        run["stats"] = {k2: v for k2, v in _genspec_stats(steps, 0, 0, wall).items()
                        if k2 not in ("draft_time_s", "verify_time_s", "total_time_s", "new_tokens")}
        run["steps"] = steps
        run["forward"] = {"model_s": 0.9 * wall}
    else:
        run["forward"] = {"model_s": 0.9 * wall}
    if error:
        run.update(new_tokens=0, wall_time_s=0.0, stats=None, steps=None, forward=None, token_ids=[])
    return run


def synthetic_results():
    """plain 1.0 s, hf-plain 2.0 s, prompt-lookup 0.5 s, hf-prompt-lookup 1.0 s per 10-token prompt."""
    methods = [(PLAIN, "genspec", 1.0), (HF_PLAIN, "hf", 2.0), ("prompt-lookup", "genspec", 0.5),
               ("hf-prompt-lookup", "hf", 1.0)]
    runs = []
    for repeat in range(2):
        for category, qid in (("qa", 1), ("qa", 2), ("coding", 3)):
            for method, kind, wall in methods:
                error = "RuntimeError: boom" if (method, qid, repeat) == ("hf-prompt-lookup", 2, 1) else None
                runs.append(_run(method, kind, category, qid, repeat, wall, error=error))
            if category == "coding":
                runs.append(_run(PLAIN, "genspec", category, qid, repeat, 1.0, phase="sweep"))
                for k, wall in ((2, 0.8), (4, 0.6)):
                    runs.append(_run(f"prompt-lookup@k={k}", "genspec", category, qid, repeat, wall, "sweep", k))
    return {"created": "now", "command": "genspec bench ...",
            "machine": {"cpu_model": "Test CPU", "logical_cores": 2, "torch": "x", "transformers": "y"},
            "model": {"path": "/models/tiny", "num_layers": 2, "vocab_size": 259, "dtype": "float32"},
            "settings": {"categories": ["qa", "coding"], "num_prompts": 2, "max_new_tokens": 10, "repeats": 2,
                         "temperature": 0.0, "seed": 0, "num_draft_tokens": 4, "draft_length": "cost",
                         "default_method": "prompt-lookup", "sweep_method": "prompt-lookup", "sweep_prompts": 1},
            "methods": [{"name": m, "kind": k} for m, k, _ in methods], "runs": runs}


def _row(summary, category, method):
    return next(r for r in summary["rows"] if r["category"] == category and r["method"] == method)


def test_summary_pairs_speedups_per_repeat_and_skips_failed_calls():
    summary = analysis.summarize(synthetic_results())
    assert summary["categories"] == ["qa", "coding"] and summary["repeats"] == 2
    for category in ("qa", "coding", analysis.ALL, analysis.MEAN):
        pl = _row(summary, category, "prompt-lookup")
        assert pl["speedup_vs_plain"]["median"] == pytest.approx(2.0)
        assert pl["speedup_vs_plain"]["min"] == pytest.approx(2.0) and pl["speedup_vs_plain"]["n"] == 2
        assert pl["speedup_vs_reference"]["median"] == pytest.approx(4.0)
        # the failed call is left out of both sides of its pair, so the speedup stays exact
        assert _row(summary, category, "hf-prompt-lookup")["speedup_vs_reference"]["median"] == pytest.approx(2.0)
    plain = _row(summary, "qa", PLAIN)["tokens_per_second"]
    assert plain["values"] == pytest.approx([10.0, 10 / 1.1])
    assert plain["min"] == pytest.approx(10 / 1.1) and plain["max"] == pytest.approx(10.0)
    hf = _row(summary, analysis.ALL, "hf-prompt-lookup")
    assert hf["failed_runs"] == 1 and hf["errors"] == ["RuntimeError: boom"]
    assert hf["mean_accepted_length"] == pytest.approx(2.0) and hf["acceptance_rate"] == pytest.approx(0.1)
    pl = _row(summary, analysis.ALL, "prompt-lookup")
    assert pl["mean_accepted_length"] == pytest.approx(2.0) and pl["acceptance_rate"] == pytest.approx(0.25)
    assert [p["rate"] for p in pl["acceptance_per_position"]] == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert pl["matches_plain"] == [6, 6]
    assert pl["overhead_share"] == pytest.approx(0.1) and pl["verify_share"] == pytest.approx(0.8)


def test_theory_prediction_uses_measured_acceptance_and_costs():
    summary = analysis.summarize(synthetic_results())
    theory = _row(summary, "qa", "prompt-lookup")["theory"]
    assert theory["alpha"] == pytest.approx(0.5)  # 5 accepted, 5 rejections
    per_token = (4 * 0.001 + 0.08) / expected_tokens(0.5, 4)
    assert theory["predicted_decode_speedup"] == pytest.approx(0.09 / per_token)
    predicted = (10 / (0.05 + 10 * per_token)) / (10 / (0.1 + 10 * 0.09))
    assert theory["predicted_speedup"] == pytest.approx(predicted)
    assert theory["efficiency"] == pytest.approx(2.0 / predicted)
    assert theory["draft_cost_ratio"] == pytest.approx(0.001 / 0.09)
    assert theory["verify_cost_ratio"] == pytest.approx(0.08 / 0.09)


def test_theory_reproduces_leviathan_with_free_drafts_and_unit_verify_cost():
    """alpha = 0.8, gamma = 5, c = 0, verify cost = 1 step: 3.689 tokens per call, so a 3.689x speedup."""
    steps = [[5, 4]] * 8  # 32 accepted, 8 rejections: alpha = 0.8
    run = {"new_tokens": 40, "wall_time_s": 1.0, "stats": _genspec_stats(steps, 0.0, 0.8, 1.0), "steps": steps,
           "forward": {"prefill_s": 0.0, "verify_by_width": {"6": [8, 0.8]}}}
    plain = {"new_tokens": 40, "wall_time_s": 4.0, "stats": _genspec_stats([(0, 0)] * 40, 0, 4.0, 4.0),
             "forward": {"prefill_s": 0.0, "verify_by_width": {"1": [40, 4.0]}}}
    theory = analysis.theory([run], [plain])
    assert theory["alpha"] == pytest.approx(0.8)
    assert theory["predicted_decode_speedup"] == pytest.approx(3.689, abs=1e-3)
    assert theory["predicted_speedup"] == pytest.approx(3.689, abs=1e-3)


def test_noise_notes():
    rows = [{"category": "qa", "method": PLAIN, "speedup_vs_plain": analysis.spread([1.0, 1.0])},
            {"category": "qa", "method": "a", "speedup_vs_plain": analysis.spread([1.5, 1.9])},
            {"category": "qa", "method": "b", "speedup_vs_plain": analysis.spread([1.8, 2.2])},
            {"category": "qa", "method": "c", "speedup_vs_plain": analysis.spread([0.95, 1.1])}]
    [note] = analysis.noise_notes(rows, [PLAIN, "a", "b", "c"], ["qa"])
    assert note == {"category": "qa", "fastest": "b", "within_noise_of_fastest": ["a"],
                    "within_noise_of_plain": ["c"]}
    assert analysis.overlap(analysis.spread([1.0]), analysis.spread([1.0, 2.0])) is None  # one repeat: unknown


def test_report_on_synthetic_results():
    results = synthetic_results()
    text = write_report(results)
    for heading in ("## Summary: mean over categories", "## Within noise", "### all prompts pooled", "### qa",
                    "### coding", "## Diagnostics", "## Draft length sweep", "## How this was measured"):
        assert heading in text
    assert "| prompt-lookup (genspec default) | 19.1 [18.2–20.0] | 2.00x [2.00–2.00] | 4.00x [4.00–4.00] |" in text
    assert "hf-prompt-lookup ⚠ 1 failed" in text and "RuntimeError: boom" in text
    assert "separate copy of the model" in text and "Test CPU" in text
    assert "| prompt-lookup@k=2 | 2 | 11.9 [11.4–12.5] |" in text
    assert "fastest `prompt-lookup`" in text
    one_repeat = dict(results, runs=[r for r in results["runs"] if r["repeat"] == 0])
    assert "One repeat only" in write_report(one_repeat)
    assert "Note:" not in text and "Note: runs of x removed" in write_report(dict(results, note="runs of x removed"))


def _check_png(path):
    import matplotlib.image

    assert path.is_file() and path.read_bytes()[:8] == PNG_MAGIC
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width >= 600 and height >= 300


def test_plots_on_synthetic_results(tmp_path):
    results = synthetic_results()
    written = write_plots(results, analysis.summarize(results), tmp_path)
    assert sorted(p.name for p in written) == sorted(
        ["speedup_by_category.png", "acceptance_by_position.png", "time_breakdown.png", "tokens_per_second_vs_k.png"])
    for path in written:
        _check_png(path)
    no_sweep = dict(results, runs=[r for r in results["runs"] if r["phase"] == "main"])
    (tmp_path / "no_sweep").mkdir()
    written = write_plots(no_sweep, analysis.summarize(no_sweep), tmp_path / "no_sweep")
    assert "tokens_per_second_vs_k.png" not in {p.name for p in written}


# --------------------------------------------------------------------------------------- CLI errors
def _one_line_error(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("extra, message", [
    (["--methods", "nope"], "unknown method 'nope'"),
    (["--methods", "prompt-lookup,hf-assisted"], "needs a draft model"),
    (["--categories", ""], "--categories is empty"),
    (["--categories", ","], "--categories is empty"),
    (["--categories", "qa,poetry"], "unknown categories ['poetry']"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["-k", "0"], "-k must be >= 1"),
    (["--k-sweep", "2,x"], "--k-sweep must be a comma-separated list of integers"),
    (["--k-sweep", "2", "--methods", "hf-prompt-lookup"], "--k-sweep needs a genspec method"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--draft-model", "/no/such/draft"], "no draft model at /no/such/draft"),
    (["--report-from", "/no/results.json"], "results file not found"),
])
def test_bad_arguments_are_one_clear_line(capsys, tmp_path, tiny_model_dirs, extra, message):
    target, _ = tiny_model_dirs
    _one_line_error(capsys, ["bench", "--model", str(target), "--out", str(tmp_path / "out")] + extra, message)


@pytest.mark.parametrize("runs", [[], [{"repeat": 0, "method": "plain", "kind": "genspec", "category": "qa",
                                        "question_id": 1, "new_tokens": 0, "wall_time_s": 0.1, "error": "boom"}]])
def test_report_from_results_without_a_completed_call_is_an_error(capsys, tmp_path, runs):
    """Issue 46 item 10: ``--report-from`` a results file with ``"runs": []`` (or only failed calls) wrote an
    all-"–" report and exited 0."""
    source = tmp_path / "results.json"
    source.write_text(json.dumps({"methods": [{"name": PLAIN, "kind": "genspec"}], "runs": runs}))
    err = _one_line_error(capsys, ["bench", "--report-from", str(source), "--out", str(tmp_path / "out")],
                          "runs: no completed call to report")
    assert str(source) in err and not (tmp_path / "out").exists()


def test_missing_model_is_one_clear_line(capsys, tmp_path):
    _one_line_error(capsys, ["bench", "--model", str(tmp_path / "none"), "--out", str(tmp_path)], "no model at")


def test_unwritable_output_directory(capsys, tmp_path, tiny_model_dirs):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    err = _one_line_error(capsys, ["bench", "--model", str(tiny_model_dirs[0]), "--out", str(blocker / "out")],
                          "cannot write to output directory")
    assert str(blocker / "out") in err


def test_bad_drafter_option_is_one_clear_line(capsys, tmp_path, tiny_model_dirs):
    _one_line_error(capsys, ["bench", "--model", str(tiny_model_dirs[0]), "--out", str(tmp_path), "--categories", "qa",
                             "--num-prompts", "1", "--max-new-tokens", "2", "--methods", "early-exit:exit_layer=9"],
                    "exit layer must be in 1..2")


# ----------------------------------------------------------------------------------- full tiny run
def check_bench_output(out, expect_sweep: bool = True, raw: bool = True) -> dict:
    """results.json, report.md and the PNGs exist and are well-formed; returns the results. ``raw``: the
    run was made with ``--raw`` (each call's token ids and steps kept), else those records are absent."""
    results = json.loads((out / "results.json").read_text())
    for key in ("created", "command", "machine", "model", "settings", "methods", "prompts", "runs", "summary"):
        assert key in results
    for key in ("cpu_model", "logical_cores", "torch", "transformers", "python", "torch_threads"):
        assert results["machine"][key]
    assert results["model"]["path"] and results["model"]["vocab_size"] > 0
    backend = results["settings"]["backend"]
    assert results["model"]["backend"] == backend
    if backend == "torch":
        kernels = results["model"]["lm_head_kernels"]  # a tiny model's head is not timed: nothing chosen
        assert kernels is None or all(k in ("gemm", "packed", "chunked") for k in kernels.values())
        linears = results["model"]["linear_kernels"]
        assert linears is None or all(k in ("linear", "gemm", "packed") for k in linears.values())
    names = [m["name"] for m in results["methods"]]
    assert names[:2] == [PLAIN, REFERENCES[backend]]
    keys = RUN_KEYS if raw else RUN_KEYS - {"token_ids", "steps"}
    for run in results["runs"]:
        assert keys <= set(run)
        assert raw or not {"token_ids", "steps"} & set(run)
        if run["error"] is None:
            assert run["new_tokens"] == (len(run["token_ids"]) if raw else run["new_tokens"]) > 0
            assert run["wall_time_s"] > 0
            assert math.isclose(run["tokens_per_second"], run["new_tokens"] / run["wall_time_s"])
    ok = [r for r in results["runs"] if r["error"] is None and r["phase"] == "main"]
    assert {r["method"] for r in ok} == set(names), "every method completed at least one call"
    report = (out / "report.md").read_text()
    for category in results["summary"]["categories"]:
        assert f"### {category}" in report
    for name in names:
        assert f"| {name}" in report
    pngs = ["speedup_by_category.png", "acceptance_by_position.png", "time_breakdown.png"]
    for name in pngs + (["tokens_per_second_vs_k.png"] if expect_sweep else []):
        _check_png(out / name)
        assert f"({name})" in report
    return results


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dirs):
    target, draft = tiny_model_dirs
    out = tmp_path_factory.mktemp("bench_out")
    argv = ["bench", "--model", str(target), "--draft-model", str(draft), "--categories", "qa,extraction",
            "--num-prompts", "2", "--max-new-tokens", "6", "--repeats", "2", "-k", "3", "--out", str(out),
            "--methods", "prompt-lookup,draft-model:k=2:draft_length=fixed,hf-prompt-lookup,hf-early-exit,hf-assisted",
            "--k-sweep", "1,3", "--sweep-prompts", "1", "--threads", "1", "--raw"]
    assert main(argv) == 0
    return out


def test_full_tiny_run_writes_everything(tiny_run):
    results = check_bench_output(tiny_run)
    settings = results["settings"]
    # the extraction prompts do not fit the tiny model's 256-token context: skipped and recorded
    assert {p["category"] for p in settings["prompts_skipped"]} == {"extraction"}
    assert results["summary"]["categories"] == ["qa"]
    assert settings["hf_generate"]["hf-prompt-lookup"] == {"prompt_lookup_num_tokens": 10}
    assert settings["hf_generate"]["hf-early-exit"] == {"assistant_early_exit": 1}
    assert settings["eos_token_ids"] == [2]
    assert settings["threads"] == 1 and results["machine"]["torch_threads"] == 1
    assert "--threads 1" in results["command"]
    main_runs = [r for r in results["runs"] if r["phase"] == "main"]
    assert len(main_runs) == 2 * 2 * 7  # repeats x prompts x methods
    # greedy: every genspec method reproduces plain decoding token for token
    for run in main_runs:
        if run["kind"] == "genspec" and run["method"] != PLAIN:
            assert run["matches_plain"] is True
        if run["kind"] == "hf" and run["method"] != HF_PLAIN:
            assert run["matches_reference"] is not None
    # instrumented figures
    dm = next(r for r in main_runs if r["method"] == "draft-model:k=2:draft_length=fixed")
    assert dm["forward"]["draft_model_s"] > 0 and dm["forward"]["prefill_s"] > 0
    assert all(d <= 2 for d, _ in dm["steps"]) and len(dm["steps"]) == dm["stats"]["target_calls"]
    assisted = [r for r in main_runs if r["method"] == "hf-assisted"]
    assert all(r["steps"] for r in assisted) and all(r["stats"]["target_calls"] == len(r["steps"]) for r in assisted)
    rows = {(r["category"], r["method"]): r for r in results["summary"]["rows"]}
    assert rows[("all", "draft-model:k=2:draft_length=fixed")]["theory"]["predicted_speedup"] > 0
    assert rows[("all", "hf-assisted")]["mean_accepted_length"] >= 1
    sweep = [r for r in results["runs"] if r["phase"] == "sweep"]
    assert {r["method"] for r in sweep} == {PLAIN, "prompt-lookup", "prompt-lookup@k=1", "prompt-lookup@k=3"}
    assert {r["k"] for r in sweep} == {None, 1, 3}


def test_report_can_be_rebuilt_from_results(tiny_run, tmp_path, capsys):
    assert main(["bench", "--report-from", str(tiny_run / "results.json"), "--out", str(tmp_path)]) == 0
    check_bench_output(tmp_path)
    assert (tmp_path / "report.md").read_text() == (tiny_run / "report.md").read_text()


def test_bench_writes_per_token_records_only_with_raw(tiny_model_dirs, tmp_path, capsys):
    """Without ``--raw`` results.json holds no call's token ids or step list, only each call's step counts
    ``[[drafted, accepted, count], ...]``, which agree with its stats; the report (Leviathan's prediction
    included) is rebuilt identically from that compact file, also gzip-compressed."""
    target, _ = tiny_model_dirs
    out = tmp_path / "run"
    assert main(["bench", "--model", str(target), "--categories", "qa", "--num-prompts", "1", "--max-new-tokens",
                 "6", "--repeats", "1", "-k", "3", "--methods", "prompt-lookup", "--threads", "1",
                 "--out", str(out)]) == 0
    results = check_bench_output(out, expect_sweep=False, raw=False)
    assert "--raw" not in results["command"] and results["settings"]["raw"] is False
    genspec_runs = [r for r in results["runs"] if r["kind"] == "genspec" and r["error"] is None]
    assert genspec_runs
    for run in genspec_runs:
        assert sum(n for _, _, n in run["step_counts"]) == run["stats"]["target_calls"]
        assert sum(a * n for _, a, n in run["step_counts"]) == run["stats"]["accepted_tokens"]
    rows = {(r["category"], r["method"]): r for r in results["summary"]["rows"]}
    assert rows[("all", "prompt-lookup")]["theory"] is not None
    again = tmp_path / "again"
    assert main(["bench", "--report-from", str(out / "results.json"), "--out", str(again)]) == 0
    assert (again / "report.md").read_text() == (out / "report.md").read_text()
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "results.json.gz").write_bytes(gzip.compress((out / "results.json").read_bytes()))
    assert main(["bench", "--report-from", str(packed / "results.json.gz")]) == 0
    assert (packed / "report.md").read_text() == (out / "report.md").read_text()
    assert sorted(p.name for p in packed.iterdir() if p.suffix != ".png") == ["report.md", "results.json.gz"]


def test_raw_bench_records_every_token_and_step(tiny_run):
    """``--raw`` keeps each call's token ids and its steps in order, as the command line says."""
    results = json.loads((tiny_run / "results.json").read_text())
    assert results["command"].split()[-3] == "--raw" and results["settings"]["raw"] is True
    run = next(r for r in results["runs"] if r["method"] == "prompt-lookup" and r["error"] is None)
    assert len(run["token_ids"]) == run["new_tokens"] and len(run["steps"]) == run["stats"]["target_calls"]


def test_quick_preset_is_small():
    assert QUICK["num_prompts"] * len(QUICK["categories"].split(",")) <= 3
    assert QUICK["max_new_tokens"] <= 32 and QUICK["repeats"] == 1


@pytest.mark.smoke
def test_quick_bench_on_the_real_default_model(tmp_path):
    """``genspec bench --quick`` on the embedded Gemma 3 270M: files exist and are well-formed (not speeds).
    CI runs it (about 70 s on the 2-core VM)."""
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    results = check_bench_output(tmp_path, raw=False)
    assert results["settings"]["quick"] is True


def test_edit_task_prompts_are_selectable_and_not_in_the_default():
    from genspec.bench.prompts import load_spec_bench

    edit = load_spec_bench(["edit"])
    assert len(edit) == 8 and {p.category for p in edit} == {"edit"}
    assert all("Correct the grammar" in p.text for p in edit)
    assert "edit" not in {p.category for p in load_spec_bench()}


def test_repeated_traffic_replay_is_selectable_and_disjoint_from_the_measured_prompts():
    from genspec.bench.prompts import load_spec_bench

    replay = load_spec_bench(["repeated"], 2)
    assert [p.question_id % 10 for p in replay] == [1, 2, 1, 2, 3, 3]  # turns 1, 2 per conversation, then repeats
    assert replay[1].follows == replay[0].question_id and replay[3].follows == replay[2].question_id
    assert replay[4].text == replay[0].text and replay[5].text == replay[2].text  # the same questions again
    assert [p.history for p in replay] == [True, False, True, False, False, False]  # first turns: history
    assert "repeated" not in {p.category for p in load_spec_bench()}
    measured = {p.text for p in load_spec_bench(None, 2)}
    assert not measured & {p.text for p in load_spec_bench(["repeated"])}  # 24 conversations, none measured
    assert len(load_spec_bench(["repeated"])) == 3 * 24


def test_repeated_traffic_bench_learns_across_requests(tmp_path):
    """A tiny bench run of the replay (1 conversation: first turn, second turn with the answer in context,
    first turn again): greedy outputs equal plain decoding, the second turn's prompt holds the first turn's
    answer, and the suffix drafter drafts the repeated question's answer from its process cache."""
    model = save_tiny_model(tmp_path / "model", seed=0, context=2048)
    out = tmp_path / "out"
    assert main(["bench", "--model", str(model), "--categories", "repeated", "--num-prompts", "1",
                 "--max-new-tokens", "24", "--repeats", "1", "-k", "4", "--draft-length", "fixed",
                 "--methods", "suffix,prompt-lookup", "--threads", "1", "--raw", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    runs = {(r["method"], r["question_id"] % 10): r for r in results["runs"]}
    # the first turn is history: decoded by every method, not counted in the category's figures
    assert {r["phase"] for r in results["runs"] if r["question_id"] % 10 == 1} == {"history"}
    assert {r["phase"] for r in results["runs"] if r["question_id"] % 10 != 1} == {"main"}
    counted = {row["method"]: row["runs"] for row in results["summary"]["rows"] if row["category"] == "repeated"}
    assert counted and all(n == 2 for n in counted.values())  # the second turn and the repeated question
    assert "History: 1 request(s)" in (out / "report.md").read_text()
    assert all(r["matches_plain"] for r in runs.values() if r["kind"] == "genspec" and r["method"] != PLAIN)
    tokens = {p["question_id"] % 10: p["prompt_tokens"] for p in results["prompts"]}
    assert tokens[2] > tokens[1] + 24 - 1  # the first turn and its answer are in the second turn's context
    first, again = runs[("suffix", 1)], runs[("suffix", 3)]
    assert again["token_ids"] == first["token_ids"]
    assert again["stats"]["accepted_tokens"] > first["stats"]["accepted_tokens"] + 8
    assert again["stats"]["accepted_tokens"] > runs[("prompt-lookup", 3)]["stats"]["accepted_tokens"]


def test_sampled_bench_with_top_p_applies_it_to_every_method_and_records_it(tmp_path, tiny_model_dirs):
    """``--temperature 0.7 --top-p 0.9``: genspec's methods and the HF baselines sample with the same
    nucleus (HF's generate() gets top_p 0.9); results and report say so and the command line replays it."""
    from genspec.bench.hf_baselines import HFDecoder
    from genspec.sampling import SamplingConfig

    decoder = HFDecoder.__new__(HFDecoder)  # generate_kwargs reads only these three fields
    decoder.kwargs, decoder.eos_token_ids, decoder.pad_token_id = {}, [1], 0
    sampled = decoder.generate_kwargs(8, SamplingConfig(temperature=0.7, top_p=0.9))
    assert (sampled["do_sample"], sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (True, 0.7, 0.9, 0)
    assert decoder.generate_kwargs(8, SamplingConfig())["do_sample"] is False
    target, _ = tiny_model_dirs
    out = tmp_path / "out"
    assert main(["bench", "--model", str(target), "--categories", "qa", "--num-prompts", "1", "--max-new-tokens",
                 "4", "--repeats", "1", "--temperature", "0.7", "--top-p", "0.9", "--methods",
                 "prompt-lookup,hf-prompt-lookup", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["top_p"] == 0.9 and "--top-p 0.9" in results["command"]
    assert "top-p 0.9" in (out / "report.md").read_text()
    assert all(r["error"] is None for r in results["runs"])



def test_skip_prompts_takes_the_prompts_the_default_run_does_not_measure(capsys):
    """``--skip-prompts N`` leaves out each category's first N prompts (and the replay's first N
    conversations), so a tuning run never sees what the default benchmark measures."""
    from genspec.bench.prompts import load_spec_bench

    measured = load_spec_bench(None, 2)
    tuning = load_spec_bench(None, 2, skip=2)
    assert len(tuning) == len(measured) == 26 and not {p.question_id for p in tuning} & {p.question_id for p in measured}
    assert [p.question_id for p in tuning] == [p.question_id for p in load_spec_bench(None, 4) if p not in measured]
    replay, later = load_spec_bench(["repeated"], 2), load_spec_bench(["repeated"], 2, skip=2)
    assert not {p.question_id for p in replay} & {p.question_id for p in later} and len(later) == 6
    assert main(["bench", "--skip-prompts", "-1", "--quick"]) == 2
    assert "--skip-prompts must be >= 0" in capsys.readouterr().err


def test_ignore_eos_generates_the_full_budget_for_every_method(tmp_path, tiny_model_dir):
    """``--ignore-eos``: genspec's methods and the HF baselines all generate --max-new-tokens past an end token
    (the same tokens as before it), where without it each stops at that token; settings, report and the
    replayed command say so."""
    import shutil

    def bench(model, out, *extra):
        assert main(["bench", "--model", str(model), "--categories", "qa", "--num-prompts", "1", "--max-new-tokens",
                     "12", "--repeats", "1", "--methods", "prompt-lookup,hf-prompt-lookup", "--raw", "--out",
                     str(tmp_path / out), *extra]) == 0
        results = json.loads((tmp_path / out / "results.json").read_text())
        return results, {r["method"]: r["token_ids"] for r in results["runs"] if r["phase"] == "main"}

    _, free = bench(tiny_model_dir, "free", "--ignore-eos")
    plain = free["plain"]
    end = plain[4]  # make the fifth greedy token the model's end token
    stop = plain.index(end) + 1
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(dict(config, eos_token_id=end)))
    _, stopped = bench(model, "stopped")
    assert set(stopped) == {"plain", "hf-plain", "prompt-lookup", "hf-prompt-lookup"}
    assert all(tokens == plain[:stop] for tokens in stopped.values())
    results, ignored = bench(model, "ignored", "--ignore-eos")
    assert all(tokens == plain for tokens in ignored.values()) and len(plain) == 12
    assert results["settings"]["ignore_eos"] is True and results["settings"]["eos_token_ids"] == []
    assert "--ignore-eos" in results["command"]
    assert "12 new tokens on every call (end tokens ignored)" in (tmp_path / "ignored" / "report.md").read_text()


def test_round_robin_takes_each_category_in_turn():
    from genspec.bench.prompts import BenchPrompt, round_robin
    prompts = [BenchPrompt(i, category, f"{category}{i}") for i, category in enumerate("aabbbc")]
    assert round_robin(prompts) == ["a0", "b2", "c5", "a1", "b3", "b4"]
    assert round_robin([]) == []
