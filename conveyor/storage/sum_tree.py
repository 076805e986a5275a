"""A vectorized sum-tree for prioritized replay (Schaul et al. 2015, appendix B.2.1).

Leaves hold non-negative priorities; every inner node holds the sum of its two
children, so the root is the total and a prefix-sum search finds the leaf
whose cumulative range contains a number in O(log n). Both operations here
work on whole batches with numpy: an update rewrites the touched leaves and
then recomputes one tree level at a time (log n vectorized steps, not one
Python step per item), and sampling walks all queries down the tree together.

Inner nodes are always recomputed from their children (never incremented), so
sums do not drift over millions of updates.
"""

from __future__ import annotations

import numpy as np


class SumTree:
    """``capacity`` leaves, all priorities 0 at start; float64 throughout."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"SumTree capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.depth = max(1, int(np.ceil(np.log2(capacity))))
        self.first_leaf = 1 << self.depth
        # Node 1 is the root; node i has children 2i and 2i + 1; leaf j is node first_leaf + j.
        self.nodes = np.zeros(2 * self.first_leaf, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.nodes[1])

    @property
    def nbytes(self) -> int:
        return int(self.nodes.nbytes)

    def __getitem__(self, indices: np.ndarray) -> np.ndarray:
        """The priorities of leaves ``indices``."""
        return self.nodes[self.first_leaf + np.asarray(indices, dtype=np.int64)]

    def update(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Set leaves ``indices [N]`` to ``priorities [N]`` (>= 0, finite); a repeated index keeps its last value."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        priorities = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if indices.shape != priorities.shape:
            raise ValueError(f"SumTree.update: {len(indices)} indices but {len(priorities)} priorities")
        if len(indices) == 0:
            return
        if indices.min() < 0 or indices.max() >= self.capacity:
            raise IndexError(f"SumTree.update: indices must lie in [0, {self.capacity}), "
                             f"got [{indices.min()}, {indices.max()}]")
        if not np.all(np.isfinite(priorities)) or priorities.min() < 0:
            raise ValueError("SumTree.update: priorities must be finite and >= 0")
        nodes = self.first_leaf + indices
        self.nodes[nodes] = priorities  # numpy fancy assignment: the last of repeated indices wins
        for _ in range(self.depth):
            nodes = np.unique(nodes >> 1)
            self.nodes[nodes] = self.nodes[2 * nodes] + self.nodes[2 * nodes + 1]

    def find(self, values: np.ndarray) -> np.ndarray:
        """The leaf whose cumulative range holds each of ``values [N]`` (each in [0, total)).

        A zero-priority leaf is never returned while the total is positive: the
        walk only turns right into a subtree with a positive sum, which guards
        against rounding that would otherwise step past the last positive leaf.
        """
        values = np.array(values, dtype=np.float64).reshape(-1)
        nodes = np.ones(len(values), dtype=np.int64)
        for _ in range(self.depth):
            left = self.nodes[2 * nodes]
            right_positive = self.nodes[2 * nodes + 1] > 0
            go_right = (values >= left) & right_positive
            values -= np.where(go_right, left, 0.0)
            nodes = 2 * nodes + go_right
        return nodes - self.first_leaf

    def sample(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """``batch_size`` leaves drawn with probability proportional to priority, stratified:
        the total is cut into ``batch_size`` equal segments and one uniform point is drawn in each
        (lower variance than independent draws; same marginal probabilities)."""
        total = self.total
        if not total > 0:
            raise ValueError("SumTree.sample: all priorities are 0; insert items before sampling")
        points = (np.arange(batch_size) + rng.random(batch_size)) * (total / batch_size)
        return self.find(np.minimum(points, np.nextafter(total, 0.0)))
