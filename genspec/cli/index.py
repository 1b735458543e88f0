"""``genspec index build CORPUS --out DIR [--model PATH] [--force]``: the datastore of the ``retrieval`` drafter.

CORPUS is a UTF-8 text file, a ``.jsonl`` file (a ``"text"`` field per line), or a directory of
``.txt`` / ``.jsonl`` files. It is tokenised with the model's tokenizer (default: the embedded
model's) and saved with the suffix array that the drafter searches (see :mod:`genspec.datastore`
and :mod:`genspec.drafters.retrieval`). DIR must be new or empty; an index already there is replaced
only with ``--force``, and a directory holding other files never. Use it with
``genspec generate --drafter retrieval -O index=DIR``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from genspec.cli.options import add_options
from genspec.datastore import (RetrievalIndex, check_index_destination, read_corpus, tokenize_documents,
                               tokenizer_fingerprint)
from genspec.embedded import default_model_dir
from genspec.errors import InputFileError


def add_parser(subparsers) -> None:
    index = subparsers.add_parser("index", help="build a retrieval datastore (drafter retrieval)",
                                  description="Datastores for the retrieval drafter.")
    actions = index.add_subparsers(dest="index_action", metavar="ACTION")
    build = actions.add_parser("build", help="tokenise a corpus and build its suffix array",
                               description="Tokenise CORPUS (a .txt or .jsonl file, or a directory of them) "
                                           "with the model's tokenizer and save a suffix-array datastore in DIR.")
    build.add_argument("corpus", metavar="CORPUS", help="text file, .jsonl file, or directory of .txt/.jsonl files")
    build.add_argument("--out", required=True, metavar="DIR",
                       help="directory to write the datastore to: new or empty, or an index to replace with --force")
    build.add_argument("--force", action="store_true",
                       help="replace the retrieval index already in DIR (a directory with other files is never "
                            "replaced); the new index is written beside it and renamed at the end")
    add_options(build, "model", model={"help": "model directory whose tokenizer to use (default: the embedded "
                                                "Gemma 3 270M)"})
    build.set_defaults(func=run_build)
    index.set_defaults(func=lambda args: _usage(index))


def _usage(parser) -> int:
    parser.print_help(sys.stderr)
    return 2


def load_tokenizer(model: str | None):
    """The tokenizer of a local model directory (default: the embedded model's), never from the network."""
    if model is None:
        model = default_model_dir()
    path = Path(model)
    if not path.is_dir():
        raise InputFileError(f"no model at {path}: expected a model directory with a tokenizer")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InputFileError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from exc


def run_build(args) -> int:
    out = Path(args.out)
    check_index_destination(out, args.force)  # before the corpus and the (slow) tokenizer: nothing is lost
    started = time.perf_counter()
    documents = read_corpus(args.corpus)  # corpus errors before the (slow) tokenizer load
    tokenizer = load_tokenizer(args.model)
    token_ids = tokenize_documents(documents, tokenizer)
    index = RetrievalIndex.from_documents(token_ids, {"source": str(args.corpus), "num_documents": len(documents),
                                                      **tokenizer_fingerprint(tokenizer)})
    index.save(out, force=args.force)
    print(f"indexed {len(index) - len(documents):,} tokens from {len(documents):,} documents into {out} "
          f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0
