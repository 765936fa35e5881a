"""The planner's predictions against measured step times, for every 4-rank layout.

    python bench/planner.py                          # launches mpiexec -n 4 itself
    python bench/planner.py --model small --global-batch 32 --rounds 6 --json planner.json
    python bench/planner.py --layouts 4,1,1,1 1,1,4,1 --rounds 3 --no-end-profile   # a subset

One MPI job (4 ranks) does, in order:
  1. calibrates the hardware profile (rtxmpi.parallel.calibrate, the same call as
     `rtxmpi plan --calibrate` and `--plan auto`, inside the same job as the layouts: the same
     binding, none (_common.worker_job's `--bind-to none`), so the ranks sit where the scheduler
     put them; the calibration averages its sharing runs over placements, docs/planner.md
     "Placement", and the report prints the cores the ranks ran on after each round) and plans
     (rtxmpi.parallel.planner.make_plan, every layout);
  2. for each target layout (dp, tp, pp, sp) = (4,1,1,1), (2,2,1,1), (2,1,2,1), (1,2,2,1),
     (1,1,4,1), (1,1,1,4), (2,1,1,2), takes the planner's best configuration of that layout
     (micro-batches, ZeRO stage, schedule); layouts the runtime cannot run are listed with the
     planner's reason;
  3. builds every runnable layout's engine side by side (DataParallel / ZeroDataParallel,
     HybridParallel for tp and sp, PipelineParallel for pp: what examples/train.py builds) and
     times the training loop's step (train.py's: micro-batches, grad norm, overflow agree, clipped
     AdamW step, loss average), interleaved: each round runs --steps-per-round steps of every
     layout, the order rotating, so machine noise hits all alike; a step's time is the slowest
     rank's (barrier before it); the table shows the median;
  4. calibrates again at the end (unless --no-end-profile): predictions from both profiles show
     how much the machine drifted.
Per layout the table shows the 1-minute load average while its steps ran (mean over the rounds)
and both ratios, predicted (start profile, what --plan auto uses) / measured and predicted
(during) / measured. --layouts runs a subset (any 4-rank dp,tp,pp,sp), which keeps a run on a
busy machine short.
Targets (reported, never asserted): predicted within 25% of measured for every layout; the
planner's first choice within 10% of the fastest measured layout.
"""
import argparse
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import run_worker_job, machine_info, machine_line, markdown_table, write_json  # noqa: E402

LAUNCH = "self"  # rtxmpi bench planner: runs as python and starts its own mpiexec -n 4
TARGETS = [(4, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (1, 2, 2, 1), (1, 1, 4, 1), (1, 1, 1, 4),
           (2, 1, 1, 2)]


class _Replicated:
    """ZeRO stage 0 as examples/train.py runs it: DataParallel + a whole AdamW per rank."""

    def __init__(self, model, world, optimizer):
        from rtxmpi.nn import decay_mask
        from rtxmpi.parallel.data import DataParallel

        self.model = model
        self.ddp = DataParallel(model, world)
        self.optimizer = optimizer(model.flat_data, decay_mask(model.params))
        self.forward, self.backward, self.no_sync = self.ddp.forward, self.ddp.backward, self.ddp.no_sync

    def grad_norm(self):
        import math

        from rtxmpi.nn import grad_norm_sq

        return math.sqrt(grad_norm_sq(self.model.flat_grad))

    def step(self, lr=None, max_grad_norm=None, total_norm=None):
        from rtxmpi.nn import clip_grad_norm

        if max_grad_norm is not None:
            clip_grad_norm(self.model.flat_grad, max_grad_norm, total_norm=total_norm)
        self.ddp.step(self.optimizer, lr=lr)


def _zero_kwargs(builder, layout):
    """zero_stage (and offload) for a builder that takes them; the planner only proposes ZeRO
    with tp / pp / sp where the runtime's checks accept it, and such a runtime's builder does."""
    import inspect

    if not layout.zero_stage:
        return {}
    params = inspect.signature(builder).parameters
    if "zero_stage" not in params:
        raise SystemExit(f"[planner] {layout}: this runtime's {builder.__name__} takes no zero_stage")
    out = {"zero_stage": layout.zero_stage}
    if layout.offload != "none":
        out["offload"] = layout.offload
    return out


def build(layout, cfg, world):
    """The engine examples/train.py would build for `layout`, and (dp_rank, dp_size)."""
    from rtxmpi.nn import GPT, AdamW
    from rtxmpi.parallel.zero import ZeroDataParallel

    def optimizer(params, mask):
        return AdamW(params, lr=1e-4, weight_decay=0.1, decay_mask=mask)

    L = layout
    if L.pp > 1:
        from rtxmpi.parallel.pipeline import build_pipeline

        import inspect

        extra = {"tp": L.tp} if "tp" in inspect.signature(build_pipeline).parameters else {}
        extra.update(_zero_kwargs(build_pipeline, L))
        e = build_pipeline(cfg, world, dp=L.dp, pp=L.pp, micro_batches=L.micro_batches,
                           schedule=L.schedule, optimizer=optimizer, **extra)
        return e, e.mesh.dp_rank, e.mesh.dp, True
    if L.tp > 1 or L.sp > 1:
        from rtxmpi.parallel.hybrid import build_hybrid

        e = build_hybrid(cfg, world, dp=L.dp, tp=L.tp, sp=L.sp, optimizer=optimizer,
                         **_zero_kwargs(build_hybrid, L))
        return e, e.mesh.dp_rank, e.mesh.dp, False
    model = GPT(cfg, seed=0)
    if L.zero_stage:
        e = ZeroDataParallel(model, world, stage=L.zero_stage, optimizer=optimizer)
    else:
        e = _Replicated(model, world, optimizer)
    return e, world.rank, world.world_size, False


def train_step(engine, pipeline, x, y, micro_batches, world):
    """examples/train.py's step body (without metrics and checkpoints)."""
    import math

    import numpy as np

    from rtxmpi.control import agree

    if pipeline:
        loss_sum = engine.train_step(x, y) * micro_batches
    else:
        loss_sum = 0.0
        xs, ys = np.split(x, micro_batches), np.split(y, micro_batches)
        for m in range(micro_batches):
            loss, cache = engine.forward(xs[m], ys[m])
            loss_sum += loss
            if m < micro_batches - 1:
                with engine.no_sync():
                    engine.backward(cache, scale=1.0 / micro_batches)
            else:
                engine.backward(cache, scale=1.0 / micro_batches)
    grad_norm = engine.grad_norm()
    if agree(world, overflow=not math.isfinite(grad_norm)).overflow:
        engine.zero_grad()
    else:
        engine.step(lr=1e-4, max_grad_norm=1.0, total_norm=grad_norm)
    losses = np.array([loss_sum / micro_batches])
    world.all_reduce(losses, op="avg")
    return float(losses[0])


def _core():
    """The core this process last ran on (/proc/self/stat field 39), -1 where not readable."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def worker(args):
    import numpy as np
    from mpi4py import MPI

    import rtxmpi
    from rtxmpi.nn import GPTConfig
    from rtxmpi.parallel.calibrate import ReferenceRun, _measure_sync, calibrate
    from rtxmpi.parallel.planner import estimate, make_plan

    world = rtxmpi.init(check=False)
    comm = MPI.COMM_WORLD
    rank0 = world.rank == 0
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    t0 = time.perf_counter()
    profile = calibrate(world, cfg=cfg)
    ref = ReferenceRun(world, cfg, profile.ref_model["micro_batch"])
    ref_samples = {k: [] for k in ref.ks}
    sync_samples, ranks_of_node = [], [list(range(world.world_size))]  # one node
    segment = min(0.02, float(profile.ref_busy_ms[str(ref.ks[-1])]) * 1e-3 / (2 * cfg.n_layer))
    if rank0:
        print(f"[planner] calibrated in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    plan = make_plan(cfg, args.global_batch, world.world_size, profile)
    chosen, skipped = [], []
    for degrees in args.layouts:
        best = next((e for e in plan.ranked if e.layout.degrees == degrees), None)
        if best is None:
            why = next((w for L, w in plan.rejected if L.degrees == degrees), "no candidate")
            skipped.append((degrees, why))
        else:
            chosen.append(best)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (args.global_batch, args.seq_len)).astype(np.int64)
    y = np.roll(x, -1, axis=1)
    engines = []
    for e in chosen:
        eng, dp_rank, dp_size, pipe = build(e.layout, cfg, world)
        local = args.global_batch // dp_size
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        engines.append((e, eng, pipe, x[rows], y[rows]))
    times = [[] for _ in engines]
    loads = [[] for _ in engines]  # the 1-minute load average as each layout's steps began
    cores = []  # per round, the core each rank ran on (the ranks are not bound: placement)
    for i, (e, eng, pipe, xl, yl) in enumerate(engines):  # warm-up
        train_step(eng, pipe, xl, yl, e.layout.micro_batches, world)
    for r in range(args.rounds):
        order = list(range(len(engines)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            e, eng, pipe, xl, yl = engines[i]
            loads[i].append(os.getloadavg()[0])
            for _ in range(args.steps_per_round):
                comm.Barrier()
                t = time.perf_counter()
                train_step(eng, pipe, xl, yl, e.layout.micro_batches, world)
                times[i].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        cores.append("".join(str(c) if 0 <= c < 10 else "?" for c in comm.allgather(_core())))
        for k, v in ref.sample(1).items():  # the reference run, interleaved with the layouts
            ref_samples[k] += v
        sync_samples.append(_measure_sync(comm, world, ranks_of_node, cfg, segment, reps=3))
        if rank0:
            print(f"[planner] round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    profile_end = calibrate(world, cfg=cfg) if args.end_profile else None
    if not rank0:
        return
    # the profile refitted to the reference runs interleaved with the measured steps: the same
    # machine load as the measurements (the start profile saw only the first seconds)
    during = profile.with_reference(ReferenceRun.median_ms(ref_samples),
                                    note="reference run re-sampled during the benchmark rounds",
                                    work_ms=ReferenceRun.median_ms(ref.cpu)[1])
    during.sync_s = {n: float(np.median([s[n] for s in sync_samples])) for n in sync_samples[0]}
    fastest_ref = {k: float(np.min(v)) * 1e3 for k, v in ref_samples.items()}
    during_min = profile.with_reference(fastest_ref, note="fastest reference runs during the rounds",
                                        work_ms=float(np.min(ref.cpu[1])) * 1e3)
    during_min.sync_s = {n: float(np.min([s[n] for s in sync_samples])) for n in sync_samples[0]}
    plan_during = make_plan(cfg, args.global_batch, world.world_size, during,
                            layouts=[e.layout for e in chosen])  # ranks the layouts run
    results = []
    for (e, *_), ts, load in zip(engines, times, loads):
        end = estimate(cfg, e.layout, args.global_batch, profile_end or profile,
                       plan.inputs["ranks_per_node"])
        mid = estimate(cfg, e.layout, args.global_batch, during, plan.inputs["ranks_per_node"])
        low = estimate(cfg, e.layout, args.global_batch, during_min, plan.inputs["ranks_per_node"])
        results.append({"layout": vars(e.layout), "degrees": list(e.layout.degrees),
                        "predicted_start_ms": e.total_ms,
                        "predicted_end_ms": end.total_ms if profile_end else None,
                        "load_average": float(np.mean(load)),
                        "predicted_ms": mid.total_ms, "predicted_min_ms": low.total_ms,
                        "measured_ms": float(np.median(ts)) * 1e3,
                        "measured_min_ms": float(np.min(ts)) * 1e3, "samples": len(ts),
                        "compute_ms": e.compute_ms, "comm_ms": e.comm_ms, "bubble": e.bubble})
    out = {"results": results, "skipped": [{"degrees": list(d), "reason": w} for d, w in skipped],
           "first_choice": vars(plan_during.best.layout),
           "first_choice_predicted_ms": plan_during.best.total_ms,
           "first_choice_start": vars(plan.best.layout), "reason": plan_during.reason(),
           "placement": cores,
           "profile": vars(during), "profile_start": vars(profile),
           "profile_end": vars(profile_end) if profile_end else None}
    print("RESULT " + json.dumps(out), flush=True)


def launch(args):
    return run_worker_job("planner", 4, __file__, [
        "--model", args.model, "--global-batch", args.global_batch, "--seq-len", args.seq_len,
        "--rounds", args.rounds, "--steps-per-round", args.steps_per_round,
        "--layouts", *[",".join(map(str, d)) for d in args.layouts]]
        + ([] if args.end_profile else ["--no-end-profile"]))


def report(args, out, info):
    rows, ok_all = [], True
    fastest = min(out["results"], key=lambda r: r["measured_ms"])
    by_layout = {json.dumps(r["layout"], sort_keys=True): r for r in out["results"]}
    first_start = by_layout.get(json.dumps(out["first_choice_start"], sort_keys=True))
    first_during = by_layout.get(json.dumps(out["first_choice"], sort_keys=True))
    ok_start = True
    for r in out["results"]:
        L = r["layout"]
        ratio = r["predicted_ms"] / r["measured_ms"]
        start = r["predicted_start_ms"] / r["measured_ms"]
        ok = abs(ratio - 1) <= 0.25
        ok_all &= ok
        ok_start &= abs(start - 1) <= 0.25
        marks = [m for m, on in (("first choice (start)", r is first_start),
                                 ("first choice (during)", r is first_during),
                                 ("fastest", r is fastest)) if on]
        end = r.get("predicted_end_ms")
        zero = str(L["zero_stage"]) + ("" if L.get("offload", "none") == "none" else f" +{L['offload']}")
        rows.append([f"({L['dp']},{L['tp']},{L['pp']},{L['sp']})", L["micro_batches"],
                     zero, L["schedule"], f"{r.get('load_average', float('nan')):.1f}",
                     f"{r['predicted_start_ms']:.0f}", f"{r['predicted_ms']:.0f}",
                     "-" if end is None else f"{end:.0f}", f"{r['measured_ms']:.0f}",
                     f"{start:.2f}", f"{ratio:.2f}", "yes" if ok else "NO",
                     f"{r['predicted_min_ms'] / r['measured_min_ms']:.2f}", ", ".join(marks)])
    print(f"Planner: predicted vs measured step time, 4 ranks, model {args.model}, global batch "
          f"{args.global_batch} x {args.seq_len} tokens; median of {out['results'][0]['samples']} "
          f"interleaved steps per layout")
    print()
    print(markdown_table(["layout (dp,tp,pp,sp)", "micro-batches", "zero", "schedule",
                          "load average", "predicted ms (start profile)", "predicted ms (during)",
                          "predicted ms (end profile)", "measured ms",
                          "start / measured", "during / measured", "within 25% (during)",
                          "fastest-sample ratio", ""], rows))
    print("\n(fastest-sample ratio: the prediction from the fastest reference runs over the fastest "
          "measured step, the same comparison with the machine's other load at its lowest)")
    for s in out["skipped"]:
        print(f"\nnot run: {tuple(s['degrees'])}: {s['reason']}")
    print()
    gaps = {}
    for name, row in (("start", first_start), ("during", first_during)):
        if row is None:
            print(f"first choice ({name} profile): not among the layouts run")
            continue
        gap = gaps[name] = row["measured_ms"] / fastest["measured_ms"] - 1
        print(f"first choice ({name} profile): {tuple(row['degrees'])} m{row['layout']['micro_batches']} "
              f"z{row['layout']['zero_stage']}, measured {row['measured_ms']:.0f} ms, "
              f"{100 * gap:.1f}% slower than the fastest measured {tuple(fastest['degrees'])} "
              f"({fastest['measured_ms']:.0f} ms): target <= 10% {'met' if gap <= 0.10 else 'NOT met'}")
    print(f"every prediction (during) within 25%: {'met' if ok_all else 'NOT met'}; "
          f"(start profile): {'met' if ok_start else 'NOT met'}")
    print(f"\nplanner's reason (during profile, among the layouts run): {out['reason']}")
    for name in ("profile_start", "profile", "profile_end"):
        p = out[name]
        if p is None:
            continue
        print(f"{name.replace('_', ' '):<16}: effective cores "
              f"{p['effective_cores']:.2f}, wait weight {p['wait_weight']:.2f}, contention "
              f"{p['contention']:.2f}, reference run {p['ref_ms']:.0f} ms, sync wait "
              f"{', '.join(f'{n} ranks {1e3 * v:.1f} ms' for n, v in p.get('sync_s', {}).items())}")
    print("('start' is calibrate() before the runs, as --plan auto uses it; 'during' refits the "
          "reference run sampled between the rounds; 'end' is calibrate() after the runs)")
    if out.get("placement"):
        print(f"placement (the core each of ranks 0-{len(out['placement'][0]) - 1} ran on after "
              f"each round; not bound, the scheduler's choice): {' '.join(out['placement'])}")
    print(f"machine: {machine_line(info)}")
    print(f"command: python bench/planner.py {shlex.join(sys.argv[1:])}".rstrip())
    return gaps, ok_all


def _degrees(text):
    try:
        d = tuple(int(x) for x in text.split(","))
    except ValueError:
        d = ()
    if len(d) != 4 or min(d) < 1 or d[0] * d[1] * d[2] * d[3] != 4:
        raise argparse.ArgumentTypeError(f"{text!r}: want dp,tp,pp,sp with product 4, e.g. 2,1,2,1")
    return d


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the layouts")
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--layouts", nargs="+", type=_degrees, default=TARGETS, metavar="DP,TP,PP,SP",
                   help="run only these layouts (default: the 7 targets), e.g. --layouts 4,1,1,1 1,1,4,1")
    p.add_argument("--no-end-profile", dest="end_profile", action="store_false",
                   help="skip the calibration after the runs (saves 10-30 s)")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    info = machine_info()
    out = launch(args)
    report(args, out, info)
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, **out})


if __name__ == "__main__":
    main()
