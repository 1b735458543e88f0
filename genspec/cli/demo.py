"""``genspec demo``: plain vs speculative decoding on the embedded default model."""
from __future__ import annotations

import json


def add_parser(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="plain vs speculative decoding on the embedded default model")
    demo.add_argument("--model", metavar="PATH", help="local model directory (default: embedded Gemma 3 270M)")
    demo.add_argument("--drafter", default="prompt-lookup")
    demo.add_argument("--num-draft-tokens", "-k", type=int, default=None, metavar="K",
                      help="draft tokens per step at most (default: the drafter's own: 8, suffix 24)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--draft-length", default="cost", choices=["fixed", "heuristic", "cost"])
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=run_demo)


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
    k = args.num_draft_tokens or drafter.default_draft_tokens
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
        print(json.dumps({"drafter": args.drafter, "num_draft_tokens": k, "results": rows}))
        return 0 if all(r["greedy_outputs_match"] for r in rows) else 1
    table = Table(title=f"genspec demo: plain vs {args.drafter} (greedy, k={k}, "
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
