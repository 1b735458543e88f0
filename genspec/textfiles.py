"""Reading the text files users hand to genspec (corpora, edit sources): UTF-8 or a clear one-line error."""
from __future__ import annotations

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
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{path}: not UTF-8 text (byte {exc.start}); the {what} must be {expected}") from exc
