"""The options several ``genspec`` commands share, each declared once here.

A command adds those it takes with :func:`add_options`, by name: ``add_options(parser, "model", "backend", "dtype")``.
Where a command's option differs on purpose (its own default, help text, choices or flag), the
difference is a parameter: ``add_options(parser, "drafter", drafter={"default": "head", "help": "..."})``;
``"flags"`` renames an option (``genspec serve`` calls the model's backend ``--model-backend``, as its
``--backend`` chooses one process or Ray replicas).
"""
from __future__ import annotations

import argparse

from genspec.cli import finite_float
from genspec.errors import ConfigError

#: ``--model``'s help where a model runs on either backend
MODEL_HELP = "local model directory or .gguf file (default: embedded Gemma 3 270M)"

#: what runs a model
BACKENDS = ["auto", "torch", "llamacpp"]
#: a target's kernels (genspec.Kernels' values: tests/test_cli_options.py checks they agree)
KERNELS = ["auto", "exact", "exact-tiled", "fast"]
#: the dtypes a model may run in (float64: exact arithmetic, for the commands that measure laws)
DTYPES = ["float32", "bfloat16", "float16", "float64"]
#: the draft length policies
DRAFT_LENGTHS = ["fixed", "heuristic", "cost"]

#: name -> (flags, argparse keywords): every shared option, as most commands declare it
SHARED: dict[str, tuple[tuple[str, ...], dict]] = {
    "model": (("--model",), {"metavar": "PATH", "help": MODEL_HELP}),
    "backend": (("--backend",), {
        "default": "auto", "choices": BACKENDS,
        "help": "what runs the target: llamacpp (a GGUF file on llama.cpp, the fastest on a CPU), torch "
                "(transformers: model directories, every drafter, GPUs) or auto (default: llamacpp for a "
                ".gguf file and for the embedded model when llama-cpp-python is installed)"}),
    "kernels": (("--kernels",), {
        "default": "auto", "choices": KERNELS,
        "help": "the target's kernels: exact (a row's logits do not depend on the batch, so speculation changes "
                "no token), exact-tiled (llamacpp: exact too, dearer for one row, cheaper for prompts and full "
                "batches: for a loaded server), fast (a greedy token may flip at a near-tie) or auto (default: "
                "exact on llamacpp; fast on torch, where exact kernels cost far more)"}),
    "dtype": (("--dtype",), {"default": "float32", "choices": DTYPES}),
    "drafter": (("--drafter",), {"default": "prompt-lookup"}),
    "draft_model": (("--draft-model",), {"metavar": "PATH", "help": "draft model directory (drafter draft-model)"}),
    "drafter_option": (("-O", "--drafter-option"), {"action": "append", "default": [], "metavar": "KEY=VALUE",
                                                    "help": "drafter option (repeatable)"}),
    "num_draft_tokens": (("--num-draft-tokens", "-k"), {
        "type": int, "default": None, "metavar": "K",
        "help": "draft tokens per step at most (default: the drafter's own: 8, suffix 24)"}),
    "draft_length": (("--draft-length",), {"default": "cost", "choices": DRAFT_LENGTHS}),
    "temperature": (("--temperature",), {"type": finite_float, "default": 0.0, "help": "0 = greedy (default)"}),
    "top_k": (("--top-k",), {"type": int, "default": 0}),
    "top_p": (("--top-p",), {"type": finite_float, "default": 1.0}),
    "seed": (("--seed",), {"type": int, "default": None}),
    "max_new_tokens": (("--max-new-tokens",), {"type": int, "default": 64}),
}


def add_options(parser: argparse.ArgumentParser, *names: str, **differences: dict) -> None:
    """Add the shared options ``names`` to ``parser``, in that order. ``differences``: per option name,
    the argparse keywords (or ``flags``) in which this command's option differs from the shared one
    (``"help": None``: none)."""
    unknown = set(differences) - set(names)
    if unknown:
        raise ValueError(f"differences for options not added: {sorted(unknown)}")
    for name in names:
        flags, keywords = SHARED[name]
        keywords = {**keywords, **differences.get(name, {})}
        flags = keywords.pop("flags", flags)
        parser.add_argument(*flags, **keywords)


def parse_option(text: str) -> tuple[str, object]:
    """A ``-O`` / ``--drafter-option`` value, ``KEY=VALUE`` with VALUE read as JSON when it parses
    (numbers, lists; NaN and infinities are not numbers), else as a string."""
    from genspec import strict_json

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"drafter option must look like KEY=VALUE, got {text!r}")
    try:
        return key.strip().replace("-", "_"), strict_json.loads(value)
    except ValueError:
        return key.strip().replace("-", "_"), value
