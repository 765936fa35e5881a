"""The `rtxmpi` command.

    rtxmpi info                       environment of one process
    mpiexec -n 4 rtxmpi info          ... and of every rank: hosts, local ranks, devices, topology
    mpiexec -n 4 rtxmpi info --calibrate   ... with measured bandwidth/latency between ranks
    rtxmpi ckpt ls DIR                checkpoints in DIR: step, committed, world size, size, latest
    rtxmpi ckpt verify DIR [--step S] metadata, every file and dataset, checksums (exit 1 if bad)
    rtxmpi ckpt inspect DIR [--step S] [--all]  a summary of the tensors and the meta (--all: all of it)
    rtxmpi run -n N [--min-ranks K] [--max-restarts R] -- python train.py ...
                                      supervise: forward signals, relaunch after a failure
    rtxmpi join --job CKPT_DIR -n K   admit K more ranks into the running --elastic grow job whose
                                      --ckpt-dir is CKPT_DIR, at its next step boundary
    rtxmpi plan --model small --world-size 4 [--profile F]   ranked layouts and why the first
    mpiexec -n 4 rtxmpi plan --calibrate --save-profile F  ... measuring this machine first
    rtxmpi report RUN_DIR [RUN_DIR ...] [--out DIR] [--last N]   summary, bottleneck and PNG plots
                                      of training runs with a run_dir (docs/observe.md)
    rtxmpi bench NAME|all [-n N] [--dry-run] [-- ARGS]   run bench/NAME.py under the right
                                      launcher, or every benchmark (bench/README.md)

Output piped into a reader that stops early (`rtxmpi info | head`) ends quietly, exit 141.
"""
import argparse
import os
import platform
import socket
import sys

import numpy as np


def _versions():
    import h5py
    import mpi4py
    from mpi4py import MPI

    import rtxmpi

    try:
        import cupy

        cupy_version = cupy.__version__
    except Exception:
        cupy_version = "not installed"
    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    return {
        "rtxmpi": rtxmpi.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "h5py": h5py.__version__,
        "cupy": cupy_version,
        "MPI library": library,
        "MPI standard": "%d.%d" % MPI.Get_version(),
    }


_THREAD_LEVELS = {"THREAD_SINGLE": "single", "THREAD_FUNNELED": "funneled",
                  "THREAD_SERIALIZED": "serialized", "THREAD_MULTIPLE": "multiple"}


def _thread_level():
    from mpi4py import MPI

    level = MPI.Query_thread()
    for name, label in _THREAD_LEVELS.items():
        if getattr(MPI, name) == level:
            return label
    return str(level)


def _all_reduce_paths(group):
    """What the world's blocking all_reduce runs on a node (comm/shm.py), after one small
    all_reduce builds it (collective)."""
    import numpy as np

    from .comm import shm

    if group.world_size == 1:
        return "one rank: no transfer"
    if not hasattr(group.backend, "shm_config"):
        return f"{group.backend.name} backend"
    group.all_reduce(np.zeros(1, np.float32))
    text = shm.describe(group.backend, lambda n: f"{n} bytes")
    if shm._mailbox is None:
        text += " (the compiled mailbox was not built: pip install rebuilds it)"
    return text


def _cpu_kernels():
    """Which path the CPU layers run (rtxmpi.fused), for `info`."""
    from . import fused
    from .errors import ConfigError

    try:
        return fused.describe()
    except ConfigError as exc:
        return f"not known: {exc}"


def cmd_info(args):
    """Print versions, the MPI library and thread level, world size, hosts, local ranks, GPUs."""
    from mpi4py import MPI

    from .backend import gpu_count
    from .comm import init
    from .comm.launch import slurm_env, slurm_summary
    from .errors import ConfigError
    from .exchange import all_gather_json

    if not args.timeout_s > 0:  # a bad flag, not a reason to describe a lone process
        print(f"error: --timeout-s must be > 0 seconds, got {args.timeout_s}", file=sys.stderr)
        return 2
    warning = None
    try:
        group = init(timeout_s=args.timeout_s)
        rank, size, local_rank, device = group.rank, group.world_size, group.local_rank, group.device
    except ConfigError as exc:  # e.g. Slurm singletons: still describe this process
        warning = str(exc)
        comm = MPI.COMM_WORLD
        rank, size, local_rank, device = comm.Get_rank(), comm.Get_size(), 0, "cpu"
    row = [rank, socket.gethostname(), local_rank, str(device), gpu_count()]
    if warning is None:  # init checked every rank's SLURM_* variables: slurm_env cannot raise
        rows, slurm = zip(*all_gather_json(group, [row, slurm_env()]))
    else:
        try:
            rows, slurm = [row], [slurm_env()]
        except ConfigError:  # a malformed SLURM_* variable: init's warning already names it
            rows, slurm = [row], []
    topo = None
    shm_text = "not known (rtxmpi.init failed, see the warning)"
    if warning is None:  # collective: GPUs, links, InfiniBand, NUMA of every host
        from .topology import discover
        topo = discover(group, calibrate=args.calibrate)
        shm_text = _all_reduce_paths(group)
    if rank != 0:
        return 0
    for key, value in _versions().items():
        print(f"{key:<14} {value}")
    print(f"{'thread level':<14} {_thread_level()}")
    print(f"{'all_reduce':<14} {shm_text}")
    print(f"{'CPU kernels':<14} {_cpu_kernels()}")
    print(f"{'world_size':<14} {size}")
    hosts = sorted({r[1] for r in rows})
    print(f"{'hosts':<14} {len(hosts)}: {', '.join(hosts)}")
    gpus = rows[0][4]
    print(f"{'GPUs':<14} {gpus if gpus else 'none'} (on rank 0's host)")
    print(f"{'rank':>6} {'host':<24} {'local_rank':>10} {'device':<8}")
    for rank_, host, local, dev, _ in rows:
        print(f"{rank_:>6} {host:<24} {local:>10} {dev:<8}")
    for line in slurm_summary(slurm, size, hosts):  # SLURM_* variables checked against MPI
        print(f"{'slurm':<14} {line}")
    if topo is not None:
        print("topology")
        print("\n".join("  " + line for line in topo.describe().splitlines()))
    if warning:
        print(f"warning: {warning}")
    return 0


def _human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def cmd_ckpt_ls(args):
    """One line per step dir: step, committed or not, saved world size, size on disk, latest."""
    from .checkpoint import list_checkpoints

    if not os.path.isdir(args.dir):
        print(f"error: {args.dir}: no such directory", file=sys.stderr)
        return 2
    found = list_checkpoints(args.dir)
    if not found:
        print(f"{args.dir}: no checkpoints")
        return 0
    print(f"{'step':>10} {'state':<12} {'world_size':>10} {'size':>10}  path")
    for c in found:
        state = "CORRUPT" if c.problem else "committed" if c.committed else "UNCOMMITTED"
        print(f"{c.step:>10} {state:<12} {c.world_size:>10} {_human_bytes(c.bytes):>10}  {c.path}"
              f"{'  <- latest' if c.latest else ''}")
    for c in found:
        if c.problem:
            print(f"step {c.step}: {c.problem}")
    if any(c.problem for c in found):
        print("--resume skips a checkpoint that does not verify (rtxmpi ckpt verify DIR --step S "
              "also reads its files)")
    return 0


def _committed_steps(ckpt_dir):
    """' (committed steps in DIR: 25, 30)' for an error about a step the user named."""
    from .checkpoint import list_checkpoints

    steps = [str(c.step) for c in list_checkpoints(ckpt_dir) if c.committed] \
        if os.path.isdir(ckpt_dir) else []
    return f" (committed steps in {ckpt_dir}: {', '.join(steps) or 'none'})"


def cmd_ckpt_verify(args):
    """Check a committed checkpoint as a resume would: metadata.json, every file and dataset
    (structure, sizes, checksums). The same reader as `load_checkpoint` and `latest_valid`."""
    from .checkpoint import latest_step, verify_checkpoint
    from .errors import CheckpointError

    if args.step is not None and args.step < 0:
        print(f"error: --step must be >= 0, got {args.step}", file=sys.stderr)
        return 2
    warnings = []
    try:
        checked = verify_checkpoint(args.dir, args.step, warnings)
    except CheckpointError as exc:
        print(f"FAILED: {exc}" + (_committed_steps(args.dir) if args.step is not None else ""),
              file=sys.stderr)
        return 1
    for text in warnings:
        print(f"warning: {text}", file=sys.stderr)
    step = f"step {args.step}" if args.step is not None else f"step {latest_step(args.dir)} (latest)"
    print(f"ok: {step}: {len(checked)} dataset{'' if len(checked) == 1 else 's'} verified "
          f"(sizes and checksums)")
    return 0


INSPECT_TENSORS = 20  # tensors the summary lists before "... N more"
INSPECT_VALUE_CHARS = 100  # a meta value longer than this (as JSON) is summarized


def _meta_summary(key, value):
    """One line for a meta entry: its JSON when short, else its kind and size."""
    import json

    text = json.dumps(value, sort_keys=True)
    if len(text) <= INSPECT_VALUE_CHARS:
        return f"  {key}: {text}"
    size = f"{len(value)} {'keys' if isinstance(value, dict) else 'items'}" \
        if isinstance(value, (dict, list)) else f"{len(text)} characters"
    return f"  {key}: {type(value).__name__} of {size}"


def cmd_ckpt_inspect(args):
    """A committed checkpoint from its metadata.json (no data read): a summary (tensors with their
    piece counts, the meta's short values), or with --all every tensor's pieces and the whole meta."""
    import json

    from .checkpoint import load_checkpoint
    from .errors import CheckpointError

    if args.step is not None and args.step < 0:
        print(f"error: --step must be >= 0, got {args.step}", file=sys.stderr)
        return 2
    try:
        ckpt = load_checkpoint(None, args.dir, args.step)
    except CheckpointError as exc:
        print(f"error: {exc}" + (_committed_steps(args.dir) if args.step is not None else ""),
              file=sys.stderr)
        return 1
    tensors = list(ckpt.tensors.items())
    nbytes = sum(info["global_size"] * np.dtype(info["dtype"]).itemsize for _, info in tensors)
    print(f"{ckpt.path}: step {ckpt.step}, saved by {ckpt.world_size_saved} "
          f"rank{'' if ckpt.world_size_saved == 1 else 's'}, {len(tensors)} tensor"
          f"{'' if len(tensors) == 1 else 's'}, {_human_bytes(nbytes)}")
    shown = tensors if args.all else tensors[:INSPECT_TENSORS]
    where = "pieces (file [offset, offset+length))" if args.all else "pieces"
    print(f"{'tensor':<24} {'dtype':<8} {'global shape':<14} {where}")
    for name, info in shown:
        pieces = ", ".join(f"{p['file']} [{p['offset']}, {p['offset'] + p['length']})"
                           for p in info["pieces"]) if args.all else len(info["pieces"])
        print(f"{name:<24} {np.dtype(info['dtype']).name:<8} {str((info['global_size'],)):<14} {pieces}")
    if len(shown) < len(tensors):
        print(f"... {len(tensors) - len(shown)} more tensors (--all lists every one)")
    print("meta:")
    if args.all:
        print(json.dumps(ckpt.meta, indent=1, sort_keys=True))
    else:
        print("\n".join(_meta_summary(k, v) for k, v in sorted(ckpt.meta.items())))
        print("(--all: every tensor's pieces and the whole meta)")
    return 0


def cmd_run(args):
    """Supervise `mpiexec -n N COMMAND` (rtxmpi.elastic.supervisor; docs/elastic.md)."""
    import shlex

    from .elastic.supervisor import Supervisor
    from .errors import ConfigError

    command = args.job[1:] if args.job[:1] == ["--"] else args.job
    try:
        supervisor = Supervisor(command, n=args.n, min_ranks=args.min_ranks,
                                max_ranks=args.max_ranks, max_restarts=args.max_restarts,
                                grace_s=args.grace_s, hostfile=args.hostfile,
                                mpiexec=shlex.split(args.mpiexec), resume_flag=args.resume_flag,
                                early_failure_s=args.early_failure_s,
                                max_early_failures=args.max_early_failures,
                                backoff_s=args.backoff_s)
        return supervisor.run()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


def cmd_join(args):
    """Ask the running job at --job DIR to admit -n more ranks (rtxmpi.elastic.admit)."""
    from .elastic.admit import client
    from .errors import ConfigError

    try:
        return client(args.job, args.n, timeout_s=args.timeout_s)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


def cmd_plan(args):
    """Rank parallel layouts by predicted step time (rtxmpi/parallel/planner.py, docs/planner.md)."""
    from .parallel import planner

    return planner.main(args)


def cmd_report(args):
    from .errors import ConfigError
    from .observe.report import load_run, plot, summary

    try:
        if args.last < 1:
            raise ConfigError(f"--last must be >= 1, got {args.last}")
        runs = [load_run(path) for path in args.run_dir]
        print(summary(runs, last=args.last))
        written = plot(runs[0], args.out or args.run_dir[0], last=args.last)
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("plots: " + ", ".join(written))
    return 0


def cmd_bench(args):
    """Run bench/NAME.py under the right launcher (rtxmpi/bench_launch.py), or `all`: bench/run_all.py."""
    import os
    import subprocess

    from . import bench_launch
    from .errors import ConfigError

    # options may also follow NAME (`rtxmpi bench checkpoint -n 4 --size-mb 64`): ours are taken
    # from before a `--`, everything else goes to the benchmark
    cut = args.args.index("--") if "--" in args.args else len(args.args)
    ours = argparse.ArgumentParser(add_help=False)
    for flag in ("-n", "--mpiexec", "--bench-dir"):
        ours.add_argument(flag, type=int if flag == "-n" else str, default=argparse.SUPPRESS)
    ours.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS)
    known, rest = ours.parse_known_args(args.args[:cut])
    vars(args).update(vars(known))
    extra = rest + args.args[cut + 1:]
    try:
        if args.name == "all":
            script = os.path.join(bench_launch.bench_dir(args.bench_dir), "run_all.py")
            argv = ([sys.executable, script] + (["--mpiexec", args.mpiexec] if args.mpiexec else [])
                    + (["--dry-run"] if args.dry_run else []) + extra)
            print("[rtxmpi bench] " + " ".join(argv), file=sys.stderr, flush=True)
            return subprocess.run(argv, env=bench_launch.environment()).returncode
        return bench_launch.run(args.name, args.n, extra, args.bench_dir, args.mpiexec, args.dry_run)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser():
    parser = argparse.ArgumentParser(prog="rtxmpi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, MPI library, world size, hosts, GPUs")
    info.add_argument("--timeout-s", type=float, default=60.0, dest="timeout_s",
                      help="deadline of the rank exchange (seconds)")
    info.add_argument("--calibrate", action="store_true",
                      help="measure bandwidth and latency between every pair of ranks")
    info.set_defaults(func=cmd_info)
    ckpt = sub.add_parser("ckpt", help="list, verify and inspect checkpoints (one process)")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    for name, func, text in (("ls", cmd_ckpt_ls, "step dirs, committed or not, and which is latest"),
                             ("verify", cmd_ckpt_verify, "sizes and checksums of every dataset"),
                             ("inspect", cmd_ckpt_inspect, "summary of the tensors and meta")):
        cmd = ckpt_sub.add_parser(name, help=text)
        cmd.add_argument("dir", help="checkpoint directory (holds step_XXXXXXXX/ and latest)")
        if name != "ls":
            cmd.add_argument("--step", type=int, default=None, help="step (default: the latest committed)")
        if name == "inspect":
            cmd.add_argument("--all", action="store_true",
                             help="every tensor with its pieces and the whole meta (default: a summary)")
        cmd.set_defaults(func=func)
    run = sub.add_parser("run", help="supervise an MPI job: forward signals, relaunch after a failure",
                         description="Exit status: 0 done, 75 pre-empted, 130 interrupted by Ctrl-C, "
                                     "2 bad flags, 4 diverged, else the "
                                     "last attempt's status after --max-restarts relaunches or "
                                     "--max-early-failures launches in a row that failed before "
                                     "any training step (docs/elastic.md).")
    run.add_argument("-n", type=int, required=True, help="ranks of the first launch")
    run.add_argument("--min-ranks", type=int, default=1, help="give up below this many ranks")
    run.add_argument("--max-ranks", type=int, default=None,
                     help="grow up to this many ranks when the hostfile offers more slots")
    run.add_argument("--max-restarts", type=int, default=3, help="relaunches after failures")
    run.add_argument("--grace-s", type=float, default=30.0,
                     help="seconds the ranks get to checkpoint after a forwarded signal")
    run.add_argument("--hostfile", default=None, help="Open MPI hostfile, re-read before every launch")
    run.add_argument("--mpiexec", default="mpiexec",
                     help="launcher and its options, e.g. 'mpiexec --oversubscribe --bind-to none'")
    run.add_argument("--resume-flag", default="--resume",
                     help="added to the command on relaunches when missing ('' for none)")
    run.add_argument("--early-failure-s", type=float, default=60.0, metavar="S",
                     help="a failure within S s of a launch with no training step done is an early "
                          "failure: back off before relaunching (0: off)")
    run.add_argument("--max-early-failures", type=int, default=3, metavar="K",
                     help="give up after K early failures in a row, naming the cause")
    run.add_argument("--backoff-s", type=float, default=2.0, metavar="B",
                     help="wait B s after an early failure, doubling each time in a row (at most 60)")
    run.add_argument("job", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    run.set_defaults(func=cmd_run)
    join = sub.add_parser("join", help="admit more ranks into a running --elastic grow job",
                          description="Writes a join request into the job's --ckpt-dir; the job "
                                      "spawns the ranks at its next step boundary and re-plans "
                                      "its layout (docs/elastic.md, \"Join\"). Exit status: 0 "
                                      "admitted, 1 refused or no answer in time, 2 bad arguments "
                                      "or no running job at DIR.")
    join.add_argument("--job", required=True, metavar="DIR", help="the job's --ckpt-dir")
    join.add_argument("-n", type=int, required=True, metavar="K", help="ranks to add")
    join.add_argument("--timeout-s", type=float, default=300.0, metavar="S",
                      help="give up (and withdraw the request) after S seconds without an answer")
    join.set_defaults(func=cmd_join)
    plan = sub.add_parser("plan", help="rank (dp, tp, pp, sp) layouts by predicted step time",
                          description="Exit status: 0 planned, 1 no layout fits, 2 bad flags. "
                                      "See docs/planner.md.")
    from .parallel.planner import add_arguments as add_plan_arguments

    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)
    report = sub.add_parser("report", help="summary, bottleneck and plots of a training run",
                            description="Reads what a training run wrote to its run_dir; the first "
                                        "run is described, several runs add a scaling table. "
                                        "Exit status: 0, or 2 for a missing or bad run directory.")
    report.add_argument("run_dir", nargs="+", help="run directories (TrainConfig.run_dir)")
    report.add_argument("--out", default=None, help="where the PNGs go (default: the first run dir)")
    report.add_argument("--last", type=int, default=20,
                        help="steps the breakdown and the bottleneck verdict look at")
    report.set_defaults(func=cmd_report)
    bench = sub.add_parser("bench", help="run a benchmark (bench/NAME.py) or all of them",
                           description="NAME: a file of bench/ (collectives, scaling, memory, "
                                       "checkpoint, ...) or 'all' (bench/run_all.py: every "
                                       "benchmark, then bench/RESULTS.md regenerated). Arguments "
                                       "after NAME go to the benchmark. Exit status: the "
                                       "benchmark's; 2 for an unknown name.")
    bench.add_argument("name", help="benchmark name, or 'all'")
    bench.add_argument("-n", type=int, default=2, help="ranks, for benchmarks that are MPI jobs")
    bench.add_argument("--mpiexec", default=None,
                       help="launcher to use instead of this machine's mpiexec flags, "
                            "e.g. 'srun --mpi=pmix'")
    bench.add_argument("--bench-dir", default=None, help="default: ./bench or the source checkout's")
    bench.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="[--] arguments for the benchmark")
    bench.set_defaults(func=cmd_bench)
    return parser


EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE


def main(argv=None):
    """The entry point: the subcommand's exit status. A closed stdout (`rtxmpi info | head`)
    ends the command quietly with EXIT_BROKEN_PIPE instead of a BrokenPipeError traceback."""
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a broken pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        # further writes (the exit's flush included) go nowhere instead of raising again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
