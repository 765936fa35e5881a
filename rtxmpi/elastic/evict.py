"""Ending the process of a rank that the survivors gave up on.

A rank the survivors shrink away from may still exist: stopped (SIGSTOP, a frozen container),
stuck with its heartbeat thread unable to act on an eviction, or declared dead by ULFM's detector
while its process lives on. The launcher waits for every process it started, so such a process
keeps mpiexec running after the survivors finish; resumed, it could write files the survivors
own. So a survivor on the same node SIGKILLs it, which ULFM then reports as a failure within
milliseconds (docs/elastic.md, "Stopped and evicted ranks"). Where no survivor shares its node, a
stopped process can be ended only from outside; should it be resumed (SIGCONT), `guard_resume`'s
handler sees that its world was revoked while it was stopped and SIGKILLs it before its training
loop runs on (a stuck one is ended by its heartbeat thread, which receives the eviction).

`Processes.exchange(comm)` (collective) gathers every rank's identity as one int64 row
[pid, start time in clock ticks, pid-namespace inode, node]: node is the lowest rank of its
MPI shared-memory node, and pid, start time and namespace name the process uniquely (a pid
reused by another process, or one of another pid namespace, is never signalled). Linux only; where
/proc is missing nothing is killed.
"""
import os
import signal
import time

import numpy as np

from ..comm.failure import poll
from ..comm.node import node_ranks

FIELDS = ("pid", "start_ticks", "pid_ns", "node")


def _stat(pid):
    """(state, start time since boot in clock ticks) of process `pid` from /proc/PID/stat
    (fields 3 and 22), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name in ( ) may hold spaces
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _start_ticks(pid):
    """The process's start time since boot in clock ticks, else 0."""
    stat = _stat(pid)
    return 0 if stat is None else stat[1]


def _running(pid, start):
    """True while process `pid` started at `start` ticks exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[1] == start and stat[0] not in (b"Z", b"X")


def _pid_namespace():
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class Processes:
    """Identity of every rank process of one communicator. Attributes: rank, table ((size, 4)
    int64, columns FIELDS, rows by rank)."""

    def __init__(self, table, rank):
        self.table, self.rank = np.asarray(table, np.int64), rank

    @classmethod
    def exchange(cls, comm):
        """Gather the identities of `comm`'s rank processes. Collective over comm."""
        _, _, lowest = node_ranks(comm)
        pid = os.getpid()
        mine = np.array([pid, _start_ticks(pid), _pid_namespace(), lowest], np.int64)
        table = np.empty((comm.Get_size(), len(FIELDS)), np.int64)
        comm.Allgather(mine, table)
        return cls(table, comm.Get_rank())

    def subset(self, ranks, rank):
        """The table of the communicator made of `ranks` of this one in that order (a shrink
        keeps the survivors' order), seen from its rank `rank`. Local."""
        return Processes(self.table[list(ranks)], rank)

    def same_node(self, rank):
        """True when `rank`'s process can be signalled from here (same node, same pid namespace,
        identity known)."""
        pid, start, ns, node = (int(v) for v in self.table[rank])
        _, _, my_ns, my_node = (int(v) for v in self.table[self.rank])
        return node == my_node and ns == my_ns != 0 and start != 0

    def gone(self):
        """True when the process of a rank on this node has ended (a zombie counts as ended).
        Local; never raises."""
        return any(self.same_node(r) and not _running(int(self.table[r, 0]), int(self.table[r, 1]))
                   for r in range(len(self.table)) if r != self.rank)

    def kill(self, rank):
        """SIGKILL `rank`'s process if it is on this node and still exists. Returns "killed",
        "gone" (no such process any more) or "elsewhere" (another node or pid namespace: not
        reachable from here). Local; never raises."""
        if rank == self.rank or not self.same_node(rank):
            return "elsewhere"
        pid, start = int(self.table[rank, 0]), int(self.table[rank, 1])
        try:
            handle = os.pidfd_open(pid)  # pins the process: no pid reuse between check and kill
        except (AttributeError, OSError):
            handle = None
        try:
            if _start_ticks(pid) != start:
                return "gone"
            if handle is not None:
                signal.pidfd_send_signal(handle, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            return "killed"
        except OSError:
            return "gone"
        finally:
            if handle is not None:
                os.close(handle)


class _Guard:
    comm = None  # the world communicator of the attempt in progress
    installed = False


_guard = _Guard()
RESUME_LISTEN_S = 0.2  # how long a resumed process listens for a revoke that came while it was stopped


def guard_resume(comm):
    """Make a SIGCONT end this process when `comm` (the current world) was revoked while the
    process was stopped: its peers gave up on it and shrank without it, and it must not run on
    to write checkpoints, logs or metrics they own. Under ULFM only (a revoke is how the
    survivors leave); call from the main thread at each attempt. Local."""
    _guard.comm = comm
    if not _guard.installed:
        try:
            signal.signal(signal.SIGCONT, _on_continue)
            _guard.installed = True
        except ValueError:
            pass  # not the main thread: no handler (the node's survivors still SIGKILL it)


def revoked_while_away(comm, listen_s=RESUME_LISTEN_S):
    """True when `comm` is revoked, listening up to `listen_s` for a revoke still in transit."""
    deadline = time.monotonic() + listen_s
    while True:
        revoked = poll(comm)  # progress: deliver a revoke
        if revoked is not False:
            return bool(revoked)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _on_continue(signum, frame):
    comm = _guard.comm
    if comm is not None and revoked_while_away(comm):
        os.write(2, f"[rtxmpi pid {os.getpid()}] resumed (SIGCONT) after its peers revoked the world "
                    f"and went on without it: ending this process\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
