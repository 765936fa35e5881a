"""The checkpoint directory lock (rtxmpi.checkpoint.lock) in one process, against real holders in
other processes: flock and lease modes, dead and stale holders, relaunches, and the run id rule
of save_checkpoint(overwrite=True)."""
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rtxmpi.checkpoint import Shard, load_checkpoint, save_checkpoint
from rtxmpi.checkpoint import lock as lock_mod
from rtxmpi.checkpoint.lock import LEASE_FILE, LOCK_FILE, TAKEOVER_SUFFIX, lock_dir
from rtxmpi.errors import CheckpointError, ConfigError, DirectoryLocked

HOLD = ("import sys; from rtxmpi.checkpoint.lock import lock_dir; lock_dir(None, sys.argv[1]); "
        "print('held', flush=True); sys.stdin.read()")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("RTXMPI_CKPT_LOCK", "RTXMPI_CKPT_LEASE_S", "RTXMPI_JOB_ID", "SLURM_JOB_ID",
                 "RTXMPI_RESTART", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    yield
    lock_mod.release_all()


@pytest.fixture
def holder_process(tmp_path):
    """Start another process that takes the lock of a directory and holds it until closed."""
    started = []

    def start(ckpt_dir, **env):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(ckpt_dir)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        started.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(10)


def lease(tmp_path, **fields):
    record = {"job_id": "", "host": "elsewhere", "pid": 4242, "start_unix": 1.0e9, "attempt": [0, 0]}
    record.update(fields)
    path = tmp_path / LEASE_FILE
    path.write_text(json.dumps(record))
    return path


def test_flock_second_job_is_refused_naming_the_holder(tmp_path, holder_process):
    other = holder_process(tmp_path, RTXMPI_JOB_ID="job-a")
    with pytest.raises(DirectoryLocked, match=f"in use by job job-a \\(host {socket.gethostname()}, "
                                              f"pid {other.pid}, since ") as info:
        lock_dir(None, tmp_path)
    assert info.value.holder["pid"] == other.pid and isinstance(info.value, ConfigError)


def test_flock_is_free_once_the_holder_released_and_no_warning(tmp_path, holder_process, capfd):
    other = holder_process(tmp_path)
    other.stdin.close()  # the holder exits normally: its lock is released and its record emptied
    other.wait(10)
    assert (tmp_path / LOCK_FILE).read_text() == ""
    lock = lock_dir(None, tmp_path)
    assert lock.mode == "flock" and lock.taken_over is None and "warning" not in capfd.readouterr().err
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_flock_left_by_a_killed_job_is_taken_over_with_a_warning(tmp_path, holder_process, capfd):
    other = holder_process(tmp_path)
    other.kill()
    other.wait(10)
    lock = lock_dir(None, tmp_path)
    assert lock.owner and f"pid {other.pid}" in lock.taken_over
    warning = f"warning: took over checkpoint lock {tmp_path / LOCK_FILE} left by a job"
    assert warning in capfd.readouterr().err


def test_lease_mode_refuses_a_live_holder_and_takes_over_once_its_pid_is_gone(
        tmp_path, holder_process, monkeypatch, capfd):
    monkeypatch.setenv("RTXMPI_CKPT_LOCK", "lease")
    other = holder_process(tmp_path, RTXMPI_CKPT_LOCK="lease")
    assert json.loads((tmp_path / LEASE_FILE).read_text())["pid"] == other.pid
    with pytest.raises(DirectoryLocked, match=f"pid {other.pid}"):
        lock_dir(None, tmp_path)
    other.kill()
    other.wait(10)
    lock = lock_dir(None, tmp_path)
    assert lock.mode == "lease" and "its process is gone" in lock.taken_over
    assert "warning: took over stale checkpoint lease" in capfd.readouterr().err
    lock.release()
    assert not (tmp_path / LEASE_FILE).exists()


def test_lease_of_another_host_is_held_until_older_than_the_stale_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("RTXMPI_CKPT_LOCK", "lease")
    monkeypatch.setenv("RTXMPI_CKPT_LEASE_S", "60")
    path = lease(tmp_path, job_id="9", host="node-b")
    with pytest.raises(DirectoryLocked, match="job 9 \\(host node-b, pid 4242"):
        lock_dir(None, tmp_path)
    os.utime(path, (time.time() - 61, time.time() - 61))
    lock = lock_dir(None, tmp_path)
    assert "not refreshed for 61 s > 60 s" in lock.taken_over
    assert json.loads(path.read_text())["pid"] == os.getpid()


def test_lease_is_refreshed_while_held(tmp_path, monkeypatch):
    monkeypatch.setenv("RTXMPI_CKPT_LOCK", "lease")
    monkeypatch.setenv("RTXMPI_CKPT_LEASE_S", "0.4")
    lock = lock_dir(None, tmp_path)
    path = tmp_path / LEASE_FILE
    os.utime(path, (time.time() - 100, time.time() - 100))
    time.sleep(0.5)  # refreshed every 0.1 s
    assert time.time() - path.stat().st_mtime < 100 and lock.lost is None


def test_a_lease_taken_by_another_job_is_reported_lost(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("RTXMPI_CKPT_LOCK", "lease")
    monkeypatch.setenv("RTXMPI_CKPT_LEASE_S", "0.4")
    lock = lock_dir(None, tmp_path)
    lease(tmp_path, job_id="thief")
    time.sleep(0.5)
    assert lock.lost == "now held by job thief (host elsewhere, pid 4242, since 2001-09-09 01:46:40 UTC)"
    assert f"warning: checkpoint lease {tmp_path / LEASE_FILE} lost (now held by job thief" in \
        capfd.readouterr().err
    lock.release()
    assert json.loads((tmp_path / LEASE_FILE).read_text())["job_id"] == "thief"  # not ours to remove


def test_flock_unsupported_falls_back_to_a_lease(tmp_path, monkeypatch, capfd):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_mod.fcntl, "flock", no_flock)
    lock = lock_dir(None, tmp_path)
    assert lock.mode == "lease" and (tmp_path / LEASE_FILE).exists()
    assert "flock not supported" in capfd.readouterr().err


def test_an_earlier_attempt_of_the_same_job_is_taken_over_silently(tmp_path, monkeypatch):
    monkeypatch.setenv("RTXMPI_CKPT_LOCK", "lease")
    lease(tmp_path, job_id="77", attempt=[0, 0])  # rtxmpi run's attempt 1, on another node
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    with pytest.raises(DirectoryLocked):  # the same attempt is not an earlier one
        lock_dir(None, tmp_path)
    monkeypatch.setenv("RTXMPI_RESTART", "1")
    lock = lock_dir(None, tmp_path)
    assert lock.owner and lock.taken_over is None
    monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job with a later attempt: still refused
    lock.release()
    lease(tmp_path, job_id="77", attempt=[0, 0])
    with pytest.raises(DirectoryLocked):
        lock_dir(None, tmp_path)


def test_flock_relaunch_waits_for_the_earlier_attempt_to_exit(tmp_path, holder_process, monkeypatch):
    other = holder_process(tmp_path, RTXMPI_JOB_ID="run-1", RTXMPI_RESTART="0")
    monkeypatch.setenv("RTXMPI_JOB_ID", "run-1")
    monkeypatch.setenv("RTXMPI_RESTART", "1")
    subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {other.pid}"])
    start = time.monotonic()
    lock = lock_dir(None, tmp_path)
    assert lock.owner and lock.taken_over is None and 0.5 < time.monotonic() - start < 20


def test_a_takeover_in_progress_elsewhere_is_not_raced(tmp_path, monkeypatch):
    monkeypatch.setenv("RTXMPI_CKPT_LOCK", "lease")
    monkeypatch.setenv("RTXMPI_CKPT_LEASE_S", "1")
    path = lease(tmp_path)
    os.utime(path, (time.time() - 10, time.time() - 10))
    (tmp_path / (LEASE_FILE + TAKEOVER_SUFFIX)).write_text("")  # another job is taking over now
    with pytest.raises(DirectoryLocked):
        lock_dir(None, tmp_path)
    assert json.loads(path.read_text())["pid"] == 4242


def test_same_process_relock_keeps_the_lock(tmp_path):
    first = lock_dir(None, tmp_path)
    assert lock_dir(None, tmp_path) is first and first.owner


@pytest.mark.parametrize("name, value", [("RTXMPI_CKPT_LOCK", "nfs"), ("RTXMPI_CKPT_LEASE_S", "0"),
                                         ("RTXMPI_CKPT_LEASE_S", "soon"), ("RTXMPI_RESTART", "x")])
def test_bad_environment_is_a_config_error_naming_it(tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        lock_dir(None, tmp_path)


def test_unreadable_holder_record_still_refuses(tmp_path, monkeypatch):
    monkeypatch.setenv("RTXMPI_CKPT_LOCK", "lease")
    (tmp_path / LEASE_FILE).write_bytes(b"\xff\xfe\0garbage{")
    with pytest.raises(DirectoryLocked, match="a job that left no readable record"):
        lock_dir(None, tmp_path)


@pytest.mark.parametrize("mode", ["flock", "lease"])
def test_a_job_refused_before_the_holder_wrote_its_record_still_names_it(tmp_path, monkeypatch, mode):
    """The holder has the lock (flock taken, lease file created) but writes its record 0.3 s
    later: the refused job waits for it instead of reporting a job without a record."""
    record = {"job_id": "job-late", "host": "elsewhere", "pid": 4242, "start_unix": 1.0e9,
              "attempt": [0, 0]}
    if mode == "lease":
        monkeypatch.setenv("RTXMPI_CKPT_LOCK", "lease")
    path = tmp_path / (LEASE_FILE if mode == "lease" else LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if mode == "flock":
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: conflicts in-process too
    writer = threading.Timer(0.3, os.pwrite, args=(fd, json.dumps(record).encode(), 0))
    writer.start()
    try:
        with pytest.raises(DirectoryLocked, match="in use by job job-late \\(host elsewhere, pid 4242"):
            lock_dir(None, tmp_path)
    finally:
        writer.join()
        os.close(fd)


def shards(seed):
    a = np.random.default_rng(seed).standard_normal(64).astype(np.float32)
    return {"params": Shard(a, 0, a.size)}


def test_save_records_the_run_id_and_overwrite_keeps_to_its_own_run(tmp_path):
    save_checkpoint(None, tmp_path, 5, shards(0), run_id="run-a")
    assert load_checkpoint(None, tmp_path).metadata["run_id"] == "run-a"
    with pytest.raises(CheckpointError, match="committed checkpoint of run run-a, this is run run-b"):
        save_checkpoint(None, tmp_path, 5, shards(1), run_id="run-b", overwrite=True)
    with pytest.raises(CheckpointError, match="of run run-a, this is run None"):
        save_checkpoint(None, tmp_path, 5, shards(1), overwrite=True)
    assert np.array_equal(load_checkpoint(None, tmp_path).read("params"), shards(0)["params"].data)
    save_checkpoint(None, tmp_path, 5, shards(2), run_id="run-a", overwrite=True)  # its own lineage
    assert np.array_equal(load_checkpoint(None, tmp_path).read("params"), shards(2)["params"].data)


def test_overwrite_replaces_a_committed_step_that_does_not_verify(tmp_path, capfd):
    """A resume that fell back past a corrupt step later saves that step again: it is replaced
    (with a warning), as no run can be read from it."""
    save_checkpoint(None, tmp_path, 5, shards(0), run_id="run-a")
    meta = tmp_path / "step_00000005" / "metadata.json"
    meta.write_text(meta.read_text().replace('"step": 5', '"step": 6'))  # checksum now wrong
    save_checkpoint(None, tmp_path, 5, shards(2), run_id="run-b", overwrite=True)
    assert "does not verify" in capfd.readouterr().err
    ckpt = load_checkpoint(None, tmp_path)
    assert ckpt.metadata["run_id"] == "run-b"
    assert np.array_equal(ckpt.read("params"), shards(2)["params"].data)
