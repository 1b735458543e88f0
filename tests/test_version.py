"""The version is written once (``genspec.__version__``): the package metadata reads it from there,
``genspec --version`` prints it, and the changelog has a section for it."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import genspec
from genspec.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_genspec_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"genspec {genspec.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", genspec.__version__)


def test_python_m_genspec_version_exits_zero():
    done = subprocess.run([sys.executable, "-m", "genspec", "--version"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"genspec {genspec.__version__}"


def test_the_version_is_written_in_one_place():
    """pyproject.toml declares the version dynamic, read from ``genspec.__version__``: no second copy."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "genspec.__version__"}


def test_the_changelog_has_a_section_for_this_version():
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog")
    assert re.search(rf"^## \[{re.escape(genspec.__version__)}\]", changelog, re.M)
