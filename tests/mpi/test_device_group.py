"""The GPU data plane's host-side machinery, proven on the MPI path (no GPU needed): a DeviceGroup
world runs numpy collectives and splits like the MPI world and hands its DeviceBackend to every
sub-group; the device wait enforces deadlines by polling (never a stream synchronize), aborts the
NCCL communicator and raises CollectiveTimeout on every rank; an NCCL async error aborts and
raises CollectiveError. NCCL itself runs in bench/gpu_check.py on a GPU machine."""
import time

import numpy as np
import pytest
from mpi4py import MPI

from rtxmpi.comm.nccl import DeviceBackend, DeviceGroup, _Pending, make_world
from rtxmpi.errors import CollectiveError, CollectiveTimeout, RankFailure


def _device_world(world, transport="nccl", timeout_s=None):
    """A DeviceGroup over the same ranks as `world` (its own communicator; no NCCL is created
    until a cupy array arrives, which these tests never pass)."""
    comm = world.backend.comm.Dup()
    return make_world(transport, comm, world.backend.monitor, list(range(world.world_size)),
                      "cuda:0", name="device-world", rank=world.rank, world_size=world.world_size,
                      local_rank=world.local_rank, timeout_s=timeout_s or world.timeout_s,
                      check=world.check)


def _drain_notices(world):
    """Consume the timeout NOTICEs peers sent while this rank was raising its own (they would
    otherwise surface in the next test's wait). Collective; plain MPI barriers, as a wait in
    rtxmpi would itself raise on a NOTICE still queued."""
    world.backend.comm.Barrier()  # every rank has raised: every NOTICE has been sent
    time.sleep(0.2)
    for _ in range(world.world_size + 1):
        try:
            world.backend.monitor.service()
            break
        except CollectiveTimeout:
            continue
    world.backend.comm.Barrier()


class FakeEvent:
    """A CUDA event stand-in that completes after `polls` queries (never when None)."""

    def __init__(self, polls=None):
        self.polls = polls

    @property
    def done(self):
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0


class FakeNccl:
    """An NCCL communicator stand-in: records abort(); check_async_error raises `error`."""

    def __init__(self, error=None):
        self.error, self.aborted = error, False

    def check_async_error(self):
        if self.error:
            raise RuntimeError(self.error)

    def abort(self):
        self.aborted = True


@pytest.mark.parametrize("transport", ["nccl", "cuda-aware-mpi"])
def test_device_world_runs_host_collectives_and_splits_like_mpi(world, transport):
    group = _device_world(world, transport)
    assert isinstance(group, DeviceGroup) and group.backend.name == transport
    n, r = world.world_size, world.rank
    x = np.full(5, r + 1, np.float32)
    assert (group.all_reduce(x) == n * (n + 1) / 2).all()
    assert (group.all_gather(np.array([r])) == np.arange(n)).all()
    assert group.reduce_scatter(np.ones((2 * n, 3)), op="avg").shape == (2, 3)
    sub = group.split(color=r % 2)
    assert isinstance(sub, DeviceGroup) and isinstance(sub.backend, DeviceBackend)
    assert sub.backend.transport == transport and sub.backend.device_id == 0
    assert sub.all_reduce(np.ones(1))[0] == len(range(r % 2, n, 2))
    works = group.send_recv(sends=[(np.full(3, r, np.int64), (r + 1) % n)],
                            recvs=[(got := np.zeros(3, np.int64), (r - 1) % n)], async_op=True)
    works.wait()
    assert (got == (r - 1) % n).all()


def test_device_wait_completes_when_the_event_does(world):
    group = _device_world(world)
    group.backend.nccl_comm = FakeNccl()
    group.backend.wait(_Pending(event=FakeEvent(polls=50)), op="all_reduce", seq=1, timeout_s=30)
    assert not group.backend.nccl_comm.aborted


def test_device_wait_past_its_deadline_aborts_nccl_and_raises_on_every_rank(world):
    group = _device_world(world, timeout_s=0.3)
    fake = group.backend.nccl_comm = FakeNccl()
    with pytest.raises(CollectiveTimeout, match=r"all_reduce #7 .* did not complete") as info:
        group.backend.wait(_Pending(event=FakeEvent()), op="all_reduce", seq=7, timeout_s=0.3)
    assert info.value.op == "all_reduce" and info.value.seq == 7
    assert fake.aborted
    _drain_notices(world)
    with pytest.raises(CollectiveError, match="aborted"):
        group.backend.check_usable("all_reduce")


class StuckPeer:
    """A heartbeat stand-in that reports the next rank as stuck."""

    def __init__(self, rank):
        self.rank = rank

    def stuck(self, members):
        return self.rank, f"rank {self.rank} made no progress (test)"


def test_device_wait_on_a_stuck_peer_aborts_nccl_and_raises_rank_failure(world):
    # the heartbeat's RankFailure must stop the device kernel too, as a timeout does
    group = _device_world(world)
    fake = group.backend.nccl_comm = FakeNccl()
    peer = (world.rank + 1) % world.world_size
    monitor = group.backend.monitor
    monitor.heartbeat, previous = StuckPeer(peer), monitor.heartbeat
    try:
        with pytest.raises(RankFailure, match="no progress"):
            group.backend.wait(_Pending(event=FakeEvent()), op="all_reduce", seq=4, timeout_s=30)
    finally:
        monitor.heartbeat = previous
    assert fake.aborted
    with pytest.raises(CollectiveError, match="aborted"):
        group.backend.check_usable("all_reduce")


def test_nccl_async_error_aborts_and_raises_collective_error(world):
    group = _device_world(world)
    fake = group.backend.nccl_comm = FakeNccl(error="NCCL_ERROR_REMOTE_ERROR: peer gone")
    with pytest.raises(CollectiveError, match="peer gone"):
        group.backend.wait(_Pending(event=FakeEvent()), op="all_gather", seq=3, timeout_s=30)
    assert fake.aborted and "NCCL error" in group.backend.aborted


def test_mpi_requests_still_complete_through_a_device_backend(world):
    group = _device_world(world)
    request = group.backend.comm.Ibarrier()
    group.backend.wait(_Pending(requests=[request]), op="barrier", seq=1, timeout_s=30)
    assert request == MPI.REQUEST_NULL or MPI.Request.Testall([request])
