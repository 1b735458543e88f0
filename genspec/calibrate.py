"""``genspec calibrate``: choose self-speculation settings for a target on this machine.

- ``early-exit``: the exit layer L; ``layer-skip``: the set of layers to skip; both by predicted
  speedup = E[tokens per call](alpha, k) * t_plain / (k * t_draft + t_verify(k + 1)), where alpha is the
  draft's greedy agreement with the target measured teacher-forced on calibration text (one forward
  per candidate) and the t are measured step times. The winner is saved to a JSON file.
- ``draft-vocab``: the most frequent tokens of a corpus (or of the target's own samples), for a
  truncated-vocabulary draft head.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from genspec.draft_length import expected_tokens
from genspec.errors import ConfigError, InputFileError

CALIBRATION_PROMPTS = [
    "Summarize: The council approved the new budget for the library, which adds a children's room and a cafe.",
    "Write a short story about a fisherman who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("calibrate", help="choose self-speculation settings for a model on this machine")
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, helptext in (("early-exit", "pick the exit layer"), ("layer-skip", "pick the layers to skip")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", metavar="PATH")
        p.add_argument("--out", required=True, help="JSON file to write")
        p.add_argument("-k", "--num-draft-tokens", type=int, default=4)
        p.add_argument("--tokens", type=int, default=48, help="calibration tokens generated per prompt")
        p.set_defaults(func=run_search)
    p = sub.add_parser("draft-vocab", help="most frequent tokens, for a truncated-vocabulary draft head")
    p.add_argument("--model", metavar="PATH")
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=32768)
    p.add_argument("--corpus", action="append", default=[], metavar="FILE", help="text file(s) to count")
    p.set_defaults(func=run_draft_vocab)


# ---------------------------------------------------------------- measurements
def calibration_text(target, tokens: int) -> list[list[int]]:
    """Prompt + the target's own greedy continuation, per calibration prompt (the text drafts must match)."""
    from genspec.engine import SpeculativeEngine

    engine = SpeculativeEngine(target)
    prompts = [target.tokenizer(p)["input_ids"] for p in CALIBRATION_PROMPTS]
    results = engine.generate_ids(prompts, max_new_tokens=tokens, eos_token_ids=())
    return [p + r.token_ids for p, r in zip(prompts, results)]


def greedy_agreement(draft, target_argmax: list[torch.Tensor], texts: list[list[int]], start: list[int]) -> float:
    """Fraction of generated positions where the draft's argmax equals the target's (teacher forced)."""
    agree = total = 0
    for text, reference, begin in zip(texts, target_argmax, start):
        draft.reset(1)
        predicted = draft.forward(torch.tensor([text[:-1]])).argmax(-1)[0]
        agree += int((predicted[begin - 1:] == reference[begin - 1:]).sum())
        total += len(text) - begin
    return agree / total


def step_time(model, context: list[int], width: int = 1, repeats: int = 5) -> float:
    """Median seconds of one forward of ``width`` tokens after ``context``."""
    model.reset(1)
    model.forward(torch.tensor([context]), last_only=True)
    model.commit_all()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model.forward(torch.tensor([context[-width:]]))
        times.append(time.perf_counter() - start)
        model.keep_block(torch.full((1, width), -1))
    return sorted(times[1:])[len(times[1:]) // 2]


def predicted_speedup(alpha: float, k: int, t_plain: float, t_draft: float, t_verify: float) -> float:
    return expected_tokens(alpha, k) * t_plain / (k * t_draft + t_verify)


def run_search(args) -> int:
    import genspec
    from genspec.models import variants
    from rich.console import Console

    console = Console(stderr=True)
    k = args.num_draft_tokens
    if k < 1:
        raise ConfigError(f"num_draft_tokens must be >= 1, got {k}")
    target = genspec.load_model(args.model)
    total = variants.num_layers(target)
    with console.status("generating calibration text"):
        texts = calibration_text(target, args.tokens)
        starts = [len(target.tokenizer(p)["input_ids"]) for p in CALIBRATION_PROMPTS]
        argmaxes = []
        for text in texts:
            target.reset(1)
            argmaxes.append(target.forward(torch.tensor([text[:-1]])).argmax(-1)[0])
        t_plain = step_time(target, texts[0])
        t_verify = step_time(target, texts[0], width=k + 1)

    def evaluate(model) -> dict:
        alpha = greedy_agreement(model, argmaxes, texts, starts)
        t_draft = step_time(model, texts[0])
        return {"alpha": alpha, "draft_step_s": t_draft,
                "predicted_speedup": predicted_speedup(alpha, k, t_plain, t_draft, t_verify)}

    candidates = []
    if args.what == "early-exit":
        for layer in range(1, total):
            with console.status(f"exit layer {layer}/{total - 1}"):
                candidates.append({"exit_layer": layer, **evaluate(variants.early_exit(target, layer))})
        best = max(candidates, key=lambda c: c["predicted_speedup"])
        result = {"exit_layer": best["exit_layer"]}
    else:
        skip: list[int] = []
        best = {"skip": [], **evaluate(variants.layer_skip(target, [])), "predicted_speedup": 1.0}
        while True:  # greedy: add the layer whose removal helps most, while it helps
            round_best = None
            for layer in range(1, total - 1):  # the first and last layers stay
                if layer in skip:
                    continue
                with console.status(f"skip {sorted(skip + [layer])}"):
                    trial = {"skip": sorted(skip + [layer]), **evaluate(variants.layer_skip(target, skip + [layer]))}
                candidates.append(trial)
                if round_best is None or trial["predicted_speedup"] > round_best["predicted_speedup"]:
                    round_best = trial
            if round_best is None or round_best["predicted_speedup"] <= best["predicted_speedup"]:
                break
            best, skip = round_best, round_best["skip"]
        result = {"skip": best["skip"]}
    payload = {**result, "alpha": best["alpha"], "predicted_speedup": best["predicted_speedup"],
               "num_draft_tokens": k, "plain_step_s": t_plain, "verify_step_s": t_verify, "candidates": candidates}
    _write_json(args.out, payload)
    console.print(f"{args.what}: {result} alpha={best['alpha']:.2f} predicted speedup "
                  f"{best['predicted_speedup']:.2f}x (k={k}); written to {args.out}")
    return 0


def run_draft_vocab(args) -> int:
    import genspec

    if args.size < 1:
        raise ConfigError(f"--size must be >= 1, got {args.size}")
    target = genspec.load_model(args.model)
    counts: Counter[int] = Counter()
    if args.corpus:
        for path in args.corpus:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except FileNotFoundError as exc:
                raise InputFileError(f"corpus file not found: {path}") from exc
            except (OSError, UnicodeDecodeError) as exc:
                raise InputFileError(f"cannot read {path} as UTF-8 text: {exc}") from exc
            counts.update(target.tokenizer(text)["input_ids"])
        source = "corpus"
    else:
        for text in calibration_text(target, 256):
            counts.update(text)
        source = "target samples"
    if not counts:
        raise InputFileError("the corpus has no text")
    special = [i for i in (target.tokenizer.all_special_ids or []) if i < target.vocab_size]
    ids = [token for token, _ in counts.most_common(args.size)]
    ids = sorted(set(ids) | set(special))
    covered = sum(counts[i] for i in ids) / sum(counts.values())
    _write_json(args.out, {"token_ids": ids, "source": source, "coverage": covered})
    print(f"{len(ids)} token ids covering {covered:.1%} of the {source}; written to {args.out}")
    return 0


def _write_json(path: str, payload: dict) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))
    except OSError as exc:
        raise InputFileError(f"cannot write {path}: {exc}") from exc
