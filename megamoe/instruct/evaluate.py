"""Exact-match evaluation of instruction-tuned models by greedy generation, per task family.

The model is any callable `forward(tokens [B, S], prompt_mask [B, S]) -> logits [B, S, V]`, so a
dense GPT, a sparse-upcycled MoE and a SIMoE model are evaluated the same way. Prompts of equal
token length are generated together; each answer stops at end-of-sentence or after
`max_new_tokens`, and counts as correct when it equals the reference after stripping spaces.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from megamoe.instruct.dataset import Record

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def greedy_answers(forward: Forward, tokenizer, prompts: list[str], max_new_tokens: int,
                   max_length: int) -> list[str]:
    """The greedy continuation of each prompt, decoded, without the end-of-sentence."""
    encoded = [tokenizer.tokenize(p) for p in prompts]
    answers: list[str] = [""] * len(prompts)
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, ids in enumerate(encoded):
        by_length[len(ids)].append(index)
    for length, indices in by_length.items():
        tokens_BS = torch.tensor([encoded[i] for i in indices])
        prompt_mask_BS = torch.ones_like(tokens_BS, dtype=torch.bool)
        done_B = torch.zeros(len(indices), dtype=torch.bool)
        new_tokens = []
        for _ in range(min(max_new_tokens, max_length - length)):
            next_B = forward(tokens_BS, prompt_mask_BS)[:, -1].argmax(dim=-1)
            next_B = torch.where(done_B, torch.full_like(next_B, tokenizer.eod), next_B)
            new_tokens.append(next_B)
            done_B |= next_B == tokenizer.eod
            tokens_BS = torch.cat([tokens_BS, next_B[:, None]], dim=1)
            prompt_mask_BS = torch.cat([prompt_mask_BS, torch.zeros_like(done_B)[:, None]], dim=1)
            if done_B.all():
                break
        generated_BT = torch.stack(new_tokens, dim=1) if new_tokens else tokens_BS[:, :0]
        for row, index in enumerate(indices):
            ids = generated_BT[row].tolist()
            answers[index] = tokenizer.detokenize(ids[:ids.index(tokenizer.eod)]
                                                  if tokenizer.eod in ids else ids)
    return answers


def exact_match(forward: Forward, tokenizer, records: list[Record], max_new_tokens: int = 24,
                max_length: int = 128) -> dict[str, float]:
    """Accuracy per task family (records without a task count as `all` only), and `all`."""
    answers = greedy_answers(forward, tokenizer, [r.prompt for r in records], max_new_tokens,
                             max_length)
    hits: dict[str, list[bool]] = defaultdict(list)
    for record, answer in zip(records, answers):
        correct = answer.strip() == record.response.strip()
        hits["all"].append(correct)
        if record.task:
            hits[record.task].append(correct)
    return {task: sum(values) / len(values) for task, values in sorted(hits.items())}
