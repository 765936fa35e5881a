"""`rtxmpi report RUN_DIR`: a human summary of a training run and PNG plots.

    from rtxmpi.observe.report import load_run, summary, plot
    run = load_run("runs/a")               # what a run with run_dir="runs/a" wrote
    print(summary([run]))
    plot(run, "runs/a")                    # loss.png, step_breakdown.png, bandwidth.png

A run directory holds (docs/observe.md): metrics.jsonl (one JSON object per step, rank 0),
timeline.json (Chrome trace of every rank), breakdown.json (each rank's step breakdown), run.json,
memory.json, bottleneck.json. Only metrics.jsonl or timeline.json is required: breakdowns are
recomputed from the timeline when breakdown.json is missing, and the verdict is always computed
again from the breakdowns of the last N steps. Several runs of one job at different world sizes
add a scaling table (speedup and efficiency against the smallest). Local: one process.
"""
import json
import math
import os
import statistics
from dataclasses import dataclass, field

from ..errors import ConfigError
from .breakdown import StepBreakdown, bus_bytes, median_steps, step_breakdowns
from .classify import classify
from .timeline import load_chrome_trace

PARTS = (("compute_ms", "compute"), ("data_ms", "data"), ("exposed_comm_ms", "exposed comm"),
         ("checkpoint_ms", "checkpoint"), ("other_ms", "other"))


@dataclass
class Run:
    """What load_run read. records: metrics.jsonl objects; breakdowns: StepBreakdowns (all
    ranks, all steps); spans: {rank: spans} from timeline.json ({} without one); info: run.json;
    memory: memory.json rows (or None)."""

    path: str
    records: list = field(default_factory=list)
    breakdowns: list = field(default_factory=list)
    spans: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    memory: list = None

    @property
    def world_size(self):
        if self.info.get("world_size"):
            return int(self.info["world_size"])
        if self.records:
            return int(self.records[-1].get("world_size", 1))
        return len({b.rank for b in self.breakdowns}) or 1

    def last_steps(self, n):
        """Breakdowns of the last n steps (every rank)."""
        steps = sorted({b.step for b in self.breakdowns})[-n:]
        keep = set(steps)
        return [b for b in self.breakdowns if b.step in keep]


def _read_json(path, default=None):
    if not os.path.exists(path):
        return default
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


def load_run(path):
    """Read a run directory. Raises ConfigError when it is not a directory or holds neither
    metrics.jsonl nor timeline.json, or when a file in it is not valid JSON."""
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: not a directory (give the --run-dir of a training run)")
    run = Run(path=path, info=_read_json(os.path.join(path, "run.json"), {}),
              memory=_read_json(os.path.join(path, "memory.json")))
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        raise ConfigError(f"{metrics} line {n}: not valid JSON") from None
                    if isinstance(record, dict) and "loss" in record and record["loss"] is None:
                        record["loss"] = math.nan  # a diverged step: its line says null
                    run.records.append(record)
    timeline = os.path.join(path, "timeline.json")
    if not os.path.exists(timeline) and run.info.get("timeline"):
        timeline = run.info["timeline"]
    if os.path.exists(timeline):
        try:
            _, run.spans = load_chrome_trace(timeline)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    rows = _read_json(os.path.join(path, "breakdown.json"))
    if rows is not None:
        names = set(StepBreakdown.__dataclass_fields__)
        run.breakdowns = [StepBreakdown(**{k: v for k, v in r.items() if k in names}) for r in rows]
    elif run.spans:
        run.breakdowns = step_breakdowns(run.spans)
    if not run.records and not run.breakdowns:
        raise ConfigError(f"{path}: no metrics.jsonl and no timeline.json; train with the run "
                          f"directory {path} (TrainConfig.run_dir, docs/observe.md)")
    return run


def _median_by_rank(breakdowns):
    """{rank: {part: ms}} in the median step (breakdown.median_steps), plus "step" (its number):
    one real step, the same on every rank, so each rank's parts add up to its step_ms."""
    return {r: {**{k: getattr(b, k) for k, _ in PARTS + (("step_ms", ""),)}, "step": b.step}
            for r, b in median_steps(breakdowns).items()}


def _mib(n):
    return "n/a" if n < 0 else f"{n / 2**20:.1f}"


def summary(runs, last=20):
    """The text report of `runs` (Run objects; the first is described in full, all of them in the
    scaling table). last: the steps the breakdown and the verdict look at."""
    run, lines = runs[0], []
    info = run.info
    args = info.get("args", {})
    what = f"job {info['job']}, " if info.get("job") else ""
    lines.append(f"run {run.path}: {what}world size {run.world_size}"
                 + (f", model {args['model']}" if args.get("model") else "")
                 + (f", {len(run.records)} step{'' if len(run.records) == 1 else 's'} logged"
                    if run.records else ""))
    recs = run.records
    if recs:
        losses = [r["loss"] for r in recs if "loss" in r]
        vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        if losses:
            lines.append(f"loss: {losses[0]:.3f} at step {recs[0]['step']} -> {losses[-1]:.3f} at "
                         f"step {recs[-1]['step']}" + (f"; val_loss {vals[-1][1]:.3f} at step "
                                                       f"{vals[-1][0]}" if vals else ""))
        tail = recs[-last:]
        tps = statistics.median(r["tokens_per_s"] for r in tail if "tokens_per_s" in r) \
            if any("tokens_per_s" in r for r in tail) else None
        if tps is not None:
            lines.append(f"throughput: {tps:.0f} tokens/s ({tps / run.world_size:.0f} per rank), "
                         f"median of the last {len(tail)} step{'' if len(tail) == 1 else 's'}")
    chosen = run.last_steps(last)
    if chosen:
        per_rank = _median_by_rank(chosen)
        # the median step (a real step: its parts add up), averaged over the ranks
        mean = {k: statistics.fmean(v[k] for v in per_rank.values()) for k, _ in PARTS}
        step = statistics.fmean(v["step_ms"] for v in per_rank.values())
        pct = lambda ms: 100 * ms / step if step > 0 else 0.0  # noqa: E731
        parts = " + ".join(f"{name} {mean[k]:.1f} ({pct(mean[k]):.0f}%)" for k, name in PARTS)
        n = len({b.step for b in chosen})
        over = f", mean over {len(per_rank)} ranks" if len(per_rank) > 1 else ""
        which = next(iter(per_rank.values()))["step"]
        lines.append(f"step time (step {which}, the median of the last {n} step{'' if n == 1 else 's'}"
                     f"{over}): "
                     f"{step:.1f} ms = {parts}")
        comm = statistics.fmean(b.comm_ms for b in chosen)
        hidden = statistics.fmean(b.hidden_comm_ms for b in chosen)
        moved = statistics.fmean(b.bus_bytes for b in chosen)
        if comm > 0:
            lines.append(f"communication (mean over the last {n} step{'' if n == 1 else 's'} and "
                         f"all ranks): {comm:.1f} ms in flight per step, "
                         f"{100 * hidden / comm:.0f}% hidden behind compute, "
                         f"{moved / (comm * 1e6):.3f} GB/s bus bandwidth")
        lines.append("per rank (ms, the median step): rank  step#  step  "
                     + "  ".join(n for _, n in PARTS))
        for r, v in per_rank.items():
            lines.append(f"  {r:>4} {v['step']:>6} {v['step_ms']:7.1f} "
                         + " ".join(f"{v[k]:8.1f}" for k, _ in PARTS))
        lines.append(f"parallel efficiency bound: compute is {pct(mean['compute_ms']):.0f}% "
                     f"of the step")
    if len(runs) > 1:
        lines.append(scaling(runs, last))
    if run.memory:
        lines.append("memory per rank (MiB): rank params grads optimizer activations peak_rss")
        for m in run.memory:
            lines.append(f"  {m['rank']:>4} {_mib(m['params_bytes']):>6} {_mib(m['grads_bytes']):>5} "
                         f"{_mib(m['optimizer_bytes']):>9} {_mib(m['activations_bytes'] or -1):>11} "
                         f"{_mib(m['peak_rss_bytes']):>8}")
        if any(m["activations_bytes"] <= 0 for m in run.memory):  # 0: runs before it was measured
            lines.append("  (activations n/a: not measured; the engine's forward returns no cache, "
                         "e.g. a pipeline schedule)")
        else:
            lines.append("  (activations: the largest cache one forward kept alive until its "
                         "backward)")
    if recs and "alloc_frag_pct" in recs[-1]:
        lines.append(f"allocator: {recs[-1]['alloc_frag_pct']:.1f}% fragmentation, "
                     f"{recs[-1].get('oom_count', 0):.0f} out-of-memory errors")
    if chosen:
        verdict = classify(chosen, bucket_mb=info.get("bucket_mb"))
        lines.append(f"bottleneck: {verdict}")
    return "\n".join(lines)


def scaling(runs, last=20):
    """The scaling table of several runs: world size, tokens/s, speedup and efficiency against
    the run with the fewest ranks (tokens/s from metrics.jsonl, median of the last steps)."""
    rows = []
    for run in runs:
        tail = [r["tokens_per_s"] for r in run.records[-last:] if "tokens_per_s" in r]
        if tail:
            rows.append((run.world_size, statistics.median(tail), run.path))
    if len(rows) < 2:
        return "scaling: needs metrics.jsonl in at least two runs"
    rows.sort()
    base_n, base_tps, _ = rows[0]
    out = ["scaling: world_size tokens/s speedup efficiency run"]
    for n, tps, path in rows:
        speedup = tps / base_tps
        out.append(f"  {n:>10} {tps:9.0f} {speedup:7.2f} {100 * speedup * base_n / n:9.0f}% {path}")
    return "\n".join(out)


def plot(run, out_dir, last=20):
    """Write loss.png, step_breakdown.png and bandwidth.png (what the run holds data for) to
    out_dir with matplotlib (Agg backend); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    if run.records:
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [r["step"] for r in run.records if "loss" in r]
        ax.plot(steps, [r["loss"] for r in run.records if "loss" in r], label="train loss")
        vals = [(r["step"], r["val_loss"]) for r in run.records if "val_loss" in r]
        if vals:
            ax.plot(*zip(*vals), "o-", label="val loss")
        ax.set(xlabel="step", ylabel="loss (nats/byte)", title=f"loss: {run.path}")
        ax.legend()
        written.append(_save(fig, os.path.join(out_dir, "loss.png")))
    chosen = run.last_steps(last)
    if chosen:
        per_rank = _median_by_rank(chosen)
        chosen_step = next(iter(per_rank.values()))["step"]
        fig, ax = plt.subplots(figsize=(7, 1.5 + 0.5 * len(per_rank)))
        left = [0.0] * len(per_rank)
        ranks = list(per_rank)
        for k, name in PARTS:
            widths = [per_rank[r][k] for r in ranks]
            ax.barh([str(r) for r in ranks], widths, left=left, label=name)
            left = [a + b for a, b in zip(left, widths)]
        ax.set(xlabel=f"ms (step {chosen_step}, the median of the last {last})", ylabel="rank",
               title="step time breakdown per rank")
        # outside the axes, right of the bars: it never covers them
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
        written.append(_save(fig, os.path.join(out_dir, "step_breakdown.png")))
    points = bandwidth_points(run.spans)
    if points:
        fig, ax = plt.subplots(figsize=(7, 4))
        for is_async, marker, label in ((False, "o", "blocking"), (True, "x", "async (launch to done)")):
            pts = [(b, g) for b, g, a in points if a == is_async]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, label=label, alpha=0.6)
        by_size = {}
        for b, g, _ in points:
            by_size.setdefault(b, []).append(g)
        sizes = sorted(by_size)
        ax.plot(sizes, [statistics.median(by_size[b]) for b in sizes], "k-", lw=1, label="median")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
               title="collective bandwidth vs message size")
        ax.legend()
        written.append(_save(fig, os.path.join(out_dir, "bandwidth.png")))
    return written


def bandwidth_points(spans):
    """(payload bytes, bus GB/s, async) for every collective in the timeline with a payload."""
    out = []
    for events in spans.values():
        for name, cat, s, d, args in events:
            if cat == "comm" and args.get("bytes") and d > 0:
                moved = bus_bytes(args.get("op", name), args["bytes"], args.get("world_size", 1))
                if moved > 0:
                    out.append((args["bytes"], moved / (d * 1e3), bool(args.get("async"))))
    return out


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
