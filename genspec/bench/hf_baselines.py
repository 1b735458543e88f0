"""Hugging Face ``generate()`` baselines: plain greedy, prompt lookup, assisted (draft model), early exit.

Fairness: genspec's :class:`~genspec.models.hf.HFCausalLM` rewrites its model in place (every decoder
``nn.Linear`` becomes a :class:`~genspec.models.hf.TransposedLinear`, the LM head is re-laid out), so
the baselines run on a *second* copy of the weights loaded with plain ``AutoModelForCausalLM`` from the
same directory and never touched by genspec: stock transformers, as a user would run it.

What is measured per call: wall time around ``generate()`` (prefill included, as for genspec), the new
tokens, the time inside the model's (and the assistant's) forward passes (a forward pre/post hook on
the top module), and for assisted methods each verification step's (drafted, accepted) counts, so mean
accepted length and per-position acceptance are known. Those are observed, not patched in: a forward
pre-hook on the target's *last* decoder layer sees every target pass and no draft pass (an early-exit
draft stops before it; an assistant is another model), with its width and first position. A
verification pass feeds the last committed token and the candidates, so a pass of width w at
position s drafted w - 1 tokens and kept (next pass's s) - s - 1 of them (the first pass also holds
the prompt).
"""
from __future__ import annotations

import time

import torch

from genspec.bench.methods import MethodSpec
from genspec.drafters.cross_tokenizer import same_vocabulary
from genspec.errors import InputFileError
from genspec.sampling import SamplingConfig


def load_hf_model(path, dtype: str = "float32"):
    """A stock transformers model from a local directory (no network), in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InputFileError(f"cannot load model from {path}: {str(exc).splitlines()[0]}") from exc
    return model.eval()


def assistant_tokenizers(target_tokenizer, draft_path) -> dict:
    """``generate()``'s ``tokenizer`` and ``assistant_tokenizer`` when the draft model at ``draft_path`` has
    another tokenizer than the target's (transformers' universal assisted generation then translates its
    drafts), else nothing (also when it has no tokenizer: ``generate()`` then says what it lacks)."""
    from transformers import AutoTokenizer

    try:
        draft = AutoTokenizer.from_pretrained(draft_path, local_files_only=True)
    except (OSError, ValueError):
        return {}
    if target_tokenizer is None or same_vocabulary(draft, target_tokenizer):
        return {}
    return {"tokenizer": target_tokenizer, "assistant_tokenizer": draft}


class ForwardClock:
    """Accumulates the time spent inside a module's forward (hooks on the top module only)."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self._start = None

    def attach(self, module) -> "ForwardClock":
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)
        return self

    def _pre(self, module, args):
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.calls += 1
            self._start = None

    def reset(self) -> None:
        self.seconds, self.calls, self._start = 0.0, 0, None


class StepLog:
    """(drafted, accepted) per verification step of one HF assisted ``generate()`` call, from the
    (first position, width) of every target pass (see the module docstring)."""

    def __init__(self, model):
        self.passes: list[tuple[int, int]] = []
        model.get_decoder().layers[-1].register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = kwargs["cache_position"].unsqueeze(0)
        self.passes.append((int(positions.reshape(-1)[0]), int(hidden.shape[1])))

    def steps(self, prompt_length: int, total_length: int) -> list[list[int]]:
        """The steps of the call whose passes were logged (``total_length``: prompt + new tokens)."""
        steps, starts = [], []
        for number, (position, width) in enumerate(self.passes):
            first = position + (prompt_length - 1 if number == 0 else 0)  # the last committed token's position
            drafted = width - (prompt_length if number == 0 else 1)
            starts.append(first)
            steps.append([drafted, 0])
        ends = starts[1:] + [total_length - 1]
        for step, start, end in zip(steps, starts, ends):
            step[1] = end - start - 1
        return steps


class HFDecoder:
    """One HF baseline method on a stock transformers model (shared by the HF methods of a run)."""

    kind = "hf"

    def __init__(self, spec: MethodSpec, model, clock: ForwardClock, log: StepLog, eos_token_ids: list[int],
                 pad_token_id: int | None, assistant=None, num_layers: int | None = None,
                 tokenizers: dict | None = None):
        """``clock`` / ``log``: the model's forward clock and step log, shared by the methods that run
        it (one hook each per model). ``tokenizers``: for an assistant of another tokenizer, what
        :func:`assistant_tokenizers` gives."""
        self.spec = spec
        self.name = spec.name
        self.model = model
        self.assistant = assistant
        self.kwargs = {k: v for k, v in spec.options.items()}
        if spec.base == "hf-prompt-lookup":
            self.kwargs.setdefault("prompt_lookup_num_tokens", 10)
        elif spec.base == "hf-early-exit":
            self.kwargs.setdefault("assistant_early_exit", max(1, (num_layers or 4) // 4))
        elif spec.base == "hf-assisted":
            self.kwargs["assistant_model"] = assistant
            self.kwargs.update(tokenizers or {})
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (eos_token_ids or [0])[0]
        self.clock, self.log = clock, log
        self.assistant_clock = None
        if assistant is not None:
            self.assistant_clock = ForwardClock().attach(assistant)

    @property
    def settings(self) -> dict:
        """What this method passes to ``generate()`` (besides prompt, length and sampling)."""
        shown = {"assistant_model": "model", "tokenizer": "tokenizer", "assistant_tokenizer": "tokenizer"}
        return {k: (f"<{shown[k]} {getattr(v, 'name_or_path', '')}>" if k in shown else v)
                for k, v in self.kwargs.items()}

    def generate_kwargs(self, max_new_tokens: int, sampling: SamplingConfig) -> dict:
        """``generate()``'s arguments: the method's own, length, and the same sampling as genspec's methods
        (temperature, top-k 0 = off, top-p)."""
        kwargs = dict(self.kwargs, max_new_tokens=max_new_tokens, eos_token_id=self.eos_token_ids,
                      pad_token_id=self.pad_token_id)
        if not sampling.greedy:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        else:
            kwargs.update(do_sample=False)
        return kwargs

    def decode(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig, seed: int) -> dict:
        """Generate for one prompt; returns the raw figures of the call."""
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.model.device)
        kwargs = self.generate_kwargs(max_new_tokens, sampling)
        self.clock.reset()
        if self.assistant_clock is not None:
            self.assistant_clock.reset()
        self.log.passes = []
        torch.manual_seed(seed)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
            wall = time.perf_counter() - start
        new = out[0, input_ids.shape[1]:].tolist()
        forward = self.clock.seconds + (self.assistant_clock.seconds if self.assistant_clock else 0.0)
        steps = self.log.steps(len(ids), out.shape[1]) if self.spec.base != "hf-plain" else None
        return {"new_tokens": len(new), "wall_time_s": wall, "token_ids": new, "stats": _step_stats(steps),
                "steps": steps, "forward": {"model_s": forward, "calls": self.clock.calls}}


def _step_stats(steps: list | None) -> dict | None:
    """Counts from (drafted, accepted) steps, with the key names of genspec's RequestStats."""
    if not steps:
        return None
    drafted = sum(d for d, _ in steps)
    accepted = sum(a for _, a in steps)
    width = max(d for d, _ in steps)
    drafted_pos = [sum(1 for d, _ in steps if d > i) for i in range(width)]
    accepted_pos = [sum(1 for _, a in steps if a > i) for i in range(width)]
    return {"drafted_tokens": drafted, "accepted_tokens": accepted, "target_calls": len(steps),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / len(steps),
            "drafted_per_position": drafted_pos, "accepted_per_position": accepted_pos}
