"""The training curve of a speculator (``training_curve.png`` beside it): loss and top-1 agreement per
step (a moving average over 50 steps), with the held-out figures every ``held_out_every`` steps (a gap
between the two curves is over-fitting: more data, not more steps, is what helps then)."""
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
    curve = [{"step": 0, **log["held_out_before"]}] if log.get("held_out_before") else []
    curve += log.get("held_out_curve") or ([{"step": steps[-1], **log["held_out_after"]}] if log.get("held_out_after") else [])
    for axis, key in ((left, "loss"), (right, "agreement")):
        points = [(e["step"], e[key]) for e in curve if key in e]
        if points:
            axis.plot(*zip(*points), "o-", color="black", label="held out")
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
