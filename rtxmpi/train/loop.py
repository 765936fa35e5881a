"""fit(task, config): the training loop every model gets (docs/training.md).

    record = fit(MyTask(...), TrainConfig(steps=100, ckpt_dir="ck", resume=True))

One attempt: the task's layout and parts, the ckpt_dir lock, resume (or the survivors' state
after an elastic shrink), then per step: the sampler's batch, forward and backward over the
micro-batches, the global gradient norm, one agreed reduction (a non-finite gradient on any rank
skips the step everywhere; a pre-emption signal or Ctrl-C on any rank stops every rank after
it), the clipped optimizer step on the cosine schedule, the metrics line, evaluation, the
write-ahead log and checkpoints. elastic.run re-enters the attempt on the survivors after a
rank failure under config.elastic == "shrink".
"""
import math
import sys
import time
from dataclasses import replace

import numpy as np
from tqdm import tqdm

import rtxmpi
from rtxmpi import elastic
from rtxmpi.backend import to_host
from rtxmpi.checkpoint import latest_step
from rtxmpi.checkpoint.lock import release_all
from rtxmpi.comm.failure import ulfm_enabled
from rtxmpi.errors import ConfigError
from rtxmpi.nn import cosine_lr
from rtxmpi.observe.observer import Observer
from rtxmpi.parallel.data import weighted_micro_batches
from rtxmpi.parallel.replica import replica_pieces
from rtxmpi.train.checkpointing import Checkpoints, lock_ckpt_dir
from rtxmpi.train.metrics import count, drop_metrics_after, last_logged_step, metrics_line
from rtxmpi.train.steplog import StepLog, check_deterministic


def fit(task, config):
    """Train `task` (rtxmpi.train.Task) with `config` (rtxmpi.train.TrainConfig) on every rank of
    the job; initializes rtxmpi (config.timeout_s) when it is not yet. Every rank calls it.

    Returns the final step's record (dict: step, loss, lr, grad_norm, tokens_per_s, step_time_ms,
    world_size, skipped, val_loss when evaluated, and the observer's fields), the same on every
    rank, with "preempted" set when a signal (SIGTERM, SIGUSR1, SIGINT) stopped every rank after
    a committed checkpoint, "interrupted" also for Ctrl-C (SIGINT), and "diverged" (a sentence)
    when every step of the run was skipped or the final loss is not finite; None when the
    checkpoint resumed from is already at the last step.
    Raises ConfigError (a setting), DirectoryLocked (another job holds ckpt_dir),
    CheckpointError (a checkpoint or the write-ahead log), RankFailure (a lost rank that was not
    survived); each on every rank. The ckpt_dir lock is released on return or error.
    """
    return Trainer(task, config).fit()


class Trainer:
    """One run of `task` with `config`; fit() runs it (see rtxmpi.train.fit). What outlives an
    attempt (an elastic shrink re-enters `attempt` on the survivors) lives here: the run id."""

    def __init__(self, task, config):
        self.task, self.config, self.run_id = task, config, None

    def fit(self):
        config = self.config
        try:
            if config.timeout_s is not None and not config.timeout_s > 0:  # before rtxmpi.init
                raise ConfigError(f"{config.name('timeout_s')} must be > 0 seconds, got {config.timeout_s}")
            elastic.configure(policy=config.elastic, min_ranks=config.min_ranks,
                              stuck_timeout_s=config.stuck_timeout_s,
                              grow_retry_s=config.grow_retry_s, grow_hosts=config.grow_hosts,
                              join_dir=config.ckpt_dir, max_ranks=config.max_ranks)
            return elastic.run(self.attempt, config)  # elastic.run sets config.resume after a shrink
        finally:
            release_all()  # the ckpt_dir lock, once the last checkpoint is committed

    def attempt(self, config):
        """One attempt of the run on the current world (see the module doc). Collective."""
        world = rtxmpi.init(timeout_s=config.timeout_s)
        rank, task = world.rank, self.task
        config = task.configure(world, config)
        config.validate(world.world_size)
        dir_existed = True
        if config.ckpt_dir:
            dir_existed, self.run_id = lock_ckpt_dir(world, config, self.run_id)
        parts = task.build(world, config)
        engine, sampler = parts.engine, parts.sampler
        data_rank, data_size = ((rank, world.world_size) if parts.data_size is None
                                else (parts.data_rank, parts.data_size))
        parts = replace(parts, data_rank=data_rank, data_size=data_size)
        rng = np.random.default_rng([config.seed, rank])  # per-rank randomness, checkpointed
        obs = Observer(world, timeline=config.timeline, run_dir=config.run_dir,
                       metrics_port=config.metrics_port, metrics_bind=config.metrics_bind,
                       metrics_textfile=config.metrics_textfile,
                       metrics_jsonl=bool(config.metrics_path), job=task.name,
                       tokens_per_step=parts.tokens_per_step, bucket_mb=parts.bucket_mb,
                       run_info=config.run_info, names=config.names)  # docs/observe.md
        obs.instrument(engine=engine, sampler=sampler)
        metrics_path = config.metrics_path
        metrics = open(metrics_path, "a") if rank == 0 and metrics_path else None
        if rank == 0:
            print(task.describe(world, parts, config), flush=True)
            if config.elastic in ("shrink", "grow") and ulfm_enabled() is False:
                print(f"warning: {config.name('elastic')} {config.elastic} without fault-tolerant MPI: a lost "
                      "rank ends the job (CollectiveTimeout) instead of shrinking; launch with "
                      "mpiexec --with-ft ulfm (docs/elastic.md)", file=sys.stderr, flush=True)
        if config.deterministic:
            check_deterministic(world, config)
        ckpts = Checkpoints(world, config, task, parts, rng, self.run_id)
        replica = elastic.recovered_state()  # after an elastic shrink: the surviving replica's state
        start_step = (ckpts.restore(replica) if replica else
                      ckpts.resume(dir_existed) if config.ckpt_dir else 0) + 1
        self.run_id = ckpts.run_id
        last_step = config.last_step
        if replica is not None:  # the failure may have cut the tail of that step short
            self._finish_recovered_step(world, config, replica, metrics, last_step, ckpts)
        elif (elastic.resizes() or config.resume) and metrics is not None:  # steps after it re-run
            drop_metrics_after(metrics_path, start_step - 1)
        if start_step > last_step:
            if rank == 0:
                print(f"nothing to do: the checkpoint is at step {start_step - 1} >= "
                      f"{config.name('steps' if last_step == config.steps else 'stop_after_step')} "
                      f"{last_step}", flush=True)
            return None
        log = (StepLog(world, config, engine, start_step - 1, sampler.samples_consumed, ckpts.loss)
               if config.ckpt_dir else None)
        bar = tqdm(total=config.steps, initial=start_step - 1, disable=rank != 0 or not config.progress,
                   unit="step", mininterval=1.0)
        start = time.perf_counter()
        skipped_steps = 0  # agreed overflow skips: the same count on every rank
        micro_batches = config.micro_batches
        loop = elastic.Loop(world)  # pre-emption, phases, what survivors hand over (docs/elastic.md)
        loop.track(meta=ckpts.meta, tensors=engine.pieces if parts.replica == "tensors" else None,
                   pieces=(lambda: replica_pieces(engine)) if parts.replica == "pieces" else None,
                   close=(log, metrics, bar), step=start_step - 1)  # the next attempt's bar starts afresh
        for step in range(start_step, last_step + 1):
            obs.begin_step(step)
            t0 = time.perf_counter()
            loop.phase("forward", step)
            x, y = sampler.next_batch()
            # a pipeline engine's schedule runs every micro-batch's forward and backward
            loss_sum = engine.train_step(x, y) * micro_batches if parts.pipelined else 0.0
            # weighted by samples when the global batch splits unevenly (scale 1/k, weight 1.0 if not)
            micro = [] if parts.pipelined else weighted_micro_batches(x, y, micro_batches,
                                                                      config.global_batch, data_size)
            for m, (x_m, y_m, scale, weight) in enumerate(micro):
                loss, cache = engine.forward(x_m, y_m)
                loss_sum += loss * weight
                loop.phase("backward", step)
                if m < micro_batches - 1:
                    with engine.no_sync():
                        engine.backward(cache, scale=scale)
                else:
                    engine.backward(cache, scale=scale)
            grad_norm = engine.grad_norm()  # global: the same on every rank
            lr = cosine_lr(step, config.lr, config.warmup, config.steps, config.final_lr)
            losses = np.array([to_host(loss_sum / micro_batches)])
            world.all_reduce(losses, op="avg")
            flags = loop.agree(overflow=not math.isfinite(grad_norm))  # + stop: a signal on any rank
            if flags.overflow:
                engine.zero_grad()  # every rank skips the step: a non-finite gradient somewhere
                skipped_steps += 1
            else:
                engine.step(lr=lr, max_grad_norm=config.grad_clip or None, total_norm=grad_norm)
            step_time = time.perf_counter() - t0
            record = {"step": step, "loss": float(losses[0]), "lr": lr, "grad_norm": float(grad_norm),
                      "tokens_per_s": parts.tokens_per_step / step_time,
                      "step_time_ms": step_time * 1e3, "world_size": world.world_size,
                      "skipped": flags.overflow}
            loop.applied(step, record)  # no collective since the update: survivors agree on `step`
            record.update(obs.end_step(step))  # allreduce_pct, overlap_pct, net_bw_gbps, ...
            if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
                record["val_loss"] = task.evaluate(world, parts, config)
            if rank == 0:
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}",
                                **({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {}))
                if metrics:
                    metrics.write(metrics_line(record))
                    metrics.flush()
                if config.log_every and (step % config.log_every == 0 or step == last_step):
                    print(f"step {step} loss {record['loss']:.4f} lr {lr:.2e} "
                          f"{time.perf_counter() - start:.1f}s", flush=True)
            ckpt_now = config.ckpt_dir and ((config.ckpt_every and step % config.ckpt_every == 0)
                                            or step == last_step or flags.stop)
            if log:
                log.step(step, record, sampler.samples_consumed, sync=ckpt_now)  # durable before commit
            if ckpt_now:
                loop.phase("save", step)
                with obs.span("checkpoint", "checkpoint"):
                    ckpts.save(step, record["loss"])
            if flags.stop:  # pre-empted or interrupted: every rank stops after this step
                record["preempted"], last_step = True, step
                record["interrupted"] = not flags.preempt  # only Ctrl-C (SIGINT/SIGUSR2) on every rank
                break
        with obs.span("checkpoint", "checkpoint"):
            ckpts.finish()
        obs.close(engine)  # rank 0: merged timeline, bottleneck verdict, run directory
        bar.close()
        if log:
            log.close()
        elapsed = time.perf_counter() - start
        steps_run = last_step - start_step + 1
        if rank == 0:
            self._report(config, parts, record, start_step, last_step, elapsed)
        if last_step == config.steps:
            task.finish(world, parts, config, record)
        if metrics:
            metrics.close()
        if parts.close is not None:
            parts.close()
        if skipped_steps == steps_run or not math.isfinite(record["loss"]):  # agreed on every rank
            why = (f"every step of this run ({count(steps_run, 'step')}) was skipped: the gradients "
                   "were not finite" if skipped_steps == steps_run else
                   f"the loss is {record['loss']} after step {last_step} ({skipped_steps} of "
                   f"{count(steps_run, 'step')} skipped)")
            record["diverged"] = f"{why}; try a lower {config.name('lr')} (now {config.lr:g})"
        return record

    @staticmethod
    def _report(config, parts, record, start_step, last_step, elapsed):
        """Rank 0: the run's closing lines."""
        steps_run = last_step - start_step + 1
        val = f", val_loss {record['val_loss']:.3f}" if "val_loss" in record else ""
        since = f" (steps {start_step}-{last_step}: this attempt)" if elastic.resizes() else ""
        print(f"done: {count(steps_run, 'step')}{since} in {elapsed:.1f} s, "
              f"{steps_run * parts.tokens_per_step / elapsed:.0f} {parts.unit}/s, "
              f"final loss {record['loss']:.3f}{val}{parts.loss_unit}", flush=True)
        if last_step < config.steps:
            n = config.name
            why = ("interrupted by Ctrl-C" if record.get("interrupted") else "pre-empted"
                   if record.get("preempted") else n("stop_after_step"))
            saved = (f"checkpoint of step {last_step} committed in {config.ckpt_dir}; continue with "
                     f"{n('resume')} up to step {config.steps}" if config.ckpt_dir else
                     f"no {n('ckpt_dir')}: nothing saved, a rerun starts at step 1")
            print(f"stopped after step {last_step} ({why}); {saved}", flush=True)

    @staticmethod
    def _finish_recovered_step(world, config, replica, metrics, last_step, ckpts):
        """After an elastic shrink to the replica of step S: write S's metrics line (rank 0) and
        commit S's checkpoint when it is due, unless the failure happened after they were done."""
        record, step = replica.meta.get("record"), replica.step
        if metrics is not None and record is not None:
            logged = last_logged_step(config.metrics_path)
            if logged is None or logged < step:
                metrics.write(metrics_line(record))
                metrics.flush()
        if config.ckpt_dir and step and (step == last_step or config.ckpt_every
                                         and step % config.ckpt_every == 0):
            found = np.array([(latest_step(config.ckpt_dir) or 0) if world.rank == 0 else 0], np.int64)
            world.broadcast(found, src=0)
            if found[0] < step:
                ckpts.save(step)
