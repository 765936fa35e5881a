"""rtxmpi.observe: trace switches, step breakdowns, the classifier, timelines, metrics, reports."""
import json
import socket
import urllib.request

import numpy as np
import pytest

import rtxmpi
from rtxmpi.comm.group import ProcessGroup
from rtxmpi.errors import ConfigError
from rtxmpi.observe import inject, trace
from rtxmpi.observe.breakdown import (StepBreakdown, breakdown, bus_bytes, intersect, step_breakdowns,
                                      subtract, union)
from rtxmpi.observe.classify import classify
from rtxmpi.observe.metrics import NAMES, Metrics, alloc_frag_pct, textfile_path
from rtxmpi.observe.report import load_run, plot, summary
from rtxmpi.observe.timeline import load_chrome_trace, to_chrome_trace, write_chrome_trace


@pytest.fixture
def tracing():
    trace.events(clear=True)
    trace.enable(True)
    yield
    trace.enable(False)
    trace.events(clear=True)


def span(name, cat, start_ms, end_ms, **args):
    return (name, cat, start_ms * 1e3, (end_ms - start_ms) * 1e3, args)


# -- trace and the collective switch --------------------------------------------------------------
def test_tracing_off_leaves_the_plain_collectives_in_place():
    trace.enable(False)
    assert ProcessGroup.all_reduce.__qualname__ == "ProcessGroup.all_reduce"
    assert trace.span("x") is trace.span("y")  # the shared no-op


def test_collectives_record_op_bytes_group_and_async(tracing):
    world = rtxmpi.init()
    x = np.ones(1000, np.float32)
    world.all_reduce(x)
    world.all_reduce(x, async_op=True).wait()
    world.all_gather(np.ones(3, np.float64))
    spans = trace.events()
    comm = [s for s in spans if s[1] == "comm"]
    assert [s[0] for s in comm] == ["all_reduce", "all_reduce", "all_gather"]
    assert comm[0][4] == {"op": "all_reduce", "bytes": 4000, "group": "world",
                          "world_size": world.world_size, "async": False}
    assert comm[1][4]["async"] is True
    assert comm[2][4]["bytes"] == 24 * world.world_size
    trace.enable(False)
    world.all_reduce(x)
    assert len(trace.events()) == len(spans)


def test_an_async_collective_is_one_span_from_launch_to_completion_plus_its_wait(tracing):
    world = rtxmpi.init()
    work = world.all_reduce(np.ones(8, np.float32), async_op=True)
    pending = not work.is_completed()
    work.wait()
    spans = trace.events()
    comm = [s for s in spans if s[1] == "comm"]
    assert len(comm) == 1 and comm[0][4]["async"] is True
    waits = [s for s in spans if s[1] == "wait"]
    assert len(waits) == int(pending)
    if waits:  # the wait lies inside the in-flight span
        assert comm[0][2] <= waits[0][2] and waits[0][2] + waits[0][3] <= comm[0][2] + comm[0][3] + 100



def test_collectives_launched_untraced_record_nothing_even_when_they_complete_later(tracing):
    from rtxmpi.comm.traced import untraced

    world = rtxmpi.init()
    with untraced():
        work = world.all_gather(np.ones(4, np.float64), async_op=True)
        world.all_reduce(np.ones(4, np.float32))
    work.test()
    work.wait()
    assert trace.events() == []
    world.all_reduce(np.ones(4, np.float32))  # outside the block: recorded again
    assert [s[0] for s in trace.events()] == ["all_reduce"]

# -- intervals and breakdowns ----------------------------------------------------------------------
def test_interval_union_intersect_subtract():
    a = union([(5, 7), (0, 2), (1, 3), (9, 9)])
    assert a == [(0, 3), (5, 7)]
    assert intersect(a, [(2, 6)]) == [(2, 3), (5, 6)]
    assert subtract(a, [(1, 2), (6, 10)]) == [(0, 1), (2, 3), (5, 6)]
    assert subtract([(0, 10)], []) == [(0, 10)]


def test_bus_bytes_follow_the_nccl_tests_convention():
    assert bus_bytes("all_reduce", 100, 4) == 150
    assert bus_bytes("all_gather", 100, 4) == 75
    assert bus_bytes("all_reduce", 100, 1) == 0
    assert bus_bytes("barrier", 0, 4) == 0


def test_breakdown_charges_each_instant_once():
    spans = [span("data", "data", 0, 10),
             span("forward", "forward", 10, 30),
             span("backward", "backward", 30, 60),
             span("all_reduce", "comm", 40, 58, op="all_reduce", bytes=4e6, world_size=2,
                  **{"async": True}),
             span("wait all_reduce", "wait", 55, 58),
             span("all_reduce", "comm", 60, 65, op="all_reduce", bytes=1e6, world_size=2,
                  **{"async": False}),
             span("checkpoint", "checkpoint", 70, 90),
             span("barrier", "comm", 85, 90, op="barrier", bytes=0, world_size=2,
                  **{"async": False})]
    b = breakdown(spans, 0, 100e3, rank=1, step=3)
    assert (b.rank, b.step) == (1, 3)
    assert b.step_ms == pytest.approx(100)
    assert b.data_ms == pytest.approx(10)
    assert b.compute_ms == pytest.approx(47)           # 10..60 less the wait 55..58
    assert b.exposed_comm_ms == pytest.approx(8)       # wait 3 + blocking 5
    assert b.checkpoint_ms == pytest.approx(20)        # the barrier inside counts as checkpoint
    assert b.other_ms == pytest.approx(15)
    assert b.comm_ms == pytest.approx(18 + 5 + 5)
    assert b.hidden_comm_ms == pytest.approx(15)       # 40..55 under compute
    assert b.overlap_pct == pytest.approx(100 * 15 / 28)
    assert b.bus_bytes == pytest.approx(5e6)
    assert b.net_bw_gbps == pytest.approx(5e6 / 28e6)
    assert b.allreduce_pct == pytest.approx(8)


def test_step_breakdowns_use_the_step_spans_of_each_rank():
    spans = {0: [span("step", "step", 0, 10, step=1), span("forward", "forward", 1, 9),
                 span("step", "step", 10, 20, step=2), span("forward", "forward", 10, 12)],
             1: [span("step", "step", 0, 10, step=1), span("data", "data", 0, 10),
                 span("step", "step", 10, 20, step=2)]}
    out = step_breakdowns(spans)
    assert [(b.step, b.rank) for b in out] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert out[0].compute_ms == pytest.approx(8) and out[1].data_ms == pytest.approx(10)
    assert out[2].compute_ms == pytest.approx(2) and out[3].other_ms == pytest.approx(10)


# -- classifier ------------------------------------------------------------------------------------
def steps_of(ranks, n=5, **ms):
    """n steps of `ranks` ranks, each StepBreakdown given as ms per part; rank-specific parts as
    {rank: value} dicts."""
    out = []
    for step in range(1, n + 1):
        for r in range(ranks):
            part = {k: (v.get(r, v.get("rest", 0.0)) if isinstance(v, dict) else v)
                    for k, v in ms.items()}
            parts = {k: part.get(k, 0.0) for k in ("compute_ms", "data_ms", "exposed_comm_ms",
                                                  "checkpoint_ms", "other_ms")}
            out.append(StepBreakdown(rank=r, step=step, start_us=0.0, step_ms=sum(parts.values()),
                                     comm_ms=part.get("comm_ms", parts["exposed_comm_ms"]),
                                     hidden_comm_ms=part.get("hidden_comm_ms", 0.0),
                                     bus_bytes=1e6, comm_calls=2, **parts))
    return out


@pytest.mark.parametrize("label, ms", [
    ("compute-bound", dict(compute_ms=80, exposed_comm_ms=10, data_ms=1)),
    ("communication-bound", dict(compute_ms=20, exposed_comm_ms=70)),
    ("input-bound", dict(compute_ms=20, data_ms=60, exposed_comm_ms=5)),
    ("checkpoint-bound", dict(compute_ms=20, checkpoint_ms=50, exposed_comm_ms=5)),
    ("straggler-bound", dict(compute_ms={1: 90, "rest": 20}, exposed_comm_ms={1: 3, "rest": 73})),
])
def test_classifier_labels_each_cause(label, ms):
    verdict = classify(steps_of(4, **ms), bucket_mb=25)
    assert verdict.label == label, verdict
    assert verdict.hint and verdict.steps == [1, 2, 3, 4, 5]
    if label == "straggler-bound":
        assert verdict.slowest_rank == 1 and "rank 1" in verdict.hint
    json.dumps(verdict.as_dict())


def test_a_small_imbalance_is_not_a_straggler():
    verdict = classify(steps_of(2, compute_ms={0: 50, 1: 58}, exposed_comm_ms={0: 12, 1: 4}))
    assert verdict.label == "compute-bound"


def test_classifier_refuses_nothing():
    with pytest.raises(ValueError, match="at least one"):
        classify([])


# -- timeline --------------------------------------------------------------------------------------
def ranks_fixture():
    a = {"op": "all_reduce", "bytes": 64, "group": "world", "world_size": 2, "async": True}
    return [{"rank": r, "offset_us": 0.0, "meta": {"host": f"h{r}"},
             "events": [span("step", "step", 0, 10, step=1), span("forward", "forward", 1, 4),
                        span("all_reduce", "comm", 2, 6, **a), span("all_reduce", "comm", 3, 7, **a),
                        span("all_reduce", "comm", 6.5, 8, **a)]} for r in (0, 1)]


def test_chrome_trace_has_a_process_per_rank_and_non_overlapping_async_lanes(tmp_path):
    doc = to_chrome_trace(ranks_fixture())
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0 (h0)"), (1, "rank 1 (h1)")}
    lanes = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "comm" and e["pid"] == 0:
            lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(lanes) == 2
    for spans in lanes.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    path = tmp_path / "t.json"
    write_chrome_trace(path, ranks_fixture(), {"x": 1})
    other, spans = load_chrome_trace(path)
    assert other["x"] == 1 and sorted(spans) == [0, 1] and len(spans[1]) == 5


def test_load_chrome_trace_refuses_other_json(tmp_path):
    (tmp_path / "a.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        load_chrome_trace(tmp_path / "a.json")


# -- metrics ---------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_server_and_textfile_carry_every_name_by_rank_and_job(tmp_path):
    port = free_port()
    m = Metrics(rank=0, job="t", port=port, textfile=str(tmp_path / "m.prom"), cross=True)
    try:
        m.update({n: i + 0.5 for i, n in enumerate(NAMES)})
        m.update_cross([{n: 1.0 for n in NAMES}, {n: 3.0 for n in NAMES}], slowest_rank=1)
        m.write_textfile()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    for i, n in enumerate(NAMES):
        assert f'{n}{{job="t",rank="0"}} {i + 0.5}' in body
        assert f'{n}_cross{{job="t",stat="median"}} 2.0' in body
    assert 'slowest_rank{job="t"} 1.0' in body
    assert 'step_time_ms{job="t",rank="0"} 0.5' in (tmp_path / "m.prom").read_text()


def test_textfile_per_rank_and_alloc_frag_in_range():
    assert textfile_path("/x/m.prom", 0, 1) == "/x/m.prom"
    assert textfile_path("/x/m.prom", 3, 4) == "/x/m.rank3.prom"
    assert 0.0 <= alloc_frag_pct("cpu") <= 100.0


# -- injection, report -----------------------------------------------------------------------------
def test_inject_spec_is_validated():
    assert inject.parse("loader_sleep_ms=5,slow_rank=1") == {"loader_sleep_ms": 5.0, "slow_rank": 1}
    with pytest.raises(ConfigError, match="unknown key"):
        inject.parse("sleep=1")
    with pytest.raises(ConfigError, match="not a number"):
        inject.parse("slow_ms=abc")


def test_report_step_time_parts_add_up_to_the_total(tmp_path):
    """Per-part medians do not add (compute and comm peak on different steps); the report
    shows one real step, the median one, so its parts sum to its total, per rank and overall."""
    import re

    from rtxmpi.observe.breakdown import median_steps

    rows = []
    for step, (compute, comm, other) in enumerate([(10, 50, 1), (50, 10, 2), (30, 31, 3),
                                                   (12, 48, 4), (48, 11, 5)], 1):
        for r in (0, 1):
            parts = dict(compute_ms=compute + 5 * r, data_ms=0.5, exposed_comm_ms=comm - 5 * r,
                         checkpoint_ms=0.25 * r, other_ms=other)
            rows.append(StepBreakdown(rank=r, step=step, start_us=0.0, step_ms=sum(parts.values()),
                                      comm_ms=comm, hidden_comm_ms=0.0, bus_bytes=1e6,
                                      comm_calls=2, **parts).as_dict())
    (tmp_path / "breakdown.json").write_text(json.dumps(rows))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 1.0}) + "\n")
    run = load_run(str(tmp_path))
    assert {r: b.step for r, b in median_steps(run.breakdowns).items()} == {0: 3, 1: 3}
    text = summary([run])
    line = next(x for x in text.splitlines() if x.startswith("step time"))
    total = float(re.search(r": ([\d.]+) ms =", line).group(1))
    parts = [float(v) for v in re.findall(r" ([\d.]+) \(\d+%\)", line)]
    assert len(parts) == 5 and sum(parts) == pytest.approx(total, abs=0.05 * len(parts))
    assert total == pytest.approx(61.5 + 0.125 + 3.0, abs=0.05)  # step 3, mean over the ranks
    for row in (x.split() for x in text.splitlines() if re.match(r"^ +[01] +3 ", x)):
        assert sum(map(float, row[3:])) == pytest.approx(float(row[2]), abs=0.05 * 5)
    verdict = classify(run.breakdowns)
    assert sum(verdict.costs.values()) == pytest.approx(verdict.numbers["critical_step_ms"])
    assert sum(verdict.shares.values()) == pytest.approx(100.0)
    assert f"{verdict.numbers['critical_step_ms']:.1f} = compute" in str(verdict)


def test_report_from_a_timeline_alone(tmp_path):
    write_chrome_trace(tmp_path / "timeline.json", ranks_fixture())
    run = load_run(str(tmp_path))
    assert len(run.breakdowns) == 2
    text = summary([run])
    assert "bottleneck:" in text and "step time" in text
    assert [p.rsplit("/", 1)[1] for p in plot(run, str(tmp_path))] == ["step_breakdown.png",
                                                                      "bandwidth.png"]


def test_report_refuses_a_directory_without_a_run(tmp_path):
    with pytest.raises(ConfigError, match="no metrics.jsonl and no timeline.json"):
        load_run(str(tmp_path))
    with pytest.raises(ConfigError, match="not a directory"):
        load_run(str(tmp_path / "missing"))


def test_report_reads_a_diverged_run_whose_loss_is_null(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 5.5, "world_size": 1}\n{"step": 2, "loss": null, "world_size": 1}\n')
    run = load_run(str(tmp_path))
    assert "loss: 5.500 at step 1 -> nan at step 2" in summary([run])
    assert plot(run, str(tmp_path / "plots"))


# -- Observer (one process) ------------------------------------------------------------------------
class Engine:
    def __init__(self):
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise MemoryError("out of memory")
        return x


def test_observer_counts_an_oom_and_keeps_only_the_last_steps(tmp_path):
    from rtxmpi.observe.observer import Observer

    world = rtxmpi.init()
    engine = Engine()
    before = trace.counters().get("oom_count", 0.0)
    obs = Observer(world, timeline=str(tmp_path / "t.json"), timeline_steps=3, classify_steps=2)
    obs.instrument(engine=engine)
    try:
        for step in range(1, 11):
            obs.begin_step(step)
            engine.fail = step == 7
            try:
                engine.forward(1)
            except MemoryError:
                pass
            values = obs.end_step(step)
            assert values["oom_count"] == before + (step >= 7)
    finally:
        obs.close()
    _, spans = load_chrome_trace(tmp_path / "t.json")
    steps = [s[4]["step"] for s in spans[0] if s[1] == "step"]
    assert steps == [7, 8, 9, 10]  # the last 3 complete steps when step 10 began, and step 10


def test_observer_without_outputs_does_nothing():
    from rtxmpi.observe.observer import Observer

    world = rtxmpi.init()
    engine = Engine()
    forward = engine.forward
    obs = Observer(world)
    obs.instrument(engine=engine)
    assert not obs.active and not trace.enabled() and engine.forward == forward
    obs.begin_step(1)
    assert obs.end_step(1) == {} and obs.close() is None


def test_observer_refuses_a_bad_port_and_path(tmp_path):
    from rtxmpi.observe.observer import Observer

    world = rtxmpi.init()
    with pytest.raises(ConfigError, match="^metrics_port 0"):
        Observer(world, metrics_port=0)
    with pytest.raises(ConfigError, match="^timeline .*not a writable file path"):
        Observer(world, timeline=str(tmp_path / "missing" / "t.json"))
    with pytest.raises(ConfigError, match="^--timeline .*not a writable file path"):  # as a CLI names it
        Observer(world, timeline=str(tmp_path / "missing" / "t.json"), names={"timeline": "--timeline"})


def test_report_scaling_table_from_runs_at_two_world_sizes(tmp_path):
    for n, tps in ((1, 1000.0), (2, 1800.0)):
        d = tmp_path / f"n{n}"
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": tps, "world_size": n}) + "\n"
            for s in range(1, 6)))
    text = summary([load_run(str(tmp_path / "n2")), load_run(str(tmp_path / "n1"))])
    rows = [line.split() for line in text.splitlines() if line.startswith("   ")]
    assert ["1", "1000", "1.00", "100%"] == rows[0][:4]
    assert ["2", "1800", "1.80", "90%"] == rows[1][:4]
