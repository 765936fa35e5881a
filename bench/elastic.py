"""Recovery time after a rank dies: shrink-and-continue and replace (ULFM) against supervised restart;
and the time a join takes.

    python bench/elastic.py [--model small] [--ranks 4] [--repeats 3] [--layout "--tp 2 --dp 2"]
                            [--kinds shrink,replace,restart,join] [--json FILE]

(a driver: it launches the jobs itself). Each repetition, in a rotating order:
  shrink   mpiexec --with-ft ulfm -n 4 python examples/train.py --elastic shrink, a seeded random
           rank SIGKILLed in the backward of a seeded random step (RTXMPI_FAULT); recovery = from
           the kill (the fault's own timestamp) to the first step completed after the shrink (the
           survivors' timestamp); lost = steps whose work was redone (the step in progress).
  replace  the same with --elastic grow (and --prtemca state_base_recoverable 1): the survivors
           shrink, spawn a replacement and hand it the replica; recovery = from the kill to the
           first step completed at full size again.
  restart  rtxmpi run -n 4 -- python examples/train.py --ckpt-every K (no ULFM: the dead rank takes
           the job down, the supervisor relaunches it with --resume); recovery = from the kill to
           the first step of the relaunch appearing in the metrics file (polled every 5 ms);
           lost = steps redone from the last checkpoint.
  join     mpiexec --with-ft ulfm -n R/2 ... --elastic grow, and at a seeded random step a join
           request for the other R - R/2 ranks (as `rtxmpi join` writes it); time = from the
           request written to the first step completed at R ranks (rank 0's timestamp); no step
           is lost, so the "steps lost" column shows 0.
--layout: train.py layout flags for both (e.g. "--tp 2 --dp 2": the shrink then rebuilds the model
from the survivors' tp shards and re-plans it for 3 ranks, docs/elastic.md "Hybrid layouts").
Step time (the median before the kill) is shown for scale. Targets (reported, never asserted):
shrink <= 2 s to the first step after recovery with <= 1 step lost; replace <= 5 s; restart <= 30 s;
join <= 5 s.
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import fmt, machine_info, machine_line, markdown_table, progress, write_json  # noqa: E402

LAUNCH = "self"  # rtxmpi bench: a driver that starts its own jobs
REPO = os.path.dirname(HERE)
TRAIN = os.path.join(REPO, "examples", "train.py")
BIN = os.path.dirname(sys.executable)
MPIEXEC = shutil.which("mpiexec", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}") or "mpiexec"
MPIEXEC_ARGV = [MPIEXEC, "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "--bind-to", "none"]
ULFM = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca",
        "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "10"]
KILLED = re.compile(r"\[rtxmpi fault\] kill launch rank (\d+) step (\d+) phase \w+ (?:pid=\d+ )?t=([\d.]+)")
JOINED = re.compile(r"elastic: step (\d+) completed at (\d+) ranks [\d.]+ s after the join was agreed "
                    r"\(t=([\d.]+)\)")
FIRST = re.compile(r"elastic: step (\d+) completed [\d.]+ s after the failure was seen \(t=([\d.]+)\)")
REPLICA = re.compile(r"(?:replica|shards of ranks \[[\d, ]+\]) at step (\d+)")


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "RTXMPI_"))}
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    if os.environ.get("RTXMPI_CACHE_DIR"):
        e["RTXMPI_CACHE_DIR"] = os.environ["RTXMPI_CACHE_DIR"]
    e.update({k: str(v) for k, v in extra.items()})
    return e


def train_args(args, folder):
    return [sys.executable, TRAIN, "--model", args.model, "--steps", str(args.steps),
            "--global-batch", "12", "--seq-len", "64", "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--no-progress", "--ckpt-dir", os.path.join(folder, "ckpt"),
            "--metrics-jsonl", os.path.join(folder, "m.jsonl")] + args.layout.split()


def step_times(folder, before):
    path = os.path.join(folder, "m.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return [r["step_time_ms"] for r in rows if r["step"] < before]


def shrink(args, folder, victim, step, policy="shrink"):
    recoverable = ["--prtemca", "state_base_recoverable", "1"] if policy == "grow" else []
    command = (MPIEXEC_ARGV[:1] + ULFM + recoverable + MPIEXEC_ARGV[1:] + ["-n", str(args.ranks)]
               + train_args(args, folder) + ["--elastic", policy, "--ckpt-every", str(args.ckpt_every)])
    done = subprocess.run(["timeout", "300"] + command, capture_output=True, text=True,
                          env=env(RTXMPI_FAULT=f"kill:{victim}:{step}:backward:0.002"))
    killed, first, replica = KILLED.search(done.stderr), FIRST.search(done.stdout), REPLICA.search(done.stderr)
    grown = policy != "grow" or f"grew the world {args.ranks - 1} -> {args.ranks} ranks" in done.stderr
    if done.returncode or not (killed and first and replica and grown):
        raise RuntimeError(f"{policy} run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return {"recovery_s": float(first.group(2)) - float(killed.group(3)),
            "lost_steps": step - int(replica.group(1)), "step_ms": statistics.median(step_times(folder, step))}


def restart(args, folder, victim, step):
    metrics = os.path.join(folder, "m.jsonl")
    seen = {}  # (line number) -> time it appeared

    def watch(stop):
        count = 0
        while not stop.is_set():
            if os.path.exists(metrics):
                with open(metrics) as f:
                    text = f.read()
                lines = text[:text.rfind("\n") + 1].splitlines()  # complete lines only
                for i in range(count, len(lines)):
                    seen[i] = (time.time(), json.loads(lines[i])["step"])
                count = len(lines)
            time.sleep(0.005)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
    watcher.start()
    command = [sys.executable, "-m", "rtxmpi.cli", "run", "-n", str(args.ranks), "--max-restarts",
               "1", "--mpiexec", " ".join(MPIEXEC_ARGV), "--"] + train_args(args, folder) + [
               "--ckpt-every", str(args.ckpt_every)]
    done = subprocess.run(["timeout", "300"] + command, capture_output=True, text=True,
                          env=env(RTXMPI_FAULT=f"kill:{victim}:{step}:backward:0.002"))
    time.sleep(0.05)
    stop.set()
    watcher.join()
    killed = KILLED.search(done.stderr)
    if done.returncode or not killed:
        raise RuntimeError(f"restart run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    t_kill = float(killed.group(3))
    after = sorted(v for v in seen.values() if v[0] > t_kill)
    if not after:
        raise RuntimeError("no step after the relaunch")
    first_t, first_step = after[0]
    return {"recovery_s": first_t - t_kill, "lost_steps": step - (first_step - 1),
            "step_ms": statistics.median(step_times(folder, step))}


def join(args, folder, step):
    """A job of R/2 ranks joined by R - R/2 once `step` is logged; seconds from the request to the
    first step completed at R ranks."""
    sys.path.insert(0, REPO)
    from rtxmpi.elastic import admit

    start_ranks = args.ranks // 2
    metrics, ckpt, asked = os.path.join(folder, "m.jsonl"), os.path.join(folder, "ckpt"), []

    def ask():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= step:
                admit.write_request(ckpt, args.ranks - start_ranks, timeout_s=300)
                asked.append(time.time())
                return
            time.sleep(0.005)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    command = (MPIEXEC_ARGV[:1] + ULFM + ["--prtemca", "state_base_recoverable", "1"]
               + MPIEXEC_ARGV[1:] + ["-n", str(start_ranks)] + train_args(args, folder)
               + ["--elastic", "grow", "--ckpt-every", str(args.ckpt_every)])
    done = subprocess.run(["timeout", "300"] + command, capture_output=True, text=True, env=env())
    thread.join(5)
    first = JOINED.search(done.stdout)
    if done.returncode or not (asked and first and int(first.group(2)) == args.ranks):
        raise RuntimeError(f"join run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return {"recovery_s": float(first.group(3)) - asked[0], "lost_steps": 0,
            "step_ms": statistics.median(step_times(folder, step))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ckpt-every", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default="", help='train.py layout flags, e.g. "--tp 2 --dp 2"')
    p.add_argument("--kinds", default="shrink,replace,restart,join",
                   help="comma-separated subset of shrink, replace, restart, join")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    kinds = [k for k in ("shrink", "replace", "restart", "join") if k in args.kinds.split(",")]
    if not kinds or set(args.kinds.split(",")) - set(kinds):
        p.error(f"--kinds {args.kinds!r}: a comma-separated subset of shrink, replace, restart, join")
    info = machine_info()
    rng = random.Random(args.seed)
    results = {kind: [] for kind in kinds}
    root = tempfile.mkdtemp(prefix="rtxmpi-bench-elastic-")
    os.environ.setdefault("RTXMPI_CACHE_DIR", os.path.join(root, "cache"))
    try:
        for rep in range(args.repeats):
            victim, step = rng.randrange(args.ranks), rng.randrange(args.ckpt_every + 2, args.steps - 2)
            order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
            for kind in order:
                folder = os.path.join(root, f"{rep}-{kind}")
                os.makedirs(folder)
                result = (restart(args, folder, victim, step) if kind == "restart" else
                          join(args, folder, step) if kind == "join" else
                          shrink(args, folder, victim, step, "grow" if kind == "replace" else "shrink"))
                result.update(victim=victim, step=step)
                results[kind].append(result)
                what = (f"join at step {step}" if kind == "join" else
                        f"kill rank {victim} at step {step}")
                progress(f"{kind} rep {rep}: {what}: "
                         f"{result['recovery_s']:.3f} s, {result['lost_steps']} steps lost")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for kind, target in (("shrink (ULFM, same processes)", 2.0),
                         ("replace (ULFM + spawn, back to full size)", 5.0),
                         ("restart (rtxmpi run, from checkpoint)", 30.0),
                         (f"join {args.ranks // 2} -> {args.ranks} (request -> first step at "
                          f"{args.ranks} ranks)", 5.0)):
        runs = results.get(kind.split()[0])
        if not runs:
            continue
        rec = [r["recovery_s"] for r in runs]
        rows.append([kind, fmt(statistics.median(rec), 3), f"{fmt(min(rec), 3)} - {fmt(max(rec), 3)}",
                     max(r["lost_steps"] for r in runs), fmt(statistics.median(r["step_ms"] for r in runs), 1),
                     f"<= {target:g} s", "yes" if statistics.median(rec) <= target else "NO"])
    print(f"\n{machine_line(info)}")
    print(f"model {args.model}, {args.ranks} ranks{' ' + args.layout if args.layout else ''}, "
          f"global batch 12 x 64, checkpoint every "
          f"{args.ckpt_every} steps; {args.repeats} repetitions, kill = SIGKILL of a random rank in "
          f"the backward of a random step\n")
    print(markdown_table(["recovery", "median s (kill -> first step)", "range s", "max steps lost",
                          "step ms", "target", "met"], rows))
    layout = f' --layout "{args.layout}"' if args.layout else ""
    some = "" if len(kinds) == 4 else f" --kinds {','.join(kinds)}"
    print(f"\ncommand: python bench/elastic.py --model {args.model} --ranks {args.ranks} "
          f"--repeats {args.repeats} --seed {args.seed}{layout}{some}")
    if args.json:
        write_json(args.json, {"machine": info, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
