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
    (["--drafter", "early-exit", "-O", "confidence_threshold=abc"], "confidence_threshold='abc': expected float"),
    (["--drafter", "early-exit", "-O", "num_drafts=1.5"], "num_drafts=1.5: expected int"),
    (["--drafter", "hierarchical", "-O", "levels=quantized,prompt-lookup"], "cannot verify another drafter"),
    (["--drafter", "hierarchical", "-O", "levels=prompt-lookup,nope"], "unknown or unstackable level"),
    (["--drafter", "quantized", "-O", "draft_vocab_file=/no/file.json"], "not found"),
    (["--drafter", "layer-skip", "-O", "skip=/no/skip.json"], "not found"),
    (["-O", "novalue"], "KEY=VALUE"),
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
