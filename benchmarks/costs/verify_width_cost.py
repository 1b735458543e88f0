"""What verifying a block of 1..9 tokens costs the embedded model, and where the time goes.

    python benchmarks/costs/verify_width_cost.py --out benchmarks/results/costs/verify_width_cost.txt

Why: the cost policy extrapolates the verify costs it has measured (genspec/draft_length.py), so a
block width whose kernel is slow for its size (a 2-token block once cost 121 ms against 103-124 ms for 3
to 9 tokens and 48 ms for one) makes drafting look too dear. This script measures, for each block width after a 200-token context (the model's slot cache rolled back after each
measurement, as :func:`genspec.calibration.step_time` does):

 (a) the whole verify forward (``target.forward``: decoder + genspec's LM head), and the decoder alone
     (``target.hidden_states``), so head = (a) - decoder;
 (b) the LM head alone (262,144 x 640 fp32) with each exact kernel genspec has: the chunked ``bmm`` over
     the transposed copy, ``W @ x.T``, oneDNN's GEMM over a packed copy, and what
     :class:`genspec.kernels.LMHead` picks for that many rows;
 (c) the decoder's linear layers alone (all of them, once each, on that many rows): ``x @ W_t`` over a
     transposed copy, ``W @ x.T``, ``F.linear`` (what
     transformers runs), the packed GEMM and :class:`genspec.models.hf.TransposedLinear` as it is now.

Widths are interleaved within each repeat (a background load shifts all widths alike); each cell is
``median / min`` over repeats (noise only adds time, so on a shared CPU the minimum is the steadier
figure). Timings on a shared CPU vary by +-20% or more: compare widths and kernels, not runs.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import genspec
from genspec.models.hf import TransposedLinear

WIDTHS = range(1, 10)
CONTEXT = 200


def parse_widths(text: str) -> list[int]:
    widths = sorted({int(w) for w in text.split(",") if w.strip()})
    if not widths or widths[0] < 1:
        raise argparse.ArgumentTypeError(f"widths must be integers >= 1, got {text!r}")
    return widths


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def block_runner(target, widest: int) -> Callable[[int, bool], None]:
    """Prefill ``target`` with a ``CONTEXT``-token text; returns ``block(width, decoder_only)``, which runs
    the next ``width`` tokens (the whole verify forward, or the decoder alone) and rolls the cache back."""
    text = target.tokenizer("The history of the printing press begins " * 40)["input_ids"][:CONTEXT + widest]
    target.reset(1)
    target.forward(torch.tensor([text[:CONTEXT]]), last_only=True)
    target.commit_all()

    def block(width: int, decoder_only: bool) -> None:
        tokens = torch.tensor([text[CONTEXT:CONTEXT + width]])
        if decoder_only:
            target.hidden_states(tokens)
        else:
            target.forward(tokens)
        target.keep_block(torch.full((1, width), -1))  # roll back: the next block sees the same context

    return block


def emit(lines: list[str], out: Path | None) -> None:
    """Print the report (a header line of machine and versions first) and write it to ``out``."""
    report = "\n".join([f"# {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
                        f"embedded model, context {CONTEXT}, " + lines[0], *lines[1:]])
    print(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report + "\n")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--widths", type=parse_widths, default=list(WIDTHS),
                        help="block widths, comma-separated (default 1-9)")
    args = parser.parse_args()
    widths = args.widths

    target = genspec.load_model(None, backend="torch")
    head = target.lm_head
    block = block_runner(target, max(widths))

    kernels = {
        "LMHead": head,
        "bmm chunks": head.chunked,
        "W @ x.T": lambda x: (head.weight @ x.T).T,
        "packed": head.packed,
    }
    linears = [m for m in target.decoder.modules() if isinstance(m, TransposedLinear)]
    transposed = [m.weight.detach().t().contiguous() for m in linears]  # the one-row kernel genspec ran before
    inputs = {n: torch.randn(max(widths), n) for n in {m.in_features for m in linears}}
    layer_kernels = {
        "lin x @ W_t": lambda rows: [inputs[m.in_features][:rows] @ w_t for m, w_t in zip(linears, transposed)],
        "lin genspec": lambda rows: [m(inputs[m.in_features][:rows]) for m in linears],
        "lin W @ x.T": lambda rows: [(m.weight @ inputs[m.in_features][:rows].T).T for m in linears],
        "lin F.linear": lambda rows: [F.linear(inputs[m.in_features][:rows], m.weight) for m in linears],
        "lin packed": lambda rows: [m.packed_weight(inputs[m.in_features][:rows]) for m in linears],
    }
    hidden = torch.randn(max(widths), head.weight.shape[1])
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for width in widths:  # warm-up
            block(width, False)
        for _ in range(args.repeats):
            for width in widths:
                times.setdefault(("verify", width), []).append(timed(lambda: block(width, False)))
                times.setdefault(("decoder", width), []).append(timed(lambda: block(width, True)))
                for name, kernel in kernels.items():
                    times.setdefault((name, width), []).append(timed(lambda: kernel(hidden[:width])))
                for name, kernel in layer_kernels.items():
                    times.setdefault((name, width), []).append(timed(lambda: kernel(width)))

    columns = ["verify", "decoder", *kernels, *layer_kernels]
    lines = [f"median / min of {args.repeats} (ms)", "width " + " ".join(f"{c:>13s}" for c in columns)]
    for width in widths:
        cells = (f"{statistics.median(times[(c, width)]):.0f} / {min(times[(c, width)]):.0f}" for c in columns)
        lines.append(f"{width:5d} " + " ".join(f"{cell:>13s}" for cell in cells))
    emit(lines, args.out)


if __name__ == "__main__":
    main()
