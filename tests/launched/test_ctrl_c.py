"""Ctrl-C (SIGINT) with examples/train.py as users launch it (README, docs/elastic.md).

A terminal's Ctrl-C is SIGINT to its foreground process group. Under `rtxmpi run` (mpiexec in a
session of its own) that is the supervisor, which stops the ranks through mpiexec: one agreed
step, a committed checkpoint, one line saying where, exit 130. A one-process run handles it
itself, and a second Ctrl-C stops it at once. Bare mpiexec (Open MPI's prterun) kills the ranks
within about 0.5 s (measured: SIGCONT, SIGTERM 0.25 s later, SIGKILL 0.25 s after that): only a
step and a save that fit in that time are saved, but no committed checkpoint is lost and the
directory is not left locked.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command

from rtxmpi.checkpoint import latest_step, verify_checkpoint
from rtxmpi.checkpoint.lock import LOCK_FILE

TRAIN = REPO / "examples" / "train.py"
ARGS = ["--model", "tiny", "--global-batch", "8", "--seq-len", "32", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
EXIT_INTERRUPTED = 130
STOPPED = re.compile(r"stopped after step (\d+) \(interrupted by Ctrl-C\); checkpoint of step (\d+) "
                     r"committed in (\S+); continue with --resume")


def start(argv, tmp_path, **env):
    """Start `argv` as a terminal starts a foreground job: a process group of its own."""
    return subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env=launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache", **env))


def finish(job, timeout_s=90):
    try:
        return job.communicate(timeout=timeout_s)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()


def steps_logged(metrics):
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def wait_for_steps(metrics, n, job, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while steps_logged(metrics) < n and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert steps_logged(metrics) >= n, f"no {n} steps logged: {finish(job, 5)}"


def train_args(tmp_path, *extra, steps=100000):
    return [*ARGS, "--steps", steps, "--ckpt-dir", tmp_path / "ckpt", "--metrics-jsonl",
            tmp_path / "m.jsonl", *extra]


def test_ctrl_c_under_rtxmpi_run_checkpoints_at_one_step_and_exits_130(tmp_path):
    """No --ckpt-every: the stop itself commits the checkpoint; --resume continues after it."""
    supervisor = [sys.executable, "-m", "rtxmpi.cli", "run", "-n", "2", "--grace-s", "60",
                  "--mpiexec", " ".join(mpiexec_argv(2)[:1] + mpiexec_argv(2)[3:]), "--",
                  sys.executable, TRAIN, *train_args(tmp_path)]
    job = start(supervisor, tmp_path)
    wait_for_steps(tmp_path / "m.jsonl", 3, job)
    os.killpg(job.pid, signal.SIGINT)  # the terminal's Ctrl-C
    stdout, stderr = finish(job)
    assert job.returncode == EXIT_INTERRUPTED, stdout + stderr
    (line,) = [m for m in map(STOPPED.search, stdout.splitlines()) if m]
    assert line.group(1) == line.group(2) and line.group(3) == str(tmp_path / "ckpt")
    stopped = int(line.group(1))
    assert latest_step(tmp_path / "ckpt") == stopped == steps_logged(tmp_path / "m.jsonl")
    assert "SIGINT: asking the ranks to stop (SIGUSR2 via mpiexec)" in stderr
    assert "attempt 2" not in stderr and "interrupted by Ctrl-C (checkpoint committed)" in stderr
    assert (tmp_path / "ckpt" / LOCK_FILE).read_text() == ""  # released
    proc = run_command(mpiexec_argv(2) + [sys.executable, TRAIN,
                                          *train_args(tmp_path, "--resume", steps=stopped + 2)],
                       outer_timeout_s=90, env=launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache"))
    assert proc.returncode == 0, str(proc)
    assert f"continuing at step {stopped + 1}" in proc.stdout


def test_sigint_to_one_rank_stops_every_rank_at_one_step_with_exit_130(tmp_path):
    proc = run_command(mpiexec_argv(2) + [sys.executable, TRAIN, *train_args(tmp_path, steps=20)],
                       outer_timeout_s=90, env=launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache",
                                                          RTXMPI_FAULT="int:1:7:backward"))
    assert proc.returncode == EXIT_INTERRUPTED, str(proc)
    assert STOPPED.search(proc.stdout).group(1) == "7" and latest_step(tmp_path / "ckpt") == 7
    assert steps_logged(tmp_path / "m.jsonl") == 7


def test_ctrl_c_to_one_process_checkpoints_and_a_second_stops_at_once(tmp_path):
    job = start([sys.executable, TRAIN, *train_args(tmp_path)], tmp_path, RTXMPI_ALLOW_SINGLETON=1)
    wait_for_steps(tmp_path / "m.jsonl", 3, job)
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr = finish(job)
    assert job.returncode == EXIT_INTERRUPTED, stdout + stderr
    stopped = int(STOPPED.search(stdout).group(1))
    assert latest_step(tmp_path / "ckpt") == stopped
    assert "SIGINT: stop requested" in stderr and "Ctrl-C again: stop at once" in stderr

    # stalled inside a step: the first Ctrl-C waits for its end, the second does not
    job = start([sys.executable, TRAIN, *train_args(tmp_path, "--resume")], tmp_path,
                RTXMPI_ALLOW_SINGLETON=1, RTXMPI_FAULT=f"stall:0:{stopped + 2}")
    wait_for_steps(tmp_path / "m.jsonl", stopped + 1, job)
    time.sleep(0.5)  # into the stall
    os.killpg(job.pid, signal.SIGINT)
    time.sleep(0.5)
    assert job.poll() is None  # still in the stalled step, stop requested
    sent = time.monotonic()
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr = finish(job, 30)
    assert job.returncode == -signal.SIGINT and time.monotonic() - sent < 10, stdout + stderr
    assert latest_step(tmp_path / "ckpt") == stopped  # nothing new committed


@pytest.mark.parametrize("target", ["process group", "mpiexec alone"])
def test_ctrl_c_to_bare_mpiexec_loses_no_committed_checkpoint_and_no_lock(tmp_path, target):
    job = start(mpiexec_argv(2) + [sys.executable, TRAIN, *train_args(tmp_path, "--ckpt-every", "3")],
                tmp_path)
    wait_for_steps(tmp_path / "m.jsonl", 7, job)
    sent = time.monotonic()
    if target == "process group":
        os.killpg(job.pid, signal.SIGINT)
    else:
        os.kill(job.pid, signal.SIGINT)
    stdout, stderr = finish(job, 60)
    assert job.returncode not in (0, EXIT_INTERRUPTED) and time.monotonic() - sent < 20, stdout + stderr
    committed = latest_step(tmp_path / "ckpt")  # a --ckpt-every one, or the stop's own when the
    assert committed >= 6                          # step and the save fit in SIGTERM's 0.25 s
    verify_checkpoint(tmp_path / "ckpt", committed)
    proc = run_command(mpiexec_argv(2) + [sys.executable, TRAIN,
                                          *train_args(tmp_path, "--resume", steps=committed + 1)],
                       outer_timeout_s=90, env=launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache"))
    assert proc.returncode == 0, str(proc)  # the killed job's lock went with its processes
    assert f"continuing at step {committed + 1}" in proc.stdout
