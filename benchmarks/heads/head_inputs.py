"""Which inputs lift the draft head's first token: several of the target's layers at i (EAGLE-3's fused
feature), the target's early layers over token i + 1 instead of its embedding, or both?

    genspec train head --out DIR --steps 1            # once: the default run's sequences (DIR/sequences.json)
    python benchmarks/heads/head_inputs.py record --sequences DIR/sequences.json --features WORK/feats.pt \\
        --outputs benchmarks/results/head_studies/answers.json
    python benchmarks/heads/head_inputs.py train --features WORK/feats.pt --variants "final+embedding;final+6;fused+6" --steps 600

``record`` runs the embedded target once over every sequence (one row at a time) and keeps, per position,
the outputs of its layers 3, 4, 6, 9 and 14 (``hidden_states[3, 4, 6, 9, 14]``; the layer numbers here
count from 1, so "layer 6" is the output of the first 6 of its 18 layers) and its final feature (the LM
head's input), float32; the same for ``--outputs`` (each Spec-Bench category's 3rd and 4th prompt with the
target's greedy 128-token answer, written by ``benchmarks/heads/next_token_layer_state.py``: prompts no run
measures or trains on).

``train`` trains one head per variant ``FIRST+SECOND`` on the run's train split (seed 0, the run's own
held-out split and an 8,192-token vocabulary of its training sequences), with
:class:`genspec.train.settings.TrainSettings` defaults but ``--steps``: the pair at i is (FIRST at i, SECOND at
i + 1), the head predicts the target's final feature at i + 1 (regression + 0.1 x cross-entropy, the shipped
loss) with uniform noise on FIRST (what stands in for the head's own predictions further on).

- FIRST ``final``: the target's final feature (the shipped input); ``fused``: ``Linear(concat(RMSNorm(part)))``
  of layers 3, 9, 14 and the final feature (EAGLE-3's fusion; 1.6 M more weights);
- SECOND ``embedding``: the embedding of token i + 1 (the shipped input); a layer number L (4 or 6): the target's
  state after its first L layers over token i + 1 (which has attended over the whole context; at run time
  the engine would run those layers over each token it commits before the head drafts); ``attn6``: the same
  after its first 6 layers with their MLPs left out (:func:`attention_only`: about 30% of those layers' cost).

Printed every 300 steps: held-out top-1 agreement over all held-out pairs (as ``genspec train`` reports)
and, at the output positions of ``--outputs`` (the target's own answers: what the engine's first draft
token meets), how often the target's token is the head's top 1 / among its top 2 / 3 (the shipped head's:
0.459 / 0.548 / 0.595, ``benchmarks/heads/head_top_k.py``; a 4-node draft tree's first level holds about the top 2). Only the first draft token
is measured: a second one would need the head's own prediction in place of FIRST and of SECOND.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import nn

import genspec
from genspec.speculators.distilled import local_ids
from genspec.speculators.head import DraftHead, HeadConfig
from genspec.train.data import Sequences
from genspec.train.data import choose_vocabulary
from genspec.train.loop import cut_pieces, pad_batch
from genspec.train.losses import Teacher, feature_loss
from genspec.train.settings import TrainSettings

#: ``hidden_states`` indices kept (outputs of the first 3, 4, 6, 9 and 14 layers), then the final feature,
#: then the output of the first 6 layers with their MLPs left out ("attn6", :func:`attention_only`)
LAYERS = (3, 4, 6, 9, 14)
ATTENTION_ONLY = 6
#: the columns (in units of the hidden size) of each input part in a recorded feature row
PART = {**{layer: n for n, layer in enumerate(LAYERS)}, "final": len(LAYERS), "attn6": len(LAYERS) + 1}
FUSED = (3, 9, 14, "final")


class _NoMLP(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def attention_only(target, layers: int = ATTENTION_ONLY):
    """A copy of the target whose first ``layers`` layers have no MLP (a zero MLP output: Gemma 3 norms it to
    zero, so the residual stream passes on), as an HFCausalLM: its first ``layers`` layers' state is a token's
    context through attention alone, at about 30% of those layers' weights (1.6 M of 5.6 M per layer on the
    embedded model)."""
    import copy

    from genspec.models.hf import HFCausalLM

    model = copy.deepcopy(target.model)
    for layer in model.model.layers[:layers]:
        layer.mlp = _NoMLP()
    return HFCausalLM(model, target.tokenizer)


def record(sequences: str, outputs: str, path: str) -> None:
    target = genspec.load_model(None, backend="torch")
    data = Sequences.load(sequences)
    data.split(0)
    answers = json.load(open(outputs))

    lean = attention_only(target).model
    lean.model.layers = lean.model.layers[:ATTENTION_ONLY]  # only its first layers' output is kept
    kept = {}
    lean.model.layers[-1].register_forward_hook(
        lambda module, args, output: kept.update(state=output[0] if isinstance(output, tuple) else output))

    def features(seq: list[int]) -> torch.Tensor:
        hidden = target.model(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        lean.model(input_ids=torch.tensor([seq[:-1]]))
        return torch.cat([hidden[i][0].float() for i in LAYERS] + [hidden[-1][0].float(), kept["state"][0].float()], -1)

    started = time.perf_counter()
    with torch.no_grad():
        check = data.sequences[0]
        same = torch.allclose(target.model.lm_head(columns(features(check), ["final"])),
                              target.model(input_ids=torch.tensor([check[:-1]])).logits[0], atol=1e-3)
        print("last hidden = LM head input:", same, flush=True)
        full = target.model(input_ids=torch.tensor([check[:-1]]), output_hidden_states=True).hidden_states
        lean_6 = features(check)[:, PART["attn6"] * 640:]
        print("attention-only state differs from layer 6's by", float((lean_6 - full[6][0]).norm() / full[6][0].norm()),
              "(relative)", flush=True)
        train = []
        for n, seq in enumerate(data.sequences):
            train.append((torch.tensor(seq), features(seq)))
            if n % 50 == 0:
                print(n, f"{time.perf_counter() - started:.0f}s", flush=True)
        measured = [(torch.tensor(p + o), features(p + o), len(p)) for p, o in answers]
    vocab_ids = choose_vocabulary([data.sequences[i] for i in data.train], 8192, target.eos_token_ids)
    torch.save({"data": train, "held_out": data.held_out, "train": data.train, "answers": measured,
                "vocab_ids": vocab_ids, "layers": LAYERS}, path)
    print("recorded", sum(len(s) for s in data.sequences), "tokens", f"{time.perf_counter() - started:.0f}s", flush=True)


class InputHead(DraftHead):
    """The shipped head whose pair is (FIRST at i, SECOND at i + 1): FIRST one part or several fused."""

    def __init__(self, config: HeadConfig, first_parts: int):
        super().__init__(config)
        if first_parts > 1:
            self.part_norms = nn.ModuleList(nn.RMSNorm(config.hidden_size, eps=config.eps) for _ in range(first_parts))
            self.fuse = nn.Linear(first_parts * config.hidden_size, config.hidden_size, bias=False)

    def inputs(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        chunks = first.split(self.config.hidden_size, -1)
        if len(chunks) > 1:
            first = self.fuse(torch.cat([norm(c) for norm, c in zip(self.part_norms, chunks)], -1))
        else:
            first = self.feature_norm(first)
        return self.fc(torch.cat([first, self.embedding_norm(second)], dim=-1))


def columns(features: torch.Tensor, parts) -> torch.Tensor:
    hidden = 640
    return torch.cat([features[..., PART[p] * hidden:(PART[p] + 1) * hidden] for p in parts], -1)


def make_loss(first_parts, second):
    def loss_of(head, teacher, tokens, features, mask, settings, generator=None):
        inputs = columns(features[:, :-1], first_parts)
        if settings.noise and generator is not None:
            noisy = []
            for part in inputs.split(640, -1):
                scale = part.pow(2).mean(-1, keepdim=True).sqrt()
                noisy.append(part + settings.noise * scale * (torch.rand(part.shape, generator=generator) * 2 - 1))
            inputs = torch.cat(noisy, -1)
        nxt = teacher.embed(tokens[:, 1:-1]).to(features.dtype) if second == "embedding" else columns(features[:, 1:], [second])
        return feature_loss(head(inputs, nxt), columns(features[:, 1:], ["final"]), teacher, mask, settings)
    return loss_of


@torch.no_grad()
def agreement(head, teacher, vocab, pieces, loss_of, settings) -> float:
    head.eval()
    quiet = TrainSettings(**{**settings.__dict__, "noise": 0.0})
    agree = pairs = 0.0
    for start in range(0, len(pieces), 16):
        tokens, features, mask = pad_batch(pieces, list(range(start, min(start + 16, len(pieces)))))
        a = loss_of(head, teacher, tokens, features, mask, quiet)[3]
        agree += float(a) * int(mask.sum())
        pairs += int(mask.sum())
    head.train()
    return agree / max(1, pairs)


@torch.no_grad()
def answer_agreement(head, teacher, vocab, answers, first_parts, second) -> str:
    """How often the target's next token is the head's top 1 / among its top 2 / top 3, at the answers'
    output positions (teacher-forced; a draft tree's first level holds about the top 2)."""
    head.eval()
    agree, n = torch.zeros(3), 0
    for tokens, features, prompt_length in answers:
        first = columns(features[None, :-1], first_parts)
        nxt = teacher.embed(tokens[None, 1:-1]).to(features.dtype) if second == "embedding" else columns(features[None, 1:], [second])
        predicted = vocab[teacher.logits_of(head(first, nxt)[0]).topk(3).indices]  # [n, 3]
        truth = tokens[2:]
        output = torch.arange(len(truth)) + 2 >= prompt_length
        hits = (predicted == truth[:, None]).cumsum(-1) > 0  # [n, 3]: truth among the top 1, 2, 3
        agree += (hits & output[:, None]).sum(0)
        n += output.sum().item()
    head.train()
    return " / ".join(f"{a / n:.4f}" for a in agree.tolist())


def train(path: str, variant: str, steps: int) -> None:
    saved = torch.load(path, weights_only=False)
    first_name, second_name = variant.split("+")
    first_parts = FUSED if first_name == "fused" else ["final"]
    second = second_name if second_name in ("embedding", "attn6") else int(second_name)
    target = genspec.load_model(None, backend="torch")
    vocab = torch.as_tensor(saved["vocab_ids"])
    teacher = Teacher(target.subset_head(vocab), target.model.get_input_embeddings(),
                      local_ids(saved["vocab_ids"], target.vocab_size))
    settings = TrainSettings(steps=steps)
    torch.manual_seed(0)
    head = InputHead(HeadConfig(hidden_size=640), len(first_parts)).float().train()
    loss_of = make_loss(first_parts, second)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / settings.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    generator = torch.Generator().manual_seed(0)
    pieces = cut_pieces([saved["data"][i] for i in saved["train"]], 256)
    held = cut_pieces([saved["data"][i] for i in saved["held_out"]], 256)
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
                line += (f" HELD-OUT {agreement(head, teacher, vocab, held, loss_of, settings):.4f}"
                         f" ANSWERS top-1/2/3 {answer_agreement(head, teacher, vocab, saved['answers'], first_parts, second)}")
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "train"))
    parser.add_argument("--sequences", help="a genspec train run's sequences.json (record)")
    parser.add_argument("--outputs", help="the measured answers (record), as benchmarks/heads/next_token_layer_state.py writes them")
    parser.add_argument("--features", required=True, help="the recorded features (written by record)")
    parser.add_argument("--variants", default="final+embedding;final+6;fused+6")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    if args.action == "record":
        record(args.sequences, args.outputs, args.features)
    else:
        for variant in args.variants.split(";"):
            train(args.features, variant, args.steps)


if __name__ == "__main__":
    main()
