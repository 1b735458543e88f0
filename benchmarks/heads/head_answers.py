"""The shipped head teacher-forced over measured answers: the one pass the head diagnostics share
(``head_top_k.py``, ``head_vocabulary_coverage.py``, ``head_confidence.py``; run them from the repository's root).

The answers are the greedy 128-token answers to each Spec-Bench category's 3rd and 4th prompt (which no run
measures or trains on), written once by ``benchmarks/heads/next_token_layer_state.py``."""
import json

import torch

ANSWERS = "benchmarks/results/head_studies/answers.json"


@torch.no_grad()
def teacher_forced(target, head, path: str = ANSWERS):
    """Per answer ``(sequence, prompt length, features, predicted)``: the target's features f_0..f_{n-2} of
    ``sequence = prompt + answer`` ``[n - 1, H]`` and the head's prediction of f_{i+1} from the pair
    (f_i, embedding of token i + 1), ``[n - 2, H]`` (row i drafts token i + 2), both float32."""
    embed = target.model.get_input_embeddings()
    for prompt, answer in json.load(open(path)):
        sequence = prompt + answer
        target.reset(0)
        features = target.add_rows([sequence[:-1]], return_hidden=True)[0].float()
        target.reset(0)
        predicted = head(features[None, :-1], embed(torch.tensor(sequence[1:-1]))[None].float())[0]
        yield sequence, len(prompt), features, predicted
