"""examples/train.py under a real single-node Slurm (slurmctld + slurmd + munged, tests/launched/
slurm_cluster.py), submitted with the scripts in examples/slurm/ as users submit them.

- a batch job (mpiexec inside the allocation) trains and commits its checkpoints;
- `scancel -b --signal=USR1` (mpiexec script) and `scancel --signal=USR1` (srun --mpi=pmix
  script) stop every rank after one step with a committed checkpoint; rank 0 requeues the job
  and the requeued run resumes from that checkpoint and finishes, every step logged once;
- a job that reaches its time limit (`--time=1`: Slurm sends TERM, the mpiexec script turns it
  into USR1) commits a checkpoint and requeues itself within KillWait, before the SIGKILL;
- under srun every rank's SLURM_PROCID/STEP_NUM_TASKS match MPI (`rtxmpi info`), and plain
  `srun -n 2` (singletons) is refused with exit 2;
- in a 4-task allocation, mpiexec starts 2 ranks of an `--elastic grow` job and `rtxmpi join -n 2`,
  a second step of the same allocation (`srun --overlap`), has it spawn 2 ranks on the free slots;
- a second cluster runs beside the first (as two checkouts' test runs would), picking its ports
  again when one was taken between the pick and the bind.

Skipped with the reason when Slurm is not installed or not root (`python tests/launched/
slurm_cluster.py install` installs it; .ci/run does). The cluster and the time-limit job start at
the first launched test of the session (tests/launched/conftest.py), so that the job's wait
(Slurm's minute plus up to 30 s of time-limit polling) overlaps the other launched tests. Slurm
holds a requeued job for about two minutes before it may start again; the tests release it at
once with `scontrol update StartTime=now` (a real cluster just waits; the time-limit job is held).
"""
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import BIN, MPIEXEC, REPO, ULFM_RECOVERABLE, launch_env

from rtxmpi.checkpoint import latest_step, load_checkpoint, verify_checkpoint

import slurm_cluster

WHY_NOT = slurm_cluster.missing()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

SCRIPTS = REPO / "examples" / "slurm"
ARGS = ["--model", "tiny", "--global-batch", "12", "--seq-len", "32", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


class Job:
    """One submitted job: its dir (ckpt/, metrics.jsonl, out), id and cluster."""

    def __init__(self, cluster, tmp, script, steps, *extra, ntasks=2, sbatch=(), env=None):
        self.cluster, self.tmp = cluster, tmp
        self.ckpt, self.metrics, self.out = tmp / "ckpt", tmp / "metrics.jsonl", tmp / "out"
        env = launch_env(**cluster.env, CKPT_DIR=self.ckpt, PYTHON=sys.executable,
                         MPIEXEC=f"{MPIEXEC} --oversubscribe --mca mpi_yield_when_idle 1",
                         OPAL_PREFIX=BIN.parent, PMIX_MCA_psec="native",
                         RTXMPI_CACHE_DIR=tmp.parent / "cache", RTXMPI_TIMEOUT_S=60,
                         PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {}))
        argv = ["sbatch", "--parsable", f"--ntasks={ntasks}", "-o", self.out, "-D", REPO,
                *sbatch, SCRIPTS / script, *ARGS, "--steps", str(steps),
                "--metrics-jsonl", self.metrics, *extra]
        self.id = cluster.run([str(a) for a in argv], env=env).stdout.strip().split(";")[0]

    def steps(self):
        if not self.metrics.exists():
            return []
        return [json.loads(line)["step"] for line in self.metrics.read_text().splitlines() if line]

    def output(self):
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def info(self):
        return self.cluster.job(self.id)

    def wait_steps(self, n, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while len(self.steps()) < n:
            assert time.monotonic() < deadline, f"fewer than {n} steps after {timeout_s} s\n{self}"
            assert self.info()["JobState"] in ("PENDING", "RUNNING"), str(self)
            time.sleep(0.2)

    def wait_requeued(self, timeout_s=60):
        """Until the job is pending again after its requeue (Restarts >= 1)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            if info["JobState"] == "PENDING" and int(info.get("Restarts", 0)) >= 1:
                return info
            assert time.monotonic() < deadline, f"not requeued after {timeout_s} s: {info}\n{self}"
            time.sleep(0.3)

    def wait_done(self, timeout_s):
        try:
            return self.cluster.wait_job(self.id, DONE, timeout_s)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self}") from None

    def __str__(self):
        return f"job {self.id} output:\n{self.output()[-4000:]}"


def start_cluster(tmp_path_factory):
    """The cluster, and the time-limit job submitted first: its wait (Slurm's minute plus up to
    30 s until slurmctld checks the limit) overlaps other tests. tests/launched/conftest.py calls
    this at the first launched test of a session that will run this file. The job sleeps 300 ms a
    step (RTXMPI_INJECT) so that it leaves the cores to those tests; once requeued it is held
    (`scontrol hold`, still PENDING) so that it does not start again after Slurm's requeue delay.
    End it with stop_cluster()."""
    running = slurm_cluster.Cluster(kill_wait_s=20).start()
    try:
        running.limited = Job(running, tmp_path_factory.mktemp("limited"), "train_mpiexec.sbatch",
                              100000, "--ckpt-every", "100000", ntasks=1,
                              sbatch=["--time=1", "--signal=B:USR1@0"],
                              env={"RTXMPI_INJECT": "loader_sleep_ms=300"})
    except BaseException:
        running.stop()
        raise
    running.done = threading.Event()
    running.holder = threading.Thread(target=hold_when_requeued, args=(running,), daemon=True)
    running.holder.start()
    return running


def hold_when_requeued(cluster, poll_s=1.0):
    """`scontrol hold` the time-limit job once it is PENDING after its requeue (Restarts >= 1)."""
    while not cluster.done.wait(poll_s):
        try:
            info = cluster.limited.info()
        except (RuntimeError, OSError, subprocess.SubprocessError):
            continue
        if info.get("JobState") == "PENDING" and int(info.get("Restarts", 0)) >= 1:
            cluster.run(["scontrol", "hold", cluster.limited.id], check=False)
            return


def stop_cluster(cluster):
    cluster.done.set()
    try:
        cluster.run(["scancel", "--user=root"], check=False)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def cluster(slurm_started_early):
    """The session's cluster (tests/launched/conftest.py: slurm_started_early)."""
    if isinstance(slurm_started_early, Exception):
        raise slurm_started_early  # the cluster did not start
    assert slurm_started_early is not None, "conftest did not start the Slurm test cluster"
    return slurm_started_early


def test_mpiexec_batch_job_trains_and_commits_checkpoints(cluster, tmp_path):
    job = Job(cluster, tmp_path, "train_mpiexec.sbatch", 30, "--ckpt-every", "10")
    info = job.wait_done(90)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", str(job)
    assert job.steps() == list(range(1, 31))
    assert latest_step(job.ckpt) == 30 and verify_checkpoint(job.ckpt, 30)
    out = job.output()
    assert f"job {job.id} restart 0 on {cluster.node}: 2 tasks" in out
    assert "world_size 2" in out and "train.py exit 0" in out


def preempt_requeue_resume(cluster, tmp_path, script, scancel):
    steps = 200
    job = Job(cluster, tmp_path, script, steps, "--ckpt-every", "1000")
    job.wait_steps(5)
    cluster.run(["scancel", *scancel, job.id])
    job.wait_requeued()
    stopped = latest_step(job.ckpt)
    assert stopped is not None and 5 <= stopped < steps, str(job)
    verify_checkpoint(job.ckpt, stopped)  # committed and intact
    out = job.output()
    assert f"stopped after step {stopped} (pre-empted)" in out, str(job)
    assert f"requeue: asking Slurm to requeue job {job.id}" in out, str(job)
    # Slurm may cancel the step before scontrol's answer is printed: either line shows it took
    assert f"requeue: job {job.id} requeued" in out or "DUE TO JOB REQUEUE" in out, str(job)
    cluster.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"])  # skip Slurm's hold
    info = job.wait_done(120)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", str(job)
    assert int(info["Restarts"]) == 1
    out = job.output()
    assert f"job {job.id} restart 1" in out
    assert f"continuing at step {stopped + 1}" in out, str(job)
    assert job.steps() == list(range(1, steps + 1))  # each step once, across the two runs
    assert latest_step(job.ckpt) == steps
    return job


def test_mpiexec_scancel_usr1_checkpoints_requeues_and_resumes(cluster, tmp_path):
    job = preempt_requeue_resume(cluster, tmp_path, "train_mpiexec.sbatch",
                                 ["-b", "--signal=USR1"])
    assert "batch script: USR1 -> USR1 to mpiexec" in job.output()


def test_srun_pmix_usr1_to_the_ranks_checkpoints_requeues_and_resumes(cluster, tmp_path):
    job = preempt_requeue_resume(cluster, tmp_path, "train_srun.sbatch", ["--signal=USR1"])
    assert "world_size 2" in job.output()


def test_srun_ranks_match_slurm_and_singletons_are_refused(cluster, tmp_path):
    out = tmp_path / "out"
    env = launch_env(**cluster.env, OPAL_PREFIX=BIN.parent, PMIX_MCA_psec="native",
                     RTXMPI_CACHE_DIR=tmp_path.parent / "cache",
                     PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    wrap = (f"srun --mpi=pmix -n 2 {BIN / 'rtxmpi'} info; echo info exit $?; "
            f"srun -n 2 {sys.executable} {REPO / 'examples' / 'train.py'} {' '.join(ARGS)} "
            f"--steps 2; echo singletons exit $?")
    job_id = cluster.run(["sbatch", "--parsable", "-n", "2", "-o", str(out), "-D", str(REPO),
                          "--wrap", wrap], env=env).stdout.strip()
    cluster.wait_job(job_id, DONE, 90)
    text = out.read_text()
    assert f"slurm          job {job_id}: 2 tasks on 1 node(s); ranks started by srun (step 0, " \
           "2 tasks)" in text, text
    assert "SLURM_PROCID == rank and SLURM_STEP_NUM_TASKS == world_size on every rank" in text
    assert "info exit 0" in text and "singletons exit 2" in text, text
    assert "Slurm started 2 tasks but MPI sees a world of 1" in text


def grow_job(cluster, tmp_path, ranks, steps, fault, after=""):
    """sbatch -n 4 --overcommit (the test node may have one CPU) of a script that runs
    examples/train.py under mpiexec -n RANKS --elastic grow (mpiexec takes its slots from
    Slurm) with RTXMPI_FAULT=`fault`, in the background, then the shell text `after` (which may
    use $pid), then waits for it. Returns (the job's scontrol record, its output, the metrics
    records, the checkpoint directory)."""
    ckpt, metrics, out = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "out"
    args = [*ARGS, "--steps", str(steps), "--ckpt-every", "4"]
    env = launch_env(**cluster.env, OPAL_PREFIX=BIN.parent, PMIX_MCA_psec="native",
                     RTXMPI_CACHE_DIR=tmp_path.parent / "cache", RTXMPI_TIMEOUT_S=30,
                     RTXMPI_FAULT=fault, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    wrap = (f"{MPIEXEC} {' '.join(ULFM_RECOVERABLE)} -n {ranks} --mca mpi_yield_when_idle 1 "
            f"--bind-to none {sys.executable} {REPO / 'examples' / 'train.py'} {' '.join(args)} "
            f"--ckpt-dir {ckpt} --metrics-jsonl {metrics} --elastic grow & pid=$!; "
            f"{after.format(metrics=metrics, ckpt=ckpt)} wait $pid; echo train.py exit $?")
    job_id = cluster.run(["sbatch", "--parsable", "-n", "4", "--overcommit", "-o", str(out),
                          "-D", str(REPO), "--wrap", wrap], env=env).stdout.strip()
    info = cluster.wait_job(job_id, DONE, 90)
    text = out.read_text(errors="replace")
    got = ([json.loads(line) for line in metrics.read_text().splitlines()]
           if metrics.exists() else [])
    return info, text, got, ckpt


def test_join_from_a_second_step_grows_mpiexec_ranks_into_the_allocation(cluster, tmp_path):
    """mpiexec takes 4 slots from Slurm and starts 2 ranks; once step 3 is logged
    `srun -n 1 --overlap rtxmpi join -n 2` asks for 2 more while rank 0 stalls in step 4, and
    the job grows to 4 ranks without --oversubscribe and finishes every step."""
    after = ("until grep -qs '\"step\": 3' {metrics} || ! kill -0 $pid; do sleep 0.1; done; "
             f"srun -n 1 --overlap {BIN / 'rtxmpi'} join --job {{ckpt}} -n 2 --timeout-s 60; "
             "echo join exit $?;")
    info, text, got, ckpt = grow_job(cluster, tmp_path, 2, 12, "stall:0:4:forward:5", after)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
    assert "join exit 0" in text and "train.py exit 0" in text, text[-4000:]
    assert "rtxmpi join: admitted 2 ranks: the world grew 2 -> 4 ranks" in text, text[-4000:]
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [r["world_size"] for r in got] == [2] * 4 + [4] * 8
    assert load_checkpoint(None, ckpt, 12).world_size_saved == 4


def test_a_lost_rank_is_replaced_on_a_free_slot_of_the_allocation(cluster, tmp_path):
    """mpiexec starts 3 ranks in a 4-task allocation; launch rank 2 is SIGKILLed in step 5; the
    survivors shrink and spawn its replacement on the allocation's free slot (a lost rank's slot
    is not given back), and the job finishes every step at 3 ranks."""
    info, text, got, ckpt = grow_job(cluster, tmp_path, 3, 10, "kill:2:5:backward:0.002")
    assert info["JobState"] == "COMPLETED" and "train.py exit 0" in text, text[-4000:]
    assert "shrank the world 3 -> 2 ranks" in text and "grew the world 2 -> 3 ranks" in text, text[-4000:]
    assert [r["step"] for r in got] == list(range(1, 11))
    assert {r["world_size"] for r in got} == {3}
    assert load_checkpoint(None, ckpt, 10).world_size_saved == 3


def test_a_second_cluster_runs_beside_it_and_repicks_a_port_taken_meanwhile(cluster, monkeypatch):
    """Two clusters on one machine (two checkouts' test runs): the second is handed the first's
    slurmd port as if another process took it between the pick and the bind; its slurmd cannot
    bind, so start() ends what it spawned and starts again on fresh ports. Both then run jobs,
    with disjoint job ids; stop() leaves no daemon behind."""
    picks, free_ports = [], slurm_cluster.free_ports

    def first_pick_taken(n):
        ports = free_ports(n)
        if not picks:
            ports[1] = cluster.ports[1]
        picks.append(tuple(ports))
        return ports

    monkeypatch.setattr(slurm_cluster, "free_ports", first_pick_taken)
    second = slurm_cluster.Cluster(kill_wait_s=5).start()
    try:
        assert len(picks) == 2 and second.ports == picks[1], picks
        assert set(second.ports).isdisjoint(cluster.ports)
        out = second.root / "j.out"
        job_id = second.run(["sbatch", "--parsable", "-o", str(out), "--wrap",
                             "echo second $SLURM_JOB_ID"]).stdout.strip()
        assert second.wait_job(job_id, DONE, 60)["JobState"] == "COMPLETED"
        assert out.read_text().strip() == f"second {job_id}"
        assert cluster.run(["scontrol", "show", "job", job_id], check=False).returncode != 0
        procs = list(second.procs)
    finally:
        second.stop()
    assert all(proc.poll() is not None for proc in procs) and not second.root.exists()


def test_time_limit_commits_a_checkpoint_before_the_kill_and_requeues(cluster):
    job = cluster.limited
    deadline = time.monotonic() + 150
    while "train.py exit" not in job.output():
        assert time.monotonic() < deadline, f"no time-limit stop after 150 s\n{job}"
        time.sleep(1)
    out = job.output()
    assert "DUE TO TIME LIMIT" in out and "batch script: TERM -> USR1 to mpiexec" in out, str(job)
    assert "train.py exit 75" in out, str(job)  # train.py exited by itself, not SIGKILLed
    stopped = latest_step(job.ckpt)
    assert stopped and f"stopped after step {stopped} (pre-empted)" in out, str(job)
    verify_checkpoint(job.ckpt, stopped)
    assert f"requeue: asking Slurm to requeue job {job.id}" in out, str(job)
    assert f"requeue: job {job.id} requeued" in out or "DUE TO JOB REQUEUE" in out, str(job)
    assert int(job.wait_requeued()["Restarts"]) == 1
