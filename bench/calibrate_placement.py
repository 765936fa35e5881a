"""Does the calibration's CPU-sharing reference depend on where the scheduler put the ranks?

    python bench/calibrate_placement.py                  # launches mpiexec -n 4 itself
    python bench/calibrate_placement.py --rounds 8 --json placement.json

One 4-rank job on one node pins its ranks (os.sched_setaffinity) to each even placement of the
node's ranks on its cores in turn (4 ranks on 2 cores: cores (0,0,1,1), (0,1,0,1), (0,1,1,0)),
as an unbound job's scheduler leaves them (docs/planner.md, "Placement"), and times the
calibration's reference run (rtxmpi.parallel.calibrate.ReferenceRun: one GPT forward + backward)
with k = 1, half and all of the ranks computing, interleaved round by round (the placement order
rotating), medians over the rounds. For k = half it shows both statistics: the one fixed subset
of local ranks (0, 1) that the calibration timed before, and the mean over
calibrate.balanced_subsets that it times now; the last row is the spread over placements
(max / min). The same reference with its fitted (effective cores, wait weight) per placement
(calibrate.fit_sharing, work = the k = 1 CPU time).
"""
import argparse
import itertools
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine_info, machine_line, markdown_table, run_worker_job, write_json  # noqa: E402

LAUNCH = "self"  # starts its own mpiexec -n 4


def worker(args):
    import numpy as np
    from mpi4py import MPI

    import rtxmpi
    from rtxmpi.nn import GPTConfig
    from rtxmpi.parallel.calibrate import ReferenceRun, balanced_subsets, fit_sharing

    world = rtxmpi.init(check=False)
    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    cores = sorted(os.sched_getaffinity(0))
    P = len(cores)
    if R % P or len(set(comm.allgather(tuple(cores)))) != 1:
        raise SystemExit(f"[calibrate_placement] needs one node whose {P} cores divide the {R} ranks")
    ref = ReferenceRun(world, GPTConfig.named(args.model, seq_len=args.seq_len), args.micro_batch)
    half = (R + 1) // 2
    subsets = balanced_subsets(R, half)
    layout = sorted({p for p in itertools.permutations([c for c in range(P) for _ in range(R // P)])
                     if p[0] == 0})  # rank 0 on the first core: the others are relabellings
    res = {p: {"k1": [], "fixed": [], "balanced": [], "all": [], "work": []} for p in layout}

    def run(subset):
        comm.Barrier()
        t = c = None
        if rank in subset:
            t0, c0 = time.perf_counter(), time.thread_time()
            ref._step()
            t, c = time.perf_counter() - t0, time.thread_time() - c0
        comm.Barrier()
        done = [x for x in comm.allgather((t, c)) if x[0] is not None]
        return float(np.mean([x[0] for x in done])) * 1e3, float(np.mean([x[1] for x in done])) * 1e3

    for r in range(args.rounds):
        for p in layout[r % len(layout):] + layout[:r % len(layout)]:
            os.sched_setaffinity(0, {cores[p[rank]]})
            comm.Barrier()
            ref._step()  # settle on the new core
            d = res[p]
            wall, cpu = run((0,))
            d["k1"].append(wall)
            d["work"].append(cpu)
            times = [run(s)[0] for s in subsets]
            d["fixed"].append(times[0])
            d["balanced"].append(float(np.mean(times)))
            d["all"].append(run(tuple(range(R)))[0])
        if rank == 0:
            print(f"[calibrate_placement] round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    os.sched_setaffinity(0, set(cores))
    if rank != 0:
        return
    rows = []
    for p in layout:
        m = {k: float(np.median(v)) for k, v in res[p].items()}
        fits = {s: fit_sharing({1: m["k1"], half: m[s], R: m["all"]}, R, P, work_ms=m["work"])
                for s in ("fixed", "balanced")}
        rows.append({"placement": list(p), "half": half, "subsets": [list(s) for s in subsets],
                     **m, "fit_fixed": list(fits["fixed"]), "fit_balanced": list(fits["balanced"]),
                     "load_average": os.getloadavg()[0]})
    print("RESULT " + json.dumps({"rows": rows, "ranks": R, "cores": P}), flush=True)


def launch(args):
    return run_worker_job("calibrate_placement", 4, __file__, ["--model", args.model, "--seq-len", args.seq_len,
                                        "--micro-batch", args.micro_batch, "--rounds", args.rounds])


def report(args, out, info):
    rows = out["rows"]
    half = rows[0]["half"]
    table = [[" ".join(map(str, r["placement"])), f"{r['work']:.0f}", f"{r['k1']:.0f}",
              f"{r['fixed']:.0f}", f"{r['balanced']:.0f}", f"{r['all']:.0f}",
              "C {:.2f} w {:.2f}".format(*r["fit_fixed"]),
              "C {:.2f} w {:.2f}".format(*r["fit_balanced"])] for r in rows]
    spread = [max(r[k] for r in rows) / min(r[k] for r in rows)
              for k in ("work", "k1", "fixed", "balanced", "all")]
    table.append(["spread (max / min)"] + [f"{s:.2f}x" for s in spread] + ["", ""])
    print(f"Calibration reference vs placement: {out['ranks']} ranks pinned to {out['cores']} cores, "
          f"model {args.model}, {args.micro_batch} x {args.seq_len} tokens, median of {args.rounds} "
          f"interleaved rounds (ms)")
    print()
    print(markdown_table(["core of ranks 0..3", "work (CPU, k=1)", "k=1 wall",
                          f"k={half}: ranks (0,1) only (before)",
                          f"k={half}: balanced subsets {' '.join(''.join(map(str, s)) for s in rows[0]['subsets'])} (now)",
                          f"k={out['ranks']} wall", "fit, before", "fit, now"], table))
    print(f"\nmachine: {machine_line(info)}")
    print(f"command: python bench/calibrate_placement.py {shlex.join(sys.argv[1:])}".rstrip())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences of the reference run "
                   "(the calibration's default: 1024 tokens)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if min(args.seq_len, args.micro_batch, args.rounds) < 1:
        p.error("--seq-len, --micro-batch and --rounds must be >= 1")
    info = machine_info()
    out = launch(args)
    report(args, out, info)
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, **out})


if __name__ == "__main__":
    main()
