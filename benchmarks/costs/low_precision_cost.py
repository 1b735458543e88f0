"""What the torch backend's lower precisions cost per product on this CPU: the embedded model's LM head and
one decoder layer's linears in float32 and bfloat16 (``F.linear`` and oneDNN's packed GEMM, as
:class:`genspec.kernels.PackedWeight` runs it) and int8 weight-only (``torch._weight_int8pack_mm``: int8
weights with a scale per output channel, activations in float32 or bfloat16, as gpt-fast and torchao run it
on CPUs), for the row counts of a decode step and of verify blocks.

    python benchmarks/costs/low_precision_cost.py [--rows 1,4,9] [--repeats 20]

Random weights of the embedded Gemma 3 270M's shapes; median milliseconds per product (a decoder layer: its
seven linears in turn). Prints whether oneDNN runs bfloat16 in hardware here (AVX512-BF16 or AMX).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import median_seconds

from genspec.kernels import bf16_packable

#: [out, in] of the embedded model's LM head and of one decoder layer's linears (q, k, v, o, gate, up, down)
HEAD = (262_144, 640)
LAYER = [(1024, 640), (256, 640), (256, 640), (640, 1024), (2048, 640), (2048, 640), (640, 2048)]


def kernels(shapes, dtype):
    """name -> (activation dtype, product): the product takes one input per shape (``[rows, in]``)."""
    weights = [torch.randn(out, inp) * 0.02 for out, inp in shapes]
    out = {}
    if dtype == "int8":
        quantised = []
        for w in weights:
            scales = w.abs().amax(1) / 127
            quantised.append((torch.round(w / scales[:, None]).to(torch.int8), scales))
        for activation in (torch.float32, torch.bfloat16):
            prepared = [(q, s.to(activation)) for q, s in quantised]
            out[f"int8 weights, {str(activation)[6:]} activations"] = (
                activation, lambda xs, prepared=prepared: [torch._weight_int8pack_mm(x, q, s)
                                                           for x, (q, s) in zip(xs, prepared)])
        return out
    typed = [w.to(dtype) for w in weights]
    out[f"{str(dtype)[6:]} F.linear"] = (dtype, lambda xs: [F.linear(x, w) for x, w in zip(xs, typed)])
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in typed]
    out[f"{str(dtype)[6:]} packed (oneDNN)"] = (
        dtype, lambda xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,9")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; oneDNN bfloat16 in hardware: "
          f"{bf16_packable()}; median ms per product")
    for title, shapes in (("LM head 262,144 x 640", [HEAD]), ("one decoder layer's 7 linears", LAYER)):
        print(f"\n{title}\n")
        print("| kernel | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for dtype in (torch.float32, torch.bfloat16, "int8"):
            for name, (activation, product) in kernels(shapes, dtype).items():
                cells = []
                for count in rows:
                    inputs = [torch.randn(count, inp).to(activation) for _, inp in shapes]
                    cells.append(f"{median_seconds(lambda: product(inputs), args.repeats) * 1e3:.2f}")
                print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
