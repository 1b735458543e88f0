"""Adapter for a GGUF model run by llama.cpp (through llama-cpp-python's low-level API).

Design: each engine row is a llama.cpp *sequence*. By default every sequence has a KV cache stream of its own
(``kv_unified`` off: a row's attention reads its own cells only); a drafter that drafts token trees makes the
cache one shared by all sequences (:meth:`LlamaCppLM.reserve_candidates`), so that a token may belong to
several. A block is one ``llama_decode`` batch whose tokens carry their row's sequence id and position (row
length + depth) and ask for logits only where the caller reads them; each row feeds its own tokens, no
padding (:meth:`LlamaCppLM.block_shapes` says how llama.cpp splits such a batch). Rolling back is
``llama_memory_seq_rm`` past the kept tokens. A token tree is laid out as one temporary sequence per leaf: a
node belongs to the sequences of every leaf below it, so each node attends exactly to its ancestors
(llama.cpp masks by the query token's first sequence and by position); the kept path is copied into the
row's sequence and the temporary sequences are dropped.

The sliding-window layers keep a full-size cache (``swa_full``): a window cache forgets the tokens a
rolled-back row needs again.

Final hidden states (the output layer's inputs, which heads read) come with llama.cpp's embeddings switched on
for the decodes that want them (no pooling: a state per token). llama.cpp then makes every token of the batch an
output and runs its output layer on it, so a prefill asked for states takes them for its last tokens only
(:meth:`LlamaCppLM.add_rows`' ``hidden_last``); a verify block has every token an output anyway. Per-layer
states are not given (Gemma 3's graph records no layer inputs for ``llama_set_embeddings_layer_inp``), and
self-speculation that reuses the target's weights in place (early exit, layer skip) needs the torch backend;
its quantised and layer-skipped GGUF copies do not.
"""
from __future__ import annotations

import ctypes
import enum
import functools
import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from genspec.errors import ConfigError, InputFileError
from genspec.kernels import LMHead
from genspec.models import gguf_file
from genspec.models.base import CausalLM, PrefixKV, equal_split, states_kept
from genspec.models.gguf_file import check_complete

#: tokens per row (prompt + generated) unless asked otherwise: the KV cache holds ``max_rows`` of them, in
#: float16 for every layer (the full-size sliding-window cache): 18 KB a token on the embedded Gemma 3 270M
DEFAULT_CONTEXT = 8192
#: the most tokens one row's verify block may hold (a tree's nodes); the batch and the number of
#: temporary sequences are sized from it
MAX_BLOCK_TOKENS = 64
#: temporary sequences per row for the leaves of its token trees
MAX_LEAVES_PER_ROW = 8
#: llama.cpp's limit on sequence ids (LLAMA_MAX_SEQ)
LLAMA_MAX_SEQUENCES = 256


class KVCacheType(enum.IntEnum):
    """The number type of the KV cache, by its ggml type id. ``F16`` is llama.cpp's default. ``BF16`` also takes
    llama.cpp's CPU flash attention off the paths that depend on the batch: with an f16 or f32 cache a lone query
    past 512 cells has its cells split across the threads and the partial sums merged, while a block's queries
    each run over all cells in order, so a position's logits differ between the two; a bf16 cache always runs the
    second way and accumulates the values in float32."""

    F16 = 1
    BF16 = 30


class Tiling(enum.Enum):
    """llama.cpp's tiled K-quant matrix kernels, one setting per process: llama.cpp reads ``GGML_CPU_TILED_MM``
    (off when 0) and ``GGML_CPU_TILED_MM_FORCE`` (every batch when 1) once, at the first matrix product.

    ``FROM_8_ROWS`` (llama.cpp's default) tiles products of 8 or more rows and runs one dot product per output
    element below, so a row's logits move when its batch crosses 8 tokens. ``OFF`` and ``EVERY_BATCH`` each run
    one kernel for every batch: the untiled one is the cheaper for a batch of one or a few tokens, the tiled one
    for wide batches and prompts (the manual's Backends page has the costs). Both are batch invariant for the
    K-quants (measured bitwise on Q4_K and Q6_K: the tiled kernel sums each 256-weight slab in the same order
    whatever the number of rows) and do not touch the other quantised types."""

    OFF = "off"
    FROM_8_ROWS = "from 8 rows"
    EVERY_BATCH = "every batch"

    @classmethod
    def of_environment(cls) -> Tiling:
        """The setting llama.cpp reads from this process's environment, as it reads it."""
        enabled = os.environ.get("GGML_CPU_TILED_MM")
        forced = os.environ.get("GGML_CPU_TILED_MM_FORCE")
        if enabled is not None and _atoi(enabled) == 0:
            return cls.OFF
        return cls.EVERY_BATCH if forced is not None and _atoi(forced) == 1 else cls.FROM_8_ROWS

    @property
    def batch_invariant(self) -> bool:
        return self is not Tiling.FROM_8_ROWS


class Kernels(str, enum.Enum):
    """Which kernels compute a target's decode: llama.cpp's CPU kernels on the llamacpp backend, genspec's on the
    torch backend.

    ``auto`` (the default): each backend's own default, ``exact`` on llamacpp, ``fast`` on torch, whose exact
    kernels cost more than the 10% a default may (:meth:`on_torch`; the manual's Backends page has the costs).

    ``exact``: a row's logits do not depend on how many tokens or rows share its decode, so greedy
    speculation gives plain greedy decoding's tokens and a seeded sample repeats whatever the draft lengths. It
    runs flash attention over a bfloat16 KV cache (:class:`KVCacheType`), keeps the weights as the file lays them
    out (no repacking: repacked Q4_K rows take a 4-row kernel in groups of 4 and a 1-row one for the rest) and
    turns llama.cpp's tiled matrix kernels off for the process (:class:`Tiling`: K-quant products are one dot
    product per output element). It holds for quantised weights; float weights (F32, F16, BF16) are multiplied by
    llamafile's kernels from 2 rows on, a stock build's, which sum in another order than the 1-row dot product, so
    a model holding any is not batch invariant (:attr:`LlamaCppLM.batch_invariant` says which).

    ``exact-tiled``: exact too, with the tiled kernels for every batch (``Tiling.EVERY_BATCH``): dearer for a
    one-token step, cheaper for prompts and for batches of many rows, so it suits a server that runs full batches.

    ``fast``: llama.cpp's own defaults (a float16 cache, tiled kernels from 8 rows, repacking if asked): a big block
    or batch costs a little less than exact ones, and a greedy token may flip at a near-tie. The manual's Backends
    page has the costs."""

    AUTO = "auto"
    EXACT = "exact"
    EXACT_TILED = "exact-tiled"
    FAST = "fast"

    @classmethod
    def parse(cls, value: str | Kernels) -> Kernels:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"unknown kernels {value!r}; choose from: {', '.join(k.value for k in cls)}") from None

    @property
    def exact(self) -> bool:
        """On llama.cpp: a row's logits do not depend on the batch (``auto`` is ``exact`` there)."""
        return self is not Kernels.FAST

    def on_torch(self) -> bool:
        """Whether a torch model runs exact (``HFCausalLM(..., exact=True)``): for ``exact`` only; ``auto`` and
        ``fast`` take its default kernels, and ``exact-tiled``, llama.cpp's tiled kernels, is refused."""
        if self is Kernels.EXACT_TILED:
            raise ConfigError("kernels exact-tiled are llama.cpp's; a torch model takes exact or fast")
        return self is Kernels.EXACT

    @property
    def tiling(self) -> Tiling:
        """The tiled-kernel setting these kernels ask of the process."""
        return {Kernels.AUTO: Tiling.OFF, Kernels.EXACT: Tiling.OFF,
                Kernels.EXACT_TILED: Tiling.EVERY_BATCH}.get(self, Tiling.FROM_8_ROWS)


#: weight types whose products give each output element one dot product in one order, whatever the number of
#: rows, under a batch-invariant :class:`Tiling` (measured bitwise: the manual's Backends page); float weights are
#: not among them (llamafile's kernels, from 2 rows)
_INVARIANT_WEIGHT_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})

#: llama.cpp's tiled-kernel setting in this process, decided by the first model made (None: none made yet)
_PROCESS_TILING: Tiling | None = None


def _process_tiling(wanted: Tiling) -> Tiling:
    """llama.cpp's tiled-kernel setting for this process: ``wanted`` if no model has been made yet (a variable
    the user set is left as it is; ``FROM_8_ROWS`` leaves the environment alone), else what the first model
    made."""
    global _PROCESS_TILING
    if _PROCESS_TILING is None:
        if wanted is Tiling.OFF:
            os.environ.setdefault("GGML_CPU_TILED_MM", "0")
        elif wanted is Tiling.EVERY_BATCH:
            os.environ.setdefault("GGML_CPU_TILED_MM_FORCE", "1")
        _PROCESS_TILING = Tiling.of_environment()
    return _PROCESS_TILING


def _atoi(text: str) -> int:
    """C's ``atoi``: the leading integer of ``text`` (0 if none)."""
    match = re.match(r"\s*([+-]?\d+)", text)
    return int(match.group(1)) if match else 0


def _float_weight_types(path: Path) -> set[str]:
    """The weight types (of tensors of 2 or more dimensions) in the GGUF file that are not among the batch-invariant
    quantised ones; an unreadable header counts as holding such weights."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) >= 2}
    except (OSError, ValueError, KeyError, IndexError):
        return {"unknown"}
    return types - _INVARIANT_WEIGHT_TYPES


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:
        raise ConfigError("the llamacpp backend needs llama-cpp-python: pip install 'genspec[llamacpp]' "
                          "(it compiles llama.cpp: several minutes on a 2-core CPU)") from exc
    return llama_cpp


_BACKEND_READY = False
_LOG_CALLBACK = None  # kept alive: llama.cpp holds the pointer


def _quiet_backend(llama_cpp) -> None:
    """Initialise llama.cpp once, with its log silenced (it writes model details to stderr)."""
    global _BACKEND_READY, _LOG_CALLBACK
    if _BACKEND_READY:
        return
    @llama_cpp.llama_log_callback
    def _ignore(level, text, user_data):
        return None

    _LOG_CALLBACK = _ignore
    llama_cpp.llama_log_set(_ignore, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _BACKEND_READY = True


class LlamaCppLM(CausalLM):
    """A GGUF model on llama.cpp. Build with :meth:`from_gguf`.

    ``max_rows`` rows (sequences) of up to ``context`` tokens each (capped by the model's trained context);
    ``threads`` CPU threads (default: all cores this process may use); ``device`` other than ``cpu`` offloads
    every layer to the GPU backend llama.cpp was built with (none: it stays on the CPU); ``repack`` lets
    llama.cpp repack the weights for its CPU kernels (off by default: see the comment where it is applied);
    ``shared_cache`` makes the KV cache one shared by all rows, which token trees need
    (:meth:`reserve_candidates` makes it so when a drafter drafts them), instead of a stream per row;
    ``flash_attention`` turns llama.cpp's fused attention on where the cache is a stream per row (on by
    default; a shared cache runs without it: :meth:`_make_context` says why); ``kv_cache_type`` the KV cache's
    number type (:class:`KVCacheType`; default: bf16 with exact kernels, f16 with fast ones); ``kernels``
    exact, exact-tiled or fast (:class:`Kernels`).

    :attr:`batch_invariant` is true where the logits are exact: exact kernels, quantised weights, the CPU, a
    cache stream per row (token trees' shared cache runs attention without flash attention, whose products
    depend on the batch), and llama.cpp's tiled kernels off or on for every batch in the process
    (:class:`Tiling`), which the first model made in a process decides (made with fast kernels, or after
    llama-cpp-python's own ``Llama`` has decoded, they run from 8 rows: set ``GGML_CPU_TILED_MM=0`` before
    either to keep them off)."""

    backend = "llamacpp"
    max_block_tokens = MAX_BLOCK_TOKENS
    # a block's cost climbs in steps of 4 tokens, in the output layer (with logits at the last position only it is
    # smooth): a 5-token block costs about what an 8-token one does and far more than a 4-token one, so no width
    # can be priced between two measured ones
    uneven_verify_cost = True

    def __init__(self, path: str | os.PathLike, tokenizer=None, context: int = DEFAULT_CONTEXT, max_rows: int = 8,
                 threads: int | None = None, device: str = "cpu", repack: bool = False, flash_attention: bool = True,
                 shared_cache: bool = False, kv_cache_type: KVCacheType | None = None,
                 kernels: Kernels | str = Kernels.EXACT):
        kernels = Kernels.parse(kernels)
        self.kernels = Kernels.EXACT if kernels is Kernels.AUTO else kernels
        exact = self.kernels.exact
        kv_cache_type = KVCacheType(kv_cache_type if kv_cache_type is not None
                                    else KVCacheType.BF16 if exact else KVCacheType.F16)
        if exact and repack:
            raise ConfigError("exact kernels keep the weights as the file lays them out: repacking needs "
                              "kernels='fast'")
        if exact and not flash_attention:
            raise ConfigError("exact kernels need flash attention (without it llama.cpp multiplies the attention "
                              "matrices with kernels that depend on the batch): use kernels='fast'")
        if exact and kv_cache_type is not KVCacheType.BF16:
            raise ConfigError(f"exact kernels need a bf16 KV cache (with {kv_cache_type.name.lower()} a lone "
                              "query past 512 cells splits its attention across threads): use kernels='fast'")
        llama_cpp = _import_llama_cpp()
        #: llama.cpp's tiled kernels in this process (:class:`Tiling`), set before its first decode
        self.tiling = _process_tiling(self.kernels.tiling)
        if exact and self.tiling is not self.kernels.tiling:
            consequence = ("its logits do not depend on the batch" if self.tiling.batch_invariant
                           else "this model's logits depend on the batch (batch_invariant is False)")
            warnings.warn(f"llama.cpp's tiled kernels run {self.tiling.value} in this process, as an earlier model "
                          f"or GGML_CPU_TILED_MM(_FORCE) set them, not {self.kernels.tiling.value} as "
                          f"{self.kernels.value} kernels ask: {consequence}", RuntimeWarning, stacklevel=2)
        _quiet_backend(llama_cpp)
        path = Path(path)
        if not path.is_file():
            raise InputFileError(f"no GGUF model at {path}")
        check_complete(path)  # a cut-short file named as such, not by llama.cpp's failure to load it
        self._invariant_kernels = (exact and self.tiling.batch_invariant and str(device) == "cpu" and not _float_weight_types(path))
        self._llama = llama_cpp
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0 if str(device) == "cpu" else -1
        if not repack:
            # the weights stay as the file lays them out (llama.cpp's CPU_REPACK buffers unused): exact kernels
            # need it (:class:`Kernels`), and fast ones then round a k-token block like k one-token steps more
            # often, at about the same cost (the manual's Backends page)
            model_params.use_extra_bufts = False
        elif b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info():
            # llama.cpp's AMX kernels have crashed at the first decode (a segfault in ggml_backend_amx_mul_mat;
            # Getting started says where): a build that has them keeps the weights out of the AMX buffers. The
            # README's set-up builds without them.
            model_params.use_extra_bufts = False
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise InputFileError(f"llama.cpp cannot load {path} (not a GGUF model it knows)")
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._vocab = vocab
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(vocab))
        trained = int(llama_cpp.llama_model_n_ctx_train(self._model))
        self.trained_context = trained if trained > 0 else None
        if context < 1:
            raise ConfigError(f"context must be at least 1 token, got {context}")
        self.max_context = min(context, trained) if trained > 0 else context
        if max_rows < 1:
            raise ConfigError(f"max_rows must be at least 1, got {max_rows}")
        self.max_rows = max_rows
        self.tokenizer = tokenizer
        self.path = path
        if max_rows >= LLAMA_MAX_SEQUENCES:
            raise ConfigError(f"max_rows must be below {LLAMA_MAX_SEQUENCES} (llama.cpp's sequences), got {max_rows}")
        self._threads = threads or len(os.sched_getaffinity(0))
        self._flash_attention = flash_attention
        self.kv_cache_type = kv_cache_type
        self._context = self._batch = None
        self._make_context(shared_cache)
        described = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self._model, described, 256)
        #: llama.cpp's description of the model: architecture, size and quantisation ("gemma3 270M Q4_K - Medium")
        self.description = described.value.decode("utf-8", "replace")
        self.num_layers = int(llama_cpp.llama_model_n_layer(self._model))
        #: the width of a final hidden state (the output layer's input)
        self.hidden_size = int(llama_cpp.llama_model_n_embd_out(self._model))
        eos = {int(llama_cpp.llama_vocab_eos(vocab)), int(llama_cpp.llama_vocab_eot(vocab))}
        self._eos = tuple(sorted(i for i in eos if 0 <= i < self.vocab_size))
        self.reset(0)

    def _make_context(self, shared: bool) -> None:
        """(Re)create the llama.cpp context and its batch, with no rows. ``shared``: one KV cache whose cells every
        sequence may share, a sequence per row and per tree leaf (token trees need it: a node belongs to the
        sequences of all the leaves below it). Otherwise one cache stream per row: a row's attention reads its
        own cells only, where in a shared cache every token's attention runs over the cells of all rows (masked),
        so its cost grows with the rows times their contexts (the manual's backends page has the figures)."""
        llama_cpp = self._llama
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._context:
            llama_cpp.llama_free(self._context)
            self._context = None
        max_rows = self.max_rows
        self._num_sequences = min(LLAMA_MAX_SEQUENCES, max_rows * (1 + MAX_LEAVES_PER_ROW)) if shared else max_rows
        self.shared_cache = shared
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.max_context * max_rows + MAX_BLOCK_TOKENS * max_rows  # split evenly between streams
        params.n_batch = params.n_ubatch = max(512, MAX_BLOCK_TOKENS * max_rows)
        params.n_seq_max = self._num_sequences
        params.n_threads = params.n_threads_batch = self._threads
        params.swa_full = True
        params.kv_unified = shared
        params.no_perf = True
        params.type_k = params.type_v = int(self.kv_cache_type)
        # a state per token when embeddings are on (:meth:`_decode`); off until a caller asks for states
        params.embeddings = False
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        self._embeddings = False
        # llama.cpp's CPU flash attention accumulates float16 values in float16, in cell order: in a shared cache a
        # row's logits then move when another row leaves it, and a tree's nodes leave their chain's (by 5e-4 and
        # 6e-4 on the float32 test model), so a shared cache runs without it; with a stream per row the cells a
        # row reads are its own, in its order (tests/test_llamacpp.py::test_rows_join_and_leave_with_their_own_caches)
        self.flash_attention = self._flash_attention and not shared
        #: a position's logits do not depend on the block or batch that computes them (the class docstring says
        #: when: exact kernels, quantised weights, a cache stream per row)
        self.batch_invariant = self._invariant_kernels and self.flash_attention
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attention
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self._context = llama_cpp.llama_init_from_model(self._model, params)
        if not self._context:
            raise ConfigError(f"llama.cpp cannot make a context of {params.n_ctx} tokens for {max_rows} rows")
        self._memory = llama_cpp.llama_get_memory(self._context)
        self._scratch_buffer: torch.Tensor | None = None
        self._dirty: set[int] = set()  # the slots of the reused buffer that are not zero (:meth:`_scratch`)
        self._batch_size = int(params.n_batch)
        self._batch = llama_cpp.llama_batch_init(self._batch_size, 0, self._num_sequences)

    def block_shapes(self, widths: list[int]) -> list[tuple[int, int]]:
        """With a cache stream per row llama.cpp splits a batch into micro-batches that take the same number of
        tokens from each of a run of rows with consecutive sequence ids (:func:`~genspec.models.base.equal_split`,
        with the rows' sequences when ``widths`` has one entry per row held). With a shared cache every token
        goes into one micro-batch, priced as the rows' tokens spread evenly (``[5, 2, 1, 1]``: 4 rows x 3)."""
        if self.shared_cache:
            widths = [w for w in widths if w > 0]
            return [(len(widths), -(-sum(widths) // len(widths)))] if widths else []
        return equal_split(widths, self._sequences if len(widths) == len(self._sequences) else None)

    def reserve_candidates(self, max_candidates: int) -> int:
        """Token trees of up to ``max_candidates`` chains may come. With fast kernels a context with a stream per
        row is made again as a shared one, which trees need (the rows it held are dropped, as by ``reset(0)``),
        and every chain is verified. Exact kernels verify chains only (1): in the shared cache llama.cpp puts new
        tokens in the first free cells, so a row's cells leave position order after a rejection and attention
        sums them in another order, and the shared cache runs attention without flash attention."""
        if self.kernels.exact:
            return 1
        if max_candidates > 1 and not self.shared_cache:
            self._make_context(shared=True)
            self.reset(0)
        return max_candidates

    def __del__(self):
        llama_cpp = getattr(self, "_llama", None)
        if llama_cpp is None:
            return
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_context", None):
            llama_cpp.llama_free(self._context)
            self._context = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_gguf(cls, path: str | os.PathLike, tokenizer=None, **options) -> LlamaCppLM:
        """Load a GGUF file; its tokenizer converted by transformers (``tokenizer`` overrides it)."""
        path = Path(path)
        if not path.is_file():
            raise InputFileError(f"no GGUF model at {path}")
        check_complete(path)  # before the tokenizer, whose reader fails on a cut-short file with its own error
        if tokenizer is None:
            tokenizer = gguf_tokenizer(path)
        return cls(path, tokenizer, **options)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self._eos)
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tokenizer_eos is not None and int(tokenizer_eos) not in ids:
            ids.append(int(tokenizer_eos))
        return tuple(ids)

    # ---------------------------------------------------------------- what drafters on its features read
    @functools.cached_property
    def _header(self) -> gguf_file.Header:
        return gguf_file.read_header(self.path)

    @functools.cached_property
    def _embedding(self) -> gguf_file.TensorRows:
        return gguf_file.TensorRows(self.path, "token_embd.weight", self._header)

    @functools.cached_property
    def _output(self) -> gguf_file.TensorRows:
        """The output layer's matrix: ``output.weight``, or the token embedding where the two are tied (Gemma)."""
        name = "output.weight" if "output.weight" in self._header.tensors else "token_embd.weight"
        return gguf_file.TensorRows(self.path, name, self._header)

    def _metadata(self, key: str, default=None):
        """The architecture's own metadata ``key`` (``gemma3.final_logit_softcapping``)."""
        return self._header.metadata.get(f"{self._header.metadata.get('general.architecture')}.{key}", default)

    @functools.cached_property
    def embedding_scale(self) -> float:
        """What llama.cpp multiplies a token's embedding row by before the first layer: the square root of the
        width on Gemma's architectures (their graphs scale by ``sqrtf(n_embd)``), the file's
        ``embedding_scale`` where it gives one, else 1."""
        if str(self._header.metadata.get("general.architecture", "")).startswith("gemma"):
            return float(self.hidden_size) ** 0.5
        return float(self._metadata("embedding_scale", 1.0))

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._embedding.rows(tokens) * self.embedding_scale

    def output_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._output.rows(token_ids)

    def subset_head(self, token_ids: torch.Tensor):
        """See :meth:`CausalLM.subset_head`: the output layer's rows dequantised from the file into an
        :class:`~genspec.kernels.LMHead` (llama.cpp's quantised products round them a little differently, so a
        draft's logits are close to the target's, not equal: a draft needs no more), then the soft cap."""
        head = LMHead(self.output_rows(token_ids))
        cap = float(self._metadata("final_logit_softcapping", 0.0) or 0.0)
        if not cap:
            return head
        return lambda hidden: torch.tanh(head(hidden) / cap) * cap

    # ---------------------------------------------------------------- rows
    def reset(self, batch_size: int = 0) -> None:
        if batch_size > self.max_rows:
            raise ConfigError(f"{batch_size} rows exceed this llama.cpp model's {self.max_rows} (max_rows)")
        self._llama.llama_memory_clear(self._memory, True)
        self._sequences = list(range(batch_size))
        self._free = list(range(batch_size, self.max_rows))
        self._lengths = torch.zeros(batch_size, dtype=torch.long)
        self._block = None

    def add_rows(self, prefixes: list[list[int]], return_hidden: bool = False,
                 hidden_layers: tuple[int, ...] = (), hidden_last: int | None = None) -> list[torch.Tensor] | None:
        """See :meth:`CausalLM.add_rows`. The states of each prefix's last ``hidden_last`` tokens come from a
        second decode with embeddings on: every token of it pays the output layer (262,144 rows on Gemma 3), so
        a caller that reads only the last states of a long prompt asks for those."""
        self._no_layers(hidden_layers)
        if len(prefixes) > len(self._free):
            raise ConfigError(f"{len(self._sequences) + len(prefixes)} rows exceed this llama.cpp model's "
                              f"{self.max_rows} (max_rows)")
        self._free.sort()  # the lowest free sequences: dense ids run as one micro-batch (_emission_order)
        new = [self._free.pop(0) for _ in prefixes]
        read = [0] * len(prefixes)
        if return_hidden:
            read = [states_kept(len(p), hidden_last) for p in prefixes]
        states = []
        # the tokens whose states nobody reads first, without the output layer
        for with_states in ((False, True) if return_hidden else (False,)):
            entries = [(token, position, (sequence,), with_states)
                       for sequence, prefix, count in zip(new, prefixes, read)
                       for position, token in enumerate(prefix)
                       if (position >= len(prefix) - count) == with_states]
            for start in range(0, len(entries), self._batch_size):
                _, chunk = self._decode(entries[start:start + self._batch_size], states=with_states)
                if with_states:
                    states.append(chunk)
        self._sequences += new
        self._lengths = torch.cat([self._lengths, torch.tensor([len(p) for p in prefixes], dtype=torch.long)])
        self._block = None
        if not return_hidden:
            return None
        states = torch.cat(states) if states else torch.zeros(0, self.hidden_size)
        return list(states.split(read))

    def _no_layers(self, hidden_layers: tuple[int, ...]) -> None:
        if tuple(hidden_layers):
            raise ConfigError("the llamacpp backend gives the final hidden states only, not those of layers "
                              f"{list(hidden_layers)} (a head trained with feature layers needs the torch backend)")

    def remove_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        gone = set(rows)
        for row in sorted(gone):
            sequence = self._sequences[row]
            self._llama.llama_memory_seq_rm(self._memory, sequence, -1, -1)
            self._free.append(sequence)
        kept = [row for row in range(len(self._sequences)) if row not in gone]
        self._sequences = [self._sequences[row] for row in kept]
        self._lengths = self._lengths[kept] if kept else torch.zeros(0, dtype=torch.long)
        self._block = None

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    # ---------------------------------------------------------------- blocks
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, last_only: bool = False,
                prefix: PrefixKV | None = None, return_hidden: bool = False, hidden_layers: tuple[int, ...] = ()):
        return self._forward(tokens, valid, tree_mask, last_only, prefix, return_hidden, hidden_layers, False)

    def forward_transient(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                          tree_mask: torch.Tensor | None = None, last_only: bool = False,
                          prefix: PrefixKV | None = None, return_hidden: bool = False,
                          hidden_layers: tuple[int, ...] = ()):
        """:meth:`forward` whose logits are llama.cpp's own buffer when every slot of the block is an output
        (no copy), else a buffer this model reuses from call to call: either is overwritten by the next call, and
        the caller must not write into it (the reused buffer keeps track of its non-zero slots).
        A fresh ``[B, n, V]`` tensor each step costs its page faults as well as the copy: 262,144 float32
        logits are 1 MiB a slot, so 16 rows of 17-token blocks are 272 MiB of new memory."""
        return self._forward(tokens, valid, tree_mask, last_only, prefix, return_hidden, hidden_layers, True)

    def _forward(self, tokens, valid, tree_mask, last_only, prefix, return_hidden, hidden_layers, transient: bool):
        if prefix is not None:
            raise ConfigError("the llamacpp backend cannot take a block's first layers from a draft")
        self._no_layers(hidden_layers)
        rows, width = tokens.shape
        if rows != len(self._sequences):
            raise ValueError(f"a block of {rows} rows for a model holding {len(self._sequences)}")
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool()
        counts = valid.sum(1).tolist()
        if not bool((valid == (torch.arange(width) < valid.sum(1, keepdim=True))).all()):
            raise ValueError("valid tokens must come first in each row (right padding)")
        if max(counts, default=0) > MAX_BLOCK_TOKENS:
            raise ConfigError(f"a verify block of {max(counts)} tokens exceeds the llamacpp backend's "
                              f"{MAX_BLOCK_TOKENS}")
        token_list, lengths = tokens.tolist(), self._lengths.tolist()
        entries, outputs, leaves = [], [], [[] for _ in counts]
        next_leaf = self.max_rows  # temporary sequences for tree leaves: the ids above the rows' own
        order = self._emission_order()
        for row in order:
            count, start, own = counts[row], lengths[row], self._sequences[row]
            row_leaves: list[tuple[int, frozenset[int]]] = []  # (temporary sequence, its path's nodes)
            if tree_mask is not None and count and not _is_chain(tree_mask[row, :count, :count]):
                ancestors = tree_mask[row, :count, :count].bool()
                is_leaf = ~(ancestors.sum(0) > 1)  # no other node counts it among its ancestors
                leaf_nodes = is_leaf.nonzero().flatten().tolist()
                if not self.shared_cache:
                    raise ConfigError("a token tree on a llamacpp model with a cache stream per row: build it with "
                                      "shared_cache=True (or call reserve_candidates before adding rows)")
                if next_leaf + len(leaf_nodes) > self._num_sequences:
                    raise ConfigError(f"token trees of {next_leaf - self.max_rows + len(leaf_nodes)} leaves in one "
                                      f"block exceed the llamacpp backend's {self._num_sequences - self.max_rows}")
                depth = ancestors.sum(1) - 1
                for leaf in leaf_nodes:
                    sequence, next_leaf = next_leaf, next_leaf + 1
                    self._llama.llama_memory_seq_cp(self._memory, own, sequence, -1, -1)
                    row_leaves.append((sequence, frozenset(ancestors[leaf].nonzero().flatten().tolist())))
                for node in range(count):
                    below = tuple(s for s, path in row_leaves if node in path)
                    entries.append((token_list[row][node], start + int(depth[node]), below,
                                    not last_only or node == count - 1))
            else:
                for j in range(count):
                    entries.append((token_list[row][j], start + j, (own,), not last_only or j == count - 1))
            outputs += [(row, j) for j in range(count) if not last_only or j == count - 1]
            leaves[row] = row_leaves
        self._block = (counts, leaves)
        if len(entries) > self._batch_size:
            raise ConfigError(f"a block of {len(entries)} tokens exceeds the llamacpp batch ({self._batch_size})")
        # llama.cpp's buffer: copied at most once, into ``out``
        logits, states = self._decode(entries, states=return_hidden)
        shape = (rows, 1 if last_only else width, self.vocab_size)
        full = len(outputs) == shape[0] * shape[1]
        index = torch.tensor(outputs, dtype=torch.long).reshape(-1, 2)
        if return_hidden:  # every position's state (as the torch backend's), in row order; zeros at padding
            hidden = torch.zeros(rows, width, self.hidden_size)
            decoded = torch.tensor([(row, j) for row in order for j in range(counts[row])], dtype=torch.long)
            if len(decoded):
                hidden[decoded[:, 0], decoded[:, 1]] = states
            return self._shaped_logits(logits, shape, full, order, index, last_only, transient), hidden
        return self._shaped_logits(logits, shape, full, order, index, last_only, transient)

    def _shaped_logits(self, logits: torch.Tensor, shape: tuple[int, int, int], full: bool, order: list[int],
                       index: torch.Tensor, last_only: bool, transient: bool) -> torch.Tensor:
        """The decoded outputs' logits ``[m, V]`` (in decode order: rows by ``order``) laid out ``shape``, zero
        where no output was asked: :meth:`forward_transient`'s buffers, or a new tensor."""
        if full and order == sorted(order):  # every slot is an output, row by row
            return logits.view(shape) if transient else logits.view(shape).clone()
        slots = index[:, 0] * shape[1] + (0 if last_only else index[:, 1])  # in the order they were decoded
        if not transient:
            out = torch.zeros(shape, dtype=torch.float32)
            out.view(-1, shape[2])[slots] = logits
            return out
        # the reused buffer is zero except at the slots a call wrote: only those of the last calls that this one does
        # not write are zeroed again (a 16-row block 9 wide of which 20 slots are real is 144 MiB to zero, 20 to copy)
        out = self._scratch(shape)
        flat, written = out.view(-1, shape[2]), set(slots.tolist())
        stale = [slot for slot in self._dirty if slot < shape[0] * shape[1] and slot not in written]
        if stale:
            flat[torch.tensor(stale)] = 0.0
        flat[slots] = logits
        self._dirty = (self._dirty - set(stale)) | written
        return out

    def _emission_order(self) -> list[int]:
        """The rows in the order their tokens go into a batch: by sequence id. With a cache stream per row
        llama.cpp puts into one micro-batch only sequences whose ids rise by one from each to the next in the
        batch (``split_equal`` with ``sequential``): rows holding sequences 0, 1, 2, 4, 3 would run in row
        order as three passes over the weights ([0, 1, 2], [4], [3]) and run in sequence order as one. A
        free id between busy ones still splits the batch (0, 1, 2, 4: two passes), so rows take the lowest
        free sequence (:meth:`add_rows`)."""
        return sorted(range(len(self._sequences)), key=self._sequences.__getitem__)

    def _scratch(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """A ``shape`` view of the buffer :meth:`forward_transient` reuses (grown when too small)."""
        needed = shape[0] * shape[1] * shape[2]
        if self._scratch_buffer is None or self._scratch_buffer.numel() < needed:
            self._scratch_buffer = torch.zeros(needed, dtype=torch.float32)
            self._dirty = set()
        return self._scratch_buffer[:needed].view(shape)

    def hidden_states(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                      tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`'s states (llama.cpp computes the output layer with them: nothing is saved)."""
        _, hidden = self.forward(tokens, valid, tree_mask, return_hidden=True)
        return hidden, torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool()

    def keep_block(self, keep: torch.Tensor) -> None:
        if self._block is None:
            raise RuntimeError("keep_block without a block")
        counts, leaves = self._block
        keep_list = keep.tolist()
        lengths = self._lengths.tolist()
        for row, count in enumerate(counts):
            kept = [i for i in (keep_list[row] if row < len(keep_list) else []) if i >= 0]
            start, own = lengths[row], self._sequences[row]
            if leaves[row]:  # a tree: copy the kept path from a leaf's sequence that holds it
                holder = next((s for s, path in leaves[row] if set(kept) <= path), None)
                if holder is None:
                    raise ValueError(f"row {row}: the kept nodes {kept} are no path of the tree")
                if kept:
                    self._llama.llama_memory_seq_cp(self._memory, holder, own, start, start + len(kept))
                for sequence, _ in leaves[row]:
                    self._llama.llama_memory_seq_rm(self._memory, sequence, -1, -1)
            else:
                if kept != list(range(len(kept))):
                    raise ValueError(f"row {row}: a chain keeps a prefix of its block, got {kept}")
                if len(kept) < count:
                    self._llama.llama_memory_seq_rm(self._memory, own, start + len(kept), -1)
            lengths[row] = start + len(kept)
        self._lengths = torch.tensor(lengths, dtype=torch.long)
        self._block = None

    def commit_all(self, valid: torch.Tensor | None = None) -> None:
        if self._block is None:
            raise RuntimeError("commit_all without a block")
        counts, leaves = self._block
        if any(leaves):
            raise ValueError("commit_all keeps a chain; this block was a tree")
        self._lengths = self._lengths + torch.tensor(counts, dtype=torch.long)
        self._block = None

    def truncate(self, lengths: torch.Tensor) -> None:
        new = torch.minimum(self._lengths, lengths.to(self._lengths.dtype))
        for row, (old, length) in enumerate(zip(self._lengths.tolist(), new.tolist())):
            if length < old:
                self._llama.llama_memory_seq_rm(self._memory, self._sequences[row], length, -1)
        self._lengths = new
        self._block = None

    # ---------------------------------------------------------------- llama.cpp calls
    def _decode(self, entries: list[tuple[int, int, tuple[int, ...], bool]],
                states: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One ``llama_decode`` of ``(token, position, sequences, wants_logits)`` entries: the logits of those
        that want them ``[m, V]`` in order (a view of llama.cpp's buffer, valid until the next decode, when
        ``states`` is off) and, with ``states``, the final hidden state of every entry ``[len(entries), H]`` (a
        copy; llama.cpp then computes every entry's logits, of which those wanted are copied out), else None."""
        if not entries:
            return torch.zeros(0, self.vocab_size), (torch.zeros(0, self.hidden_size) if states else None)
        if states != self._embeddings:
            self._llama.llama_set_embeddings(self._context, states)
            self._embeddings = states
        batch = self._batch
        batch.n_tokens = len(entries)
        for i, (token, position, sequences, wants) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = len(sequences)
            for j, sequence in enumerate(sequences):
                batch.seq_id[i][j] = sequence
            batch.logits[i] = wants or states
        status = self._llama.llama_decode(self._context, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed (status {status}) on a batch of {len(entries)} tokens")
        wanted = [i for i, entry in enumerate(entries) if entry[3]]
        outputs = len(entries) if states else len(wanted)
        if not outputs:
            return torch.zeros(0, self.vocab_size), None
        pointer = self._llama.llama_get_logits(self._context)
        logits = torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(outputs, self.vocab_size)))
        if not states:
            return logits, None
        pointer = self._llama.llama_get_embeddings(self._context)
        hidden = torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(outputs, self.hidden_size))).clone()
        return (logits if len(wanted) == outputs else logits[wanted]), hidden


def _is_chain(mask: torch.Tensor) -> bool:
    """True if an ancestor mask ``[n, n]`` is the causal (lower-triangular) one."""
    return bool((mask.bool() == torch.ones_like(mask, dtype=torch.bool).tril()).all())


def gguf_context(path: str | os.PathLike) -> int | None:
    """The context a :class:`LlamaCppLM` gives the GGUF file at ``path`` by default (its trained context,
    capped at :data:`DEFAULT_CONTEXT`), read from the metadata alone; None if it cannot be read."""
    try:
        import gguf  # here: `import genspec`, which imports this module, need not pay for it

        reader = gguf.GGUFReader(str(path))
        architecture = reader.fields["general.architecture"].contents()
        trained = int(reader.fields[f"{architecture}.context_length"].contents())
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return min(trained, DEFAULT_CONTEXT)


def gguf_tokenizer(path: Path):
    """The GGUF file's tokenizer, converted by transformers (no network)."""
    from transformers import (
        AutoTokenizer,  # here: `import genspec` does not pay transformers' import otherwise
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputFileError(f"cannot read the tokenizer of {path}: {message}") from exc


class GGUFType(str, enum.Enum):
    """The weight types llama.cpp's quantiser writes a draft copy in (:func:`derived_gguf`), by its ``llama_ftype``
    names: the K-quants from 2 to 6 bits and the simple 4- and 8-bit blocks."""

    Q2_K = "Q2_K"
    Q3_K_S = "Q3_K_S"
    Q3_K_M = "Q3_K_M"
    Q4_0 = "Q4_0"
    Q4_K_S = "Q4_K_S"
    Q4_K_M = "Q4_K_M"
    Q5_K_M = "Q5_K_M"
    Q6_K = "Q6_K"
    Q8_0 = "Q8_0"

    def ftype(self, llama_cpp) -> int:
        return int(getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{self.value}"))


#: the version of what :func:`derived_gguf` writes, part of a copy's name: a copy written by an earlier version
#: (2: the sliding-window pattern of a copy without some layers, :func:`kept_window_pattern`) is made anew
_DERIVED_FORMAT = 2


def derived_gguf(source: str | os.PathLike, weight_type: GGUFType | str | None = None,
                 drop_layers: tuple[int, ...] = (), cache: Path | None = None) -> Path:
    """A copy of the GGUF file ``source`` written by llama.cpp's own quantiser: its matrices requantised to
    ``weight_type`` (None: copied as they are) and the layers ``drop_layers`` left out (llama.cpp renumbers the
    rest). Made once and kept in ``cache`` (default: ``$GENSPEC_CACHE/derived``), named by the source's name,
    size and modification time and by what was asked, so a changed source makes a new copy; written to a
    temporary name first, so an interrupted run leaves no half file under the final one."""
    import hashlib

    from genspec.embedded import cache_root

    llama_cpp = _import_llama_cpp()
    _quiet_backend(llama_cpp)
    source = Path(source)
    if not source.is_file():
        raise InputFileError(f"no GGUF model at {source}")
    check_complete(source)
    weight_type = None if weight_type is None else GGUFType(weight_type)
    layers = tuple(sorted(set(int(i) for i in drop_layers)))
    stat = source.stat()
    key = hashlib.sha256(repr((str(source.resolve()), stat.st_size, stat.st_mtime_ns,
                               weight_type and weight_type.value, layers, _DERIVED_FORMAT)).encode()).hexdigest()[:16]
    folder = Path(cache) if cache is not None else cache_root() / "derived"
    copy = folder / f"{source.stem}-{weight_type.value if weight_type else 'copy'}-{key}.gguf"
    if copy.is_file():
        return copy
    folder.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = len(os.sched_getaffinity(0))
    params.allow_requantize = True
    if weight_type is None:
        params.only_copy = True
    else:
        params.ftype = weight_type.ftype(llama_cpp)
    pruned = (ctypes.c_int32 * (len(layers) + 1))(*layers, -1)
    if layers:
        params.prune_layers = ctypes.cast(pruned, ctypes.POINTER(ctypes.c_int32))
    partial = copy.with_suffix(f".{os.getpid()}.partial")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise InputFileError(f"llama.cpp could not write a {weight_type.value if weight_type else 'copy'} of "
                             f"{source}{f' without layers {list(layers)}' if layers else ''} (status {status})")
    pattern = kept_window_pattern(gguf_file.read_header(source).metadata, layers)
    if pattern is not None:
        windows = partial.with_suffix(".windows")
        try:
            _copy_with_window_pattern(partial, windows, pattern)
        except BaseException:
            windows.unlink(missing_ok=True)
            raise
        finally:
            partial.unlink(missing_ok=True)
        partial = windows
    os.replace(partial, copy)
    return copy


#: the sliding-window pattern llama.cpp gives an architecture whose file names none (its loaders'
#: ``load_swa_pattern(ml, n, dense_first)``): every n-th layer attends to the whole context (the first of each n
#: with ``dense_first``, else the last), the others to a window
_DEFAULT_WINDOW_PATTERNS = {"gemma2": (2, False), "gemma3": (6, False), "gemma3n": (5, False), "cohere2": (4, False),
                            "gpt-oss": (2, False), "olmo2": (4, False), "exaone4": (4, False)}


def kept_window_pattern(metadata: dict, dropped: tuple[int, ...]) -> list[bool] | None:
    """Which of the layers kept after dropping ``dropped`` attend to a sliding window, in order, for a GGUF whose
    ``metadata`` gives it sliding-window layers; None where nothing is dropped or no layer slides. llama.cpp
    derives the pattern from a layer's index, and its quantiser renumbers the layers it keeps, so a copy without
    some layers would put the whole-context layers (and their rotary base) at other layers: the copy names the
    kept layers' pattern instead. Example: Gemma 3's 18 layers, 5, 11 and 17 whole-context; without layers 9 and
    13, the kept 16 have them at 5, 10 and 15, where llama.cpp would have put them at 5 and 11."""
    arch = metadata.get("general.architecture")
    if not dropped or not metadata.get(f"{arch}.attention.sliding_window"):
        return None
    layers = int(metadata[f"{arch}.block_count"])
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern[:layers]]
    else:
        if pattern is None and arch not in _DEFAULT_WINDOW_PATTERNS:
            raise ConfigError(f"cannot leave layers out of this {arch} model: its file does not say which layers "
                              "attend to a sliding window, and genspec does not know llama.cpp's default for it")
        every, dense_first = _DEFAULT_WINDOW_PATTERNS.get(arch, (0, False))
        every = every if pattern is None else int(pattern)
        sliding = [every == 0 or (i % every != 0 if dense_first else i % every < every - 1) for i in range(layers)]
    return [sliding[i] for i in range(layers) if i not in set(dropped)]


def _copy_with_window_pattern(source: Path, destination: Path, pattern: list[bool]) -> None:
    """Copy the GGUF ``source`` to ``destination`` with its sliding-window pattern set to ``pattern`` (one bool per
    layer), by gguf-py's own metadata copier."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(destination), arch=arch, endianess=reader.endianess)
    alignment = reader.fields.get("general.alignment")
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    copy_with_new_metadata(reader, writer, {pattern_key: MetadataDetails(
        gguf.GGUFValueType.ARRAY, pattern, sub_type=gguf.GGUFValueType.BOOL)}, [])
