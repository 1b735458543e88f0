"""The datastore of the ``retrieval`` drafter (:mod:`genspec.drafters.retrieval`) and of the n-gram
cache's static tables: corpus reading and tokenising, suffix arrays, and :class:`RetrievalIndex`.

A datastore (``genspec index build CORPUS --out DIR``) is the corpus tokenised with the target's
tokenizer, documents separated by :data:`SEPARATOR`, plus the suffix array of the *reversed* token
array. Reversed, because the pattern is the sequence's suffix and we want the longest one that
occurs: the reversed suffix is a prefix, so one binary-search narrowing per token extends the match
by one token to the left, and the longest match costs ``O(n log N)`` instead of a binary search per
candidate length.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from genspec.dirs import move_into_place, staging_directory
from genspec.errors import ConfigError, InputFileError
from genspec.textfiles import check_output_dir, read_utf8_text, some_names

#: token id that separates documents in the datastore (never a real token, never matched)
SEPARATOR = 0xFFFFFFFF
INDEX_FORMAT = "genspec-retrieval-index"
INDEX_VERSION = 1
#: the files of an index directory
INDEX_FILES = ("index.json", "tokens.npy", "reversed_suffix_array.npy")
#: text whose token ids identify a tokenizer (an index only fits models with the same tokenizer)
TOKENIZER_PROBE = "The quick brown fox, 1234 ünïcödé\n\tdef f(x): return x"
_TEXT_SUFFIXES = (".txt", ".jsonl")


# ------------------------------------------------------------------------------- corpus reading
def _read_text(path: Path) -> str:
    return read_utf8_text(path, "corpus file", "UTF-8 text (.txt) or JSON lines (.jsonl)")


def _read_jsonl(path: Path) -> list[str]:
    """The ``"text"`` field of each line (or the line itself if it is a JSON string)."""
    documents = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise InputFileError(f"{path}:{number}: not a JSON line ({exc.msg})") from exc
        text = record.get("text") if isinstance(record, dict) else record
        if not isinstance(text, str):
            raise InputFileError(f"{path}:{number}: expected a JSON string or an object with a \"text\" string")
        documents.append(text)
    return documents


def read_corpus(path: str | Path) -> list[str]:
    """Documents of a corpus: a text file (one document), a ``.jsonl`` file (one per line), or a
    directory of ``.txt`` / ``.jsonl`` files (searched recursively, in name order)."""
    path = Path(path)
    if not path.exists():
        raise InputFileError(f"corpus not found: {path}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES)
        if not files:
            raise InputFileError(f"{path}: no .txt or .jsonl files in this directory")
    else:
        files = [path]
    documents = []
    for file in files:
        documents.extend(_read_jsonl(file) if file.suffix.lower() == ".jsonl" else [_read_text(file)])
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise InputFileError(f"corpus {path} is empty: no text to index")
    return documents


def _line_chunks(text: str, size: int) -> list[str]:
    """``text`` cut after newlines into pieces of about ``size`` characters (so that a fast tokenizer
    tokenises one long document on all cores; a cut after a newline changes almost no token)."""
    chunks, start = [], 0
    while start < len(text):
        cut = text.find("\n", start + size)
        end = len(text) if cut < 0 else cut + 1
        chunks.append(text[start:end])
        start = end
    return chunks


def tokenize_documents(documents: list[str], tokenizer, batch: int = 64, chunk_chars: int = 20_000) -> list[list[int]]:
    """Token ids of each document (no special tokens), with ``tokenizer`` (a Hugging Face tokenizer)."""
    if tokenizer is None:
        raise ConfigError("tokenising a corpus needs the model's tokenizer (the model directory has none)")
    pieces, owner = [], []
    for number, document in enumerate(documents):
        for chunk in _line_chunks(document, chunk_chars):
            pieces.append(chunk)
            owner.append(number)
    ids: list[list[int]] = [[] for _ in documents]
    for start in range(0, len(pieces), batch):
        encoded = tokenizer(pieces[start:start + batch], add_special_tokens=False, verbose=False)["input_ids"]
        for number, piece_ids in zip(owner[start:start + batch], encoded):
            ids[number].extend(piece_ids)
    return ids


def join_documents(documents: list[list[int]]) -> np.ndarray:
    """One ``uint32`` token array with :data:`SEPARATOR` after every document."""
    total = sum(len(d) + 1 for d in documents)
    tokens = np.empty(total, dtype=np.uint32)
    at = 0
    for doc in documents:
        tokens[at:at + len(doc)] = doc
        tokens[at + len(doc)] = SEPARATOR
        at += len(doc) + 1
    return tokens


def corpus_tokens(path: str | Path, tokenizer) -> np.ndarray:
    """The token array of a corpus (tokenised with ``tokenizer``) or of an index directory."""
    if (Path(path) / "index.json").is_file():
        return RetrievalIndex.load(path).tokens
    tokens = join_documents(tokenize_documents(read_corpus(path), tokenizer))
    if not (tokens != SEPARATOR).any():
        raise InputFileError(f"corpus {path} is empty: it tokenises to no tokens")
    return tokens


# ------------------------------------------------------------------------------- suffix arrays
def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of the suffixes of ``tokens`` in lexicographic order (a suffix that is a
    prefix of another sorts first). Uses libdivsufsort (``pydivsufsort``) when installed, else
    :func:`suffix_array_doubling`; both give the same (unique) order."""
    tokens = np.ascontiguousarray(tokens)
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        from pydivsufsort import divsufsort
    except ImportError:
        return suffix_array_doubling(tokens)
    return np.asarray(divsufsort(tokens.astype(np.uint32, copy=False))).astype(_index_dtype(len(tokens)))


def suffix_array_doubling(tokens: np.ndarray) -> np.ndarray:
    """Prefix doubling in numpy: sort by the first 2^i tokens' ranks until all ranks differ;
    ``O(N log N)`` per round, ``log2`` (longest repeat) rounds."""
    n = len(tokens)
    rank = np.unique(np.asarray(tokens), return_inverse=True)[1].astype(np.int64).reshape(-1)
    order = np.argsort(rank, kind="stable")
    step = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)  # past the end sorts first
        second[:n - step] = rank[step:]
        order = np.lexsort((second, rank))
        first_sorted, second_sorted = rank[order], second[order]
        boundary = np.ones(n, dtype=bool)
        boundary[1:] = (first_sorted[1:] != first_sorted[:-1]) | (second_sorted[1:] != second_sorted[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(boundary) - 1
        if boundary.all() or step >= n:
            return order.astype(_index_dtype(n))
        step *= 2


def _index_dtype(n: int):
    return np.int32 if n < 2 ** 31 else np.int64


# ------------------------------------------------------------------------------- the index
class RetrievalIndex:
    """Token array ``tokens`` ``[N]`` (uint32, documents separated by :data:`SEPARATOR`) and the
    suffix array ``reversed_suffix_array`` ``[N]`` of ``tokens[::-1]``."""

    def __init__(self, tokens: np.ndarray, reversed_suffix_array: np.ndarray, meta: dict | None = None):
        self.tokens = np.ascontiguousarray(tokens)
        self.reversed_suffix_array = np.ascontiguousarray(reversed_suffix_array)
        self.meta = dict(meta or {})
        # the binary search reads single entries: a memoryview gives Python ints quicker than numpy does
        self._token_at = memoryview(self.tokens)
        self._suffix_at = memoryview(self.reversed_suffix_array)

    @classmethod
    def from_documents(cls, documents: list[list[int]], meta: dict | None = None) -> "RetrievalIndex":
        """Index token-id documents directly (no tokenizer)."""
        tokens = join_documents([list(d) for d in documents])
        if not (tokens != SEPARATOR).any():
            raise InputFileError("cannot index an empty corpus: no tokens")
        return cls(tokens, suffix_array(tokens[::-1]), meta)

    def save(self, directory: str | Path, force: bool = False) -> Path:
        """Write the index to ``directory``: a new or empty directory, or one that holds a retrieval index
        and nothing else if ``force`` (see :func:`check_index_destination`). Written into a temporary
        directory beside it and renamed at the end, so an interrupted build never leaves half an index
        and the old index stays whole until the new one is complete."""
        directory = Path(directory)
        check_index_destination(directory, force)
        try:
            staged = staging_directory(directory)
            try:
                np.save(staged / "tokens.npy", self.tokens)
                np.save(staged / "reversed_suffix_array.npy", self.reversed_suffix_array)
                meta = {**self.meta, "format": INDEX_FORMAT, "version": INDEX_VERSION, "num_tokens": len(self.tokens)}
                (staged / "index.json").write_text(json.dumps(meta, indent=1) + "\n")
                move_into_place(staged, directory)
            finally:
                shutil.rmtree(staged, ignore_errors=True)
        except OSError as exc:
            raise InputFileError(f"cannot write the index to {directory}: {exc.strerror or exc}") from exc
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "RetrievalIndex":
        """Load a saved index (memory-mapped, so a large datastore costs no load time), validated
        (:func:`read_index_files`): a damaged index is an :class:`InputFileError` naming the damaged file."""
        meta, tokens, suffixes = read_index_files(directory)
        return cls(tokens, suffixes, meta)

    def __len__(self) -> int:
        return len(self.tokens)

    # ---------------------------------------------------------------- search
    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """Sub-range of suffix-array rows ``[lo, hi)`` (which share ``depth`` tokens) whose next token
        is ``token``: two binary searches (rows are sorted by that token; -1 = past the corpus start)."""
        token_at, suffix_at, last = self._token_at, self._suffix_at, len(self.tokens) - 1 - depth
        a, b = lo, hi
        while a < b:
            mid = (a + b) // 2
            at = last - suffix_at[mid]
            if (token_at[at] if at >= 0 else -1) < token:
                a = mid + 1
            else:
                b = mid
        start, b = a, hi
        while a < b:
            mid = (a + b) // 2
            at = last - suffix_at[mid]
            if (token_at[at] if at >= 0 else -1) <= token:
                a = mid + 1
            else:
                b = mid
        return start, a

    def longest_suffix_match(self, sequence: list[int], max_length: int) -> tuple[int, int, int]:
        """``(length, lo, hi)``: the longest suffix of ``sequence`` (at most ``max_length`` tokens)
        occurring in the datastore and its rows ``[lo, hi)`` of the reversed suffix array."""
        lo, hi, length = 0, len(self.tokens), 0
        for token in reversed(sequence[max(0, len(sequence) - max_length):] if max_length > 0 else []):
            a, b = self._narrow(lo, hi, length, token)
            if a == b:
                break
            lo, hi, length = a, b, length + 1
        return length, lo, hi

    def continuations(self, lo: int, hi: int, width: int, max_matches: int) -> np.ndarray:
        """``[M, width]`` tokens following the matches in rows ``[lo, hi)`` (at most ``max_matches``,
        evenly spaced), -1 after a document's end."""
        rows = np.arange(lo, hi) if hi - lo <= max_matches else np.linspace(lo, hi - 1, max_matches).astype(np.int64)
        starts = len(self.tokens) - np.asarray(self.reversed_suffix_array[rows], dtype=np.int64)
        at = starts[:, None] + np.arange(width)[None, :]
        inside = at < len(self.tokens)
        follow = np.where(inside, np.asarray(self.tokens[np.minimum(at, len(self.tokens) - 1)], dtype=np.int64), -1)
        follow[follow == SEPARATOR] = -1
        return np.where(np.cumsum(follow < 0, axis=1) > 0, -1, follow)  # nothing after a boundary


# ------------------------------------------------------------------------------- index files
def _rebuild_hint(directory: Path) -> str:
    return f"rebuild it with: genspec index build CORPUS --out {directory} --force"


def _is_index(directory: Path) -> bool:
    try:
        meta = json.loads((directory / "index.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == INDEX_FORMAT


def check_index_destination(directory: str | Path, force: bool = False) -> None:
    """Raise :class:`InputFileError` unless an index may be written to ``directory``: it does not exist,
    is empty, or (with ``force``) holds a genspec retrieval index and nothing else. A directory with
    other files is never replaced, not even with ``force``: the index replaces the whole directory, and
    they would be lost. The rest is the check every command's output directory gets
    (:func:`genspec.textfiles.check_output_dir`)."""
    directory = Path(directory)
    entries = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if entries:
        if not _is_index(directory):
            raise InputFileError(f"--out {directory} is not empty and is not a genspec retrieval index (it holds "
                                 f"{some_names(entries)}); give a new or empty directory")
        others = [name for name in entries if name not in INDEX_FILES]
        if others:
            raise InputFileError(f"--out {directory} holds a retrieval index and other files ({some_names(others)}); "
                                 f"not replacing it: give a new or empty directory")
    check_output_dir(directory, force, create=False)


def read_index_files(directory: str | Path) -> tuple[dict, np.ndarray, np.ndarray]:
    """``(meta, tokens [N] uint32, reversed_suffix_array [N] int32/int64)`` of an index directory, the
    arrays memory-mapped. Every check names the file it failed on: ``index.json`` missing, not JSON or
    not an index of this version; an ``.npy`` file missing, empty, truncated, with trailing bytes, of
    the wrong dtype or shape; lengths that differ from each other or from ``index.json``. The one
    validation of both users of an index: the ``retrieval`` drafter and ``ngram-cache``'s ``corpus``."""
    directory = Path(directory)
    meta_path = directory / "index.json"
    if not meta_path.is_file():
        raise InputFileError(f"no retrieval index at {directory} (build one with: genspec index build CORPUS "
                             f"--out {directory})")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputFileError(f"{meta_path}: not valid JSON ({exc}); {_rebuild_hint(directory)}") from exc
    if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT or meta.get("version") != INDEX_VERSION:
        raise InputFileError(f"{meta_path}: not a genspec retrieval index of version {INDEX_VERSION}; "
                             f"{_rebuild_hint(directory)}")
    tokens = _read_npy(directory / "tokens.npy", (np.uint32,), directory)
    suffixes = _read_npy(directory / "reversed_suffix_array.npy", (np.int32, np.int64), directory)
    expected = meta.get("num_tokens")
    if len(tokens) != len(suffixes) or len(tokens) != expected:
        raise InputFileError(f"{directory}: tokens.npy has {len(tokens):,} entries, reversed_suffix_array.npy "
                             f"{len(suffixes):,} and index.json says {expected}; {_rebuild_hint(directory)}")
    return meta, tokens, suffixes


def _read_npy(path: Path, dtypes: tuple, directory: Path) -> np.ndarray:
    """A 1-D ``.npy`` array of one of ``dtypes``, memory-mapped, checked to fill its file exactly."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise InputFileError(f"{path}: missing; {_rebuild_hint(directory)}") from None
    if size == 0:
        raise InputFileError(f"{path}: empty file (0 bytes); {_rebuild_hint(directory)}")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:  # bad magic or header, truncated data ("mmap length ...")
        raise InputFileError(f"{path}: damaged .npy file ({exc}); {_rebuild_hint(directory)}") from exc
    if not isinstance(array, np.memmap) or array.ndim != 1 or array.dtype not in dtypes:
        raise InputFileError(f"{path}: expected a 1-D array of {' or '.join(np.dtype(d).name for d in dtypes)}, "
                             f"found {getattr(array, 'dtype', '?')} of shape {getattr(array, 'shape', '?')}; "
                             f"{_rebuild_hint(directory)}")
    if array.offset + array.nbytes != size:
        raise InputFileError(f"{path}: {size:,} bytes where the header announces {array.offset + array.nbytes:,}; "
                             f"{_rebuild_hint(directory)}")
    return array


def tokenizer_fingerprint(tokenizer) -> dict:
    """What identifies a tokenizer in an index's metadata: its name, size and the ids of a probe text."""
    return {"tokenizer": getattr(tokenizer, "name_or_path", "") or "", "tokenizer_size": len(tokenizer),
            "tokenizer_probe": list(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])}


def check_index_fits(index: RetrievalIndex, target) -> None:
    """Raise :class:`ConfigError` if the index was built with another tokenizer than ``target``'s."""
    tokenizer = getattr(target, "tokenizer", None)
    probe = index.meta.get("tokenizer_probe")
    if tokenizer is not None and probe is not None and tokenizer_fingerprint(tokenizer)["tokenizer_probe"] != probe:
        raise ConfigError(f"the retrieval index was built with another tokenizer "
                          f"({index.meta.get('tokenizer') or 'unknown'}); rebuild it with --model for this model")
    vocab = getattr(target, "vocab_size", None)
    if vocab is not None and index.meta.get("tokenizer_size", 0) > vocab:
        raise ConfigError(f"the retrieval index has token ids up to {index.meta['tokenizer_size'] - 1} but the "
                          f"model's vocabulary has {vocab}; rebuild it with --model for this model")
