"""Heartbeats between ranks: typed beats, a change of marker sent at once, evictions as bytes."""
import time

import pytest

from rtxmpi.comm.heartbeat import Heartbeat


@pytest.mark.mpi(min_size=2)
def test_change_of_marker_reaches_every_peer_long_before_the_next_periodic_beat(world):
    """The period is 30 s: only the send made by progress() can bring step 5 within 10 s."""
    beat = Heartbeat(world.backend.comm, stuck_timeout_s=120.0, period_s=30.0)
    try:
        beat.progress("backward", 5 + world.rank)
        others = [r for r in range(world.world_size) if r != world.rank]
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(beat.peers.get(r, (0,))[0] < 1 for r in others):
            beat.receive()
            time.sleep(0.01)
        got = {r: beat.peers.get(r, (None,) * 3)[1:3] for r in others}
        assert got == {r: ("backward", 5 + r) for r in others}
    finally:
        world.barrier()
        beat.stop()
