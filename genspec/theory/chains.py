"""Pairs of Markov chains (draft and target): the paper's abstraction and genspec's JSON format.

Shapes (docs/theory.md, "Markov-chain pairs"): ``V`` symbols, horizon ``T`` generated tokens.

- ``initial``  ``[V]``        law of the prompt token x_0,
- ``draft``    ``[T, V, V]``  ``draft[n][i]``  = p(x_{n+1} = . | x_n = i)   (p = DRAFT, the speculator),
- ``target``   ``[T, V, V]``  ``target[n][i]`` = q(x_{n+1} = . | x_n = i)  (q = TARGET, the large model).

Everything is float64. Rows are non-negative and sum to 1 within ``ROW_SUM_TOLERANCE``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from genspec.checks import integer
from genspec.errors import ConfigError, InputFileError
from genspec.theory.budget import Cost, check

ROW_SUM_TOLERANCE = 1e-9
#: cost per probability of a chain pair (validation walks nested Python lists; JSON text), measured (the
#: manual's Theory toolkit page)
_CHAIN_SECONDS_PER_ENTRY = 3e-6
_CHAIN_BYTES_PER_ENTRY = 100


class _ChainFormatError(ValueError):
    """A problem with the chain data itself; the callers add where the data came from."""


@dataclass(frozen=True, eq=False)  # arrays: compare with numpy, not ==
class ChainPair:
    """A draft chain and a target chain over the same ``V`` symbols and horizon ``T``.

    Construct with :meth:`from_arrays` (validates) or load with :func:`load_chain`.
    """

    initial: np.ndarray  # [V]
    draft: np.ndarray  # [T, V, V]
    target: np.ndarray  # [T, V, V]

    @property
    def vocab_size(self) -> int:
        return int(self.initial.shape[0])

    @property
    def horizon(self) -> int:
        return int(self.draft.shape[0])

    @classmethod
    def from_arrays(cls, initial, draft, target) -> "ChainPair":
        """Validate (shapes, non-negativity, rows summing to 1) and freeze as float64 arrays.

        Raises :class:`genspec.errors.ConfigError` naming the first bad entry.
        """
        try:
            return _build(initial, draft, target)
        except _ChainFormatError as exc:
            raise ConfigError(f"invalid chain pair: {exc}") from None

    def target_marginals(self) -> np.ndarray:
        """``[T + 1, V]``: row n is the law of x_n under the target chain (row 0 = initial)."""
        marginals = np.empty((self.horizon + 1, self.vocab_size))
        marginals[0] = self.initial
        for n in range(self.horizon):
            marginals[n + 1] = marginals[n] @ self.target[n]
        return marginals

    def target_joint_first_two(self) -> np.ndarray:
        """``[V, V]``: the exact law of (x_1, x_2) under the target chain (needs T >= 2)."""
        if self.horizon < 2:
            raise ConfigError("the joint law of (x_1, x_2) needs a horizon of at least 2")
        law_x1 = self.initial @ self.target[0]
        return law_x1[:, None] * self.target[1]

    def to_json_dict(self) -> dict:
        return {"initial": self.initial.tolist(), "draft": self.draft.tolist(), "target": self.target.tolist()}


def chain_cost(vocab_size: int, horizon: int) -> Cost:
    """Making, validating and writing (JSON) a pair of ``V`` symbols and horizon ``T``: 2 T V^2 + V numbers."""
    entries = 2 * horizon * vocab_size ** 2 + vocab_size
    return Cost(entries * _CHAIN_BYTES_PER_ENTRY, entries * _CHAIN_SECONDS_PER_ENTRY)


def random_chain(vocab_size: int, horizon: int, seed: int) -> ChainPair:
    """A random pair exactly as docs/theory.md specifies: every row flat Dirichlet, drawn in the order
    initial, draft, target from ``numpy.random.default_rng(seed)``. Same seed, same pair.
    Refused (:class:`ConfigError`) above the theory toolkit's limits (:mod:`genspec.theory.budget`)."""
    if vocab_size < 1 or horizon < 1:
        raise ConfigError(f"need vocab >= 1 and horizon >= 1, got vocab={vocab_size}, horizon={horizon}")
    seed = integer("seed", seed, minimum=0)  # NumPy's generators take seeds >= 0
    check(chain_cost(vocab_size, horizon), f"a chain pair with V = {vocab_size}, T = {horizon} "
                                           f"({2 * horizon * vocab_size ** 2:.3g} transition probabilities)")
    rng = np.random.default_rng(seed)
    ones = np.ones(vocab_size)
    initial = rng.dirichlet(ones)
    draft = rng.dirichlet(ones, size=(horizon, vocab_size))
    target = rng.dirichlet(ones, size=(horizon, vocab_size))
    return ChainPair.from_arrays(initial, draft, target)


def load_chain(path) -> ChainPair:
    """Read and validate a chain-pair JSON file.

    Raises :class:`genspec.errors.InputFileError` with one line naming the file and the problem
    (missing file, bad JSON, wrong shape, negative entry, row not summing to 1, ...).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(f"chain file not found: {path}") from None
    except IsADirectoryError:
        raise InputFileError(f"chain file is a directory: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFileError(f"cannot read chain file {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise InputFileError(f"{path}: expected a JSON object with keys 'initial', 'draft', 'target'")
    missing = [key for key in ("initial", "draft", "target") if key not in data]
    if missing:
        raise InputFileError(f"{path}: missing key {missing[0]!r} (a chain file has 'initial', 'draft', 'target')")
    try:
        return _build(data["initial"], data["draft"], data["target"])
    except _ChainFormatError as exc:
        raise InputFileError(f"{path}: {exc}") from None


def save_chain(chain: ChainPair, path) -> None:
    """Write ``chain`` as JSON (floats round-trip exactly)."""
    try:
        Path(path).write_text(json.dumps(chain.to_json_dict()) + "\n", encoding="utf-8")
    except OSError as exc:
        raise InputFileError(f"cannot write chain file {path}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# validation: walk the nested lists ourselves so that errors name the exact bad entry


def _build(initial, draft, target) -> ChainPair:
    initial_arr = _as_array("initial", initial, depth=1)
    vocab = initial_arr.shape[0]
    if vocab < 1:
        raise _ChainFormatError("initial is empty (need at least one symbol)")
    draft_arr = _as_array("draft", draft, depth=3)
    target_arr = _as_array("target", target, depth=3)
    for name, arr in (("draft", draft_arr), ("target", target_arr)):
        if arr.shape[0] < 1:
            raise _ChainFormatError(f"{name} is empty (need a horizon T >= 1)")
        _check_square(name, arr, vocab)
    if draft_arr.shape[0] != target_arr.shape[0]:
        raise _ChainFormatError(f"draft has horizon {draft_arr.shape[0]} but target has {target_arr.shape[0]}")
    for name, arr in (("initial", initial_arr), ("draft", draft_arr), ("target", target_arr)):
        _check_distributions(name, arr)
    for arr in (initial_arr, draft_arr, target_arr):
        arr.setflags(write=False)
    return ChainPair(initial_arr, draft_arr, target_arr)


def _as_array(name: str, value, depth: int) -> np.ndarray:
    """Nested lists of numbers -> float64 array of ``depth`` dimensions, or a named error.

    Raggedness is reported with the first offending index, e.g. ``draft[2] has 6 rows, draft[0] has 7``.
    """
    if isinstance(value, np.ndarray):
        value = value.tolist()
    _check_nesting(name, value, depth)
    return np.asarray(value, dtype=np.float64)


def _check_nesting(name: str, value, depth: int) -> None:
    if depth == 0:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _ChainFormatError(f"{name} is {_describe(value)}, expected a number")
        if not math.isfinite(value):
            raise _ChainFormatError(f"{name} is {value}, expected a finite number")
        return
    if not isinstance(value, (list, tuple)):
        raise _ChainFormatError(f"{name} is {_describe(value)}, expected a list ({depth} levels of nesting)")
    lengths = None
    for index, item in enumerate(value):
        _check_nesting(f"{name}[{index}]", item, depth - 1)
        if depth > 1:
            if lengths is None:
                lengths = len(item)
            elif len(item) != lengths:
                raise _ChainFormatError(f"{name}[{index}] has {len(item)} entries, {name}[0] has {lengths}")
    if depth > 2 and value:
        # deeper raggedness: compare every sub-list's shape with the first one's
        first_shape = np.shape(value[0])
        for index, item in enumerate(value):
            if np.shape(item) != first_shape:
                raise _ChainFormatError(f"{name}[{index}] has shape {list(np.shape(item))}, "
                                        f"{name}[0] has {list(first_shape)}")


def _check_square(name: str, arr: np.ndarray, vocab: int) -> None:
    """Every ``arr[n]`` must be a V x V transition matrix, V = len(initial)."""
    _, rows, cols = arr.shape
    if rows != vocab:
        raise _ChainFormatError(f"{name}[0] has {rows} rows, expected {vocab} (V = len(initial))")
    if cols != vocab:
        raise _ChainFormatError(f"{name}[0][0] has {cols} entries, expected {vocab} (V = len(initial))")


def _check_distributions(name: str, arr: np.ndarray) -> None:
    """Every row (last axis) of ``arr`` must be non-negative and sum to 1; name the first bad one."""
    negative = np.argwhere(arr < 0)
    if negative.size:
        index = tuple(int(i) for i in negative[0])
        raise _ChainFormatError(f"{name}{_subscript(index)} = {arr[index]:.12g} is negative")
    sums = arr.sum(axis=-1)
    off = np.argwhere(np.abs(np.atleast_1d(sums) - 1.0) > ROW_SUM_TOLERANCE)
    if off.size:
        index = tuple(int(i) for i in off[0]) if arr.ndim > 1 else ()  # () names the whole vector
        raise _ChainFormatError(f"{name}{_subscript(index)} sums to {float(sums[index]):.12g}, not 1 "
                                f"(tolerance {ROW_SUM_TOLERANCE:g})")


def _subscript(index: tuple) -> str:
    return "".join(f"[{i}]" for i in index)


def _describe(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return f"the string {value[:20]!r}"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)
