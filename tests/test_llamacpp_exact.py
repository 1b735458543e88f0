"""llama.cpp's exact kernels (``genspec.Kernels.EXACT``, the default): a position's logits are bitwise the same
whether a one-token step, a k-token block (k = 2..16) or a batch of 16 rows computes them, past 512 cached
tokens, on a quantised tiny GGUF written here and on the embedded Gemma 3 270M; so greedy speculation gives
plain decoding's tokens for every model-free drafter, and a seeded sample repeats with speculation on and off.
Which models are batch invariant (``batch_invariant``) and which settings exact kernels refuse."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from test_drafters_model_free import (DRAFTER_NAMES, PER_REQUEST_SOURCE, PROMPTS,  # noqa: E402
                                      model_free_drafters, run_requests)
from tiny_gguf import write_tiny_gguf  # noqa: E402

import genspec  # noqa: E402
from genspec.engine import SpeculativeEngine  # noqa: E402
from genspec.errors import ConfigError  # noqa: E402
from genspec.models.llamacpp import Kernels, KVCacheType, LlamaCppLM  # noqa: E402

#: tokens cached before the compared positions: past 512 cells, where llama.cpp's flash attention splits a lone
#: query's cells across threads unless the cache is bf16
LONG = 600
BLOCK = [17, 40, 41, 42, 7, 3, 100, 9, 55, 56, 57, 58, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    """(path, tokenizer) of a tiny Llama with Q8_0 matrices and a 1024-token context."""
    path = tmp_path_factory.mktemp("exact") / "tiny-q8.gguf"
    _, tokenizer = write_tiny_gguf(path, seed=0, scale=4.0, context=1024, weight_type="Q8_0")
    return path, tokenizer


@pytest.fixture(scope="module")
def exact(q8_gguf):
    path, tokenizer = q8_gguf
    return LlamaCppLM(path, tokenizer, context=1024, max_rows=16, threads=2)


def _prompt(seed: int, length: int = LONG) -> list[int]:
    return torch.randint(5, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _steps(model, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits of ``tokens`` fed one at a time after ``prefix`` (a model holding that one row)."""
    model.reset(0)
    model.add_rows([prefix])
    out = []
    for token in tokens:
        out.append(model.forward(torch.tensor([[token]]))[0, 0].clone())
        model.commit_all()
    return torch.stack(out)


def assert_batch_invariant(model, prefixes: list[list[int]], block: list[int]) -> None:
    """Bitwise: 1-token steps == each k-token block (k = 2..len(block)) == the block's first token and a 4-token
    block of row 0 batched with the other rows (each with its own prefix and tokens)."""
    alone = _steps(model, prefixes[0], block)
    for k in range(2, len(block) + 1):
        model.reset(0)
        model.add_rows([prefixes[0]])
        together = model.forward(torch.tensor([block[:k]]))[0]
        assert torch.equal(together, alone[:k]), f"the {k}-token block's logits differ from one-token steps"
    rows = len(prefixes)
    others = [[(token + 7 * row) % 240 + 5 for token in block] for row in range(rows)]
    others[0] = block
    for width in (1, 4):
        model.reset(0)
        model.add_rows(prefixes)
        batched = model.forward(torch.tensor([tokens[:width] for tokens in others]))
        assert torch.equal(batched[0], alone[:width]), f"row 0 of {rows} rows x {width} differs from it alone"


def test_exact_kernels_give_a_position_one_set_of_logits_in_any_block_or_batch(exact):
    """On Q8_0 weights past 512 cached tokens, blocks of 2..16 tokens and 16 rows batched (1 and 4 tokens
    each) give row 0's positions the logits of one-token steps, bit for bit."""
    assert exact.kernels is Kernels.EXACT and exact.kv_cache_type is KVCacheType.BF16
    assert exact.batch_invariant
    assert_batch_invariant(exact, [_prompt(seed) for seed in range(16)], BLOCK)


def test_which_models_are_batch_invariant(q8_gguf, tmp_path):
    """Exact kernels on quantised weights with a stream per row are batch invariant; float weights (llamafile's
    kernels from 2 rows), a shared cache (no flash attention) and fast kernels are not, and say so."""
    path, tokenizer = q8_gguf
    assert not LlamaCppLM(path, tokenizer, context=64, max_rows=1, kernels="fast").batch_invariant
    assert not LlamaCppLM(path, tokenizer, context=64, max_rows=1, shared_cache=True).batch_invariant
    chains = LlamaCppLM(path, tokenizer, context=64, max_rows=1)
    assert chains.batch_invariant
    assert chains.reserve_candidates(3) == 1  # exact kernels verify chains: no shared cache
    assert chains.batch_invariant and not chains.shared_cache
    float_path = tmp_path / "tiny-f16.gguf"
    write_tiny_gguf(float_path, seed=0, weight_type="F16")
    assert not LlamaCppLM(float_path, tokenizer, context=64, max_rows=1).batch_invariant


def test_exact_kernels_refuse_what_would_break_them(q8_gguf):
    """Repacking, no flash attention or an f16 cache with exact kernels: one line that names the fast kernels;
    an unknown kernels name lists the known ones."""
    path, tokenizer = q8_gguf
    for options, words in (({"repack": True}, "repacking"), ({"flash_attention": False}, "flash attention"),
                           ({"kv_cache_type": KVCacheType.F16}, "bf16 KV cache")):
        with pytest.raises(ConfigError, match=words) as error:
            LlamaCppLM(path, tokenizer, context=64, max_rows=1, **options)
        assert "kernels='fast'" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="choose from: auto, exact, exact-tiled, fast"):
        LlamaCppLM(path, tokenizer, context=64, max_rows=1, kernels="quick")
    fast = LlamaCppLM(path, tokenizer, context=64, max_rows=1, kernels=Kernels.FAST, repack=True)
    assert fast.kv_cache_type is KVCacheType.F16


def test_the_first_model_of_a_process_decides_the_tiled_kernels(q8_gguf):
    """llama.cpp reads its tiled-kernel switches once per process: the first model made sets them for its kernels
    (exact: off, exact-tiled: every batch); one made after another kind warns, and is batch invariant only if
    the tiling it gets is (a fresh process each)."""
    path, _ = q8_gguf
    script = textwrap.dedent(f"""
        import warnings
        from genspec.models.llamacpp import LlamaCppLM
        first, second = {{order}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = LlamaCppLM({str(path)!r}, None, context=64, max_rows=1, kernels=first)
            b = LlamaCppLM({str(path)!r}, None, context=64, max_rows=1, kernels=second)
        print(a.tiling.name, b.tiling.name, b.batch_invariant, len(caught))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED_MM")}
    runs = {}
    for order in ('"exact", "exact"', '"exact-tiled", "exact-tiled"', '"fast", "exact"', '"exact-tiled", "exact"'):
        out = subprocess.run([sys.executable, "-c", script.replace("{order}", order)], capture_output=True,
                             text=True, check=True, env=env)
        runs[order] = out.stdout.split()
    assert runs['"exact", "exact"'] == ["OFF", "OFF", "True", "0"]
    assert runs['"exact-tiled", "exact-tiled"'] == ["EVERY_BATCH", "EVERY_BATCH", "True", "0"]
    assert runs['"fast", "exact"'] == ["FROM_8_ROWS", "FROM_8_ROWS", "False", "1"]
    assert runs['"exact-tiled", "exact"'] == ["EVERY_BATCH", "EVERY_BATCH", "True", "1"]


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """A tiny Llama in Q4_K and Q6_K (llama.cpp's quantiser, Q4_K_M), 256 wide so that its K-quant blocks fit:
    the types llama.cpp's tiled kernels multiply, which the Q8_0 model never reaches."""
    from genspec.models.llamacpp import GGUFType, derived_gguf

    folder = tmp_path_factory.mktemp("kquant")
    write_tiny_gguf(folder / "tiny-f32.gguf", seed=0, scale=4.0, hidden=256, context=1024)
    path = derived_gguf(folder / "tiny-f32.gguf", GGUFType.Q4_K_M, cache=folder)
    import gguf

    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors
             if len(t.shape) >= 2}
    assert {"Q4_K", "Q6_K"} <= types
    return path


#: a fresh process (its own tiled-kernel setting) that checks a K-quant model bitwise; prints the model's
#: batch_invariant and the first check that failed (or "ok")
_KQUANT_CHECK = textwrap.dedent("""
    import sys, warnings
    import torch
    warnings.simplefilter("ignore")
    from test_llamacpp_exact import BLOCK, _prompt, assert_batch_invariant
    from genspec.drafters.prompt_lookup import PromptLookupDrafter
    from genspec.engine import SpeculativeEngine
    from genspec.models.llamacpp import LlamaCppLM
    model = LlamaCppLM(sys.argv[1], None, context=1024, max_rows=16, threads=2, kernels=sys.argv[2])
    print(model.tiling.name, model.batch_invariant)
    try:
        assert_batch_invariant(model, [_prompt(seed) for seed in range(16)], BLOCK)
    except AssertionError as error:
        print(error); sys.exit()
    prompts = [_prompt(seed, 300) * 2 for seed in range(4)]  # repeats: prompt lookup drafts from it
    plain = [r.token_ids for r in SpeculativeEngine(model).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())]
    spec = SpeculativeEngine(model, PromptLookupDrafter()).generate_ids(prompts, max_new_tokens=24, eos_token_ids=(),
                                                                       num_draft_tokens=4, draft_length="fixed")
    print("ok" if [r.token_ids for r in spec] == plain and sum(r.stats.accepted_tokens for r in spec) > 0
          else "speculation changed the output")
""")


@pytest.mark.parametrize("kernels, environment, expected", [
    ("exact", {}, ["OFF", "True", "ok"]),
    ("exact-tiled", {}, ["EVERY_BATCH", "True", "ok"]),
    # the negative control: exact kernels' other settings, tiling from 8 rows (llama.cpp's default)
    ("exact", {"GGML_CPU_TILED_MM": "1"}, ["FROM_8_ROWS", "False", "the 8-token block's logits differ"]),
])
def test_exact_kernels_on_k_quants_with_tiling_off_or_for_every_batch(kquant_gguf, kernels, environment,
                                                                      expected):
    """Q4_K / Q6_K weights past 512 cached tokens, bitwise: with the tiled kernels off (exact) or on for every
    batch (exact-tiled) a position gets one set of logits in blocks of 2..16 tokens and 16 rows batched, and
    greedy prompt lookup (batch 4) gives plain decoding's tokens; with tiling from 8 rows an 8-token block's
    logits already differ from one-token steps (a fresh process each: llama.cpp reads the switch once)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED_MM")} | environment
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _KQUANT_CHECK, str(kquant_gguf), kernels], capture_output=True,
                         text=True, check=True, env=env, timeout=600)
    lines = out.stdout.strip().splitlines()
    assert lines[0].split() == expected[:2]
    assert lines[1].startswith(expected[2]), lines


# ---------------------------------------------------------------- speculation on exact kernels

NEW = 24


@pytest.fixture(scope="module")
def long_prompts(exact):
    """Prompts past 512 cached tokens that repeat themselves (so that lookup drafts are sometimes right): a random
    520-token start, a short prompt, the model's greedy continuation of both, the short prompt again."""
    firsts = [_prompt(99, 520) + p for p in PROMPTS]
    continued = SpeculativeEngine(exact).generate_ids(firsts, max_new_tokens=NEW, eos_token_ids=())
    return [first + r.token_ids + p for first, r, p in zip(firsts, continued, PROMPTS)]


@pytest.fixture(scope="module")
def exact_plain(exact, long_prompts):
    return [r.token_ids for r in SpeculativeEngine(exact).generate_ids(long_prompts, max_new_tokens=NEW,
                                                                       eos_token_ids=())]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", DRAFTER_NAMES)
def test_greedy_speculation_equals_plain_on_exact_kernels(exact, long_prompts, exact_plain, name, batch):
    """Every model-free drafter, batch 1 and 4, past 512 cached tokens on Q8_0 weights: token for token plain
    greedy output, with drafts used (some tokens accepted); a tree drafter's first chain is verified (exact
    kernels keep a cache stream per row), and the model stays batch invariant."""
    drafter = model_free_drafters(exact_plain)[name](batch)
    options = ([{"source": p + o} for p, o in zip(long_prompts[:batch], exact_plain[:batch])]
               if name in PER_REQUEST_SOURCE else None)
    engine = SpeculativeEngine(exact, drafter)
    results = run_requests(engine, long_prompts[:batch], options, max_new_tokens=NEW, num_draft_tokens=4,
                           eos_token_ids=(), draft_length="fixed")
    assert [tokens for tokens, _ in results] == exact_plain[:batch]
    if name != "edit-prompt-source":
        assert sum(step.stats.accepted_tokens for _, step in results) > 0
    assert engine.max_candidates == 1 and exact.batch_invariant


@pytest.mark.parametrize("draft_length", ["fixed", "heuristic"])
def test_a_seeded_sample_repeats_with_speculation_on_and_off(exact, long_prompts, draft_length):
    """The coupled rule with a seed: the same samples with and without a drafter and under two draft length
    policies (they draft different blocks, so different batches), 4 requests at temperature 0.5."""
    from genspec.drafters.prompt_lookup import PromptLookupDrafter

    config = {"max_new_tokens": NEW, "temperature": 0.5, "seed": 11, "eos_token_ids": (), "rule": "coupled"}
    plain = [r.token_ids for r in SpeculativeEngine(exact).generate_ids(long_prompts, **config)]
    engine = SpeculativeEngine(exact, PromptLookupDrafter())
    spec = engine.generate_ids(long_prompts, num_draft_tokens=4, draft_length=draft_length, **config)
    assert [r.token_ids for r in spec] == plain
    assert sum(r.stats.accepted_tokens for r in spec) > 0
    assert len({tuple(t) for t in plain}) > 1  # sampled: the four requests do not all give one text


def test_the_embedded_model_is_batch_invariant_on_exact_kernels():
    """The embedded Gemma 3 270M (Q4_K_M: Q4_K, Q6_K and Q5_0 / Q8_0 matrices) on exact kernels: blocks of 2..16
    tokens and 16 rows batched give a position the logits of one-token steps, bit for bit (bounded: 40-token
    prompts)."""
    model = genspec.load_model(backend="llamacpp", max_rows=16)
    assert model.batch_invariant
    prefixes = [_prompt(seed, 40) for seed in range(16)]
    assert_batch_invariant(model, prefixes, BLOCK)


def test_a_served_request_gets_its_plain_output_beside_15_others(q8_gguf):
    """``genspec serve`` on exact kernels over real HTTP on loopback: 16 concurrent greedy completions of prompts
    past 512 tokens, speculation on (prompt lookup), each equal to plain decoding of its prompt alone, token for
    token, whichever requests shared its steps."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai
    from test_serve import serving

    from genspec.serve.settings import ServerSettings
    from genspec.serve.worker import load_engine

    path, _ = q8_gguf
    settings = ServerSettings(model=str(path), max_batch_size=16, measure_costs=False, served_model_name="tiny")
    engine = load_engine(settings)
    assert engine.target.batch_invariant and engine.drafter is not None
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    prompts = [" ".join(rng.choice(words) for _ in range(110)) for _ in range(16)]
    alone = genspec.load(str(path), drafter="none", max_batch_size=1, measure_costs=False)
    expected = [alone.generate(p, max_new_tokens=24)[0].text for p in prompts]
    with serving(engine, settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=24,
                                                                       temperature=0).choices[0].text, prompts))
        assert texts == expected
        metrics = httpx.get(f"{url}/metrics").text
        accepted = [line for line in metrics.splitlines()
                    if line.startswith("genspec:spec_decode_num_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0  # speculation ran, and drafts were kept
