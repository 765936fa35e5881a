"""Training throughput on one GPU: rtxmpi's GPT on cupy against the same model in PyTorch on the
same device, float32.

    python bench/gpu_train.py                               # gpt2-small and base, 1024 tokens
    python bench/gpu_train.py --shapes gpt2-small --batch 8 --seq-len 1024 --json gpu_train.json

Rows per shape (rtxmpi.nn.MODEL_SIZES; byte vocabulary), each in its own process so that its
peak device memory is its own:
- rtxmpi: GPT(xp=cupy) forward, backward, global-norm clip and AdamW (train.py's step without
  the data pipeline);
- train.py: `examples/train.py --device cuda` end to end (sampler, loss agreement, clip, AdamW);
- torch eager: bench/_peer_torch.py's TorchGPT (the same model and arithmetic, SDPA attention),
  torch.optim.AdamW (foreach) and clip_grad_norm_;
- torch.compile: the same with the model under torch.compile (compile time not counted).
Every row: the same batch (--batch x --seq-len tokens of random bytes), --warmup untimed steps,
then the median of --steps timed steps (host clock, the device synchronized after each step).
Peak device memory: CuPy's memory pool (total bytes held) and torch.cuda.max_memory_reserved.
MFU: model FLOPs per token (6 N + 12 L C T: parameters N without the position embeddings, L
layers, width C, sequence T; PaLM appendix B, as nanoGPT's estimate_mfu) x tokens/s over
--peak-tflops (float32 without tensor cores: 67 TFLOP/s on an H100/H200 SXM, NVIDIA's datasheet).
Both frameworks compute float32 matrix products in float32 (cupy and torch leave TF32 off by
default). cupy has no bfloat16 arrays, so there is no bf16 row.

A worker that fails or passes --timeout-s gives a row with its error; the rest still run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

LAUNCH = "self"  # one process per row, no MPI job (rtxmpi.bench_launch)
FRAMEWORKS = ("rtxmpi", "train.py", "torch", "torch.compile")
MIB = 2**20


def flops_per_token(cfg):
    """6 N + 12 L C T (PaLM appendix B): N the parameters without the position embeddings."""
    from rtxmpi.nn.gpt import param_layout

    n = sum(spec.size for spec in param_layout(cfg) if spec.name != "wpe")
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len


def _timed(step, sync, warmup, steps):
    """Median seconds of `steps` calls of step() after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _batch(args, cfg):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


def rtxmpi_training(args, cfg):
    """rtxmpi's GPT on cupy with AdamW. Returns (model, optimizer, hooks, step): step() runs
    forward, backward, the global-norm clip (hooks.clip, rtxmpi.nn.clip_grad_norm), AdamW and
    zero_grad on a fixed batch."""
    import cupy as cp

    from rtxmpi.nn import GPT, AdamW, clip_grad_norm, decay_mask

    model = GPT(cfg, seed=0, xp=cp)
    opt = AdamW(model.flat_data, lr=3e-4, weight_decay=0.1, decay_mask=decay_mask(model.params))
    x, y = _batch(args, cfg)
    hooks = types.SimpleNamespace(clip=clip_grad_norm)

    def step():
        _, cache = model.forward(x, y)
        model.backward(cache)
        hooks.clip(model.flat_grad, 1.0)
        opt.step(model.flat_grad)
        model.zero_grad()

    return model, opt, hooks, step


def worker_rtxmpi(args, cfg):
    import cupy as cp

    step = rtxmpi_training(args, cfg)[3]
    seconds = _timed(step, cp.cuda.Device().synchronize, args.warmup, args.steps)
    return seconds, cp.get_default_memory_pool().total_bytes()


def worker_torch(args, cfg, compile_model):
    import torch

    from _peer_torch import TorchGPT, make_optimizer, optimizer_step

    torch.manual_seed(0)
    model = TorchGPT(cfg).cuda()
    opt = make_optimizer(model, lr=3e-4, weight_decay=0.1)
    run = torch.compile(model) if compile_model else model
    x, y = (torch.from_numpy(a).cuda() for a in _batch(args, cfg))

    def step():
        run(x, y).backward()
        optimizer_step(model, opt, 3e-4, 1.0)
        opt.zero_grad(set_to_none=True)

    seconds = _timed(step, torch.cuda.synchronize, args.warmup, args.steps)
    return seconds, torch.cuda.max_memory_reserved()


def breakdown(args, cfg):
    """Where rtxmpi's step goes on the GPU: every function of rtxmpi.nn.layers and
    rtxmpi.kernels, AdamW.step, clip_grad_norm and zero_grad timed with the device synchronized
    around each call (self time: a function's nested timed calls are subtracted), over --steps
    steps after --warmup; then the matrix products of one block in cupy and torch side by side.
    Prints tables; the synchronizations make the step a little slower than unmeasured."""
    import cupy as cp

    from _common import markdown_table
    from rtxmpi import kernels
    from rtxmpi.nn import layers

    sync = cp.cuda.Device().synchronize
    own, calls, stack, wrapped = {}, {}, [], []

    def wrap(owner, name, label):
        fn = getattr(owner, name)
        wrapped.append((owner, name, fn))

        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                sync()
                dt = time.perf_counter() - t0
                own[label] = own.get(label, 0.0) + dt - stack.pop()
                calls[label] = calls.get(label, 0) + 1
                if stack:
                    stack[-1] += dt
        setattr(owner, name, timed)

    model, opt, hooks, step = rtxmpi_training(args, cfg)
    plain = _timed(step, sync, args.warmup, args.steps)
    for module in (layers, kernels):
        for name, fn in list(vars(module).items()):
            if callable(fn) and getattr(fn, "__module__", None) == module.__name__ \
                    and not isinstance(fn, type) and name != "_kernel":
                wrap(module, name, f"{module.__name__.rsplit('.', 1)[-1]}.{name}")
    wrap(opt, "step", "AdamW.step")
    wrap(model, "zero_grad", "zero_grad")
    wrap(hooks, "clip", "clip_grad_norm")
    try:
        measured = _timed(step, sync, 1, args.steps)
    finally:
        for owner, name, fn in wrapped:
            setattr(owner, name, fn)
    n = args.steps + 1
    rows = sorted(own.items(), key=lambda kv: -kv[1])
    total = sum(own.values()) / n
    table = [[label, calls[label] // n, f"{t / n * 1e3:.2f}", f"{100 * t / n / measured:.1f}%"]
             for label, t in rows if t / n >= 1e-4]
    table.append(["(outside the timed functions)", "", f"{(measured - total) * 1e3:.2f}",
                  f"{100 * (measured - total) / measured:.1f}%"])
    print(f"Step {plain * 1e3:.1f} ms unmeasured, {measured * 1e3:.1f} ms with every timed "
          f"function synchronized; self time per step:")
    print(markdown_table(["function", "calls/step", "ms", "of step"], table))
    gemm_table(args, cfg)


def gemm_table(args, cfg):
    """One block's matrix products (forward and both backward products), cupy against torch."""
    import cupy as cp
    import torch

    from _common import markdown_table

    N, C = args.batch * cfg.seq_len, cfg.n_embd
    rows = []
    for name, (m, k, n) in (("qkv", (N, C, 3 * C)), ("attn proj", (N, C, C)),
                            ("fc", (N, C, 4 * C)), ("mlp proj", (N, 4 * C, C))):
        a, w, dy = (cp.random.standard_normal(s, dtype=cp.float32) for s in ((m, k), (k, n), (m, n)))
        ta, tw, tdy = (torch.as_tensor(v, device="cuda") for v in (a, w, dy))
        cases = {"x @ w": (lambda: a @ w, lambda: ta @ tw),
                 "dy @ w.T": (lambda: dy @ w.T, lambda: tdy @ tw.T),
                 "x.T @ dy": (lambda: a.T @ dy, lambda: ta.T @ tdy)}
        for what, (c_fn, t_fn) in cases.items():
            c_s = _timed(c_fn, cp.cuda.Device().synchronize, 3, 20)
            t_s = _timed(t_fn, torch.cuda.synchronize, 3, 20)
            flops = 2.0 * m * k * n
            rows.append([name, what, f"{flops / c_s / 1e12:.1f}", f"{flops / t_s / 1e12:.1f}",
                         f"{t_s / c_s:.2f}"])
    print(f"\nMatrix products of one block, float32, N = {N} rows (TFLOP/s):")
    print(markdown_table(["layer", "product", "cupy", "torch", "cupy / torch speed"], rows))


def worker(args):
    from rtxmpi.nn import GPTConfig

    cfg = GPTConfig.named(args.shapes, seq_len=args.seq_len)
    if args.breakdown:
        return breakdown(args, cfg)
    if args.worker == "rtxmpi":
        seconds, peak = worker_rtxmpi(args, cfg)
    else:
        seconds, peak = worker_torch(args, cfg, compile_model=args.worker == "torch.compile")
    print("RESULT " + json.dumps({"step_s": seconds, "peak_bytes": peak}), flush=True)


def gpu_line():
    """The device, driver, CUDA and library versions, one line (nvidia-smi, cupy, torch)."""
    parts = []
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        parts.append(smi.stdout.strip().splitlines()[0])
    except (OSError, IndexError, subprocess.SubprocessError):
        parts.append("nvidia-smi: not available")
    try:
        import cupy as cp

        rt = cp.cuda.runtime.runtimeGetVersion()
        parts.append(f"CUDA runtime {rt // 1000}.{rt % 1000 // 10}; cupy {cp.__version__}")
        from cupy.cuda import nccl

        v = nccl.get_version()  # major * 10000 + minor * 100 + patch
        parts.append(f"NCCL {v // 10000}.{v % 10000 // 100}.{v % 100}")
    except Exception as exc:  # the line says what could not be read
        parts.append(f"cupy/NCCL: {type(exc).__name__}")
    try:
        import torch

        parts.append(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    except ImportError:
        parts.append("torch: not installed")
    return "GPU: " + "; ".join(parts)


def _run(cmd, timeout_s):
    """The finished subprocess `cmd` (output captured); RuntimeError past `timeout_s` seconds."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no result within --timeout-s {timeout_s:g} s") from None


def run_worker(args, shape, framework):
    """(step seconds, peak bytes or None) of one row, or raises RuntimeError with the cause."""
    if framework == "train.py":
        return run_train_py(args, shape)
    cmd = [sys.executable, __file__, "--worker", framework, "--shapes", shape, "--batch",
           str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    out = _run(cmd, args.timeout_s)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"exit {out.returncode}: {(out.stdout + out.stderr).strip()[-600:]}")
    result = json.loads(line[len("RESULT "):])
    return result["step_s"], result["peak_bytes"]


def run_train_py(args, shape):
    """Median step time of examples/train.py --device cuda over its steps after --warmup."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [sys.executable, os.path.join(ROOT, "examples", "train.py"), "--device", "cuda",
               "--model", shape, "--seq-len", str(args.seq_len), "--global-batch", str(args.batch),
               "--steps", str(args.warmup + args.steps), "--eval-every", "0", "--eval-batches", "1",
               "--sample-tokens", "0", "--no-progress", "--metrics-jsonl", metrics]
        out = _run(cmd, args.timeout_s)
        rows = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                rows = [json.loads(line) for line in f if line.strip()]
    times = [r["step_time_ms"] / 1e3 for r in rows
             if r.get("step", 0) > args.warmup and "step_time_ms" in r]
    if out.returncode != 0 or not times:
        raise RuntimeError(f"exit {out.returncode}, {len(rows)} metric rows: "
                           f"{(out.stdout + out.stderr).strip()[-600:]}")
    return statistics.median(times), None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="gpt2-small,base", help="comma-separated MODEL_SIZES names")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated rows of "
                   + ", ".join(FRAMEWORKS))
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--peak-tflops", type=float, default=67.0,
                   help="the device's dense float32 peak, for MFU (H100/H200 SXM: 67)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="per row")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--breakdown", action="store_true",
                   help="instead: where rtxmpi's step goes on the GPU, for the first of --shapes")
    p.add_argument("--worker", default=None, choices=FRAMEWORKS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.breakdown:
        args.shapes = args.shapes.split(",")[0]
    if args.worker or args.breakdown:
        return worker(args)
    from _common import machine_info, machine_line, markdown_table
    from rtxmpi.backend import gpu_count
    from rtxmpi.nn import GPTConfig

    if gpu_count() == 0:
        print("skipped: no CUDA device visible through cupy (gpu_train measures on a GPU)")
        return 0

    frameworks = args.frameworks.split(",")
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        p.error(f"--frameworks: unknown {unknown}; choose from {', '.join(FRAMEWORKS)}")
    results, table = [], []
    for shape in args.shapes.split(","):
        cfg = GPTConfig.named(shape, seq_len=args.seq_len)
        tokens = args.batch * args.seq_len
        rows = {}
        for framework in frameworks:
            print(f"[gpu_train] {shape} {framework} ...", file=sys.stderr, flush=True)
            try:
                seconds, peak = run_worker(args, shape, framework)
                rows[framework] = {"step_s": seconds, "peak_bytes": peak,
                                   "tokens_per_s": tokens / seconds,
                                   "mfu": flops_per_token(cfg) * tokens / seconds / (args.peak_tflops * 1e12)}
                print(f"[gpu_train] {shape} {framework}: {tokens / seconds:.0f} tokens/s, "
                      f"{seconds * 1e3:.1f} ms/step" + (f", peak {peak / MIB:.0f} MiB" if peak else ""),
                      file=sys.stderr, flush=True)
            except RuntimeError as exc:
                rows[framework] = {"error": str(exc)}
                print(f"[gpu_train] {shape} {framework}: {exc}", file=sys.stderr, flush=True)
            if args.json:  # after every row: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"rows": results + [{"shape": shape, "framework": k, **v}
                                                  for k, v in rows.items()],
                               "batch": args.batch, "seq_len": args.seq_len}, f, indent=2)
        eager = rows.get("torch", {}).get("tokens_per_s")
        for framework, r in rows.items():
            results.append({"shape": shape, "framework": framework, **r})
            if "error" in r:
                table.append([shape, framework, "failed", "-", "-", "-", "-"])
                continue
            table.append([shape, framework, f"{r['tokens_per_s']:.0f}", f"{r['step_s'] * 1e3:.1f}",
                          "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / MIB:.0f}",
                          f"{100 * r['mfu']:.1f}%",
                          f"{r['tokens_per_s'] / eager:.2f}" if eager else "-"])
    print(f"Training throughput on one GPU, float32, batch {args.batch} x {args.seq_len} tokens; "
          f"median of {args.steps} steps after {args.warmup}; MFU over {args.peak_tflops:g} TFLOP/s\n")
    print(markdown_table(["shape", "framework", "tokens/s", "step ms", "peak device MiB", "MFU",
                          "vs torch eager"], table))
    chosen = "" if args.frameworks == ",".join(FRAMEWORKS) else f" --frameworks {args.frameworks}"
    print(f"\n{gpu_line()}\n\nmachine: {machine_line(machine_info())}\n\ncommand: `python "
          f"bench/gpu_train.py --shapes {args.shapes}{chosen} --batch {args.batch} --seq-len "
          f"{args.seq_len} --steps {args.steps} --warmup {args.warmup}`")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "batch": args.batch, "seq_len": args.seq_len}, f, indent=2)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
