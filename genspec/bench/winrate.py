"""WinRate: how often one decoding's responses score higher than another's on the same prompts and seeds
(Yin et al.'s Table 1 compares Decoding-OPT with Decoding-UNO this way), with a pluggable scorer.

A scorer is any callable taking a :class:`Response` and returning a float (higher is better):

- :class:`TargetLogLikelihood` (the default, ``"loglik"``): the target's mean log-likelihood of the
  response tokens under its *untempered* law (raw logits: no temperature, top-k or top-p), given the
  prompt. It needs no other model; it rewards what the target itself finds likely.
- :class:`RewardModel` (a local directory): a Hugging Face sequence-classification model with one output
  (a reward model such as the paper's RM-Mistral-7B), scoring the prompt and response as a chat turn
  when its tokenizer has a chat template, else as plain text.
- ``"module:function"``: a callable imported by name; or, from Python, any callable.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from genspec.errors import ConfigError, InputFileError
from genspec.models.base import CausalLM
from genspec.theory.stats import wilson_interval

DEFAULT_SCORER = "loglik"


@dataclass(frozen=True)
class Response:
    """A generated response with its prompt: text and token ids (``response_ids`` are the new tokens)."""

    prompt_text: str
    prompt_ids: list[int]
    text: str
    token_ids: list[int]


Scorer = Callable[[Response], float]


class TargetLogLikelihood:
    """Mean log q(token | prompt, earlier tokens) over the response, q the target's raw softmax.

    Runs the target through its :class:`~genspec.models.base.CausalLM` interface on a row of its own,
    so it must not be called while an engine on the same target has requests running."""

    name = "target mean log-likelihood (untempered)"

    def __init__(self, target: CausalLM):
        self.target = target

    @torch.inference_mode()
    def __call__(self, response: Response) -> float:
        if not response.token_ids:
            raise ConfigError("cannot score an empty response")
        if self.target.num_rows:
            raise ConfigError("the log-likelihood scorer needs the target idle (no requests running on it)")
        prompt, tokens = list(response.prompt_ids), list(response.token_ids)
        self.target.add_rows([prompt[:-1]])
        try:
            block = torch.tensor([[prompt[-1]] + tokens[:-1]], dtype=torch.long, device=self.target.device)
            logits = self.target.forward(block)[0].double()  # [n, V]: the law of each response token
        finally:
            self.target.remove_rows([0])
        log_probs = logits.log_softmax(-1).gather(-1, torch.tensor(tokens, device=logits.device).unsqueeze(-1))
        return float(log_probs.mean())


class RewardModel:
    """A local reward model: ``AutoModelForSequenceClassification`` with one label, from a directory."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise InputFileError(f"reward model directory not found: {path}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).to(device).eval()
        except (OSError, ValueError) as exc:
            raise InputFileError(f"{path}: not a loadable sequence-classification model ({exc})") from None
        if self.model.config.num_labels != 1:
            raise InputFileError(f"{path}: a reward model has one output, this one has {self.model.config.num_labels}")
        self.name = f"reward model {path.name}"
        self.device = device

    @torch.inference_mode()
    def __call__(self, response: Response) -> float:
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": response.prompt_text},
                                                      {"role": "assistant", "content": response.text}],
                                                     tokenize=True, return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = self.tokenizer(response.prompt_text + response.text, return_tensors="pt")["input_ids"]
        return float(self.model(input_ids=ids.to(self.device)).logits[0, 0])


def load_scorer(spec: str | Scorer, target: CausalLM) -> tuple[Scorer, str]:
    """(scorer, its name) from ``"loglik"``, a reward-model directory, ``"module:function"`` or a callable."""
    if callable(spec):
        return spec, getattr(spec, "name", getattr(spec, "__name__", type(spec).__name__))
    if spec == DEFAULT_SCORER:
        scorer = TargetLogLikelihood(target)
        return scorer, scorer.name
    if Path(spec).is_dir():
        scorer = RewardModel(spec, str(target.device))
        return scorer, scorer.name
    module, sep, function = spec.partition(":")
    if not sep or not module or not function:
        raise ConfigError(f"--scorer must be 'loglik', a reward-model directory or MODULE:FUNCTION, got {spec!r}")
    try:
        scorer = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import scorer {spec!r}: {exc}") from None
    if not callable(scorer):
        raise ConfigError(f"scorer {spec!r} is not callable")
    return scorer, spec


@dataclass
class WinRate:
    """``first``'s WinRate over ``second`` on paired responses: wins + ties / 2 over comparisons, with
    the Wilson score 95% interval (ties counted half). A pair of identical responses is a tie."""

    comparisons: int
    wins: int
    ties: int
    losses: int
    rate: float | None
    ci95: tuple[float, float]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["ci95"] = list(self.ci95)
        return out


def win_rate(first_scores: list[float], second_scores: list[float], identical: list[bool] | None = None) -> WinRate:
    """WinRate of the first responses over the second, pair by pair (``identical[i]``: pair i is the same
    text, a tie whatever the scores)."""
    if len(first_scores) != len(second_scores):
        raise ConfigError("WinRate needs the same number of scores on both sides")
    identical = identical or [False] * len(first_scores)
    wins = ties = losses = 0
    for a, b, same in zip(first_scores, second_scores, identical):
        if same or a == b:
            ties += 1
        elif a > b:
            wins += 1
        else:
            losses += 1
    n = len(first_scores)
    successes = wins + ties / 2
    return WinRate(n, wins, ties, losses, successes / n if n else None, wilson_interval(successes, n))
