"""``genspec generate`` end to end on a tiny model saved to disk (the real from_pretrained path)."""
from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_model

from genspec.cli import main

STATS_KEYS = {"drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
              "accepted_length_histogram", "target_calls", "draft_time_s", "verify_time_s", "total_time_s",
              "tokens_per_second"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny_model(root / "target", seed=0), save_tiny_model(root / "draft", seed=1, layers=1)


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_generate_json_and_greedy_equality(capsys, model_dirs, drafter):
    target, draft = model_dirs
    base = ["generate", "--model", str(target), "--prompt", "abcabcabc", "--max-new-tokens", "12", "--json"]
    plain = run_json(capsys, base + ["--drafter", "none"])
    extra = ["--draft-model", str(draft)] if drafter == "draft-model" else []
    spec = run_json(capsys, base + ["--drafter", drafter, "-k", "3"] + extra)
    assert set(spec["stats"]) >= STATS_KEYS
    assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert plain["stats"]["drafted_tokens"] == 0
    assert len(spec["samples"][0]["token_ids"]) == spec["stats"]["new_tokens"]


def test_generate_samples_with_seed_are_reproducible(capsys, model_dirs):
    target, _ = model_dirs
    argv = ["generate", "--model", str(target), "--prompt", "xyz", "--max-new-tokens", "6", "--temperature", "0.8",
            "--top-p", "0.9", "--seed", "5", "--num-samples", "3", "--json"]
    first, second = run_json(capsys, argv), run_json(capsys, argv)
    assert len(first["samples"]) == 3
    assert first["samples"] == second["samples"]


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
    (["--drafter", "hierarchical", "-O", "levels=quantized,prompt-lookup"], "cannot verify another drafter"),
    (["--drafter", "hierarchical", "-O", "levels=prompt-lookup,nope"], "unknown or unstackable level"),
    (["--drafter", "quantized", "-O", "draft_vocab_file=/no/file.json"], "not found"),
    (["--drafter", "layer-skip", "-O", "skip=/no/skip.json"], "not found"),
    (["-O", "novalue"], "KEY=VALUE"),
])
def test_generate_bad_input_is_one_clear_line(capsys, model_dirs, extra, message):
    target, _ = model_dirs
    argv = ["generate", "--model", str(target), "--prompt", "hi", "--max-new-tokens", "2"] + extra
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_generate_prompt_longer_than_context(capsys, model_dirs):
    target, _ = model_dirs
    assert main(["generate", "--model", str(target), "--prompt", "a" * 400, "--max-new-tokens", "2"]) == 2
    assert "context" in capsys.readouterr().err


def test_vocabulary_mismatch(capsys, model_dirs, tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from tiny_models import tiny_llama

    other = tmp_path / "other"
    tiny_llama(2, vocab=100, dtype=__import__("torch").float32).save_pretrained(other)
    target, _ = model_dirs
    argv = ["generate", "--model", str(target), "--prompt", "hi", "--drafter", "draft-model", "--draft-model",
            str(other)]
    assert main(argv) == 2
    assert "vocabularies differ" in capsys.readouterr().err


def test_stream_chunks_join_to_the_generated_text(model_dirs):
    import genspec

    target, _ = model_dirs
    engine = genspec.load(str(target), drafter="prompt-lookup")
    chunks = list(engine.stream("abcabcabc", max_new_tokens=16, eos_token_ids=()))
    full = engine.generate("abcabcabc", max_new_tokens=16, eos_token_ids=())[0]
    assert len(chunks) >= 2
    assert "".join(chunks) == full.text


def test_stream_cli(capsys, model_dirs):
    target, _ = model_dirs
    assert main(["generate", "--model", str(target), "--prompt", "abab", "--max-new-tokens", "5", "--stream"]) == 0
    assert capsys.readouterr().out.strip() != ""
