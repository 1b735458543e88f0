"""The prompt suites shipped with genspec: Spec-Bench (Apache-2.0, see data/spec_bench/README.md) and
genspec's own ``edit`` task (grammar correction, data/edit_task/README.md)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from genspec.errors import ConfigError

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarization", "qa", "math_reasoning", "rag")
#: genspec's own suites, selectable by name but not part of the Spec-Bench default
EXTRA_CATEGORIES = ("edit",)
ALL_CATEGORIES = CATEGORIES + EXTRA_CATEGORIES


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str
    text: str


def load_spec_bench(categories: list[str] | None = None, per_category: int | None = None) -> list[BenchPrompt]:
    """First-turn prompts, in file order, optionally filtered by category and capped per category."""
    wanted = list(categories) if categories else list(CATEGORIES)
    unknown = [c for c in wanted if c not in ALL_CATEGORIES]
    if unknown:
        raise ConfigError(f"unknown categories {unknown}; choose from: {', '.join(ALL_CATEGORIES)}")
    if not wanted:
        raise ConfigError("no categories selected")
    if per_category is not None and per_category < 1:
        raise ConfigError(f"number of prompts per category must be >= 1, got {per_category}")
    data = resources.files("genspec") / "data"
    lines = (data / "spec_bench" / "question.jsonl").read_text(encoding="utf-8").splitlines()
    if "edit" in wanted:
        lines += (data / "edit_task" / "question.jsonl").read_text(encoding="utf-8").splitlines()
    taken: dict[str, int] = {}
    prompts = []
    for line in lines:
        row = json.loads(line)
        category = row["category"]
        if category not in wanted or (per_category is not None and taken.get(category, 0) >= per_category):
            continue
        taken[category] = taken.get(category, 0) + 1
        prompts.append(BenchPrompt(row["question_id"], category, row["turns"][0]))
    return prompts


def encode_prompt(text: str, tokenizer) -> list[int]:
    """Token ids the model sees: the tokenizer's chat template when it has one (Spec-Bench prompts are
    user turns), else a plain "Question/Answer" frame. Applied the same way for every method, so
    comparisons stay fair."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(f"Question: {text}\nAnswer:")["input_ids"]
