"""The control plane: decisions every rank takes together at step boundaries.

Rule that prevents most hangs: whether a rank enters a collective never depends on its local data.
A branch (skip the step on overflow, stop on request, stop at the end of data) is first agreed with
one small reduction, then every rank takes the same branch.
"""
from types import SimpleNamespace

import numpy as np

from .errors import ConfigError

MESSAGE_BYTES = 1024  # per failing rank: 8 bytes of world rank + 1, then the UTF-8 message


def agree(group, **flags):
    """Agree on boolean flags across `group`: each result is True when ANY rank passed True.

    flags: name=bool pairs, the same names in the same order on every rank (e.g.
    `agree(g, overflow=found_inf, stop=stop_requested, out_of_data=not has_batch)`).
    Returns a SimpleNamespace with the same names and the agreed bools. One MAX all_reduce of
    len(flags) bytes. Collective: every rank of `group` must call, in the same order.
    Raises CollectiveTimeout, CollectiveMismatch (checking mode: different flag counts).
    """
    values = np.fromiter((bool(v) for v in flags.values()), dtype=np.uint8, count=len(flags))
    group.all_reduce(values, op="max")
    return SimpleNamespace(**{name: bool(v) for name, v in zip(flags, values)})


def raise_if_any_failed(groups, error, what, error_type=ConfigError):
    """Collective: raise `error_type` on every rank of `groups` when any rank passed an error.

    groups: a ProcessGroup, or a sequence of them applied in turn so that the flag reaches every
    rank of their union (e.g. [pp_group, dp_group] for a pp x dp grid: OR over each pipeline,
    then over each stage's replicas); None entries and size-1 groups are skipped (unless all are
    of size 1: then the first one, so the message still names the rank). Every rank of
    the union must call with the same sequence. error: None, or the exception (or message) this
    rank hit, e.g. a local check of its own batch.
    Raises error_type on every rank when any rank passed an error, its message naming `what` and
    every failing rank (world rank) with that rank's message (an error_type's own text, else
    "TypeName: text"); with no group at all (None) raises `error` itself when it is an
    error_type, else error_type(f"{what}: {error}"). Also CollectiveTimeout, CollectiveMismatch.
    Cost: one 1-byte MAX all_reduce per group when nothing failed; when something did, one
    all_gather per group of MESSAGE_BYTES per rank gathered so far.
    """
    if groups is None or not isinstance(groups, (list, tuple)):
        groups = [groups]
    kept = [g for g in groups if g is not None]
    groups = [g for g in kept if g.world_size > 1] or kept[:1]  # one process: still "rank 0: ..."
    if not groups:
        if error is not None:
            raise error if isinstance(error, error_type) else error_type(f"{what}: {error}")
        return
    failed = error is not None
    for g in groups:  # OR over each group in turn: over the union once every group is done
        failed = agree(g, failed=failed).failed
    if not failed:
        return
    row = np.zeros(MESSAGE_BYTES, np.uint8)  # every rank takes this branch alike
    if error is not None:
        text = str(error) if isinstance(error, error_type) else f"{type(error).__name__}: {error}"
        raw = text.encode()[:MESSAGE_BYTES - 8]
        row[:8] = np.frombuffer(np.int64(groups[0].members[groups[0].rank] + 1).tobytes(), np.uint8)
        row[8:8 + len(raw)] = np.frombuffer(raw, np.uint8)
    table = row
    for g in groups:
        table = g.all_gather(table.reshape(-1))
    failures = {}
    for row in table.reshape(-1, MESSAGE_BYTES):
        rank = int(row[:8].view(np.int64)[0]) - 1
        if rank >= 0:
            failures[rank] = bytes(row[8:]).rstrip(b"\0").decode(errors="replace")
    parts = [f"rank {r}: {failures[r]}" for r in sorted(failures)]
    raise error_type(f"{what} failed on {len(parts)} rank(s): " + "; ".join(parts))


def agree_max(group, value):
    """The largest of the ints `value` passed by the ranks of `group` (collective)."""
    buf = np.array([int(value)], np.int64)
    group.all_reduce(buf, op="max")
    return int(buf[0])


def join_batches(group, batches):
    """Iterate `batches` while EVERY rank of `group` still has one; all ranks stop together.

    Each iteration agrees (one 1-byte MAX all_reduce) on whether any rank ran out, so a rank with
    fewer batches never leaves the others waiting in a collective. Collective: every rank of the
    group iterates it in step with the others.
    """
    iterator = iter(batches)
    while True:
        batch = next(iterator, None)
        if agree(group, out_of_data=batch is None).out_of_data:
            return
        yield batch
