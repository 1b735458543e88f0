"""The drafter contract: capabilities declared once, offers before the plan, and the manual's "Write your
own drafter" example (``examples/bigram_drafter.py``, included in ``docs/drafters/write-your-own.md`` as it
is) run through the engine."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from genspec.drafters.base import Draft, Drafter, DrafterCapabilities, DraftOffer, DraftRequest
from genspec.engine import SpeculativeEngine
from genspec.errors import ConfigError
from tiny_models import early_exit_setup, tiny_llama

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "bigram_drafter.py"
PAGE = REPO / "docs" / "drafters" / "write-your-own.md"


def _example():
    spec = importlib.util.spec_from_file_location("bigram_drafter", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_shows_the_example_file_whole_and_it_is_short():
    assert '--8<-- "examples/bigram_drafter.py"' in PAGE.read_text(encoding="utf-8")
    code = [line for line in EXAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(code) <= 40


def test_the_example_drafter_is_lossless_and_drafts(tiny_target):
    drafter = _example().BigramDrafter()
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 4, 3, 4, 3]]
    plain = SpeculativeEngine(tiny_target).generate_ids(prompts, max_new_tokens=24, eos_token_ids=())
    engine = SpeculativeEngine(tiny_target, drafter)
    for batch in (prompts[:1], prompts):
        out = engine.generate_ids(batch, max_new_tokens=24, eos_token_ids=())
        assert [r.token_ids for r in out] == [p.token_ids for p in plain[:len(batch)]]
    assert sum(r.stats.accepted_tokens for r in out) > 0


def test_the_engine_knows_no_composite_and_no_drafter_attribute_beyond_the_contract():
    """Composites (fallbacks, unverified proposals) live in their drafters; the engine reads drafters through
    ``capabilities`` and the base class's methods only."""
    source = (REPO / "genspec" / "engine.py").read_text(encoding="utf-8")
    assert re.findall(r"fallback|shadow|hasattr|getattr", source) == []


def test_capabilities_are_checked_and_costly_defaults_to_not_free():
    assert DrafterCapabilities().costly and not DrafterCapabilities(free=True).costly
    assert DrafterCapabilities(free=True, costly=True).costly
    for bad in ({"free": False, "costly": False}, {"max_candidates": 0}, {"default_draft_tokens": 0}):
        with pytest.raises(ConfigError):
            DrafterCapabilities(**bad)


def test_a_default_offer_is_free_tokens_or_a_costly_draft_to_come():
    class Copy(Drafter):
        name = "copy"

        def propose(self, requests):
            return Draft.from_chains([[r.sequence[len(r.sequence) - r.max_tokens:]] for r in requests], evidence=[1] * len(requests))

    rows = [DraftRequest(0, [1, 2, 3], 2), DraftRequest(1, [4, 5], 0)]
    costly = Copy().offer(rows)
    assert costly.costly == (True, True) and costly.cap(0, 2) == 2 and costly.first_chain(0) == []
    free = Copy()
    free.capabilities = DrafterCapabilities(free=True)
    offer = free.offer(rows)
    assert offer.costly == (False, False) and offer.cap(0, 2) == 2 and offer.cap(1, 5) == 0
    assert offer.first_chain(0) == [2, 3] and offer.evidence_of(0) == 1
    both = DraftOffer.stack([offer, DraftOffer.to_draft(1, evidence=["head"])])
    assert both.costly == (False, False, True) and both.evidence_of(2) == "head"


def test_a_prefix_that_does_not_fit_the_block_is_not_used():
    """The target honours an early-exit draft's layers only for the block they were computed for: given
    another block (here one token shorter), it runs every layer and its logits are a full pass's."""
    model = tiny_llama(0, layers=3)
    prompt, drafts = [5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]
    reused, fresh, draft = early_exit_setup(model, 2, prompt, drafts)
    assert draft.prefix_source is reused
    block = torch.tensor([[prompt[-1]] + drafts])
    prefix = draft.prefix_for(reused, torch.tensor([len(prompt) - 1]), torch.ones_like(block, dtype=torch.bool))
    shorter = torch.tensor([[True, True, True, False]])
    assert prefix.fits(torch.ones_like(block, dtype=torch.bool), None) and not prefix.fits(shorter, None)
    assert torch.allclose(reused.forward(block, shorter, prefix=prefix), fresh.forward(block, shorter), atol=1e-9)
