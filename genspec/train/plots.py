"""The training curve of a speculator (``training_curve.png`` beside it): loss and top-1 agreement per
step (a moving average over 50 steps), with the held-out figures before and after training."""
from __future__ import annotations

from pathlib import Path


def _smooth(values: list[float], window: int = 50) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def training_curve(log: dict, path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log["loss"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(steps, _smooth([e["loss"] for e in log["loss"]]), label="training (mean of 50 steps)")
    right.plot(steps, _smooth([e["agreement"] for e in log["loss"]]), label="training (mean of 50 steps)")
    for axis, key in ((left, "loss"), (right, "agreement")):
        before, after = log.get("held_out_before", {}), log.get("held_out_after", {})
        if key in before and key in after:
            axis.plot([0, steps[-1]], [before[key], after[key]], "o", color="black", label="held out (before, after)")
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend()
    left.set_ylabel("loss")
    right.set_ylabel("first draft token = target's top token")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
