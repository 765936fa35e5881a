"""Where a step's time went, from its trace spans: interval arithmetic over one rank's spans.

    from rtxmpi.observe.breakdown import breakdown
    b = breakdown(trace.events(), start_us, end_us, rank=0, step=7)
    b.compute_ms, b.exposed_comm_ms, b.overlap_pct

Spans are (name, category, start_us, dur_us, args) tuples (rtxmpi.observe.trace). Inside the step
window [start_us, end_us) every instant is charged to exactly one bucket, in this priority:
  checkpoint  -- inside a "checkpoint" span (collectives a checkpoint runs count as checkpoint);
  comm        -- exposed communication: inside a blocking "comm" span (args async False) or a
                 "wait" span (blocked in Work.wait), and no checkpoint;
  data        -- inside a "data" span (loading the batch);
  compute     -- inside "forward", "backward", "optimizer", "compute" or "eval";
  other       -- none of these (Python between spans, logging, ...).
Communication in flight: the union of every "comm" span (async ones from launch to completion).
hidden = the part of it that overlaps compute (not blocked). overlap_pct = hidden / in flight.
Bytes moved follow the nccl-tests bus-bandwidth convention: per rank a ring all_reduce moves
2 (n - 1) / n of the payload, reduce_scatter / all_gather / all_to_all (n - 1) / n, broadcast and
point-to-point 1x; a span's bytes count in the window where it ends.
"""
from dataclasses import asdict, dataclass

COMPUTE = frozenset({"forward", "backward", "optimizer", "compute", "eval"})
_BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "broadcast": lambda n: 1.0 if n > 1 else 0.0, "send": lambda n: 1.0,
               "recv": lambda n: 1.0, "barrier": lambda n: 0.0}


# -- intervals: sorted lists of disjoint (start, end) -------------------------------------------
def union(intervals):
    """Merge (start, end) pairs into sorted disjoint intervals (empty ones dropped)."""
    out = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def measure(intervals):
    return sum(e - s for s, e in intervals)


def intersect(a, b):
    """Intersection of two disjoint sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b):
    """a minus b, both disjoint sorted interval lists."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def bus_bytes(op, nbytes, world_size):
    """Bytes one rank moves for a collective `op` of `nbytes` payload in a group of `world_size`."""
    factor = _BUS_FACTOR.get(op)
    return 0.0 if factor is None or world_size < 1 else nbytes * factor(world_size)


@dataclass
class StepBreakdown:
    """One rank's step, in milliseconds (floats) unless named otherwise.

    step_ms = checkpoint_ms + exposed_comm_ms + data_ms + compute_ms + other_ms.
    comm_ms: communication in flight (union of comm spans); hidden_comm_ms: its part overlapping
    compute. overlap_pct = 100 hidden / comm (100 when there is no communication). comm_calls:
    collectives that ended in the window.
    allreduce_pct = 100 exposed_comm / step. bus_bytes: bytes moved (bus convention);
    net_bw_gbps = bus_bytes / comm time, in GB/s (1e9 bytes/s; 0 without communication).
    """

    rank: int
    step: int
    start_us: float
    step_ms: float
    compute_ms: float
    data_ms: float
    exposed_comm_ms: float
    checkpoint_ms: float
    other_ms: float
    comm_ms: float
    hidden_comm_ms: float
    bus_bytes: float
    comm_calls: int = 0

    @property
    def overlap_pct(self):
        return 100.0 * self.hidden_comm_ms / self.comm_ms if self.comm_ms > 0 else 100.0

    @property
    def allreduce_pct(self):
        return 100.0 * self.exposed_comm_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def net_bw_gbps(self):
        return self.bus_bytes / (self.comm_ms * 1e6) if self.comm_ms > 0 else 0.0

    def as_dict(self):
        return {**asdict(self), "overlap_pct": self.overlap_pct,
                "allreduce_pct": self.allreduce_pct, "net_bw_gbps": self.net_bw_gbps}


def breakdown(events, start_us, end_us, *, rank=0, step=0):
    """The StepBreakdown of the window [start_us, end_us) from `events` (one rank's spans)."""
    by = {"checkpoint": [], "blocked": [], "data": [], "compute": [], "comm": []}
    moved, calls = 0.0, 0
    for name, cat, s, d, args in events:
        e = s + d
        if e <= start_us or s >= end_us:
            continue
        iv = (max(s, start_us), min(e, end_us))
        if cat == "comm":
            by["comm"].append(iv)
            if not args.get("async"):
                by["blocked"].append(iv)
            if e <= end_us:
                calls += 1
                moved += bus_bytes(args.get("op", name), args.get("bytes", 0),
                                   args.get("world_size", 1))
        elif cat == "wait":
            by["blocked"].append(iv)
        elif cat in by:
            by[cat].append(iv)
        elif cat in COMPUTE:
            by["compute"].append(iv)
    ckpt = union(by["checkpoint"])
    blocked = subtract(union(by["blocked"]), ckpt)
    taken = union(ckpt + blocked)
    data = subtract(union(by["data"]), taken)
    taken = union(taken + data)
    compute = subtract(union(by["compute"]), taken)
    comm = union(by["comm"])
    hidden = intersect(comm, compute)
    ms = lambda iv: measure(iv) / 1e3  # noqa: E731
    step_ms = (end_us - start_us) / 1e3
    parts = ms(ckpt) + ms(blocked) + ms(data) + ms(compute)
    return StepBreakdown(rank=int(rank), step=int(step), start_us=float(start_us),
                         step_ms=step_ms, compute_ms=ms(compute), data_ms=ms(data),
                         exposed_comm_ms=ms(blocked), checkpoint_ms=ms(ckpt),
                         other_ms=max(0.0, step_ms - parts), comm_ms=ms(comm),
                         hidden_comm_ms=ms(hidden), bus_bytes=moved, comm_calls=calls)


def step_breakdowns(spans_by_rank):
    """StepBreakdowns of every step of every rank, from the "step" spans (args {"step": s}).

    spans_by_rank: {rank: [span tuples]} (rtxmpi.observe.timeline.load_chrome_trace, or
    gather_events). Returns a list ordered by (step, rank).
    """
    from bisect import bisect_left, bisect_right

    out = []
    for rank, spans in spans_by_rank.items():
        spans = sorted(spans, key=lambda e: e[2])
        starts = [e[2] for e in spans]
        longest = max((e[3] for e in spans if e[1] != "step"), default=0.0)
        for name, cat, s, d, args in spans:
            if cat != "step":
                continue
            lo, hi = bisect_left(starts, s - longest), bisect_right(starts, s + d)
            window = [e for e in spans[lo:hi] if e[1] != "step"]
            out.append(breakdown(window, s, s + d, rank=rank, step=args.get("step", 0)))
    out.sort(key=lambda b: (b.step, b.rank))
    return out


def median_steps(breakdowns):
    """{rank: StepBreakdown} of the median step: the one step, common to every rank, whose step_ms
    averaged over the ranks is the median (the lower median for an even count, so it is a real
    step; steps some rank lacks are skipped unless no step has every rank). Each rank's parts add
    up to its step_ms, which per-part medians do not, and all ranks show the same step. Ordered by
    rank; {} for an empty list."""
    by_step = {}
    for b in breakdowns:
        by_step.setdefault(b.step, {})[b.rank] = b
    if not by_step:
        return {}
    ranks = {b.rank for b in breakdowns}
    steps = [s for s, row in by_step.items() if set(row) == ranks] or list(by_step)
    steps.sort(key=lambda s: (sum(b.step_ms for b in by_step[s].values()) / len(by_step[s]), s))
    return dict(sorted(by_step[steps[(len(steps) - 1) // 2]].items()))
