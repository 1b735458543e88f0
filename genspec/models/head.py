"""The LM head as genspec computes it: exact logits ``hidden @ W.T`` with the fastest CPU kernel for the
number of rows.

Why: with a 262k vocabulary the head weight (262,144 x 640 fp32, 671 MB) does not fit any cache, so a
decode step streams it from memory and its cost decides every speedup on a CPU. BLAS kernels differ a
lot with the number of rows (``benchmarks/step_cost.py``, 2-core EPYC, torch 2.13, MKL; median ms):

=========================================  ====  ====  ====  ====  ====
rows                                          1     2     4     8    16
=========================================  ====  ====  ====  ====  ====
``F.linear(x, W)`` (what transformers runs)  82   193   209   243   280
``x @ W_t`` in 64 column blocks             43    75   167   194   227
``bmm`` over 256 column chunks of ``W_t``    34    49   133   139   178
``W @ x.T`` (one GEMM, small N)              89    67    64    99   175
this class                                   38    50    55    72   140
=========================================  ====  ====  ====  ====  ====

(one run; the VM is shared and single figures vary by +-20% between runs, the ranking does not).
So one row (plain decoding, the draft models' steps) uses the chunked ``bmm`` over a transposed copy,
2-12 rows (verifying a draft) use ``W @ x.T`` on the original weight (shared with the model, no copy),
and more rows use the ``bmm`` again. All are exact fp32 products of the same numbers; only the
summation order inside the BLAS differs (last-bit differences, as between any two batch sizes).
"""
from __future__ import annotations

import torch

#: columns per chunk of the transposed weight (1,024 x 640 fp32 = 2.6 MB: fits the L2/L3 slice)
CHUNK = 1024
#: row counts for which ``W @ x.T`` is the faster kernel
SMALL_GEMM_ROWS = range(2, 13)


class LMHead:
    """Logits ``[..., V]`` of hidden states ``[..., H]`` for a head weight ``[V, H]`` (and optional bias).

    Holds the weight itself (a view, not a copy) and one transposed, chunked copy ``[C, H, CHUNK]``
    (zero-padded at the end). Several models may share one head (self-drafts of the same target)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach()
        self.weight = weight if weight.is_contiguous() else weight.contiguous()
        self.bias = None if bias is None else bias.detach()
        vocab, hidden = self.weight.shape
        self.vocab_size = vocab
        chunks = -(-vocab // CHUNK)
        padded = self.weight.new_zeros(chunks * CHUNK, hidden)
        padded[:vocab] = self.weight
        self.chunked_t = padded.view(chunks, CHUNK, hidden).transpose(1, 2).contiguous()  # [C, H, CHUNK]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        rows = hidden.reshape(-1, shape[-1])
        if rows.shape[0] in SMALL_GEMM_ROWS:
            logits = (self.weight @ rows.T).T
        else:
            chunks = self.chunked_t.shape[0]
            out = torch.bmm(rows.unsqueeze(0).expand(chunks, -1, -1), self.chunked_t)  # [C, R, CHUNK]
            logits = out.transpose(0, 1).reshape(rows.shape[0], -1)[:, :self.vocab_size]
        if self.bias is not None:
            logits = logits + self.bias
        return logits.reshape(*shape[:-1], self.vocab_size)
