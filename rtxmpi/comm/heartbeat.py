"""Control-plane heartbeats: tell a rank that is alive but stuck from one that is slow.

Each process runs one daemon thread that, every `period_s`, sends its progress marker
(phase, step, seconds since the marker last changed) to every other rank of the world on a private
communicator, and files the markers it receives. The marker is set by the training loop
(`Heartbeat.progress(phase, step)`, e.g. from `rtxmpi.elastic.Loop.phase`), so a rank computing a
long step still reports its phase, and a rank blocked outside rtxmpi (a stuck file system, a
deadlock in user code) keeps answering through its thread while its marker stops moving.

`stuck(members)` names a member whose marker has not changed for more than `stuck_timeout_s`, or
whose heartbeats stopped for that long. `Monitor.wait` checks it while waiting and raises
`RankFailure` naming the rank with its last phase and step, so the peers report it instead of
waiting for the collective deadline. `evict(rank)` asks that rank's thread to kill its process
(SIGKILL), which turns a stuck rank into a dead one that ULFM's shrink can remove.

Needs MPI_THREAD_MULTIPLE (mpi4py asks for it by default). Off unless started
(`RTXMPI_STUCK_TIMEOUT_S`, or `rtxmpi.comm.start_heartbeats`).
"""
import atexit
import os
import signal
import threading
import time

from mpi4py import MPI

TAG_BEAT = 7101
TAG_EVICT = 7102


class Heartbeat:
    """Heartbeat thread over a Dup of `comm` (collective over comm to create)."""

    def __init__(self, comm, *, stuck_timeout_s, period_s=None, waiting=lambda: False):
        self.comm = comm.Dup()
        self.comm.Set_name("rtxmpi-heartbeat")
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stuck_timeout_s = float(stuck_timeout_s)
        self.period_s = float(period_s or min(1.0, self.stuck_timeout_s / 4))
        self.waiting = waiting  # True while this rank waits inside rtxmpi (not stuck: blocked on peers)
        self.marker = ("start", 0)
        self.changed = time.monotonic()
        self.peers = {}  # rank -> (phase, step, stalled_s, received at (monotonic))
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._sends = []
        self._thread = threading.Thread(target=self._run, name="rtxmpi-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def progress(self, phase, step):
        """This rank is now in `phase` of `step` (cheap; call at every phase change)."""
        marker = (phase, step)
        if marker != self.marker:
            self.marker, self.changed = marker, time.monotonic()

    def _run(self):
        status = MPI.Status()
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if self.waiting():
                    self.changed = now  # waiting for peers is not a lack of progress
                beat = (self.marker[0], self.marker[1], now - self.changed)
                self._sends = [r for r in self._sends if not r.Test()]
                for peer in range(self.size):
                    if peer != self.rank:
                        self._sends.append(self.comm.isend(beat, dest=peer, tag=TAG_BEAT))
                while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                    source, tag = status.Get_source(), status.Get_tag()
                    message = self.comm.recv(source=source, tag=tag)
                    if tag == TAG_EVICT:
                        os.write(2, f"[rtxmpi rank {self.rank}] evicted by rank {source}: "
                                    f"{message}\n".encode())
                        os.kill(os.getpid(), signal.SIGKILL)
                    self.peers[source] = (*message, time.monotonic())
            except MPI.Exception:
                pass  # a dead peer (ULFM): the failure is reported by the waits
            self._stop.wait(self.period_s)

    def stuck(self, members):
        """(rank, description) of the first member that made no progress for longer than
        stuck_timeout_s (by its heartbeats, or by their absence), else None. Local."""
        now = time.monotonic()
        for m in members:
            if m == self.rank:
                continue
            beat = self.peers.get(m)
            if beat is None:
                if now - self.started > self.stuck_timeout_s:
                    return m, f"no heartbeat from rank {m} in {now - self.started:.1f} s"
                continue
            phase, step, stalled_s, received = beat
            stalled_s += now - received
            if stalled_s > self.stuck_timeout_s:
                silent = now - received
                how = (f"its heartbeats stopped {silent:.1f} s ago" if silent > self.stuck_timeout_s
                       else "alive (heartbeats arrive)")
                return m, (f"rank {m} made no progress for {stalled_s:.1f} s: last in phase "
                           f"'{phase}' of step {step}; {how}")
        return None

    def evict(self, rank, reason):
        """Ask `rank`'s heartbeat thread to SIGKILL its process (it becomes a failed rank)."""
        try:
            self.comm.isend(reason, dest=rank, tag=TAG_EVICT)
        except MPI.Exception:
            pass

    def stop(self):
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
