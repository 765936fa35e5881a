"""Per-rank memory of data parallelism (ZeRO stage 0 = DataParallel) and ZeRO stages 1, 2 (3).

    python bench/memory.py                          # launches mpiexec at 1, 2 and 4 ranks
    python bench/memory.py --ranks 1,2,4 --model small --local-batch 16 --json memory.json
    python bench/memory.py --ranks 2,4 --tp 2                # ZeRO on each tp slice (zero_hybrid)
    python bench/memory.py --recompute                       # activation recomputation, one process
    python bench/memory.py --device cuda --ranks 2 --model gpt2-small   # ranks sharing one GPU

One mpiexec job per (world size, stage), so each job's peak RSS is that configuration's own. Each
job builds the model, the engine (stage 0: DataParallel + AdamW with the decay mask, as train.py;
stage k: ZeroDataParallel(stage=k)), runs --steps training steps of --local-batch x --seq-len
tokens per rank, then one more forward whose cache it keeps, and reports per rank
(rtxmpi.observe.memory.report): params, grads, optimizer state (the engine's memory_bytes() when it
has one, else the arrays), activations (the unique buffers of that one micro-batch's forward cache,
views and parameter buffers not counted), model state = params + grads + optimizer, and the
process's peak RSS; "transient" is the peak of buffers the engine allocates and frees within a
step when it tracks them (ZeRO-3: gathered units and unit gradients), not part of model state.
Tables show the largest value over ranks (shards can be uneven). Stage 3 is
measured when rtxmpi.parallel.zero.STAGES has it. --device cuda: the model on cupy, and "peak
device" is each rank's CuPy memory pool at the end (the bytes it ever held: the pool keeps what it
allocates), with its ratio to stage 0's.

--recompute: instead, for each model of --recompute-models (GPT small and base) in one process,
with recompute "none" and "blocks" (rtxmpi.nn.Model.recompute) side by side: the activations one
micro-batch's forward cache keeps (observe.memory.cache_bytes, parameters excluded), the largest
single block cache (what backward rebuilds at a time under "blocks"), the peak of traced
allocations over a forward and backward (tracemalloc, which numpy reports to; the logits, the
recomputed block and backward's temporaries included), and the time of a step (forward, backward,
AdamW): the process's CPU time, which other processes on a loaded machine barely change (one
thread: OMP_NUM_THREADS=1), and wall time, and the minor page faults of a step (fresh memory the
kernel maps in, CPU time too); medians of --repeats, the two policies alternating.

Target: at 4 ranks, ZeRO-3 per-rank model-state bytes <= (DP's / 4 + one layer's gathered
parameters) x 1.05, where "one layer" is the largest of: one transformer block's parameters, the
embeddings (wte + wpe), the final LayerNorm (+ an untied head).
"""
import argparse
import json
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import run_worker_job, machine_info, machine_line, markdown_table, write_json  # noqa: E402

MIB = 2**20


def largest_layer_bytes(model):
    """Bytes of the largest group of parameters gathered together in ZeRO-3: the model's `units`
    when it has them, else a block (h{l}.*), the embeddings (wte, wpe) or the rest (ln_f,
    lm_head)."""
    itemsize = model.dtype.itemsize
    if getattr(model, "units", None):
        return max(sum(p.size for p in model.params[a:b]) * itemsize for a, b in model.units)
    groups = {}
    for p in model.params:
        key = p.name.split(".")[0] if p.name.startswith("h") and "." in p.name else (
            "embeddings" if p.name in ("wte", "wpe") else "final")
        groups[key] = groups.get(key, 0) + p.size * itemsize
    return max(groups.values())


def worker(args):
    import numpy as np

    import rtxmpi
    from rtxmpi.data import BatchSampler, load_corpus
    from rtxmpi.backend import array_module
    from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask
    from rtxmpi.observe.memory import gather_reports, report
    from rtxmpi.parallel.data import DataParallel
    from rtxmpi.parallel.zero import ZeroDataParallel

    world = rtxmpi.init(check=False)
    corpus = load_corpus(progress=False)
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    if args.tp * args.sp > 1:
        return mesh_worker(args, world, corpus, cfg)
    sampler = BatchSampler(corpus.train, args.seq_len, args.local_batch * world.world_size, seed=0,
                           dp_rank=world.rank, dp_size=world.world_size)
    xp = array_module(args.device)
    model = GPT(cfg, seed=0, xp=xp)
    optimizer = None
    if args.stage == 0:
        engine = DataParallel(model, world)
        optimizer = AdamW(model.flat_data, lr=1e-4, decay_mask=decay_mask(model.params))
        step = lambda: engine.step(optimizer)  # noqa: E731
    else:
        engine = ZeroDataParallel(model, world, stage=args.stage)
        step = lambda: engine.step()  # noqa: E731
    for _ in range(args.steps):
        x, y = sampler.next_batch()
        _, cache = engine.forward(x, y)
        engine.backward(cache)
        step()
        del cache
    x, y = sampler.next_batch()
    _, cache = engine.forward(x, y)
    reports = gather_reports(world, report(engine, model=model, optimizer=optimizer, cache=cache))
    pool = xp.get_default_memory_pool().total_bytes() if args.device == "cuda" else 0
    device_peaks = world.all_gather(np.array([pool], dtype=np.int64)).reshape(-1).tolist()
    if world.rank == 0:
        print("RESULT " + json.dumps({
            "ranks": world.world_size, "stage": args.stage, "params": model.num_params,
            "layer_bytes": largest_layer_bytes(model),
            # stage 3: the most bytes of gathered units (and their gradients) held at once
            "gathered_peak_bytes": getattr(getattr(engine, "provider", None), "peak_bytes", None),
            "device_peak_bytes": device_peaks,
            "per_rank": [r.as_dict() for r in reports]}), flush=True)


def mesh_worker(args, world, corpus, cfg):
    """--tp / --sp: stage 0 is HybridParallel (each rank's tp slice whole), stage k
    ZeroHybridParallel(stage=k) (the tp slice sharded over the dp x sp ranks)."""
    from rtxmpi.data import BatchSampler
    from rtxmpi.mesh import DeviceMesh
    from rtxmpi.observe.memory import gather_reports, report
    from rtxmpi.parallel.hybrid import HybridParallel, ParallelGPT
    from rtxmpi.parallel.zero_hybrid import ZeroHybridParallel

    mesh = DeviceMesh(tp=args.tp, sp=args.sp, group=world)
    sampler = BatchSampler(corpus.train, args.seq_len, args.local_batch * mesh.dp, seed=0,
                           dp_rank=mesh.dp_rank, dp_size=mesh.dp)
    model = ParallelGPT(cfg, mesh, seed=0)
    engine = (ZeroHybridParallel(model, stage=args.stage) if args.stage else
              HybridParallel(model))
    for _ in range(args.steps):
        x, y = sampler.next_batch()
        _, cache = engine.forward(x, y)
        engine.backward(cache)
        engine.step()
        del cache
    x, y = sampler.next_batch()
    _, cache = engine.forward(x, y)
    reports = gather_reports(world, report(engine, model=model, optimizer=engine.optimizer,
                                           cache=cache))
    if world.rank == 0:
        print("RESULT " + json.dumps({
            "ranks": world.world_size, "stage": args.stage, "params": model.full_num_params,
            "layer_bytes": largest_layer_bytes(model),
            "gathered_peak_bytes": getattr(getattr(engine, "provider", None), "peak_bytes", None),
            "device_peak_bytes": [0],  # on the CPU only (main() refuses --device cuda here)
            "per_rank": [r.as_dict() for r in reports]}), flush=True)


def compare_recompute(args):
    """The --recompute table: rows (model, policy) of activation bytes and step time."""
    import resource
    import time
    import tracemalloc

    import numpy as np

    from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask
    from rtxmpi.observe.memory import cache_bytes

    rows = []
    for name in args.recompute_models.split(","):
        cfg = GPTConfig.named(name, seq_len=args.seq_len)
        idx = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.local_batch, args.seq_len + 1))
        x, y = idx[:, :-1], idx[:, 1:]
        runs = {}
        for policy in ("none", "blocks"):
            model = GPT(cfg, seed=0, recompute=policy)
            opt = AdamW(model.flat_data, lr=1e-4, decay_mask=decay_mask(model.params))
            _, cache = model.forward(x, y)
            keep = [model.flat_data, model.flat_grad]
            if policy == "none":  # a block's cache: what "blocks" rebuilds, one at a time
                block = max(cache_bytes(c, keep) for c in cache.units[1:-1])
            activations = cache_bytes(cache, keep)
            del cache
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            loss, cache = model.forward(x, y)
            model.backward(cache)
            del cache
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
            runs[policy] = {"model": model, "opt": opt, "cpu": [], "wall": [], "faults": [], "loss": loss,
                            "activations_bytes": activations, "peak_bytes": peak,
                            "block_bytes": block}
        for _ in range(args.repeats + 1):  # the first round warms up
            for run in runs.values():
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                c0, t0 = time.process_time(), time.perf_counter()
                run["model"].zero_grad()
                _, cache = run["model"].forward(x, y)
                run["model"].backward(cache)
                run["opt"].step(run["model"].flat_grad)
                run["cpu"].append(time.process_time() - c0)
                run["wall"].append(time.perf_counter() - t0)
                run["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                del cache
        none = runs["none"]
        for policy, run in runs.items():
            rows.append({"model": name, "n_layer": cfg.n_layer, "recompute": policy,
                         "same_loss": run["loss"] == none["loss"],
                         "step_cpu_ms": float(np.median(run["cpu"][1:])) * 1e3,
                         "step_time_ms": float(np.median(run["wall"][1:])) * 1e3,
                         "page_faults": int(np.median(run["faults"][1:])),
                         **{k: run[k] for k in ("activations_bytes", "block_bytes", "peak_bytes")}})
        for row in rows[-2:]:
            row["activations_ratio"] = none["activations_bytes"] / row["activations_bytes"]
            row["step_cpu_ratio"] = row["step_cpu_ms"] / rows[-2]["step_cpu_ms"]
    print(f"Activation recomputation, one process, float32, one micro-batch of {args.local_batch} x "
          f"{args.seq_len} tokens; step = forward + backward + AdamW, median of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f} at the end\n")
    print(markdown_table(
        ["model", "recompute", "activations (MiB)", "none / this", "one block (MiB)",
         "fwd+bwd peak (MiB)", "step CPU (ms)", "CPU / none", "step wall (ms)", "page faults",
         "same loss"],
        [[f"{r['model']} (L={r['n_layer']})", r["recompute"], mib(r["activations_bytes"]),
          f"{r['activations_ratio']:.1f}", mib(r["block_bytes"]), mib(r["peak_bytes"]),
          f"{r['step_cpu_ms']:.1f}", f"{r['step_cpu_ratio']:.3f}", f"{r['step_time_ms']:.1f}",
          r["page_faults"], r["same_loss"]] for r in rows]))
    print(f"\nmachine: {machine_line(machine_info())}")
    print(f"command: python bench/memory.py {shlex.join(sys.argv[1:])}".rstrip())
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": machine_info(), "recompute": rows})


def available_stages():
    from rtxmpi.parallel.zero import STAGES

    return [0] + [s for s in (1, 2, 3) if s in STAGES]


def launch(args, ranks, stage):
    result = run_worker_job("memory", ranks, __file__, ["--stage", str(stage), "--model", args.model, "--local-batch", str(args.local_batch),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--tp", str(args.tp),
           "--sp", str(args.sp), "--device", args.device], timeout=300)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "model_state_bytes", "peak_rss_bytes", "rss_bytes", "transient_peak_bytes"):
        result[key] = max(r[key] for r in result["per_rank"])
    result["device_peak_bytes"] = max(result["device_peak_bytes"])
    return result


def mib(n):
    return f"{n / MIB:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes")
    p.add_argument("--model", default="small")
    p.add_argument("--stages", default=None, help="comma-separated stages (default: 0 and every "
                                                   "stage rtxmpi.parallel.zero.STAGES has)")
    p.add_argument("--local-batch", type=int, default=16, help="sequences per rank per micro-batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=2, help="training steps before measuring")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: stage 0 is "
                   "HybridParallel, stage k ZeRO-k on each tp slice over the dp x sp ranks")
    p.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree (as --tp)")
    p.add_argument("--recompute", action="store_true", help="compare recompute none and blocks "
                   "(activation bytes, step time) in this process instead of the ZeRO table")
    p.add_argument("--recompute-models", default="small,base", help="--recompute: the GPT sizes")
    p.add_argument("--repeats", type=int, default=5, help="--recompute: timed steps per policy")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model lives (cuda: cupy; ranks may share one GPU)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device == "cuda" and args.tp * args.sp > 1:
        p.error("--device cuda measures DataParallel and ZeRO (--tp 1 --sp 1)")
    if args.worker:
        return worker(args)
    if args.recompute:
        return compare_recompute(args)
    stages = ([int(s) for s in args.stages.split(",")] if args.stages else available_stages())
    ranks = [int(n) for n in args.ranks.split(",")]
    results = {(n, s): launch(args, n, s) for s in stages for n in ranks}
    dp = {n: results[(n, 0)]["model_state_bytes"] for n in ranks if (n, 0) in results}
    dp_device = {n: results[(n, 0)]["device_peak_bytes"] for n in ranks if (n, 0) in results}
    on_device = args.device == "cuda"
    first = next(iter(results.values()))
    rows = []
    for s in stages:
        for n in ranks:
            r = results[(n, s)]
            ratio = f"{r['model_state_bytes'] / dp[n]:.3f}" if n in dp else "-"
            r["ratio_to_dp"] = r["model_state_bytes"] / dp[n] if n in dp else None
            rows.append([s, n, mib(r["params_bytes"]), mib(r["grads_bytes"]),
                         mib(r["optimizer_bytes"]), mib(r["activations_bytes"]),
                         mib(r["transient_peak_bytes"]), mib(r["model_state_bytes"]), ratio,
                         mib(r["peak_rss_bytes"])])
            if on_device:
                r["device_ratio_to_dp"] = (r["device_peak_bytes"] / dp_device[n]
                                           if dp_device.get(n) else None)
                rows[-1] += [mib(r["device_peak_bytes"]),
                             "-" if r["device_ratio_to_dp"] is None else f"{r['device_ratio_to_dp']:.3f}"]
    info = machine_info()
    print(f"Per-rank memory (MiB, largest over ranks), model {args.model} "
          f"({first['params'] / 1e6:.2f} M params, float32), activations of one micro-batch of "
          f"{args.local_batch} x {args.seq_len} tokens; stage 0 = "
          + ("DataParallel + AdamW\n" if args.tp * args.sp == 1 else
             f"HybridParallel (tp {args.tp}, sp {args.sp}: each rank's tp slice whole), stage k = "
             f"ZeroHybridParallel (the slice sharded over dp x sp ranks)\n"))
    print(markdown_table(["stage", "ranks", "params", "grads", "optimizer", "activations",
                          "transient", "model state",
                          "ratio to DP" if args.tp * args.sp == 1 else "ratio to stage 0",
                          "peak RSS"] + (["peak device", "device ratio to DP"] if on_device else []),
                         rows))
    print()
    layer = first["layer_bytes"]
    if 4 in dp and args.tp * args.sp == 1:  # the target is against plain DP
        bound = (dp[4] / 4 + layer) * 1.05
        target = {"bound_bytes": bound, "layer_bytes": layer, "dp_bytes": dp[4]}
        if (4, 3) in results:
            got = results[(4, 3)]["model_state_bytes"]
            target.update(zero3_bytes=got, met=got <= bound)
            print(f"- Target: ZeRO-3 model state at 4 ranks <= (DP/4 + largest layer) x 1.05 = "
                  f"({mib(dp[4])}/4 + {mib(layer)}) x 1.05 = {mib(bound)} MiB: {mib(got)} MiB -> "
                  f"{'met' if got <= bound else 'MISSED'} ({got / bound:.2f} of the bound)")
            peak = results[(4, 3)].get("gathered_peak_bytes")
            if peak:  # {"params", "grads"}: transient gathered units and unit gradient buffers
                transient = got + peak["params"]
                target.update(gathered_peak_bytes=peak, zero3_with_gathered_params_bytes=transient)
                print(f"- Adding ZeRO-3's transient buffers (rank 0's provider.peak_bytes): gathered "
                      f"units {mib(peak['params'])} MiB -> {mib(transient)} MiB "
                      f"({transient / bound:.2f} of the bound, "
                      f"{'met' if transient <= bound else 'MISSED'}); unit gradient buffers "
                      f"{mib(peak['grads'])} MiB more -> {mib(transient + peak['grads'])} MiB "
                      f"({(transient + peak['grads']) / bound:.2f} of the bound)")
        else:
            best = min(results[(4, s)]["model_state_bytes"] for s in stages if s)
            print(f"- Target: ZeRO-3 model state at 4 ranks <= (DP/4 + largest layer) x 1.05 = "
                  f"({mib(dp[4])}/4 + {mib(layer)}) x 1.05 = {mib(bound)} MiB: not measured "
                  f"(rtxmpi.parallel.zero.STAGES has no stage 3); best stage now {mib(best)} MiB "
                  f"= {best / bound:.2f} of the bound")
            target.update(zero3_bytes=None, met=None)
    else:
        target = None
    print(f"\nmachine: {machine_line(info)}")
    print(f"command: python bench/memory.py {shlex.join(sys.argv[1:])}".rstrip())
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, "target": target,
                               "results": [results[k] for k in sorted(results)]})


if __name__ == "__main__":
    main()
