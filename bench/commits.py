"""The training job's step time at two commits, alternated in one run: what a change costs.

    python bench/commits.py --old 521f0ce --new HEAD -- --model small --dp 2
    python bench/commits.py --old 521f0ce --ranks 2 --runs 5 --steps 30 -- --model small --tp 2
    python bench/commits.py --old HEAD~3 --script examples/train_vit.py --steps 40 -- --zero-stage 3

Each commit is exported (`git archive`) into a temporary directory and its C extensions (its
pyproject.toml's ext-modules: the mailbox, the CPU fused kernels) are built there (a commit
compared with itself: built once, copied), so the old code runs as it was, with the same
Python, MPI and packages. Then
--runs rounds each run the job once per commit, in ABBA order (old, new; new, old; ...) so a
drift of the machine's load falls on both alike: `mpiexec -n RANKS python SCRIPT ARGS --steps N
--metrics-jsonl F --no-progress` with the commit's directory first on PYTHONPATH. A run's figure
is the median step_time_ms (the script's metrics JSONL) of the steps after --warmup; a commit's is
the median of its runs. The table gives every run, the medians, new/old (below 1: the new commit
is faster) and the spread of the runs, so a ratio inside the spread reads as "no difference";
then the median of each round's new/old, which a load that comes and goes between rounds (another
job on the machine) moves less than the medians.
Arguments after `--` go to the script at both commits; a flag one commit lacks fails its run,
named with the script's error line.
"""
import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import machine_info, machine_line, markdown_table, progress, write_json  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--new", default="HEAD", help="the commit measured (default HEAD)")
    parser.add_argument("--script", default="examples/train.py",
                        help="the training script, relative to the repository (default examples/train.py)")
    parser.add_argument("--ranks", type=int, default=2, help="mpiexec -n (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="runs per commit (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not counted (default 5)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    parser.add_argument("--json", help="also write every run's figures here")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="after --: the script's own flags, the same at both commits")
    args = parser.parse_args(argv)
    if args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    for name in ("ranks", "runs", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    return args


def resolve(revision):
    """The full commit id of a git revision of this repository (exits with the git error)."""
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", f"{revision}^{{commit}}"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: {revision!r} is not a commit of {ROOT}: {out.stderr.strip()}")
    return out.stdout.strip()


def export(commit, into):
    """The tree of `commit` in directory `into`, with its C extensions built in place: those its
    pyproject.toml lists (ext-modules, with their extra-compile-args), else its mailbox."""
    os.makedirs(into)
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", into], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        sys.exit(f"error: git archive {commit} failed")
    with open(os.path.join(into, "pyproject.toml"), "rb") as f:
        extensions = tomllib.load(f).get("tool", {}).get("setuptools", {}).get("ext-modules", [])
    if not extensions and os.path.exists(os.path.join(into, "rtxmpi", "comm", "_mailbox.c")):
        extensions = [{"name": "rtxmpi.comm._mailbox", "sources": ["rtxmpi/comm/_mailbox.c"],
                       "extra-compile-args": ["-O3"]}]
    for ext in extensions:
        target = os.path.join(into, *ext["name"].split(".")) + sysconfig.get_config_var("EXT_SUFFIX")
        subprocess.run(["cc", *ext.get("extra-compile-args", []), "-shared", "-fPIC",
                        f"-I{sysconfig.get_paths()['include']}",
                        *(os.path.join(into, source) for source in ext["sources"]), "-o", target],
                       check=True)


def step_times(path, warmup):
    """step_time_ms of the steps after `warmup` in a metrics JSONL file."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["step_time_ms"] for r in records if r.get("step", 0) > warmup and "step_time_ms" in r]


def run_once(directory, args, metrics):
    """One run of the script from `directory`; the median step time in ms."""
    command = (["mpiexec", "-n", str(args.ranks)] + _mpiexec_flags()
               + [sys.executable, args.script] + args.script_args
               + ["--steps", str(args.steps), "--metrics-jsonl", metrics, "--no-progress"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [directory] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.startswith("error")] or \
            done.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"exit {done.returncode}: {' | '.join(lines)}")
    times = step_times(metrics, args.warmup)
    if not times:
        raise RuntimeError(f"no step after --warmup {args.warmup} in {metrics}")
    return statistics.median(times)


def _mpiexec_flags():
    """Open MPI's flags for this machine: as root, more ranks than cores, no binding."""
    flags = ["--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        flags.insert(0, "--allow-run-as-root")
    return flags


def main(argv=None):
    args = parse_args(argv)
    commits = {"old": resolve(args.old), "new": resolve(args.new)}
    info = machine_info()
    runs = {"old": [], "new": []}
    work = tempfile.mkdtemp(prefix="rtxmpi-commits-")
    try:
        exported = {}  # commit -> its directory: a commit compared with itself is built once
        for label, commit in commits.items():
            into = os.path.join(work, label)
            if commit in exported:
                progress(f"copying {label} {commit[:10]} from {os.path.basename(exported[commit])}")
                shutil.copytree(exported[commit], into, symlinks=True)
            else:
                progress(f"exporting {label} {commit[:10]}")
                export(commit, into)
            exported.setdefault(commit, into)
        order = []
        for r in range(args.runs):  # ABBA: old new, new old, ...
            order += ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for i, label in enumerate(order):
            metrics = os.path.join(work, f"metrics-{i}.jsonl")
            t0 = time.perf_counter()
            runs[label].append(run_once(os.path.join(work, label), args, metrics))
            progress(f"run {i + 1}/{len(order)}: {label} {runs[label][-1]:.1f} ms/step "
                     f"({time.perf_counter() - t0:.0f} s)")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"error: {exc}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {label: statistics.median(values) for label, values in runs.items()}
    spread = {label: (max(v) - min(v)) / medians[label] for label, v in runs.items()}
    rows = [[label, commits[label][:10], ", ".join(f"{v:.1f}" for v in runs[label]),
             f"{medians[label]:.1f}", f"{spread[label]:.1%}"] for label in ("old", "new")]
    print(markdown_table(["commit", "id", "median step time per run (ms)", "median (ms)",
                          "spread (max-min)/median"], rows, align="llrrr"))
    ratio = medians["new"] / medians["old"]
    pairs = [n / o for o, n in zip(runs["old"], runs["new"])]  # each round's two runs, back to back
    verdict = "" if args.runs < 2 else (
        f" ({'within' if abs(ratio - 1) <= max(spread.values()) else 'outside'} the runs' spread)")
    print(f"\nnew/old step time: {ratio:.3f} of the medians{verdict}; "
          f"{statistics.median(pairs):.3f} the median of the rounds' ratios "
          f"({', '.join(f'{r:.2f}' for r in pairs)})")
    print(f"machine: {machine_line(info)}")
    print("reproduce: " + shlex.join(["python", "bench/commits.py", "--old", commits["old"][:10],
                                       "--new", commits["new"][:10],
                                       "--script", args.script, "--ranks", str(args.ranks),
                                       "--runs", str(args.runs), "--steps", str(args.steps),
                                       "--warmup", str(args.warmup), "--"] + args.script_args))
    if args.json:
        write_json(args.json, {"commits": commits, "runs_ms": runs, "median_ms": medians,
                               "ratio_new_over_old": ratio, "round_ratios": pairs,
                               "args": vars(args), "machine": info})


if __name__ == "__main__":
    main()
