"""The fingerprint of a collective call with checking off: what its ranks must agree on.

Two int64 per call, (count, code): count is the array's element count (-1: no array); code packs
the op, the dtype and the op's argument: op code << 56 | dtype code << 48 | arg, where arg is
the reduce op's code (all_reduce), the reduce op's code + 16 x crc32(counts) (reduce_scatter),
src (broadcast), crc32 of the ranks (new_group), else 0. Equal fingerprints on every rank mean
the same collective, element count, dtype and reduce op / src / counts. Each transport compares
them where it already synchronizes (docs/comm.md, "Mismatched calls").
"""
import operator
import zlib

import numpy as np
from mpi4py import MPI

from ..backend import SUPPORTED_DTYPES, dtype_name
from ..errors import CollectiveMismatch

OP_CODES = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4,
            "all_to_all": 5, "barrier": 6, "split": 7, "new_group": 8, "send": 9, "recv": 10}
REDUCE_NAMES = ("sum", "avg", "max", "min", "prod")  # the order of mpi.REDUCE_OPS
REDUCE_CODES = {name: i for i, name in enumerate(REDUCE_NAMES, start=1)}
ARG_SHIFT = 16  # reduce_scatter's arg: op code + ARG_SHIFT * crc32(counts) (0: even shards)
NO_DTYPE = 255  # the dtype code of a call without an array
POISON = 1 << 62  # marks a call posted only to fail a peer's on another path (comm/shm.py)
_OP_SHIFT, _DTYPE_SHIFT, _ARG_MASK = 56, 48, (1 << 48) - 1
_NAMES = {code: name for name, code in OP_CODES.items()}
_DTYPE_CODES = {dtype: i for i, dtype in enumerate(SUPPORTED_DTYPES)}


def dtype_code(dtype):
    """The index of `dtype` in SUPPORTED_DTYPES, or a number >= 1000 for another dtype (checking
    mode's fingerprint names it; validation refuses it before any transfer)."""
    dtype = np.dtype(dtype)
    if dtype in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES.index(dtype)
    return 1000 + zlib.crc32(dtype.str.encode()) % 1000000


def dtype_from_code(code):
    return dtype_name(SUPPORTED_DTYPES[code]) if 0 <= code < len(SUPPORTED_DTYPES) else f"<dtype#{code}>"


def counts_crc(counts):
    """crc32 of reduce_scatter's `counts` (0 for None), also for counts that validation will
    refuse."""
    if counts is None:
        return 0
    try:
        values = np.asarray([operator.index(c) for c in counts], np.int64)
    except (TypeError, ValueError, OverflowError):
        return zlib.crc32(repr(counts).encode()) | 1  # never 0
    return zlib.crc32(b"counts" + values.tobytes())


def code(op, dtype=None, arg=0):
    """The code half of a fingerprint: op name, dtype (None: no array), arg (int >= 0)."""
    dcode = NO_DTYPE if dtype is None else _DTYPE_CODES[np.dtype(dtype)]
    return OP_CODES[op] << _OP_SHIFT | dcode << _DTYPE_SHIFT | (int(arg) & _ARG_MASK)


def same_data(a, b):
    """Whether a send's and a recv's fingerprints (count, code) agree on count and dtype."""
    return a[0] == b[0] and (a[1] >> _DTYPE_SHIFT & 0xFF) == (b[1] >> _DTYPE_SHIFT & 0xFF)


def of(op, x=None, arg=0):
    """(count, code) of a call of `op` on the validated array `x` (None: no array)."""
    if x is None:
        return -1, code(op, None, arg)
    return int(x.size), code(op, x.dtype, arg)


def describe_row(count, fcode):
    """One rank's call, as text: 'all_reduce(count=4, dtype=float32, op=sum)'."""
    fcode &= ~POISON
    op = _NAMES.get(fcode >> _OP_SHIFT, "?")
    dcode, arg = (fcode >> _DTYPE_SHIFT) & 0xFF, fcode & _ARG_MASK
    parts = [] if dcode == NO_DTYPE else [f"count={count}", f"dtype={dtype_from_code(dcode)}"]
    if op == "all_reduce":
        parts.append(f"op={REDUCE_NAMES[arg - 1]}")
    elif op == "reduce_scatter":
        parts.append(f"op={REDUCE_NAMES[arg % ARG_SHIFT - 1]}")
        parts.append(f"counts crc32={arg // ARG_SHIFT:#010x}" if arg // ARG_SHIFT else "counts=None")
    elif op == "broadcast":
        parts.append(f"src={arg}")
    return f"{op}({', '.join(parts)})"


def describe(op, seq, group, table, ranks=None):
    """CollectiveMismatch's message from every rank's (count, code) row (table: (world_size, 2)
    int64, by group rank, or one row per group rank in `ranks`); names each rank's call as
    checking mode does."""
    ranks = range(len(table)) if ranks is None else ranks
    rows = "; ".join(f"rank {r}: {describe_row(int(count), int(fcode))}"
                     for r, (count, fcode) in zip(ranks, table))
    return (f"CollectiveMismatch in {op} #{seq} on group '{group}': ranks called it "
            f"differently: {rows}")


def agree(comm, fp, wait, op, seq, group):
    """The arrival check of an MPI transport that compares the fingerprint fp = (count, code):
    one nonblocking MAX all_reduce of (count, code, -count, -code) on `comm`, whose result has
    max == min exactly when every rank passed the same fp (32 bytes at any world size, one
    synchronization like a barrier); only then a mismatch all_gathers the rows to name them
    (every rank sees the same maximum, so all take that branch together).
    wait(requests): completes MPI requests (deadline-aware). Collective on `comm`.
    Raises CollectiveMismatch on every rank when the fingerprints differ, and what `wait` raises.
    """
    mine = np.array([fp[0], fp[1], -fp[0], -fp[1]], np.int64)
    high = np.empty(4, np.int64)
    wait([comm.Iallreduce(mine, high, MPI.MAX)])
    if high[0] != -high[2] or high[1] != -high[3]:
        table = np.empty((comm.Get_size(), 2), np.int64)
        wait([comm.Iallgather(mine[:2].copy(), table)])
        raise CollectiveMismatch(describe(op, seq, group, table))
