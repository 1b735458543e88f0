"""Self-speculation drafters (early exit, layer skip, int8 quantized, truncated vocabulary) and
hierarchical stacks: greedy equality with plain decoding and lossless sampling."""
from __future__ import annotations

import json

import pytest
import torch
from stats_helpers import lossless_pvalue
from tiny_models import early_exit_setup, tiny_gemma3, tiny_llama

import genspec
from genspec.drafters import DraftModelDrafter, PromptLookupDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError, InputFileError
from genspec.models import HFCausalLM, variants
from genspec.sampling import SamplingConfig

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [20, 21, 20, 21, 20]]


def self_drafters():
    subset = torch.arange(0, 48)
    return {
        "early-exit": lambda t: DraftModelDrafter(variants.early_exit(t, 1)),
        "layer-skip": lambda t: DraftModelDrafter(variants.layer_skip(t, [1])),
        "quantized": lambda t: DraftModelDrafter(variants.quantized(t)),
        "early-exit-truncated-vocab": lambda t: DraftModelDrafter(variants.early_exit(t, 2, vocab_subset=subset)),
        "quantized-truncated-vocab": lambda t: DraftModelDrafter(variants.quantized(t, vocab_subset=subset)),
        "confidence-threshold": lambda t: DraftModelDrafter(variants.early_exit(t, 2), confidence_threshold=0.3),
        "hierarchical": lambda t: DraftModelDrafter(variants.quantized(t), inner=PromptLookupDrafter()),
        "hierarchical-3": lambda t: DraftModelDrafter(
            variants.layer_skip(t, [1]), inner=DraftModelDrafter(variants.early_exit(t, 1), inner=PromptLookupDrafter())),
    }


@pytest.mark.parametrize("name", list(self_drafters()))
@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_greedy_equality(name, build):
    target = HFCausalLM(build(0, layers=3, dtype=torch.float32))
    plain = SpeculativeEngine(target).generate_ids(PROMPTS, max_new_tokens=20, eos_token_ids=())
    single = SpeculativeEngine(target, self_drafters()[name](target)).generate_ids(
        PROMPTS[:1], max_new_tokens=20, eos_token_ids=(), num_draft_tokens=4)
    batch = SpeculativeEngine(target, self_drafters()[name](target)).generate_ids(
        PROMPTS, max_new_tokens=20, eos_token_ids=(), num_draft_tokens=4)
    assert single[0].token_ids == plain[0].token_ids
    assert [r.token_ids for r in batch] == [p.token_ids for p in plain]


def test_variants_share_the_targets_weights():
    target = HFCausalLM(tiny_llama(0, layers=3))
    draft = variants.early_exit(target, 2)
    assert draft.num_layers == 2 and target.num_layers == 3
    assert draft.decoder.layers[0] is target.decoder.layers[0]
    assert draft.lm_head is target.lm_head


def test_early_exit_is_the_truncated_network():
    """Early exit at L equals running the first L layers then the final norm and head."""
    model = tiny_llama(0, layers=3)
    target = HFCausalLM(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    draft = variants.early_exit(target, 2)
    draft.reset(1)
    with torch.no_grad():
        hidden = model.model(ids, output_hidden_states=True).hidden_states[2]
        expected = model.lm_head(model.model.norm(hidden))
    assert torch.allclose(draft.forward(ids), expected, atol=1e-10)


SAMPLING = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)


@pytest.mark.parametrize("name, make, seed", [
    ("early-exit", lambda t: DraftModelDrafter(variants.early_exit(t, 1)), 21),
    ("layer-skip", lambda t: DraftModelDrafter(variants.layer_skip(t, [0, 2])), 22),
    ("truncated-vocab", lambda t: DraftModelDrafter(variants.early_exit(t, 1, vocab_subset=torch.arange(2, 9))), 23),
    ("hierarchical", lambda t: DraftModelDrafter(variants.layer_skip(t, [1]),
                                                 inner=DraftModelDrafter(variants.early_exit(t, 1))), 24),
    ("confidence-threshold", lambda t: DraftModelDrafter(variants.early_exit(t, 1), confidence_threshold=0.3), 26),
    ("hierarchical-confidence-threshold", lambda t: DraftModelDrafter(
        variants.layer_skip(t, [1]), confidence_threshold=0.3, inner=DraftModelDrafter(variants.early_exit(t, 1))), 27),
])
def test_lossless_sampling(name, make, seed):
    """Chi-square of the first 3 tokens' joint law vs the exact target law (T=0.7, top-k 8, top-p 0.9),
    N = 20,000, cells with expected count < 5 pooled, fail if p < 1e-3. With a confidence threshold the
    unsure token ends the draft and is drafted: left out, the drafted tokens were drawn from the law cut
    to its sure tokens while the verifier was given the whole law (both threshold cases failed so, p < 1e-3)."""
    pvalue, acceptance = lossless_pvalue(make, SAMPLING, seed=seed)
    assert acceptance < 0.98
    assert pvalue > 1e-3


def test_lossless_sampling_quantized():
    """Same test (N = 20,000, p > 1e-3) for the int8 self-draft on a float32 target."""
    pvalue, _ = lossless_pvalue(lambda t: DraftModelDrafter(variants.quantized(t)), SAMPLING, seed=25,
                                dtype=torch.float32)
    assert pvalue > 1e-3


def test_bad_layers():
    target = HFCausalLM(tiny_llama(0, layers=3))
    with pytest.raises(ConfigError, match="out of range"):
        variants.layer_skip(target, [3])
    with pytest.raises(ConfigError, match="every layer"):
        variants.layer_skip(target, [0, 1, 2])
    with pytest.raises(ConfigError, match="exit layer"):
        variants.early_exit(target, 0)


def test_layer_skip_file_round_trip(tmp_path):
    target = HFCausalLM(tiny_llama(0, layers=3))
    path = tmp_path / "skip.json"
    path.write_text(json.dumps({"skip": [1]}))
    drafter = genspec.build_drafter("layer-skip", target, skip=str(path))
    assert drafter.model.num_layers == 2
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(InputFileError):
        genspec.build_drafter("layer-skip", target, skip=str(tmp_path / "bad.json"))


def test_draft_vocab_file(tmp_path):
    target = HFCausalLM(tiny_llama(0, layers=3))
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps({"token_ids": list(range(10, 30))}))
    drafter = genspec.build_drafter("early-exit", target, draft_vocab_file=str(path), exit_layer=1)
    drafter.model.reset(1)
    logits = drafter.model.forward(torch.tensor([[5, 6]]))
    assert torch.isinf(logits[..., :10]).all() and torch.isfinite(logits[..., 10:30]).all()
    path.write_text("{}")
    with pytest.raises(InputFileError):
        genspec.build_drafter("early-exit", target, draft_vocab_file=str(path))


@pytest.mark.parametrize("build, tolerance", [(tiny_llama, 1e-9), (tiny_gemma3, 1e-5)])
def test_early_exit_prefix_equals_a_full_verify_pass(build, tolerance):
    """KV reuse: the target fed the early-exit draft's first layers (keys, values, hidden states at
    the exit) gives the logits of a full pass, and its cache stays exact for later steps. float64
    (Gemma 3's RMSNorm runs in float32, hence its looser tolerance)."""
    model = build(0, layers=3)
    prompt, drafts = [5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]
    reused, fresh, draft = early_exit_setup(model, 2, prompt, drafts)
    block = torch.tensor([[prompt[-1]] + drafts])
    valid = torch.ones_like(block, dtype=torch.bool)
    prefix = draft.prefix_for(reused, torch.tensor([len(prompt) - 1]), valid)
    assert prefix is not None and prefix.num_layers == 2
    assert torch.allclose(reused.forward(block, valid, prefix=prefix), fresh.forward(block, valid), atol=tolerance)
    keep = torch.tensor([[0, 1, -1, -1]])  # one draft accepted
    for target in (reused, fresh):
        target.keep_block(keep)
    after = torch.tensor([[20, 21]])
    assert torch.allclose(reused.forward(after), fresh.forward(after), atol=tolerance)


def test_early_exit_prefix_needs_held_positions():
    target = HFCausalLM(tiny_llama(0, layers=3))
    draft = variants.early_exit(target, 1)
    draft.reset(1)
    draft.forward(torch.tensor([[5, 6, 7]]))
    draft.commit_all()
    assert draft.prefix_for(target, torch.tensor([2]), torch.ones(1, 2, dtype=torch.bool)) is None  # 3 not held
    assert draft.prefix_for(target, torch.tensor([1]), torch.ones(1, 2, dtype=torch.bool)) is not None
    other = HFCausalLM(tiny_llama(0, layers=3))  # another model: the draft's layers are not its layers
    assert not draft.shares_prefix_with(other) and draft.prefix_for(other, torch.tensor([1]),
                                                                      torch.ones(1, 2, dtype=torch.bool)) is None


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_early_exit_engine_reuses_the_draft_layers(build, monkeypatch):
    """The engine's verify pass takes the early-exit draft's layers (the target runs only the rest),
    for single rows and ragged batches, and greedy output still equals plain decoding."""
    target = HFCausalLM(build(0, layers=3, dtype=torch.float32))
    plain = SpeculativeEngine(target).generate_ids(PROMPTS, max_new_tokens=24, eos_token_ids=())
    used = []
    original = HFCausalLM.forward

    def spy(self, tokens, valid=None, tree_mask=None, last_only=False, prefix=None, return_hidden=False,
            hidden_layers=()):
        if self is target and not last_only:  # verify passes (the prefill is last_only)
            used.append((tokens.shape[1] > 1, prefix is not None))
        return original(self, tokens, valid, tree_mask, last_only, prefix, return_hidden, hidden_layers)

    monkeypatch.setattr(HFCausalLM, "forward", spy)
    engine = SpeculativeEngine(target, DraftModelDrafter(variants.early_exit(target, 2)))
    for prompts in (PROMPTS[:1], PROMPTS):
        used.clear()
        out = engine.generate_ids(prompts, max_new_tokens=24, eos_token_ids=(), num_draft_tokens=3,
                                  draft_length="fixed")
        assert [r.token_ids for r in out] == [p.token_ids for p in plain[:len(prompts)]]
        assert len(used) >= 5 and all(drafted == reused for drafted, reused in used)  # every pass with drafts
