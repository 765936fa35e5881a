"""Step time of tensor (and sequence) parallelism next to data parallelism, in the same job.

    mpiexec -n 2 python bench/tensor_parallel.py                  # small model, global batch 16 x 128
    mpiexec -n 4 python bench/tensor_parallel.py --model base --global-batch 32 --json tp.json

All variants train the same model on the same global batch (--global-batch sequences of --seq-len
bytes from the default corpus) over all N ranks, so their step times compare directly (strong
scaling):
  DP=N      : rtxmpi.nn.GPT + DataParallel (bucketed all_reduce overlapping backward) + AdamW;
              each rank runs global_batch / N sequences
  TP=N      : ParallelGPT (Megatron column/row-parallel layers, vocabulary-parallel embedding and
              cross-entropy) + AdamW on 1/N of the matrices; every rank runs the whole batch
  TP=N+SP   : the same with Megatron sequence parallelism (all-gather / reduce-scatter)
  SP=N      : Ulysses: every rank runs the whole batch on seq_len / N positions, two all-to-alls
              per attention layer, gradients averaged over the sp ranks
  1 rank    : (with --single) the plain GPT on the whole batch, on rank 0 alone, the others idle
The variants alternate step by step (the one that goes first rotates); every timed step follows a
barrier and counts as the slowest rank's time; the table shows the median over --steps.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import time_interleaved, launch_command, machine_info, machine_line, markdown_table, write_json  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--single", action="store_true", help="also time one process on the whole batch")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    import numpy as np
    from mpi4py import MPI

    import rtxmpi
    from rtxmpi.data import BatchSampler, load_corpus
    from rtxmpi.mesh import DeviceMesh
    from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask
    from rtxmpi.parallel.data import DataParallel
    from rtxmpi.parallel.hybrid import HybridParallel, ParallelGPT

    world = rtxmpi.init(check=False)
    comm, n = MPI.COMM_WORLD, world.world_size
    corpus = load_corpus(progress=False)
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    sampler = BatchSampler(corpus.train, args.seq_len, args.global_batch, seed=0)  # whole batch
    b = args.global_batch // n
    rows = slice(world.rank * b, (world.rank + 1) * b)

    dp_model = GPT(cfg, seed=0)
    dp = DataParallel(dp_model, world)
    dp_opt = AdamW(dp_model.flat_data, lr=1e-4, decay_mask=decay_mask(dp_model.params))
    variants = {}

    def dp_step(x, y):
        _, cache = dp.forward(x[rows], y[rows])
        dp.backward(cache)
        dp.step(dp_opt)

    variants[f"DP={n}"] = (dp_step, dp_model.num_params)
    if n > 1:
        for name, kwargs in ((f"TP={n}", {"tp": n}), (f"TP={n}+SP", {"tp": n, "sp_on": True}),
                             (f"SP={n}", {"sp": n})):
            mesh = DeviceMesh(dp=1, tp=kwargs.get("tp", 1), sp=kwargs.get("sp", 1), group=world)
            engine = HybridParallel(ParallelGPT(cfg, mesh, seed=0,
                                                sequence_parallel=kwargs.get("sp_on", False)),
                                    optimizer=lambda prm, m: AdamW(prm, lr=1e-4, decay_mask=m))

            def hybrid_step(x, y, engine=engine):
                _, cache = engine.forward(x, y)
                engine.backward(cache)
                engine.step()

            variants[name] = (hybrid_step, engine.model.num_params)
    if args.single:
        single = GPT(cfg, seed=0)
        single_opt = AdamW(single.flat_data, lr=1e-4, decay_mask=decay_mask(single.params))

        def single_step(x, y):
            if world.rank == 0:
                _, cache = single.forward(x, y)
                single.backward(cache)
                single_opt.step(single.flat_grad)
                single.zero_grad()

        variants["1 rank"] = (single_step, single.num_params)

    names = list(variants)
    times = time_interleaved(comm, {name: fn for name, (fn, _) in variants.items()},
                             sampler.next_batch, args.steps, args.warmup, label="tensor_parallel")
    if world.rank != 0:
        return
    tokens = args.global_batch * args.seq_len
    base = float(np.median(times[names[0]]))
    results, table = [], []
    for name in names:
        median = float(np.median(times[name]))
        params = variants[name][1]
        results.append({"variant": name, "step_ms": median * 1e3, "min_ms": min(times[name]) * 1e3,
                        "tokens_per_s": tokens / median, "params_per_rank": params})
        table.append([name, f"{median * 1e3:.0f}", f"{min(times[name]) * 1e3:.0f}",
                      f"{tokens / median:,.0f}", f"{params / 1e6:.3f}", f"{median / base:.2f}"])
    info = machine_info()
    print(f"Tensor / sequence parallel vs data parallel at {n} ranks, model {args.model} "
          f"({dp_model.num_params / 1e6:.2f} M params), global batch {args.global_batch} x "
          f"{args.seq_len} tokens, median of {args.steps} steps")
    print(markdown_table(["variant", "step ms", "min ms", "tokens/s", "M params / rank",
                          f"time / DP={n}"], table))
    print(f"\nmachine: {machine_line(info)}")
    print(f"command: {launch_command(n)}")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, "world_size": n,
                               "results": results})


if __name__ == "__main__":
    main()
