"""llama.cpp's own ``llama-server`` as a baseline: the method's options, the build's inputs, and (where a
built binary is at hand: ``$GENSPEC_LLAMA_SERVER`` or the cache; ``-m slow`` builds it) greedy decoding
through it equal to llama-cpp-python's plain decoding on a tiny float32 GGUF model."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("llama_cpp")

from tiny_gguf import write_tiny_gguf  # noqa: E402

from genspec.bench import llama_server  # noqa: E402
from genspec.bench.methods import parse_method  # noqa: E402
from genspec.errors import ConfigError, InputFileError  # noqa: E402
from genspec.sampling import SamplingConfig  # noqa: E402


def test_llama_server_method_takes_its_speculation_types():
    spec = parse_method("llama-server:spec_type=ngram-mod", backend="llamacpp")
    assert (spec.kind, spec.base) == ("llamacpp", "llama-server")
    assert spec.options == {"spec_type": "ngram-mod"}
    for bad, reason in (("llama-server:spec_type=ngram-magic", "spec_type must be one of"),
                        ("llama-server:spec_type=3", "spec_type must be one of"),
                        ("llama-server:n_gram=3", "unknown option 'n_gram'")):
        with pytest.raises(ConfigError, match=reason):
            parse_method(bad, backend="llamacpp")
    with pytest.raises(ConfigError, match="needs --backend llamacpp"):
        parse_method("llama-server", backend="torch")


def test_speculation_flags_name_llama_servers_own_options():
    assert llama_server.speculation_flags("none") == []
    assert llama_server.speculation_flags("default") == ["--spec-default"]
    assert llama_server.speculation_flags("ngram-map-k") == ["--spec-type", "ngram-map-k"]
    with pytest.raises(ConfigError, match="unknown llama-server speculation"):
        llama_server.LlamaServer("model.gguf", spec_type="eagle", binary="llama-server")


def test_a_named_binary_that_is_missing_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("GENSPEC_LLAMA_SERVER", str(tmp_path / "nowhere" / "llama-server"))
    with pytest.raises(InputFileError, match="GENSPEC_LLAMA_SERVER names .* not a file"):
        llama_server.server_binary()


def test_the_build_passes_cmake_args_on(monkeypatch):
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_AVX512=OFF -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8'")
    flags = llama_server.cmake_flags()
    assert "-DGGML_NATIVE=ON" in flags and "-DLLAMA_CURL=OFF" in flags and "-DBUILD_SHARED_LIBS=OFF" in flags
    assert flags[-2:] == ["-DGGML_AVX512=OFF", "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8"]


def built_binary():
    named = os.environ.get("GENSPEC_LLAMA_SERVER")
    cached = llama_server.build_dir() / "bin" / "llama-server"
    return named if named else (cached if cached.is_file() else None)


def decode_through_both(tmp_path, spec_types):
    from genspec.bench.llamacpp_baselines import LlamaCppDecoder, LlamaServerDecoder

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    prompt = [(5 * i) % 40 + 3 for i in range(24)] * 2  # repeats: the n-gram types find drafts in it
    plain = LlamaCppDecoder(parse_method("llamacpp-plain", backend="llamacpp"), path, eos_token_ids=[], context=256,
                            threads=1).decode(prompt, 24, SamplingConfig(), seed=0)["token_ids"]
    outputs = {}
    for spec_type in spec_types:
        decoder = LlamaServerDecoder(parse_method(f"llama-server:spec_type={spec_type}", backend="llamacpp"), path,
                                     eos_token_ids=[], context=256, threads=1)
        try:
            outputs[spec_type] = decoder.decode(prompt, 24, SamplingConfig(), seed=0)
        finally:
            decoder.close()
        assert decoder.server.process.poll() is not None  # stopped
    return plain, outputs


@pytest.mark.skipif(built_binary() is None, reason="no llama-server built (GENSPEC_LLAMA_SERVER, or -m slow builds it)")
def test_llama_server_greedy_equals_llama_cpp_python_plain(tmp_path):
    """The server's greedy tokens, plain and with its n-gram speculation, are llama-cpp-python's (float32
    weights: the kernels of any batch shape agree on the argmax here)."""
    plain, outputs = decode_through_both(tmp_path, ("none", "ngram-simple"))
    assert len(plain) == 24
    for spec_type, out in outputs.items():
        assert out["token_ids"] == plain, spec_type
        assert out["new_tokens"] == 24 and out["wall_time_s"] > 0
    assert outputs["none"]["server_draft"]["drafted"] == 0


@pytest.mark.slow
def test_llama_server_builds_from_the_vendored_source(tmp_path, monkeypatch):
    """Builds llama-server from llama-cpp-python's sdist (several minutes, once per cache), then decodes."""
    monkeypatch.delenv("GENSPEC_LLAMA_SERVER", raising=False)
    binary = llama_server.server_binary(progress=False)
    assert binary.is_file() and os.access(binary, os.X_OK)
    plain, outputs = decode_through_both(tmp_path, ("none",))
    assert outputs["none"]["token_ids"] == plain
