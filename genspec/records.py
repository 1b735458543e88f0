"""What the engine reports: a request's statistics and result, and per step the record of each request
(:class:`RequestStep`) and of the whole batch (:class:`StepRecord`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from genspec.theory.pareto import StepStatistics

@dataclass
class RequestStats:
    """Per-request statistics. The key names of :meth:`as_dict` are a stable interface."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_calls: int = 0
    new_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    accepted_length_histogram: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    acceptance: dict | None = None  # GenerationConfig.acceptance of the request
    bias: StepStatistics | None = None  # sums over judged positions, with GenerationConfig.measure_bias
    bias_time_s: float = 0.0  # time spent measuring them (inside total_time_s)

    def record(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One target call that verified ``drafted`` draft tokens (``depth`` positions deep; a chain's
        depth is its length) and kept ``accepted``."""
        depth = drafted if depth is None else depth
        self.target_calls += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.accepted_length_histogram.extend([0] * (accepted + 1 - len(self.accepted_length_histogram)))
        self.accepted_length_histogram[accepted] += 1
        for counts, upto in ((self.drafted_per_position, depth), (self.accepted_per_position, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for i in range(upto):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target call: 1 + accepted / target calls (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_length_histogram": list(self.accepted_length_histogram),
            "target_calls": self.target_calls,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "total_time_s": self.total_time_s,
            "tokens_per_second": self.tokens_per_second,
            "new_tokens": self.new_tokens,
            "acceptance_per_position": [a / d if d else 0.0 for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position)],
            "acceptance": self.acceptance,
            "bias": None if self.bias is None else {**self.bias.means(), "measure_time_s": self.bias_time_s},
        }


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated ``token``, and the ``top`` most likely tokens at its
    position as (token id, log-probability), most likely first (as many as the request's ``logprobs``).
    They are the log-softmax of the target's own logits, before the request's sampling settings
    (logit bias, penalties, temperature, top-k, top-p: vLLM's default, "raw" log-probabilities), so
    they are the same whether the token was drafted and accepted or sampled by the target."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestResult:
    """One finished request: its new tokens, and their text (with a tokenizer) ending before the stop
    string that stopped it (:func:`visible_text`); with ``GenerationConfig.logprobs``, one
    :class:`TokenLogprob` per token."""

    token_ids: list[int]
    stats: RequestStats
    finish_reason: str  # "length", "eos", "stop", "cancelled" or "error"
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None


def visible_text(text: str, stop_strings: tuple[str, ...], finished: bool) -> str:
    """The part of a request's generated ``text`` its caller is shown: up to the first stop string, not
    including it (OpenAI's convention). While the request runs (not ``finished``), also without a
    trailing incomplete character (a multi-byte character whose rest is to come) or a trailing piece
    that may yet begin a stop string, so that text once shown is never taken back."""
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut]
    if not finished:
        text = text.rstrip("\ufffd")
        hold = max((k for s in stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        text = text[:len(text) - hold]
    return text


class IncrementalText:
    """The text of a growing list of generated tokens, decoded a few tokens at a time instead of whole at every
    step. A token's text depends on the tokens before it (a word piece's leading space, a byte of a multi-byte
    character), so it is never decoded alone: it is the decode of a short window of the tokens before it and
    itself, less the decode of that window without it. A token that ends inside a character adds nothing until
    the character is complete, and the window then moves past it.

    Example, a byte-level vocabulary where "é" is the two tokens 0xC3 0xA9: after "caf" and 0xC3 the text is
    "caf" (the window [0xC3] decodes to U+FFFD, held back); 0xA9 completes it, the piece is "é" and the text
    "café"."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.tokens: list[int] = []
        #: the text of the tokens up to ``_read``: every complete character so far
        self.text = ""
        self._start = 0  # the window's first token: the one after the text before the last piece
        self._read = 0  # the tokens the text holds
        self._window: str | None = ""  # the decode of tokens[_start:_read] (None: not decoded yet)

    def extend(self, tokens: list[int]) -> list[str]:
        """Add ``tokens``; the text each added to :attr:`text` (empty while a character is incomplete)."""
        pieces = []
        for token in tokens:
            self.tokens.append(token)
            if self._window is None:
                self._window = self._decode(self.tokens[self._start:self._read])
            longer = self._decode(self.tokens[self._start:])
            piece = ""
            if len(longer) > len(self._window) and not longer.endswith("\ufffd"):
                piece = longer[len(self._window):]
                self.text += piece
                self._start, self._read, self._window = self._read, len(self.tokens), None
            pieces.append(piece)
        return pieces

    def final(self) -> str:
        """The whole text once no token is to come: :attr:`text` and whatever the tokens it holds back decode to
        (a character cut short shows as U+FFFD, as a decode of every token shows it)."""
        if self._read == len(self.tokens):
            return self.text
        window = self._window if self._window is not None else self._decode(self.tokens[self._start:self._read])
        return self.text + self._decode(self.tokens[self._start:])[len(window):]


@dataclass
class RequestStep:
    """What one step did for one request. ``new_tokens[:accepted]`` are accepted draft tokens, the
    token after them (if kept) the target's own; ``accepted_per_position`` says, per draft depth,
    whether that position was accepted. ``finish_reason`` is None while the request runs ("length",
    "eos", "stop", "cancelled", or "error" with ``error`` saying what failed). ``stats`` are the
    request's running totals (final once it finished). ``logprobs``: one :class:`TokenLogprob` per new
    token when the request asked for them (``GenerationConfig.logprobs``), else None."""

    new_tokens: list[int]
    drafted: int
    accepted: int
    accepted_per_position: list[bool]
    finish_reason: str | None
    stats: RequestStats
    evidence: object = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class StepRecord:
    """One :meth:`SpeculativeEngine.step`: per request its :class:`RequestStep`, and the step's times.

    ``prefill_time_s``: joining requests' prefills; ``draft_time_s``: the drafters' ``propose`` calls;
    ``target_time_s``: the target's pass over the verify block (``block_width`` tokens per row,
    ``batch_size`` rows); ``verify_time_s``: that pass plus the acceptance rule; ``outside_model_time_s``:
    the step's time outside model forward passes (engine bookkeeping, model-free drafting);
    ``total_time_s``: the whole step.
    """

    requests: dict[int, RequestStep] = field(default_factory=dict)
    batch_size: int = 0
    block_width: int = 0
    joined: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    draft_model_time_s: float = 0.0
    target_time_s: float = 0.0
    verify_time_s: float = 0.0
    outside_model_time_s: float = 0.0
    total_time_s: float = 0.0
