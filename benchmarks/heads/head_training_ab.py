"""Which training settings make a draft head agree with the target more where it was not trained?

    genspec train head --out DIR --steps 1          # once: the default run's sequences (DIR/sequences.json)
    python benchmarks/heads/head_training_ab.py --sequences DIR/sequences.json --steps 600 \\
        --variants "base;classification_weight=1.0;data=continued" --out benchmarks/results/head_studies/training_ab.json

Every variant trains a fresh head (seed 0) on the same recorded features and vocabulary, with a held-out
curve every ``--eval-every`` steps (all held-out pairs, what ``genspec train`` reports) and at the end the
agreement on the held-out sequences' *continuations* only (the pairs whose next token the target itself
wrote: what drafting meets; their prompts are context). A variant is ``;``-separated: ``base`` (the
defaults of :class:`genspec.train.settings.TrainSettings` and :class:`genspec.speculators.head.HeadConfig`), or
``key=value,...`` overriding fields of either (e.g. ``head_dim=128,intermediate_size=2048``: a wider head), plus
``data=continued`` (train on the target's continuations only, no teacher-forced text), ``data=plus-text``
(add the ``--data`` files' text, teacher-forced, to the training sequences; never to the held-out ones) or
``data=first-N`` (each training continuation cut to its prompt and first N tokens: with sequences continued
256 tokens, ``genspec train head --max-new-tokens 256``, ``data=first-128`` trains on what the default run has
and ``base`` on twice its continuations, both measured on the same held-out sequences).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

import genspec
from genspec.speculators.distilled import local_ids
from genspec.speculators.head import HeadConfig
from genspec.speculators.store import load_head
from genspec.train.data import Sequences, read_texts, teacher_forced
from genspec.train.data import choose_vocabulary, record_features
from genspec.train.loop import train_head
from genspec.train.losses import Teacher, head_loss
from genspec.train.settings import TrainSettings


def parse_variant(text: str) -> tuple[dict, dict, str]:
    """``(settings overrides, head shape overrides, data)`` of one variant."""
    settings, shape, data = {}, {}, "all"
    types = {f.name: f.type for f in fields(TrainSettings)}
    shapes = {f.name: f.type for f in fields(HeadConfig) if f.name != "hidden_size"}
    for part in filter(None, text.split(",")):
        if part == "base":
            continue
        key, _, value = part.partition("=")
        if key == "data":
            data = value
        elif key in types or key in shapes:
            kind = types.get(key, shapes.get(key))
            (settings if key in types else shape)[key] = float(value) if kind in (float, "float") else int(value)
        else:
            raise SystemExit(f"unknown setting {key!r}")
    return settings, shape, data


@torch.no_grad()
def continuation_agreement(head, teacher: Teacher, items) -> tuple[float, int]:
    """Mean top-1 agreement over the pairs predicting a token the target wrote itself."""
    agree = pairs = 0.0
    quiet = TrainSettings(noise=0.0)
    for (tokens, features), prompt_length in items:
        n = len(features)
        mask = torch.zeros(1, n - 1, dtype=torch.bool)
        mask[0, max(prompt_length - 2, 0):] = True  # pair j predicts token j + 2
        count = int(mask.sum())
        if count:
            *_, a = head_loss(head, teacher, tokens[None], features[None], mask, quiet)
            agree, pairs = agree + float(a) * count, pairs + count
    return agree / max(pairs, 1), int(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--variants", default="base")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--data", action="append", default=[], metavar="FILE",
                        help="extra teacher-forced text for data=plus-text variants (as genspec train --data)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    target = genspec.load_model(None, backend="torch")
    data = Sequences.load(args.sequences)
    started = time.perf_counter()
    features = record_features(target, data.sequences)
    extra = record_features(target, teacher_forced(target, [], read_texts(args.data))) if args.data else []
    print(f"features of {len(data.sequences)} sequences (+ {len(extra)} of --data, "
          f"{sum(len(f) for _, f in extra)} tokens) in {time.perf_counter() - started:.0f} s", flush=True)
    train_all = data.train
    held = [features[i] for i in data.held_out]
    vocab = choose_vocabulary([data.sequences[i] for i in train_all], args.vocab_size, target.eos_token_ids)
    teacher = Teacher(target.subset_head(torch.as_tensor(vocab)), target.model.get_input_embeddings(),
                      local_ids(vocab, target.vocab_size))
    continued = [(features[i], data.prompt_lengths[i]) for i in data.held_out if data.prompt_lengths[i]]
    results = {"sequences": args.sequences, "data": args.data, "steps": args.steps, "variants": []}
    for text in args.variants.split(";"):
        overrides, shape, which = parse_variant(text)
        config = HeadConfig(hidden_size=target.config.hidden_size, **shape)
        train = [features[i] for i in train_all if which != "continued" or data.prompt_lengths[i]]
        if which.startswith("first-"):
            keep = int(which.removeprefix("first-"))
            cut = [data.prompt_lengths[i] + keep if data.prompt_lengths[i] else None for i in train_all]
            train = [(tokens[:n], feats[:n - 1]) if n else (tokens, feats) for n, (tokens, feats) in zip(cut, train)]
        train += extra if which == "plus-text" else []
        settings = TrainSettings(**{**asdict(TrainSettings()), "steps": args.steps, "held_out_every": args.eval_every,
                                    "checkpoint_every": args.steps, **overrides})
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            log = train_head(target, train, held, vocab, Path(tmp) / "head", config=config, settings=settings)
            head = load_head(Path(tmp) / "head")[0].to(torch.float32)
        agreement, pairs = continuation_agreement(head, teacher, continued)
        entry = {"variant": text, "data": which, "training_tokens": sum(len(f) for _, f in train),
                 "settings": asdict(settings), "config": config.as_dict(),
                 "weights": sum(p.numel() for p in head.parameters()), "minutes": (time.perf_counter() - started) / 60,
                 "held_out_curve": [{"step": 0, **log["held_out_before"]}] + log["held_out_curve"],
                 "train_agreement_last_100": sum(e["agreement"] for e in log["loss"][-100:]) / min(100, len(log["loss"])),
                 "continuation_agreement": agreement, "continuation_pairs": pairs}
        results["variants"].append(entry)
        curve = " ".join(f"{e['step']}:{e['agreement']:.3f}" for e in entry["held_out_curve"])
        print(f"{text:40s} train {entry['train_agreement_last_100']:.3f}  held-out curve {curve}  "
              f"continuations {agreement:.3f} ({pairs} pairs)  {entry['minutes']:.1f} min", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
