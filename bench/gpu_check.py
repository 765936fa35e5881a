"""The device check: everything rtxmpi does on a GPU, in one call of at most 5 minutes on a one-GPU
machine.

    python bench/gpu_check.py                   # all checks; exit 0 when all pass
    python bench/gpu_check.py --json out.json   # also the numbers as JSON
    python bench/gpu_check.py --require-gpu     # exit 2 (instead of 0) when there is no GPU

Steps, each reported PASS/FAIL with its numbers:
1. kernels: every kernel of rtxmpi.kernels on fresh random data against its numpy reference, with
   the outputs poisoned (NaN) before the call: bit for bit where the reference promises it
   (epilogue, AdamW), within float32 rounding elsewhere; aligned (vectorized) and misaligned /
   odd-length (scalar) launches; the non-finite flag.
2. bandwidth: device-to-device copy bandwidth measured first (read + write bytes / time), then
   each kernel's achieved bandwidth and its ratio to the copy (target >= 0.80 for the
   memory-bound kernels on an H200).
3. nccl: single-rank NCCL collectives through rtxmpi.init(backend="nccl") (all_reduce sum/avg,
   float16, reduce_scatter, all_gather, broadcast, grouped send/recv to self, async Work).
   Without cupy's NCCL binding: a SKIP line (not a failure).
4. model: the GPT on cupy (fused bias+GELU and residual+LayerNorm, one launch per block and
   pass) against the numpy model: loss and gradients within float32 rounding.
5. pytest: the GPU-marked tests (`pytest -m gpu`).
6. train: examples/train.py for a few steps on cupy (--device cuda) and on the CPU, tokens/s
   table and ratio (target >= 20x for --model small on an H200).
7. train_zero: examples/train.py --device cuda with --zero-stage 2 (checkpoint, then --resume),
   --zero-stage 3, and --offload cpu / nvme, each against the same run on the CPU: final loss
   within 1e-3 relative.
8. layouts: `mpiexec -n 2 examples/train.py --device cuda` with both ranks on the one GPU (cupy
   arrays then travel host-staged or over CUDA-aware MPI: NCCL takes one GPU per rank) for data
   parallelism, ZeRO-1/3, --tp 2 (--sequence-parallel), --pp 2 and --sp 2, each against the same
   2-rank run on the CPU: final loss within 1e-3 relative. Skipped without mpiexec.

Never hangs: every subprocess has a timeout, and each in-process step a watchdog
(faulthandler) that ends the process with its stack after --step-timeout-s; all of them are cut
to what is left of --budget-s (290 s), and a step not started in time FAILs. The JSON (--json) is
rewritten after every step, so a check cut short still leaves what it measured. Exit status: 0
when every step passed (or was skipped), 1 on any failure, 2 without a GPU under --require-gpu
(0 otherwise, after a SKIP line).
"""
import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from _common import mpi_job  # noqa: E402
from rtxmpi import kernels  # noqa: E402
from rtxmpi.backend import cupy_module  # noqa: E402
from rtxmpi.comm.nccl import nccl_module  # noqa: E402

MEMORY_BOUND = ("grad_epilogue", "adamw", "residual_layernorm", "bias_gelu_forward",
                "bias_gelu_backward", "layernorm_backward", "softmax_forward", "softmax_backward")
TARGET_COPY_FRACTION = 0.80


# ---------------------------------------------------------------------------- correctness
def _poison_pool(cp, nbytes):
    """Fill the memory pool's next blocks of about `nbytes` with NaN, so arrays the kernels'
    wrappers allocate next start as NaN (an output the kernel fails to write stays NaN)."""
    blocks = [cp.full(max(1, nbytes // 4), np.nan, cp.float32) for _ in range(4)]
    del blocks  # back to the pool, NaN-filled, for the next allocations of that size


def _same_bits(got, want):
    return np.asarray(got).tobytes() == np.asarray(want).tobytes()


def _close(got, want, rtol, atol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return bool(np.isfinite(got).all()) and bool(np.allclose(got, want, rtol=rtol, atol=atol))


# array sizes of the correctness checks: "full" on a GPU; "small" (--small) for a smoke run
SIZES = {
    "full": {"epilogue": ((1 << 20, 0, None), (1000003, 0, "float16"), (4099, 1, "bfloat16"),
                          (0, 0, None)),
             "adamw": ((1 << 20, False), (1000003, True)),
             "bias_gelu": ((4096, 3072), (37, 129)),
             "layernorm": ((8192, 768), (33, 4099), (5, 7)),
             "softmax": ((2, 3, 1024), (1, 2, 129), (3, 1, 1))},
    "small": {"epilogue": ((1 << 12, 0, None), (4003, 0, "float16"), (4099, 1, "bfloat16"),
                           (0, 0, None)),
              "adamw": ((1 << 12, False), (4003, True)),
              "bias_gelu": ((64, 256), (37, 129)),
              "layernorm": ((64, 768), (33, 4099), (5, 7)),
              "softmax": ((1, 2, 256), (1, 2, 129), (3, 1, 1))},
}


def check_all_kernels(cp, seed=0, sizes="full"):
    """Run every kernel against its reference; returns a list of failure messages (empty: pass).
    sizes: a key of SIZES."""
    rng = np.random.default_rng(seed)
    failures = []
    size = SIZES[sizes]

    def fail(name, what):
        failures.append(f"{name}: {what}")

    # (a) epilogue: sizes hitting the vector body + tail, a misaligned view (scalar kernel)
    for n, offset, cast in size["epilogue"]:
        host = rng.standard_normal(n + offset).astype(np.float32)
        dev = cp.asarray(host)[offset:]
        _poison_pool(cp, 2 * n + 64)
        out, flag = kernels.grad_epilogue(dev, 1 / 3, cast=cast)
        ref, ref_flag = kernels.grad_epilogue(host[offset:].copy(), 1 / 3, cast=cast)
        got = cp.asnumpy(out)
        if cast == "bfloat16":
            got = got.view(ref.dtype)
        if not _same_bits(cp.asnumpy(dev), host[offset:] * np.float32(1 / 3)) or not _same_bits(got, ref):
            fail("grad_epilogue", f"n={n} offset={offset} cast={cast}: differs from the reference")
        if bool(flag) != bool(ref_flag) or bool(flag):
            fail("grad_epilogue", f"n={n}: non-finite flag {bool(flag)} on finite data")
    for bad in (np.inf, np.nan):
        dev = cp.asarray(rng.standard_normal(1 << 16).astype(np.float32))
        dev[12345] = bad
        if not bool(kernels.grad_epilogue(dev, 0.5)[1]):
            fail("grad_epilogue", f"a single {bad} was not flagged")
    big = cp.asarray(np.array([1.0, 7e4, 2.0, 3.0], np.float32))
    if not bool(kernels.grad_epilogue(big, 1.0, cast="float16")[1]):
        fail("grad_epilogue", "float16 overflow was not flagged")

    # (b) AdamW: bit for bit over three steps, with and without the decay mask, odd length
    for n, masked in size["adamw"]:
        p = rng.standard_normal(n).astype(np.float32)
        mask = (rng.random(n) > 0.5).astype(np.float32) if masked else None
        state = [p.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
        dstate = [cp.asarray(a) for a in state]
        dmask = None if mask is None else cp.asarray(mask)
        for t in range(1, 4):
            g = rng.standard_normal(n).astype(np.float32)
            hyper = dict(lr=3e-3 * t, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=t)
            kernels.adamw_step(*dstate[:1], cp.asarray(g), *dstate[1:], decay_mask=dmask, **hyper)
            kernels.adamw_step(*state[:1], g, *state[1:], decay_mask=mask, **hyper)
        for name, d, h in zip(("p", "m", "v"), dstate, state):
            if not _same_bits(cp.asnumpy(d), h):
                worst = float(np.max(np.abs(cp.asnumpy(d) - h)))
                fail("adamw", f"n={n} masked={masked}: {name} not bit-identical (max |diff| {worst:g})")

    # (c) bias + GELU forward and backward
    for rows, C in size["bias_gelu"]:
        h = rng.standard_normal((rows, C)).astype(np.float32)
        b = rng.standard_normal(C).astype(np.float32)
        dy = rng.standard_normal((rows, C)).astype(np.float32)
        _poison_pool(cp, h.nbytes)
        u, y = kernels.bias_gelu_forward(cp.asarray(h), cp.asarray(b))
        ru, ry = kernels.bias_gelu_forward(h, b)
        # tolerances: CUDA's tanhf (2 ulp) against libm's tanh, amplified where 1 + tanh cancels
        # (a ~ 1e-5 at u ~ -4): about 1e-6 * |u| in y and 1e-6 * |dy| in du
        if not _same_bits(cp.asnumpy(u), ru) or not _close(cp.asnumpy(y), ry, 1e-5, 1e-5):
            fail("bias_gelu_forward", f"{rows}x{C}: differs from the reference")
        _poison_pool(cp, h.nbytes)
        du, db = kernels.bias_gelu_backward(cp.asarray(dy), u)
        rdu, rdb = kernels.bias_gelu_backward(dy, ru)
        if not _close(cp.asnumpy(du), rdu, 1e-5, 1e-5) or not _close(cp.asnumpy(db), rdb, 1e-4, 1e-3):
            fail("bias_gelu_backward", f"{rows}x{C}: differs from the reference")

    # (d) residual + LayerNorm forward
    for rows, C in size["layernorm"]:
        x, r = (rng.standard_normal((rows, C)).astype(np.float32) for _ in range(2))
        g, b = (rng.standard_normal(C).astype(np.float32) for _ in range(2))
        _poison_pool(cp, x.nbytes)
        got = kernels.residual_layernorm_forward(*(cp.asarray(a) for a in (x, r, g, b)))
        want = kernels.residual_layernorm_forward(x, r, g, b)
        for name, d, w, tol in zip(("s", "y", "mean", "rstd"), got, want,
                                   ((0, 0), (1e-4, 5e-5), (1e-5, 1e-6), (1e-4, 0))):
            ok = _same_bits(cp.asnumpy(d), w) if name == "s" else _close(cp.asnumpy(d), w, *tol)
            if not ok:
                fail("residual_layernorm", f"{rows}x{C}: {name} differs from the reference")

    # (e) LayerNorm backward and the column sums behind it
    for rows, C in size["layernorm"]:
        dy, xhat = (rng.standard_normal((rows, C)).astype(np.float32) for _ in range(2))
        rstd = rng.random((rows, 1)).astype(np.float32) + 0.5
        g = rng.standard_normal(C).astype(np.float32)
        _poison_pool(cp, dy.nbytes)
        got = kernels.layernorm_backward(*(cp.asarray(a) for a in (dy, xhat, rstd, g)))
        want = kernels.layernorm_backward(dy, xhat, rstd, g)
        for name, d, w, tol in zip(("dx", "dg", "db"), got, want,
                                   ((1e-4, 1e-5), (1e-4, 1e-3), (1e-4, 1e-3))):
            if not _close(cp.asnumpy(d), w, *tol):
                fail("layernorm_backward", f"{rows}x{C}: {name} differs from the reference")

    # (f) attention softmax, causal and not, forward (in place) and backward
    for batch, heads, T in size["softmax"]:
        scores = rng.standard_normal((batch, heads, T, T)).astype(np.float32) * 4
        datt = rng.standard_normal(scores.shape).astype(np.float32)
        for causal in (True, False):
            want = kernels.softmax_forward(scores.copy(), causal)
            got = kernels.softmax_forward(cp.asarray(scores), causal)
            if not _close(cp.asnumpy(got), want, 1e-5, 1e-7):
                fail("softmax_forward", f"{scores.shape} causal={causal}: differs from the reference")
            if causal and bool((cp.asnumpy(got)[..., np.triu(np.ones((T, T), bool), 1)] != 0).any()):
                fail("softmax_forward", f"{scores.shape}: a masked (future) key is not 0")
            dwant = kernels.softmax_backward(datt.copy(), want)
            dgot = kernels.softmax_backward(cp.asarray(datt), got)
            if not _close(cp.asnumpy(dgot), dwant, 1e-4, 1e-6):
                fail("softmax_backward", f"{scores.shape} causal={causal}: differs from the reference")
    return failures


# ------------------------------------------------------------------------------ bandwidth
def _time_gpu(cp, fn, repeats=20):
    """Median seconds of fn() measured with CUDA events (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def copy_bandwidth(cp, nbytes=1 << 30):
    """Device-to-device copy bandwidth in GB/s, counting read + write bytes."""
    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    seconds = _time_gpu(cp, lambda: cp.cuda.runtime.memcpyAsync(
        dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
        cp.cuda.get_current_stream().ptr))
    return 2 * nbytes / seconds / 1e9


def kernel_bandwidths(cp, n=1 << 26):
    """{kernel: (seconds, GB/s)} for each kernel on n float32 elements; bytes are what each must
    read and write at least once."""
    rng = cp.random.default_rng(0)
    a = [rng.standard_normal(n, dtype=cp.float32) for _ in range(4)]
    p, g, m, v = a
    C = 1024
    h2, x2, r2 = (t.reshape(-1, C) for t in (p, g, m))
    b = rng.standard_normal(C, dtype=cp.float32)
    u, _ = kernels.bias_gelu_forward(h2, b)
    results = {}

    def record(name, fn, nbytes):
        seconds = _time_gpu(cp, fn)
        results[name] = (seconds, nbytes / seconds / 1e9)

    record("grad_epilogue", lambda: kernels.grad_epilogue(g, 1.0), 8 * n)
    record("adamw", lambda: kernels.adamw_step(p, g, m, v, lr=1e-9, beta1=0.9, beta2=0.95,
                                               eps=1e-8, weight_decay=0.0, step=1), 28 * n)
    record("bias_gelu_forward", lambda: kernels.bias_gelu_forward(h2, b), 12 * n)
    # backward: dy, u read and du written by the kernel, du read again by the bias-gradient sum
    record("bias_gelu_backward", lambda: kernels.bias_gelu_backward(x2, u), 16 * n)
    record("residual_layernorm", lambda: kernels.residual_layernorm_forward(x2, r2, b, b), 16 * n)
    rstd = cp.ones((x2.shape[0], 1), cp.float32)
    # dy, xhat read by the row kernel and again by the column sums, dx written
    record("layernorm_backward", lambda: kernels.layernorm_backward(x2, r2, rstd, b), 20 * n)
    att = g.reshape(-1, 1024)  # rows of 1024 keys, not causal: every element read and written
    record("softmax_forward", lambda: kernels.softmax_forward(att), 8 * n)
    record("softmax_backward", lambda: kernels.softmax_backward(m.reshape(-1, 1024), att), 12 * n)
    return results


# ------------------------------------------------------------------------------------- nccl
def check_nccl(cp):
    """Single-rank NCCL collectives through the public API; returns failure messages."""
    import rtxmpi

    failures = []
    world = rtxmpi.init(backend="nccl", timeout_s=60)
    if world.backend.name != "nccl":
        return [f"init(backend='nccl') gave backend {world.backend.name!r}"]
    x = cp.arange(1000, dtype=cp.float32)
    if not bool((world.all_reduce(x.copy()) == x).all()):
        failures.append("all_reduce sum")
    if not bool((world.all_reduce(x.copy(), op="avg") == x).all()):
        failures.append("all_reduce avg")
    half = x.astype(cp.float16)
    if not bool((world.all_reduce(half.copy()) == half).all()):
        failures.append("all_reduce float16")
    if not bool((world.reduce_scatter(x.reshape(10, 100)) == x.reshape(10, 100)).all()):
        failures.append("reduce_scatter")
    if not bool((world.all_gather(x) == x).all()):
        failures.append("all_gather")
    y = x.copy()
    if not bool((world.broadcast(y, src=0) == x).all()):
        failures.append("broadcast")
    work = world.all_reduce(x.copy(), async_op=True)
    if not bool((work.wait() == x).all()):
        failures.append("async all_reduce")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        z = x * 2
    if not bool((world.all_reduce(z, stream=stream) == x * 2).all()):
        failures.append("all_reduce on a user stream")
    recv = cp.zeros_like(x)
    world.send_recv(sends=[(x, 0)], recvs=[(recv, 0)])
    if not bool((recv == x).all()):
        failures.append("grouped send/recv to self")
    sub = world.split(color=0)
    if not bool((sub.all_reduce(x.copy()) == x).all()):
        failures.append("all_reduce on a split group")
    return failures


# ------------------------------------------------------------------------------------ model
def check_model(cp, seed=0):
    """GPT "tiny" forward + backward on cupy and on numpy from the same weights and batch.
    Returns (failures, launches): the fused kernels must run once per block and pass (counted
    by wrapping rtxmpi.kernels._kernel), loss and gradients agree within float32 rounding."""
    from rtxmpi.nn import GPT, GPTConfig

    cfg = GPTConfig.named("tiny", seq_len=64)
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, 256, (4, 64)), rng.integers(0, 256, (4, 64))
    host, device = GPT(cfg, seed=seed), GPT(cfg, seed=seed, xp=cp)
    launches, original = {}, kernels._kernel

    def counting(name, function):
        launches[function] = launches.get(function, 0) + 1
        return original(name, function)

    kernels._kernel = counting
    try:
        loss_d, cache = device.forward(x, y)
        device.backward(cache)
    finally:
        kernels._kernel = original
    loss_h, cache = host.forward(x, y)
    host.backward(cache)
    failures = []
    for function in ("bias_gelu_forward_f32", "bias_gelu_backward_f32",
                     "residual_layernorm_forward_f32"):
        if launches.get(function) != cfg.n_layer:
            failures.append(f"{function} launched {launches.get(function, 0)} times, expected "
                            f"{cfg.n_layer} (one per block)")
    if not abs(loss_d - loss_h) <= 1e-5 * abs(loss_h):
        failures.append(f"loss {loss_d!r} on cupy vs {loss_h!r} on numpy")
    grad = cp.asnumpy(device.flat_grad)
    rel = float(np.max(np.abs(grad - host.flat_grad)) / np.max(np.abs(host.flat_grad)))
    if not np.isfinite(grad).all() or rel > 1e-4:
        failures.append(f"gradients differ from numpy's: max |diff| / max |grad| = {rel:.2e}")
    return failures, {"launches": launches, "grad_rel_diff": rel}


# ------------------------------------------------------------------------------- the rest
def run_gpu_pytests(timeout_s):
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/unit"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    tail = (result.stdout + result.stderr).strip().splitlines()[-1:]
    return result.returncode == 0, " ".join(tail)


def train_rows(device, flags, timeout_s, ranks=1):
    """Run `examples/train.py --device DEVICE FLAGS` (one process, or an mpiexec job of `ranks`);
    returns its --metrics-jsonl rows. Raises RuntimeError (exit status, output tail) on failure,
    TimeoutExpired past timeout_s (the process is killed)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        argv = ["examples/train.py", "--device", device, "--eval-every", "0",
                "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
                "--metrics-jsonl", metrics] + [f.replace("{tmp}", tmp) for f in flags]
        cmd, env = ([sys.executable] + argv, None) if ranks == 1 else mpi_job(ranks, argv)
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=timeout_s)
        rows = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                rows = [json.loads(line) for line in f if line.strip()]
    if result.returncode != 0 or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {result.returncode}, {len(rows)} metric "
                           f"rows): {(result.stdout + result.stderr)[-2000:]}")
    return rows


def train_tokens_per_s(device, model, steps, timeout_s):
    """Median tokens/s of `examples/train.py --device DEVICE` over its steps after the first
    (which pays cupy's kernel compilation and the corpus cache), from --metrics-jsonl."""
    rows = train_rows(device, ["--model", model, "--steps", str(steps), "--global-batch", "32",
                               "--seq-len", "128"], timeout_s)
    steady = [r["tokens_per_s"] for r in rows if r.get("step", 0) > 1 and "tokens_per_s" in r]
    if not steady:
        raise RuntimeError(f"train.py --device {device}: no step after the first in {len(rows)} rows")
    return float(np.median(steady))


# --zero-stage / --offload runs on cupy against the CPU: (name, flags); "{tmp}" is a fresh
# directory per run, "{ckpt}" one checkpoint directory shared by the zero2 run and its resume
ZERO_RUNS = (
    ("zero2+checkpoint", ["--zero-stage", "2", "--steps", "3", "--ckpt-dir", "{ckpt}",
                          "--ckpt-every", "2"]),
    ("zero2 --resume", ["--zero-stage", "2", "--steps", "5", "--ckpt-dir", "{ckpt}", "--resume"]),
    ("zero3", ["--zero-stage", "3", "--steps", "4", "--micro-batches", "2"]),
    ("zero2 offload cpu", ["--zero-stage", "2", "--steps", "4", "--offload", "cpu"]),
    ("zero3 offload nvme", ["--zero-stage", "3", "--steps", "4", "--offload", "nvme",
                            "--offload-dir", "{tmp}/nvme"]),
)
ZERO_BASE = ["--model", "tiny", "--seq-len", "64", "--global-batch", "8"]


# two ranks on one GPU: (name, flags) run on cupy and on the CPU by check_against_cpu(ranks=2)
LAYOUT_RUNS = (
    ("dp", ["--steps", "4"]),
    ("zero1", ["--zero-stage", "1", "--steps", "4"]),
    ("zero3", ["--zero-stage", "3", "--steps", "4"]),
    ("tp2 + sequence parallel", ["--tp", "2", "--sequence-parallel", "--steps", "4"]),
    ("pp2 1f1b", ["--pp", "2", "--micro-batches", "4", "--steps", "4"]),
    ("sp2", ["--sp", "2", "--steps", "4"]),
)


def check_against_cpu(timeout_s, runs=ZERO_RUNS, ranks=1):
    """Each run of `runs` on cupy and on the CPU (`ranks` processes); returns (failures,
    {name: losses}). timeout_s() -> seconds allowed for the next run."""
    failures, table = [], {}
    with tempfile.TemporaryDirectory() as ckpt_root:
        for name, flags in runs:
            losses = {}
            for device in ("cuda", "cpu"):
                ckpt = os.path.join(ckpt_root, device)
                try:
                    rows = train_rows(device, ZERO_BASE + [f.replace("{ckpt}", ckpt) for f in flags],
                                      timeout_s(), ranks=ranks)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the next run still runs
                    failures.append(f"{name} on {device}: {str(exc)[-1500:]}")
                    break
                losses[device] = rows[-1]["loss"]
            if len(losses) < 2:
                continue
            table[name] = losses
            gpu, cpu = losses["cuda"], losses["cpu"]
            if not (np.isfinite(gpu) and abs(gpu - cpu) <= 1e-3 * abs(cpu)):
                failures.append(f"{name}: final loss {gpu!r} on cupy vs {cpu!r} on the CPU")
    return failures, table


STEPS = ("kernels", "bandwidth", "nccl", "model", "pytest", "train", "train_zero", "layouts")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--require-gpu", action="store_true", help="exit 2 when no GPU is found")
    parser.add_argument("--train-model", default="small")
    parser.add_argument("--train-steps", type=int, default=8)
    parser.add_argument("--bandwidth-mb", type=int, default=1024,
                        help="bytes of the copy measured (MiB); kernels run on a quarter each")
    parser.add_argument("--small", action="store_true",
                        help="small arrays in the kernel checks (a smoke run, not the device check)")
    parser.add_argument("--step-timeout-s", type=float, default=150,
                        help="in-process steps: the watchdog ends the process past this")
    parser.add_argument("--budget-s", type=float, default=290,
                        help="the whole check: steps not started in time FAIL as not run, and "
                             "every timeout is cut to what is left")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: "
                        + ",".join(STEPS))
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - set(STEPS)
    if unknown:
        parser.error(f"--skip: unknown step(s) {sorted(unknown)}; steps: {','.join(STEPS)}")
    report = {"device": None, "steps": {}}

    def write_json():
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(report, f, indent=2)
            os.replace(args.json + ".tmp", args.json)

    cp = cupy_module()
    if cp is None or not kernels.gpu_available():
        why = "cupy is not installed" if cp is None else "cupy sees no CUDA device"
        print(f"gpu_check: SKIP: {why}; nothing to check on this machine "
              "(install with pip install -e '.[cuda12]' on a GPU host)")
        report["skipped"] = why
        write_json()
        return 2 if args.require_gpu else 0
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    report["device"] = props["name"].decode()
    print(f"gpu_check on {report['device']} (cupy {cp.__version__})", flush=True)
    ok = True
    started = time.monotonic()
    deadline = started + args.budget_s

    def left(limit_s):
        """`limit_s`, cut to the time left in --budget-s (at least 1 s)."""
        return max(1.0, min(limit_s, deadline - time.monotonic()))

    def step(name, fn, in_process=True):
        nonlocal ok
        if name in skip:
            print(f"[SKIP] {name}: --skip", flush=True)
            report["steps"][name] = {"pass": None, "detail": "--skip"}
            return
        if time.monotonic() >= deadline:
            ok = False
            detail = f"not run: the --budget-s {args.budget_s:g} s budget was spent"
            report["steps"][name] = {"pass": False, "detail": detail}
            print(f"[FAIL] {name}: {detail}", flush=True)
            write_json()
            return
        t0 = time.monotonic()
        if in_process:  # a hung CUDA/NCCL call ends the process with its stack, never a hang
            faulthandler.dump_traceback_later(left(args.step_timeout_s) + 5, exit=True)
        try:
            passed, detail = fn()
        except Exception as exc:  # a check that crashes is a failed check, reported with its cause
            passed, detail = False, f"{type(exc).__name__}: {exc}"
        finally:
            faulthandler.cancel_dump_traceback_later()
        if passed is not None:
            ok = ok and passed
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[passed]
        report["steps"][name] = {"pass": passed, "detail": detail, "s": time.monotonic() - t0}
        print(f"[{verdict}] {name} ({time.monotonic() - t0:.1f} s): {detail}", flush=True)
        write_json()

    def do_kernels():
        failures = check_all_kernels(cp, seed=int(time.time()),
                                     sizes="small" if args.small else "full")
        return not failures, "all match their references" if not failures else "; ".join(failures)

    def do_bandwidth():
        nbytes = args.bandwidth_mb * 2**20
        copy = copy_bandwidth(cp, nbytes)
        rows = kernel_bandwidths(cp, n=max(1024, nbytes // 16))
        report["copy_gbps"] = copy
        report["kernels"] = {k: {"ms": s * 1e3, "gbps": bw, "of_copy": bw / copy}
                             for k, (s, bw) in rows.items()}
        print(f"  copy d2d: {copy:.0f} GB/s (read + write)")
        print("  | kernel | ms | GB/s | of copy |\n  |---|---|---|---|")
        for k, (s, bw) in rows.items():
            print(f"  | {k} | {s * 1e3:.3f} | {bw:.0f} | {bw / copy:.2f} |")
        slow = [k for k, (_, bw) in rows.items() if k in MEMORY_BOUND
                and bw / copy < TARGET_COPY_FRACTION]
        return not slow, ("every memory-bound kernel >= 0.80 of copy" if not slow else
                          f"below {TARGET_COPY_FRACTION:.2f} of copy: {', '.join(slow)}")

    def do_nccl():
        if nccl_module() is None:
            return None, ("cupy's NCCL binding is missing (pip install nvidia-nccl-cu12); "
                          "NCCL collectives not checked")
        failures = check_nccl(cp)
        return not failures, "single-rank collectives correct" if not failures else "; ".join(failures)

    def do_model():
        failures, detail = check_model(cp)
        report["model"] = detail
        return not failures, ("fused kernels once per block; loss and gradients match numpy "
                              f"(grad rel diff {detail['grad_rel_diff']:.1e})"
                              if not failures else "; ".join(failures))

    def do_pytest():
        return run_gpu_pytests(timeout_s=left(120))

    def do_train():
        gpu = train_tokens_per_s("cuda", args.train_model, args.train_steps, left(150))
        cpu = train_tokens_per_s("cpu", args.train_model, 3, left(120))
        report["train"] = {"model": args.train_model, "gpu_tokens_per_s": gpu,
                           "cpu_tokens_per_s": cpu, "ratio": gpu / cpu}
        print(f"  | train.py --model {args.train_model} | tokens/s |\n  |---|---|\n"
              f"  | --device cuda | {gpu:.0f} |\n  | --device cpu (this host) | {cpu:.0f} |\n"
              f"  | ratio | {gpu / cpu:.1f}x (target 20x) |")
        return gpu / cpu >= 20, f"{gpu:.0f} vs {cpu:.0f} tokens/s on the CPU: {gpu / cpu:.1f}x (target 20x)"

    def do_train_zero():
        failures, table = check_against_cpu(timeout_s=lambda: left(90))
        report["train_zero"] = table
        for name, losses in table.items():
            print(f"  {name}: loss {losses['cuda']:.6f} on cupy, {losses['cpu']:.6f} on the CPU")
        return not failures, ("ZeRO 2/3, checkpoint + resume, offload cpu/nvme on cupy match the "
                              "CPU" if not failures else "; ".join(failures))

    def do_layouts():
        import shutil

        if shutil.which("mpiexec") is None:
            return None, "no mpiexec on PATH: two-rank layouts not checked"
        failures, table = check_against_cpu(timeout_s=lambda: left(90), runs=LAYOUT_RUNS, ranks=2)
        report["layouts"] = table
        for name, losses in table.items():
            print(f"  2 ranks, {name}: loss {losses['cuda']:.6f} on cupy, {losses['cpu']:.6f} on "
                  "the CPU")
        return not failures, ("two ranks on one GPU match the CPU in every layout"
                              if not failures else "; ".join(failures))

    for name, fn, in_process in (("kernels", do_kernels, True), ("bandwidth", do_bandwidth, True),
                                 ("nccl", do_nccl, True), ("model", do_model, True),
                                 ("pytest", do_pytest, False), ("train", do_train, False),
                                 ("train_zero", do_train_zero, False),
                                 ("layouts", do_layouts, False)):
        step(name, fn, in_process)
    report["total_s"] = time.monotonic() - started
    report["pass"] = ok
    print(f"gpu_check: {'PASS' if ok else 'FAIL'} in {report['total_s']:.0f} s")
    write_json()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
