"""The main job against PyTorch: examples/train.py against the same GPT in PyTorch DDP over gloo.

    python bench/peers.py            # small and base, 1 and 2 ranks, 2 rounds: ~8 min on 2 cores
    python bench/peers.py --quick    # small, 1 and 2 ranks, 10 steps, 1 round: ~30 s
    python bench/peers.py --models base --ranks 2 --steps 40 --warmup 5 --rounds 3 --json out.json

For each model and world size, --rounds times, one mpiexec job of each side, alternating which
goes first (ABBA...): rtxmpi's examples/train.py, and the same training in PyTorch
(bench/_peer_torch.py, DistributedDataParallel over gloo, fused AdamW, eager mode), with the same
global batch, sequence length, initial weights (rtxmpi's, seed --seed), batches (rtxmpi.data's
BatchSampler over the same corpus), lr schedule, AdamW and clipping, one thread per rank. A step
is timed on rank 0 from fetching the batch to the end of the optimizer step, the loss's
all_reduce included, as train.py's metrics do; the table gives the median over every round's
steps after --warmup, tokens/s from it, the training loss of step 1 and the validation loss after
the run (the same tokens on both: the same steps of the same global batch).

Compute rate: model FLOPs per step over the step time, per rank, against the machine's float32
matmul rate at one thread, numpy's and torch's, measured in this run on the model's weight
matmuls (forward shapes at the per-rank batch, each layer's count; best of 6, the two libraries
alternating). FLOPs per token = 6 N + 12 L T C with N = 12 L C^2 + V C, the weights of the
matmuls (the tied head included, embeddings lookups and biases not), and attention over the full
T x T (PaLM's count, Chowdhery et al. 2022, appendix B). The matrix floor: numpy's time for all
of one step's matrix products on one rank (`step_matmuls`: the linears' forward and both
gradients, attention's six batched products on strided head views), the least time rtxmpi's
step can take.

Needs torch (`pip install 'rtxmpi[peers]'`): without it the run prints one `skipped:` line and
exits 0.
"""
import argparse
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from _common import fmt, machine_info, machine_line, markdown_table, progress, write_json  # noqa: E402

LAUNCH = "self"  # starts its own mpiexec jobs
TRAIN = os.path.join(ROOT, "examples", "train.py")
SIDES = ("rtxmpi", "torch")
QUICK = {"models": "small", "ranks": "1,2", "steps": 10, "warmup": 3, "rounds": 1, "eval_batches": 2}


# ------------------------------------------------------------------------------ the model's cost
def flops_per_token(cfg):
    """Model FLOPs of one token's forward and backward: 6 N + 12 L T C (see the docstring)."""
    L, C, V, T = cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.seq_len
    return 6 * (12 * L * C * C + V * C) + 12 * L * T * C


def matmul_shapes(cfg, rows):
    """The forward weight matmuls of one step on `rows` = local batch x T rows: [(m, k, n, count)]."""
    L, C, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    return [(rows, C, 3 * C, L), (rows, C, C, L), (rows, C, 4 * C, L), (rows, 4 * C, C, L),
            (rows, C, V, 1)]


def step_matmuls(cfg, rows, np):
    """The matrix products of one training step on `rows` = local batch x T rows, as
    rtxmpi.nn.layers makes them (numpy, float32): [(callable, calls per step)]. Per linear layer
    y = x @ w, dx = dy @ w.T, dw = x.T @ dy; per block attention's six batched products on the
    (B, H, T, hs) views of the (B, T, 3C) qkv activations, written into views where layers does."""
    rng = np.random.default_rng(0)
    f32 = np.float32
    products = []
    for m, k, n, count in matmul_shapes(cfg, rows):
        x, w = rng.standard_normal((m, k), f32), rng.standard_normal((k, n), f32)
        dy = rng.standard_normal((m, n), f32)
        products += [(lambda x=x, w=w: x @ w, count), (lambda dy=dy, w=w: dy @ w.T, count),
                     (lambda x=x, dy=dy: x.T @ dy, count)]
    B, T, H = rows // cfg.seq_len, cfg.seq_len, cfg.n_head
    hs = cfg.n_embd // H
    qkv = rng.standard_normal((B, T, 3, H, hs), f32).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0].copy(), qkv[1], qkv[2]  # q: the scaled copy attention_core_forward makes
    att = rng.standard_normal((B, H, T, T), f32)
    dyh = rng.standard_normal((B, T, H, hs), f32).transpose(0, 2, 1, 3)
    out = np.empty((B, T, 3, H, hs), f32).transpose(2, 0, 3, 1, 4)
    for product in (lambda: q @ k.swapaxes(-1, -2), lambda: np.matmul(att, v, out=out[0]),
                    lambda: np.matmul(att.swapaxes(-1, -2), dyh, out=out[2]),
                    lambda: dyh @ v.swapaxes(-1, -2), lambda: np.matmul(att, k, out=out[0]),
                    lambda: np.matmul(att.swapaxes(-1, -2), q, out=out[1])):
        products.append((product, cfg.n_layer))
    return products


# ------------------------------------------------------------------------------ workers
def sgemm_worker(args):
    """Print the float32 matmul rate (GFLOP/s) of numpy and torch on `matmul_shapes`, one thread,
    and numpy's time for the products of a whole step (`step_matmuls`, median of 7 each, seconds)."""
    import numpy as np
    import torch

    from rtxmpi.nn import GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    rng = np.random.default_rng(0)
    flops = {"numpy": 0.0, "torch": 0.0}
    seconds = {"numpy": 0.0, "torch": 0.0}
    for m, k, n, count in matmul_shapes(cfg, args.rows):
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        c = np.empty((m, n), np.float32)
        ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.empty(m, n)
        calls = {"numpy": lambda: np.matmul(a, b, out=c), "torch": lambda: torch.mm(ta, tb, out=tc)}
        iters = max(1, int(2.5e9 / (2 * m * k * n)))  # about 0.05 s a timing at 50 GFLOP/s
        best = {name: math.inf for name in calls}
        for _ in range(6):
            for name, call in calls.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                best[name] = min(best[name], (time.perf_counter() - t0) / iters)
        for name in calls:
            flops[name] += count * 2.0 * m * k * n
            seconds[name] += count * best[name]
    rates = {name: flops[name] / seconds[name] / 1e9 for name in flops}
    floor_s = 0.0
    for product, count in step_matmuls(cfg, args.rows, np):
        product()
        seconds = []
        for _ in range(7):
            t0 = time.perf_counter()
            product()
            seconds.append(time.perf_counter() - t0)
        floor_s += count * statistics.median(seconds)
    print("RESULT " + json.dumps({**rates, "numpy_step_matmuls_s": floor_s}), flush=True)


def torch_worker(args):
    """One rank of the PyTorch job (under mpiexec): the training of examples/train.py with `args`;
    rank 0 prints `RESULT {json}` (step_time_ms, loss per step, val_loss)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel

    import _peer_torch as twin
    from rtxmpi.data import BatchSampler, eval_batches, load_corpus
    from rtxmpi.nn import GPT, GPTConfig, cosine_lr

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    one_node = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size() == size
    address = comm.bcast(("127.0.0.1" if one_node else socket.gethostname(), _free_port())
                         if rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{address[0]}:{address[1]}", rank=rank,
                            world_size=size)
    corpus = load_corpus(args.data, seq_len=args.seq_len, progress=False)
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    model = twin.TorchGPT(cfg)
    twin.load_flat(model, GPT(cfg, seed=args.seed).flat_data)  # rtxmpi's initial weights
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    optimizer = twin.make_optimizer(model, args.lr, args.weight_decay, fused=True)
    sampler = BatchSampler(corpus.train, args.seq_len, args.global_batch, seed=args.seed,
                           dp_rank=rank, dp_size=size)
    times_ms, losses = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = sampler.next_batch()
        optimizer.zero_grad(set_to_none=False)
        loss = ddp(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()  # DDP's bucketed all_reduce averages the gradients, overlapping backward
        lr = cosine_lr(step, args.lr, args.warmup_steps, args.steps, args.min_lr)
        twin.optimizer_step(model, optimizer, lr, args.grad_clip)
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean)  # the logged loss, as train.py's
        times_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(mean) / size)
    total = torch.zeros(2, dtype=torch.float64)  # loss * samples, samples: train.py's evaluate
    with torch.no_grad():
        for x, y in eval_batches(corpus.val, args.seq_len, args.global_batch, args.eval_batches,
                                 dp_rank=rank, dp_size=size):
            total += torch.tensor([float(model(torch.from_numpy(x), torch.from_numpy(y))) * len(x), len(x)],
                                  dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        print("RESULT " + json.dumps({"step_time_ms": times_ms, "loss": losses,
                                      "val_loss": float(total[0] / total[1])}), flush=True)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ the driver
def job_flags(args, model):
    """The training flags both sides get (examples/train.py's names)."""
    flags = ["--model", model, "--steps", args.steps, "--global-batch", args.global_batch,
             "--seq-len", args.seq_len, "--lr", args.lr, "--min-lr", args.min_lr, "--warmup-steps",
             args.warmup_steps, "--weight-decay", args.weight_decay, "--grad-clip", args.grad_clip,
             "--seed", args.seed, "--eval-batches", args.eval_batches, "--bucket-mb", args.bucket_mb]
    return [format(f, ".12g") if isinstance(f, float) else str(f) for f in flags] + (
        ["--data", args.data] if args.data else [])


def job_env():
    """One BLAS thread per rank, checking mode off, root allowed (Open MPI) as root."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               RTXMPI_CHECK="0",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run_job(label, argv, timeout_s):
    """Run `argv`; its stderr passes through. Returns its stdout; a failure ends the benchmark."""
    progress(f"[peers] {label}: {shlex.join(argv)}")
    try:
        proc = subprocess.run(argv, env=job_env(), stdout=subprocess.PIPE, text=True, timeout=timeout_s,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        sys.exit(f"[peers] {label}: no result within --timeout-s {timeout_s:g}")
    if proc.returncode != 0:
        sys.exit(f"[peers] {label}: the job failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout


def result_line(label, stdout):
    line = next((line for line in stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"[peers] {label}: the job printed no RESULT line:\n{stdout[-4000:]}")
    return json.loads(line[len("RESULT "):])


def run_side(side, model, ranks, args):
    """One training job of `side`: {"step_time_ms": [...], "loss": [...], "val_loss": float}."""
    from rtxmpi import bench_launch

    label = f"{side} {model} n={ranks}"
    mpiexec = bench_launch.mpiexec_argv(ranks)
    if side == "torch":
        out = run_job(label, mpiexec + [sys.executable, __file__, "--worker", "torch"]
                      + job_flags(args, model), args.timeout_s)
        return result_line(label, out)
    with tempfile.TemporaryDirectory(prefix="rtxmpi-peers-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        run_job(label, mpiexec + [sys.executable, TRAIN] + job_flags(args, model)
                + ["--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--metrics-jsonl",
                   metrics], args.timeout_s)
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return {"step_time_ms": [r["step_time_ms"] for r in records], "loss": [r["loss"] for r in records],
            "val_loss": records[-1]["val_loss"]}


def sgemm_rates(model, rows, args):
    label = f"sgemm {model} rows={rows}"
    out = run_job(label, [sys.executable, __file__, "--worker", "sgemm", "--model", model,
                          "--seq-len", str(args.seq_len), "--rows", str(rows)], args.timeout_s)
    return result_line(label, out)


def measure(args):
    """Every (model, world size): the sides' runs, alternated, and the matmul rates. Returns rows."""
    from rtxmpi.nn import GPTConfig

    rows = []
    for model in args.models:
        cfg = GPTConfig.named(model, seq_len=args.seq_len)
        for ranks in args.ranks:
            local_rows = args.global_batch // ranks * args.seq_len
            row = {"model": model, "ranks": ranks, "runs": {side: [] for side in SIDES},
                   "sgemm_gflops": sgemm_rates(model, local_rows, args),
                   "flops_per_step": flops_per_token(cfg) * args.global_batch * args.seq_len}
            for r in range(args.rounds):
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    row["runs"][side].append(run_side(side, model, ranks, args))
            rows.append(row)
    return rows


def summarize(row, args):
    """Per side: the median step time (s) over every round's steps after --warmup, and the rest;
    round_ratios: each round's rtxmpi/torch ratio of its two jobs' medians."""
    def median_s(run):
        return statistics.median(run["step_time_ms"][args.warmup:]) / 1e3

    out = {"round_ratios": [median_s(a) / median_s(b)
                            for a, b in zip(row["runs"]["rtxmpi"], row["runs"]["torch"])]}
    for side in SIDES:
        runs = row["runs"][side]
        step_s = statistics.median(t for run in runs for t in run["step_time_ms"][args.warmup:]) / 1e3
        out[side] = {"step_s": step_s, "tokens_per_s": args.global_batch * args.seq_len / step_s,
                     "first_loss": statistics.median(run["loss"][0] for run in runs),
                     "val_loss": statistics.median(run["val_loss"] for run in runs),
                     "gflops_per_rank": row["flops_per_step"] / step_s / row["ranks"] / 1e9}
    return out


def report(rows, args, info, elapsed_s):
    """The markdown on stdout."""
    print("### The main job against PyTorch DDP (gloo), float32, one thread per rank\n")
    print(f"machine: {machine_line(info)}\n")
    print(f"command: `python bench/peers.py {shlex.join(sys.argv[1:])}` ({elapsed_s:.0f} s)\n")
    print(f"Global batch {args.global_batch} x {args.seq_len} tokens, {args.steps} steps (the first "
          f"{args.warmup} untimed), {args.rounds} round(s) of one job a side, alternating which goes "
          f"first (each round's ratio: its two jobs' medians, the spread that the machine's load "
          f"makes); both from rtxmpi's initial weights (seed {args.seed}) on the same batches; "
          f"lr {args.lr:g} -> {args.min_lr:g}, {args.warmup_steps} warm-up step(s), AdamW "
          f"(0.9, 0.95) weight decay {args.weight_decay:g}, clip {args.grad_clip:g}. Step time: "
          f"rank 0's median; validation loss after the run ({args.eval_batches} global batches).\n")
    table, rates = [], []
    for row in rows:
        s = summarize(row, args)
        ours, peer = s["rtxmpi"], s["torch"]
        table.append([row["model"], row["ranks"], fmt(ours["step_s"] * 1e3, 1), fmt(peer["step_s"] * 1e3, 1),
                      fmt(ours["step_s"] / peer["step_s"]), ", ".join(fmt(r) for r in s["round_ratios"]),
                      fmt(ours["tokens_per_s"]),
                      fmt(peer["tokens_per_s"]), f"{ours['first_loss']:.4f} / {peer['first_loss']:.4f}",
                      f"{ours['val_loss']:.4f} / {peer['val_loss']:.4f}"])
        sgemm = row["sgemm_gflops"]
        rates.append([row["model"], row["ranks"], fmt(row["flops_per_step"] / 1e9, 1), fmt(sgemm["numpy"], 1),
                      fmt(sgemm["torch"], 1), fmt(ours["gflops_per_rank"], 1),
                      fmt(ours["gflops_per_rank"] / sgemm["numpy"]), fmt(peer["gflops_per_rank"], 1),
                      fmt(peer["gflops_per_rank"] / sgemm["torch"]),
                      fmt(sgemm["numpy_step_matmuls_s"] * 1e3, 1),
                      fmt(sgemm["numpy_step_matmuls_s"] / peer["step_s"])])
        row["summary"] = s
    print(markdown_table(["model", "ranks", "rtxmpi step (ms)", "torch step (ms)", "rtxmpi/torch step time",
                          "each round's ratio", "rtxmpi tokens/s", "torch tokens/s",
                          "step-1 loss rtxmpi / torch", "val loss rtxmpi / torch"], table))
    print("\nCompute rate: model FLOPs per step (6 N + 12 L T C a token) / step time / ranks, against "
          "one thread's float32 matmul on the model's weight shapes at the per-rank batch, measured "
          "in this run. Matrix floor: numpy's time for every matrix product of one step on one "
          "rank, at the shapes and strides rtxmpi uses (median of 7 each); over torch's step time it "
          "is the shortest rtxmpi/torch step time that numpy's BLAS allows.\n")
    print(markdown_table(["model", "ranks", "GFLOP/step", "numpy sgemm GFLOP/s", "torch sgemm GFLOP/s",
                          "rtxmpi GFLOP/s/rank", "rtxmpi / numpy sgemm", "torch GFLOP/s/rank",
                          "torch / torch sgemm", "matrix floor (ms)", "floor / torch step"], rates))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small,base", help="comma-separated model sizes")
    p.add_argument("--ranks", default="1,2", help="comma-separated world sizes")
    p.add_argument("--steps", type=int, default=30, help="training steps of every job")
    p.add_argument("--warmup", type=int, default=5, help="first steps of a job left out of the timing")
    p.add_argument("--rounds", type=int, default=2, help="jobs of each side per (model, world size)")
    p.add_argument("--quick", action="store_true",
                   help="small, 1 and 2 ranks, 10 steps (3 untimed), 1 round, 2 eval batches (~30 s); "
                        "flags given explicitly still apply")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=None, help="default lr / 10")
    p.add_argument("--warmup-steps", type=int, default=None, help="lr warm-up (default max(1, steps // 20))")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket of both sides (MiB)")
    p.add_argument("--data", default=None, help="corpus (default: the Python standard library's source)")
    p.add_argument("--rows", type=int, default=None, help=argparse.SUPPRESS)  # the sgemm worker's
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)  # a worker's model
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit per job")
    p.add_argument("--json", default=None, help="write every number and the machine facts here")
    p.add_argument("--worker", choices=("torch", "sgemm"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    given = {a.split("=")[0].lstrip("-").replace("-", "_")
             for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
    if args.quick:
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    from rtxmpi.nn import MODEL_SIZES

    if args.worker:
        args.models, args.ranks = [], []
    else:
        args.models = [m for m in str(args.models).split(",") if m]
        unknown = [m for m in args.models if m not in MODEL_SIZES]
        if unknown or not args.models:
            p.error(f"--models {','.join(args.models)}: choose from {', '.join(MODEL_SIZES)}")
        try:
            args.ranks = [int(n) for n in str(args.ranks).split(",") if n]
        except ValueError:
            p.error(f"--ranks {args.ranks!r}: comma-separated positive integers")
        if not args.ranks or min(args.ranks) < 1:
            p.error(f"--ranks {args.ranks}: comma-separated positive integers")
        uneven = [n for n in args.ranks if args.global_batch % n]
        if uneven:
            p.error(f"--global-batch {args.global_batch} does not divide over {uneven} ranks (DDP averages "
                    f"equal local batches)")
        if not 0 <= args.warmup < args.steps:
            p.error(f"--warmup {args.warmup} must be in [0, --steps {args.steps})")
        if args.rounds < 1:
            p.error(f"--rounds {args.rounds} must be >= 1")
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    args.warmup_steps = max(1, args.steps // 20) if args.warmup_steps is None else args.warmup_steps
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker == "torch":
        return torch_worker(args)
    if args.worker == "sgemm":
        return sgemm_worker(args)
    try:
        import torch
    except ImportError as exc:
        print(f"skipped: PyTorch is not installed ({exc}); `pip install 'rtxmpi[peers]'` for the peer",
              flush=True)
        return 0
    from rtxmpi.data import load_corpus

    info = machine_info({"torch": torch.__version__})
    load_corpus(args.data, seq_len=args.seq_len, progress=True)  # the cache, before the jobs map it
    t0 = time.perf_counter()
    rows = measure(args)
    report(rows, args, info, time.perf_counter() - t0)
    if args.json:
        write_json(args.json, {"machine": info, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
