"""Failures agreed across ranks: a checkpoint error on one rank is raised on every rank."""
import numpy as np

from rtxmpi.control import agree
from rtxmpi.errors import CheckpointError

MESSAGE_BYTES = 1024


def raise_if_any_failed(group, error, what):
    """Collective: raise CheckpointError on every rank of `group` when any rank passed an error.

    error: None, or the exception (or message) this rank hit. The raised message names `what`
    and every failing rank's message (which names the file and dataset). One 1-byte MAX
    all_reduce when nothing failed; one all_gather of MESSAGE_BYTES per rank when something did.
    group None: single process, raise `error` itself.
    """
    if group is None:
        if error is not None:
            raise error if isinstance(error, CheckpointError) else CheckpointError(
                f"{what}: {error}")
        return
    if not agree(group, failed=error is not None).failed:
        return
    text = "" if error is None else (str(error) if isinstance(error, CheckpointError)
                                     else f"{type(error).__name__}: {error}")
    buf = np.zeros(MESSAGE_BYTES, np.uint8)
    raw = text.encode()[:MESSAGE_BYTES]
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    table = group.all_gather(buf).reshape(group.world_size, MESSAGE_BYTES)
    parts = [f"rank {r}: " + bytes(row).rstrip(b"\0").decode(errors="replace")
             for r, row in enumerate(table) if row.any()]
    raise CheckpointError(f"{what} failed on {len(parts)} rank(s): " + "; ".join(parts))
