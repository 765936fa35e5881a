"""`save_checkpoint`: every rank writes its shard file; the coordinator commits with metadata.json.

Protocol (docs/design.md, "Invariants": nothing lost):
 1. ranks agree that they pass the same tensors (names, global sizes, dtypes);
 2. the coordinator (rank 0) clears an uncommitted directory of this step left by a crash;
 3. every rank writes `rank_xxxxx.h5.tmp`, fsyncs it and renames it to `rank_xxxxx.h5`;
 4. the ranks agree that every write succeeded and gather the piece table (offset, length, crc);
 5. the coordinator checks the pieces cover each tensor exactly, writes `metadata.json.tmp`,
    fsyncs, renames, fsyncs the step directory, then replaces `CKPT/latest` (tmp + fsync + rename)
    and fsyncs CKPT, which also makes step 2's new directory entry durable; save returns after it.
A failure anywhere raises CheckpointError on every rank and leaves no metadata.json, so the
previous committed checkpoint (and `latest`) stays as it was.

Asynchronous save (`async_save=True`): steps 1-2 run in the call, which then copies this rank's
pieces and rank_state into host buffers and returns an `AsyncSave`; a background thread does step
3 (no collectives there); `AsyncSave.finish()`, collective and called from the training thread,
waits for the write and does steps 4-5. At most one async save is in flight per process: a new
save (sync or async) first finishes the previous one.
"""
import copy
import json
import os
import shutil
import sys
import threading
import time
import zlib

import numpy as np

from rtxmpi.checkpoint import format as fmt
from rtxmpi.checkpoint.agree import raise_if_any_failed
from rtxmpi.checkpoint.metadata import read_metadata
from rtxmpi.checkpoint.shard import Shard
from rtxmpi.errors import CheckpointError

CRASH_ENV = "RTXMPI_TEST_CRASH_IN_SAVE"  # test-only: "rank:step" -> os._exit after the tmp write


def _crash_hook(rank, step):
    """Test-only fault injection: with RTXMPI_TEST_CRASH_IN_SAVE="rank:step", that rank dies
    (os._exit(17)) at that step right after writing and fsyncing its tmp file, before the rename."""
    spec = os.environ.get(CRASH_ENV)
    if spec and spec == f"{rank}:{step}":
        os._exit(17)


def _signature(shards):
    table = sorted((name, s.global_size, np.dtype(getattr(s.data, "dtype", "V")).str)
                   for name, s in shards.items())
    return table, zlib.crc32(json.dumps(table).encode())


def _check_same_tensors(group, shards, error, what):
    """One all_gather of (this rank failed, signature): raises CheckpointError on every rank when
    any rank passed `error` (its message, via raise_if_any_failed) or the signatures differ."""
    if group is None:
        raise_if_any_failed(None, error, what)
        return
    table, crc = _signature(shards) if error is None else ([], 0)
    rows = group.all_gather(np.array([error is not None, crc], np.int64)).reshape(-1, 2)
    if rows[:, 0].any():
        raise_if_any_failed(group, error, what)  # every rank takes this branch alike
    if (rows[:, 1] != rows[0, 1]).any():
        raise CheckpointError(f"{what}: ranks passed different tensors (names, global sizes or "
                              f"dtypes); rank {group.rank} passed {table}")


def _prepare_dir(ckpt_dir, step_dir, overwrite, run_id):
    os.makedirs(ckpt_dir, exist_ok=True)
    if os.path.exists(step_dir):
        if fmt.is_committed(step_dir):
            if not overwrite:
                raise CheckpointError(f"{step_dir} is already a committed checkpoint; pass "
                                      f"overwrite=True or save another step")
            try:
                written_by = read_metadata(step_dir)[0].get("run_id")
            except CheckpointError as exc:  # not a usable checkpoint (the resume skipped it):
                written_by = run_id  # replaced, under this job's lock of the directory
                print(f"warning: replacing {step_dir}, which does not verify: {exc}",
                      file=sys.stderr, flush=True)
            if written_by != run_id:
                raise CheckpointError(f"{step_dir} is a committed checkpoint of run {written_by}, "
                                      f"this is run {run_id}: a save never replaces another run's "
                                      f"checkpoint; use another checkpoint directory")
            os.remove(os.path.join(step_dir, fmt.METADATA))  # de-commit first, then clear
            fmt.fsync_path(step_dir)
        shutil.rmtree(step_dir)
    os.makedirs(step_dir)  # its entry in ckpt_dir is made durable by the commit's last fsync


def _metadata(step, world_size, names, pieces, file_bytes, dtypes, sizes, meta, run_id):
    """Build metadata.json's dict from the gathered piece table; checks exact coverage."""
    tensors = {}
    for t, name in enumerate(names):
        entries = []
        for r in range(world_size):
            offset, length, crc = (int(v) for v in pieces[r, t])
            if length:
                entries.append({"file": fmt.rank_file_name(r), "offset": offset, "length": length,
                                "checksum": fmt.format_checksum(crc)})
        entries.sort(key=lambda e: e["offset"])
        covered = 0
        for e in entries:
            if e["offset"] != covered:
                raise CheckpointError(f"tensor {name!r}: pieces leave a gap or overlap at element "
                                      f"{covered} (next piece starts at {e['offset']})")
            covered += e["length"]
        if covered != sizes[name]:
            raise CheckpointError(f"tensor {name!r}: pieces cover {covered} of {sizes[name]} elements")
        tensors[name] = {"dtype": dtypes[name], "global_size": sizes[name], "pieces": entries}
    files = {fmt.rank_file_name(r): {"rank": r, "bytes": int(file_bytes[r])} for r in range(world_size)}
    return {"format_version": fmt.FORMAT_VERSION, "step": int(step), "world_size": world_size,
            "created_unix": time.time(), "files": files, "tensors": tensors, "meta": meta,
            "run_id": run_id}


def _begin(group, ckpt_dir, step_dir, shards, meta, overwrite, run_id, what):
    """Collective steps 1-2: every rank passes the same valid tensors; rank 0 prepares step_dir."""
    rank = 0 if group is None else group.rank
    error = None
    try:
        for name, shard in shards.items():
            fmt.check_tensor_name(name)
            if not isinstance(shard, Shard):
                raise CheckpointError(f"shards[{name!r}] must be a Shard, got {type(shard).__name__}")
    except CheckpointError as exc:
        error = exc
    _check_same_tensors(group, shards, error, what)  # every rank reaches its all_gather

    error = None
    if rank == 0:
        try:
            json.dumps(meta)
            _prepare_dir(ckpt_dir, step_dir, overwrite, run_id)
        except (CheckpointError, OSError, TypeError, ValueError) as exc:
            error = exc
    raise_if_any_failed(group, error, what)


def _write(step_dir, rank, step, shards, rank_state):
    """Step 3, local (no collectives: safe on a background thread): write tmp, fsync, rename.
    Returns (error or None, {name: written entry}, file bytes)."""
    path = os.path.join(step_dir, fmt.rank_file_name(rank))
    try:
        written = fmt.write_rank_file(path + fmt.TMP_SUFFIX, shards, rank_state)
        _crash_hook(rank, step)
        os.replace(path + fmt.TMP_SUFFIX, path)
        fmt.fsync_path(step_dir)
        return None, written, os.path.getsize(path)
    except Exception as exc:  # noqa: BLE001 - any failure of any rank must reach every rank
        return CheckpointError(f"{path}: write failed: {type(exc).__name__}: {exc}"), {}, 0


def _commit(group, ckpt_dir, step_dir, step, names, write_result, meta, run_id, what):
    """Collective steps 4-5: agree the writes succeeded, gather the piece table, rank 0 commits."""
    rank, world_size = (0, 1) if group is None else (group.rank, group.world_size)
    error, written, file_bytes = write_result
    # one all_gather: row 0 = (file bytes, this rank's write failed, 0), then the piece table
    local = np.zeros((1 + len(names), 3), np.int64)
    local[0, :2] = file_bytes, error is not None
    if error is None:
        for t, name in enumerate(names):
            w = written[name]
            local[1 + t] = (w["offset"], w["length"], int(w["checksum"].split(":")[1], 16))
    table = local[None] if group is None else group.all_gather(local).reshape(world_size, -1, 3)
    if table[:, 0, 1].any():
        raise_if_any_failed(group, error, what)  # every rank takes this branch alike

    error = None
    if rank == 0:
        try:
            dtypes = {n: written[n]["dtype"] for n in names}
            sizes = {n: written[n]["global_size"] for n in names}
            metadata = _metadata(step, world_size, names, table[:, 1:], table[:, 0, 0], dtypes,
                                 sizes, meta, run_id)
            fmt.write_metadata(step_dir, metadata)
            fmt.write_latest(ckpt_dir, step)
        except (CheckpointError, OSError, TypeError, ValueError) as exc:
            error = exc
    raise_if_any_failed(group, error, what)
    return step_dir


def _snapshot(shards, rank_state):
    """Host copies of this rank's pieces and rank_state: later training cannot change them."""
    copies = {name: Shard(np.array(fmt.as_host(s.data), copy=True), s.global_offset, s.global_size)
              for name, s in shards.items()}
    return copies, copy.deepcopy(rank_state)


class AsyncSave:
    """An asynchronous checkpoint save in flight (returned by `save_checkpoint(async_save=True)`).

    done(): local, non-blocking: this rank's background write has ended (well or not).
    finish(timeout_s=None): collective, from the thread that makes the group's other collectives:
    waits up to timeout_s (default the group's timeout_s) for this rank's write, agrees that every
    rank's write succeeded, gathers the piece table and rank 0 commits (metadata.json, latest).
    Returns the committed step dir; a second call returns it again (or re-raises). Raises
    CheckpointError on every rank when any rank's write failed or timed out; nothing is committed.
    """

    def __init__(self, group, ckpt_dir, step_dir, step, names, meta, run_id, what):
        self.group, self.ckpt_dir, self.path, self.step = group, ckpt_dir, step_dir, step
        self._names, self._meta, self._run_id, self._what = names, meta, run_id, what
        self._result, self._outcome, self._thread = None, None, None

    def _start(self, shards, rank_state):
        rank = 0 if self.group is None else self.group.rank

        def run():
            self._result = _write(self.path, rank, self.step, shards, rank_state)

        self._thread = threading.Thread(target=run, name=f"rtxmpi-ckpt-{self.step}", daemon=True)
        self._thread.start()

    def done(self):
        return not self._thread.is_alive()

    def finish(self, timeout_s=None):
        global _IN_FLIGHT
        if self._outcome is not None:
            if isinstance(self._outcome, BaseException):
                raise self._outcome
            return self._outcome
        if _IN_FLIGHT is self:
            _IN_FLIGHT = None
        if timeout_s is None:
            timeout_s = getattr(self.group, "timeout_s", None)
        self._thread.join(timeout_s)
        result = self._result
        if self._thread.is_alive():
            result = (CheckpointError(f"{self.path}: background write of rank "
                                      f"{0 if self.group is None else self.group.rank} not done "
                                      f"after {timeout_s} s"), {}, 0)
        try:
            self._outcome = _commit(self.group, self.ckpt_dir, self.path, self.step, self._names,
                                    result, self._meta, self._run_id, self._what)
        except CheckpointError as exc:
            self._outcome = exc
            raise
        return self._outcome


_IN_FLIGHT = None  # the AsyncSave not yet finished, if any (at most one per process)


def finish_pending():
    """Collective: finish the async save in flight, if any (every rank has one or none alike).
    Returns its committed step dir, or None. Raises CheckpointError as AsyncSave.finish."""
    pending = _IN_FLIGHT
    return None if pending is None else pending.finish()


def save_checkpoint(group, ckpt_dir, step, shards, meta=None, rank_state=None, *, overwrite=False,
                    async_save=False, run_id=None):
    """Write and commit checkpoint `step` in `ckpt_dir`; returns the committed step dir path
    (async_save: an `AsyncSave` handle whose finish() commits).

    group: the ProcessGroup whose ranks each write one file (None: a single process, rank 0).
    shards: {name: Shard}, the same names on every rank; each rank passes the pieces it owns of
    every named global 1-D tensor (an empty Shard where it owns nothing); together the pieces must
    cover each tensor exactly once. For data parallelism use `Shard.even(full, rank, size)`.
    meta: JSON-able dict (rank 0's is stored in metadata.json). rank_state: this rank's small
    JSON-able values and small numpy arrays (top-level keys), stored in its own file.
    overwrite: replace an already committed checkpoint of the same step (default: refuse); only
    one whose metadata.json has the same run_id (a run never replaces another run's step).
    run_id: str or None (rank 0's is stored in metadata.json as "run_id"), the run's lineage.
    async_save: copy this rank's pieces to host memory (the caller may then change its arrays),
    write them on a background thread and return at once; call `.finish()` later (collective).
    Collective: every rank of `group` must call. Tensors are written one at a time. An async
    save still in flight is finished first (its failure is raised here, before this save starts).
    Raises CheckpointError on every rank when any rank fails (nothing is committed then).
    """
    finish_pending()
    rank = 0 if group is None else group.rank
    ckpt_dir = os.path.abspath(ckpt_dir)
    step_dir = os.path.join(ckpt_dir, fmt.step_dir_name(step))
    what = f"saving checkpoint {step_dir}"
    meta = {} if meta is None else meta
    _begin(group, ckpt_dir, step_dir, shards, meta, overwrite, run_id, what)
    names = sorted(shards)
    if not async_save:
        return _commit(group, ckpt_dir, step_dir, step, names,
                       _write(step_dir, rank, step, shards, rank_state), meta, run_id, what)
    global _IN_FLIGHT
    error, snapshot = None, None
    try:
        snapshot = _snapshot(shards, rank_state)
    except Exception as exc:  # noqa: BLE001 - e.g. out of host memory: every rank must know
        error = CheckpointError(f"{what}: host snapshot failed: {type(exc).__name__}: {exc}")
    raise_if_any_failed(group, error, what)
    handle = AsyncSave(group, ckpt_dir, step_dir, step, names, copy.deepcopy(meta), run_id, what)
    handle._start(*snapshot)
    _IN_FLIGHT = handle
    return handle
