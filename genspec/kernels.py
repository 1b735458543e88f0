"""The LM head as genspec computes it: exact logits ``hidden @ W.T`` with the fastest CPU kernel for the
number of rows.

Why: with a 262k vocabulary the head weight (262,144 x 640 fp32, 671 MB) does not fit any cache, so a
decode step streams it from memory and its cost decides every speedup on a CPU. BLAS kernels differ a
lot with the number of rows (``F.linear``, what transformers runs, is among the slowest from 2 rows on), and
their ranking differs between machines: on some CPUs ``W @ x.T`` for a few rows costs over twice the one-row
``bmm``, and there a 2-token verify block cost more than 3- to 9-token ones, which made drafting look dear.
The manual's Backends page (the torch backend's kernels) has the measurements.

The kernels, all exact fp32 products of the same numbers (only the summation order inside the BLAS differs:
last-bit differences, as between any two batch sizes):

- the chunked ``bmm`` over a transposed copy: fast for one or two rows (plain decoding, the draft models'
  steps, a one-token draft's verify block);
- ``W @ x.T`` on the original weight (shared with the model, no copy), one row computed as two (MKL's GEMV
  is slower than its two-column GEMM): 3-12 rows (verifying a longer draft) and ``LARGE_GEMM_ROWS`` on;
- oneDNN's GEMM over a copy of the weight packed once for it (:class:`PackedWeight`), where the weight can
  take it (a float32 CPU tensor, or a bfloat16 one where the CPU computes bfloat16 natively: :func:`packable`):
  from 3 rows on it beats the others by far, so there it replaces the ``bmm`` as the head's second kernel,
  and its copy replaces the chunked one (no more memory).

Since the ranking differs between machines, a large head on the CPU picks its kernel per row count by
timing: the first calls with a new row count alternate the two kernels (the logits they compute are the
ones returned, so nothing is computed twice), and after ``TUNE_TRIALS`` calls of each the faster one
(by its quickest call: noise only adds time) is kept for that row count, and timed again after 64 more
calls of it, then 128, 256, ... (at most every 8,192): a pick spoilt by a noisy start, or by a shared VM
whose speed shifts, does not last the life of a server (:meth:`KernelTuner._count_call`). A fixed choice
costs a verify step a good share of its time at some row counts. Small heads (tests' random models) and
heads on other devices keep the fixed choice (:meth:`LMHead.default_kernel`), deterministically. The
decoder's linear layers choose their kernel the same way (:class:`genspec.models.hf.TransposedLinear`), timed
over a whole decoder pass.

The argmax over a vocabulary (greedy decoding's every step) is :func:`most_likely`: NumPy's on a CPU.
"""
from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

#: columns per chunk of the transposed weight (1,024 x 640 fp32 = 2.6 MB: fits the L2/L3 slice)
CHUNK = 1024
#: row counts for which ``W @ x.T`` is the faster kernel (not 2 rows: see the module's docstring)
SMALL_GEMM_ROWS = range(3, 13)
#: from this many rows on, one GEMM again (a training batch through a draft head's truncated head, where
#: ``W @ x.T`` beats the ``bmm`` and ``F.linear``: the manual's Backends page)
LARGE_GEMM_ROWS = 64
#: the number of rows oneDNN lays a packed weight out for; it serves every row count (``PackedWeight``)
PACK_ROWS_HINT = 8
#: heads with at least this many weights (vocabulary x hidden) time their kernels (the embedded model's:
#: 262,144 x 640 = 168 M); below it a head call costs too little for the choice to matter
TUNE_MIN_ELEMENTS = 1 << 24
#: timed calls of each kernel before a row count's kernel is chosen
TUNE_TRIALS = 2
#: a chosen row count is timed again after this many of its calls, then after twice as many each time, up
#: to every ``RETUNE_MAX`` calls (see :meth:`KernelTuner._count_call`)
RETUNE_FIRST, RETUNE_MAX = 64, 8192
#: exact kernels multiply this many rows at a time (:func:`in_fixed_blocks`)
EXACT_ROWS = 16


def cpu_array(tensor: torch.Tensor) -> np.ndarray | None:
    """A NumPy view of ``tensor`` where NumPy can take it (a non-empty float32, float64 or bool CPU tensor without
    autograd), else None: NumPy's reductions over a 262,144-token vocabulary are quicker than torch's on a CPU
    (:func:`most_likely`)."""
    if (tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64, torch.bool)
            and not tensor.requires_grad and tensor.numel()):
        return tensor.numpy()
    return None


def most_likely(scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The argmax over the last axis, ``[..., V] -> [...]`` (int64): the first index of the largest value, a NaN
    counting as the largest, as ``torch.argmax`` (of a bool tensor: the first True). A CPU tensor goes through
    NumPy, whose argmax over a large vocabulary is over ten times quicker than torch's CPU argmax (the manual's
    Backends page, where a plain step goes).
    ``valid`` ``[B, N]`` (scores ``[B, N, V]``): positions not marked are not read, and their argmax is 0."""
    array = cpu_array(scores)
    if valid is not None and scores.dim() == 3 and not bool(valid.all()):
        lengths = prefix_lengths(valid, scores.shape) if array is not None else None
        if lengths is not None:
            return torch.from_numpy(reduce_valid(array, lengths, np.argmax))
        return most_likely(scores).masked_fill(~valid.to(scores.device).bool(), 0)
    if array is not None:
        return torch.from_numpy(np.asarray(array.argmax(-1), dtype=np.int64))
    return (scores.to(torch.uint8) if scores.dtype == torch.bool else scores).argmax(-1)


def prefix_lengths(valid: torch.Tensor | None, shape: torch.Size) -> list[int] | None:
    """Each row's count of valid positions where ``valid`` ``[B, N]`` marks a prefix of every row, shorter than
    ``N`` in some row (a block of rows of different widths), else None: the caller then reduces over every
    position of ``scores`` ``[B, N, V]`` (``shape``), padding included."""
    if valid is None or valid.dim() != 2 or tuple(valid.shape) != tuple(shape[:2]) or bool(valid.all()):
        return None
    counts = valid.sum(1)
    if not bool((valid == (torch.arange(valid.shape[1]) < counts[:, None])).all()):
        return None
    return counts.tolist()


def reduce_valid(array: np.ndarray, lengths: list[int], reduce) -> np.ndarray:
    """``reduce`` (``np.argmax``, ``np.max``) over the last axis of ``array`` ``[B, N, V]`` at each row's first
    ``lengths[b]`` positions only, ``[B, N]`` (0 elsewhere): the padding of a ragged block is not read (a block of
    16 rows, 4 of them 9 tokens wide, is 144 positions of 262,144 logits of which 36 are real)."""
    out = np.zeros(array.shape[:2], dtype=np.int64 if reduce is np.argmax else array.dtype)
    for row, count in enumerate(lengths):
        if count:
            out[row, :count] = reduce(array[row, :count], axis=-1)
    return out


def weight_times_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(weight @ rows.T).T`` ``[R, V]`` for ``rows`` ``[R, H]``: one GEMM with the rows as its small N.
    One row goes as two (a copy: a stride-0 view takes a slow path), because MKL's GEMV is the slower
    kernel (module docstring; models/hf.py's TransposedLinear has the decoder's timings). A transposed view."""
    count = rows.shape[0]
    columns = rows.repeat(2, 1) if count == 1 else rows
    return (weight @ columns.T).T[:count]


def in_fixed_blocks(rows: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor],
                    block: int = EXACT_ROWS) -> torch.Tensor:
    """``product(rows)`` for ``rows`` ``[R, in]``, computed ``block`` rows at a time (the last block padded with
    zero rows): every row goes through the same kernel call on operands of the same shape, wherever it stands and
    whatever the other rows hold, so its result does not depend on how many rows share the product. A BLAS GEMM
    picks its blocking, and with it the order in which it sums a row's products, by the number of rows: one row
    alone and the same row among 15 others differ in the last bits; as rows of two 16-row products they do not."""
    count = rows.shape[0]
    padded = torch.nn.functional.pad(rows, (0, 0, 0, -count % block if count else block))
    if padded.shape[0] == block:  # one block: no copy into a joined result (an output layer's is 16 MB)
        return product(padded)[:count]
    return torch.cat([product(part) for part in padded.split(block)])[:count]


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can take oneDNN's prepacked GEMM: a float32 CPU tensor, with a torch built with
    oneDNN (every CPU wheel), or a bfloat16 one where oneDNN computes bfloat16 natively (AVX512-BF16 or AMX:
    :func:`bf16_packable`). Other dtypes (the tests' float64) and devices keep the BLAS kernels."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_packable())


@functools.cache
def bf16_packable() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 GEMM in hardware (AVX512-BF16 or AMX). There the packed
    bfloat16 head costs about half the packed float32 one, nearly flat over 1 to 9 rows (the manual's Backends
    page, the torch backend in bfloat16); without it oneDNN emulates bfloat16 and MKL's kernels stay."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeight:
    """A weight ``[out, in]`` laid out once for oneDNN's GEMM, which computes ``rows @ weight.T`` for the
    3-16 rows of a verify block far faster than MKL does from the plain weight on the CPUs measured, for the
    decoder's linears and the LM head alike; for one or two rows the plain weight is as fast or faster (the
    manual's Backends page has the measurements). The same fp32 products; only the summation order differs
    (last-bit differences, as between any two kernels or batch sizes).

    The packed copy (as large as the weight) is made on first use and again if the weight changed in
    place or moved (its version counter or storage differ); it is never copied or pickled, since oneDNN's
    opaque tensors cannot be: a deep copy of a module holding one packs afresh when it runs."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self._packed: torch.Tensor | None = None
        self._packed_from: tuple[int, int] | None = None

    def __call__(self, rows: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``rows @ weight.T (+ bias)`` for ``rows`` ``[R, in]`` (no autograd: callers send gradients
        through the BLAS kernels)."""
        source = (self.weight.data_ptr(), self.weight._version)  # in-place updates bump _version
        if self._packed is None or self._packed_from != source:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS_HINT)
            self._packed_from = source
        return torch.ops.mkldnn._linear_pointwise(rows, self._packed, bias, "none", [], "")

    def __deepcopy__(self, memo):
        return PackedWeight(copy.deepcopy(self.weight, memo))

    def __getstate__(self):
        return {"weight": self.weight}

    def __setstate__(self, state):
        self.__init__(state["weight"])


def needs_grad(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of ``rows`` and ``weight`` must carry a gradient (then the packed kernel, which
    has no backward, is not taken)."""
    return torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)


T = TypeVar("T")


def worth_tuning(*weights: torch.Tensor) -> bool:
    """Whether products with ``weights`` cost enough for timing their kernels to matter: CPU tensors of at
    least ``TUNE_MIN_ELEMENTS`` weights in all (the embedded model's head, or its decoder's linears)."""
    return (all(w.device.type == "cpu" for w in weights)
            and sum(w.numel() for w in weights) >= TUNE_MIN_ELEMENTS)


class KernelTuner:
    """Which of a few exact kernels a product with a given number of rows takes: the fixed ``default``
    choice, or with ``tune``, the one that timed faster for that row count (module docstring): the first
    calls of a new row count through :meth:`run` alternate the kernels, ``TUNE_TRIALS`` timed calls of
    each, and the one with the quickest call (noise only adds time) is kept, then timed again after 64 more
    calls, 128, 256, ... (at most every ``RETUNE_MAX``). Row counts above ``max_rows`` keep the fixed
    choice (a prefill's hundreds of rows: a tuning per prompt length would never end). ``clock``: the
    timer (tests give a fake one)."""

    def __init__(self, kernels: tuple[str, ...], default: Callable[[int], str], tune: bool = False,
                 clock: Callable[[], float] = time.perf_counter, max_rows: int | None = None):
        self.kernels, self.default, self.tune, self.max_rows = tuple(kernels), default, tune, max_rows
        self._clock = clock
        self._chosen: dict[int, str] = {}  # rows -> kernel, once timed
        self._interval: dict[int, int] = {}  # rows -> calls between its last two timings
        self._until_retune: dict[int, int] = {}  # rows -> calls left before it is timed again
        self._timings: dict[int, dict[str, list[float]]] = {}  # rows -> kernel -> seconds of its calls

    def _tuned(self, rows: int) -> bool:
        return self.tune and (self.max_rows is None or rows <= self.max_rows)

    def kernel(self, rows: int) -> str:
        """The kernel the next call with ``rows`` rows takes: the chosen one, or while timing, the one
        with fewer timed calls (the fixed choice first)."""
        chosen = self._chosen.get(rows)
        if chosen is not None:
            return chosen
        first = self.default(rows)
        if not self._tuned(rows):
            return first
        timings = self._timings.get(rows, {})
        order = (first,) + tuple(k for k in self.kernels if k != first)
        return min(order, key=lambda k: len(timings.get(k, ())))

    def chosen(self) -> dict[int, str]:
        """Row count -> kernel, for the row counts whose timing is done."""
        return dict(self._chosen)

    def run(self, rows: int, call: Callable[[str], T]) -> T:
        """``call(kernel)`` with the kernel for ``rows`` rows, timed while that row count is being tuned."""
        kernel = self.kernel(rows)
        if not self._tuned(rows):
            return call(kernel)
        if rows in self._chosen:
            result = call(kernel)
            self._count_call(rows)
            return result
        start = self._clock()
        result = call(kernel)
        self._record(rows, kernel, self._clock() - start)
        return result

    def _record(self, rows: int, kernel: str, seconds: float) -> None:
        timings = self._timings.setdefault(rows, {k: [] for k in self.kernels})
        timings[kernel].append(seconds)
        if all(len(t) >= TUNE_TRIALS for t in timings.values()):
            self._chosen[rows] = min(self.kernels, key=lambda k: min(timings[k]))
            del self._timings[rows]
            self._interval[rows] = min(RETUNE_MAX, 2 * self._interval.get(rows, RETUNE_FIRST // 2))
            self._until_retune[rows] = self._interval[rows]

    def _count_call(self, rows: int) -> None:
        """Count an untimed call of a chosen row count; after ``RETUNE_FIRST`` of them (then twice as many
        each time, at most ``RETUNE_MAX``) the kernels are timed again. A choice made on a few calls would
        otherwise be kept for the life of the process (a server's): a slower kernel picked on a noisy start
        keeps that row count dear for good, as a ``bmm`` kept for two rows made 2-token verify blocks dearer
        than one-token ones where in isolation two rows cost what one does (the manual's Backends page)."""
        self._until_retune[rows] -= 1
        if self._until_retune[rows] <= 0:
            del self._chosen[rows]


class LMHead:
    """Logits ``[..., V]`` of hidden states ``[..., H]`` for a head weight ``[V, H]`` (and optional bias).

    Holds the weight itself (a view, not a copy) and, made on first use, one laid-out copy for its second
    kernel: oneDNN's packed weight (:class:`PackedWeight`) where the weight can take it, else a
    transposed, chunked copy ``[C, H, CHUNK]`` (zero-padded at the end) for the ``bmm``. Several models may
    share one head (self-drafts of the same target). ``tune``: time the kernels per row count (module
    docstring; default: a large head on the CPU); ``clock``: the timer (tests give a fake one). ``exact``: one
    kernel for every row count, ``blocks`` (:meth:`blocks`), so that a row's logits do not depend on how many rows
    share the call (no timing)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, tune: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter, exact: bool = False):
        weight = weight.detach()
        self.weight = weight if weight.is_contiguous() else weight.contiguous()
        self.bias = None if bias is None else bias.detach()
        self.vocab_size = self.weight.shape[0]
        #: every row's logits come from :meth:`blocks`, whatever the number of rows
        self.exact = bool(exact)
        if tune is None:
            tune = worth_tuning(self.weight)
        #: the row count -> kernel choice, between the plain GEMM and the packed (or chunked) copy (exact: blocks)
        if self.exact:
            self.tuner = KernelTuner(("blocks",), lambda rows: "blocks", False, clock)
        else:
            self.tuner = KernelTuner(("gemm", "packed") if packable(self.weight) else ("gemm", "chunked"),
                                     self.default_kernel, tune, clock)

    @functools.cached_property
    def chunked_t(self) -> torch.Tensor:
        """The transposed, chunked copy ``[C, H, CHUNK]`` the ``bmm`` reads (made on first use)."""
        vocab, hidden = self.weight.shape
        chunks = -(-vocab // CHUNK)
        padded = self.weight.new_zeros(chunks * CHUNK, hidden)
        padded[:vocab] = self.weight
        return padded.view(chunks, CHUNK, hidden).transpose(1, 2).contiguous()

    @functools.cached_property
    def packed_weight(self) -> PackedWeight:
        return PackedWeight(self.weight)

    def default_kernel(self, rows: int) -> str:
        """The fixed choice for ``rows`` rows (an untuned head's, a tuned one's first): the packed GEMM
        where there is one (on a draft head's truncated output layer it is the faster from 3 rows on and within
        noise for one or two: the manual's Backends page); else ``"gemm"`` (``W @ x.T``) or ``"chunked"``
        (the ``bmm``) by the row count (module docstring)."""
        if packable(self.weight):
            return "packed"
        return "gemm" if rows in SMALL_GEMM_ROWS or rows >= LARGE_GEMM_ROWS else "chunked"

    @property
    def kernels(self) -> tuple[str, ...]:
        """The two kernels this head chooses between."""
        return self.tuner.kernels

    @property
    def tune(self) -> bool:
        return self.tuner.tune

    def kernel(self, rows: int) -> str:
        """The kernel the next call with ``rows`` rows takes (:meth:`KernelTuner.kernel`)."""
        return self.tuner.kernel(rows)

    def chosen(self) -> dict[int, str]:
        """Row count -> kernel, for the row counts whose timing is done."""
        return self.tuner.chosen()

    def gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """``W @ x.T`` for ``rows`` ``[R, H]``, no bias (:func:`weight_times_rows`)."""
        return weight_times_rows(self.weight, rows)

    def chunked(self, rows: torch.Tensor) -> torch.Tensor:
        """The ``bmm`` over the transposed, chunked copy, for ``rows`` ``[R, H]``, no bias."""
        out = torch.bmm(rows.unsqueeze(0).expand(self.chunked_t.shape[0], -1, -1), self.chunked_t)  # [C, R, CHUNK]
        return out.transpose(0, 1).reshape(rows.shape[0], -1)[:, :self.vocab_size]

    def packed(self, rows: torch.Tensor) -> torch.Tensor:
        """oneDNN's GEMM over the packed weight, for ``rows`` ``[R, H]``, no bias (no gradient)."""
        return self.packed_weight(rows)

    def blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """The packed GEMM (``F.linear`` where the weight cannot take it) ``EXACT_ROWS`` rows at a time
        (:func:`in_fixed_blocks`), for ``rows`` ``[R, H]``, no bias: each row's logits the same whatever the
        number of rows (no gradient). Not ``W @ x.T``, which makes the block's rows the GEMM's columns: in float64
        MKL computes columns 12-15 of 16 with another kernel than the first 12, so a row's result would depend on
        its place in the block."""
        if packable(self.weight):
            return in_fixed_blocks(rows, self.packed)
        return in_fixed_blocks(rows, lambda block: torch.nn.functional.linear(block, self.weight))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        rows = hidden.reshape(-1, shape[-1])
        if needs_grad(rows, self.weight):  # training through a draft head's output layer: a differentiable GEMM
            logits = self.gemm(rows)
        else:
            kernels = {"gemm": self.gemm, "packed": self.packed, "chunked": self.chunked, "blocks": self.blocks}
            logits = self.tuner.run(rows.shape[0], lambda kernel: kernels[kernel](rows))
        if self.bias is not None:
            logits = logits + self.bias
        return logits.reshape(*shape[:-1], self.vocab_size)
