"""`rtxmpi bench NAME`: run bench/NAME.py the way this machine needs (apps layer, used by cli.py).

A benchmark is either an MPI job (rank 0 prints; start it under mpiexec -n N) or a driver that
starts its own mpiexec jobs (scaling.py, memory.py: one job per configuration). A bench file says
which with a top-level `LAUNCH = "mpi"` or `LAUNCH = "self"`; without one, a file that builds an
`mpiexec` command line itself counts as "self". Read from the source, never imported.

Flags for this machine: `--oversubscribe --bind-to none --mca mpi_yield_when_idle 1` (ranks may
outnumber cores and share them with other work; busy-polling ranks starve each other; Open MPI
counts slots by cores, so N above the core count needs --oversubscribe), the flags every result in
bench/RESULTS.md was measured with; OMP_NUM_THREADS=1 unless set; as root, Open MPI's
allow-run-as-root variables. `--mpiexec "srun --mpi=pmix"` (or any launcher) replaces all of that.
"""
import ast
import os
import shlex
import shutil
import subprocess
import sys

from rtxmpi.errors import ConfigError

NOT_BENCHES = {"run_all", "gpu_check"}  # scripts in bench/ that are not benchmarks


def bench_dir(explicit=None):
    """The bench/ directory: `explicit`, else ./bench, else the one next to this package (a
    source checkout). Raises ConfigError when none exists."""
    candidates = [explicit] if explicit else [
        os.path.join(os.getcwd(), "bench"),
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")]
    for path in candidates:
        if path and os.path.isdir(path):
            return os.path.abspath(path)
    raise ConfigError(f"no bench/ directory (looked at {', '.join(c for c in candidates if c)}); "
                      f"run from the repository root or pass --bench-dir")


def available(directory):
    """Names of the benchmarks in `directory` (bench/NAME.py, not helpers or run_all)."""
    return sorted(name[:-3] for name in os.listdir(directory)
                  if name.endswith(".py") and not name.startswith("_") and name[:-3] not in NOT_BENCHES)


def launch_mode(path):
    """"mpi" or "self" for the bench file at `path` (its LAUNCH constant, else whether it builds
    an mpiexec command itself or through bench/_common.py's worker_job / run_worker_job)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAUNCH" for t in node.targets):
            value = ast.literal_eval(node.value)
            if value not in ("mpi", "self"):
                raise ConfigError(f"{path}: LAUNCH = {value!r}; use 'mpi' or 'self'")
            return value
    builds_mpiexec = any(isinstance(n, ast.List) and any(
        isinstance(e, ast.Constant) and e.value == "mpiexec" for e in n.elts) or (
        isinstance(n, ast.Call)  # bench/_common.py's job launchers
        and getattr(n.func, "id", None) in ("worker_job", "run_worker_job"))
        for n in ast.walk(tree))
    return "self" if builds_mpiexec else "mpi"


def mpiexec_argv(n, launcher=None):
    """The launcher and its flags for `n` ranks on this machine (see the module docstring)."""
    if launcher:
        return shlex.split(launcher) + ["-n", str(n)]
    here = os.path.dirname(sys.executable)
    mpiexec = shutil.which("mpiexec", path=f"{here}{os.pathsep}{os.environ.get('PATH', '')}") or "mpiexec"
    return [mpiexec, "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
            "-n", str(n)]


def environment():
    """os.environ plus OMP_NUM_THREADS=1 (unless set) and, as root, Open MPI's root permission."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def command(name, n=2, args=(), directory=None, launcher=None):
    """(argv, mode) that runs benchmark `name` with `args`: under the launcher with `n` ranks
    ("mpi"), or as plain python ("self", which launches its own jobs; `n` is then unused).
    Raises ConfigError for an unknown name or n < 1."""
    directory = bench_dir(directory)
    path = os.path.join(directory, f"{name}.py")
    if name in NOT_BENCHES or not os.path.isfile(path):
        raise ConfigError(f"no benchmark {name!r} in {directory}; there are: "
                          f"{', '.join(available(directory))}")
    if int(n) < 1:
        raise ConfigError(f"-n {n}: need at least 1 rank")
    mode = launch_mode(path)
    script = [sys.executable, path] + list(args)
    return (script if mode == "self" else mpiexec_argv(int(n), launcher) + script), mode


def run(name, n=2, args=(), directory=None, launcher=None, dry_run=False):
    """Run benchmark `name` (see `command`), its stdout and stderr passed through, after the
    command on stderr; returns its exit status. dry_run: only print the command, on stdout, with
    the variables `environment()` adds in front (so that `rtxmpi bench NAME --dry-run > job.sh`
    runs the same job), and return 0."""
    argv, _ = command(name, n, args, directory, launcher)
    env = environment()
    added = [f"{k}={shlex.quote(v)}" for k, v in env.items() if os.environ.get(k) != v]
    line = " ".join(added + [shlex.join(argv)])
    if dry_run:
        print(line, flush=True)
        return 0
    print("[rtxmpi bench] " + line, file=sys.stderr, flush=True)
    return subprocess.run(argv, env=env).returncode
