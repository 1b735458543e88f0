"""Issue 62 items 1 and 8 (bench): no command overwrites an earlier result unless ``--force``, and
``genspec bench --methods`` refuses lists that name no method, an empty item, a method twice or an empty
option. Every refusal is one line, exit 2, before any model loads or any work starts."""
from __future__ import annotations

import json

import pytest

from genspec.cli import build_parser, main


class Started(Exception):
    """Raised by a stand-in for the first slow step of a command: the checks let it through."""


def _start_marker(monkeypatch, module, name):
    def started(*args, **kwargs):
        raise Started(f"{module.__name__}.{name}")

    monkeypatch.setattr(module, name, started)


def _refused(capsys, argv, *mentions):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for mention in mentions:
        assert mention in err, err
    return err


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _earlier_run(tmp_path, name="earlier"):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "report.md").write_text("keep")
    return directory


# --------------------------------------------------------------------------------- every command
def _writing_commands():
    """(command words, parser) of every genspec command that has an --out option."""
    import argparse

    found = []

    def walk(parser, words):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, words + [name])
        if any("--out" in action.option_strings for action in parser._actions):
            found.append((words, parser))

    walk(build_parser(), [])
    return found


def test_every_command_with_an_out_option_has_force():
    """The commands that write (a directory or a file) all take --force: the one way past the refusal."""
    commands = _writing_commands()
    names = {" ".join(words) for words, _ in commands}
    assert {"bench", "tradeoff", "train head", "train medusa", "train draft", "index build", "theory figures",
            "theory random-chain", "calibrate early-exit", "calibrate layer-skip", "calibrate prune",
            "calibrate draft-vocab"} <= names
    missing = [" ".join(words) for words, parser in commands
               if not any("--force" in action.option_strings for action in parser._actions)]
    assert not missing, missing


# ------------------------------------------------------------------------------------------ bench
def _bench(model, out, *extra):
    return ["bench", "--model", str(model), "--methods", "prompt-lookup", "--num-prompts", "1", "--categories",
            "qa", "--max-new-tokens", "2", "--repeats", "1", "--threads", "1", "--out", str(out), *extra]


def test_bench_refuses_a_directory_holding_an_earlier_run_before_anything_loads(capsys, tmp_path, tiny_model_dir,
                                                                                 monkeypatch):
    """The issue's probe: ``echo keep > d/report.md; genspec bench ... --out d`` exited 0 and replaced
    report.md, results.json and the plots."""
    import genspec.cli.bench as bench

    out = _earlier_run(tmp_path)
    before = _snapshot(out)
    _start_marker(monkeypatch, bench, "load_spec_bench")
    _start_marker(monkeypatch, bench, "execute")
    _refused(capsys, _bench(tiny_model_dir, out), f"--out {out} exists and is not empty", "report.md", "--force")
    assert _snapshot(out) == before
    with pytest.raises(Started):  # --force: the checks pass, the run starts
        main(_bench(tiny_model_dir, out, "--force"))


def test_bench_writes_into_a_new_or_empty_directory_and_over_a_run_only_with_force(capsys, tmp_path, tiny_model_dir):
    """An empty directory is fine; a second run into it is refused and leaves the first run's files as
    they were; with --force it writes over them (the other files there stay)."""
    out = tmp_path / "empty"
    out.mkdir()
    assert main(_bench(tiny_model_dir, out)) == 0
    capsys.readouterr()
    first = _snapshot(out)
    assert {"report.md", "results.json"} <= set(first)
    _refused(capsys, _bench(tiny_model_dir, out), "exists and is not empty", "--force")
    assert _snapshot(out) == first
    (out / "notes.txt").write_text("mine")
    (out / "report.md").write_text("stale")
    assert main(_bench(tiny_model_dir, out, "--force")) == 0
    capsys.readouterr()
    again = _snapshot(out)
    assert again["notes.txt"] == b"mine" and set(again) == set(first) | {"notes.txt"}
    assert again["report.md"] != b"stale" and json.loads(again["results.json"])["summary"]


def test_bench_report_from_rebuilds_in_place_but_not_over_another_directory(capsys, tmp_path, monkeypatch):
    """``--report-from RESULTS`` rebuilds the report beside its results without --force; into another
    directory that holds files only with --force (checked after the results file, before anything is written)."""
    import genspec.cli.bench as bench

    source = tmp_path / "run" / "results.json"
    source.parent.mkdir()
    source.write_text("{}")
    monkeypatch.setattr("genspec.bench.schema.check_results", lambda results, path: None)
    _start_marker(monkeypatch, bench, "write_outputs")
    with pytest.raises(Started):
        main(["bench", "--report-from", str(source)])
    with pytest.raises(Started):
        main(["bench", "--report-from", str(source), "--out", str(source.parent)])
    other = _earlier_run(tmp_path)
    _refused(capsys, ["bench", "--report-from", str(source), "--out", str(other)], "exists and is not empty")
    assert _snapshot(other) == {"report.md": b"keep"}
    with pytest.raises(Started):
        main(["bench", "--report-from", str(source), "--out", str(other), "--force"])


# ------------------------------------------------------------------------------ bench --methods
@pytest.mark.parametrize("methods, message", [
    ("", "--methods is empty"),
    (" ", "--methods is empty"),
    (",", "--methods is empty"),
    ("prompt-lookup,,suffix", "has an empty item"),
    ("prompt-lookup,", "has an empty item"),
    ("prompt-lookup,prompt-lookup", "names 'prompt-lookup' twice"),
    ("prompt-lookup:k=4, prompt-lookup:k=4", "names 'prompt-lookup:k=4' twice"),
    ("plain,none", "names 'plain' twice"),
    ("prompt-lookup:", "an empty option after ':'"),
    ("prompt-lookup::k=4", "an empty option after ':'"),
    ("prompt-lookup:k=4:", "an empty option after ':'"),
])
def test_bench_refuses_method_lists_that_run_other_methods_than_asked(capsys, tmp_path, tiny_model_dir, monkeypatch,
                                                                      methods, message):
    """``--methods ""`` ran only the baselines; ``","``, ``"a,,b"``, duplicates and ``"prompt-lookup:"``
    were accepted. Each is one line, exit 2, before any prompt or model loads."""
    import genspec.cli.bench as bench

    _start_marker(monkeypatch, bench, "load_spec_bench")
    _start_marker(monkeypatch, bench, "execute")
    argv = ["bench", "--model", str(tiny_model_dir), "--methods", methods, "--out", str(tmp_path / "out")]
    _refused(capsys, argv, message)
    assert not (tmp_path / "out").exists()


def test_method_lists_that_name_each_method_once_still_parse():
    from genspec.bench.methods import HF_PLAIN, PLAIN, parse_methods

    names = [m.name for m in parse_methods(" prompt-lookup , hf-plain,plain,prompt-lookup:k=4,layer-skip:skip=[1,2]")]
    assert names == [PLAIN, HF_PLAIN, "prompt-lookup", "prompt-lookup:k=4", "layer-skip:skip=[1,2]"]


# --------------------------------------------------------------------------------------- tradeoff
def test_tradeoff_refuses_a_directory_holding_files_before_the_model_loads(capsys, tmp_path, monkeypatch):
    import genspec

    _start_marker(monkeypatch, genspec, "load")
    out = _earlier_run(tmp_path)
    argv = ["tradeoff", "--drafter", "prompt-lookup", "--no-win-rate", "--out", str(out)]
    _refused(capsys, argv, "exists and is not empty", "--force")
    assert _snapshot(out) == {"report.md": b"keep"}
    with pytest.raises(Started):
        main(argv + ["--force"])
    with pytest.raises(Started):  # a new or an empty directory needs nothing
        main(argv[:-1] + [str(tmp_path / "new")])


# ------------------------------------------------------------------------------------------ train
@pytest.mark.parametrize("kind", ["head", "medusa", "draft"])
def test_train_starts_over_in_a_directory_holding_files_only_with_force(capsys, tmp_path, tiny_model_dir, monkeypatch,
                                                                        kind):
    import genspec

    _start_marker(monkeypatch, genspec, "load_model")
    out = _earlier_run(tmp_path)
    argv = ["train", kind, "--model", str(tiny_model_dir), "--out", str(out), "--steps", "2", "--prompts", "2",
            "--max-new-tokens", "8", "--max-prompt-tokens", "64", "--vocab-size", "32"]
    _refused(capsys, argv, "exists and is not empty", "--force", "--resume")
    _refused(capsys, argv + ["--force", "--resume"], "--resume and --force exclude each other")
    assert _snapshot(out) == {"report.md": b"keep"}
    with pytest.raises(Started):
        main(argv + ["--force"])


# ----------------------------------------------------------------------------------------- theory
def test_theory_figures_refuse_a_directory_holding_files_before_simulating(capsys, tmp_path, monkeypatch):
    import genspec.theory.figures as figures

    _start_marker(monkeypatch, figures, "make_figures")
    out = _earlier_run(tmp_path)
    argv = ["theory", "figures", "--out", str(out), "--no-progress"]
    _refused(capsys, argv, "exists and is not empty", "--force")
    assert _snapshot(out) == {"report.md": b"keep"}
    with pytest.raises(Started):
        main(argv + ["--force"])


def test_theory_random_chain_overwrites_a_file_only_with_force(capsys, tmp_path):
    path = tmp_path / "pair.json"
    path.write_text("mine")
    argv = ["theory", "random-chain", "-V", "3", "-T", "2", "--out", str(path)]
    _refused(capsys, argv, f"--out file {path} already exists", "--force")
    assert path.read_text() == "mine"
    assert main(argv + ["--force"]) == 0
    assert "draft" in json.loads(path.read_text())
    empty = tmp_path / "empty.json"
    empty.write_text("")  # an empty file holds nothing to lose (a mktemp name)
    assert main(["theory", "random-chain", "-V", "3", "-T", "2", "--out", str(empty)]) == 0
    assert main(["theory", "random-chain", "-V", "3", "-T", "2", "--out", "-"]) == 0


# -------------------------------------------------------------------------------------- calibrate
@pytest.mark.parametrize("what", [["early-exit"], ["layer-skip"], ["draft-vocab"], ["prune"],
                                  ["prune", "--heal-steps", "2"]])
def test_calibrate_overwrites_its_file_only_with_force(capsys, tmp_path, tiny_model_dir, monkeypatch, what):
    import genspec

    _start_marker(monkeypatch, genspec, "load_model")
    out = tmp_path / "plan.json"
    out.write_text('{"mine": 1}')
    argv = ["calibrate", *what, "--model", str(tiny_model_dir), "--out", str(out)]
    _refused(capsys, argv, f"--out file {out} already exists", "--force")
    assert out.read_text() == '{"mine": 1}'
    with pytest.raises(Started):
        main(argv + ["--force"])
    out.write_text("")
    with pytest.raises(Started):
        main(argv)


def test_calibrate_prune_keeps_the_healed_weights_and_checkpoint_beside_the_plan(capsys, tmp_path, tiny_model_dir,
                                                                                 monkeypatch):
    """Healing writes PLAN.safetensors beside the plan: an earlier one is refused without --force; a healing
    checkpoint there is continued with --resume or started over with --force, never both."""
    import genspec

    _start_marker(monkeypatch, genspec, "load_model")
    out = tmp_path / "plan.json"
    argv = ["calibrate", "prune", "--model", str(tiny_model_dir), "--out", str(out), "--heal-steps", "2"]
    (tmp_path / "plan.safetensors").write_bytes(b"weights")
    _refused(capsys, argv, "plan.safetensors already exists", "--force")
    (tmp_path / "plan.safetensors").unlink()
    (tmp_path / "plan.checkpoint.pt").write_bytes(b"state")
    _refused(capsys, argv, "pass --resume to continue that healing run, or --force to start over")
    _refused(capsys, argv + ["--resume", "--force"], "--resume and --force exclude each other")
    with pytest.raises(Started):
        main(argv + ["--force"])
    assert (tmp_path / "plan.checkpoint.pt").read_bytes() == b"state"


# ------------------------------------------------------------------------------ the shared check
def test_one_check_for_every_output_directory(tmp_path):
    """``index build`` shares the check: its own rule (only an index is ever replaced) comes on top."""
    from genspec.datastore import RetrievalIndex, check_index_destination
    from genspec.errors import InputFileError
    from genspec.textfiles import check_output_dir

    check_output_dir(tmp_path / "new")  # created and writable
    assert (tmp_path / "new").is_dir() and not any((tmp_path / "new").iterdir())
    check_output_dir(tmp_path / "new")  # empty: fine
    earlier = _earlier_run(tmp_path)
    with pytest.raises(InputFileError, match="exists and is not empty"):
        check_output_dir(earlier)
    check_output_dir(earlier, force=True)
    (tmp_path / "afile").write_text("x")
    for force in (False, True):
        with pytest.raises(InputFileError, match="is a file; give a directory"):
            check_output_dir(tmp_path / "afile", force)
        with pytest.raises(InputFileError, match="is a file; give a directory"):
            check_index_destination(tmp_path / "afile", force)
    RetrievalIndex.from_documents([[5, 6, 7]]).save(tmp_path / "ix")
    with pytest.raises(InputFileError, match="exists and is not empty.*--force"):
        check_index_destination(tmp_path / "ix")
    check_index_destination(tmp_path / "ix", force=True)
    with pytest.raises(InputFileError, match="not a genspec retrieval index"):
        check_index_destination(earlier, force=True)
