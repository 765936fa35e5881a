"""Process failures reported by ULFM (MPI fault tolerance), as `RankFailure`.

Under Open MPI's ULFM (`mpiexec --with-ft ulfm`, see docs/elastic.md) an operation that involves a
dead process fails with an `MPI.Exception` of error class ERR_PROC_FAILED, ERR_PROC_FAILED_PENDING
or ERR_REVOKED (a peer revoked the communicator after seeing a failure). Every place the comm layer
waits on MPI turns these into `RankFailure` naming the dead ranks, so the class of the error alone
tells the recovery layer what happened. Other MPI errors pass through unchanged.
"""
import os

from mpi4py import MPI

from ..errors import RankFailure

FAILURE_CLASSES = frozenset(getattr(MPI, name) for name in
                            ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                            if hasattr(MPI, name))


def ulfm_enabled():
    """Whether this job runs with fault tolerance on: True or False under Open MPI (`mpiexec
    --with-ft ulfm` sets OMPI_MCA_mpi_ft_enable in every rank's environment), None where the MPI
    library gives no way to tell. Local; no communication."""
    if "Open MPI" not in MPI.Get_library_version():
        return None
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "0").lower() in ("1", "true", "yes", "on")


def is_process_failure(exc, comm=None):
    """True for an MPI.Exception that reports a failed process or a revoked communicator; also for
    any other MPI error on `comm` once it is revoked or has failed ranks (a multi-request test
    reports ERR_IN_STATUS, a nonblocking collective aborted by a revoke ERR_OTHER)."""
    if not isinstance(exc, MPI.Exception):
        return False
    error_class = exc.Get_error_class()
    if error_class in FAILURE_CLASSES:
        return True
    if comm is not None:  # ERR_IN_STATUS, or ERR_OTHER from an aborted nonblocking schedule
        return _is_revoked(comm) or bool(failed_ranks(comm))
    return False


def _is_revoked(comm):
    try:
        return bool(comm.Is_revoked())
    except (AttributeError, NotImplementedError, MPI.Exception):
        return False


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


def any_failed(comm):
    """True when ULFM reports a failed process of `comm` (of either group of an
    intercommunicator); False without ULFM or when none is known. Local."""
    try:
        failed = comm.Get_failed()
    except (AttributeError, NotImplementedError, MPI.Exception):
        return False
    try:
        return failed.Get_size() > 0
    finally:
        failed.Free()


MPIError = MPI.Exception  # what an MPI call raises under MPI_ERRORS_RETURN (ULFM's failures too)


def revoke(comms):
    """MPI_Comm_revoke each of `comms`, ignoring those already revoked or freed. Local."""
    for c in comms:
        try:
            c.Revoke()
        except MPI.Exception:
            pass


def poll(comm):
    """Let MPI progress on `comm` (a nonblocking probe) so that a failure or a revoke still in
    transit is delivered. Returns whether `comm` is revoked, None for an MPI without ULFM. Local."""
    try:
        comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        return bool(comm.Is_revoked())
    except MPI.Exception as exc:
        return exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", None)
    except (AttributeError, NotImplementedError):
        return None


def lost_ranks(old, new):
    """Ranks of communicator `old` that are not in `new` (the ones a shrink left out). Local."""
    old_group, new_group = old.Get_group(), new.Get_group()
    try:
        kept = MPI.Group.Translate_ranks(new_group, list(range(new_group.Get_size())), old_group)
    finally:
        old_group.Free()
        new_group.Free()
    return sorted(set(range(old.Get_size())) - set(kept))


def rank_failure(exc, comm, *, op="", group="world"):
    """The RankFailure for a ULFM MPI.Exception `exc` raised on `comm` (ranks: comm ranks)."""
    ranks = failed_ranks(comm)
    what = "revoked by a peer that saw a process failure" if (
        exc.Get_error_class() == getattr(MPI, "ERR_REVOKED", None) or _is_revoked(comm)
        and not ranks) else "a process failed"
    return RankFailure(f"{op or 'MPI call'} on group '{group}': {what}; failed ranks "
                       f"{ranks if ranks else '(not yet known)'} [{exc.Get_error_string().strip()}]",
                       ranks=ranks)
