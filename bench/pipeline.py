"""Pipeline parallelism: the 1F1B bubble measured against (p-1)/(m+p-1), and PP=2 next to DP=2.
(Interleaved 1F1B with V = 2 virtual stages too, against (p-1)/(V m+p-1), when the model has
2 blocks a stage: --model base --n-layer 8.)

    python bench/pipeline.py                     # launches mpiexec -n 4 (bubble) and -n 2 (PP vs DP)
    python bench/pipeline.py --stages 4 --micro-batches 8 --model small --steps 6 --json pp.json

Part 1, bubble (mpiexec -n STAGES, one pipeline, dp = 1): every rank records, for each op of its
1F1B (and GPipe) schedule, the wall time (perf_counter) and the CPU time of this thread
(thread_time) it took; a receive's wall time is the time blocked waiting for the peer. Per rank:
    wall bubble  = 1 - (wall time in F and B) / (step wall time)   -- the rank's idle share
    recv wait    = (wall time blocked in receives) / (step wall time)
The table shows the mean over ranks and steps (after warm-up). On a machine with fewer cores than
ranks (the CI box: 4 ranks on 2 cores) wall times are distorted: in the steady phase all stages
compute at once and each op runs slower than in the ramp phases, which shrinks the measured
bubble. So the bench also reports the
    replay bubble = the bubble of the same schedule run with each stage's measured CPU time per F
                    and per B (median over steps), zero-cost messages and one core per stage:
                    a critical-path replay of the op lists (rtxmpi.parallel.schedule ops)
which is what the schedule costs on a machine with a core per stage, with the real, unequal stage
costs (stage 0 has the embeddings, the last stage the head and the loss).

Part 2 (mpiexec -n 2): the step time of PP=2 (1F1B, --micro-batches) and of DP=2 (bucketed
all_reduce) on the same model and global batch, interleaved step by step in the same job (the
faster layout on 2 cores is DP: PP's bubble idles half a stage per ramp, DP computes all the time).
"""
import argparse
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from rtxmpi.parallel.schedule import replay  # noqa: E402  (critical-path replay of op lists)
from _common import run_worker_job, time_interleaved, machine_info, machine_line, markdown_table, write_json  # noqa: E402


def model_config(args):
    from rtxmpi.nn import GPTConfig

    extra = {} if args.n_layer is None else {"n_layer": args.n_layer}
    return GPTConfig.named(args.model, seq_len=args.seq_len, **extra)


def worker_bubble(args):
    import numpy as np

    import rtxmpi
    from rtxmpi.data import BatchSampler, load_corpus
    from rtxmpi.nn import GPT
    from rtxmpi.parallel.pipeline import PipelineParallel
    from rtxmpi.parallel.schedule import Op

    world = rtxmpi.init(check=False)
    p, m = world.world_size, args.micro_batches
    corpus = load_corpus(progress=False)
    cfg = model_config(args)
    global_batch = args.micro_batch_size * m
    out = {}
    variants = [("1f1b", "1f1b", True, 1), ("1f1b, W not deferred", "1f1b", False, 1),
                ("gpipe", "gpipe", True, 1)]
    if cfg.n_layer >= 2 * p and m % p == 0:  # a block per virtual stage at least
        variants.append(("interleaved, V=2", "interleaved", True, 2))
    for name, schedule, defer, V in variants:
        if args.no_defer and defer:
            continue
        engine = PipelineParallel(GPT(cfg, seed=0), world, micro_batches=m, schedule=schedule,
                                  defer_weight_grads=defer, virtual_stages=V)
        sampler = BatchSampler(corpus.train, args.seq_len, global_batch, seed=0)
        rows = []
        for step in range(args.warmup + args.steps):
            x, y = sampler.next_batch()
            world.barrier()
            # thread CPU time per op: wrap the stage's compute
            cpu = {"F": [], "B": [], "W": []}
            fwd, bwd = engine.stage.forward, engine.stage.backward
            flush = getattr(engine.stage, "flush_weight_grads", None)  # not on a ChunkedStage

            def timed(fn, kind):
                def run(*a, **k):
                    c0 = time.thread_time()
                    r = fn(*a, **k)
                    cpu[kind].append(time.thread_time() - c0)
                    return r
                return run

            engine.stage.forward, engine.stage.backward = timed(fwd, "F"), timed(bwd, "B")
            if flush is not None:
                engine.stage.flush_weight_grads = timed(flush, "W")
            t0 = time.perf_counter()
            engine.train_step(x, y)
            del engine.stage.forward, engine.stage.backward  # back to the class methods
            if flush is not None:
                del engine.stage.flush_weight_grads
            engine.zero_grad()
            tl = engine.timeline
            total = tl[-1][3] - t0
            compute = sum(b - a for k, _, a, b in tl if k in ("F", "B", "W"))
            wait = sum(b - a for k, _, a, b in tl if k.startswith("recv"))
            if step >= args.warmup:
                rows.append((total, compute, wait, float(np.median(cpu["F"])),
                             float(np.median(cpu["B"])), sum(cpu["W"])))
        arr = np.array(rows)
        mine = {"step_s": float(np.median(arr[:, 0])),
                "wall_bubble": float(np.mean(1 - arr[:, 1] / arr[:, 0])),
                "recv_wait": float(np.mean(arr[:, 2] / arr[:, 0])),
                "cpu_F_s": float(np.median(arr[:, 3])), "cpu_B_s": float(np.median(arr[:, 4])),
                "cpu_W_s": float(np.median(arr[:, 5]))}
        everyone = world.backend.comm.gather(mine, root=0)
        if world.rank == 0:
            cost = [{"F": r["cpu_F_s"], "B": r["cpu_B_s"], "W": r["cpu_W_s"]} for r in everyone]
            lists = [ops + [Op("W", -1, None)] for ops in engine.schedules]  # deferred W last
            makespan, busy = replay(lists, cost)
            equal = [{"F": np.mean([c["F"] for c in cost]), "B": np.mean([c["B"] for c in cost]),
                      "W": 0.0}] * p
            ms_eq, busy_eq = replay(lists, equal)
            out[name] = {
                "ranks": everyone,
                "wall_bubble": float(np.mean([r["wall_bubble"] for r in everyone])),
                "recv_wait": float(np.mean([r["recv_wait"] for r in everyone])),
                "replay_bubble": float(np.mean([1 - b / makespan for b in busy])),
                "replay_equal_bubble": float(np.mean([1 - b / ms_eq for b in busy_eq])),
                "step_ms": 1e3 * float(np.median([r["step_s"] for r in everyone])),
                "theory": (p - 1) / (V * m + p - 1)}
    if world.rank == 0:
        print("RESULT " + json.dumps({"stages": p, "micro_batches": m, "params": GPT(cfg).num_params,
                                      "schedules": out}), flush=True)


def worker_compare(args):
    import numpy as np
    from mpi4py import MPI

    import rtxmpi
    from rtxmpi.data import BatchSampler, load_corpus
    from rtxmpi.nn import GPT, AdamW, decay_mask
    from rtxmpi.parallel.data import DataParallel
    from rtxmpi.parallel.pipeline import PipelineParallel

    world = rtxmpi.init(check=False)
    comm = MPI.COMM_WORLD
    corpus = load_corpus(progress=False)
    cfg = model_config(args)
    m = args.compare_micro_batches
    global_batch = args.global_batch
    pp = PipelineParallel(GPT(cfg, seed=0), world, micro_batches=m, schedule="1f1b")
    dp_model = GPT(cfg, seed=0)
    ddp = DataParallel(dp_model, world)
    dp_opt = AdamW(dp_model.flat_data, lr=1e-4, decay_mask=decay_mask(dp_model.params))
    sampler = BatchSampler(corpus.train, args.seq_len, global_batch, seed=0)
    b = global_batch // world.world_size

    def step_pp(x, y):
        pp.train_step(x, y)
        pp.step(lr=1e-4)

    def step_dp(x, y):
        xs, ys = x[world.rank * b:(world.rank + 1) * b], y[world.rank * b:(world.rank + 1) * b]
        _, cache = ddp.forward(xs, ys)
        ddp.backward(cache)
        ddp.step(dp_opt, lr=1e-4)

    times = time_interleaved(comm, {"pp": step_pp, "dp": step_dp}, sampler.next_batch,
                             args.steps, args.warmup)
    if world.rank == 0:
        tokens = global_batch * args.seq_len
        result = {"global_batch": global_batch, "micro_batches": m}
        for name, ts in times.items():
            result[f"{name}_step_ms"] = float(np.median(ts)) * 1e3
            result[f"{name}_tokens_per_s"] = tokens / float(np.median(ts))
        print("RESULT " + json.dumps(result), flush=True)


def worker_overlap(args):
    import numpy as np
    from mpi4py import MPI

    import rtxmpi
    from rtxmpi.data import BatchSampler, load_corpus
    from rtxmpi.mesh import DeviceMesh
    from rtxmpi.nn import GPT
    from rtxmpi.parallel.pipeline import PipelineParallel

    world = rtxmpi.init(check=False)
    comm = MPI.COMM_WORLD
    corpus = load_corpus(progress=False)
    cfg = model_config(args)
    mesh = DeviceMesh(dp=2, pp=world.world_size // 2, group=world)
    m, bucket_bytes = args.compare_micro_batches, int(args.bucket_mb * 2**20)
    engines = {name: PipelineParallel.from_mesh(GPT(cfg, seed=0), mesh, micro_batches=m,
                                                bucket_bytes=bucket_bytes, overlap_dp=on)
               for name, on in (("overlap", True), ("after", False))}
    sampler = BatchSampler(corpus.train, args.seq_len, args.global_batch, seed=0)
    rows = mesh.batch_slice(args.global_batch)
    waits = {name: [] for name in engines}

    def stepper(name):
        engine = engines[name]

        def run(x, y):
            engine.train_step(x[rows], y[rows])
            waits[name].append(next(b - a for k, _, a, b in engine.timeline if k == "dp_wait"))
            engine.step(lr=1e-4)
        return run

    times = time_interleaved(comm, {name: stepper(name) for name in engines}, sampler.next_batch,
                             args.steps, args.warmup)
    wait_ms = {name: 1e3 * float(np.median(w[args.warmup:])) for name, w in waits.items()}
    everyone = comm.gather({"stage": mesh.pp_rank, "wait_ms": wait_ms}, root=0)
    if world.rank == 0:
        result = {"global_batch": args.global_batch, "micro_batches": m,
                  "buckets": len(engines["overlap"].buckets), "bucket_mb": args.bucket_mb}
        for name, ts in times.items():
            result[f"{name}_step_ms"] = float(np.median(ts)) * 1e3
            result[f"{name}_wait_ms_by_stage"] = [
                float(np.mean([r["wait_ms"][name] for r in everyone if r["stage"] == s]))
                for s in range(mesh.pp)]
        print("RESULT " + json.dumps(result), flush=True)


def launch(args, ranks, part):
    return run_worker_job("pipeline", ranks, __file__, [part,
           "--model", args.model, *(["--n-layer", str(args.n_layer)] if args.n_layer else []),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--micro-batches", str(args.micro_batches),
           "--micro-batch-size", str(args.micro_batch_size), "--global-batch",
           str(args.global_batch), "--compare-micro-batches", str(args.compare_micro_batches),
           "--bucket-mb", str(args.bucket_mb), *(["--no-defer"] if args.no_defer else [])])


def print_bubble(args, bubble):
    rows = []
    for name, r in bubble["schedules"].items():
        rows.append([name, bubble["stages"], bubble["micro_batches"], f"{r['theory']:.3f}",
                     f"{r['replay_bubble']:.3f}", f"{r['replay_equal_bubble']:.3f}",
                     f"{r['wall_bubble']:.3f}", f"{r['recv_wait']:.3f}", f"{r['step_ms']:.0f}"])
    name = args.model + (f", n_layer {args.n_layer}" if args.n_layer else "")
    print(f"Pipeline bubble, model {name} ({bubble['params'] / 1e6:.2f} M params), "
          f"micro-batch {args.micro_batch_size} x {args.seq_len} tokens, {args.steps} steps")
    print(markdown_table(["schedule", "stages", "micro-batches", "theory (p-1)/(V m+p-1)",
                          "replay (measured stage CPU costs)", "replay (equal stages)",
                          "wall bubble", "recv wait", "step ms"], rows))
    print()
    print("per stage (1F1B): CPU ms per F / B, deferred W per step, wall bubble, recv wait")
    print(markdown_table(["stage", "F ms", "B ms", "W ms / step", "wall bubble", "recv wait"],
                         [[s, f"{r['cpu_F_s'] * 1e3:.1f}", f"{r['cpu_B_s'] * 1e3:.1f}",
                           f"{r['cpu_W_s'] * 1e3:.1f}", f"{r['wall_bubble']:.3f}",
                           f"{r['recv_wait']:.3f}"]
                          for s, r in enumerate(bubble["schedules"][
                              "1f1b, W not deferred" if args.no_defer else "1f1b"]["ranks"])]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (= ranks) for the bubble")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--model", default="small")
    p.add_argument("--n-layer", type=int, default=None,
                   help="override the model's blocks (e.g. 8 with --model base: 2 blocks a stage)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16, help="PP vs DP: sequences per step")
    p.add_argument("--compare-micro-batches", type=int, default=4, help="PP=2 micro-batches")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-compare", action="store_true", help="only the bubble (no PP=2 vs DP=2)")
    p.add_argument("--no-bubble", action="store_true", help="skip the bubble part")
    p.add_argument("--no-defer", action="store_true",
                   help="bubble only without the last stage's deferred weight gradients")
    p.add_argument("--overlap", action="store_true",
                   help="also PP=2 x DP=2 (4 ranks): dp all_reduce overlapped with the last "
                        "backward vs after the schedule, exposed wait per stage")
    p.add_argument("--bucket-mb", type=float, default=0.25, help="dp bucket size for --overlap")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "bubble":
        return worker_bubble(args)
    if args.worker == "compare":
        return worker_compare(args)
    if args.worker == "overlap":
        return worker_overlap(args)
    bubble = None if args.no_bubble else launch(args, args.stages, "bubble")
    compare = None if args.no_compare else launch(args, 2, "compare")
    overlap = launch(args, 4, "overlap") if args.overlap else None
    if bubble is not None:
        print_bubble(args, bubble)
    if compare is not None:
        print()
        print(f"PP=2 (1F1B, {compare['micro_batches']} micro-batches) vs DP=2, global batch "
              f"{compare['global_batch']} x {args.seq_len}, median of {args.steps} interleaved steps")
        print(markdown_table(["layout", "step ms", "tokens/s"],
                             [["PP=2", f"{compare['pp_step_ms']:.0f}",
                               f"{compare['pp_tokens_per_s']:,.0f}"],
                              ["DP=2", f"{compare['dp_step_ms']:.0f}",
                               f"{compare['dp_tokens_per_s']:,.0f}"]]))
    if overlap is not None:
        print()
        print(f"PP=2 x DP=2 (1F1B, {overlap['micro_batches']} micro-batches, global batch "
              f"{overlap['global_batch']}, {overlap['buckets']} dp buckets of "
              f"{overlap['bucket_mb']} MiB per stage): dp all_reduce started during the last "
              f"backward vs after the schedule; exposed = time waiting for it after the schedule")
        print(markdown_table(
            ["dp all_reduce", "step ms"] + [f"exposed ms, stage {s}"
                                            for s in range(len(overlap["overlap_wait_ms_by_stage"]))],
            [[name, f"{overlap[name + '_step_ms']:.0f}"]
             + [f"{w:.2f}" for w in overlap[name + "_wait_ms_by_stage"]]
             for name in ("overlap", "after")]))
    info = machine_info()
    print(f"\nmachine: {machine_line(info)}")
    print(f"command: python bench/pipeline.py {shlex.join(sys.argv[1:])}".rstrip())
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, "bubble": bubble,
                               "compare": compare, "overlap": overlap})


if __name__ == "__main__":
    main()
