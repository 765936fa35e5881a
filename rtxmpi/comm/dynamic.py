"""MPI's dynamic processes: start processes into a running job and merge them with its ranks.

MPI_Comm_spawn is collective over the spawning ranks and has no deadline: when one of them dies
during it or during the MPI_Intercomm_merge after it, Open MPI 5 can leave another blocked for
good (seen with the spawn's root, whose ULFM failure reports stay empty meanwhile, and with every
rank in the merge). A watchdog thread beside every spawn polls ULFM's failure reports of the
spawning communicator and of the intercommunicator the spawn returned: once a process is known
to have failed (or the caller's `peer_lost` says so) it revokes both, so that the calls that
notice end with an error and the caller recovers as from any failure (the spawn's collectives
over the group do; a blocked root or merge does not). A call still blocked at the deadline ends
this process (exit status EXIT_SPAWN_STUCK): it is then lost like any other rank instead of
blocking forever (the survivors' shrink ends a process it excludes on their node at once,
rtxmpi.elastic). The spawned processes' merge has the same watchdog. When every spawning rank
is blocked (the spawn's root died inside the merge), the job ends after the deadline and
`rtxmpi run` relaunches it from the last committed checkpoint. The spawned processes get a
deadline on their MPI_Init too (rtxmpi.spawn_deadline): a spawn that failed on the spawning side
can leave them blocked there.

Source: MPI-4.1 standard, chapter 11 (MPI_Comm_spawn, MPI_Comm_get_parent,
MPI_Intercomm_merge); ULFM (MPIX_Comm_get_failed, MPIX_Comm_revoke). rtxmpi.elastic.grow builds
replacement of lost ranks on these.
"""
import os
import sys
import threading
import time

from mpi4py import MPI

from ..errors import SpawnFailed
from ..spawn_deadline import interpreter_options
from .failure import any_failed, revoke

EXIT_SPAWN_STUCK = 5  # this process left the job: MPI_Comm_spawn or its merge blocked past the deadline


def spawned():
    """True in a process started by MPI_Comm_spawn (it has a parent communicator). Local."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def spawn_merged(comm, count, argv, info=None, timeout_s=None, peer_lost=None):
    """Start `count` processes of `sys.executable argv...` and merge them after the ranks of
    `comm` (which keep their ranks). info: {key: value} MPI_Info hints read on rank 0 only.
    timeout_s: the deadline of the spawn and merge in seconds (None: none); past it this process
    exits with EXIT_SPAWN_STUCK; the spawned processes get it as their MPI_Init deadline
    (rtxmpi.spawn_deadline). peer_lost: None or a callable, True once a rank of `comm` is
    known to be gone by other means than MPI (a process of this node that ended): the watchdog
    then revokes as on a failure report. Returns the merged intracommunicator, errors returned rather than fatal.
    Collective over `comm`. Raises SpawnFailed when MPI_Comm_spawn fails (no free slot, program
    not found)."""
    mpi_info = MPI.Info.Create()
    for key, value in (info or {}).items():
        mpi_info.Set(str(key), str(value))
    watchdog = _SpawnWatchdog(comm, timeout_s, peer_lost) if timeout_s else None
    try:
        try:
            args = interpreter_options(timeout_s) + [str(a) for a in argv]
            inter = comm.Spawn(sys.executable, args=args, maxprocs=count, info=mpi_info, root=0)
        except MPI.Exception as exc:
            raise SpawnFailed(exc.Get_error_string().strip()) from None
        finally:
            mpi_info.Free()
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        if watchdog is not None:
            watchdog.inter = inter
        merged = inter.Merge(high=False)  # can block for good, too, when a rank dies here
    finally:
        if watchdog is not None:
            watchdog.done.set()
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def merge_with_parent(timeout_s=None):
    """In a spawned process: the intracommunicator of the parent's ranks followed by the spawned
    ones (errors returned). timeout_s: as spawn_merged's. Collective over the spawned processes
    and the parent's spawn_merged."""
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    watchdog = _SpawnWatchdog(parent, timeout_s) if timeout_s else None
    try:
        merged = parent.Merge(high=True)
    finally:
        if watchdog is not None:
            watchdog.done.set()
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


class _SpawnWatchdog(threading.Thread):
    """Beside a spawn over `comm` (module docstring): revokes `comm` and `inter` (set once the
    spawn returned) when either reports a failed process or `peer_lost()`, and ends this process
    (EXIT_SPAWN_STUCK) unless `done` is set within `timeout_s` seconds."""

    def __init__(self, comm, timeout_s, peer_lost=None, poll_s=0.05):
        super().__init__(name="rtxmpi-spawn-watchdog", daemon=True)
        self.comm, self.inter, self.timeout_s, self.poll_s = comm, None, timeout_s, poll_s
        self.peer_lost = peer_lost or (lambda: False)
        self.done = threading.Event()
        self.start()

    def run(self):
        deadline, revoked = time.monotonic() + self.timeout_s, False
        while not self.done.wait(self.poll_s):
            comms = [c for c in (self.comm, self.inter) if c is not None]
            if not revoked and (self.peer_lost() or any(any_failed(c) for c in comms)):
                revoke(comms)
                revoked = True
            if time.monotonic() > deadline and not self.done.is_set():
                print(f"elastic: rank {self.comm.Get_rank()}: MPI_Comm_spawn or the merge after "
                      f"it is still blocked after {self.timeout_s:g} s"
                      f"{' (a spawning rank failed)' if revoked else ''}; this process leaves "
                      f"the job (exit {EXIT_SPAWN_STUCK}) and the others go on without it",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_SPAWN_STUCK)
