"""The Hugging Face adapter: exact logits against a pristine transformers model, loading errors."""
from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model, tiny_gemma3, tiny_llama

from genspec.errors import ContextLengthError, InputFileError
from genspec.models import HFCausalLM
from genspec.models.hf import TransposedLinear


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_adapter_logits_equal_pristine_transformers_model(build):
    pristine = build(0)
    adapted = HFCausalLM(build(0))
    assert any(isinstance(m, TransposedLinear) for m in adapted.model.modules())
    ids = torch.randint(3, 64, (3, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = pristine(ids).logits
    adapted.reset(3)
    out = adapted.forward(ids[:, :17])
    adapted.commit_all()
    out = torch.cat([out, adapted.forward(ids[:, 17:])], dim=1)
    assert torch.allclose(out, reference, atol=1e-10, rtol=0)


def test_last_only_logits():
    model = HFCausalLM(tiny_llama(0))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    model.reset(2)
    last = model.forward(ids, valid, last_only=True)
    model.reset(2)
    full = model.forward(ids, valid)
    assert torch.allclose(last[0, 0], full[0, 3]) and torch.allclose(last[1, 0], full[1, 1])


def test_from_pretrained_round_trip(tmp_path):
    directory = save_tiny_model(tmp_path / "m", seed=3, dtype=torch.float64)
    loaded = HFCausalLM.from_pretrained(directory, dtype="float64")
    assert loaded.tokenizer is not None and loaded.vocab_size == len(loaded.tokenizer)
    pristine = tiny_llama(3, vocab=loaded.vocab_size)
    ids = torch.tensor([[1, 40, 41, 42]])
    loaded.reset(1)
    with torch.no_grad():
        assert torch.allclose(loaded.forward(ids), pristine(ids).logits, atol=1e-10)


def test_missing_model_directory(tmp_path):
    with pytest.raises(InputFileError, match="no model at"):
        HFCausalLM.from_pretrained(tmp_path / "nothing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(InputFileError):
        HFCausalLM.from_pretrained(tmp_path / "broken")


def test_context_overflow_is_a_clear_error():
    model = HFCausalLM(tiny_llama(0))  # context 256
    model.reset(1)
    with pytest.raises(ContextLengthError):
        model.forward(torch.zeros(1, 300, dtype=torch.long))
