"""Span recorder and metric registry that every layer may call.

Cheap and off by default: `span()` returns a shared no-op context manager while tracing is off, so
instrumented code costs one function call. When on, each span is recorded as
(name, category, start_us, duration_us, args) on this rank; the observe layer merges ranks into a
Chrome-trace timeline.
"""
import time
from contextlib import contextmanager

_enabled = False
_events = []
_counters = {}


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_SPAN = _NoSpan()


def enable(on=True):
    """Turn span recording on or off for this process."""
    global _enabled
    _enabled = bool(on)


def enabled():
    return _enabled


@contextmanager
def _record(name, category, args):
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        _events.append((name, category, start * 1e6, (end - start) * 1e6, args))


def span(name, category="compute", **args):
    """Context manager that records a span named `name` when tracing is on; no-op otherwise."""
    if not _enabled:
        return _NO_SPAN
    return _record(name, category, args)


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
