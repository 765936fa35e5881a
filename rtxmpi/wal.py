"""The write-ahead log: one small record per optimizer step, durable every k steps (docs/wal.md).

    wal = WriteAheadLog("CKPT/wal.h5", every=10)        # coordinator (rank 0) only; no MPI here
    wal.append(step=s, samples_consumed=n, loss=l, lr=lr, grad_norm=g, world_size=w,
               params_digest=params_digest(flat) if s % 10 == 0 else None)
    wal.close()                                         # durable up to the last append
    records = read_wal("CKPT/wal.h5")                   # numpy structured array, durable rows only

File: HDF5 (h5py, no pickle), one resizable compound dataset `/records` of RECORD_DTYPE, written in
HDF5's single-writer/multiple-reader (SWMR) mode, so the file on disk is always consistent: a crash
loses at most the rows appended since the last `sync()`, never the file. Root attributes:
`rtxmpi_wal_version` (1) and `digest` (how `params_digest` is computed). The file format is
HDF5 1.10's (LIBVER), which SWMR needs and h5dump/h5ls 1.10 and later read.

`ResumeParity` compares a re-run against the log (deterministic mode: bitwise).
"""
import os
import time
import zlib

import h5py
import numpy as np

from rtxmpi.errors import CheckpointError, ConfigError

WAL_VERSION = 1
WAL_NAME = "wal.h5"
DATASET = "records"
NO_DIGEST = -1  # params_digest of a step whose parameters were not digested
DIGEST_DOC = "crc32 (zlib) of the flat parameter buffer's bytes, as uint32; -1: not computed"
RECORD_DTYPE = np.dtype([
    ("step", "<i8"),              # 1-based optimizer step just completed
    ("samples_consumed", "<i8"),  # global samples read after this step (the data position)
    ("loss", "<f8"),              # mean training loss over the global batch, as the job reports it
    ("lr", "<f8"),                # learning rate used by this step
    ("grad_norm", "<f8"),         # global gradient norm before clipping
    ("wall_time", "<f8"),         # unix time the record was appended (s)
    ("world_size", "<i4"),        # ranks that ran this step
    ("params_digest", "<i8"),     # params_digest() after the step, or NO_DIGEST
])
CHUNK_ROWS = 256
LIBVER = ("v110", "v110")  # not "latest": the installed HDF5 (2.0) writes what 1.10's tools cannot read


def wal_path(ckpt_dir):
    """Where the job keeps its log: CKPT/wal.h5."""
    return os.path.join(ckpt_dir, WAL_NAME)


def params_digest(flat):
    """crc32 of the bytes of a contiguous parameter buffer (numpy or cupy), as a non-negative int.
    Cheap (about 1 GB/s); detects any bit flip, not an adversary."""
    host = flat.get() if hasattr(flat, "get") and not isinstance(flat, np.ndarray) else flat
    return zlib.crc32(memoryview(np.ascontiguousarray(host)).cast("B")) & 0xFFFFFFFF


def _fsync_dir(path):
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteAheadLog:
    """Appendable, crash-tolerant step log; written by one process (the coordinator, rank 0).

    path: the file; created (replaced atomically: tmp + fsync + rename) holding `records` first,
    e.g. the kept prefix of a previous log on resume (a structured array from `read_wal`).
    every: `append` makes the log durable (flush + fsync) every `every` appended rows; `sync()`
    and `close()` make it durable now. Raises ConfigError (every < 1), CheckpointError (cannot
    create the file).
    """

    def __init__(self, path, every=10, *, records=None):
        if int(every) < 1:
            raise ConfigError(f"WAL every={every}: must be >= 1")
        self.path, self.every = os.fspath(path), int(every)
        records = np.zeros(0, RECORD_DTYPE) if records is None else np.asarray(records, RECORD_DTYPE)
        tmp, self._file = self.path + ".tmp", None
        try:
            self._file = h5py.File(tmp, "w", libver=LIBVER)
            self._file.attrs["rtxmpi_wal_version"] = WAL_VERSION
            self._file.attrs["digest"] = DIGEST_DOC
            self._ds = self._file.create_dataset(DATASET, data=records, maxshape=(None,),
                                                 chunks=(CHUNK_ROWS,))
            self._file.swmr_mode = True  # from here on the file on disk is always consistent
            self._durable = self._rows = len(records)
            self._flush()
            os.replace(tmp, self.path)
            _fsync_dir(self.path)
        except OSError as exc:
            if self._file is not None:
                self._file.close()
                self._file = None
            raise CheckpointError(f"{self.path}: cannot create the write-ahead log: {exc}") from None

    @property
    def rows(self):
        """Rows appended so far (durable or not)."""
        return self._rows

    @property
    def durable_rows(self):
        """Rows that a crash now would keep."""
        return self._durable

    def append(self, *, step, samples_consumed, loss, lr, grad_norm, world_size=1,
               params_digest=None, wall_time=None):
        """Add one step's record; durable once `every` rows have gathered since the last sync."""
        row = np.array([(step, samples_consumed, loss, lr, grad_norm,
                         time.time() if wall_time is None else wall_time, world_size,
                         NO_DIGEST if params_digest is None else params_digest)], RECORD_DTYPE)
        self._ds.resize((self._rows + 1,))
        self._ds[self._rows] = row[0]
        self._rows += 1
        if self._rows - self._durable >= self.every:
            self.sync()

    def sync(self):
        """Make every appended row durable: HDF5 flush, then fsync of the file."""
        if self._rows != self._durable:
            self._flush()
            self._durable = self._rows

    def _flush(self):
        self._file.flush()
        os.fsync(self._file.id.get_vfd_handle())

    def close(self):
        """sync() and close; idempotent."""
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_wal(path):
    """The durable records of the log at `path`: a structured array of RECORD_DTYPE, in order.

    Tolerates a writer that crashed (rows after its last sync are simply absent) and a file cut
    short (the rows before the cut are returned: a valid log's steps are >= 1 and increasing).
    Single process; safe while a writer appends.
    Raises CheckpointError: no file, not HDF5, or not an rtxmpi write-ahead log.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no write-ahead log")
    try:
        f = h5py.File(path, "r", swmr=True)  # SWMR: opens a file whose writer is alive or crashed
    except OSError as exc:
        raise CheckpointError(f"{path}: not an rtxmpi write-ahead log (cannot open as HDF5: "
                              f"{exc})") from None
    with f:
        version = f.attrs.get("rtxmpi_wal_version")
        ds = f.get(DATASET)
        if version is None or not isinstance(ds, h5py.Dataset):
            raise CheckpointError(f"{path}: not an rtxmpi write-ahead log (no rtxmpi_wal_version "
                                  f"attribute or /{DATASET} dataset)")
        if int(version) != WAL_VERSION or ds.dtype != RECORD_DTYPE or ds.ndim != 1:
            raise CheckpointError(f"{path}: write-ahead log version {version} dtype {ds.dtype} "
                                  f"is not version {WAL_VERSION} of {RECORD_DTYPE}")
        try:
            records = ds[()]
        except OSError:  # cut short inside the HDF5 structures: keep the chunks that still read
            parts = []
            for start in range(0, ds.shape[0], CHUNK_ROWS):
                try:
                    parts.append(ds[start:start + CHUNK_ROWS])
                except OSError:
                    break
            records = np.concatenate(parts) if parts else np.zeros(0, RECORD_DTYPE)
    return _valid_prefix(records)


def _valid_prefix(records):
    """The rows up to the first that is not a real record: steps are >= 1 and strictly increasing
    (a file cut inside its data reads back zeros there)."""
    steps = records["step"]
    bad = np.flatnonzero((steps < 1) | (np.diff(steps, prepend=0) <= 0))
    return records[:bad[0]] if bad.size else records


def check_checkpoint_record(path, records, step, samples_consumed, loss=None):
    """Compare the log's record of checkpoint step `step` with what the checkpoint says.

    records: from `read_wal(path)`; samples_consumed: the checkpoint's data position after `step`;
    loss: the step's loss the checkpoint recorded (float, compared bit for bit), or None (not
    recorded: checkpoints written before it was).
    Returns None when they agree or the log holds no record of `step` (a log that starts later,
    or was cut before it), else a one-line message naming the log, the step and both values.
    """
    at = records[records["step"] == step]
    if not len(at):
        return None
    why = "(an edited metadata.json, or the log of another run)"
    if int(at["samples_consumed"][0]) != int(samples_consumed):
        return (f"{path} step {step}: the checkpoint says {int(samples_consumed)} samples consumed, "
                f"the log recorded {int(at['samples_consumed'][0])}: checkpoint and log disagree "
                + why)
    if loss is not None and not _same_bits(loss, at["loss"][0]):
        return (f"{path} step {step}: the checkpoint says loss {float(loss)!r}, the log recorded "
                f"{float(at['loss'][0])!r}: checkpoint and log disagree " + why)
    return None


class ResumeParity:
    """Checks a re-run of logged steps against the log (single process: the coordinator).

    logged: records of the steps to be re-run (step > the checkpoint's step), from `read_wal`.
    `check(step, loss, lr, grad_norm, digest)` returns None when the recomputed values equal the
    logged ones bit for bit (as float64; grad_norm and digest only when given and, for the digest,
    logged), else a one-line message naming the log, the step and the first differing value.
    `first_step` and `last_step` are the first and last logged steps (0: nothing to re-run).
    """

    def __init__(self, path, logged):
        self.path = path
        self.logged = {int(r["step"]): r for r in logged}
        self.first_step, self.last_step = min(self.logged, default=0), max(self.logged, default=0)
        self.digests_checked = 0

    def wants_digest(self, step):
        """Whether the log holds a parameter digest of `step` (compute one only then)."""
        r = self.logged.get(step)
        return r is not None and int(r["params_digest"]) != NO_DIGEST

    def check(self, step, loss, lr, grad_norm=None, *, digest=None):
        r = self.logged.get(step)
        if r is None:
            return None
        where = f"{self.path} step {step}"
        if not _same_bits(lr, r["lr"]):
            return (f"{where}: learning rate {float(lr)!r} != logged {float(r['lr'])!r} (resume "
                    f"with the logged run's --steps, --lr, --min-lr and --warmup-steps)")
        if not _same_bits(loss, r["loss"]):
            return (f"{where}: recomputed loss {float(loss)!r} != logged {float(r['loss'])!r}: the "
                    f"run diverged from its log (bitwise needs the logged run's world size, "
                    f"flags, MPI library and machine type)")
        if grad_norm is not None and not _same_bits(grad_norm, r["grad_norm"]):
            return (f"{where}: recomputed gradient norm {float(grad_norm)!r} != logged "
                    f"{float(r['grad_norm'])!r}: the run diverged from its log")
        if int(r["params_digest"]) != NO_DIGEST and digest is not None:
            self.digests_checked += 1
            if int(digest) != int(r["params_digest"]):
                return (f"{where}: parameter digest {int(digest):08x} != logged "
                        f"{int(r['params_digest']):08x}: the run diverged from its log")
        return None


def _same_bits(a, b):
    return np.float64(a).tobytes() == np.float64(b).tobytes()
