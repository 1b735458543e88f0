"""Is the shipped head's confidence worth acting on? Two questions, teacher-forced over the measured answers
(``head_answers.py``):

1. Calibration (greedy): the head's probability of its top first draft token, in buckets, against how often
   that token is the target's. A calibrated head could draft longer where it is sure and not at all where it
   is not (EAGLE-2's and Hugging Face's confidence threshold); whether that pays depends on verify costs.
2. Sampling (temperature 0.7, top-p 0.9): the first draft token's acceptance, sum_v min(target, draft), when
   the head's logits are scaled by s before the same processing as the target's (a calibration of the head,
   not of the processing; any draft law the verifier is given keeps the standard rule exact), and for a point
   mass on the head's top token.

    python benchmarks/heads/head_confidence.py --out benchmarks/results/head_studies/confidence.txt
"""
import argparse

import torch

import genspec
from genspec.drafters.trained import load_for_target
from genspec.sampling import SamplingConfig, process_logits
from head_answers import ANSWERS, teacher_forced

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--outputs", default=ANSWERS)
parser.add_argument("--scales", default="0.7,0.85,1.0,1.15,1.3,1.5,2.0")
parser.add_argument("--out", default=None)
args = parser.parse_args()
scales = [float(s) for s in args.scales.split(",")]
target = genspec.load_model(None, backend="torch")
head, vocab_ids = load_for_target(target, None, "head")
head = head.float().eval()
vocab = torch.tensor(vocab_ids)
logits_of = target.subset_head(vocab)
sampling = SamplingConfig(temperature=0.7, top_p=0.9)
confidence, agree = [], []
kept, point_mass, positions = torch.zeros(len(scales), dtype=torch.float64), 0.0, 0
with torch.no_grad():
    for seq, prompt_length, features, predicted in teacher_forced(target, head, args.outputs):
        start = max(prompt_length - 2, 0)  # rows drafting an answer token (row i drafts token i + 2)
        predicted, true = predicted[start:], features[1:][start:]
        draft_logits = logits_of(predicted).float()
        top = draft_logits.softmax(-1).max(-1)
        confidence.append(top.values)
        agree.append(vocab[top.indices] == torch.tensor(seq[start + 2:]))
        target_law = process_logits(target.head(true), sampling)
        for j, scale in enumerate(scales):
            full = draft_logits.new_full((len(draft_logits), target.vocab_size), -torch.inf)
            full[:, vocab] = draft_logits * scale
            kept[j] += torch.minimum(target_law, process_logits(full, sampling)).sum().double()
        point_mass += float(target_law.gather(1, vocab[top.indices][:, None]).sum())
        positions += len(true)
confidence, agree = torch.cat(confidence), torch.cat(agree).float()
lines = [f"{positions} answer positions (26 answers); shipped head, teacher-forced",
         "greedy: head's top-token probability -> share of positions, top token = target's"]
edges = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]
for low, high in zip(edges, edges[1:]):
    inside = (confidence >= low) & (confidence < high)
    lines.append(f"  [{low:.1f}, {min(high, 1.0):.1f}{']' if high > 1 else ')'}: share {inside.float().mean():.3f}, "
                 f"agreement {agree[inside].mean():.3f}")
lines.append(f"  all: agreement {agree.mean():.3f}")
lines.append("temperature 0.7, top-p 0.9: first draft token kept, sum min(target, draft), by scale of the head's logits")
lines += [f"  scale {s}: {k / positions:.4f}" for s, k in zip(scales, kept)]
lines.append(f"  point mass on the head's top token: {point_mass / positions:.4f}")
text = "\n".join(lines)
print(text)
if args.out:
    with open(args.out, "w") as f:
        f.write("# python benchmarks/heads/head_confidence.py --out " + args.out + "; 2-core AMD EPYC VM, torch 2.13.0, "
                "shipped head, " + __import__("datetime").date.today().isoformat() + "\n" + text + "\n")
