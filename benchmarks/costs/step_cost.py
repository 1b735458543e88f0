"""What one decode / verify step costs on this machine, and which EXACT LM-head computation is fastest.

    python benchmarks/costs/step_cost.py --out bench_results/step_cost.json

On the embedded Gemma 3 270M (fp32, loaded from genspec's cache):
 (a) the LM head (262,144 x 640) alone for n = 1..16 rows: F.linear, x @ W.T (view), x @ W_t (contiguous
     transposed copy), mm/addmm/mv, vocabulary-chunked variants; 1 and 2 threads. Exactness against a
     float64 reference (max relative error) and argmax agreement with the stock F.linear head.
 (b) a whole step of n new tokens after a 200-token context (DynamicCache, cropped back after each
     measurement): stock ``model(...)`` vs ``model.model(...)`` + the fastest exact head.
 (c) caveats: 8 rows at once vs each row alone (head, and a verify block vs single-token steps), and
     ``DynamicCache.crop`` rollback vs a fresh prefill.
Medians over repeats after warm-up.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.mkldnn
from timing import median_seconds  # benchmarks/costs/ is on the path when run as a script
from transformers import AutoModelForCausalLM, DynamicCache

from genspec.embedded import default_model_dir
from genspec.kernels import LMHead
from genspec.models.hf import HFCausalLM

ROWS = (1, 2, 4, 8, 16)
CONTEXT = 200


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    return 1000 * median_seconds(fn, repeats, warmup)


def chunks_of(matrix: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    return [c.contiguous() for c in matrix.chunk(parts, dim=dim)]


def head_variants(weight: torch.Tensor, max_rows: int) -> dict:
    """name -> fn(x [n, H]) -> logits [n, V]; every one is the same fp32 product, laid out differently.
    (Results may be non-contiguous views; consumers only read them.)"""
    w_t = weight.t().contiguous()
    out = torch.empty(max_rows, weight.shape[0])
    zero = torch.zeros(weight.shape[0])
    col_chunks = {p: chunks_of(w_t, p, dim=1) for p in (16, 64, 256)}
    row_chunks = chunks_of(weight, 256, dim=0)
    stacked = w_t.reshape(w_t.shape[0], 256, -1).permute(1, 0, 2).contiguous()  # [256, H, V/256]
    onednn = _onednn_linear(weight)
    variants = {
        "F.linear(x, W)": lambda x: F.linear(x, weight),
        "F.linear(x[None], W) (3-D, as HF)": lambda x: F.linear(x[None], weight)[0],
        "x @ W.T (view)": lambda x: x @ weight.t(),
        "x @ W_t": lambda x: x @ w_t,
        "mm(x, W_t, out=)": lambda x: torch.mm(x, w_t, out=out[: x.shape[0]]),
        "addmm(0, x, W_t)": lambda x: torch.addmm(zero, x, w_t),
        "(W @ x.T).T": lambda x: (weight @ x.t()).t(),
        "oneDNN linear (mkldnn weight)": lambda x: onednn(x.to_mkldnn()).to_dense(),
        "W @ x.T in 256 row-chunks": lambda x: torch.cat([c @ x.t() for c in row_chunks]).t(),
        "bmm over 256 chunks of W_t": lambda x: torch.bmm(x.expand(len(stacked), *x.shape), stacked).transpose(0, 1)
        .reshape(x.shape[0], -1),
    }
    for parts, blocks in col_chunks.items():
        variants[f"x @ W_t in {parts} col-chunks"] = lambda x, blocks=blocks: torch.cat([x @ b for b in blocks], dim=-1)
    variants["genspec LMHead (per-row-count kernel)"] = LMHead(weight)
    return variants


def _onednn_linear(weight: torch.Tensor):
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    return torch.utils.mkldnn.to_mkldnn(torch.nn.Sequential(linear))[0]  # copies W into oneDNN's layout


def head_study(weight: torch.Tensor, hidden: torch.Tensor, repeats: int, threads: tuple[int, ...]) -> dict:
    """{threads: {variant: {n: {ms, rel_err, argmax_ok}}}} on real final hidden states."""
    variants = head_variants(weight, max(ROWS))
    reference = F.linear(hidden.double(), weight.double())
    stock_argmax = F.linear(hidden, weight).argmax(-1)
    table = {}
    for t in threads:
        torch.set_num_threads(t)
        table[t] = {}
        for name, fn in variants.items():
            table[t][name] = {}
            for n in ROWS:
                x = hidden[:n].contiguous()
                y = fn(x).double()
                table[t][name][n] = {
                    "ms": median_ms(lambda: fn(x), repeats),
                    "rel_err": float((y - reference[:n]).abs().max() / reference[:n].abs().max()),
                    "argmax_ok": bool(torch.equal(y.argmax(-1), stock_argmax[:n])),
                }
    torch.set_num_threads(max(threads))
    return table


def fastest_exact(table: dict, n: int, tol: float = 1e-5) -> str:
    ok = {name: rows[n]["ms"] for name, rows in table.items() if rows[n]["rel_err"] < tol and rows[n]["argmax_ok"]}
    return min(ok, key=ok.get)


def prefilled(model, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True)
    return cache


def step_study(model, ids: torch.Tensor, heads: dict, head_table: dict, repeats: int) -> dict:
    """Whole step of n tokens after CONTEXT tokens: stock forward vs base model + fastest exact head."""
    cache = prefilled(model, ids[:, :CONTEXT])
    table = {}
    for n in ROWS:
        block = ids[:, CONTEXT:CONTEXT + n]
        best = fastest_exact(head_table, n)
        head = heads[best]

        def stock():
            model(block, past_key_values=cache, use_cache=True)
            cache.crop(-n)  # roll back: the context stays CONTEXT tokens

        def base_only():
            model.model(block, past_key_values=cache, use_cache=True)
            cache.crop(-n)

        def base_and_head():
            head(model.model(block, past_key_values=cache, use_cache=True).last_hidden_state[0])
            cache.crop(-n)

        table[n] = {"stock_ms": median_ms(stock, repeats), "base_ms": median_ms(base_only, repeats),
                    "base_best_head_ms": median_ms(base_and_head, repeats), "head": best}
        assert cache.get_seq_length() == CONTEXT
    return table


def batch_vs_single(model, hidden: torch.Tensor, ids: torch.Tensor, heads: dict) -> dict:
    """Are 8 rows at once bitwise equal to each row alone? For heads, and for a verify block vs 8 decode steps."""
    result = {}
    for name in ("F.linear(x, W)", "x @ W_t", "x @ W_t in 64 col-chunks", "(W @ x.T).T", "oneDNN linear (mkldnn weight)"):
        together = heads[name](hidden[:8])
        alone = torch.cat([heads[name](hidden[i:i + 1]) for i in range(8)])
        result[f"head: {name}"] = {"max_abs_diff": float((together - alone).abs().max()),
                                   "argmax_agrees": bool(torch.equal(together.argmax(-1), alone.argmax(-1)))}
    cache = prefilled(model, ids[:, :CONTEXT])
    block = model(ids[:, CONTEXT:CONTEXT + 8], past_key_values=cache, use_cache=True).logits[0]
    cache.crop(-8)
    steps = torch.cat([model(ids[:, CONTEXT + i:CONTEXT + i + 1], past_key_values=cache, use_cache=True).logits[0]
                       for i in range(8)])
    result["model: 8-token block vs 8 single steps"] = {
        "max_abs_diff": float((block - steps).abs().max()), "argmax_agrees": bool(torch.equal(block.argmax(-1), steps.argmax(-1)))}
    return result


def crop_check(model, ids: torch.Tensor) -> dict:
    """Cache 200, feed 8, crop(-4), refeed 204..207 vs a fresh 208-token prefill (and vs no crop at all)."""
    fresh = model(ids[:, :208]).logits[0, -4:]
    cache = prefilled(model, ids[:, :200])
    model(ids[:, 200:208], past_key_values=cache, use_cache=True)
    cache.crop(-4)
    refed = model(ids[:, 204:208], past_key_values=cache, use_cache=True).logits[0]
    plain = model(ids[:, 204:208], past_key_values=prefilled(model, ids[:, :204]), use_cache=True).logits[0]
    return {"crop_vs_fresh_max_abs_diff": float((refed - fresh).abs().max()),
            "crop_vs_no_crop_max_abs_diff": float((refed - plain).abs().max()),
            "argmax_agrees": bool(torch.equal(refed.argmax(-1), fresh.argmax(-1))),
            "note": "crop takes a NEGATIVE count in transformers 5 (crop(204) raises); past the 512-token sliding "
                    "window it also needs cache.activate_past_recording() before the forwards"}


def decoder_linear_study(model, repeats: int) -> dict:
    """All the Linear layers of one decoder layer (q, k, v, o, gate, up, down), n rows each, per kernel."""
    from genspec.models.hf import TransposedLinear

    linears = [m for m in model.model.layers[0].modules() if type(m) is torch.nn.Linear]
    weights = [m.weight.detach() for m in linears]
    transposed = [w.t().contiguous() for w in weights]
    ours = [TransposedLinear(m) for m in linears]
    kernels = {
        "F.linear(x, W)": lambda xs: [F.linear(x, w) for x, w in zip(xs, weights)],
        "x @ W_t": lambda xs: [x @ w for x, w in zip(xs, transposed)],
        "(W @ x.T).T": lambda xs: [(w @ x.t()).t() for x, w in zip(xs, weights)],
        "genspec TransposedLinear": lambda xs: [m(x) for x, m in zip(xs, ours)],
    }
    table = {}
    for name, fn in kernels.items():
        table[name] = {}
        for n in ROWS:
            xs = [torch.randn(n, w.shape[1]) for w in weights]
            table[name][n] = 1000 * median_ms(lambda: fn(xs), repeats)  # microseconds
    return table


def engine_step_study(ids: torch.Tensor, repeats: int) -> dict:
    """What the engine really pays: ``HFCausalLM.forward`` of n tokens after CONTEXT (genspec's slot cache,
    explicit masks, LM head on all n rows), rolled back with ``truncate`` after each call."""
    model = HFCausalLM.from_pretrained(default_model_dir())
    model.reset(1)
    model.forward(ids[:, :CONTEXT], last_only=True)
    model.commit_all()
    table = {}
    for n in ROWS:
        block = ids[:, CONTEXT:CONTEXT + n]

        def step():
            model.forward(block)
            model.truncate(torch.tensor([CONTEXT]))

        table[n] = median_ms(step, repeats)
    return {n: {"ms": ms, "vs_one_token": ms / table[1]} for n, ms in table.items()}


def print_tables(heads: dict, steps: dict, caveats: dict, engine: dict | None = None,
                 linears: dict | None = None) -> None:
    for t, table in heads.items():
        print(f"\n### LM head alone, ms (torch {torch.__version__}, {t} thread{'s' * (t > 1)})\n")
        print("| variant | " + " | ".join(f"n={n}" for n in ROWS) + " | max rel err | argmax ok |")
        print("|---" * (len(ROWS) + 3) + "|")
        for name, rows in table.items():
            err = max(r["rel_err"] for r in rows.values())
            ok = all(r["argmax_ok"] for r in rows.values())
            print(f"| {name} | " + " | ".join(f"{rows[n]['ms']:.1f}" for n in ROWS) + f" | {err:.1e} | {ok} |")
    print(f"\n### Whole step of n tokens after {CONTEXT} tokens of context, ms\n")
    print("| threads | n | stock model(...) | model.model only | model.model + best head | best head | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for t, table in steps.items():
        for n, r in table.items():
            print(f"| {t} | {n} | {r['stock_ms']:.1f} | {r['base_ms']:.1f} | {r['base_best_head_ms']:.1f} | {r['head']} "
                  f"| {r['stock_ms'] / r['base_best_head_ms']:.2f}x |")
    for t, table in (linears or {}).items():
        print(f"\n### decoder linears: the 7 Linear layers of one decoder layer, n rows, microseconds ({t} threads)\n")
        print("| kernel | " + " | ".join(f"n={n}" for n in ROWS) + " |")
        print("|---" * (len(ROWS) + 1) + "|")
        for name, rows in table.items():
            print(f"| {name} | " + " | ".join(f"{rows[n]:.0f}" for n in ROWS) + " |")
    if engine:
        print(f"\n### genspec engine: HFCausalLM.forward of n tokens after {CONTEXT} tokens, ms\n")
        print("| threads | " + " | ".join(f"n={n}" for n in ROWS) + " |")
        print("|---" * (len(ROWS) + 1) + "|")
        for t, table in engine.items():
            print(f"| {t} | " + " | ".join(f"{r['ms']:.1f} ({r['vs_one_token']:.2f}x)" for r in table.values()) + " |")
    print("\n### Caveats\n")
    for name, r in caveats.items():
        print(f"- {name}: {r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--out", help="write the tables as JSON here")
    args = parser.parse_args()
    threads = tuple(sorted(set(args.threads)))
    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    weight = model.lm_head.weight.detach()
    ids = torch.randint(100, 20000, (1, CONTEXT + 32), generator=torch.Generator().manual_seed(0))
    hidden = model.model(ids[:, :CONTEXT]).last_hidden_state[0, -max(ROWS):].contiguous()  # real final states

    heads = head_study(weight, hidden, args.repeats, threads)
    variants = head_variants(weight, max(ROWS))
    steps = {}
    for t in threads:
        torch.set_num_threads(t)
        steps[t] = step_study(model, ids, variants, heads[t], args.repeats)
    caveats = {**batch_vs_single(model, hidden, ids, variants), "DynamicCache.crop": crop_check(model, ids),
               "final_logit_softcapping": model.config.final_logit_softcapping,
               "tie_word_embeddings": model.config.tie_word_embeddings}
    linears = {}
    for t in threads:
        torch.set_num_threads(t)
        linears[t] = decoder_linear_study(model, args.repeats * 3)
    del model, variants
    engine = {}
    for t in threads:
        torch.set_num_threads(t)
        engine[t] = engine_step_study(ids, args.repeats)
    print_tables(heads, steps, caveats, engine, linears)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "machine": {"processor": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(),
                        "torch": torch.__version__, "blas": torch.backends.mkl.is_available() and "MKL" or "other"},
            "context": CONTEXT, "head_ms": heads, "step_ms": steps, "engine_step_ms": engine, "decoder_linears_us": linears,
            "caveats": caveats}, indent=1))


if __name__ == "__main__":
    main()
