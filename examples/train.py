"""The main job: train a byte-level GPT with data parallelism on real text.

    mpiexec -n 2 python examples/train.py                      # the stdlib's own source as corpus
    mpiexec -n 4 python examples/train.py --data ~/corpus --model small --steps 500
    srun --mpi=pmix -n 8 python examples/train.py ...          # inside a Slurm allocation

Every rank reads its slice of the same global batch (chosen from the seed and the global sample
index, so the run is the same at any world size), gradients are averaged with bucketed all_reduce
overlapping backward, and rank 0 shows progress, writes one JSON line per step to --metrics-jsonl,
evaluates the validation loss every --eval-every steps and prints a generated sample at the end.
With --ckpt-dir and --ckpt-every K a sharded checkpoint is committed after every step S with
S % K == 0 and at the end; --resume continues from the latest committed one at step S + 1, at any
world size (docs/checkpoint.md). Rank 0 logs every step to CKPT/wal.h5 (the write-ahead log);
--deterministic makes a resume re-run the logged steps after the checkpoint and check them bit for
bit against the log (docs/wal.md). --stop-after-step S ends the run early as if pre-empted.
SIGTERM or SIGUSR1 to any rank stops every rank after the same step with a committed checkpoint
and exit code 75 (--requeue: and requeues the Slurm job); SIGINT (Ctrl-C) does the same with exit
code 130 (under mpiexec: launch with `rtxmpi run`, README); --elastic shrink continues on the
surviving ranks after a rank dies (ULFM; docs/elastic.md). --ckpt-dir is locked for the run: a
second job on it exits 2 naming the holder (docs/checkpoint.md).
A bad flag or data path gives a one-line error and exit code 2 on every rank; a run whose steps
were all skipped (non-finite gradients) or whose final loss is not finite, exit code 4.
"""
import argparse
import difflib
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace


def _default_blas_threads():
    """Unless OMP_NUM_THREADS is set: give each rank its share of the cores (cores // ranks on this
    node, at least 1), before numpy loads its BLAS. N ranks that each start an all-core BLAS pool
    starve each other (5x slower measured with 2 ranks on 2 cores). Local sizes from Open MPI or
    MPICH's launcher; without them nothing changes."""
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or os.environ.get("MPI_LOCALNRANKS")
    if "OMP_NUM_THREADS" in os.environ or not (local or "").isdigit() or int(local) < 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ["OMP_NUM_THREADS"] = str(max(1, (cores or 1) // int(local)))


_default_blas_threads()

import numpy as np  # noqa: E402  (after the BLAS thread default)
from tqdm import tqdm

import rtxmpi
from rtxmpi import elastic
from rtxmpi.elastic.replan import describe, replan
from rtxmpi.backend import array_module, to_host
from rtxmpi.checkpoint import Shard, latest_step, latest_valid, load_checkpoint, save_checkpoint
from rtxmpi.checkpoint.agree import raise_if_any_failed
from rtxmpi.checkpoint.lock import lock_dir, release_all
from rtxmpi.control import agree
from rtxmpi.data import BatchSampler, batch_split, decode, encode, eval_batches, load_corpus
from rtxmpi.errors import CheckpointError, ConfigError, DirectoryLocked
from rtxmpi.observe.observer import Observer
from rtxmpi.nn import (GPT, MODEL_SIZES, AdamW, GPTConfig, clip_grad_norm, cosine_lr, decay_mask,
                       grad_norm_sq)
from rtxmpi.nn.gpt import param_layout
from rtxmpi.comm.failure import ulfm_enabled
from rtxmpi.parallel.data import DataParallel, weighted_micro_batches
from rtxmpi.parallel.hybrid import build_hybrid
from rtxmpi.parallel.layout import (OFFLOADS, RECOMPUTE, SCHEDULES, ZERO_STAGES, Layout,
                                    auto_micro_batches)
from rtxmpi.parallel.pipeline import build_pipeline
from rtxmpi.parallel.planner import (explicit_layout_flags, memory_breakdown,
                                     node_memory_per_rank, plan_for_job)
from rtxmpi.parallel.replica import replica_pieces
from rtxmpi.parallel.zero import ZeroDataParallel
from rtxmpi.wal import (ResumeParity, WriteAheadLog, check_checkpoint_record, params_digest, read_wal,
                        wal_path)

EXIT_CONFIG = 2
MEMORY_SLACK = 1.5  # check_memory refuses estimates over 1.5 x the node's memory per rank
EXIT_CHECKPOINT = 3  # a checkpoint or write-ahead log error, e.g. resume parity failed
EXIT_DIVERGED = 4  # every step of the run skipped (non-finite gradients), or a non-finite loss
EXIT_PREEMPTED = elastic.EXIT_PREEMPTED  # 75: stopped by SIGTERM/SIGUSR1 with a committed checkpoint
EXIT_INTERRUPTED = elastic.EXIT_INTERRUPTED  # 130: stopped by Ctrl-C with a committed checkpoint


def _count(n, noun):
    """'1 step', '2 steps', '1 loss', '3 losses': a count and its noun, pluralized."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def printable(text):
    """`text` with control characters other than newline and tab (a generated ESC or NUL would
    drive the terminal) shown as U+FFFD, like the invalid UTF-8 that decode() already replaced."""
    return "".join(c if c in "\n\t" or c.isprintable() else "\ufffd"
                   for c in text)


def _is_rank0():
    if rtxmpi.is_initialized():  # after an elastic shrink, launch rank 0 may be gone
        return rtxmpi.world().rank == 0
    from mpi4py import MPI  # initialized by `import rtxmpi`; works before rtxmpi.init()

    return MPI.COMM_WORLD.Get_rank() == 0


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, once (rank 0), with exit code 2."""

    def error(self, message):
        if _is_rank0():
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
    p.add_argument("--cache-dir", default=None, help="token cache (default $RTXMPI_CACHE_DIR or ~/.cache/rtxmpi)")
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
    p.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate at the end (0: none)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (sharded HDF5, docs/checkpoint.md)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="checkpoint after every K-th step and at the end (0: only at the end)")
    p.add_argument("--async-save", action="store_true",
                   help="write each checkpoint on a background thread while training goes on; it "
                        "is committed at the next checkpoint or the end (docs/checkpoint.md)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest committed checkpoint in --ckpt-dir that verifies "
                        "(a corrupt newer one is skipped with a warning; none: start fresh)")
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
                        "needs mpiexec --with-ft ulfm), restart (exit non-zero for `rtxmpi run`)")
    p.add_argument("--min-ranks", type=int, default=1, help="--elastic shrink: fewest ranks to go on with")
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
    for name in ("steps", "global_batch", "micro_batches", "seq_len", "eval_batches",
                 "virtual_stages"):
        if getattr(args, name) is not None and getattr(args, name) < 1:  # micro_batches None: auto
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_every < 0 or args.sample_tokens < 0:
        raise ConfigError("--eval-every and --sample-tokens must be >= 0")
    if args.seed < 0:  # numpy's generators take non-negative seeds
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    for name in ("lr", "bucket_mb"):
        if not 0 < getattr(args, name) < math.inf:
            raise ConfigError(f"--{name.replace('_', '-')} must be finite and > 0, got "
                              f"{getattr(args, name)}")
    if args.min_lr is not None and not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} must be in [0, --lr {args.lr}]")
    if args.warmup_steps is not None and not 0 <= args.warmup_steps <= args.steps:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} must be in [0, --steps {args.steps}]")
    if not 0 <= args.grad_clip < math.inf or not 0 <= args.weight_decay < math.inf:
        raise ConfigError("--grad-clip and --weight-decay must be finite and >= 0 (--grad-clip 0: "
                          "no clipping)")
    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    if args.metrics_jsonl is not None:
        folder = os.path.dirname(os.path.abspath(args.metrics_jsonl))
        if os.path.isdir(args.metrics_jsonl) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError(f"--metrics-jsonl {args.metrics_jsonl}: not a writable file path")
    if args.ckpt_every < 0:
        raise ConfigError(f"--ckpt-every must be >= 0, got {args.ckpt_every}")
    if args.ckpt_dir is not None:
        check_ckpt_dir(args.ckpt_dir)
    if args.resume_strict and not args.resume:
        raise ConfigError("--resume-strict needs --resume")
    if args.ckpt_dir is None and (args.ckpt_every or args.resume or args.stop_after_step
                                  or args.async_save):
        flag = ("--ckpt-every" if args.ckpt_every else "--resume" if args.resume else
                "--async-save" if args.async_save else "--stop-after-step")
        raise ConfigError(f"{flag} needs --ckpt-dir DIR")
    if args.stop_after_step is not None and not 1 <= args.stop_after_step <= args.steps:
        raise ConfigError(f"--stop-after-step {args.stop_after_step} must be in [1, --steps {args.steps}]")
    if not 1 <= args.min_ranks <= world_size:
        raise ConfigError(f"--min-ranks {args.min_ranks} must be in [1, world_size {world_size}]")
    if args.wal_every < 1:
        raise ConfigError(f"--wal-every must be >= 1, got {args.wal_every}")
    if (args.offload == "nvme") != (args.offload_dir is not None):
        raise ConfigError("--offload nvme needs --offload-dir DIR, and --offload-dir only goes "
                          "with --offload nvme")
    dp = check_layout_flags(args, world_size)
    if args.data is not None and not os.path.exists(os.path.expanduser(args.data)):
        raise ConfigError(f"--data {args.data}: no such file or directory")
    return dp


def check_ckpt_dir(path):
    """--ckpt-dir: a directory this process can write in, or one it can create (the nearest
    existing parent is a directory it can write in). Probed with a temporary directory, removed
    at once; nothing is created otherwise (--resume warns about a missing directory later).
    Raises ConfigError naming the flag and the system's reason."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"--ckpt-dir {path}: {existing} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rtxmpi-probe-", dir=existing))
    except OSError as exc:
        where = ("cannot be written" if existing == os.path.abspath(path) else
                 f"cannot be created (in {existing})")
        raise ConfigError(f"--ckpt-dir {path}: the directory {where}: "
                          f"{exc.strerror or exc}") from None


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


class Replicated:
    """ZeRO stage 0: DataParallel with a whole AdamW on every rank, behind the calls of
    ZeroDataParallel (grad_norm, step(lr, max_grad_norm, total_norm), shards, load_shards), so the
    training loop and the checkpoint format are the same at every stage."""

    def __init__(self, model, world, bucket_bytes, optimizer):
        self.model, self.group = model, world
        self.ddp = DataParallel(model, world, bucket_bytes=bucket_bytes)
        self.optimizer = optimizer(model.flat_data, decay_mask(model.params))
        self.forward, self.backward, self.no_sync = self.ddp.forward, self.ddp.backward, self.ddp.no_sync
        self.zero_grad = self.ddp.zero_grad

    def grad_norm(self):
        return math.sqrt(grad_norm_sq(self.model.flat_grad))  # averaged: identical on every rank

    def full_params(self):
        return self.model.flat_data

    def step(self, lr=None, max_grad_norm=None, total_norm=None):
        self.ddp.check_step()  # before clipping: a refused step leaves the gradient as it was
        if max_grad_norm is not None:
            clip_grad_norm(self.model.flat_grad, max_grad_norm, total_norm=total_norm)
        self.ddp.step(self.optimizer, lr=lr)

    def shards(self):
        """Each rank writes an even 1/world_size of every replicated tensor (no duplicate bytes)."""
        r, n = self.group.rank, self.group.world_size
        shards = {name: Shard.even(full, r, n) for name, full in self.pieces().items()}
        return {name: (sh.data, sh.global_offset, sh.global_size) for name, sh in shards.items()}

    def pieces(self):
        """The full replicated tensors, by checkpoint name (also what a shrink hands over)."""
        state = self.optimizer.state_dict()
        return {"params": self.model.flat_data, "adam.m": state["m"], "adam.v": state["v"],
                "adam.step": np.array([state["step"]], np.int64)}

    def load_shards(self, read):
        n = self.model.flat_data.shape[0]
        self.optimizer.load_state_dict({"step": int(read("adam.step", 0, 1)[0]),
                                        "m": read("adam.m", 0, n), "v": read("adam.v", 0, n)})
        flat = self.model.flat_data
        flat[...] = self.model.xp.asarray(read("params", 0, n), dtype=flat.dtype)  # cupy: to device
        self.ddp.zero_grad()


def build_engine(args, model, world):
    """The data-parallel engine for --zero-stage: Replicated (0) or ZeroDataParallel (1, 2)."""
    def optimizer(params, mask):
        return AdamW(params, lr=args.lr, weight_decay=args.weight_decay, decay_mask=mask)

    bucket_bytes = int(args.bucket_mb * 2**20)
    if args.zero_stage == 0:
        return Replicated(model, world, bucket_bytes, optimizer)
    return ZeroDataParallel(model, world, stage=args.zero_stage, bucket_bytes=bucket_bytes,
                            optimizer=optimizer, offload_dir=args.offload_dir,
                            offload=None if args.offload == "none" else args.offload)


def checkpoint_meta(args, cfg, model, engine, sampler, loss=None):
    """What a resume needs besides the flat tensors (JSON, stored in metadata.json). loss: the
    step's loss, stored as its float64 bits (hex), which a resume compares with the log's."""
    return {"loss_bits": None if loss is None else loss_bits(loss), "model": args.model,
            "model_config": asdict(cfg), "dtype": np.dtype(model.dtype).str,
            "param_layout": [[p.name, list(p.shape), p.offset]
                             for p in getattr(model, "full_specs", model.params)],
            "optimizer_step": engine.optimizer.step_count, "sampler": sampler.state_dict(),
            "samples_consumed": sampler.samples_consumed, "seed": args.seed,
            "global_batch": args.global_batch, "seq_len": args.seq_len,
            "zero_stage": args.zero_stage}


def loss_bits(loss):
    """A loss as the hex of its float64 bits: exact, and JSON even when the loss is not finite."""
    return f"{int(np.float64(loss).view(np.uint64)):016x}"


def save(world, args, step, cfg, model, engine, sampler, rng, pending=None, loss=None):
    """Commit a checkpoint of `step`: each rank writes its piece of params, m, v and the step,
    and its generator's state. With --async-save, first commits `pending` (the previous save),
    then snapshots and returns the new save in flight for `finish_save` (collective)."""
    finish_save(world, model, pending)
    t0 = time.perf_counter()
    shards = {name: Shard(*piece) for name, piece in engine.shards().items()}
    path = save_checkpoint(world, args.ckpt_dir, step, shards,
                           meta=checkpoint_meta(args, cfg, model, engine, sampler, loss),
                           rank_state={"rank": world.rank, "world_size": world.world_size,
                                       "rng": rng.bit_generator.state},
                           overwrite=True, async_save=args.async_save, run_id=args.run_id)
    if args.async_save:
        return path, t0  # an AsyncSave: committed by the next save() or finish_save()
    finish_save(world, model, (path, t0))
    return None


def finish_save(world, model, pending):
    """Commit an async save in flight (collective; CheckpointError on every rank) and report it."""
    if pending is None:
        return
    handle, t0 = pending
    path = handle if isinstance(handle, str) else handle.finish()
    if world.rank == 0:
        numel = getattr(model, "full_num_params", model.num_params)  # tp: the whole model's
        mb = 3 * numel * np.dtype(model.dtype).itemsize / 1e6
        print(f"checkpoint: saved step {step_of(path)} to {path} ({mb:.1f} MB over "
              f"{world.world_size} rank file{'s' if world.world_size > 1 else ''}, "
              f"{time.perf_counter() - t0:.2f} s"
              f"{'' if isinstance(handle, str) else ' to commit, written in the background'})",
              flush=True)


def step_of(step_dir):
    return int(os.path.basename(step_dir).split("_")[1])


def resume(world, args, cfg, engine, sampler, rng, dir_existed=True):
    """Load the newest committed checkpoint in --ckpt-dir that verifies (latest_valid; rank 0
    warns naming each newer one skipped and why; --resume-strict: CheckpointError instead);
    returns its step (0: none, fresh). Any world size and ZeRO stage loads any other's. Without
    --resume, refuses a --ckpt-dir that already holds checkpoints (ConfigError). The per-rank
    generator continues from its saved state at the same world size; at another, it restarts
    from (seed, rank, step) (docs/wal.md). The run continues the lineage of the checkpoint: it
    takes its run id (docs/checkpoint.md). dir_existed: whether --ckpt-dir existed before this
    run locked (and so made) it."""
    if not args.resume:
        found = np.array([-1 if world.rank else (latest_step(args.ckpt_dir) or 0)], np.int64)
        world.broadcast(found, src=0)
        if found[0] > 0:
            raise ConfigError(f"--ckpt-dir {args.ckpt_dir} already holds checkpoints (latest step "
                              f"{found[0]}); pass --resume or use an empty directory")
        return 0
    step, skipped = latest_valid(world, args.ckpt_dir, fallback=not args.resume_strict)
    if world.rank == 0:
        for path, why in skipped:
            print(f"warning: checkpoint {path} does not verify, skipped: {why}", file=sys.stderr,
                  flush=True)
    if step is None and skipped:
        raise CheckpointError(f"no checkpoint in {args.ckpt_dir} verifies ({len(skipped)} "
                              f"committed, all corrupt; see the warnings above)")
    if not step:
        if world.rank == 0 and not dir_existed:
            warn_missing_ckpt_dir(args.ckpt_dir)
        elif world.rank == 0:
            print(f"checkpoint: no committed checkpoint in {args.ckpt_dir}; starting fresh", flush=True)
        return 0
    ckpt = load_checkpoint(world, args.ckpt_dir, step=step)
    args.run_id = ckpt.metadata.get("run_id") or args.run_id
    return restore(world, args, cfg, engine, sampler, rng, ckpt)


def lock_ckpt_dir(world, args):
    """Lock --ckpt-dir for this job before anything is written there (collective; made if
    missing; rtxmpi.checkpoint.lock): another job's lock is a DirectoryLocked on every rank. The
    first time, also gives the run a fresh id (args.run_id, from the agreed lock holder) that a
    resume replaces with its checkpoint's. Returns whether the directory existed before."""
    existed = np.array([os.path.isdir(args.ckpt_dir) if world.rank == 0 else 0], np.int64)
    world.broadcast(existed, src=0)
    lock = lock_dir(world, args.ckpt_dir)
    if getattr(args, "run_id", None) is None:
        args.run_id = hashlib.sha1(json.dumps(lock.holder, sort_keys=True).encode()).hexdigest()[:16]
    return bool(existed[0])


def warn_missing_ckpt_dir(ckpt_dir):
    """--resume with a --ckpt-dir that does not exist (rank 0): not an error, since a first launch
    under `rtxmpi run` or a Slurm script passes --resume with a directory still to be made, but a
    warning on stderr naming the absolute path, and any directory next to it that holds committed
    checkpoints (a mistyped name; docs/checkpoint.md)."""
    path = os.path.abspath(ckpt_dir)
    parent, name = os.path.split(path)
    try:
        siblings = [d for d in sorted(os.listdir(parent)) if os.path.isdir(os.path.join(parent, d))]
    except OSError:
        siblings = []
    held = []
    for d in difflib.get_close_matches(name, siblings, n=20, cutoff=0.0):  # most similar first
        try:
            step = latest_step(os.path.join(parent, d))
        except OSError:
            step = None
        if step:
            held.append(f"{os.path.join(parent, d)} (latest step {step})")
    shown = ckpt_dir if ckpt_dir == path else f"{ckpt_dir} ({path})"
    print(f"warning: --resume: --ckpt-dir {shown} does not exist; starting fresh at "
          f"step 1 and creating it. Expected on a first launch; if you meant to continue a run, "
          f"stop now and fix --ckpt-dir"
          + (f" (checkpoints next to it: {', '.join(held[:3])})" if held else ""),
          file=sys.stderr, flush=True)


def _logged_step(line):
    """The step of a metrics JSONL line, or None for a blank, cut or foreign line (rank 0 reads
    the file between collectives: it must not raise on a line a killed run left half written)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def drop_metrics_after(path, step):
    """After a resume (--resume, or an elastic shrink that reloaded a checkpoint) from `step`
    (rank 0; 0: none found): remove the lines of later steps from the metrics file, which the
    run writes again, so each step is logged once (as the write-ahead log keeps only the
    records up to the checkpoint). In place: the run's append handle keeps writing at the new
    end."""
    with open(path, "r+") as f:  # a line that does not parse (cut by a kill) is kept as it is
        lines = [line for line in f if line.strip() and (_logged_step(line) or 0) <= step]
        f.seek(0)
        f.writelines(lines)
        f.truncate()


def metrics_line(record):
    """A step's JSONL line, strict JSON. A skipped step (the ranks agreed that some gradient was
    not finite) has grad_norm null: no rank's own norm describes a step that was not taken. A
    non-finite number (a diverged loss) is written as null."""
    record = {**record, "grad_norm": None} if record.get("skipped") else record
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in record.items()}, allow_nan=False) + "\n"


def finish_recovered_step(world, args, replica, metrics, last_step, save_step):
    """After an elastic shrink to the replica of step S: write S's metrics line (rank 0) and
    commit S's checkpoint when it is due, unless the failure happened after they were done."""
    record, step = replica.meta.get("record"), replica.step
    if metrics is not None and record is not None:
        with open(args.metrics_jsonl) as f:
            logged = [n for n in map(_logged_step, f) if n is not None]
        if not logged or logged[-1] < step:
            metrics.write(metrics_line(record))
            metrics.flush()
    if args.ckpt_dir and step and (step == last_step or args.ckpt_every and step % args.ckpt_every == 0):
        found = np.array([(latest_step(args.ckpt_dir) or 0) if world.rank == 0 else 0], np.int64)
        world.broadcast(found, src=0)
        if found[0] < step:
            save_step(step)


def restore(world, args, cfg, engine, sampler, rng, ckpt):
    """Load `ckpt` (a loaded checkpoint, or the surviving replica's state after an elastic
    shrink) into engine, sampler and rng; returns its step (collective). Raises CheckpointError
    on every rank when the saved meta or rank state lacks a field or has one of the wrong type."""
    try:  # the meta is the same on every rank: each reaches the same verdict
        saved_cfg = GPTConfig(**ckpt.meta["model_config"])
        sampler.load_state_dict(ckpt.meta["sampler"])
        saved_model = str(ckpt.meta["model"])
        bits = ckpt.meta.get("loss_bits")  # absent in a replica and in older checkpoints
        args.ckpt_loss = None if bits is None else float(np.uint64(int(bits, 16)).view(np.float64))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {ckpt.path}: its meta cannot be resumed from: "
                              f"{type(exc).__name__}: {exc}") from None
    if saved_cfg != cfg:
        raise CheckpointError(f"checkpoint {ckpt.path} holds model {saved_model} "
                              f"({saved_cfg}), this run builds model {args.model} ({cfg}); "
                              f"resume with --model {saved_model} and --seq-len "
                              f"{saved_cfg.seq_len}, or use another --ckpt-dir")
    engine.load_shards(ckpt.read)  # reads only the slices this rank keeps
    saved, error = ckpt.rank_state(world.rank).get("rng"), None
    try:  # a rank's own state: agree on its verdict
        if saved is not None and ckpt.world_size_saved == world.world_size:
            rng.bit_generator.state = saved
        else:
            rng.bit_generator.state = np.random.default_rng(
                [args.seed, world.rank, ckpt.step]).bit_generator.state
    except (KeyError, TypeError, ValueError) as exc:
        error = CheckpointError(f"checkpoint {ckpt.path}: saved generator state unusable: {exc}")
    raise_if_any_failed(world, error, "restoring the generator state")
    if world.rank == 0:
        for path in ckpt.ignored:
            print(f"checkpoint: ignoring uncommitted {path}", flush=True)
        for text in getattr(ckpt, "warnings", ()):
            print(f"warning: {text}", file=sys.stderr, flush=True)
        print(f"checkpoint: resumed from {ckpt.path} (saved at world size {ckpt.world_size_saved}, "
              f"ZeRO stage {ckpt.meta.get('zero_stage', 0)}, {sampler.samples_consumed} samples "
              f"consumed); continuing at step {ckpt.step + 1}", flush=True)
    return ckpt.step


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def check_deterministic(world):
    """--deterministic: warn (rank 0) when numpy's BLAS may run more than one thread per rank
    (the variables are read once, when numpy loads, so they must be set before the job starts)."""
    if world.rank != 0:
        return
    loose = [f"{v}={os.environ.get(v, 'unset')}" for v in THREAD_VARIABLES
             if os.environ.get(v, "1" if v != "OMP_NUM_THREADS" else None) != "1"]
    if loose:
        print(f"warning: --deterministic with {', '.join(loose)}: numpy's BLAS may use several "
              f"threads, reproducible only on the same machine; export OMP_NUM_THREADS=1",
              file=sys.stderr, flush=True)
    print(f"deterministic: bitwise reproducible at world size {world.world_size} with the same "
          f"flags, MPI library and machine type (docs/wal.md)", flush=True)


class StepLog:
    """The write-ahead log CKPT/wal.h5 as the loop sees it (docs/wal.md). Every rank holds one;
    rank 0 writes. A fresh run starts an empty log. A resume from the checkpoint at step C reads
    the durable records (a crashed writer's tail is simply absent) up to the last logged step L:
    without --deterministic it keeps the records up to C and appends the re-run steps C+1.. anew;
    with it, the log is left as it is while steps C+1..L are re-run and each is checked bit for bit
    against it (CheckpointError on every rank at the first difference), then it is kept up to L
    and continued at L+1."""

    def __init__(self, world, args, engine, ckpt_step, samples_consumed=0, loss=None):
        self.world, self.args, self.engine = world, args, engine
        self.samples_consumed, self.loss = samples_consumed, loss  # the checkpoint's, checked against the log
        self.path, self.wal, self.parity, self.records = wal_path(args.ckpt_dir), None, None, None
        error, verify_until = None, 0
        digest = self._digest() if ckpt_step else None
        if world.rank == 0:
            try:
                verify_until = self._open(ckpt_step, digest)
            except (CheckpointError, OSError) as exc:
                error = exc
        raise_if_any_failed(world, error, "opening the write-ahead log")
        until = np.array([verify_until], np.int64)
        world.broadcast(until, src=0)
        self.verify_until = int(until[0])

    def _digest(self):
        """crc32 of the whole parameter vector. Every rank calls it (a gather at ZeRO stage 3)."""
        return params_digest(self.engine.full_params())

    def _open(self, ckpt_step, digest):
        """Rank 0: open or check the log; returns the last step to verify (0: none)."""
        args, world = self.args, self.world
        if not (args.resume and os.path.exists(self.path)):
            if args.resume and ckpt_step:
                print(f"wal: no log at {self.path}; a new one starts at step {ckpt_step + 1}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            self.wal = WriteAheadLog(self.path, args.wal_every)
            return 0
        try:
            records = self.records = read_wal(self.path)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; move it away to resume without the log") from None
        message = check_checkpoint_record(self.path, records, ckpt_step, self.samples_consumed,
                                          self.loss)
        if ckpt_step and message:
            raise CheckpointError(message)
        kept, logged = records[records["step"] <= ckpt_step], records[records["step"] > ckpt_step]
        last = int(records["step"][-1]) if len(records) else 0
        at_ckpt = kept[kept["step"] == ckpt_step]
        if len(at_ckpt) and at_ckpt["params_digest"][0] >= 0:
            logged_digest = int(at_ckpt["params_digest"][0])
            if digest != logged_digest:
                message = (f"{self.path} step {ckpt_step}: the checkpoint's parameter digest "
                           f"{digest:08x} != logged {logged_digest:08x}: log and checkpoint are of "
                           f"different runs")
                if args.deterministic:
                    raise CheckpointError(message)
                print(f"wal: warning: {message}", flush=True)
        same_world = bool((logged["world_size"] == world.world_size).all())
        if len(logged) and args.deterministic and same_world:
            self.parity = ResumeParity(self.path, logged)
            print(f"wal: last logged step {last}; re-running steps {ckpt_step + 1}..{last} from the "
                  f"checkpoint and checking them bit for bit against the log", flush=True)
            return last
        self.wal = WriteAheadLog(self.path, args.wal_every, records=kept)
        if len(logged):
            why = ("no parity check without --deterministic" if not args.deterministic else
                   f"logged at world size {int(logged['world_size'][0])}, not bitwise comparable: "
                   f"no parity check")
            print(f"wal: last logged step {last}; re-running steps {ckpt_step + 1}..{last} from the "
                  f"checkpoint ({why})", flush=True)
        elif last == ckpt_step:
            print(f"wal: the log ends at step {last}, the checkpoint's step; nothing to re-run",
                  flush=True)
        else:
            print(f"wal: the log ends at step {last}, before the checkpoint at step {ckpt_step}; "
                  f"it continues at step {ckpt_step + 1}", flush=True)
        return 0

    def step(self, step, record, samples_consumed, sync):
        """After `step`: check it against the log while re-running logged steps (collective: one
        agree), else append it (rank 0), durable now when `sync` (checkpoint or last step)."""
        if step <= self.verify_until:
            error, digest = None, self._digest()
            if self.world.rank == 0:
                digest = digest if self.parity.wants_digest(step) else None
                message = self.parity.check(step, record["loss"], record["lr"], record["grad_norm"],
                                            digest=digest)
                error = CheckpointError(message) if message else None
            raise_if_any_failed(self.world, error, "resume parity")
            if step == self.verify_until and self.world.rank == 0:
                print(f"wal: resume parity ok: steps {self.parity.first_step}..{step} "
                      f"reproduce the log bit for bit ({_count(len(self.parity.logged), 'loss')}, "
                      f"{_count(self.parity.digests_checked, 'parameter digest')})", flush=True)
                self.wal = WriteAheadLog(self.path, self.args.wal_every,
                                         records=self.records[self.records["step"] <= step])
            return
        digest = self._digest() if sync or step % self.args.wal_every == 0 else None
        if self.wal is None:
            return
        self.wal.append(step=step, samples_consumed=samples_consumed, loss=record["loss"],
                        lr=record["lr"], grad_norm=record["grad_norm"],
                        world_size=self.world.world_size, params_digest=digest)
        if sync:
            self.wal.sync()

    def close(self):
        if self.wal is not None:
            self.wal.close()


def observer(world, args, engine, sampler):
    """The run's Observer (collective); --run-dir DIR also puts --metrics-jsonl in DIR."""
    if args.run_dir and not args.metrics_jsonl:
        args.metrics_jsonl = os.path.join(args.run_dir, "metrics.jsonl")
    obs = Observer(world, timeline=args.timeline, run_dir=args.run_dir,
                   metrics_port=args.metrics_port, metrics_bind=args.metrics_bind,
                   metrics_textfile=args.metrics_textfile, metrics_jsonl=bool(args.metrics_jsonl),
                   job=f"train-{args.model}", tokens_per_step=args.global_batch * args.seq_len,
                   bucket_mb=args.bucket_mb, run_info={"args": vars(args)})
    obs.instrument(engine=engine, sampler=sampler)
    return obs


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


def relaunched():
    """True in a relaunch by `rtxmpi run` ($RTXMPI_RESTART > 0), perhaps on other ranks."""
    return os.environ.get("RTXMPI_RESTART", "0") not in ("", "0")


def replan_layout(world, args):
    """After an elastic shrink, or in a relaunch by `rtxmpi run` on the ranks still available: keep
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
    shrinks = elastic.shrinks()
    given = (args.dp, args.tp, args.pp, args.sp)
    old = (describe(shrinks[-1][0] // model, args.tp, args.pp, args.sp) if shrinks else
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
    if not shrinks and (why == "" and given[0] in (None, layout.dp)):
        return  # a relaunch that fits the flags as given: nothing to say
    if world.rank == 0:
        micro = (f", micro-batches {layout.micro_batches}" if layout.micro_batches != (
            micro_batches or layout.micro_batches) else "") + (", --sequence-parallel off" if sequence_parallel and
                             not args.sequence_parallel else "")
        print(f"elastic: layout for {_count(size, 'rank')}: {old} -> {describe(*layout.degrees)}{micro} "
              f"({why or '--tp/--pp/--sp as given'})", flush=True)


def train(args):
    world = rtxmpi.init(timeout_s=args.timeout_s)
    rank, world_size = world.rank, world.world_size
    if args.plan:  # --plan auto: every rank runs the layout rank 0 planned (docs/planner.md)
        apply_plan(world, args)
    elif elastic.shrinks() or relaunched():  # the layout for the survivors (docs/elastic.md)
        replan_layout(world, args)
    check_args(args, world_size)
    dir_existed = lock_ckpt_dir(world, args) if args.ckpt_dir else True
    cfg = GPTConfig.named(args.model, seq_len=args.seq_len)
    check_memory(world, args, cfg)
    corpus = load_data(world, args)
    pipeline = args.pp > 1  # layers in stages over --pp ranks, --schedule (docs/pipeline.md)
    hybrid = (args.tp > 1 or args.sp > 1) and not pipeline  # tensor / sequence (docs/parallel.md)
    xp = array_module(args.device)  # numpy, or cupy for --device cuda (docs/gpu.md)
    engine = build_hybrid(cfg, world, dp=args.dp, tp=args.tp, sp=args.sp, seed=args.seed, xp=xp,
                          sequence_parallel=args.sequence_parallel,
                          bucket_bytes=int(args.bucket_mb * 2**20),
                          optimizer=lambda params, mask: AdamW(
                              params, lr=args.lr, weight_decay=args.weight_decay,
                              decay_mask=mask),
                          zero_stage=args.zero_stage, offload_dir=args.offload_dir,  # ZeRO over dp x sp
                          offload=None if args.offload == "none" else args.offload) if hybrid else None
    if hybrid:
        engine.model.recompute = args.recompute  # the tensor-parallel Model's units (docs/model.md)
    if pipeline:  # with --tp > 1: tensor-parallel stages
        engine = build_pipeline(cfg, world, dp=args.dp, pp=args.pp, tp=args.tp, sp=args.sp,
                                seed=args.seed, xp=xp, sequence_parallel=args.sequence_parallel,
                                bucket_bytes=int(args.bucket_mb * 2**20),
                                zero_stage=args.zero_stage,  # 1-3: each stage over its replicas
                                virtual_stages=args.virtual_stages,  # --schedule interleaved
                                micro_batches=args.micro_batches, schedule=args.schedule,
                                recompute=args.recompute,  # each stage reruns its blocks
                                optimizer=lambda params, mask: AdamW(
                                    params, lr=args.lr, weight_decay=args.weight_decay,
                                    decay_mask=mask))
    hybrid = hybrid or pipeline  # an engine on a DeviceMesh: model, data slice, eval from it
    # on CPU the gradient lives in memory the node's peers can map: the data-parallel all_reduce
    # of its buckets folds straight from it (rtxmpi.shared_zeros, docs/comm.md)
    model = engine.model if hybrid else GPT(
        cfg, seed=args.seed, xp=xp, grad_alloc=rtxmpi.shared_zeros if xp is np else None,
        recompute=args.recompute)
    engine = engine or build_engine(args, model, world)
    data_rank, data_size = (engine.mesh.dp_rank, engine.mesh.dp) if hybrid else (rank, world_size)
    rng = np.random.default_rng([args.seed, rank])  # per-rank randomness (dropout, ...), checkpointed
    sampler = BatchSampler(corpus.train, args.seq_len, args.global_batch, seed=args.seed,
                           dp_rank=data_rank, dp_size=data_size)
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    warmup = max(1, args.steps // 20) if args.warmup_steps is None else args.warmup_steps
    obs = observer(world, args, engine, sampler)  # timeline, metrics, run dir (docs/observe.md)
    metrics = open(args.metrics_jsonl, "a") if rank == 0 and args.metrics_jsonl else None
    if rank == 0:
        mesh = engine.mesh if hybrid else None
        layout = f" (dp {mesh.dp} x tp {mesh.tp} x pp {mesh.pp} x sp {mesh.sp})" if mesh else ""
        print(f"rtxmpi {rtxmpi.__version__}: world_size {world_size}{layout}, model {args.model} "
              f"({param_layout(cfg)[-1].stop / 1e6:.2f} M params), "
              f"corpus {corpus.source} "
              f"({_size(corpus.train.size)} train / {_size(corpus.val.size)} val), "
              f"global batch {args.global_batch} x {args.seq_len} tokens{_uneven(args, data_size)}, "
              f"ZeRO stage {args.zero_stage}{_micro_note(args)}", flush=True)
        if args.elastic == "shrink" and ulfm_enabled() is False:
            print("warning: --elastic shrink without fault-tolerant MPI: a lost rank ends the job "
                  "(CollectiveTimeout) instead of shrinking; launch with mpiexec --with-ft ulfm "
                  "(docs/elastic.md)", file=sys.stderr, flush=True)
    if args.deterministic:
        check_deterministic(world)
    replica = elastic.recovered_state()  # after an elastic shrink: the surviving replica's state
    start_step = (restore(world, args, cfg, engine, sampler, rng, replica) if replica else
                  resume(world, args, cfg, engine, sampler, rng, dir_existed) if args.ckpt_dir
                  else 0) + 1
    last_step = args.steps if args.stop_after_step is None else args.stop_after_step
    if replica is not None:  # the failure may have cut the tail of that step short
        finish_recovered_step(world, args, replica, metrics, last_step,
                              lambda s: save(world, args, s, cfg, model, engine, sampler, rng))
    elif (elastic.shrinks() or args.resume) and metrics is not None:  # steps after it re-run
        drop_metrics_after(args.metrics_jsonl, start_step - 1)
    if start_step > last_step:
        if rank == 0:
            print(f"nothing to do: the checkpoint is at step {start_step - 1} >= "
                  f"{'--steps' if last_step == args.steps else '--stop-after-step'} {last_step}",
                  flush=True)
        return None
    log = (StepLog(world, args, engine, start_step - 1, sampler.samples_consumed,
                   getattr(args, "ckpt_loss", None)) if args.ckpt_dir else None)
    bar = tqdm(total=args.steps, initial=start_step - 1, disable=rank != 0 or args.no_progress,
               unit="step", mininterval=1.0)
    tokens_per_step = args.global_batch * args.seq_len
    start = time.perf_counter()
    pending = None  # --async-save: the checkpoint being written in the background
    skipped_steps = 0  # agreed overflow skips: the same count on every rank
    loop = elastic.Loop(world)  # pre-emption, phases, what survivors hand over (docs/elastic.md)
    loop.track(meta=lambda: checkpoint_meta(args, cfg, model, engine, sampler),
               tensors=engine.pieces if args.zero_stage == 0 and not hybrid else None,
               pieces=(lambda: replica_pieces(engine)) if args.zero_stage == 0 and hybrid else None,
               close=(log, metrics), step=start_step - 1)
    for step in range(start_step, last_step + 1):
        obs.begin_step(step)
        t0 = time.perf_counter()
        loop.phase("forward", step)
        x, y = sampler.next_batch()
        # --pp: the schedule runs every micro-batch's forward and backward through the stages
        loss_sum = engine.train_step(x, y) * args.micro_batches if pipeline else 0.0
        # weighted by samples when the global batch splits unevenly (scale 1/k, weight 1.0 if not)
        micro = [] if pipeline else weighted_micro_batches(x, y, args.micro_batches,
                                                           args.global_batch, data_size)
        for m, (x_m, y_m, scale, weight) in enumerate(micro):
            loss, cache = engine.forward(x_m, y_m)
            loss_sum += loss * weight
            loop.phase("backward", step)
            if m < args.micro_batches - 1:
                with engine.no_sync():
                    engine.backward(cache, scale=scale)
            else:
                engine.backward(cache, scale=scale)
        grad_norm = engine.grad_norm()  # global: the same on every rank
        lr = cosine_lr(step, args.lr, warmup, args.steps, min_lr)
        losses = np.array([to_host(loss_sum / args.micro_batches)])
        world.all_reduce(losses, op="avg")
        flags = loop.agree(overflow=not math.isfinite(grad_norm))  # + stop: a signal on any rank
        if flags.overflow:
            engine.zero_grad()  # every rank skips the step: a non-finite gradient somewhere
            skipped_steps += 1
        else:
            engine.step(lr=lr, max_grad_norm=args.grad_clip or None, total_norm=grad_norm)
        step_time = time.perf_counter() - t0
        record = {"step": step, "loss": float(losses[0]), "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": tokens_per_step / step_time, "step_time_ms": step_time * 1e3,
                  "world_size": world_size, "skipped": flags.overflow}
        loop.applied(step, record)  # no collective since the update: survivors agree on `step`
        record.update(obs.end_step(step))  # allreduce_pct, overlap_pct, net_bw_gbps, ...
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            record["val_loss"] = evaluate(engine if hybrid else model, world, corpus.val, args,
                                          data_rank, data_size)
        if rank == 0:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", **({"val": f"{record['val_loss']:.3f}"}
                                                              if "val_loss" in record else {}))
            if metrics:
                metrics.write(metrics_line(record))
                metrics.flush()
        ckpt_now = args.ckpt_dir and ((args.ckpt_every and step % args.ckpt_every == 0)
                                      or step == last_step or flags.stop)
        if log:
            log.step(step, record, sampler.samples_consumed, sync=ckpt_now)  # durable before commit
        if ckpt_now:
            loop.phase("save", step)
            with obs.span("checkpoint", "checkpoint"):
                pending = save(world, args, step, cfg, model, engine, sampler, rng, pending,
                               record["loss"])
        if flags.stop:  # pre-empted or interrupted: every rank stops after this step
            record["preempted"], last_step = True, step
            record["interrupted"] = not flags.preempt  # only Ctrl-C (SIGINT/SIGUSR2) on every rank
            break
    with obs.span("checkpoint", "checkpoint"):
        finish_save(world, model, pending)
    obs.close(engine)  # rank 0: merged timeline, bottleneck verdict, run directory
    bar.close()
    if log:
        log.close()
    elapsed = time.perf_counter() - start
    steps_run = last_step - start_step + 1
    sample = last_step == args.steps and args.sample_tokens
    full = engine.full_params() if sample else None  # every rank: a gather at ZeRO stage 3
    if rank == 0:
        val = f", val_loss {record['val_loss']:.3f}" if "val_loss" in record else ""
        since = f" (steps {start_step}-{last_step}: this attempt)" if elastic.shrinks() else ""
        print(f"done: {_count(steps_run, 'step')}{since} in {elapsed:.1f} s, "
              f"{steps_run * tokens_per_step / elapsed:.0f} tokens/s, "
              f"final loss {record['loss']:.3f}{val} nats/byte", flush=True)
        if last_step < args.steps:
            why = ("interrupted by Ctrl-C" if record.get("interrupted") else "pre-empted"
                   if record.get("preempted") else "--stop-after-step")
            saved = (f"checkpoint of step {last_step} committed in {args.ckpt_dir}; continue with "
                     f"--resume up to step {args.steps}" if args.ckpt_dir else
                     "no --ckpt-dir: nothing saved, a rerun starts at step 1")
            print(f"stopped after step {last_step} ({why}); {saved}", flush=True)
        elif sample:
            prompt = encode("def ")[None, :].astype(np.int64)
            sampler_model = GPT(cfg, seed=args.seed)  # a plain local copy: generation talks to no one
            sampler_model.load_flat(full)
            out = sampler_model.generate(prompt, args.sample_tokens, temperature=0.8, top_k=40,
                                         rng=np.random.default_rng(args.seed))
            print("---- sample ----\n" + printable(decode(to_host(out[0])))
                  + "\n----------------", flush=True)
    if metrics:
        metrics.close()
    if args.offload == "nvme":
        engine.close()  # removes this rank's offload files
    if skipped_steps == steps_run or not math.isfinite(record["loss"]):  # agreed on every rank
        why = (f"every step of this run ({_count(steps_run, 'step')}) was skipped: the gradients "
               "were not finite" if skipped_steps == steps_run else
               f"the loss is {record['loss']} after step {last_step} ({skipped_steps} of "
               f"{_count(steps_run, 'step')} skipped)")
        record["diverged"] = f"{why}; try a lower --lr (now {args.lr:g})"
    return record


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
    try:
        if args.timeout_s is not None and not args.timeout_s > 0:
            raise ConfigError(f"--timeout-s must be > 0 seconds, got {args.timeout_s}")
        elastic.configure(policy=args.elastic, min_ranks=args.min_ranks,
                          stuck_timeout_s=args.stuck_timeout_s)
        record = elastic.run(train, args)  # --elastic shrink: re-entered on the survivors
    except DirectoryLocked as exc:  # every rank says it: each node's log shows why its ranks left
        print(f"error: rank {rtxmpi.world().rank}: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    except ConfigError as exc:
        if _is_rank0():
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    except CheckpointError as exc:  # raised on every rank together (e.g. resume parity)
        if _is_rank0():
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CHECKPOINT)
    finally:
        release_all()  # the --ckpt-dir lock, once the last checkpoint is committed
    if record and record.get("diverged"):  # every rank: the skips and the loss are agreed
        if _is_rank0():
            print(f"error: training diverged: {record['diverged']}", file=sys.stderr, flush=True)
        sys.exit(EXIT_DIVERGED)
    if record and record.get("interrupted"):  # every rank: the stop was agreed
        sys.exit(EXIT_INTERRUPTED)
    if record and record.get("preempted"):
        if args.requeue and rtxmpi.world().rank == 0:
            print(elastic.requeue(), flush=True)
        sys.exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    elastic.exit_after(main)  # main()'s exit status; after a shrink, no MPI_Finalize (docs/elastic.md)
