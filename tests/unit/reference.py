"""Naive per-token reference implementations the tests compare megamoe against.

Written as plain Python loops over tokens and experts, sharing no code with megamoe.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def naive_topk(scores, k, bias=None, num_groups=None, groups_per_token=None,
               group_score_topk=None):
    """Per token: the indices of the k highest (scores + bias), group-limited if asked (a
    group scored by its best group_score_topk scores, k // groups_per_token if None)."""
    T, E = scores.shape
    chosen = []
    for t in range(T):
        s = [float(scores[t, e]) + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        allowed = list(range(E))
        if num_groups:
            size = E // num_groups
            per_group = group_score_topk or k // groups_per_token
            group_score = [sum(sorted(s[g * size:(g + 1) * size], reverse=True)[:per_group])
                           for g in range(num_groups)]
            best = sorted(range(num_groups), key=lambda g: -group_score[g])[:groups_per_token]
            allowed = [e for e in range(E) if e // size in best]
        chosen.append(sorted(allowed, key=lambda e: -s[e])[:k])
    return chosen


def naive_top_p(probs, p):
    """Per token: experts by decreasing probability until the mass reaches p (crossing one in)."""
    chosen = []
    for row in probs.tolist():
        order = sorted(range(len(row)), key=lambda e: -row[e])
        picked, mass = [], 0.0
        for e in order:
            picked.append(e)
            mass += row[e]
            if mass >= p:
                break
        chosen.append(picked)
    return chosen


def naive_expert(x, fc1, fc2, activation):
    h = fc1 @ x
    if activation == "swiglu":
        half = h.shape[0] // 2
        h = F.silu(h[:half]) * h[half:]
    elif activation == "gelu":
        h = F.gelu(h)
    else:
        h = F.relu(h) ** 2
    return fc2 @ h


def naive_moe(x_TD, chosen, gates, fc1_EFD, fc2_EDF, activation):
    """out[t] = sum over chosen e of gates[t][e] * expert_e(x[t]), one token at a time."""
    rows = []
    for t in range(x_TD.shape[0]):
        out = torch.zeros(fc2_EDF.shape[1], dtype=x_TD.dtype)
        for e in chosen[t]:
            out = out + gates[t][e] * naive_expert(x_TD[t], fc1_EFD[e], fc2_EDF[e], activation)
        rows.append(out)
    return torch.stack(rows)


def naive_capacity_keep(chosen, priority, num_experts, capacity_factor, policy):
    """Per expert, keep the `capacity` assignments with the highest gate (probs) or the earliest
    tokens (position); returns the kept (token, expert) pairs."""
    assignments = sum(len(c) for c in chosen)
    capacity = max(1, math.ceil(capacity_factor * assignments / num_experts))
    kept = set()
    for e in range(num_experts):
        tokens = [t for t, c in enumerate(chosen) if e in c]
        if policy == "probs":
            tokens = sorted(tokens, key=lambda t: -priority[t][e])
        kept.update((t, e) for t in tokens[:capacity])
    return kept
