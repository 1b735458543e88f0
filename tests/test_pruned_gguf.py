"""Pruned GGUF copies (``--drafter pruned -O path=PLAN.json`` on a llama.cpp target) and hierarchical stacks of
GGUF self-drafts: the copy computes what the pruned torch copy of the same plan computes (healed weights
included), keeps the bytes of the rows it keeps, greedy output equal to plain output (batch 1 and 4), the
sampled law (chi-square), and plans it cannot write refused in one line."""
from __future__ import annotations

import json

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

import gguf  # noqa: E402
import torch  # noqa: E402
from test_llamacpp import assert_samples_follow_the_exact_law  # noqa: E402
from test_llamacpp_draft_model import PROMPTS, assert_plain_greedy_output_with_drafts_accepted  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

import genspec  # noqa: E402
from genspec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from genspec.drafters.hierarchical import HierarchicalDrafter  # noqa: E402
from genspec.errors import ConfigError, InputFileError  # noqa: E402
from genspec.models import HFCausalLM, variants  # noqa: E402
from genspec.models.llamacpp import LlamaCppLM  # noqa: E402
from genspec.models.pruned_gguf import pruned_gguf  # noqa: E402
from genspec.speculators.store import target_fingerprint  # noqa: E402

SEQUENCE = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
#: a plan for the 3-layer tiny Llama (4 query heads in 2 key/value groups, 128 MLP channels): layer 1 goes,
#: layer 0 keeps the first group and every other channel, layer 2 the second group and the odd channels
LAYERS, HEADS = [0, 2], [[0, 1], [2, 3], [2, 3]]
CHANNELS = [list(range(0, 128, 2)), list(range(64)), list(range(1, 128, 2))]


def _logits(model, sequence=SEQUENCE) -> torch.Tensor:
    model.reset(1)
    return model.forward(torch.tensor([sequence]))[0].float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, GGUF path, the same model in transformers): a float32 tiny Llama, 3 layers, 40 made-up tokens."""
    folder = tmp_path_factory.mktemp("pruned")
    model, _ = write_tiny_gguf(folder / "tiny.gguf", seed=0, layers=3, hidden=64, scale=4.0, vocab=40)
    return folder, folder / "tiny.gguf", HFCausalLM(model, None)


@pytest.mark.parametrize("heads, other", [
    (HEADS, [[2, 3], [0, 1], [0, 1]]),  # whole key/value groups: a key/value head goes with its query heads
    ([[0, 2], [1, 3], [1, 2]], [[1, 3], [0, 2], [0, 3]]),  # one query head of each group: every key/value head kept
])
def test_a_pruned_gguf_computes_what_the_pruned_torch_copy_computes(tiny, tmp_path, heads, other):
    """The GGUF copy cut by a plan (a layer left out, two of four query heads and half the channels of each kept
    layer), run by llama.cpp, gives the logits of the torch copy the same plan makes, as closely as the unpruned
    GGUF gives the unpruned model's (both float32: the backends' rounding), and far from a copy that kept other
    heads; with healed weights, the healed torch copy's. Made once: the same plan gives the same file."""
    _, path, target = tiny
    folder = tmp_path
    full = (_logits(target) - _logits(LlamaCppLM(path, None, context=64, max_rows=1))).abs().max()
    draft = variants.pruned(target, LAYERS, heads, CHANNELS)
    copy = pruned_gguf(path, LAYERS, heads, CHANNELS, cache=folder)
    lm = LlamaCppLM(copy, None, context=64, max_rows=1)
    assert lm.num_layers == 2
    expected = _logits(draft)
    assert (expected - _logits(lm)).abs().max() <= 2 * full + 1e-4
    assert (_logits(variants.pruned(target, LAYERS, other, CHANNELS)) - _logits(lm)).abs().max() > 20 * (full + 1e-4)
    assert pruned_gguf(path, LAYERS, heads, CHANNELS, cache=folder) == copy

    torch.manual_seed(1)
    with torch.no_grad():
        for weight in variants.own_weights(draft, target).values():
            weight.add_(0.05 * torch.randn_like(weight))
    variants.save_own_weights(folder / "healed.safetensors", draft, target)
    healed = pruned_gguf(path, LAYERS, heads, CHANNELS, weights=folder / "healed.safetensors", cache=folder)
    assert healed != copy
    healed_logits = _logits(draft)
    assert (healed_logits - expected).abs().max() > 20 * (full + 1e-4)  # the healing moved the logits
    assert (healed_logits - _logits(LlamaCppLM(healed, None, context=64, max_rows=1))).abs().max() <= 2 * full + 1e-4


def test_a_quantised_sources_kept_rows_keep_their_bytes(tmp_path):
    """A Q8_0 source: the query rows of the kept heads are the source's bytes (rows are whole blocks); the
    output projection, cut along its inputs, is requantised by llama.cpp to Q8_0."""
    path = tmp_path / "q8.gguf"
    write_tiny_gguf(path, seed=0, layers=3, hidden=64, scale=4.0, vocab=40, weight_type="Q8_0")
    copy = pruned_gguf(path, LAYERS, HEADS, CHANNELS, cache=tmp_path)
    source = {t.name: t for t in gguf.GGUFReader(path).tensors}
    cut = {t.name: t for t in gguf.GGUFReader(copy).tensors}
    head_dim = 16
    assert (cut["blk.1.attn_q.weight"].data == source["blk.2.attn_q.weight"].data[2 * head_dim:]).all()
    assert (cut["blk.0.ffn_up.weight"].data == source["blk.0.ffn_up.weight"].data[0::2]).all()
    kinds = {gguf.GGMLQuantizationType(t.tensor_type).name for name, t in cut.items() if len(t.shape) >= 2}
    assert kinds == {"Q8_0"}
    assert list(cut["blk.0.attn_output.weight"].shape) == [32, 64]  # 2 heads of 16 inputs, 64 outputs


def _plan_file(folder, target, layers=LAYERS, heads=HEADS, channels=CHANNELS, **extra):
    plan = folder / "plan.json"
    plan.write_text(json.dumps({"layers": layers, "heads": heads, "channels": channels,
                                "fingerprint": target_fingerprint(target), **extra}))
    return plan


@pytest.mark.parametrize("batch", [1, 4])
def test_the_pruned_drafter_on_a_gguf_target_gives_plain_greedy_output(tiny, tmp_path, monkeypatch, batch):
    """``pruned`` with a plan on a llama.cpp target drafts with the GGUF copy (made in the cache): greedy output
    is plain decoding's, batch 1 and 4, with drafts accepted."""
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    _, path, _ = tiny
    target = LlamaCppLM(path, None, context=256, max_rows=4)
    drafter = genspec.build_drafter("pruned", target, path=str(_plan_file(tmp_path, target)))
    assert isinstance(drafter.model, LlamaCppLM) and drafter.model.path.parent == tmp_path / "derived"
    assert drafter.model.num_layers == 2
    assert_plain_greedy_output_with_drafts_accepted(target, drafter, PROMPTS[:batch])


def test_a_pruned_gguf_draft_samples_the_targets_law(tmp_path, monkeypatch):
    """Sampled outputs (T 0.7, top-k 8, top-p 0.9) with a pruned GGUF draft (one of two key/value groups and half
    the channels in each of 3 layers) follow the exact law of the GGUF target: N = 20,000 joint samples of 3
    tokens over a 12-token vocabulary, chi-square p > 1e-3."""
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    path = tmp_path / "target.gguf"
    write_tiny_gguf(path, seed=0, layers=3, scale=8.0, vocab=12)
    target = LlamaCppLM(path, None, context=16, max_rows=64, threads=1)
    plan = _plan_file(tmp_path, target, layers=[0, 1, 2], heads=[[0, 1], [2, 3], [0, 1]],
                      channels=[list(range(64))] * 3)
    assert_samples_follow_the_exact_law(target, genspec.build_drafter("pruned", target, path=str(plan)))


def test_plans_a_gguf_copy_cannot_hold_are_refused_in_one_line(tiny, tmp_path):
    """A plan keeping different head counts in different layers, more heads of one key/value group than of
    another, a layer the model lacks, too few layers' lists, a plan for another
    model, missing healed weights: each refused in one line, before any file is written."""
    folder, path, _ = tiny
    cases = [(dict(heads=[[0, 1], [0, 1], [0, 1, 2, 3]]), ConfigError, "one count for all its layers"),
             (dict(heads=[[0, 1, 2], [0, 1, 2], [0, 1, 2]]), ConfigError, "each serve as many query heads"),
             (dict(layers=[0, 5]), ConfigError, "keeps layers of 0..2"),
             (dict(channels=[[0]] * 2), ConfigError, "for each of the model's 3 layers"),
             (dict(weights=tmp_path / "missing.safetensors"), InputFileError, "healed weights not found")]
    for change, error, words in cases:
        plan = {"layers": LAYERS, "heads": HEADS, "channels": CHANNELS, **change}
        with pytest.raises(error, match=words) as caught:
            pruned_gguf(path, plan["layers"], plan["heads"], plan["channels"], plan.get("weights"), cache=tmp_path)
        assert "\n" not in str(caught.value)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob("*.partial"))
    target = LlamaCppLM(path, None, context=64, max_rows=1)
    with pytest.raises(ConfigError, match="made for another model"):
        genspec.build_drafter("pruned", target, path=str(_plan_file(tmp_path, target, fingerprint="0" * 16)))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(path, tokenizer) of a 3-layer float32 tiny GGUF 256 wide, whose rows the K-quants can hold."""
    path = tmp_path_factory.mktemp("stack") / "wide.gguf"
    _, tokenizer = write_tiny_gguf(path, seed=0, layers=3, hidden=256, scale=4.0)
    return path, tokenizer


@pytest.mark.parametrize("levels", ["prompt-lookup,quantized", "layer-skip,quantized"])
@pytest.mark.parametrize("batch", [1, 4])
def test_hierarchical_stacks_of_gguf_self_drafts_give_plain_greedy_output(wide, tmp_path, monkeypatch, levels,
                                                                          batch):
    """A stack on a llama.cpp target whose model levels are GGUF copies (a layer-skipped copy or prompt lookup
    drafting for the Q2_K copy, which drafts for the target): each level below verifies the one above it on its
    own llama.cpp context, and greedy output is plain decoding's, batch 1 and 4."""
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    path, tokenizer = wide
    target = LlamaCppLM(path, tokenizer, context=256, max_rows=4)
    drafter = genspec.build_drafter("hierarchical", target, levels=levels)
    assert isinstance(drafter, DraftModelDrafter) and isinstance(drafter.model, LlamaCppLM)
    inner = drafter.inner
    assert inner is not None and (not isinstance(inner, DraftModelDrafter) or isinstance(inner.model, LlamaCppLM))
    assert_plain_greedy_output_with_drafts_accepted(target, drafter, PROMPTS[:batch])


def test_a_hierarchical_stack_of_gguf_self_drafts_samples_the_targets_law(tmp_path, monkeypatch):
    """Sampled outputs (T 0.7, top-k 8, top-p 0.9) with a layer-skipped GGUF copy drafting for a Q4_0 copy that
    drafts for the target follow the target's exact law: N = 20,000 joint samples of 3 tokens over 12 tokens,
    chi-square p > 1e-3."""
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    path = tmp_path / "target.gguf"
    write_tiny_gguf(path, seed=0, layers=3, scale=8.0, vocab=12)
    target = LlamaCppLM(path, None, context=16, max_rows=64, threads=1)
    stack = HierarchicalDrafter.stack([("layer-skip", genspec.build_drafter("layer-skip", target, skip=[1])),
                                       ("quantized", genspec.build_drafter("quantized", target, gguf_type="Q4_0"))])
    assert_samples_follow_the_exact_law(target, stack)
