"""One merged Chrome-trace timeline for all ranks: clock offsets, gathering, export, loading.

    offset_us = estimate_clock_offset(world)          # collective, once at init
    trace.enable(); ...train...; trace.enable(False)
    merged = gather_events(world, trace.events(), offset_us)   # collective; rank 0 gets all
    if world.rank == 0: write_chrome_trace("timeline.json", merged)

The file is Chrome's trace-event JSON ({"traceEvents": [...]}) and opens in Perfetto
(ui.perfetto.dev) and chrome://tracing: one process per rank ("rank 3 (host)"), one track
(thread) per role: step, data, compute (forward, backward, optimizer, eval and the layers inside
them), comm (blocking collectives and waits for asynchronous ones), comm async 0..k (one lane per
asynchronous collective in flight at once), checkpoint. Times are microseconds on rank 0's clock,
counted from the earliest span. Every span carries its args (collectives: op, bytes, group, async).

Clock offsets (NTP's estimator, Mills, RFC 5905): every rank r != 0 exchanges `rounds` ping-pongs
with rank 0; for each, t1 = r's send time, t2 = rank 0's reply time, t3 = r's receive time, and
the offset is t2 - (t1 + t3) / 2, exact when both legs take equally long. The sample with the
smallest round trip t3 - t1 is kept (the least queuing), so the error is at most half of that
round trip (a few microseconds over shared memory, tens over TCP). Adding the offset to a rank's
timestamps puts them on rank 0's clock. Ranks on one host share CLOCK_MONOTONIC (offset ~0);
ranks on different hosts do not, which is what the correction is for.
"""
import json
import os
import socket

import numpy as np

_TRACKS = {"step": (0, "step"), "data": (1, "data"), "forward": (2, "compute"),
           "backward": (2, "compute"), "optimizer": (2, "compute"), "compute": (2, "compute"),
           "eval": (2, "compute"), "comm": (3, "comm"), "wait": (3, "comm"),
           "checkpoint": (4, "checkpoint")}
_ASYNC_TID = 10  # comm async lanes: tid 10, 11, ...
_OTHER_TID = 5


def estimate_clock_offset(group, rounds=8):
    """This rank's clock offset to group rank 0 in microseconds (0.0 on rank 0).

    rank 0's clock = this rank's clock + offset. Collective: every rank of `group` must call; rank
    0 serves the ranks one after another (`rounds` 8-byte ping-pongs each). Call it with tracing
    off. Raises CollectiveTimeout when a rank does not answer.
    """
    from . import trace

    if group.world_size == 1:
        return 0.0
    buf = np.zeros(1, np.float64)
    if group.rank == 0:
        for peer in range(1, group.world_size):
            for _ in range(rounds):
                group.recv(buf, src=peer, tag=7301)
                buf[0] = trace.now_us()
                group.send(buf, dst=peer, tag=7302)
        return 0.0
    best_rtt, offset = float("inf"), 0.0
    for _ in range(rounds):
        t1 = trace.now_us()
        buf[0] = t1
        group.send(buf, dst=0, tag=7301)
        group.recv(buf, src=0, tag=7302)
        t3 = trace.now_us()
        if t3 - t1 < best_rtt:
            best_rtt, offset = t3 - t1, float(buf[0]) - (t1 + t3) / 2
    return offset


def gather_events(group, events, offset_us, meta=None):
    """Every rank's spans on rank 0's clock, on rank 0 (None elsewhere).

    events: this rank's (name, category, start_us, dur_us, args) spans; offset_us: from
    estimate_clock_offset. meta: a JSON-able dict about this rank (host added). Returns, on rank 0,
    a list indexed by rank of {"rank", "offset_us", "meta", "events"} with shifted start times.
    Collective: every rank of `group` must call (one all_gather of lengths, then one send per
    rank to rank 0). Encoded as JSON: nothing is pickled. Call it with tracing off.
    """
    mine = {"rank": group.rank, "offset_us": float(offset_us),
            "meta": {"host": socket.gethostname(), "pid": os.getpid(), **(meta or {})},
            "events": [[n, c, s + offset_us, d, a] for n, c, s, d, a in events]}
    payload = np.frombuffer(json.dumps(mine, default=_jsonable).encode(), np.uint8)
    sizes = group.all_gather(np.array([payload.size], np.int64))
    if group.rank != 0:
        group.send(payload, dst=0, tag=7303)
        return None
    out = [mine]
    for peer in range(1, group.world_size):
        buf = np.empty(int(sizes[peer]), np.uint8)
        group.recv(buf, src=peer, tag=7303)
        out.append(json.loads(buf.tobytes()))
    for r in out:
        r["events"] = [tuple(e) for e in r["events"]]
    return out


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def _lanes(spans):
    """Greedy lane per span so that spans in one lane never overlap: [(lane, span)]."""
    ends, out = [], []
    for span in sorted(spans, key=lambda e: e[2]):
        start, end = span[2], span[2] + span[3]
        lane = next((i for i, e in enumerate(ends) if e <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        out.append((lane, span))
    return out


def to_chrome_trace(ranks, other=None):
    """The Chrome trace-event dict of `ranks` (gather_events' result). other: extra JSON-able
    run information stored under "otherData"."""
    t0 = min((e[2] for r in ranks for e in r["events"]), default=0.0)
    out = []
    for r in ranks:
        pid, host = r["rank"], r["meta"].get("host", "?")
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"rank {pid} ({host})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": pid}})
        named = {}
        plain, in_flight = [], []
        for e in r["events"]:
            (in_flight if e[1] == "comm" and e[4].get("async") else plain).append(e)
        for name, cat, s, d, args in plain:
            tid, track = _TRACKS.get(cat, (_OTHER_TID, "other"))
            named[tid] = track
            out.append({"name": name, "cat": cat, "ph": "X", "ts": round(s - t0, 3),
                        "dur": round(d, 3), "pid": pid, "tid": tid, "args": args})
        for lane, (name, cat, s, d, args) in _lanes(in_flight):
            named[_ASYNC_TID + lane] = f"comm async {lane}"
            out.append({"name": name, "cat": cat, "ph": "X", "ts": round(s - t0, 3),
                        "dur": round(d, 3), "pid": pid, "tid": _ASYNC_TID + lane, "args": args})
        for tid, track in named.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": track}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
    ranks_meta = [{"rank": r["rank"], "offset_us": r["offset_us"], **r["meta"]} for r in ranks]
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"rtxmpi_ranks": ranks_meta, "t0_us": t0, **(other or {})}}


def write_chrome_trace(path, ranks, other=None):
    """Write to_chrome_trace(ranks, other) to `path` as JSON (atomically: a temp file, renamed)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(to_chrome_trace(ranks, other), f, separators=(",", ":"), default=_jsonable)
    os.replace(tmp, path)


def load_chrome_trace(path):
    """Read a timeline written by write_chrome_trace: (other_data, {rank: [span tuples]}), spans
    as (name, category, start_us, dur_us, args) in file time. Raises ValueError on a file that is
    not a Chrome trace-event JSON object."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    ranks = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            ranks.setdefault(int(e["pid"]), []).append(
                (e["name"], e.get("cat", ""), float(e["ts"]), float(e["dur"]), e.get("args", {})))
    for spans in ranks.values():
        spans.sort(key=lambda s: s[2])
    return doc.get("otherData", {}), ranks
