"""Output directories written whole or not at all (the default model's cache, retrieval indexes): built
in a temporary directory beside the target, then renamed into place, so a reader never sees half of one
and an interrupted writer leaves only a hidden ``.NAME-*`` directory (never a damaged ``NAME``)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def staging_directory(target: Path, prefix: str | None = None) -> Path:
    """A new, empty directory beside ``target`` named ``.<target name>-XXXXXXXX`` (or ``prefix`` + XXXXXXXX)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix or f".{target.name}-", dir=target.parent))


def move_into_place(staged: Path, target: Path) -> None:
    """Give ``staged`` ordinary permissions and rename it to ``target``. An existing ``target`` is moved
    aside first (so the swap itself is one rename), then deleted."""
    make_readable(staged)
    if target.exists():
        aside = staging_directory(target, prefix=f".{target.name}-stale-")
        os.replace(target, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(staged, target)


def ordinary_mode(directory: bool) -> int:
    """The permissions ``open`` / ``mkdir`` would give under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def make_readable(directory: Path) -> None:
    """``mkdtemp`` makes a directory private (0700); give it and its files ordinary permissions (umask)."""
    directory.chmod(ordinary_mode(directory=True))
    for path in directory.iterdir():
        path.chmod(ordinary_mode(path.is_dir()))
