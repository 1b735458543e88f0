"""A draft model with another tokenizer than the target's (``--draft-model DIR`` whose tokenizer differs):
greedy drafts re-encoded as text, sampled drafts through the shared vocabulary, both lossless; the refusals.

The two tokenizers are built in code (tests/tiny_models.py): the target's word-level (``the``, ``cat``, ...;
decoded joined by spaces), the draft's SentencePiece-style unigram (``▁the``, ``▁cat``, ``▁d`` + ``og``, ...).
"""
from __future__ import annotations

import json

import pytest
import torch
from stats_helpers import chi_square_pvalue
from tiny_models import (exact_joint, peaked, piece_tokenizer, save_cross_tokenizer_models, tiny_llama,
                         translated_copy, word_target, word_tokenizer)

import genspec
from genspec.cli import main
from genspec.drafters.base import DraftRequest, RequestContext
from genspec.drafters.cross_tokenizer import (CrossTokenizerDrafter, SharedVocabulary, continuation_ids, draft_text,
                                              token_texts)
from genspec.drafters.draft_model import DraftModelDrafter
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from genspec.models import HFCausalLM
from genspec.sampling import SamplingConfig, process_logits

PROMPTS = ["the cat sat on", "a dog ran on the mat", "the cat", "on a mat . the dog"]
#: pieces of a draft tokenizer that shares one word of the target's nine ("the"): 11% < MIN_SHARED
FOREIGN_PIECES = ("▁le", "▁chat", "▁chien", "▁sur", "▁tapis", "▁un", "▁the", "▁est", "▁assis")


@pytest.fixture(scope="module")
def words():
    return word_tokenizer()


@pytest.fixture(scope="module")
def pieces():
    return piece_tokenizer()


@pytest.fixture(scope="module")
def cross_dirs(tmp_path_factory):
    return save_cross_tokenizer_models(tmp_path_factory.mktemp("cross_tokenizer"))


# ------------------------------------------------------------------------------- the translation
def test_shared_tokens_are_matched_by_their_text_not_their_spelling(words, pieces):
    """``▁the`` (unigram) and ``the`` (word-level) both read `` the`` after another token; the draft's "." reads
    "." but the target's " ." (its words are joined by spaces), so they are not shared; specials are left out."""
    assert token_texts(words, len(words))[words.convert_tokens_to_ids("the")] == " the"
    assert token_texts(pieces, len(pieces))[pieces.convert_tokens_to_ids("▁the")] == " the"
    shared = SharedVocabulary(pieces, words, len(pieces), len(words))
    pairs = {pieces.convert_ids_to_tokens(d): words.convert_ids_to_tokens(t)
             for d, t in zip(shared.draft_ids.tolist(), shared.target_ids.tolist())}
    assert pairs == {"▁the": "the", "▁cat": "cat", "▁sat": "sat", "▁on": "on", "▁a": "a", "▁ran": "ran"}
    assert shared.share == pytest.approx(6 / 9)  # of the target's 9 ordinary tokens, the smaller vocabulary
    logits = torch.arange(len(pieces), dtype=torch.float64).unsqueeze(0)
    mapped = shared.target_logits(logits)
    assert mapped[0, words.convert_tokens_to_ids("cat")] == pieces.convert_tokens_to_ids("▁cat")
    assert torch.isinf(mapped[0, words.convert_tokens_to_ids("dog")])
    assert int(shared.to_draft[words.convert_tokens_to_ids("ran")]) == pieces.convert_tokens_to_ids("▁ran")


def test_a_greedy_draft_becomes_the_target_tokens_that_continue_the_committed_ones(words, pieces):
    """Drafted ``▁d og .`` after ``▁the ▁cat`` is the text " dog." and, after the target's ``the cat``, the
    target's ``dog .``; committed tokens the text does not give back (a special token) are found by their text."""
    context = pieces("the cat")["input_ids"]
    drafted = pieces.convert_tokens_to_ids(["▁d", "og", "."])
    text = draft_text(pieces, context, drafted)
    assert text == " dog."
    ids = words.convert_tokens_to_ids
    assert continuation_ids(words, ids(["the", "cat"]), text) == ids(["dog", "."])
    assert continuation_ids(words, ids(["<bos>", "the", "cat"]), text) == ids(["dog", "."])
    assert continuation_ids(words, [], text) == ids(["dog", "."])


# ------------------------------------------------------------------------------- greedy: plain decoding's output
@pytest.mark.parametrize("draft, batch", [("translated", 1), ("translated", 4), ("random", 4)])
def test_greedy_output_equals_plain_decoding(words, pieces, draft, batch):
    target_model = word_target()
    prompts = [words(p)["input_ids"] for p in PROMPTS[:batch]]
    plain = SpeculativeEngine(HFCausalLM(word_target())).generate_ids(prompts, max_new_tokens=16, eos_token_ids=())
    draft_model = (translated_copy(word_target(), pieces, words) if draft == "translated"
                   else tiny_llama(3, vocab=len(pieces), layers=1))
    drafter = CrossTokenizerDrafter(HFCausalLM(draft_model, pieces), words, len(words))
    out = SpeculativeEngine(HFCausalLM(target_model, words), drafter).generate_ids(
        prompts, max_new_tokens=16, num_draft_tokens=4, draft_length="fixed", eos_token_ids=())
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert sum(r.stats.drafted_tokens for r in out) > 0
    if draft == "translated":  # the drafts were really used
        assert sum(r.stats.accepted_tokens for r in out) > 0


def test_mixed_batch_greedy_rows_equal_plain_beside_sampled_rows(words, pieces):
    """A greedy request drafted beside sampled ones (its point masses in a batch with laws) still gets plain
    greedy decoding's tokens."""
    prompts = [words(p)["input_ids"] for p in PROMPTS]
    plain = SpeculativeEngine(HFCausalLM(word_target())).generate_ids(prompts[:1], max_new_tokens=12,
                                                                        eos_token_ids=())
    drafter = CrossTokenizerDrafter(HFCausalLM(translated_copy(word_target(), pieces, words), pieces), words,
                                    len(words))
    engine = SpeculativeEngine(HFCausalLM(word_target(), words), drafter)
    greedy = genspec.GenerationConfig(max_new_tokens=12, num_draft_tokens=3, draft_length="fixed", eos_token_ids=())
    sampled = genspec.GenerationConfig(max_new_tokens=12, num_draft_tokens=3, draft_length="fixed", eos_token_ids=(),
                                       temperature=0.9, seed=4)
    first = engine.add_request(prompts[0], greedy)
    for prompt in prompts[1:]:
        engine.add_request(prompt, sampled)
    tokens, drafted = [], 0
    while engine.has_unfinished():
        step = engine.step()
        tokens += step.requests[first].new_tokens if first in step.requests else []
        drafted += sum(r.drafted for r in step.requests.values())
    assert tokens == plain[0].token_ids and drafted > 0


# ------------------------------------------------------------------------------- sampling: the target's exact law
def _lossless_pvalue(words, pieces, num_samples: int, length: int, rule: str, k: int = 2):
    """Decode ``num_samples`` rows of ``length`` tokens (T 0.7, top-k 8, top-p 0.9, seed 0) after ``the dog on``
    (a word the draft splits in two) from the 12-token word target, sharpened; the draft is its first layer on
    the shared tokens (:func:`translated_copy`). Returns (chi-square p-value of the joint law of the tokens
    against the exact target law, acceptance rate)."""
    sampling = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)
    draft = translated_copy(peaked(word_target(), 4.0), pieces, words, layers=1)
    engine = SpeculativeEngine(HFCausalLM(peaked(word_target(), 4.0)),
                               CrossTokenizerDrafter(HFCausalLM(draft, pieces), words, len(words)))
    prompt = words("the dog on")["input_ids"]
    results = engine.generate_ids([prompt] * num_samples, max_new_tokens=length, num_draft_tokens=k,
                                  temperature=0.7, top_k=8, top_p=0.9, seed=0, eos_token_ids=(), draft_length="fixed",
                                  rule=rule)
    counts = torch.zeros([len(words)] * length)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    exact = exact_joint(peaked(word_target(), 4.0), prompt, length, lambda logits: process_logits(logits, sampling))
    accepted = sum(r.stats.accepted_tokens for r in results) / sum(r.stats.drafted_tokens for r in results)
    return chi_square_pvalue(counts.numpy(), exact.numpy()), accepted


def test_sampling_through_the_shared_vocabulary_is_lossless(words, pieces):
    """The joint law of 2 sampled tokens (a draft of 2: both positions judged) against the exact target law
    under the standard rule: N = 6,000, chi-square p > 1e-3. The target puts 39% of its first token's
    probability on shared tokens, so the residual carries most of the law (acceptance 0.05..0.95 asserted)."""
    pvalue, acceptance = _lossless_pvalue(words, pieces, 6_000, 2, "overaccept")
    assert 0.05 < acceptance < 0.95
    assert pvalue > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["overaccept", "auto"])
def test_sampling_through_the_shared_vocabulary_is_lossless_at_length_3(words, pieces, rule):
    """3 tokens, N = 20,000, chi-square p > 1e-3, under the standard rule and under ``auto`` (seeded requests
    of a sampling drafter: the coupled rule, its draft tokens drawn with the request's noise)."""
    pvalue, acceptance = _lossless_pvalue(words, pieces, 20_000, 3, rule)
    assert 0.05 < acceptance < 0.95
    assert pvalue > 1e-3


# ------------------------------------------------------------------------------- refusals and routing
def test_too_small_a_shared_vocabulary_is_refused_in_one_line(words):
    draft = HFCausalLM(tiny_llama(1, vocab=len(piece_tokenizer(FOREIGN_PIECES)), layers=1),
                       piece_tokenizer(FOREIGN_PIECES))
    message = r"share 1 tokens, 11% of the smaller vocabulary, under min_shared=0.5"
    with pytest.raises(ConfigError, match=message) as err:
        CrossTokenizerDrafter(draft, words, len(words))
    assert "\n" not in str(err.value)
    assert CrossTokenizerDrafter(draft, words, len(words), min_shared=0.1).shared.size == 1
    with pytest.raises(ConfigError, match=r"option min_shared=1.5: expected a number in \[0, 1\]"):
        CrossTokenizerDrafter(draft, words, len(words), min_shared=1.5)


def test_the_registry_routes_by_tokenizer(cross_dirs, tiny_model_dirs):
    target_dir, draft_dir = cross_dirs
    target = HFCausalLM.from_pretrained(target_dir)
    assert isinstance(genspec.build_drafter("draft-model", target, draft_model=str(draft_dir)), CrossTokenizerDrafter)
    same = HFCausalLM.from_pretrained(tiny_model_dirs[0])
    drafter = genspec.build_drafter("draft-model", same, draft_model=str(tiny_model_dirs[1]))
    assert type(drafter) is DraftModelDrafter
    with pytest.raises(ConfigError, match="num_drafts=2 needs a draft model with the target's tokenizer"):
        genspec.build_drafter("draft-model", target, draft_model=str(draft_dir), num_drafts=2)
    with pytest.raises(ConfigError, match="min_shared=0.9"):
        genspec.build_drafter("draft-model", target, draft_model=str(draft_dir), min_shared=0.9)
    no_tokenizer = HFCausalLM(tiny_llama(1, vocab=30, layers=1))
    with pytest.raises(ConfigError, match="vocabularies differ .* has no tokenizer"):
        genspec.build_drafter("draft-model", target, draft_model=no_tokenizer)


def test_a_request_picks_the_cross_tokenizer_drafter_by_name(cross_dirs):
    """What the server does per request: the engine holds it as ``draft-model`` beside its default."""
    target_dir, draft_dir = cross_dirs
    engine = genspec.load(str(target_dir), drafter="none", draft_model=str(draft_dir),
                          extra_drafters={"draft-model": {}})
    plain = engine.generate(PROMPTS[0], max_new_tokens=10, eos_token_ids=())[0]
    spec = engine.generate(PROMPTS[0], max_new_tokens=10, eos_token_ids=(), drafter="draft-model",
                           num_draft_tokens=3, draft_length="fixed")[0]
    assert spec.token_ids == plain.token_ids and spec.stats.drafted_tokens > 0


def test_a_row_that_reads_nothing_stays_at_length_zero():
    """A draft model's row started but not drafted for keeps length 0 while another row syncs (it was set to
    -1, which shifted the positions of everything it read later by one)."""
    drafter = DraftModelDrafter(HFCausalLM(tiny_llama(1, layers=1)))
    drafter.propose([DraftRequest(0, [5, 6, 7], 2)])
    drafter.start([RequestContext(1, [8, 9])])
    drafter.propose([DraftRequest(0, [5, 6, 7, 8], 2)])
    assert drafter.model.lengths.tolist()[1] == 0


# ------------------------------------------------------------------------------- the command line
def test_cli_generate_with_a_draft_model_of_another_tokenizer(capsys, cross_dirs):
    target_dir, draft_dir = cross_dirs
    base = ["generate", "--model", str(target_dir), "--prompt", PROMPTS[1], "--max-new-tokens", "12", "--json"]
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "draft-model", "--draft-model", str(draft_dir), "-k", "3",
                        "--draft-length", "fixed"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    assert spec["stats"]["drafted_tokens"] > 0


def test_cli_refuses_a_draft_tokenizer_that_shares_too_little_in_one_line(capsys, tmp_path):
    target_dir, draft_dir = save_cross_tokenizer_models(tmp_path, draft_pieces=FOREIGN_PIECES)
    argv = ["generate", "--model", str(target_dir), "--prompt", "the cat", "--max-new-tokens", "2",
            "--drafter", "draft-model", "--draft-model", str(draft_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "under min_shared=0.5" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert main(argv + ["-O", "min_shared=abc"]) == 2
    assert "min_shared='abc': expected a number in [0, 1]" in capsys.readouterr().err


def test_bench_runs_it_beside_transformers_universal_assisted_generation(capsys, cross_dirs, tmp_path):
    """``genspec bench`` reaches it by name, and ``hf-assisted`` with the same draft model is transformers'
    universal assisted generation (its ``tokenizer`` and ``assistant_tokenizer`` passed to ``generate()``)."""
    target_dir, draft_dir = cross_dirs
    method = "draft-model:draft_length=fixed"
    argv = ["bench", "--model", str(target_dir), "--draft-model", str(draft_dir), "--categories", "qa",
            "--num-prompts", "1", "--max-new-tokens", "6", "--repeats", "1", "--methods", f"{method},hf-assisted",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = {r["method"]: r for r in results["runs"] if r["phase"] == "main"}
    assert runs[method]["matches_plain"] is True and runs[method]["stats"]["drafted_tokens"] > 0
    assert runs["hf-assisted"]["error"] is None and runs["hf-assisted"]["matches_reference"] is True
    assert results["settings"]["hf_generate"]["hf-assisted"]["assistant_tokenizer"] == f"<tokenizer {draft_dir}>"
