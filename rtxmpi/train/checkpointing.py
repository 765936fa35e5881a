"""The run's checkpoints in config.ckpt_dir, as the training loop uses them: the directory lock,
resume from the newest committed checkpoint that verifies, save (synchronous or in the
background) and restore (docs/checkpoint.md)."""
import difflib
import hashlib
import json
import os
import sys
import time

import numpy as np

from rtxmpi.checkpoint import Shard, latest_step, latest_valid, load_checkpoint, prune, save_checkpoint
from rtxmpi.checkpoint.agree import raise_if_any_failed
from rtxmpi.checkpoint.lock import lock_dir
from rtxmpi.errors import CheckpointError, ConfigError


def loss_bits(loss):
    """A loss as the hex of its float64 bits: exact, and JSON even when the loss is not finite."""
    return f"{int(np.float64(loss).view(np.uint64)):016x}"


def step_of(step_dir):
    return int(os.path.basename(step_dir).split("_")[1])


def lock_ckpt_dir(world, config, run_id=None):
    """Lock config.ckpt_dir for this job before anything is written there (collective; made if
    missing; rtxmpi.checkpoint.lock): another job's lock is a DirectoryLocked on every rank.
    Returns (whether the directory existed before, the run id): `run_id`, or without one a fresh
    id from the agreed lock holder (a resume replaces it with its checkpoint's)."""
    existed = np.array([os.path.isdir(config.ckpt_dir) if world.rank == 0 else 0], np.int64)
    world.broadcast(existed, src=0)
    lock = lock_dir(world, config.ckpt_dir)
    if run_id is None:
        run_id = hashlib.sha1(json.dumps(lock.holder, sort_keys=True).encode()).hexdigest()[:16]
    return bool(existed[0]), run_id


def warn_missing_ckpt_dir(config):
    """Resume with a ckpt_dir that does not exist (rank 0): not an error, since a first launch
    under `rtxmpi run` or a Slurm script asks to resume with a directory still to be made, but a
    warning on stderr naming the absolute path, and any directory next to it that holds committed
    checkpoints (a mistyped name; docs/checkpoint.md)."""
    ckpt_dir = config.ckpt_dir
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
    n = config.name
    print(f"warning: {n('resume')}: {n('ckpt_dir')} {shown} does not exist; starting fresh at "
          f"step 1 and creating it. Expected on a first launch; if you meant to continue a run, "
          f"stop now and fix {n('ckpt_dir')}"
          + (f" (checkpoints next to it: {', '.join(held[:3])})" if held else ""),
          file=sys.stderr, flush=True)


class Checkpoints:
    """Save and restore one attempt's state: the engine's shards, the sampler's position, the
    per-rank generator `rng` and the task's description of the model. Every rank holds one and
    calls each method together (they are collective). run_id: the lineage written into every
    checkpoint (a resume takes its checkpoint's). loss: the loss of the checkpoint resumed from
    (None: none, or not stored), which the write-ahead log checks. resumed_step: the step resumed
    from (None: none), which config.keep_last never removes."""

    def __init__(self, world, config, task, parts, rng, run_id):
        self.world, self.config, self.task, self.parts, self.rng = world, config, task, parts, rng
        self.run_id, self.loss, self.pending, self.resumed_step = run_id, None, None, None

    def meta(self, loss=None):
        """What a resume needs besides the flat tensors (JSON, stored in metadata.json). loss: the
        step's loss, stored as its float64 bits (hex), which a resume compares with the log's."""
        model, sampler = self.parts.model, self.parts.sampler
        return {"loss_bits": None if loss is None else loss_bits(loss), **self.task.checkpoint_meta(),
                "dtype": np.dtype(model.dtype).str,
                "param_layout": [[p.name, list(p.shape), p.offset]
                                 for p in getattr(model, "full_specs", model.params)],
                "optimizer_step": self.parts.engine.optimizer.step_count,
                "sampler": sampler.state_dict(), "samples_consumed": sampler.samples_consumed,
                "seed": self.config.seed, "global_batch": self.config.global_batch,
                "zero_stage": self.parts.zero_stage}

    def save(self, step, loss=None):
        """Commit a checkpoint of `step`: each rank writes its piece of the engine's shards and its
        generator's state. With config.async_save, first commits the previous save, then
        snapshots and leaves the new one in flight for the next save or `finish`."""
        self.finish()
        t0 = time.perf_counter()
        shards = {name: Shard(*piece) for name, piece in self.parts.engine.shards().items()}
        world = self.world
        path = save_checkpoint(world, self.config.ckpt_dir, step, shards, meta=self.meta(loss),
                               rank_state={"rank": world.rank, "world_size": world.world_size,
                                           "rng": self.rng.bit_generator.state},
                               overwrite=True, async_save=self.config.async_save, run_id=self.run_id)
        self.pending = (path, t0)  # an AsyncSave when async: committed by the next save or finish
        if not self.config.async_save:
            self.finish()

    def finish(self):
        """Commit a save in flight (CheckpointError on every rank) and report it (rank 0); with
        config.keep_last, rank 0 then removes this run's older checkpoints (`prune`; a failure is
        a CheckpointError on every rank)."""
        if self.pending is None:
            return
        (handle, t0), self.pending = self.pending, None
        path = handle if isinstance(handle, str) else handle.finish()
        if self.world.rank == 0:
            model, size = self.parts.model, self.world.world_size
            numel = getattr(model, "full_num_params", model.num_params)  # tp: the whole model's
            mb = 3 * numel * np.dtype(model.dtype).itemsize / 1e6
            print(f"checkpoint: saved step {step_of(path)} to {path} ({mb:.1f} MB over "
                  f"{size} rank file{'s' if size > 1 else ''}, {time.perf_counter() - t0:.2f} s"
                  f"{'' if isinstance(handle, str) else ' to commit, written in the background'})",
                  flush=True)
        if self.config.keep_last:
            self.prune()

    def prune(self):
        """config.keep_last: remove this run's older committed checkpoints (rank 0; collective)."""
        error, removed = None, []
        if self.world.rank == 0:
            protect = () if self.resumed_step is None else (self.resumed_step,)
            try:
                removed = prune(self.config.ckpt_dir, self.config.keep_last, self.run_id, protect)
            except CheckpointError as exc:
                error = exc
        raise_if_any_failed(self.world, error, self.config.name("keep_last"))
        if removed:
            print(f"checkpoint: removed step{'s' if len(removed) > 1 else ''} "
                  f"{', '.join(map(str, removed))} ({self.config.name('keep_last')} "
                  f"{self.config.keep_last})", flush=True)

    def resume(self, dir_existed=True):
        """With config.resume: load the newest committed checkpoint that verifies (latest_valid;
        rank 0 warns naming each newer one skipped and why; resume_strict: CheckpointError
        instead); returns its step (0: none, fresh). Any world size and ZeRO stage loads any
        other's. Without it, refuses a ckpt_dir that already holds checkpoints (ConfigError). The
        run continues the lineage of the checkpoint: it takes its run id (docs/checkpoint.md).
        dir_existed: whether ckpt_dir existed before this run locked (and so made) it."""
        world, config, n = self.world, self.config, self.config.name
        if not config.resume:
            found = np.array([-1 if world.rank else (latest_step(config.ckpt_dir) or 0)], np.int64)
            world.broadcast(found, src=0)
            if found[0] > 0:
                raise ConfigError(f"{n('ckpt_dir')} {config.ckpt_dir} already holds checkpoints "
                                  f"(latest step {found[0]}); pass {n('resume')} or use an empty "
                                  f"directory")
            return 0
        step, skipped = latest_valid(world, config.ckpt_dir, fallback=not config.resume_strict)
        if world.rank == 0:
            for path, why in skipped:
                print(f"warning: checkpoint {path} does not verify, skipped: {why}", file=sys.stderr,
                      flush=True)
        if step is None and skipped:
            raise CheckpointError(f"no checkpoint in {config.ckpt_dir} verifies ({len(skipped)} "
                                  f"committed, all corrupt; see the warnings above)")
        if not step:
            if world.rank == 0 and not dir_existed:
                warn_missing_ckpt_dir(config)
            elif world.rank == 0:
                print(f"checkpoint: no committed checkpoint in {config.ckpt_dir}; starting fresh",
                      flush=True)
            return 0
        ckpt = load_checkpoint(world, config.ckpt_dir, step=step)
        self.run_id = ckpt.metadata.get("run_id") or self.run_id
        self.resumed_step = self.restore(ckpt)
        return self.resumed_step

    def restore(self, ckpt):
        """Load `ckpt` (a loaded checkpoint, or the surviving replica's state after an elastic
        shrink) into engine, sampler and generator; returns its step (collective). The per-rank
        generator continues from its saved state at the same world size; at another, it restarts
        from (seed, rank, step) (docs/wal.md). Raises CheckpointError on every rank when the meta
        describes another model (Task.check_checkpoint) or the saved meta or rank state lacks a
        field or has one of the wrong type."""
        world, sampler, rng = self.world, self.parts.sampler, self.rng
        try:  # the meta is the same on every rank: each reaches the same verdict
            self.task.check_checkpoint(ckpt.meta, ckpt.path)
            sampler.load_state_dict(ckpt.meta["sampler"])
            bits = ckpt.meta.get("loss_bits")  # absent in a replica and in older checkpoints
            self.loss = None if bits is None else float(np.uint64(int(bits, 16)).view(np.float64))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {ckpt.path}: its meta cannot be resumed from: "
                                  f"{type(exc).__name__}: {exc}") from None
        self.parts.engine.load_shards(ckpt.read)  # reads only the slices this rank keeps
        saved, error = ckpt.rank_state(world.rank).get("rng"), None
        try:  # a rank's own state: agree on its verdict
            if saved is not None and ckpt.world_size_saved == world.world_size:
                rng.bit_generator.state = saved
            else:
                rng.bit_generator.state = np.random.default_rng(
                    [self.config.seed, world.rank, ckpt.step]).bit_generator.state
        except (KeyError, TypeError, ValueError) as exc:
            error = CheckpointError(f"checkpoint {ckpt.path}: saved generator state unusable: {exc}")
        raise_if_any_failed(world, error, "restoring the generator state")
        if world.rank == 0:
            for path in ckpt.ignored:
                print(f"checkpoint: ignoring uncommitted {path}", flush=True)
            for text in getattr(ckpt, "warnings", ()):
                print(f"warning: {text}", file=sys.stderr, flush=True)
            print(f"checkpoint: resumed from {ckpt.path} (saved at world size "
                  f"{ckpt.world_size_saved}, ZeRO stage {ckpt.meta.get('zero_stage', 0)}, "
                  f"{sampler.samples_consumed} samples consumed); continuing at step "
                  f"{ckpt.step + 1}", flush=True)
        return ckpt.step
