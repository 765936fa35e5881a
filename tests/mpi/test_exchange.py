"""rtxmpi.exchange: JSON values over a ProcessGroup as typed buffers (no pickle), at any world
size."""
import pytest

from rtxmpi.exchange import all_gather_json, broadcast_json


def test_broadcast_json_gives_src_s_value_on_every_rank(world):
    src = world.world_size - 1
    mine = {"rank": world.rank, "hosts": ["a" * world.rank], "ms": 0.1 + world.rank, "none": None}
    got = broadcast_json(world, mine if world.rank == src else None, src=src)
    assert got == {"rank": src, "hosts": ["a" * src], "ms": 0.1 + src, "none": None}


def test_all_gather_json_keeps_rank_order_and_values_of_different_lengths(world):
    values = all_gather_json(world, ["x" * (3 * world.rank), world.rank, 1 / 3, "h\u00e9te"])
    assert values == [["x" * (3 * r), r, 1 / 3, "h\u00e9te"] for r in range(world.world_size)]


def test_a_value_json_cannot_encode_is_a_type_error_on_every_rank(world):
    src = world.world_size - 1
    with pytest.raises(TypeError, match=f"rank {src}'s value cannot be sent as JSON"):
        broadcast_json(world, {1, 2} if world.rank == src else None, src=src)
    with pytest.raises(TypeError, match="rank 0's value cannot be sent as JSON"):
        all_gather_json(world, object() if world.rank == 0 else "fine")
    assert broadcast_json(world, "after", src=0) == "after"  # the group still works
