"""`save_checkpoint`: every rank writes its shard file; the coordinator commits with metadata.json.

Protocol (DESIGN.md, "Nothing lost"):
 1. ranks agree that they pass the same tensors (names, global sizes, dtypes);
 2. the coordinator (rank 0) clears an uncommitted directory of this step left by a crash;
 3. every rank writes `rank_xxxxx.h5.tmp`, fsyncs it and renames it to `rank_xxxxx.h5`;
 4. the ranks agree that every write succeeded and gather the piece table (offset, length, crc);
 5. the coordinator checks the pieces cover each tensor exactly, writes `metadata.json.tmp`,
    fsyncs, renames, fsyncs the directory, then replaces `CKPT/latest` (tmp + rename).
A failure anywhere raises CheckpointError on every rank and leaves no metadata.json, so the
previous committed checkpoint (and `latest`) stays as it was.
"""
import json
import os
import shutil
import time
import zlib

import numpy as np

from rtxmpi.checkpoint import format as fmt
from rtxmpi.checkpoint.agree import raise_if_any_failed
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


def _check_same_tensors(group, shards):
    table, crc = _signature(shards)
    if group is None:
        return
    crcs = group.all_gather(np.array([crc], np.int64))
    if (crcs != crcs[0]).any():
        raise CheckpointError(f"ranks passed different tensors (names, global sizes or dtypes); "
                              f"rank {group.rank} passed {table}")


def _prepare_dir(ckpt_dir, step_dir, overwrite):
    os.makedirs(ckpt_dir, exist_ok=True)
    if os.path.exists(step_dir):
        if fmt.is_committed(step_dir):
            if not overwrite:
                raise CheckpointError(f"{step_dir} is already a committed checkpoint; pass "
                                      f"overwrite=True or save another step")
            os.remove(os.path.join(step_dir, fmt.METADATA))  # de-commit first, then clear
            fmt.fsync_path(step_dir)
        shutil.rmtree(step_dir)
    os.makedirs(step_dir)
    fmt.fsync_path(ckpt_dir)


def _metadata(step, world_size, names, pieces, file_bytes, dtypes, sizes, meta):
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
            "created_unix": time.time(), "files": files, "tensors": tensors, "meta": meta}


def save_checkpoint(group, ckpt_dir, step, shards, meta=None, rank_state=None, *, overwrite=False):
    """Write and commit checkpoint `step` in `ckpt_dir`; returns the committed step dir path.

    group: the ProcessGroup whose ranks each write one file (None: a single process, rank 0).
    shards: {name: Shard}, the same names on every rank; each rank passes the pieces it owns of
    every named global 1-D tensor (an empty Shard where it owns nothing); together the pieces must
    cover each tensor exactly once. For data parallelism use `Shard.even(full, rank, size)`.
    meta: JSON-able dict (rank 0's is stored in metadata.json). rank_state: this rank's small
    JSON-able values and small numpy arrays (top-level keys), stored in its own file.
    overwrite: replace an already committed checkpoint of the same step (default: refuse).
    Collective: every rank of `group` must call. Tensors are written one at a time.
    Raises CheckpointError on every rank when any rank fails (nothing is committed then).
    """
    rank, world_size = (0, 1) if group is None else (group.rank, group.world_size)
    ckpt_dir = os.path.abspath(ckpt_dir)
    step_dir = os.path.join(ckpt_dir, fmt.step_dir_name(step))
    what = f"saving checkpoint {step_dir}"
    meta = {} if meta is None else meta

    error = None
    try:
        for name, shard in shards.items():
            fmt.check_tensor_name(name)
            if not isinstance(shard, Shard):
                raise CheckpointError(f"shards[{name!r}] must be a Shard, got {type(shard).__name__}")
    except CheckpointError as exc:
        error = exc
    raise_if_any_failed(group, error, what)
    error = None
    try:
        _check_same_tensors(group, shards)  # every rank reaches its all_gather
    except CheckpointError as exc:
        error = exc
    raise_if_any_failed(group, error, what)

    error = None
    if rank == 0:
        try:
            json.dumps(meta)
            _prepare_dir(ckpt_dir, step_dir, overwrite)
        except (CheckpointError, OSError, TypeError, ValueError) as exc:
            error = exc
    raise_if_any_failed(group, error, what)

    error, written, file_bytes = None, {}, 0
    path = os.path.join(step_dir, fmt.rank_file_name(rank))
    try:
        written = fmt.write_rank_file(path + fmt.TMP_SUFFIX, shards, rank_state)
        _crash_hook(rank, step)
        os.replace(path + fmt.TMP_SUFFIX, path)
        fmt.fsync_path(step_dir)
        file_bytes = os.path.getsize(path)
    except Exception as exc:  # noqa: BLE001 - any failure of any rank must reach every rank
        error = CheckpointError(f"{path}: write failed: {type(exc).__name__}: {exc}")
    raise_if_any_failed(group, error, what)

    names = sorted(shards)
    local = np.zeros((1 + len(names), 3), np.int64)
    local[0, 0] = file_bytes
    for t, name in enumerate(names):
        w = written[name]
        local[1 + t] = (w["offset"], w["length"], int(w["checksum"].split(":")[1], 16))
    table = local[None] if group is None else group.all_gather(local).reshape(world_size, -1, 3)

    error = None
    if rank == 0:
        try:
            dtypes = {n: written[n]["dtype"] for n in names}
            sizes = {n: written[n]["global_size"] for n in names}
            metadata = _metadata(step, world_size, names, table[:, 1:], table[:, 0, 0], dtypes,
                                 sizes, meta)
            fmt.write_metadata(step_dir, metadata)
            fmt.write_latest(ckpt_dir, step)
        except (CheckpointError, OSError, TypeError, ValueError) as exc:
            error = exc
    raise_if_any_failed(group, error, what)
    return step_dir
