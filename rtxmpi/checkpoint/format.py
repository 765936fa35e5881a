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
Files are untrusted input: a rank file is opened only as a regular file of its recorded size, and
a dataset is read (with pread, into an array sized from metadata.json) only after its link, layout,
dtype, shape and byte range in the file are checked (`RankFile`).

Format versions: 3 (written now) adds metadata.json's own checksum; 2 checksums datasets with
crc32c; 1 with zlib's crc32. A checksum string names its algorithm, so each dataset is verified
with the one it was written with.
"""
import hashlib
import json
import os
import re
import stat
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import crc32c
import h5py
import numpy as np

from rtxmpi.backend import copy_to_host, host_empty, is_device_array, to_host
from rtxmpi.errors import CheckpointError

FORMAT_VERSION = 3  # written; 3: metadata.json carries its checksum, 2: crc32c, 1: zlib crc32
READABLE_FORMAT_VERSIONS = (1, 2, 3)
CHECKSUM_ALGORITHM = "crc32c"  # the one written now
# algorithm -> update(crc, contiguous uint8 buffer) -> crc; both release the GIL on large buffers
CHECKSUM_UPDATE = {"crc32c": lambda crc, buf: crc32c.crc32c(buf, crc),
                   "crc32": lambda crc, buf: zlib.crc32(buf, crc)}
METADATA = "metadata.json"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
STEP_RE = re.compile(r"^step_(\d{8,})$")
READ_CHUNK_BYTES = 16 << 20  # checksums and reads stream through datasets in pieces of this size
# HDF5 file format of the rank files: checksummed object headers, readable by HDF5 1.10 and later
# (h5dump/h5ls of Debian bookworm); "latest" would follow the installed HDF5 (2.0 here).
LIBVER = ("v110", "v110")


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


def _forget_crc_pool():
    global _CRC_POOL, _CRC_POOL_LOCK
    _CRC_POOL, _CRC_POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_crc_pool)  # a forked child has no pool thread


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


def fixed_string(text):
    """A string attribute value stored inline, as fixed-length UTF-8: a variable-length string
    lives in HDF5's global heap, which carries no checksum (a damaged heap reference can make
    HDF5 loop), so format 3 writes none."""
    return np.bytes_(text.encode())


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
    with h5py.File(path, "w", libver=LIBVER) as f:
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["rank_state_json"] = fixed_string(plain_json)
        tensors = f.create_group("tensors")
        for name, shard in shards.items():  # one tensor at a time: at most one host copy alive
            check_tensor_name(name)
            ds, crc, length, dtype = _write_tensor(tensors, name, shard.data)
            crc = format_checksum(crc)
            ds.attrs["global_shape"] = np.array([shard.global_size], np.int64)
            ds.attrs["global_offset"] = np.int64(shard.global_offset)
            ds.attrs["checksum"] = fixed_string(crc)
            written[name] = {"offset": int(shard.global_offset), "length": int(length),
                             "checksum": crc, "dtype": dtype.str,
                             "global_size": int(shard.global_size)}
        state = f.create_group("rank_state")
        for key, value in arrays.items():
            check_tensor_name(key)
            value = np.ascontiguousarray(value)
            ds = state.create_dataset(key, data=value)
            ds.attrs["checksum"] = fixed_string(checksum(value))
    fsync_path(path)
    return written


RANK_FILE_RE = re.compile(r"^rank_\d{5,}\.h5$")
# What a checkpoint may hold: fixed-size numbers (and bfloat16, an opaque 2-byte type to HDF5).
# Nothing else is read: object, string, structured and large void dtypes are refused.
DTYPES = frozenset([f"|{k}1" for k in "biu"] + [f"{o}{k}" for o in "<>" for k in
                   ("i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")] + ["<V2", "|V2"])


def check_dtype(text, where):
    """The numpy dtype of an allowlisted dtype string (DTYPES). Raises CheckpointError."""
    if not isinstance(text, str) or text not in DTYPES:
        raise CheckpointError(f"{where}: dtype {text!r} is not one a checkpoint holds "
                              f"(fixed-size numbers: {', '.join(sorted(DTYPES))})")
    return np.dtype(text)


def open_regular(path):
    """Open `path` read-only as a regular file that is not a symlink, without blocking (a FIFO
    or device is refused before anything waits on it). Returns (fd, size in bytes).
    Raises CheckpointError (missing, a symlink, not a regular file), OSError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file (a symlink, FIFO, device or directory); "
                              f"a checkpoint holds only regular files")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:  # ELOOP: replaced by a symlink since the lstat
        raise CheckpointError(f"{path}: cannot open: {exc.strerror}") from None
    now = os.fstat(fd)
    if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise CheckpointError(f"{path}: replaced while being opened")
    return fd, now.st_size


class RankFile:
    """A rank file opened for reading after checks, from which datasets are read only once
    their layout is checked against metadata.json and the file's real size.

    step_dir, name: the file is `name` (a plain "rank_xxxxx.h5") in `step_dir`, a regular file,
    not a symlink, of exactly `nbytes` bytes (None: any size). HDF5 opens the checked file
    descriptor itself (/proc/self/fd), so the file checked is the file read. Use as a context
    manager or call close(). Raises CheckpointError naming the file.
    """

    def __init__(self, step_dir, name, nbytes=None):
        if not isinstance(name, str) or not RANK_FILE_RE.match(name):
            raise CheckpointError(f"{step_dir}: file name {name!r} is not a rank file name "
                                  f"(rank_xxxxx.h5, no directory part)")
        self.path = os.path.join(step_dir, name)
        self.fd, self.size = open_regular(self.path)
        self.h5 = None
        try:
            if nbytes is not None and self.size != nbytes:
                raise CheckpointError(f"{self.path}: {self.size} bytes on disk, metadata says "
                                      f"{nbytes} (truncated or replaced)")
            by_fd = f"/proc/self/fd/{self.fd}"
            try:
                self.h5 = h5py.File(by_fd if os.path.exists(by_fd) else self.path, "r")
            except OSError as exc:  # truncated or not HDF5
                raise CheckpointError(f"{self.path}: cannot open as HDF5 (truncated or corrupt?): "
                                      f"{exc}") from None
            self.version = 1  # what attr() needs to read the format_version attribute itself
            self.version = self.attr(self.h5, "format_version", "int", self.path) or 1
        except BaseException:
            self.close()
            raise

    def close(self):
        if self.h5 is not None:
            self.h5.close()
            self.h5 = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def member(self, parent, name, kind, where):
        """parent[name] when it is a hard link to a `kind` (never an external or soft link)."""
        try:
            link = parent.get(name, getlink=True)
            if link is None:
                raise CheckpointError(f"{where} is missing")
            if not isinstance(link, h5py.HardLink):
                raise CheckpointError(f"{where} is a {type(link).__name__}; a checkpoint holds "
                                      f"only hard links inside its own file")
            obj = parent[name]
        except (KeyError, OSError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: unreadable HDF5 object: {exc}") from None
        if not isinstance(obj, kind):
            raise CheckpointError(f"{where} is not an HDF5 {kind.__name__}")
        return obj

    def attr(self, obj, name, kind, where):
        """Attribute `name` of `obj`, checked before it is read: kind "str" (a scalar string) or
        "int" (an integer scalar or 1-element array). None when absent."""
        try:
            if name not in obj.attrs:
                return None
            aid = obj.attrs.get_id(name)
            shape, dtype = aid.shape, aid.dtype
            if kind == "str":
                string = h5py.check_string_dtype(dtype)
                ok = shape == () and string is not None and (string.length is not None
                                                             or self.version < 3)
            else:
                ok = shape in ((), (1,)) and dtype.kind in "iu" and dtype.itemsize <= 8
            if not ok:
                raise CheckpointError(f"{where}: attribute {name} is {dtype} {shape}, not a {kind}")
            value = obj.attrs[name]
        except (KeyError, OSError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: attribute {name} unreadable: {exc}") from None
        if kind == "str":
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        return int(np.asarray(value).reshape(-1)[0])

    def dataset(self, group, name, dtype=None, shape=None):
        """Dataset /group/name after checks, as (dataset, byte offset in the file, nbytes): a
        hard link, contiguous, unfiltered, no external or virtual storage, an allowlisted dtype
        (equal to `dtype` when given), `shape` when given, and all its bytes inside the file."""
        where = f"{self.path}: dataset /{group}/{name}"
        parent = self.member(self.h5, group, h5py.Group, f"{self.path}: group /{group}")
        ds = self.member(parent, name, h5py.Dataset, where)
        try:
            plist = ds.id.get_create_plist()
            layout, external, filters = plist.get_layout(), plist.get_external_count(), plist.get_nfilters()
            found, found_shape = ds.dtype, ds.shape
        except (OSError, TypeError, ValueError) as exc:  # e.g. an HDF5 type numpy has no dtype for
            raise CheckpointError(f"{where}: unreadable: {exc}") from None
        if layout != h5py.h5d.CONTIGUOUS or external or filters:
            raise CheckpointError(f"{where}: stored as layout {layout} with {external} external "
                                  f"file(s) and {filters} filter(s); a checkpoint stores each "
                                  f"dataset contiguously in its own file, unfiltered")
        check_dtype(found.str, where)
        if (dtype is not None and found != dtype) or (shape is not None and found_shape != shape):
            raise CheckpointError(f"{where} has shape {found_shape} dtype {found}; metadata says "
                                  f"{shape} {dtype}")
        nbytes = int(np.prod(found_shape, dtype=object)) * found.itemsize
        offset = ds.id.get_offset() if nbytes else 0
        if offset is None or offset < 0 or offset + nbytes > self.size \
                or (nbytes and ds.id.get_storage_size() != nbytes):
            raise CheckpointError(f"{where}: its {nbytes} bytes at offset {offset} do not lie in the "
                                  f"file's {self.size} bytes (truncated or corrupt)")
        return ds, offset, nbytes

    def check_listed(self, names):
        """Every non-empty dataset under /tensors is one of `names` (the tensors metadata.json
        gives a piece in this file): a tensor left out of the metadata is an error, not a
        smaller checkpoint."""
        group = self.member(self.h5, "tensors", h5py.Group, f"{self.path}: group /tensors")
        for key in group:
            if key not in names:
                ds = self.member(group, key, h5py.Dataset, f"{self.path}: dataset /tensors/{key}")
                if ds.shape != (0,):
                    raise CheckpointError(f"{self.path}: holds dataset /tensors/{key} of shape "
                                          f"{ds.shape}, which metadata.json does not list")

    def read_into(self, view, offset):
        """Fill the contiguous array `view` from the file's bytes at `offset` (pread)."""
        buf = memoryview(view).cast("B")
        while buf:
            got = os.preadv(self.fd, [buf], offset)
            if got == 0:
                raise OSError(f"end of file at byte {offset}, {len(buf)} bytes short")
            buf, offset = buf[got:], offset + got


def read_piece(rank_file, name, expected, start=0, stop=None, out=None):
    """Read elements [start, stop) of dataset /tensors/<name> of the open RankFile `rank_file`,
    verifying the WHOLE dataset's checksum while streaming through it (the only extra memory is
    one read chunk). `expected`: the piece's metadata entry {"length", "checksum", "dtype",
    "offset"}, already validated (metadata.py).

    out: optional 1-D array of stop - start elements to fill; returns it (or a new array).
    Raises CheckpointError naming the file and dataset: missing, wrong layout/shape/dtype,
    attribute or checksum mismatch.
    """
    where = f"{rank_file.path}: dataset /tensors/{name}"
    length, dtype = int(expected["length"]), check_dtype(expected["dtype"], where)
    stop = length if stop is None else stop
    if not 0 <= start <= stop <= length:
        raise CheckpointError(f"{where}: range [{start}, {stop}) outside its {length} elements")
    algorithm = checksum_algorithm(expected["checksum"], where)
    ds, base, _ = rank_file.dataset("tensors", name, dtype, (length,))
    global_offset = rank_file.attr(ds, "global_offset", "int", where)
    if "offset" in expected and global_offset != int(expected["offset"]):
        raise CheckpointError(f"{where}: global_offset attribute {global_offset} != metadata "
                              f"{expected['offset']}")
    if out is None:
        out = np.empty(stop - start, dtype)
    chunk = max(1, READ_CHUNK_BYTES // max(1, dtype.itemsize))
    bufs, buf_jobs = [], [None, None]  # two bounce buffers: one read while the other's crc runs
    running = RunningCrc(algorithm)  # chunk i's checksum runs while chunk i + 1 is read
    direct = isinstance(out, np.ndarray) and out.dtype == dtype and out.flags.c_contiguous
    if length:
        os.posix_fadvise(rank_file.fd, base, length * dtype.itemsize, os.POSIX_FADV_SEQUENTIAL)
    try:
        for i, a in enumerate(range(0, length, chunk)):
            b = min(a + chunk, length)
            if direct and start <= a and b <= stop:  # wholly wanted: straight into `out`
                view = out[a - start:b - start]
                rank_file.read_into(view, base + a * dtype.itemsize)
                running.add(view)
            else:
                k = i % 2
                if buf_jobs[k] is not None:
                    buf_jobs[k].result()  # its previous chunk's crc is done: reuse it
                while len(bufs) <= k:
                    bufs.append(np.empty(min(chunk, length), dtype))
                view = bufs[k][:b - a]
                rank_file.read_into(view, base + a * dtype.itemsize)
                lo, hi = max(a, start), min(b, stop)
                if lo < hi:
                    out[lo - start:hi - start] = view[lo - a:hi - a]
                buf_jobs[k] = running.add(view)
    except OSError as exc:  # truncated data
        running.value()
        raise CheckpointError(f"{where}: read failed (truncated?): {exc}") from None
    crc = format_checksum(running.value(), algorithm)
    if crc != expected["checksum"]:
        raise CheckpointError(f"{where}: checksum mismatch: data has {crc}, "
                              f"metadata says {expected['checksum']} (corrupt file)")
    return out


def read_rank_state(rank_file):
    """The rank_state dict stored in the open RankFile `rank_file` (arrays checked like pieces,
    read whole, verified against their checksums). Raises CheckpointError."""
    path = rank_file.path
    text = rank_file.attr(rank_file.h5, "rank_state_json", "str", path)
    try:
        state = json.loads(text)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: attribute rank_state_json unreadable: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: attribute rank_state_json is not a JSON object")
    try:
        keys = list(rank_file.member(rank_file.h5, "rank_state", h5py.Group,
                                    f"{path}: group /rank_state").keys())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: group /rank_state unreadable: {exc}") from None
    for key in keys:
        where = f"{path}: dataset /rank_state/{key}"
        ds, base, _ = rank_file.dataset("rank_state", key)
        expected = rank_file.attr(ds, "checksum", "str", where)
        algorithm = checksum_algorithm(expected, where)
        value = np.empty(ds.shape, ds.dtype)  # its bytes lie in the file: a bounded allocation
        try:
            rank_file.read_into(value.reshape(-1), base)
        except OSError as exc:
            raise CheckpointError(f"{where}: read failed (truncated?): {exc}") from None
        if checksum(value, algorithm) != expected:
            raise CheckpointError(f"{where}: checksum mismatch")
        state[key] = value
    return state


# ---------------------------------------------------------------- metadata and latest
METADATA_CHECKSUM = "metadata_checksum"  # metadata.json's field: sha256 of the canonical rest


def metadata_checksum(metadata):
    """"sha256:<64 hex>" of the canonical JSON of `metadata` without its METADATA_CHECKSUM field:
    json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=True), UTF-8."""
    rest = {k: v for k, v in metadata.items() if k != METADATA_CHECKSUM}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def write_metadata(step_dir, metadata):
    """metadata.json, carrying its own checksum, via tmp + fsync + rename + fsync(dir): the
    commit of a checkpoint."""
    metadata = {**metadata, METADATA_CHECKSUM: metadata_checksum(metadata)}
    write_text_atomic(os.path.join(step_dir, METADATA), json.dumps(metadata, indent=1, sort_keys=True))


def is_committed(step_dir):
    return os.path.isfile(os.path.join(step_dir, METADATA))


def write_latest(ckpt_dir, step):
    """Replace CKPT/latest atomically with the step dir name of `step`."""
    write_text_atomic(os.path.join(ckpt_dir, LATEST), step_dir_name(step) + "\n")


def read_latest(ckpt_dir):
    """The step named by CKPT/latest, or None (missing, not a regular file, or unparsable)."""
    try:
        fd, _ = open_regular(os.path.join(ckpt_dir, LATEST))
        with os.fdopen(fd, "rb") as f:
            return parse_step(f.read(64).decode("ascii", "replace").strip())
    except (CheckpointError, OSError):
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
