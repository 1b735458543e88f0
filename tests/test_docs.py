"""The manual (``docs/``, ``mkdocs.yml``) and the README as its front door.

The manual builds with ``mkdocs build --strict`` (a broken link or anchor, a missing page or an API reference
to a name that does not exist fails the build), every folder of ``benchmarks/results`` is linked from it and
every benchmark script is cited by it, no package file cites a results file, and the README keeps the two
set-up commands that CI and a fresh clone run.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"


def _manual_pages() -> list[Path]:
    """The manual's own pages (not the benchmark reports that docs/results, a link, brings into the site)."""
    return sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] != "results")


def _manual_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in _manual_pages())


def test_the_manual_builds_strictly(tmp_path):
    """``mkdocs build --strict`` in a temporary directory: every page, link, anchor, image and API reference
    resolves (about 15 s). Skipped only where mkdocs is not installed (``pip install -e ".[docs]"``)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip('mkdocs is not installed: pip install -e ".[docs]" to build the manual')
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
                           "--site-dir", str(site)], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "SpeculativeEngine" in (site / "reference" / "engine" / "index.html").read_text(encoding="utf-8")
    assert (site / "drafters" / "index.html").is_file() and (site / "theory" / "index.html").is_file()
    assert (site / "results" / "all_kinds" / "report" / "index.html").is_file()  # the canonical reports are pages


def test_every_results_folder_is_linked_from_the_manual():
    text = _manual_text()
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert len(folders) >= 10
    assert [name for name in folders if f"results/{name}/" not in text] == []


def test_results_are_compact():
    """benchmarks/results holds the canonical runs only: under 10 MB in all, no file of 2 MB or more, every
    folder with its report.md, and no uncompressed results file (per-token records stay out)."""
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 10 * 2**20
    assert [p for p in files if p.stat().st_size >= 2 * 2**20] == []
    assert [p for p in files if p.name == "results.json"] == []
    assert [p.name for p in RESULTS.iterdir() if p.is_dir() and not (p / "report.md").is_file()] == []
    assert [p.name for p in RESULTS.iterdir() if not p.is_dir()] == []


def test_every_benchmark_script_is_cited_by_the_manual():
    text = _manual_text()
    scripts = [p for p in (REPO / "benchmarks").rglob("*") if p.suffix in (".py", ".sh")
               and "results" not in p.relative_to(REPO / "benchmarks").parts]
    assert len(scripts) >= 20
    assert [str(p.relative_to(REPO)) for p in scripts if p.name not in text] == []


def test_no_package_file_cites_benchmark_results():
    """Package code says what and why with the command that measures a number, not a results file."""
    citing = [str(p.relative_to(REPO)) for p in (REPO / "genspec").rglob("*.py")
              if "benchmarks/results" in p.read_text(encoding="utf-8")]
    assert citing == []


def test_readme_is_a_short_front_door_with_the_two_commands():
    """The README's first two bash blocks are the contract CI (.ci/run) and a fresh clone run: set up (llama.cpp
    built without its AMX kernels) and demo, then set up with every extra (the manual's tools and llama.cpp
    included, so CI builds the manual and tests the llamacpp backend) and test. Its relative links resolve, and
    it stays short: the manual holds the rest."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    build = f"""CMAKE_ARGS="-DCMAKE_C_FLAGS='{flags}' -DCMAKE_CXX_FLAGS='{flags}'" """
    assert blocks[0] == build + 'pip install torch==2.13.0 -e ".[serve,test,llamacpp]" && genspec demo\n'
    assert blocks[1] == build + 'pip install torch==2.13.0 -e ".[serve,test,ray,docs,llamacpp]" && pytest -q\n'
    assert len(text.splitlines()) <= 200
    links = [target for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text) if "://" not in target]
    assert links and [target for target in links if not (REPO / target).exists()] == []


def test_the_front_pages_say_where_speculation_is_exact():
    """The README's and the manual's opening paragraph promise what holds on every backend (the acceptance rule
    is lossless) and say where the text is plain decoding's to the token: llama.cpp's exact kernels (the
    default) and torch with exact kernels, not llama.cpp's fast kernels, whose batched kernels flip near-ties; both link
    the section that explains it. No page promises unchanged output without that caveat, and the Concepts page's
    guarantee names the backends."""
    section = "## What is exact on each backend"
    assert f"\n{section}\n" in (DOCS / "backends.md").read_text(encoding="utf-8")
    for page, link in ((README, "docs/backends.md#what-is-exact-on-each-backend"),
                       (DOCS / "index.md", "backends.md#what-is-exact-on-each-backend")):
        text = page.read_text(encoding="utf-8")
        opening = " ".join(text.split("\n\n")[1].split())  # the paragraph under the title, one line
        assert "lossless" in opening and link in opening, page.name
        assert "llama.cpp" in opening and "PyTorch with `--kernels exact`" in opening, page.name
        assert "--kernels exact" in opening or "exact kernels" in opening, page.name
        assert "--kernels fast" in opening and "near-tie" in opening, page.name
    for page in [README, *_manual_pages()]:
        assert "without changing what it generates" not in page.read_text(encoding="utf-8"), page.name
    concepts = " ".join((DOCS / "concepts.md").read_text(encoding="utf-8").split())
    assert "**Greedy speculation equals plain decoding** on the torch backend in float32" in concepts


def test_the_docs_extra_installs_the_manuals_tools():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[\[<>=]", requirement)[0] for requirement in extras["docs"]}
    assert names == {"mkdocs", "mkdocs-material", "mkdocstrings"}
