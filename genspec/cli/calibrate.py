"""``genspec calibrate``: choose self-speculation settings for a target on this machine.

- ``early-exit``: the exit layer L; ``layer-skip``: the set of layers to skip; both by predicted
  speedup (see :mod:`genspec.calibration`). The winner is saved to a JSON file.
- ``prune``: which attention heads, MLP channels and layers a pruned copy of the target keeps (``--keep``,
  ``--keep-layers``), by their importance on the target's continuations of Spec-Bench prompts that
  ``genspec bench`` does not measure (each category's 6th on, as ``genspec train`` takes), optionally
  healed by a short distillation (``--heal-steps``, resumable with ``--resume``); the plan is saved to a JSON
  file (the healed weights beside it) for ``--drafter pruned -O path=PLAN.json``.
- ``draft-vocab``: the most frequent tokens of a corpus (or of the target's own samples), for a
  truncated-vocabulary draft head.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import genspec
from genspec import strict_json
from genspec.bench.prompts import CATEGORIES, encode_prompt, load_spec_bench
from genspec.calibration import (check_keep, choose_plan, draft_vocabulary, measure_pruned, read_corpus_files,
                                 search_early_exit, search_layer_skip)
from genspec.cli.options import add_options
from genspec.cli.train import BENCH_PROMPTS_EXCLUDED
from genspec.errors import ConfigError, InputFileError
from genspec.models import variants
from genspec.models.hf import HFCausalLM
from genspec.speculators.store import target_fingerprint
from genspec.textfiles import check_output_file
from genspec.train.data import Sequences, collect_sequences
from genspec.train.heal import heal, read_checkpoint


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("calibrate", help="choose self-speculation settings for a model on this machine")
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, helptext in (("early-exit", "pick the exit layer"), ("layer-skip", "pick the layers to skip")):
        p = sub.add_parser(name, help=helptext)
        add_options(p, "model", model={"help": None})
        p.add_argument("--out", required=True, help="JSON file to write (new unless --force)")
        p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
        add_options(p, "num_draft_tokens", num_draft_tokens={"default": 4, "metavar": None, "help": None})
        p.add_argument("--tokens", type=int, default=48, help="calibration tokens generated per prompt")
        p.set_defaults(func=run_search)
    p = sub.add_parser("prune", help="pick the heads, MLP channels and layers a pruned copy keeps")
    add_options(p, "model", model={"help": None})
    p.add_argument("--out", required=True, help="JSON file to write (the plan: -O path=FILE), new unless --force")
    p.add_argument("--force", action="store_true",
                   help="overwrite --out and the files beside it (healed weights, a healing checkpoint: the "
                        "healing starts over)")
    p.add_argument("--keep", type=float, default=0.5,
                   help="share of attention heads and of MLP channels kept in each layer, in (0, 1]")
    p.add_argument("--keep-layers", type=float, default=1.0, help="share of layers kept, in (0, 1]")
    p.add_argument("--prompts", type=int, default=2,
                   help=f"Spec-Bench prompts per category scored (of the {len(CATEGORIES)} categories; after the "
                        f"first {BENCH_PROMPTS_EXCLUDED}, which genspec bench measures)")
    p.add_argument("--continuation", type=int, default=64,
                   help="the target's greedy tokens after each prompt, scored with it")
    p.add_argument("--max-prompt-tokens", type=int, default=384,
                   help="longer prompts are scored without a continuation")
    add_options(p, "num_draft_tokens", num_draft_tokens={"default": 4, "metavar": None, "help": None})
    p.add_argument("--tokens", type=int, default=48,
                   help="calibration tokens generated per prompt to measure the pruned copy's agreement")
    p.add_argument("--heal-steps", type=int, default=0,
                   help="distil the pruned copy's own weights towards the target for this many steps (0: no healing)")
    p.add_argument("--heal-lr", type=float, default=1e-4, help="the healing's learning rate (AdamW)")
    p.add_argument("--heal-tokens", type=int, default=128, help="tokens of a calibration sequence per healing step")
    add_options(p, "seed", seed={"default": 0})
    p.add_argument("--resume", action="store_true",
                   help="continue the healing run whose checkpoint is beside --out (PLAN.checkpoint.pt)")
    p.set_defaults(func=run_prune)
    p = sub.add_parser("draft-vocab", help="most frequent tokens, for a truncated-vocabulary draft head")
    add_options(p, "model", model={"help": None})
    p.add_argument("--out", required=True, help="JSON file to write (new unless --force)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--size", type=int, default=32768)
    p.add_argument("--corpus", action="append", default=[], metavar="FILE", help="text file(s) to count")
    p.set_defaults(func=run_draft_vocab)


def run_search(args) -> int:
    console = Console(stderr=True)
    k = args.num_draft_tokens
    if k < 1:  # before the (slow) model load
        raise ConfigError(f"num_draft_tokens must be >= 1, got {k}")
    check_output_file(args.out, "--out file", args.force)
    target = genspec.load_model(args.model, backend="torch")
    search, key = (search_early_exit, "exit_layer") if args.what == "early-exit" else (search_layer_skip, "skip")
    with console.status("") as status:
        payload = search(target, k, args.tokens, progress=status.update)
    result = {key: payload[key]}
    _write_json(args.out, payload)
    console.print(f"{args.what}: {result} alpha={payload['alpha']:.2f} predicted speedup "
                  f"{payload['predicted_speedup']:.2f}x (k={k}); written to {args.out}")
    return 0


def _prune_files(out: str) -> tuple[Path, Path]:
    """The healing checkpoint and the healed weights beside the plan ``out`` (PLAN.json: PLAN.checkpoint.pt,
    PLAN.safetensors)."""
    return Path(out).with_suffix(".checkpoint.pt"), Path(out).with_suffix(".safetensors")


def run_prune(args) -> int:
    check_keep(args.keep, "--keep")  # everything is checked before the (slow) model load
    check_keep(args.keep_layers, "--keep-layers")
    for name in ("prompts", "continuation", "max_prompt_tokens", "num_draft_tokens", "tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heal_steps < 0 or args.heal_tokens < 2 or not args.heal_lr > 0:
        raise ConfigError(f"--heal-steps must be >= 0, --heal-tokens >= 2 and --heal-lr > 0, got {args.heal_steps}, "
                          f"{args.heal_tokens}, {args.heal_lr}")
    checkpoint, weights = _prune_files(args.out)
    state = None
    if args.resume:
        if args.force:
            raise ConfigError("--resume and --force exclude each other: continue the healing run, or start over")
        if not args.heal_steps:
            raise ConfigError("--resume continues a healing run: give its --heal-steps")
        state = read_checkpoint(checkpoint)
    elif args.heal_steps and checkpoint.exists() and not args.force:
        raise ConfigError(f"{checkpoint} exists: pass --resume to continue that healing run, or --force to start over")
    # a resumed run writes over its own plan and weights; a new one over nobody's unless --force
    check_output_file(args.out, "--out file", args.force or args.resume)
    if args.heal_steps:
        check_output_file(weights, "healed weights file", args.force or args.resume)
    target = genspec.load_model(args.model, backend="torch")
    if not isinstance(target, HFCausalLM):
        raise ConfigError("genspec calibrate prune needs a Hugging Face model directory (it prunes the weights)")
    console = Console(stderr=True)
    if state is not None:  # the plan and sequences of the run resumed
        plan, sequences = dict(state["plan"]), Sequences(**state["sequences"])
        if plan.get("fingerprint") != target_fingerprint(target):
            raise ConfigError(f"{checkpoint} was made for another model")
    else:
        prompts = [encode_prompt(p.text, target.tokenizer)
                   for p in load_spec_bench(per_category=args.prompts, skip=BENCH_PROMPTS_EXCLUDED)]
        with console.status("") as status:
            sequences = collect_sequences(
                target, prompts, [], args.continuation, args.max_prompt_tokens,
                progress=lambda done, total: status.update(f"the target's continuations: {done}/{total} prompts"))
            sequences.split(args.seed)
            plan = choose_plan(target, [sequences.sequences[i] for i in sequences.train], args.keep,
                               args.keep_layers, progress=status.update)
        plan["calibration"] = {"model": args.model or "embedded default", **sequences.info,
                               "spec_bench_prompts_per_category": args.prompts,
                               "spec_bench_prompts_skipped_per_category": BENCH_PROMPTS_EXCLUDED,
                               "held_out_sequences": len(sequences.held_out)}
    draft = variants.pruned(target, plan["layers"], plan["heads"], plan["channels"])
    if args.heal_steps:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("healing", total=args.heal_steps, completed=state["step"] if state else 0)
            healed = heal(target, draft, [sequences.sequences[i] for i in sequences.train],
                          [sequences.sequences[i] for i in sequences.held_out], args.heal_steps, args.heal_lr,
                          args.heal_tokens, args.seed, checkpoint, state,
                          saved_with={"plan": plan, "sequences": asdict(sequences)},
                          progress=lambda step, loss: progress.update(task, completed=step,
                                                                      description=f"healing (loss {loss:.3f})"))
        variants.save_own_weights(weights, draft, target)
        plan["healed"] = {**healed, "weights": weights.name}
    with console.status("") as status:
        plan.update(measure_pruned(target, draft, args.num_draft_tokens, args.tokens, progress=status.update))
    _write_json(args.out, plan)
    heads = sum(map(len, (plan["heads"][i] for i in plan["layers"])))
    channels = sum(map(len, (plan["channels"][i] for i in plan["layers"])))
    healing = (f"; healed {args.heal_steps} steps, held-out KL {plan['healed']['held_out_kl_before']:.3f} -> "
               f"{plan['healed']['held_out_kl_after']:.3f}" if args.heal_steps else "")
    console.print(f"prune: {len(plan['layers'])}/{target.num_layers} layers, {heads} heads, {channels} MLP channels "
                  f"kept ({plan['parameters']['kept']:.0%} of the decoder's weights){healing}; "
                  f"alpha={plan['alpha']:.2f} predicted speedup {plan['predicted_speedup']:.2f}x "
                  f"(k={args.num_draft_tokens}); written to {args.out}")
    return 0


def run_draft_vocab(args) -> int:
    if args.size < 1:  # everything is checked before the (slow) model load
        raise ConfigError(f"--size must be >= 1, got {args.size}")
    texts = read_corpus_files(args.corpus)
    check_output_file(args.out, "--out file", args.force)
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
