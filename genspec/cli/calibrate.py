"""``genspec calibrate``: choose self-speculation settings for a target on this machine.

- ``early-exit``: the exit layer L; ``layer-skip``: the set of layers to skip; both by predicted
  speedup (see :mod:`genspec.calibration`). The winner is saved to a JSON file.
- ``draft-vocab``: the most frequent tokens of a corpus (or of the target's own samples), for a
  truncated-vocabulary draft head.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

import genspec
from genspec import strict_json
from genspec.calibration import draft_vocabulary, read_corpus_files, search_early_exit, search_layer_skip
from genspec.cli.options import add_options
from genspec.errors import ConfigError, InputFileError
from genspec.textfiles import check_output_file


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("calibrate", help="choose self-speculation settings for a model on this machine")
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, helptext in (("early-exit", "pick the exit layer"), ("layer-skip", "pick the layers to skip")):
        p = sub.add_parser(name, help=helptext)
        add_options(p, "model", model={"help": None})
        p.add_argument("--out", required=True, help="JSON file to write")
        add_options(p, "num_draft_tokens", num_draft_tokens={"default": 4, "metavar": None, "help": None})
        p.add_argument("--tokens", type=int, default=48, help="calibration tokens generated per prompt")
        p.set_defaults(func=run_search)
    p = sub.add_parser("draft-vocab", help="most frequent tokens, for a truncated-vocabulary draft head")
    add_options(p, "model", model={"help": None})
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=32768)
    p.add_argument("--corpus", action="append", default=[], metavar="FILE", help="text file(s) to count")
    p.set_defaults(func=run_draft_vocab)


def run_search(args) -> int:
    console = Console(stderr=True)
    k = args.num_draft_tokens
    if k < 1:  # before the (slow) model load
        raise ConfigError(f"num_draft_tokens must be >= 1, got {k}")
    check_output_file(args.out, "--out file")
    target = genspec.load_model(args.model, backend="torch")
    search, key = (search_early_exit, "exit_layer") if args.what == "early-exit" else (search_layer_skip, "skip")
    with console.status("") as status:
        payload = search(target, k, args.tokens, progress=status.update)
    result = {key: payload[key]}
    _write_json(args.out, payload)
    console.print(f"{args.what}: {result} alpha={payload['alpha']:.2f} predicted speedup "
                  f"{payload['predicted_speedup']:.2f}x (k={k}); written to {args.out}")
    return 0


def run_draft_vocab(args) -> int:
    if args.size < 1:  # everything is checked before the (slow) model load
        raise ConfigError(f"--size must be >= 1, got {args.size}")
    texts = read_corpus_files(args.corpus)
    check_output_file(args.out, "--out file")
    target = genspec.load_model(args.model, backend="torch")
    vocab = draft_vocabulary(target, args.size, texts=texts or None)
    _write_json(args.out, vocab)
    print(f"{len(vocab['token_ids'])} token ids covering {vocab['coverage']:.1%} of the {vocab['source']}; "
          f"written to {args.out}")
    return 0


def _write_json(path: str, payload: dict) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(strict_json.dumps(payload, indent=1))
    except OSError as exc:
        raise InputFileError(f"cannot write {path}: {exc}") from exc
