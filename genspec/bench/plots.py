"""PNG figures of a benchmark run (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

from genspec.bench.analysis import MEAN, sweep_summary
from genspec.bench.methods import PLAIN


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(results: dict) -> str:
    s = results.get("settings", {})
    m = results.get("machine", {})
    model = Path(str(results.get("model", {}).get("path", "?"))).name
    mode = "greedy" if not s.get("temperature") else f"T={s.get('temperature')}"
    return (f"{model}, {mode}, batch 1, {s.get('max_new_tokens', '?')} new tokens, "
            f"{s.get('repeats', '?')} repeat(s), {m.get('logical_cores', '?')}-core {m.get('cpu_model', 'CPU')}")


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _colors(methods: list[str]) -> dict:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


def speedup_by_category(results: dict, summary: dict, path: Path) -> None:
    """Grouped bars: speedup over genspec plain per category and method, min–max over repeats."""
    plt = _pyplot()
    methods = [m for m in summary["methods"] if m != PLAIN]
    groups = summary["categories"] + [MEAN]
    rows = {(r["category"], r["method"]): r for r in summary["rows"]}
    colors = _colors(summary["methods"])
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(groups) * max(1, len(methods)) * 0.45 + 3), 4.8))
    for j, method in enumerate(methods):
        xs, heights, lows, highs = [], [], [], []
        for i, group in enumerate(groups):
            s = rows[(group, method)].get("speedup_vs_plain")
            if not s:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            heights.append(s["median"])
            lows.append(s["median"] - s["min"])
            highs.append(s["max"] - s["median"])
        ax.bar(xs, heights, width, color=colors[method], label=method, yerr=[lows, highs] if any(lows + highs) else None,
               capsize=2, error_kw={"elinewidth": 0.8})
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="genspec plain = 1")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g if g != MEAN else "MEAN" for g in groups], rotation=30 if len(groups) > 5 else 0,
                       ha="right" if len(groups) > 5 else "center")
    ax.set_ylabel("speedup over genspec plain decoding (x)")
    ax.set_title("Speedup per Spec-Bench category (median over repeats, bars: min–max)\n" + _subtitle(results),
                 fontsize=10)
    ax.legend(fontsize=8, ncol=2 if len(methods) > 4 else 1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(bottom=0)
    _save(plt, fig, path)


def acceptance_by_position(results: dict, summary: dict, path: Path) -> None:
    """Per method (all prompts pooled): share of drafts reaching position i that were accepted up to i."""
    plt = _pyplot()
    rows = [r for r in summary["rows"] if r["category"] == "all" and r.get("acceptance_per_position")]
    colors = _colors(summary["methods"])
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    longest = 1
    for row in rows:
        points = [(i + 1, p["rate"]) for i, p in enumerate(row["acceptance_per_position"]) if p["rate"] is not None]
        if not points:
            continue
        longest = max(longest, points[-1][0])
        ax.plot(*zip(*points), marker="o", markersize=3, color=colors.get(row["method"]), label=row["method"])
    if not rows:
        ax.text(0.5, 0.5, "no drafts were verified in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(draft tokens 1..i accepted | i drafted)")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0.5, longest + 0.5)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Acceptance by draft position (all prompts pooled)\n" + _subtitle(results), fontsize=10)
    if rows:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(plt, fig, path)


def time_breakdown(results: dict, summary: dict, path: Path) -> None:
    """Stacked bars per method: seconds per generated token inside model passes vs outside them."""
    plt = _pyplot()
    rows = [r for r in summary["rows"] if r["category"] == "all" and r.get("overhead_share") is not None
            and r.get("tokens_per_second")]
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * max(3, len(rows)) + 2.2))
    names, inside, outside = [], [], []
    for row in rows:
        per_token = 1000.0 / row["tokens_per_second"]["median"]  # ms per token
        names.append(row["method"])
        outside.append(per_token * row["overhead_share"])
        inside.append(per_token - outside[-1])
    ys = range(len(names))
    ax.barh(ys, inside, color="#4c72b0", label="inside model forward passes")
    ax.barh(ys, outside, left=inside, color="#dd8452", label="outside (engine, drafter logic, rule, rollback)")
    for y, a, b in zip(ys, inside, outside):
        ax.text(a + b, y, f" {100 * b / (a + b):.0f}% outside", va="center", fontsize=8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel("wall time per generated token (ms)")
    ax.set_title("Where the time goes (all prompts pooled, median repeat)\n" + _subtitle(results), fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(0, max([a + b for a, b in zip(inside, outside)] or [1]) * 1.25)
    _save(plt, fig, path)


def tokens_per_second_vs_k(results: dict, summary: dict, path: Path) -> bool:
    """tokens/s of the sweep method at each fixed k, plain decoding and the adaptive setting as lines."""
    sweep = sweep_summary(results)
    points = [s for s in sweep if s["k"] is not None and s["tokens_per_second"]]
    if not points:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ks = [s["k"] for s in points]
    med = [s["tokens_per_second"]["median"] for s in points]
    err = [[m - s["tokens_per_second"]["min"] for m, s in zip(med, points)],
           [s["tokens_per_second"]["max"] - m for m, s in zip(med, points)]]
    method = results.get("settings", {}).get("sweep_method", "")
    ax.errorbar(ks, med, yerr=err, marker="o", capsize=3, label=f"{method}, fixed k")
    for s, m in zip(points, med):
        if s["mean_accepted_length"] is not None:
            ax.annotate(f"{s['mean_accepted_length']:.2f} tok/call", (s["k"], m), textcoords="offset points",
                        xytext=(4, 6), fontsize=7)
    plain = next((s for s in sweep if s["method"] == PLAIN and s["tokens_per_second"]), None)
    if plain:
        ax.axhline(plain["tokens_per_second"]["median"], color="black", linestyle="--", linewidth=1,
                   label="genspec plain decoding")
    adaptive = next((s for s in sweep if s["k"] is None and s["method"] != PLAIN and s["tokens_per_second"]), None)
    if adaptive:
        ax.axhline(adaptive["tokens_per_second"]["median"], color="tab:green", linestyle=":", linewidth=1.5,
                   label=f"{adaptive['method']} (its own draft length policy)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_xlabel("draft length k (tokens drafted per target call)")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Tokens/s vs draft length ({results.get('settings', {}).get('sweep_prompts', '?')} prompt(s), "
                 "median over repeats, bars: min–max)\n" + _subtitle(results), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(plt, fig, path)
    return True


def tradeoff_plot(records: list[dict], path: Path, title: str) -> None:
    """Measured (rejection rate, bias) per setting against the Pareto front: each setting's front point
    (hollow, same rejection rate) and the line bias = mean TV - rejection, mean TV over all settings."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    styles = {}
    markers = {"opt": "o", "uno": "s"}
    measured = [r for r in records if r["rejection_rate"] is not None]
    for r in measured:
        key = (r["rule"], r["residual"])
        if key not in styles:
            styles[key] = plt.get_cmap("tab10")(len(styles) % 10)
            label = f"{r['rule']}, {r['residual'].upper()}"
        else:
            label = None
        color = styles[key]
        marker = markers[r["residual"]] if r["rule"] == "overaccept" else ("^" if r["residual"] == "opt" else "v")
        ax.plot(r["rejection_rate"], r["bias_tv"], marker, color=color, label=label, markersize=7)
        ax.plot(r["rejection_rate"], r["pareto_bias"], marker, color=color, fillstyle="none", markersize=7, alpha=0.7)
        ax.vlines(r["rejection_rate"], r["pareto_bias"], r["bias_tv"], color=color, linewidth=0.6, alpha=0.5)
        ax.annotate(f"{r['eps']:g}", (r["rejection_rate"], r["bias_tv"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=7, color=color)
    if measured:
        tv = sum(r["details"]["tv"] for r in measured) / len(measured)
        ax.plot([0, tv], [tv, 0], "--", color="gray", label=f"Pareto front, mean TV(p, q) = {tv:.3f}")
    ax.set_xlabel("rejection rate (mean R per judged draft position)")
    ax.set_ylabel("bias (mean TV(b p + R P, q) per judged position)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, title="filled: measured; hollow: front at the same R; labels: eps", title_fontsize=7)
    _save(plt, fig, path)


def write_plots(results: dict, summary: dict, out_dir: Path) -> list[Path]:
    """Every figure that applies to this run; returns the files written."""
    out_dir = Path(out_dir)
    written = []
    for name, draw in (("speedup_by_category.png", speedup_by_category),
                       ("acceptance_by_position.png", acceptance_by_position),
                       ("time_breakdown.png", time_breakdown),
                       ("tokens_per_second_vs_k.png", tokens_per_second_vs_k)):
        if draw(results, summary, out_dir / name) is not False:
            written.append(out_dir / name)
    return written
