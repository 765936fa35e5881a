"""Data-parallel weak and strong scaling of the training step, rtxmpi vs a raw mpi4py DP step.

    python bench/scaling.py                       # launches mpiexec at 1, 2 and 4 ranks, both modes
    python bench/scaling.py --ranks 1,2 --modes weak --local-batch 16 --json scaling.json

Weak scaling: each rank keeps a fixed batch (--local-batch sequences of --seq-len bytes from the
default corpus), so the global batch grows with the ranks. Strong scaling: the global batch stays
--global-batch sequences and each of N ranks runs global_batch / N of them. Each (mode, N) is one
mpiexec job; in it, interleaved step by step, it times:
  rtxmpi : DataParallel (bucketed all_reduce overlapping backward) + AdamW
  raw    : the same model, backward, then one blocking mpi4py Allreduce of the flat gradient, a
           1/N scale, AdamW — the plain data-parallel step a user would write by hand
A step's time is the slowest rank's (barrier before each timed step); the table shows the median.
Efficiency at N ranks = tokens/s(N) / (N * tokens/s(1)) in both modes (for strong scaling that is
speedup / N, speedup = step time(1) / step time(N)).
"""
import argparse
import json
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import run_worker_job, time_interleaved, machine_info, machine_line, markdown_table, write_json  # noqa: E402


def worker(args):
    import numpy as np
    from mpi4py import MPI

    import rtxmpi
    from rtxmpi.data import BatchSampler, load_corpus
    from rtxmpi.nn import GPT, AdamW, GPTConfig
    from rtxmpi.parallel.data import DataParallel

    world = rtxmpi.init(check=False)
    comm = MPI.COMM_WORLD
    corpus = load_corpus(progress=False)
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    global_batch = args.local_batch * world.world_size
    sampler = BatchSampler(corpus.train, args.seq_len, global_batch, seed=0, dp_rank=world.rank,
                           dp_size=world.world_size)
    ours = GPT(cfg, seed=0)
    ddp = DataParallel(ours, world, bucket_bytes=int(args.bucket_mb * 2**20))
    ours_opt = AdamW(ours.flat_data, lr=1e-4)
    raw = GPT(cfg, seed=0)
    raw_opt = AdamW(raw.flat_data, lr=1e-4)

    def step_rtxmpi(x, y):
        _, cache = ddp.forward(x, y)
        ddp.backward(cache)
        ddp.step(ours_opt)

    def step_raw(x, y):
        _, cache = raw.forward(x, y)
        raw.backward(cache)
        comm.Allreduce(MPI.IN_PLACE, raw.flat_grad, op=MPI.SUM)
        raw.flat_grad *= np.float32(1.0 / comm.Get_size())
        raw_opt.step(raw.flat_grad)
        raw.zero_grad()

    times = time_interleaved(comm, {"rtxmpi": step_rtxmpi, "raw": step_raw}, sampler.next_batch,
                             args.steps, args.warmup)
    if world.rank == 0:
        tokens = global_batch * args.seq_len
        result = {"ranks": world.world_size, "params": ours.num_params,
                  "buckets": len(ddp.buckets), "global_batch": global_batch}
        for name, ts in times.items():
            median = float(np.median(ts))
            result[f"{name}_step_ms"] = median * 1e3
            result[f"{name}_tokens_per_s"] = tokens / median
        print("RESULT " + json.dumps(result), flush=True)


def launch(args, ranks, local_batch):
    return run_worker_job("scaling", ranks, __file__, ["--model", args.model, "--local-batch", str(local_batch), "--seq-len",
           str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--bucket-mb", str(args.bucket_mb)])


def table(results, mode):
    """Markdown rows of one mode's results (adds the efficiencies to each result)."""
    base = {name: results[0][f"{name}_tokens_per_s"] / results[0]["ranks"] for name in ("rtxmpi", "raw")}
    rows = []
    for r in results:
        n = r["ranks"]
        eff = {name: r[f"{name}_tokens_per_s"] / (n * base[name]) for name in base}
        r.update(rtxmpi_efficiency=eff["rtxmpi"], raw_efficiency=eff["raw"])
        row = [n, r["global_batch"]]
        if mode == "strong":
            row += [r["global_batch"] // n, f"{eff['rtxmpi'] * n:.2f}"]
        row += [f"{r['rtxmpi_step_ms']:.0f}", f"{r['raw_step_ms']:.0f}", f"{r['rtxmpi_tokens_per_s']:,.0f}",
                f"{r['raw_tokens_per_s']:,.0f}", f"{eff['rtxmpi']:.2f}", f"{eff['raw']:.2f}",
                f"{r['rtxmpi_tokens_per_s'] / r['raw_tokens_per_s']:.2f}"]
        rows.append(row)
    header = ["ranks", "global batch"] + (["local batch", "rtxmpi speedup"] if mode == "strong" else [])
    header += ["rtxmpi ms", "raw ms", "rtxmpi tok/s", "raw tok/s", "rtxmpi eff", "raw eff", "rtxmpi/raw"]
    return markdown_table(header, rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes")
    p.add_argument("--modes", default="weak,strong", help="weak, strong or both (comma-separated)")
    p.add_argument("--model", default="small")
    p.add_argument("--local-batch", type=int, default=16, help="weak scaling: sequences per rank per step")
    p.add_argument("--global-batch", type=int, default=32,
                   help="strong scaling: sequences per step over all ranks (divisible by each N)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    ranks = [int(n) for n in args.ranks.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - {"weak", "strong"} or not modes:
        p.error(f"--modes {args.modes!r}: use weak, strong or weak,strong")
    if "strong" in modes and any(args.global_batch % n for n in ranks):
        p.error(f"--global-batch {args.global_batch} must be divisible by every world size in --ranks {args.ranks}")
    results = {}
    for mode in modes:
        results[mode] = [launch(args, n, args.local_batch if mode == "weak" else args.global_batch // n)
                         for n in ranks]
    info = machine_info()
    params = results[modes[0]][0]["params"] / 1e6
    for mode in modes:
        if mode == "weak":
            print(f"DP weak scaling, model {args.model} ({params:.2f} M params), {args.local_batch} x "
                  f"{args.seq_len} tokens per rank, median of {args.steps} steps")
        else:
            print(f"DP strong scaling, model {args.model} ({params:.2f} M params), global batch "
                  f"{args.global_batch} x {args.seq_len} tokens split over the ranks, median of "
                  f"{args.steps} steps")
        print()
        print(table(results[mode], mode))
        print()
    print(f"machine: {machine_line(info)}")
    print(f"command: python bench/scaling.py {shlex.join(sys.argv[1:])}".rstrip())
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, "results": results.get("weak", []),
                               "strong": results.get("strong", [])})


if __name__ == "__main__":
    main()
