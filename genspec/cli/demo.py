"""``genspec demo``: plain vs speculative decoding on the embedded default model.

Each prompt is decoded ``--repeats`` times each way, plain and speculative alternating (plain first in even
repeats, speculative first in odd ones), so that a moment when other work takes the CPU slows one run, not a
whole column. The table shows medians and their range; the speedup is the median of the per-repeat ratios
(each speculative run against the plain run beside it), and a prompt whose ratios spread too widely is
flagged as not to be trusted.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import genspec
from genspec.calibration import calibrate_engine
from genspec.cli.options import add_options
from genspec.drafters.registry import check_drafter
from genspec.engine import NO_DRAFTER, GenerationConfig, SpeculativeEngine
from genspec.errors import ConfigError
from genspec.strict_json import dumps

#: a prompt's speedup is flagged as untrustworthy when its per-repeat ratios spread over more than this fraction
#: of their median ((max - min) / median): repeats on an otherwise idle machine stay well within it, a run that
#: other work stalled does not (a stalled plain run inflates that prompt's ratio many times over)
TRUSTED_SPREAD = 0.25


def add_parser(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="plain vs speculative decoding on the embedded default model")
    add_options(demo, "model", "backend", "kernels", "drafter", "draft_model", "num_draft_tokens", "max_new_tokens",
                "draft_length")
    demo.add_argument("--repeats", type=int, default=3, metavar="R",
                      help="runs of each decoding per prompt, alternating (default 3): medians and their range")
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


def measure(plain, spec, prompts: dict[str, str], config, repeats: int,
            on_run: Callable[[str, str, int], None] | None = None) -> dict[str, tuple[list, list]]:
    """Per prompt, the results of ``repeats`` plain and speculative runs, alternating which goes first;
    ``on_run(prompt name, "plain" or "speculative", runs done so far)`` is called before each run."""
    runs, count = {}, 0
    for name, prompt in prompts.items():
        done = {"plain": [], "speculative": []}
        for repeat in range(repeats):
            for kind in ("plain", "speculative") if repeat % 2 == 0 else ("speculative", "plain"):
                if on_run is not None:
                    on_run(name, kind, count)
                done[kind].append((plain if kind == "plain" else spec).generate(prompt, config)[0])
                count += 1
        runs[name] = (done["plain"], done["speculative"])
    return runs


def summarize(name: str, plain: Sequence, speculative: Sequence) -> dict:
    """One prompt's row from its plain and speculative runs (``RequestResult``s, in run order): medians, the
    runs themselves, the spread of the per-repeat speedups and whether it is too wide to trust."""
    plain_rates = [r.stats.tokens_per_second for r in plain]
    spec_rates = [r.stats.tokens_per_second for r in speculative]
    speedups = [s / p for s, p in zip(spec_rates, plain_rates)]
    speedup = statistics.median(speedups)
    spread = (max(speedups) - min(speedups)) / speedup if len(speedups) > 1 else None
    drafted = sum(r.stats.drafted_tokens for r in speculative)
    calls = sum(r.stats.target_calls for r in speculative)
    accepted = sum(r.stats.accepted_tokens for r in speculative)
    return {"prompt": name,
            "plain_tokens_per_second": statistics.median(plain_rates),
            "speculative_tokens_per_second": statistics.median(spec_rates),
            "speedup": speedup,
            "plain_tokens_per_second_runs": plain_rates, "speculative_tokens_per_second_runs": spec_rates,
            "speedup_runs": speedups, "speedup_spread": spread,
            "spread_too_wide": spread is not None and spread > TRUSTED_SPREAD,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1.0 + accepted / calls if calls else 0.0,
            "greedy_outputs_match": all(r.token_ids == plain[0].token_ids for r in [*plain, *speculative]),
            "text": speculative[0].text}


def noise_note(rows: list[dict], repeats: int) -> str | None:
    """What the reader should know about the timings' reliability (None when nothing)."""
    if repeats == 1:
        return "one run each: no spread to judge the timings by (--repeats 3 or more shows it)"
    wide = [r["prompt"] for r in rows if r["spread_too_wide"]]
    if not wide:
        return None
    return (f"the speedups of {', '.join(wide)} varied by more than {TRUSTED_SPREAD:.0%} of their median between "
            f"repeats ((max - min) / median): other work was probably using the CPU, so they are not to be trusted; "
            f"rerun on an idle machine or with more --repeats")


def greedy_check_passes(match: bool, target) -> bool:
    """Whether the demo's greedy check passes: speculative outputs equal plain ones, or the target is not batch
    invariant (its kernels round a block of tokens differently from one token, so a near-tie may flip: the
    mismatch is reported, not a failure)."""
    return match or not target.batch_invariant


#: the manual's section (docs/backends.md) that says where greedy speculation equals plain decoding
EXACTNESS_SECTION = "What is exact on each backend"


def near_tie_note(backend: str) -> str:
    """What the demo prints when greedy outputs differ on a target that is not batch invariant."""
    return (f"some greedy outputs differ from plain decoding where they meet a near-tie: {backend}'s kernels round "
            f"a block of tokens differently from one token, so the acceptance rule, which is exact, is handed other "
            f"logits than a plain step computes; --kernels exact (on a quantised GGUF model, or on the torch "
            f"backend) gives equal outputs (the manual's Backends page, \"{EXACTNESS_SECTION}\")")


def run_demo(args) -> int:
    if args.drafter == NO_DRAFTER:
        raise ConfigError("--drafter none is plain decoding: the demo compares plain decoding with a drafter "
                          "(e.g. --drafter prompt-lookup)")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    options = {"draft_model": args.draft_model} if args.draft_model is not None else {}
    check_drafter(args.drafter, options)
    console = Console(stderr=args.json)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                              draft_length=args.draft_length)
    with console.status("loading the model (the first run converts the embedded model, about a minute)"):
        target = genspec.load_model(args.model, backend=args.backend, kernels=args.kernels)
        drafter = genspec.build_drafter(args.drafter, target, **options)
    plain, spec = SpeculativeEngine(target), SpeculativeEngine(target, drafter)
    k = args.num_draft_tokens or drafter.capabilities.default_draft_tokens
    if target.uneven_verify_cost:  # as genspec.load does
        calibrate_engine(spec, deepest=k)
    for engine in (plain, spec):  # warm-up (first-call allocations), not timed
        engine.generate("Hello", max_new_tokens=2)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=2 * args.repeats * len(DEMO_PROMPTS))

        def on_run(name: str, kind: str, done: int) -> None:
            progress.update(task, completed=done, description=f"{name}: {kind if kind == 'plain' else args.drafter}")

        runs = measure(plain, spec, DEMO_PROMPTS, config, args.repeats, on_run)
    rows = [summarize(name, *results) for name, results in runs.items()]
    match = all(r["greedy_outputs_match"] for r in rows)
    ok = greedy_check_passes(match, target)
    note = noise_note(rows, args.repeats)
    if args.json:
        print(dumps({"backend": target.backend, "batch_invariant": target.batch_invariant,
                     "drafter": args.drafter, "num_draft_tokens": k, "repeats": args.repeats,
                     "trusted_spread": TRUSTED_SPREAD, "note": note, "results": rows}))
        return 0 if ok else 1
    table = Table(title=f"genspec demo on {target.backend}: plain vs {args.drafter} (greedy, k={k}, {args.max_new_tokens} new tokens; "
                        f"median of {args.repeats} alternating run(s) each)")
    for column in ("prompt", "plain tok/s", "speculative tok/s", "speedup", "speedup range", "acceptance",
                   "mean accepted", "identical to plain"):
        table.add_column(column, justify="right" if column != "prompt" else "left")
    for r in rows:
        speedups = r["speedup_runs"]
        table.add_row(r["prompt"], f"{r['plain_tokens_per_second']:.1f}", f"{r['speculative_tokens_per_second']:.1f}",
                      f"{r['speedup']:.2f}x", "–" if len(speedups) == 1 else
                      f"{min(speedups):.2f}–{max(speedups):.2f}x" + (" (noisy)" if r["spread_too_wide"] else ""),
                      f"{r['acceptance_rate']:.2f}", f"{r['mean_accepted_length']:.2f}",
                      "yes" if r["greedy_outputs_match"] else "NO")
    for r in rows:
        console.print(f"[bold]{r['prompt']}[/bold]: {r['text'].strip()[:160]!r}")
    Console(stderr=args.json, width=max(120, console.width)).print(table)
    if note:
        console.print(f"[yellow]note: {note}[/yellow]")
    if match:
        console.print("greedy speculative outputs are identical to plain decoding's, token for token")
    elif ok:
        console.print(f"[yellow]{near_tie_note(target.backend)}[/yellow]")
    else:
        console.print("[red]some greedy outputs differ from plain decoding[/red]")
    return 0 if ok else 1
