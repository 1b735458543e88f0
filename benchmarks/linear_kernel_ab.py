"""The decoder's linear layers before and after the two-column kernel, in one process, interleaved.

    python benchmarks/linear_kernel_ab.py --out benchmarks/results/linear_kernel_ab.txt

Before (genspec until 2026-11-26): one row ran ``x @ W_t`` over a transposed copy of the weight, two or
more rows ``(W @ x.T).T`` returned as a transposed (strided) view. Now
(:class:`genspec.models.hf.TransposedLinear`): ``(W @ x.T).T`` for every row count, one row computed as
two, the result contiguous. Both are exact fp32 products; the LM head is today's in both columns. The script loads the embedded model, prefills a
200-token context, and times a verify forward (decoder + LM head) and the decoder alone for blocks of 1-8
tokens with each kernel, alternating kernels and widths within every repeat (the slot cache rolled back
after each block), so a background load shifts both alike. Cells: median / min ms over the repeats. On a
shared VM the machine's speed moves between runs; compare the two columns of one run.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from verify_width_cost import block_runner, emit, timed  # benchmarks/ is on the path when run as a script

import genspec
from genspec.models.hf import TransposedLinear

WIDTHS = (1, 2, 3, 4, 8)


class BeforeLinear(torch.nn.Module):
    """The decoder linear as genspec ran it before: ``x @ W_t`` over a transposed copy for one row,
    ``(W @ x.T).T`` returned as a strided view for more."""

    def __init__(self, now: TransposedLinear):
        super().__init__()
        self.weight, self.bias, self.out_features = now.weight, now.bias, now.out_features
        self.weight_t = now.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = rows @ self.weight_t if rows.shape[0] == 1 else (self.weight @ rows.T).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    target = genspec.load_model(None)
    # (parent, attribute, kernel name -> module): the layers are swapped in place between rounds, as
    # HFCausalLM swaps nn.Linear for TransposedLinear
    places = [(parent, name, {"before": BeforeLinear(child), "now": child})
              for parent in list(target.decoder.modules()) for name, child in parent.named_children()
              if isinstance(child, TransposedLinear)]
    kernels = ("before", "now")
    block = block_runner(target, max(WIDTHS))

    times: dict[tuple[str, str, int], list[float]] = {}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name in kernels:
                for parent, attribute, modules in places:
                    setattr(parent, attribute, modules[name])
                for width in WIDTHS:
                    for part in ("verify", "decoder"):
                        ms = timed(lambda: block(width, part == "decoder"))
                        if repeat:
                            times.setdefault((part, name, width), []).append(ms)

    lines = [f"median / min of {args.repeats} (ms)", "width  verify before    verify now  decoder before   decoder now"]
    for width in WIDTHS:
        cells = [times[(part, name, width)] for part in ("verify", "decoder") for name in kernels]
        lines.append(f"{width:5d} " + " ".join(f"{statistics.median(c):7.0f} /{min(c):4.0f}" for c in cells))
    emit(lines, args.out)


if __name__ == "__main__":
    main()
