"""Checkpoint I/O: rtxmpi save_checkpoint / load_checkpoint against plain writes and reads of the
same bytes, in one MPI job.

    mpiexec -n N python bench/checkpoint.py [--size-mb 256] [--repeats 5] [--dir DIR] [--json FILE]

The checkpoint holds three float32 tensors ("params", "adam.m", "adam.v", as train.py saves) of
--size-mb MiB in all; rank r owns 1/N of each (the ZeRO / Shard.even shape) and writes only that.
Per repetition, in a rotating order, every rank writes the same bytes (all ranks at once) to
new files (repetition r saves step r + 1; the previous repetition's files are deleted untimed):
  raw write    open / write / fsync of one file per rank
  h5py write   one HDF5 file per rank with the three datasets, then fsync (the format without
               rtxmpi's protocol: no checksum, no tmp + rename, no metadata commit)
  rtxmpi save  save_checkpoint (agree, write tmp + crc32c + fsync, rename, gather, metadata, latest)
then the page cache is emptied of those files (see --evict) and, in a rotating order:
  raw read     os.readv of the raw file into a preallocated buffer
  h5py read    read_direct of the three datasets into preallocated buffers
  rtxmpi load  load_checkpoint + Checkpoint.read_many({name: (offset, length, out)}) of this rank's
               range of every tensor
               (verifies each dataset's crc32c while streaming)
  resharded    (N >= 2) the first N/2 ranks load the N-rank checkpoint: each reads 2/N
  same-size    ... and a checkpoint those N/2 ranks saved themselves (same bytes, same readers)
A phase's time is its slowest rank's (barrier before, MAX after); bandwidth = all ranks' bytes /
that time; tables show the median over repetitions. Targets (reported, never asserted): save >=
0.8x h5py write + fsync bandwidth; load >= 0.8x uncached h5py read bandwidth; resharded load time
<= 1.5x the same-size load.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import (fmt, machine_info, machine_line, launch_command, markdown_table,  # noqa: E402
                     progress, write_json)
from rtxmpi.checkpoint.format import fsync_path  # noqa: E402 - the same fsync the protocol uses

NAMES = ("params", "adam.m", "adam.v")
WRITES = ("raw write", "h5py write", "rtxmpi save")
READS = ("raw read", "h5py read", "rtxmpi load")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=256.0, help="checkpoint size in MiB, all ranks together")
    p.add_argument("--repeats", type=int, default=5, help="repetitions of every phase")
    p.add_argument("--dir", default=None,
                   help="where files go (default: a fresh directory in the temporary directory, "
                        "removed at the end; it must be on the disk you mean to measure, not tmpfs)")
    p.add_argument("--evict", choices=("auto", "fadvise", "none"), default="auto",
                   help="how reads start uncached: auto = rank 0 writes 1 to /proc/sys/vm/drop_caches "
                        "when allowed, and every rank posix_fadvise(DONTNEED)s its files; fadvise = "
                        "only the latter; none = measure reads from the page cache")
    p.add_argument("--json", default=None, help="write every number and the machine facts here")
    return p.parse_args()


def _cached_kib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1])
    return -1


class Bench:
    def __init__(self, args):
        import numpy as np

        import rtxmpi
        from rtxmpi.parallel.zero import shard_range

        self.np, self.args = np, args
        self.world = rtxmpi.init(check=False)
        self.rank, self.size = self.world.rank, self.world.world_size
        per_tensor = int(args.size_mb * 2**20) // (4 * len(NAMES))
        self.numel = max(self.size, per_tensor - per_tensor % (2 * self.size))  # even split at N and N/2
        self.total_bytes = 4 * self.numel * len(NAMES)
        self.start, self.stop = shard_range(self.numel, self.size, self.rank)
        n = self.stop - self.start
        rng = np.random.default_rng(self.rank)
        self.data = {name: rng.standard_normal(n, dtype=np.float32) for name in NAMES}
        self.out = {name: np.ones(n, np.float32) for name in NAMES}  # preallocated and touched
        self.raw_out = np.ones(len(NAMES) * n, np.float32)
        self.half = None
        if self.size >= 2:
            h = self.size // 2
            self.half = self.world.new_group(range(h))
            if self.half is not None:
                a, b = shard_range(self.numel, h, self.half.rank)
                self.half_range = (a, b)
                self.half_data = {name: rng.standard_normal(b - a, dtype=np.float32) for name in NAMES}
                self.half_out = {name: np.ones(b - a, np.float32) for name in NAMES}
        self.times = {k: [] for k in WRITES + READS + ("resharded load", "same-size load")}
        self.evicted = []

    # -- timing ---------------------------------------------------------------------------------
    def timed(self, group, fn):
        group.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        buf = self.np.array([elapsed])
        group.all_reduce(buf, op="max")
        return float(buf[0])

    # -- the writers ------------------------------------------------------------------------------
    def raw_write(self, path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for name in NAMES:
                view = memoryview(self.data[name]).cast("B")
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def h5_write(self, path):
        import h5py

        with h5py.File(path, "w", libver="latest") as f:
            for name in NAMES:
                f.create_dataset(name, data=self.data[name])
        fsync_path(path)

    def rtxmpi_save(self, ckpt_dir, step, group=None, data=None, start=None):
        from rtxmpi.checkpoint import Shard, save_checkpoint

        group = group or self.world
        data = data or self.data
        start = self.start if start is None else start
        shards = {name: Shard(data[name], start, self.numel) for name in NAMES}
        save_checkpoint(group, ckpt_dir, step, shards)

    # -- the readers -------------------------------------------------------------------------------
    def raw_read(self, path):
        fd = os.open(path, os.O_RDONLY)
        try:
            view = memoryview(self.raw_out).cast("B")
            while view:
                got = os.readv(fd, [view])
                if got == 0:
                    raise OSError(f"{path}: short read")
                view = view[got:]
        finally:
            os.close(fd)

    def h5_read(self, path):
        import h5py

        with h5py.File(path, "r") as f:
            for name in NAMES:
                f[name].read_direct(self.out[name])

    def rtxmpi_load(self, group, ckpt_dir, start, out):
        from rtxmpi.checkpoint import load_checkpoint

        ckpt = load_checkpoint(group, ckpt_dir)
        if not hasattr(ckpt, "read_many"):  # an rtxmpi before read_many (before/after comparisons)
            for name in NAMES:
                ckpt.read(name, start, len(out[name]), out=out[name])
            return
        ckpt.read_many({name: (start, len(out[name]), out[name]) for name in NAMES})

    # -- the page cache ------------------------------------------------------------------------------
    def evict(self, paths):
        """Empty the page cache of `paths` (this rank's files); collective over the world."""
        from mpi4py import MPI

        if self.args.evict == "none":
            self.world.barrier()
            return "none (page cache)"
        before = MPI.COMM_WORLD.bcast(_cached_kib() if self.rank == 0 else None, root=0)
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self.world.barrier()
        method = "posix_fadvise(DONTNEED) per file"
        if self.args.evict == "auto" and self.rank == 0:
            try:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("1\n")
                method = "drop_caches=1 + " + method
            except OSError:
                pass
        method = MPI.COMM_WORLD.bcast(method, root=0)
        self.world.barrier()
        if self.rank == 0:
            self.evicted.append((before - _cached_kib()) * 1024)
        return method

    # -- one repetition ---------------------------------------------------------------------------------
    def remove_previous(self, root, rep):
        """Delete repetition `rep - 1`'s files (untimed): every writer writes new files, as a
        training run's saves do; deleting old data is no part of a write's bandwidth."""
        if rep == 0:
            return
        old = os.path.join(root, f"base_r{self.rank:05d}_{rep - 1}")
        for path in (old + ".bin", old + ".h5"):
            os.remove(path)
        if self.rank == 0:
            for name in ("ckpt", "ckpt_half"):
                shutil.rmtree(os.path.join(root, name, f"step_{rep:08d}"), ignore_errors=True)
        self.world.barrier()

    def run(self, root):
        ckpt = os.path.join(root, "ckpt")
        half_ckpt = os.path.join(root, "ckpt_half")
        method = None
        for rep in range(self.args.repeats):
            self.remove_previous(root, rep)
            mine, step = os.path.join(root, f"base_r{self.rank:05d}_{rep}"), rep + 1
            writes = {"raw write": lambda: self.raw_write(mine + ".bin"),
                      "h5py write": lambda: self.h5_write(mine + ".h5"),
                      "rtxmpi save": lambda: self.rtxmpi_save(ckpt, step)}
            reads = {"raw read": lambda: self.raw_read(mine + ".bin"),
                     "h5py read": lambda: self.h5_read(mine + ".h5"),
                     "rtxmpi load": lambda: self.rtxmpi_load(self.world, ckpt, self.start, self.out)}
            k = rep % 3
            for name in WRITES[k:] + WRITES[:k]:
                self.times[name].append(self.timed(self.world, writes[name]))
            if self.half is not None:  # the N/2-rank checkpoint for the same-size load (untimed)
                self.rtxmpi_save(half_ckpt, step, self.half, self.half_data, self.half_range[0])
            self.world.barrier()
            files = [mine + ".bin", mine + ".h5", os.path.join(ckpt, f"step_{step:08d}",
                                                                 f"rank_{self.rank:05d}.h5")]
            if self.half is not None:
                files.append(os.path.join(half_ckpt, f"step_{step:08d}", f"rank_{self.half.rank:05d}.h5"))
            method = self.evict(files)
            for name in READS[k:] + READS[:k]:
                self.times[name].append(self.timed(self.world, reads[name]))
            if self.size >= 2:
                self.reshard_pair(rep, ckpt, half_ckpt, files)
            if self.rank == 0:
                progress(f"[checkpoint] repetition {rep + 1}/{self.args.repeats} done")
        return method

    def reshard_pair(self, rep, ckpt, half_ckpt, files):
        """Resharded (N-rank checkpoint) and same-size (N/2-rank checkpoint) loads on the first
        N/2 ranks, each from a cold cache; the other ranks wait at the world barrier."""
        pair = [("resharded load", ckpt), ("same-size load", half_ckpt)]
        for name, where in (pair if rep % 2 == 0 else pair[::-1]):
            self.evict(files)
            elapsed = None
            if self.half is not None:
                elapsed = self.timed(self.half, lambda: self.rtxmpi_load(
                    self.half, where, self.half_range[0], self.half_out))
            self.world.barrier()
            if self.rank == 0:
                self.times[name].append(elapsed)

    def check(self):
        """The last loads returned the saved bytes (rtxmpi load and same-size/resharded)."""
        np = self.np
        for name in NAMES:
            if not np.array_equal(self.out[name], self.data[name]):
                raise SystemExit(f"rank {self.rank}: {name} read back differs")


def cpu_costs_gbps(np, nbytes=16 << 20, repeats=5):
    """One core's checksum (crc32c, written now; zlib crc32, format version 1) and memory-copy
    bandwidth (GB/s, best of `repeats`) on a 16 MiB buffer: the CPU work save and load add per
    byte (one read chunk)."""
    import zlib

    import crc32c

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    work = {"crc32c": lambda: crc32c.crc32c(src), "crc32": lambda: zlib.crc32(src),
            "copy": lambda: np.copyto(dst, src)}
    best = {k: float("inf") for k in work}
    for _ in range(repeats):
        for k, fn in work.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: nbytes / t / 1e9 for k, t in best.items()}


def main():
    args = parse_args()
    bench = Bench(args)
    world = bench.world
    info = machine_info() if bench.rank == 0 else None
    root = args.dir
    if bench.rank == 0:
        if root is None:
            root = tempfile.mkdtemp(prefix="rtxmpi_bench_checkpoint_")
        os.makedirs(root, exist_ok=True)
        progress(f"[checkpoint] {bench.size} ranks, {bench.total_bytes / 2**20:.0f} MiB, files in {root}")
    from mpi4py import MPI

    root = MPI.COMM_WORLD.bcast(root, root=0)
    t_start = time.perf_counter()
    try:
        method = bench.run(root)
        bench.check()
    finally:
        world.barrier()
        if bench.rank == 0 and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if bench.rank != 0:
        return
    cpu = cpu_costs_gbps(bench.np)
    med = {k: statistics.median(v) for k, v in bench.times.items() if v}
    gbps = {k: bench.total_bytes / t / 1e9 for k, t in med.items()}
    command = launch_command(bench.size)
    rows = [[k, fmt(med[k] * 1e3, 1), fmt(gbps[k]), fmt(min(bench.times[k]) * 1e3, 1),
             {"rtxmpi save": f"{gbps['rtxmpi save'] / gbps['h5py write']:.2f}x h5py write",
              "rtxmpi load": f"{gbps['rtxmpi load'] / gbps['h5py read']:.2f}x h5py read",
              "h5py write": f"{gbps['h5py write'] / gbps['raw write']:.2f}x raw write",
              "h5py read": f"{gbps['h5py read'] / gbps['raw read']:.2f}x raw read"}.get(k, "")]
            for k in WRITES + READS]
    half = bench.size // 2
    for k in ("same-size load", "resharded load"):
        if k in med:
            rows.append([f"{k} ({half} rank{'s' if half > 1 else ''})", fmt(med[k] * 1e3, 1), fmt(gbps[k]),
                         fmt(min(bench.times[k]) * 1e3, 1),
                         f"{med[k] / med['same-size load']:.2f}x same-size time"
                         if k == "resharded load" else ""])
    evicted = statistics.median(bench.evicted) if bench.evicted else None
    print(f"Checkpoint I/O, {bench.size} rank{'s' if bench.size > 1 else ''}, {bench.total_bytes / 2**20:.0f} MiB "
          f"({len(NAMES)} float32 tensors, 1/{bench.size} per rank), median of {args.repeats}; "
          f"time = slowest rank; GB/s = all ranks' bytes / time")
    print(f"reads start after: {method}"
          + (f" (page cache shrank by a median {evicted / 2**20:.0f} MiB)" if evicted is not None else ""))
    print()
    print(markdown_table(["phase", "median ms", "GB/s", "min ms", "ratio"], rows, align="lrrrl"))
    targets = {"save_vs_write": gbps["rtxmpi save"] / gbps["h5py write"],
               "load_vs_read": gbps["rtxmpi load"] / gbps["h5py read"]}
    if "resharded load" in med:
        targets["resharded_vs_same_size_time"] = med["resharded load"] / med["same-size load"]
    print()
    verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    print(f"- Target save >= 0.8x h5py write+fsync bandwidth: {targets['save_vs_write']:.3f}x -> "
          f"{verdict(targets['save_vs_write'] >= 0.8)}")
    print(f"- Target load >= 0.8x h5py read bandwidth: {targets['load_vs_read']:.3f}x -> "
          f"{verdict(targets['load_vs_read'] >= 0.8)}")
    if "resharded_vs_same_size_time" in targets:
        r = targets["resharded_vs_same_size_time"]
        print(f"- Target resharded load ({half} rank{'s' if half > 1 else ''} reading the {bench.size}-rank checkpoint) "
              f"<= 1.5x the same-size load time: {r:.3f}x -> {verdict(r <= 1.5)}")
    print(f"- CPU work per byte on one core (rank 0, after the run): crc32c {cpu['crc32c']:.1f} GB/s "
          f"(zlib.crc32 {cpu['crc32']:.1f}), memory copy {cpu['copy']:.1f} GB/s")
    print(f"\nmachine: {machine_line(info)}")
    print(f"command: {command}")
    print(f"total run time {time.perf_counter() - t_start:.1f} s")
    if args.json:
        write_json(args.json, {"args": vars(args), "machine": info, "command": command,
                               "world_size": bench.size, "total_bytes": bench.total_bytes,
                               "evict_method": method, "page_cache_evicted_bytes": bench.evicted,
                               "times_s": bench.times, "median_s": med, "gbps": gbps,
                               "targets": targets, "cpu_gbps": cpu})


if __name__ == "__main__":
    main()
