"""Helpers for tests that start their own MPI job (or a plain `python` process) in a subprocess.

Every launch runs under a hard outer deadline (coreutils `timeout`, then a kill of the whole
process group), so a hang fails the test instead of stalling the suite. A test asserts that the
runtime's own deadline fired first: the result says whether the outer timeout did.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
REPO = Path(__file__).resolve().parents[2]
# under --elastic grow: the spawned ranks form a job of their own, recoverable, so that one failing
# (or leaving without MPI_Finalize, as every rank does after a shrink) does not end the whole job
ULFM_RECOVERABLE = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca",
                    "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "10",
                    "--prtemca", "state_base_recoverable", "1"]
OUTER_TIMEOUT_RC = 124  # coreutils `timeout` exit status when it had to stop the command
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "RTXMPI_")


@dataclass
class Launch:
    """What a launched command did: exit status, output, wall time, whether the outer timeout hit."""

    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float
    outer_timeout: bool

    def lines(self, prefix):
        """Lines of stdout that start with `prefix` (what the script reported)."""
        return [line for line in self.stdout.splitlines() if line.startswith(prefix)]

    def __str__(self):
        return (f"exit {self.returncode} after {self.elapsed_s:.1f} s"
                f"{' (OUTER TIMEOUT)' if self.outer_timeout else ''}\n"
                f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}")


def launch_env(**extra):
    """A clean environment for a child job: no launcher, Slurm or rtxmpi variables inherited,
    root allowed, one thread per rank, unbuffered output, the repository importable, Open MPI's
    btl/ofi left out unless $OMPI_MCA_btl says otherwise (closed unused, it sleeps 1 s in every
    MPI_Init; one node needs only shared memory, and the multi-node tests pass their own btl)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(OMPI_MCA_btl=os.environ.get("OMPI_MCA_btl", "^ofi"))
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.update({k: str(v) for k, v in extra.items()})
    return env


# Open MPI's launcher now and then fails before it starts any process (its PMIx server could not
# open its listening socket): nothing of the job ran, so the same command is launched again
LAUNCHER_NOT_STARTED = "The PMIx server's listener thread failed to start"
LAUNCH_ATTEMPTS = 3


def run_command(argv, *, outer_timeout_s, env=None, cwd=None):
    """Run `argv` under `timeout` with a hard deadline; never hangs. Returns a Launch. A launch that
    Open MPI could not start (LAUNCHER_NOT_STARTED) is retried, LAUNCH_ATTEMPTS times in all."""
    for _ in range(LAUNCH_ATTEMPTS):
        launch = _run_once(argv, outer_timeout_s=outer_timeout_s, env=env, cwd=cwd)
        if launch.returncode == 0 or LAUNCHER_NOT_STARTED not in launch.stderr:
            break
    return launch


def _run_once(argv, *, outer_timeout_s, env, cwd):
    command = ["timeout", "--kill-after=5", str(outer_timeout_s)] + [str(a) for a in argv]
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=launch_env() if env is None else env, cwd=cwd,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=outer_timeout_s + 15)
    except subprocess.TimeoutExpired:  # `timeout` itself failed to end it: kill the whole session
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    elapsed_s = time.monotonic() - start
    outer_timeout = process.returncode == OUTER_TIMEOUT_RC or elapsed_s >= outer_timeout_s
    return Launch(process.returncode, stdout, stderr, elapsed_s, outer_timeout)


def resume_after_a_spawn_fault(proc, relaunch):
    """A launch that a fault inside MPI_Comm_spawn ended before its last step: the spawn watchdog
    ended it (exit 5) or Open MPI's launcher crashed (a signal; seen: SIGSEGV). relaunch() (the
    job with --resume, as `rtxmpi run` does it) must then finish with exit 0. Returns its Launch."""
    assert ("leaves the job (exit 5)" in proc.stderr or proc.returncode < 0
            or proc.returncode > 128), str(proc)
    again = relaunch()
    assert not again.outer_timeout and again.returncode == 0, str(again)
    return again


def mpiexec_argv(n):
    """mpiexec for `n` ranks on a small machine: oversubscribed, yielding when idle, unbound."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found next to the Python interpreter or on PATH")
    return [MPIEXEC, "-n", str(n), "--oversubscribe", "--mca", "mpi_yield_when_idle", "1",
            "--bind-to", "none"]


def write_script(tmp_path, source, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def run_mpi(tmp_path):
    """run_mpi(source, n, outer_timeout_s=60, **env) -> Launch: `source` as a script on n ranks."""

    def run(source, n, outer_timeout_s=60, **env):
        script = write_script(tmp_path, source)
        return run_command(mpiexec_argv(n) + [sys.executable, script],
                           outer_timeout_s=outer_timeout_s, env=launch_env(**env), cwd=tmp_path)

    return run


@pytest.fixture
def run_python(tmp_path):
    """run_python(args, outer_timeout_s=30, **env) -> Launch: plain `python args...` (a singleton)."""

    def run(args, outer_timeout_s=30, **env):
        return run_command([sys.executable] + list(args), outer_timeout_s=outer_timeout_s,
                           env=launch_env(**env), cwd=tmp_path)

    return run


@pytest.fixture(scope="session", autouse=True)
def slurm_started_early(request, tmp_path_factory):
    """test_slurm.py's cluster and time-limit job, started at the first launched test of a session
    that will run test_slurm.py (so that the job's minute and more overlaps the other tests instead
    of idling at the end), else None; the exception when it could not start. Stopped at the end of
    the session."""
    if not any(item.path.name == "test_slurm.py" for item in request.session.items):
        yield None
        return
    import test_slurm  # already imported by the collection

    if test_slurm.WHY_NOT is not None:
        yield None
        return
    try:
        running = test_slurm.start_cluster(tmp_path_factory)
    except Exception as exc:  # noqa: BLE001 - raised by test_slurm.py's tests, not by whichever ran first
        yield exc
        return
    try:
        yield running
    finally:
        test_slurm.stop_cluster(running)

