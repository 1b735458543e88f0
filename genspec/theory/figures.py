"""The paper's figures, redrawn from genspec's exact formulas and simulators (``genspec theory figures``).

Figures are drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas, so importing this
module never changes the global pyplot backend.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from genspec.errors import ConfigError, InputFileError
from genspec.theory import exact, pareto
from genspec.theory.budget import Cost, check, total
from genspec.theory.chains import ChainPair, chain_cost, random_chain
from genspec.theory.simulate import Simulation, simulate, simulation_cost

BATCH_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MULTIDRAFT_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128)
SIMULATED_BATCHES = (2, 4, 8)
COLORS = {"sd": "tab:blue", "batch": "tab:orange", "multidraft": "tab:green", "limit": "tab:red",
          "opt": "tab:green", "uno": "tab:red", "front": "black"}


@dataclass
class FigureSettings:
    """What the figures are computed on. ``chain`` overrides the random pair (vocab, horizon, seed)."""

    out_dir: Path
    runs: int = 100_000
    seed: int = 0
    vocab: int = 7
    horizon: int = 50
    chain: ChainPair | None = None

    def pair(self) -> ChainPair:
        return self.chain if self.chain is not None else random_chain(self.vocab, self.horizon, self.seed)

    def describe(self) -> str:
        if self.chain is not None:
            return f"given chain, V={self.chain.vocab_size}, T={self.chain.horizon}"
        return f"random pair V={self.vocab}, T={self.horizon}, seed {self.seed}"


def figures_cost(settings: FigureSettings) -> Cost:
    """Estimated cost of :func:`make_figures`: the random pair, the simulations and the exact curves."""
    chain = settings.chain
    vocab, horizon = (chain.vocab_size, chain.horizon) if chain is not None else (settings.vocab, settings.horizon)
    sim_runs = max(settings.runs // 5, 10)
    parts = [] if chain is not None else [chain_cost(vocab, horizon)]
    parts += [simulation_cost(vocab, horizon, settings.runs, batch) for batch in (1, 4, 5)]
    parts += [simulation_cost(vocab, horizon, sim_runs, batch) for batch in SIMULATED_BATCHES for _ in exact.VARIANTS]
    parts += [exact.rejections_cost(vocab, horizon, batch, "batch") for batch in BATCH_GRID + (4, 5)]
    parts += [exact.rejections_cost(vocab, horizon, batch, "multidraft") for batch in MULTIDRAFT_GRID]
    return total(parts)


def make_figures(settings: FigureSettings, show_progress: bool = True) -> list[Path]:
    """Write all figures as PNG files into ``settings.out_dir``; return their paths. Refused at once
    (:class:`ConfigError`) if :func:`figures_cost` exceeds the theory toolkit's limits."""
    if settings.runs < 10:
        raise ConfigError(f"--runs must be >= 10, got {settings.runs}")
    if settings.chain is None and (settings.vocab < 1 or settings.horizon < 1):
        raise ConfigError(f"need vocab >= 1 and horizon >= 1, got vocab={settings.vocab}, horizon={settings.horizon}")
    check(figures_cost(settings), f"theory figures with --runs {settings.runs} on {settings.describe()}")
    try:
        settings.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputFileError(f"cannot create output directory {settings.out_dir}: {exc}") from None
    chain = settings.pair()
    with _progress(show_progress) as progress:
        return [
            _save(figure_theorem1(chain, settings, progress), settings.out_dir / "theorem1_sd_simulation.png"),
            _save(figure_theorem3(chain, settings, progress), settings.out_dir / "theorem3_batch_simulation.png"),
            _save(figure_rejections_vs_batch(chain, settings, progress),
                  settings.out_dir / "rejections_vs_batch.png"),
            _save(figure_batch_improvement(), settings.out_dir / "batch_improvement.png"),
            _save(figure_pareto(), settings.out_dir / "pareto_front.png"),
        ]


# ---------------------------------------------------------------------------------------------
# progress bar (rich): one task per simulation, advanced per simulated position


class _NoProgress:
    def simulate(self, label, chain, runs, **kwargs) -> Simulation:
        return simulate(chain, runs, **kwargs)


class _RichProgress:
    def __init__(self, progress):
        self._progress = progress

    def simulate(self, label, chain, runs, **kwargs) -> Simulation:
        task = self._progress.add_task(label, total=runs * chain.horizon)
        result = simulate(chain, runs, progress=lambda advanced: self._progress.advance(task, advanced), **kwargs)
        self._progress.update(task, completed=runs * chain.horizon)
        return result


@contextlib.contextmanager
def _progress(show: bool):
    if not show:
        yield _NoProgress()
        return
    columns = (TextColumn("{task.description:<34}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        yield _RichProgress(progress)


# ---------------------------------------------------------------------------------------------
# the figures


def _running_mean_axes(ax, sim: Simulation, exact_value: float, color: str, label: str) -> None:
    """Running mean of N_rej over the first n runs (log-spaced n), a +-2 standard-error band, and
    the exact value as a dashed line."""
    runs = np.arange(1, sim.num_runs + 1)
    running = np.cumsum(sim.rejections) / runs
    shown = np.unique(np.geomspace(1, sim.num_runs, 400).astype(int)) - 1
    band = 2 * sim.rejections.std() / np.sqrt(runs[shown])
    ax.fill_between(runs[shown], exact_value - band, exact_value + band, color=color, alpha=0.15,
                    label=f"{label}: exact ± 2 s.e.")
    ax.plot(runs[shown], running[shown], color=color, lw=1.4, label=f"{label}: simulated running mean")
    ax.axhline(exact_value, color=color, ls="--", lw=1.2, label=f"{label}: exact = {exact_value:.3f}")
    ax.set_xscale("log")


def figure_theorem1(chain: ChainPair, settings: FigureSettings, progress) -> Figure:
    """Simulated standard SD converging to Theorem 1, plus the histogram of N_rej."""
    exact_value = exact.expected_rejections_sd(chain)
    sim = progress.simulate("Theorem 1: SD", chain, settings.runs, batch=1, seed=settings.seed + 1)
    fig = Figure(figsize=(12, 4.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    _running_mean_axes(left, sim, exact_value, COLORS["sd"], "SD")
    left.set_xlabel("number of simulated runs n")
    left.set_ylabel("mean number of rejections over the first n runs")
    left.set_title("Simulation converges to Theorem 1")
    left.legend(loc="upper right", fontsize=9)
    bins = np.arange(sim.rejections.min(), sim.rejections.max() + 2) - 0.5
    right.hist(sim.rejections, bins=bins, color=COLORS["sd"], alpha=0.7, label=f"{sim.num_runs:,} runs")
    right.axvline(exact_value, color="black", ls="--", label=f"E[N_rej] (Thm 1) = {exact_value:.2f}")
    right.set_xlabel("N_rej (rejections in one run)")
    right.set_ylabel("runs")
    right.set_title("Distribution of N_rej")
    right.legend(fontsize=9, loc="upper left")
    fig.suptitle(f"Standard speculative decoding on a {settings.describe()}; "
                 f"speedup T/E[N_rej] = {chain.horizon / exact_value:.2f}")
    fig.tight_layout()
    return fig


def figure_theorem3(chain: ChainPair, settings: FigureSettings, progress) -> Figure:
    """Batch speculative decoding (Algorithm 4) with M = 4 and M = 5 against Theorem 3."""
    fig = Figure(figsize=(12, 4.8))
    axes = fig.subplots(1, 2, sharey=True)
    sd_value = exact.expected_rejections_sd(chain)
    for ax, batch, color in zip(axes, (4, 5), (COLORS["batch"], "tab:purple")):
        exact_value = exact.expected_rejections_theorem3(chain, batch)
        sim = progress.simulate(f"Theorem 3: batch M={batch}", chain, settings.runs, batch=batch,
                                variant="batch", seed=settings.seed + 10 + batch)
        _running_mean_axes(ax, sim, exact_value, color, f"M = {batch}")
        ax.axhline(sd_value, color=COLORS["sd"], ls=":", lw=1.2, label=f"SD (M = 1), Thm 1 = {sd_value:.3f}")
        ax.set_xlabel("number of simulated runs n")
        ax.set_title(f"Batch SD, M = {batch}: simulation vs Theorem 3")
        ax.legend(loc="upper right", fontsize=9)
    axes[0].set_ylabel("mean number of rejections over the first n runs")
    fig.suptitle(f"Batch speculative decoding (Algorithm 4) on a {settings.describe()}")
    fig.tight_layout()
    return fig


def figure_rejections_vs_batch(chain: ChainPair, settings: FigureSettings, progress) -> Figure:
    """E[N_rej] vs M for both variants with their M -> infinity limits (Prop. 1), plus simulated
    points (mean ± 2 s.e.)."""
    fig = Figure(figsize=(9, 5.5))
    ax = fig.subplots()
    sim_runs = max(settings.runs // 5, 10)
    for variant, grid in (("batch", BATCH_GRID), ("multidraft", MULTIDRAFT_GRID)):
        color = COLORS[variant]
        curve = exact.rejections_curve(chain, grid, variant)
        ax.plot(grid, curve, "-", color=color, lw=1.6, label=f"{variant}: exact DP")
        limit = exact.expected_rejections_limit(chain, variant)
        ax.axhline(limit, color=color, ls="--", lw=1.2, label=f"{variant}: limit M → ∞ = {limit:.2f}")
        means, errors = [], []
        for batch in SIMULATED_BATCHES:
            sim = progress.simulate(f"rejections vs M: {variant} M={batch}", chain, sim_runs, batch=batch,
                                    variant=variant, seed=settings.seed + 100 + batch)
            means.append(sim.mean)
            errors.append(2 * sim.stderr)
        ax.errorbar(SIMULATED_BATCHES, means, yerr=errors, fmt="o", color=color, ms=5, capsize=3,
                    label=f"{variant}: simulated ({sim_runs:,} runs, ± 2 s.e.)")
    ax.axhline(exact.expected_rejections_sd(chain), color=COLORS["sd"], ls=":", lw=1.2, label="SD (M = 1)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (drafts per round)")
    ax.set_ylabel("expected number of rejections E[N_rej]")
    ax.set_title(f"Rejections vs number of drafts M ({settings.describe()})")
    ax.legend(fontsize=8.5, loc="lower left")  # the space between the curves and the multidraft limit
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figure_batch_improvement(max_batch: int = 16) -> Figure:
    """Single-step improvement TV(q, p) - prod_m TV(q^m, p): closed forms (lines) vs the generic
    recursion (markers), for Bernoulli pairs and uniform pairs."""
    batches = np.arange(1, max_batch + 1)
    fig = Figure(figsize=(12, 4.8))
    left, right = fig.subplots(1, 2)
    for u, v in ((0.8, 0.2), (0.6, 0.3), (0.3, 0.6), (0.1, 0.5)):
        draft, target = exact.bernoulli_pair(u, v)
        closed = [exact.bernoulli_improvement(u, v, m) for m in batches]
        generic = [exact.single_step_improvement(draft, target, m) for m in batches]
        line, = left.plot(batches, closed, "-", lw=1.4, label=f"p(1) = {u}, q(1) = {v}")
        left.plot(batches, generic, "o", color=line.get_color(), ms=4, mfc="none")
    left.plot([], [], "k-", label="closed form")
    left.plot([], [], "ko", mfc="none", label="generic recursion")
    left.set_title("Bernoulli: |u − v| (1 − base^(M−1))")
    vocab = 12
    for ratio in (2, 3, 4, 6):
        draft, target = exact.uniform_pair(vocab, ratio)
        closed = [exact.uniform_improvement(ratio, m) for m in batches]
        generic = [exact.single_step_improvement(draft, target, m) for m in batches]
        line, = right.plot(batches, closed, "-", lw=1.4, label=f"q uniform on V/{ratio} of p's V = {vocab}")
        right.plot(batches, generic, "o", color=line.get_color(), ms=4, mfc="none")
    draft, target = exact.uniform_pair(vocab, 3)
    swapped = [exact.single_step_improvement(target, draft, m) for m in batches]  # roles swapped
    right.plot(batches, swapped, "s--", color="gray", ms=4, mfc="none", label="swapped (p on V/3, q uniform): 0")
    right.plot([], [], "k-", label="closed form")
    right.plot([], [], "ko", mfc="none", label="generic recursion")
    right.set_title("Uniform: (1 − 1/r) − (1 − 1/r)^M")
    for ax in (left, right):
        ax.set_xlabel("M (drafts per round)")
        ax.set_ylabel("rejection probability saved at a round's first position")
        ax.legend(fontsize=8.5)
        ax.grid(alpha=0.3)
    fig.suptitle("Single-step batch improvement TV(q, p) − Π_{m≤M} TV(q^m, p)  (p = draft, q = target)")
    fig.tight_layout()
    return fig


def figure_pareto(random_seed: int = 3, vocab: int = 7) -> Figure:
    """Theorem 5's front R + Loss* = TV with Decoding-OPT (on it) and Decoding-UNO (above it) for the
    over-acceptance family, on docs/theory.md's worked example and on a random pair."""
    rng = np.random.default_rng(random_seed)
    random_draft, random_target = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    cases = [("worked example p = (0.3, 0.7), q = (0.5, 0.5)", pareto.EXAMPLE_DRAFT, pareto.EXAMPLE_TARGET,
              pareto.DEFAULT_EPSILONS),
             (f"random pair, V = {vocab} (flat Dirichlet, seed {random_seed})", random_draft, random_target,
              tuple(np.round(np.linspace(0, 0.3, 7), 3)))]
    fig = Figure(figsize=(12, 5.2))
    axes = fig.subplots(1, 2)
    for ax, (title, draft, target, epsilons) in zip(axes, cases):
        points = pareto.pareto_table(draft, target, epsilons)
        front = pareto.pareto_front(draft, target)
        tv = front[0, 0]
        ax.fill_between([0, tv], [tv, 0], [0, 0], color="gray", alpha=0.12, label="unreachable (below the front)")
        ax.plot(front[:, 0], front[:, 1], "-", color=COLORS["front"], lw=1.2, label="Pareto front R + Loss* = TV")
        rejection = [pt.rejection for pt in points]
        ax.plot(rejection, [pt.opt_bias for pt in points], "o", color=COLORS["opt"], ms=7,
                label="Decoding-OPT (bias = Loss*)")
        ax.plot(rejection, [pt.uno_bias for pt in points], "^", color=COLORS["uno"], ms=7,
                label="Decoding-UNO (resample from q)")
        for (rejection_value, uno_value), label in _epsilon_labels(points):
            ax.annotate(label, (rejection_value, uno_value), textcoords="offset points",
                        xytext=(4, 5), fontsize=7.5, color=COLORS["uno"])
        ax.set_xlim(-0.02 * tv, tv * 1.08)
        ax.set_ylim(-0.02 * tv, max(pt.uno_bias for pt in points) * 1.15)
        ax.set_xlabel("rejection probability R")
        ax.set_ylabel("bias TV(output law, q)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8.5, loc="upper right")
        ax.grid(alpha=0.3)
    fig.suptitle("Bias vs rejections for over-acceptance b = min{1, (q + ε)/p} (Theorems 4 and 5)")
    fig.tight_layout()
    return fig


def _epsilon_labels(points) -> list[tuple[tuple[float, float], str]]:
    """One label per distinct UNO point: levels of eps that land on the same point (every eps >= the
    largest q - p gives R = 0) share one label such as "ε ≥ 0.2"."""
    groups: dict[tuple[float, float], list[float]] = {}
    for pt in points:
        groups.setdefault((round(pt.rejection, 9), round(pt.uno_bias, 9)), []).append(pt.epsilon)
    labels = []
    for where, epsilons in groups.items():
        text = f"ε={epsilons[0]:g}" if len(epsilons) == 1 else f"ε ≥ {min(epsilons):g}"
        labels.append((where, text))
    return labels


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise InputFileError(f"cannot write figure {path}: {exc}") from None
    return path
