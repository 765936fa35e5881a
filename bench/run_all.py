"""Run every benchmark and regenerate bench/RESULTS.md from their output.

    python bench/run_all.py                     # all, in the order below (same as `rtxmpi bench all`)
    python bench/run_all.py --only checkpoint,memory --results /tmp/RESULTS.md
    python bench/run_all.py --dry-run           # print the commands only

Each benchmark runs through `rtxmpi bench` (rtxmpi/bench_launch.py: this machine's mpiexec flags)
once per world size of its row below (MPI jobs) or once (benchmarks that start their own jobs),
with `--json`. Its stdout (markdown tables, the command, the machine line) and JSON go to
--out-dir as NAME[_nN].md / .json. Then, in RESULTS.md, each benchmark's generated block (between
`<!-- run_all:NAME begin -->` and `<!-- run_all:NAME end -->`) is replaced by the new output; a
section without a block gets one at its end (the hand-written text around it is kept: update
findings that quote numbers by hand); a benchmark without a section gets a new one at the end.
The Machine section's block records the machine, the date and the commit. Benchmarks whose file is
missing in this checkout are skipped and their sections left as they are, as are those of a
benchmark whose output starts with a `skipped:` line (peers.py without torch); a failed benchmark
leaves its block as it was and makes the exit status 1.
"""
import argparse
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
    ("collectives", "Collectives", (2, 4), ()),
    ("scaling", "Data-parallel scaling", (), ()),
    ("peers", "The main job against PyTorch", (), ()),
    ("memory", "Memory", (), ()),
    ("checkpoint", "Checkpoint I/O", (1, 2, 4), ()),
    ("tensor_parallel", "Tensor and sequence parallelism", (2, 4), ()),
    ("pipeline", "Pipeline parallelism", (), ()),
    ("elastic", "Elastic recovery", (), ()),
    ("timeline", "Timeline overhead", (1, 2), ()),
    ("planner", "Planner", (), ()),
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


def splice(text, name, title, body):
    """`text` with `name`'s generated block set to `body` (see the module docstring)."""
    block = f"{begin_marker(name)}\n{body.strip()}\n{end_marker(name)}"
    pattern = re.compile(re.escape(begin_marker(name)) + r".*?" + re.escape(end_marker(name)), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    heading = re.search(rf"^## {re.escape(title)}\s*$", text, re.M)
    if heading is None:
        return text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"
    following = re.search(r"^## ", text[heading.end():], re.M)
    cut = heading.end() + following.start() if following else len(text)
    return text[:cut].rstrip("\n") + f"\n\n{block}\n\n" + text[cut:].lstrip("\n")


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
    with open(args.results) as f:
        text = f.read()
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
        header = (f"Generated by `python bench/run_all.py` ({when}, commit {commit}, "
                  f"{seconds:.0f} s); each run's machine line gives the load average at its start.")
        text = splice(text, name, title, header + "\n\n" + "\n".join(parts))
        done.append(name)
    if args.dry_run:
        return 0
    machine = (f"Last `bench/run_all.py` run: {stamp.strftime('%Y-%m-%d %H:%M UTC')}, commit {commit}; "
               f"benchmarks {', '.join(done) or 'none'}"
               + (f"; failed {', '.join(failed)}" if failed else "")
               + (f"; not in this checkout {', '.join(skipped)}" if skipped else "")
               + (f"; skipped by themselves {', '.join(unavailable)}" if unavailable else "")
               + f".\n\nmachine: {machine_line(info)}")
    text = splice(text, "machine", "Machine", machine)
    with open(args.results, "w") as f:
        f.write(text)
    progress(f"[run_all] {args.results} updated ({len(done)} benchmark(s)); outputs in {out_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
