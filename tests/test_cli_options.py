"""The options several ``genspec`` commands share are declared once (``genspec/cli/options.py``); each
command keeps its own defaults and help texts."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import genspec.cli
from genspec.cli import build_parser
from genspec.cli.options import SHARED, add_options


def test_no_command_declares_a_shared_option_itself():
    flags = {flag for names, _ in (SHARED[name] for name in SHARED if name != "seed") for flag in names}
    flags.add("--model-backend")
    other = {("serve.py", "--backend")}  # serve's own: one process or Ray replicas, not what runs the model
    for path in Path(genspec.cli.__file__).parent.glob("*.py"):
        if path.name == "options.py":
            continue
        declared = set(re.findall(r"add_argument\(\s*((?:\"-[^\"]+\",\s*)+)", path.read_text()))
        for found in declared:
            clash = {flag for flag in re.findall(r"\"(-[^\"]+)\"", found) if (path.name, flag) not in other}
            assert not flags & clash, (path.name, found)


def _defaults(*argv: str) -> dict:
    return vars(build_parser().parse_args(list(argv)))


def test_each_command_keeps_its_own_defaults():
    generate = _defaults("generate", "--prompt", "x")
    assert (generate["backend"], generate["drafter"], generate["num_draft_tokens"], generate["draft_length"],
            generate["temperature"], generate["seed"], generate["max_new_tokens"]) == (
        "auto", "prompt-lookup", None, "cost", 0.0, None, 64)
    tradeoff = _defaults("tradeoff")
    assert (tradeoff["backend"], tradeoff["drafter"], tradeoff["num_draft_tokens"], tradeoff["draft_length"],
            tradeoff["temperature"], tradeoff["seed"], tradeoff["max_new_tokens"]) == (
        "torch", "head", 8, "fixed", 1.0, 0, 32)
    bench = _defaults("bench")
    assert (bench["seed"], bench["max_new_tokens"]) == (0, None)
    assert _defaults("calibrate", "early-exit", "--out", "x.json")["num_draft_tokens"] == 4
    assert _defaults("train", "head", "--out", "d")["max_new_tokens"] == 128
    serve = _defaults("serve", "--model-backend", "llamacpp")
    assert serve["model_backend"] == "llamacpp" and serve["backend"] == "local"  # serve's --backend: local or ray


@pytest.mark.parametrize("argv", [["bench", "--dtype", "float64"], ["serve", "--dtype", "float64"],
                                  ["demo", "--draft-length", "longest"], ["generate", "--prompt", "x", "--top-p", "nan"]])
def test_a_commands_own_choices_still_refuse(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and "genspec: error:" in capsys.readouterr().err


def test_a_difference_for_an_option_not_added_is_a_mistake():
    import argparse

    with pytest.raises(ValueError, match="drafter"):
        add_options(argparse.ArgumentParser(), "model", drafter={"default": "x"})
