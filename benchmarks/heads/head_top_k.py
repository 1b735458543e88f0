"""How often is the target's next token among the shipped head's k most likely first draft tokens?

    python benchmarks/heads/head_top_k.py --outputs benchmarks/results/head_studies/answers.json

Teacher-forced over the greedy 128-token answers to each Spec-Bench category's 3rd and 4th prompt (which
no run measures or trains on; the file ``benchmarks/heads/next_token_layer_state.py`` writes), at the answers'
positions: the share where the target's token is the head's top 1, among its top 2, 3, 4. A tree of k
sibling first tokens (``-O tree_nodes=k -O tree_top_k=k``, depth 1) keeps one more token exactly that often.
"""
import argparse

import torch

import genspec
from genspec.drafters.trained import load_for_target
from head_answers import ANSWERS, teacher_forced

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--outputs", default=ANSWERS)
args = parser.parse_args()
target = genspec.load_model(None, backend="torch")
head, vocab_ids = load_for_target(target, None, "head")
head = head.float().eval()
vocab = torch.tensor(vocab_ids)
logits_of = target.subset_head(vocab)
hits, positions = torch.zeros(4), 0
with torch.no_grad():
    for seq, prompt_length, _, predicted in teacher_forced(target, head, args.outputs):
        top = vocab[logits_of(predicted).topk(4, dim=-1).indices]  # [n, 4]: token i + 2's candidates
        truth = torch.tensor(seq[2:])
        answer_positions = torch.arange(len(truth)) + 2 >= prompt_length
        found = (top == truth[:, None]).cumsum(-1).clamp(max=1)[answer_positions]
        hits += found.sum(0).float()
        positions += int(answer_positions.sum())
print(f"{positions} answer positions; target's token in the head's top 1 / 2 / 3 / 4: "
      + " / ".join(f"{h / positions:.3f}" for h in hits))
