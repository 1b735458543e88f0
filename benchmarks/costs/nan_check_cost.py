"""What the engine's NaN / inf check on logits costs, and why the embedded model cannot run in float16.

    python benchmarks/costs/nan_check_cost.py            # cost of the check next to the target pass it follows
    python benchmarks/costs/nan_check_cost.py --dtypes   # largest activation per layer of the embedded model in float16

Cost: the embedded model (float32) after a 64-token prompt per row verifies blocks of rows x width tokens;
for each shape the median time of the target pass (``forward``, LM head included) and of
``genspec.engine.unusable_rows`` on its logits ``[rows, width, 262144]`` (one max over the vocabulary),
with ``torch.isfinite(logits).all()`` for comparison. 20 repeats per shape.

Dtypes: the embedded model loaded in float16, four prompts; per decoder layer the largest absolute value of
its output (the residual stream) and whether it is finite; then whether the logits are.
"""
from __future__ import annotations

import argparse

import torch
from timing import median_seconds

import genspec
from genspec.drafting import unusable_rows

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "Summarize: The council approved the new budget for the library."]



def cost() -> None:
    target = genspec.load_model(None, backend="torch")
    generator = torch.Generator().manual_seed(0)
    for rows, width in ((1, 1), (1, 9), (4, 1), (4, 9)):
        target.reset(0)
        target.add_rows([torch.randint(3, 32_000, (64,), generator=generator).tolist() for _ in range(rows)])
        block = torch.randint(3, 32_000, (rows, width), generator=generator)
        valid = torch.ones(rows, width, dtype=torch.bool)
        logits = target.forward(block)
        target.keep_block(torch.full((rows, width), -1))

        def forward():
            target.forward(block)
            target.keep_block(torch.full((rows, width), -1))

        seconds = median_seconds(forward)
        check = median_seconds(lambda: unusable_rows(logits, valid))
        full = median_seconds(lambda: bool(torch.isfinite(logits).all()))
        print(f"{rows} row(s) x {width} token(s): target pass {seconds * 1e3:.1f} ms, check {check * 1e3:.2f} ms "
              f"({check / seconds:.1%}), isfinite().all() {full * 1e3:.2f} ms", flush=True)


def dtypes() -> None:
    from genspec.embedded import default_model_dir
    from genspec.models.hf import HFCausalLM

    model = HFCausalLM.from_pretrained(default_model_dir(), dtype="float16")  # load_model refuses float16
    peaks: list[float] = []
    hooks = [layer.register_forward_hook(lambda module, inputs, output: peaks.append(
        float((output[0] if isinstance(output, tuple) else output).float().abs().max())))
        for layer in model.decoder.layers]
    for prompt in PROMPTS:
        peaks.clear()
        model.reset(1)
        logits = model.forward(torch.tensor([model.tokenizer(prompt)["input_ids"]]))
        layers = ", ".join(f"{i}: {p:,.0f}" for i, p in enumerate(peaks))
        print(f"{prompt!r}: largest |activation| per layer {layers}; logits finite: "
              f"{bool(torch.isfinite(logits).all())}", flush=True)
    for hook in hooks:
        hook.remove()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", action="store_true", help="float16 activations of the embedded model")
    dtypes() if parser.parse_args().dtypes else cost()
