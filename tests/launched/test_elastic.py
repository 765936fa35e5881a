"""Pre-emption and shrink-and-continue with examples/train.py as users launch it (docs/elastic.md).

Pre-emption: a SIGUSR1 or SIGTERM that reaches ONE rank stops every rank after the same step with
one committed checkpoint and exit code 75; the resumed deterministic run ends bitwise equal to the
uninterrupted one. Shrink (ULFM): a rank SIGKILLed in backward or while a checkpoint is written
leaves 3 of 4 ranks training on in the same processes, every step counted once, and in
deterministic mode the final parameters equal a run that went 4 ranks -> checkpoint at the step
the survivors continued from -> 3 ranks. Every launch runs under a hard outer timeout.
"""
import json
import os
import re
import shutil
import signal
import sys
import time

import numpy as np
import pytest
from conftest import REPO, launch_env, mpiexec_argv, run_command

from rtxmpi.checkpoint import latest_step, load_checkpoint
from rtxmpi.checkpoint.format import step_dir_name, write_latest

TRAIN = REPO / "examples" / "train.py"
# global batch 8: even at 2 and 4 ranks, uneven at 3 (3, 3, 2), so every shrink 4 -> 3 below keeps
# the 4-rank global batch split unevenly and weighted by samples (docs/elastic.md)
ARGS = ["--model", "tiny", "--global-batch", "8", "--seq-len", "32", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--deterministic"]
ULFM = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca",
        "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "10"]
EXIT_PREEMPTED = 75
RESUMED = re.compile(r"continuing from rank (\d+)'s replica at step (\d+)")


def train(tmp, ckpt, *extra, n=2, steps=20, ulfm=False, outer_timeout_s=90, **env):
    mpiexec = mpiexec_argv(n)
    if ulfm:
        mpiexec = mpiexec[:1] + ULFM + mpiexec[1:]
    args = [*ARGS, "--steps", str(steps), "--ckpt-dir", ckpt, "--metrics-jsonl", tmp / "m.jsonl",
            *extra]
    return run_command(mpiexec + [sys.executable, TRAIN, *args], outer_timeout_s=outer_timeout_s,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp.parent / "cache", RTXMPI_TIMEOUT_S=30,
                                      **env))


def wait_for_steps(tmp_path, n, timeout_s=60):
    """Poll the run's metrics file until it holds `n` steps (or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (tmp_path / "m.jsonl").exists() and len(records(tmp_path)) >= n:
            return
        time.sleep(0.05)


def records(tmp):
    return [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]


def assert_same_params(got_dir, want_dir, step):
    got, want = load_checkpoint(None, got_dir, step), load_checkpoint(None, want_dir, step)
    for name in ("params", "adam.m", "adam.v", "adam.step"):
        assert np.array_equal(got.read(name), want.read(name)), name  # bitwise


@pytest.fixture(scope="module")
def straight2(tmp_path_factory):
    """One uninterrupted 2-rank deterministic run of 20 steps."""
    tmp = tmp_path_factory.mktemp("straight2")
    proc = train(tmp, tmp / "ckpt")
    assert proc.returncode == 0, str(proc)
    return tmp


def test_usr1_to_one_rank_stops_all_at_one_step_and_resume_is_bitwise(straight2, tmp_path):
    """(SIGTERM from outside: the next test.)"""
    proc = train(tmp_path, tmp_path / "ckpt", RTXMPI_FAULT="usr1:1:7:backward")
    assert not proc.outer_timeout and proc.returncode == EXIT_PREEMPTED, str(proc)
    assert (f"stopped after step 7 (pre-empted); checkpoint of step 7 committed in "
            f"{tmp_path / 'ckpt'}") in proc.stdout
    assert latest_step(tmp_path / "ckpt") == 7  # one committed checkpoint, at the agreed step
    assert load_checkpoint(None, tmp_path / "ckpt", 7).world_size_saved == 2
    proc = train(tmp_path, tmp_path / "ckpt", "--resume")
    assert proc.returncode == 0, str(proc)
    assert [r["step"] for r in records(tmp_path)] == list(range(1, 21))
    assert [r["loss"] for r in records(tmp_path)] == [r["loss"] for r in records(straight2)]
    assert_same_params(tmp_path / "ckpt", straight2 / "ckpt", 20)


def _parent(pid):
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descends_from(pid, ancestor):
    while pid > 1:
        if pid == ancestor:
            return True
        pid = _parent(pid)
    return False


def rank_pids(script, rank, ancestor):
    """pids of descendants of `ancestor` running `script` with OMPI_COMM_WORLD_RANK=rank (a /proc
    scan: other jobs on the machine may run the same script)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if not _descends_from(int(pid), ancestor):
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if str(script).encode() in cmdline and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            found.append(int(pid))
    return found


def test_sigterm_from_outside_to_one_rank_stops_every_rank_with_exit_75(tmp_path):
    """The signal comes from another process at an arbitrary moment, as a scheduler sends it."""
    import subprocess
    mpiexec = mpiexec_argv(2)
    args = [*ARGS, "--steps", "100000", "--ckpt-dir", tmp_path / "ckpt", "--metrics-jsonl",
            tmp_path / "m.jsonl"]
    job = subprocess.Popen(["timeout", "--kill-after=5", "90"] + mpiexec
                           + [sys.executable, str(TRAIN)] + [str(a) for a in args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache"),
                           start_new_session=True)
    try:
        wait_for_steps(tmp_path, 3)
        pids = rank_pids(TRAIN, 1, job.pid)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == EXIT_PREEMPTED, stdout + stderr
    stopped = int(re.search(r"stopped after step (\d+) \(pre-empted\)", stdout).group(1))
    assert latest_step(tmp_path / "ckpt") == stopped == records(tmp_path)[-1]["step"]
    assert "SIGTERM: stop requested" in stderr


def test_preempted_without_ckpt_dir_still_stops_with_exit_75(tmp_path):
    proc = run_command(mpiexec_argv(2) + [sys.executable, TRAIN, *ARGS, "--steps", "20"],
                       outer_timeout_s=60, env=launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache",
                                                          RTXMPI_FAULT="usr1:0:4"))
    assert proc.returncode == EXIT_PREEMPTED, str(proc)
    assert "stopped after step 4 (pre-empted); no --ckpt-dir: nothing saved" in proc.stdout


SHRINK_STEPS = 12


@pytest.fixture(scope="module")
def straight4(tmp_path_factory):
    """One uninterrupted 4-rank deterministic run of 12 steps with a checkpoint after every step,
    launched with ULFM as the shrinking runs are (under ULFM small all_reduces run over MPI,
    without it through the shared-memory mailbox: other sums, docs/wal.md)."""
    tmp = tmp_path_factory.mktemp("straight4")
    proc = train(tmp, tmp / "ckpt", "--ckpt-every", "1", n=4, ulfm=True, steps=SHRINK_STEPS)
    assert proc.returncode == 0, str(proc)
    return tmp


def restart_from(straight, step, dst):
    """A checkpoint directory holding only the straight run's committed checkpoint of `step`,
    and the straight run's metrics up to `step`: the state of a 4-rank run stopped there."""
    (dst / "ckpt").mkdir(parents=True)
    shutil.copytree(straight / "ckpt" / step_dir_name(step), dst / "ckpt" / step_dir_name(step))
    write_latest(dst / "ckpt", step)
    (dst / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(straight)
                                         if r["step"] <= step))


@pytest.mark.parametrize("fault", ["kill:2:7:backward:0.002", "kill:1:8:save:0.003",
                                   "kill:0:4:forward"])
def test_shrink_after_a_kill_continues_on_3_ranks_like_a_checkpoint_restart(straight4, tmp_path,
                                                                             fault):
    run = tmp_path / "run"
    run.mkdir()
    proc = train(run, run / "ckpt", "--elastic", "shrink", "--ckpt-every", "4", n=4, ulfm=True,
                 steps=SHRINK_STEPS, RTXMPI_FAULT=fault)
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "shrank the world 4 -> 3 ranks" in proc.stderr, str(proc)
    resumed = int(RESUMED.search(proc.stderr).group(2))
    got = records(run)
    assert [r["step"] for r in got] == list(range(1, SHRINK_STEPS + 1))  # none twice or skipped
    assert {r["world_size"] for r in got if r["step"] > resumed} == {3}
    assert load_checkpoint(None, run / "ckpt", SHRINK_STEPS).world_size_saved == 3
    # reference: 4 ranks to the step the survivors continued from, checkpoint, then 3 ranks
    ref = tmp_path / "ref"
    restart_from(straight4, resumed, ref)
    proc = train(ref, ref / "ckpt", "--resume", n=3, ulfm=True, steps=SHRINK_STEPS)
    assert proc.returncode == 0, str(proc)
    assert [r["loss"] for r in got] == [r["loss"] for r in records(ref)]
    assert_same_params(run / "ckpt", ref / "ckpt", SHRINK_STEPS)


def test_shrink_below_min_ranks_ends_the_job_with_a_clear_error(tmp_path):
    proc = train(tmp_path, tmp_path / "ckpt", "--elastic", "shrink", "--min-ranks", "4", n=4,
                 ulfm=True, steps=SHRINK_STEPS, RTXMPI_FAULT="kill:3:5:backward",
                 outer_timeout_s=60)
    assert not proc.outer_timeout, str(proc)
    assert "fewer than min_ranks=4: cannot continue" in proc.stderr, str(proc)
    assert max(r["step"] for r in records(tmp_path)) < SHRINK_STEPS


def test_shrink_with_zero_reloads_the_last_committed_checkpoint_at_3_ranks(tmp_path):
    proc = train(tmp_path, tmp_path / "ckpt", "--elastic", "shrink", "--zero-stage", "1",
                 "--ckpt-every", "5", n=4, ulfm=True, steps=SHRINK_STEPS,
                 RTXMPI_FAULT="kill:1:8:backward:0.002")
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "continuing from the last committed checkpoint" in proc.stderr, str(proc)
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000005'} " in proc.stdout, str(proc)
    steps = [r["step"] for r in records(tmp_path)]  # the re-run steps 6, 7 replace their lines
    assert steps == list(range(1, SHRINK_STEPS + 1))
    assert load_checkpoint(None, tmp_path / "ckpt", SHRINK_STEPS).world_size_saved == 3


HYBRID = ["--global-batch", "12", "--tp", "2", "--dp", "2"]  # 12: even over dp 2 and dp 3
SHARDS = re.compile(r"continuing from the shards of ranks \[([\d, ]+)\] at step (\d+)")


def test_shrink_of_tp2_dp2_replans_to_dp3_like_a_checkpoint_restart(tmp_path):
    """A tp peer dies: the other dp replica's ranks still hold both tp shards, the survivors
    rebuild the model from them, re-plan tp 2 x dp 2 -> dp 3 and go on in the same processes."""
    run = tmp_path / "run"
    run.mkdir()
    proc = train(run, run / "ckpt", "--elastic", "shrink", "--ckpt-every", "4", *HYBRID, n=4,
                 ulfm=True, steps=SHRINK_STEPS, RTXMPI_FAULT="kill:1:7:backward:0.002")
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "shrank the world 4 -> 3 ranks" in proc.stderr, str(proc)
    assert ("elastic: layout for 3 ranks: dp 2 x tp 2 x pp 1 x sp 1 -> dp 3 x tp 1 x pp 1 x sp 1 "
            "(tp 2 x pp 1 x sp 1 = 2 does not divide 3 ranks)") in proc.stdout, str(proc)
    resumed = int(SHARDS.search(proc.stderr).group(2))
    got = records(run)
    assert [r["step"] for r in got] == list(range(1, SHRINK_STEPS + 1))  # none twice or skipped
    assert {r["world_size"] for r in got if r["step"] > resumed} == {3}
    assert load_checkpoint(None, run / "ckpt", SHRINK_STEPS).world_size_saved == 3
    # reference: tp 2 x dp 2 up to the step the survivors continued from, checkpoint, then dp 3,
    # as `rtxmpi run` would relaunch it on the 3 ranks still available (the same flags re-planned,
    # the same ULFM launch: the same all_reduce paths)
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = train(ref, ref / "ckpt", "--stop-after-step", str(resumed), *HYBRID, n=4, ulfm=True,
                 steps=SHRINK_STEPS)
    assert proc.returncode == 0, str(proc)
    proc = train(ref, ref / "ckpt", "--resume", *HYBRID, n=3, ulfm=True, steps=SHRINK_STEPS,
                 RTXMPI_RESTART=1)
    assert proc.returncode == 0, str(proc)
    assert ("elastic: layout for 3 ranks: --dp 2 --tp 2 --pp 1 --sp 1 -> dp 3 x tp 1 x pp 1 x "
            "sp 1 (tp 2 x pp 1 x sp 1 = 2 does not divide 3 ranks)") in proc.stdout, str(proc)
    assert [r["loss"] for r in got] == [r["loss"] for r in records(ref)]
    assert_same_params(run / "ckpt", ref / "ckpt", SHRINK_STEPS)


def test_shrink_of_pp2_tp2_without_a_complete_copy_reloads_the_checkpoint(tmp_path):
    """dp 1: the dead rank's shard has no other copy, so the survivors reload the last committed
    checkpoint at the re-planned layout; the steps after it run again and are logged once.
    (With pp the whole step is the forward phase; the kill lands 2 ms into step 8, steps before
    step 10's checkpoint, which a later kill could let commit first.)"""
    proc = train(tmp_path, tmp_path / "ckpt", "--elastic", "shrink", "--global-batch", "12",
                 "--pp", "2", "--tp", "2", "--micro-batches", "2", "--ckpt-every", "5", n=4,
                 ulfm=True, steps=SHRINK_STEPS, RTXMPI_FAULT="kill:3:8:forward:0.002")
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "continuing from the last committed checkpoint (no complete copy survived)" in proc.stderr
    assert "layout for 3 ranks: dp 1 x tp 2 x pp 2 x sp 1 -> dp 3 x tp 1 x pp 1 x sp 1" in proc.stdout
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000005'} " in proc.stdout, str(proc)
    got = records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, SHRINK_STEPS + 1))
    assert {r["world_size"] for r in got if r["step"] > 5} == {3}
    assert load_checkpoint(None, tmp_path / "ckpt", SHRINK_STEPS).world_size_saved == 3


def test_stuck_rank_is_reported_with_its_phase_and_step_and_ends_the_job(tmp_path):
    """Without ULFM: the heartbeats name the stuck rank long before the collective deadline
    (30 s here), and the job ends non-zero so that a supervisor can act."""
    proc = train(tmp_path, tmp_path / "ckpt", "--stuck-timeout-s", "2", steps=12,
                 RTXMPI_FAULT="stall:1:5:backward:600", outer_timeout_s=60)
    assert not proc.outer_timeout and proc.returncode != 0, str(proc)
    assert ("RankFailure: all_reduce" in proc.stderr
            and "rank 1 made no progress for" in proc.stderr
            and "last in phase 'backward' of step 5; alive (heartbeats arrive)" in proc.stderr), str(proc)
    assert "CollectiveTimeout" not in proc.stderr


def _state(pid, script):
    """The /proc state letter of `pid` while it runs `script` (R, S, T, Z...), else None."""
    try:
        if str(script).encode() not in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0"):
            return None
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.parametrize("detect", [["--stuck-timeout-s", "5"], []], ids=["heartbeats", "ulfm"])
def test_stopped_rank_is_ended_and_the_survivors_job_exits(tmp_path, detect):
    """SIGSTOP freezes every thread of rank 3 at the start of step 8's backward: its heartbeats
    stop (or, without them, ULFM's detector declares it dead after 10 s), the survivors shrink
    and finish, and the frozen process is SIGKILLed by its node's survivors, so mpiexec exits
    instead of waiting for it; the report names it with its phase and step of that moment."""
    proc = train(tmp_path, tmp_path / "ckpt", "--elastic", "shrink", "--ckpt-every", "4", *detect,
                 n=4, ulfm=True, steps=SHRINK_STEPS, RTXMPI_FAULT="stop:3:8:backward",
                 outer_timeout_s=150)
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    pid = int(re.search(r"\[rtxmpi fault\] stop launch rank 3 step 8 phase backward pid=(\d+)",
                        proc.stderr).group(1))
    assert f"elastic: rank 3's process (pid {pid}) ended by SIGKILL from its node's surviving ranks" \
        in proc.stderr, str(proc)
    assert _state(pid, TRAIN) is None  # neither stopped (T) nor a zombie: it ended with the job
    if detect:
        assert ("; rank 3: last in phase 'backward' of step 8; its heartbeats stopped "
                in proc.stderr), str(proc)
        assert "alive (heartbeats arrive)" not in proc.stderr, str(proc)
    else:
        assert "failed ranks [3]" in proc.stderr, str(proc)
    assert "shrank the world 4 -> 3 ranks" in proc.stderr, str(proc)
    got = records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, SHRINK_STEPS + 1))  # the survivors' result
    assert {r["world_size"] for r in got if r["step"] >= 8} == {3}
    assert load_checkpoint(None, tmp_path / "ckpt", SHRINK_STEPS).world_size_saved == 3


ULFM_JOB = """
import os, signal, time
import numpy as np
import rtxmpi
from rtxmpi.elastic.shrink import shrink_world

world = rtxmpi.init(timeout_s=30)
world.barrier()
if world.rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    for _ in range(1000):                      # the failure surfaces in one of these
        world.all_reduce(np.ones(1000, np.float32))
    print(f"NO FAILURE rank={world.rank}", flush=True)
except rtxmpi.RankFailure as exc:
    print(f"FAILURE rank={world.rank} ranks={exc.ranks} after_s={time.monotonic() - start:.3f}",
          flush=True)
new, old_size = shrink_world(world)
x = np.full(4, new.rank + 1.0)
new.all_reduce(x)
print(f"SHRUNK old_rank={world.rank} rank={new.rank} size={new.world_size} sum={x[0]:g}", flush=True)
new.barrier()
os._exit(0)
"""


def test_ulfm_failure_is_rank_failure_on_every_survivor_and_shrink_works(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(ULFM_JOB)
    mpiexec = mpiexec_argv(4)
    proc = run_command(mpiexec[:1] + ULFM + mpiexec[1:] + [sys.executable, script],
                       outer_timeout_s=60, env=launch_env())
    assert not proc.outer_timeout, str(proc)
    failures = proc.lines("FAILURE")
    assert len(failures) == 3, str(proc)  # every survivor, as RankFailure (not MPI.Exception)
    for line in failures:
        assert float(line.split("after_s=")[1]) < 10.0, line  # ULFM, not the 30 s deadline
    shrunk = sorted(proc.lines("SHRUNK"))
    assert len(shrunk) == 3 and all("size=3 sum=6" in line for line in shrunk), str(proc)
    assert {line.split()[2] for line in shrunk} == {"rank=0", "rank=1", "rank=2"}


RESUMED_JOB = """
import os, signal, sys, time
import numpy as np
import rtxmpi
from rtxmpi.elastic.evict import guard_resume
from rtxmpi.elastic.shrink import shrink_world

world = rtxmpi.init(timeout_s=60)
pids = np.empty(world.world_size, np.int64)
world.backend.comm.Allgather(np.array([os.getpid()], np.int64), pids)
guard_resume(world.backend.comm)
world.barrier()
if world.rank == 3:
    os.kill(os.getpid(), signal.SIGSTOP)   # frozen until rank 0's SIGCONT below
    print("RAN ON after the resume", flush=True)
    open(sys.argv[1], "w").write("a file the survivors own")
    os._exit(0)
try:
    for _ in range(100000):
        world.all_reduce(np.ones(4, np.float32))
except rtxmpi.RankFailure as exc:
    print(f"FAILURE rank={world.rank} ranks={exc.ranks}", flush=True)
new, _ = shrink_world(world)
new.barrier()
if new.rank == 0:
    os.kill(int(pids[3]), signal.SIGCONT)
    deadline = time.monotonic() + 20
    state = "?"
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pids[3]}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("gone", "Z", "X"):
            break
        time.sleep(0.05)
    print(f"RESUMED rank 3 state={state}", flush=True)
new.barrier()
os._exit(0)
"""


def test_rank_resumed_after_the_survivors_left_ends_itself_before_running_on(tmp_path):
    """Where no survivor shares its node (simulated: nobody kills it here), a stopped rank
    outlives the shrink; resumed by SIGCONT, its guard sees the revoked world and SIGKILLs the
    process before its program goes on to write anything. (Open MPI itself sometimes aborts the
    process first, when the guard's probe learns that the detector declared it dead.)"""
    script, owned = tmp_path / "job.py", tmp_path / "owned.txt"
    script.write_text(RESUMED_JOB)
    mpiexec = mpiexec_argv(4)
    proc = run_command(mpiexec[:1] + ULFM + mpiexec[1:] + [sys.executable, script, owned],
                       outer_timeout_s=90, env=launch_env())
    assert not proc.outer_timeout, str(proc)
    assert len(proc.lines("FAILURE")) == 3, str(proc)  # ULFM's detector: rank 3 declared dead
    assert proc.lines("RESUMED") == ["RESUMED rank 3 state=Z"] or proc.lines("RESUMED") == [
        "RESUMED rank 3 state=gone"], str(proc)
    assert ("resumed (SIGCONT) after its peers revoked the world" in proc.stderr
            or "I have been reported dead by someone else" in proc.stderr), str(proc)
    assert not proc.lines("RAN ON") and not owned.exists(), str(proc)


def test_rtxmpi_run_turns_sigterm_into_a_checkpoint_and_exit_75(tmp_path):
    """SIGTERM to the supervisor reaches the ranks through mpiexec as SIGUSR1 (prterun would turn
    TERM into SIGKILL): they stop at one step with a committed checkpoint; nothing is relaunched."""
    import subprocess
    args = [*ARGS, "--steps", "100000", "--ckpt-dir", tmp_path / "ckpt", "--metrics-jsonl",
            tmp_path / "m.jsonl"]
    supervisor = [sys.executable, "-m", "rtxmpi.cli", "run", "-n", "2", "--grace-s", "60",
                  "--mpiexec", " ".join(mpiexec_argv(2)[:1] + mpiexec_argv(2)[3:]), "--",
                  sys.executable, str(TRAIN)] + [str(a) for a in args]
    job = subprocess.Popen(["timeout", "--kill-after=5", "90"] + supervisor, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env=launch_env(RTXMPI_CACHE_DIR=tmp_path.parent / "cache"),
                           start_new_session=True)
    try:
        wait_for_steps(tmp_path, 3)
        supervisors = [pid for pid in rank_pids_of_cmd("rtxmpi.cli", job.pid)
                       if _parent(pid) == job.pid]  # not `timeout` itself
        assert len(supervisors) == 1, supervisors
        os.kill(supervisors[0], signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == EXIT_PREEMPTED, stdout + stderr
    assert "SIGTERM: asking the ranks to stop" in stderr and "attempt 2" not in stderr
    stopped = int(re.search(r"stopped after step (\d+) \(pre-empted\)", stdout).group(1))
    assert latest_step(tmp_path / "ckpt") == stopped == records(tmp_path)[-1]["step"]


def rank_pids_of_cmd(marker, ancestor):
    """pids of descendants of `ancestor` whose command line contains `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if not _descends_from(int(pid), ancestor):
            continue
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(pid))
    return found
