"""The decode loop on tiny random-weight models: greedy equality, lossless sampling, stats, stopping,
streaming text, bad configurations and inputs."""
from __future__ import annotations

import pytest
import torch
from stats_helpers import chi_square_pvalue
from tiny_models import exact_joint, peaked, tiny_gemma3, tiny_llama

from genspec.drafters import DraftModelDrafter, PromptLookupDrafter
from genspec.engine import GenerationConfig, SpeculativeEngine, visible_text
from genspec.errors import ConfigError, ContextLengthError
from genspec.models import HFCausalLM
from genspec.sampling import SamplingConfig, process_logits

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [20, 21, 20, 21, 20]]


def drafters():
    return {
        "prompt-lookup": lambda: PromptLookupDrafter(),
        "draft-model": lambda: DraftModelDrafter(HFCausalLM(tiny_llama(1, layers=1))),
        "self-draft": lambda: DraftModelDrafter(HFCausalLM(tiny_llama(0))),
    }


@pytest.mark.parametrize("name", list(drafters()))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_equals_plain_decoding(tiny_target, name, batch):
    prompts = PROMPTS[:batch]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())
    spec = SpeculativeEngine(tiny_target, drafters()[name]()).generate_ids(prompts, max_new_tokens=24,
                                                                          num_draft_tokens=4, eos_token_ids=())
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert len(s.token_ids) == 24


@pytest.mark.parametrize("name", ["prompt-lookup", "self-draft"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculation_equals_plain_decoding_in_float32_through_the_packed_kernels(name, batch):
    """In float32 a verify block of 3 or more tokens takes oneDNN's packed GEMM in every linear layer and
    the LM head, and one token the BLAS kernel: different summation orders, the same greedy output."""
    from genspec.models.hf import TransposedLinear

    target = HFCausalLM(tiny_llama(0, dtype=torch.float32))
    layer = next(m for m in target.model.modules() if isinstance(m, TransposedLinear))
    with torch.inference_mode():
        assert layer.kernel(torch.zeros(5, layer.in_features)) == "packed"
    assert target.lm_head.kernel(5) == "packed"
    draft = {"prompt-lookup": PromptLookupDrafter,
             "self-draft": lambda: DraftModelDrafter(HFCausalLM(tiny_llama(0, dtype=torch.float32)))}[name]()
    prompts = PROMPTS[:batch]
    plain = SpeculativeEngine(target).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())
    spec = SpeculativeEngine(target, draft).generate_ids(prompts, max_new_tokens=24, num_draft_tokens=4,
                                                        draft_length="fixed", eos_token_ids=())
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    if name == "self-draft":
        assert spec[0].stats.mean_accepted_length > 4  # full 5-token blocks were verified


def test_greedy_plain_decoding_equals_transformers_generate(tiny_target):
    ids = torch.tensor([PROMPTS[0]])
    reference = tiny_target.model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    ours = SpeculativeEngine(tiny_target).generate_ids([PROMPTS[0]], max_new_tokens=16, eos_token_ids=())[0]
    assert ours.token_ids == reference.tolist()


def test_gemma3_sliding_window_greedy_equality():
    """Gemma 3 layout (sliding-window layers, window 6) with drafts crossing the window."""
    model = HFCausalLM(tiny_gemma3(0))
    plain = SpeculativeEngine(model).generate_ids(PROMPTS, max_new_tokens=20)
    spec = SpeculativeEngine(model, DraftModelDrafter(HFCausalLM(tiny_gemma3(0)))).generate_ids(
        PROMPTS, max_new_tokens=20, num_draft_tokens=5, draft_length="fixed")  # cost policy: timing-dependent k
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert spec[0].stats.mean_accepted_length > 4


def test_identical_draft_accepts_everything(tiny_target):
    k = 4
    result = SpeculativeEngine(tiny_target, DraftModelDrafter(HFCausalLM(tiny_llama(0)))).generate_ids(
        [PROMPTS[1]], max_new_tokens=5 * (k + 1), num_draft_tokens=k, temperature=0.9, seed=3,
        draft_length="fixed", eos_token_ids=())[0]
    assert result.stats.acceptance_rate == pytest.approx(1.0)
    assert result.stats.mean_accepted_length == pytest.approx(k + 1)
    assert result.stats.accepted_length_histogram == [0] * k + [5]


def test_stats_keys_and_consistency(tiny_target):
    result = SpeculativeEngine(tiny_target, PromptLookupDrafter()).generate_ids([PROMPTS[0]], max_new_tokens=20)[0]
    stats = result.stats.as_dict()
    for key in ("drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
                "accepted_length_histogram", "target_calls", "draft_time_s", "verify_time_s",
                "total_time_s", "tokens_per_second"):
        assert key in stats
    assert sum(stats["accepted_length_histogram"]) == stats["target_calls"]
    assert stats["new_tokens"] == stats["accepted_tokens"] + stats["target_calls"] == 20
    assert stats["mean_accepted_length"] == pytest.approx(20 / stats["target_calls"])


def _lossless_check(drafter, sampling: SamplingConfig, num_samples: int, length: int, k: int, seed: int):
    target_model = peaked(tiny_llama(0, vocab=12))
    prompt = [3, 5, 7]
    engine = SpeculativeEngine(HFCausalLM(target_model), drafter)
    results = engine.generate_ids([prompt] * num_samples, max_new_tokens=length, num_draft_tokens=k,
                                  temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  seed=seed, eos_token_ids=(), draft_length="fixed",
                                  rule="overaccept")  # by name: "auto" couples a seeded sampling drafter
    vocab = 12
    counts = torch.zeros([vocab] * length)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    exact = exact_joint(target_model, prompt, length, lambda logits: process_logits(logits, sampling))
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    return chi_square_pvalue(counts.numpy(), exact.numpy()), accepted / drafted


SAMPLING = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)


def test_lossless_sampling_with_unlike_draft_model():
    """Chi-square of the joint law of the first 3 generated tokens against the exact target law
    (temperature 0.7, top-k 8, top-p 0.9 on both models). N = 20,000 samples, cells with expected
    count < 5 pooled; fail if p < 1e-3 (a correct engine fails this 1 time in 1000)."""
    draft = HFCausalLM(peaked(tiny_llama(1, vocab=12, layers=1)))
    pvalue, acceptance = _lossless_check(DraftModelDrafter(draft), SAMPLING, 20_000, 3, k=2, seed=11)
    assert 0.05 < acceptance < 0.95  # the draft is unlike the target: rejections really happen
    assert pvalue > 1e-3


def test_lossless_sampling_multidraft():
    """Same test (N = 20,000, p > 1e-3) with 3 i.i.d. draft chains verified as a tree by the
    recursive residual verifier."""
    draft = HFCausalLM(peaked(tiny_llama(1, vocab=12, layers=1)))
    pvalue, acceptance = _lossless_check(DraftModelDrafter(draft, num_drafts=3), SAMPLING, 20_000, 3, k=2, seed=12)
    assert acceptance < 0.95
    assert pvalue > 1e-3


def test_lossless_sampling_deterministic_drafter():
    """A lookup drafter (one-hot draft law) stays exact: N = 20,000, p > 1e-3."""
    pvalue, _ = _lossless_check(PromptLookupDrafter(max_ngram=2), SAMPLING, 20_000, 3, k=3, seed=13)
    assert pvalue > 1e-3


def test_biased_rule_is_detected():
    """The same chi-square test has power: the lossy rule (epsilon = 0.3, UNO residual) fails it."""
    target_model = peaked(tiny_llama(0, vocab=12))
    draft = HFCausalLM(peaked(tiny_llama(1, vocab=12, layers=1)))
    engine = SpeculativeEngine(HFCausalLM(target_model), DraftModelDrafter(draft))
    results = engine.generate_ids([[3, 5, 7]] * 20_000, max_new_tokens=2, num_draft_tokens=2, temperature=0.7,
                                  top_k=8, top_p=0.9, seed=14, epsilon=0.3, residual="uno", eos_token_ids=(),
                                  draft_length="fixed")
    counts = torch.zeros(12, 12)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    exact = exact_joint(target_model, [3, 5, 7], 2, lambda logits: process_logits(logits, SAMPLING))
    assert chi_square_pvalue(counts.numpy(), exact.numpy()) < 1e-3


def test_eos_and_stop():
    model = HFCausalLM(tiny_llama(0))
    plain = SpeculativeEngine(model).generate_ids([PROMPTS[0]], max_new_tokens=20, eos_token_ids=())[0]
    eos = plain.token_ids[5]
    first = plain.token_ids.index(eos)
    stopped = SpeculativeEngine(model, PromptLookupDrafter()).generate_ids(
        [PROMPTS[0]], max_new_tokens=20, eos_token_ids=(eos,))[0]
    assert stopped.token_ids == plain.token_ids[:first + 1]
    assert stopped.finish_reason == "eos"


def _stop_in(text: str) -> str:
    """A 2-character printable ASCII stop string that first occurs in ``text`` after its 3rd character."""
    for i in range(3, len(text) - 1):
        window = text[i:i + 2]
        if window.isascii() and window.isprintable() and text.index(window) >= 3:
            return window
    raise AssertionError(f"no printable stop string in {text!r}")


def test_stop_strings_are_not_returned(tiny_model_dir):
    """OpenAI's convention, in the engine (what genspec generate and genspec serve show): the text ends
    before the stop string, in generate and in stream; the token ids go up to the token that completed it."""
    import genspec

    engine = genspec.load(str(tiny_model_dir))
    prompt = "abcabcabc def def abc"
    full = engine.generate(prompt, max_new_tokens=40)[0]
    stop = _stop_in(full.text)
    stopped = engine.generate(prompt, max_new_tokens=40, stop_strings=(stop,))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index(stop)]
    assert engine.tokenizer.decode(stopped.token_ids, skip_special_tokens=True).startswith(stopped.text + stop)
    assert "".join(engine.stream(prompt, max_new_tokens=40, stop_strings=(stop,))) == stopped.text


def test_visible_text_holds_back_what_may_yet_be_a_stop_string():
    assert visible_text("ab<stop>cd<x", ("<x", "<stop>"), finished=True) == "ab"
    assert visible_text("ab<st", ("<stop>",), finished=False) == "ab"  # "<st" may become "<stop>"
    assert visible_text("ab<st", ("<stop>",), finished=True) == "ab<st"
    assert visible_text("ab\ufffd", (), finished=False) == "ab"  # an incomplete character: its rest is to come


@pytest.mark.parametrize("kwargs, message", [
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"residual": "bad"}, "residual"),
])
def test_bad_generation_config(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GenerationConfig(**kwargs)


def test_prompt_longer_than_context(tiny_target):
    with pytest.raises(ContextLengthError, match="context"):
        SpeculativeEngine(tiny_target).generate_ids([[5] * 300], max_new_tokens=4)


def test_bad_token_ids(tiny_target):
    with pytest.raises(ConfigError):
        SpeculativeEngine(tiny_target).generate_ids([[5, 999]], max_new_tokens=4)
    with pytest.raises(ConfigError):
        SpeculativeEngine(tiny_target).generate_ids([[]], max_new_tokens=4)


def test_stream_chunks_join_to_the_generated_text(tiny_model_dirs):
    import genspec

    target, _ = tiny_model_dirs
    engine = genspec.load(str(target), drafter="prompt-lookup")
    chunks = list(engine.stream("abcabcabc", max_new_tokens=16, eos_token_ids=()))
    full = engine.generate("abcabcabc", max_new_tokens=16, eos_token_ids=())[0]
    assert len(chunks) >= 2
    assert "".join(chunks) == full.text
