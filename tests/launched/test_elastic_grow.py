"""Replace lost ranks after a shrink (`--elastic grow`, docs/elastic.md) with examples/train.py.

A rank SIGKILLed at step k: the survivors shrink, spawn a replacement, hand it the replica from
memory and go on at 4 ranks; in deterministic mode the run is bitwise the run that never lost a
rank. A rank lost during the handover is survived the same way. With no free slot the survivors
keep running shrunk and say so at every attempt. Every launch runs under a hard outer timeout.
"""
import json
import sys
import threading
import time

import numpy as np
import pytest
from conftest import (MPIEXEC, REPO, ULFM_RECOVERABLE as ULFM, launch_env, resume_after_a_spawn_fault,
                      run_command)

from rtxmpi.checkpoint import load_checkpoint

TRAIN = REPO / "examples" / "train.py"
STEPS = 12
ARGS = ["--model", "tiny", "--global-batch", "8", "--seq-len", "32", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--deterministic",
        "--steps", str(STEPS), "--ckpt-every", "4"]


def train(tmp, *extra, slots=None, outer_timeout_s=120, **env):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    where = ["-H", f"localhost:{slots}"] if slots else ["--oversubscribe"]
    argv = [MPIEXEC, *ULFM, "-n", "4", *where, "--mca", "mpi_yield_when_idle", "1", "--bind-to",
            "none", sys.executable, TRAIN, *ARGS, "--ckpt-dir", tmp / "ckpt", "--metrics-jsonl",
            tmp / "m.jsonl", *extra]
    return run_command(argv, outer_timeout_s=outer_timeout_s,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp.parent / "cache", RTXMPI_TIMEOUT_S=30, **env))


def records(tmp):
    return [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 4-rank run, launched the same way."""
    tmp = tmp_path_factory.mktemp("straight")
    proc = train(tmp)
    assert proc.returncode == 0, str(proc)
    return tmp


def assert_bitwise(run, straight):
    assert [r["loss"] for r in records(run)] == [r["loss"] for r in records(straight)]
    got = load_checkpoint(None, run / "ckpt", STEPS)
    want = load_checkpoint(None, straight / "ckpt", STEPS)
    assert got.world_size_saved == 4
    for name in ("params", "adam.m", "adam.v", "adam.step"):
        assert np.array_equal(got.read(name), want.read(name)), name


@pytest.mark.parametrize("fault", ["kill:2:7:backward:0.002", "kill:0:5:forward"])
def test_replace_after_a_kill_is_bitwise_the_run_that_never_lost_a_rank(straight, tmp_path, fault):
    proc = train(tmp_path, "--elastic", "grow", RTXMPI_FAULT=fault)
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "shrank the world 4 -> 3 ranks" in proc.stderr, str(proc)
    assert "grew the world 3 -> 4 ranks; continuing from rank 0's replica at step" in proc.stderr
    got = records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # none twice or skipped
    assert {r["world_size"] for r in got} == {4}  # back to full size before the next step
    assert_bitwise(tmp_path, straight)


def test_replace_in_a_tp2_dp2_layout_restores_the_layout_bitwise(tmp_path):
    """The survivors rebuild the full model from the shards (the dead rank's tp peer in the other
    replica holds its shard) and hand it over; the grown world runs tp 2 x dp 2 again."""
    hybrid = ["--global-batch", "12", "--tp", "2", "--dp", "2"]
    straight = tmp_path / "straight"
    straight.mkdir()
    proc = train(straight, *hybrid)
    assert proc.returncode == 0, str(proc)
    run = tmp_path / "run"
    run.mkdir()
    proc = train(run, *hybrid, "--elastic", "grow", RTXMPI_FAULT="kill:1:7:backward:0.002")
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "continuing from the shards of ranks" in proc.stderr, str(proc)
    assert "grew the world 3 -> 4 ranks; continuing from rank 0's replica at step 6" in proc.stderr
    assert [r["step"] for r in records(run)] == list(range(1, STEPS + 1))
    assert_bitwise(run, straight)


def test_a_rank_lost_during_the_handover_is_survived(straight, tmp_path):
    """Launch rank 1 dies in the 'grow' phase (after the merge, before the state transfer): the
    merged world shrinks again, spawns again, and the replica still comes from memory."""
    # the replica is at step 6 or 7 (the kill lands 2 ms into step 7's backward): both are armed
    proc = train(tmp_path, "--elastic", "grow",
                 RTXMPI_FAULT="kill:2:7:backward:0.002,kill:1:6:grow,kill:1:7:grow")
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert proc.stderr.count("shrank the world 4 -> 3 ranks") == 2, str(proc)
    assert proc.stderr.count("grew the world 3 -> 4 ranks") == 1, str(proc)
    assert "last committed checkpoint" not in proc.stderr
    assert [r["step"] for r in records(tmp_path)] == list(range(1, STEPS + 1))
    assert_bitwise(tmp_path, straight)


@pytest.mark.parametrize("fault", [
    "kill:2:7:backward:0.002,kill:1:6:spawn,kill:1:7:spawn",  # a survivor, before its spawn call
    "kill:2:7:backward:0.002,kill:0:6:spawn:0.3,kill:0:7:spawn:0.3",  # the root, inside it
])
def test_a_rank_lost_during_the_spawn_never_hangs_and_loses_nothing(straight, tmp_path, fault):
    """A survivor dies while the others spawn its replacement. MPI_Comm_spawn and the merge have
    no deadline of their own: the spawn watchdog revokes and, past RTXMPI_TIMEOUT_S, ends a rank
    still blocked (exit 5). Either the job recovers in the same processes and finishes at 4
    ranks, or (every spawning rank blocked) it ends and its relaunch from the checkpoint, as
    `rtxmpi run` does it, finishes; both bitwise the run that never lost a rank. (Open MPI's
    launcher may exit non-zero after every rank finished, once a spawn failed.)"""
    proc = train(tmp_path, "--elastic", "grow", RTXMPI_FAULT=fault)
    assert not proc.outer_timeout, str(proc)
    assert "phase spawn" in proc.stderr, str(proc)  # the second kill landed in the spawn phase
    finished = [r["step"] for r in records(tmp_path)] == list(range(1, STEPS + 1))
    if not finished:
        resume_after_a_spawn_fault(proc, lambda: train(tmp_path, "--elastic", "grow", "--resume"))
    assert [r["step"] for r in records(tmp_path)] == list(range(1, STEPS + 1))
    assert_bitwise(tmp_path, straight)


def test_no_free_slot_keeps_running_shrunk_and_retries(tmp_path):
    """Four slots for four ranks: PRRTE does not give the dead rank's slot back, so every spawn
    fails at once; the survivors finish at 3 ranks and rank 0 reports each attempt."""
    proc = train(tmp_path, "--elastic", "grow", "--grow-retry-s", "0.001", slots=4,
                 RTXMPI_FAULT="kill:3:4:backward")
    # every rank exits 0; prterun itself exits 213 once a spawn of the job has failed (measured,
    # Open MPI 5.0.11; docs/elastic.md), so the outcome is read from the ranks' output
    assert not proc.outer_timeout and "done: 9 steps (steps 4-12: this attempt)" in proc.stdout, str(proc)
    attempts = [line for line in proc.stderr.splitlines()
                if line.startswith("elastic: cannot replace 1 lost rank (spawn failed")]
    assert len(attempts) >= 2, str(proc)  # after the shrink, and again at step boundaries
    assert "continuing at 3 ranks, next attempt in 0.001 s" in attempts[0]
    got = records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got[-1]["world_size"] == 3
    assert "grew the world" not in proc.stderr


def test_a_host_that_comes_back_is_used_at_the_next_retry(tmp_path):
    """No free slot at the shrink; while the survivors run shrunk, the hosts file starts to name
    a host with a slot more, and the next step boundary's retry spawns there and grows back."""
    hosts = tmp_path / "hosts"
    steps_seen = threading.Event()

    def add_host():  # once step 6 is logged: rank 0 then stalls 3 s before step 7's spawn attempt
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not steps_seen.is_set():
            if (tmp_path / "m.jsonl").exists() and len(records(tmp_path)) >= 6:
                hosts.write_text("# returned by the scheduler\nlocalhost:5\n")
                return
            time.sleep(0.02)

    writer = threading.Thread(target=add_host, daemon=True)
    writer.start()
    proc = train(tmp_path, "--elastic", "grow", "--grow-retry-s", "0.001", "--grow-hosts", hosts,
                 slots=4, RTXMPI_FAULT="kill:3:4:backward,stall:0:7:forward:3")
    steps_seen.set()
    writer.join()
    assert not proc.outer_timeout and "done: 6 steps (steps 7-12: this attempt)" in proc.stdout, str(proc)
    # at the shrink (step 4) and before steps 5 and 6: the file did not exist yet
    assert proc.stderr.count("elastic: cannot replace 1 lost rank") == 3, str(proc)
    assert "grew the world 3 -> 4 ranks; continuing from rank 0's replica at step 6" in proc.stderr
    got = records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["world_size"] for r in got] == [4] * 3 + [3] * 3 + [4] * 6
    assert load_checkpoint(None, tmp_path / "ckpt", STEPS).world_size_saved == 4
