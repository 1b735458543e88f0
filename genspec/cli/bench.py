"""``genspec bench``: genspec's methods against plain decoding and Hugging Face's assisted generation.

    genspec bench --quick                                   # a first look: 2 short prompts, one repeat
    genspec bench --categories qa,summarization --num-prompts 5 --repeats 3 --out bench_results
    genspec bench --methods "prompt-lookup,hierarchical:levels=prompt-lookup+quantized,hf-prompt-lookup" \\
                  --k-sweep 2,4,8
    genspec bench --report-from bench_results/results.json  # rebuild report.md and the plots

Writes ``results.json`` (every call's figures, machine, versions, settings; each call's generated tokens
and per-step draft counts only with ``--raw``), ``report.md`` (tables per category, diagnostics, noise
notes) and PNG plots into ``--out`` (default ``bench_results`` in the current directory).
"""
from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from genspec.api import resolve_backend
from genspec.bench.analysis import ALL, MEAN
from genspec.bench.methods import parse_int_list, parse_method, parse_methods, split_top_level
from genspec.bench.prompts import ALL_CATEGORIES, CATEGORIES, load_spec_bench
from genspec.bench.report import format_match, format_number
from genspec.bench.run import execute, read_results, write_outputs
from genspec.cli.options import add_options
from genspec.drafters.registry import check_draft_model
from genspec.errors import ConfigError, InputFileError
from genspec.textfiles import check_output_dir

#: the methods of a run by backend (plain and the backend's reference baseline always run too)
DEFAULT_METHODS = {"torch": "prompt-lookup,quantized,hierarchical:levels=prompt-lookup+quantized,hf-prompt-lookup,"
                            "hf-early-exit",
                   "llamacpp": "prompt-lookup,suffix,llamacpp-lookup"}
WITH_DRAFT_MODEL = ",draft-model,hf-assisted"
#: --quick: two short prompts, both baselines, genspec's default setting and the outside engine's prompt
#: lookup, one repeat (a smoke test and a first look; use --repeats 3 or more for figures with a spread)
QUICK_METHODS = {"torch": "prompt-lookup,hf-prompt-lookup", "llamacpp": "prompt-lookup,llamacpp-lookup"}
QUICK = {"categories": "coding,extraction", "num_prompts": 1,
         "max_new_tokens": 32, "repeats": 1, "k_sweep": "2,8", "sweep_prompts": 1}
DEFAULTS = {"categories": None, "num_prompts": 2, "max_new_tokens": 128, "repeats": 3, "k_sweep": None,
            "sweep_prompts": 2}


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmark genspec methods vs plain decoding and Hugging Face assisted generation",
        description="Decode Spec-Bench prompts with plain decoding, genspec's methods and Hugging Face "
                    "baselines, interleaved in one process; write results.json, report.md and PNG plots.",
        epilog="examples:\n" + __doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(bench, "model", "backend", "kernels", "draft_model",
                model={"help": "target model directory or .gguf file (default: embedded Gemma 3 270M)"},
                backend={"help": "what runs the target (see genspec generate --help); the reference baseline is its "
                                 "own plain decoding: hf-plain on torch, llamacpp-plain on llamacpp"},
                draft_model={"help": "draft model directory: enables the draft-model and hf-assisted methods"})
    bench.add_argument("--methods", metavar="LIST",
                       help="comma-separated methods NAME[:KEY=VALUE...]: genspec drafters (prompt-lookup, "
                            "quantized, early-exit:exit_layer=4, hierarchical:levels=prompt-lookup+quantized, "
                            "prompt-lookup:k=4:draft_length=fixed, ...) and HF baselines (hf-prompt-lookup, "
                            "hf-early-exit[:assistant_early_exit=L], hf-assisted; --backend torch) and llama-cpp-python "
                            "baselines (llamacpp-lookup[:num_pred_tokens=N]; --backend llamacpp). plain and the "
                            "backend's reference (hf-plain or llamacpp-plain) always run. "
                            f"Default: {DEFAULT_METHODS['llamacpp']} on llamacpp, {DEFAULT_METHODS['torch']} on torch "
                            f"(+{WITH_DRAFT_MODEL[1:]} with --draft-model)")
    bench.add_argument("--categories", metavar="LIST",
                       help="Spec-Bench categories (default: all 13), and/or genspec's grammar-correction task 'edit' and "
                            "the repeated-traffic replay 'repeated' (multi-turn chat and repeated questions)")
    bench.add_argument("--num-prompts", type=int, metavar="N", help="prompts per category (default 2)")
    bench.add_argument("--skip-prompts", type=int, default=0, metavar="N",
                       help="leave out each category's first N prompts (default 0): tune on prompts that the "
                            "default run, which measures the first ones, does not")
    add_options(bench, "max_new_tokens", "temperature", "top_p", "seed",
                max_new_tokens={"default": None, "metavar": "N", "help": "tokens per prompt at most (default 128)"},
                temperature={"metavar": "T"},
                top_p={"metavar": "P",
                       "help": "nucleus sampling with --temperature > 0, for every method alike (default 1.0: off)"},
                seed={"default": 0, "help": "seed of every call (default 0)"})
    bench.add_argument("--repeats", type=int, metavar="R", help="repeats of the whole suite (default 3)")
    bench.add_argument("--ignore-eos", action="store_true",
                       help="generate --max-new-tokens on every call, past any end token, for every method and "
                            "baseline alike: sampled methods then compare tok/s over equal lengths")
    add_options(bench, "num_draft_tokens", "draft_length",
                num_draft_tokens={"help": "draft tokens per step (max for adaptive policies; default: each "
                                          "drafter's own, 8, suffix 24)"},
                draft_length={"help": "genspec draft length policy unless a method sets its own (default cost)"})
    bench.add_argument("--k-sweep", metavar="LIST", help="also run --sweep-method at these fixed k, e.g. 2,4,8")
    bench.add_argument("--sweep-method", metavar="METHOD",
                       help="the genspec method of the k sweep (default: the first genspec method)")
    bench.add_argument("--sweep-prompts", type=int, metavar="N", help="prompts in the k sweep (default 2)")
    bench.add_argument("--out", metavar="DIR",
                       help="output directory, new or empty unless --force (default bench_results)")
    bench.add_argument("--force", action="store_true",
                       help="write into --out even if it holds files (an earlier run's are overwritten)")
    bench.add_argument("--raw", action="store_true",
                       help="also keep each call's generated token ids and per-step (drafted, accepted) counts in "
                            "results.json (several MB for a full run; the report does not need them)")
    bench.add_argument("--quick", action="store_true",
                       help=f"smoke-test size (< 2 min on 2 cores): {', '.join(f'{k}={v}' for k, v in QUICK.items())}; "
                            "explicit options still win")
    add_options(bench, "dtype", dtype={"choices": ["float32", "bfloat16", "float16"]})
    bench.add_argument("--threads", type=int, metavar="N",
                       help="torch intra-op threads (default: torch's choice; recorded in results.json)")
    bench.add_argument("--report-from", metavar="RESULTS_JSON",
                       help="do not run: rebuild report.md and plots from a results.json or results.json.gz "
                            "(into --out, default its directory)")
    bench.set_defaults(func=run_bench)


# --------------------------------------------------------------------------- settings and checks
def resolve_settings(args) -> dict:
    """Every setting of the run, checked, with --quick and defaults applied (no model loaded)."""
    preset = QUICK if args.quick else DEFAULTS
    pick = {key: getattr(args, key) if getattr(args, key) is not None else preset.get(key, DEFAULTS.get(key))
            for key in ("categories", "num_prompts", "max_new_tokens", "repeats", "k_sweep", "sweep_prompts")}
    if pick["categories"] is None:
        categories = list(CATEGORIES)
    else:
        categories = split_top_level(pick["categories"])
        if not categories:
            raise ConfigError("--categories is empty; choose from: " + ", ".join(ALL_CATEGORIES))
        unknown = [c for c in categories if c not in ALL_CATEGORIES]
        if unknown:
            raise ConfigError(f"unknown categories {unknown}; choose from: {', '.join(ALL_CATEGORIES)}")
    for key, flag in (("num_prompts", "--num-prompts"), ("max_new_tokens", "--max-new-tokens"),
                      ("repeats", "--repeats"), ("sweep_prompts", "--sweep-prompts")):
        if pick[key] < 1:
            raise ConfigError(f"{flag} must be >= 1, got {pick[key]}")
    if args.skip_prompts < 0:
        raise ConfigError(f"--skip-prompts must be >= 0, got {args.skip_prompts}")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise ConfigError(f"-k must be >= 1, got {args.num_draft_tokens}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    check_draft_model(args.draft_model)
    if args.draft_model is not None and not Path(args.draft_model).exists():
        raise InputFileError(f"no draft model at {args.draft_model}: expected a model directory or a GGUF file")

    backend = resolve_backend(args.model, args.backend, args.dtype).value
    methods_text = args.methods if args.methods is not None else (
        QUICK_METHODS[backend] if args.quick else
        DEFAULT_METHODS[backend] + (WITH_DRAFT_MODEL if args.draft_model and backend == "torch" else ""))
    if args.model is not None and backend == "torch" and not (Path(args.model) / "config.json").is_file():
        raise InputFileError(f"no model at {args.model}: expected a directory with config.json and weights")
    if args.model is not None and backend == "llamacpp" and not Path(args.model).is_file():
        raise InputFileError(f"no GGUF model at {args.model}")
    if backend == "llamacpp" and args.dtype != "float32":
        raise ConfigError(f"--dtype {args.dtype} applies to the torch backend; a GGUF model keeps its own quantisation")
    methods = parse_methods(methods_text, draft_model=args.draft_model, backend=backend)
    genspec_methods = [m for m in methods if m.kind == "genspec" and m.base != "none"]
    sweep_ks, sweep_method = [], None
    if pick["k_sweep"]:
        sweep_ks = parse_int_list(pick["k_sweep"], "--k-sweep")
        if args.sweep_method:
            sweep_method = parse_method(args.sweep_method, draft_model=args.draft_model, backend=backend)
        elif genspec_methods:
            sweep_method = genspec_methods[0]
        else:
            raise ConfigError("--k-sweep needs a genspec method: add one to --methods or give --sweep-method")
    return {"model": args.model, "backend": backend, "kernels": args.kernels, "draft_model": args.draft_model, "methods": methods, "categories": categories,
            "num_prompts": pick["num_prompts"], "skip_prompts": args.skip_prompts,
            "max_new_tokens": pick["max_new_tokens"],
            "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "repeats": pick["repeats"],
            "ignore_eos": args.ignore_eos, "num_draft_tokens": args.num_draft_tokens, "draft_length": args.draft_length,
            "k_sweep": sweep_ks, "sweep_method": sweep_method, "sweep_prompts": pick["sweep_prompts"],
            "out": Path(args.out or "bench_results"), "raw": args.raw, "quick": args.quick, "dtype": args.dtype, "threads": args.threads,
            "default_method": "prompt-lookup" if any(m.name == "prompt-lookup" for m in methods) else None}


def command_line(s: dict) -> str:
    parts = ["genspec", "bench"]
    if s["model"]:
        parts += ["--model", str(s["model"])]
    parts += ["--backend", s.get("backend", "torch")]
    if s.get("backend") == "llamacpp":
        parts += ["--kernels", s.get("kernels", "auto")]
    if s["draft_model"]:
        parts += ["--draft-model", str(s["draft_model"])]
    parts += ["--methods", ",".join(m.name for m in s["methods"]), "--categories", ",".join(s["categories"]),
              "--num-prompts", str(s["num_prompts"]),
              *(["--skip-prompts", str(s["skip_prompts"])] if s.get("skip_prompts") else []),
              "--max-new-tokens", str(s["max_new_tokens"]),
              "--temperature", str(s["temperature"]), "--seed", str(s["seed"]), "--repeats", str(s["repeats"]),
              *(["-k", str(s["num_draft_tokens"])] if s.get("num_draft_tokens") is not None else []),
              "--draft-length", s["draft_length"]]
    if s.get("top_p", 1.0) != 1.0:
        parts += ["--top-p", str(s["top_p"])]
    if s.get("ignore_eos"):
        parts.append("--ignore-eos")
    if s["threads"]:
        parts += ["--threads", str(s["threads"])]
    if s["k_sweep"]:
        parts += ["--k-sweep", ",".join(map(str, s["k_sweep"])), "--sweep-method", s["sweep_method"].name,
                  "--sweep-prompts", str(s["sweep_prompts"])]
    if s.get("raw"):
        parts.append("--raw")
    return shlex.join(parts + ["--out", str(s["out"])])


# --------------------------------------------------------------------------- the run
def run_bench(args) -> int:
    console = Console(stderr=True)
    if args.report_from:
        return rebuild_report(args, console)
    settings = resolve_settings(args)
    check_output_dir(settings["out"], args.force)  # an earlier run's results are never overwritten unasked

    prompts = load_spec_bench(settings["categories"], settings["num_prompts"], settings["skip_prompts"])
    started = time.perf_counter()

    threads = torch.get_num_threads()
    try:
        results = execute(settings, prompts, console, command_line(settings))
    finally:
        torch.set_num_threads(threads)  # as it was (bench may run inside a larger program)
    results["elapsed_s"] = time.perf_counter() - started
    written = write_outputs(results, settings["out"], raw=settings["raw"])
    print_summary(results, written, console)
    return 130 if results.get("interrupted") else 0


def rebuild_report(args, console) -> int:
    from genspec.bench.schema import check_results

    source = Path(args.report_from)
    results = read_results(source)
    check_results(results, source)  # every field the report reads, before anything is written
    out = Path(args.out) if args.out else source.parent
    # the results' own directory is where their report is rebuilt; any other holding files needs --force
    check_output_dir(out, args.force or out.resolve() == source.parent.resolve())
    results.pop("summary", None)
    # the records are written back as they were read, compressed if they were
    written = write_outputs(results, out, name="results.json.gz" if source.name.endswith(".gz") else "results.json")
    print_summary(results, written, console)
    return 0


def print_summary(results: dict, written: list[Path], console) -> None:
    """The mean-over-categories table on standard output, compact (medians; the report has ranges)."""
    def median(spread, fmt="{:.2f}", suffix=""):
        return "–" if not spread else fmt.format(spread["median"]) + suffix

    summary = results["summary"]
    table = Table(title=f"genspec bench: mean over {len(summary['categories'])} categories, "
                        f"median of {summary['repeats']} repeat(s)")
    for column in ("method", "tok/s", "vs plain", f"vs {summary['reference']}", "accepted/call", "greedy=plain"):
        table.add_column(column, justify="left" if column == "method" else "right")
    rows = {(r["category"], r["method"]): r for r in summary["rows"]}
    for method in summary["methods"]:
        mean, pooled = rows[(MEAN, method)], rows[(ALL, method)]
        table.add_row(method, median(mean["tokens_per_second"], "{:.1f}"), median(mean["speedup_vs_plain"], suffix="x"),
                      median(mean["speedup_vs_reference"], suffix="x"), format_number(pooled.get("mean_accepted_length")),
                      format_match(pooled.get("matches_plain")))
    Console(width=max(100, Console().width)).print(table)
    elapsed = results.get("elapsed_s")
    console.print(("finished in %.0f s; " % elapsed if elapsed else "") + "wrote " + ", ".join(str(p) for p in written),
                  markup=False, highlight=False)
