"""Errors that name the real fault (issue 62, item 6): a truncated GGUF file is called truncated, not a
tokenizer failure; a GGUF file is known by its bytes or its extension in any case (``Model.GGUF``), not
taken for a model directory; ``--drafter hybrid`` on the llamacpp backend is refused by its own name; a
pruning plan that is not JSON says so, with where the parser stopped. Each on tiny files written in the
test, through the Python API (a :class:`~genspec.errors.GenspecError` with that message) and the CLI (one
line, exit 2)."""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from tiny_gguf import write_tiny_gguf

import genspec
from genspec.api import Backend, resolve_backend
from genspec.cli import main
from genspec.drafters.registry import check_drafter
from genspec.errors import ConfigError, InputFileError
from genspec.models import HFCausalLM
from genspec.models.gguf_file import check_complete, is_gguf
from genspec.models.llamacpp import LlamaCppLM

TRUNCATED = "truncated, not a complete GGUF file"
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed")


def _one_line(capsys, argv) -> str:
    """The CLI's error for ``argv``: it must exit 2 with one line and no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and err.startswith("genspec: error: "), err
    return err


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A whole tiny GGUF file and where its tensor data starts."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, seed=0, layers=1, hidden=32)
    return path, gguf.GGUFReader(str(path)).data_offset


# --------------------------------------------------------------------------- a truncated GGUF file
def _cuts(size: int, data_start: int) -> dict[str, int]:
    """Where a copy is cut short: inside the magic bytes, the counts, the metadata (the vocabulary), the
    tensor descriptions' end, the tensor data, its last byte."""
    return {"magic": 3, "counts": 20, "metadata": data_start // 2, "descriptions": data_start - 1,
            "data start": data_start, "data": (data_start + size) // 2, "last byte": size - 1}


@needs_llama_cpp
def test_a_truncated_gguf_file_is_called_truncated(tiny_gguf, tmp_path, capsys):
    """A GGUF file cut short anywhere, in its header or its tensor data, is refused as truncated (not as
    a tokenizer it cannot read, nor a model llama.cpp does not know), by the Python API and the CLI; the
    whole file passes the check."""
    path, data_start = tiny_gguf
    whole = path.read_bytes()
    check_complete(path)
    for where, length in _cuts(len(whole), data_start).items():
        cut = tmp_path / f"cut-{where.replace(' ', '-')}.gguf"
        cut.write_bytes(whole[:length])
        for load in (LlamaCppLM.from_gguf, genspec.load_model, LlamaCppLM):
            with pytest.raises(InputFileError, match=TRUNCATED):
                load(cut)
        assert TRUNCATED in _one_line(capsys, ["generate", "--model", str(cut), "--prompt", "a"]), where


def test_a_file_that_is_not_gguf_is_called_so(tmp_path, capsys):
    """A ``.gguf`` file without GGUF's magic bytes is "not a GGUF file"; an empty one says it is empty."""
    (tmp_path / "text.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(InputFileError, match="not a GGUF file") as refused:
        LlamaCppLM.from_gguf(tmp_path / "text.gguf")
    assert "tokenizer" not in str(refused.value)  # the file's fault, not its tokenizer's
    with pytest.raises(InputFileError, match="empty"):
        LlamaCppLM.from_gguf(tmp_path / "empty.gguf")
    assert "not a GGUF file" in _one_line(capsys, ["generate", "--model", str(tmp_path / "text.gguf"), "--prompt", "a"])


# ------------------------------------------------------------------- a GGUF file by any other name
@needs_llama_cpp
def test_a_gguf_file_is_known_by_its_bytes_or_any_case_of_its_extension(tiny_gguf, tmp_path, tiny_model_dir,
                                                                        capsys):
    """``Model.GGUF`` and a GGUF file named ``weights.bin`` run on the llamacpp backend (the CLI generates
    from both); a missing ``Model.GGUF`` is a missing GGUF model; transformers refuses a GGUF file as one, not as
    a directory without config.json; the draft-model drafter takes a GGUF file and refuses a file that is none."""
    path, _ = tiny_gguf
    upper, unnamed = tmp_path / "Model.GGUF", tmp_path / "weights.bin"
    shutil.copy(path, upper)
    shutil.copy(path, unnamed)
    for gguf_path in (upper, unnamed):
        assert is_gguf(gguf_path) and resolve_backend(str(gguf_path)) is Backend.LLAMACPP
        with pytest.raises(ConfigError, match="is a GGUF file"):
            resolve_backend(str(gguf_path), "torch")
        assert isinstance(genspec.load_model(str(gguf_path), max_rows=1), LlamaCppLM)
        assert main(["generate", "--model", str(gguf_path), "--prompt", "abcabc", "--max-new-tokens", "4",
                     "--json"]) == 0, capsys.readouterr().err
        assert len(json.loads(capsys.readouterr().out)["samples"][0]["token_ids"]) == 4
        with pytest.raises(InputFileError, match="is a GGUF file"):
            HFCausalLM.from_pretrained(gguf_path)
        check_drafter("draft-model", {"draft_model": str(gguf_path)})  # a GGUF draft model runs on llama.cpp
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("not a model")
    with pytest.raises(InputFileError, match="neither a GGUF file nor a model directory"):
        check_drafter("draft-model", {"draft_model": str(not_a_model)})
    err = _one_line(capsys, ["generate", "--model", str(tiny_model_dir), "--drafter", "draft-model",
                             "--draft-model", str(not_a_model), "--prompt", "a"])
    assert "neither a GGUF file nor a model directory" in err
    assert not is_gguf(tiny_model_dir) and resolve_backend(str(tiny_model_dir)) is Backend.TORCH
    assert "no GGUF model" in _one_line(capsys, ["generate", "--model", str(tmp_path / "Missing.GGUF"),
                                                 "--prompt", "a"])


# ------------------------------------------------------------- the hybrid on the llamacpp backend
@needs_llama_cpp
def test_the_hybrid_without_a_head_is_refused_by_its_own_name(tiny_gguf, capsys):
    """``--drafter hybrid`` on a model no head was trained for names the hybrid (the drafter asked for), not the
    head it holds; ``--drafter head`` still names the head."""
    path, _ = tiny_gguf
    target = LlamaCppLM.from_gguf(path, context=64, max_rows=1, threads=1)
    for name in ("hybrid", "head"):
        with pytest.raises(ConfigError, match=f"drafter '{name}' needs a trained head for this model"):
            genspec.build_drafter(name, target)
    err = _one_line(capsys, ["generate", "--model", str(path), "--drafter", "hybrid", "--prompt", "a"])
    assert "'hybrid'" in err and "'head'" not in err


# ---------------------------------------------------------------- a pruning plan that is not JSON
def test_a_pruning_plan_that_is_not_json_says_so(tiny_model_dir, tmp_path, capsys):
    """A plan cut short or not JSON at all is "not valid JSON" with the parser's line and column; valid
    JSON without a "layers" entry is still "not a calibration file with a "layers" entry"."""
    target = HFCausalLM.from_pretrained(tiny_model_dir)
    cut, prose, other = tmp_path / "cut.json", tmp_path / "prose.json", tmp_path / "other.json"
    cut.write_text('{"layers": [0, 1],\n "heads": [')
    prose.write_text("layers: all of them\n")
    other.write_text('{"exit_layer": 1}')
    with pytest.raises(InputFileError, match=r"not valid JSON \(line 2, column 12: "):
        genspec.build_drafter("pruned", target, path=str(cut))
    with pytest.raises(InputFileError, match=r"not valid JSON \(line 1, column 1: "):
        genspec.build_drafter("pruned", target, path=str(prose))
    with pytest.raises(InputFileError, match='not a calibration file with a "layers" entry'):
        genspec.build_drafter("pruned", target, path=str(other))
    err = _one_line(capsys, ["generate", "--model", str(tiny_model_dir), "--drafter", "pruned",
                             "-O", f"path={cut}", "--prompt", "a"])
    assert "not valid JSON (line 2, column 12" in err
