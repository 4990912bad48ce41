"""A deterministic, seekable batch loader over packed rows.

The rows are read as one endless stream, epoch after epoch; epoch ``e`` visits every row once, in the
order ``np.random.default_rng([seed, e]).permutation(num_rows)``. Batch ``step`` is the stream's items
``step * batch_size`` to ``(step + 1) * batch_size - 1`` (a batch may span two epochs). The data therefore
depend only on ``(seed, step, batch_size)``: resuming at step ``k`` gives exactly the batches an
uninterrupted run would, with no loader state to checkpoint.

``shard=(process_index, process_count)`` returns this process's contiguous slice of the global batch
(rows ``process_index * batch_size / process_count`` onwards), for multi-host data parallelism.
"""

import numpy as np
from jaxtyping import Int64

from eqmoe.data.packing import PackedRows

_CACHED_EPOCHS = 4


class PackedDataset:
    """Packed rows (a :class:`~eqmoe.data.packing.PackedRows` of ``[num_rows, seq]``) and :meth:`batch_at`."""

    def __init__(self, rows: PackedRows):
        shapes = {name: np.shape(value) for name, value in rows._asdict().items()}
        if len(set(shapes.values())) != 1 or len(rows.tokens.shape) != 2 or rows.tokens.shape[0] == 0:
            raise ValueError(f"PackedDataset: rows must be equal non-empty [rows, seq] arrays, got shapes {shapes}")
        self.rows = rows
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.rows.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.rows.tokens.shape[1]

    def epoch(self, step: int, batch_size: int) -> float:
        """How many epochs the batches before ``step`` cover."""
        return step * batch_size / len(self)

    def _order(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._orders:
            if len(self._orders) >= _CACHED_EPOCHS:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = np.random.default_rng([seed, epoch]).permutation(len(self))
        return self._orders[key]

    def indices_at(self, step: int, batch_size: int, seed: int = 0) -> Int64[np.ndarray, "batch"]:
        """The row indices of global batch ``step``."""
        for name, value, least in (("step", step, 0), ("batch_size", batch_size, 1), ("seed", seed, 0)):
            if value < least:
                raise ValueError(f"{name}={value} is invalid; allowed: an integer >= {least}")
        stream = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(stream, len(self))
        indices = np.empty(batch_size, np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            indices[chosen] = self._order(seed, int(epoch))[offsets[chosen]]
        return indices

    def batch_at(self, step: int, batch_size: int, seed: int = 0, shard: tuple[int, int] | None = None) -> PackedRows:
        """Batch ``step`` of the stream for ``seed``: ``[batch_size, seq]``, or with
        ``shard=(process_index, process_count)`` this process's ``[batch_size / process_count, seq]`` slice."""
        indices = self.indices_at(step, batch_size, seed)
        if shard is not None:
            index, count = shard
            if count < 1 or not 0 <= index < count:
                raise ValueError(
                    f"shard={shard!r} is invalid; allowed: (process_index, process_count), 0 <= index < count"
                )
            if batch_size % count:
                raise ValueError(f"batch_size={batch_size} is invalid; allowed: a multiple of process_count={count}")
            local = batch_size // count
            indices = indices[index * local : (index + 1) * local]
        return PackedRows(*(np.asarray(array)[indices] for array in self.rows))
