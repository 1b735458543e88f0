"""Where the shipped head misses: its top-1 agreement with the target on the greedy answers to prompts no run
measures or trains on (each Spec-Bench category's 3rd and 4th, 128 tokens), teacher-forced with its attention
over all earlier pairs or only the last 256 / 64 / 16, the share of the answer's tokens inside its
vocabulary, and the first-token acceptance the engine measures on the same prompts (one draft token a step).

    python benchmarks/heads/head_misses.py   # from the repository's root; writes head_misses.json in the working directory; log: benchmarks/results/head_studies/misses.txt
"""
import time, json
import torch
import genspec
from genspec.drafters.registry import DRAFTERS
from genspec.bench.prompts import load_spec_bench, encode_prompt
from genspec.drafters.trained import load_for_target
from genspec.train.data import held_out_acceptance

torch.manual_seed(0)
target = genspec.load_model(None, backend="torch")
prompts = load_spec_bench(skip=2, per_category=2)
ids = [encode_prompt(p.text, target.tokenizer) for p in prompts]
cats = [p.category for p in prompts]
head, vocab_ids = load_for_target(target, None, "head")
head = head.float().eval()
vocab = torch.tensor(vocab_ids)
inv = torch.full((target.vocab_size,), -1, dtype=torch.long); inv[vocab] = torch.arange(len(vocab))
logits_of = target.subset_head(vocab)
embed = target.model.get_input_embeddings()
# the answers benchmarks/heads/next_token_layer_state.py measures: greedy, 128 tokens, one prompt at a time (the
# logged run generated its own the same way)
answers = json.load(open("benchmarks/results/head_studies/answers.json"))
assert [a[0] for a in answers] == ids, "outputs.json holds other prompts"
t0 = time.time()
rows = []
for (p, out), cat in zip(answers, cats):
    seq = p + out
    target.reset(0)
    with torch.no_grad():
        feats = target.add_rows([seq[:-1]], return_hidden=True)[0].float()  # f_0..f_{n-2}
        target.reset(0)
        n = len(seq)
        x = head.inputs(feats[None, :-1], embed(torch.tensor(seq[1:-1]))[None].float())  # pairs 0..n-3
        m = x.shape[1]
        pos = torch.arange(m)[None]
        res = {}
        for W in (None, 256, 64, 16):
            i = torch.arange(m)
            mask = (i[None, :] <= i[:, None])
            if W: mask &= (i[:, None] - i[None, :] < W)
            pred = head.run(x, pos, lambda _, q, k, v: head.attend(q, k, v, mask[None, None]))[0]
            tok = vocab[logits_of(pred[0]).argmax(-1)]  # predicted token at i+2
            truth = torch.tensor(seq[2:])
            outpos = torch.arange(m) + 2 >= len(p)
            res[str(W)] = ((tok == truth) & outpos).sum().item() / outpos.sum().item()
        cover = (inv[torch.tensor(out)] >= 0).float().mean().item()
    rows.append({"cat": cat, "prompt": len(p), "agree": res, "cover": cover})
    print(cat, len(p), res, round(cover, 3), round(time.time() - t0), flush=True)
drafter = DRAFTERS["head"].for_target(target)
acc = []
for p, cat in zip(ids, cats):
    a = held_out_acceptance(target, drafter, [p], max_new_tokens=128, num_draft_tokens=1)
    acc.append(a["first_token_acceptance"])
    print("engine", cat, round(a["first_token_acceptance"], 3), flush=True)
for r, a in zip(rows, acc):
    r["engine"] = a
json.dump(rows, open("head_misses.json", "w"), indent=1)
import statistics as st
print("mean agree", {W: st.mean(r["agree"][W] for r in rows) for W in rows[0]["agree"]}, "engine", st.mean(acc), "cover", st.mean(r["cover"] for r in rows))
