"""The main job: train a byte-level GPT with data parallelism on real text.

    mpiexec -n 2 python examples/train.py                      # the stdlib's own source as corpus
    mpiexec -n 4 python examples/train.py --data ~/corpus --model small --steps 500
    srun --mpi=pmix -n 8 python examples/train.py ...          # inside a Slurm allocation

Every rank reads its slice of the same global batch (chosen from the seed and the global sample
index, so the run is the same at any world size), gradients are averaged with bucketed all_reduce
overlapping backward, and rank 0 shows progress, writes one JSON line per step to --metrics-jsonl,
evaluates the validation loss every --eval-every steps and prints a generated sample at the end
(its prompt drawn from the validation text).
With --ckpt-dir and --ckpt-every K a sharded checkpoint is committed after every step S with
S % K == 0 and at the end; --resume continues from the latest committed one at step S + 1, at any
world size (docs/checkpoint.md). Rank 0 logs every step to CKPT/wal.h5 (the write-ahead log);
--deterministic makes a resume re-run the logged steps after the checkpoint and check them bit for
bit against the log (docs/wal.md). --stop-after-step S ends the run early as if pre-empted.
SIGTERM or SIGUSR1 to any rank stops every rank after the same step with a committed checkpoint
and exit code 75 (--requeue: and requeues the Slurm job); SIGINT (Ctrl-C) does the same with exit
code 130 (under mpiexec: launch with `rtxmpi run`, docs/usage.md); --elastic shrink continues on the
surviving ranks after a rank dies (ULFM; docs/elastic.md). --ckpt-dir is locked for the run: a
second job on it exits 2 naming the holder (docs/checkpoint.md).
A bad flag or data path gives a one-line error and exit code 2 on every rank; a run whose steps
were all skipped (non-finite gradients) or whose final loss is not finite, exit code 4.
This file is the command line and the GPT's task (GPTTask); the loop, checkpoints, log, signals
and exit codes are rtxmpi.train's (docs/training.md).
"""
import argparse
import math
import os
import sys
from dataclasses import asdict, fields, replace

import rtxmpi  # before numpy: it sets each rank's BLAS threads (rtxmpi.threads)

import numpy as np

from rtxmpi import elastic
from rtxmpi.backend import array_module, to_host
from rtxmpi.control import agree
from rtxmpi.data import BatchSampler, batch_split, decode, encode, eval_batches, load_corpus
from rtxmpi.elastic.replan import describe, replan
from rtxmpi.errors import CheckpointError, ConfigError
from rtxmpi.nn import GPT, MODEL_SIZES, AdamW, GPTConfig
from rtxmpi.nn.gpt import param_layout
from rtxmpi.parallel.hybrid import build_hybrid
from rtxmpi.parallel.layout import (OFFLOADS, RECOMPUTE, SCHEDULES, ZERO_STAGES, Layout,
                                    auto_micro_batches)
from rtxmpi.parallel.pipeline import build_pipeline
from rtxmpi.parallel.planner import (explicit_layout_flags, memory_breakdown,
                                     node_memory_per_rank, plan_for_job)
from rtxmpi.train import (EXIT_CONFIG, Parts, Task, TrainConfig, build_engine, exit_status, fit,
                          flag_names, is_rank0)
from rtxmpi.train.metrics import count

MEMORY_SLACK = 1.5  # check_memory refuses estimates over 1.5 x the node's memory per rank


def printable(text):
    """`text` with control characters other than newline and tab (a generated ESC or NUL would
    drive the terminal) shown as U+FFFD, like the invalid UTF-8 that decode() already replaced."""
    return "".join(c if c in "\n\t" or c.isprintable() else "\ufffd"
                   for c in text)


def sample_prompt(val, seed, length):
    """The generated sample's prompt: up to `length` bytes of held-out text, from the first
    non-empty line that starts within 256 bytes after an offset drawn from `seed` (the offset
    itself when none does). val: the validation tokens (1-D uint8). Returns (tokens (n,) uint8,
    offset), or (a newline, None) when val is empty."""
    if val.size == 0:
        return encode("\n"), None
    offset = int(np.random.default_rng(seed).integers(0, max(1, val.size - length)))
    window = np.asarray(val[offset:offset + 256])
    starts = np.flatnonzero((window[:-1] == ord("\n")) & (window[1:] != ord("\n"))) + 1
    offset += int(starts[0]) if starts.size else 0
    return np.array(val[offset:offset + length], np.uint8), offset


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, once (rank 0), with exit code 2."""

    def error(self, message):
        if is_rank0():
            print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)


def _micro_batches(text):
    """--micro-batches: 'auto' (None: chosen in check_args) or an int."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: use auto or an integer") from None


def parse_args(argv=None):
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None,
                   help="text file or directory (default: the Python standard library's source)")
    p.add_argument("--cache-dir", default=None,
                   help="token cache (default $RTXMPI_CACHE_DIR or ~/.cache/rtxmpi)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of files (by path hash) held out for validation")
    p.add_argument("--model", default="small", choices=sorted(MODEL_SIZES), help="model size")
    p.add_argument("--steps", type=int, default=300, help="the step the run ends at")
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step over all ranks")
    p.add_argument("--micro-batches", type=_micro_batches, default=None, metavar="{auto,M}",
                   help="micro-batches per step on each rank: gradient accumulation, or with "
                        "--pp the pipeline's micro-batches; auto (the default): 1 without --pp, "
                        "with --pp P the smallest multiple of P that divides the per-rank batch "
                        "(docs/pipeline.md)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel stages (layers split over --pp ranks; docs/parallel.md)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule with --pp > 1 (1f1b needs --micro-batches >= --pp; "
                        "interleaved: --virtual-stages chunks a rank, micro-batches a multiple "
                        "of --pp; docs/pipeline.md)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per pipeline rank for --schedule interleaved (V >= 2)")
    p.add_argument("--plan", default=None, choices=("auto",),
                   help="auto: the planner picks --dp/--tp/--pp/--sp/--micro-batches/--zero-stage/"
                        "--schedule/--offload from a hardware profile (docs/planner.md; with "
                        "--offload-dir it may pick nvme offload); not with those flags")
    p.add_argument("--plan-profile", default=None, metavar="FILE",
                   help="--plan auto: read the hardware profile from FILE, or measure it and save "
                        "it there when FILE does not exist (default: measure, 5-15 s)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree (default: world size / (tp * pp * sp))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Megatron; docs/parallel.md)")
    p.add_argument("--sp", type=int, default=1,
                   help="sequence-parallel degree (Ulysses all-to-all attention; docs/parallel.md)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp > 1: Megatron sequence parallelism (LayerNorm regions split along "
                        "the sequence over tp)")
    p.add_argument("--zero-stage", type=int, default=0, choices=ZERO_STAGES,
                   help="0: replicated optimizer; 1: sharded optimizer state; 2: + sharded "
                        "gradients; 3: + sharded parameters, gathered layer by layer")
    p.add_argument("--offload", default="none", choices=OFFLOADS,
                   help="ZeRO master parameters and optimizer state in host memory (cpu) or in "
                        "files under --offload-dir, streamed in chunks (nvme); needs --zero-stage >= 1")
    p.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="directory for --offload nvme files (DIR/rank_XXXXX/; use a local NVMe disk)")
    p.add_argument("--recompute", default="none", choices=RECOMPUTE,
                   help="blocks: forward keeps only each transformer block's input and backward "
                        "reruns the block (activations of about one block instead of all, at "
                        "about one extra forward; the same bits); with every layout, pipeline "
                        "stages included (docs/model.md)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default steps/20)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model computes: numpy or cupy (cuda: docs/gpu.md)")
    p.add_argument("--eval-every", type=int, default=50, help="validation every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8, help="global batches per validation")
    p.add_argument("--metrics-jsonl", default=None,
                   help="append one JSON object per step (rank 0; a resumed run continues the file)")
    p.add_argument("--timeline", default=None, metavar="FILE",
                   help="write one merged Chrome-trace JSON of every rank (Perfetto; docs/observe.md)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="P",
                   help="serve Prometheus metrics on --metrics-bind:(P + local rank)")
    p.add_argument("--metrics-bind", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics server binds (default 127.0.0.1)")
    p.add_argument("--metrics-textfile", default=None, metavar="FILE",
                   help="write Prometheus metrics for node_exporter's textfile collector")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="write metrics.jsonl, timeline.json, breakdown, bottleneck and memory "
                        "for `rtxmpi report DIR`")
    p.add_argument("--sample-tokens", type=int, default=200,
                   help="bytes to generate at the end, after a prompt from the validation text (0: none)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (sharded HDF5, docs/checkpoint.md)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="checkpoint after every K-th step and at the end (0: only at the end)")
    p.add_argument("--async-save", action="store_true",
                   help="write each checkpoint on a background thread while training goes on; it "
                        "is committed at the next checkpoint or the end (docs/checkpoint.md)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest committed checkpoint in --ckpt-dir that verifies "
                        "(a corrupt newer one is skipped with a warning; none: start fresh)")
    p.add_argument("--keep-last", type=int, default=None, metavar="K",
                   help="after each checkpoint, remove this run's older committed ones but the K "
                        "newest (never the one resumed from, nor another run's; default: keep all)")
    p.add_argument("--resume-strict", action="store_true",
                   help="with --resume: refuse (exit 3) when the newest committed checkpoint does "
                        "not verify, instead of falling back to an older one")
    p.add_argument("--stop-after-step", type=int, default=None, metavar="S",
                   help="end this run after step S with a committed checkpoint, as if pre-empted "
                        "(the schedule still follows --steps); needs --ckpt-dir")
    p.add_argument("--wal-every", type=int, default=10, metavar="K",
                   help="write-ahead log CKPT/wal.h5: durable and a parameter digest every K steps")
    p.add_argument("--deterministic", action="store_true",
                   help="bitwise-reproducible run; --resume re-runs the logged steps after the "
                        "checkpoint and checks them against the log (docs/wal.md)")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of every collective wait")
    p.add_argument("--elastic", default="off", choices=elastic.POLICIES,
                   help="on a rank failure: off (exit non-zero), shrink (continue on the survivors; "
                        "needs mpiexec --with-ft ulfm), grow (shrink, then spawn replacements on "
                        "free slots; docs/elastic.md), restart (exit non-zero for `rtxmpi run`)")
    p.add_argument("--min-ranks", type=int, default=1, help="--elastic shrink: fewest ranks to go on with")
    p.add_argument("--grow-retry-s", type=float, default=30.0, metavar="S",
                   help="--elastic grow: while no slot is free, retry spawning every S seconds")
    p.add_argument("--grow-hosts", default=None, metavar="FILE",
                   help="--elastic grow: HOST[:SLOTS] lines to add to the allocation, re-read "
                        "at every attempt (capacity that comes back)")
    p.add_argument("--max-ranks", type=int, default=None, metavar="N",
                   help="--elastic grow: the most ranks `rtxmpi join --job CKPT_DIR -n K` may grow "
                        "the job to (default: 4 x the launch's ranks; docs/elastic.md, \"Join\")")
    p.add_argument("--stuck-timeout-s", type=float, default=None, metavar="S",
                   help="heartbeats: a rank with no progress for S seconds is reported with its "
                        "phase and step and handled as failed (docs/elastic.md)")
    p.add_argument("--requeue", action="store_true",
                   help="after a pre-emption signal: scontrol requeue $SLURM_JOB_ID (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.micro_batches_auto = args.micro_batches is None  # resolved in check_args (or by a plan)
    given = explicit_layout_flags(sys.argv[1:] if argv is None else argv)
    if args.plan and given:
        p.error(f"--plan auto chooses the layout; drop {', '.join(given)} or --plan")
    if args.plan_profile and not args.plan:
        p.error("--plan-profile needs --plan auto")
    return args


def check_args(args, world_size):
    """Validate flags against each other and the world size; raises ConfigError (a user can act)."""
    for name in ("seq_len", "eval_batches", "virtual_stages"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.sample_tokens < 0:
        raise ConfigError(f"--sample-tokens must be >= 0, got {args.sample_tokens}")
    if not 0 < args.bucket_mb < math.inf:
        raise ConfigError(f"--bucket-mb must be finite and > 0, got {args.bucket_mb}")
    if not 0 <= args.grad_clip < math.inf or not 0 <= args.weight_decay < math.inf:
        raise ConfigError("--grad-clip and --weight-decay must be finite and >= 0 (--grad-clip 0: "
                          "no clipping)")
    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    train_config(args).validate(world_size)  # the loop's: --steps, --lr, --ckpt-dir, ...
    if (args.offload == "nvme") != (args.offload_dir is not None):
        raise ConfigError("--offload nvme needs --offload-dir DIR, and --offload-dir only goes "
                          "with --offload nvme")
    dp = check_layout_flags(args, world_size)
    if args.data is not None and not os.path.exists(os.path.expanduser(args.data)):
        raise ConfigError(f"--data {args.data}: no such file or directory")
    return dp


def check_memory(world, args, cfg):
    """Refuse a CPU job whose estimated peak memory per rank (rtxmpi.parallel.planner.
    memory_breakdown: parameters, gradients, optimizer, activations; docs/planner.md) is over
    MEMORY_SLACK times this node's memory per rank: it would fail far into the run with a
    MemoryError or swap for hours (e.g. --seq-len 100000: attention scores of B x H x T x T).
    Collective: ConfigError on every rank when any rank's node is too small."""
    available = node_memory_per_rank(world.backend.comm)
    dp = world.world_size // (args.tp * args.pp * args.sp)
    layout = Layout(dp, args.tp, args.pp, args.sp, args.micro_batches or 1, args.zero_stage,
                    args.schedule if args.pp > 1 else "none", args.offload, args.recompute)
    peak = max(stage["total"] for stage in memory_breakdown(cfg, layout, args.global_batch))
    too_big = args.device == "cpu" and available is not None and peak > MEMORY_SLACK * available
    if agree(world, too_big=too_big).too_big:
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        raise ConfigError(
            f"--model {args.model} --seq-len {args.seq_len} --global-batch {args.global_batch} on "
            f"dp {dp} x tp {args.tp} x pp {args.pp} x sp {args.sp} needs about {gib(peak)} per "
            f"rank (estimate), over this node's {gib(available or 0)} of memory per rank: lower "
            "--seq-len or --global-batch, or use more micro-batches, ranks or a ZeRO stage")


def check_layout_flags(args, world_size):
    """The layout flags as one rtxmpi.parallel.layout.Layout, checked against the world size,
    the model, --seq-len and --global-batch (docs/parallel.md, docs/pipeline.md): the global
    batch may split unevenly over dp (8 over 3: 3, 3, 2; weighted by samples,
    rtxmpi.parallel.data.weighted_micro_batches), a pipeline needs equal per-rank batches
    divisible by --micro-batches. Resolves --micro-batches auto into args. Returns dp. Raises
    ConfigError naming every problem."""
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    layout = Layout(args.dp, args.tp, args.pp, args.sp, args.micro_batches or 1, args.zero_stage,
                    args.schedule, args.offload, args.recompute, args.virtual_stages,
                    args.sequence_parallel).resolved(world_size)
    if args.micro_batches is None and layout.pp > 1 and layout.dp is not None:  # auto
        try:
            per_rank = min(batch_split(args.global_batch, layout.dp, "--global-batch"))
        except ConfigError:
            per_rank = None  # the check below names the batch's problem with the others
        if per_rank:
            layout = replace(layout, micro_batches=auto_micro_batches(layout, world_size, cfg,
                                                                      per_rank))
    layout = layout.check(world_size, cfg, args.global_batch, batch_name="--global-batch")
    args.micro_batches = layout.micro_batches
    return layout.dp


def load_data(world, args):
    """Rank 0 tokenizes (or finds the cache) first; then the others map the cache."""
    load = lambda progress: load_corpus(args.data, cache_dir=args.cache_dir, seq_len=args.seq_len,  # noqa: E731
                                        val_fraction=args.val_fraction, progress=progress)
    corpus, failed = None, False
    if world.rank == 0:
        try:
            corpus = load(not args.no_progress)
        except ConfigError:
            failed = True
    if agree(world, failed=failed).failed or world.rank != 0:
        corpus = load(False)  # raises the same ConfigError on every rank when rank 0's failed
    return corpus


def evaluate(model, world, tokens, args, dp_rank=None, dp_size=None):
    """Mean validation loss (nats/byte) over the same fixed windows at any world size."""
    total = np.zeros(2, np.float64)  # loss * samples, samples
    dp_rank, dp_size = (world.rank, world.world_size) if dp_size is None else (dp_rank, dp_size)
    for x, y in eval_batches(tokens, args.seq_len, args.global_batch, args.eval_batches,
                             dp_rank=dp_rank, dp_size=dp_size):
        loss, _ = model.forward(x, y)
        total += (to_host(loss) * len(x), len(x))
    world.all_reduce(total)
    return float(total[0] / total[1])


def relaunched():
    """True in a relaunch by `rtxmpi run` ($RTXMPI_RESTART > 0), perhaps on other ranks."""
    return os.environ.get("RTXMPI_RESTART", "0") not in ("", "0")


def replan_layout(world, args):
    """After an elastic shrink or growth (replacements, `rtxmpi join`), or in a relaunch by
    `rtxmpi run` on the ranks still available: keep
    the user's --tp/--pp/--sp when they fit this world, else take the first that fits in
    rtxmpi.elastic.replan's fixed order (dp fills the rest); rank 0 prints the old and the new
    layout when they differ. Pure data parallelism is left as it is (dp follows the world size).
    Raises ConfigError (on every rank) when nothing fits."""
    user = args.__dict__.setdefault("user_layout", [  # micro-batches None: auto for each layout
        args.tp, args.pp, args.sp, None if args.micro_batches_auto else args.micro_batches,
        args.sequence_parallel, args.virtual_stages])
    if user[:3] == [1, 1, 1]:
        args.dp = None  # data parallelism only: dp follows the world (a --dp N no longer fits)
        return
    size, model = world.world_size, args.tp * args.pp * args.sp
    resizes = elastic.resizes()  # shrinks and growths (replacements, a join)
    given = (args.dp, args.tp, args.pp, args.sp)
    old = (describe(resizes[-1][0] // model, args.tp, args.pp, args.sp) if resizes else
           " ".join(f"--{axis} {n}" for axis, n in zip(("dp", "tp", "pp", "sp"), given)
                    if n is not None))
    tp, pp, sp, micro_batches, sequence_parallel, virtual_stages = user
    layout, args.sequence_parallel, why = replan(
        size, GPTConfig.named(args.model, seq_len=args.seq_len), args.global_batch, tp=tp, pp=pp,
        sp=sp, micro_batches=micro_batches, schedule=args.schedule, zero_stage=args.zero_stage,
        sequence_parallel=sequence_parallel, virtual_stages=virtual_stages)
    args.dp, args.tp, args.pp, args.sp = layout.degrees
    args.micro_batches = layout.micro_batches
    args.virtual_stages = virtual_stages if layout.pp > 1 else 1
    if not resizes and (why == "" and given[0] in (None, layout.dp)):
        return  # a relaunch that fits the flags as given: nothing to say
    if world.rank == 0:
        micro = (f", micro-batches {layout.micro_batches}"
                 if layout.micro_batches != (micro_batches or layout.micro_batches) else "")
        micro += ", --sequence-parallel off" if sequence_parallel and not args.sequence_parallel else ""
        print(f"elastic: layout for {count(size, 'rank')}: {old} -> {describe(*layout.degrees)}{micro} "
              f"({why or '--tp/--pp/--sp as given'})", flush=True)


def apply_plan(world, args):
    """--plan auto: calibrate (or read --plan-profile), plan, and set the layout flags in args."""
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    layout, plan = plan_for_job(world, cfg, args.global_batch, args.plan_profile,
                                offload_dir=args.offload_dir, device=args.device,
                                recompute=args.recompute)
    args.dp, args.tp, args.pp, args.sp = layout.degrees
    args.micro_batches, args.zero_stage = layout.micro_batches, layout.zero_stage
    args.schedule = layout.schedule if layout.pp > 1 else args.schedule
    args.offload = layout.offload  # --offload-dir lets the planner consider nvme offload
    args.offload_dir = args.offload_dir if layout.offload == "nvme" else None
    if world.rank == 0:
        print(f"plan (--plan auto):\n{plan.table(top=5)}\n{plan.reason()}\nplan: running "
              f"{layout.flags()}", flush=True)


class GPTTask(Task):
    """The main job's model for rtxmpi.train.fit: a byte-level GPT on the corpus of --data, on the
    layout of --dp/--tp/--pp/--sp (or --plan auto, or re-planned after an elastic shrink)."""

    def __init__(self, args):
        self.args, self.name = args, f"train-{args.model}"

    def configure(self, world, config):
        args = self.args
        if args.plan:  # --plan auto: every rank runs the layout rank 0 planned (docs/planner.md)
            apply_plan(world, args)
        elif elastic.resizes() or relaunched():  # the layout for the new world size (docs/elastic.md)
            replan_layout(world, args)
        check_args(args, world.world_size)
        self.cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
        check_memory(world, args, self.cfg)
        return replace(config, micro_batches=args.micro_batches)

    def build(self, world, config):
        args, cfg = self.args, self.cfg
        self.corpus = load_data(world, args)
        pipeline = args.pp > 1  # layers in stages over --pp ranks, --schedule (docs/pipeline.md)
        hybrid = (args.tp > 1 or args.sp > 1) and not pipeline  # tensor / sequence (docs/parallel.md)
        xp = array_module(args.device)  # numpy, or cupy for --device cuda (docs/gpu.md)
        bucket_bytes = int(args.bucket_mb * 2**20)

        def optimizer(params, mask):
            return AdamW(params, lr=args.lr, weight_decay=args.weight_decay, decay_mask=mask)

        offload = None if args.offload == "none" else args.offload
        if hybrid:
            engine = build_hybrid(cfg, world, dp=args.dp, tp=args.tp, sp=args.sp, seed=args.seed, xp=xp,
                                  sequence_parallel=args.sequence_parallel, bucket_bytes=bucket_bytes,
                                  optimizer=optimizer, zero_stage=args.zero_stage,  # ZeRO over dp x sp
                                  offload_dir=args.offload_dir, offload=offload)
            engine.model.recompute = args.recompute  # the tensor-parallel Model's units (docs/model.md)
        elif pipeline:  # with --tp > 1: tensor-parallel stages
            engine = build_pipeline(cfg, world, dp=args.dp, pp=args.pp, tp=args.tp, sp=args.sp,
                                    seed=args.seed, xp=xp, sequence_parallel=args.sequence_parallel,
                                    bucket_bytes=bucket_bytes,
                                    zero_stage=args.zero_stage,  # 1-3: each stage over its replicas
                                    virtual_stages=args.virtual_stages,  # --schedule interleaved
                                    micro_batches=args.micro_batches, schedule=args.schedule,
                                    recompute=args.recompute,  # each stage reruns its blocks
                                    optimizer=optimizer)
        else:  # on CPU the gradient lives in memory the node's peers can map: the data-parallel
            # all_reduce of its buckets folds straight from it (rtxmpi.shared_zeros, docs/comm.md)
            model = GPT(cfg, seed=args.seed, xp=xp, grad_alloc=rtxmpi.shared_zeros if xp is np else None,
                        recompute=args.recompute)
            engine = build_engine(model, world, zero_stage=args.zero_stage, optimizer=optimizer,
                                  bucket_bytes=bucket_bytes, offload=offload, offload_dir=args.offload_dir)
        mesh = hybrid or pipeline  # an engine on a DeviceMesh: model, data slice, eval from it
        self.mesh = engine.mesh if mesh else None
        self.eval_model = engine if mesh else engine.model
        data_rank, data_size = ((engine.mesh.dp_rank, engine.mesh.dp) if mesh
                                else (world.rank, world.world_size))
        sampler = BatchSampler(self.corpus.train, args.seq_len, args.global_batch, seed=args.seed,
                               dp_rank=data_rank, dp_size=data_size)
        return Parts(engine.model, engine, sampler, tokens_per_step=args.global_batch * args.seq_len,
                     data_rank=data_rank, data_size=data_size, zero_stage=args.zero_stage,
                     pipelined=pipeline, bucket_mb=args.bucket_mb, loss_unit=" nats/byte",
                     replica=None if args.zero_stage else "pieces" if mesh else "tensors",
                     close=engine.close if args.offload == "nvme" else None)  # its offload files

    def describe(self, world, parts, config):
        args, mesh, corpus = self.args, self.mesh, self.corpus
        layout = f" (dp {mesh.dp} x tp {mesh.tp} x pp {mesh.pp} x sp {mesh.sp})" if mesh else ""
        return (f"rtxmpi {rtxmpi.__version__}: world_size {world.world_size}{layout}, model {args.model} "
                f"({param_layout(self.cfg)[-1].stop / 1e6:.2f} M params), "
                f"corpus {corpus.source} "
                f"({_size(corpus.train.size)} train / {_size(corpus.val.size)} val), "
                f"global batch {args.global_batch} x {args.seq_len} tokens{_uneven(args, parts.data_size)}, "
                f"ZeRO stage {args.zero_stage}{_micro_note(args)}")

    def evaluate(self, world, parts, config):
        return evaluate(self.eval_model, world, self.corpus.val, self.args, parts.data_rank,
                        parts.data_size)

    def checkpoint_meta(self):
        return {"model": self.args.model, "model_config": asdict(self.cfg), "seq_len": self.args.seq_len}

    def check_checkpoint(self, meta, path):
        saved_cfg, saved_model = GPTConfig(**meta["model_config"]), str(meta["model"])
        if saved_cfg != self.cfg:
            raise CheckpointError(f"checkpoint {path} holds model {saved_model} ({saved_cfg}), this "
                                  f"run builds model {self.args.model} ({self.cfg}); resume with "
                                  f"--model {saved_model} and --seq-len {saved_cfg.seq_len}, or use "
                                  f"another --ckpt-dir")

    def finish(self, world, parts, config, record):
        """--sample-tokens N: rank 0 prints N bytes the trained model generates after a prompt from
        the validation text (sample_prompt)."""
        args = self.args
        if not args.sample_tokens:
            return
        full = parts.engine.full_params()  # every rank: a gather at ZeRO stage 3
        if world.rank != 0:
            return
        prompt, offset = sample_prompt(self.corpus.val, args.seed, max(1, min(32, args.seq_len // 2)))
        sampler_model = GPT(self.cfg, seed=args.seed)  # a plain local copy: generation talks to no one
        sampler_model.load_flat(full)
        out = sampler_model.generate(prompt[None, :].astype(np.int64), args.sample_tokens,
                                     temperature=0.8, top_k=40, rng=np.random.default_rng(args.seed))
        where = "a newline (no validation text)" if offset is None else \
            f"{prompt.size} bytes of the validation text at byte {offset}"
        print(f"sample: the prompt is {where}, then {args.sample_tokens} generated bytes")
        print("---- sample ----\n" + printable(decode(to_host(out[0]))) + "\n----------------", flush=True)


def train_config(args):
    """The loop's settings (rtxmpi.train.TrainConfig) from the flags; messages name the flags."""
    keys = {f.name for f in fields(TrainConfig)} & vars(args).keys() - {"micro_batches"}
    micro_batches = 1 if args.micro_batches is None else args.micro_batches  # None: auto, not yet chosen
    return TrainConfig(**{k: getattr(args, k) for k in keys}, micro_batches=micro_batches,
                       progress=not args.no_progress, run_info={"args": vars(args)},
                       names=flag_names())


def train(args):
    """Run the job of `args` (parse_args) on every rank; returns rtxmpi.train.fit's record."""
    return fit(GPTTask(args), train_config(args))


def _uneven(args, dp):
    """Banner note when the global batch splits unevenly over dp (docs/elastic.md)."""
    sizes = batch_split(args.global_batch, dp)
    return "" if len(set(sizes)) == 1 else (f" (uneven over dp {dp}: {', '.join(map(str, sizes))}"
                                            f" per rank, gradients weighted by samples)")


def _micro_note(args):
    """Banner note: the micro-batches per step, with --pp or more than one (auto: chosen by
    --micro-batches auto, docs/pipeline.md)."""
    if args.pp == 1 and args.micro_batches == 1:
        return ""
    how = " (auto)" if args.micro_batches_auto and not args.plan else ""
    schedule = (f", schedule {args.schedule}"
                + (f" (V={args.virtual_stages})" if args.schedule == "interleaved" else "")
                if args.pp > 1 else "")
    return f", {args.micro_batches} micro-batches{how}{schedule}"


def _size(n_bytes):
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e5 else f"{n_bytes / 1e3:.1f} KB"


def main(argv=None):
    args = parse_args(argv)
    code = exit_status(lambda: train(args), args.requeue)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    elastic.exit_after(main)  # main()'s exit status; after a shrink, no MPI_Finalize (docs/elastic.md)
