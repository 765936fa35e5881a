"""Bottleneck classifier: what limits a run, from the step breakdowns of its last steps.

    from rtxmpi.observe.classify import classify
    verdict = classify(breakdowns)          # StepBreakdowns of every rank over the last N steps
    print(verdict.label, verdict.hint)

Labels: "compute-bound", "communication-bound", "input-bound", "checkpoint-bound",
"straggler-bound". The model is the critical path of a data-parallel step. Take the median step
of the steps given (rtxmpi.observe.breakdown.median_steps: one real step, the same on every rank,
whose parts add up); a rank's own work is compute + data (time not spent in collectives). The
slowest rank s (most own work, median over the steps) waits for nobody, so its step is the
critical path:

    step_s = compute_s + data_s + comm_s + checkpoint_s + other_s

with comm_s the exposed communication of s (pure communication: s never waits for a peer). When s
straggles, part of its own work is the gap = own_s minus the other ranks' median own work (what
every other rank waits for s inside collectives), and the costs become compute and data scaled to
the others' own work plus straggler = gap (the same sum). The costs are those terms of rank s, so
they add up to its step; the label is the largest of compute, data (input), comm (communication),
checkpoint, or straggler ("other" never names a bound). The gap counts only when it is clearly
more than noise: own_s >= STRAGGLER_RATIO (1.3) x the others' and gap >= STRAGGLER_SHARE (20%) of
the step, both as per-rank medians over all the steps given. Each verdict carries the numbers it was decided on and an actionable hint.
"""
import statistics
from dataclasses import dataclass, field

from .breakdown import median_steps

LABELS = ("compute-bound", "communication-bound", "input-bound", "checkpoint-bound",
          "straggler-bound")
STRAGGLER_RATIO = 1.3
STRAGGLER_SHARE = 0.2
_FIELDS = ("step_ms", "compute_ms", "data_ms", "exposed_comm_ms", "checkpoint_ms", "other_ms",
           "comm_ms", "hidden_comm_ms", "bus_bytes", "comm_calls")


@dataclass
class Verdict:
    """label: one of LABELS. costs: ms per step of each term of the critical path, the slowest
    rank in the median step (compute, data, comm, checkpoint, straggler, other; they add up to
    numbers["critical_step_ms"]). shares: % of the step per part (compute, data, comm, checkpoint,
    other; the median step averaged over ranks, so they add up to 100). numbers: the other
    values the decision used. hint: what to try. steps: the steps looked at. slowest_rank: the rank
    with the most own work."""

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
        costs = " + ".join(f"{k} {v:.1f}" for k, v in self.costs.items())
        total = self.numbers.get("critical_step_ms", sum(self.costs.values()))
        return (f"{self.label} (ms, rank {self.slowest_rank} (the slowest) in the median step: "
                f"{total:.1f} = {costs}): {self.hint}")


def _medians(breakdowns):
    """{field: {rank: value in the median step}} (median_steps)."""
    typical = median_steps(breakdowns)
    return {name: {r: getattr(b, name) for r, b in typical.items()} for name in _FIELDS}


def classify(breakdowns, *, bucket_mb=None):
    """The Verdict for `breakdowns` (rtxmpi.observe.breakdown.StepBreakdown of one or more ranks
    over the last steps). bucket_mb: the run's gradient bucket size, quoted in the hint.
    Raises ValueError on an empty list."""
    if not breakdowns:
        raise ValueError("classify() needs at least one step breakdown (was the run traced?)")
    # who straggles is decided on per-rank medians over every step (robust to one noisy step)
    by_rank = {}
    for b in breakdowns:
        by_rank.setdefault(b.rank, []).append(b)
    own_med = {r: statistics.median(b.compute_ms + b.data_ms for b in bs) for r, bs in by_rank.items()}
    slowest = max(sorted(own_med), key=own_med.get)
    others = [r for r in own_med if r != slowest] or [slowest]
    rest_med = statistics.median(own_med[r] for r in others)
    step_med = statistics.median(statistics.median(b.step_ms for b in bs) for bs in by_rank.values())
    straggling = (len(own_med) > 1 and own_med[slowest] >= STRAGGLER_RATIO * rest_med
                  and own_med[slowest] - rest_med >= STRAGGLER_SHARE * step_med)
    # the costs are one real step's (the median step), so they add up
    med = _medians(breakdowns)
    ranks = list(med["step_ms"])
    step_ms = statistics.median(med["step_ms"].values())
    own = {r: med["compute_ms"][r] + med["data_ms"][r] for r in ranks}
    if slowest not in own:  # no step holds every rank: the slowest of this step
        slowest = max(ranks, key=own.get)
    present = [r for r in ranks if r != slowest]
    rest = statistics.median(own[r] for r in present) if present else own[slowest]
    gap = max(0.0, own[slowest] - rest)
    of_s = {name: med[name][slowest] for name in _FIELDS}
    # a straggler's own work = the others' share (split like its own compute : data) + the gap
    scale = rest / own[slowest] if straggling and gap > 0 and own[slowest] > 0 else 1.0
    costs = {"compute": of_s["compute_ms"] * scale, "data": of_s["data_ms"] * scale,
             "comm": of_s["exposed_comm_ms"], "checkpoint": of_s["checkpoint_ms"],
             "straggler": gap if straggling else 0.0, "other": of_s["other_ms"]}
    mean = {name: statistics.fmean(v.values()) for name, v in med.items()}
    mean_step = mean["step_ms"]
    pct = lambda ms: 100.0 * ms / mean_step if mean_step > 0 else 0.0  # noqa: E731
    shares = {"compute": pct(mean["compute_ms"]), "data": pct(mean["data_ms"]),
              "comm": pct(mean["exposed_comm_ms"]), "checkpoint": pct(mean["checkpoint_ms"]),
              "other": pct(mean["other_ms"])}
    overlap = 100.0 * mean["hidden_comm_ms"] / mean["comm_ms"] if mean["comm_ms"] else 100.0
    numbers = {"step_ms": step_ms, "critical_step_ms": of_s["step_ms"],
               "world_size": len(ranks), "overlap_pct": overlap,
               "comm_ms": mean["comm_ms"], "comm_calls_per_step": mean["comm_calls"],
               "bytes_per_call": mean["bus_bytes"] / mean["comm_calls"] if mean["comm_calls"] else 0.0,
               "net_bw_gbps": mean["bus_bytes"] / (mean["comm_ms"] * 1e6) if mean["comm_ms"] else 0.0,
               "slowest_rank_own_ms": own[slowest], "other_ranks_own_ms": rest,
               "gap_ms": gap, "straggling": straggling}
    steps = sorted({b.step for b in breakdowns})
    term = max((k for k in costs if k != "other"), key=costs.get)
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
            buckets = (f"lower the gradient bucket size{bucket} so several buckets form and the first "
                       f"all_reduces start while backward still runs")
        else:
            buckets = (f"raise the gradient bucket size{bucket} for fewer, larger all_reduces ({calls:.0f} "
                       f"calls of {size / 2**20:.2f} MiB per step now)")
        return (f"{costs['comm']:.1f} ms per step of exposed communication at "
                f"{numbers['net_bw_gbps']:.3f} GB/s, {numbers['overlap_pct']:.0f}% of it hidden "
                f"behind compute: {buckets}; add micro-batches (more compute per all_reduce); "
                f"use ZeRO stage 1 or 2 (reduce_scatter + all_gather instead of all_reduce, "
                f"optimizer work split over ranks); keep tensor parallelism inside a node and "
                f"check the network link")
    if numbers["world_size"] == 1:
        return (f"compute takes {costs['compute']:.1f} ms per step on one rank: add "
                f"data-parallel ranks, or a GPU")
    return (f"compute takes {costs['compute']:.1f} ms per step, more than the "
            f"{costs['comm']:.1f} ms of exposed communication: the run scales; add data-parallel "
            f"ranks or use a GPU to go faster, and raise the per-rank batch (or the micro-batches) "
            f"for better arithmetic intensity")
