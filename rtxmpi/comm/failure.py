"""Process failures reported by ULFM (MPI fault tolerance), as `RankFailure`.

Under Open MPI's ULFM (`mpiexec --with-ft ulfm`, see docs/elastic.md) an operation that involves a
dead process fails with an `MPI.Exception` of error class ERR_PROC_FAILED, ERR_PROC_FAILED_PENDING
or ERR_REVOKED (a peer revoked the communicator after seeing a failure). Every place the comm layer
waits on MPI turns these into `RankFailure` naming the dead ranks, so the class of the error alone
tells the recovery layer what happened. Other MPI errors pass through unchanged.
"""
from mpi4py import MPI

from ..errors import RankFailure

FAILURE_CLASSES = frozenset(getattr(MPI, name) for name in
                            ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                            if hasattr(MPI, name))


def is_process_failure(exc):
    """True for an MPI.Exception that reports a failed process or a revoked communicator."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAILURE_CLASSES


def failed_ranks(comm):
    """Ranks of `comm` known to have failed (empty without ULFM or when none is known). Local."""
    try:
        failed = comm.Get_failed()
    except (AttributeError, NotImplementedError, MPI.Exception):
        return []
    try:
        n = failed.Get_size()
        if n == 0:
            return []
        ranks = MPI.Group.Translate_ranks(failed, list(range(n)), comm.Get_group())
        return sorted(int(r) for r in ranks if r != MPI.UNDEFINED)
    finally:
        failed.Free()


def rank_failure(exc, comm, *, op="", group="world"):
    """The RankFailure for a ULFM MPI.Exception `exc` raised on `comm` (ranks: comm ranks)."""
    ranks = failed_ranks(comm)
    what = "revoked by a peer that saw a process failure" if (
        exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", None)) else "a process failed"
    return RankFailure(f"{op or 'MPI call'} on group '{group}': {what}; failed ranks "
                       f"{ranks if ranks else '(not yet known)'} [{exc.Get_error_string().strip()}]",
                       ranks=ranks)
