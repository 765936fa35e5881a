"""Per-rank memory accounting: model state, activations and the process's resident set.

    from rtxmpi.observe.memory import report, gather_reports
    loss, cache = engine.forward(x, y)
    mine = report(engine, cache=cache)               # local: this rank's MemoryReport
    every = gather_reports(world, mine)              # collective: one MemoryReport per rank
    if world.rank == 0: print(every[0].model_state_bytes, every[0].peak_rss_bytes)

What is counted (all in bytes, per rank):
  params, grads, optimizer: from the engine's own `memory_bytes()` when it has one (ZeRO knows
      what it shards and which buffers it keeps); otherwise from the arrays: the model's
      `flat_data` (params), `flat_grad` (grads) and every array attribute of the optimizer except
      the parameters it updates (AdamW: m, v, decay mask, scratch).
  activations: the unique buffers a forward cache keeps alive (`cache_bytes`). Views are followed
      to the array that owns the memory (`arr.base`), each owner counted once, whole; buffers of
      the model's parameters and gradients (e.g. the weight a linear layer's cache keeps for its
      backward) are excluded, since they are counted as params/grads already.
  transient_peak: buffers an engine allocates and frees within a step, at their peak, when the
      engine tracks them (ZeRO-3: `engine.provider.peak_bytes`, gathered units + unit gradient
      buffers); 0 otherwise.
  rss: the process's resident set now (/proc/self/statm) and its peak (getrusage ru_maxrss).
      These include the interpreter, libraries and MPI buffers, so they exceed the sum above.
Nothing here communicates except `gather_reports`.
"""
import resource
import sys
from dataclasses import asdict, dataclass, fields

import numpy as np

_FIELDS = ("rank", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
           "rss_bytes", "peak_rss_bytes", "transient_peak_bytes")


@dataclass(frozen=True)
class MemoryReport:
    """One rank's memory, in bytes (ints); -1 where a value could not be measured.

    rank: the group rank reported. params_bytes, grads_bytes, optimizer_bytes: model state held by
    this rank. activations_bytes: unique buffers kept alive by one forward cache (0 without one).
    rss_bytes: resident set size now. peak_rss_bytes: the largest resident set so far.
    transient_peak_bytes: the most bytes of step-transient buffers the engine held at once (ZeRO-3
    gathered units and unit gradients), 0 where the engine does not track them.
    """

    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    rss_bytes: int
    peak_rss_bytes: int
    transient_peak_bytes: int = 0

    @property
    def model_state_bytes(self):
        """params + grads + optimizer: what ZeRO shards (bytes)."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def as_dict(self):
        """Every field plus model_state_bytes, JSON-able."""
        return {**asdict(self), "model_state_bytes": self.model_state_bytes}


# -- the process -----------------------------------------------------------------------------
def peak_rss_bytes():
    """The process's peak resident set size in bytes (getrusage ru_maxrss: KiB on Linux, bytes on
    macOS). Includes the interpreter and every library; never decreases."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def rss_bytes():
    """The process's current resident set size in bytes (/proc/self/statm), or -1 where there is
    no /proc (then use peak_rss_bytes)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return -1
    return resident_pages * resource.getpagesize()


# -- arrays ------------------------------------------------------------------------------------
def _is_array(x):
    return hasattr(x, "nbytes") and hasattr(x, "shape") and hasattr(x, "dtype")


def _owner(arr):
    """The array that owns `arr`'s memory: follow `.base` while it is an array (numpy and cupy
    views keep their owner in `.base`; a numpy owner's base may be a bytes/mmap object)."""
    while _is_array(getattr(arr, "base", None)):
        arr = arr.base
    return arr


def _walk(obj, seen_containers, found):
    """Collect every array reachable from `obj` into `found` (id(owner) -> owner)."""
    if obj is None or isinstance(obj, (str, bytes, int, float, complex, bool, np.generic)):
        return
    if _is_array(obj):
        owner = _owner(obj)
        found[id(owner)] = owner
        return
    if id(obj) in seen_containers:
        return
    seen_containers.add(id(obj))
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (tuple, list, set, frozenset)):
        items = obj
    else:
        items = [getattr(obj, name) for name in _slot_names(type(obj)) if hasattr(obj, name)]
        items += list(getattr(obj, "__dict__", {}).values())
    for item in items:
        _walk(item, seen_containers, found)


def _slot_names(cls):
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def cache_bytes(cache, exclude=()):
    """Bytes of the unique buffers that `cache` keeps alive (activations).

    cache: any nest of objects (attributes or __slots__), tuples, lists and dicts holding numpy
    or cupy arrays, e.g. the cache rtxmpi.nn.GPT.forward returns. A view counts as its owner
    (`.base`), and each owner is counted once, in full (a view keeps all of it alive).
    exclude: arrays whose owners are not counted (the model's flat_data and flat_grad: weights
    that layer caches reference for their backward). Local.
    """
    found = {}
    _walk(cache, set(), found)
    skip = {id(_owner(a)) for a in exclude if _is_array(a)}
    return int(sum(owner.nbytes for key, owner in found.items() if key not in skip))


def optimizer_state_bytes(optimizer):
    """Bytes of every array attribute of `optimizer` except the parameters it updates (AdamW: m,
    v, decay mask, scratch); 0 for None."""
    if optimizer is None:
        return 0
    params = getattr(optimizer, "params", None)
    owners = {}
    for name, value in vars(optimizer).items():
        if _is_array(value) and value is not params and name != "params":
            owner = _owner(value)
            owners[id(owner)] = owner
    return int(sum(o.nbytes for o in owners.values()))


# -- reports -------------------------------------------------------------------------------------
def transient_peak_bytes(engine):
    """The peak bytes of step-transient buffers `engine` tracks: the sum of the values of
    `engine.provider.peak_bytes` (ZeroDataParallel stage 3: gathered units and unit gradient
    buffers); 0 when there is none."""
    peak = getattr(getattr(engine, "provider", None), "peak_bytes", None)
    if isinstance(peak, dict):
        return int(sum(peak.values()))
    return int(peak or 0)


def report(engine=None, *, model=None, optimizer=None, cache=None, rank=None):
    """This rank's MemoryReport (bytes). Local: no communication.

    engine: a training wrapper. When it has `memory_bytes()` (ZeroDataParallel) its
    {"params", "grads", "optimizer"} are used as they are; otherwise (DataParallel, or None) the
    model's flat_data / flat_grad and `optimizer`'s state arrays are counted.
    model: the model (default engine.model); needs flat_data and flat_grad unless the engine
    reports its own bytes. optimizer: the optimizer of an engine without memory_bytes (e.g. the
    AdamW passed to DataParallel.step); None counts 0 there. cache: a forward cache to count as
    activations (0 when None); the model's parameter and gradient buffers are excluded.
    rank: the rank to record (default engine.group.rank, else 0).
    Raises ValueError when neither an engine with memory_bytes() nor a model is given.
    """
    model = model if model is not None else getattr(engine, "model", None)
    if rank is None:
        rank = getattr(getattr(engine, "group", None), "rank", 0)
    held = engine.memory_bytes() if hasattr(engine, "memory_bytes") else None
    if held is not None:
        params, grads, opt = int(held["params"]), int(held["grads"]), int(held["optimizer"])
    elif model is not None:
        params, grads = int(model.flat_data.nbytes), int(model.flat_grad.nbytes)
        opt = optimizer_state_bytes(optimizer)
    else:
        raise ValueError("report() needs an engine with memory_bytes() or a model with flat_data "
                         "and flat_grad")
    exclude = () if model is None else [a for a in (getattr(model, "flat_data", None),
                                                     getattr(model, "flat_grad", None))
                                        if a is not None]
    activations = 0 if cache is None else cache_bytes(cache, exclude=exclude)
    return MemoryReport(rank=int(rank), params_bytes=params, grads_bytes=grads,
                        optimizer_bytes=opt, activations_bytes=activations,
                        rss_bytes=rss_bytes(), peak_rss_bytes=peak_rss_bytes(),
                        transient_peak_bytes=transient_peak_bytes(engine))


def gather_reports(group, mine):
    """Every rank's MemoryReport, in group-rank order, on every rank (rank 0 usually prints).

    group: a ProcessGroup (None: a single process, returns [mine]). mine: this rank's report.
    Collective: every rank of `group` must call (one small int64 all_gather).
    """
    if group is None or group.world_size == 1:
        return [mine]
    row = np.array([getattr(mine, name) for name in _FIELDS], np.int64)
    table = group.all_gather(row).reshape(group.world_size, len(_FIELDS))
    return [MemoryReport(**{name: int(v) for name, v in zip(_FIELDS, r)}) for r in table]


assert tuple(f.name for f in fields(MemoryReport)) == _FIELDS  # field order is the wire order
