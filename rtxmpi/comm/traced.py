"""Trace spans for every collective, swapped in only while tracing is on.

When rtxmpi.observe.trace is enabled, the public collectives of ProcessGroup (all_reduce,
reduce_scatter, all_gather, broadcast, all_to_all, barrier, send, recv) are replaced by wrappers
that record a "comm" span with args {op, bytes, group, world_size, async}; when it is turned off the
plain methods are put back, so tracing off costs nothing on the collective path.

- A blocking call is one span from entry to return (all of it is exposed: nothing else runs).
- An asynchronous call (async_op=True) is one span from its launch to its completion (when
  `Work.test()` first returns True or `Work.wait()` returns), with async=True; the time a rank
  spends blocked inside `Work.wait()` is a separate "wait" span. The observe layer counts the part
  of an async span that overlaps compute as hidden and the wait spans as exposed.

bytes is the payload of this rank's call: the input array's nbytes (all_gather: the output's),
0 for barrier. ProcessGroup's subclasses (e.g. DeviceGroup) and Work's are wrapped too, where
they define these methods themselves; a call made inside another traced call (a subclass calling
super(), a blocking send waiting on its Work) is not recorded twice. Collectives launched inside
`untraced()` are not recorded at all (nor their completion or wait): the observer's own
bookkeeping (its cross-rank all_gather) is not the job's communication. Nothing here communicates.
"""
import functools
import threading
from contextlib import contextmanager

from ..observe import trace
from .group import ProcessGroup
from .work import Work

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier",
       "send", "recv")
_plain = {}
_inside = threading.local()  # .busy: an outer traced call is running on this thread


def _subclasses(cls):
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def _payload_bytes(op, args, group):
    x = args[0] if args else None
    nbytes = int(getattr(x, "nbytes", 0) or 0)
    return nbytes * group.world_size if op == "all_gather" else nbytes


def _traced_collective(op, method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(_inside, "busy", False):
            return method(self, *args, **kwargs)
        start = trace._now()
        _inside.busy = True
        try:
            result = method(self, *args, **kwargs)
        finally:
            _inside.busy = False
        pending = isinstance(result, Work) and not result.is_completed()
        info = {"op": op, "bytes": _payload_bytes(op, args, self), "group": self.name,
                "world_size": self.world_size, "async": pending}
        if pending:  # recorded when it completes; a Work done at once (host-staged) was blocking
            result._span = (start, info)
        else:
            trace.add(op, "comm", start, trace._now(), info)
        return result

    return wrapper


def _traced_complete(method):
    @functools.wraps(method)
    def wrapper(self):
        span, self._span = self._span, None
        result = method(self)
        if span is not None:
            trace.add(span[1]["op"], "comm", span[0], trace._now(), span[1])
        return result

    return wrapper


def _traced_wait(method):
    @functools.wraps(method)
    def wrapper(self, timeout_s=None):
        if self._done or self._span is None or getattr(_inside, "busy", False):
            return method(self, timeout_s)
        start, info = trace._now(), self._span[1]
        _inside.busy = True
        try:
            return method(self, timeout_s)
        finally:
            _inside.busy = False
            trace.add("wait " + info["op"], "wait", start, trace._now(),
                      {"op": info["op"], "group": info["group"], "bytes": info["bytes"]})

    return wrapper


@contextmanager
def untraced():
    """Collectives this thread launches inside the block record no span, and neither do their
    Work's completion or wait later (e.g. the Observer's cross-rank all_gather, which runs from the
    end of one step to the end of the next and would otherwise count as communication in flight
    hidden behind the whole step). Local; nests."""
    busy = getattr(_inside, "busy", False)
    _inside.busy = True
    try:
        yield
    finally:
        _inside.busy = busy


def _switch(on):
    if on and not _plain:
        for cls in _subclasses(ProcessGroup):
            for op in OPS:
                if op in cls.__dict__:
                    _plain[(cls, op)] = cls.__dict__[op]
                    setattr(cls, op, _traced_collective(op, cls.__dict__[op]))
        for cls in _subclasses(Work):
            for name, wrap in (("_complete", _traced_complete), ("wait", _traced_wait)):
                if name in cls.__dict__:
                    _plain[(cls, name)] = cls.__dict__[name]
                    setattr(cls, name, wrap(cls.__dict__[name]))
    elif not on and _plain:
        for (cls, name), method in _plain.items():
            setattr(cls, name, method)
        _plain.clear()


def install():
    """Register the switch with rtxmpi.observe.trace (once; rtxmpi.comm does it on import)."""
    if _switch not in trace._switches:
        trace.on_switch(_switch)
