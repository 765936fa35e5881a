"""The control plane: decisions every rank takes together at step boundaries.

Rule that prevents most hangs: whether a rank enters a collective never depends on its local data.
A branch (skip the step on overflow, stop on request, stop at the end of data) is first agreed with
one small reduction, then every rank takes the same branch.
"""
from types import SimpleNamespace

import numpy as np


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
