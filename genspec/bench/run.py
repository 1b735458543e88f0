"""A ``genspec bench`` run: the decoders of every method over the shared target, timed interleaved per
prompt, and the outputs (results.json, report.md, plots). The command line is :mod:`genspec.cli.bench`."""
from __future__ import annotations

import gzip
import json
from collections import Counter
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import genspec
from genspec import strict_json
from genspec.bench.analysis import summarize
from genspec.bench.hf_baselines import ForwardClock, HFDecoder, StepLog, assistant_tokenizers, load_hf_model
from genspec.bench.llamacpp_baselines import LlamaCppDecoder, LlamaServerDecoder
from genspec.bench.methods import HF_PLAIN, LLAMA_SERVER, LLAMACPP_PLAIN, drafter_options, sweep_methods
from genspec.bench.plots import write_plots
from genspec.bench.prompts import encode_follow_up
from genspec.bench.report import write_report
from genspec.bench.runner import GenspecDecoder, encode_all, run_interleaved, warm_up
from genspec.drafters.ngram_cache import clear_process_tables
from genspec.drafters.suffix import clear_suffix_caches
from genspec.embedded import default_gguf_path, default_model_dir
from genspec.engine import GenerationConfig
from genspec.errors import ConfigError, InputFileError
from genspec.interrupts import stoppable


# --------------------------------------------------------------------------- environment
def machine_info() -> dict:
    import transformers  # here: its version only, and slow to import

    cpu_model, physical = platform.processor() or platform.machine(), set()
    try:
        current = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if not key:
                if "core id" in current:
                    physical.add((current.get("physical id"), current["core id"]))
                current = {}
            else:
                current[key] = value
                if key == "model name":
                    cpu_model = value
    except OSError:
        pass
    return {"cpu_model": cpu_model, "logical_cores": os.cpu_count(), "physical_cores": len(physical) or None,
            "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "genspec": genspec.__version__,
            "blas": "MKL" if torch.backends.mkl.is_available() else "other"}


def model_info(path, target) -> dict:
    if target.backend == "llamacpp":  # a GGUF file on llama.cpp
        return {"path": str(path), "backend": "llamacpp", "architecture": target.description,
                "num_layers": target.num_layers, "vocab_size": target.vocab_size, "dtype": "GGUF",
                "max_context": target.max_context, "max_rows": target.max_rows}
    config = getattr(target.model, "config", None)
    head = target.lm_head
    return {"path": str(path), "backend": "torch",
            "architecture": (getattr(config, "architectures", None) or [type(target.model).__name__])[0],
            "num_layers": target.num_layers, "vocab_size": target.vocab_size, "dtype": str(target.dtype),
            "max_context": target.max_context,
            # the LM head's kernel per row count when the run ended (timed per process: genspec/kernels.py)
            "lm_head_kernels": None if head is None else {str(rows): k for rows, k in sorted(head.chosen().items())},
            # and the decoder's linear layers' (genspec/models/hf.py: TransposedLinear)
            "linear_kernels": None if target.linear_kernels is None else {
                str(rows): k for rows, k in sorted(target.linear_kernels.chosen().items())}}


# --------------------------------------------------------------------------- the run
def execute(s: dict, prompts, console, command: str) -> dict:
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    config = GenerationConfig(max_new_tokens=s["max_new_tokens"], num_draft_tokens=s["num_draft_tokens"],
                              temperature=s["temperature"], top_p=s.get("top_p", 1.0), seed=s["seed"],
                              draft_length=s["draft_length"],
                              # the standard rule by name: the seed only makes methods comparable, and the
                              # coupled rule that "auto" would pick for seeded model drafters accepts less
                              rule="overaccept")
    with console.status("loading the target model (genspec)"):
        model_path = s["model"]
        backend = s.get("backend", "torch")
        target = genspec.load_model(None if model_path is None else str(model_path), dtype=s["dtype"],
                                    backend=backend, max_rows=1, kernels=s.get("kernels", "auto"))
        if model_path is None:  # the embedded model (load_model refuses a dtype it cannot run in)
            model_path = default_gguf_path() if backend == "llamacpp" else default_model_dir()
    # what every method and baseline stops at: the tokenizer's and the model's end tokens, as generate() does,
    # or none with --ignore-eos (each call then generates --max-new-tokens)
    eos = [] if s.get("ignore_eos") else list(target.eos_token_ids)
    config = replace(config, eos_token_ids=tuple(eos))
    drafters = {}

    def drafter_for(spec):
        options = drafter_options(spec)
        key = (spec.base, json.dumps(options, sort_keys=True, default=str))
        if key not in drafters:  # methods that differ only in engine settings share a drafter
            with console.status(f"building drafter {spec.base}"):
                drafters[key] = genspec.build_drafter(spec.base, target, **options)
        return drafters[key]

    main_specs = list(s["methods"])
    sweep_specs = []
    if s["k_sweep"]:
        sweep_specs = sweep_methods(s["sweep_method"], s["k_sweep"])
    decoders, sweep_decoders = {}, []
    for spec in main_specs + ([s["sweep_method"]] if s["sweep_method"] else []) + sweep_specs:
        if spec.kind == "genspec" and spec.name not in decoders:
            decoders[spec.name] = GenspecDecoder(spec, target, drafter_for(spec) if spec.base != "none" else None,
                                                 target.tokenizer, deepest=s["num_draft_tokens"])
    hf_specs = [m for m in main_specs if m.kind == "hf"]
    if hf_specs:
        with console.status("loading an untouched copy of the model for the transformers baselines"):
            hf_model = load_hf_model(model_path, s["dtype"])
            assistant = (load_hf_model(s["draft_model"], s["dtype"]) if any(m.base == "hf-assisted" for m in hf_specs)
                         else None)
            tokenizers = assistant_tokenizers(target.tokenizer, s["draft_model"]) if assistant is not None else {}
        pad = getattr(target.tokenizer, "pad_token_id", None)
        clock, log = ForwardClock().attach(hf_model), StepLog(hf_model)  # observed once, shared by the HF methods
        for spec in hf_specs:
            decoders[spec.name] = HFDecoder(spec, hf_model, clock, log, eos, pad,
                                            assistant if spec.base == "hf-assisted" else None,
                                            num_layers=target.num_layers, tokenizers=tokenizers)
    llamacpp_specs = [m for m in main_specs if m.kind == "llamacpp"]
    if llamacpp_specs:
        # llama-cpp-python keeps the logits of every position of its context when it drafts (4 bytes x 262,144
        # a token on the embedded model): its context is the run's longest prompt and answer, not the model's
        longest = max(len(ids) for ids in encode_all(prompts, target.tokenizer)) + s["max_new_tokens"] + 64
        if any(p.follows is not None for p in prompts):  # a second turn holds the first and its answer
            longest *= 2
        context = min(target.max_context or longest, -(-longest // 256) * 256)
        for spec in llamacpp_specs:
            if spec.base == LLAMA_SERVER:
                with console.status(f"starting llama.cpp's llama-server for {spec.name}"):
                    decoders[spec.name] = LlamaServerDecoder(spec, model_path, eos, context=context)
            else:
                with console.status(f"loading llama-cpp-python's own Llama for {spec.name}"):
                    decoders[spec.name] = LlamaCppDecoder(spec, model_path, eos, context=context)
    main = [decoders[m.name] for m in main_specs]
    if s["sweep_method"] and s["sweep_method"].name not in {m.name for m in main_specs}:
        sweep_decoders.append(decoders[s["sweep_method"].name])
    sweep_decoders += [decoders[m.name] for m in sweep_specs]

    prompt_ids = encode_all(prompts, target.tokenizer)
    if any(p.follows is not None for p in prompts):
        with console.status("answering the first turns of the repeated-traffic conversations (not timed)"):
            prompt_ids = follow_ups(prompts, prompt_ids, decoders["plain"], config, target)
    kept, skipped = [], []
    for prompt, ids in zip(prompts, prompt_ids):
        if target.max_context is not None and len(ids) + s["max_new_tokens"] > target.max_context:
            skipped.append({"category": prompt.category, "question_id": prompt.question_id, "prompt_tokens": len(ids)})
        else:
            kept.append((prompt, ids))
    if skipped:
        console.print(f"skipping {len(skipped)} prompt(s) longer than the model's context of {target.max_context} "
                      f"tokens minus --max-new-tokens", markup=False)
    if not kept:
        raise ConfigError(f"no prompt fits the model's context of {target.max_context} tokens with "
                          f"--max-new-tokens {s['max_new_tokens']}")
    sweep_keys = set()
    for prompt, _ in kept[:s["sweep_prompts"]] if sweep_decoders else []:
        sweep_keys.add((prompt.category, prompt.question_id))

    with console.status("warming up every method (not timed)"):
        warm_up(main + sweep_decoders, kept[0][1], config)

    total = s["repeats"] * (len(kept) * len(main) + len(sweep_keys) * len(sweep_decoders))
    records = []
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[last]}"),
                  console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=total, last="")

        def on_progress(text, record):
            if record is None:
                progress.update(task, description=text)
            else:
                last = (f"[red]{record['method']} failed[/red]" if record["error"] else
                        f"last: {record['method']} {record['tokens_per_second']:.1f} tok/s")
                progress.update(task, advance=1, last=last)

        interrupted = False
        with stoppable():  # Ctrl-C, or SIGTERM / SIGINT in the background: report what was measured
            try:
                for repeat in range(s["repeats"]):
                    # repeats are independent replicates: a drafter that learns across requests (ngram-cache's
                    # process table, the suffix drafter's process cache) must not have seen this very suite's
                    # outputs in an earlier repeat
                    clear_process_tables()
                    clear_suffix_caches()
                    for index, (prompt, ids) in enumerate(kept):
                        extra = sweep_decoders if (prompt.category, prompt.question_id) in sweep_keys else []
                        batch = run_interleaved(main + extra, [prompt], [ids], config, repeats=1,
                                                on_progress=on_progress, rotation=index + repeat)
                        for record in batch:
                            record["repeat"] = repeat
                            if prompt.history:
                                record["phase"] = "history"
                            elif any(record["method"] == d.name for d in extra):
                                record["phase"] = "sweep"
                            records.append(record)
            except KeyboardInterrupt:  # keep what was measured: a long run stopped early still reports
                interrupted = True
                console.print("interrupted: writing the results of the prompts finished so far", markup=False)
    if not records:
        raise KeyboardInterrupt

    by_name = {spec.name: spec for spec in main_specs + sweep_specs + ([s["sweep_method"]] if s["sweep_method"] else [])}
    for record in records:
        spec = by_name[record["method"]]
        record["k"] = spec.config_overrides.get("num_draft_tokens") if record["method"] in {m.name for m in sweep_specs} else None
    # the sweep's reference points (plain, the sweep method with its own policy) come from the same
    # interleaved calls on the sweep prompts
    for record in list(records):
        if (record["phase"] == "main" and (record["category"], record["question_id"]) in sweep_keys
                and s["sweep_method"] is not None and record["method"] in ("plain", s["sweep_method"].name)):
            records.append(dict(record, phase="sweep", k=None))

    settings = {k: v for k, v in s.items() if k not in ("methods", "sweep_method", "out")}
    settings.update(out=str(s["out"]), sweep_prompts=len(sweep_keys), sweep_method=s["sweep_method"].name if s["sweep_method"] else None,
                    eos_token_ids=eos, model=str(model_path), prompts_skipped=skipped,
                    hf_generate={d.name: d.settings for d in main if d.kind == "hf"},
                    llamacpp_baselines={d.name: d.settings for d in main if d.kind == "llamacpp"},
                    genspec_methods={d.name: d.settings for d in main + sweep_decoders if d.kind == "genspec"},
                    baselines={"plain": "genspec SpeculativeEngine without a drafter (same code path, same kernels)",
                               HF_PLAIN: "transformers generate(), greedy, stock model loaded separately",
                               LLAMACPP_PLAIN: "llama-cpp-python Llama.generate(), the same GGUF file loaded separately"})
    return {"format": 1, "interrupted": interrupted, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command,
            "machine": machine_info(), "model": model_info(model_path, target), "settings": settings,
            "methods": [m.to_dict() for m in main_specs],
            "sweep_methods": [m.to_dict() for m in sweep_specs],
            "prompts": [{"category": p.category, "question_id": p.question_id, "prompt_tokens": len(i),
                         **({"history": True} if p.history else {})} for p, i in kept],
            "runs": records}


def follow_ups(prompts, prompt_ids: list[list[int]], plain, config, target) -> list[list[int]]:
    """The ids of every prompt that follows an earlier one (the repeated-traffic replay's second turns):
    the earlier prompt, the model's greedy answer to it (plain decoding, ``config``'s length) and the next
    turn. An earlier prompt too long for the context leaves its follow-up as long (it is skipped)."""
    index = {p.question_id: i for i, p in enumerate(prompts)}
    out = list(prompt_ids)
    greedy = replace(config, temperature=0.0, seed=0)
    for i, prompt in enumerate(prompts):
        if prompt.follows is None:
            continue
        earlier = index[prompt.follows]
        ids = prompt_ids[earlier]
        answer: list[int] = []
        if target.max_context is None or len(ids) + config.max_new_tokens < target.max_context:
            answer = list(plain.decode(ids, greedy)["token_ids"])
            while answer and answer[-1] in target.eos_token_ids:
                answer.pop()
        out[i] = encode_follow_up(prompts[earlier], ids, answer, prompt.text, target.tokenizer)
    return out


#: each call's per-token records, written only with ``genspec bench --raw``: the generated token ids and
#: the (drafted, accepted) counts of every step in order
RAW_FIELDS = ("token_ids", "steps")


def compact_runs(results: dict) -> None:
    """Drop the per-token records (:data:`RAW_FIELDS`) from every run, in place. A run's steps are kept as
    ``step_counts``, ``[[drafted, accepted, count], ...]``: what the report's Leviathan prediction reads, so
    ``--report-from`` rebuilds the same report from the compact file."""
    for run in results["runs"]:
        if not isinstance(run, dict):
            continue
        steps = run.pop("steps", None)
        run.pop("token_ids", None)
        if steps is not None:
            counts = Counter((int(drafted), int(accepted)) for drafted, accepted in steps)
            run["step_counts"] = [[d, a, n] for (d, a), n in sorted(counts.items())]


def read_results(source: Path) -> dict:
    """A results file as written by :func:`write_outputs` (``results.json``, or gzip-compressed
    ``results.json.gz``), parsed; unreadable or non-JSON files raise :class:`InputFileError` (one line)."""
    name = str(source)
    try:
        raw = gzip.decompress(source.read_bytes()) if name.endswith(".gz") else source.read_bytes()
        return json.loads(raw.decode("utf-8"))
    except FileNotFoundError as exc:
        raise InputFileError(f"results file not found: {source}") from exc
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as exc:
        raise InputFileError(f"{source}: not a genspec bench results.json (binary or not UTF-8 text)") from exc
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{source}: not a genspec bench results.json (not JSON: {exc.msg} at line "
                             f"{exc.lineno}, column {exc.colno})") from exc
    except OSError as exc:
        raise InputFileError(f"cannot read results file {source}: {exc.strerror or exc}") from exc


def write_outputs(results: dict, out: Path, raw: bool = True, name: str = "results.json") -> list[Path]:
    """Write ``name`` (gzip-compressed if it ends in ``.gz``), report.md and the plots into ``out``. The
    summary is computed first, from every record; ``raw=False`` then leaves the per-token records out of
    the results file (:func:`compact_runs`)."""
    results["summary"] = summarize(results)
    if not raw:
        compact_runs(results)
    text = strict_json.dumps(results, indent=1, default=str)
    try:
        if name.endswith(".gz"):
            (out / name).write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
        else:
            (out / name).write_text(text)
        (out / "report.md").write_text(write_report(results))
        plots = write_plots(results, results["summary"], out)
    except OSError as exc:
        raise InputFileError(f"cannot write to output directory {out}: {exc.strerror or exc}") from exc
    return [out / name, out / "report.md"] + plots
