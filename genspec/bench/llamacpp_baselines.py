"""llama-cpp-python's own decoding as benchmark baselines: ``llamacpp-plain`` (``Llama.generate``) and
``llamacpp-lookup`` (the same with its ``LlamaPromptLookupDecoding`` draft model), on the GGUF file the
genspec methods run, loaded separately through the high-level ``Llama`` class as a user would run it.

Sampling is the run's (greedy: ``temp=0``); every sampler llama-cpp-python adds by default that genspec's
methods do not apply (``min_p`` 0.05, top-k 40 when genspec's is off) is switched off, so greedy outputs are
comparable token for token. Its per-step figures are not observable without patching it, so the records
carry counts and wall time only.
"""
from __future__ import annotations

import os
import time

from genspec.bench.methods import MethodSpec
from genspec.sampling import SamplingConfig

#: llama-cpp-python's prompt lookup defaults (``LlamaPromptLookupDecoding``)
LOOKUP_DEFAULTS = {"num_pred_tokens": 10, "max_ngram_size": 2}


class LlamaCppDecoder:
    """One llama-cpp-python baseline on its own ``Llama`` instance of the GGUF file at ``path``."""

    kind = "llamacpp"

    def __init__(self, spec: MethodSpec, path, eos_token_ids: list[int], context: int, threads: int | None = None):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.spec = spec
        self.name = spec.name
        self.options = dict(LOOKUP_DEFAULTS, **spec.options) if spec.base == "llamacpp-lookup" else {}
        draft = LlamaPromptLookupDecoding(**self.options) if self.options else None
        # logits_all with a draft: llama-cpp-python 0.3.36 keeps every position's logits when it drafts but sizes
        # their buffer from this argument (n_batch rows when False), so prompts over 512 tokens failed with a
        # broadcast error (tests/test_llamacpp.py::test_llamacpp_lookup_takes_a_prompt_longer_than_its_batch)
        self.llama = Llama(str(path), n_ctx=context, n_threads=threads or len(os.sched_getaffinity(0)),
                           draft_model=draft, logits_all=draft is not None, verbose=False)
        self.eos_token_ids = set(eos_token_ids)

    @property
    def settings(self) -> dict:
        return dict(self.options)

    def decode(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig, seed: int) -> dict:
        """Generate for one prompt; returns the raw figures of the call."""
        llama = self.llama
        llama.set_seed(seed)
        greedy = sampling.greedy
        tokens: list[int] = []
        start = time.perf_counter()
        for token in llama.generate(ids, reset=True, temp=0.0 if greedy else sampling.temperature,
                                    top_k=1 if greedy else (sampling.top_k if sampling.top_k > 0 else 0),
                                    top_p=1.0 if greedy else sampling.top_p, min_p=0.0, typical_p=1.0,
                                    repeat_penalty=sampling.repetition_penalty):
            tokens.append(int(token))  # an end token is kept, as genspec and generate() keep it
            if token in self.eos_token_ids or len(tokens) >= max_new_tokens:
                break
        wall = time.perf_counter() - start
        return {"new_tokens": len(tokens), "wall_time_s": wall, "token_ids": tokens, "stats": None, "steps": None,
                "forward": None}


class LlamaServerDecoder:
    """llama.cpp's own C++ server at one client (:class:`~genspec.bench.llama_server.LlamaServer`, one slot)
    on the GGUF file at ``path``: plain, or with one of its speculation types (``spec_type``). Each prompt
    goes to its native ``/completion`` endpoint as token ids, without its prompt cache (every call prefills
    its prompt, as the other methods do), and the request's wall time on the client is the call's time.

    Its samplers are set as :class:`LlamaCppDecoder` sets llama-cpp-python's: greedy at temperature 0, no
    ``min_p`` and no top-k unless genspec's is on. The records carry its draft and accepted counts."""

    kind = "llamacpp"

    def __init__(self, spec: MethodSpec, path, eos_token_ids: list[int], context: int, threads: int | None = None):
        from genspec.bench.llama_server import LlamaServer

        self.spec = spec
        self.name = spec.name
        self.options = {"spec_type": "none", **spec.options}
        self.server = LlamaServer(path, self.options["spec_type"], parallel=1, context=context, threads=threads)
        self.server.__enter__()
        self.ignore_eos = not eos_token_ids

    def close(self) -> None:
        self.server.__exit__()

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.__exit__()

    @property
    def settings(self) -> dict:
        return dict(self.options, command=" ".join(self.server.command))

    def decode(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig, seed: int) -> dict:
        greedy = sampling.greedy
        out = self.server.complete(list(ids), max_new_tokens, {
            "temperature": 0.0 if greedy else sampling.temperature,
            "top_k": 1 if greedy else max(0, sampling.top_k), "top_p": 1.0 if greedy else sampling.top_p,
            "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": sampling.repetition_penalty, "seed": seed,
            "ignore_eos": self.ignore_eos})
        tokens = [int(t) for t in out.get("tokens", [])][:max_new_tokens]
        timings = out.get("timings", {})
        return {"new_tokens": len(tokens), "wall_time_s": out["wall_time_s"], "token_ids": tokens, "stats": None,
                "steps": None, "forward": None,
                "server_draft": {"drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)}}
