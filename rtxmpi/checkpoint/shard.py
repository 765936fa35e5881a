"""`Shard`: the piece of a global 1-D tensor that one rank owns and writes."""
from dataclasses import dataclass

from rtxmpi.comm.arrays import as_array, is_foreign
from rtxmpi.errors import CheckpointError
from rtxmpi.parallel.zero import even_range


@dataclass(frozen=True)
class Shard:
    """Elements [global_offset, global_offset + data.size) of a global 1-D tensor of global_size.

    data: 1-D numpy or cupy array (contiguous or not; cupy is copied to the host when written),
    or any DLPack array (a torch tensor: viewed as numpy/cupy without a copy, rtxmpi.comm.arrays).
    Raises CheckpointError when data is not 1-D or the range falls outside the tensor.
    """

    data: object
    global_offset: int
    global_size: int

    def __post_init__(self):
        if is_foreign(self.data):
            object.__setattr__(self, "data", as_array(self.data, "Shard"))
        shape = getattr(self.data, "shape", None)
        if shape is None or len(shape) != 1:
            raise CheckpointError(f"Shard data must be a 1-D array, got shape {shape}")
        offset, size = int(self.global_offset), int(self.global_size)
        if offset < 0 or offset + shape[0] > size:
            raise CheckpointError(f"Shard [{offset}, {offset + shape[0]}) lies outside a tensor "
                                  f"of {size} elements")
        object.__setattr__(self, "global_offset", offset)
        object.__setattr__(self, "global_size", size)

    @classmethod
    def even(cls, full, rank, world_size):
        """Rank `rank`'s 1/world_size slice of a tensor every rank holds whole (data parallel):
        elements [rank * n // world_size, (rank + 1) * n // world_size) of the 1-D `full`, a view."""
        n = int(full.shape[0])
        start, stop = even_range(n, world_size, rank)
        return cls(full[start:stop], start, n)
