"""``genspec tradeoff``: bias versus speed of lossy acceptance rules on real generations, against the
theory's Pareto front, and OPT's WinRate over UNO (:mod:`genspec.bench.tradeoff`)."""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import genspec
from genspec import strict_json
from genspec.bench import tradeoff
from genspec.bench.plots import tradeoff_plot
from genspec.bench.prompts import encode_prompt
from genspec.bench.run import machine_info
from genspec.bench.winrate import load_scorer
from genspec.cli import float_list
from genspec.cli.options import add_options, parse_option
from genspec.engine import GenerationConfig
from genspec.errors import ConfigError
from genspec.interrupts import stoppable
from genspec.textfiles import check_output_dir


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "tradeoff", help="bias vs speed of lossy acceptance rules on real generations (Pareto front, WinRate)",
        description="Decode Spec-Bench prompts (the 3rd-5th of each category: not measured by genspec bench, not "
                    "used to train the shipped head) with every setting (rule x eps [x delta] x residual), batch 1, "
                    "same seeds, measuring at every judged draft position the rule's exact rejection probability and "
                    "bias TV(b p + R P, q). Prints per setting: rejection_rate, mean_accepted_length, "
                    "tokens_per_second, bias_tv, pareto_bias (Theorem 5's least bias at the same rejections) and "
                    "win_rate (OPT over UNO, same prompts and seeds). Lossy rules need temperature > 0.")
    add_options(parser, "model", "backend", "drafter", "draft_model", "drafter_option",
                backend={"default": "torch", "help": "what runs the target (default torch: the default drafter, head, "
                         "reads its hidden states; llamacpp for a model-free drafter on a GGUF file)"},
                drafter={"default": "head",
                         "help": "a chain drafter (default head: the shipped head, which samples drafts with its law)"})
    parser.add_argument("--rule", default="overaccept", metavar="LIST",
                        help="rules, comma-separated: overaccept (b = min(1, (q + eps)/p)), typical (Medusa: keep y "
                             "iff q(y) > min(eps, delta exp(-H(q)))); default overaccept")
    parser.add_argument("--eps", default="0,0.01,0.05", metavar="LIST",
                        help="eps grid (default 0,0.01,0.05: with a large vocabulary, eps = 0.05 already accepts "
                             "almost every draft token)")
    parser.add_argument("--typical-eps", metavar="LIST", help="eps grid of the typical rule (default: --eps)")
    parser.add_argument("--residual", default="opt,uno", metavar="LIST", help="residuals: opt, uno (default both)")
    parser.add_argument("--delta", default="0.3", metavar="LIST", help="typical acceptance's delta grid (default 0.3)")
    parser.add_argument("--num-prompts", type=int, default=4, metavar="N", help="prompts (1-39; default 4)")
    parser.add_argument("--samples", type=int, default=1, metavar="S",
                        help="samples per prompt, seeds SEED..SEED+S-1 (default 1)")
    add_options(parser, "max_new_tokens", "temperature", "top_k", "top_p", "num_draft_tokens", "draft_length", "seed",
                max_new_tokens={"default": 32, "metavar": "N", "help": "default 32"},
                temperature={"default": 1.0, "help": "> 0 (default 1.0)"},
                num_draft_tokens={"default": 8, "help": None},
                draft_length={"default": "fixed", "help": "draft length policy (default fixed: K tokens every step; "
                              "the cost policy stops drafting where drafts cost more time than they save, leaving "
                              "nothing to measure)"},
                seed={"default": 0})
    parser.add_argument("--scorer", default="loglik",
                        help="WinRate scorer: loglik (the target's mean log-likelihood of the response, untempered; "
                             "default), a local reward-model directory, or MODULE:FUNCTION")
    parser.add_argument("--no-win-rate", action="store_true", help="skip the WinRate scoring")
    add_options(parser, "dtype")
    parser.add_argument("--out", metavar="DIR",
                        help="write results.json, report.md and tradeoff.png here (new or empty unless --force)")
    parser.add_argument("--force", action="store_true",
                        help="write into --out even if it holds files (an earlier run's are overwritten)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per setting")
    parser.set_defaults(func=run_tradeoff)


def _names(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def run_tradeoff(args) -> int:
    console = Console(stderr=True)
    # everything the user gave is checked before the model loads
    settings = tradeoff.settings_grid(_names(args.rule), float_list(args.eps, "--eps"), _names(args.residual),
                                      float_list(args.delta, "--delta"),
                                      float_list(args.typical_eps, "--typical-eps") if args.typical_eps else None)
    if args.temperature <= 0:
        raise ConfigError("--temperature must be > 0: the rules differ only when sampling (greedy decoding is exact)")
    if args.samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {args.samples}")
    prompts = tradeoff.tradeoff_prompts(args.num_prompts)
    base = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            draft_length=args.draft_length, seed=args.seed, measure_bias=True)
    options = dict(parse_option(o) for o in args.drafter_option)
    out = Path(args.out) if args.out else None
    if out is not None:
        check_output_dir(out, args.force)
    if args.drafter == "none":
        raise ConfigError("--drafter none drafts nothing: there is no acceptance rule to measure")

    started = time.perf_counter()
    with console.status("loading the model and the drafter"):
        engine = genspec.load(args.model, drafter=args.drafter, draft_model=args.draft_model, dtype=args.dtype,
                              backend=args.backend, **options)
    if engine.drafter.capabilities.max_candidates > 1:
        raise ConfigError(f"drafter {args.drafter!r} drafts trees (up to {engine.drafter.capabilities.max_candidates} candidates); "
                          f"bias is measured on chain drafts: drop its tree option")
    prompt_ids = [encode_prompt(p.text, engine.tokenizer) for p in prompts]
    scorer = scorer_name = None
    if not args.no_win_rate:
        scorer, scorer_name = load_scorer(args.scorer, engine.target)

    with _progress(console) as progress:
        task = progress.add_task(f"{len(settings)} settings x {len(prompts)} prompts x {args.samples} samples",
                                 total=len(settings) * len(prompts) * args.samples)
        with stoppable():  # Ctrl-C, or SIGTERM / SIGINT in the background: keep the generations done
            generations, interrupted = tradeoff.run_generations(
                engine, settings, prompt_ids, args.samples, base, args.seed,
                lambda done, total: progress.update(task, completed=done))
        if scorer is not None:  # also after a Ctrl-C: the responses done are scored (a second one stops that)
            scoring = progress.add_task("scoring responses (WinRate)", total=None)
            tradeoff.score_generations(generations, prompts, prompt_ids, scorer, settings,
                                       lambda done, total: progress.update(scoring, completed=done, total=total))
    records = tradeoff.summarize(settings, generations)
    if not interrupted:
        tradeoff.check_drafted(records, args.drafter, args.draft_length)
    if out is not None:
        _write(out, args, records, settings, prompts, generations, scorer_name, interrupted,
               time.perf_counter() - started, machine_info())
    if args.json:
        print(strict_json.dumps(tradeoff.public(records)))
    else:
        print(tradeoff.speed_table(records))
        if any(r["win_rate"] for r in records):
            print(f"\nOPT's WinRate over UNO (scorer: {scorer_name}; ties count half; Wilson 95% interval)\n")
            print(tradeoff.win_rate_table(records))
    if interrupted:
        print("genspec: interrupted; the table covers the generations done", file=sys.stderr)
        return 130
    return 0


def command_line(args) -> str:
    """The command that reproduces this run (every option spelled out)."""
    parts = ["genspec", "tradeoff"]
    if args.model:
        parts += ["--model", args.model]
    parts += ["--drafter", args.drafter]
    if args.draft_model:
        parts += ["--draft-model", args.draft_model]
    for option in args.drafter_option:
        parts += ["-O", option]
    parts += ["--rule", args.rule, "--eps", args.eps, "--residual", args.residual]
    if "typical" in args.rule:
        parts += ["--delta", args.delta] + (["--typical-eps", args.typical_eps] if args.typical_eps else [])
    parts += ["--num-prompts", str(args.num_prompts), "--samples", str(args.samples), "--max-new-tokens",
              str(args.max_new_tokens), "--temperature", f"{args.temperature:g}"]
    if args.top_k:
        parts += ["--top-k", str(args.top_k)]
    if args.top_p != 1.0:
        parts += ["--top-p", f"{args.top_p:g}"]
    parts += ["-k", str(args.num_draft_tokens), "--draft-length", args.draft_length, "--seed", str(args.seed)]
    parts += ["--no-win-rate"] if args.no_win_rate else ["--scorer", args.scorer]
    if args.dtype != "float32":
        parts += ["--dtype", args.dtype]
    if args.out:
        parts += ["--out", args.out]
    return shlex.join(parts)


def _progress(console):
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def _write(out: Path, args, records, settings, prompts, generations, scorer_name, interrupted, elapsed, machine) -> None:
    command = command_line(args)
    results = {
        "command": command, "interrupted": interrupted, "elapsed_s": elapsed, "machine": machine,
        "model": args.model or "embedded default (Gemma 3 270M)", "drafter": args.drafter,
        "drafter_options": args.drafter_option, "temperature": args.temperature, "top_k": args.top_k,
        "top_p": args.top_p, "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens,
        "draft_length": args.draft_length, "seeds": [args.seed + s for s in range(args.samples)],
        "scorer": scorer_name,
        "prompts": [{"question_id": p.question_id, "category": p.category} for p in prompts],
        "settings": tradeoff.public(records), "details": [r["details"] for r in records],
        "generations": [g.as_dict() for g in generations],
    }
    (out / "results.json").write_text(strict_json.dumps(results, indent=1))
    title = (f"{Path(args.model).name if args.model else 'Gemma 3 270M'}, drafter {args.drafter}, T={args.temperature:g}, "
             f"{len(prompts)} prompts x {args.samples} samples x {args.max_new_tokens} tokens")
    tradeoff_plot(records, out / "tradeoff.png", title)
    report = [f"# genspec tradeoff\n", f"`{command}`\n", f"{title}; {machine['logical_cores']}-core "
              f"{machine['cpu_model']}; {elapsed / 60:.1f} min. tok/s depend on the machine's load at the time; rejection, bias and tokens per target call do not.\n",
              "## Speed and bias per setting\n", tradeoff.speed_table(records), ""]
    if any(r["win_rate"] for r in records):
        report += [f"## OPT's WinRate over UNO\n\nScorer: {scorer_name}; ties count half; Wilson 95% interval.\n",
                   tradeoff.win_rate_table(records), ""]
    report.append("![bias vs rejection rate](tradeoff.png)\n")
    (out / "report.md").write_text("\n".join(report))
