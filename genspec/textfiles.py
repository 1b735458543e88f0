"""The files users hand to genspec: text to read (corpora, edit sources, standard input: UTF-8 or a clear
one-line error), and output files and directories checked before any slow work: writable, and never
overwriting an earlier result unless the command's ``--force`` says so."""
from __future__ import annotations

import tempfile
from pathlib import Path

from genspec.errors import InputFileError


def read_utf8_text(path: str | Path, what: str, expected: str = "UTF-8 text") -> str:
    """The text of ``path``; ``what`` names the file in errors ("corpus file", "edit source file"),
    ``expected`` says what it must be. Missing, unreadable, binary and non-UTF-8 files raise
    :class:`InputFileError`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise InputFileError(f"{what} not found: {path}") from exc
    except OSError as exc:
        raise InputFileError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    if b"\x00" in data[:8192]:
        raise InputFileError(f"{path}: binary file; the {what} must be {expected}")
    return decode_utf8(data, str(path), f"the {what} must be {expected}")


def decode_utf8(data: bytes, source: str, hint: str = "") -> str:
    """``data`` decoded as UTF-8; bytes that are not raise :class:`InputFileError` naming ``source`` and the
    offset of the first bad byte (and ``hint``, what the input must be)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{source}: not UTF-8 text (byte {exc.start}: 0x{data[exc.start]:02x})"
                             + (f"; {hint}" if hint else "")) from exc


def some_names(names: list[str]) -> str:
    """The first few of ``names`` for a one-line message: ``a, b, c and 4 more``."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_output_file(path: str | Path, what: str = "output file", force: bool = False) -> None:
    """Make sure ``path`` can be written (its directory is created if missing) before the work that
    produces it starts: a directory in its place, a file in the way of its directory or a read-only
    directory raise :class:`InputFileError` now, not after minutes of work. A file already there that is
    not empty is an earlier result: refused unless ``force`` (the command's ``--force``). Nothing is
    written to it."""
    path = Path(path)
    if path.is_dir():
        raise InputFileError(f"{what} {path} is a directory; give a file name")
    if not force and path.is_file() and path.stat().st_size > 0:
        raise InputFileError(f"{what} {path} already exists; pass --force to overwrite it, or give another file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".genspec-write-test-"):
            pass
    except OSError as exc:
        raise InputFileError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc


def check_output_dir(directory: str | Path, force: bool = False, what: str = "--out", *, create: bool = True,
                     instead: str = "") -> None:
    """The check of every command that writes its results into a directory, before any model loads or
    work starts: ``directory`` must be new or empty, or ``force`` given (the command's ``--force``: its
    files are then written over those of the same name; other files stay). A directory that holds files
    is an earlier result, which a run would overwrite. A file in its place raises too; with ``create``
    the directory is made and a file written and removed in it, so a directory that cannot be written
    fails now rather than after the work. ``instead`` adds the command's other way out to the refusal
    (", or --resume to continue its training"). Every refusal is one :class:`InputFileError` line."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise InputFileError(f"{what} {directory} is a file; give a directory")
    if not force and directory.is_dir():
        try:
            entries = sorted(p.name for p in directory.iterdir())
        except OSError as exc:
            raise InputFileError(f"cannot read output directory {directory}: {exc.strerror or exc}") from exc
        if entries:
            raise InputFileError(f"{what} {directory} exists and is not empty (it holds {some_names(entries)}); "
                                 f"give a new or empty directory, or pass --force to overwrite its files{instead}")
    if not create:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".genspec-write-test-"):
            pass
    except OSError as exc:
        raise InputFileError(f"cannot write to output directory {directory}: {exc.strerror or exc}") from exc
