"""The stuck-peer rule of rtxmpi.comm.heartbeat, on one process (peers' beats filed by hand)."""
import time

from mpi4py import MPI

from rtxmpi.comm.heartbeat import Heartbeat


def make(stuck_timeout_s=2.0):
    beat = Heartbeat(MPI.COMM_SELF, stuck_timeout_s=stuck_timeout_s, period_s=0.05)
    return beat


def test_peer_whose_marker_stopped_is_stuck_with_its_phase_and_step():
    beat = make()
    try:
        now = time.monotonic()
        beat.peers[1] = ("backward", 7, 1.5, now - 1.0)  # 1.5 s without progress, beat 1 s old
        rank, text = beat.stuck([0, 1])
        assert rank == 1
        assert "rank 1 made no progress for 2.5 s: last in phase 'backward' of step 7" in text
        assert "alive (heartbeats arrive)" in text
    finally:
        beat.stop()


def test_progressing_or_waiting_peer_is_not_stuck():
    beat = make()
    try:
        beat.peers[1] = ("forward", 3, 0.1, time.monotonic())
        assert beat.stuck([0, 1]) is None
        assert beat.stuck([0]) is None  # not a member of the group waited on
    finally:
        beat.stop()


def test_peer_whose_heartbeats_stopped_is_stuck():
    beat = make(stuck_timeout_s=1.0)
    try:
        beat.peers[2] = ("save", 10, 0.0, time.monotonic() - 5.0)
        rank, text = beat.stuck([2])
        assert rank == 2 and "its heartbeats stopped 5.0 s ago" in text
    finally:
        beat.stop()


def test_silent_peer_is_stuck_only_after_the_timeout():
    beat = make(stuck_timeout_s=0.2)
    try:
        assert beat.stuck([3]) is None
        time.sleep(0.3)
        rank, text = beat.stuck([3])
        assert rank == 3 and "no heartbeat from rank 3" in text
    finally:
        beat.stop()


def test_own_marker_resets_while_waiting():
    waiting = {"now": True}
    beat = Heartbeat(MPI.COMM_SELF, stuck_timeout_s=5.0, period_s=0.02,
                     waiting=lambda: waiting["now"])
    try:
        beat.progress("backward", 4)
        changed = beat.changed
        deadline = time.monotonic() + 5
        while beat.changed == changed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert beat.changed > changed  # the thread counts waiting in a collective as progress
        waiting["now"] = False
        time.sleep(0.2)  # the thread's iteration in flight may still see waiting=True
        frozen = beat.changed
        time.sleep(0.1)
        assert beat.changed == frozen
    finally:
        beat.stop()
