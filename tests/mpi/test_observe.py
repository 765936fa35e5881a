"""rtxmpi.observe across ranks: clock offsets, the merged timeline and the Observer's step values."""
import numpy as np
import pytest

import rtxmpi
from rtxmpi.observe import trace
from rtxmpi.observe.observer import Observer
from rtxmpi.observe.timeline import estimate_clock_offset, gather_events


@pytest.fixture
def world():
    return rtxmpi.init()


def test_clock_offset_on_one_host_is_small(world):
    offset = estimate_clock_offset(world)
    if world.rank == 0:
        assert offset == 0.0
    assert abs(offset) < 20_000  # one host, one CLOCK_MONOTONIC: the estimate's error only


def test_gather_events_brings_every_rank_to_rank_0_shifted_by_its_offset(world):
    mine = [("work", "compute", 1000.0 * world.rank, 5.0, {"rank": world.rank})]
    merged = gather_events(world, mine, offset_us=10.0 * world.rank)
    if world.rank != 0:
        assert merged is None
        return
    assert [r["rank"] for r in merged] == list(range(world.world_size))
    for r in merged:
        (name, cat, start, dur, args), = r["events"]
        assert start == 1000.0 * r["rank"] + 10.0 * r["rank"] and args == {"rank": r["rank"]}


def test_observer_step_values_and_verdict(world, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run")) if world.rank == 0 else None
    box = np.zeros(1, np.int64)
    path = np.frombuffer((run_dir or "").ljust(4096).encode(), np.uint8).copy()  # one host: rank 0 folder
    world.broadcast(path, src=0)
    run_dir = path.tobytes().decode().strip()
    obs = Observer(world, run_dir=run_dir, tokens_per_step=100)
    grads = np.ones(1 << 16, np.float32)
    try:
        for step in (1, 2, 3):
            obs.begin_step(step)
            with obs.span("forward", "forward"):
                box += 1
            world.all_reduce(grads)
            values = obs.end_step(step)
            assert values["allreduce_pct"] > 0 and 0 <= values["overlap_pct"] <= 100
            if world.world_size > 1:
                assert values["net_bw_gbps"] > 0
    finally:
        verdict = obs.close()
    assert not trace.enabled()
    if world.rank == 0:
        assert verdict is not None and verdict.steps == [1, 2, 3]
        assert verdict.numbers["world_size"] == world.world_size


def test_clock_offset_recovers_a_skewed_clock(world, monkeypatch):
    skew_us = 5e6 * world.rank  # rank r's clock runs r * 5 s ahead of rank 0's
    real = trace.now_us
    monkeypatch.setattr(trace, "now_us", lambda: real() + skew_us)
    offset = estimate_clock_offset(world)
    assert abs(offset + skew_us) < 20_000
