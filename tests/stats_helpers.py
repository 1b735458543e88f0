"""Chi-square goodness of fit with pooling of small cells (theory.md, "How to test")."""
from __future__ import annotations

import numpy as np
from scipy import stats


def chi_square_pvalue(observed_counts, expected_probs, min_expected: float = 5.0) -> float:
    """p-value of observed counts against exact probabilities; cells with expected count below
    ``min_expected`` are pooled into one cell. An observation in a zero-probability cell gives 0."""
    observed = np.asarray(observed_counts, dtype=float).ravel()
    probs = np.asarray(expected_probs, dtype=float).ravel()
    total = observed.sum()
    if observed[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * total
    big = expected >= min_expected
    obs = list(observed[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(observed[~big].sum())
        exp.append(expected[~big].sum())
    exp = np.asarray(exp)
    exp *= total / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


def lossless_pvalue(make_drafter, sampling, num_samples: int = 20_000, length: int = 3, k: int = 2,
                    seed: int = 0, vocab: int = 12, dtype=None, draft_length: str = "fixed", layers: int = 3):
    """Decode ``num_samples`` rows of ``length`` tokens from a sharpened tiny Llama target (``layers``
    layers: pick a target whose law is not near a point mass at the prompt, or the test sees nothing)
    with the drafter ``make_drafter(target)`` and return (chi-square p-value of the joint law of the
    tokens against the exact target law, acceptance rate)."""
    import torch
    from tiny_models import exact_joint, peaked, tiny_llama

    from genspec.engine import SpeculativeEngine
    from genspec.models import HFCausalLM
    from genspec.sampling import process_logits

    reference = peaked(tiny_llama(0, vocab=vocab, layers=layers, dtype=dtype or torch.float64))
    target = HFCausalLM(peaked(tiny_llama(0, vocab=vocab, layers=layers, dtype=dtype or torch.float64)))
    prompt = [3, 5, 7]
    engine = SpeculativeEngine(target, make_drafter(target))
    results = engine.generate_ids([prompt] * num_samples, max_new_tokens=length, num_draft_tokens=k,
                                  temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  seed=seed, eos_token_ids=(), draft_length=draft_length)
    counts = torch.zeros([vocab] * length)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    exact = exact_joint(reference, prompt, length, lambda logits: process_logits(logits.double(), sampling))
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    return chi_square_pvalue(counts.numpy(), exact.numpy()), accepted / max(drafted, 1)
