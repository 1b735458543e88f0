"""The Hugging Face adapter: exact logits against a pristine transformers model, its KV cache (rollback,
tree blocks), loading errors, the LM head and linear kernels."""
from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model, tiny_gemma3, tiny_llama

from genspec.errors import ContextLengthError, InputFileError
from genspec.models import HFCausalLM
from genspec.models.hf import TransposedLinear


class FakeClock:
    """A clock read twice per timed call: the second reading is ``duration`` later."""

    def __init__(self):
        self.now, self.duration, self.readings = 0.0, 0.0, 0

    def __call__(self):
        self.readings += 1
        if self.readings % 2 == 0:
            self.now += self.duration
        return self.now


# Gemma 3's RMSNorm computes in float32 even for float64 inputs (``x.float()``), so last-bit differences
# of the float64 products (another BLAS kernel) come out at float32 rounding there: 1e-5, not 1e-10.
@pytest.mark.parametrize("build, tolerance", [(tiny_llama, 1e-10), (tiny_gemma3, 1e-5)])
def test_adapter_logits_equal_pristine_transformers_model(build, tolerance):
    pristine = build(0)
    adapted = HFCausalLM(build(0))
    assert any(isinstance(m, TransposedLinear) for m in adapted.model.modules())
    ids = torch.randint(3, 64, (3, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = pristine(ids).logits
    adapted.reset(3)
    out = adapted.forward(ids[:, :17])
    adapted.commit_all()
    out = torch.cat([out, adapted.forward(ids[:, 17:])], dim=1)
    assert torch.allclose(out, reference, atol=tolerance, rtol=0)


def test_last_only_logits():
    model = HFCausalLM(tiny_llama(0))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    model.reset(2)
    last = model.forward(ids, valid, last_only=True)
    model.reset(2)
    full = model.forward(ids, valid)
    assert torch.allclose(last[0, 0], full[0, 3]) and torch.allclose(last[1, 0], full[1, 1])


def test_kv_rollback_matches_fresh_prefill():
    """Logits after rollback + re-feed equal a fresh prefill (float64: 1e-9; Gemma 3, whose RMSNorm
    computes in float32 whatever the input dtype: 1e-5; a wrong rollback is off by ~0.1)."""
    for build, tolerance in ((tiny_llama, 1e-9), (tiny_gemma3, 1e-5)):
        model = HFCausalLM(build(0))
        ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(0))
        fresh = HFCausalLM(build(0))
        fresh.reset(2)
        reference = fresh.forward(ids)
        model.reset(2)
        model.forward(ids[:, :10])
        model.commit_all()
        model.forward(ids[:, 10:18])  # a chain of 8 drafts, 3 kept in row 0, 6 in row 1
        model.keep_block(torch.tensor([[0, 1, 2, -1, -1, -1], [0, 1, 2, 3, 4, 5]]))
        model.truncate(torch.tensor([12, 15]))
        assert model.lengths.tolist() == [12, 15]
        refeed = torch.stack([ids[0, 12:20], ids[1, 15:23]])
        out = model.forward(refeed)
        assert torch.allclose(out[0], reference[0, 12:20], atol=tolerance, rtol=0)
        assert torch.allclose(out[1], reference[1, 15:23], atol=tolerance, rtol=0)


def test_tree_block_logits_match_each_branch():
    """A token tree in one pass gives each node the logits of its own branch."""
    model = HFCausalLM(tiny_llama(0))
    prefix = [5, 6, 7]
    model.reset(1)
    model.forward(torch.tensor([prefix[:-1]]))
    model.commit_all()
    # tree: 0=last(7) -> 1=(8) -> 3=(9); 0 -> 2=(10) -> 4=(11)
    block = torch.tensor([[7, 8, 10, 9, 11]])
    parents = [-1, 0, 0, 1, 2]
    mask = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    out = model.forward(block, tree_mask=mask.unsqueeze(0))[0]
    with torch.no_grad():
        branch_a = model.model(torch.tensor([prefix + [8, 9]])).logits[0, -3:]
        branch_b = model.model(torch.tensor([prefix + [10, 11]])).logits[0, -2:]
    assert torch.allclose(out[[0, 1, 3]], branch_a, atol=1e-9)
    assert torch.allclose(out[[2, 4]], branch_b, atol=1e-9)


def test_from_pretrained_round_trip(tmp_path):
    directory = save_tiny_model(tmp_path / "m", seed=3, dtype=torch.float64)
    loaded = HFCausalLM.from_pretrained(directory, dtype="float64")
    assert loaded.tokenizer is not None and loaded.vocab_size == len(loaded.tokenizer)
    pristine = tiny_llama(3, vocab=loaded.vocab_size)
    ids = torch.tensor([[1, 40, 41, 42]])
    loaded.reset(1)
    with torch.no_grad():
        assert torch.allclose(loaded.forward(ids), pristine(ids).logits, atol=1e-10)


def test_missing_model_directory(tmp_path):
    with pytest.raises(InputFileError, match="no model at"):
        HFCausalLM.from_pretrained(tmp_path / "nothing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(InputFileError):
        HFCausalLM.from_pretrained(tmp_path / "broken")


def test_context_overflow_is_a_clear_error():
    model = HFCausalLM(tiny_llama(0))  # context 256
    model.reset(1)
    with pytest.raises(ContextLengthError):
        model.forward(torch.zeros(1, 300, dtype=torch.long))


def test_a_two_row_lm_head_takes_the_chunked_kernel_where_there_is_no_packed_one():
    """W @ x.T cost 2.3x the one-row step for two rows on the Intel Xeon VM, more than for 3-9 rows
    (benchmarks/costs/verify_width_cost.py); without oneDNN's packed GEMM (a float64 head here) a 2-token verify
    block must take the chunked bmm, as one row does."""
    from genspec.kernels import LMHead

    head = LMHead(torch.randn(300, 8, dtype=torch.float64))
    assert head.kernels == ("gemm", "chunked")
    assert [head.default_kernel(rows) for rows in (1, 2, 3, 12, 13, 63)] == ["chunked", "chunked", "gemm", "gemm", "chunked", "chunked"]
    assert head.default_kernel(64) == head.default_kernel(2048) == "gemm"  # a training batch: one GEMM
    assert not head.tune and [head.kernel(rows) for rows in (1, 2, 3)] == ["chunked", "chunked", "gemm"]


def test_a_float32_cpu_head_takes_the_packed_gemm_without_gradients_and_stays_exact():
    """oneDNN's packed GEMM is the small heads' kernel for every row count (module docstring of
    genspec.kernels); results are the same products up to summation order (fp32, 1e-5), a gradient
    goes through the differentiable GEMM and is right, and a head copied after use still computes."""
    import copy

    from genspec.kernels import LMHead

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 8, generator=generator)
    head = LMHead(weight)
    assert head.kernels == ("gemm", "packed") and not head.tune
    assert [head.kernel(rows) for rows in (1, 2, 3, 16, 64)] == ["packed"] * 5
    for rows in (1, 2, 3, 16, 64):
        hidden = torch.randn(rows, 8, generator=generator)
        assert torch.allclose(head(hidden), hidden @ weight.T, atol=1e-5, rtol=0)
    leaf = torch.randn(5, 8, generator=generator, requires_grad=True)
    head(leaf).square().sum().backward()
    assert torch.allclose(leaf.grad, 2 * (leaf.detach() @ weight.T) @ weight, atol=1e-3, rtol=1e-5)
    copied = copy.deepcopy(head)
    hidden = torch.randn(4, 8, generator=generator)
    assert torch.allclose(copied(hidden), hidden @ weight.T, atol=1e-5, rtol=0)


@pytest.mark.parametrize("in_hardware", [True, False])
def test_a_bfloat16_head_and_linear_pack_only_where_onednn_runs_bfloat16_in_hardware(monkeypatch, in_hardware):
    """bfloat16 weights take oneDNN's packed GEMM where the CPU runs bfloat16 natively (AVX512-BF16 or AMX:
    the embedded head in 16 ms against 29 ms packed float32, benchmarks/costs/low_precision_cost.py), else the
    BLAS kernels; either way the product is the float32 one rounded to bfloat16 (within 2 bfloat16 ulps)."""
    import genspec.kernels as kernels
    from genspec.kernels import LMHead, packable

    monkeypatch.setattr(kernels, "bf16_packable", lambda: in_hardware)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 16, generator=generator).bfloat16()
    assert packable(weight) is in_hardware and packable(weight.float())
    head = LMHead(weight)
    assert head.kernels == (("gemm", "packed") if in_hardware else ("gemm", "chunked"))
    linear = torch.nn.Linear(16, 7).bfloat16()
    layer = TransposedLinear(linear)
    for rows in (1, 2, 3, 9):
        hidden = torch.randn(rows, 16, generator=generator).bfloat16()
        exact = hidden.double() @ weight.double().T
        assert head(hidden).dtype == torch.bfloat16
        assert torch.allclose(head(hidden).double(), exact, rtol=2 ** -7, atol=1e-2)
        with torch.no_grad():
            assert layer.kernel(hidden) == ("packed" if in_hardware and rows >= 3 else "gemm")
            expected = hidden.double() @ linear.weight.double().T + linear.bias.double()
            assert torch.allclose(layer(hidden).double(), expected, rtol=2 ** -7, atol=1e-2)


def test_a_transposed_linear_packs_from_three_rows_and_repacks_after_its_weight_changes():
    """Untimed, 1-2 rows take W @ x.T, 3 or more the packed copy; a weight updated in place (a training step, a
    loaded state dict) is packed again, a deep copy packs its own, and autograd never meets the packed op."""
    import copy

    linear = torch.nn.Linear(24, 7)
    layer = TransposedLinear(linear)
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert [layer.kernel(x[:rows]) for rows in (1, 2, 3, 5)] == ["gemm", "gemm", "packed", "packed"]
        assert torch.allclose(layer(x), linear(x), atol=1e-5, rtol=0)
        linear.weight.mul_(-2.0)
        assert torch.allclose(layer(x), linear(x), atol=1e-5, rtol=0)
        copied = copy.deepcopy(layer)
        copied.weight.add_(1.0)
        assert torch.allclose(copied(x), x @ copied.weight.T + copied.bias, atol=1e-5, rtol=0)
        assert torch.allclose(layer(x), linear(x), atol=1e-5, rtol=0)
    assert layer.kernel(x) == "gemm"  # the weight asks for a gradient
    layer(x).sum().backward()
    assert torch.allclose(linear.weight.grad, x.sum(0).expand(7, -1), atol=1e-5, rtol=0)
    assert layer.kernel(torch.randn(5, 24, dtype=torch.float64)) == "gemm"


def test_a_large_lm_head_keeps_the_kernel_that_timed_faster_for_each_row_count():
    """The kernel ranking differs between CPUs (2 rows: bmm 32 ms against W @ x.T 21 ms on the EPYC VM,
    the reverse on the Intel one), so a tuned head alternates both kernels on a row count's first calls and
    keeps the faster; every call returns the exact product. A fake clock makes the gemm faster at 1 row
    (computed as two) and at 2 rows, and the bmm faster at 5."""
    from genspec.kernels import TUNE_TRIALS, LMHead

    clock = FakeClock()
    weight = torch.randn(2100, 16, dtype=torch.float64)
    head = LMHead(weight, tune=True, clock=clock)
    speed = {(1, "gemm"): 1.0, (1, "chunked"): 2.0, (2, "gemm"): 1.0, (2, "chunked"): 3.0,
             (5, "gemm"): 4.0, (5, "chunked"): 2.0}
    seen: dict[int, list[str]] = {1: [], 2: [], 5: []}
    for _ in range(2 * TUNE_TRIALS + 3):
        for rows in (1, 2, 5):
            kernel = head.kernel(rows)
            seen[rows].append(kernel)
            clock.duration = speed[(rows, kernel)]
            hidden = torch.randn(rows, 16, dtype=torch.float64)
            assert torch.allclose(head(hidden), hidden @ weight.T, atol=1e-12, rtol=0)
    assert head.chosen() == {1: "gemm", 2: "gemm", 5: "chunked"}
    for rows in (1, 2, 5):  # both kernels timed TUNE_TRIALS times, then only the winner, untimed
        assert sorted(seen[rows][:2 * TUNE_TRIALS]) == sorted(head.kernels * TUNE_TRIALS)
        assert set(seen[rows][2 * TUNE_TRIALS:]) == {head.chosen()[rows]}
    assert clock.readings == 3 * 2 * 2 * TUNE_TRIALS


def test_a_decoders_linears_share_one_kernel_choice_timed_over_whole_passes():
    """The decoder's linears rank differently on two CPUs (1 row: F.linear 19 ms against W @ x.T 60 ms on
    the Intel VM, the reverse order on the EPYC), so they share a KernelTuner timed around a whole pass:
    every linear of a pass takes the kernel under trial, and the fastest pass's kernel is kept for that
    row count. A fake clock makes F.linear fastest at 1 row and the packed GEMM at 5; every product stays
    exact; row counts above LINEAR_TUNE_MAX_ROWS keep the fixed choice, untimed."""
    from genspec.kernels import TUNE_TRIALS, KernelTuner
    from genspec.models.hf import LINEAR_TUNE_MAX_ROWS, linear_kernels

    generator = torch.Generator().manual_seed(0)
    first, second = torch.nn.Linear(24, 16), torch.nn.Linear(16, 7)
    fixed = linear_kernels([first.weight, second.weight], tune=False)
    clock = FakeClock()
    tuner = KernelTuner(fixed.kernels, fixed.default, tune=True, clock=clock, max_rows=LINEAR_TUNE_MAX_ROWS)
    layers = [TransposedLinear(first, tuner), TransposedLinear(second, tuner)]
    assert tuner.kernels == ("linear", "gemm", "packed")
    speed = {1: {"linear": 1.0, "gemm": 3.0, "packed": 2.0}, 5: {"linear": 4.0, "gemm": 5.0, "packed": 2.0}}
    passes: dict[int, list[list[str]]] = {1: [], 5: []}

    def one_pass(x):
        kernels = [layer.kernel(x) for layer in layers]
        out = layers[1](layers[0](x))
        return kernels, out

    with torch.no_grad():
        for _ in range(3 * TUNE_TRIALS + 2):
            for rows in (1, 5):
                x = torch.randn(rows, 24, generator=generator)
                clock.duration = speed[rows][tuner.kernel(rows)]
                kernels, out = tuner.run(rows, lambda _kernel: one_pass(x))
                passes[rows].append(kernels)
                assert torch.allclose(out, second(first(x)), atol=1e-5, rtol=0)
        assert tuner.chosen() == {1: "linear", 5: "packed"}
        for rows in (1, 5):  # each pass ran one kernel in all its layers; each kernel timed TUNE_TRIALS times
            assert all(len(set(kernels)) == 1 for kernels in passes[rows])
            trials = [kernels[0] for kernels in passes[rows][:3 * TUNE_TRIALS]]
            assert sorted(trials) == sorted(tuner.kernels * TUNE_TRIALS)
            assert {kernels[0] for kernels in passes[rows][3 * TUNE_TRIALS:]} == {tuner.chosen()[rows]}
        readings = clock.readings
        big = LINEAR_TUNE_MAX_ROWS + 1
        out = tuner.run(big, lambda _kernel: layers[0](torch.zeros(big, 24)))
        assert clock.readings == readings and big not in tuner.chosen() and tuner.kernel(big) == "packed"


def test_a_tuned_decoder_decodes_greedily_as_the_untuned_one():
    """With its linears' kernel timed (forced on for a tiny float32 model), the model picks a kernel for
    one-row steps and verify blocks and decodes greedily as with the fixed choice, token for token."""
    from genspec.drafters import PromptLookupDrafter
    from genspec.engine import SpeculativeEngine

    fixed = HFCausalLM(tiny_llama(0, dtype=torch.float32))
    tuned = HFCausalLM(tiny_llama(0, dtype=torch.float32))
    assert not fixed.linear_kernels.tune
    tuned.linear_kernels.tune = True
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12]]
    def tokens(model, drafter=None):
        results = SpeculativeEngine(model, drafter).generate_ids(prompts, max_new_tokens=40, eos_token_ids=())
        return [result.token_ids for result in results]

    plain = tokens(fixed)
    for drafter in (None, PromptLookupDrafter()):
        assert tokens(tuned, drafter) == plain
    assert 2 in tuned.linear_kernels.chosen()  # two rows' one-token steps, timed and chosen
    assert not fixed.linear_kernels.chosen()


@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 40, 70])
def test_lm_head_and_linear_kernels_are_exact_for_every_row_count(rows):
    """Each row count takes another kernel; all must be the plain product (float64, 1e-12)."""
    from genspec.kernels import CHUNK, LMHead

    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(CHUNK + 37, 24, dtype=torch.float64, generator=generator)  # padded last chunk
    bias = torch.randn(CHUNK + 37, dtype=torch.float64, generator=generator)
    hidden = torch.randn(2, rows, 24, dtype=torch.float64, generator=generator)
    for head_bias in (None, bias):
        expected = torch.nn.functional.linear(hidden, weight, head_bias)
        assert torch.allclose(LMHead(weight, head_bias)(hidden), expected, atol=1e-12, rtol=0)
        assert torch.allclose(LMHead(weight, head_bias)(hidden[:1, :1]), expected[:1, :1], atol=1e-12, rtol=0)
    linear = torch.nn.Linear(24, 7, dtype=torch.float64)
    x = torch.randn(rows, 24, dtype=torch.float64, generator=generator)
    assert torch.allclose(TransposedLinear(linear)(x), linear(x), atol=1e-12, rtol=0)
    assert torch.allclose(TransposedLinear(linear)(x[:1]), linear(x[:1]), atol=1e-12, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 5, 70])
def test_a_subset_head_gives_the_targets_own_logits_of_those_tokens_and_their_gradient(tiny_target, rows):
    """A draft head's truncated output layer (now an LMHead, whose kernel depends on the row count) is the
    target's logits restricted to the chosen ids, for a draft token (1 row), a tree level or a training
    batch, and stays differentiable in the hidden states (training reads it)."""
    generator = torch.Generator().manual_seed(rows)
    ids = torch.tensor([3, 7, 11, 40, 63])
    hidden = torch.randn(rows, tiny_target.config.hidden_size, dtype=tiny_target.dtype, generator=generator)
    expected = tiny_target.head(hidden)[:, ids]
    got = tiny_target.subset_head(ids)(hidden.clone().requires_grad_(True))
    assert torch.allclose(got, expected, atol=1e-10, rtol=0)
    leaf = hidden.clone().requires_grad_(True)
    tiny_target.subset_head(ids)(leaf).sum().backward()
    reference = hidden.clone().requires_grad_(True)
    tiny_target.head(reference)[:, ids].sum().backward()
    assert torch.allclose(leaf.grad, reference.grad, atol=1e-10, rtol=0)


def test_an_output_layer_with_a_bias_keeps_it_in_full_subset_and_truncated_heads():
    """A head bias is indexed by token id everywhere: in the full head, in a truncated-vocabulary model
    (whose other logits are -inf) and in a subset head taken from that truncated model, which still
    names tokens by their full-vocabulary ids."""
    from genspec.models import HFCausalLM

    model = tiny_llama(3)
    head = model.get_output_embeddings()
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True, dtype=head.weight.dtype)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight)
        model.lm_head.bias.copy_(torch.linspace(-5, 5, head.out_features, dtype=head.weight.dtype))
    full, truncated = HFCausalLM(model), HFCausalLM(model, vocab_subset=torch.tensor([60, 2, 9, 33]))
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reference = model.lm_head(hidden)  # (hidden: final states, already normed)
    assert torch.allclose(full.head(hidden), reference, atol=1e-10, rtol=0)
    kept = torch.tensor([2, 9, 33, 60])
    assert torch.allclose(truncated.head(hidden)[:, kept], reference[:, kept], atol=1e-10, rtol=0)
    ids = torch.tensor([9, 60])
    assert torch.allclose(truncated.subset_head(ids)(hidden), reference[:, ids], atol=1e-10, rtol=0)


def test_a_tuned_lm_head_times_its_kernels_again_after_64_calls_then_twice_as_many():
    """A pick made on the first few calls is not kept for ever: after RETUNE_FIRST calls of a row count its
    kernels are timed again (and a kernel that became slower is dropped), then after twice as many calls.
    A fake clock makes the gemm faster at first, the bmm faster afterwards."""
    from genspec.kernels import RETUNE_FIRST, TUNE_TRIALS, LMHead

    class FakeClock:  # read twice per timed call: the second reading is ``duration`` later
        def __init__(self):
            self.now, self.readings, self.speed = 0.0, 0, {"gemm": 1.0, "chunked": 3.0}
            self.kernel = None

        def __call__(self):
            self.readings += 1
            if self.readings % 2 == 0:
                self.now += self.speed[self.kernel]
            return self.now

    clock = FakeClock()
    weight = torch.randn(2100, 16, dtype=torch.float64)
    head = LMHead(weight, tune=True, clock=clock)
    kernels = []
    for call in range(2 * TUNE_TRIALS + RETUNE_FIRST + 2 * TUNE_TRIALS + 2 * RETUNE_FIRST + 1):
        if call == 2 * TUNE_TRIALS:
            clock.speed = {"gemm": 3.0, "chunked": 1.0}  # the machine changed after the first pick
        clock.kernel = head.kernel(1)
        kernels.append(clock.kernel)
        hidden = torch.randn(1, 16, dtype=torch.float64)
        assert torch.allclose(head(hidden), hidden @ weight.T, atol=1e-12, rtol=0)
    first = 2 * TUNE_TRIALS
    assert set(kernels[first:first + RETUNE_FIRST]) == {"gemm"}  # the first pick, kept for RETUNE_FIRST calls
    retimed = first + RETUNE_FIRST
    assert sorted(kernels[retimed:retimed + 2 * TUNE_TRIALS]) == sorted(["gemm", "chunked"] * TUNE_TRIALS)
    after = retimed + 2 * TUNE_TRIALS
    assert set(kernels[after:after + 2 * RETUNE_FIRST]) == {"chunked"} and head.chosen() == {}  # next timing due now
    assert clock.readings == 2 * (2 * 2 * TUNE_TRIALS + 1)


def test_float32_logits_of_a_row_alone_and_beside_others_differ_in_the_last_bits_only():
    """The torch backend in float32, bitwise where it can be and bounded where it cannot: a position's logits in
    one-token steps, in blocks of 2..16 tokens and as row 0 of 16 rows of other lengths (1 and 4 tokens each)
    agree within 1e-6 (MKL's float32 products sum a row in an order that depends on the number of rows: the
    last bits, about 1e-7 here), with the same argmax everywhere; the same computation twice is bitwise equal."""
    lm = HFCausalLM(tiny_llama(0, vocab=256, dtype=torch.float32, context=512))
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(30, 120, (16,), generator=g)]
    block = [17, 40, 41, 42, 7, 3, 100, 9, 55, 56, 57, 58, 12, 13, 14, 15]

    def steps() -> torch.Tensor:
        lm.reset(0)
        lm.add_rows([prefixes[0]])
        out = []
        for token in block:
            out.append(lm.forward(torch.tensor([[token]]))[0, 0].clone())
            lm.commit_all()
        return torch.stack(out)

    alone = steps()
    assert torch.equal(steps(), alone)
    compared = []
    for k in range(2, len(block) + 1):
        lm.reset(0)
        lm.add_rows([prefixes[0]])
        compared.append((lm.forward(torch.tensor([block[:k]]))[0], alone[:k]))
    others = [[(token + 7 * row) % 240 + 5 for token in block] for row in range(16)]
    others[0] = block
    for width in (1, 4):
        lm.reset(0)
        lm.add_rows(prefixes)
        compared.append((lm.forward(torch.tensor([tokens[:width] for tokens in others]))[0], alone[:width]))
    for got, expected in compared:
        assert (got - expected).abs().max().item() < 1e-6
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
