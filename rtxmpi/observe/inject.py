"""Fault injection for validating the bottleneck classifier (and for drills).

RTXMPI_INJECT holds comma-separated key=value items; unknown keys or bad values raise ConfigError:
  loader_sleep_ms=M   every rank sleeps M ms in each batch load (input-bound)
  slow_rank=R         rank R sleeps slow_ms in each forward (a straggler)
  slow_ms=M           how long (default 50)
A throttled link and a slow checkpoint need no hook: `tc qdisc ... tbf` on a veth between network
namespaces, and --ckpt-every 1 with a large model (docs/observe.md).
"""
import functools
import os
import time

from ..errors import ConfigError

_KEYS = {"loader_sleep_ms": float, "slow_rank": int, "slow_ms": float}


def parse(spec):
    """{key: value} from an RTXMPI_INJECT string ('' or None: {})."""
    out = {}
    for item in filter(None, (spec or "").split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in _KEYS:
            raise ConfigError(f"RTXMPI_INJECT: unknown key {key!r}; known: {', '.join(_KEYS)}")
        try:
            out[key] = _KEYS[key](value)
        except ValueError:
            raise ConfigError(f"RTXMPI_INJECT: {key}={value!r} is not a number") from None
        if out[key] < 0:
            raise ConfigError(f"RTXMPI_INJECT: {key} must be >= 0, got {value}")
    return out


def _sleeping(method, seconds):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return method(*args, **kwargs)

    return wrapper


def apply(rank, *, engine=None, sampler=None, spec=None):
    """Apply RTXMPI_INJECT (or `spec`) to this rank's sampler.next_batch and engine.forward.
    Returns the parsed items ({} when nothing is injected)."""
    items = parse(os.environ.get("RTXMPI_INJECT") if spec is None else spec)
    if sampler is not None and items.get("loader_sleep_ms"):
        sampler.next_batch = _sleeping(sampler.next_batch, items["loader_sleep_ms"] / 1e3)
    if engine is not None and items.get("slow_rank") == rank:
        engine.forward = _sleeping(engine.forward, items.get("slow_ms", 50.0) / 1e3)
    return items
