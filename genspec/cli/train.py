"""``genspec train KIND``: train a speculator for a model on this machine.

- ``head``: an EAGLE-style draft head on the target's own features (:mod:`genspec.train.head`), used
  with ``--drafter head -O path=DIR``.

Data: the target's own greedy continuations of Spec-Bench prompts that ``genspec bench`` never measures
(from the 6th prompt of each category on; bench measures the first ``--num-prompts``, at most 5 are
excluded here), plus teacher-forced text files given with ``--data``. 1 in 10 sequences is held out.
"""
from __future__ import annotations

from pathlib import Path

from genspec.errors import ConfigError, InputFileError

#: Spec-Bench prompts per category that training never uses (``genspec bench`` measures the first ones)
BENCH_PROMPTS_EXCLUDED = 5


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a speculator (a draft head) for a model on this machine")
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    p = sub.add_parser("head", help="an EAGLE-style draft head on the target's own features")
    p.add_argument("--model", metavar="PATH", help="target model directory (default: the embedded model)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the head (and its checkpoint) go")
    p.add_argument("--data", action="append", default=[], metavar="FILE",
                   help="extra teacher-forced text (UTF-8 .txt, or .jsonl with a \"text\" field); repeatable")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=415, help="Spec-Bench prompts used (at most 415 are not measured)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per continuation")
    p.add_argument("--max-prompt-tokens", type=int, default=384,
                   help="longer prompts are not continued (decoding after them is slow on a CPU); their text "
                        "still trains, teacher-forced")
    p.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary (most frequent output tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue the training in --out")
    p.set_defaults(func=run_head)


def _texts(paths: list[str]) -> list[str]:
    import json

    texts = []
    for path in paths:
        try:
            raw = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise InputFileError(f"training data not found: {path}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise InputFileError(f"cannot read {path} as UTF-8 text: {exc}") from exc
        if path.endswith(".jsonl"):
            try:
                texts += [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
            except (ValueError, KeyError, TypeError) as exc:
                raise InputFileError(f"{path}: expected one JSON object with a \"text\" field per line") from exc
        else:
            texts += [part for part in raw.split("\n\n") if part.strip()]
    return texts


def run_head(args) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    import genspec
    from genspec.bench.prompts import encode_prompt, load_spec_bench
    from genspec.engine import SpeculativeEngine
    from genspec.models.hf import HFCausalLM
    from genspec.train.head import TrainSettings, choose_vocabulary, record_features, train_head

    for name in ("steps", "batch_size", "prompts", "max_new_tokens", "max_prompt_tokens", "vocab_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.resume:
        raise ConfigError(f"{out} exists and is not empty; choose another --out or pass --resume")
    texts = _texts(args.data)
    console = Console(stderr=True)
    torch.manual_seed(args.seed)
    target = genspec.load_model(args.model)
    if not isinstance(target, HFCausalLM):
        raise ConfigError("genspec train head needs a Hugging Face model directory (it reads hidden states)")
    measured = {q.question_id for q in load_spec_bench(per_category=BENCH_PROMPTS_EXCLUDED)}
    prompts = [p for p in load_spec_bench() if p.question_id not in measured][:args.prompts]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("target continuations", total=len(prompts))
        engine = SpeculativeEngine(target, max_batch_size=16)
        sequences = []
        context = target.max_context or 1 << 30
        encoded = sorted((encode_prompt(p.text, target.tokenizer) for p in prompts), key=len)  # less padding
        limit = min(args.max_prompt_tokens, context - args.max_new_tokens)
        continued, long_prompts = [e for e in encoded if len(e) <= limit], [e for e in encoded if len(e) > limit]
        progress.update(task, total=len(continued))
        for start in range(0, len(continued), 16):
            batch = continued[start:start + 16]
            results = engine.generate_ids(batch, max_new_tokens=args.max_new_tokens, temperature=0.0)
            sequences += [prompt + r.token_ids for prompt, r in zip(batch, results)]
            progress.advance(task, len(batch))
        generated = sum(len(s) for s in sequences) - sum(len(e) for e in continued)
        sequences += [e[:min(1024, context)] for e in long_prompts]
        sequences += [target.tokenizer(text)["input_ids"][:min(1024, context)] for text in texts]
        if len(sequences) < 2:
            raise ConfigError("too little training data: no prompt fits the model's context and no --data given")
        task = progress.add_task("target features", total=len(sequences))
        data = record_features(target, sequences, progress=lambda n: progress.advance(task, n))
        generator = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(len(data), generator=generator).tolist()
        held = [data[i] for i in order[:max(1, len(data) // 10)]]
        train = [data[i] for i in order[max(1, len(data) // 10):]]
        vocab = choose_vocabulary([s.tolist() for s, _ in train], args.vocab_size, target.eos_token_ids)
        task = progress.add_task("training", total=args.steps)
        settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
        tokens = sum(len(f) for _, f in train)
        log = train_head(target, train, held, vocab, out, settings=settings, resume=args.resume,
                         progress=lambda step, entry: progress.update(
                             task, completed=step, description=f"training (loss {entry['loss']:.3f})"),
                         info={"model": args.model or "embedded default", "prompts": len(prompts),
                               "continued_prompts": len(continued), "generated_tokens": generated,
                               "continuation_tokens": args.max_new_tokens, "text_files": args.data,
                               "training_tokens": tokens, "sequences": len(train), "held_out_sequences": len(held)})
    after = log["held_out_after"]
    console.print(f"head written to {out}: {len(train)} sequences, {tokens} training tokens, {args.steps} steps in "
                  f"{log['seconds'] / 60:.1f} min; held out: first draft token agrees with the target "
                  f"{after['agreement']:.1%} of the time (before training {log['held_out_before']['agreement']:.1%})")
    return 0
