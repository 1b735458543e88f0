"""Calibration of self-speculation for a target on this machine (``genspec calibrate`` prints it).

- :func:`search_early_exit` picks the exit layer L, :func:`search_layer_skip` the set of layers to skip;
  both by predicted speedup = E[tokens per call](alpha, k) * t_plain / (k * t_draft + t_verify(k + 1)),
  where alpha is the draft's greedy agreement with the target measured teacher-forced on calibration
  text (one forward per candidate) and the t are measured step times.
- :func:`prune_plan`: what a structurally pruned copy of the target keeps (heads, MLP channels, layers),
  by importance measured on calibration text, with the pruned copy's agreement and predicted speedup.
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
from genspec.speculators.store import target_fingerprint
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


# ---------------------------------------------------------------- structured pruning
#: how ``genspec calibrate prune`` scores what it keeps (written into the plan)
PRUNE_SCORES = {
    "heads": "root mean square over the calibration tokens of the head's contribution to the residual stream "
             "(its output through its columns of o_proj)",
    "channels": "Wanda-style |W| * ||x||: the norm of the channel's down_proj column times the root mean square "
                "of its activation over the calibration tokens (its contribution to the residual stream)",
    "layers": "block influence (ShortGPT): mean over the calibration tokens of 1 - cos(layer input, layer output)",
}


def check_keep(value, name: str) -> float:
    """A keep ratio: a number in (0, 1]; anything else is a one-line :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{name} must be in (0, 1], got {value}")
    return float(value)


class _UnitScores:
    """Hooks on the target's decoder layers that add up, over every token the target runs, each query
    head's and each MLP channel's squared contribution to the residual stream and each layer's block
    influence. One-shot: every unit is scored in the whole target."""

    def __init__(self, target):
        self.layers = list(target.decoder.layers)
        self.shapes = [variants.attention_shape(layer) for layer in self.layers]
        self.heads = [torch.zeros(h, dtype=torch.float64) for h, _, _ in self.shapes]
        self.channels = [torch.zeros(layer.mlp.down_proj.in_features, dtype=torch.float64) for layer in self.layers]
        self.influence = torch.zeros(len(self.layers), dtype=torch.float64)
        self.tokens = 0
        # ||W_h a||^2 = a^T (W_h^T W_h) a for head h's columns W_h of o_proj: a [H, d, d] Gram per layer
        self._grams = []
        for layer, (heads, _, size) in zip(self.layers, self.shapes):
            weight = layer.self_attn.o_proj.weight.detach().double().reshape(-1, heads, size)
            self._grams.append(torch.einsum("ohd,ohe->hde", weight, weight))
        self._hooks = []
        for i, layer in enumerate(self.layers):
            self._hooks += [layer.self_attn.o_proj.register_forward_pre_hook(self._attention_hook(i)),
                            layer.mlp.down_proj.register_forward_pre_hook(self._mlp_hook(i)),
                            layer.register_forward_hook(self._layer_hook(i), with_kwargs=True)]

    def _attention_hook(self, i):
        def hook(module, args):
            heads, _, size = self.shapes[i]
            x = args[0].detach().double().reshape(-1, heads, size)
            self.heads[i] += torch.einsum("thd,hde,the->h", x, self._grams[i], x)
        return hook

    def _mlp_hook(self, i):
        def hook(module, args):
            x = args[0].detach().double()
            self.channels[i] += x.reshape(-1, x.shape[-1]).square().sum(0)
        return hook

    def _layer_hook(self, i):
        def hook(module, args, kwargs, output):
            before = (args[0] if args else kwargs["hidden_states"]).detach().double()
            after = (output[0] if isinstance(output, tuple) else output).detach().double()
            cosine = torch.nn.functional.cosine_similarity(before, after, dim=-1)
            self.influence[i] += (1 - cosine).sum()
            if i == 0:
                self.tokens += cosine.numel()
        return hook

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def scores(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """(head scores per layer, channel scores per layer, block influence per layer)."""
        tokens = max(1, self.tokens)
        heads = [(h / tokens).sqrt() for h in self.heads]
        channels = [(c / tokens).sqrt() * layer.mlp.down_proj.weight.detach().double().norm(dim=0)
                    for c, layer in zip(self.channels, self.layers)]
        return heads, channels, self.influence / tokens


def _round_count(ratio: float, total: int) -> int:
    return max(1, min(total, int(ratio * total + 0.5)))


def head_counts(num_heads: int, num_kv: int, keep: float) -> tuple[int, int]:
    """``(key/value heads kept, query heads kept per key/value head)``: the product closest to ``keep`` of
    the query heads, every key/value head kept serving as many query heads (grouped-query attention repeats
    each the same number of times); ties keep more key/value heads, then fewer query heads."""
    wanted, group = _round_count(keep, num_heads), num_heads // num_kv
    pairs = [(g, c) for g in range(1, num_kv + 1) for c in range(1, group + 1)]
    return min(pairs, key=lambda pair: (abs(pair[0] * pair[1] - wanted), -pair[0], pair[1]))


def _top(scores: torch.Tensor, count: int) -> list[int]:
    return sorted(torch.argsort(scores, descending=True, stable=True)[:count].tolist())


def choose_units(head_scores: list[torch.Tensor], channel_scores: list[torch.Tensor], influence: torch.Tensor,
                 shapes: list[tuple[int, int, int]], keep: float, keep_layers: float = 1.0) -> dict:
    """What to keep, from the scores: in every layer the same share ``keep`` of query heads (the best
    key/value groups, by the sum of their best heads' scores, and the best heads in each) and of MLP
    channels; the share ``keep_layers`` of layers (the first and last always, then by block influence).
    Returns ``{"layers", "heads", "channels"}`` (index lists, sorted)."""
    heads, channels = [], []
    for scores, channel, (num_heads, num_kv, _) in zip(head_scores, channel_scores, shapes):
        groups, per_group = head_counts(num_heads, num_kv, keep)
        by_group = scores.reshape(num_kv, num_heads // num_kv)
        best = by_group.sort(dim=1, descending=True, stable=True)
        kept_groups = _top(best.values[:, :per_group].sum(1), groups)
        heads.append(sorted(g * by_group.shape[1] + h for g in kept_groups
                            for h in best.indices[g, :per_group].tolist()))
        channels.append(_top(channel, _round_count(keep, len(channel))))
    total = len(influence)
    count = max(min(2, total), _round_count(keep_layers, total))
    ends = sorted({0, total - 1})
    middle = [i + 1 for i in _top(influence[1:-1], count - len(ends))] if count > len(ends) else []
    return {"layers": sorted(ends + middle), "heads": heads, "channels": channels}


def score_units(target, sequences: list[list[int]], progress: Progress | None = None):
    """Score the target's query heads, MLP channels and layers (:data:`PRUNE_SCORES`) over the token
    ``sequences``, teacher forced one at a time. Returns ``(head scores per layer, channel scores per layer,
    block influence per layer, tokens scored)``; the target is left empty (no rows)."""
    if not sequences:
        raise ConfigError("pruning needs calibration text: no sequences given")
    units = _UnitScores(target)
    try:
        for i, sequence in enumerate(sequences):
            _report(progress, f"scoring heads, channels and layers: sequence {i + 1}/{len(sequences)}")
            target.reset(1)
            target.forward(torch.tensor([sequence]), last_only=True)
    finally:
        units.remove()
        target.reset(0)
    return (*units.scores(), units.tokens)


def choose_plan(target, sequences: list[list[int]], keep: float, keep_layers: float = 1.0,
                progress: Progress | None = None) -> dict:
    """Score the target's units on ``sequences`` (:func:`score_units`) and keep the share ``keep`` of heads and
    channels in each layer and ``keep_layers`` of the layers (:func:`choose_units`). Returns ``{"layers",
    "heads", "channels", "keep", "keep_layers", "fingerprint", "score", "scores", "scored_tokens",
    "scored_sequences"}``."""
    keep, keep_layers = check_keep(keep, "keep"), check_keep(keep_layers, "keep_layers")
    shapes = [variants.attention_shape(layer) for layer in target.decoder.layers]
    head_scores, channel_scores, influence, scored = score_units(target, sequences, progress)
    plan = choose_units(head_scores, channel_scores, influence, shapes, keep, keep_layers)
    return {**plan, "keep": keep, "keep_layers": keep_layers, "fingerprint": target_fingerprint(target),
            "score": PRUNE_SCORES, "scored_tokens": scored, "scored_sequences": len(sequences),
            "scores": {"heads": [s.tolist() for s in head_scores], "layers": influence.tolist()}}


def measure_pruned(target, draft, num_draft_tokens: int = 4, tokens: int = 48,
                   progress: Progress | None = None) -> dict:
    """The pruned copy ``draft`` measured as :func:`search_early_exit` measures an exit layer (greedy agreement
    with the target on the calibration prompts' continuations, step times, the predicted speedup at
    ``num_draft_tokens``), and the decoder weights it keeps."""
    evaluate = _Evaluator(target, num_draft_tokens, tokens, progress)
    _report(progress, "measuring the pruned copy")
    measured = evaluate(draft)
    parameters = {"target": variants.decoder_parameters(target), "pruned": variants.decoder_parameters(draft)}
    return {"parameters": {**parameters, "kept": parameters["pruned"] / parameters["target"]}, **measured,
            "num_draft_tokens": evaluate.k, "plain_step_s": evaluate.t_plain, "verify_step_s": evaluate.t_verify}


def prune_plan(target, sequences: list[list[int]], keep: float, keep_layers: float = 1.0,
               num_draft_tokens: int = 4, tokens: int = 48, progress: Progress | None = None) -> dict:
    """:func:`choose_plan`, then :func:`measure_pruned` of the copy it makes: the plan ``genspec calibrate
    prune`` saves (without healing), ``{"layers", "heads", "channels", "keep", "keep_layers", "fingerprint",
    "parameters", "alpha", "predicted_speedup", "num_draft_tokens", "plain_step_s", "verify_step_s",
    "draft_step_s", "score", "scores", ...}``."""
    if num_draft_tokens < 1:
        raise ConfigError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    plan = choose_plan(target, sequences, keep, keep_layers, progress)
    draft = variants.pruned(target, plan["layers"], plan["heads"], plan["channels"])
    return {**plan, **measure_pruned(target, draft, num_draft_tokens, tokens, progress)}


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
#: the block widths timed per batch size where a target's cost is smooth in the width (the cost model
#: interpolates between them)
GRID_WIDTHS = (1, 2, 3, 5, 9)
#: the batch sizes ``genspec serve`` times at start, up to its largest batch (:func:`served_batches`)
SERVED_BATCHES = (1, 2, 4, 8, 16)


def served_batches(largest: int) -> list[int]:
    """The batch sizes a server whose batch holds up to ``largest`` rows times at start: those of
    ``SERVED_BATCHES`` below it, and ``largest`` itself (``served_batches(12)``: 1, 2, 4, 8, 12)."""
    return sorted({*SERVED_BATCHES, largest} & set(range(1, largest + 1)))


#: where it is not (:attr:`CausalLM.uneven_verify_cost`): every width up to the engine's deepest draft + 1 at one
#: row, up to this many at more rows (wider blocks of several rows are rare, and learned as the engine runs)
UNEVEN_BATCH_WIDTHS = 9


def calibrate_engine(engine: SpeculativeEngine, batches: Iterable[int] = (1,), deepest: int | None = None,
                     progress: Progress | None = None) -> None:
    """Time ``engine``'s target on the block shapes its plans will price, into ``engine.costs``: the grid
    ``GRID_WIDTHS`` per batch size, or for a target whose cost is uneven in the width every width a draft
    can fill, ``deepest`` tokens + 1 (default: its drafters' deepest draft; two timings each, the first
    dropped: llama.cpp's widths 1 to 9 at one row take about a second). ``genspec serve`` calls it for every
    batch size it may run; :func:`genspec.load` and ``genspec bench`` at one row where the target is uneven
    (elsewhere the engine measures as it runs)."""
    if deepest is None:
        deepest = max((d.capabilities.default_draft_tokens for d in engine.drafters.values()), default=0)
    target = engine.target
    for batch in batches:
        if target.uneven_verify_cost:
            widths = range(1, (deepest if batch == 1 else min(deepest, UNEVEN_BATCH_WIDTHS - 1)) + 2)
            measure_verify_costs(target, engine.costs, batches=(batch,), widths=tuple(widths), repeats=1,
                                 progress=progress)
        else:
            measure_verify_costs(target, engine.costs, batches=(batch,), progress=progress)


def measure_verify_costs(target, costs, batches=(1, 2, 4, 8, 16), widths=GRID_WIDTHS, context: int = 256,
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
