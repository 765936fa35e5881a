"""Failures agreed across ranks: a checkpoint error on one rank is raised on every rank."""
from rtxmpi import control
from rtxmpi.errors import CheckpointError


def raise_if_any_failed(group, error, what):
    """Collective: raise CheckpointError on every rank of `group` when any rank passed an error.

    error: None, or the exception (or message) this rank hit. The raised message names `what` and
    every failing rank's message (which names the file and dataset). One 1-byte MAX all_reduce
    when nothing failed; one all_gather of MESSAGE_BYTES per rank when something did.
    group None: single process, raise `error` itself (a CheckpointError, else wrapped in one).
    rtxmpi.control.raise_if_any_failed with error_type=CheckpointError.
    """
    control.raise_if_any_failed(group, error, what, error_type=CheckpointError)
