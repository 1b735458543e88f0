"""A GGUF draft model with another tokenizer than its GGUF target's (``--drafter draft-model --draft-model
small.gguf`` routes it to the cross-tokenizer drafter), both on llama.cpp and written in the test: the word-level
target of tests/test_cross_tokenizer.py and its copy in a SentencePiece-style vocabulary
(``tiny_models.translated_copy``). Greedy output equal to plain output at batch 1 and 4, and sampled outputs
following the GGUF target's exact law."""
from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from test_llamacpp import assert_samples_follow_the_exact_law  # noqa: E402
from tiny_gguf import made_up_pieces, write_llama_gguf  # noqa: E402
from tiny_models import peaked, piece_tokenizer, translated_copy, word_target, word_tokenizer  # noqa: E402

import genspec  # noqa: E402
from genspec.drafters.cross_tokenizer import CrossTokenizerDrafter  # noqa: E402
from genspec.engine import SpeculativeEngine  # noqa: E402
from genspec.models.llamacpp import Kernels, LlamaCppLM  # noqa: E402

PROMPTS = ["the cat sat on", "the dog on", "a cat", "the mat"]


def write_pair(folder, scale: float, weight_type: str, rows: int):
    """(target, draft): the word target and its translated copy as GGUF files on llama.cpp with ``rows`` rows,
    each with its own tokenizer (the files' vocabularies are made up: the tokenizers are handed over)."""
    import torch

    words, pieces = word_tokenizer(), piece_tokenizer()
    target_model = peaked(word_target(dtype=torch.float32), scale)
    draft_model = translated_copy(target_model, pieces, words)
    target_path, draft_path = folder / "target.gguf", folder / "draft.gguf"
    write_llama_gguf(target_path, target_model, made_up_pieces(len(words)), weight_type)
    write_llama_gguf(draft_path, draft_model, made_up_pieces(len(pieces)), weight_type)
    target = LlamaCppLM(target_path, words, context=64, max_rows=rows)
    draft = LlamaCppLM(draft_path, pieces, context=64, max_rows=rows, kernels=Kernels.FAST)
    return target, draft


@pytest.fixture(scope="module")
def quantised_pair(tmp_path_factory):
    """Q8_0 weights: the target is batch invariant on exact kernels, so a greedy mismatch would be the drafter's."""
    return write_pair(tmp_path_factory.mktemp("cross_gguf"), 1.0, "Q8_0", rows=4)


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_a_gguf_draft_of_another_tokenizer_gives_plain_greedy_output(quantised_pair, batch):
    target, draft = quantised_pair
    assert target.batch_invariant
    drafter = genspec.build_drafter("draft-model", target, draft_model=draft)
    assert isinstance(drafter, CrossTokenizerDrafter)  # routed by tokenizer
    prompts = [target.tokenizer(p)["input_ids"] for p in PROMPTS[:batch]]
    plain = [r.token_ids for r in SpeculativeEngine(target).generate_ids(prompts, max_new_tokens=16, eos_token_ids=())]
    results = SpeculativeEngine(target, drafter).generate_ids(prompts, max_new_tokens=16, num_draft_tokens=4,
                                                              draft_length="fixed", eos_token_ids=())
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.accepted_tokens for r in results) > 0  # the draft's guesses were used


@pytest.mark.slow
def test_a_gguf_draft_of_another_tokenizer_samples_the_targets_law(tmp_path):
    """T 0.7, top-k 8, top-p 0.9, through the shared vocabulary: 20,000 joint samples of 3 tokens over the
    target's 12 follow its exact law (enumerated with llama.cpp itself), chi-square p > 1e-3, drafts partly
    accepted. Slow (minutes: the drafter decodes and re-encodes every row's text at every step); the default run
    keeps the torch backend's sampled test (tests/test_cross_tokenizer.py) and the greedy one here."""
    target, draft = write_pair(tmp_path, 4.0, "F32", rows=64)
    assert_samples_follow_the_exact_law(target, genspec.build_drafter("draft-model", target, draft_model=draft))
