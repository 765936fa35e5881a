"""Train a vision transformer (rtxmpi.nn.ViT) on scikit-learn's 8x8 digits, data-parallel.

    mpiexec -n 2 python examples/train_vit.py                  # DataParallel
    mpiexec -n 2 python examples/train_vit.py --zero-stage 3   # ZeRO stage 1, 2 or 3

Every rank reads its slice of the same global batch (rtxmpi.data_vision.ImageBatchSampler: the
run is the same at any world size), AdamW with warmup and cosine decay, gradient clipping; rank 0
prints the loss every --log-every steps and, at the end, the held-out accuracy over all ranks.
Needs scikit-learn (pip install 'rtxmpi[vision]'). A bad flag gives a one-line error and exit
code 2 on every rank; a non-finite final loss, exit code 4.
"""
import argparse
import math
import sys
import time

import numpy as np

import rtxmpi
from rtxmpi.backend import to_host
from rtxmpi.data_vision import ImageBatchSampler, eval_slice, load_digits
from rtxmpi.errors import ConfigError
from rtxmpi.nn import VIT_SIZES, AdamW, ViT, ViTConfig, clip_grad_norm, cosine_lr, decay_mask
from rtxmpi.parallel.data import DataParallel, grad_scale
from rtxmpi.parallel.layout import ZERO_STAGES
from rtxmpi.parallel.zero import ZeroDataParallel

EXIT_CONFIG = 2
EXIT_DIVERGED = 4


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def parse_args(argv=None):
    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", help=f"size: {', '.join(VIT_SIZES)}")
    p.add_argument("--patch", type=int, default=2, help="patch side in pixels (8 must divide)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=64, help="global batch (images per step)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--zero-stage", type=int, default=0, choices=ZERO_STAGES,
                   help="0: DataParallel; 1, 2, 3: ZeroDataParallel of that stage")
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    if min(args.steps, args.batch, args.log_every) < 1 or args.seed < 0:
        raise ConfigError("--steps, --batch and --log-every must be >= 1 and --seed >= 0")
    if not (math.isfinite(args.lr) and args.lr > 0 and args.grad_clip > 0
            and 0 <= args.weight_decay < math.inf):
        raise ConfigError("--lr and --grad-clip must be finite and > 0, --weight-decay >= 0")
    if not 0 <= args.warmup_steps <= args.steps:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} must be in [0, --steps {args.steps}]")
    return args


def accuracy(model, world, images, labels):
    """Held-out accuracy over every rank's slice, (correct, total): one logits call per rank (at
    ZeRO stage 3 it gathers the parameters, a collective). Collective."""
    part = eval_slice(len(labels), world.rank, world.world_size)
    logits = to_host(model.logits(images[part]))
    correct = int((logits.argmax(axis=-1) == labels[part]).sum())
    counts = np.array([correct, part.stop - part.start], np.int64)
    world.all_reduce(counts, op="sum")
    return int(counts[0]), int(counts[1])


def train(args, world):
    data = load_digits(args.val_fraction, seed=args.seed)
    cfg = ViTConfig.named(args.model, patch_size=args.patch)
    model = ViT(cfg, seed=args.seed)
    sampler = ImageBatchSampler(data.train_images, data.train_labels, args.batch, seed=args.seed,
                                dp_rank=world.rank, dp_size=world.world_size)

    def adamw(params, mask):
        return AdamW(params, lr=args.lr, weight_decay=args.weight_decay, decay_mask=mask)

    if args.zero_stage:
        engine = ZeroDataParallel(model, world, stage=args.zero_stage, optimizer=adamw)
    else:
        engine = DataParallel(model, world)
        opt = adamw(model.flat_data, decay_mask(model.params, dtype=model.dtype))
    if world.rank == 0:
        print(f"ViT {args.model} ({model.num_params} parameters, {cfg.seq_len} positions) on "
              f"digits: {len(data.train_labels)} train, {len(data.val_labels)} held-out images; "
              f"{world.world_size} rank(s), "
              f"{f'ZeRO stage {args.zero_stage}' if args.zero_stage else 'DataParallel'}",
              flush=True)
    start = time.perf_counter()
    loss_sum = np.zeros(2)
    for step in range(1, args.steps + 1):
        images, labels = sampler.next_batch()
        loss, cache = engine.forward(images, labels)
        engine.backward(cache, scale=grad_scale(len(labels), args.batch, world.world_size))
        lr = cosine_lr(step, args.lr, args.warmup_steps, args.steps, min_lr=args.lr / 10)
        if args.zero_stage:
            engine.step(lr=lr, max_grad_norm=args.grad_clip)
        else:
            clip_grad_norm(model.flat_grad, args.grad_clip)
            engine.step(opt, lr=lr)
        loss_sum += (loss * len(labels), len(labels))
        if step % args.log_every == 0 or step == args.steps:
            world.all_reduce(loss_sum, op="sum")  # the mean over every rank's images
            mean_loss, loss_sum[:] = loss_sum[0] / loss_sum[1], 0
            if world.rank == 0:
                print(f"step {step} loss {mean_loss:.4f} lr {lr:.2e} "
                      f"{time.perf_counter() - start:.1f}s", flush=True)
    train_s = time.perf_counter() - start
    correct, total = accuracy(model, world, data.val_images, data.val_labels)
    if world.rank == 0:
        print(f"held-out accuracy {correct / total:.4f} ({correct}/{total}) after {args.steps} "
              f"steps, train loss {mean_loss:.4f}, {train_s:.1f}s", flush=True)
    return mean_loss


def main(argv=None):
    world = rtxmpi.init()
    try:
        final_loss = train(parse_args(argv), world)
    except ConfigError as exc:  # flags and data are the same on every rank: every rank raises
        if world.rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    if not math.isfinite(final_loss):
        if world.rank == 0:
            print(f"error: training diverged: final loss {final_loss}", file=sys.stderr, flush=True)
        sys.exit(EXIT_DIVERGED)


if __name__ == "__main__":
    main()
