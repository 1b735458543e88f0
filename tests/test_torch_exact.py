"""The torch backend's exact models (``HFCausalLM(..., exact=True)``): a position's logits bitwise equal as a
one-token step, inside a block and beside other rows (Llama, and Gemma 3's sliding-window layers); greedy
speculation giving plain decoding's tokens and log-probabilities bit for bit; a request alone and beside others
getting the same; the same function as the default model's; ``batch_invariant`` saying which model is exact."""
from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model, tiny_gemma3, tiny_llama

from genspec.drafters.prompt_lookup import PromptLookupDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.models.exact_attention import exact_attention

BLOCK = [17, 40, 41, 42, 7, 3, 100, 9, 55, 56, 57, 58, 12, 13, 14, 15]


def _prefixes(rows: int) -> list[list[int]]:
    """``rows`` random prefixes of 30..119 tokens (longer than the tiny Gemma 3's sliding window of 6)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(30, 120, (rows,), generator=g)
    return [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in lengths]


def _compared(lm: HFCausalLM) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Row 0's logits of ``BLOCK``'s tokens computed in blocks of 2..16 tokens and as row 0 of 16 rows of other
    lengths (1 and 4 tokens each), each beside the same positions' logits from one-token steps of row 0 alone."""
    prefixes = _prefixes(16)

    def steps() -> torch.Tensor:
        lm.reset(0)
        lm.add_rows([prefixes[0]])
        out = []
        for token in BLOCK:
            out.append(lm.forward(torch.tensor([[token]]))[0, 0].clone())
            lm.commit_all()
        return torch.stack(out)

    alone = steps()
    compared = [("the same steps again", steps(), alone)]
    for k in range(2, len(BLOCK) + 1):
        lm.reset(0)
        lm.add_rows([prefixes[0]])
        compared.append((f"a block of {k}", lm.forward(torch.tensor([BLOCK[:k]]))[0], alone[:k]))
    others = [[(token + 7 * row) % 240 + 5 for token in BLOCK] for row in range(16)]
    others[0] = BLOCK
    for width in (1, 4):
        lm.reset(0)
        lm.add_rows(prefixes)
        compared.append((f"row 0 of 16, {width} tokens each",
                         lm.forward(torch.tensor([tokens[:width] for tokens in others]))[0], alone[:width]))
    return compared


@pytest.mark.parametrize("build", [lambda: tiny_llama(0, vocab=256, dtype=torch.float32, context=512),
                                   lambda: tiny_gemma3(0, vocab=256, dtype=torch.float32)], ids=["llama", "gemma3"])
def test_exact_logits_are_bitwise_equal_in_steps_blocks_and_batches(build):
    """Bitwise, where the default model's agree to about 1e-7 (test_models.py's float32 test): the tiny Gemma 3's
    sliding window (6 keys) is far shorter than the prefixes, so a block's queries see windows that start at
    different keys."""
    lm = HFCausalLM(build(), exact=True)
    for what, got, expected in _compared(lm):
        assert torch.equal(got, expected), f"{what}: max |difference| {(got - expected).abs().max().item():.3g}"


@pytest.mark.parametrize("build", [lambda: tiny_llama(0, vocab=256, dtype=torch.float32, context=512),
                                   lambda: tiny_gemma3(0, vocab=256, dtype=torch.float32)], ids=["llama", "gemma3"])
def test_an_exact_model_computes_the_default_models_function(build):
    """The same logits as the default model to float32 rounding, through genspec's cache (blocks after a prefill,
    rows of other lengths) and through a plain transformers forward of the model itself."""
    default, exact = HFCausalLM(build()), HFCausalLM(build(), exact=True)
    prefixes = _prefixes(4)
    block = torch.tensor([BLOCK[:5]] * 4)
    outs = []
    for lm in (default, exact):
        lm.reset(0)
        lm.add_rows(prefixes)
        outs.append(lm.forward(block))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5
    ids = torch.tensor([prefixes[0][:30], prefixes[1][:30]])
    with torch.no_grad():
        plain = [lm.model(ids).logits for lm in (default, exact)]
    assert (plain[0] - plain[1]).abs().max().item() < 1e-5


def _engine_runs(target, prompts, drafter=None) -> tuple[list[tuple[list[int], list[float]]], int]:
    """Each prompt's greedy tokens and their log-probabilities, and the draft tokens accepted in all."""
    results = SpeculativeEngine(target, drafter).generate_ids(prompts, max_new_tokens=40, eos_token_ids=(), logprobs=0)
    return ([(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in results],
            sum(r.stats.accepted_tokens for r in results))


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [20, 21, 20, 21, 20]]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_gives_plain_decodings_tokens_and_logprobs_bit_for_bit(batch):
    """Prompt lookup's drafts verified in blocks, against one-token plain steps: the same tokens, and the same
    log-probabilities to the bit (they come from the verify blocks' logits), alone and in a batch of 4."""
    target = HFCausalLM(tiny_llama(0, vocab=256, dtype=torch.float32, context=512), exact=True)
    plain, _ = _engine_runs(target, PROMPTS[:batch])
    drafted, accepted = _engine_runs(target, PROMPTS[:batch], PromptLookupDrafter())
    assert drafted == plain
    assert accepted > 0  # drafts were verified in blocks (their widths follow measured times) and kept


def test_a_request_alone_and_beside_others_gets_the_same_tokens_and_logprobs():
    target = HFCausalLM(tiny_gemma3(0, vocab=256, dtype=torch.float32), exact=True)
    for drafter in (None, PromptLookupDrafter()):
        alone, _ = _engine_runs(target, PROMPTS[:1], drafter)
        beside, _ = _engine_runs(target, PROMPTS, drafter)
        assert beside[0] == alone[0]


def test_batch_invariant_says_whether_a_torch_model_is_exact(tmp_path):
    assert not HFCausalLM(tiny_llama(0)).batch_invariant
    assert HFCausalLM(tiny_llama(0), exact=True).batch_invariant
    save_tiny_model(tmp_path)
    assert HFCausalLM.from_pretrained(tmp_path, exact=True).batch_invariant
    assert not HFCausalLM.from_pretrained(tmp_path).batch_invariant
    with pytest.raises(ConfigError, match="fast_kernels"):
        HFCausalLM(tiny_llama(0), fast_kernels=False, exact=True)


def test_kernels_pick_a_torch_models_exactness(tmp_path):
    """``genspec.load_model(..., kernels=...)`` on the torch backend: exact makes the exact model, auto (the
    default) and fast the default one; exact-tiled, llama.cpp's, is refused with one line."""
    import genspec

    save_tiny_model(tmp_path)
    assert genspec.load_model(str(tmp_path), backend="torch", kernels="exact").batch_invariant
    for kernels in ("auto", "fast"):
        assert not genspec.load_model(str(tmp_path), backend="torch", kernels=kernels).batch_invariant
    assert not genspec.load_model(str(tmp_path), backend="torch").batch_invariant
    with pytest.raises(ConfigError, match="exact-tiled are llama.cpp's"):
        genspec.load_model(str(tmp_path), backend="torch", kernels="exact-tiled")


def test_exact_attention_soft_caps_scores_and_refuses_biases():
    """Gemma 2's attention soft cap, with grouped-query heads and a causal mask: eager attention's result to
    float32 rounding; a mask that adds biases (not only 0 and the lowest value) is refused."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, 7, 16, generator=g) for h in (4, 2, 2))
    unseen = ~torch.ones(7, 7, dtype=torch.bool).tril()
    mask = torch.zeros(2, 1, 7, 7).masked_fill(unseen, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim, module.training = 2, 16, False
    expected, _ = eager_attention_forward(module, query, key, value, mask, scaling=0.25, softcap=3.0)
    got, _ = exact_attention(module, query, key, value, mask, scaling=0.25, softcap=3.0)
    assert (got - expected).abs().max().item() < 1e-5
    with pytest.raises(ConfigError, match="biases"):
        exact_attention(module, query, key, value, mask + 0.5, scaling=0.25)
