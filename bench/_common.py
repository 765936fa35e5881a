"""Helpers shared by the benchmarks in bench/: sizes, machine facts, tables, JSON, the launch command.

Nothing here communicates; every function is local to the calling process. Benchmarks print from
rank 0 only and write progress to stderr, so stdout holds just the result tables.
"""
import json
import os
import platform
import re
import shlex
import statistics
import sys

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_LAUNCHERS = ("prterun", "mpiexec", "mpirun", "srun")


# -- sizes ------------------------------------------------------------------------------------
def parse_bytes(text):
    """'8' -> 8, '4K' -> 4096, '256M' -> 268435456 (binary units; 'KiB'/'MB' also accepted)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8, 4K, 1M, 256MiB)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(spec, factor=4):
    """Sizes in bytes from 'A:B' (A, A*factor, ... up to B) and/or comma-separated items.

    '8,4K:256M' -> [8, 4096, 16384, ..., 268435456]. Returns a sorted list without duplicates.
    """
    sizes = set()
    for item in spec.split(","):
        if ":" in item:
            low, high = (parse_bytes(part) for part in item.split(":", 1))
            if not 0 < low <= high:
                raise ValueError(f"bad size range {item!r}: need 0 < start <= end")
            size = low
            while size <= high:
                sizes.add(size)
                size *= factor
        else:
            size = parse_bytes(item)
            if size <= 0:
                raise ValueError(f"sizes must be > 0 bytes, got {item!r}")
            sizes.add(size)
    return sorted(sizes)


def format_bytes(n):
    """4096 -> '4 KiB', 268435456 -> '256 MiB', 8 -> '8 B' (exact powers shown without decimals)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


# -- statistics ---------------------------------------------------------------------------------
def summarize_s(times_s):
    """{'median_us', 'min_us', 'max_us'} of a list of seconds."""
    return {"median_us": statistics.median(times_s) * 1e6, "min_us": min(times_s) * 1e6,
            "max_us": max(times_s) * 1e6}


# -- machine and software -------------------------------------------------------------------------
def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def machine_info(extra_versions=None):
    """Facts that decide benchmark numbers: CPU, cores, memory, OS, MPI and library versions.

    extra_versions: {name: version} to add (e.g. torch when it was used).
    """
    from mpi4py import MPI
    import mpi4py
    import numpy

    info = {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "mpi_library": MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "numpy": numpy.__version__,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    info.update(extra_versions or {})
    return info


def machine_line(info):
    """One line for a results file."""
    line = (f"{info['cpu_model']}, {info['logical_cores']} logical cores, {info['memory_gib']} GiB; "
            f"{info['os']}; Python {info['python']}; {info['mpi_library']}; "
            f"mpi4py {info['mpi4py']}; numpy {info['numpy']}")
    if info.get("torch"):
        line += f"; torch {info['torch']}"
    if info.get("load_average_1m") is not None:
        line += f"; load average {info['load_average_1m']} at the start"
    return line


# -- the command that reproduces a run ------------------------------------------------------------
def launch_command(world_size):
    """The command line that started this job, as a string a user can paste.

    Reads the launcher's own command line (the parent process of an Open MPI rank is `prterun`,
    which `mpiexec` runs) so flags such as --oversubscribe and --mca are kept; falls back to
    `mpiexec -n N python <argv>` with the --mca settings visible in the environment.
    """
    script = ["python"] + sys.argv
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        if argv and os.path.basename(argv[0]) in _LAUNCHERS:
            if os.path.basename(argv[0]) == "prterun":
                argv[0] = "mpiexec"
            else:
                argv[0] = os.path.basename(argv[0])
            return _with_env(shlex.join(argv))
    except OSError:
        pass
    mca = []
    skip = {"num_procs", "initial_wdir", "cpu_type", "PREFIXES"}
    for key, value in sorted(os.environ.items()):
        if key.startswith("OMPI_MCA_") and key[9:] not in skip:
            mca += ["--mca", key[9:], value]
    return _with_env(shlex.join(["mpiexec", "-n", str(world_size)] + mca + script))


def _with_env(command):
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RTXMPI_CHECK")
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in names if k in os.environ]
    return " ".join(env + [command])


# -- tables and files -------------------------------------------------------------------------------
def markdown_table(header, rows, align=None):
    """A GitHub markdown table; `align` is a string of 'l'/'r' per column (default: first l, rest r)."""
    align = align or "l" + "r" * (len(header) - 1)
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row):
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w)
                                 for c, w, a in zip(row, widths, align)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1))
                          for w, a in zip(widths, align)) + "|"
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def fmt(value, digits=2):
    """A number for a table cell; '-' for None. Below 0.1, `digits` significant digits (a small
    message's GB/s would otherwise print as 0.000)."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if 0 < abs(value) < 0.1:
        return f"{value:.{digits}g}"
    return f"{value:.{digits}f}"


def _json_default(value):
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):  # numpy arrays
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_json(path, obj):
    """Write `obj` as indented JSON atomically (temporary file + rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def progress(message):
    """A progress line on stderr (call from rank 0 only)."""
    print(message, file=sys.stderr, flush=True)


def time_interleaved(comm, variants, next_input, steps, warmup=0, label=None):
    """Time several step functions side by side on the same inputs, in a rotating order.

    comm: the mpi4py communicator every rank of the job calls this on. variants: {name: fn(x, y)}.
    next_input: () -> (x, y), called once per round so every variant sees the same batch. Each
    round rotates the order (noise and drift hit every variant alike); a step's time is the slowest
    rank's (MAX-reduced), in seconds, after a barrier. Rounds below `warmup` are not recorded.
    Returns {name: [seconds per recorded round]}. With `label`, rank 0 prints progress to stderr.
    """
    import time
    from mpi4py import MPI
    names = list(variants)
    times = {name: [] for name in names}
    for i in range(warmup + steps):
        x, y = next_input()
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            comm.Barrier()
            t0 = time.perf_counter()
            variants[name](x, y)
            elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= warmup:
                times[name].append(elapsed)
        if label and comm.Get_rank() == 0:
            print(f"[{label}] step {i + 1}/{warmup + steps}", file=sys.stderr, flush=True)
    return times


def run_worker_job(label, ranks, script, worker_args, timeout=None):
    """Run `script --worker ...` as an MPI job of `ranks` ranks (worker_job) and return the dict
    its rank 0 printed as one `RESULT {json}` line. The command goes to stderr first; the job's
    stderr passes through (progress); a failed job ends this process naming `label` with the
    job's stdout."""
    import subprocess

    cmd, env = worker_job(ranks, script, worker_args)
    print(f"[{label}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"[{label}] {ranks} ranks: the job failed (exit {proc.returncode}):\n{proc.stdout}")
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"[{label}] {ranks} ranks: the job printed no RESULT line:\n{proc.stdout}")
    return json.loads(line[len("RESULT "):])


def mpi_job(ranks, argv):
    """(cmd, env) that runs `python argv...` as an MPI job of `ranks` ranks on this machine.

    One BLAS thread per rank, checking mode off, more ranks than cores allowed (--oversubscribe,
    ranks yield while idle, no binding), root allowed when run as root.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", RTXMPI_CHECK="0")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpiexec", "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
           "-n", str(ranks), sys.executable, *[str(a) for a in argv]]
    return cmd, env


def worker_job(ranks, script, worker_args):
    """(cmd, env) that runs `script --worker ...` as an MPI job of `ranks` ranks (mpi_job).
    worker_args: the worker's own arguments after `--worker`, as strings."""
    return mpi_job(ranks, [os.path.abspath(script), "--worker", *worker_args])
