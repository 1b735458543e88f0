"""Would the draft head gain from the target's own first L layers over the token just chosen?

    python benchmarks/heads/next_token_layer_state.py --layers 0,3,6 --steps 400 \
        --outputs benchmarks/results/head_studies/answers.json

The shipped head (:class:`genspec.speculators.head.DraftHead`) reads the pair (target feature at i, the
*embedding* of token i + 1). Here the second part is the target's layer-L state of token i + 1
(``hidden_states[L]``: the output of its first L layers, which have attended over the whole context; L = 0
is the embedding, the shipped input). One head per L, same shape, loss, noise, seed and 400 steps
(:class:`genspec.train.settings.TrainSettings` defaults but the steps), the shipped head's 8,192-token
vocabulary. Training text: the Spec-Bench prompts from the 6th of each category on (what ``genspec train``
teacher-forces), cut to 1,024 tokens; no continuations, so every variant stays below the shipped head.
Measured: top-1 agreement with the target's next token at the output positions of ``--outputs`` (each
category's 3rd and 4th prompt with the target's greedy 128-token answer: prompts ``genspec bench`` does
not measure and no training saw; written by the first run), every 200 steps. Only the first draft
token is measured.
"""
import argparse
import json
import math
import os
import time

import torch
from torch import nn

import genspec
from genspec.bench.prompts import encode_prompt, load_spec_bench
from genspec.drafters.trained import load_for_target
from genspec.engine import SpeculativeEngine
from genspec.speculators.distilled import local_ids
from genspec.speculators.head import DraftHead, HeadConfig
from genspec.train.loop import cut_pieces, pad_batch
from genspec.train.losses import Teacher, feature_loss
from genspec.train.settings import TrainSettings

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--layers", default="0,3,6")
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--outputs", required=True, help="the measured prompts and answers (made if missing)")
args = parser.parse_args()
LAYERS = [int(x) for x in args.layers.split(",")]
STEPS = args.steps
torch.manual_seed(0)
target = genspec.load_model(None, backend="torch")
_, vocab_ids = load_for_target(target, None, "head")
vocab = torch.tensor(vocab_ids)
teacher = Teacher(target.subset_head(vocab), target.model.get_input_embeddings(), local_ids(vocab_ids, target.vocab_size))
H = 640
t0 = time.time()
def rec(seqs):
    out = []
    with torch.no_grad():
        for seq in seqs:
            hs = target.model(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
            out.append((torch.tensor(seq), torch.cat([hs[-1][0].float()] + [hs[L][0].float() for L in LAYERS], -1)))
    return out
train_seqs = [encode_prompt(p.text, target.tokenizer)[:1024] for p in load_spec_bench(skip=5)]
if not os.path.exists(args.outputs):  # the measured answers: greedy, 128 tokens, one prompt at a time
    engine = SpeculativeEngine(target, max_batch_size=1)
    made = []
    for p in load_spec_bench(skip=2, per_category=2):
        ids = encode_prompt(p.text, target.tokenizer)
        made.append([ids, engine.generate_ids([ids], max_new_tokens=128, temperature=0.0)[0].token_ids])
    os.makedirs(os.path.dirname(args.outputs) or ".", exist_ok=True)
    json.dump(made, open(args.outputs, "w"))
diag = json.load(open(args.outputs))
train = rec([s for s in train_seqs if len(s) >= 3]); evald = rec([p + o for p, o in diag])
print("recorded", sum(len(t) for t, _ in train), "train tokens", round(time.time() - t0), flush=True)

def loss_of(head, li, tokens, feats, mask, settings, gen=None):
    f = feats[..., :H]; s = feats[..., H * (1 + li):H * (2 + li)]
    inputs = f[:, :-1]
    if gen is not None:
        scale = inputs.pow(2).mean(-1, keepdim=True).sqrt()
        inputs = inputs + settings.noise * scale * (torch.rand(inputs.shape, generator=gen) * 2 - 1)
    return feature_loss(head(inputs, s[:, 1:]), f[:, 1:], teacher, mask, settings)

@torch.no_grad()
def engine_like(head, li):
    agree = n = 0
    head.eval()
    for (tokens, feats), (p, o) in zip(evald, diag):
        f = feats[:, :H]; s = feats[:, H * (1 + li):H * (2 + li)]
        pred = vocab[teacher.logits_of(head(f[None, :-1], s[None, 1:])[0]).argmax(-1)]
        truth = tokens[2:]
        outpos = torch.arange(len(truth)) + 2 >= len(p)
        agree += ((pred == truth) & outpos).sum().item(); n += outpos.sum().item()
    head.train()
    return agree / n

settings = TrainSettings(steps=STEPS)
pieces = cut_pieces(train, 256)
for li, L in enumerate(LAYERS):
    torch.manual_seed(0)
    head = DraftHead(HeadConfig(hidden_size=H)).float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / settings.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, STEPS) / STEPS)))
    gen = torch.Generator().manual_seed(0)
    started = time.time()
    for step in range(1, STEPS + 1):
        tokens, feats, mask = pad_batch(pieces, torch.randint(len(pieces), (8,), generator=gen).tolist())
        loss, _, _, agree = loss_of(head, li, tokens, feats, mask, settings, gen)
        opt.zero_grad(); loss.backward(); nn.utils.clip_grad_norm_(head.parameters(), 1.0); opt.step(); sched.step()
        if step % 100 == 0:
            line = f"L={L} step {step} loss {loss.item():.3f} train-agree {agree.item():.3f} {time.time() - started:.0f}s"
            if step % 200 == 0:
                line += f" UNMEASURED-OUTPUT agreement {engine_like(head, li):.4f}"
            print(line, flush=True)
