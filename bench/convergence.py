"""Training to a target: the GPT main job's validation loss over time, and the ViT's held-out accuracy.

    python bench/convergence.py                    # GPT small 800 steps and ViT small 400 steps, 2 ranks
    python bench/convergence.py --quick            # 60 + 60 steps (a check that it runs)
    python bench/convergence.py --gpt-steps 800 --vit-steps 600 --ranks 2 --json convergence.json

GPT: `examples/train.py --model small` (byte-level, the default corpus: the Python standard
library's source), global batch 32 x 128, validation every --eval-every steps; the table gives
validation loss (nats/byte) at each evaluation, with the training time up to it (sum of the
steps' `step_time_ms`) and the whole launch's wall time. Target: below 1.6 nats/byte within 15
minutes at 2 ranks. ViT: `examples/train_vit.py` with its defaults (8x8 digits); the table gives the
held-out accuracy and the wall time. Target: at least 90% in about a minute at 2 ranks. Both jobs run
one after the other with one BLAS thread per rank.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import (fmt, machine_info, machine_line, markdown_table, mpi_job, progress,  # noqa: E402
                     write_json)

GPT_TARGET = 1.6  # nats/byte
VIT_TARGET = 0.90  # held-out accuracy


def run(label, ranks, argv, timeout_s):
    """Run `python argv` as an MPI job; (stdout, wall seconds). Exits naming `label` on failure."""
    cmd, env = mpi_job(ranks, argv)
    progress(f"[{label}] {' '.join(cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"[{label}] the job failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout, wall


def gpt(args, tmp):
    jsonl = os.path.join(tmp, "gpt.jsonl")
    shown = ["examples/train.py", "--model", "small", "--steps", args.gpt_steps, "--eval-every",
             args.eval_every, "--seed", args.seed, "--sample-tokens", 0]
    _, wall = run("gpt", args.ranks, shown + ["--metrics-jsonl", jsonl], args.timeout_s)
    rows, elapsed_ms = [], 0.0
    with open(jsonl) as f:
        for line in f:
            record = json.loads(line)
            elapsed_ms += record.get("step_time_ms") or 0.0
            if record.get("val_loss") is not None:
                rows.append({"step": record["step"], "val_loss": record["val_loss"],
                             "train_s": elapsed_ms / 1e3})
    reached = next((r for r in rows if r["val_loss"] < GPT_TARGET), None)
    return {"command": "python " + " ".join(map(str, shown)), "ranks": args.ranks, "evals": rows,
            "wall_s": wall, "target": GPT_TARGET, "reached": reached}


def vit(args):
    argv = ["examples/train_vit.py", "--steps", args.vit_steps, "--seed", args.seed]
    out, wall = run("vit", args.ranks, argv, args.timeout_s)
    match = re.search(r"held-out accuracy ([0-9.]+) \((\d+)/(\d+)\).*train loss ([0-9.]+)", out)
    if match is None:
        sys.exit(f"[vit] no held-out accuracy line in the job's output:\n{out[-2000:]}")
    return {"command": "python " + " ".join(map(str, argv)), "ranks": args.ranks,
            "accuracy": float(match.group(1)), "correct": int(match.group(2)),
            "total": int(match.group(3)), "train_loss": float(match.group(4)), "wall_s": wall,
            "target": VIT_TARGET}


def report(result, info):
    g, v = result["gpt"], result["vit"]
    print(f"#### GPT small, {g['ranks']} ranks, global batch 32 x 128: validation loss (nats/byte)\n")
    print(markdown_table(["step", "val_loss", "training time (s)"],
                         [[r["step"], f"{r['val_loss']:.3f}", fmt(r["train_s"], 1)] for r in g["evals"]]))
    if g["reached"]:
        verdict = (f"below {g['target']} at step {g['reached']['step']} after "
                   f"{g['reached']['train_s']:.0f} s of training: "
                   + ("**met**" if g["reached"]["train_s"] <= 900 else "**not met** (over 15 minutes)"))
    else:
        verdict = f"**not met**: never below {g['target']} in {g['evals'][-1]['step']} steps"
    print(f"\nTarget: validation loss below {g['target']} nats/byte within 15 minutes at 2 ranks: "
          f"{verdict}. Whole launch {g['wall_s']:.0f} s.\n")
    print(f"#### ViT small on 8x8 digits, {v['ranks']} ranks\n")
    print(markdown_table(["held-out accuracy", "correct", "final train loss", "wall (s)"],
                         [[f"{100 * v['accuracy']:.1f}%", f"{v['correct']}/{v['total']}",
                           f"{v['train_loss']:.3f}", f"{v['wall_s']:.0f}"]]))
    print(f"\nTarget: at least {100 * v['target']:.0f}% held-out accuracy in about a minute at 2 ranks: "
          + ("**met**" if v["accuracy"] >= v["target"] else "**not met**") + ".\n")
    print("```\n" + f"OMP_NUM_THREADS=1 mpiexec -n {g['ranks']} {g['command']}\n"
          f"OMP_NUM_THREADS=1 mpiexec -n {v['ranks']} {v['command']}\n" + "```\n")
    print(f"machine: {machine_line(info)}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--gpt-steps", type=int, default=800)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--vit-steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="60 GPT and 60 ViT steps: a check that it runs")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit per job")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if args.quick:
        args.gpt_steps, args.eval_every, args.vit_steps = 60, 30, 60
    for name in ("ranks", "gpt_steps", "eval_every", "vit_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    info = machine_info()
    with tempfile.TemporaryDirectory(prefix="rtxmpi-convergence-") as tmp:
        result = {"gpt": gpt(args, tmp), "vit": vit(args), "machine": info}
    report(result, info)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
