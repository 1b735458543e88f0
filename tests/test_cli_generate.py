"""``genspec generate`` end to end on a tiny model saved to disk (the real from_pretrained path)."""
from __future__ import annotations

import json

import pytest

from genspec.cli import main

STATS_KEYS = {"drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
              "accepted_length_histogram", "target_calls", "draft_time_s", "verify_time_s", "total_time_s",
              "tokens_per_second"}


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_generate_json_and_greedy_equality(capsys, tiny_model_dirs, drafter):
    target, draft = tiny_model_dirs
    base = ["generate", "--model", str(target), "--prompt", "abcabcabc", "--max-new-tokens", "12", "--json"]
    plain = run_json(capsys, base + ["--drafter", "none"])
    extra = ["--draft-model", str(draft)] if drafter == "draft-model" else []
    spec = run_json(capsys, base + ["--drafter", drafter, "-k", "3"] + extra)
    assert set(spec["stats"]) >= STATS_KEYS
    assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert plain["stats"]["drafted_tokens"] == 0
    assert len(spec["samples"][0]["token_ids"]) == spec["stats"]["new_tokens"]


def test_generate_samples_with_seed_are_reproducible(capsys, tiny_model_dirs):
    target, _ = tiny_model_dirs
    argv = ["generate", "--model", str(target), "--prompt", "xyz", "--max-new-tokens", "6", "--temperature", "0.8",
            "--top-p", "0.9", "--seed", "5", "--num-samples", "3", "--json"]
    first, second = run_json(capsys, argv), run_json(capsys, argv)
    assert len(first["samples"]) == 3
    assert first["samples"] == second["samples"]


def test_generate_with_edit_source(capsys, tmp_path, tiny_model_dir):
    source = tmp_path / "source.txt"
    source.write_text("hello wrld, hello world")
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "fix: hello wrld", "--max-new-tokens", "10",
            "--json"]
    _, out, _ = _run(capsys, base + ["--drafter", "none"])
    code, spec, _ = _run(capsys, base + ["--drafter", "edit", "--edit-source", str(source), "-k", "4"])
    assert code == 0
    assert json.loads(spec)["samples"][0]["token_ids"] == json.loads(out)["samples"][0]["token_ids"]


@pytest.mark.parametrize("extra, message", [
    (["--drafter", "nope"], "unknown drafter"),
    (["-k", "0"], "num_draft_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--drafter", "draft-model"], "needs a draft model"),
    (["--model", "/no/such/model"], "no model at"),
    (["--drafter", "early-exit", "-O", "exit_layer=9"], "exit layer must be in 1..2"),
    (["--drafter", "layer-skip", "-O", "skip=[0,7]"], "out of range"),
    (["--drafter", "early-exit", "-O", "bogus=1"], "does not take option"),
    (["--drafter", "early-exit", "-O", "confidence_threshold=abc"], "confidence_threshold='abc': expected a number in [0, 1)"),
    (["--drafter", "early-exit", "-O", "num_drafts=1.5"], "num_drafts=1.5: expected an integer from 1 to 32"),
    (["--drafter", "hierarchical", "-O", "levels=quantized,prompt-lookup"], "cannot verify another drafter"),
    (["--drafter", "hierarchical", "-O", "levels=prompt-lookup,nope"], "unknown or unstackable level"),
    (["--drafter", "quantized", "-O", "draft_vocab_file=/no/file.json"], "not found"),
    (["--drafter", "layer-skip", "-O", "skip=/no/skip.json"], "not found"),
    (["-O", "novalue"], "KEY=VALUE"),
    # issue 46 items 9-11
    (["--drafter", "early-exit", "-O", "exit_layer=0"], "exit_layer=0: expected an integer >= 1 or a path"),
    (["--drafter", "early-exit", "-O", "confidence_threshold=NaN"], "confidence_threshold='NaN': expected a number in [0, 1)"),
    (["--drafter", "early-exit", "-O", "confidence_threshold=1e400"], "expected a number in [0, 1)"),
    (["--seed", "-1", "--temperature", "0.8"], "seed must be an integer >= 0, got -1"),
])
def test_generate_bad_input_is_one_clear_line(capsys, tiny_model_dirs, extra, message):
    target, _ = tiny_model_dirs
    argv = ["generate", "--model", str(target), "--prompt", "hi", "--max-new-tokens", "2"] + extra
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def _bad_drafter_inputs(tmp_path, model_dir):
    (tmp_path / "binary.txt").write_bytes(b"\x7fELF\x00\x01\x02" * 10)
    gen = ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "2"]
    return [
        (gen + ["--drafter", "retrieval", "-O", f"index={tmp_path / 'no-index'}"], "no retrieval index at"),
        (gen + ["--drafter", "retrieval"], "needs a datastore"),
        (gen + ["--drafter", "edit", "--edit-source", str(tmp_path / "missing.txt")], "edit source file not found"),
        (gen + ["--drafter", "edit", "--edit-source", str(tmp_path / "binary.txt")], "binary file"),
        (gen + ["--drafter", "ngram-cache", "-O", f"corpus={tmp_path / 'binary.txt'}"], "binary file"),
        (gen + ["--drafter", "ngram-cache", "-O", f"corpus={tmp_path / 'nothing'}"], "corpus not found"),
        (gen + ["--drafter", "prompt-lookup", "-O", "min_ngram=0"], "min_ngram"),
        (gen + ["--drafter", "lookahead", "-O", "ngram_size=1"], "ngram_size"),
        (gen + ["--drafter", "lookahead", "-O", "window=-1"], "option window=-1: expected an integer from 0 to 64"),
    ]


def test_generate_bad_drafter_input_gives_one_line_errors(capsys, tmp_path, tiny_model_dir):
    for argv, message in _bad_drafter_inputs(tmp_path, tiny_model_dir):
        code, _, err = _run(capsys, argv)
        assert code == 2, argv
        assert message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_generate_prompt_longer_than_context(capsys, tiny_model_dirs):
    target, _ = tiny_model_dirs
    assert main(["generate", "--model", str(target), "--prompt", "a" * 400, "--max-new-tokens", "2"]) == 2
    assert "context" in capsys.readouterr().err


def test_vocabulary_mismatch(capsys, tiny_model_dirs, tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from tiny_models import tiny_llama

    other = tmp_path / "other"
    tiny_llama(2, vocab=100, dtype=__import__("torch").float32).save_pretrained(other)
    target, _ = tiny_model_dirs
    argv = ["generate", "--model", str(target), "--prompt", "hi", "--drafter", "draft-model", "--draft-model",
            str(other)]
    assert main(argv) == 2
    assert "vocabularies differ" in capsys.readouterr().err


def test_stream_cli(capsys, tiny_model_dirs):
    target, _ = tiny_model_dirs
    assert main(["generate", "--model", str(target), "--prompt", "abab", "--max-new-tokens", "5", "--stream"]) == 0
    assert capsys.readouterr().out.strip() != ""


def test_stop_strings_are_not_printed(capsys, tiny_model_dirs):
    """As the server (and OpenAI) do, the text ends before the stop string: in --json, plain and
    --stream output alike."""
    target, _ = tiny_model_dirs
    base = ["generate", "--model", str(target), "--prompt", "abcabcabc def def abc", "--max-new-tokens", "40"]
    full = run_json(capsys, base + ["--json"])["samples"][0]["text"]
    stop = next(full[i:i + 2] for i in range(3, len(full) - 1)
                if full[i:i + 2].isascii() and full[i:i + 2].isprintable() and full.index(full[i:i + 2]) >= 3)
    expected = full[:full.index(stop)]
    sample = run_json(capsys, base + [f"--stop={stop}", "--json"])["samples"][0]
    assert sample["finish_reason"] == "stop" and sample["text"] == expected
    for extra in ([], ["--stream"]):
        code, out, _ = _run(capsys, base + [f"--stop={stop}"] + extra)
        assert code == 0 and out == expected + "\n"


@pytest.mark.parametrize("option, value", [("--epsilon", "inf"), ("--temperature", "nan"), ("--top-p", "-inf"),
                                           ("--delta", "NaN")])
def test_non_finite_numbers_are_refused_by_the_parser(capsys, option, value):
    """Issue 46 item 9: ``--epsilon inf --json`` printed ``Infinity`` (not JSON); every numeric option
    refuses NaN and infinities in one line, exit 2, before anything loads."""
    with pytest.raises(SystemExit) as exit:
        main(["generate", "--model", "/no/such/model", "--prompt", "hi", "--rule", "typical", f"{option}={value}", "--json"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and f"argument {option}: must be a finite number, got '{value}'" in err
    assert "Traceback" not in err


def test_prompt_from_standard_input_must_be_utf8(capsys, monkeypatch, tiny_model_dirs):
    """Issue 46 item 11: invalid UTF-8 on standard input is one line naming the offset of the bad byte
    (it reached the tokenizer as lone surrogates and raised a TypeError); valid UTF-8 is read whatever
    the locale."""
    import io
    import sys

    target, _ = tiny_model_dirs
    argv = ["generate", "--model", str(target), "--prompt", "-", "--max-new-tokens", "2", "--json"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"abc\xff\xfedef"), encoding="ascii",
                                                       errors="surrogateescape"))
    code, out, err = _run(capsys, argv)
    assert code == 2 and out == ""
    assert err.strip() == "genspec: error: standard input: not UTF-8 text (byte 3: 0xff); --prompt - reads UTF-8 text"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("café".encode()), encoding="ascii"))
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    assert json.loads(out)["samples"][0]["finish_reason"] == "length"


def test_json_output_is_strict_json(capsys, tiny_model_dirs):
    """``--json`` goes through genspec.strict_json: a NaN or infinity would be an error naming where it is,
    never the ``NaN`` / ``Infinity`` that strict parsers refuse."""
    from genspec.errors import GenerationError
    from genspec.strict_json import dumps, loads

    target, _ = tiny_model_dirs
    out = run_json(capsys, ["generate", "--model", str(target), "--prompt", "abc", "--max-new-tokens", "3", "--json"])
    assert dumps(out) == json.dumps(out)
    with pytest.raises(GenerationError, match=r"results\[1\]\.speedup is nan"):
        dumps({"results": [{"speedup": 1.0}, {"speedup": float("nan")}]})
    with pytest.raises(GenerationError, match=r"output's value is inf"):
        dumps(float("inf"))
    for text in ("NaN", "-Infinity", "1e400", "[1, NaN]"):
        with pytest.raises(ValueError):
            loads(text)
    assert loads("[1, 2.5, 1e300]") == [1, 2.5, 1e300]
