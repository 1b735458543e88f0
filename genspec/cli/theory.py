"""``genspec theory ...``: the theory toolkit on the command line.

Subcommands: random-chain, rejections, limit, leviathan, pareto, optimality, figures. Every one prints a readable
text line (or table) by default and one JSON object with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from genspec import strict_json
from genspec.cli import finite_float, float_list
from genspec.errors import ConfigError, InputFileError
from genspec.textfiles import check_output_dir, check_output_file
from genspec.theory import leviathan, optimality, pareto
from genspec.theory.budget import check, total
from genspec.theory.chains import load_chain, random_chain, save_chain
from genspec.theory.exact import (expected_rejections, expected_rejections_limit, expected_rejections_sd,
                                  rejections_cost, total_variation)
from genspec.theory.optimality import single_step_chain
from genspec.theory.pareto import check_pair
from genspec.theory.simulate import simulate, simulation_cost


def add_parser(subparsers) -> None:
    theory = subparsers.add_parser(
        "theory", help="theory of speculative decoding on Markov chains: exact, simulated, figures",
        description="Exact and simulated rejections of speculative decoding on Markov-chain pairs, "
                    "bias vs rejections, Leviathan's closed forms, figures. Notation: p = draft, q = target.")
    theory.set_defaults(func=lambda args: _print_help(theory))
    sub = theory.add_subparsers(dest="theory_command", metavar="SUBCOMMAND")

    chain = sub.add_parser("random-chain", help="write a random chain pair (flat Dirichlet rows) as JSON")
    chain.add_argument("--vocab", "-V", type=int, required=True, metavar="V", help="number of symbols")
    chain.add_argument("--horizon", "-T", type=int, required=True, metavar="T", help="generated tokens")
    chain.add_argument("--seed", type=int, default=0)
    chain.add_argument("--out", required=True, metavar="FILE",
                       help="output JSON file, new unless --force ('-' = standard output)")
    chain.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    chain.set_defaults(func=run_random_chain)

    rej = sub.add_parser("rejections", help="exact E[N_rej] (Thm 1 / Thm 3 / multidraft DP), optionally simulated")
    rej.add_argument("chain", metavar="CHAIN.json", help="chain pair file {initial, draft, target}")
    rej.add_argument("--batch", "-M", type=int, default=1, metavar="M", help="drafts per round (1 = standard SD)")
    rej.add_argument("--variant", default="batch", choices=["batch", "multidraft"],
                     help="batch: Algorithm 4 (default); multidraft: token-tree style")
    rej.add_argument("--simulate", type=int, default=0, metavar="N", help="also simulate N runs")
    rej.add_argument("--seed", type=int, default=0, help="seed of the simulation")
    rej.add_argument("--json", action="store_true", help="print one JSON object")
    rej.set_defaults(func=run_rejections)

    lim = sub.add_parser("limit", help="E[N_rej] vs M and the M -> infinity limit (Prop. 1), both variants")
    lim.add_argument("chain", metavar="CHAIN.json")
    lim.add_argument("--max-batch", type=int, default=64, metavar="M", help="largest M of the curve (powers of 2)")
    lim.add_argument("--json", action="store_true")
    lim.set_defaults(func=run_limit)

    lev = sub.add_parser("leviathan", help="Leviathan et al.: tokens per target call, speedup, optimal gamma")
    source = lev.add_mutually_exclusive_group(required=True)
    source.add_argument("--alpha", type=finite_float, help="per-token acceptance rate alpha = 1 - E[TV]")
    source.add_argument("--chain", metavar="CHAIN.json", help="take alpha = 1 - E[N_rej]/T from a chain pair")
    lev.add_argument("--gamma", type=int, help="draft tokens per target call (default: report the optimum only)")
    lev.add_argument("--cost", type=finite_float, default=0.0, metavar="C", help="draft step cost / target step cost")
    lev.add_argument("--verify-cost", type=finite_float, default=1.0, metavar="V",
                     help="measured cost of verifying gamma + 1 tokens, in target steps (default 1)")
    lev.add_argument("--max-gamma", type=int, default=64, help="search the optimal gamma in 1..MAX")
    lev.add_argument("--json", action="store_true")
    lev.set_defaults(func=run_leviathan)

    par = sub.add_parser("pareto", help="bias vs rejections of over-acceptance with OPT and UNO (Thm 4/5)",
                         description="Default pair: theory.md's worked example p = (0.3, 0.7), q = (0.5, 0.5).")
    par.add_argument("--draft", metavar="P1,P2,...", help="draft distribution p (comma-separated)")
    par.add_argument("--target", metavar="Q1,Q2,...", help="target distribution q (comma-separated)")
    par.add_argument("--pair", metavar="FILE", help='JSON file {"draft": [...], "target": [...]}')
    par.add_argument("--eps", metavar="E1,E2,...", help="over-acceptance grid (default 0,0.05,...,0.3)")
    par.add_argument("--json", action="store_true")
    par.set_defaults(func=run_pareto)

    opt = sub.add_parser("optimality", help="Theorem 2: standard SD vs other rejection-based rules, exact and simulated",
                         description="Compare standard speculative decoding with unbiased rejection-based rules that "
                                     "accept less (b scaled by a factor, or raised to a power; each resampling from "
                                     "norm([q - b p]+), the law that keeps the output exact) and, for contrast, "
                                     "over-acceptance (rejects less, biased). Exact expected rejections and bias; "
                                     "with --simulate, Monte-Carlo runs and a chi-square test of the last token.")
    opt.add_argument("pair", metavar="PAIR.json", help='chain pair {initial, draft, target} or one step {"draft", "target"}')
    opt.add_argument("--factors", metavar="C1,C2,...", help="scaling factors in (0, 1] (default 0.9,0.75,0.5)")
    opt.add_argument("--powers", metavar="G1,...", help="powers >= 1 (default 2)")
    opt.add_argument("--epsilon", type=finite_float, default=0.1, help="over-acceptance shown for contrast (0: none)")
    opt.add_argument("--simulate", type=int, default=20_000, metavar="N", help="simulated runs per rule (0: exact only)")
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--json", action="store_true")
    opt.set_defaults(func=run_optimality)

    fig = sub.add_parser("figures", help="write the paper's figures as PNG files")
    fig.add_argument("--out", required=True, metavar="DIR", help="directory of the PNG files, new or empty unless --force")
    fig.add_argument("--force", action="store_true",
                     help="write into --out even if it holds files (earlier figures are overwritten)")
    fig.add_argument("--runs", type=int, default=100_000, help="simulated runs per curve (default 100000)")
    fig.add_argument("--seed", type=int, default=0, help="seed of the random pair and of the simulations")
    fig.add_argument("--vocab", "-V", type=int, default=7)
    fig.add_argument("--horizon", "-T", type=int, default=50)
    fig.add_argument("--chain", metavar="CHAIN.json", help="use this chain pair instead of a random one")
    fig.add_argument("--no-progress", action="store_true", help="no progress bar")
    fig.set_defaults(func=run_figures)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _emit(args, payload: dict, text: str) -> int:
    print(strict_json.dumps(payload) if args.json else text)
    return 0


def _finite_or_none(value: float):
    """JSON has no infinity: an infinite speedup (zero expected rejections) is printed as null."""
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------


def run_random_chain(args) -> int:
    if args.out != "-":
        check_output_file(args.out, "--out file", args.force)
    chain = random_chain(args.vocab, args.horizon, args.seed)
    if args.out == "-":
        print(strict_json.dumps(chain.to_json_dict()))
        return 0
    save_chain(chain, args.out)
    print(f"wrote {args.out}: random pair V={chain.vocab_size}, T={chain.horizon}, seed {args.seed} "
          f"(SD: E[N_rej] = {expected_rejections_sd(chain):.4f})")
    return 0


def run_rejections(args) -> int:
    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    if args.simulate < 0:
        raise ConfigError(f"--simulate must be >= 0, got {args.simulate}")
    chain = load_chain(args.chain)
    if args.simulate:  # refuse the whole command at once, not after the exact part has run
        check(rejections_cost(chain.vocab_size, chain.horizon, args.batch, args.variant).then(
            simulation_cost(chain.vocab_size, chain.horizon, args.simulate, args.batch)),
            f"theory rejections --batch {args.batch} --simulate {args.simulate} on V = {chain.vocab_size}, "
            f"T = {chain.horizon}")
    value = expected_rejections(chain, args.batch, args.variant)
    speedup = chain.horizon / value if value > 0 else math.inf
    payload = {"expected_rejections": value, "horizon": chain.horizon, "batch": args.batch,
               "variant": args.variant, "speedup": _finite_or_none(speedup)}
    text = (f"E[N_rej] = {value:.6f} over T = {chain.horizon} positions (variant {args.variant}, "
            f"M = {args.batch}); speedup T/E[N_rej] = {speedup:.4f}")
    if args.simulate:
        sim = simulate(chain, args.simulate, args.batch, args.variant, seed=args.seed)
        payload.update(simulated_mean=sim.mean, simulated_stderr=sim.stderr)
        distance = abs(sim.mean - value) / sim.stderr if sim.stderr > 0 else 0.0
        text += (f"\nsimulated: {sim.mean:.6f} ± {sim.stderr:.6f} (N = {sim.num_runs} runs, seed {args.seed}; "
                 f"{distance:.2f} standard errors from exact)")
    return _emit(args, payload, text)


def run_limit(args) -> int:
    if args.max_batch < 1:
        raise ConfigError(f"--max-batch must be >= 1, got {args.max_batch}")
    chain = load_chain(args.chain)
    batches = [2 ** i for i in range(args.max_batch.bit_length())]  # powers of 2 up to --max-batch
    _check_curve_cost(chain, batches[-1], f"theory limit --max-batch {args.max_batch}")
    variants = {}
    for variant in ("batch", "multidraft"):
        variants[variant] = {"curve": {str(m): expected_rejections(chain, m, variant) for m in batches},
                             "limit": expected_rejections_limit(chain, variant)}
    payload = {"horizon": chain.horizon, "sd": expected_rejections_sd(chain), "variants": variants}
    lines = [f"E[N_rej] vs M (T = {chain.horizon})", f"{'M':>8} {'batch':>12} {'multidraft':>12}"]
    for m in batches:
        lines.append(f"{m:>8} {variants['batch']['curve'][str(m)]:>12.6f} "
                     f"{variants['multidraft']['curve'][str(m)]:>12.6f}")
    lines.append(f"{'∞':>8} {variants['batch']['limit']:>12.6f} {variants['multidraft']['limit']:>12.6f}")
    return _emit(args, payload, "\n".join(lines))


def _check_curve_cost(chain, largest: int, what: str) -> None:
    """Refuse a curve (M = 1, 2, 4, ..., ``largest``; both variants) above the theory toolkit's limits,
    saying up to which power of 2 this chain fits."""
    def cost(top: int):
        return total(rejections_cost(chain.vocab_size, chain.horizon, 2 ** i, variant)
                     for i in range(top.bit_length()) for variant in ("batch", "multidraft"))

    fitting = 1
    while fitting * 2 <= largest and cost(fitting * 2).fits():
        fitting *= 2
    check(cost(largest), f"{what} (M up to {largest} on V = {chain.vocab_size}, T = {chain.horizon})",
          hint=f"the largest --max-batch within them for this chain is {fitting}")


def run_leviathan(args) -> int:
    if args.chain:
        alpha = leviathan.acceptance_rate(load_chain(args.chain))
    else:
        alpha = args.alpha
    best_gamma, best_speedup = leviathan.optimal_gamma(alpha, args.cost, args.max_gamma, args.verify_cost)
    payload = {"alpha": alpha, "cost_ratio": args.cost, "verify_cost": args.verify_cost,
               "optimal_gamma": best_gamma, "optimal_speedup": best_speedup}
    lines = []
    if args.gamma is not None:
        tokens = leviathan.expected_tokens_per_call(alpha, args.gamma)
        speedup = leviathan.speedup(alpha, args.gamma, args.cost, args.verify_cost)
        payload.update(gamma=args.gamma, tokens_per_call=tokens, speedup=speedup)
        lines.append(f"alpha = {alpha:.4f}, gamma = {args.gamma}: {tokens:.4f} tokens per target call; "
                     f"speedup {speedup:.4f} (c = {args.cost:g}, verify cost {args.verify_cost:g})")
    lines.append(f"optimal gamma in 1..{args.max_gamma}: {best_gamma} (speedup {best_speedup:.4f})")
    return _emit(args, payload, "\n".join(lines))


def run_pareto(args) -> int:
    draft, target = _pareto_pair(args)
    epsilons = float_list(args.eps, "--eps") if args.eps else pareto.DEFAULT_EPSILONS
    draft, target = pareto.check_pair(draft, target)
    points = pareto.pareto_table(draft, target, epsilons)
    tv = float(total_variation(draft, target))
    payload = {"draft": draft.tolist(), "target": target.tolist(), "tv": tv,
               "points": [pt.as_dict() for pt in points]}
    lines = [f"p (draft) = {_fmt_list(draft)}, q (target) = {_fmt_list(target)}, TV = {tv:.6g}",
             f"{'eps':>8} {'R':>10} {'Loss*':>10} {'OPT bias':>10} {'UNO bias':>10}"]
    lines += [f"{pt.epsilon:>8.4g} {pt.rejection:>10.6f} {pt.loss_star:>10.6f} {pt.opt_bias:>10.6f} "
              f"{pt.uno_bias:>10.6f}" for pt in points]
    return _emit(args, payload, "\n".join(lines))


def run_optimality(args) -> int:
    if args.simulate < 0:
        raise ConfigError(f"--simulate must be >= 0, got {args.simulate}")
    rules = optimality.comparison_rules(
        float_list(args.factors, "--factors") if args.factors else optimality.DEFAULT_FACTORS,
        float_list(args.powers, "--powers") if args.powers else optimality.DEFAULT_POWERS, args.epsilon)
    chain = _chain_or_pair(Path(args.pair))
    outcomes = optimality.compare_rules(chain, rules, args.simulate, args.seed)
    standard = outcomes[0].expected_rejections
    fewer = [o.name for o in outcomes[1:] if o.unbiased and o.expected_rejections < standard - 1e-12]
    payload = {"horizon": chain.horizon, "vocab": chain.vocab_size, "simulated_runs": args.simulate,
               "seed": args.seed, "rules": [o.as_dict() for o in outcomes],
               "unbiased_with_fewer_rejections": fewer}
    lines = [f"Theorem 2 on T = {chain.horizon}, V = {chain.vocab_size}: every rule drafts y ~ p, keeps it with "
             f"probability b(y), else draws from norm([q - b p]+)",
             f"{'rule':<18} {'b':<44} {'E[N_rej] exact':>14} {'simulated':>20} {'max bias':>10} {'chi2 p':>8}"]
    for o in outcomes:
        simulated = "" if o.simulated_mean is None else f"{o.simulated_mean:.4f} ± {o.simulated_stderr:.4f}"
        pvalue = "" if o.chi_square_pvalue is None else f"{o.chi_square_pvalue:.3g}"
        lines.append(f"{o.name:<18} {o.description:<44} {o.expected_rejections:>14.6f} {simulated:>20} "
                     f"{o.max_bias:>10.3g} {pvalue:>8}")
    lines.append("no unbiased rule rejects less than standard SD" if not fewer
                 else f"UNEXPECTED: unbiased rules with fewer rejections: {', '.join(fewer)}")
    if args.simulate:
        lines.append(f"simulated: {args.simulate} runs per rule, seed {args.seed}; chi2 p: the last token's counts "
                     f"against the target chain's law (unbiased rules should pass p > 1e-3)")
    return _emit(args, payload, "\n".join(lines))


def _chain_or_pair(path: Path):
    """A chain-pair file, or a one-step {"draft", "target"} file as a chain of horizon 1."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        data = None  # load_chain reports the problem in one line
    if isinstance(data, dict) and "initial" not in data and "draft" in data:
        return single_step_chain(*_read_pair_file(path))
    return load_chain(path)


def _pareto_pair(args):
    if args.pair:
        if args.draft or args.target:
            raise ConfigError("give either --pair FILE or --draft/--target, not both")
        return _read_pair_file(Path(args.pair))
    if bool(args.draft) != bool(args.target):
        raise ConfigError("--draft and --target go together")
    if args.draft:
        return float_list(args.draft, "--draft"), float_list(args.target, "--target")
    return pareto.EXAMPLE_DRAFT, pareto.EXAMPLE_TARGET


def _read_pair_file(path: Path):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputFileError(f"pair file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFileError(f"cannot read pair file {path}: {exc}") from None
    if not isinstance(data, dict) or "draft" not in data or "target" not in data:
        raise InputFileError(f'{path}: expected a JSON object {{"draft": [...], "target": [...]}}')
    for key in ("draft", "target"):
        values = data[key]
        if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise InputFileError(f"{path}: {key} must be a list of numbers")
    try:
        return check_pair(data["draft"], data["target"])
    except ConfigError as exc:
        raise InputFileError(f"{path}: {exc}") from None


def _fmt_list(values) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


def run_figures(args) -> int:
    from genspec.theory.figures import FigureSettings, make_figures

    chain = None
    if args.chain:
        chain = load_chain(args.chain)
    check_output_dir(args.out, args.force, create=False)  # made by make_figures, once its sizes pass
    settings = FigureSettings(out_dir=Path(args.out), runs=args.runs, seed=args.seed, vocab=args.vocab,
                              horizon=args.horizon, chain=chain)
    paths = make_figures(settings, show_progress=not args.no_progress)
    for path in paths:
        print(path)
    return 0
