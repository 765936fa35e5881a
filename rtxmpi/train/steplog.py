"""The write-ahead log ckpt_dir/wal.h5 as the training loop sees it (docs/wal.md), and the
deterministic mode's check of the BLAS threads."""
import os
import sys

import numpy as np

from rtxmpi.checkpoint.agree import raise_if_any_failed
from rtxmpi.errors import CheckpointError
from rtxmpi.train.metrics import count
from rtxmpi.wal import (ResumeParity, WriteAheadLog, check_checkpoint_record, params_digest, read_wal,
                        wal_path)


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def check_deterministic(world, config):
    """config.deterministic: warn (rank 0) when numpy's BLAS may run more than one thread per rank
    (the variables are read once, when numpy loads, so they must be set before the job starts)."""
    if world.rank != 0:
        return
    loose = [f"{v}={os.environ.get(v, 'unset')}" for v in THREAD_VARIABLES
             if os.environ.get(v, "1" if v != "OMP_NUM_THREADS" else None) != "1"]
    if loose:
        print(f"warning: {config.name('deterministic')} with {', '.join(loose)}: numpy's BLAS may "
              f"use several threads, reproducible only on the same machine; export OMP_NUM_THREADS=1",
              file=sys.stderr, flush=True)
    print(f"deterministic: bitwise reproducible at world size {world.world_size} with the same "
          f"settings, MPI library and machine type (docs/wal.md)", flush=True)


class StepLog:
    """The write-ahead log ckpt_dir/wal.h5 as the loop sees it (docs/wal.md). Every rank holds one;
    rank 0 writes. A fresh run starts an empty log. A resume from the checkpoint at step C reads
    the durable records (a crashed writer's tail is simply absent) up to the last logged step L:
    without config.deterministic it keeps the records up to C and appends the re-run steps C+1..
    anew; with it, the log is left as it is while steps C+1..L are re-run and each is checked bit for bit
    against it (CheckpointError on every rank at the first difference), then it is kept up to L
    and continued at L+1."""

    def __init__(self, world, config, engine, ckpt_step, samples_consumed=0, loss=None):
        self.world, self.config, self.engine = world, config, engine
        self.samples_consumed, self.loss = samples_consumed, loss  # the checkpoint's, checked against the log
        self.path, self.wal, self.parity, self.records = wal_path(config.ckpt_dir), None, None, None
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
        config, world = self.config, self.world
        if not (config.resume and os.path.exists(self.path)):
            if config.resume and ckpt_step:
                print(f"wal: no log at {self.path}; a new one starts at step {ckpt_step + 1}", flush=True)
            os.makedirs(config.ckpt_dir, exist_ok=True)
            self.wal = WriteAheadLog(self.path, config.wal_every)
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
                if config.deterministic:
                    raise CheckpointError(message)
                print(f"wal: warning: {message}", flush=True)
        same_world = bool((logged["world_size"] == world.world_size).all())
        if len(logged) and config.deterministic and same_world:
            self.parity = ResumeParity(self.path, logged)
            print(f"wal: last logged step {last}; re-running steps {ckpt_step + 1}..{last} from the "
                  f"checkpoint and checking them bit for bit against the log", flush=True)
            return last
        self.wal = WriteAheadLog(self.path, config.wal_every, records=kept)
        if len(logged):
            why = (f"no parity check without {config.name('deterministic')}"
                   if not config.deterministic else
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
                      f"reproduce the log bit for bit ({count(len(self.parity.logged), 'loss')}, "
                      f"{count(self.parity.digests_checked, 'parameter digest')})", flush=True)
                self.wal = WriteAheadLog(self.path, self.config.wal_every,
                                         records=self.records[self.records["step"] <= step])
            return
        digest = self._digest() if sync or step % self.config.wal_every == 0 else None
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
