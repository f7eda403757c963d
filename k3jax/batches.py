"""Token windows for training and evaluation, from a byte corpus (one byte = one token id).

Training draws windows of ``length + 1`` bytes (inputs and their next-byte targets) in an order that is a
pure function of (seed, position): epoch ``e`` cuts the training bytes into ``windows_per_epoch`` windows
at an offset and in a permutation both drawn from ``numpy.random.default_rng((seed, e))``, and position
``p`` (sequences consumed so far) is window ``p % windows_per_epoch`` of epoch ``p // windows_per_epoch``.
So a run resumed at a position sees exactly the windows it would have seen, on any machine.

Evaluation reads the held-out bytes once, in order: consecutive windows that overlap by one byte, so
every byte after the first is a target exactly once; the last window is right-padded and its padding
masked out of the loss.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


class TrainWindows:
    """Training windows [count, length + 1] of int32 byte ids, addressed by position."""

    def __init__(self, data: bytes, length: int, seed: int):
        if len(data) < 2 * (length + 1):
            raise ValueError(f"training data: {len(data)} bytes, too few for windows of {length + 1} "
                             f"(need at least {2 * (length + 1)})")
        self.data = np.frombuffer(data, np.uint8)
        self.length, self.seed = length, seed
        self.windows_per_epoch = (len(self.data) - 1 - length) // length
        self._epoch, self._starts = -1, np.zeros(0, np.int64)

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng((self.seed, epoch))
            offset = int(rng.integers(self.length))
            starts = offset + self.length * np.arange(self.windows_per_epoch, dtype=np.int64)
            self._epoch, self._starts = epoch, starts[rng.permutation(self.windows_per_epoch)]
        return self._starts

    def at(self, position: int, count: int) -> np.ndarray:
        """Windows ``position .. position + count - 1`` as int32 [count, length + 1]."""
        rows = []
        for p in range(position, position + count):
            start = self._epoch_starts(p // self.windows_per_epoch)[p % self.windows_per_epoch]
            rows.append(self.data[start:start + self.length + 1])
        return np.stack(rows).astype(np.int32)


def eval_windows(data: bytes, length: int, batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches (tokens int32 [batch, length + 1], mask float32 [batch, length]) covering every byte of
    ``data`` after the first exactly once as a target; padding rows and positions have mask 0."""
    ids = np.frombuffer(data, np.uint8).astype(np.int32)
    starts = np.arange(0, max(len(ids) - 1, 1), length)
    for first in range(0, len(starts), batch):
        tokens = np.zeros((batch, length + 1), np.int32)
        mask = np.zeros((batch, length), np.float32)
        for row, start in enumerate(starts[first:first + batch]):
            window = ids[start:start + length + 1]
            tokens[row, :len(window)] = window
            mask[row, :len(window) - 1] = 1.0
        yield tokens, mask


__all__ = ["TrainWindows", "eval_windows"]
