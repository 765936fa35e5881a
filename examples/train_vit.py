"""Train a vision transformer (rtxmpi.nn.ViT) on scikit-learn's 8x8 digits, at any layout.

    mpiexec -n 2 python examples/train_vit.py                  # DataParallel
    mpiexec -n 2 python examples/train_vit.py --zero-stage 3   # ZeRO stage 1, 2 or 3
    mpiexec -n 4 python examples/train_vit.py --tp 2 --pp 2 --micro-batches 2 --recompute blocks
    mpiexec -n 4 python examples/train_vit.py --ckpt-dir ck --ckpt-every 50 --resume

The layout (--tp, --pp with --micro-batches and --schedule, --zero-stage, --recompute; dp is the
ranks left over) is checked and built by rtxmpi.train.build_parallel; --sp needs the positions
(patches and the class token: 17 for the 8x8 digits in 2x2 patches) divisible by sp.

Every rank reads its slice of the same global batch (rtxmpi.data_vision.ImageBatchSampler: the
run is the same at any world size), AdamW with warmup and cosine decay, gradient clipping; rank 0
prints the loss every --log-every steps and, at the end, the held-out accuracy over all ranks.
The loop is rtxmpi.train.fit's (docs/training.md): checkpoints and --resume at any world size,
the write-ahead log, --metrics-jsonl, SIGTERM/SIGUSR1 (exit 75) and Ctrl-C (exit 130) after a
committed checkpoint, --elastic shrink. Needs scikit-learn (pip install 'rtxmpi[vision]').
A bad flag gives a one-line error and exit code 2 on every rank; a checkpoint error, 3; a
diverged run, 4.
"""
import argparse
import math
import sys
from dataclasses import asdict

import numpy as np

from rtxmpi import elastic
from rtxmpi.backend import to_host
from rtxmpi.data_vision import ImageBatchSampler, eval_slice, load_digits
from rtxmpi.errors import CheckpointError, ConfigError
from rtxmpi.nn import VIT_SIZES, AdamW, ViT, ViTConfig
from rtxmpi.nn.module import RECOMPUTE
from rtxmpi.parallel.layout import SCHEDULES, ZERO_STAGES, Layout
from rtxmpi.train import Task, TrainConfig, build_parallel, exit_status, fit, flag_names


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
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up (default 20, or --steps when fewer)")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--zero-stage", type=int, default=0, choices=ZERO_STAGES,
                   help="0: DataParallel; 1, 2, 3: ZeroDataParallel of that stage")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--sp", type=int, default=1,
                   help="sequence-parallel degree (Ulysses; it must divide the positions, patches + 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step: the pipeline's with --pp (default --pp), else "
                        "gradient accumulation (default 1)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule with --pp")
    p.add_argument("--recompute", default="none", choices=RECOMPUTE,
                   help="blocks: every transformer block reruns its forward in backward")
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out loss every N steps (0: only at the end)")
    p.add_argument("--metrics-jsonl", default=None, help="one JSON object per step (rank 0)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (docs/checkpoint.md)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="checkpoint after every K-th step and at the end (0: only at the end)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest committed checkpoint in --ckpt-dir")
    p.add_argument("--stop-after-step", type=int, default=None, metavar="S",
                   help="end after step S with a committed checkpoint, as if pre-empted")
    p.add_argument("--deterministic", action="store_true",
                   help="a resume re-runs the logged steps and checks them bit for bit (docs/wal.md)")
    p.add_argument("--elastic", default="off", choices=elastic.POLICIES,
                   help="on a rank failure: off, shrink (needs mpiexec --with-ft ulfm), restart")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of every collective wait")
    args = p.parse_args(argv)
    if min(args.steps, args.batch, args.log_every) < 1 or args.seed < 0:
        raise ConfigError("--steps, --batch and --log-every must be >= 1 and --seed >= 0")
    if not (math.isfinite(args.lr) and args.lr > 0 and args.grad_clip > 0
            and 0 <= args.weight_decay < math.inf):
        raise ConfigError("--lr and --grad-clip must be finite and > 0, --weight-decay >= 0")
    if args.warmup_steps is None:
        args.warmup_steps = min(20, args.steps)
    if args.micro_batches is None:
        args.micro_batches = args.pp  # 1F1B's least: one micro-batch in flight per stage
    if not 0 <= args.warmup_steps <= args.steps:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} must be in [0, --steps {args.steps}]")
    return args


class ViTTask(Task):
    """A ViT on the digits for rtxmpi.train.fit, at the layout of the flags."""

    def __init__(self, args):
        self.args, self.name = args, f"train-vit-{args.model}"
        self.cfg = ViTConfig.named(args.model, patch_size=args.patch)
        self.data = load_digits(args.val_fraction, seed=args.seed)
        self.layout = Layout(dp=None, tp=args.tp, pp=args.pp, sp=args.sp,
                             micro_batches=args.micro_batches, zero_stage=args.zero_stage,
                             schedule=args.schedule if args.pp > 1 else "none",
                             recompute=args.recompute)

    def build(self, world, config):
        args = self.args
        built = self.built = build_parallel(
            lambda: ViT(self.cfg, seed=args.seed), world, self.layout, global_batch=args.batch,
            optimizer=lambda params, mask: AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                                                 decay_mask=mask))
        sampler = ImageBatchSampler(self.data.train_images, self.data.train_labels, args.batch,
                                    seed=args.seed, dp_rank=built.data_rank, dp_size=built.data_size)
        return built.parts(sampler, args.batch, unit="images")

    def describe(self, world, parts, config):
        args, data, layout = self.args, self.data, self.built.layout
        engine = (str(layout) if (layout.tp, layout.pp) != (1, 1) else
                  f"ZeRO stage {args.zero_stage}" if args.zero_stage else "DataParallel")
        return (f"ViT {args.model} ({self.built.num_params} parameters, {self.cfg.seq_len} positions) "
                f"on digits: {len(data.train_labels)} train, {len(data.val_labels)} held-out images; "
                f"{world.world_size} rank(s), {engine}")

    def _held_out(self, world, fn):
        """sum of fn(model, images, labels) over every rank's slice of the held-out set, and the
        count; model: the one-process ViT with the trained parameters (gathered: collective)."""
        model = self.built.gathered_model()
        part = eval_slice(len(self.data.val_labels), world.rank, world.world_size)
        images, labels = self.data.val_images[part], self.data.val_labels[part]
        totals = np.array([fn(model, images, labels), len(labels)], np.float64)
        world.all_reduce(totals, op="sum")
        return totals[0], int(totals[1])

    def evaluate(self, world, parts, config):
        """The mean held-out loss over every rank's slice."""
        total, n = self._held_out(world, lambda model, x, y: to_host(model.forward(x, y)[0]) * len(y))
        return float(total / n)

    def checkpoint_meta(self):
        return {"model": self.args.model, "model_config": asdict(self.cfg)}

    def check_checkpoint(self, meta, path):
        saved = ViTConfig(**meta["model_config"])
        if saved != self.cfg:
            raise CheckpointError(f"checkpoint {path} holds ViT {meta['model']} ({saved}), this run "
                                  f"builds ViT {self.args.model} ({self.cfg}); resume with --model "
                                  f"{meta['model']} --patch {saved.patch_size}, or use another --ckpt-dir")

    def finish(self, world, parts, config, record):
        """Rank 0 prints the held-out accuracy over every rank's slice."""
        correct, total = self._held_out(world, lambda model, x, y: int(
            (to_host(model.logits(x)).argmax(axis=-1) == y).sum()))
        if world.rank == 0:
            print(f"held-out accuracy {correct / total:.4f} ({int(correct)}/{total}) after "
                  f"{config.steps} steps, train loss {record['loss']:.4f}", flush=True)


def train_config(args):
    """The loop's settings from the flags (messages name the flags)."""
    return TrainConfig(steps=args.steps, global_batch=args.batch, micro_batches=args.micro_batches,
                       lr=args.lr, warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, seed=args.seed,
                       eval_every=args.eval_every, log_every=args.log_every,
                       metrics_jsonl=args.metrics_jsonl, ckpt_dir=args.ckpt_dir,
                       ckpt_every=args.ckpt_every, async_save=args.async_save, resume=args.resume,
                       stop_after_step=args.stop_after_step, deterministic=args.deterministic,
                       elastic=args.elastic, timeout_s=args.timeout_s, progress=False,
                       run_info={"args": vars(args)},
                       names={**flag_names(), "global_batch": "--batch"})


def main(argv=None):
    def run():
        args = parse_args(argv)
        return fit(ViTTask(args), train_config(args))

    code = exit_status(run)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    elastic.exit_after(main)  # main()'s exit status; after a shrink, no MPI_Finalize (docs/elastic.md)
