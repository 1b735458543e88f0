"""The files users hand to genspec: text to read (corpora, edit sources, standard input: UTF-8 or a clear
one-line error), and output files checked writable before any slow work."""
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


def check_output_file(path: str | Path, what: str = "output file") -> None:
    """Make sure ``path`` can be written (its directory is created if missing) before the work that
    produces it starts: a directory in its place, a file in the way of its directory or a read-only
    directory raise :class:`InputFileError` now, not after minutes of work. Nothing is written to it."""
    path = Path(path)
    if path.is_dir():
        raise InputFileError(f"{what} {path} is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".genspec-write-test-"):
            pass
    except OSError as exc:
        raise InputFileError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc
