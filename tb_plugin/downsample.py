"""Peak-keeping thinning of aligned time series to a point budget (used by ``/series``).

TensorBoard keeps every step when started with
``--samples_per_plugin=memory_hierarchy=0``; the plugin then reads all stored steps and
thins each answer here, so that a tier's one-step peak never vanishes from a chart.
"""

from __future__ import annotations

import numpy as np


def peak_keeping_indices(values: np.ndarray, budget: int) -> np.ndarray:
    """Choose which steps of a set of aligned series to keep, keeping every peak.

    The steps are cut into equal buckets; in each bucket the first step holding each
    series' minimum and the first holding its maximum are kept, as are the first and the
    last step. If the union is larger than ``budget`` neighbouring buckets are merged in
    pairs (keeping the larger maximum and the smaller minimum of the two) and the union
    taken again, until it fits. So the largest (and smallest) value of every series always
    survives, however far it is thinned; NaN cells are ignored. The steps are scanned once
    (cost O(N x S)); each merge costs O(buckets x S).

    Args:
        values: float array ``[N, S]``: N steps, S series sharing those steps.
        budget: the number of steps to aim for (>= 2). The answer has at most
            ``max(budget, 2 * S + 2)`` steps.

    Returns:
        Sorted int indices into the N steps (all of them when ``N <= budget``).
    """
    n = values.shape[0]
    if n <= budget:
        return np.arange(n)
    measured = values[:, ~np.all(np.isnan(values), axis=0)]  # [N, S'] drop all-NaN series
    highs = np.where(np.isnan(measured), -np.inf, measured)
    lows = np.where(np.isnan(measured), np.inf, measured)
    position = np.arange(n)[:, None]  # [N, 1]
    buckets = max(1, (budget - 2) // 2)
    starts = np.linspace(0, n, buckets + 1).astype(np.int64)[:-1]  # [B] bucket starts
    bucket_of = np.repeat(np.arange(buckets), np.diff(np.append(starts, n)))  # [N]
    picks = []  # per (series, reduce): [B, S'] the step of each bucket's extreme
    for series, reduce in ((highs, np.maximum), (lows, np.minimum)):
        extreme = reduce.reduceat(series, starts, axis=0)  # [B, S'] per-bucket extreme
        at_extreme = np.where(series == extreme[bucket_of], position, n)  # [N, S']
        picks.append((series, np.minimum.reduceat(at_extreme, starts, axis=0)))
    columns = np.arange(measured.shape[1])[None, :]  # [1, S']
    ends = np.array([0, n - 1])
    while True:
        kept = np.unique(np.concatenate([ends] + [pos.ravel() for _s, pos in picks]))
        kept = kept[kept < n]
        if len(kept) <= budget or len(picks[0][1]) == 1:
            return kept
        merged = []
        for (series, pos), better in zip(picks, (np.greater, np.less)):
            pairs = len(pos) // 2
            left, right = pos[0 : 2 * pairs : 2], pos[1 : 2 * pairs : 2]  # [B/2, S']
            take_right = better(series[np.minimum(right, n - 1), columns], series[left, columns])
            take_right &= right < n
            out = np.where(take_right, right, left)
            if len(pos) % 2:
                out = np.vstack([out, pos[-1:]])
            merged.append((series, out))
        picks = merged
