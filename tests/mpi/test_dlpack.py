"""Arrays of other frameworks in the collectives (rtxmpi.comm.arrays), at any world size.

A DLPack object that is not numpy's (a minimal one defined here, so that CI without torch covers
the path) and, when torch is installed, torch tensors: an in-place collective changes the
caller's own memory and returns the caller's object; a new result comes back as the caller's kind.
"""
import numpy as np
import pytest


class Foreign:
    """The least an array of another framework offers: DLPack export of a numpy buffer."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_a_foreign_array_is_reduced_in_its_own_memory(world):
    buf = np.full(5, world.rank + 1.0)
    x = Foreign(buf)
    assert world.all_reduce(x) is x
    assert buf.tolist() == [world.world_size * (world.world_size + 1) / 2] * 5
    out = world.all_gather(Foreign(np.array([world.rank])))  # no from_dlpack in its module: numpy
    assert type(out) is np.ndarray and out.tolist() == list(range(world.world_size))


torch = pytest.importorskip("torch")


def test_all_reduce_changes_the_tensor_itself_and_returns_it(world):
    t = torch.full((3, 4), float(world.rank + 1))
    address = t.data_ptr()
    assert world.all_reduce(t, op="sum") is t
    assert t.data_ptr() == address
    assert torch.equal(t, torch.full((3, 4), world.world_size * (world.world_size + 1) / 2))
    world.all_reduce(t, op="avg")  # the average of equal values: unchanged
    assert torch.equal(t, torch.full((3, 4), world.world_size * (world.world_size + 1) / 2))


def test_a_strided_view_is_reduced_into_the_base_tensor(world):
    base = torch.zeros(4, 6, dtype=torch.float64)
    view = base[:, ::2]  # every other column: not contiguous
    view.fill_(1.0)
    assert world.all_reduce(view) is view
    assert torch.equal(base[:, ::2], torch.full((4, 3), float(world.world_size)))
    assert torch.equal(base[:, 1::2], torch.zeros(4, 3, dtype=torch.float64))  # untouched


def test_new_results_come_back_as_tensors(world):
    n = world.world_size
    gathered = world.all_gather(torch.tensor([world.rank, world.rank], dtype=torch.int64))
    assert isinstance(gathered, torch.Tensor) and gathered.tolist() == [r for r in range(n) for _ in (0, 1)]
    shard = world.reduce_scatter(torch.ones(2 * n, 3), op="sum")
    assert isinstance(shard, torch.Tensor) and torch.equal(shard, torch.full((2, 3), float(n)))
    exchanged = world.all_to_all(torch.full((n,), float(world.rank)))
    assert isinstance(exchanged, torch.Tensor) and exchanged.tolist() == [float(r) for r in range(n)]


def test_broadcast_and_async_work_return_the_callers_kind(world):
    t = torch.full((3,), float(world.rank))
    assert world.broadcast(t, src=world.world_size - 1) is t
    assert t.tolist() == [float(world.world_size - 1)] * 3
    work = world.all_reduce(t, async_op=True)
    assert work.wait() is t and t.tolist() == [float(world.world_size * (world.world_size - 1))] * 3
    gathered = world.all_gather(torch.ones(1), async_op=True).wait()
    assert isinstance(gathered, torch.Tensor) and gathered.tolist() == [1.0] * world.world_size


@pytest.mark.mpi(min_size=2)
def test_send_and_recv_move_tensors(world):
    if world.rank == 0:
        world.send(torch.arange(4, dtype=torch.float32), dst=1)
    elif world.rank == 1:
        into = torch.zeros(4)
        assert world.recv(into, src=0) is into and into.tolist() == [0.0, 1.0, 2.0, 3.0]
    world.barrier()


def test_a_tensor_that_cannot_be_viewed_is_a_type_error_on_every_rank(world, assert_raised_on_every_rank):
    assert_raised_on_every_rank(world, lambda: world.all_reduce(torch.ones(2, requires_grad=True)),
                                TypeError, ["all_reduce: a torch.Tensor cannot be viewed", "detach"])
