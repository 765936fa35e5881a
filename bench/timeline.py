"""Cost of observing a training run: step time with the timeline and metrics on vs off.

    mpiexec -n 2 python bench/timeline.py                       # tiny and small models
    mpiexec -n 2 python bench/timeline.py --model small --blocks 12 --json timeline.json

One job runs the training step of examples/train.py (next_batch, forward, backward with bucketed
all_reduce overlapping it, global grad norm, agree, clip + AdamW, loss all_reduce) in blocks of
--steps-per-block steps, alternating "off" (tracing off, the engine's plain methods, no Observer
call: what train.py does without observe flags) and "on" (what train.py does with --timeline,
--run-dir and --metrics-textfile: spans around data/forward/backward/optimizer and every layer,
every collective wrapped, Observer.begin_step/end_step computing the breakdown, the gauges, one
cross-rank all_gather and a textfile write per step). Blocks go in ABBA order so drift cancels;
the overhead is the median over pairs of (on / off - 1) of each block's median step time, with the
spread over pairs, and min(on) / min(off) - 1 (the fastest step of each mode: least disturbed by
other processes). The same A/B median of this thread's CPU time per step (time.thread_time: not
inflated by waiting for a core, but including MPI's polling) is the steadiest of the three at -n 1. On a shared machine those differences are noisy, so the cost is also accounted
directly, in the same run: the time spent inside Observer.begin_step/end_step (breakdown, gauges,
the cross-rank all_gather, the textfile) plus spans per step x the cost of one span (the span
context manager and the collective wrapper, timed in a tight loop here), over the median step
time off. The end-of-run merge (gather every rank's spans to rank 0, write the Chrome
trace) happens once and is reported on its own. Rank 0 prints; --json writes every number.

Target: overhead <= 2% of step time.
"""
import argparse
import math
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import (fmt, launch_command, machine_info, machine_line, markdown_table,  # noqa: E402
                     progress, write_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny,small", help="comma-separated model sizes")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=0.25, help="small buckets: several async all_reduces")
    p.add_argument("--blocks", type=int, default=40, help="blocks per mode (even: ABBA pairs)")
    p.add_argument("--steps-per-block", type=int, default=1)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def run_model(world, corpus, name, args, tmp):
    import numpy as np

    from rtxmpi.control import agree
    from rtxmpi.data import BatchSampler
    from rtxmpi.nn import GPT, AdamW, GPTConfig, clip_grad_norm, decay_mask, grad_norm_sq
    from rtxmpi.observe import trace
    from rtxmpi.observe.observer import Observer
    from rtxmpi.parallel.data import DataParallel

    cfg = GPTConfig.named(name, seq_len=args.seq_len)
    model = GPT(cfg, seed=0)
    engine = DataParallel(model, world, bucket_bytes=int(args.bucket_mb * 2**20))
    opt = AdamW(model.flat_data, lr=1e-3, weight_decay=0.1, decay_mask=decay_mask(model.params))
    sampler = BatchSampler(corpus.train, args.seq_len, args.global_batch, seed=0,
                           dp_rank=world.rank, dp_size=world.world_size)
    run_dir = os.path.join(tmp, f"run_{name}") if world.rank == 0 else os.path.join(tmp, "unused")
    obs = Observer(world, run_dir=run_dir, timeline=None, tokens_per_step=args.global_batch * args.seq_len,
                   metrics_textfile=os.path.join(tmp, f"{name}.prom"))
    trace.enable(False)  # the Observer turned it on; blocks switch it
    plain = {"forward": engine.forward, "backward": engine.backward, "next_batch": sampler.next_batch}
    obs.instrument(engine=engine, sampler=sampler)
    traced = {"forward": engine.forward, "backward": engine.backward, "next_batch": sampler.next_batch}
    step_fn_plain, step_fn_traced = opt.step, obs._wrap(opt.step, "optimizer")

    def set_mode(on):
        for key, fn in (traced if on else plain).items():
            setattr(sampler if key == "next_batch" else engine, key, fn)
        trace.enable(on)
        return step_fn_traced if on else step_fn_plain

    times, cpu, hooks = {"off": [], "on": []}, {"off": [], "on": []}, []
    order = ["off", "on", "on", "off"] * math.ceil(args.blocks / 2)
    step = 0
    for mode in order[:2 * args.blocks]:
        optimizer_step = set_mode(mode == "on")
        block, block_cpu = [], []
        for _ in range(args.steps_per_block):
            step += 1
            c0 = time.thread_time()
            t0 = time.perf_counter()
            if mode == "on":
                h0 = time.perf_counter()
                obs.begin_step(step)
                hook = time.perf_counter() - h0
            x, y = sampler.next_batch()
            loss, cache = engine.forward(x, y)
            engine.backward(cache)
            norm = math.sqrt(grad_norm_sq(model.flat_grad))
            if not agree(world, overflow=not math.isfinite(norm)).overflow:
                clip_grad_norm(model.flat_grad, 1.0, total_norm=norm)
                optimizer_step(model.flat_grad)
            model.zero_grad()
            engine._synced = False
            losses = np.array([loss])
            world.all_reduce(losses, op="avg")
            if mode == "on":
                h0 = time.perf_counter()
                obs.end_step(step)
                hooks.append(hook + time.perf_counter() - h0)
            block.append(time.perf_counter() - t0)
            block_cpu.append(time.thread_time() - c0)
        times[mode].append(statistics.median(block) * 1e3)
        cpu[mode].append(statistics.median(block_cpu) * 1e3)
    spans_per_step = len(trace.events()) / max(1, step // 2)  # this rank's, "on" steps only
    set_mode(True)
    t0 = time.perf_counter()
    obs.close()
    close_ms = (time.perf_counter() - t0) * 1e3
    pairs = [on / off - 1 for on, off in zip(times["on"], times["off"])]
    cpu_pairs = [on / off - 1 for on, off in zip(cpu["on"], cpu["off"])]
    off_ms = statistics.median(times["off"])
    span_us = span_cost_us()
    hooks_ms = statistics.median(hooks) * 1e3
    direct = 100 * (hooks_ms + spans_per_step * span_us / 1e3) / off_ms
    return {"direct_pct": direct, "cpu_off_ms": statistics.median(cpu["off"]),
            "cpu_overhead_pct": 100 * statistics.median(cpu_pairs), "hooks_ms": hooks_ms, "span_us": span_us,
            "min_ratio_pct": 100 * (min(times["on"]) / min(times["off"]) - 1),
            "model": name, "params_m": model.num_params / 1e6, "off_ms": statistics.median(times["off"]),
            "on_ms": statistics.median(times["on"]), "overhead_pct": 100 * statistics.median(pairs),
            "overhead_min_pct": 100 * min(pairs), "overhead_max_pct": 100 * max(pairs),
            "spans_per_step": spans_per_step, "close_ms": close_ms, "blocks": times}


def span_cost_us(n=20000):
    """Microseconds one traced span costs: trace.span's context manager, plus the collective
    wrapper (rtxmpi.comm.traced) around a call that does nothing."""
    from rtxmpi.comm.traced import _traced_collective
    from rtxmpi.observe import trace

    class Group:
        name, world_size = "world", 2

    wrapped, group, x = _traced_collective("all_reduce", lambda self, x: x), Group(), bytearray(8)
    trace.enable(True)
    t0 = time.perf_counter()
    for _ in range(n):
        with trace.span("forward", "forward"):
            pass
    t1 = time.perf_counter()
    for _ in range(n):
        wrapped(group, x)
    t2 = time.perf_counter()
    trace.enable(False)
    trace.events(clear=True)
    return max(t1 - t0, t2 - t1) / n * 1e6


def main(argv=None):
    args = parse_args(argv)
    import rtxmpi
    from rtxmpi.data import load_corpus

    world = rtxmpi.init(check=False)
    corpus = load_corpus(None, seq_len=args.seq_len)
    info = machine_info() if world.rank == 0 else None
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.model.split(","):
            if world.rank == 0:
                progress(f"timeline overhead: model {name}, {args.blocks} blocks per mode")
            results.append(run_model(world, corpus, name, args, tmp))
    if world.rank != 0:
        return
    print(machine_line(info))
    print(f"world_size {world.world_size}, global batch {args.global_batch} x {args.seq_len}, "
          f"bucket {args.bucket_mb} MiB, {args.blocks} blocks x {args.steps_per_block} steps "
          f"per mode, ABBA\n")
    rows = [[r["model"], fmt(r["params_m"], 2), fmt(r["off_ms"]), fmt(r["on_ms"]),
             fmt(r["overhead_pct"]), f"{fmt(r['overhead_min_pct'])} .. {fmt(r['overhead_max_pct'])}",
             fmt(r["min_ratio_pct"]), fmt(r["cpu_off_ms"]), fmt(r["cpu_overhead_pct"]), fmt(r["hooks_ms"], 3), fmt(r["spans_per_step"], 0),
             fmt(r["span_us"], 2), fmt(r["direct_pct"], 3), fmt(r["close_ms"], 1)] for r in results]
    print(markdown_table(["model", "params (M)", "step off (ms)", "step on (ms)", "A/B overhead (%)",
                          "spread over pairs (%)", "min on / min off - 1 (%)", "CPU/step off (ms)",
                          "A/B CPU-time overhead (%)", "hooks/step (ms)",
                          "spans/step/rank", "one span (us)", "accounted overhead (%)",
                          "merge at close (ms)"], rows))
    print(f"\n{launch_command(world.world_size)}")
    if args.json:
        write_json(args.json, {"machine": info, "args": vars(args), "results": results,
                               "command": launch_command(world.world_size)})


if __name__ == "__main__":
    main()
