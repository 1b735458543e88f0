"""The embedded default model: cache logic (fast) and one real-model smoke test (CI runs it)."""
from __future__ import annotations

import pytest

from genspec.models import default


def test_cache_is_built_atomically_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    calls = []

    def fake_convert(out_dir, step):
        calls.append(out_dir)
        step("writing")
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(default, "_convert_gguf", fake_convert)
    first = default.default_model_dir(progress=False)
    second = default.default_model_dir(progress=False)
    assert first == second == tmp_path / "models" / default.MODEL_ID
    assert len(calls) == 1 and (first / "model.safetensors").read_bytes() == b"weights"
    assert [p.name for p in first.parent.iterdir()] == [default.MODEL_ID]  # no temporary leftovers


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))

    def failing_convert(out_dir, step):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(default, "_convert_gguf", failing_convert)
    with pytest.raises(KeyboardInterrupt):
        default.default_model_dir(progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_stale_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path))
    stale = tmp_path / "models" / default.MODEL_ID
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"old")
    (stale / default.MARKER).write_text('{"format": -1}')
    monkeypatch.setattr(default, "_convert_gguf",
                        lambda out_dir, step: (out_dir / "model.safetensors").write_bytes(b"new"))
    assert (default.default_model_dir(progress=False) / "model.safetensors").read_bytes() == b"new"


@pytest.mark.smoke
def test_real_default_model_speculative_equals_plain():
    """Loads Gemma 3 270M (converting it on first use) and decodes 12 greedy tokens."""
    import genspec

    target = genspec.load_model()
    assert target.vocab_size == 262144
    prompt = "The capital of France is Paris. The capital of France is"
    plain = genspec.SpeculativeEngine(target).generate(prompt, max_new_tokens=12)[0]
    spec = genspec.SpeculativeEngine(target, genspec.build_drafter("prompt-lookup", target)).generate(
        prompt, max_new_tokens=12)[0]
    assert plain.text.strip()
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0
