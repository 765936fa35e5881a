"""TrainConfig: the training loop's settings (rtxmpi.train.fit), validated once.

What differs per model (the model, its engine, its data, its evaluation) is the Task's
(rtxmpi.train.task); everything here is the same for every model: the step count and learning-rate
schedule, gradient clipping and accumulation, evaluation cadence, checkpoints and resume, the
write-ahead log, metrics, pre-emption and elastic recovery.
"""
import math
import os
import tempfile
from dataclasses import dataclass, field, fields

from rtxmpi.checkpoint.prune import check_keep_last
from rtxmpi.elastic import POLICIES
from rtxmpi.errors import ConfigError


@dataclass
class TrainConfig:
    """The loop's settings. Units: steps are 1-based optimizer steps; *_s seconds.

    steps: the step the run ends at (the schedule's length). global_batch: samples per step over
    every data-parallel rank (a split that is not even is weighted by samples). micro_batches:
    gradient accumulation per step (with a pipeline engine: its micro-batches).
    lr, min_lr (None: lr / 10), warmup_steps (None: max(1, steps // 20)): linear warm-up, then
    cosine decay to min_lr (rtxmpi.nn.cosine_lr). grad_clip: global gradient-norm clip (0: off).
    seed: the run's seed (the per-rank generator is (seed, rank)). eval_every: Task.evaluate every
    N steps and at the last (0: only at the last).
    ckpt_dir: sharded checkpoints (docs/checkpoint.md), locked for the run; ckpt_every: after
    every K-th step and at the end (0: only at the end); async_save: written in the background,
    committed at the next checkpoint or the end; resume: continue from the newest committed
    checkpoint that verifies (resume_strict: refuse when the newest does not); keep_last: after
    each commit remove this run's committed checkpoints but the K newest, never the one resumed
    from nor another run's (None: keep all; rtxmpi.checkpoint.prune);
    stop_after_step: end after that step with a checkpoint, as if pre-empted.
    wal_every: the write-ahead log ckpt_dir/wal.h5 is made durable with a parameter digest every
    K steps; deterministic: a resume re-runs the logged steps and checks them bit for bit.
    metrics_jsonl: one JSON line per step (rank 0); run_dir: metrics.jsonl, timeline and report
    files for `rtxmpi report`; timeline, metrics_port, metrics_bind, metrics_textfile: the
    Observer's outputs (docs/observe.md). run_info: JSON-able dict stored in the run directory.
    timeout_s: deadline of every collective wait. elastic: "off", "shrink", "grow" or "restart";
    min_ranks: fewest ranks a shrink goes on with; stuck_timeout_s: heartbeat deadline;
    grow_retry_s: "grow" with no free slot: seconds between spawn attempts; grow_hosts: a file
    of HOST[:SLOTS] lines, re-read at each attempt, added to the allocation. max_ranks: the most
    ranks `rtxmpi join` may grow the job to (None: 4 x the launch's world size); join requests
    are read from ckpt_dir (docs/elastic.md, "Join").
    requeue: after a pre-emption, `scontrol requeue` the Slurm job (rank 0). progress: a
    progress bar on rank 0. log_every: rank 0 prints "step S loss L lr R T s" after every K-th
    step and the last (0: never).
    names: how messages name a field (default: the field's own name), e.g. a command line maps
    "ckpt_dir" to "--ckpt-dir" so that its users read the flag they typed.
    """

    steps: int = 300
    global_batch: int = 32
    micro_batches: int = 1
    lr: float = 3e-3
    min_lr: float = None
    warmup_steps: int = None
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    ckpt_dir: str = None
    ckpt_every: int = 0
    async_save: bool = False
    resume: bool = False
    resume_strict: bool = False
    keep_last: int = None
    stop_after_step: int = None
    wal_every: int = 10
    deterministic: bool = False
    metrics_jsonl: str = None
    run_dir: str = None
    timeline: str = None
    metrics_port: int = None
    metrics_bind: str = "127.0.0.1"
    metrics_textfile: str = None
    run_info: dict = None
    timeout_s: float = None
    elastic: str = "off"
    min_ranks: int = 1
    stuck_timeout_s: float = None
    grow_retry_s: float = 30.0
    grow_hosts: str = None
    max_ranks: int = None
    requeue: bool = False
    progress: bool = True
    log_every: int = 0
    names: dict = field(default_factory=dict, repr=False)

    def name(self, field_name):
        """How messages call `field_name`: names[field_name], else the name itself."""
        return self.names.get(field_name, field_name)

    @property
    def final_lr(self):
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def warmup(self):
        return max(1, self.steps // 20) if self.warmup_steps is None else self.warmup_steps

    @property
    def metrics_path(self):
        """Where rank 0 appends the metrics lines: metrics_jsonl, else run_dir/metrics.jsonl, else
        None."""
        if self.metrics_jsonl is None and self.run_dir:
            return os.path.join(self.run_dir, "metrics.jsonl")
        return self.metrics_jsonl

    @property
    def last_step(self):
        """The step this run ends at: stop_after_step, else steps."""
        return self.steps if self.stop_after_step is None else self.stop_after_step

    def validate(self, world_size):
        """Check the settings against each other and `world_size`; probes that ckpt_dir can be
        written (or made) and metrics_jsonl's folder. Local. Raises ConfigError naming the
        field (as `names` spells it) and the value."""
        n = self.name
        for key in ("steps", "global_batch", "micro_batches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{n(key)} must be >= 1, got {getattr(self, key)}")
        if self.eval_every < 0:
            raise ConfigError(f"{n('eval_every')} must be >= 0, got {self.eval_every}")
        if self.seed < 0:  # numpy's generators take non-negative seeds
            raise ConfigError(f"{n('seed')} must be >= 0, got {self.seed}")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"{n('lr')} must be finite and > 0, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"{n('min_lr')} {self.min_lr} must be in [0, {n('lr')} {self.lr}]")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"{n('warmup_steps')} {self.warmup_steps} must be in [0, "
                              f"{n('steps')} {self.steps}]")
        if not 0 <= self.grad_clip < math.inf:
            raise ConfigError(f"{n('grad_clip')} must be finite and >= 0 ({n('grad_clip')} 0: no "
                              f"clipping), got {self.grad_clip}")
        if self.metrics_jsonl is not None:
            folder = os.path.dirname(os.path.abspath(self.metrics_jsonl))
            if (os.path.isdir(self.metrics_jsonl) or not os.path.isdir(folder)
                    or not os.access(folder, os.W_OK)):
                raise ConfigError(f"{n('metrics_jsonl')} {self.metrics_jsonl}: not a writable file path")
        if self.ckpt_every < 0:
            raise ConfigError(f"{n('ckpt_every')} must be >= 0, got {self.ckpt_every}")
        if self.ckpt_dir is not None:
            check_ckpt_dir(self.ckpt_dir, n("ckpt_dir"))
        check_keep_last(self.keep_last, n("keep_last"))
        if self.resume_strict and not self.resume:
            raise ConfigError(f"{n('resume_strict')} needs {n('resume')}")
        if self.ckpt_dir is None and (self.ckpt_every or self.resume or self.stop_after_step
                                      or self.async_save or self.keep_last):
            key = ("ckpt_every" if self.ckpt_every else "resume" if self.resume else
                   "async_save" if self.async_save else "keep_last" if self.keep_last else
                   "stop_after_step")
            raise ConfigError(f"{n(key)} needs {n('ckpt_dir')} DIR")
        if self.stop_after_step is not None and not 1 <= self.stop_after_step <= self.steps:
            raise ConfigError(f"{n('stop_after_step')} {self.stop_after_step} must be in [1, "
                              f"{n('steps')} {self.steps}]")
        if not 1 <= self.min_ranks <= world_size:
            raise ConfigError(f"{n('min_ranks')} {self.min_ranks} must be in [1, world_size {world_size}]")
        if self.log_every < 0:
            raise ConfigError(f"{n('log_every')} must be >= 0, got {self.log_every}")
        if self.wal_every < 1:
            raise ConfigError(f"{n('wal_every')} must be >= 1, got {self.wal_every}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"{n('timeout_s')} must be > 0 seconds, got {self.timeout_s}")
        if not self.grow_retry_s > 0:
            raise ConfigError(f"{n('grow_retry_s')} must be > 0 seconds, got {self.grow_retry_s}")
        if self.max_ranks is not None and (isinstance(self.max_ranks, bool)
                                           or not isinstance(self.max_ranks, int)
                                           or self.max_ranks < world_size):
            raise ConfigError(f"{n('max_ranks')} {self.max_ranks} must be an int >= world_size "
                              f"{world_size}")
        if self.elastic not in POLICIES:
            raise ConfigError(f"{n('elastic')} {self.elastic!r}: use one of {', '.join(POLICIES)}")


def flag_names(prefix="--"):
    """names for TrainConfig when its fields come from command-line flags of the same names:
    {"ckpt_dir": "--ckpt-dir", ...}."""
    return {f.name: prefix + f.name.replace("_", "-") for f in fields(TrainConfig)}


def check_ckpt_dir(path, name="ckpt_dir"):
    """ckpt_dir: a directory this process can write in, or one it can create (the nearest
    existing parent is a directory it can write in). Probed with a temporary directory, removed
    at once; nothing is created otherwise. Raises ConfigError naming `name` and the system's
    reason."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{name} {path}: {existing} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rtxmpi-probe-", dir=existing))
    except OSError as exc:
        where = ("cannot be written" if existing == os.path.abspath(path) else
                 f"cannot be created (in {existing})")
        raise ConfigError(f"{name} {path}: the directory {where}: {exc.strerror or exc}") from None
