"""Does an EAGLE-3-style input (features of several of the target's layers, fused) make the draft head's
first token agree with the target more often on held-out text?

    genspec train head --out DIR ...                       # once: a run's sequences (DIR/sequences.json)
    python benchmarks/multilayer_features.py record --sequences DIR/sequences.json --features WORK/feats.pt
    python benchmarks/multilayer_features.py train --sequences DIR/sequences.json --features WORK/feats.pt \\
        --variant final --steps 600
    python benchmarks/multilayer_features.py train ... --variant fused --steps 600

``record`` runs the embedded target once over every sequence (one row at a time) and keeps, per position,
the outputs of layers 2, 8 and 13 of its 18 (``hidden_states[3, 9, 14]``) and its final feature (the LM
head's input, checked against the model's logits on the first sequence), float32 (2.7 GB for the 267,827
tokens of the 384-token run). ``train`` trains one head on them, seed 0, the run's own train / held-out split
(seed 0) and 8,192-token vocabulary, :class:`genspec.train.head.TrainSettings` defaults but ``--steps``:

- ``final``: the shipped architecture and loss (:class:`genspec.models.draft_head.DraftHead`,
  :func:`genspec.train.head.head_loss`) on the final feature alone;
- ``fused``: the same head whose input pair starts from ``Linear(concat(RMSNorm(part) per part))`` of all
  four parts (EAGLE-3's fusion) instead of the normed final feature; the same loss on the final feature
  (regression + 0.1 x cross-entropy), the same uniform noise on each part.

Only the first draft token is measured (what the fused input changes: a second token would need the
head's own output in place of the fused feature, i.e. EAGLE-3's training-time test). It prints the
held-out top-1 agreement (all held-out pairs, as ``genspec train`` reports) every 300 steps.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import genspec
from genspec.models.distilled import local_ids
from genspec.models.draft_head import DraftHead, HeadConfig
from genspec.train.data import Sequences
from genspec.train.head import (Teacher, TrainSettings, choose_vocabulary, cut_pieces, evaluate, feature_loss, head_loss,
                                pad_batch)

#: ``hidden_states`` indices kept besides the final feature (outputs of layers 2, 8 and 13 of 18)
LAYERS = (3, 9, 14)


def record(sequences: str, path: str) -> None:
    target = genspec.load_model(None)
    data = Sequences.load(sequences)
    data.split(0)
    out = []
    started = time.perf_counter()
    with torch.no_grad():
        for n, seq in enumerate(data.sequences):
            ids = torch.tensor([seq[:-1]])
            hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
            out.append((torch.tensor(seq), torch.cat([hidden[i][0].float() for i in LAYERS] + [hidden[-1][0].float()], -1)))
            if n == 0:
                same = torch.allclose(target.model.lm_head(hidden[-1]), target.model(input_ids=ids).logits, atol=1e-3)
                print("last hidden = LM head input:", same, flush=True)
            if n % 50 == 0:
                print(n, f"{time.perf_counter() - started:.0f}s", flush=True)
    torch.save({"data": out, "held_out": data.held_out, "train": data.train, "layers": LAYERS}, path)


class FusedInputHead(DraftHead):
    """The draft head whose input starts from the fused parts instead of the normed final feature."""

    def __init__(self, config: HeadConfig, parts: int):
        super().__init__(config)
        hidden = config.hidden_size
        self.part_norms = nn.ModuleList(nn.RMSNorm(hidden, eps=config.eps) for _ in range(parts))
        self.fuse = nn.Linear(parts * hidden, hidden, bias=False)

    def inputs(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        chunks = features.split(self.config.hidden_size, -1)
        fused = self.fuse(torch.cat([norm(c) for norm, c in zip(self.part_norms, chunks)], -1))
        return self.fc(torch.cat([fused, self.embedding_norm(embeddings)], dim=-1))


def fused_loss(head, teacher, tokens, features, mask, settings, generator=None):
    """:func:`genspec.train.head.head_loss` for a multi-part input: noise on every part, the regression
    and cross-entropy against the final part (the target's feature)."""
    hidden = head.config.hidden_size
    inputs = features[:, :-1]
    if settings.noise and generator is not None:
        noisy = []
        for part in inputs.split(hidden, -1):
            scale = part.pow(2).mean(-1, keepdim=True).sqrt()
            noisy.append(part + settings.noise * scale * (torch.rand(part.shape, generator=generator) * 2 - 1))
        inputs = torch.cat(noisy, -1)
    predicted = head(inputs, teacher.embed(tokens[:, 1:-1]).to(features.dtype))
    return feature_loss(predicted, features[:, 1:, -hidden:], teacher, mask, settings)


def train(sequences: str, path: str, variant: str, steps: int) -> None:
    saved = torch.load(path, weights_only=False)
    hidden = 640
    parts = len(saved["layers"]) + 1
    data = [(t, f[:, -hidden:] if variant == "final" else f) for t, f in saved["data"]]
    target = genspec.load_model(None)
    runs = Sequences.load(sequences)
    vocab_ids = choose_vocabulary([runs.sequences[i] for i in saved["train"]], 8192, target.eos_token_ids)
    teacher = Teacher(target.subset_head(torch.as_tensor(vocab_ids)), target.model.get_input_embeddings(),
                      local_ids(vocab_ids, target.vocab_size))
    settings = TrainSettings(steps=steps)
    torch.manual_seed(0)
    config = HeadConfig(hidden_size=hidden)
    head = (DraftHead(config) if variant == "final" else FusedInputHead(config, parts)).float().train()
    loss_of = head_loss if variant == "final" else fused_loss
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / settings.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    generator = torch.Generator().manual_seed(0)
    pieces = cut_pieces([data[i] for i in saved["train"]], 256)
    held = cut_pieces([data[i] for i in saved["held_out"]], 256)
    print(variant, "params", sum(p.numel() for p in head.parameters()), "pieces", len(pieces), len(held), flush=True)

    started = time.perf_counter()
    for step in range(1, steps + 1):
        tokens, features, mask = pad_batch(pieces, torch.randint(len(pieces), (8,), generator=generator).tolist())
        loss, _, _, agree = loss_of(head, teacher, tokens, features, mask, settings, generator)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps:
            line = f"{variant} step {step} loss {loss.item():.3f} train-agree {agree.item():.3f} {time.perf_counter() - started:.0f}s"
            if step % 300 == 0 or step == steps:
                line += f" HELD-OUT agreement {evaluate(head, teacher, held, settings, loss_of)['agreement']:.4f}"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "train"))
    parser.add_argument("--sequences", required=True, help="a genspec train run's sequences.json")
    parser.add_argument("--features", required=True, help="the recorded features (written by record)")
    parser.add_argument("--variant", choices=("final", "fused"), default="final")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    if args.action == "record":
        record(args.sequences, args.features)
    else:
        train(args.sequences, args.features, args.variant, args.steps)


if __name__ == "__main__":
    main()
