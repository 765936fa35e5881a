"""Deadlines for every blocking wait, and the diagnosis of who did not arrive.

Each process has one `Monitor`. Every wait in the comm layer goes through `Monitor.wait()`, which
polls MPI requests until they complete or the deadline passes. It never blocks in MPI, so it can
answer questions from peers while it waits. Past the deadline, the waiting rank:

1. sends a QUERY to every other member of the group on a private control communicator;
2. listens for a short probe window (min(timeout_s, 2 s)) while still answering its own queries;
   a peer that is itself waiting in rtxmpi answers with (group, seq, op) of its wait; a peer that is
   computing, sleeping or dead does not answer;
3. classifies each member: arrived (waiting in the same group, sequence number and op),
   elsewhere (in another collective, or in another op at the same sequence number), or silent;
   then sends a NOTICE with the diagnosis to every member and raises `CollectiveTimeout`. Any
   rank that receives a NOTICE while waiting raises the same error, so every rank that reaches
   rtxmpi raises within the timeout plus the probe window (< 3x the timeout).

Blocking data transfers (the fast MPI algorithms) run only after every rank has arrived, so they
cannot wait for a rank that is not there. As a backstop for what no arrival check catches (mismatched
calls with checking off, a rank lost mid-transfer), a watchdog thread aborts the job when a blocking
transfer outlasts its deadline.

Uncaught errors: with more than one rank, an uncaught exception would leave mpi4py's exit-time
MPI_Finalize waiting for peers forever. `install_excepthook()` prints the traceback, flushes, waits
briefly so that peers that received the NOTICE can print theirs, then aborts the job (non-zero exit).
"""
import functools
import os
import signal
import sys
import threading
import time
import traceback

from mpi4py import MPI

from ..errors import CollectiveError, CollectiveTimeout, RankFailure
from .failure import is_process_failure, rank_failure

TAG_QUERY = 7001
TAG_REPLY = 7002
TAG_NOTICE = 7003

SERVICE_INTERVAL_S = 0.002  # how often a wait answers peers' control messages
SPIN_BEFORE_SLEEP_S = 0.0005  # spin this long on Test() before yielding the core
MAX_PROBE_S = 2.0
ABORT_GRACE_S = 10.0  # abort(): end this rank (SIGALRM, SIGKILL) if MPI_Abort has not by then


# Progress functions every wait calls between its polls (comm/shm.py registers one while it has
# queued nonblocking all_reduces, which advance only when their rank runs them): a rank waiting
# here for a peer keeps that peer's pending transfers with it moving, as MPI's progress engine
# does for MPI requests. Each takes no argument, never waits, and may raise RankFailure.
PROGRESS = []


class Monitor:
    """Per-process deadline enforcer (one per process; created by `rtxmpi.init`)."""

    def __init__(self, world_comm):
        self.ctl = world_comm.Dup()  # control messages never mix with user traffic
        self.ctl.Set_name("rtxmpi-control")
        self.comm = world_comm  # for the failed ranks ULFM reports
        self.rank = world_comm.Get_rank()
        self.state = None  # (group, seq, op) of the wait this rank is in, or None
        self._pending_sends = []
        self._replies = {}
        # (group, seq, op, deadline) of the blocking transfer in progress, else None; set by
        # blocking() or directly by a backend around its MPI call; read by the watchdog
        self.blocking_entry = None
        self._watchdog = None
        self.heartbeat = None  # a comm.heartbeat.Heartbeat once started: stuck-peer detection

    def is_waiting(self):
        """True while this process waits in (or transfers through) an rtxmpi collective."""
        return self.state is not None or self.blocking_entry is not None

    # -- waiting --------------------------------------------------------------------------
    def wait(self, requests, *, op, seq, group, members, timeout_s):
        """Wait until every MPI request in `requests` completes, or raise.

        requests: list of mpi4py Request, or a callable poll() -> bool (True once done) for a
        wait that is not on MPI requests (the shared-memory flags of comm/shm.py). members: world
        ranks of the group (for the diagnosis).
        Raises CollectiveTimeout (on this and, through the NOTICE, on every waiting member), and
        what a PROGRESS function raises: RankFailure or CollectiveError of a queued nonblocking
        all_reduce, possibly of another group (comm/shm.py start_all_reduce).
        """
        done = requests if callable(requests) else functools.partial(MPI.Request.Testall,
                                                                     requests)
        if done():
            return
        self.state = (group, seq, op)
        try:
            start = time.monotonic()
            deadline = start + timeout_s
            next_service = start + SERVICE_INTERVAL_S
            while True:
                if done():
                    return
                if PROGRESS:
                    for progress in tuple(PROGRESS):  # a progress() may end its registration
                        progress()
                now = time.monotonic()
                if now >= next_service:
                    self.service()
                    next_service = now + SERVICE_INTERVAL_S
                    if self.heartbeat is not None:
                        stuck = self.heartbeat.stuck(members)
                        if stuck is not None:
                            raise RankFailure(f"{op} #{seq} on group '{group}': {stuck[1]}; "
                                              f"handled as a failed rank [rank {self.rank}]",
                                              ranks=[stuck[0]])
                if now >= deadline:
                    if self._diagnose_and_raise(done, op=op, seq=seq, group=group,
                                                members=members, timeout_s=timeout_s):
                        return  # completed during the probe window: a late arrival, not an error
                if now - start > SPIN_BEFORE_SLEEP_S:
                    time.sleep(0)  # yield the core: ranks may outnumber cores
        except MPI.Exception as exc:
            if is_process_failure(exc, self.comm):
                raise rank_failure(exc, self.comm, op=f"{op} #{seq}", group=group) from None
            raise
        finally:
            self.state = None

    def service(self):
        """Answer peers' queries and act on notices (called from inside waits)."""
        status = MPI.Status()
        while self.ctl.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            source, tag = status.Get_source(), status.Get_tag()
            message = self.ctl.recv(source=source, tag=tag)
            if tag == TAG_QUERY:
                self._pending_sends.append(self.ctl.isend(self.state, dest=source, tag=TAG_REPLY))
            elif tag == TAG_REPLY:
                self._replies[source] = message
            elif tag == TAG_NOTICE:
                text, fields = message
                raise CollectiveTimeout(f"{text} [reported to rank {self.rank} by rank {source}]",
                                        **fields)
        if self._pending_sends:
            self._pending_sends = [r for r in self._pending_sends if not r.Test()]

    def _diagnose_and_raise(self, done, *, op, seq, group, members, timeout_s):
        others = [m for m in members if m != self.rank]
        self._replies = {}
        for m in others:
            self._pending_sends.append(self.ctl.isend((group, seq, op), dest=m, tag=TAG_QUERY))
        probe_end = time.monotonic() + min(max(timeout_s, 0.1), MAX_PROBE_S)
        while time.monotonic() < probe_end and len(self._replies) < len(others):
            if done():
                return True
            self.service()
            time.sleep(0.0005)
        missing, notes = [], []
        for m in others:
            reply = self._replies.get(m)
            if reply is None:
                missing.append(m)
                notes.append(f"rank {m}: no answer (computing, blocked outside rtxmpi, or dead)")
            elif reply[0] != group or reply[1] != seq or reply[2] != op:
                missing.append(m)
                notes.append(f"rank {m}: waiting in {reply[2]} #{reply[1]} on group '{reply[0]}'"
                             + (" (a different collective at the same position: the ranks' "
                                "programs diverge)" if reply[:2] == (group, seq) else ""))
        if not missing:  # every member is in this very call, yet it did not complete
            notes.append("every rank is in this call: their arguments took different algorithms "
                         "(different sizes or dtypes, with checking off), or a transfer stalled; "
                         "RTXMPI_CHECK=1 compares the calls")
        text = (f"{op} #{seq} on group '{group}' did not complete within "
                f"{timeout_s:g} s; ranks that did not arrive: {missing}"
                + (" (" + "; ".join(notes) + ")" if notes else ""))
        fields = dict(op=op, seq=seq, group=group, missing=missing, timeout_s=timeout_s)
        for m in others:
            self._pending_sends.append(self.ctl.isend((text, fields), dest=m, tag=TAG_NOTICE))
        raise CollectiveTimeout(f"{text} [rank {self.rank}]", **fields)

    # -- blocking transfers and the watchdog ---------------------------------------------------
    def blocking(self, op, seq, group, timeout_s):
        """Context manager around a blocking MPI call that runs after every rank has arrived."""
        return _Blocking(self, (group, seq, op, time.monotonic() + timeout_s))

    def start_watchdog(self, period_s=0.5):
        """Start the daemon thread that aborts the job when a blocking transfer overruns."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, args=(period_s,),
                                              name="rtxmpi-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self, period_s):
        while True:
            time.sleep(period_s)
            current = self.blocking_entry
            if current is not None and time.monotonic() > current[3] + period_s:
                group, seq, op, _ = current
                print(f"[rtxmpi rank {self.rank}] CollectiveTimeout: {op} #{seq} on group '{group}' "
                      "is still transferring after every rank arrived and its deadline passed "
                      "(ranks called different collectives with checking off, or a peer died); "
                      "aborting the job", file=sys.stderr, flush=True)
                abort(1)


class _Blocking:
    __slots__ = ("monitor", "entry")

    def __init__(self, monitor, entry):
        self.monitor, self.entry = monitor, entry

    def __enter__(self):
        self.monitor.blocking_entry = self.entry

    def __exit__(self, exc_type, exc, tb):
        self.monitor.blocking_entry = None
        if exc is not None and is_process_failure(exc, self.monitor.comm):
            group, seq, op, _ = self.entry
            raise rank_failure(exc, self.monitor.comm, op=f"{op} #{seq}", group=group) from None
        return False


def abort(code):
    """Tear the whole job down from any thread: MPI_Abort, or SIGKILL of this rank as a fallback,
    also when MPI_Abort does not return within ABORT_GRACE_S (seen under ULFM after a peer died:
    the launcher's teardown can wait on the dead process). A timer thread sends the SIGKILL, and
    a second later the kernel's SIGALRM (default action: terminate) does without the interpreter:
    mpi4py calls MPI_Abort holding the GIL, so no Python thread runs while it hangs."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # only from the main thread
    except ValueError:
        pass
    signal.setitimer(signal.ITIMER_REAL, ABORT_GRACE_S + 1.0)  # the backup of the SIGKILL below
    killer = threading.Timer(ABORT_GRACE_S, os.kill, (os.getpid(), signal.SIGKILL))
    killer.daemon = True
    killer.start()
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(code)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def install_excepthook(rank, grace_s=0.3):
    """Make an uncaught exception on any rank end the job with a non-zero exit instead of a hang."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            previous(exc_type, exc, tb)
        else:
            sys.stderr.write(f"[rtxmpi rank {rank}] uncaught {exc_type.__name__}:\n")
            traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        if issubclass(exc_type, CollectiveError):
            sys.stderr.flush()
            time.sleep(grace_s)  # peers told by our NOTICE print their own error first
        abort(1)

    sys.excepthook = hook
