"""Chi-square goodness of fit with pooling of small cells (docs/theory.md, "How it is tested"; the function lives in
genspec.theory.stats, which ``genspec theory optimality`` also uses) and the engine's lossless test."""
from __future__ import annotations

from genspec.theory.stats import chi_square_pvalue  # noqa: F401 - the tests' import path


def lossless_pvalue(make_drafter, sampling, num_samples: int = 20_000, length: int = 3, k: int = 2,
                    seed: int = 0, vocab: int = 12, dtype=None, draft_length: str = "fixed", layers: int = 3,
                    prompt: tuple[int, ...] = (3, 5, 7), **acceptance):
    """Decode ``num_samples`` rows of ``length`` tokens after ``prompt`` from a sharpened tiny Llama target
    (``layers`` layers: pick a target whose law is not near a point mass at the prompt, or the test sees
    nothing) with the drafter ``make_drafter(target)`` and return (chi-square p-value of the joint law of the
    tokens against the exact target law, acceptance rate). ``acceptance``: a rule's settings
    (``rule``, ``epsilon``, ``delta``, ``residual``; default the standard rule, "overaccept")."""
    import torch
    from tiny_models import exact_joint, peaked, tiny_llama

    from genspec.engine import SpeculativeEngine
    from genspec.models import HFCausalLM
    from genspec.sampling import process_logits

    acceptance.setdefault("rule", "overaccept")  # by name: "auto" would couple a seeded sampling drafter
    reference = peaked(tiny_llama(0, vocab=vocab, layers=layers, dtype=dtype or torch.float64))
    target = HFCausalLM(peaked(tiny_llama(0, vocab=vocab, layers=layers, dtype=dtype or torch.float64)))
    prompt = list(prompt)
    engine = SpeculativeEngine(target, make_drafter(target))
    results = engine.generate_ids([prompt] * num_samples, max_new_tokens=length, num_draft_tokens=k,
                                  temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  seed=seed, eos_token_ids=(), draft_length=draft_length, **acceptance)
    counts = torch.zeros([vocab] * length)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    exact = exact_joint(reference, prompt, length, lambda logits: process_logits(logits.double(), sampling))
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    return chi_square_pvalue(counts.numpy(), exact.numpy()), accepted / max(drafted, 1)
