"""The shared-memory all_reduce keeps the no-silent-hang contract (each test is its own job).

The path is forced for every size (RTXMPI_SHM_MIN_BYTES=0, 4 KiB chunks), so the all_reduce that
a rank misses, or arrives late to, is one the shared-memory (or, at 4 ranks with pretend nodes of
2, the hierarchical) path would run, blocking or (queued path) async_op=True. Every
test asserts the runtime fired first, not the outer timeout; bad RTXMPI_SHM* settings are refused
on every rank.
"""
import ast
import re

import pytest

TIMEOUT_S = 2.0
SHM_ENV = {"RTXMPI_SHM_MIN_BYTES": 0, "RTXMPI_SHM_CHUNK_BYTES": 4096, "RTXMPI_SHM_SMALL_BYTES": 0}
# the one-synchronization mailbox for the 200 KB all_reduce instead (its wait is a flag poll)
MAILBOX_ENV = {**SHM_ENV, "RTXMPI_SHM_SMALL_BYTES": 1 << 20}
REPORT = re.compile(r"^TIMEOUT rank=(\d+) elapsed_s=([\d.]+) op=(\S+) seq=(\d+) "
                    r"missing=(\[[\d, ]*\])")

JOB = """
import time
import numpy as np
import rtxmpi

world = rtxmpi.init(check={check}, timeout_s={timeout_s})
x = np.full(50_000, world.rank + 1, np.float32)
world.all_reduce(x)                   # world seq 1: the path works and every rank is up
assert (x == world.world_size * (world.world_size + 1) / 2).all(), x[:4]
engine = world.backend._shm
print(f"ENGINE rank={{world.rank}} local_size={{engine.local_size}} nodes={{engine.nodes}}",
      flush=True)
if world.rank in {late}:
    time.sleep({sleep_s})
start = time.monotonic()
y = np.full(50_000, 1.0, np.float32)
try:
    if {async_op}:  # the queued cross-memory (or mailbox) path: launched, then waited for
        work = world.all_reduce(y, async_op=True)
        print(f"QUEUED rank={{world.rank}} pending={{len(engine._queue)}}", flush=True)
        work.wait()
    else:
        world.all_reduce(y)
except rtxmpi.CollectiveTimeout as exc:
    print(f"TIMEOUT rank={{world.rank}} elapsed_s={{time.monotonic() - start:.3f}} op={{exc.op}} "
          f"seq={{exc.seq}} missing={{exc.missing}}", flush=True)
    raise
assert (y == world.world_size).all(), y[:4]
print(f"COMPLETED rank={{world.rank}}", flush=True)
"""


def job(*, check, late, sleep_s, async_op=False):
    return JOB.format(check=check, timeout_s=TIMEOUT_S, late=late, sleep_s=sleep_s,
                      async_op=async_op)


def engines(launch):
    return sorted(launch.lines("ENGINE "))


@pytest.mark.parametrize("check,env,async_op", [(True, SHM_ENV, False), (False, SHM_ENV, False),
                                                (False, MAILBOX_ENV, False),
                                                (False, SHM_ENV, True), (False, MAILBOX_ENV, True)],
                         ids=["checking", "unchecked", "mailbox", "async-queued",
                              "async-mailbox"])
def test_missing_rank_times_out_on_the_other_rank(run_mpi, check, env, async_op):
    launch = run_mpi(job(check=check, late=[1], sleep_s=60, async_op=async_op), n=2, **env)
    if async_op:  # rank 0 launched and found rank 1 missing: its call waits in the queue
        assert launch.lines("QUEUED") == ["QUEUED rank=0 pending=1"], launch
    assert not launch.outer_timeout and launch.returncode != 0, launch
    assert engines(launch) == [f"ENGINE rank={r} local_size=2 nodes=1" for r in (0, 1)], launch
    assert not launch.lines("COMPLETED"), launch
    reports = [REPORT.match(line).groups() for line in launch.lines("TIMEOUT ")]
    assert [r[0] for r in reports] == ["0"], launch
    _, elapsed_s, op, seq, missing = reports[0]
    assert (op, seq, ast.literal_eval(missing)) == ("all_reduce", "2", [1]), launch
    assert TIMEOUT_S * 0.9 <= float(elapsed_s) < 3 * TIMEOUT_S, launch


def test_hierarchical_missing_ranks_time_out_on_the_others(run_mpi):
    launch = run_mpi(job(check=False, late=[1, 2], sleep_s=60), n=4, RTXMPI_SHM_NODE_SIZE=2,
                     **SHM_ENV)
    assert not launch.outer_timeout and launch.returncode != 0, launch
    assert engines(launch) == [f"ENGINE rank={r} local_size=2 nodes=2" for r in range(4)], launch
    reports = {int(m.group(1)): m.groups() for m in map(REPORT.match, launch.lines("TIMEOUT "))}
    assert sorted(reports) == [0, 3], launch
    for _, elapsed_s, op, seq, missing in reports.values():
        assert (op, seq, ast.literal_eval(missing)) == ("all_reduce", "2", [1, 2]), launch
        assert float(elapsed_s) < 3 * TIMEOUT_S, launch


@pytest.mark.parametrize("env", [SHM_ENV, MAILBOX_ENV], ids=["cma", "mailbox"])
def test_late_rank_within_the_probe_window_completes(run_mpi, env):
    # the deadline passes at 2 s, the diagnosis listens until 4 s, rank 1 arrives at 3 s
    launch = run_mpi(job(check=False, late=[1], sleep_s=1.5 * TIMEOUT_S), n=2, **env)
    assert launch.returncode == 0 and not launch.outer_timeout, launch
    assert sorted(launch.lines("COMPLETED")) == ["COMPLETED rank=0", "COMPLETED rank=1"], launch


def test_bad_setting_is_refused_on_every_rank(run_mpi):
    launch = run_mpi("import rtxmpi\nrtxmpi.init()\nprint('STARTED', flush=True)\n", n=2,
                     RTXMPI_SHM_CHUNK_BYTES="64k")
    assert not launch.outer_timeout and launch.returncode != 0, launch
    assert not launch.lines("STARTED"), launch
    assert launch.stderr.count("RTXMPI_SHM_CHUNK_BYTES='64k' is not an integer") == 2, launch
