"""Admit new ranks into a running job (`rtxmpi join`, docs/elastic.md "Join") with examples/train.py.

A 2-rank `--elastic grow` job is asked for 2 more ranks while it trains: it spawns them at a step
boundary, hands them its state from memory, re-plans for 4 ranks and goes on; in deterministic
mode the rest of the run is bitwise the run resumed at 4 ranks from a checkpoint of that step. Bad
requests and a join with no free slot are refused while the job goes on; a rank lost during the
join is survived; a client with no job, or a job that does not answer, gets a clear error. Every
launch runs under a hard outer timeout.
"""
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import (MPIEXEC, REPO, ULFM_RECOVERABLE as ULFM, launch_env, resume_after_a_spawn_fault,
                      run_command)

from rtxmpi.checkpoint import load_checkpoint
from rtxmpi.elastic import admit

TRAIN = REPO / "examples" / "train.py"
STEPS = 12
ARGS = ["--model", "tiny", "--global-batch", "8", "--seq-len", "32", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--deterministic",
        "--steps", str(STEPS), "--ckpt-every", "4"]


def train(tmp, n, *extra, slots=None, outer_timeout_s=120, **env):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    where = ["-H", f"localhost:{slots}"] if slots else ["--oversubscribe"]
    argv = [MPIEXEC, *ULFM, "-n", str(n), *where, "--mca", "mpi_yield_when_idle", "1", "--bind-to",
            "none", sys.executable, TRAIN, *ARGS, "--ckpt-dir", tmp / "ckpt", "--metrics-jsonl",
            tmp / "m.jsonl", *extra]
    return run_command(argv, outer_timeout_s=outer_timeout_s,
                       env=launch_env(**{"RTXMPI_CACHE_DIR": tmp.parent / "cache", "RTXMPI_TIMEOUT_S": 30,
                                         **env}))


def records(tmp):
    path = tmp / "m.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def join_cli(tmp, n, timeout_s=60):
    return subprocess.run([sys.executable, "-m", "rtxmpi.cli", "join", "--job", str(tmp / "ckpt"),
                           "-n", str(n), "--timeout-s", str(timeout_s)],
                          capture_output=True, text=True, timeout=timeout_s + 30, env=launch_env())


def when_logged(tmp, step, action, deadline_s=90):
    """Run action() on a thread once the metrics file holds `step`; returns (thread, results)."""
    results = []

    def wait():
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if any(r["step"] >= step for r in records(tmp)):
                results.append(action())
                return
            time.sleep(0.02)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, results


def test_join_2_to_4_is_bitwise_the_run_resumed_at_4_ranks(tmp_path):
    """`rtxmpi join -n 2` during a stall of step 4: the job admits 2 ranks at a step boundary S,
    the steps after S run at 4 ranks, and losses and final state equal a 2-rank run to S followed
    by a 4-rank --resume from its checkpoint of S."""
    run = tmp_path / "run"
    run.mkdir()
    client, answers = when_logged(run, 3, lambda: join_cli(run, 2))
    proc = train(run, 2, "--elastic", "grow", RTXMPI_FAULT="stall:0:4:forward:5")
    client.join()
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    cli = answers[0]
    assert cli.returncode == 0, cli.stderr
    assert "rtxmpi join: admitted 2 ranks: the world grew 2 -> 4 ranks" in cli.stderr, cli.stderr
    step = int(cli.stderr.rsplit("continuing from step ", 1)[1].split()[0])
    assert "elastic: spawned 2 joining ranks" in proc.stderr, str(proc)
    assert f"grew the world 2 -> 4 ranks; continuing from rank 0's replica at step {step}" in proc.stderr
    assert "completed at 4 ranks" in proc.stdout
    got = records(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # none twice or skipped
    assert [r["world_size"] for r in got] == [2] * step + [4] * (STEPS - step)
    # the reference: 2 ranks to step S with a checkpoint, then 4 ranks resumed from it
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = train(ref, 2, "--stop-after-step", str(step))
    assert proc.returncode == 0, str(proc)
    proc = train(ref, 4, "--resume")
    assert proc.returncode == 0, str(proc)
    assert [r["loss"] for r in got] == [r["loss"] for r in records(ref)]
    joined, resumed = (load_checkpoint(None, d / "ckpt", STEPS) for d in (run, ref))
    assert joined.world_size_saved == resumed.world_size_saved == 4
    for name in ("params", "adam.m", "adam.v", "adam.step"):
        assert np.array_equal(joined.read(name), resumed.read(name)), name


def test_bad_requests_and_no_free_slot_are_refused_and_the_job_goes_on(tmp_path):
    """Two slots for two ranks. A garbage request found at the start, a client that gives up
    while rank 0 stalls, a request for more ranks than the job's limit, and a valid one that
    finds no free slot: each gets its answer, and the job finishes at 2 ranks."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / admit.REQUEST).write_bytes(b"\x00garbage{")

    def clients():
        done = [join_cli(tmp_path, 1, timeout_s=1.5)]  # rank 0 stalls 6 s in step 3: no answer
        done.append(join_cli(tmp_path, 1000))  # over --max-ranks 8
        done.append(join_cli(tmp_path, 2))  # within the limit; the spawn finds no slot
        return done

    client, answers = when_logged(tmp_path, 2, clients)
    proc = train(tmp_path, 2, "--elastic", "grow", "--max-ranks", "8", slots=2,
                 RTXMPI_FAULT="stall:0:3:forward:6,stall:0:6:forward:5")
    client.join()
    # prterun exits 213 once a spawn of the job has failed (docs/elastic.md): read the ranks' output
    assert not proc.outer_timeout and f"done: {STEPS} steps" in proc.stdout, str(proc)
    assert "join request refused: the request is not a JSON object" in proc.stderr, str(proc)
    slow, huge, no_slot = answers[0]
    assert slow.returncode == 1 and "did not take the request within 1.5 s (withdrawn)" in slow.stderr
    assert huge.returncode == 1, huge.stderr
    assert "refused: 2 + 1000 ranks is over this job's limit of 8 (--max-ranks)" in huge.stderr
    assert no_slot.returncode == 1, no_slot.stderr
    assert "refused: no free slot" in no_slot.stderr and "continues at 2 ranks" in no_slot.stderr
    assert "cannot admit 2 joining ranks" in proc.stderr
    for answer in (slow, huge, no_slot):
        assert "Traceback" not in answer.stderr
    got = records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert {r["world_size"] for r in got} == {2}
    assert "grew the world" not in proc.stderr


def test_a_rank_lost_during_the_join_is_survived(tmp_path):
    """A request waiting when the job starts is agreed at step 1's boundary; launch rank 1 dies
    while the state is handed to the new ranks (phase 'grow' of step 1): the merged world shrinks
    4 -> 3, spawns one more rank and the join completes at 4 ranks."""
    (tmp_path / "ckpt").mkdir()
    ident = admit.write_request(tmp_path / "ckpt", 2, timeout_s=120)
    proc = train(tmp_path, 2, "--elastic", "grow", RTXMPI_FAULT="kill:1:1:grow")
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "[rtxmpi fault] kill launch rank 1 step 1 phase grow" in proc.stderr, str(proc)
    assert "shrank the world 4 -> 3 ranks" in proc.stderr
    assert "grew the world 3 -> 4 ranks" in proc.stderr
    answer = admit.read_answer(tmp_path / "ckpt", ident)
    assert answer is not None and answer["admitted"] and answer["world_size"] == 4, answer
    got = records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["world_size"] for r in got] == [2] + [4] * (STEPS - 1)
    assert load_checkpoint(None, tmp_path / "ckpt", STEPS).world_size_saved == 4


def test_a_rank_lost_entering_the_joins_spawn_is_survived(tmp_path):
    """A request waiting when the job starts is agreed at step 1's boundary; launch rank 1 dies
    as the members enter the MPI_Comm_spawn of the joining ranks (phase 'spawn', the replica at
    step 1). Either the spawn fails at once: the survivor's next collective reports the loss, it
    recovers in its process, spawns again and the join is admitted at 4 ranks; the processes
    the failed spawn had started, blocked in MPI_Init, end at their deadline
    (rtxmpi/spawn_deadline.py; 12 s here). Or the survivor, the spawn's root, stays blocked in
    it: the spawn watchdog ends it (exit 5) and the relaunch with --resume, as `rtxmpi run` does
    it, finishes. Never a hang, every step once. (After a failed spawn Open MPI's launcher may
    end non-zero once every rank is done, docs/elastic.md.)"""
    (tmp_path / "ckpt").mkdir()
    ident = admit.write_request(tmp_path / "ckpt", 2, timeout_s=120)
    proc = train(tmp_path, 2, "--elastic", "grow", RTXMPI_FAULT="kill:1:1:spawn", RTXMPI_TIMEOUT_S=12)
    assert not proc.outer_timeout, str(proc)
    assert "[rtxmpi fault] kill launch rank 1 step 1 phase spawn" in proc.stderr, str(proc)
    got = records(tmp_path)
    if [r["step"] for r in got] == list(range(1, STEPS + 1)):  # recovered in its process
        assert "shrank the world 2 -> 1 ranks" in proc.stderr and "-> 4 ranks" in proc.stderr
        assert "join refused" not in proc.stderr, str(proc)
        answer = admit.read_answer(tmp_path / "ckpt", ident)
        assert answer is not None and answer["admitted"] and answer["world_size"] == 4, answer
        assert got[0]["world_size"] == 2 and got[-1]["world_size"] == 4
        assert load_checkpoint(None, tmp_path / "ckpt", STEPS).world_size_saved == 4
    else:  # the root blocked in the spawn
        resume_after_a_spawn_fault(proc, lambda: train(tmp_path, 2, "--elastic", "grow", "--resume"))
        assert [r["step"] for r in records(tmp_path)] == list(range(1, STEPS + 1))


def test_a_job_without_grow_refuses_and_no_job_is_an_error(tmp_path):
    """--elastic shrink: the request is refused with the reason; after the job: no job at DIR."""
    (tmp_path / "ckpt").mkdir()
    ident = admit.write_request(tmp_path / "ckpt", 1, timeout_s=120)
    proc = train(tmp_path, 2, "--elastic", "shrink")
    assert proc.returncode == 0, str(proc)
    answer = admit.read_answer(tmp_path / "ckpt", ident)
    assert answer is not None and not answer["admitted"]
    assert "joining needs --elastic grow" in answer["reason"]
    done = join_cli(tmp_path, 1)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error: no job running at" in done.stderr, done.stderr
