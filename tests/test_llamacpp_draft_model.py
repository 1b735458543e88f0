"""A GGUF draft model (``--drafter draft-model --draft-model small.gguf``) drafting for a llama.cpp target, both
written in the test with the target's vocabulary: greedy output equal to plain output (batch 1 and 4, one chain
and two drafts as a tree), a chi-square test of sampled outputs against the exact law, and the command line.
Self-drafts as GGUF copies that llama.cpp's quantiser writes (``quantized``: fewer bits; ``layer-skip``: layers
left out): what the copy holds, greedy equality at batch 1 and 4, and the sampled law."""
from __future__ import annotations

import json

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from test_llamacpp import assert_samples_follow_the_exact_law  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

import genspec  # noqa: E402
from genspec.cli import main  # noqa: E402
from genspec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from genspec.engine import SpeculativeEngine  # noqa: E402
from genspec.models.llamacpp import Kernels, LlamaCppLM  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [20, 21, 20, 21, 20]]


def assert_plain_greedy_output_with_drafts_accepted(target, drafter, prompts) -> None:
    """Greedy decoding of ``prompts`` (24 tokens, 4 drafted at every step) with ``drafter`` gives plain decoding's
    tokens, and some drafted tokens were kept."""
    plain = [r.token_ids for r in SpeculativeEngine(target).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())]
    results = SpeculativeEngine(target, drafter).generate_ids(prompts, max_new_tokens=24, eos_token_ids=(),
                                                               num_draft_tokens=4, draft_length="fixed")
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target path, draft path, tokenizer): a Q8_0 target and its Q4_0 copy as the draft, whose drafts are mostly
    right."""
    folder = tmp_path_factory.mktemp("draft")
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    _, tokenizer = write_tiny_gguf(target, seed=0, scale=4.0, weight_type="Q8_0")
    write_tiny_gguf(draft, seed=0, scale=4.0, weight_type="Q4_0")
    return target, draft, tokenizer


@pytest.mark.parametrize("num_drafts, kernels", [(1, "exact"), (2, "exact"), (2, "fast")])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_gguf_draft_model_gives_plain_greedy_output(pair, batch, num_drafts, kernels):
    """Drafts from the GGUF draft model (its own llama.cpp context, a sequence per row), greedy, batch 1 and 4,
    a chain, or two drafts (a tree on fast kernels; exact ones verify the first): token for token plain
    decoding's output, with drafts accepted."""
    target_path, draft_path, _ = pair
    # its tokenizer read from the file, as the draft's is
    target = LlamaCppLM.from_gguf(target_path, context=256, max_rows=4, kernels=kernels)
    plain = [r.token_ids for r in SpeculativeEngine(target).generate_ids(PROMPTS[:batch], max_new_tokens=24,
                                                                         eos_token_ids=())]
    drafter = genspec.build_drafter("draft-model", target, draft_model=str(draft_path), num_drafts=num_drafts)
    assert type(drafter) is DraftModelDrafter  # the same tokenizer: drafts in the target's ids
    assert isinstance(drafter.model, LlamaCppLM) and drafter.model.kernels is Kernels.FAST
    engine = SpeculativeEngine(target, drafter)
    assert engine.max_candidates == (num_drafts if kernels == "fast" else 1)
    results = engine.generate_ids(PROMPTS[:batch], max_new_tokens=24, eos_token_ids=(), num_draft_tokens=4,
                                  draft_length="fixed")
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_a_gguf_draft_model_samples_the_targets_law(tmp_path):
    """Sampled outputs (T 0.7, top-k 8, top-p 0.9) with a GGUF draft model follow the exact law of the GGUF target
    itself: N = 20,000 joint samples of 3 tokens over a 12-token vocabulary, chi-square p > 1e-3."""
    target_path, draft_path = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny_gguf(target_path, seed=0, layers=3, scale=8.0, vocab=12)
    write_tiny_gguf(draft_path, seed=0, layers=3, scale=8.0, vocab=12, weight_type="Q4_0")
    target = LlamaCppLM(target_path, None, context=16, max_rows=64, threads=1)  # 313 batches of 20,000
    assert_samples_follow_the_exact_law(target, genspec.build_drafter("draft-model", target,
                                                                      draft_model=str(draft_path)))


def test_generate_with_a_gguf_draft_model(pair, capsys):
    """``genspec generate --model target.gguf --drafter draft-model --draft-model draft.gguf --json``: the text of
    plain decoding, with drafted tokens in its statistics."""
    target_path, draft_path, _ = pair
    common = ["generate", "--model", str(target_path), "--prompt", "abcabcabc", "--max-new-tokens", "12", "--json"]
    assert main([*common, "--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    # a fixed draft length: the draft is the target's own size here, so the cost policy would rightly not draft
    assert main([*common, "--drafter", "draft-model", "--draft-model", str(draft_path), "--draft-length", "fixed"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert drafted["stats"]["drafted_tokens"] > 0


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(path, tokenizer) of a 3-layer float32 tiny GGUF 256 wide, whose rows the K-quants can hold."""
    path = tmp_path_factory.mktemp("self") / "wide.gguf"
    _, tokenizer = write_tiny_gguf(path, seed=0, layers=3, hidden=256, scale=4.0)
    return path, tokenizer


@pytest.mark.parametrize("name, options, weight_types, layers", [
    ("quantized", {}, {"Q2_K", "Q3_K", "Q6_K"}, 3),  # Q2_K: llama.cpp keeps a few tensors in more bits
    ("quantized", {"gguf_type": "Q4_0"}, {"Q4_0", "Q6_K"}, 3),
    ("layer-skip", {"skip": [1]}, {"F32"}, 2),
])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_gguf_self_draft_gives_plain_greedy_output(wide, tmp_path, monkeypatch, name, options, weight_types,
                                                     layers, batch):
    """``quantized`` and ``layer-skip`` on a llama.cpp target draft with a GGUF copy llama.cpp's quantiser writes
    into the cache (its matrices in fewer bits, or fewer layers): greedy output is plain decoding's, batch 1 and
    4, with drafts accepted; the copy is made once."""
    import gguf

    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    path, tokenizer = wide
    target = LlamaCppLM(path, tokenizer, context=256, max_rows=4)
    drafter = genspec.build_drafter(name, target, **options)
    copy = drafter.model.path
    assert copy.parent == tmp_path / "derived" and drafter.model.num_layers == layers
    kinds = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(copy).tensors if len(t.shape) >= 2}
    assert kinds == weight_types
    assert genspec.build_drafter(name, target, **options).model.path == copy  # cached
    assert_plain_greedy_output_with_drafts_accepted(target, drafter, PROMPTS[:batch])


def test_which_kept_layers_slide_is_the_sources_pattern_without_the_dropped_layers():
    """llama.cpp derives a layer's sliding window (and, in Gemma 3, its rotary base) from its index; a copy without
    some layers names its kept layers' pattern: Gemma 3's default (every sixth layer whole-context), a pattern
    given as a number or as one bool per layer, and no pattern where nothing slides or nothing is dropped."""
    from genspec.errors import ConfigError
    from genspec.models.llamacpp import kept_window_pattern

    gemma3 = {"general.architecture": "gemma3", "gemma3.block_count": 18, "gemma3.attention.sliding_window": 512}
    kept = kept_window_pattern(gemma3, (9, 13))
    assert len(kept) == 16 and [i for i, slides in enumerate(kept) if not slides] == [5, 10, 15]
    assert kept_window_pattern(gemma3, ()) is None
    assert kept_window_pattern({**gemma3, "gemma3.attention.sliding_window": 0}, (1,)) is None
    assert kept_window_pattern({**gemma3, "gemma3.attention.sliding_window_pattern": 2}, (0,)) == [False, True] * 8 + [False]
    given = [True, False, False] * 6
    assert kept_window_pattern({**gemma3, "gemma3.attention.sliding_window_pattern": given}, (1, 2)) == [True] + given[3:]
    other = {"general.architecture": "mystery", "mystery.block_count": 4, "mystery.attention.sliding_window": 8}
    with pytest.raises(ConfigError, match="does not know llama.cpp's default"):
        kept_window_pattern(other, (1,))


def test_a_copy_without_layers_keeps_their_window_pattern(tmp_path):
    """A GGUF with sliding-window layers (a pattern of one whole-context layer in 2) copied without its second
    layer: the copy names its 2 kept layers' pattern, and llama.cpp loads it and decodes."""
    import gguf
    import torch
    from tiny_gguf import made_up_pieces, write_llama_gguf
    from tiny_models import tiny_llama

    from genspec.models.llamacpp import derived_gguf

    path = tmp_path / "windows.gguf"
    write_llama_gguf(path, tiny_llama(0, vocab=12, layers=3, dtype=torch.float32), made_up_pieces(12),
                     metadata={"llama.attention.sliding_window": 16, "llama.attention.sliding_window_pattern": 2})
    copy = derived_gguf(path, None, (1,), cache=tmp_path)
    reader = gguf.GGUFReader(copy)
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["llama.attention.sliding_window_pattern"].contents() == [True, True]  # layers 0 and 2
    lm = LlamaCppLM(copy, None, context=32, max_rows=1)
    lm.add_rows([[3, 4]])
    assert lm.num_layers == 2 and torch.isfinite(lm.forward(torch.tensor([[5]]))).all()


def test_gguf_self_drafts_refuse_what_they_cannot_do(wide):
    """On a llama.cpp target: a draft vocabulary file, an unknown GGUF type, layer indices outside the model, and
    the self-drafts that reuse the target's layers as a torch model, each in one line."""
    from genspec.errors import ConfigError

    path, tokenizer = wide
    target = LlamaCppLM(path, tokenizer, context=64, max_rows=1)
    cases = [("quantized", {"draft_vocab_file": "ids.json"}, "draft_vocab_file needs the torch backend"),
             ("quantized", {"gguf_type": "Q1_X"}, "gguf_type"),
             ("layer-skip", {"skip": [0, 1, 2]}, "keeping at least one"),
             ("layer-skip", {"skip": [7]}, "indices of the target's layers"),
             ("early-exit", {}, "torch")]
    for name, options, words in cases:
        with pytest.raises(ConfigError, match=words) as error:
            genspec.build_drafter(name, target, **options)
        assert "\n" not in str(error.value)


def test_a_draft_model_catches_up_on_more_tokens_than_a_block_holds(pair):
    """A draft that has not drafted for a while feeds every token committed since: in pieces of the model's
    ``max_block_tokens`` (64 on llama.cpp), with each row's next-token logits those of a prefill of the same tokens
    (bitwise: exact kernels on Q8_0)."""
    import torch

    from genspec.drafters.draft_model import sync_rows

    path, _, tokenizer = pair
    lm = LlamaCppLM(path, tokenizer, context=256, max_rows=2, threads=1)
    sequences = [[(7 * i) % 250 + 3 for i in range(150)], [5, 6, 7, 8, 9]]
    assert len(sequences[0]) > lm.max_block_tokens
    lm.add_rows([[], sequences[1][:2]])
    held, logits = sync_rows(lm, [[], sequences[1][:2]], sequences, [True, True])
    assert held == sequences and lm.lengths.tolist() == [150, 5]
    reference = LlamaCppLM(path, tokenizer, context=256, max_rows=2, threads=1)
    reference.add_rows([s[:-1] for s in sequences])
    expected = reference.forward(torch.tensor([[s[-1]] for s in sequences]))[:, 0]
    assert torch.equal(logits, expected)
