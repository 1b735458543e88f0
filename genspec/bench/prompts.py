"""The prompt suites shipped with genspec: Spec-Bench (Apache-2.0, see data/spec_bench/README.md),
genspec's own ``edit`` task (grammar correction, data/edit_task/README.md) and the ``repeated`` traffic
replay.

``repeated`` replays what a chat service sees again and again, from Spec-Bench's MT-bench conversations
that the measured categories do not use (the 3rd to 5th of each MT-bench category, round robin over
categories; ``genspec bench`` measures a category's first ``--num-prompts``, 2 by default, and the trained
speculators learn from the 6th on): for each conversation its first turn, then its second turn with the
first turn and the model's answer in context (multi-turn chat: the same document again), and after all
conversations, each first turn asked again (another user with the same question: the same answer
again). The requests run in that order within one repeat, so drafters that learn across requests (the
n-gram cache's process table, the suffix drafter's process cache) see the earlier ones, as in a server.
The first turns are the traffic's *history*: every method decodes them, in their place in the replay,
but they are first-seen text like any Spec-Bench prompt, so the category's figures count the repeated
requests only (second turns and repeated questions); the history's runs are kept in the results with
phase ``history``. Question ids: ``10 * MT-bench id + 1`` (first turn), ``+ 2`` (second turn), ``+ 3``
(first turn again).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from genspec.errors import ConfigError

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarization", "qa", "math_reasoning", "rag")
#: genspec's own suites, selectable by name but not part of the Spec-Bench default
EXTRA_CATEGORIES = ("edit", "repeated")
#: MT-bench conversations the ``repeated`` category replays: each MT-bench category's 3rd to 5th
REPEATED_POSITIONS = (2, 3, 4)
ALL_CATEGORIES = CATEGORIES + EXTRA_CATEGORIES


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str
    text: str
    #: the question id of an earlier prompt of the same list whose prompt and answer open this one
    follows: int | None = None
    #: decoded by every method in its place (drafters that learn across requests see it) but not counted
    #: in the figures: the history of a replayed traffic
    history: bool = False


def round_robin(prompts: list[BenchPrompt]) -> list[str]:
    """The prompts' texts taken a category at a time in turn (each category's first, then each one's second, ...),
    so that any slice of them mixes the categories: what load tests send as their held-out traffic."""
    by_category: dict[str, list[str]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt.text)
    columns = list(by_category.values())
    return [column[i] for i in range(max(map(len, columns), default=0)) for column in columns if i < len(column)]


def load_spec_bench(categories: list[str] | None = None, per_category: int | None = None,
                    skip: int = 0) -> list[BenchPrompt]:
    """First-turn prompts, in file order, optionally filtered by category and capped per category.
    ``skip``: leave out each category's first ``skip`` prompts (and the replay's first ``skip``
    conversations): tuning runs take prompts that the default benchmark, which measures the first ones,
    does not."""
    wanted = list(categories) if categories else list(CATEGORIES)
    unknown = [c for c in wanted if c not in ALL_CATEGORIES]
    if unknown:
        raise ConfigError(f"unknown categories {unknown}; choose from: {', '.join(ALL_CATEGORIES)}")
    if not wanted:
        raise ConfigError("no categories selected")
    if per_category is not None and per_category < 1:
        raise ConfigError(f"number of prompts per category must be >= 1, got {per_category}")
    if skip < 0:
        raise ConfigError(f"prompts to skip per category must be >= 0, got {skip}")
    data = resources.files("genspec") / "data"
    lines = (data / "spec_bench" / "question.jsonl").read_text(encoding="utf-8").splitlines()
    if "edit" in wanted:
        lines += (data / "edit_task" / "question.jsonl").read_text(encoding="utf-8").splitlines()
    seen: dict[str, int] = {}
    prompts = []
    for line in lines:
        row = json.loads(line)
        category = row["category"]
        if category not in wanted:
            continue
        seen[category] = seen.get(category, 0) + 1
        if seen[category] <= skip or (per_category is not None and seen[category] > skip + per_category):
            continue
        prompts.append(BenchPrompt(row["question_id"], category, row["turns"][0]))
    if "repeated" in wanted:
        prompts += repeated_traffic([json.loads(line) for line in lines], per_category, skip)
    return prompts


def repeated_traffic(rows: list[dict], conversations: int | None, skip: int = 0) -> list[BenchPrompt]:
    """The ``repeated`` replay (module docstring) of ``conversations`` conversations after the first ``skip``."""
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        if len(row.get("turns", ())) >= 2:
            by_category.setdefault(row["category"], []).append(row)
    chosen = [rows_[i] for i in REPEATED_POSITIONS for rows_ in by_category.values() if i < len(rows_)]
    chosen = chosen[skip:skip + conversations] if conversations is not None else chosen[skip:]
    replay = []
    for row in chosen:
        first = 10 * row["question_id"] + 1
        replay.append(BenchPrompt(first, "repeated", row["turns"][0], history=True))
        replay.append(BenchPrompt(first + 1, "repeated", row["turns"][1], follows=first))
    replay += [BenchPrompt(10 * row["question_id"] + 3, "repeated", row["turns"][0]) for row in chosen]
    return replay


def encode_prompt(text: str, tokenizer) -> list[int]:
    """Token ids the model sees: the tokenizer's chat template when it has one (Spec-Bench prompts are
    user turns), else a plain "Question/Answer" frame. Applied the same way for every method, so
    comparisons stay fair."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(f"Question: {text}\nAnswer:")["input_ids"]


def encode_follow_up(earlier: BenchPrompt, earlier_ids: list[int], answer: list[int], text: str, tokenizer) -> list[int]:
    """Token ids of a next turn ``text`` after ``earlier`` (its ids ``earlier_ids``) and the model's
    ``answer`` (token ids): the chat template over the three messages when the tokenizer has one, else the
    earlier ids, the answer and another "Question/Answer" frame, so the context is exactly what the model
    saw and said."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": earlier.text},
                    {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                    {"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(earlier_ids) + list(answer) + tokenizer(f"\n\nQuestion: {text}\nAnswer:",
                                                        add_special_tokens=False)["input_ids"]
