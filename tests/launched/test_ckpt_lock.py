"""Two examples/train.py jobs on one --ckpt-dir through mpiexec (docs/checkpoint.md, "One job per
directory"): the second exits 2 with one line per rank naming the holder, the first finishes and
every checkpoint in the directory is its own; jobs started at the same moment: exactly one runs.
Both lock modes (flock; the O_EXCL lease file forced with RTXMPI_CKPT_LOCK=lease). After an
elastic shrink that lost rank 0, the new rank 0 holds the job's lease."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command

from rtxmpi.checkpoint import list_checkpoints, load_checkpoint
from rtxmpi.checkpoint.lock import LEASE_FILE, LOCK_FILE

TRAIN = REPO / "examples" / "train.py"
ARGS = ["--model", "tiny", "--global-batch", "8", "--seq-len", "32", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--ckpt-every", "5"]
MODES = {"flock": LOCK_FILE, "lease": LEASE_FILE}
HELD = "[rtxmpi fault] stop launch rank 0 step 7 phase forward"


def start(tmp_path, ckpt, steps, mode, name):
    """A 2-rank job whose rank 0 stops itself (SIGSTOP) in step 7, holding the lock until the test
    resumes it (resume_stopped), so a second job started meanwhile finds it running, however
    slowly the machine starts processes."""
    argv = mpiexec_argv(2) + [sys.executable, TRAIN, *ARGS, "--steps", steps, "--ckpt-dir", ckpt,
                              "--metrics-jsonl", tmp_path / f"{name}.jsonl"]
    env = launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache", RTXMPI_JOB_ID=name,
                     RTXMPI_FAULT="stop:0:7:forward", RTXMPI_TIMEOUT_S=60,
                     **({"RTXMPI_CKPT_LOCK": "lease"} if mode == "lease" else {}))
    return subprocess.Popen(["timeout", "--kill-after=5", "120"] + [str(a) for a in argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def stopped_pids(job):
    """The stopped processes of a job started by start() (its own session)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or gone meanwhile
            continue
        if fields[0] == "T" and int(fields[3]) == job.pid:
            pids.append(int(entry))
    return pids


def resume_stopped(jobs, timeout_s=60):
    """Wait until every job still running has a stopped process (its rank 0 in step 7), then
    continue them all (SIGCONT)."""
    deadline = time.monotonic() + timeout_s
    waiting = [job for job in jobs if job.poll() is None]
    while waiting and time.monotonic() < deadline:
        for job in list(waiting):
            pids = stopped_pids(job)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            if pids or job.poll() is not None:
                waiting.remove(job)
        time.sleep(0.05)


def wait_for_one_exit(jobs, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(job.poll() is None for job in jobs):
        time.sleep(0.05)


def refusal_lines(stderr):
    return [line for line in stderr.splitlines() if "is in use by" in line]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_second_job_on_a_locked_dir_exits_2_naming_the_holder_on_every_rank(tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    first = start(tmp_path, ckpt, 20, mode, "job-a")
    lock_file = ckpt / MODES[mode]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and first.poll() is None and not (
            (tmp_path / "job-a.jsonl").exists() and (tmp_path / "job-a.jsonl").read_text()):
        time.sleep(0.05)
    holder = json.loads(lock_file.read_text())
    second = start(tmp_path, ckpt, 20, mode, "job-b")
    out_b, err_b = second.communicate(timeout=130)
    resume_stopped([first])
    out_a, err_a = first.communicate(timeout=130)
    assert first.returncode == 0, out_a + err_a
    assert HELD in err_a, err_a  # held in step 7 until the second job had been refused
    assert second.returncode == 2, out_b + err_b
    lines = refusal_lines(err_b)
    assert sorted(line.split(":")[0:2] for line in lines) == [["error", " rank 0"], ["error", " rank 1"]]
    for line in lines:
        assert f"checkpoint directory {ckpt} is in use by job job-a (host {holder['host']}, pid " \
               f"{holder['pid']}, since " in line, line
    assert not (tmp_path / "job-b.jsonl").exists() or not (tmp_path / "job-b.jsonl").read_text()
    steps = [c.step for c in list_checkpoints(ckpt) if c.committed]
    assert steps == [5, 10, 15, 20]
    run_ids = {load_checkpoint(None, ckpt, s).metadata["run_id"] for s in steps}
    assert len(run_ids) == 1  # every checkpoint is job-a's own
    assert not lock_file.exists() or not lock_file.read_text()  # released at its end


@pytest.mark.parametrize("mode", sorted(MODES))
def test_jobs_started_at_the_same_moment_one_runs_one_is_refused(tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    jobs = [start(tmp_path, ckpt, 20, mode, name) for name in ("job-a", "job-b")]
    wait_for_one_exit(jobs)  # the refused one, while the other is held in step 7
    resume_stopped(jobs)
    results = [(job.communicate(timeout=130), job.returncode) for job in jobs]
    codes = sorted(code for _, code in results)
    assert codes == [0, 2], results
    (winner,) = [name for name, (_, code) in zip(("job-a", "job-b"), results) if code == 0]
    (out, err), _ = [r for r in results if r[1] == 2][0]
    assert len(refusal_lines(err)) == 2 and all(f"in use by job {winner} " in line
                                                for line in refusal_lines(err)), err
    assert [c.step for c in list_checkpoints(ckpt) if c.committed] == [5, 10, 15, 20]
    assert len({load_checkpoint(None, ckpt, s).metadata["run_id"] for s in (5, 10, 15, 20)}) == 1
    assert re.search(r"done: 20 steps", results[("job-a", "job-b").index(winner)][0][0])
    assert HELD in results[("job-a", "job-b").index(winner)][0][1]


def test_after_a_shrink_that_lost_rank_0_the_new_rank_0_holds_the_lease(tmp_path):
    """--elastic shrink (ULFM): launch rank 0, the lease's holder, is killed; the survivors' new
    rank 0 takes over its own job's lease without a warning, keeps saving, and releases it."""
    ulfm = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca",
            "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "10"]
    mpiexec = mpiexec_argv(4)
    ckpt = tmp_path / "ckpt"
    proc = run_command(mpiexec[:1] + ulfm + mpiexec[1:] + [
        sys.executable, TRAIN, *ARGS, "--steps", "12", "--ckpt-dir", ckpt, "--elastic", "shrink"],
        outer_timeout_s=120, env=launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache",
                                            RTXMPI_CKPT_LOCK="lease", RTXMPI_TIMEOUT_S=30,
                                            RTXMPI_FAULT="kill:0:7:backward"))
    assert proc.returncode == 0 and "shrank the world 4 -> 3" in proc.stderr, str(proc)
    assert "took over" not in proc.stderr and "is in use by" not in proc.stderr
    assert [c.step for c in list_checkpoints(ckpt) if c.committed] == [5, 10, 12]
    assert load_checkpoint(None, ckpt, 12).world_size_saved == 3
    assert not (ckpt / LEASE_FILE).exists()  # released by the new rank 0, whose lease it was
