"""The llama.cpp backend on tiny GGUF files written in the test: it computes the model transformers
computes, a k-token block gives the logits of k single steps, rows and trees keep their own caches,
speculation on it is lossless (greedy equality with its own plain decoding, batch 1 and 4, every
model-free drafter; chi-square of sampled outputs against the exact law), and what it cannot do is
refused with one line."""
from __future__ import annotations

import json

import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from stats_helpers import chi_square_pvalue  # noqa: E402
from test_drafters_model_free import (DRAFTER_NAMES, NEW_TOKENS, PER_REQUEST_SOURCE, PROMPTS,  # noqa: E402
                                      model_free_drafters, run_requests)
from tiny_gguf import write_tiny_gguf  # noqa: E402

import genspec  # noqa: E402
from genspec.engine import SpeculativeEngine  # noqa: E402
from genspec.errors import ConfigError, InputFileError  # noqa: E402
from genspec.models.llamacpp import KVCacheType, LlamaCppLM  # noqa: E402
from genspec.sampling import SamplingConfig, process_logits  # noqa: E402



@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, transformers model, tokenizer) of a tiny byte-vocabulary Llama written as GGUF."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    model, tokenizer = write_tiny_gguf(path, seed=0, scale=4.0)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def target(tiny_gguf):
    path, _, tokenizer = tiny_gguf
    return LlamaCppLM(path, tokenizer, context=256, max_rows=8, threads=1)


def test_gguf_model_computes_what_transformers_computes(tiny_gguf, target):
    """The written GGUF and the adapter's positions are right: llama.cpp's logits for a prompt equal the
    transformers model's (float32) within 1e-3 at every position with fast kernels' f16 KV cache, within 5e-3
    with exact kernels' bf16 one (8 bits of mantissa where f16 has 11)."""
    path, model, tokenizer = tiny_gguf
    prompt = [5, 9, 40, 41, 42, 7, 3, 100]
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits.float()
    fast = LlamaCppLM(path, tokenizer, context=64, max_rows=1, threads=1, kernels="fast")
    for lm, tolerance in ((target, 5e-3), (fast, 1e-3)):
        lm.reset(0)
        lm.add_rows([[]])
        logits = lm.forward(torch.tensor([prompt]))
        lm.commit_all()
        assert logits.shape == reference.shape
        assert (logits - reference).abs().max().item() < tolerance
        assert lm.lengths.tolist() == [len(prompt)]



def test_a_quantised_tiny_gguf_holds_its_matrices_in_that_type(tmp_path):
    """``write_tiny_gguf(weight_type=...)`` stores every matrix in that type and the norms in float32, and
    llama.cpp runs it as the same function up to the quantisation: the greedy token of transformers' float32
    model at 8 of 8 positions (the tiny model's laws are peaked), logits within 0.1 (Q8_0 rounds each weight to 1 part in 254 of its block's largest)."""
    import gguf

    path = tmp_path / "tiny-q8.gguf"
    model, tokenizer = write_tiny_gguf(path, seed=0, scale=4.0, weight_type="Q8_0")
    kinds = {tensor.name: (tensor.tensor_type, len(tensor.shape)) for tensor in gguf.GGUFReader(path).tensors}
    assert {kind for kind, dims in kinds.values() if dims >= 2} == {gguf.GGMLQuantizationType.Q8_0}
    assert {kind for kind, dims in kinds.values() if dims == 1} == {gguf.GGMLQuantizationType.F32}
    quantised = LlamaCppLM(path, tokenizer, context=256, max_rows=1, threads=1)
    prompt = [5, 9, 40, 41, 42, 7, 3, 100]
    quantised.add_rows([[]])
    logits = quantised.forward(torch.tensor([prompt]))
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits.float()
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    assert (logits - reference).abs().max().item() < 0.1


@pytest.mark.parametrize("kv_cache_type", list(KVCacheType))
def test_a_bf16_cache_gives_a_block_the_logits_of_single_steps_past_512_cells(tmp_path, kv_cache_type):
    """Past 512 cached tokens a lone one-token step and an 8-token block compute the same positions' logits
    bitwise with a bf16 KV cache (flash attention runs every query over the cells in order) and not with llama.cpp's
    default f16 cache (a lone query's cells are split across threads); Q8_0 weights, whose products do not depend
    on the rows beside them."""
    path = tmp_path / "tiny-q8.gguf"
    _, tokenizer = write_tiny_gguf(path, seed=0, scale=4.0, context=1024, weight_type="Q8_0")
    model = LlamaCppLM(path, tokenizer, context=1024, max_rows=1, threads=2, kv_cache_type=kv_cache_type,
                       kernels="fast")
    prompt = torch.randint(5, 200, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    block = [17, 40, 41, 42, 7, 3, 100, 9]
    model.add_rows([prompt])
    steps = []
    for token in block:
        steps.append(model.forward(torch.tensor([[token]]))[0, -1].clone())
        model.commit_all()
    model.reset(0)
    model.add_rows([prompt])
    together = model.forward(torch.tensor([block]))[0]
    assert torch.equal(together, torch.stack(steps)) == (kv_cache_type is KVCacheType.BF16)

def test_transient_logits_are_forwards_without_the_copy(target):
    """``forward_transient`` gives ``forward``'s logits bit for bit, for a block where every slot is an output
    (llama.cpp's own buffer, no copy) and for padded rows (a reused buffer, zeros where a row has no token),
    and the next call overwrites them, as its contract says; ``forward``'s logits stay the caller's."""
    block = torch.tensor([[7, 8, 9], [10, 11, 12]])
    for valid in (None, torch.tensor([[True, True, True], [True, False, False]])):
        outputs = {}
        for name in ("forward", "forward_transient"):
            target.reset(0)
            target.add_rows([[3, 4, 5], [6, 5, 4]])
            outputs[name] = getattr(target, name)(block, valid)
            outputs[name] = outputs[name].clone() if name == "forward_transient" else outputs[name]
            target.keep_block(torch.tensor([[0], [0]]))
        assert torch.equal(outputs["forward"], outputs["forward_transient"])
        if valid is not None:
            assert not outputs["forward"][1, 1:].any()
    target.reset(0)
    target.add_rows([[3, 4, 5]])
    kept = target.forward(torch.tensor([[7]]))
    kept_then = kept.clone()
    target.commit_all()
    first = target.forward_transient(torch.tensor([[8]]))
    seen = first.clone()
    target.commit_all()
    target.forward_transient(torch.tensor([[9]]))
    target.commit_all()
    assert not torch.equal(first, seen)  # overwritten by the next call
    assert torch.equal(kept, kept_then)  # forward's are the caller's


def test_transient_logits_of_ragged_blocks_in_turn_are_forwards(target):
    """The reused buffer zeroes only the slots earlier calls wrote: ragged blocks of other shapes one after the
    other (wide, narrow, the rows swapped, one row empty) give ``forward``'s logits each time, zeros included."""
    blocks = [torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]]), torch.tensor([[7, 8], [9, 10]]),
              torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]])]
    valids = [torch.tensor([[True] * 4, [True, False, False, False]]), torch.tensor([[True, False], [True, True]]),
              torch.tensor([[True, True, True], [False, False, False]]), torch.tensor([[True, False, False, False]] * 2)]
    expected = []
    target.reset(0)
    target.add_rows([[3, 4, 5], [6, 5, 4]])
    for block, valid in zip(blocks, valids):
        expected.append(target.forward(block, valid))
        target.keep_block(torch.full(block.shape, -1))
    for block, valid, want in zip(blocks, valids, expected):
        got = target.forward_transient(block, valid)
        assert torch.equal(got, want)
        assert not got[~valid].any()
        target.keep_block(torch.full(block.shape, -1))


def test_block_logits_equal_single_steps(target):
    """A k-token block's logits equal those of k one-token steps (the measured flip rate on the real model
    is in the manual; on this float32 model they agree to 1e-4), and rolling back a rejected tail leaves
    the cache as if it had never been there."""
    prompt, block = [3, 4, 5, 6], [7, 8, 9, 10, 11]
    target.reset(0)
    target.add_rows([prompt])
    together = target.forward(torch.tensor([block]))
    target.keep_block(torch.tensor([[0, 1]]))  # keep 2 of 5
    assert target.lengths.tolist() == [len(prompt) + 2]
    after_rollback = target.forward(torch.tensor([[12]]))
    target.commit_all()
    target.reset(0)
    target.add_rows([prompt])
    singles = []
    for token in block:
        singles.append(target.forward(torch.tensor([[token]])))
        target.commit_all()
    assert (together - torch.cat(singles, 1)).abs().max().item() < 1e-4
    target.truncate(torch.tensor([len(prompt) + 2]))
    fresh = target.forward(torch.tensor([[12]]))
    assert (after_rollback - fresh).abs().max().item() < 1e-4


def test_weights_let_into_the_repacked_kernels_compute_the_same_logits(tiny_gguf):
    """``repack=True`` (fast kernels) lets llama.cpp repack the weights for its CPU kernels; on this float32 model
    (which llama.cpp does not repack) a block's logits are those of the weights kept as they are."""
    path, _, tokenizer = tiny_gguf
    repacked = LlamaCppLM(path, tokenizer, context=64, max_rows=1, threads=1, repack=True, kernels="fast")
    kept = LlamaCppLM(path, tokenizer, context=64, max_rows=1, threads=1, kernels="fast")
    logits = {}
    for name, lm in (("no repack", kept), ("repack", repacked)):
        lm.reset(0)
        lm.add_rows([[3, 4, 5]])
        logits[name] = lm.forward(torch.tensor([[6, 7, 8]]))[0]
    assert (logits["repack"] - logits["no repack"]).abs().max() < 1e-5


def test_rows_join_and_leave_with_their_own_caches(target):
    """Rows added, removed and added again each see only their own tokens."""
    a, b, c = [3, 4, 5], [50, 60, 70, 80], [9, 9]

    def alone(prefix, token):
        target.reset(0)
        target.add_rows([prefix])
        return target.forward(torch.tensor([[token]]))[0, 0]

    expected = {name: alone(prefix, 11) for name, prefix in (("a", a), ("b", b), ("c", c))}
    target.reset(0)
    target.add_rows([a, b])
    target.remove_rows([0])
    target.add_rows([c])
    logits = target.forward(torch.tensor([[11], [11]]))
    assert (logits[0, 0] - expected["b"]).abs().max() < 1e-4
    assert (logits[1, 0] - expected["c"]).abs().max() < 1e-4
    # the rows hold sequences 1 and 0 (c took the lowest free one) and go into the batch in that order: a ragged
    # block's logits still land on their own rows
    target.keep_block(torch.zeros(2, 0, dtype=torch.long))
    ragged = target.forward(torch.tensor([[11, 12], [11, 0]]), valid=torch.tensor([[1, 1], [1, 0]]))
    assert (ragged[0, 0] - expected["b"]).abs().max() < 1e-4 and (ragged[1, 0] - expected["c"]).abs().max() < 1e-4
    assert not ragged[1, 1].any()
    target.keep_block(torch.zeros(2, 0, dtype=torch.long))
    last = target.forward(torch.tensor([[11, 12], [11, 0]]), valid=torch.tensor([[1, 1], [1, 0]]), last_only=True)
    assert (last[1, 0] - expected["c"]).abs().max() < 1e-4


def test_rows_take_the_lowest_free_sequence_so_a_batch_runs_as_one(target):
    """A row that leaves from the middle splits a batch of one-token rows in two micro-batches (llama.cpp runs
    only consecutive sequences together); the next row to join fills the gap, and the batch is one again."""
    target.reset(0)
    target.add_rows([[3]] * 4)
    assert target.block_shapes([1] * 4) == [(4, 1)]
    target.remove_rows([1])
    assert target.block_shapes([1] * 3) == [(1, 1), (2, 1)]
    target.add_rows([[3]])
    assert target.block_shapes([1] * 4) == [(4, 1)]
    target.remove_rows([0, 2])
    target.add_rows([[3], [3]])
    assert target.block_shapes([1] * 4) == [(4, 1)]


@pytest.fixture(scope="module")
def shared_target(tiny_gguf):
    """The same model with the KV cache all rows share, which token trees need."""
    path, _, tokenizer = tiny_gguf
    return LlamaCppLM(path, tokenizer, context=256, max_rows=8, threads=1, shared_cache=True)


def test_trees_need_the_shared_cache(tiny_gguf):
    """A model with a cache stream per row (the default) refuses a token tree in one line; with fast kernels,
    reserving room for several candidates makes its cache a shared one, which takes it, and grants them all; one
    candidate leaves it as it is; exact kernels grant one candidate and keep a stream per row."""
    path, _, tokenizer = tiny_gguf
    exact = LlamaCppLM(path, tokenizer, context=256, max_rows=2, threads=1)
    assert exact.reserve_candidates(3) == 1 and not exact.shared_cache
    model = LlamaCppLM(path, tokenizer, context=256, max_rows=2, threads=1, kernels="fast")
    assert not model.shared_cache
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    model.add_rows([[3, 4, 5]])
    with pytest.raises(ConfigError, match="shared_cache=True"):
        model.forward(torch.tensor([[20, 21, 22]]), tree_mask=mask)
    assert model.reserve_candidates(1) == 1
    assert not model.shared_cache
    assert model.reserve_candidates(3) == 3
    assert model.shared_cache and model.lengths.tolist() == []
    model.add_rows([[3, 4, 5]])
    assert model.forward(torch.tensor([[20, 21, 22]]), tree_mask=mask).shape == (1, 3, model.vocab_size)


def test_block_shapes_follow_the_cache_layout(target, shared_target):
    """With a stream per row llama.cpp takes the same tokens from every row left (micro-batch by micro-batch);
    with a shared cache all the tokens go into one, priced as spread evenly over the rows."""
    target.reset(0)
    assert target.block_shapes([5, 2, 1, 1]) == [(4, 1), (2, 1), (1, 3)]
    assert target.block_shapes([3, 3, 3]) == [(3, 3)]
    assert shared_target.block_shapes([5, 2, 1, 1]) == [(4, 3)]
    assert shared_target.block_shapes([]) == [] and target.block_shapes([]) == []


def test_tree_block_sees_only_ancestors(shared_target):
    """A token tree (root, two children, a grandchild under the second) gives each node the logits of its
    own path as a chain, and keeping a path leaves the cache of that chain."""
    target = shared_target
    prompt = [3, 4, 5]
    tokens = torch.tensor([[20, 21, 22, 23]])  # 0 root; 1, 2 its children; 3 the child of 2
    mask = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], dtype=torch.bool)
    target.reset(0)
    target.add_rows([prompt])
    tree = target.forward(tokens, tree_mask=mask)
    target.keep_block(torch.tensor([[0, 2, 3]]))
    assert target.lengths.tolist() == [len(prompt) + 3]
    next_after_tree = target.forward(torch.tensor([[24]]))
    target.commit_all()
    target.reset(0)
    target.add_rows([prompt])
    path = target.forward(torch.tensor([[20, 22, 23, 24]]))
    target.commit_all()
    target.reset(0)
    target.add_rows([prompt])
    other = target.forward(torch.tensor([[20, 21]]))
    assert (tree[0, [0, 2, 3]] - path[0, :3]).abs().max() < 1e-4
    assert (tree[0, 1] - other[0, 1]).abs().max() < 1e-4
    assert (next_after_tree[0, 0] - path[0, 3]).abs().max() < 1e-4


@pytest.fixture(scope="module")
def plain(target):
    return [r.token_ids for r in SpeculativeEngine(target).generate_ids(PROMPTS, max_new_tokens=NEW_TOKENS,
                                                                        eos_token_ids=())]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", DRAFTER_NAMES)
def test_greedy_speculation_equals_plain_on_llamacpp(target, plain, name, batch):
    """Every model-free drafter, chains and trees, batch 1 and 4: token for token the backend's plain
    greedy output, and the drafts are used (some tokens accepted)."""
    drafter = model_free_drafters(plain)[name](batch)
    options = ([{"source": p + o} for p, o in zip(PROMPTS[:batch], plain[:batch])] if name in PER_REQUEST_SOURCE
               else None)
    results = run_requests(SpeculativeEngine(target, drafter), PROMPTS[:batch], options,
                           max_new_tokens=NEW_TOKENS, num_draft_tokens=4, eos_token_ids=(), draft_length="fixed")
    assert [tokens for tokens, _ in results] == plain[:batch]
    if name != "edit-prompt-source":
        assert sum(step.stats.accepted_tokens for _, step in results) > 0


def _exact_joint(lm, prompt: list[int], length: int, process) -> torch.Tensor:
    """Exact law ``[V] * length`` of the next ``length`` tokens under ``lm`` (any CausalLM), by enumeration."""
    vocab = lm.vocab_size
    prefixes, laws = [[]], []
    for _ in range(length):
        rows = []
        for start in range(0, len(prefixes), lm.max_rows):
            chunk = [prompt + p for p in prefixes[start:start + lm.max_rows]]
            lm.reset(0)
            lm.add_rows([c[:-1] for c in chunk])
            rows.append(process(lm.forward(torch.tensor([[c[-1]] for c in chunk]))[:, 0].double()))
        laws.append(torch.cat(rows))
        prefixes = [p + [t] for p in prefixes for t in range(vocab)]
    joint = laws[0][0]
    for probs in laws[1:]:
        joint = (joint.reshape(-1, 1) * probs.reshape(-1, vocab)).reshape(-1)
    return joint.reshape([vocab] * length)


# the tree's run takes ~100 s on 2 cores (20,000 requests through tree blocks); its parts run in the default
# suite: tree logits (test_tree_block_sees_only_ancestors), greedy trees (above), the shared tree rules'
# chi-square on the torch backend (test_drafters_model_free.py)
@pytest.mark.parametrize("drafter_name", ["prompt-lookup", pytest.param("prompt-lookup-tree", marks=pytest.mark.slow)])
def test_sampled_speculation_is_lossless_on_llamacpp(tmp_path, drafter_name):
    """Sampled outputs (T 0.7, top-k 8, top-p 0.9) with speculation follow the exact law of the GGUF model
    itself: N = 20,000 joint samples of 3 tokens over a 12-token vocabulary, chi-square p > 1e-3."""
    from genspec.drafters.prompt_lookup import PromptLookupDrafter

    path = tmp_path / "small.gguf"
    write_tiny_gguf(path, seed=0, layers=3, scale=8.0, vocab=12)
    # fast kernels: their shared cache verifies the tree (exact kernels verify its first chain only)
    lm = LlamaCppLM(path, None, context=16, max_rows=64, threads=1, kernels="fast")  # 64 rows: 313 batches
    assert_samples_follow_the_exact_law(lm, PromptLookupDrafter(num_candidates=3 if drafter_name.endswith("tree")
                                                                else 1))


def assert_samples_follow_the_exact_law(lm, drafter, samples: int = 20_000) -> None:
    """Speculative samples (T 0.7, top-k 8, top-p 0.9) of 3 tokens after a fixed prompt, ``samples`` of them, follow
    the exact joint law of ``lm`` (a 12-token vocabulary) enumerated: chi-square p > 1e-3, with drafts partly
    accepted (between 2% and 98% of the drafted tokens)."""
    sampling = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)
    prompt = [6, 4, 6, 7, 6, 9, 6]
    exact = _exact_joint(lm, prompt, 3, lambda logits: process_logits(logits, sampling))
    results = SpeculativeEngine(lm, drafter).generate_ids(
        [prompt] * samples, max_new_tokens=3, num_draft_tokens=3, temperature=0.7, top_k=8, top_p=0.9, seed=5,
        eos_token_ids=(), draft_length="fixed")
    counts = torch.zeros([lm.vocab_size] * 3)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0.02 < accepted / drafted < 0.98
    assert chi_square_pvalue(counts.numpy(), exact.numpy()) > 1e-3


def test_capacity_caps_the_running_batch(target):
    """More requests than the model's rows: the engine runs them max_rows at a time, same outputs."""
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(target.max_rows + 3)]
    engine = SpeculativeEngine(target)
    assert engine.max_batch_size == target.max_rows
    together = [r.token_ids for r in engine.generate_ids(prompts, max_new_tokens=6, eos_token_ids=())]
    alone = [SpeculativeEngine(target).generate_ids([p], max_new_tokens=6, eos_token_ids=())[0].token_ids
             for p in prompts[:3]]
    assert together[:3] == alone


def test_what_the_backend_cannot_do_is_refused(tiny_gguf, target, tmp_path):
    path, _, _ = tiny_gguf
    with pytest.raises(InputFileError, match="no GGUF model"):
        LlamaCppLM(tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(InputFileError, match="cannot load"):
        LlamaCppLM(tmp_path / "bad.gguf")
    with pytest.raises(ConfigError, match="final hidden states only"):  # heads: tests/test_llamacpp_heads.py
        target.add_rows([[3]], return_hidden=True, hidden_layers=(1,))
    # quantized, layer-skip (test_llamacpp_draft_model.py) and pruned (test_pruned_gguf.py) make GGUF copies
    with pytest.raises(ConfigError, match="torch"):
        genspec.build_drafter("early-exit", target)
    with pytest.raises(InputFileError, match="calibration file not found"):
        genspec.build_drafter("pruned", target, path=str(tmp_path / "plan.json"))


# ------------------------------------------------------------------------------- choosing the backend
def test_backend_resolution_and_refusals(tmp_path):
    from genspec.api import Backend, resolve_backend

    assert resolve_backend("model.gguf") is Backend.LLAMACPP
    assert resolve_backend(str(tmp_path)) is Backend.TORCH
    assert resolve_backend(None) is Backend.LLAMACPP  # llama-cpp-python is installed (this module's skip)
    assert resolve_backend(None, "torch") is Backend.TORCH
    with pytest.raises(ConfigError, match="GGUF file"):
        resolve_backend("model.gguf", "torch")
    with pytest.raises(ConfigError, match="runs a .gguf file"):
        resolve_backend(str(tmp_path), "llamacpp")
    with pytest.raises(ConfigError, match="unknown backend 'onnx'"):
        resolve_backend(None, "onnx")
    with pytest.raises(ConfigError, match="applies to the torch backend"):
        genspec.load_model("model.gguf", dtype="bfloat16")


def test_generate_cli_on_a_gguf_file(tiny_gguf, capsys):
    """``genspec generate --model FILE.gguf``: the llamacpp backend with the GGUF's own tokenizer (converted by
    transformers); greedy speculative text equals plain text; a missing file is one line, exit 2."""
    from genspec.cli import main

    path, _, _ = tiny_gguf
    outputs = []
    for drafter in ("none", "prompt-lookup"):
        assert main(["generate", "--model", str(path), "--prompt", "abcabcabcabc", "--max-new-tokens", "12",
                     "--drafter", drafter, "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["samples"][0]["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12
    assert main(["generate", "--model", str(path.parent / "missing.gguf"), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "missing.gguf" in err and "Traceback" not in err


def test_bench_on_a_gguf_file_runs_the_llamacpp_baselines(tiny_gguf, tmp_path):
    """``genspec bench`` on the llamacpp backend: plain, llamacpp-plain (the reference) and llamacpp-lookup
    run interleaved; greedy outputs of genspec's methods equal plain, and llama-cpp-python's own plain
    decoding gives the same tokens on this float32 model."""
    from genspec.cli import main

    path, _, _ = tiny_gguf
    out = tmp_path / "out"
    assert main(["bench", "--model", str(path), "--methods", "prompt-lookup,llamacpp-lookup:num_pred_tokens=4",
                 "--categories", "coding", "--num-prompts", "1", "--max-new-tokens", "12", "--repeats", "1",
                 "--raw", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["backend"] == "llamacpp"
    main_runs = {r["method"]: r for r in results["runs"] if r["phase"] == "main"}
    assert set(main_runs) == {"plain", "llamacpp-plain", "prompt-lookup", "llamacpp-lookup:num_pred_tokens=4"}
    assert all(r["error"] is None for r in main_runs.values())
    assert main_runs["prompt-lookup"]["matches_plain"] is True
    assert main_runs["llamacpp-plain"]["token_ids"] == main_runs["plain"]["token_ids"]
    assert main_runs["llamacpp-lookup:num_pred_tokens=4"]["matches_reference"] is True
    assert "vs llamacpp-plain" in (out / "report.md").read_text()


def test_llamacpp_lookup_takes_a_prompt_longer_than_its_batch(tiny_gguf):
    """llama-cpp-python's prompt lookup baseline decodes a prompt of 600 tokens (more than its 512-token batch,
    as the embedded model's rag and summarization prompts) and gives its plain decoding's greedy tokens."""
    from genspec.bench.llamacpp_baselines import LlamaCppDecoder
    from genspec.bench.methods import parse_methods

    path, _, _ = tiny_gguf
    prompt = [(7 * i) % 200 + 3 for i in range(600)]
    outputs = {}
    for spec in parse_methods("llamacpp-plain,llamacpp-lookup:num_pred_tokens=4", backend="llamacpp"):
        decoder = LlamaCppDecoder(spec, path, eos_token_ids=[], context=768, threads=1)
        outputs[spec.base] = decoder.decode(prompt, 8, SamplingConfig(), seed=0)["token_ids"]
    assert len(outputs["llamacpp-lookup"]) == 8
    assert outputs["llamacpp-lookup"] == outputs["llamacpp-plain"]


def test_bench_refuses_methods_of_the_other_backend(tiny_gguf, capsys):
    from genspec.cli import main

    path, _, _ = tiny_gguf
    assert main(["bench", "--model", str(path), "--methods", "hf-prompt-lookup", "--quick"]) == 2
    assert "needs --backend torch" in capsys.readouterr().err
    assert main(["bench", "--backend", "torch", "--methods", "llamacpp-lookup"]) == 2
    assert "needs --backend llamacpp" in capsys.readouterr().err


def test_load_times_every_width_a_draft_can_fill(tiny_gguf):
    """llama.cpp's verify cost is uneven in the block width, so ``genspec.load`` times one row's blocks of
    every width prompt lookup's drafts can fill (k = 8: 1 to 9 tokens) before the first request; asked not
    to, it leaves the costs to be measured as the engine runs. ``genspec serve`` measures more rows."""
    from genspec.serve.settings import ServerSettings
    from genspec.serve.worker import load_engine

    path, _, _ = tiny_gguf
    engine = genspec.load(str(path), drafter="prompt-lookup", max_batch_size=2)
    assert engine.target.uneven_verify_cost
    assert set(engine.costs.verify) == {(1, w) for w in range(1, 10)}
    assert genspec.load(str(path), drafter="prompt-lookup", measure_costs=False).costs.verify == {}
    served = load_engine(ServerSettings(model=str(path), max_batch_size=2, served_model_name="tiny"))
    assert set(served.costs.verify) == {(b, w) for b in (1, 2) for w in range(1, 10)}
    assert served.target.lengths.numel() == 0


def test_serve_on_a_gguf_file(tiny_gguf):
    """``genspec serve`` on the llamacpp backend (load_engine as the CLI calls it), over real HTTP on loopback:
    four concurrent greedy completions (rows as llama.cpp sequences in one batch, speculation on) each equal
    genspec's plain decoding of its prompt, and the server holds no row afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from test_serve import serving

    from genspec.serve.settings import ServerSettings
    from genspec.serve.worker import load_engine

    path, _, _ = tiny_gguf
    settings = ServerSettings(model=str(path), max_batch_size=4, measure_costs=False, served_model_name="tiny")
    engine = load_engine(settings)
    assert engine.target.backend == "llamacpp" and engine.max_batch_size == 4
    prompts = ["abcabcabcab", "hello hello hel", "xyz xyz xy", "12121212"]
    expected = [genspec.load(str(path), drafter="none").generate(p, max_new_tokens=16)[0].text for p in prompts]
    with serving(engine, settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=16,
                                                                       temperature=0).choices[0].text, prompts))
        assert texts == expected
        assert engine.target.num_rows == 0
