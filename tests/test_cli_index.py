"""``genspec index build`` on a tiny model saved to disk: the retrieval datastore it writes, generation
with it (``--drafter retrieval``), and clear one-line errors for bad corpora."""
from __future__ import annotations

import json

from genspec.cli import main
from genspec.datastore import SEPARATOR, RetrievalIndex


def _run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_index_build_cli_and_retrieval_generate(capsys, tmp_path, tiny_model_dir):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("abcabcabc hello world, hello world, hello world\n")
    (corpus / "b.jsonl").write_text(json.dumps({"text": "the quick brown fox"}) + "\n" + json.dumps("xyz xyz") + "\n")
    code, _, err = _run(capsys, ["index", "build", str(corpus), "--out", str(tmp_path / "ds"),
                                 "--model", str(tiny_model_dir)])
    assert code == 0 and "3 documents" in err
    index = RetrievalIndex.load(tmp_path / "ds")
    assert index.meta["num_documents"] == 3 and (index.tokens == SEPARATOR).sum() == 3
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello world, hello", "--max-new-tokens", "12",
            "--json"]
    code, out, _ = _run(capsys, base + ["--drafter", "none"])
    plain = json.loads(out)
    code, out, _ = _run(capsys, base + ["--drafter", "retrieval", "-O", f"index={tmp_path / 'ds'}", "-k", "4",
                                        "--num-drafts", "2"])
    assert code == 0
    assert json.loads(out)["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]


def _bad_index_inputs(tmp_path, model_dir):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n ")
    (tmp_path / "binary.txt").write_bytes(b"\x7fELF\x00\x01\x02" * 10)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    (tmp_path / "nodocs").mkdir()
    (tmp_path / "nodocs" / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "afile").write_text("x")
    index = ["index", "build", "--model", str(model_dir), "--out", str(tmp_path / "out")]
    return [
        (index + [str(tmp_path / "missing.txt")], "corpus not found"),
        (index + [str(tmp_path / "empty.txt")], "is empty"),
        (index + [str(tmp_path / "blank.txt")], "is empty"),
        (index + [str(tmp_path / "binary.txt")], "binary file"),
        (index + [str(tmp_path / "latin1.txt")], "not UTF-8"),
        (index + [str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not a JSON line"),
        (index + [str(tmp_path / "nodocs")], "no .txt or .jsonl files"),
        (["index", "build", str(tmp_path / "blank.txt"), "--out", str(tmp_path / "afile")], "is a file"),
        (["index", "build", str(tmp_path / "afile"), "--out", str(tmp_path / "o2"), "--model", str(tmp_path)],
         "cannot load a tokenizer"),
    ]


def test_index_bad_input_gives_one_line_errors(capsys, tmp_path, tiny_model_dir):
    for argv, message in _bad_index_inputs(tmp_path, tiny_model_dir):
        code, _, err = _run(capsys, argv)
        assert code == 2, argv
        assert message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
