"""Offload stores for ZeRO: the optimizer's tensors for this rank's shard kept in files.

`NvmeStore` keeps named 1-D tensors of one length (the master parameters and AdamW's m and v)
in raw files under `directory/rank_XXXXX/` (one `<name>.bin` each, native byte order, no
header) and streams them through memory chunk by chunk: a reader thread loads chunk i + 1 ...
while the caller updates chunk i, and a writer thread writes updated chunks back. At most
`max_chunks` chunks are in memory at once (loaded and not yet written back): the reader waits
for the writer (backpressure), so memory is bounded by max_chunks * chunk_elems * (bytes of one
element of every tensor), whatever the shard length.

Chunk buffers are always chunk_elems long: the last chunk is zero-padded (the caller sees the
padding; for AdamW zero parameters, moments and gradients stay zero). Reads and writes are
os.pread / os.pwrite (the page cache is the kernel's, not this process's memory); `array(name)`
gives an np.memmap of a whole tensor for checkpoints (coherent with them on Linux).
"""
import os
import queue
import shutil
import threading

import numpy as np

from ..errors import ConfigError, RtxmpiError

DEFAULT_CHUNK_BYTES = 4 * 2**20
DEFAULT_MAX_CHUNKS = 3  # one being updated, one being written back, one prefetched
_POLL_S = 0.05


def rank_dir(directory, rank):
    """Where rank `rank`'s files live: directory/rank_XXXXX."""
    return os.path.join(os.fspath(directory), f"rank_{rank:05d}")


class NvmeStore:
    """Named 1-D tensors of `length` elements of `dtype` in files, streamed chunk by chunk.

    directory: the offload directory (rank_XXXXX/ is created in it); names: tensor names;
    chunk_elems: elements per chunk (>= 1); max_chunks: most chunks in memory at once (>= 1).
    Files are created zero-filled (sparse). Local: no collective. Raises ConfigError when the
    directory or a file cannot be created (the message names the path and the OS error).

    Counters: chunks_read, chunks_written, resident (chunks in memory now), max_resident (most
    at once since creation or reset_counters()).
    """

    def __init__(self, directory, rank, names, length, dtype, chunk_elems, max_chunks):
        if int(chunk_elems) < 1 or int(max_chunks) < 1:
            raise ConfigError(f"offload chunks need chunk_elems >= 1 and max_chunks >= 1, got "
                              f"{chunk_elems} and {max_chunks}")
        self.names, self.length, self.dtype = tuple(names), int(length), np.dtype(dtype)
        self.chunk_elems, self.max_chunks = int(chunk_elems), int(max_chunks)
        self.path = rank_dir(directory, rank)
        self._fds = {}
        try:
            os.makedirs(self.path, exist_ok=True)
            for name in self.names:
                fd = os.open(self.file(name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self._fds[name] = fd
                os.ftruncate(fd, self.length * self.dtype.itemsize)
        except OSError as exc:
            self.close(remove=False)
            raise ConfigError(f"offload directory {os.fspath(directory)!r}: cannot create "
                              f"{exc.filename or self.path!r} ({exc.strerror or exc}); pass a "
                              f"writable offload_dir (--offload-dir)") from None
        self._maps = {}
        self._lock = threading.Lock()
        self.chunks_read = self.chunks_written = self.resident = self.max_resident = 0

    def file(self, name):
        return os.path.join(self.path, f"{name}.bin")

    @property
    def num_chunks(self):
        return -(-self.length // self.chunk_elems)

    def chunk_range(self, i):
        """[lo, hi) of chunk i within the tensor (hi - lo <= chunk_elems)."""
        lo = i * self.chunk_elems
        return lo, min(lo + self.chunk_elems, self.length)

    def disk_bytes(self):
        """Bytes of all tensors in files."""
        return len(self.names) * self.length * self.dtype.itemsize

    def memory_bound_bytes(self):
        """Most bytes of chunk buffers in memory at once: max_chunks full chunks of every tensor
        (fewer when the tensor has fewer chunks)."""
        chunks = min(self.max_chunks, self.num_chunks)
        return chunks * len(self.names) * self.chunk_elems * self.dtype.itemsize

    def reset_counters(self):
        self.max_resident = self.resident

    # -- whole tensors (checkpoints) --------------------------------------------------------
    def array(self, name):
        """The whole tensor `name` as a writable np.memmap (an empty array when length is 0)."""
        if self.length == 0:
            return np.zeros(0, self.dtype)
        if name not in self._maps:
            self._maps[name] = np.memmap(self.file(name), self.dtype, "r+", shape=(self.length,))
        return self._maps[name]

    # -- chunk I/O ---------------------------------------------------------------------------
    def _read(self, name, lo, hi):
        buf = np.zeros(self.chunk_elems, self.dtype)
        want = (hi - lo) * self.dtype.itemsize
        got = os.preadv(self._fds[name], [memoryview(buf).cast("B")[:want]],
                        lo * self.dtype.itemsize)
        if got != want:
            raise RtxmpiError(f"offload file {self.file(name)}: read {got} of {want} bytes at "
                              f"element {lo} (was it truncated?)")
        return buf

    def _write(self, name, lo, hi, buf):
        view = memoryview(np.ascontiguousarray(buf[:hi - lo])).cast("B")
        offset = lo * self.dtype.itemsize
        while len(view):
            n = os.pwrite(self._fds[name], view, offset)
            view, offset = view[n:], offset + n

    def _resident(self, delta):
        with self._lock:
            self.resident += delta
            self.max_resident = max(self.max_resident, self.resident)

    def stream(self, update, names=None):
        """For every chunk in order: update(i, lo, hi, arrays) with arrays = {name: buffer of
        chunk_elems elements, [:hi - lo] the tensor's [lo, hi), the rest zeros}; the caller
        updates the buffers in place and they are written back (all of `names`, default every
        tensor). The next chunks are read ahead while update runs, at most max_chunks in memory.
        Returns after every chunk is written. Re-raises an exception of update or of the I/O
        threads (chunks already written stay written). Local."""
        names = self.names if names is None else tuple(names)
        slots = threading.BoundedSemaphore(self.max_chunks)
        loaded = queue.Queue(maxsize=self.max_chunks)
        dirty = queue.Queue()
        stop = threading.Event()
        errors = []

        def reader():
            try:
                for i in range(self.num_chunks):
                    while not slots.acquire(timeout=_POLL_S):
                        if stop.is_set():
                            return
                    if stop.is_set():
                        slots.release()
                        return
                    lo, hi = self.chunk_range(i)
                    arrays = {name: self._read(name, lo, hi) for name in names}
                    self._resident(1)
                    self.chunks_read += 1
                    loaded.put((i, lo, hi, arrays))
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                errors.append(exc)
                stop.set()

        def writer():
            try:
                while True:
                    item = dirty.get()
                    if item is None:
                        return
                    _, lo, hi, arrays = item
                    if not errors:
                        for name in names:
                            self._write(name, lo, hi, arrays[name])
                        self.chunks_written += 1
                    del arrays, item
                    self._resident(-1)
                    slots.release()
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=reader, name="offload-reader", daemon=True),
                   threading.Thread(target=writer, name="offload-writer", daemon=True)]
        for t in threads:
            t.start()
        in_hand = None  # a chunk taken from the reader and not yet handed to the writer
        try:
            for _ in range(self.num_chunks):
                while True:
                    try:
                        item = loaded.get(timeout=_POLL_S)
                        break
                    except queue.Empty:
                        if stop.is_set():
                            raise errors[0] if errors else RtxmpiError("offload reader stopped")
                in_hand = item
                update(*item)
                dirty.put(item)
                in_hand = item = None
        except BaseException:
            stop.set()
            if in_hand is not None:  # never written back
                self._resident(-1)
            in_hand = item = None
            raise
        finally:
            dirty.put(None)
            for t in threads:
                t.join()
            while not loaded.empty():  # left by a failed update: never written back
                loaded.get_nowait()
                self._resident(-1)
        if errors:
            raise errors[0]

    def write_chunks(self, fill, names=None):
        """Overwrite tensors chunk by chunk: fill(lo, hi) -> {name: 1-D array of hi - lo}.
        Synchronous; one chunk in memory at a time. Local."""
        names = self.names if names is None else tuple(names)
        for i in range(self.num_chunks):
            lo, hi = self.chunk_range(i)
            values = fill(lo, hi)
            for name in names:
                self._write(name, lo, hi, np.asarray(values[name], self.dtype))

    def close(self, remove=True):
        """Close the files; remove=True deletes rank_XXXXX/ and its files. Idempotent. Local."""
        for mm in self._maps.values() if hasattr(self, "_maps") else ():
            mm.flush()
        self._maps = {}
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if remove and os.path.isdir(self.path):
            shutil.rmtree(self.path, ignore_errors=True)
