"""What a ``results.json`` must hold for ``genspec bench --report-from`` to rebuild its report: the
fields :mod:`genspec.bench.analysis`, :mod:`~genspec.bench.report` and :mod:`~genspec.bench.plots` read,
as pydantic models (other fields are kept and ignored). :func:`check_results` turns the first problem into
one line naming the file and the field, e.g. ``results.json: runs[3].category: field required``."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from genspec.errors import InputFileError


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow")


class Method(_Record):
    name: str
    kind: str


class Stats(_Record):
    drafted_tokens: int
    accepted_tokens: int
    target_calls: int
    draft_time_s: float | None = None  # genspec runs only (see Run)
    verify_time_s: float | None = None
    drafted_per_position: list[int] = []
    accepted_per_position: list[int] = []


class Forward(_Record):
    model_s: float
    prefill_s: float = 0.0
    verify_by_width: dict[str, tuple[int, float]] | None = None


class Run(_Record):
    phase: str = "main"
    repeat: int
    method: str
    kind: str
    category: str
    question_id: int | str
    new_tokens: int
    wall_time_s: float
    error: str | None = None
    stats: Stats | None = None
    steps: list[tuple[int, int]] | None = None
    step_counts: list[tuple[int, int, int]] | None = None
    forward: Forward | None = None
    matches_plain: bool | None = None
    matches_reference: bool | None = None
    matches_hf_plain: bool | None = None  # the name of matches_reference in results written before it
    k: int | None = None

    @model_validator(mode="after")
    def _genspec_times(self):
        """genspec's own runs split their time into drafting and verifying (the report's time shares)."""
        if self.kind == "genspec" and self.stats is not None:
            for field in ("draft_time_s", "verify_time_s"):
                if getattr(self.stats, field) is None:
                    raise ValueError(f"stats.{field} is required for a genspec run")
        return self


class Results(_Record):
    methods: list[Method]
    runs: list[Run]
    settings: dict = {}
    machine: dict = {}
    model: dict = {}

    @field_validator("runs")
    @classmethod
    def _something_to_report(cls, runs: list[Run]) -> list[Run]:
        """A report needs a completed call of the main phase (without one every figure would be "–")."""
        if not any(run.phase == "main" and run.error is None for run in runs):
            raise ValueError(f"no completed call to report ({len(runs)} runs, none of the main phase without an error)")
        return runs


def check_results(data, source: str | Path) -> None:
    """Raise :class:`InputFileError` (one line: the file, the first bad field and why) unless ``data``
    (parsed JSON) is a results dictionary the report can be rebuilt from."""
    if not isinstance(data, dict) or not ({"runs", "methods"} & set(data)):
        raise InputFileError(f"{source}: not a genspec bench results.json (no \"runs\" and \"methods\")")
    try:
        Results.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
        message = error["msg"][0].lower() + error["msg"][1:]
        if message.startswith("value error, "):
            message = message[len("value error, "):]
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        raise InputFileError(f"{source}: not a complete genspec bench results.json: {where or 'top level'}: "
                             f"{message}{more}") from None
