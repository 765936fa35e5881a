"""The CPU fused kernels (rtxmpi.fused) against the numpy references they replace.

Three tables, each alternating the two paths (the machine is shared: interleaved medians). Times
in this process are CPU time (process_time: one BLAS thread, so the work done, which other jobs
on the same cores inflate far less than wall time), with wall time beside the step's:
1. per operation, at the GPT's shapes (--model, --global-batch, --seq-len): reference and fused
   median time and their ratio;
2. the GPT's training step in this process (forward, backward, clip, AdamW; one BLAS thread):
   median step time per path, and the share of the step outside the matrix products, from a
   CPU-time cProfile of the same steps (matrix time = time inside linear_forward/_backward and
   attention_core_forward/_backward, whose own work is their matmuls, with the linears' bias add
   and bias-gradient sum and the attention's scaled copy of q: 1-2 % of the step);
3. with --train: examples/train.py end to end at 1 (and --ranks) rank(s), RTXMPI_FUSED=0 and 1
   alternated: the median step (wall) and tokens/s it reports.

    python bench/fused.py --model base [--train] [--ranks 1,2] [--json FILE]

Prints tables on stdout, progress on stderr. Local: no MPI except the launched train.py runs.
"""
import argparse
import cProfile
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, machine_line  # noqa: E402

from rtxmpi import fused, kernels  # noqa: E402
from rtxmpi.backend import tune_host_allocator  # noqa: E402
from rtxmpi.nn import GPT, AdamW, GPTConfig, clip_grad_norm, decay_mask, layers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATRIX_FUNCTIONS = ("linear_forward", "linear_backward", "attention_core_forward",
                    "attention_core_backward")


def _alternate(variants, repeats, clock=time.process_time):
    """{name: [seconds]}: each variant's callable timed `repeats` times on `clock`, the variants
    alternated; each callable gets a fresh setup (not timed)."""
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (setup, run) in variants.items():
            fused.set_enabled(name == "fused")
            args = setup()
            t0 = clock()
            run(*args)
            times[name].append(clock() - t0)
    fused.set_enabled(True)
    return times


def op_table(cfg, batch, repeats):
    """Per-operation medians (ms) at the model's shapes: [(op, reference, fused)]."""
    rng = np.random.default_rng(0)
    B, T, C, H, V = batch, cfg.seq_len, cfg.n_embd, cfg.n_head, cfg.vocab_size
    f32 = np.float32

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(f32)

    h, b4, dy4 = r(B, T, 4 * C), r(4 * C), r(B, T, 4 * C)
    att, datt = r(B, H, T, T, scale=3.0), r(B, H, T, T)
    x, a, g, bC, dyC = r(B, T, C), r(B, T, C), r(C) + 1, r(C), r(B, T, C)
    logits, targets = r(B, T, V, scale=3.0), rng.integers(0, V, (B, T))
    n = sum(int(np.prod(s)) for _, s, _ in layers.block_param_shapes(C)) * cfg.n_layer
    p, grad, m, v = r(n), r(n), r(n, scale=0.01), np.abs(r(n, scale=0.01))
    mask = (rng.random(n) < 0.9).astype(f32)
    gelu_cache = layers.bias_gelu_forward(h.copy(), b4)[1]
    ln_cache = layers.layernorm_forward(x, g, bC)[1]
    ce_cache = layers.crossentropy_forward(logits, targets)[1]
    ops = {
        "bias+GELU forward": (lambda: (h.copy(),), lambda hh: layers.bias_gelu_forward(hh, b4)),
        "bias+GELU backward": (lambda: (), lambda: layers.bias_gelu_backward(dy4, gelu_cache)),
        "causal softmax forward": (lambda: (att.copy(),),
                                   lambda s: layers.masked_softmax_forward(s, True)),
        "softmax backward": (lambda: (datt.copy(),), lambda d: layers.softmax_backward(d, att)),
        "residual+LayerNorm forward": (lambda: (a.copy(),),
                                       lambda aa: layers.residual_layernorm_forward(aa, x, g, bC)),
        "LayerNorm backward": (lambda: (), lambda: layers.layernorm_backward(dyC, ln_cache)),
        "cross-entropy forward": (lambda: (), lambda: layers.crossentropy_forward(logits, targets)),
        "cross-entropy backward": (lambda: (), lambda: layers.crossentropy_backward(1.0, ce_cache)),
        "AdamW (masked)": (lambda: (p.copy(), m.copy(), v.copy()),
                           lambda pp, mm, vv: kernels.adamw_step(
                               pp, grad, mm, vv, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                               weight_decay=0.1, step=3, decay_mask=mask)),
        "gradient epilogue": (lambda: (grad.copy(),), lambda gg: kernels.grad_epilogue(gg, 0.5)),
    }
    rows = []
    for name, (setup, run) in ops.items():
        print(f"  op {name}", file=sys.stderr)
        t = _alternate({"reference": (setup, run), "fused": (setup, run)}, repeats)
        rows.append((name, statistics.median(t["reference"]) * 1e3,
                     statistics.median(t["fused"]) * 1e3))
    return rows


def _step_fn(model, opt, idx, tgt):
    def step():
        model.zero_grad()
        _, cache = model.forward(idx, tgt)
        model.backward(cache)
        clip_grad_norm(model.flat_grad, 1.0)
        opt.step(model.flat_grad, lr=1e-4)
    return step


def step_table(cfg, batch, steps):
    """The training step in-process per path: {path: (median CPU ms, median wall ms, matrix CPU
    ms, non-matrix share)}."""
    rng = np.random.default_rng(0)
    model = GPT(cfg, seed=0)
    opt = AdamW(model.flat_data, lr=1e-4, decay_mask=decay_mask(model.params))
    idx = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    step = _step_fn(model, opt, idx, np.roll(idx, -1, axis=1))
    step()  # warm-up: first-touch page faults, imports
    both = {"reference": (tuple, step), "fused": (tuple, step)}
    times = _alternate(both, steps)
    walls = _alternate(both, steps, time.perf_counter)
    out = {}
    for path in ("reference", "fused"):
        fused.set_enabled(path == "fused")
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        t0 = time.process_time()
        for _ in range(2):
            step()
        total = (time.process_time() - t0) / 2
        prof.disable()
        stats = pstats.Stats(prof).stats
        matrix = sum(tt for (file, _, func), (_, _, tt, _, _) in stats.items()
                     if func in MATRIX_FUNCTIONS and file.endswith(os.path.join("nn", "layers.py"))) / 2
        out[path] = (statistics.median(times[path]) * 1e3, statistics.median(walls[path]) * 1e3,
                     matrix * 1e3, 1.0 - matrix / total)
    fused.set_enabled(True)
    return out


_DONE = re.compile(r"done: .*?([\d.]+) tokens/s")
_STEP = re.compile(r"median step: ([\d.]+) = compute ([\d.]+)")


def train_table(model, ranks, steps, repeats):
    """examples/train.py per path and world size: [(ranks, path, step ms, compute ms, tokens/s)]."""
    results = {}
    for _ in range(repeats):
        for n in ranks:
            for path in ("0", "1"):
                env = dict(os.environ, RTXMPI_FUSED=path, OMP_NUM_THREADS="1",
                           OPENBLAS_NUM_THREADS="1")
                cmd = [sys.executable, os.path.join(ROOT, "examples", "train.py"), "--model", model,
                       "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1",
                       "--sample-tokens", "0"]
                if n > 1:
                    cmd = ["mpiexec", "--oversubscribe", "--bind-to", "none", "-n", str(n)] + cmd
                print(f"  train.py {model} ranks={n} RTXMPI_FUSED={path}, load average "
                      f"{os.getloadavg()[0]:.1f}", file=sys.stderr)
                with tempfile.TemporaryDirectory() as run_dir:
                    text = subprocess.run(cmd + ["--run-dir", run_dir], env=env, capture_output=True,
                                          text=True, check=True).stdout
                step, done = _STEP.search(text), _DONE.search(text)
                results.setdefault((n, path), []).append(
                    (float(step.group(1)), float(step.group(2)), float(done.group(1))))
    return [(n, path, *(statistics.median(r[i] for r in results[(n, path)]) for i in range(3)))
            for (n, path) in sorted(results)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="base")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=9, help="timed runs per operation and path")
    p.add_argument("--steps", type=int, default=6, help="timed in-process steps per path")
    p.add_argument("--train", action="store_true", help="also time examples/train.py end to end")
    p.add_argument("--ranks", default="1", help="world sizes for --train, e.g. 1,2")
    p.add_argument("--train-steps", type=int, default=12)
    p.add_argument("--train-repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not fused.available():
        sys.exit("error: rtxmpi._fused is not built (pip install -e . builds it)")
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    tune_host_allocator()  # as rtxmpi.init() does in training: no page faults on every temporary
    info = machine_info()
    print(f"# rtxmpi.fused vs the numpy references, {args.model} (L={cfg.n_layer}, C={cfg.n_embd}, "
          f"H={cfg.n_head}), batch {args.global_batch} x {args.seq_len}, float32\n")
    print(machine_line(info) + "\n")
    print(f"command: python bench/fused.py {' '.join(sys.argv[1:] if argv is None else argv)}\n")
    ops = op_table(cfg, args.global_batch, args.repeats)
    print("| operation (CPU time) | reference ms | fused ms | speed-up |\n|---|---:|---:|---:|")
    for name, ref, fus in ops:
        print(f"| {name} | {ref:.2f} | {fus:.2f} | {ref / fus:.1f}x |")
    steps = step_table(cfg, args.global_batch, args.steps)
    print("\n| training step (in-process, 1 rank) | CPU ms | wall ms | matrix products CPU ms "
          "| outside them |\n|---|---:|---:|---:|---:|")
    for path, (cpu, wall, matrix, share) in steps.items():
        print(f"| {path} | {cpu:.0f} | {wall:.0f} | {matrix:.0f} | {share:.0%} |")
    print(f"\nstep speed-up (CPU time): {steps['reference'][0] / steps['fused'][0]:.2f}x")
    train = []
    if args.train:
        ranks = [int(x) for x in args.ranks.split(",")]
        train = train_table(args.model, ranks, args.train_steps, args.train_repeats)
        print("\n| examples/train.py | ranks | median step ms | compute ms | tokens/s |"
              "\n|---|---:|---:|---:|---:|")
        for n, path, step, compute, tps in train:
            print(f"| {'fused' if path == '1' else 'reference'} | {n} | {step:.0f} | {compute:.0f} "
                  f"| {tps:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "ops_ms": ops,
                       "step": steps, "train": train}, f, indent=1)


if __name__ == "__main__":
    main()
