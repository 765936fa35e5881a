"""`Observer`: the training loop's one handle on timelines, metrics and the bottleneck verdict.

    obs = Observer(world, timeline="t.json", metrics_port=9400, run_dir="runs/a",
                   tokens_per_step=global_batch * seq_len)        # collective
    obs.instrument(engine=engine, sampler=sampler)                # spans around forward/backward/...
    for step in ...:
        obs.begin_step(step)
        ... x, y = sampler.next_batch(); engine.forward/backward/step ...
        record.update(obs.end_step(step))                         # allreduce_pct, overlap_pct, ...
        with obs.span("checkpoint", "checkpoint"): save(...)
    verdict = obs.close(engine)                                   # collective; rank 0 gets it

It is active when any output is asked for (timeline, run_dir, metrics port or textfile, or
metrics_jsonl=True); inactive it does nothing at all and tracing stays off. Active, it estimates
the clock offset to rank 0 (rtxmpi.observe.timeline), turns tracing on (every collective then
records a span: rtxmpi.comm.traced), and after each step computes this rank's breakdown
(rtxmpi.observe.breakdown) and the Prometheus gauges (rtxmpi.observe.metrics). The "step" span of
step s runs from begin_step(s) to begin_step(s + 1) (or close), so a checkpoint or evaluation after
end_step counts in the timeline and in the verdict; the per-step values end_step returns cover
begin_step(s) to end_step(s). close() merges every rank's spans into one Chrome-trace timeline on
rank 0, classifies the last `classify_steps` steps (rtxmpi.observe.classify) and writes the run
directory: timeline.json, breakdown.json, bottleneck.json, memory.json, run.json (docs/observe.md).
"""
import dataclasses
import functools
import json
import os

import numpy as np

from ..comm.traced import untraced
from ..control import agree
from ..errors import ConfigError
from . import inject, trace
from .breakdown import breakdown, step_breakdowns
from .classify import classify
from .metrics import NAMES, Metrics, alloc_frag_pct, check_textfile
from .timeline import estimate_clock_offset, gather_events, write_chrome_trace

OOM_COUNTER = "oom_count"  # trace counter other layers may bump too


def _writable_path(path, flag):
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"{flag} {path}: not a writable file path"
    return None


class Observer:
    """See the module docstring. group: the world ProcessGroup. Every rank must construct it with
    the same arguments (a collective: clock offsets and an agreed port check).

    timeline: Chrome-trace JSON path written by rank 0 at close (or None). run_dir: directory for
    `rtxmpi report` (created; gets timeline.json unless `timeline` is given). metrics_port: serve
    Prometheus on metrics_bind:(port + local_rank). metrics_textfile: node_exporter textfile.
    metrics_jsonl: the caller writes per-step JSON with the Prometheus names (activates spans).
    job: the `job` label. tokens_per_step: global tokens per step (for tokens_per_s).
    classify_steps: the last N steps the verdict looks at. bucket_mb: quoted in hints.
    timeline_steps: the timeline keeps the spans of the last this many steps (bounded memory on
    long runs; ~15-40 spans of ~100 bytes per step and rank for the reference models).
    run_info: JSON-able dict stored in run.json (flags, model, ...). names: how messages name
    these settings (default: the parameter names; a command line maps e.g. "run_dir" to "--run-dir").
    Raises ConfigError on every rank for a bad port, an unwritable path, or a port that cannot be
    bound on some rank.
    """

    def __init__(self, group, *, timeline=None, run_dir=None, metrics_port=None,
                 metrics_bind="127.0.0.1", metrics_textfile=None, metrics_jsonl=False,
                 job="rtxmpi", tokens_per_step=0, classify_steps=20, bucket_mb=None,
                 run_info=None, timeline_steps=5000, names=None):
        self.group, self.job, self.tokens_per_step = group, str(job), int(tokens_per_step)
        self.timeline, self.run_dir = timeline, run_dir
        self.classify_steps, self.bucket_mb = int(classify_steps), bucket_mb
        self.run_info = dict(run_info or {})
        self.names = dict(names or {})
        self._check(metrics_port, metrics_textfile, classify_steps)
        self.active = any(v is not None for v in (timeline, run_dir, metrics_port, metrics_textfile)) \
            or bool(metrics_jsonl)
        self.keep_all = timeline is not None or run_dir is not None
        self.keep_steps = max(int(timeline_steps), self.classify_steps) if self.keep_all \
            else self.classify_steps
        self.metrics, self.verdict, self.offset_us = None, None, 0.0
        self._step, self._begin_us, self._mark, self._window_starts = None, 0.0, 0, []
        self._cross, self._written_us = None, -1e18
        # the largest forward cache seen, bytes (-1: none measured, e.g. a pipeline schedule)
        self.activations_bytes, self._measure_forward, self._engine = -1, False, None
        if not self.active:
            return
        made = None
        if run_dir is not None and group.rank == 0:
            try:
                os.makedirs(run_dir, exist_ok=True)
            except OSError as exc:
                made = exc
        if agree(group, failed=made is not None).failed:
            raise ConfigError(f"{self._name('run_dir')} {run_dir}: cannot create it on rank 0 "
                              f"({made or 'see rank 0'})")
        self.offset_us = estimate_clock_offset(group)
        error = None
        if metrics_port is not None or metrics_textfile is not None:
            try:
                self.metrics = Metrics(rank=group.rank, local_rank=group.local_rank,
                                       world_size=group.world_size, job=job, port=metrics_port,
                                       bind=metrics_bind, textfile=metrics_textfile,
                                       cross=group.rank == 0)
            except OSError as exc:
                error = exc
        if agree(group, failed=error is not None).failed:
            if self.metrics is not None:
                self.metrics.close()
            where = f" on rank {group.rank}: {error}" if error else " on another rank"
            raise ConfigError(f"{self._name('metrics_port')} {metrics_port}: cannot serve metrics at "
                              f"{metrics_bind}:{metrics_port} + local rank{where}; choose a free "
                              f"port range or another {self._name('metrics_bind')}")
        trace.enable(True)

    def _name(self, setting):
        return self.names.get(setting, setting)

    def _check(self, port, textfile, classify_steps):
        top = 65536 - self.group.world_size  # the same bound on every rank
        if port is not None and not 0 < int(port) <= top:
            raise ConfigError(f"{self._name('metrics_port')} {port}: must be in 1..{top} (each rank serves "
                              f"port + its local rank)")
        problem = (check_textfile(textfile, self._name("metrics_textfile"))
                   if textfile is not None else None)
        problem = problem or (_writable_path(self.timeline, self._name("timeline"))
                              if self.timeline is not None else None)
        if problem:
            raise ConfigError(problem)
        if self.run_dir is not None and os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
            raise ConfigError(f"{self._name('run_dir')} {self.run_dir}: exists and is not a directory")
        if classify_steps < 1:
            raise ConfigError(f"classify_steps must be >= 1, got {classify_steps}")

    # -- instrumentation --------------------------------------------------------------------
    def span(self, name, category="compute", **args):
        """trace.span: a no-op context manager unless the observer is active."""
        return trace.span(name, category, **args)

    def instrument(self, *, engine=None, sampler=None):
        """Wrap engine.forward/backward in "forward"/"backward" spans, engine.train_step (a
        pipeline's whole schedule) in "compute", engine.grad_norm/step in "optimizer" and
        sampler.next_batch in "data" spans, those the objects have (instance attributes; the
        classes are untouched), after applying RTXMPI_INJECT (rtxmpi.observe.inject). Every
        wrapper counts a MemoryError (CuPy's OutOfMemoryError included) in oom_count before
        re-raising it."""
        inject.apply(self.group.rank, engine=engine, sampler=sampler)
        if not self.active:
            return
        self._engine = engine
        targets = ((engine, "forward", "forward"), (engine, "backward", "backward"),
                   (engine, "train_step", "compute"), (engine, "grad_norm", "optimizer"),
                   (engine, "step", "optimizer"), (sampler, "next_batch", "data"))
        for obj, attr, category in targets:
            if obj is not None and hasattr(obj, attr):
                setattr(obj, attr, self._wrap(getattr(obj, attr), category))

    def _wrap(self, method, category):
        measure = category == "forward" and self.run_dir is not None

        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            try:
                with trace.span(category, category):
                    out = method(*args, **kwargs)
            except MemoryError:
                self.count_oom()
                raise
            if measure and self._measure_forward:
                self._note_activations(out)
            return out

        return wrapper

    def _note_activations(self, out):
        """Activations: the bytes the cache of a forward's (loss, cache) keeps alive
        (memory.cache_bytes, the model's parameter and gradient buffers excluded); the largest
        seen. Measured on the first forward of each step (~0.2 ms for the tiny model's cache)."""
        from .memory import cache_bytes

        self._measure_forward = False
        if not (isinstance(out, tuple) and len(out) == 2):
            return
        model = getattr(self._engine, "model", None)
        exclude = [a for a in (getattr(model, "flat_data", None), getattr(model, "flat_grad", None))
                   if a is not None]
        self.activations_bytes = max(self.activations_bytes, cache_bytes(out[1], exclude=exclude))

    def count_oom(self):
        """Count one out-of-memory error (and publish it at once)."""
        trace.count(OOM_COUNTER)
        if self.metrics is not None:
            self.metrics.update({"oom_count": trace.counters()[OOM_COUNTER]})
            self.metrics.write_textfile()

    # -- steps ------------------------------------------------------------------------------
    def _close_step(self, now_us):
        if self._step is not None:
            trace.add("step", "step", self._begin_us / 1e6, now_us / 1e6, {"step": self._step})
            self._step = None

    def begin_step(self, step):
        """Mark the start of optimizer step `step` (1-based). Local."""
        if not self.active:
            return
        now = trace.now_us()
        self._close_step(now)
        self._window_starts.append(now)
        if len(self._window_starts) > self.keep_steps + 1:  # the last keep_steps + this one
            self._window_starts.pop(0)
            trace.drop_before(self._window_starts[0])
        self._step, self._begin_us, self._mark = int(step), now, len(trace._events)
        self._measure_forward = True

    def end_step(self, step):
        """This rank's values for step `step` since begin_step: the Prometheus names except
        step_time_ms/tokens_per_s (the loop has its own), plus compute_ms, data_ms,
        exposed_comm_ms, comm_ms. Updates the gauges; with metrics on, starts an asynchronous
        all_gather of every rank's values (collective: every rank calls end_step) that the next
        end_step (or close) completes for rank 0's cross-rank view, so the view lags one step and
        adds no synchronization point; the textfile is rewritten at most once a second.
        {} when inactive.
        """
        if not self.active or self._step is None:
            return {}
        now = trace.now_us()
        b = breakdown(trace._events[self._mark:], self._begin_us, now, rank=self.group.rank,
                      step=step)
        values = {"step_time_ms": b.step_ms,
                  "tokens_per_s": self.tokens_per_step / (b.step_ms / 1e3) if b.step_ms else 0.0,
                  "allreduce_pct": b.allreduce_pct, "overlap_pct": b.overlap_pct,
                  "net_bw_gbps": b.net_bw_gbps, "alloc_frag_pct": alloc_frag_pct(self.group.device),
                  "oom_count": trace.counters().get(OOM_COUNTER, 0.0)}
        out = {k: v for k, v in values.items() if k not in ("step_time_ms", "tokens_per_s")}
        out.update(compute_ms=b.compute_ms, data_ms=b.data_ms, exposed_comm_ms=b.exposed_comm_ms,
                   comm_ms=b.comm_ms)
        if self.metrics is not None:
            self.metrics.update(values)
            slowest = self._finish_cross()
            if slowest is not None:
                out["slowest_rank"] = slowest  # of the previous step
            row = np.array([values[n] for n in NAMES] + [b.compute_ms + b.data_ms], np.float64)
            with untraced():  # bookkeeping, not the job's communication
                self._cross = self.group.all_gather(row, async_op=True)
            if now - self._written_us >= 1e6:
                self.metrics.write_textfile()
                self._written_us = now
        return out

    def _finish_cross(self):
        """Complete the pending cross-rank all_gather; rank 0 sets the cross view and returns the
        slowest rank (None elsewhere or when nothing was pending)."""
        work, self._cross = self._cross, None
        if work is None:
            return None
        table = work.wait().reshape(self.group.world_size, len(NAMES) + 1)
        if self.group.rank != 0:
            return None
        slowest = int(np.argmax(table[:, -1]))
        self.metrics.update_cross([dict(zip(NAMES, r)) for r in table], slowest)
        return slowest

    # -- the end ------------------------------------------------------------------------------
    def close(self, engine=None):
        """End tracing; merge, write and classify (rank 0). Collective: every rank must call.
        engine: when given with a run_dir, every rank's memory report goes to memory.json
        (activations_bytes: the largest forward cache seen on the first forward of each step,
        -1 when no wrapped forward returned (loss, cache), e.g. a pipeline's train_step).
        Returns the Verdict on rank 0 (None elsewhere, or when nothing was traced)."""
        if not self.active:
            return None
        self._close_step(trace.now_us())
        trace.enable(False)
        if self.metrics is not None:
            self._finish_cross()
        if self.keep_all:
            memory = self._memory(engine) if self.run_dir is not None else None
            merged = gather_events(self.group, trace.events(clear=True), self.offset_us)
            if self.group.rank == 0:
                self._write(merged, memory)
        if self.metrics is not None:
            self.metrics.close()
        return self.verdict

    def _memory(self, engine):
        from .memory import gather_reports, report

        if engine is None:
            return None
        mine = report(engine, optimizer=getattr(engine, "optimizer", None), rank=self.group.rank)
        # the cache of a forward lives only until its backward: the peak seen during the run
        mine = dataclasses.replace(mine, activations_bytes=int(self.activations_bytes))
        return [r.as_dict() for r in gather_reports(self.group, mine)]

    def _write(self, merged, memory):
        spans = {r["rank"]: r["events"] for r in merged}
        steps = step_breakdowns(spans)
        last = sorted({b.step for b in steps})[-self.classify_steps:]
        chosen = [b for b in steps if b.step in set(last)]
        run = {"job": self.job, "world_size": self.group.world_size,
               "tokens_per_step": self.tokens_per_step, "classify_steps": self.classify_steps,
               "bucket_mb": self.bucket_mb, **self.run_info}
        if chosen:
            self.verdict = classify(chosen, bucket_mb=self.bucket_mb)
            print(f"bottleneck: {self.verdict}", flush=True)
        timeline = self.timeline or (os.path.join(self.run_dir, "timeline.json")
                                     if self.run_dir else None)
        write_chrome_trace(timeline, merged, {"rtxmpi_run": run})
        if self.run_dir is None:
            return
        run["timeline"] = os.path.abspath(timeline)
        files = {"run.json": run, "breakdown.json": [b.as_dict() for b in steps],
                 "bottleneck.json": self.verdict.as_dict() if self.verdict else None,
                 "memory.json": memory}
        for name, doc in files.items():
            if doc is not None:
                with open(os.path.join(self.run_dir, name), "w") as f:
                    json.dump(doc, f, indent=1)

