"""``genspec generate``: text from a prompt with speculative decoding (``--drafter none``: plain)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import genspec
from genspec import strict_json
from genspec.api import Backend, check_drafters, check_dtype, model_context, resolve_backend
from genspec.cli import finite_float
from genspec.cli.options import add_options, parse_option
from genspec.engine import GenerationConfig, RequestStats
from genspec.errors import ConfigError, ContextLengthError, InputFileError
from genspec.textfiles import decode_utf8, read_utf8_text


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, "model", "backend", "kernels", "drafter", "draft_model", drafter={
        "help": "speculator: none, prompt-lookup, draft-model, early-exit, layer-skip, quantized, hierarchical, ..."})
    parser.add_argument("--num-drafts", type=int, default=1, help="independent draft chains verified as a tree")
    add_options(parser, "drafter_option", "num_draft_tokens", "draft_length", "temperature", "top_k", "top_p",
                drafter_option={"help": "drafter option, e.g. exit_layer=4, skip=[3,5,7], levels=prompt-lookup,quantized, "
                                        "draft_vocab_file=ids.json, confidence_threshold=0.4 (repeatable)"},
                draft_length={"help": "draft length policy: fixed k, HF's +2/-1 schedule, or cost-aware (default)"})
    parser.add_argument("--repetition-penalty", type=finite_float, default=1.0)
    add_options(parser, "seed", "max_new_tokens")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--rule", default="auto", choices=["auto", "overaccept", "typical", "coupled"],
                        help="acceptance rule: overaccept b=min(1,(q+eps)/p) (lossless only with --epsilon 0 "
                             "--residual opt: the standard rule), typical (Medusa: keep y iff q(y) > min(eps, "
                             "delta*exp(-H(q))); LOSSY), coupled (lossless; draft and target share each "
                             "position's noise, so a --seed reproduces under every --draft-length, for a lower "
                             "acceptance) or auto (default: coupled for a seeded sampled request whose drafter "
                             "samples its drafts, else overaccept)")
    parser.add_argument("--epsilon", type=finite_float, default=0.0,
                        help="over-acceptance (LOSSY if > 0; default 0) or typical acceptance's cap (Medusa: 0.09)")
    parser.add_argument("--delta", type=finite_float, default=0.3, help="typical acceptance's entropy factor (default 0.3)")
    parser.add_argument("--residual", default="opt", choices=["opt", "uno"],
                        help="law drawn after a rejection: opt (default; norm([q - b p]+), least bias) or uno "
                             "(q itself: LOSSY even at --epsilon 0)")
    add_options(parser, "dtype")


def drafter_options(args) -> dict:
    """The drafter options of ``-O``, ``--num-drafts`` and ``--edit-source``, checked before anything loads
    (the edit source is read here: a missing or binary file fails at once, not after the model load)."""
    options = dict(parse_option(o) for o in args.drafter_option)
    if args.num_drafts < 1:
        raise ConfigError(f"--num-drafts must be >= 1, got {args.num_drafts}")
    if args.num_drafts != 1:
        options["num_drafts"] = args.num_drafts
    if getattr(args, "edit_source", None) is not None:
        if "edit_source" in options:
            raise ConfigError("give the edit source as --edit-source FILE or -O edit_source=TEXT, not both")
        options["edit_source"] = read_utf8_text(args.edit_source, "edit source file")
    if args.draft_model is not None and not Path(args.draft_model).exists():
        raise InputFileError(f"no draft model at {args.draft_model}: --draft-model takes a model directory")
    check_drafters(args.drafter, args.draft_model, options)  # names, types and ranges, by the drafter's declarations
    return options


def check_model(model: str | None, dtype: str, max_new_tokens: int, backend: str = "auto") -> None:
    """Refuse, before the model loads, a dtype it cannot run in, a backend that cannot run it and a
    ``--max-new-tokens`` that no prompt leaves room for in its context (read from its config.json or GGUF
    metadata)."""
    if resolve_backend(model, backend, dtype) is Backend.TORCH:
        check_dtype(model, dtype)
    elif dtype != "float32":
        raise ConfigError(f"--dtype {dtype} applies to the torch backend; a GGUF model keeps its own quantisation")
    context = model_context(model, resolve_backend(model, backend, dtype))
    if context is not None and max_new_tokens >= context:
        raise ContextLengthError(f"--max-new-tokens {max_new_tokens} does not fit the model's context of {context} "
                                 f"tokens (prompt included)")


def check_prompt_fits(engine, prompt: str, max_new_tokens: int) -> None:
    """Refuse a prompt + ``--max-new-tokens`` longer than the model's context (as the server does),
    instead of generating fewer tokens than asked."""
    context = engine.target.max_context
    if context is None or engine.tokenizer is None:
        return
    prompt_tokens = len(engine.tokenizer(prompt)["input_ids"])
    if prompt_tokens < context < prompt_tokens + max_new_tokens:
        raise ContextLengthError(f"the prompt has {prompt_tokens} tokens, so --max-new-tokens {max_new_tokens} "
                                 f"does not fit the model's context of {context}: at most {context - prompt_tokens}")


def read_prompt(prompt: str) -> str:
    """``--prompt``: the text itself, or with ``-`` standard input's bytes decoded as UTF-8 (whatever the
    locale: in the C locale Python would smuggle undecodable bytes in as lone surrogates)."""
    if prompt != "-":
        return prompt
    return decode_utf8(sys.stdin.buffer.read(), "standard input", "--prompt - reads UTF-8 text")


def generation_config(args):
    return GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop_strings=tuple(args.stop), epsilon=args.epsilon, residual=args.residual,
                            draft_length=args.draft_length, rule=args.rule, delta=args.delta)


def add_parser(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="generate text with speculative decoding",
                                description="Generate text; --drafter none is plain decoding.")
    gen.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    gen.add_argument("--num-samples", type=int, default=1, help="independent samples (decoded as one batch)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: samples and stats")
    gen.add_argument("--stream", action="store_true",
                     help="print text as it is accepted (one sample; not with --json, which prints at the end)")
    gen.add_argument("--edit-source", metavar="FILE",
                     help="text the output rewrites (drafter edit: the input is the draft)")
    add_sampling_arguments(gen)
    gen.set_defaults(func=run_generate)


def _merge_stats(results) -> dict:
    """Stats of a batch: sums of the counts; times of the batch (shared by its rows)."""
    total = RequestStats(acceptance=results[0].stats.acceptance)
    for r in results:
        s = r.stats
        total.drafted_tokens += s.drafted_tokens
        total.accepted_tokens += s.accepted_tokens
        total.target_calls += s.target_calls
        total.new_tokens += s.new_tokens
        for name in ("accepted_length_histogram", "accepted_per_position", "drafted_per_position"):
            mine, theirs = getattr(total, name), getattr(s, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
    total.draft_time_s = max(r.stats.draft_time_s for r in results)
    total.verify_time_s = max(r.stats.verify_time_s for r in results)
    total.total_time_s = max(r.stats.total_time_s for r in results)
    return total.as_dict()


def run_generate(args) -> int:
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.stream and args.json:
        raise ConfigError("--stream and --json cannot be combined: --json prints one object when generation ends")
    if args.stream and args.num_samples > 1:
        raise ConfigError("--stream prints one sample as it comes; it cannot be combined with --num-samples > 1")
    config = generation_config(args)  # everything is checked before the (slow) model load
    options = drafter_options(args)
    check_model(args.model, args.dtype, args.max_new_tokens, args.backend)
    prompt = read_prompt(args.prompt)
    engine = genspec.load(args.model, drafter=args.drafter, draft_model=args.draft_model, dtype=args.dtype,
                          backend=args.backend, kernels=args.kernels, **options)
    check_prompt_fits(engine, prompt, args.max_new_tokens)
    if engine.drafter is not None and engine.drafter.capabilities.samples_drafts and args.seed is not None \
            and args.temperature > 0 and args.draft_length == "cost" \
            and config.resolved(engine.drafter.capabilities.samples_drafts).rule != "coupled":
        print(f"genspec: warning: drafter {args.drafter!r} samples its drafts and --rule {args.rule} is not coupled, "
              "so the seeded output depends on the draft lengths, which --draft-length cost takes from measured "
              "times: use --rule auto (lossless) or --draft-length fixed/heuristic for reproducible samples",
              file=sys.stderr)
    if args.stream:
        for chunk in engine.stream(prompt, config):
            print(chunk, end="", flush=True)
        print()
        return 0
    results = engine.generate([prompt] * args.num_samples, config)
    if args.json:
        print(strict_json.dumps({"samples": [{"text": r.text, "token_ids": r.token_ids,
                                              "finish_reason": r.finish_reason} for r in results],
                                 "stats": _merge_stats(results)}))
    else:
        for i, r in enumerate(results):
            if args.num_samples > 1:
                print(f"--- sample {i + 1}")
            print(r.text)
        s = _merge_stats(results)
        lossy = "" if config.lossless else f", LOSSY acceptance: {strict_json.dumps(config.acceptance)}"
        print(f"[{s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, acceptance {s['acceptance_rate']:.2f}, "
              f"mean accepted length {s['mean_accepted_length']:.2f}{lossy}]", file=sys.stderr)
    return 0
