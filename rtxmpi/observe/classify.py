"""Bottleneck classifier: what limits a run, from the step breakdowns of its last steps.

    from rtxmpi.observe.classify import classify
    verdict = classify(breakdowns)          # StepBreakdowns of every rank over the last N steps
    print(verdict.label, verdict.hint)

Labels: "compute-bound", "communication-bound", "input-bound", "checkpoint-bound",
"straggler-bound". The model is the critical path of a data-parallel step. Per rank, take the
medians over the steps given; a rank's own work is compute + data (time not spent in collectives).
The slowest rank s (most own work) waits for nobody, so the step is about

    step ~ compute + data + gap + comm_s + checkpoint (+ other)

where compute and data are the other ranks' medians (their typical work), gap = own_s minus the
other ranks' median own work (what every other rank waits for s inside collectives), comm_s the
exposed communication of s (pure communication: s never waits for a peer) and checkpoint the
ranks' median checkpoint time. The label is the largest term: compute, data (input), comm_s
(communication), checkpoint, or gap (straggler). The gap counts only when it is clearly more than
noise: own_s >= STRAGGLER_RATIO (1.3) x the others' and gap >= STRAGGLER_SHARE (20%) of the step.
Each verdict carries the numbers it was decided on and an actionable hint.
"""
import statistics
from dataclasses import dataclass, field

LABELS = ("compute-bound", "communication-bound", "input-bound", "checkpoint-bound",
          "straggler-bound")
STRAGGLER_RATIO = 1.3
STRAGGLER_SHARE = 0.2
_FIELDS = ("step_ms", "compute_ms", "data_ms", "exposed_comm_ms", "checkpoint_ms", "other_ms",
           "comm_ms", "hidden_comm_ms", "bus_bytes", "comm_calls")


@dataclass
class Verdict:
    """label: one of LABELS. costs: ms per step of each term of the critical path (compute, data,
    comm, checkpoint, straggler). shares: % of the median step per part (compute, data, comm,
    checkpoint, other; averaged over ranks). numbers: the other values the decision used. hint:
    what to try. steps: the steps looked at. slowest_rank: the rank with the most own work."""

    label: str
    hint: str
    costs: dict = field(default_factory=dict)
    shares: dict = field(default_factory=dict)
    numbers: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    slowest_rank: int = 0

    def as_dict(self):
        return {"label": self.label, "hint": self.hint, "costs": self.costs,
                "shares": self.shares, "numbers": self.numbers, "steps": self.steps,
                "slowest_rank": self.slowest_rank}

    def __str__(self):
        costs = ", ".join(f"{k} {v:.1f}" for k, v in self.costs.items())
        return f"{self.label} (ms per step: {costs}): {self.hint}"


def _medians(breakdowns):
    """{field: {rank: median over steps}}."""
    by_rank = {}
    for b in breakdowns:
        by_rank.setdefault(b.rank, []).append(b)
    return {name: {r: statistics.median(getattr(b, name) for b in bs)
                   for r, bs in sorted(by_rank.items())} for name in _FIELDS}


def classify(breakdowns, *, bucket_mb=None):
    """The Verdict for `breakdowns` (rtxmpi.observe.breakdown.StepBreakdown of one or more ranks
    over the last steps). bucket_mb: the run's gradient bucket size, quoted in the hint.
    Raises ValueError on an empty list."""
    if not breakdowns:
        raise ValueError("classify() needs at least one step breakdown (was the run traced?)")
    med = _medians(breakdowns)
    ranks = list(med["step_ms"])
    step_ms = statistics.median(med["step_ms"].values())
    own = {r: med["compute_ms"][r] + med["data_ms"][r] for r in ranks}
    slowest = max(ranks, key=own.get)
    typical = [r for r in ranks if r != slowest] or [slowest]
    typ = lambda name: statistics.median(med[name][r] for r in typical)  # noqa: E731
    everyone = lambda name: statistics.median(med[name].values())  # noqa: E731
    rest = statistics.median(own[r] for r in typical)
    gap = own[slowest] - rest
    straggling = (len(ranks) > 1 and own[slowest] >= STRAGGLER_RATIO * rest
                  and gap >= STRAGGLER_SHARE * step_ms)
    costs = {"compute": typ("compute_ms"), "data": typ("data_ms"),
             "comm": med["exposed_comm_ms"][slowest], "checkpoint": everyone("checkpoint_ms"),
             "straggler": gap if straggling else 0.0}
    mean = {name: statistics.fmean(v.values()) for name, v in med.items()}
    pct = lambda ms: 100.0 * ms / step_ms if step_ms > 0 else 0.0  # noqa: E731
    shares = {"compute": pct(mean["compute_ms"]), "data": pct(mean["data_ms"]),
              "comm": pct(mean["exposed_comm_ms"]), "checkpoint": pct(mean["checkpoint_ms"]),
              "other": pct(mean["other_ms"])}
    overlap = 100.0 * mean["hidden_comm_ms"] / mean["comm_ms"] if mean["comm_ms"] else 100.0
    numbers = {"step_ms": step_ms, "world_size": len(ranks), "overlap_pct": overlap,
               "comm_ms": mean["comm_ms"], "comm_calls_per_step": mean["comm_calls"],
               "bytes_per_call": mean["bus_bytes"] / mean["comm_calls"] if mean["comm_calls"] else 0.0,
               "net_bw_gbps": mean["bus_bytes"] / (mean["comm_ms"] * 1e6) if mean["comm_ms"] else 0.0,
               "slowest_rank_own_ms": own[slowest], "other_ranks_own_ms": rest,
               "gap_ms": gap, "straggling": straggling}
    steps = sorted({b.step for b in breakdowns})
    term = max(costs, key=costs.get)
    label = {"compute": "compute-bound", "data": "input-bound", "comm": "communication-bound",
             "checkpoint": "checkpoint-bound", "straggler": "straggler-bound"}[term]
    hint = _hint(label, costs, numbers, med, slowest, bucket_mb)
    return Verdict(label, hint, costs, shares, numbers, steps, slowest)


def _hint(label, costs, numbers, med, slowest, bucket_mb):
    if label == "straggler-bound":
        return (f"rank {slowest} does {numbers['slowest_rank_own_ms']:.1f} ms of its own work per "
                f"step (compute {med['compute_ms'][slowest]:.1f} + data "
                f"{med['data_ms'][slowest]:.1f}) against {numbers['other_ranks_own_ms']:.1f} ms "
                f"on the other ranks, which wait ~{numbers['gap_ms']:.1f} ms for it in "
                f"collectives: look at that rank's host (CPU contention, throttling, a slower "
                f"device or disk, its loader), move it off the shared node, or give it less work")
    if label == "checkpoint-bound":
        return (f"checkpoints take {costs['checkpoint']:.1f} ms per step: raise --ckpt-every, "
                f"use --async-save to write in the background, or write to a faster local disk")
    if label == "input-bound":
        return (f"loading a batch takes {costs['data']:.1f} ms per step: prefetch batches in "
                f"a background thread, keep the token cache (--cache-dir) on a local disk, or "
                f"make the loader cheaper (fewer, larger reads)")
    if label == "communication-bound":
        bucket = f" (now {bucket_mb:g} MiB)" if bucket_mb else ""
        calls, size = numbers["comm_calls_per_step"], numbers["bytes_per_call"]
        if numbers["overlap_pct"] < 50 and calls <= 4:
            buckets = (f"lower --bucket-mb{bucket} so several buckets form and the first "
                       f"all_reduces start while backward still runs")
        else:
            buckets = (f"raise --bucket-mb{bucket} for fewer, larger all_reduces ({calls:.0f} "
                       f"calls of {size / 2**20:.2f} MiB per step now)")
        return (f"{costs['comm']:.1f} ms per step of exposed communication at "
                f"{numbers['net_bw_gbps']:.3f} GB/s, {numbers['overlap_pct']:.0f}% of it hidden "
                f"behind compute: {buckets}; add --micro-batches (more compute per all_reduce); "
                f"use --zero-stage 1 or 2 (reduce_scatter + all_gather instead of all_reduce, "
                f"optimizer work split over ranks); keep tensor parallelism inside a node and "
                f"check the network link")
    if numbers["world_size"] == 1:
        return (f"compute takes {costs['compute']:.1f} ms per step on one rank: add "
                f"data-parallel ranks, or a GPU")
    return (f"compute takes {costs['compute']:.1f} ms per step, more than the "
            f"{costs['comm']:.1f} ms of exposed communication: the run scales; add data-parallel "
            f"ranks or use a GPU to go faster, and raise the per-rank batch (or --micro-batches) "
            f"for better arithmetic intensity")
