"""Small control exchanges of JSON values over a ProcessGroup (a plan's choice, a profile, host
names): the value travels as UTF-8 JSON in a uint8 buffer after its int64 length, so it gets the
group's deadline, checking mode and trace like any collective (mpi4py's pickled bcast/allgather
have none of them, and unpickling runs code). JSON turns tuples into lists and dict keys into
strings; the callers convert back where they need to.
"""
import json

import numpy as np


def _encode(value):
    """(uint8 buffer, None), or (None, the error) for a value JSON cannot encode."""
    try:
        return np.frombuffer(json.dumps(value).encode(), np.uint8), None
    except (TypeError, ValueError) as exc:
        return None, exc


def _refused(rank, error):
    return TypeError(f"rank {rank}'s value cannot be sent as JSON"
                     + (f": {error}" if error is not None else ""))


def _decode(buf):
    return json.loads(bytes(buf).decode())


def broadcast_json(group, value, src=0):
    """`value` from group rank `src` on every rank (a new object decoded from JSON; `value` is
    read on src only). Two broadcasts: the length (int64), then the bytes (uint8).
    Collective: every rank of `group` must call, in the same order, with the same src.
    Raises TypeError on every rank when src's value cannot be encoded as JSON (its length is
    sent as -1), CollectiveTimeout, CollectiveMismatch (ranks disagree on the call).
    """
    raw, error = _encode(value) if group.rank == src else (None, None)
    length = np.array([-1 if error else 0 if raw is None else len(raw)], np.int64)
    group.broadcast(length, src=src)
    if length[0] < 0:
        raise _refused(src, error)
    buf = raw.copy() if raw is not None else np.zeros(int(length[0]), np.uint8)
    group.broadcast(buf, src=src)
    return _decode(buf)


def all_gather_json(group, value):
    """[value of group rank 0, value of rank 1, ...] on every rank, each decoded from JSON.
    Two all_gathers: the lengths (int64), then the bytes padded to the longest (uint8).
    Collective: every rank of `group` must call, in the same order.
    Raises TypeError on every rank when a rank's value cannot be encoded as JSON (its length is
    gathered as -1), CollectiveTimeout, CollectiveMismatch (ranks disagree on the call).
    """
    raw, error = _encode(value)
    lengths = group.all_gather(np.array([-1 if error else len(raw)], np.int64))
    if (lengths < 0).any():
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise _refused(bad, error if bad == group.rank else None)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(raw)] = raw
    rows = group.all_gather(padded).reshape(group.world_size, -1)
    return [_decode(row[:n]) for row, n in zip(rows, lengths)]
