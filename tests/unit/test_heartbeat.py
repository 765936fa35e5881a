"""rtxmpi.comm.heartbeat on one process: the beat's typed buffer, and the stuck-peer rule (peers'
beats filed by hand)."""
import time

import numpy as np
import pytest
from mpi4py import MPI

from rtxmpi.comm.heartbeat import BEAT, PHASE_BYTES, Heartbeat, decode_beat, encode_beat
from rtxmpi.errors import ConfigError


def make(stuck_timeout_s=2.0, period_s=0.05):
    return Heartbeat(MPI.COMM_SELF, stuck_timeout_s=stuck_timeout_s, period_s=period_s)


def test_beat_is_a_fixed_size_record_that_round_trips():
    beat = encode_beat("backward", 2**40 + 3, 1.25, version=7)
    assert beat.dtype == BEAT and beat.shape == (1,) and not beat.dtype.hasobject
    assert beat.nbytes == 24 + PHASE_BYTES
    received = np.frombuffer(beat.tobytes(), BEAT)  # what a peer's Recv into a BEAT buffer holds
    assert decode_beat(received) == (7, "backward", 2**40 + 3, 1.25)
    assert decode_beat(encode_beat("é" * (PHASE_BYTES // 2), -1, 0.0))[1:3] == ("é" * 12, -1)


@pytest.mark.parametrize("phase", ["x" * (PHASE_BYTES + 1), "é" * 13, "a\0b", b"forward", None])
def test_phase_that_does_not_fit_the_record_is_a_config_error(phase):
    with pytest.raises(ConfigError, match="heartbeat phase must be a str of at most 24"):
        encode_beat(phase, 1, 0.0)
    beat = make()
    try:
        with pytest.raises(ConfigError):
            beat.progress(phase, 1)
        assert beat.marker == ("start", 0, 0)
    finally:
        beat.stop()


def test_peer_whose_marker_stopped_is_stuck_with_its_phase_and_step():
    beat = make()
    try:
        now = time.monotonic()
        beat.peers[1] = (4, "backward", 7, 2.49, now - 0.01)  # beats arrive: alive
        rank, text = beat.stuck([0, 1])
        assert rank == 1
        assert "rank 1 made no progress for 2.5 s: last in phase 'backward' of step 7" in text
        assert "alive (heartbeats arrive)" in text
    finally:
        beat.stop()


def test_progressing_or_waiting_peer_is_not_stuck():
    beat = make()
    try:
        beat.peers[1] = (2, "forward", 3, 0.1, time.monotonic())
        assert beat.stuck([0, 1]) is None and not beat.is_stuck(1)
        assert beat.stuck([0]) is None  # not a member of the group waited on
    finally:
        beat.stop()


def test_peer_whose_heartbeats_stopped_is_stuck():
    beat = make(stuck_timeout_s=1.0)
    try:
        beat.peers[2] = (9, "save", 10, 0.0, time.monotonic() - 5.0)
        rank, text = beat.stuck([2])
        assert rank == 2 and "its heartbeats stopped 5.0 s ago" in text and beat.is_stuck(2)
    finally:
        beat.stop()


def test_peer_stopped_while_progressing_is_reported_stopped_at_the_first_timeout():
    """A process frozen right after a change of marker: its last beat says 0 s without progress,
    so it is stuck once its silence passes the timeout, and silence of more than two periods is
    a stop, not 'alive' (the report used to say alive until the silence exceeded the timeout)."""
    beat = make(stuck_timeout_s=2.0, period_s=0.5)
    try:
        beat.peers[3] = (31, "backward", 8, 0.0, time.monotonic() - 2.05)
        rank, text = beat.stuck([0, 3])
        assert rank == 3
        assert "last in phase 'backward' of step 8; its heartbeats stopped 2." in text
        assert "alive" not in text
        assert beat.describe(3).startswith("last in phase 'backward' of step 8; its heartbeats stopped")
    finally:
        beat.stop()


def test_a_late_periodic_beat_does_not_replace_a_newer_marker():
    """The periodic thread may read the marker just before the training loop changes and sends
    it; the receiver keeps the marker of the highest version."""
    beat = make()
    try:
        beat._file(1, (5, "step", 8, 0.0))
        beat._file(1, (4, "backward", 8, 0.3))
        assert beat.peers[1][:3] == (5, "step", 8)
        beat._file(1, (5, "step", 8, 0.7))  # the same marker, later: its stalled time counts
        assert beat.peers[1][3] == 0.7
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
        assert beat.marker == ("backward", 4, 1)
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
