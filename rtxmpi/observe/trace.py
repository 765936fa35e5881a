"""Span recorder and counter registry that every layer may call.

Cheap and off by default: `span()` returns a shared no-op context manager while tracing is off, so
instrumented code costs one function call, and layers that register a switch (`on_switch`; the
collectives of rtxmpi.comm do) swap their instrumented code in only while tracing is on. When on,
each span is recorded as (name, category, start_us, duration_us, args) on this rank, times from
time.perf_counter() in microseconds (this process's clock; rtxmpi.observe.timeline estimates the
offsets between ranks and merges them into one Chrome-trace timeline).

Categories used across rtxmpi (the observe layer reads them): "step" (one training step), "data"
(loading a batch), "forward", "backward", "optimizer", "compute" (other compute, e.g. one layer),
"eval", "comm" (a collective or point-to-point transfer; args: op, bytes, group, async, world_size),
"wait" (blocked in Work.wait for an asynchronous collective), "checkpoint".
"""
import time
from contextlib import contextmanager

_enabled = False
_events = []
_counters = {}
_switches = []
_now = time.perf_counter


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_SPAN = _NoSpan()


def enable(on=True):
    """Turn span recording on or off for this process (and every registered switch with it)."""
    global _enabled
    _enabled = bool(on)
    for switch in _switches:
        switch(_enabled)


def enabled():
    return _enabled


def on_switch(callback):
    """Call `callback(on)` now and whenever tracing is turned on or off. A layer uses it to swap
    in instrumented code only while tracing is on, so that off costs nothing at all."""
    _switches.append(callback)
    callback(_enabled)


def now_us():
    """This process's trace clock (time.perf_counter) in microseconds."""
    return _now() * 1e6


@contextmanager
def _record(name, category, args):
    start = _now()
    try:
        yield
    finally:
        end = _now()
        _events.append((name, category, start * 1e6, (end - start) * 1e6, args))


def span(name, category="compute", **args):
    """Context manager that records a span named `name` when tracing is on; no-op otherwise."""
    if not _enabled:
        return _NO_SPAN
    return _record(name, category, args)


def add(name, category, start_s, end_s, args=None):
    """Record an already-timed span from `start_s` to `end_s` (time.perf_counter seconds), e.g. an
    asynchronous collective from its launch to its completion. No-op while tracing is off."""
    if _enabled:
        _events.append((name, category, start_s * 1e6, (end_s - start_s) * 1e6, args or {}))


def count(name, value=1.0):
    """Add `value` to the process-local counter `name` (always on; a dict update)."""
    _counters[name] = _counters.get(name, 0.0) + value


def counters():
    """A copy of the process-local counters."""
    return dict(_counters)


def events(clear=False):
    """The recorded spans as a list of (name, category, start_us, dur_us, args) tuples."""
    out = list(_events)
    if clear:
        _events.clear()
    return out


def drop_before(start_us):
    """Forget spans that ended at or before `start_us`, within half a microsecond of float
    rounding (bounds memory on long runs)."""
    _events[:] = [e for e in _events if e[2] + e[3] > start_us + 0.5]
