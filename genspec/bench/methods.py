"""What ``genspec bench --methods`` accepts, parsed and checked before any model is loaded.

Syntax: a comma-separated list of ``NAME[:KEY=VALUE[:KEY=VALUE...]]``, each method once, no item empty.

- NAME is a genspec drafter (``prompt-lookup``, ``quantized``, ``hierarchical``, ... see
  :data:`genspec.drafters.registry.DRAFTERS`) or a Hugging Face baseline (:data:`HF_METHODS`).
- VALUE is read as JSON when it parses (``exit_layer=4``, ``skip=[3,5,7]``; commas inside brackets do
  not split methods), else as a string; ``+`` joins list items: ``levels=prompt-lookup+quantized``.
- For genspec methods, ``k=N`` and ``draft_length=fixed|heuristic|cost`` set the engine's draft length
  for that method only; every other key is a drafter option (as ``genspec generate -O``).
- For HF methods, every key is a ``generate()`` argument (``hf-prompt-lookup:prompt_lookup_num_tokens=5``).

Example: ``prompt-lookup,prompt-lookup:k=4:draft_length=fixed,hierarchical:levels=prompt-lookup+quantized``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from genspec import strict_json
from genspec.drafters.hybrid import DEFAULT_LOOKUP
from genspec.drafters.registry import DRAFTERS, check_drafter
from genspec.errors import ConfigError

PLAIN = "plain"          # genspec plain decoding: the baseline of every speedup
HF_PLAIN = "hf-plain"    # transformers generate(), greedy: the reference on the torch backend
LLAMACPP_PLAIN = "llamacpp-plain"  # llama-cpp-python's own decoding: the reference on the llamacpp backend
#: the reference every method is also compared with: the plain decoding of the engine users would run
#: instead, by backend (always runs second)
REFERENCES = {"torch": HF_PLAIN, "llamacpp": LLAMACPP_PLAIN}

#: HF baseline name -> what it adds to ``generate()`` (``None``: filled in once the model is known)
HF_METHODS: dict[str, dict] = {
    HF_PLAIN: {},
    "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10},
    "hf-assisted": {},                       # + assistant_model (needs --draft-model)
    "hf-early-exit": {"assistant_early_exit": None},  # default: a quarter of the layers, like genspec's
}

#: llama.cpp's own C++ server (built from the vendored source, :mod:`genspec.bench.llama_server`) at one client
LLAMA_SERVER = "llama-server"
#: llama.cpp baseline name -> its options (``LlamaPromptLookupDecoding``'s for the lookup; llama-server's
#: speculation type for the server)
LLAMACPP_METHODS: dict[str, tuple[str, ...]] = {
    LLAMACPP_PLAIN: (),
    "llamacpp-lookup": ("num_pred_tokens", "max_ngram_size"),
    LLAMA_SERVER: ("spec_type",),
}

#: method-level keys that tune genspec's engine rather than the drafter
ENGINE_KEYS = {"k": "num_draft_tokens", "num_draft_tokens": "num_draft_tokens", "draft_length": "draft_length"}
DRAFT_LENGTHS = ("fixed", "heuristic", "cost")


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method of a benchmark run."""

    name: str                      # the label in tables and plots (the spec as written)
    kind: str                      # "genspec", "hf" or "llamacpp"
    base: str                      # drafter name ("none" for plain) or HF method name
    options: dict = field(default_factory=dict)           # drafter options / extra generate() kwargs
    config_overrides: dict = field(default_factory=dict)  # genspec GenerationConfig fields

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "base": self.base, "options": _jsonable(self.options),
                "config_overrides": dict(self.config_overrides)}


def split_top_level(text: str, sep: str = ",", keep_empty: bool = False) -> list[str]:
    """Split on ``sep`` outside brackets (so ``skip=[3,5,7]`` stays whole); strips blanks, and drops the
    empty parts unless ``keep_empty`` (for syntax that refuses them)."""
    parts, depth, current = [], 0, []
    for char in text:
        if char in "[{(":
            depth += 1
        elif char in "]})":
            depth = max(0, depth - 1)
        if char == sep and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    parts.append("".join(current).strip())
    return parts if keep_empty else [p for p in parts if p]


def _value(text: str):
    try:
        return strict_json.loads(text)
    except ValueError:
        if "+" in text and "/" not in text and all(text.split("+")):
            return text.split("+")
        return text


def parse_method(text: str, draft_model: str | None = None, backend: str = "torch") -> MethodSpec:
    """One method spec for a run on ``backend`` (``torch`` or ``llamacpp``); raises :class:`ConfigError`
    with a one-line reason when it is not valid."""
    head, *option_texts = split_top_level(text, ":", keep_empty=True)
    if "" in option_texts:  # "name:" or "name::k=4": a colon with no option after it
        raise ConfigError(f"method {text!r}: an empty option after ':'; options look like NAME:KEY=VALUE")
    name = head.strip()
    options, overrides = {}, {}
    for option in option_texts:
        key, sep, value = option.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"method {text!r}: options must look like NAME:KEY=VALUE, got {option!r}")
        options[key] = _value(value.strip())
    if name in (PLAIN, "none"):
        if options:
            raise ConfigError(f"method {text!r}: plain decoding takes no options")
        return MethodSpec(PLAIN, "genspec", "none")
    if name in LLAMACPP_METHODS:
        if backend != "llamacpp":
            raise ConfigError(f"method {name!r} runs llama-cpp-python on a GGUF file: it needs --backend llamacpp")
        unknown = sorted(set(options) - set(LLAMACPP_METHODS[name]))
        if unknown:
            raise ConfigError(f"method {text!r}: unknown option {unknown[0]!r}"
                              + (f"; it takes {', '.join(LLAMACPP_METHODS[name])}" if LLAMACPP_METHODS[name] else ""))
        for key, value in options.items():
            if key == "spec_type":
                from genspec.bench.llama_server import SPEC_TYPES

                if value not in SPEC_TYPES:
                    raise ConfigError(f"method {text!r}: spec_type must be one of {', '.join(SPEC_TYPES)}, "
                                      f"got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"method {text!r}: {key} must be an integer >= 1, got {value!r}")
        return MethodSpec(text.strip(), "llamacpp", name, options)
    if name in HF_METHODS:
        if backend != "torch":
            raise ConfigError(f"method {name!r} runs transformers: it needs --backend torch")
        if name == "hf-assisted" and draft_model is None:
            raise ConfigError("method 'hf-assisted' needs a draft model (--draft-model PATH)")
        if name == HF_PLAIN and options:
            raise ConfigError(f"method {text!r}: hf-plain takes no options")
        _check_hf_options(text, options)
        return MethodSpec(text.strip(), "hf", name, options)
    if name not in DRAFTERS:
        choices = [n for n in DRAFTERS if n != "none"] + list(HF_METHODS) + list(LLAMACPP_METHODS)
        raise ConfigError(f"unknown method {name!r}; choose from: {PLAIN}, {', '.join(choices)}")
    for key in list(options):
        if key in ENGINE_KEYS:
            overrides[ENGINE_KEYS[key]] = options.pop(key)
    k = overrides.get("num_draft_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ConfigError(f"method {text!r}: k must be an integer >= 1, got {k!r}")
    if overrides.get("draft_length", "cost") not in DRAFT_LENGTHS:
        raise ConfigError(f"method {text!r}: draft_length must be one of {', '.join(DRAFT_LENGTHS)}")
    if name == "draft-model":
        if draft_model is None:
            raise ConfigError("method 'draft-model' needs a draft model (--draft-model PATH)")
        options.setdefault("draft_model", draft_model)
    if name == "hierarchical" and draft_model is not None:
        options.setdefault("draft_model", draft_model)
    check_drafter(name, options)
    return MethodSpec(text.strip(), "genspec", name, options, overrides)


def _check_hf_options(text: str, options: dict) -> None:
    from transformers import GenerationConfig  # here: transformers takes 3 s to import, for HF methods only

    known = GenerationConfig()
    for key in options:
        if not hasattr(known, key):
            raise ConfigError(f"method {text!r}: {key!r} is not a transformers generate() option")


def parse_methods(text: str, draft_model: str | None = None, backend: str = "torch") -> list[MethodSpec]:
    """The methods to benchmark on ``backend``, with genspec ``plain`` first and the backend's reference
    (:data:`REFERENCES`: ``hf-plain`` or ``llamacpp-plain``) second (both always run: every speedup is
    reported against each) and no duplicates. The list must name at least one method, each once: an
    empty list or item (``""``, ``","``, ``"a,,b"``) and a method named twice are refused, since each is a
    typo that would otherwise run fewer methods than asked."""
    parts = split_top_level(text or "", keep_empty=True)
    if not any(parts):
        raise ConfigError(f"--methods is empty (got {text!r}); name at least one method, e.g. prompt-lookup")
    if not all(parts):
        raise ConfigError(f"--methods {text!r} has an empty item; separate methods with single commas")
    specs = [parse_method(part, draft_model=draft_model, backend=backend) for part in parts]
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"--methods {text!r} names {spec.name!r} twice; name each method once")
        seen.add(spec.name)
    reference = REFERENCES[backend]
    ordered = [MethodSpec(PLAIN, "genspec", "none"),
               MethodSpec(reference, "hf" if reference == HF_PLAIN else "llamacpp", reference)]
    for spec in specs:
        if spec.name not in {s.name for s in ordered}:
            ordered.append(spec)
    return ordered


#: drafters that remember other requests' outputs (a per-process table shared by namespace)
LEARNING_DRAFTERS = ("ngram-cache", "suffix")


def drafter_options(spec: MethodSpec) -> dict:
    """The drafter options a benchmark builds ``spec``'s drafter with. A drafter that learns across
    requests, itself or as a hybrid's lookup, gets a memory of its own (namespace = the method's label),
    so in one run it learns only from its own earlier requests, never from another method's output for
    the same prompt (two suffix hybrids sharing the default memory: 8.30 against 4.06 tokens per call on
    the same prompts)."""
    options = dict(spec.options)
    learner = options.get("lookup", DEFAULT_LOOKUP) if spec.base == "hybrid" else spec.base
    if learner in LEARNING_DRAFTERS:
        options.setdefault("namespace", f"genspec-bench:{spec.name}")
    return options


def sweep_methods(base: MethodSpec, ks: list[int]) -> list[MethodSpec]:
    """``base`` at each fixed draft length k (for the tokens/s vs k plot)."""
    if base.kind != "genspec" or base.base == "none":
        raise ConfigError(f"--sweep-method must be a genspec drafter, got {base.name!r}")
    out = []
    for k in ks:
        overrides = dict(base.config_overrides, num_draft_tokens=k, draft_length="fixed")
        out.append(MethodSpec(f"{base.name}@k={k}", "genspec", base.base, dict(base.options), overrides))
    return out


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in split_top_level(text)]
    except ValueError as exc:
        raise ConfigError(f"{what} must be a comma-separated list of integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise ConfigError(f"{what} must list integers >= 1, got {text!r}")
    return sorted(set(values))


def _jsonable(options: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, list, bool, type(None))) else str(v)) for k, v in options.items()}
