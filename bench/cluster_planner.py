"""The cluster planner against published runs, and how long its search takes.

    python bench/cluster_planner.py                  # the table of docs/planner.md, and timings
    python bench/cluster_planner.py --json out.json

For every row of tests/data/published_layouts.json (Narayanan et al. 2021 Table 1, Korthikanti
et al. 2022 Tables 3 and 5; DGX A100 80GB): the planner's prediction for the published layout,
predicted / published throughput, whether its memory model admits the layout, the layout it picks
itself (rtxmpi.parallel.cluster.cluster_plan, every candidate) with its prediction, and the
search's wall time. Then `rtxmpi plan` end to end (the process, imports included) for the 1T GPT
on 3,072 GPUs. Targets (reported, never asserted): every published layout admitted, predictions
within 15%, the pick predicted no slower than the published layout, the 1T plan under 10 s.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from _common import machine_info, machine_line  # noqa: E402

from rtxmpi.nn.gpt import GPTConfig  # noqa: E402
from rtxmpi.parallel.cluster import (ClusterLayout, Options, cluster_estimate,  # noqa: E402
                                     cluster_plan)
from rtxmpi.parallel.cluster_profile import load_cluster_profile  # noqa: E402

DATA = os.path.join(ROOT, "tests", "data", "published_layouts.json")


def rows():
    with open(DATA) as f:
        sets = json.load(f)["sets"]
    for st in sets:
        for row in st["rows"]:
            yield st, dict(zip(st["columns"], row))


def published_setup(st, r):
    """(GPTConfig, ClusterLayout, Options) of published row `r` of set `st` (vocabulary 51,200,
    sequence 2,048, as every row of the data file); tests/unit/test_cluster_planner.py uses it too."""
    cfg = GPTConfig(vocab_size=51200, seq_len=2048, n_layer=r["n_layer"], n_head=r["n_head"],
                    n_embd=r["n_embd"])
    lay, tp, pp = st["layout"], r["tp"], r["pp"]
    dp = r["gpus"] // (tp * pp)
    L = ClusterLayout(dp, tp, pp, lay["micro_batch"], r["global_batch"] // (dp * lay["micro_batch"]),
                      lay["schedule"] if pp > 1 else "none", 1, lay["zero_stage"], lay["recompute"],
                      lay["sequence_parallel"] and tp > 1)
    return cfg, L, Options(**st["options"])


def check(st, r):
    profile = load_cluster_profile(st["profile"])
    cfg, L, opt = published_setup(st, r)
    e = cluster_estimate(cfg, L, r["global_batch"], profile, opt)
    if st["metric"] == "tflops_per_gpu":
        published, predicted = r["tflops_per_gpu"], e.tflops_per_device
    else:
        published, predicted = r["step_s"], e.step_s
    ratio = predicted / published if st["metric"] == "tflops_per_gpu" else published / predicted
    start = time.perf_counter()
    plan = cluster_plan(cfg, r["global_batch"], r["gpus"], profile, opt)
    seconds = time.perf_counter() - start
    best = plan.best
    return {"set": st["name"], "params_b": r["params_b"], "layout": str(L), "metric": st["metric"],
            "published": published, "predicted": predicted, "ratio": ratio,
            "admitted": e.peak_bytes <= profile.usable_bytes, "memory_gib": e.peak_bytes / 2**30,
            "pick": str(best.layout), "pick_step_s": best.step_s, "published_step_s": e.step_s,
            "pick_speedup": e.step_s / best.step_s, "pick_mfu": best.mfu, "search_s": seconds,
            "layouts": plan.considered}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    info = machine_info()
    out = [check(st, r) for st, r in rows()]
    print("| set | model | published layout | published | predicted | ratio | admitted (GiB) | "
          "planner's pick | pick / published speed | search s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in out:
        unit = "TFLOP/s" if x["metric"] == "tflops_per_gpu" else "s/step"
        print(f"| {x['set'].split(',')[0]} | {x['params_b']}B | {x['layout']} | {x['published']} "
              f"{unit} | {x['predicted']:.1f} | {x['ratio']:.3f} | "
              f"{'yes' if x['admitted'] else 'NO'} ({x['memory_gib']:.1f}) | {x['pick']} "
              f"({x['pick_step_s']:.2f} s, MFU {100 * x['pick_mfu']:.0f}%) | {x['pick_speedup']:.2f}x | "
              f"{x['search_s']:.2f} |")
    ratios = [x["ratio"] for x in out]
    print(f"\nratios {min(ratios):.3f}-{max(ratios):.3f}; admitted {sum(x['admitted'] for x in out)}"
          f"/{len(out)}; pick no slower in {sum(x['pick_speedup'] >= 1 - 1e-9 for x in out)}/{len(out)}")
    cmd = [sys.executable, "-m", "rtxmpi.cli", "plan", "--profile", "dgx-a100", "--n-layer", "128",
           "--n-head", "160", "--n-embd", "25600", "--vocab-size", "51200", "--seq-len", "2048",
           "--global-batch", "3072", "--world-size", "3072", "--top", "3"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    print(f"rtxmpi plan, 1T GPT on 3,072 A100s (process, imports included): {wall:.2f} s, exit "
          f"{proc.returncode}: `rtxmpi {shlex.join(cmd[3:])}`")
    print(f"\nmachine: {machine_line(info)}")
    print(f"command: python bench/cluster_planner.py {shlex.join(sys.argv[1:])}".rstrip())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": out, "plan_1t_wall_s": wall}, f, indent=1)


if __name__ == "__main__":
    main()
