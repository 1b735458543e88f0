"""Would a wider draft vocabulary help the shipped head? Its predicted features (teacher-forced over the greedy
128-token answers to each Spec-Bench category's 3rd and 4th prompt) through other sets of the target's output
rows: the shipped 8,192, the 8,192 with the most summed target probability over 40k positions of the training
prompts (the 6th on, teacher-forced), the shipped set widened with those to 12k / 16k / 32k, and all 262,144.
Prints each set's coverage of the answers' tokens and the head's top-1 agreement there.

    python benchmarks/heads/head_vocabulary_coverage.py   # from the repository's root; log: benchmarks/results/head_studies/vocabulary.txt
"""
import time
import torch
import genspec
from genspec.bench.prompts import load_spec_bench, encode_prompt
from genspec.drafters.trained import load_for_target
from head_answers import teacher_forced

torch.manual_seed(0)
target = genspec.load_model(None, backend="torch")
V = target.vocab_size
head, shipped = load_for_target(target, None, "head"); head = head.float().eval()
t0 = time.time()
# soft counts from the training prompts (6th on, teacher-forced), as training would see them
train_prompts = [encode_prompt(p.text, target.tokenizer)[:1024] for p in load_spec_bench(skip=5)]
soft = torch.zeros(V, dtype=torch.float64)
budget = 40000; used = 0
with torch.no_grad():
    for seq in train_prompts:
        if used >= budget: break
        target.reset(0)
        f = target.add_rows([seq], return_hidden=True)[0]
        target.reset(0)
        for s in range(0, len(f), 256):
            soft += target.head(f[s:s+256]).float().softmax(-1).sum(0).double()
        used += len(seq)
print("soft counts over", used, "positions", round(time.time() - t0), flush=True)
# the head's predicted features over the answers
feats = [(seq, plen, x) for seq, plen, _, x in teacher_forced(target, head)]
shipped_t = torch.tensor(shipped)
def vocab_union(base, extra, size):
    out = list(dict.fromkeys(list(base) + [int(t) for t in extra]))[:size]
    return torch.tensor(out)
soft_order = soft.argsort(descending=True)
cands = {"shipped8k": shipped_t,
         "soft8k": soft_order[:8192],
         "shipped+soft12k": vocab_union(shipped, soft_order, 12288),
         "shipped+soft16k": vocab_union(shipped, soft_order, 16384),
         "shipped+soft32k": vocab_union(shipped, soft_order, 32768),
         "full": torch.arange(V)}
with torch.no_grad():
    for name, vocab in cands.items():
        logits_of = target.subset_head(vocab)
        cover = agree = n = 0
        for seq, plen, x in feats:
            out = torch.tensor(seq[plen:])
            inv = torch.zeros(V, dtype=torch.bool); inv[vocab] = True
            cover += inv[out].sum().item()
            pred = vocab[logits_of(x).argmax(-1)]  # token at i+2
            truth = torch.tensor(seq[2:])
            outpos = torch.arange(len(truth)) + 2 >= plen
            agree += ((pred == truth) & outpos).sum().item(); n += outpos.sum().item()
        print(f"{name:18s} size {len(vocab):6d} coverage {cover/n:.3f} agreement {agree/n:.3f}", flush=True)
