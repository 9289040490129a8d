"""Is a difference between two sets of repeats more than noise? The Mann-Whitney U test, as
benchstat uses it: it assumes no distribution (latencies and rates are skewed, and a repeat on a
noisy machine can be an outlier), only that the repeats of each side are independent.

The p-value is exact: the share of all ways to split the pooled repeats into two groups of the
same sizes whose rank sum lies at least as far from its mean as the observed one. Ties take the
mean of their ranks (doubled, to stay whole numbers) and the exact distribution is computed over
those ranks, so ties need no normal approximation. Counting splits by rank sum is a small
dynamic programme (sizes up to ``EXACT_MAX`` pooled repeats; beyond, the normal approximation
with the tie correction). Written out here because the one function would otherwise bring in
scipy (tens of MB) for a report that keeps its dependencies light.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Pooled sample sizes up to this are tested exactly.
EXACT_MAX = 60


def _doubled_midranks(values: Sequence[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + 1) + (j + 1)  # twice the mean of ranks i+1 .. j+1
        i = j + 1
    return ranks


def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test of ``a`` against ``b`` (1.0 if either is empty)."""
    n1, n2 = len(a), len(b)
    if not n1 or not n2:
        return 1.0
    ranks = _doubled_midranks([*a, *b])
    n = n1 + n2
    observed = sum(ranks[:n1])
    mean = n1 * (n + 1)  # doubled mean of the rank sum of n1 values
    distance = abs(observed - mean)
    if distance == 0:
        return 1.0
    if n > EXACT_MAX:
        return _normal_p(ranks, n1, n2, distance / 2)
    # ways[k]: {doubled rank sum: number of k-subsets of the ranks seen so far with that sum}
    ways: list[dict[int, int]] = [{0: 1}] + [{} for _ in range(n1)]
    for seen, r in enumerate(ranks, start=1):
        for k in range(min(n1, seen), 0, -1):
            into = ways[k]
            for total, count in ways[k - 1].items():
                into[total + r] = into.get(total + r, 0) + count
    extreme = sum(count for total, count in ways[n1].items() if abs(total - mean) >= distance)
    return min(1.0, extreme / math.comb(n, n1))


def _normal_p(doubled: list[int], n1: int, n2: int, distance: float) -> float:
    n = n1 + n2
    ties: dict[int, int] = {}
    for r in doubled:
        ties[r] = ties.get(r, 0) + 1
    correction = sum(t**3 - t for t in ties.values()) / (n * (n - 1))
    variance = n1 * n2 / 12 * ((n + 1) - correction)
    if variance <= 0:
        return 1.0
    z = (distance - 0.5) / math.sqrt(variance)  # continuity correction
    return min(1.0, math.erfc(max(0.0, z) / math.sqrt(2)))


def smallest_p(n1: int, n2: int) -> float:
    """The smallest p-value ``n1`` against ``n2`` repeats can give (every value of one side
    beyond every value of the other): if it is not below alpha, no difference can be told."""
    return mann_whitney_p(list(range(n1)), list(range(n1, n1 + n2)))
