"""``genspec generate`` and ``genspec demo``."""
from __future__ import annotations

import argparse
import json
import sys

from genspec.errors import ConfigError


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="local model directory (default: embedded Gemma 3 270M)")
    parser.add_argument("--drafter", default="prompt-lookup", help="speculator: none, prompt-lookup, draft-model, early-exit, layer-skip, quantized, hierarchical, ...")
    parser.add_argument("--draft-model", metavar="PATH", help="draft model directory (drafter draft-model)")
    parser.add_argument("--num-drafts", type=int, default=1, help="independent draft chains verified as a tree")
    parser.add_argument("-O", "--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                        help="drafter option, e.g. exit_layer=4, skip=[3,5,7], levels=prompt-lookup,quantized, "
                             "draft_vocab_file=ids.json, confidence_threshold=0.4 (repeatable)")
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=8, metavar="K", help="draft tokens per step")
    parser.add_argument("--draft-length", default="cost", choices=["fixed", "heuristic", "cost"],
                        help="draft length policy: fixed k, HF's +2/-1 schedule, or cost-aware (default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--epsilon", type=float, default=0.0,
                        help="LOSSY over-acceptance b=min(1,(q+eps)/p); 0 = lossless (default)")
    parser.add_argument("--residual", default="opt", choices=["opt", "uno"], help="resampling law with --epsilon")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])


def parse_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, lists), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"drafter option must look like KEY=VALUE, got {text!r}")
    try:
        return key.strip().replace("-", "_"), json.loads(value)
    except ValueError:
        return key.strip().replace("-", "_"), value


def drafter_options(args) -> dict:
    options = dict(parse_option(o) for o in args.drafter_option)
    if args.num_drafts != 1:
        options["num_drafts"] = args.num_drafts
    if getattr(args, "edit_source", None) is not None:
        options["edit_source_file"] = args.edit_source
    return options


def generation_config(args):
    from genspec.engine import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop_strings=tuple(args.stop), epsilon=args.epsilon, residual=args.residual,
                            draft_length=args.draft_length)


def add_parser(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="generate text with speculative decoding",
                                description="Generate text; --drafter none is plain decoding.")
    gen.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    gen.add_argument("--num-samples", type=int, default=1, help="independent samples (decoded as one batch)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: samples and stats")
    gen.add_argument("--stream", action="store_true", help="print text as it is accepted")
    gen.add_argument("--edit-source", metavar="FILE",
                     help="text the output rewrites (drafter edit: the input is the draft)")
    add_sampling_arguments(gen)
    gen.set_defaults(func=run_generate)

    demo = subparsers.add_parser("demo", help="plain vs speculative decoding on the embedded default model")
    demo.add_argument("--model", metavar="PATH", help="local model directory (default: embedded Gemma 3 270M)")
    demo.add_argument("--drafter", default="prompt-lookup")
    demo.add_argument("--num-draft-tokens", "-k", type=int, default=8, metavar="K")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--draft-length", default="cost", choices=["fixed", "heuristic", "cost"])
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=run_demo)


def _merge_stats(results) -> dict:
    """Stats of a batch: sums of the counts; times of the batch (shared by its rows)."""
    from genspec.engine import RequestStats

    total = RequestStats()
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
    import genspec

    if args.num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {args.num_samples}")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = generation_config(args)  # validate before loading the model
    engine = genspec.load(args.model, drafter=args.drafter, draft_model=args.draft_model, dtype=args.dtype,
                          **drafter_options(args))
    if args.stream and not args.json and args.num_samples == 1:
        for chunk in engine.stream(prompt, config):
            print(chunk, end="", flush=True)
        print()
        return 0
    results = engine.generate([prompt] * args.num_samples, config)
    if args.json:
        print(json.dumps({"samples": [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason}
                                      for r in results],
                          "stats": _merge_stats(results)}))
    else:
        for i, r in enumerate(results):
            if args.num_samples > 1:
                print(f"--- sample {i + 1}")
            print(r.text)
        s = _merge_stats(results)
        print(f"[{s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, acceptance {s['acceptance_rate']:.2f}, "
              f"mean accepted length {s['mean_accepted_length']:.2f}]", file=sys.stderr)
    return 0


DEMO_PROMPTS = {
    "summarize": (
        "Article: The city council met on Tuesday to discuss the new public library. The library will have three "
        "floors, a children's reading room, a maker space with 3D printers, and a cafe. Construction will start in "
        "March and is expected to take eighteen months. The council approved a budget of 12 million dollars for the "
        "project, which will be paid for by a local bond and a grant from the state.\n\n"
        "Summary of the article: The city council met on Tuesday to"),
    "code": (
        "def area_of_square(side):\n    return side * side\n\n\ndef area_of_rectangle(width, height):\n"
        "    return width * height\n\n\ndef perimeter_of_square(side):\n    return 4 * side\n\n\n"
        "def perimeter_of_rectangle(width, height):\n"),
    "story": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
}


def run_demo(args) -> int:
    import genspec
    from genspec.engine import GenerationConfig, SpeculativeEngine

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(stderr=args.json)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                              draft_length=args.draft_length)
    with console.status("loading the model (the first run converts the embedded model, about a minute)"):
        target = genspec.load_model(args.model)
        drafter = genspec.build_drafter(args.drafter, target)
    plain, spec = SpeculativeEngine(target), SpeculativeEngine(target, drafter)
    plain.generate("Hello", max_new_tokens=2)  # warm-up (first-call allocations), not timed
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=2 * len(DEMO_PROMPTS))
        for name, prompt in DEMO_PROMPTS.items():
            progress.update(task, description=f"{name}: plain")
            base = plain.generate(prompt, config)[0]
            progress.advance(task)
            progress.update(task, description=f"{name}: {args.drafter}")
            fast = spec.generate(prompt, config)[0]
            progress.advance(task)
            rows.append({"prompt": name, "plain_tokens_per_second": base.stats.tokens_per_second,
                         "speculative_tokens_per_second": fast.stats.tokens_per_second,
                         "speedup": fast.stats.tokens_per_second / base.stats.tokens_per_second,
                         "acceptance_rate": fast.stats.acceptance_rate,
                         "mean_accepted_length": fast.stats.mean_accepted_length,
                         "greedy_outputs_match": fast.token_ids == base.token_ids,
                         "text": fast.text})
    if args.json:
        print(json.dumps({"drafter": args.drafter, "num_draft_tokens": args.num_draft_tokens, "results": rows}))
        return 0 if all(r["greedy_outputs_match"] for r in rows) else 1
    table = Table(title=f"genspec demo: plain vs {args.drafter} (greedy, k={args.num_draft_tokens}, "
                        f"{args.max_new_tokens} new tokens)")
    for column in ("prompt", "plain tok/s", "speculative tok/s", "speedup", "acceptance", "mean accepted",
                   "outputs match"):
        table.add_column(column, justify="right" if column != "prompt" else "left")
    for r in rows:
        table.add_row(r["prompt"], f"{r['plain_tokens_per_second']:.1f}", f"{r['speculative_tokens_per_second']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['acceptance_rate']:.2f}", f"{r['mean_accepted_length']:.2f}",
                      "yes" if r["greedy_outputs_match"] else "NO")
    for r in rows:
        console.print(f"[bold]{r['prompt']}[/bold]: {r['text'].strip()[:160]!r}")
    console.print(table)
    ok = all(r["greedy_outputs_match"] for r in rows)
    console.print("greedy speculative outputs equal plain outputs token for token" if ok else
                  "[red]some greedy outputs differ from plain decoding[/red]")
    return 0 if ok else 1
