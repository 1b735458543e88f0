"""Calibration of self-speculation for a target on this machine (``genspec calibrate`` prints it).

- :func:`search_early_exit` picks the exit layer L, :func:`search_layer_skip` the set of layers to skip;
  both by predicted speedup = E[tokens per call](alpha, k) * t_plain / (k * t_draft + t_verify(k + 1)),
  where alpha is the draft's greedy agreement with the target measured teacher-forced on calibration
  text (one forward per candidate) and the t are measured step times.
- :func:`draft_vocabulary`: the most frequent tokens of a corpus (or of the target's own samples), for a
  truncated-vocabulary draft head.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models import variants
from genspec.textfiles import read_utf8_text
from genspec.theory.leviathan import expected_tokens_per_call

CALIBRATION_PROMPTS = [
    "Summarize: The council approved the new budget for the library, which adds a children's room and a cafe.",
    "Write a short story about a fisherman who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]

#: progress callback: called with a short description of the step about to run
Progress = Callable[[str], None]


# ---------------------------------------------------------------- measurements
def calibration_text(target, tokens: int) -> list[list[int]]:
    """Prompt + the target's own greedy continuation, per calibration prompt (the text drafts must match)."""
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
    return expected_tokens_per_call(alpha, k) * t_plain / (k * t_draft + t_verify)


# ---------------------------------------------------------------- self-speculation search
def _report(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


class _Evaluator:
    """The target's reference (calibration text, its argmaxes, plain and verify step times) and the
    evaluation of a draft against it."""

    def __init__(self, target, k: int, tokens: int, progress: Progress | None):
        if k < 1:
            raise ConfigError(f"num_draft_tokens must be >= 1, got {k}")
        self.k = k
        _report(progress, "generating calibration text")
        self.texts = calibration_text(target, tokens)
        self.starts = [len(target.tokenizer(p)["input_ids"]) for p in CALIBRATION_PROMPTS]
        self.argmaxes = []
        for text in self.texts:
            target.reset(1)
            self.argmaxes.append(target.forward(torch.tensor([text[:-1]])).argmax(-1)[0])
        self.t_plain = step_time(target, self.texts[0])
        self.t_verify = step_time(target, self.texts[0], width=k + 1)

    def __call__(self, model) -> dict:
        alpha = greedy_agreement(model, self.argmaxes, self.texts, self.starts)
        t_draft = step_time(model, self.texts[0])
        return {"alpha": alpha, "draft_step_s": t_draft,
                "predicted_speedup": predicted_speedup(alpha, self.k, self.t_plain, t_draft, self.t_verify)}

    def result(self, setting: dict, best: dict, candidates: list[dict]) -> dict:
        return {**setting, "alpha": best["alpha"], "predicted_speedup": best["predicted_speedup"],
                "num_draft_tokens": self.k, "plain_step_s": self.t_plain, "verify_step_s": self.t_verify,
                "candidates": candidates}


def search_early_exit(target, num_draft_tokens: int = 4, tokens: int = 48,
                      progress: Progress | None = None) -> dict:
    """The exit layer of the best predicted speedup, tried one by one. Returns ``{"exit_layer", "alpha",
    "predicted_speedup", "num_draft_tokens", "plain_step_s", "verify_step_s", "candidates"}`` (what
    ``genspec calibrate early-exit`` saves); ``tokens`` calibration tokens are generated per prompt."""
    total = variants.num_layers(target)
    evaluate = _Evaluator(target, num_draft_tokens, tokens, progress)
    candidates = []
    for layer in range(1, total):
        _report(progress, f"exit layer {layer}/{total - 1}")
        candidates.append({"exit_layer": layer, **evaluate(variants.early_exit(target, layer))})
    best = max(candidates, key=lambda c: c["predicted_speedup"])
    return evaluate.result({"exit_layer": best["exit_layer"]}, best, candidates)


def search_layer_skip(target, num_draft_tokens: int = 4, tokens: int = 48,
                      progress: Progress | None = None) -> dict:
    """The layers to skip, chosen greedily: add the layer whose removal helps the predicted speedup
    most, while it helps (the first and last layers stay). Returns ``{"skip", ...}`` like
    :func:`search_early_exit`."""
    total = variants.num_layers(target)
    evaluate = _Evaluator(target, num_draft_tokens, tokens, progress)
    candidates = []
    skip: list[int] = []
    best = {"skip": [], **evaluate(variants.layer_skip(target, [])), "predicted_speedup": 1.0}
    while True:  # greedy: add the layer whose removal helps most, while it helps
        round_best = None
        for layer in range(1, total - 1):  # the first and last layers stay
            if layer in skip:
                continue
            _report(progress, f"skip {sorted(skip + [layer])}")
            trial = {"skip": sorted(skip + [layer]), **evaluate(variants.layer_skip(target, skip + [layer]))}
            candidates.append(trial)
            if round_best is None or trial["predicted_speedup"] > round_best["predicted_speedup"]:
                round_best = trial
        if round_best is None or round_best["predicted_speedup"] <= best["predicted_speedup"]:
            break
        best, skip = round_best, round_best["skip"]
    return evaluate.result({"skip": best["skip"]}, best, candidates)


# ---------------------------------------------------------------- draft vocabulary
def draft_vocabulary(target, size: int, corpus: Iterable[str | Path] = (), texts: list[str] | None = None) -> dict:
    """The ``size`` most frequent token ids of the UTF-8 text files ``corpus`` (or of ``texts`` already
    read with :func:`read_corpus_files`; neither: of the target's own greedy samples of the calibration
    prompts), plus the special tokens, sorted. Returns ``{"token_ids", "source", "coverage"}``
    (coverage: fraction of the counted tokens they cover)."""
    if size < 1:
        raise ConfigError(f"size must be >= 1, got {size}")
    counts: Counter[int] = Counter()
    texts = read_corpus_files(corpus) if texts is None else texts
    if texts:
        for text in texts:  # the text's own tokens: a BOS the tokenizer adds is no evidence of anything
            counts.update(target.tokenizer(text, add_special_tokens=False)["input_ids"])
        source = "corpus"
    else:
        for text in calibration_text(target, 256):
            counts.update(text)
        source = "target samples"
    if not counts:
        raise InputFileError("the corpus has no tokens")
    special = [i for i in (target.tokenizer.all_special_ids or []) if i < target.vocab_size]
    ids, covered = most_frequent_tokens(counts, size, special)
    return {"token_ids": ids, "source": source, "coverage": covered}


def read_corpus_files(paths: Iterable[str | Path]) -> list[str]:
    """The texts of the corpus files ``paths`` (UTF-8); an empty or blank file is an error, not a corpus
    that covers "100%" of nothing. Called before any model loads, so a bad file fails at once."""
    texts = []
    for path in paths:
        text = read_utf8_text(path, "corpus file")
        if not text.strip():
            raise InputFileError(f"corpus file {path} is empty: a draft vocabulary needs text to count")
        texts.append(text)
    return texts


def most_frequent_tokens(counts: Counter, size: int, always: Iterable[int] = ()) -> tuple[list[int], float]:
    """The ``size`` most frequent ids of ``counts`` (ties by id) plus ``always``, sorted, and the fraction
    of the counted tokens they cover (a truncated draft vocabulary)."""
    chosen = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]]
    ids = sorted(set(chosen) | set(always))
    return ids, sum(counts[i] for i in ids) / max(1, sum(counts.values()))


# ---------------------------------------------------------------- verify costs by block shape
def measure_verify_costs(target, costs, batches=(1, 2, 4, 8, 16), widths=(1, 2, 3, 5, 9), context: int = 256,
                         repeats: int = 2, progress: Progress | None = None) -> None:
    """Time the target's pass over blocks of ``batch`` rows x ``width`` tokens after ``context`` tokens
    per row, and record them in ``costs`` (a :class:`genspec.draft_length.CostModel`), so that a batch's
    draft-length plan starts from this machine's costs. The target is left empty (no rows)."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, 32_000)
    if target.max_context is not None:  # a small model: measure at the longest context that fits
        context = max(1, min(context, target.max_context - max(widths)))
    for batch in batches:
        _report(progress, f"measuring verify costs: {batch} row(s)")
        target.reset(0)
        target.add_rows([torch.randint(3, vocab, (context,), generator=generator).tolist() for _ in range(batch)])
        for width in widths:
            times = []
            for _ in range(repeats + 1):
                block = torch.randint(3, vocab, (batch, width), generator=generator)
                started = time.perf_counter()
                target.forward(block)
                times.append(time.perf_counter() - started)
                target.keep_block(torch.full((batch, width), -1))
            costs.observe_verify(width, sorted(times[1:])[len(times[1:]) // 2], batch)
    target.reset(0)
