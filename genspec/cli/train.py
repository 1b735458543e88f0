"""``genspec train KIND``: train a speculator for a model on this machine.

- ``head``: an EAGLE-style draft head on the target's own features (:mod:`genspec.speculators.head`), used
  with ``--drafter head -O path=DIR``; ``--shape eagle3`` makes EAGLE-3's, which ``genspec export head`` writes
  for llama.cpp and vLLM;
- ``medusa``: Medusa-1 heads on the target's last feature, used with ``--drafter medusa -O path=DIR``;
- ``draft``: a tiny standalone draft model distilled from the target (a transformer, or with ``--arch gru|lstm`` a
  recurrent network), ``--drafter draft -O path=DIR``.

Data: the target's own greedy continuations of Spec-Bench prompts that ``genspec bench`` never measures
(from the 6th prompt of each category on; bench measures the first ``--num-prompts``, at most 5 are
excluded here), plus teacher-forced text files given with ``--data``. 1 in 10 sequences is held out.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.embedded import default_model_dir
from genspec.cli.options import add_options
from genspec.drafters.registry import DRAFTERS
from genspec.errors import ConfigError, InputFileError
from genspec.models.hf import HFCausalLM
from genspec.speculators.distilled import DRAFT_ARCHS, DraftConfig
from genspec.speculators.head import HeadConfig, HeadShape, eagle3_layers
from genspec.speculators.medusa import MedusaConfig
from genspec.speculators.store import HEAD_CONFIG, target_fingerprint
from genspec.textfiles import check_output_dir
from genspec.train.data import (SEQUENCES, Sequences, choose_vocabulary, collect_sequences, held_out_acceptance,
                                read_texts, record_features)
from genspec.train.loop import resumable_state, train_head
from genspec.train.plots import training_curve
from genspec.train.settings import TrainSettings

#: ``genspec train head --token-layers`` unless given: 0, the embedding (EAGLE's), which the shipped head was
#: trained with, so the default command still makes it. With the same data and steps, the target's state after
#: its first 4 or 6 layers lifts the first token's agreement with the target's answers, and through the engine
#: a head trained with 6 keeps its first draft token more often but runs slower (on a CPU those layers cost a
#: good share of a plain step per draft), so the shipped head and this default stay (the manual's Training
#: speculators and Trained heads pages have the measurements)
DEFAULT_TOKEN_LAYERS = 0

#: Spec-Bench prompts per category that training never uses (``genspec bench`` measures the first ones)
BENCH_PROMPTS_EXCLUDED = 5


KINDS = {"head": "an EAGLE-style draft head on the target's own features (one decoder layer, or --layers N; "
                 "--shape eagle3: EAGLE-3's, for llama.cpp and vLLM)",
         "medusa": "Medusa-1 heads: K residual blocks on the target's last feature",
         "draft": "a tiny standalone draft model with the target's tokenizer, distilled from its laws (a transformer, "
                  "or --arch gru|lstm)"}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a speculator (a draft head, Medusa heads) for a model here")
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, text in KINDS.items():
        p = sub.add_parser(kind, help=text)
        add_options(p, "model", model={"help": "target model directory (default: the embedded model)"})
        p.add_argument("--out", required=True, metavar="DIR", help="where the speculator (and its checkpoint) go")
        p.add_argument("--data", action="append", default=[], metavar="FILE",
                       help="extra teacher-forced text (UTF-8 .txt, or .jsonl with a \"text\" field); repeatable")
        p.add_argument("--steps", type=int, default=2000)
        p.add_argument("--batch-size", type=int, default=8)
        p.add_argument("--prompts", type=int, default=415,
                       help="Spec-Bench prompts used (at most 415 are not measured)")
        add_options(p, "max_new_tokens", max_new_tokens={"default": 128, "help": "tokens per continuation"})
        p.add_argument("--max-prompt-tokens", type=int, default=384,
                       help="longer prompts are not continued (decoding after them is slow on a CPU); their "
                            "text still trains, teacher-forced")
        p.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary (most frequent output tokens)")
        if kind == "head":
            p.add_argument("--layers", type=int, default=1, help="the head's decoder layers (EAGLE's: 1)")
            p.add_argument("--token-layers", type=int, default=DEFAULT_TOKEN_LAYERS, metavar="L",
                           help="a committed pair reads the target's state after its first L layers over the "
                                "next token instead of its embedding (default %(default)s: the embedding, EAGLE's)")
            p.add_argument("--feature-layers", default="", metavar="L1,L2,...",
                           help="a committed pair's feature fuses the target's final one with the outputs of these "
                                "layers (EAGLE-3's: e.g. 3,9,14 of 18; default: the final feature only; with --shape "
                                "eagle3 exactly three, default llama.cpp's converter's 2,n/2,n-3)")
            p.add_argument("--shape", choices=[shape.value for shape in HeadShape], default=HeadShape.EAGLE.value,
                           help="the head's layout: eagle (genspec's, default) or eagle3 (llama.cpp's and vLLM's "
                                "EAGLE-3: three target layers fused, its own output layer over the draft vocabulary; "
                                "genspec export head writes it for them)")
        if kind == "medusa":
            p.add_argument("--num-heads", type=int, default=4, help="heads (the longest draft)")
        if kind == "draft":
            p.add_argument("--arch", choices=DRAFT_ARCHS, default="transformer",
                           help="the draft's network: a Llama (default), or a stack of GRU or LSTM layers, whose cost "
                                "per draft token does not grow with the context")
            p.add_argument("--width", type=int, default=256, help="the draft's hidden size")
            p.add_argument("--layers", type=int, default=2, help="the draft's transformer (or recurrent) layers")
        add_options(p, "seed", seed={"default": 0})
        p.add_argument("--sequences", metavar="FILE", help="reuse the training sequences of an earlier run "
                       "(its sequences.json; skips the target's continuations)")
        p.add_argument("--resume", action="store_true", help="continue the training in --out")
        p.add_argument("--force", action="store_true",
                       help="start a new training in --out even if it holds files (an earlier run's are overwritten)")
        p.set_defaults(func=run)


def _check_files(args, out: Path):
    """Every path of the run checked before anything loads: ``--out`` a directory that can be written
    (empty unless ``--force``, or ``--resume``, then holding a checkpoint that loads), ``--data`` readable
    UTF-8 text, ``--sequences`` readable sequences. Returns what the run reads of them: (saved sequences of a
    resumed run or of ``--sequences``, or None; the texts of ``--data``)."""
    if out.exists() and not out.is_dir():
        raise InputFileError(f"--out {out} is a file; give a directory (the speculator's files go in it)")
    if args.resume and args.force:
        raise ConfigError("--resume and --force exclude each other: continue the training in --out, or start over")
    if args.resume:
        resumable_state(out)  # there is a checkpoint, and it loads (its shape is checked once the config is known)
    if args.data and args.sequences:
        raise ConfigError("--data and --sequences exclude each other (the sequences already hold their text)")
    # a resumed run writes over its own files; a new one over nobody's unless --force
    check_output_dir(out, args.force or args.resume, instead=", or --resume to continue its training")
    texts = read_texts(args.data)
    if args.resume and (out / SEQUENCES).is_file():
        return Sequences.load(out / SEQUENCES), texts
    return (Sequences.load(args.sequences) if args.sequences else None), texts


def _sequences(args, target, out: Path, given, texts: list[str], progress):
    """The run's sequences: ``given`` (those saved in ``out`` by the run resumed, or those of
    ``--sequences``), or new ones (the target's continuations + ``texts``), saved in ``out`` before
    training starts."""
    saved = out / SEQUENCES
    if args.resume and saved.is_file():
        return given  # the resumed run's own (read by _check_files)
    if given is not None:
        data = given
        if data.info.get("fingerprint") != _fingerprint(target):
            raise ConfigError(f"the sequences in {args.sequences} were made by another model")
    else:
        measured = {q.question_id for q in load_spec_bench(per_category=BENCH_PROMPTS_EXCLUDED)}
        prompts = [p for p in load_spec_bench() if p.question_id not in measured][:args.prompts]
        task = progress.add_task("target continuations", total=None)
        data = collect_sequences(target, [encode_prompt(p.text, target.tokenizer) for p in prompts], texts,
                                 args.max_new_tokens, args.max_prompt_tokens,
                                 progress=lambda done, total: progress.update(task, completed=done, total=total))
        data.info.update({"model": args.model or "embedded default", "prompts": len(prompts), "text_files": args.data,
                          "fingerprint": _fingerprint(target)})
    data.split(args.seed)
    out.mkdir(parents=True, exist_ok=True)
    data.save(saved)
    return data


def _layer_list(text: str, num_layers: int) -> tuple[int, ...]:
    """``--feature-layers``: distinct layer numbers 1 .. num_layers - 1, comma-separated (empty: none)."""
    try:
        layers = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--feature-layers takes comma-separated layer numbers, got {text!r}") from None
    if len(set(layers)) != len(layers) or not all(0 < layer < num_layers for layer in layers):
        raise ConfigError(f"--feature-layers must be distinct layers in 1..{num_layers - 1}, got {text!r}")
    return layers


def _fingerprint(target) -> str:
    return target_fingerprint(target)


#: the most sequences a training step may take (``--batch-size``): memory grows with them
MAX_BATCH_SIZE = 1024
#: the largest draft vocabulary ``--vocab-size`` may ask for: 2^20, more than any tokenizer holds (the draft's is the
#: target's most frequent output tokens, so a size above the target's vocabulary takes all of them)
MAX_VOCAB_SIZE = 1 << 20
#: the widest draft ``--width`` may ask for (wider than most targets' own hidden size)
MAX_WIDTH = 8192
#: the most layers (``--layers``) or Medusa heads (``--num-heads``) a speculator may have: deeper than a draft that
#: pays for itself by far
MAX_LAYERS = 64
#: a transformer draft's width is a multiple of this: its attention heads (4) of an even size (rotary positions
#: turn pairs of dimensions)
WIDTH_STEP = 2 * DraftConfig(hidden_size=0, vocab_size=0).num_heads


def _target_shape(model: str | None) -> tuple[int | None, int | None]:
    """The target's context and layer count from its config.json alone (no weights; None where it cannot be
    read: loading then says why)."""
    from transformers import AutoConfig  # here: transformers takes seconds to import, and only train needs it here

    try:
        config = AutoConfig.from_pretrained(model if model is not None else default_model_dir(), local_files_only=True)
    except (OSError, ValueError):
        return None, None
    config = config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None), getattr(config, "num_hidden_layers", None)


def check_arguments(args) -> TrainSettings:
    """Every number of the run checked before anything loads (one line each): its range, and where the target
    bounds it (the context, the layers) the target's config; returns the loop's settings."""
    unmeasured = len(load_spec_bench()) - len(load_spec_bench(per_category=BENCH_PROMPTS_EXCLUDED))
    context, layers = _target_shape(args.model)
    # name -> (least, most, why the most): None is no bound, or one the target's config did not give; a prompt
    # cap needs none (above the context it caps nothing)
    ranges = {"steps": (1, None, ""), "batch_size": (1, MAX_BATCH_SIZE, ""),
              "prompts": (1, unmeasured, " (the Spec-Bench prompts genspec bench does not measure)"),
              "max_new_tokens": (1, context, " (the target's context)"), "max_prompt_tokens": (1, None, ""),
              "vocab_size": (1, MAX_VOCAB_SIZE, ""), "num_heads": (1, MAX_LAYERS, ""),
              "width": (1, MAX_WIDTH, ""), "layers": (1, MAX_LAYERS, ""),
              "token_layers": (0, None if layers is None else layers - 1, f" (the target has {layers} layers)"),
              "seed": (0, 2 ** 63 - 1, "")}
    for name, (least, most, why) in ranges.items():
        value = getattr(args, name, None)  # the options of this kind of speculator only
        if value is not None and not (least <= value and (most is None or value <= most)):
            span = f">= {least}" if most is None else f"from {least} to {most}{why}"
            raise ConfigError(f"--{name.replace('_', '-')} must be {span}, got {value}")
    if getattr(args, "arch", None) == "transformer" and args.width % WIDTH_STEP:
        raise ConfigError(f"--width of a transformer draft must be a multiple of {WIDTH_STEP} (its attention heads "
                          f"split it evenly), got {args.width}")
    if getattr(args, "feature_layers", "") and layers is not None:
        _layer_list(args.feature_layers, layers)
    if getattr(args, "shape", None) == HeadShape.EAGLE3:
        if args.layers != 1 or args.token_layers:
            raise ConfigError("--shape eagle3 has one decoder layer and reads token embeddings: --layers 1, no --token-layers")
        given = [part for part in args.feature_layers.split(",") if part.strip()]
        if given and len(given) != 3:
            raise ConfigError(f"--shape eagle3 reads exactly three --feature-layers, got {args.feature_layers!r}")
        if not given and layers is not None:
            eagle3_layers(layers)  # a target with too few layers is refused now
    return TrainSettings(steps=args.steps, batch_size=args.batch_size, seed=args.seed)


def run(args) -> int:
    settings = check_arguments(args)
    out = Path(args.out)
    given, texts = _check_files(args, out)
    console = Console(stderr=True)
    torch.manual_seed(args.seed)
    target = genspec.load_model(args.model, backend="torch")
    if not isinstance(target, HFCausalLM):
        raise ConfigError(f"genspec train {args.kind} needs a Hugging Face model directory (it reads hidden states)")
    token_layers = getattr(args, "token_layers", 0)
    if token_layers >= target.num_layers:
        raise ConfigError(f"--token-layers must be below the target's {target.num_layers} layers, got {token_layers}")
    feature_layers = _layer_list(getattr(args, "feature_layers", ""), target.num_layers)
    shape = HeadShape(getattr(args, "shape", HeadShape.EAGLE))
    if shape is HeadShape.EAGLE3 and not feature_layers:
        feature_layers = eagle3_layers(target.num_layers)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        data = _sequences(args, target, out, given, texts, progress)
        vocab = choose_vocabulary([data.sequences[i] for i in data.train], args.vocab_size, target.eos_token_ids)
        config = {"head": lambda: HeadConfig(target.config.hidden_size, num_layers=args.layers, token_layers=token_layers,
                                             feature_layers=feature_layers, shape=shape,
                                             vocab_size=len(vocab) if shape is HeadShape.EAGLE3 else 0),
                  "medusa": lambda: MedusaConfig(target.config.hidden_size, args.num_heads),
                  "draft": lambda: DraftConfig(target.config.hidden_size, len(vocab) + 1, width=args.width,
                                               num_layers=args.layers, max_positions=target.max_context or 8192,
                                               arch=args.arch)
                  }[args.kind]
        config = config()
        if args.resume:  # before the target's features are recorded: a checkpoint of another shape fails now
            resumable_state(out, config)
        task = progress.add_task("target features", total=len(data.sequences))
        features = record_features(target, data.sequences, progress=lambda n: progress.advance(task, n),
                                   token_layers=token_layers, feature_layers=feature_layers)
        train = [features[i] for i in data.train]
        held = [features[i] for i in data.held_out]
        task = progress.add_task("training", total=args.steps)
        tokens = sum(len(f) for _, f in train)
        log = train_head(target, train, held, vocab, out, config, settings=settings, resume=args.resume, kind=args.kind,
                         progress=lambda step, entry: progress.update(
                             task, completed=step, description=f"training (loss {entry['loss']:.3f})"),
                         info={**data.info, "training_tokens": tokens, "sequences": len(train),
                               "held_out_sequences": len(held)})
        progress.add_task("held-out acceptance", total=None)
        # the head as a chain: its first draft token's acceptance is the head's own quality (a tree's
        # first level holds several guesses), the figure every earlier run recorded
        drafter = DRAFTERS[args.kind].for_target(target, path=str(out), **({"tree_nodes": 0} if args.kind == "head" else {}))
        measured = held_out_acceptance(target, drafter, data.held_out_prompts()[:8],
                                       num_draft_tokens=min(5, getattr(args, "num_heads", 5)))
    _record(out, {"held_out_acceptance": measured})
    training_curve(log, out / "training_curve.png",
                   f"genspec train {args.kind}: {tokens} training tokens, {args.steps} steps, {log['seconds'] / 60:.0f} min")
    console.print(f"{args.kind} written to {out}: {len(train)} sequences, {tokens} training tokens, {args.steps} steps in "
                  f"{log['seconds'] / 60:.1f} min; held out: draft agrees with the target's top token "
                  f"{log['held_out_after']['agreement']:.1%} of the time over the head's vocabulary (before training "
                  f"{log['held_out_before']['agreement']:.1%})")
    if measured:
        console.print(f"held-out acceptance ({measured['prompts']} prompts, greedy, {measured['num_draft_tokens']} "
                      f"draft tokens): first draft token {measured['first_token_acceptance']:.1%}, per position "
                      + " ".join(f"{a:.2f}" for a in measured["acceptance_per_position"])
                      + f"; {measured['mean_accepted_length']:.2f} tokens per target call")
    return 0


def _record(out: Path, entries: dict) -> None:
    """Add ``entries`` to the ``info`` of the saved speculator in ``out``."""
    meta = json.loads((out / HEAD_CONFIG).read_text())
    meta["info"].update(entries)
    (out / HEAD_CONFIG).write_text(json.dumps(meta))
