"""The main job: train a byte-level GPT with data parallelism on real text.

    mpiexec -n 2 python examples/train.py                      # the stdlib's own source as corpus
    mpiexec -n 4 python examples/train.py --data ~/corpus --model small --steps 500
    srun --mpi=pmix -n 8 python examples/train.py ...          # inside a Slurm allocation

Every rank reads its slice of the same global batch (chosen from the seed and the global sample
index, so the run is the same at any world size), gradients are averaged with bucketed all_reduce
overlapping backward, and rank 0 shows progress, writes one JSON line per step to --metrics-jsonl,
evaluates the validation loss every --eval-every steps and prints a generated sample at the end.
A bad flag or data path gives a one-line error and exit code 2 on every rank.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

import rtxmpi
from rtxmpi.control import agree
from rtxmpi.data import BatchSampler, decode, encode, eval_batches, load_corpus
from rtxmpi.errors import ConfigError
from rtxmpi.nn import (GPT, MODEL_SIZES, AdamW, GPTConfig, clip_grad_norm, cosine_lr, decay_mask,
                       grad_norm_sq)
from rtxmpi.parallel.data import DataParallel

EXIT_CONFIG = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None,
                   help="text file or directory (default: the Python standard library's source)")
    p.add_argument("--cache-dir", default=None, help="token cache (default $RTXMPI_CACHE_DIR or ~/.cache/rtxmpi)")
    p.add_argument("--model", default="small", choices=sorted(MODEL_SIZES), help="model size")
    p.add_argument("--steps", type=int, default=300, help="the step the run ends at")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step over all ranks")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient-accumulation micro-batches per step on each rank")
    p.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world size)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default steps/20)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50, help="validation every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8, help="global batches per validation")
    p.add_argument("--metrics-jsonl", default=None, help="append one JSON object per step (rank 0)")
    p.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate at the end (0: none)")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of every collective wait")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def check_args(args, world_size):
    """Validate flags against each other and the world size; raises ConfigError (a user can act)."""
    for name in ("steps", "global_batch", "micro_batches", "seq_len", "eval_batches"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_every < 0 or args.sample_tokens < 0:
        raise ConfigError("--eval-every and --sample-tokens must be >= 0")
    if not args.lr > 0 or not args.bucket_mb > 0:
        raise ConfigError("--lr and --bucket-mb must be > 0")
    dp = world_size if args.dp is None else args.dp
    if dp != world_size:
        raise ConfigError(f"--dp {dp} != world_size {world_size}: data parallelism is the only "
                          f"parallel axis in this version; use --dp {world_size} or {dp} ranks")
    if args.global_batch % dp:
        raise ConfigError(f"--global-batch {args.global_batch} is not divisible by the data-parallel "
                          f"size {dp}; use a multiple of {dp}")
    local = args.global_batch // dp
    if local % args.micro_batches:
        raise ConfigError(f"the per-rank batch {local} (global batch {args.global_batch} / dp {dp}) "
                          f"is not divisible by --micro-batches {args.micro_batches}")
    if args.data is not None and not os.path.exists(os.path.expanduser(args.data)):
        raise ConfigError(f"--data {args.data}: no such file or directory")
    return dp


def load_data(world, args):
    """Rank 0 tokenizes (or finds the cache) first; then the others map the cache."""
    load = lambda progress: load_corpus(args.data, cache_dir=args.cache_dir, seq_len=args.seq_len,  # noqa: E731
                                        progress=progress)
    corpus, failed = None, False
    if world.rank == 0:
        try:
            corpus = load(not args.no_progress)
        except ConfigError:
            failed = True
    if agree(world, failed=failed).failed or world.rank != 0:
        corpus = load(False)  # raises the same ConfigError on every rank when rank 0's failed
    return corpus


def evaluate(model, world, tokens, args):
    """Mean validation loss (nats/byte) over the same fixed windows at any world size."""
    total = np.zeros(2, np.float64)  # loss * samples, samples
    for x, y in eval_batches(tokens, args.seq_len, args.global_batch, args.eval_batches,
                             dp_rank=world.rank, dp_size=world.world_size):
        loss, _ = model.forward(x, y)
        total += (loss * len(x), len(x))
    world.all_reduce(total)
    return float(total[0] / total[1])


def train(args):
    world = rtxmpi.init(timeout_s=args.timeout_s)
    rank, world_size = world.rank, world.world_size
    check_args(args, world_size)
    corpus = load_data(world, args)
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    model = GPT(cfg, seed=args.seed)
    ddp = DataParallel(model, world, bucket_bytes=int(args.bucket_mb * 2**20))
    optimizer = AdamW(model.flat_data, lr=args.lr, weight_decay=args.weight_decay,
                      decay_mask=decay_mask(model.params))
    sampler = BatchSampler(corpus.train, args.seq_len, args.global_batch, seed=args.seed,
                           dp_rank=rank, dp_size=world_size)
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    warmup = max(1, args.steps // 20) if args.warmup_steps is None else args.warmup_steps
    metrics = open(args.metrics_jsonl, "a") if rank == 0 and args.metrics_jsonl else None
    if rank == 0:
        print(f"rtxmpi {rtxmpi.__version__}: world_size {world_size}, model {args.model} "
              f"({model.num_params / 1e6:.2f} M params), corpus {corpus.source} "
              f"({corpus.train.size / 1e6:.1f} MB train / {corpus.val.size / 1e6:.2f} MB val), "
              f"global batch {args.global_batch} x {args.seq_len} tokens", flush=True)
    bar = tqdm(total=args.steps, disable=rank != 0 or args.no_progress, unit="step", mininterval=1.0)
    tokens_per_step = args.global_batch * args.seq_len
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = sampler.next_batch()
        xs, ys = np.split(x, args.micro_batches), np.split(y, args.micro_batches)
        loss_sum = 0.0
        for m in range(args.micro_batches):
            loss, cache = ddp.forward(xs[m], ys[m])
            loss_sum += loss
            if m < args.micro_batches - 1:
                with ddp.no_sync():
                    ddp.backward(cache, scale=1.0 / args.micro_batches)
            else:
                ddp.backward(cache, scale=1.0 / args.micro_batches)
        grad_norm = math.sqrt(grad_norm_sq(model.flat_grad))  # identical on every rank
        if args.grad_clip > 0:
            clip_grad_norm(model.flat_grad, args.grad_clip, total_norm=grad_norm)
        lr = cosine_lr(step, args.lr, warmup, args.steps, min_lr)
        if agree(world, overflow=not math.isfinite(grad_norm)).overflow:
            ddp.zero_grad()  # every rank skips the step: a non-finite gradient somewhere
        else:
            ddp.step(optimizer, lr=lr)
        losses = np.array([loss_sum / args.micro_batches])
        world.all_reduce(losses, op="avg")
        step_time = time.perf_counter() - t0
        record = {"step": step, "loss": float(losses[0]), "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": tokens_per_step / step_time, "step_time_ms": step_time * 1e3,
                  "world_size": world_size}
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            record["val_loss"] = evaluate(model, world, corpus.val, args)
        if rank == 0:
            bar.set_postfix(loss=f"{record['loss']:.3f}", **({"val": f"{record['val_loss']:.3f}"}
                                                              if "val_loss" in record else {}))
            bar.update(1)
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
    bar.close()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"done: {args.steps} steps in {elapsed:.1f} s, "
              f"{args.steps * tokens_per_step / elapsed:.0f} tokens/s, "
              f"final loss {record['loss']:.3f}, val_loss {record['val_loss']:.3f} nats/byte", flush=True)
        if args.sample_tokens:
            prompt = encode("def ")[None, :].astype(np.int64)
            out = model.generate(prompt, args.sample_tokens, temperature=0.8, top_k=40,
                                 rng=np.random.default_rng(args.seed))
            print("---- sample ----\n" + decode(out[0]) + "\n----------------", flush=True)
    if metrics:
        metrics.close()
    return record


def main(argv=None):
    args = parse_args(argv)
    try:
        train(args)
    except ConfigError as exc:
        if not rtxmpi.is_initialized() or rtxmpi.world().rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)


if __name__ == "__main__":
    main()
