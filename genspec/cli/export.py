"""``genspec export head DIR``: write a trained EAGLE-3 head (``genspec train head --shape eagle3``) for another
engine (:mod:`genspec.speculators.export`):

- ``--format gguf --target-gguf T.gguf``: llama.cpp's ``eagle3`` GGUF, for ``llama-server -m T.gguf -md OUT
  --spec-type draft-eagle3`` (the target's architecture must record its layers' inputs: llama, qwen3, ...; Gemma 3's
  does not);
- ``--format speculators``: a speculators checkpoint directory (config.json + model.safetensors) that vLLM loads
  as an EAGLE-3 draft; ``--model`` names the target (its vocabulary size and the checkpoint's verifier).
"""
from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from genspec.cli.options import add_options
from genspec.errors import ConfigError, InputFileError
from genspec.speculators.export import (
    SPECULATIVE_TOKENS,
    export_gguf,
    export_speculators,
)
from genspec.speculators.store import load_head
from genspec.textfiles import check_output_dir, check_output_file


class ExportFormat(StrEnum):
    """What ``genspec export head`` writes."""

    GGUF = "gguf"  # llama.cpp's eagle3 architecture
    SPECULATORS = "speculators"  # vLLM's speculators checkpoint


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write a trained speculator for another engine (llama.cpp, vLLM)")
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    p = sub.add_parser("head", help="an EAGLE-3 head (genspec train head --shape eagle3) as llama.cpp's GGUF or a "
                                    "speculators checkpoint for vLLM")
    p.add_argument("path", metavar="DIR", help="the trained head's directory (genspec train head --out)")
    p.add_argument("--format", choices=[f.value for f in ExportFormat], required=True,
                   help="gguf: llama.cpp's eagle3 file; speculators: a checkpoint directory vLLM loads")
    p.add_argument("--out", required=True, metavar="PATH", help="the file (gguf) or directory (speculators) to write")
    p.add_argument("--target-gguf", metavar="FILE", help="the target's GGUF (gguf: its tokenizer and context are copied)")
    add_options(p, "model", model={"help": "the target's model directory (speculators: its vocabulary and the "
                                           "verifier named; default: the embedded model)"})
    p.add_argument("--force", action="store_true",
                   help="write over an earlier export at --out (refused without it)")
    p.add_argument("--speculative-tokens", type=int, default=SPECULATIVE_TOKENS,
                   help="speculators: the draft length the checkpoint proposes (vLLM's default num_speculative_tokens)")
    p.set_defaults(func=run)


def _target_config(model: str | None):
    """The target's text config from its config.json alone (no weights)."""
    from transformers import AutoConfig  # here: transformers takes seconds to import

    from genspec.embedded import default_model_dir

    directory = model if model is not None else default_model_dir()
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True), str(directory)
    except (OSError, ValueError) as exc:
        raise InputFileError(f"cannot read the target's config.json in {directory}: {str(exc).splitlines()[0]}") from exc


def run(args) -> int:
    out = Path(args.out)
    gguf = ExportFormat(args.format) is ExportFormat.GGUF
    # before anything loads: an earlier export is not overwritten without --force
    (check_output_file(out, "--out", args.force) if gguf else check_output_dir(out, args.force))
    head, vocab_ids, _, _ = load_head(args.path)
    if gguf:
        if not args.target_gguf:
            raise ConfigError("--format gguf needs --target-gguf (the target's GGUF: its tokenizer goes in the draft)")
        export_gguf(head, vocab_ids, args.target_gguf, out)
    else:
        if args.speculative_tokens < 1:
            raise ConfigError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
        config, verifier = _target_config(args.model)
        text = config.get_text_config(decoder=True)
        export_speculators(head, vocab_ids, out, int(text.vocab_size), verifier,
                           list(getattr(config, "architectures", None) or []),
                           int(getattr(text, "max_position_embeddings", None) or 8192), args.speculative_tokens)
    print(f"{args.format} written to {out}")
    return 0
