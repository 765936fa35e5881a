"""The on-disk format of a checkpoint: names, checksums, the HDF5 rank file, metadata.json, latest.

    CKPT/latest                         text: the newest committed step dir name ("step_00000100")
    CKPT/step_00000100/metadata.json    the commit marker, written LAST by the coordinator
    CKPT/step_00000100/rank_00003.h5    rank 3's pieces: /tensors/<name> (1-D), /rank_state/...

Each dataset in a rank file is one contiguous piece [global_offset, global_offset + length) of a
global 1-D tensor, stored contiguously (no chunking, no compression) with attributes
`global_shape` (int64[1]), `global_offset` (int64) and `checksum` ("crc32c:xxxxxxxx" of its bytes:
CRC-32C, the Castagnoli polynomial of iSCSI / RFC 3720, in hardware where the CPU has it).
Small per-rank state is the JSON string attribute `rank_state_json` plus small arrays under
/rank_state/. Nothing here needs MPI: these functions are the single-process layer that the
collective save/load and the `rtxmpi ckpt` command build on. No pickle anywhere: HDF5 and JSON.

Format versions: 2 (written now) checksums with crc32c; 1 (read still) with zlib's crc32. A
checksum string names its algorithm, so each dataset is verified with the one it was written with.
"""
import json
import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import crc32c
import h5py
import numpy as np

from rtxmpi.backend import copy_to_host, host_empty, is_device_array, to_host
from rtxmpi.errors import CheckpointError

FORMAT_VERSION = 2  # written; 2: crc32c checksums, 1: zlib crc32 checksums
READABLE_FORMAT_VERSIONS = (1, 2)
CHECKSUM_ALGORITHM = "crc32c"  # the one written now
# algorithm -> update(crc, contiguous uint8 buffer) -> crc; both release the GIL on large buffers
CHECKSUM_UPDATE = {"crc32c": lambda crc, buf: crc32c.crc32c(buf, crc),
                   "crc32": lambda crc, buf: zlib.crc32(buf, crc)}
METADATA = "metadata.json"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
STEP_RE = re.compile(r"^step_(\d{8,})$")
READ_CHUNK_BYTES = 16 << 20  # checksums and reads stream through datasets in pieces of this size


def step_dir_name(step):
    """"step_00000100" for step 100."""
    return f"step_{int(step):08d}"


def rank_file_name(rank):
    """"rank_00003.h5" for rank 3."""
    return f"rank_{int(rank):05d}.h5"


def parse_step(name):
    """The step of a step dir name, or None when `name` is not one."""
    match = STEP_RE.match(name)
    return int(match.group(1)) if match else None


def checksum_update(crc, array, algorithm=None):
    """Running checksum (`algorithm`: "crc32c", the default, or "crc32") over the raw bytes of
    an array (C order)."""
    update = CHECKSUM_UPDATE[algorithm or CHECKSUM_ALGORITHM]
    return update(crc, np.ascontiguousarray(array).view(np.uint8).reshape(-1))


_CRC_POOL, _CRC_POOL_LOCK = None, threading.Lock()


def crc_pool():
    """The one-thread pool that computes checksums while the caller's thread does the I/O
    (crc32c and zlib.crc32 release the GIL on large buffers, h5py holds it: the two run side by side).
    One worker: the jobs a caller submits run in submission order, so a running crc over
    chunks stays correct."""
    global _CRC_POOL
    with _CRC_POOL_LOCK:
        if _CRC_POOL is None:
            _CRC_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtxmpi-crc32")
        return _CRC_POOL


class RunningCrc:
    """Checksum (`algorithm`, default CHECKSUM_ALGORITHM) of a sequence of chunks, computed on
    `crc_pool()` while the caller reads or writes the next chunk. `add(view)` returns a future:
    the caller must not modify `view` until it is done or `value()` returns. value(): the final
    checksum as an int (waits for every chunk)."""

    def __init__(self, algorithm=None):
        self.algorithm = algorithm or CHECKSUM_ALGORITHM
        self.crc, self.futures = 0, []

    def _update(self, view):
        self.crc = checksum_update(self.crc, view, self.algorithm)

    def add(self, view):
        self.futures.append(crc_pool().submit(self._update, view))
        return self.futures[-1]

    def value(self):
        for future in self.futures:
            future.result()
        self.futures = []
        return self.crc


def format_checksum(crc, algorithm=None):
    """"crc32c:xxxxxxxx" (or "<algorithm>:xxxxxxxx") of a checksum value."""
    return f"{algorithm or CHECKSUM_ALGORITHM}:{crc & 0xFFFFFFFF:08x}"


def checksum_algorithm(text, where):
    """The algorithm a checksum string names ("crc32c:..." -> "crc32c"). Raises CheckpointError
    naming `where` when it is not one this rtxmpi knows."""
    algorithm = str(text).partition(":")[0]
    if algorithm not in CHECKSUM_UPDATE:
        raise CheckpointError(f"{where}: checksum {text!r} uses an unknown algorithm; this rtxmpi "
                              f"verifies {sorted(CHECKSUM_UPDATE)}")
    return algorithm


def checksum(array, algorithm=None):
    """"crc32c:xxxxxxxx" (or `algorithm`'s) of an array's bytes (C order)."""
    return format_checksum(checksum_update(0, array, algorithm), algorithm)


def check_tensor_name(name):
    """Tensor names become HDF5 dataset names: non-empty, no '/', not '.' or '..'."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise CheckpointError(f"tensor name {name!r} is not usable as a dataset name "
                              f"(non-empty, no '/')")


# ---------------------------------------------------------------- durability helpers
def fsync_path(path):
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path, text):
    """Write `text` to `path` via `path.tmp`, fsync, rename over `path`, fsync the directory."""
    tmp = path + TMP_SUFFIX
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


# ---------------------------------------------------------------- rank files
STREAM_CHUNK_BYTES = 16 * 2**20  # device-to-host streaming of a cupy tensor, per chunk


def as_host(array):
    """numpy view of a numpy or cupy 1-D array (cupy is copied to the host, one tensor at a time)."""
    return np.ascontiguousarray(to_host(array))


def _write_tensor(tensors, name, array):
    """Create dataset `name` in h5py group `tensors` from a 1-D numpy or cupy array; returns
    (dataset, crc, length, dtype). A cupy array streams to the host in STREAM_CHUNK_BYTES chunks
    through two pinned buffers (no whole-tensor host copy): while h5py writes chunk i and the
    crc pool checksums it, chunk i + 1 is copied from the device into the other buffer."""
    running = RunningCrc()
    if not is_device_array(array):
        data = np.ascontiguousarray(array)
        running.add(data)  # the checksum runs on the pool thread while h5py writes
        ds = tensors.create_dataset(name, data=data)
        return ds, running.value(), data.size, data.dtype
    flat = array.reshape(-1)
    n, dtype = flat.size, np.dtype(flat.dtype)
    ds = tensors.create_dataset(name, shape=(n,), dtype=dtype)
    chunk = max(1, STREAM_CHUNK_BYTES // dtype.itemsize)
    buffers = [host_empty(min(chunk, n), dtype, pinned=True) for _ in range(2 if n else 0)]
    pending = [None, None]  # the checksum future still reading each buffer
    for i, lo in enumerate(range(0, n, chunk)):
        hi = min(lo + chunk, n)
        if pending[i % 2] is not None:
            pending[i % 2].result()
        view = buffers[i % 2][:hi - lo]
        copy_to_host(flat[lo:hi], view)
        pending[i % 2] = running.add(view)
        ds[lo:hi] = view
    return ds, running.value(), n, dtype


def write_rank_file(path, shards, rank_state=None):
    """Write one rank's pieces to `path` (no tmp/rename here; see `save.py`), fsync it.

    shards: {name: Shard}; rank_state: dict of JSON-able values and small numpy arrays (top-level
    keys only). Returns {name: {"offset", "length", "checksum", "dtype", "global_size"}} of what
    was written. Raises CheckpointError (bad name), TypeError (rank_state not JSON-able), OSError.
    """
    rank_state = dict(rank_state or {})
    arrays = {k: v for k, v in rank_state.items() if isinstance(v, np.ndarray)}
    plain = {k: v for k, v in rank_state.items() if k not in arrays}
    plain_json = json.dumps(plain, sort_keys=True)  # TypeError when not JSON-able
    written = {}
    with h5py.File(path, "w", libver="latest") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["rank_state_json"] = plain_json
        tensors = f.create_group("tensors")
        for name, shard in shards.items():  # one tensor at a time: at most one host copy alive
            check_tensor_name(name)
            ds, crc, length, dtype = _write_tensor(tensors, name, shard.data)
            crc = format_checksum(crc)
            ds.attrs["global_shape"] = np.array([shard.global_size], np.int64)
            ds.attrs["global_offset"] = np.int64(shard.global_offset)
            ds.attrs["checksum"] = crc
            written[name] = {"offset": int(shard.global_offset), "length": int(length),
                             "checksum": crc, "dtype": dtype.str,
                             "global_size": int(shard.global_size)}
        state = f.create_group("rank_state")
        for key, value in arrays.items():
            check_tensor_name(key)
            value = np.ascontiguousarray(value)
            ds = state.create_dataset(key, data=value)
            ds.attrs["checksum"] = checksum(value)
    fsync_path(path)
    return written


def open_rank_file(path):
    """A rank file opened read-only with h5py. Raises CheckpointError (missing, not HDF5)."""
    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: rank file is missing") from None
    except OSError as exc:  # truncated or not HDF5
        raise CheckpointError(f"{path}: cannot open as HDF5 (truncated or corrupt?): {exc}") from None


class _ElementReader:
    """Reads elements [a, b) of a 1-D dataset into a contiguous array. A contiguous, unfiltered
    dataset (what `write_rank_file` writes) is read with os.preadv at its byte offset in the file,
    with the kernel told the access is sequential (the bytes HDF5 itself would read, without its
    per-call selection work); any other layout goes through h5py's read_direct."""

    def __init__(self, path, ds):
        self.ds, self.fd, self.base = ds, None, None
        if ds.chunks is None and ds.compression is None and ds.external is None and ds.size:
            self.base = ds.id.get_offset()
        if self.base is not None:
            self.itemsize = ds.dtype.itemsize
            self.fd = os.open(path, os.O_RDONLY)
            nbytes = ds.size * self.itemsize
            os.posix_fadvise(self.fd, self.base, nbytes, os.POSIX_FADV_SEQUENTIAL)

    def read(self, view, a, b):
        if self.fd is None:
            self.ds.read_direct(view, np.s_[a:b])
            return
        buf = memoryview(view).cast("B")
        pos = self.base + a * self.itemsize
        while buf:
            got = os.preadv(self.fd, [buf], pos)
            if got == 0:
                raise OSError(f"end of file at byte {pos}, {len(buf)} bytes short")
            buf, pos = buf[got:], pos + got

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_piece(path, name, expected, start=0, stop=None, out=None, *, h5file=None):
    """Read elements [start, stop) of dataset /tensors/<name> in the rank file `path`, verifying
    the WHOLE dataset's checksum while streaming through it (the only extra memory is one read
    chunk). `expected`: the piece's metadata entry {"length", "checksum", "dtype"}.

    out: optional 1-D array of stop - start elements to fill; returns it (or a new array).
    Raises CheckpointError naming the file and dataset: missing, wrong shape/dtype, bad checksum.
    """
    where = f"{path}: dataset /tensors/{name}"
    length, dtype = int(expected["length"]), np.dtype(expected["dtype"])
    stop = length if stop is None else stop
    if not 0 <= start <= stop <= length:
        raise CheckpointError(f"{where}: range [{start}, {stop}) outside its {length} elements")
    algorithm = checksum_algorithm(expected["checksum"], where)
    f = h5file if h5file is not None else open_rank_file(path)
    try:
        try:
            ds = f["tensors"][name]
        except KeyError:
            raise CheckpointError(f"{where} is missing") from None
        if ds.shape != (length,) or ds.dtype != dtype:
            raise CheckpointError(f"{where} has shape {ds.shape} dtype {ds.dtype}; metadata says "
                                  f"({length},) {dtype}")
        if "offset" in expected and int(ds.attrs.get("global_offset", -1)) != int(expected["offset"]):
            raise CheckpointError(f"{where}: global_offset attribute {ds.attrs.get('global_offset')} "
                                  f"!= metadata {expected['offset']}")
        if ds.attrs.get("checksum") != expected["checksum"]:
            raise CheckpointError(f"{where}: checksum attribute {ds.attrs.get('checksum')!r} != "
                                  f"metadata {expected['checksum']!r}")
        if out is None:
            out = np.empty(stop - start, dtype)
        chunk = max(1, READ_CHUNK_BYTES // max(1, dtype.itemsize))
        bufs, buf_jobs = [], [None, None]  # two bounce buffers: one read while the other's crc runs
        running = RunningCrc(algorithm)  # chunk i's checksum runs while chunk i + 1 is read
        direct = isinstance(out, np.ndarray) and out.dtype == dtype and out.flags.c_contiguous
        reader = None
        try:
            reader = _ElementReader(path, ds)
            for i, a in enumerate(range(0, length, chunk)):
                b = min(a + chunk, length)
                if direct and start <= a and b <= stop:  # wholly wanted: straight into `out`
                    view = out[a - start:b - start]
                    reader.read(view, a, b)
                    running.add(view)
                else:
                    k = i % 2
                    if buf_jobs[k] is not None:
                        buf_jobs[k].result()  # its previous chunk's crc is done: reuse it
                    while len(bufs) <= k:
                        bufs.append(np.empty(min(chunk, length), dtype))
                    view = bufs[k][:b - a]
                    reader.read(view, a, b)
                    lo, hi = max(a, start), min(b, stop)
                    if lo < hi:
                        out[lo - start:hi - start] = view[lo - a:hi - a]
                    buf_jobs[k] = running.add(view)
        except OSError as exc:  # truncated data
            running.value()
            raise CheckpointError(f"{where}: read failed (truncated?): {exc}") from None
        finally:
            if reader is not None:
                reader.close()
        crc = format_checksum(running.value(), algorithm)
        if crc != expected["checksum"]:
            raise CheckpointError(f"{where}: checksum mismatch: data has {crc}, "
                                  f"metadata says {expected['checksum']} (corrupt file)")
        return out
    finally:
        if h5file is None:
            f.close()


def read_rank_state(path):
    """The rank_state dict stored in a rank file (arrays verified). Raises CheckpointError."""
    with open_rank_file(path) as f:
        try:
            state = json.loads(f.attrs["rank_state_json"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: attribute rank_state_json unreadable: {exc}") from None
        for key, ds in f.get("rank_state", {}).items():
            value = ds[()]
            expected = ds.attrs.get("checksum")
            algorithm = checksum_algorithm(expected, f"{path}: dataset /rank_state/{key}")
            if checksum(value, algorithm) != expected:
                raise CheckpointError(f"{path}: dataset /rank_state/{key}: checksum mismatch")
            state[key] = value
    return state


# ---------------------------------------------------------------- metadata and latest
def write_metadata(step_dir, metadata):
    """metadata.json via tmp + fsync + rename + fsync(dir): the commit of a checkpoint."""
    write_text_atomic(os.path.join(step_dir, METADATA), json.dumps(metadata, indent=1, sort_keys=True))


def read_metadata(step_dir):
    """The parsed metadata.json of a step dir. Raises CheckpointError (missing: uncommitted)."""
    path = os.path.join(step_dir, METADATA)
    try:
        with open(path) as f:
            metadata = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir}: no {METADATA}: the checkpoint was never committed") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    if metadata.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise CheckpointError(f"{path}: format_version {metadata.get('format_version')!r}; this "
                              f"rtxmpi reads versions {', '.join(map(str, READABLE_FORMAT_VERSIONS))} "
                              f"(a newer rtxmpi wrote it?)")
    return metadata


def is_committed(step_dir):
    return os.path.isfile(os.path.join(step_dir, METADATA))


def write_latest(ckpt_dir, step):
    """Replace CKPT/latest atomically with the step dir name of `step`."""
    write_text_atomic(os.path.join(ckpt_dir, LATEST), step_dir_name(step) + "\n")


def read_latest(ckpt_dir):
    """The step named by CKPT/latest, or None (missing or unparsable)."""
    try:
        with open(os.path.join(ckpt_dir, LATEST)) as f:
            return parse_step(f.read().strip())
    except OSError:
        return None


def step_dirs(ckpt_dir):
    """{step: path} of every step dir in `ckpt_dir` (committed or not); {} when it does not exist."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        step = parse_step(name)
        if step is not None and os.path.isdir(os.path.join(ckpt_dir, name)):
            found[step] = os.path.join(ckpt_dir, name)
    return dict(sorted(found.items()))


def latest_step(ckpt_dir):
    """The newest committed step: the one CKPT/latest names when that dir is committed, else
    (latest missing, or naming an uncommitted dir) the highest committed step dir; None if none.
    Single process; never writes."""
    dirs = step_dirs(ckpt_dir)
    named = read_latest(ckpt_dir)
    if named is not None and named in dirs and is_committed(dirs[named]):
        return named
    committed = [s for s, path in dirs.items() if is_committed(path)]
    return max(committed) if committed else None
