"""``genspec demo``: alternating repeats, medians with their spread and the note when it is too wide (on
made-up timings: no wall clock is asserted), and the command on a tiny model saved to disk."""
from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_model

from genspec.cli import main
from genspec.cli.demo import TRUSTED_SPREAD, measure, noise_note, summarize
from genspec.engine import RequestResult, RequestStats


def result(seconds: float, tokens: int = 64, ids=(5, 6, 7), drafted: int = 0, accepted: int = 0,
           calls: int = 64) -> RequestResult:
    """A finished request that took ``seconds`` for ``tokens`` tokens: the fake timing source."""
    stats = RequestStats(drafted_tokens=drafted, accepted_tokens=accepted, target_calls=calls, new_tokens=tokens,
                         total_time_s=seconds)
    return RequestResult(list(ids), stats, "length", "text")


def test_one_stalled_run_does_not_make_the_speedup_and_is_flagged():
    """A plain run that other work stalled (64 tokens in 80 s instead of about 3.2 s): the median
    speedup is that of the undisturbed repeats, and the spread of the per-repeat speedups marks the
    prompt as not to be trusted."""
    plain = [result(3.2), result(80.0), result(3.3)]
    spec = [result(1.0, drafted=40, accepted=30, calls=34), result(1.05, drafted=40, accepted=30, calls=34),
            result(0.95, drafted=40, accepted=30, calls=34)]
    row = summarize("code", plain, spec)
    assert row["plain_tokens_per_second"] == pytest.approx(64 / 3.3)
    assert row["speculative_tokens_per_second"] == pytest.approx(64 / 1.0)
    assert row["speedup_runs"] == pytest.approx([3.2, 80 / 1.05, 3.3 / 0.95])
    assert row["speedup"] == pytest.approx(3.3 / 0.95)  # one run's 76x is not the answer
    assert row["speedup_spread"] > TRUSTED_SPREAD and row["spread_too_wide"]
    assert row["acceptance_rate"] == pytest.approx(0.75) and row["mean_accepted_length"] == pytest.approx(1 + 90 / 102)
    assert row["greedy_outputs_match"]
    note = noise_note([row], repeats=3)
    assert "code" in note and "not to be trusted" in note


def test_steady_runs_are_trusted_and_a_single_run_says_it_has_no_spread():
    plain, spec = [result(3.2), result(3.3), result(3.25)], [result(1.0), result(1.02), result(1.01)]
    row = summarize("story", plain, spec)
    assert row["speedup_spread"] < TRUSTED_SPREAD and not row["spread_too_wide"]
    assert noise_note([row], repeats=3) is None
    single = summarize("story", plain[:1], spec[:1])
    assert single["speedup_spread"] is None and not single["spread_too_wide"]
    assert "one run each" in noise_note([single], repeats=1)
    assert not summarize("story", plain, [result(1.0, ids=(5, 6, 8))] * 3)["greedy_outputs_match"]


class FakeEngine:
    """Records the order in which the demo runs the two decodings."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def generate(self, prompt, config):
        self.log.append((prompt, self.name))
        return [result(1.0)]


def test_plain_and_speculative_runs_alternate_which_goes_first():
    log: list = []
    seen: list = []
    runs = measure(FakeEngine("plain", log), FakeEngine("spec", log), {"a": "A", "b": "B"}, None, repeats=3,
                   on_run=lambda name, kind, done: seen.append((name, kind, done)))
    assert log == [(p, e) for p in "AB" for e in ("plain", "spec", "spec", "plain", "plain", "spec")]
    assert [len(runs["a"][0]), len(runs["a"][1])] == [3, 3]
    assert [done for _, _, done in seen] == list(range(12)) and seen[1] == ("a", "speculative", 1)


def test_demo_on_a_tiny_model_reports_medians_and_every_run(capsys, tmp_path):
    model = save_tiny_model(tmp_path / "target", context=1024)  # the byte tokenizer's prompts are long
    assert main(["demo", "--model", str(model), "--repeats", "2", "--max-new-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["repeats"] == 2 and report["trusted_spread"] == TRUSTED_SPREAD
    assert [r["prompt"] for r in report["results"]] == ["summarize", "code", "story"]
    for row in report["results"]:
        assert len(row["plain_tokens_per_second_runs"]) == len(row["speedup_runs"]) == 2
        assert row["greedy_outputs_match"] and row["speedup"] > 0 and row["speedup_spread"] >= 0


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "none"], "--drafter none is plain decoding"),
    (["--drafter", "nope"], "unknown drafter 'nope'"),
    (["--drafter", "draft-model"], "needs a draft model"),
    (["--repeats", "0"], "--repeats must be >= 1")])
def test_bad_demo_arguments_are_one_line_before_loading(capsys, argv, message):
    assert main(["demo", "--model", "/nonexistent/model", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_greedy_mismatch_fails_the_demo_only_on_a_batch_invariant_target():
    from types import SimpleNamespace

    from genspec.cli.demo import greedy_check_passes

    assert greedy_check_passes(True, SimpleNamespace(batch_invariant=True))
    assert not greedy_check_passes(False, SimpleNamespace(batch_invariant=True))
    assert greedy_check_passes(False, SimpleNamespace(batch_invariant=False))  # llama.cpp: reported, not failed


def test_the_near_tie_note_names_the_manuals_section_on_exactness():
    """What the demo prints for a greedy mismatch on llama.cpp agrees with the manual: the rule is exact, the
    backend's kernels are why, exact kernels (on either backend) are where outputs are equal, and the section it
    names exists."""
    from pathlib import Path

    from genspec.cli.demo import EXACTNESS_SECTION, near_tie_note

    note = near_tie_note("llamacpp")
    assert "near-tie" in note and "exact" in note and "--kernels exact" in note and "torch" in note
    backends = (Path(__file__).resolve().parents[1] / "docs" / "backends.md").read_text(encoding="utf-8")
    assert f"\n## {EXACTNESS_SECTION}\n" in backends and f'"{EXACTNESS_SECTION}"' in note


def test_demo_on_a_gguf_file_runs_on_llamacpp(capsys, tmp_path):
    pytest.importorskip("llama_cpp")
    from tiny_gguf import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, context=1024)
    assert main(["demo", "--model", str(path), "--repeats", "1", "--max-new-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "llamacpp"
    assert all(row["greedy_outputs_match"] for row in report["results"])  # float32 weights: no flips
