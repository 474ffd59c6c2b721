"""Owners of whole parameters for distributed Muon (`megamoe.optim.sharding`): the
longest-processing-time rule by hand, and its load within Graham's bound of the best
assignment found by trying every one."""
from __future__ import annotations

import itertools
import random

import pytest

from megamoe.optim.sharding import balanced_owners


def test_largest_first_to_the_least_loaded_rank():
    # 5 -> rank 0; 4 -> 1; 3 -> 1 (4 < 5); 3 -> 0 (5 < 7); 3 -> 1 (7 < 8); ties: lowest rank.
    assert balanced_owners([5, 4, 3, 3, 3], 2) == [0, 1, 1, 0, 1]
    assert balanced_owners([2, 2, 2], 3) == [0, 1, 2]
    assert balanced_owners([7, 1], 1) == [0, 0]
    assert balanced_owners([], 4) == []


def _max_load(sizes, owners, ranks):
    return max(sum(s for s, o in zip(sizes, owners) if o == r) for r in range(ranks))


@pytest.mark.parametrize("ranks", [2, 3])
def test_load_within_grahams_bound_of_the_best(ranks):
    rng = random.Random(ranks)
    for _ in range(40):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 7))]
        best = min(_max_load(sizes, owners, ranks)
                   for owners in itertools.product(range(ranks), repeat=len(sizes)))
        got = _max_load(sizes, balanced_owners(sizes, ranks), ranks)
        assert got <= (4 / 3 - 1 / (3 * ranks)) * best + 1e-9, (sizes, got, best)


def test_no_ranks_is_refused():
    with pytest.raises(ValueError, match="ranks=0"):
        balanced_owners([1], 0)
