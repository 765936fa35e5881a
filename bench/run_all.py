"""Run every benchmark and regenerate bench/RESULTS.md, whole, from their output.

    python bench/run_all.py                     # all, in the order below (same as `rtxmpi bench all`)
    python bench/run_all.py --only checkpoint,memory --results /tmp/RESULTS.md
    python bench/run_all.py --dry-run           # print the commands only

Each benchmark runs through `rtxmpi bench` (rtxmpi/bench_launch.py: this machine's mpiexec flags)
once per world size of its row below (MPI jobs) or once (benchmarks that start their own jobs),
with `--json`. Its stdout (markdown tables, the command, the machine line) and JSON go to
--out-dir as NAME[_nN].md / .json. RESULTS.md is then written whole: a header, the Machine
section, and one section per benchmark in the order of BENCHES, each its title, the first
paragraph of the benchmark's docstring, and its latest output (between `<!-- run_all:NAME begin -->`
and `<!-- run_all:NAME end -->`). The output of a benchmark not run this time (`--only`, `--skip`,
missing file, failure, a benchmark whose output starts with a `skipped:` line
(peers.py without torch)) is carried over from the previous RESULTS.md; one never measured says how
to measure it. Nothing else in the file is kept: it holds the current tables only (history is in
git log). A failed benchmark makes the exit status 1.
"""
import argparse
import ast
import datetime
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from _common import machine_info, machine_line, progress  # noqa: E402

from rtxmpi import bench_launch  # noqa: E402

# name, RESULTS.md section title, world sizes (MPI jobs; ignored by benchmarks that launch their
# own jobs), extra arguments. The order of this table is the order of the sections.
BENCHES = (
    ("convergence", "Training to a target", (), ()),
    ("collectives", "Collectives", (2,), ("--sizes", "8,4K,64K,1M,16M,256M")),
    ("scaling", "Data-parallel scaling", (), ()),
    ("peers", "The main job against PyTorch", (), ()),
    ("fused", "Fused CPU operations", (), ()),
    ("gpu_train", "On one GPU against PyTorch", (), ()),
    ("memory", "Memory", (), ()),
    ("checkpoint", "Checkpoint I/O", (2,), ()),
    ("tensor_parallel", "Tensor and sequence parallelism", (2, 4), ()),
    ("pipeline", "Pipeline parallelism", (), ()),
    ("elastic", "Elastic recovery", (), ()),
    ("timeline", "Timeline overhead", (2,), ()),
    ("planner", "Planner", (), ()),
    ("cluster_planner", "Planner at cluster scale", (), ()),
)


def begin_marker(name):
    return f"<!-- run_all:{name} begin -->"


def end_marker(name):
    return f"<!-- run_all:{name} end -->"


def git_describe():
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


HEADER = """# Benchmark results

The current tables of every benchmark in `bench/` ([README.md](README.md)), written whole by
`rtxmpi bench all` (`bench/run_all.py`): do not edit by hand. Each section gives the command that
reproduces it, the machine and its load at the start, and the peer measured in the same run; ratios
compare only numbers of one run. Earlier results are in the file's git history.
"""


def block(name, body):
    return f"{begin_marker(name)}\n{body.strip()}\n{end_marker(name)}"


def previous_blocks(text):
    """{name: body} of every generated block in an earlier RESULTS.md."""
    pattern = re.compile(r"<!-- run_all:(\w+) begin -->\n(.*?)\n<!-- run_all:\1 end -->", re.S)
    return {m.group(1): m.group(2) for m in pattern.finditer(text)}


def summary(name):
    """The first paragraph of bench/NAME.py's docstring (what it measures), or ''."""
    path = os.path.join(HERE, f"{name}.py")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read(), path)) or ""
    return " ".join(doc.split("\n\n")[0].split())


SINGLE_RUN = re.compile(r"\A(Measured [^\n]*)\.\n\n#### `(rtxmpi bench [^`\n]*)`\n\n")


def one_heading(body):
    """A body of one run: its `#### rtxmpi bench NAME` heading folded into the Measured line."""
    if body.count("\n#### `rtxmpi bench ") == 1:
        return SINGLE_RUN.sub(r"\1: `\2`.\n\n", body, count=1)
    return body


def render(bodies, machine):
    """The whole RESULTS.md from {name: generated body} and the Machine section's body."""
    parts = [HEADER.strip(), "## Machine", block("machine", machine)]
    for name, title, sizes, _ in BENCHES:
        body = bodies.get(name) and one_heading(bodies[name])
        parts += [f"## {title}", summary(name),
                  block(name, body) if body else f"Not measured yet: `rtxmpi bench {name}`."]
    return "\n\n".join(p for p in parts if p) + "\n"


def run_one(name, n, extra, args, out_dir):
    """Run one benchmark invocation; returns (ok, markdown body, seconds, whether it skipped itself:
    its output starts with `skipped:`)."""
    stem = os.path.join(out_dir, f"{name}_n{n}" if n else name)
    argv, _ = bench_launch.command(name, n or 1, list(extra) + ["--json", stem + ".json"],
                                   launcher=args.mpiexec)
    label = f"rtxmpi bench {name}" + (f" -n {n}" if n else "")
    progress(f"[run_all] {label}: {' '.join(argv)}")
    if args.dry_run:
        return True, "", 0.0, False
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=bench_launch.environment(), stdout=subprocess.PIPE,
                              text=True, timeout=args.timeout_s, cwd=ROOT)
        ok, out = proc.returncode == 0, proc.stdout
        if not ok:
            progress(f"[run_all] {label} FAILED with exit status {proc.returncode}")
    except subprocess.TimeoutExpired as exc:
        ok, out = False, exc.stdout or ""
        progress(f"[run_all] {label} FAILED: over --timeout-s {args.timeout_s}")
    elapsed = time.perf_counter() - t0
    out = out if isinstance(out, str) else out.decode(errors="replace")
    with open(stem + ".md", "w") as f:
        f.write(out)
    return ok, f"#### `{label}`\n\n{out.strip()}\n", elapsed, out.lstrip().startswith("skipped:")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma-separated benchmark names (default: all)")
    p.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"), help="the file to regenerate")
    p.add_argument("--out-dir", default=None,
                   help="where each run's .md and .json go (default: runs/bench/<UTC time>)")
    p.add_argument("--mpiexec", default=None, help="launcher instead of this machine's mpiexec flags")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit per benchmark run")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run and write nothing")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    known = [row[0] for row in BENCHES]
    only = known if args.only is None else [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(known))
    if unknown:
        sys.exit(f"run_all: unknown benchmark(s) {unknown}; the table has {known}")
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out_dir = args.out_dir or os.path.join(ROOT, "runs", "bench", stamp.strftime("%Y%m%dT%H%M%SZ"))
    if not args.dry_run:
        os.makedirs(out_dir, exist_ok=True)
    info = machine_info()
    commit = git_describe()
    try:
        with open(args.results) as f:
            bodies = previous_blocks(f.read())
    except FileNotFoundError:
        bodies = {}
    failed, done, skipped, unavailable = [], [], [], []
    for name, title, sizes, extra in BENCHES:
        if name not in only or name in args.skip.split(","):
            continue
        path = os.path.join(HERE, f"{name}.py")
        if not os.path.isfile(path):
            progress(f"[run_all] skip {name}: bench/{name}.py is not in this checkout")
            skipped.append(name)
            continue
        mode = bench_launch.launch_mode(path)
        runs = [None] if mode == "self" or not sizes else list(sizes)
        parts, ok_all, seconds, skipped_itself = [], True, 0.0, False
        for n in runs:
            ok, body, elapsed, skip = run_one(name, n, extra, args, out_dir)
            ok_all &= ok
            skipped_itself |= skip
            seconds += elapsed
            parts.append(body)
        if args.dry_run:
            continue
        if not ok_all:
            failed.append(name)
            continue
        if skipped_itself:
            progress(f"[run_all] {name} skipped itself; its section is left as it is")
            unavailable.append(name)
            continue
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = f"Measured {when}, commit {commit}, {seconds:.0f} s."
        bodies[name] = header + "\n\n" + "\n".join(parts)
        done.append(name)
    if args.dry_run:
        return 0
    machine = (f"Last `rtxmpi bench all` run: {stamp.strftime('%Y-%m-%d %H:%M UTC')}, commit {commit}; "
               f"benchmarks {', '.join(done) or 'none'}"
               + (f"; failed {', '.join(failed)}" if failed else "")
               + (f"; not in this checkout {', '.join(skipped)}" if skipped else "")
               + (f"; skipped by themselves {', '.join(unavailable)}" if unavailable else "")
               + f".\n\nmachine: {machine_line(info)}\n\nThe machine may be shared with other "
               "work: each run's machine line gives the load average at its start.")
    with open(args.results, "w") as f:
        f.write(render(bodies, machine))
    progress(f"[run_all] {args.results} written ({len(done)} benchmark(s) run); outputs in {out_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
