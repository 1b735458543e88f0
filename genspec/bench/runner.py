"""Fair timing of decoding methods: same target, same prompts, same settings, one process.

Each prompt is decoded by every method back to back (plain decoding first), so slow drifts of the
machine hit all methods alike; a warm-up generation per method is excluded from the figures.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import replace

from genspec.bench.methods import REFERENCES
from genspec.bench.prompts import BenchPrompt, encode_prompt
from genspec.calibration import calibrate_engine
from genspec.engine import GenerationConfig, SpeculativeEngine
from genspec.models.base import CausalLM


class GenspecDecoder:
    """One genspec method: an engine over the shared target. Its figures come from the
    :class:`~genspec.engine.StepRecord` of each step (times inside the target's passes per block width,
    prefill, drafting, and each step's drafted / accepted counts); nothing is patched."""

    kind = "genspec"

    def __init__(self, spec, target: CausalLM, drafter, tokenizer, deepest: int | None = None):
        self.spec = spec
        self.name = spec.name
        self.engine = SpeculativeEngine(target, drafter, tokenizer)
        if target.uneven_verify_cost:  # as genspec.load does: the widths this method's drafts can fill, timed
            calibrate_engine(self.engine, deepest=spec.config_overrides.get("num_draft_tokens", deepest))

    @property
    def settings(self) -> dict:
        return {"drafter": self.spec.base, "options": self.spec.to_dict()["options"],
                "config_overrides": dict(self.spec.config_overrides)}

    def decode(self, ids: list[int], config: GenerationConfig) -> dict:
        config = replace(config, **self.spec.config_overrides)
        tokens, steps, by_width = [], [], {}
        prefill = target = draft_model = 0.0
        final = None
        start = time.perf_counter()
        request_id = self.engine.add_request(ids, config)
        try:
            while final is None:
                record = self.engine.step()
                step = record.requests.get(request_id)
                prefill += record.prefill_time_s
                draft_model += record.draft_model_time_s
                if step is None:
                    continue
                target += record.target_time_s
                calls, seconds = by_width.get(record.block_width, (0, 0.0))
                by_width[record.block_width] = (calls + 1, seconds + record.target_time_s)
                steps.append([step.drafted, step.accepted])
                tokens += step.new_tokens
                final = step if step.finish_reason is not None else None
        finally:
            if final is None:  # an error mid-request: free its rows, so the shared target stays usable
                self.engine.cancel(request_id)
        wall = time.perf_counter() - start
        stats = final.stats
        raw = stats.as_dict()
        raw["accepted_per_position"] = list(stats.accepted_per_position)
        raw["drafted_per_position"] = list(stats.drafted_per_position)
        forward = {"target_s": target + prefill, "prefill_s": prefill,
                   "verify_by_width": {str(w): [c, s] for w, (c, s) in sorted(by_width.items())},
                   "draft_model_s": draft_model}
        forward["model_s"] = forward["target_s"] + forward["draft_model_s"]
        return {"new_tokens": len(tokens), "wall_time_s": wall, "token_ids": tokens, "stats": raw,
                "steps": steps, "forward": forward}


def encode_all(prompts: list[BenchPrompt], tokenizer) -> list[list[int]]:
    return [encode_prompt(p.text, tokenizer) for p in prompts]


def run_interleaved(decoders: list, prompts: list[BenchPrompt], prompt_ids: list[list[int]],
                    config: GenerationConfig, repeats: int,
                    on_progress: Callable[[str, dict | None], None] | None = None,
                    rotation: int = 0) -> list[dict]:
    """Decode every prompt with every decoder, ``repeats`` times; returns one record per call.

    Fairness: the decoders of one prompt run back to back (slow drifts of a noisy machine hit all of
    them alike) in an order rotated from prompt to prompt and repeat to repeat (no method is always
    first after a context switch); garbage collection is paused during each timed call; the
    same seed is used for every call. A decoder that raises is recorded with its error and the run
    goes on. ``matches_plain`` compares greedy outputs with the first decoder's (genspec plain);
    ``matches_reference`` the outside engines' methods with that engine's plain decoding (``hf-plain``,
    ``llamacpp-plain``: the same numerics)."""
    records = []
    seed = config.seed if config.seed is not None else 0
    for repeat in range(repeats):
        for index, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
            shift = (index + repeat + rotation) % len(decoders)
            order = decoders[shift:] + decoders[:shift]
            outputs = {}
            for decoder in order:
                if on_progress:
                    on_progress(f"repeat {repeat + 1}/{repeats} · {prompt.category} #{prompt.question_id} · "
                                f"{decoder.name}", None)
                record = {"phase": "main", "repeat": repeat, "method": decoder.name, "kind": decoder.kind,
                          "category": prompt.category, "question_id": prompt.question_id,
                          "prompt_tokens": len(ids), "error": None}
                gc.disable()  # no collection pause inside a timed call (it runs between calls instead)
                try:
                    if decoder.kind != "genspec":  # an outside engine's baseline
                        out = decoder.decode(ids, config.max_new_tokens, config.sampling, seed)
                    else:
                        out = decoder.decode(ids, replace(config, seed=seed))
                except Exception as exc:  # noqa: BLE001 - one failing baseline must not end the run
                    out = {"new_tokens": 0, "wall_time_s": 0.0, "token_ids": [], "stats": None, "steps": None,
                           "forward": None}
                    record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                finally:
                    gc.enable()
                record.update(out)
                record["tokens_per_second"] = (out["new_tokens"] / out["wall_time_s"]
                                               if out["wall_time_s"] > 0 else 0.0)
                outputs[decoder.name] = record
                if on_progress:
                    on_progress("", record)
            greedy = config.temperature == 0
            plain = outputs.get(decoders[0].name)
            references = {d.kind: outputs[d.name] for d in decoders if d.name in REFERENCES.values()}
            for decoder in decoders:  # records in the methods' order, whatever order they ran in
                record = outputs[decoder.name]
                ok = record["error"] is None
                record["matches_plain"] = (record["token_ids"] == plain["token_ids"]
                                           if greedy and ok and plain and plain["error"] is None
                                           and decoder is not decoders[0] else None)
                reference = references.get(decoder.kind)
                record["matches_reference"] = (record["token_ids"] == reference["token_ids"]
                                               if greedy and ok and decoder.kind != "genspec" and reference
                                               and reference["error"] is None and reference is not record
                                               else None)
                records.append(record)
    return records


def warm_up(decoders: list, ids: list[int], config: GenerationConfig) -> None:
    """One short untimed generation per decoder (first-call allocations, lazy initialisation)."""
    for decoder in decoders:
        try:
            if decoder.kind != "genspec":
                decoder.decode(ids, 4, config.sampling, 0)
            else:
                decoder.decode(ids, replace(config, max_new_tokens=4, seed=0))
        except Exception:  # noqa: BLE001 - the timed run records the error
            pass
