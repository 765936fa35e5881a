"""Control-plane heartbeats: tell a rank that is alive but stuck from one that is slow.

Each process runs one daemon thread that, every `period_s`, sends its progress marker
(phase, step, seconds since the marker last changed) to every other rank of the world on a private
communicator, and files the markers it receives. The marker is set by the training loop
(`Heartbeat.progress(phase, step)`, e.g. from `rtxmpi.elastic.Loop.phase`), so a rank computing a
long step still reports its phase, and a rank blocked outside rtxmpi (a stuck file system, a
deadlock in user code) keeps answering through its thread while its marker stops moving. A change
of marker is also sent at once, from the caller of `progress`, so what the peers hold is the
marker of the moment a process stopped (SIGSTOP, a hung host), not that of its last periodic beat.

Messages are typed buffers (no pickle): a beat is one `BEAT` record (phase as UTF-8, at most
PHASE_BYTES; step; the marker's version, which orders beats of the two sending threads; µs
without progress); an eviction is the reason as UTF-8 bytes.

`stuck(members)` names a member whose marker has not changed for more than `stuck_timeout_s`, or
whose heartbeats stopped for that long; heartbeats overdue by more than two periods are reported as
stopped, else the rank is "alive (heartbeats arrive)". `Monitor.wait` checks it while waiting and
raises `RankFailure` naming the rank with its last phase and step, so the peers report it instead
of waiting for the collective deadline. `evict(rank)` asks that rank's thread to kill its process
(SIGKILL), which turns a stuck rank into a dead one that ULFM's shrink can remove (a stopped
process cannot act on it: rtxmpi.elastic.evict kills it from its node).

Needs MPI_THREAD_MULTIPLE (mpi4py asks for it by default). Off unless started
(`RTXMPI_STUCK_TIMEOUT_S`, or `rtxmpi.comm.start_heartbeats`).
"""
import atexit
import os
import signal
import threading
import time

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError

TAG_BEAT = 7101
TAG_EVICT = 7102
PHASE_BYTES = 24
EVICT_BYTES = 1024  # an eviction's reason is cut to this many bytes
BEAT = np.dtype([("version", "<i8"), ("step", "<i8"), ("stalled_us", "<i8"),
                 ("phase", f"S{PHASE_BYTES}")])
OVERDUE_PERIODS = 2  # heartbeats later than this many periods: reported as stopped


def encode_beat(phase, step, stalled_s, version=0):
    """One heartbeat as a (1,) array of dtype BEAT. phase: str of at most PHASE_BYTES UTF-8
    bytes; step: int; stalled_s: seconds without progress (>= 0). Raises ConfigError."""
    name = phase.encode() if isinstance(phase, str) else None
    if name is None or len(name) > PHASE_BYTES or b"\0" in name:
        raise ConfigError(f"heartbeat phase must be a str of at most {PHASE_BYTES} UTF-8 bytes "
                          f"without NUL, got {phase!r}")
    beat = np.zeros(1, BEAT)
    beat[0] = (version, step, round(max(stalled_s, 0.0) * 1e6), name)
    return beat


def decode_beat(beat):
    """(version, phase, step, stalled_s) of a BEAT record (or a (1,) array of one)."""
    record = beat[0] if beat.shape else beat
    return (int(record["version"]), bytes(record["phase"]).decode("utf-8", "replace"),
            int(record["step"]), int(record["stalled_us"]) / 1e6)


class Heartbeat:
    """Heartbeat thread over a Dup of `comm` (collective over comm to create)."""

    def __init__(self, comm, *, stuck_timeout_s, period_s=None, waiting=lambda: False):
        self.comm = comm.Dup()
        self.comm.Set_name("rtxmpi-heartbeat")
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stuck_timeout_s = float(stuck_timeout_s)
        self.period_s = float(period_s or min(1.0, self.stuck_timeout_s / 4))
        self.waiting = waiting  # True while this rank waits inside rtxmpi (not stuck: blocked on peers)
        self.marker = ("start", 0, 0)  # phase, step, version (counts the changes)
        self.changed = time.monotonic()
        # rank -> (version, phase, step, stalled_s, received at (monotonic)): the newest marker
        self.peers = {}
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._sends = []  # (request, buffer) of the thread's beats in flight
        # progress()'s sends: at most one in flight per peer (a peer slow to take them costs
        # nothing; the periodic beat carries a change skipped then), each with its own buffer
        self._change_requests = [None] * self.size
        self._change_buffers = np.zeros((self.size, 1), BEAT)
        self._evictions = []  # (request, buffer) of evict()'s sends
        self._thread = threading.Thread(target=self._run, name="rtxmpi-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def progress(self, phase, step):
        """This rank is now in `phase` of `step`: a change is sent to every peer at once (one
        small nonblocking send per peer, skipped for a peer whose previous one is still in
        flight). Call at every phase change, from one thread; local. Raises ConfigError (a phase
        name longer than PHASE_BYTES)."""
        old = self.marker
        if (phase, step) == old[:2]:
            return
        version = old[2] + 1
        beat = encode_beat(phase, step, 0.0, version)
        self.marker, self.changed = (phase, step, version), time.monotonic()
        requests, buffers = self._change_requests, self._change_buffers
        try:
            for peer in range(self.size):
                if peer == self.rank or not (requests[peer] is None or requests[peer].Test()):
                    continue
                buffers[peer] = beat
                requests[peer] = self.comm.Isend([buffers[peer], MPI.BYTE], dest=peer, tag=TAG_BEAT)
        except MPI.Exception:
            pass  # a dead peer (ULFM): the failure is reported by the waits

    def _send_all(self, beat, in_flight):
        """Start a send of `beat` to every peer; returns `in_flight` without the completed sends,
        plus the new ones (the buffer stays referenced until its sends complete)."""
        try:
            pending = [(r, b) for r, b in in_flight if not r.Test()]
            for peer in range(self.size):
                if peer != self.rank:
                    pending.append((self.comm.Isend([beat, MPI.BYTE], dest=peer, tag=TAG_BEAT),
                                    beat))
            return pending
        except MPI.Exception:
            return in_flight  # a dead peer (ULFM): the failure is reported by the waits

    def _run(self):
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if self.waiting():
                    self.changed = now  # waiting for peers is not a lack of progress
                phase, step, version = self.marker
                self._sends = self._send_all(encode_beat(phase, step, now - self.changed, version),
                                             self._sends)
                self.receive()
            except MPI.Exception:
                pass  # a dead peer (ULFM): the failure is reported by the waits
            self._stop.wait(self.period_s)

    def receive(self):
        """File every beat that has arrived; act on an eviction (SIGKILL of this process). Called
        by the heartbeat thread every period (matched probes: safe from another thread too)."""
        status, beat = MPI.Status(), np.zeros(1, BEAT)
        while True:
            message = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            if message is None:
                return
            source, tag, nbytes = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
            if tag == TAG_BEAT and nbytes == BEAT.itemsize:
                message.Recv([beat, MPI.BYTE])
                self._file(source, decode_beat(beat))
                continue
            data = bytearray(max(nbytes, 0))
            message.Recv([data, MPI.BYTE])
            if tag == TAG_EVICT:
                os.write(2, f"[rtxmpi rank {self.rank}] evicted by rank {source}: "
                            f"{data.decode('utf-8', 'replace')}\n".encode())
                os.kill(os.getpid(), signal.SIGKILL)

    def _file(self, source, beat):
        version = beat[0]
        known = self.peers.get(source)
        if known is None or version >= known[0]:  # a periodic beat may overtake a change's
            self.peers[source] = (*beat, time.monotonic())

    def describe(self, rank):
        """What the heartbeats say about `rank` now: its last phase and step and how long ago
        its last heartbeat arrived, or that none came. Local."""
        now = time.monotonic()
        beat = self.peers.get(rank)
        if beat is None:
            return f"no heartbeat from rank {rank} in {now - self.started:.1f} s"
        _, phase, step, _, received = beat
        return f"last in phase '{phase}' of step {step}; {self._liveness(now - received)}"

    def _liveness(self, silent_s):
        if silent_s > OVERDUE_PERIODS * self.period_s:
            return (f"its heartbeats stopped {silent_s:.1f} s ago (the process is stopped, hung "
                    f"holding the GIL, or unreachable)")
        return "alive (heartbeats arrive)"

    def stuck(self, members):
        """(rank, description) of the first member that made no progress for longer than
        stuck_timeout_s (by its heartbeats, or by their absence), else None. Local."""
        now = time.monotonic()
        for m in members:
            text = self._stuck(m, now)
            if text is not None:
                return m, text
        return None

    def is_stuck(self, rank):
        """True when `rank` made no progress for longer than stuck_timeout_s. Local."""
        return self._stuck(rank, time.monotonic()) is not None

    def _stuck(self, m, now):
        if m == self.rank:
            return None
        beat = self.peers.get(m)
        if beat is None:
            return self.describe(m) if now - self.started > self.stuck_timeout_s else None
        _, phase, step, stalled_s, received = beat
        stalled_s += now - received
        if stalled_s <= self.stuck_timeout_s:
            return None
        return (f"rank {m} made no progress for {stalled_s:.1f} s: last in phase '{phase}' of "
                f"step {step}; {self._liveness(now - received)}")

    def evict(self, rank, reason):
        """Ask `rank`'s heartbeat thread to SIGKILL its process (it becomes a failed rank)."""
        data = bytearray(reason.encode()[:EVICT_BYTES])
        try:
            self._evictions.append((self.comm.Isend([data, MPI.BYTE], dest=rank, tag=TAG_EVICT),
                                    data))
        except MPI.Exception:
            pass

    def stop(self):
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
