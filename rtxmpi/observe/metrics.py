"""Prometheus metrics of a training run: per rank, and the cross-rank view on rank 0.

    m = Metrics(rank=0, local_rank=0, job="gpt", port=9400)       # serves 127.0.0.1:9400/metrics
    m.update({"step_time_ms": 41.0, "tokens_per_s": 1.2e5, ...})
    m.update_cross(table)                                           # rank 0: min/median/max

Gauges (names from docs/observe.md and docs/design.md), labelled {rank, job}:
  step_time_ms    wall time of the last step (ms)
  tokens_per_s    global tokens per second at that step time
  allreduce_pct   exposed communication (blocking collectives + waits) as % of the step
  overlap_pct     % of communication time hidden behind compute (rtxmpi.observe.breakdown)
  net_bw_gbps     bus bytes moved / communication time, GB/s (1e9 bytes/s; nccl-tests busbw)
  alloc_frag_pct  allocator memory held but not in use, % (alloc_frag_pct() below)
  oom_count       out-of-memory errors seen by this process
Rank 0 also exports, labelled {job, stat} with stat in min, median, max: `<name>_cross` for each
name above, and `slowest_rank` {job}: the rank whose own work (compute + data) took longest.

Exposure: `port` serves http://BIND:(port + local_rank)/metrics (BIND 127.0.0.1 by default, so
ranks sharing a host never collide); `textfile` writes the exposition format atomically for
node_exporter's textfile collector (with several ranks, rank r writes NAME.rank<r>.prom).
"""
import ctypes
import os
import statistics

from prometheus_client import CollectorRegistry, Gauge, start_http_server, write_to_textfile

NAMES = ("step_time_ms", "tokens_per_s", "allreduce_pct", "overlap_pct", "net_bw_gbps",
         "alloc_frag_pct", "oom_count")
_HELP = {"step_time_ms": "wall time of the last training step in milliseconds",
         "tokens_per_s": "global tokens per second at the last step time",
         "allreduce_pct": "exposed communication (blocking collectives and waits) in % of the step",
         "overlap_pct": "share of communication time hidden behind compute, in %",
         "net_bw_gbps": "bus bytes moved over measured communication time, GB/s",
         "alloc_frag_pct": "allocator memory held but not in use, in % (CuPy pool / glibc heap)",
         "oom_count": "out-of-memory errors seen by this process"}
STATS = ("min", "median", "max")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


def _libc_mallinfo2():
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_mallinfo2 = _libc_mallinfo2()


def alloc_frag_pct(device="cpu"):
    """Allocator fragmentation in percent, or NaN where it cannot be read.

    On a GPU ("cuda:i"): CuPy's default memory pool, 100 * (total_bytes - used_bytes) /
    total_bytes: device memory the pool holds in free blocks that no array uses (0 for an empty
    pool). On CPU: glibc malloc's heap, 100 * fordblks / arena (mallinfo2): bytes of the main heap
    that are free but still held by the process, i.e. not returned to the OS. Large numpy arrays are
    mmap'ed (outside the arena) and do not count.
    """
    if str(device).startswith("cuda"):
        try:
            import cupy
        except ImportError:
            return float("nan")
        pool = cupy.get_default_memory_pool()
        total = pool.total_bytes()
        return 100.0 * (total - pool.used_bytes()) / total if total else 0.0
    if _mallinfo2 is None:
        return float("nan")
    info = _mallinfo2()
    return 100.0 * info.fordblks / info.arena if info.arena else 0.0


def textfile_path(path, rank, world_size):
    """The textfile this rank writes: `path` itself on one rank, else NAME.rank<r>.prom."""
    if world_size == 1:
        return path
    stem = path[:-5] if path.endswith(".prom") else path
    return f"{stem}.rank{rank}.prom"


class Metrics:
    """The gauges of one rank (see the module docstring) in their own registry.

    rank, local_rank: this process's ranks; job: the `job` label. port: serve over HTTP on
    (port + local_rank) at `bind`, or None. textfile: node_exporter textfile path, or None.
    cross: also hold the cross-rank gauges (rank 0). Raises OSError when the port cannot be bound
    (the caller agrees on it across ranks). Local: nothing here communicates.
    """

    def __init__(self, *, rank, local_rank=0, world_size=1, job="rtxmpi", port=None,
                 bind="127.0.0.1", textfile=None, cross=False):
        self.rank, self.job = int(rank), str(job)
        self.registry = CollectorRegistry()
        self.gauges = {n: Gauge(n, _HELP[n], ["rank", "job"], registry=self.registry)
                       for n in NAMES}
        self._mine = {n: g.labels(rank=str(self.rank), job=self.job) for n, g in self.gauges.items()}
        self.cross = None
        if cross:
            self.cross = {n: Gauge(f"{n}_cross", f"{_HELP[n]}: min, median, max over ranks",
                                   ["job", "stat"], registry=self.registry) for n in NAMES}
            self.slowest = Gauge("slowest_rank", "rank whose own work (compute + data) took "
                                 "longest in the last step", ["job"], registry=self.registry)
            self._cross = {(n, stat): g.labels(job=self.job, stat=stat)
                           for n, g in self.cross.items() for stat in STATS}
        self.textfile = None if textfile is None else textfile_path(textfile, rank, world_size)
        self.server = self.address = None
        if port is not None:
            self.address = (bind, int(port) + int(local_rank))
            self.server, _ = start_http_server(self.address[1], addr=bind, registry=self.registry)

    def update(self, values):
        """Set this rank's gauges from {name: float} (names outside NAMES are ignored)."""
        for name, value in values.items():
            child = self._mine.get(name)
            if child is not None:
                child.set(float(value))

    def update_cross(self, rows, slowest_rank):
        """rows: one {name: float} per rank. Sets <name>_cross{stat} and slowest_rank."""
        if self.cross is None:
            return
        for name in self.cross:
            values = [float(r[name]) for r in rows]
            for stat, value in zip(STATS, (min(values), statistics.median(values), max(values))):
                self._cross[(name, stat)].set(value)
        self.slowest.labels(job=self.job).set(int(slowest_rank))

    def write_textfile(self):
        """Write the exposition to the textfile (atomic rename), when one was given."""
        if self.textfile is not None:
            write_to_textfile(self.textfile, self.registry)

    def close(self):
        """Write the textfile a last time and stop the HTTP server."""
        self.write_textfile()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def check_textfile(path, name="metrics_textfile"):
    """None when `path` can be written by the textfile exporter, else a message naming `name`."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"{name} {path}: not a writable file path"
    return None
