"""Collective bandwidth and latency: rtxmpi against raw mpi4py (and PyTorch gloo) in the same run.

    mpiexec -n N python bench/collectives.py [--sizes 8,4K:256M] [--ops all_reduce,reduce_scatter,
        all_gather,broadcast] [--iters auto|K] [--json out.json] [--dtype float32] [--check]
        [--async-op] [--shared] [--paths]

Every rank must run it (it is one MPI job). For each message size and operation it times
rtxmpi's ProcessGroup collective and the raw mpi4py buffer call it wraps (`Allreduce(IN_PLACE)`,
`Reduce_scatter_block`, `Allgather`, `Bcast`) and, when `import torch` works, torch.distributed
with the gloo backend. The implementations are interleaved repetition by repetition (the one that
goes first rotates) so machine noise hits all of them alike; buffers are allocated and touched once
and reused (fresh memory pages cost more than the transfer here); every timed call is preceded by an
MPI barrier. A repetition's time is the slowest rank's; the tables show the median (and minimum)
over repetitions.

Sizes are the nccl-tests "size": the all_reduce / broadcast buffer, the reduce_scatter input and
the all_gather output (per-rank shards are size / N). algbw = size / time; busbw = algbw * factor
with factor 2(N-1)/N for all_reduce, (N-1)/N for reduce_scatter and all_gather, 1 for broadcast.
rtxmpi/raw is the ratio of busbw (higher is better; 1.0 = no cost). rtxmpi's reduce_scatter and
all_gather return new arrays, so their time includes that allocation; the raw calls write into
preallocated outputs.

--async-op times the nonblocking forms instead (rtxmpi's async_op=True then Work.wait(), raw
mpi4py's Iallreduce / Ireduce_scatter_block / Iallgather / Ibcast then Wait(), as osu_iallreduce
does; gloo's async_op=True then wait()). --shared allocates the buffers (for every implementation
alike) with rtxmpi.shared_zeros, whose memory the node's peers can map: rtxmpi's all_reduce then
folds straight from the peers' arrays.

Rank 0 prints markdown tables, the per-call overhead at 8 bytes and the command that reproduces the
run on stdout; progress goes to stderr. --json writes every number and the machine facts.
"""
import argparse
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

import rtxmpi
from _common import (format_bytes, fmt, launch_command, machine_info, machine_line,
                     markdown_table, parse_sizes, progress, summarize_s, write_json)

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
DTYPES = ("float32", "float64", "int32", "int64")  # MPI reduces natively; not int8/uint8: Open MPI
# saturates their sums (open-mpi/ompi#8045), so raw would fail the correctness check (group.py widens)
DEFAULT_SIZES = "8,4K:256M"
CELL_BUDGET_S = 1.0  # --iters auto: timed seconds per (size, op), all implementations together
MIN_ITERS, MAX_ITERS = 5, 2000
WARMUP_BUDGET_S = 0.05  # warm-up rounds continue until this long has passed (or 20 rounds)
MAX_WARMUP, MAX_WARMUP_S = 60, 2.0  # ... and while rtxmpi's tuner explores, up to these (a
# tuner whose ranks always share a CPU never sees the bounce run, and never chooses)
TARGET_RATIO, TARGET_RATIO_FROM_BYTES, TARGET_OVERHEAD_US = 0.95, 1 << 20, 10.0
# the shared-memory all_reduce (rtxmpi/comm/shm.py)
TARGET_SHM_RATIO, TARGET_SHM_FROM_BYTES = 2.0, 16 << 20
TARGET_GLOO_RATIO, TARGET_GLOO_FROM_BYTES = 3.0, 1 << 20
TARGET_NEVER_SLOWER = 1.0  # target: rtxmpi all_reduce never slower than raw, at any size


def busbw_factor(op, n):
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_gather": (n - 1) / n, "broadcast": 1.0}[op]


def element_count(op, size_bytes, itemsize, n):
    """Elements of the op's "size" buffer; sharded ops round to a multiple of n (at least n)."""
    count = max(1, size_bytes // itemsize)
    if op in ("reduce_scatter", "all_gather"):
        count = max(n, count - count % n)
    return count


# -- the implementations under test ---------------------------------------------------------------
class Buffers:
    """Allocated and touched once, sized for the largest message; each cell uses prefix views
    (with shared=True from rtxmpi.shared_zeros, for every implementation alike).

    big: all_reduce / broadcast buffer and the all_gather output; src: reduce_scatter input and
    all_gather input; shard: reduce_scatter output of the raw call.
    """

    def __init__(self, max_count, dtype, n, shared=False):
        alloc = rtxmpi.shared_zeros if shared else np.empty  # --shared: memory peers can map
        self.big = alloc(max_count, dtype)
        self.src = alloc(max_count, dtype)
        self.shard = alloc(max(1, max_count // n), dtype)
        for a in (self.big, self.src, self.shard):
            a.fill(0)  # touch every page now, not inside a timed call
        self.nbytes = self.big.nbytes + self.src.nbytes + self.shard.nbytes

    def views(self, op, count, n):
        """(inp, out) of the op: in-place ops return the same view twice."""
        if op in ("all_reduce", "broadcast"):
            return self.big[:count], self.big[:count]
        if op == "reduce_scatter":
            return self.src[:count], self.shard[:count // n]
        return self.src[:count // n], self.big[:count]  # all_gather


def rtxmpi_calls(g, nonblocking=False):
    """nonblocking: each call is the op with async_op=True, then Work.wait()."""
    def make(op, inp, out):
        call = {"all_reduce": lambda **k: g.all_reduce(inp, **k),
                "reduce_scatter": lambda **k: g.reduce_scatter(inp, **k),
                "all_gather": lambda **k: g.all_gather(inp, **k),
                "broadcast": lambda **k: g.broadcast(inp, 0, **k)}[op]
        return (lambda: call(async_op=True).wait()) if nonblocking else call

    def result(op, inp, out, returned):
        return returned

    return make, result


def raw_calls(comm, nonblocking=False):
    """nonblocking: the I-form of each call (Iallreduce, ...), then Wait() (osu_iallreduce)."""
    def make(op, inp, out):
        if nonblocking:
            start = {"all_reduce": lambda: comm.Iallreduce(MPI.IN_PLACE, inp, MPI.SUM),
                     "reduce_scatter": lambda: comm.Ireduce_scatter_block(inp, out, MPI.SUM),
                     "all_gather": lambda: comm.Iallgather(inp, out),
                     "broadcast": lambda: comm.Ibcast(inp, root=0)}[op]
            return lambda: start().Wait()
        if op == "all_reduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, inp, MPI.SUM)
        if op == "reduce_scatter":
            return lambda: comm.Reduce_scatter_block(inp, out, MPI.SUM)
        if op == "all_gather":
            return lambda: comm.Allgather(inp, out)
        return lambda: comm.Bcast(inp, root=0)

    def result(op, inp, out, returned):
        return out

    return make, result


def gloo_calls(dist, torch, nonblocking=False):
    """nonblocking: each call with async_op=True, then wait()."""
    def make(op, inp, out):
        t_in, t_out = torch.from_numpy(inp), torch.from_numpy(out)
        call = {"all_reduce": lambda **k: dist.all_reduce(t_in, **k),
                "reduce_scatter": lambda **k: dist.reduce_scatter_tensor(t_out, t_in, **k),
                "all_gather": lambda **k: dist.all_gather_into_tensor(t_out, t_in, **k),
                "broadcast": lambda **k: dist.broadcast(t_in, 0, **k)}[op]
        return (lambda: call(async_op=True).wait()) if nonblocking else call

    def result(op, inp, out, returned):
        return out

    return make, result


def start_gloo(comm, enabled):
    """(torch, torch.distributed, note): gloo process group over the MPI ranks, or (None, None, why).

    Decided collectively: gloo is used only when every rank can import torch.
    """
    torch = dist = None
    why = "disabled with --no-gloo"
    if enabled:
        try:
            import torch
            import torch.distributed as dist
            why = None
        except ImportError as e:
            why = f"torch is not importable ({e}); install torch in this environment to compare"
    if not comm.allreduce(why is None, op=MPI.LAND):
        return None, None, why or "torch is not importable on every rank"
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(port, root=0))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    return torch, dist, None


# -- correctness (once per op and implementation, before timing) ---------------------------------------
def expected_result(op, count, n, rank, dtype):
    base = np.arange(count, dtype=np.int64) % 1000
    if op == "all_reduce":
        return (n * base + n * (n - 1) // 2).astype(dtype)
    if op == "reduce_scatter":
        shard = count // n
        return (n * base + n * (n - 1) // 2)[rank * shard:(rank + 1) * shard].astype(dtype)
    if op == "all_gather":
        shard = count // n
        return np.concatenate([(base[:shard] + r) for r in range(n)]).astype(dtype)
    return base.astype(dtype)  # broadcast from rank 0


def check_correct(name, make, result, op, buffers, comm, dtype):
    """Run one call on known data; raise SystemExit on every rank if any rank got a wrong answer."""
    n, rank = comm.Get_size(), comm.Get_rank()
    count = element_count(op, 4096, 1, n)
    inp, out = buffers.views(op, count, n)
    inp[...] = np.arange(inp.size) % 1000 + rank
    if op == "broadcast" and rank != 0:
        inp[...] = -1  # overwritten by rank 0's data
    got = result(op, inp, out, make(op, inp, out)())
    ok = bool(np.array_equal(got, expected_result(op, count, n, rank, dtype)))
    for a in (buffers.big, buffers.src, buffers.shard):
        a[:count].fill(0)
    if not comm.allreduce(ok, op=MPI.LAND):
        if rank == 0:
            progress(f"[collectives] {name} {op} returned a wrong result; not benchmarking it")
        raise SystemExit(2)


# -- timing --------------------------------------------------------------------------------------------
def timed_rounds(calls, rounds, first_round, comm):
    """(len(calls), rounds) seconds, each the max over ranks; call order rotates round by round."""
    k = len(calls)
    times = np.zeros((k, rounds))
    barrier = comm.Barrier
    clock = time.perf_counter
    for i in range(rounds):
        for j in range(k):
            impl = (first_round + i + j) % k
            call = calls[impl]
            barrier()
            t0 = clock()
            call()
            times[impl, i] = clock() - t0
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return times


def measure_cell(calls, iters, comm, settled=None, timed=None):
    """Warm up, choose the iteration count (agreed by all ranks), time. Returns (iters, times).
    settled() (local): whether rtxmpi's tuner has chosen (warm-up goes on until every rank says
    so, up to MAX_WARMUP rounds or MAX_WARMUP_S seconds: the steady state of a training run is
    timed, not the tuner's first calls of each algorithm); timed(): called just before the timed
    rounds."""
    warm, spent = 0, 0.0
    while warm < MAX_WARMUP:
        if warm >= 2 and (spent >= MAX_WARMUP_S
                          or comm.allreduce(settled is None or settled(), op=MPI.LAND)):
            if spent >= WARMUP_BUDGET_S or warm >= 20 or spent / warm > 0.1:
                break  # large messages: two warm-up rounds are enough for the caches
        round_s = timed_rounds(calls, 1, warm, comm).sum()  # identical on every rank (max-reduced)
        spent += round_s
        warm += 1
    if iters is None:
        per_round = spent / warm
        iters = int(min(MAX_ITERS, max(MIN_ITERS, CELL_BUDGET_S / max(per_round, 1e-9))))
    if timed is not None:
        timed()
    return iters, timed_rounds(calls, iters, 0, comm)


def tuner_settled(g):
    """Whether the tuner of g's compiled cross-memory all_reduce (local rank 0's, if any) has
    chosen in every size class it has seen (local)."""
    engine = g.backend._shm
    tuner = engine._tuner if engine else None
    return tuner is None or not tuner.exploring()


# -- reporting -----------------------------------------------------------------------------------------
def cell_result(op, size_bytes, n, iters, names, times):
    factor = busbw_factor(op, n)
    impls = {}
    for name, t in zip(names, times):
        stats = summarize_s(list(t))
        algbw = size_bytes / (stats["median_us"] * 1e-6) / 1e9
        stats.update(algbw_gbps=algbw, busbw_gbps=algbw * factor,
                     times_us=[round(x * 1e6, 3) for x in t])
        impls[name] = stats
    ratio = impls["raw"]["median_us"] / impls["rtxmpi"]["median_us"]
    return {"op": op, "size_bytes": size_bytes, "iters": iters, "busbw_factor": factor,
            "impls": impls, "busbw_ratio_rtxmpi_raw": ratio}


def op_table(cells, has_gloo, g, nonblocking=False, shared=False):
    header = ["size", "iters", "rtxmpi us", "raw us", "rtxmpi min us", "raw min us",
              "rtxmpi algbw", "raw algbw", "rtxmpi busbw", "raw busbw", "rtxmpi/raw"]
    if has_gloo:
        header += ["gloo us", "gloo busbw", "rtxmpi/gloo"]
    rows = []
    for c in cells:
        r, w = c["impls"]["rtxmpi"], c["impls"]["raw"]
        row = [format_bytes(c["size_bytes"]), c["iters"], fmt(r["median_us"], 1),
               fmt(w["median_us"], 1), fmt(r["min_us"], 1), fmt(w["min_us"], 1),
               fmt(r["algbw_gbps"], 3), fmt(w["algbw_gbps"], 3), fmt(r["busbw_gbps"], 3),
               fmt(w["busbw_gbps"], 3), fmt(c["busbw_ratio_rtxmpi_raw"], 3)]
        if has_gloo:
            gl = c["impls"].get("gloo")
            row += ([fmt(gl["median_us"], 1), fmt(gl["busbw_gbps"], 3),
                     fmt(gl["median_us"] / r["median_us"], 2)] if gl else ["n/a"] * 3)
        rows.append(row + [op_path(g, c["op"], c["size_bytes"], nonblocking, shared,
                                   c.get("cross_algorithms"))])
    return markdown_table(header + ["rtxmpi path"], rows)


def summary(cells, ops, nonblocking=False):
    """Overhead at each op's smallest size (8 B by default) and the targets, measured (the
    targets are for blocking calls: not judged with nonblocking=True)."""
    lines, verdicts, overhead = [], {}, {}
    for op in ops:
        c = min((c for c in cells if c["op"] == op), key=lambda c: c["size_bytes"], default=None)
        if c is None:
            continue
        r, w = c["impls"]["rtxmpi"], c["impls"]["raw"]
        overhead[op] = {"size_bytes": c["size_bytes"], "median_us": r["median_us"] - w["median_us"],
                        "min_us": r["min_us"] - w["min_us"]}
    if overhead:
        lines.append("Per-call overhead at the smallest size (rtxmpi minus raw, median; min in "
                     "parentheses): " + ", ".join(
                         f"{op} at {format_bytes(o['size_bytes'])} {o['median_us']:+.1f} us "
                         f"({o['min_us']:+.1f})" for op, o in overhead.items()))
    ar = [c for c in cells if c["op"] == "all_reduce"]
    raw = {c["size_bytes"]: c["busbw_ratio_rtxmpi_raw"] for c in ar}
    if nonblocking:
        cells, ar, raw = [], [], {}  # the per-size ratios are in the tables above
        lines.append("--async-op: the targets are defined for blocking calls; not judged here")
    for key, target, from_bytes in (("all_reduce_busbw_ratio", TARGET_RATIO, TARGET_RATIO_FROM_BYTES),
                                    ("all_reduce_shm_busbw_ratio", TARGET_SHM_RATIO,
                                     TARGET_SHM_FROM_BYTES),
                                    ("all_reduce_never_slower", TARGET_NEVER_SLOWER, 0)):
        ratio_target(verdicts, lines, key, "raw", raw, target, from_bytes)
    gloo = {c["size_bytes"]: c["impls"]["gloo"]["median_us"] / c["impls"]["rtxmpi"]["median_us"]
            for c in ar if "gloo" in c["impls"]}
    ratio_target(verdicts, lines, "all_reduce_gloo_busbw_ratio", "PyTorch gloo", gloo,
                 TARGET_GLOO_RATIO, TARGET_GLOO_FROM_BYTES)
    if "all_reduce" in overhead and overhead["all_reduce"]["size_bytes"] <= 8 and not nonblocking:
        o, o_min = overhead["all_reduce"]["median_us"], overhead["all_reduce"]["min_us"]
        verdicts["all_reduce_overhead_8b"] = {"target_us": TARGET_OVERHEAD_US, "measured_us": o,
                                              "measured_min_us": o_min,
                                              "met": o <= TARGET_OVERHEAD_US}
        lines.append(f"Target all_reduce overhead <= {TARGET_OVERHEAD_US:g} us at 8 B: "
                     f"{o:.1f} us median ({o_min:.1f} min) -> "
                     f"{'met' if o <= TARGET_OVERHEAD_US else 'MISSED'}")
    return lines, overhead, verdicts


def ratio_target(verdicts, lines, key, peer, ratios, target, from_bytes):
    """Judge `ratios` ({size in bytes: rtxmpi busbw / peer busbw}) against `target` at sizes >=
    `from_bytes`: adds verdicts[key] and one line naming every size, the worst and met/MISSED."""
    judged = {size: r for size, r in sorted(ratios.items()) if size >= from_bytes}
    if not judged:
        return
    worst_size = min(judged, key=judged.get)
    ok = judged[worst_size] >= target
    verdicts[key] = {"target": target, "from_bytes": from_bytes, "met": ok,
                     "worst": judged[worst_size], "worst_size_bytes": worst_size, "by_size": judged}
    where = f"at >= {format_bytes(from_bytes)}" if from_bytes else "at every size"
    lines.append(f"Target all_reduce busbw >= {target:g}x {peer} {where}: "
                 + ", ".join(f"{format_bytes(size)} {r:.2f}" for size, r in judged.items())
                 + f" -> {'met' if ok else 'MISSED'} (worst {judged[worst_size]:.2f} at "
                   f"{format_bytes(worst_size)})")


def cross_counts(g):
    """{algorithm: calls so far} of the group's compiled cross-memory all_reduce (local rank 0
    picks for every rank: its counts are the group's), or None without it."""
    engine = g.backend._shm
    if not engine or engine.mailbox is None or engine.mode != "cma":
        return None
    box = engine.mailbox
    bounce, direct = box.bounce_calls(), box.direct_calls()
    return {"bounce": bounce, "cma, shared": direct, "cma": engine._cma_calls - bounce - direct}


def cma_kind(engine, size_bytes, shared, counts=None):
    """How the engine's cross-memory all_reduce moved `size_bytes`: "cma, shared" (folded from
    the peers' shared_zeros memory), "bounce" (through the shared slots), "cma" (system calls),
    "bounce 80%, cma 20%" when the tuner (rtxmpi/comm/tuning.py) used both, from the calls
    counted while the cell was timed (`counts`, cross_counts differences); or the arena's mode
    ("copy")."""
    if engine.mode != "cma" or engine.mailbox is None:
        return engine.mode
    if counts and sum(counts.values()):
        total = sum(counts.values())
        used = sorted(((v, k) for k, v in counts.items() if v), reverse=True)
        if len(used) == 1:
            return used[0][1]
        return ", ".join(f"{k} {max(100 * v / total, 1):.0f}%" for v, k in used)  # 1%: a few
    if shared:
        return "cma, shared"
    return "bounce or cma (tuned)" if size_bytes <= engine.bounce_bytes else "cma"


def op_path(g, op, size_bytes, nonblocking=False, shared=False, counts=None):
    """Which algorithm rtxmpi's `op` (blocking, or async_op=True; on shared_zeros buffers or not)
    ran for `size_bytes` (rtxmpi/comm/mpi.py; counts: see cma_kind)."""
    from rtxmpi.comm.mpi import ALL_GATHER_FACTOR

    engine, threshold = g.backend._shm, g.backend.shm_config.threshold
    if not engine:
        return "MPI"
    if nonblocking:  # only all_reduce has a shared-memory nonblocking path: the queue
        if op != "all_reduce" or not engine.queues(size_bytes):
            return "MPI"
        if size_bytes <= engine.small_bytes:
            return "shm mailbox (queued)"
        return f"shm ({cma_kind(engine, size_bytes, shared, counts)}, queued)"
    if op == "all_reduce":
        if size_bytes <= engine.small_bytes:
            return "shm mailbox"
        return (f"shm ({cma_kind(engine, size_bytes, shared, counts)})"
                if size_bytes >= engine.all_reduce_from else "MPI")
    cma = engine.mode == "cma"
    if op == "reduce_scatter" and cma and size_bytes >= threshold:
        return "shm (cma)" if engine.nodes == 1 else "shm (cma, hierarchical)"
    if op == "all_gather" and cma and engine.nodes == 1 and size_bytes >= threshold * ALL_GATHER_FACTOR:
        return "shm (cma)"
    return "MPI"


def shm_line(g):
    """How rtxmpi's all_reduce ran: the shared-memory path's settings and mode (comm/shm.py)."""
    from rtxmpi.comm import shm

    return shm.describe(g.backend, format_bytes)


# -- --paths: every all_reduce algorithm of rtxmpi forced at every size (the thresholds) -------------
MAILBOX_MAX_BYTES = 64 << 20


def path_groups(world, max_bytes):
    """{name: group} with one rtxmpi all_reduce algorithm forced at every size (collective)."""
    from rtxmpi.comm import shm

    mailbox = min(max_bytes, MAILBOX_MAX_BYTES)
    configs = {"mailbox": dict(min_bytes=shm.NEVER, small_bytes=mailbox),
               "bounce": dict(min_bytes=0, small_bytes=0, bounce_any_cpu=True),
               "cross-memory": dict(min_bytes=0, small_bytes=0, bounce_bytes=0),
               "MPI": dict(enabled=False)}
    groups = {}
    saved = shm.CONFIG
    try:
        for name, config in configs.items():
            shm.CONFIG = shm.ShmConfig(**config)
            groups[name] = world.split(0)
    finally:
        shm.CONFIG = saved
    return groups


def measure_paths(world, comm, sizes, iters, dtype):
    """Interleaved: raw Allreduce and rtxmpi's all_reduce with each algorithm forced, on one plain
    numpy array; and the cross-memory path on an rtxmpi.shared_zeros array ("shared": folding
    straight from the peers' memory) against the same raw column. The mailbox runs only up to
    64 MiB (its shared slots are two messages per rank); the bounce is forced on every call,
    whatever CPUs the ranks share (the default lets local rank 0's tuner pick)."""
    groups = path_groups(world, max(sizes))
    for group in groups.values():  # build each group's engine before timing
        group.all_reduce(np.zeros(1, dtype))
    cells = []
    for size in sizes:
        count = element_count("all_reduce", size, dtype.itemsize, comm.Get_size())
        x, shared = np.zeros(count, dtype), rtxmpi.shared_zeros(count, dtype)
        names = ["raw"] + [name for name in groups
                           if name != "mailbox" or size <= MAILBOX_MAX_BYTES]
        calls = [(lambda: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM))] + [
            (lambda g=groups[name]: g.all_reduce(x)) for name in names[1:]]
        names.append("shared")
        calls.append(lambda g=groups["cross-memory"]: g.all_reduce(shared))
        n_iters, times = measure_cell(calls, iters, comm)
        cells.append({"size_bytes": x.nbytes, "iters": n_iters, "impls": {
            name: summarize_s(list(t)) for name, t in zip(names, times)}})
    return cells


def paths_table(cells):
    names = ["mailbox", "bounce", "cross-memory", "MPI", "shared"]
    rows = []
    for c in cells:
        raw = c["impls"]["raw"]["median_us"]
        row = [format_bytes(c["size_bytes"]), c["iters"], fmt(raw, 1)]
        for name in names:
            t = c["impls"].get(name)
            row += [fmt(t["median_us"], 1), fmt(raw / t["median_us"], 2)] if t else ["n/a"] * 2
        best = max((n for n in names if n in c["impls"]),
                   key=lambda n: raw / c["impls"][n]["median_us"])
        rows.append(row + [best])
    header = ["size", "iters", "raw us"]
    for name in names:
        header += [f"{name} us", f"raw/{name}"]
    return markdown_table(header + ["fastest"], rows)


# -- main ----------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="bytes: 'A:B' = A, 4A, 16A, ... <= B, and/or a comma list "
                        f"(default {DEFAULT_SIZES})")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--iters", default="auto",
                   help="timed repetitions per size and op, or 'auto' (about "
                        f"{CELL_BUDGET_S} s each, {MIN_ITERS}..{MAX_ITERS})")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--json", metavar="FILE", help="write all numbers and the machine facts here")
    p.add_argument("--check", action="store_true", help="rtxmpi checking mode (fingerprints)")
    p.add_argument("--no-gloo", action="store_true", help="skip torch gloo even if importable")
    p.add_argument("--async-op", action="store_true",
                   help="time the nonblocking forms: rtxmpi with async_op=True then Work.wait(), "
                        "raw Iallreduce/... then Wait() (osu_iallreduce), gloo async_op=True")
    p.add_argument("--shared", action="store_true",
                   help="allocate the buffers with rtxmpi.shared_zeros (memory the node's peers "
                        "can map; every implementation uses the same buffers)")
    p.add_argument("--paths", action="store_true",
                   help="all_reduce only: time each rtxmpi algorithm (mailbox, bounce, "
                        "cross-memory through the system calls, MPI, and the cross-memory call on "
                        "a shared_zeros array) forced at every size against raw, to place the "
                        "thresholds")
    args = p.parse_args(argv)
    try:
        args.sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        p.error(f"--sizes: {exc}")
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    bad = [op for op in args.ops if op not in OPS]
    if bad or not args.ops:
        p.error(f"--ops: unknown {bad}; choose from {', '.join(OPS)}")
    if args.paths and (args.shared or args.async_op):
        p.error("--paths has its own 'shared' column and times blocking calls: use it without "
                "--shared and --async-op")
    if args.iters == "auto":
        args.iters = None
    else:
        try:
            args.iters = int(args.iters)
        except ValueError:
            p.error(f"--iters must be 'auto' or a positive integer, got {args.iters!r}")
        if args.iters < 1:
            p.error("--iters must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    g = rtxmpi.init(backend="mpi", timeout_s=600, check=args.check)
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    dtype = np.dtype(args.dtype)
    started = time.perf_counter()
    say = progress if rank == 0 else (lambda message: None)

    if args.paths:
        return main_paths(args, g, comm, dtype, started)
    torch, dist, gloo_note = start_gloo(comm, not args.no_gloo)
    info = machine_info({"torch": torch.__version__} if torch is not None else None)
    nb = args.async_op
    # a group's shared-memory engine is built by its first blocking all_reduce (as DataParallel's
    # batch check does at the first forward); the nonblocking path starts from there
    g.all_reduce(np.zeros(1, dtype))
    impls = {"rtxmpi": rtxmpi_calls(g, nb), "raw": raw_calls(comm, nb)}
    if dist is not None:
        impls["gloo"] = gloo_calls(dist, torch, nb)

    max_count = max(element_count(op, s, dtype.itemsize, n) for op in args.ops for s in args.sizes)
    buffers = Buffers(max(max_count, element_count("all_gather", 4096, 1, n)), dtype, n,
                      args.shared)
    unsupported = {}
    for op in args.ops:
        for name, (make, result) in list(impls.items()):
            try:
                check_correct(name, make, result, op, buffers, comm, dtype)
            except (RuntimeError, ValueError, NotImplementedError) as e:
                if name != "gloo":
                    raise
                unsupported[op] = f"gloo: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    say(f"[collectives] n={n} dtype={dtype} sizes={len(args.sizes)} ops={','.join(args.ops)} "
        f"impls={','.join(impls)}; results checked; buffers {format_bytes(buffers.nbytes)} per rank")

    cells = []
    for size in args.sizes:
        t_size = time.perf_counter()
        for op in args.ops:
            count = element_count(op, size, dtype.itemsize, n)
            inp, out = buffers.views(op, count, n)
            names = [name for name in impls if not (name == "gloo" and op in unsupported)]
            calls = [impls[name][0](op, inp, out) for name in names]
            counted = {}
            iters, times = measure_cell(calls, args.iters, comm, lambda: tuner_settled(g),
                                        lambda: counted.update(before=cross_counts(g)))
            cells.append(cell_result(op, count * dtype.itemsize, n, iters, names, times))
            before = counted["before"]
            if op == "all_reduce" and before is not None:
                after = cross_counts(g)
                cells[-1]["cross_algorithms"] = {k: after[k] - before[k] for k in after}
        say(f"[collectives] {format_bytes(size):>8} done in {time.perf_counter() - t_size:6.2f} s "
            f"(elapsed {time.perf_counter() - started:6.1f} s)")

    if dist is not None:
        dist.destroy_process_group()
    if rank != 0:
        return 0

    command = launch_command(n)
    mode = (", nonblocking (async_op=True / I-calls, then wait)" if nb else "") + (
        ", buffers from rtxmpi.shared_zeros" if args.shared else "")
    lines = [f"### Collectives, n={n}, {dtype}, rtxmpi check={'on' if args.check else 'off'}{mode}", "",
             f"Command: `{command}`", "", f"Machine: {machine_line(info)}", "",
             f"rtxmpi shared-memory all_reduce: {shm_line(g)}", ""]
    if gloo_note:
        lines += [f"PyTorch gloo column skipped: {gloo_note}.", ""]
    for op, why in unsupported.items():
        lines += [f"{op}: gloo column skipped ({why}).", ""]
    if {"reduce_scatter", "all_gather"} & set(args.ops):
        lines += ["rtxmpi's reduce_scatter and all_gather return new arrays: their times include "
                  "that allocation; the raw (and gloo) calls write into preallocated outputs.", ""]
    for op in args.ops:
        lines += [f"#### {op} (busbw factor {busbw_factor(op, n):.3g}; times in us, "
                  "bandwidths in GB/s)", "",
                  op_table([c for c in cells if c["op"] == op], "gloo" in impls, g, nb,
                           args.shared), ""]
    summary_lines, overhead, verdicts = summary(cells, args.ops, nb)
    lines += [f"- {line}" for line in summary_lines]
    lines += ["", f"Total run time {time.perf_counter() - started:.1f} s."]
    print("\n".join(lines), flush=True)
    if args.json:
        write_json(args.json, {
            "benchmark": "collectives", "command": command, "machine": info,
            "config": {"world_size": n, "dtype": str(dtype), "sizes_bytes": args.sizes,
                       "ops": args.ops, "iters": args.iters or "auto", "check": args.check,
                       "nonblocking": nb, "shared_buffers": args.shared,
                       "implementations": list(impls), "gloo_note": gloo_note,
                       "gloo_unsupported": unsupported,
                       "timing": "per repetition: max over ranks of one call after a barrier; "
                                 "median/min over repetitions; implementations interleaved"},
            "results": cells, "overhead_us": overhead, "targets": verdicts,
            "wall_s": time.perf_counter() - started})
        progress(f"[collectives] wrote {args.json}")
    return 0


def main_paths(args, g, comm, dtype, started):
    """--paths: the threshold table (rank 0 prints it; --json writes it)."""
    cells = measure_paths(g, comm, args.sizes, args.iters, dtype)
    g.all_reduce(np.zeros(1, dtype))  # builds the world group's engine (the defaults' line)
    if comm.Get_rank() != 0:
        return 0
    command = launch_command(comm.Get_size())
    info = machine_info(None)
    print("\n".join([
        f"### all_reduce algorithms of rtxmpi, each forced at every size, n={comm.Get_size()}, "
        f"{dtype}", "", f"Command: `{command}`", "", f"Machine: {machine_line(info)}", "",
        "Median us per call, interleaved with raw `Allreduce`; raw/x > 1: x is faster than raw. "
        "Every column but `shared` runs on one plain numpy array: `bounce` is the cross-memory "
        "call through the shared bounce slots, `cross-memory` the same call through "
        "process_vm_readv / writev (bounce off); `shared` is the cross-memory call on an "
        "rtxmpi.shared_zeros array (raw stays on the plain one). "
        f"Current defaults: {shm_line(g)}.", "", paths_table(cells), "",
        f"Total run time {time.perf_counter() - started:.1f} s."]), flush=True)
    if args.json:
        write_json(args.json, {"benchmark": "collectives-paths", "command": command,
                               "machine": info, "results": cells})
    return 0


if __name__ == "__main__":
    sys.exit(main())
