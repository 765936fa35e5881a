"""ZeRO: data parallelism with the optimizer state (stage 1), gradients (stage 2) and parameters
(stage 3) sharded.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020. Every rank keeps the full model for forward and backward; the optimizer (its
state m, v and, with offload, the master parameters) exists only for this rank's *shard* of the
flat parameter vector.

Shard layout (the same for parameters, gradients and optimizer state): the flat vector of N
elements is viewed as padded to W * S elements, S = ceil(N / W); rank r owns the contiguous range
[min(r*S, N), min((r+1)*S, N)). A rank may own nothing (1 element over 4 ranks: 1, 0, 0, 0).

Stage 1: backward is DataParallel's (bucketed, overlapped all_reduce of the averaged gradient);
step runs the optimizer on this rank's slice of it, then all_gathers the updated parameters.

Stage 2: gradients are reduce-scattered, so each rank receives only its shard (half the bytes of
an all_reduce). The padded vector is a (W, S) matrix whose row r is rank r's shard; a gradient
bucket is a range of *columns* [a, b) of that matrix, so its reduce_scatter lands row r in rank
r's shard. Buckets are launched from the last columns to the first, asynchronously, as soon as
backward has finished every parameter they touch (which, with backward running from the last
parameter to the first, happens while the first 1/W of the model is still in backward).

Stage 3: each rank keeps only its shard of the parameters and of the reduced gradient, under the
same layout (so checkpoints are the same at every stage). The model takes its parameters from a
`ShardedParams` provider (the `rtxmpi.nn.GPT` unit hooks): a unit (embeddings, a block, the head)
is gathered from its owners just before the model uses it, in forward and again in backward, and
freed when the model releases it; the gather of the unit the model announces next is started asynchronously
first (prefetch), so it overlaps the unit's compute. A unit's gradient is accumulated in a unit
buffer (the tied wte gets both its head and its embedding terms there), reduced asynchronously
once backward reports it final, and the buffer dropped. A unit lies in the shards of one or a
few consecutive ranks (its owners): the gather is one in-place broadcast per owner of that
owner's part (about the unit's size in all, whatever W), and the gradient reduction is a
reduce_scatter with uneven counts (each rank's overlap with the unit, 0 for non-owners) that
lands each owner's part of the reduced unit in that owner, which adds it into its gradient shard
((W-1)/W x the unit per rank, half an all_reduce's bytes; see docs/zero.md).
"""
import math
from contextlib import contextmanager

import numpy as np

from ..backend import copy_to_host, host_empty, xp_of
from ..control import join_batches
from ..errors import CheckpointError, ConfigError, RtxmpiError
from ..kernels import grad_epilogue
from ..nn import AdamW, clip_grad_norm, grad_norm_sq
from .data import DEFAULT_BUCKET_BYTES, DataParallel, check_batch_on_every_rank, check_synced_step
from .layout import OFFLOADS as LAYOUT_OFFLOADS
from .layout import ZERO_STAGES
from .offload import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_CHUNKS, NvmeStore

STAGES = ZERO_STAGES[1:]  # the sharded ones
OFFLOADS = (None,) + tuple(o for o in LAYOUT_OFFLOADS if o != "none")
NVME_TENSORS = ("params", "adam.m", "adam.v")


# -- shard layout ----------------------------------------------------------------------------
def shard_size(numel, world_size):
    """S = ceil(numel / world_size): the padded length of every rank's shard."""
    if numel < 0 or world_size < 1:
        raise ConfigError(f"shard layout needs numel >= 0 and world_size >= 1, got numel={numel}, "
                          f"world_size={world_size}")
    return -(-numel // world_size)


def shard_range(numel, world_size, rank):
    """[start, stop) of the elements rank `rank` owns: [min(r*S, N), min((r+1)*S, N)).

    Ranks after the last full shard may own fewer elements, or none (stop == start).
    Raises ConfigError for a rank outside [0, world_size).
    """
    size = shard_size(numel, world_size)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside [0, {world_size})")
    return min(rank * size, numel), min((rank + 1) * size, numel)


def even_range(numel, world_size, rank):
    """[start, stop) of the contiguous piece rank `rank` takes when a vector of `numel` elements
    is split as evenly as possible over `world_size` ranks: [r * N // W, (r + 1) * N // W)
    (piece sizes differ by at most one; no padding). The layout of checkpoint pieces written by
    HybridParallel, ZeroHybridParallel, the pipeline engine and rtxmpi.checkpoint.Shard.even
    (ZeRO's own shards are `shard_range`'s). Pure."""
    return rank * numel // world_size, (rank + 1) * numel // world_size


def gather_shards(group, shard, numel, send=None):
    """The whole vector of `numel` elements from every rank's shard of the `shard_range` layout:
    each rank's shard padded to S = shard_size(numel, W) elements, one all_gather (rank k's
    shard lands at k * S), the padding past `numel` stripped.

    shard: 1-D array, this rank's elements [start, stop) of shard_range(numel, W, rank); the
    same dtype on every rank. send: optional S-element buffer (same dtype) to pad a short shard
    in, reused across calls; None: a new zero one. group: ProcessGroup, or None (one rank).
    Returns a (numel,) array not aliasing `shard`. Collective on group (W > 1).
    """
    W = 1 if group is None else group.world_size
    if W == 1:
        return shard[:numel].copy()
    S = shard_size(numel, W)
    n = shard.shape[0]
    if n < S:
        if send is None:
            send = xp_of(shard).zeros(S, dtype=shard.dtype)
        send[:n] = shard
        shard = send
    return group.all_gather(shard)[:numel]


def shard_owners(numel, world_size, lo, hi):
    """[(rank, a, b)]: the ranks whose `shard_range` shards overlap [lo, hi) of a vector of
    numel elements, with each overlap [a, b), in rank order. Pure."""
    S = shard_size(numel, world_size)
    return [(q, max(lo, q * S), min(hi, (q + 1) * S)) for q in range(world_size)
            if max(lo, q * S) < min(hi, (q + 1) * S)]


def gather_range(group, shard, numel, lo, hi):
    """Elements [lo, hi) of a vector of numel elements sharded over `group` under the
    `shard_range` layout (shard: this rank's part, 1-D): one broadcast per owning rank of its
    overlap, about hi - lo elements in all whatever the group size. group: ProcessGroup or None
    (one rank). Returns a new (hi - lo,) array. Collective on group (W > 1)."""
    W, rank = (1, 0) if group is None else (group.world_size, group.rank)
    start, stop = shard_range(numel, W, rank)
    if W == 1:
        return shard[lo:hi].copy()
    out = xp_of(shard).empty(hi - lo, shard.dtype)
    a, b = max(lo, start), min(hi, stop)
    if b > a:
        out[a - lo:b - lo] = shard[a - start:b - start]
    works = [group.broadcast(out[a - lo:b - lo], src=q, async_op=True)
             for q, a, b in shard_owners(numel, W, lo, hi)]
    for work in works:
        work.wait()
    return out


def read_range(read, name, offset, length):
    """read(name, offset, length), checked: elements [offset, offset + length) of the global 1-D
    vector `name` from a checkpoint reader (rtxmpi.checkpoint's Checkpoint.read, or any callable
    with its contract). Returns what read returns, a (length,) array. Raises CheckpointError
    naming the call when it returns another shape (or something that is not an array). Local
    (the reader itself may be collective)."""
    values = read(name, offset, length)
    if getattr(values, "shape", None) != (length,):
        raise CheckpointError(f"read({name!r}, {offset}, {length}) returned shape "
                              f"{getattr(values, 'shape', type(values).__name__)}, "
                              f"expected ({length},)")
    return values


class ColumnBucket:
    """Columns [col_start, col_stop) of the padded (W, S) gradient matrix, reduced together.

    num_params: how many parameters touch these columns (in any row); pending counts down as
    backward reports them final; work is the in-flight reduce_scatter.
    """

    __slots__ = ("index", "col_start", "col_stop", "num_params", "pending", "work", "send")

    def __init__(self, index, col_start, col_stop):
        self.index, self.col_start, self.col_stop = index, col_start, col_stop
        self.num_params, self.pending, self.work, self.send = 0, 0, None, None


def build_column_buckets(params, numel, world_size, bucket_bytes, itemsize):
    """Stage-2 buckets: column ranges of the padded (W, S) gradient matrix, last columns first.

    params: objects with `.offset` and `.size`, laying out [0, numel). A bucket of c columns
    moves W * c elements, so c = max(1, bucket_bytes // (W * itemsize)).
    Returns (buckets in launch order, buckets_of) where buckets_of[i] lists the indices of the
    buckets parameter i touches.
    """
    size = shard_size(numel, world_size)
    width = max(1, int(bucket_bytes) // (world_size * itemsize))
    buckets = []
    stop = size
    while stop > 0:
        start = max(0, stop - width)
        buckets.append(ColumnBucket(len(buckets), start, stop))
        stop = start
    buckets_of = []
    for p in params:
        touched = set()
        lo, hi = p.offset, p.offset + p.size
        for row in range(lo // size, -(-hi // size)) if size and hi > lo else ():
            a, b = max(lo - row * size, 0), min(hi - row * size, size)  # columns in this row
            # bucket k covers [S - (k+1) w, S - k w) (clipped at 0)
            touched.update(range((size - b) // width, (size - a - 1) // width + 1))
        buckets_of.append(sorted(touched))
        for k in touched:
            buckets[k].num_params += 1
    return buckets, buckets_of


def optimizer_bytes(optimizer):
    """Bytes of the arrays an optimizer holds besides the parameters it updates (m, v, masks,
    scratch): its state, for memory accounting."""
    params = getattr(optimizer, "params", None)
    return sum(int(v.nbytes) for k, v in vars(optimizer).items()
               if hasattr(v, "nbytes") and v is not params and k != "params")


def zero_state_bytes(numel, group_size, stage, itemsize=4, offload=None, unit_numel=0):
    """Model-state bytes per rank as ZeroDataParallel.memory_bytes() reports them, for a flat
    vector of `numel` elements replicated over `group_size` ranks, trained with AdamW (m, v,
    decay mask, scratch) in a model dtype of `itemsize` bytes. Pure: for planners.

    Returns {"params", "grads", "optimizer", "total", "transient"}: each of params, grads and
    optimizer is its largest value over the ranks, total their sum (an upper bound of every
    rank's total, exact when numel divides by group_size). stage 0: plain data parallelism
    (everything whole on every rank); 1, 2: the optimizer state is S = ceil(numel / group_size)
    elements (a rank with a short shard also keeps an S-element all_gather send buffer); 3:
    parameters, gradients and optimizer state are all S elements. offload "cpu": + a host master
    and a host gradient shard, and the optimizer state, in float32 or wider. "transient" (not in
    total): stage 3's two gathered units of `unit_numel` elements (in use and prefetched).
    With tensor / sequence parallelism (rtxmpi.parallel.zero_hybrid) pass numel = this tp
    rank's local parameter count (ParallelGPT.num_params) and group_size = dp * sp.
    Raises ConfigError: unknown stage, offload not None / "cpu" ("nvme" depends on the chunking:
    ask memory_bytes()), offload at stage 0, negative sizes.
    """
    if stage not in (0,) + STAGES:
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload not in (None, "cpu") or (offload and not stage):
        raise ConfigError(f"zero_state_bytes models offload None or 'cpu' at stages 1-3, got "
                          f"{offload!r} at stage {stage}")
    W, N, it = int(group_size), int(numel), int(itemsize)
    S = shard_size(N, W) if stage else N
    master = max(it, 4) if offload else it
    if stage == 3:
        params = grads = S * it
    else:
        params = grads = N * it
        if stage and W > 1 and W * S > N:
            params += S * it  # the padded send buffer on a rank whose shard is short
    if offload:
        params, grads = params + S * master, grads + S * master
    optimizer = 4 * S * master
    transient = 2 * int(unit_numel) * it if stage == 3 else 0
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "total": params + grads + optimizer, "transient": transient}


def shard_decay_mask(params, start, stop, xp=np, dtype=np.float32):
    """rtxmpi.nn.decay_mask(params)[start:stop], built for the shard alone (no N-element array):
    1 where weight decay applies, 0 elsewhere."""
    mask = np.zeros(stop - start, dtype=dtype)
    for p in params:
        lo, hi = max(p.offset, start), min(p.offset + p.size, stop)
        if p.decay and hi > lo:
            mask[lo - start:hi - start] = 1
    return mask if xp is np else xp.asarray(mask)


def _default_optimizer(params, decay_mask):
    return AdamW(params, decay_mask=decay_mask)


def _to_host(x):
    return x if isinstance(x, np.ndarray) else x.get()


# -- stage 3: parameters gathered unit by unit --------------------------------------------------
class ShardedParams:
    """The ZeRO-3 parameter provider for a model with units (rtxmpi.nn.GPT; see its docstring).

    model: gives `params` (offset, size, shape) and `units` (contiguous parameter-index ranges);
    group: the data-parallel ProcessGroup; shard: this rank's 1-D parameter shard under the
    padded layout (kept, not copied: the optimizer updates it in place); prefetch: start the
    gather of the unit named by fetch(..., then=) asynchronously.

    Attributes: shard, grad (this rank's reduced-gradient shard: a sum, until the wrapper
    averages it), gathers (unit gathers started), prefetches (of them, started ahead),
    prefetch_hits (fetches that found their unit already started), reductions (unit gradient
    reductions), peak_bytes ({"params", "grads"}: most bytes of gathered units and of unit
    gradient buffers alive at once; reset_peak() restarts it).
    fetch / grads_ready are collective (W > 1): every rank's model calls them in the same order.
    """

    transient = True
    MAX_REDUCING = 1  # unit gradient reductions in flight at once (bounds the gradient memory)

    def __init__(self, model, group, shard, prefetch=True):
        self.group, self.shard, self.prefetch = group, shard, bool(prefetch)
        self.xp = xp_of(shard)
        self.grad = self.xp.zeros_like(shard)
        W, numel = group.world_size, model.params[-1].offset + model.params[-1].size
        self.start, self.stop = shard_range(numel, W, group.rank)
        self._units = []  # (a, b, [(offset in unit, size, shape)], [(owner rank, lo, hi)])
        for first, stop in model.units:
            params = model.params[first:stop]
            a, b = params[0].offset, params[-1].offset + params[-1].size
            views = [(p.offset - a, p.size, p.shape) for p in params]
            self._units.append((a, b, views, shard_owners(numel, W, a, b)))
        # reduce_scatter counts per unit: the unit's overlap with each rank's shard
        self._counts = [[0] * W for _ in self._units]
        for counts, (_, _, _, owners) in zip(self._counts, self._units):
            for q, lo, hi in owners:
                counts[q] = hi - lo
        self._gathered, self._in_flight, self._grad_bufs, self._reducing = {}, {}, {}, []
        self.gathers = self.prefetches = self.prefetch_hits = self.reductions = 0
        self._live = {"params": 0, "grads": 0}
        self.peak_bytes = {"params": 0, "grads": 0}

    def reset_peak(self):
        self.peak_bytes = dict(self._live)

    def _track(self, kind, nbytes):
        self._live[kind] += nbytes
        self.peak_bytes[kind] = max(self.peak_bytes[kind], self._live[kind])

    # -- parameters --------------------------------------------------------------------------
    def _start_gather(self, unit):
        """A new unit vector with this rank's part copied in, and one async broadcast per owning
        rank that fills in that rank's part (in place). Collective."""
        a, b, _, owners = self._units[unit]
        vector = self.xp.empty(b - a, self.shard.dtype)
        lo, hi = max(a, self.start), min(b, self.stop)
        if hi > lo:
            vector[lo - a:hi - a] = self.shard[lo - self.start:hi - self.start]
        works = [self.group.broadcast(vector[lo - a:hi - a], src=q, async_op=True)
                 for q, lo, hi in owners]
        self.gathers += 1
        self._track("params", vector.nbytes)
        return vector, works

    def fetch(self, unit, then=None):
        """Unit `unit`'s parameter arrays, gathered from their owners (waiting for a prefetch
        already in flight); then starts the gather of unit `then` (prefetch). Collective."""
        a, b, views, _ = self._units[unit]
        if self.group.world_size == 1:
            vector = self.shard[a:b]  # the whole vector is the shard: no copy
        elif unit in self._gathered:
            vector = self._gathered[unit]
        else:
            started = self._in_flight.pop(unit, None)
            if started is not None:
                self.prefetch_hits += 1
            vector, works = started if started is not None else self._start_gather(unit)
            for work in works:
                work.wait()
            self._gathered[unit] = vector
        if (then is not None and self.prefetch and self.group.world_size > 1
                and then not in self._gathered and then not in self._in_flight):
            self._in_flight[then] = self._start_gather(then)
            self.prefetches += 1
        return [vector[o:o + n].reshape(shape) for o, n, shape in views]

    def release(self, unit):
        """Drop the gathered copy of `unit` (its arrays must no longer be used). Local."""
        vector = self._gathered.pop(unit, None)
        if vector is not None:
            self._live["params"] -= vector.nbytes

    # -- gradients ---------------------------------------------------------------------------
    def grads(self, unit):
        """Arrays to add unit `unit`'s gradients into (a zeroed unit buffer, the same until
        grads_ready(unit)). Local."""
        a, b, views, _ = self._units[unit]
        buffer = self._grad_bufs.get(unit)
        if buffer is None:
            buffer = self._grad_bufs[unit] = self.xp.zeros(b - a, self.shard.dtype)
            self._track("grads", buffer.nbytes)
        return [buffer[o:o + n].reshape(shape) for o, n, shape in views]

    def grads_ready(self, unit):
        """Start the reduce_scatter (sum) of unit `unit`'s gradient buffer straight into its
        owners' shards (uneven counts: each rank's overlap with the unit, 0 for non-owners);
        once it completes, each owner adds its part into `grad`, and the buffer is dropped. At
        most MAX_REDUCING reductions are in flight (the oldest is completed first).
        Collective (W > 1)."""
        buffer = self._grad_bufs.pop(unit)
        if self.group.world_size == 1:
            self._add_own(unit, buffer)
            self._live["grads"] -= buffer.nbytes
            return
        while len(self._reducing) >= self.MAX_REDUCING:
            self._complete_oldest()
        self.reductions += 1
        work = self.group.reduce_scatter(buffer, op="sum", counts=self._counts[unit],
                                         async_op=True)  # the Work keeps buffer alive
        self._reducing.append((unit, buffer.nbytes, work))
        del buffer
        for _, _, work in self._reducing:  # let the reductions in flight progress
            work.test()

    def _add_own(self, unit, part):
        """Add `part`, this rank's reduced part of unit `unit` (the unit's overlap with
        [start, stop), possibly empty), into `grad`."""
        a, b, _, _ = self._units[unit]
        lo, hi = max(a, self.start), min(b, self.stop)
        if hi > lo:
            self.grad[lo - self.start:hi - self.start] += part

    def _complete_oldest(self):
        unit, nbytes, work = self._reducing.pop(0)
        self._add_own(unit, work.wait())
        self._live["grads"] -= nbytes

    def finish(self):
        """Complete every reduction started by grads_ready (its results into `grad`). Call after
        the model's backward. Collective (completes started operations). Raises RtxmpiError if
        the model did not release, or report, every unit it fetched."""
        if self._grad_bufs or self._gathered or self._in_flight:
            raise RtxmpiError(f"backward left units {sorted(self._grad_bufs)} without "
                              f"grads_ready, {sorted(self._gathered)} not released, "
                              f"{sorted(self._in_flight)} prefetched and never fetched")
        while self._reducing:
            self._complete_oldest()

    def full(self):
        """The whole parameter vector (a new array) on every rank. Collective."""
        return gather_shards(self.group, self.shard, self._units[-1][1])


# -- the wrapper -------------------------------------------------------------------------------
class ZeroDataParallel:
    """Wrap a model for ZeRO data-parallel training over `group` (stage 1, 2 or 3).

    model: as for DataParallel (`params` with `.offset`, `.size`, `.decay`; `flat_data`,
    `flat_grad`; `forward`; `backward(cache, scale, grad_ready)`), e.g. rtxmpi.nn.GPT.
    group: the data-parallel ProcessGroup. stage: 1 (optimizer state sharded), 2 (gradients
    reduce-scattered too) or 3 (parameters sharded too: the model must have GPT's unit hooks,
    `units` and `use_provider`; it gives up flat_data / flat_grad, its forward, backward, logits
    and generate become collective, and full_params() rebuilds the whole vector).
    bucket_bytes: target bytes per gradient bucket (25 MiB; stage 3 reduces per unit instead).
    optimizer: callable(params, decay_mask) -> optimizer over this rank's 1-D parameter shard
    (default AdamW(params, decay_mask=decay_mask)); it must have `step(grad, lr=None)` and, for
    shards()/load_shards(), AdamW's state_dict()/load_state_dict().
    offload: None, or "cpu": master parameters, gradient shard copy and optimizer state in host
    memory (numpy), in float32 or wider; on a numpy model that is the same memory, kept separate;
    or "nvme": master parameters and optimizer state in files under offload_dir (rank_XXXXX/,
    see rtxmpi.parallel.offload.NvmeStore), updated chunk by chunk (offload_chunk_bytes of
    each tensor per chunk) with at most offload_max_chunks chunks in memory; the gradient shard
    copy stays in host memory. The optimizer must be AdamW (its state is streamed). close()
    removes the files.
    Parameters are broadcast from group rank 0 when wrapped. prefetch (stage 3): gather the next
    unit while the current one computes (False: every gather blocking; same results).

    Collective: every rank of `group` must construct it and call backward (outside no_sync),
    step, grad_norm, load_shards, full_params and join the same number of times in the same
    order; at stage 3 forward and every backward (no_sync too) as well.
    Raises ConfigError (stage, offload, bucket_bytes, a stage-3 model without unit hooks; with
    "nvme": no offload_dir, an optimizer other than AdamW, or an offload_dir any rank cannot
    write, raised on every rank).
    """

    def __init__(self, model, group, stage=1, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 optimizer=_default_optimizer, offload=None, prefetch=True, offload_dir=None,
                 offload_chunk_bytes=DEFAULT_CHUNK_BYTES, offload_max_chunks=DEFAULT_MAX_CHUNKS):
        if stage not in STAGES:
            raise ConfigError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        if stage == 3 and not (hasattr(model, "units") and hasattr(model, "use_provider")):
            raise ConfigError(f"ZeRO stage 3 needs a model with parameter units and a provider "
                              f"hook (`units`, `use_provider`, e.g. rtxmpi.nn.GPT); "
                              f"{type(model).__name__} has none: use stage 1 or 2")
        if offload not in OFFLOADS:
            raise ConfigError(f"offload must be one of {OFFLOADS}, got {offload!r}")
        if not bucket_bytes > 0:
            raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if offload == "nvme" and offload_dir is None:
            raise ConfigError('offload="nvme" needs offload_dir, a directory for the optimizer '
                              'files (e.g. on a local NVMe disk)')
        if offload == "nvme" and not (offload_chunk_bytes > 0 and offload_max_chunks >= 1):
            raise ConfigError(f"offload_chunk_bytes must be > 0 and offload_max_chunks >= 1, got "
                              f"{offload_chunk_bytes} and {offload_max_chunks}")
        self.model, self.group, self.stage, self.offload = model, group, stage, offload
        self.bucket_bytes = int(bucket_bytes)
        self.xp = xp_of(model.flat_data)
        self.numel = int(model.flat_data.shape[0])
        W = group.world_size
        self.shard_size = shard_size(self.numel, W)
        self.start, self.stop = shard_range(self.numel, W, group.rank)
        if W > 1:
            group.broadcast(model.flat_data, src=0)
        self._sync = True
        self._synced = False
        self._averaged = False  # stages 2, 3: this rank's gradient shard holds the group average
        # stages 2, 3 after averaging: 0-d bool array, True when this rank's averaged gradient
        # shard holds inf/NaN (rtxmpi.kernels.grad_epilogue; agree across ranks before use)
        self.nonfinite = None
        self._ready_count = 0
        if stage == 1:
            self._dp = DataParallel(model, group, bucket_bytes=self.bucket_bytes,
                                    broadcast_params=False)
        elif stage == 2:
            self.buckets, self._buckets_of = build_column_buckets(
                model.params, self.numel, W, self.bucket_bytes, model.flat_grad.itemsize)
            self._next_launch = 0
            self.overlapped_buckets = 0  # launched asynchronously during the last backward
        # what the optimizer updates: the parameter shard itself, or a host master copy
        mask = shard_decay_mask(model.params, self.start, self.stop,
                                xp=np if offload else self.xp, dtype=model.flat_data.dtype)
        shard, dtype = model.flat_data[self.start:self.stop], model.flat_data.dtype
        # all_gather needs S elements from every rank: a short (or empty) shard is padded
        short = W > 1 and self.stop - self.start < self.shard_size and stage != 3
        self._send = self.xp.zeros(self.shard_size if short else 0, model.flat_data.dtype)
        self.provider = None
        if stage == 3:  # keep only the shard; the model's full buffers go
            self.provider = ShardedParams(model, group, shard.copy(), prefetch=prefetch)
            model.use_provider(self.provider, drop_flat=True)
            shard = self.provider.shard
        self.store = None
        if offload == "nvme":
            self._init_nvme(shard, np.promote_types(dtype, np.float32), optimizer, offload_dir,
                            offload_chunk_bytes, offload_max_chunks)
        elif offload == "cpu":
            dtype = np.promote_types(dtype, np.float32)
            pinned = self.xp is not np  # device<->host copies at full speed from pinned memory
            self._master = host_empty(shard.shape, dtype, pinned)  # a copy, always
            self._master[...] = _to_host(shard)
            self._host_grad = host_empty(self._master.shape, dtype, pinned)
            self._host_grad[...] = 0
            self.optimizer = optimizer(self._master, mask.astype(dtype))
        else:
            self._master = shard
            self._host_grad = None
            self.optimizer = optimizer(shard, mask)

    def _init_nvme(self, shard, dtype, optimizer, offload_dir, chunk_bytes, max_chunks):
        """The file store (every rank agrees it could create its files), the master parameters
        written into it, and an optimizer over one chunk whose state is swapped per chunk."""
        n = self.stop - self.start
        chunk = max(1, min(int(chunk_bytes) // dtype.itemsize, n))
        failed = np.zeros(self.group.world_size, np.int64)
        error = None
        try:
            self.store = NvmeStore(offload_dir, self.group.rank, NVME_TENSORS, n, dtype, chunk,
                                   max_chunks)
        except ConfigError as exc:
            error, failed[self.group.rank] = exc, 1
        if self.group.world_size > 1:
            self.group.all_reduce(failed, op="sum")
        if failed.any():
            if self.store is not None:
                self.store.close()
            ranks = [int(r) for r in np.flatnonzero(failed)]
            raise ConfigError(f"offload_dir: ranks {ranks} cannot create their offload files"
                              + (f": {error}" if error else ""))
        host = _to_host(shard)
        self.store.write_chunks(lambda lo, hi: {"params": host[lo:hi]}, names=("params",))
        self._master = None
        self._host_grad = host_empty(self.store.num_chunks * chunk, dtype,  # padded to chunks
                                     pinned=self.xp is not np)
        self._host_grad[...] = 0
        self.optimizer = optimizer(np.zeros(chunk, dtype), np.ones(chunk, dtype))
        if not isinstance(self.optimizer, AdamW):
            self.store.close()
            raise ConfigError(f'offload="nvme" streams AdamW\'s state chunk by chunk; the '
                              f"optimizer factory returned {type(self.optimizer).__name__}")
        self.optimizer.m = self.optimizer.v = None  # the chunks' state comes from the files

    def _nvme_step(self, grad, lr):
        """One AdamW step over the files, chunk by chunk: the optimizer's params, m, v and mask
        become the chunk's (elementwise update: the same bits as one full-shard step); the new
        parameters go into the model's shard (its dtype) as each chunk finishes."""
        opt, step = self.optimizer, self.optimizer.step_count
        target = (self.provider.shard if self.provider is not None
                  else self.model.flat_data[self.start:self.stop])
        params = self.model.params

        def update(i, lo, hi, arrays):
            opt.params, opt.m, opt.v = arrays["params"], arrays["adam.m"], arrays["adam.v"]
            opt.decay_mask = np.zeros(len(opt.params), opt.params.dtype)
            opt.decay_mask[:hi - lo] = shard_decay_mask(params, self.start + lo,
                                                        self.start + hi, dtype=opt.params.dtype)
            opt.step_count = step
            opt.step(grad[lo:lo + len(opt.params)], lr=lr)
            target[lo:hi] = self.xp.asarray(opt.params[:hi - lo], dtype=target.dtype)

        self.store.stream(update)
        opt.step_count = step + 1
        opt.params = opt.m = opt.v = None  # the last chunk's buffers go

    def close(self):
        """Remove this rank's offload files (offload="nvme"; nothing otherwise). The wrapper
        cannot step or checkpoint after it. Local. Idempotent."""
        if self.store is not None:
            self.store.close()

    def __repr__(self):
        return (f"<ZeroDataParallel stage={self.stage} offload={self.offload} "
                f"shard=[{self.start}, {self.stop}) of {self.numel} on group '{self.group.name}'>")

    # -- forward / backward -----------------------------------------------------------------
    def forward(self, idx, targets=None):
        """The wrapped model's forward: (loss, cache) for this rank's micro-batch.

        idx, targets: (B, T) integer token ids, this rank's samples. Collective at every stage:
        the batch is checked on each rank and the verdict agreed over the group first
        (rtxmpi.parallel.data.check_batch_on_every_rank, one 1-byte all_reduce); stage 3 then
        gathers each unit's parameters. Raises ConfigError on EVERY rank, naming each offending
        rank, when any rank's batch has a bad shape, dtype, length or token id.
        """
        check_batch_on_every_rank(self.group, self.model, idx, targets)
        return self.model.forward(idx, targets)

    @contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally without communicating (accumulation).

        The next backward outside no_sync reduces the accumulated sum; the last backward before
        step() must be that one (step refuses otherwise). Local: no collective
        (stages 1, 2). Stage 3 has no full gradient to accumulate into: forward and backward
        still gather parameters and reduce each unit's gradient into the shards (collective),
        and no_sync only defers the averaging, so the result is the same.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def backward(self, cache, scale=1.0):
        """Backward of scale * loss; outside no_sync, also reduces gradients over the group.

        After it returns (outside no_sync) `grad_shard()` holds the group average of every rank's
        accumulated gradient for this rank's shard (stage 1: all of model.flat_grad is the
        average; stage 2: model.flat_grad[start:stop] is, the rest is zero; stage 3: the
        provider's gradient shard). Collective outside no_sync; at stage 3 always (parameters
        are gathered, and each unit's gradient is reduced at every backward, so that
        no full gradient is ever kept: no_sync only postpones the averaging).
        """
        self._synced = False  # until this backward has completed
        if self._averaged:  # back to a sum, so backward can add to it
            self.grad_shard()[...] *= self.group.world_size
            self._averaged = False
        if self.stage == 3:
            self.model.backward(cache, scale=scale)
            self.provider.finish()
            if self._sync and self.group.world_size > 1:
                _, self.nonfinite = grad_epilogue(self.grad_shard(), 1.0 / self.group.world_size)
                self._averaged = True
        elif self.stage == 1:
            if self._sync:
                self._dp.backward(cache, scale=scale)
            else:
                with self._dp.no_sync():
                    self._dp.backward(cache, scale=scale)
        elif not self._sync or self.group.world_size == 1:
            self.model.backward(cache, scale=scale)
        else:
            self._backward_reduce_scatter(cache, scale)
        self._synced = self._sync

    def _backward_reduce_scatter(self, cache, scale):
        for b in self.buckets:
            b.pending, b.work = b.num_params, None
        self._ready_count, self._next_launch = 0, 0
        self.model.backward(cache, scale=scale, grad_ready=self._grad_ready)
        if self._ready_count != len(self.model.params):
            raise RtxmpiError(f"backward reported {self._ready_count} of {len(self.model.params)} "
                              "parameter gradients; every parameter must report exactly once")
        self.overlapped_buckets = self._next_launch
        # what is left (at least the bucket holding parameter 0) is reduced blocking, in order;
        # a bucket's result overwrites only its own columns of this rank's slice, which no other
        # bucket reads, and only after its own columns were packed
        for b in self.buckets[self._next_launch:]:
            self._store(b, self.group.reduce_scatter(self._packed(b), op="sum"))
        for b in self.buckets[:self._next_launch]:
            self._store(b, b.work.wait())
            b.work = b.send = None
        grad = self.model.flat_grad
        grad[:self.start] = 0  # other ranks' slices: sent, and no longer this rank's to keep
        grad[self.stop:] = 0
        _, self.nonfinite = grad_epilogue(self.grad_shard(), 1.0 / self.group.world_size)
        self._averaged = True

    def _grad_ready(self, i):
        self._ready_count += 1
        for k in self._buckets_of[i]:
            self.buckets[k].pending -= 1
        # launch strictly in bucket order (identical on every rank), never the final bucket
        # early: the one completed last has nothing to overlap with
        while (self._next_launch < len(self.buckets) - 1
               and self.buckets[self._next_launch].pending == 0):
            b = self.buckets[self._next_launch]
            # the packed copy must outlive the transfer: the bucket holds it until wait()
            b.send = self._packed(b)
            b.work = self.group.reduce_scatter(b.send, op="sum", async_op=True)
            self._next_launch += 1
        for b in self.buckets[:self._next_launch]:  # let in-flight reductions progress
            if b.work is not None:
                b.work.test()

    def _packed(self, bucket):
        """Columns [a, b) of the padded (W, S) gradient matrix as a (W, b - a) array (a copy, or
        the gradient itself when one bucket covers an unpadded vector)."""
        W, S, N = self.group.world_size, self.shard_size, self.numel
        a, b = bucket.col_start, bucket.col_stop
        grad = self.model.flat_grad
        full_rows = min(W, N // S)
        if full_rows == W:
            return self.xp.ascontiguousarray(grad.reshape(W, S)[:, a:b])
        out = self.xp.zeros((W, b - a), grad.dtype)
        out[:full_rows] = grad[:full_rows * S].reshape(full_rows, S)[:, a:b]
        lo, hi = full_rows * S + a, min(full_rows * S + b, N)
        if hi > lo:
            out[full_rows, :hi - lo] = grad[lo:hi]
        return out

    def _store(self, bucket, reduced):
        """Columns [a, b) of this rank's reduced shard into its slice of flat_grad (clipped at
        the end of a short shard: the rest is padding)."""
        n = self.stop - self.start
        a, b = bucket.col_start, min(bucket.col_stop, n)
        if b > a:
            self.model.flat_grad[self.start + a:self.start + b] = reduced.reshape(-1)[:b - a]

    def grad_shard(self):
        """This rank's reduced gradient, a 1-D view of length stop - start (after a
        synchronized backward: the group average). Local."""
        if self.provider is not None:
            return self.provider.grad
        return self.model.flat_grad[self.start:self.stop]

    # -- optimizer step ---------------------------------------------------------------------
    def grad_norm(self):
        """Global L2 norm of the reduced gradient: one all_reduce of the shards' squared norms
        (float64). Collective."""
        sq = np.array([grad_norm_sq(self.grad_shard())], np.float64)
        if self.group.world_size > 1:
            self.group.all_reduce(sq, op="sum")
        return math.sqrt(sq[0])

    def step(self, lr=None, max_grad_norm=None, total_norm=None):
        """Clip (optional), step the sharded optimizer, all_gather the parameters, zero grads.

        lr: this step's learning rate (None: the optimizer's). max_grad_norm: clip the global
        gradient norm to it (as torch's clip_grad_norm_); total_norm: that norm if already
        computed with grad_norm() (saves the all_reduce). Returns the global norm before clipping
        when max_grad_norm is set, else None. Refuses (RtxmpiError, on every rank, before any
        collective) unless the last backward since the last step ran outside no_sync
        (rtxmpi.parallel.data.check_synced_step). Collective.
        """
        self.check_step()
        grad = self.grad_shard()
        if self._host_grad is not None:
            copy_to_host(grad, self._host_grad[:len(grad)])
            grad = self._host_grad
        norm = None
        if max_grad_norm is not None:
            norm = self.grad_norm() if total_norm is None else float(total_norm)
            clip_grad_norm(grad, max_grad_norm, total_norm=norm)
        if self.store is not None:
            self._nvme_step(grad, lr)
        else:
            self.optimizer.step(grad, lr=lr)
        self._gather_params()
        self.zero_grad()
        return norm

    def _gather_params(self):
        """Every rank's updated shard into every rank's model.flat_data (stage 3: only the
        offloaded master into the shard; units are gathered when used). Collective (stage < 3)."""
        if self.provider is not None:
            if self.offload == "cpu":  # nvme: the chunks were copied in as they were updated
                shard = self.provider.shard
                shard[...] = self.xp.asarray(self._master, dtype=shard.dtype)
            return
        flat = self.model.flat_data
        if self.offload == "cpu":  # otherwise already in the model's shard
            flat[self.start:self.stop] = self.xp.asarray(self._master, dtype=flat.dtype)
        if self.group.world_size == 1:
            return
        flat[...] = gather_shards(self.group, flat[self.start:self.stop], self.numel,
                                  send=self._send if len(self._send) else None)

    def zero_grad(self):
        """Drop the accumulated gradients without stepping (e.g. an agreed overflow skip). Local."""
        self.model.zero_grad()
        if self.provider is not None:
            self.provider.grad.fill(0)
        self._averaged = False
        self._synced = False

    def check_step(self):
        """Raise RtxmpiError unless the last backward since the last step was synchronized
        (outside no_sync): rtxmpi.parallel.data.check_synced_step. Local."""
        check_synced_step(self._synced)

    def full_params(self):
        """The whole flat parameter vector (a new array, model dtype) on every rank: at stage 3
        an all_gather of the shards, otherwise a copy of model.flat_data. Collective at stage 3;
        call it on every rank at every stage."""
        if self.provider is not None:
            return self.provider.full()
        return self.model.flat_data.copy()

    # -- uneven data ---------------------------------------------------------------------------
    def join(self, batches):
        """Iterate `batches` while EVERY rank still has one; all ranks stop at the same step
        (rtxmpi.control.join_batches). Collective."""
        return join_batches(self.group, batches)

    # -- checkpoint shards ---------------------------------------------------------------------
    def shards(self):
        """What a checkpoint writer needs from this rank: name -> (local 1-D array,
        global_offset, global_size).

        "params" (the master parameters: the model's shard, or the offloaded copy), "adam.m",
        "adam.v" (this rank's [start, stop) of N), "adam.step" (int64, global size 1, held by
        rank 0 under the same layout). Arrays are the live buffers: copy to keep (offload="nvme":
        np.memmap views of the offload files). Local.
        """
        step_start, step_stop = shard_range(1, self.group.world_size, self.group.rank)
        if self.store is not None:
            state = {"step": self.optimizer.step_count, "m": self.store.array("adam.m"),
                     "v": self.store.array("adam.v")}
            master = self.store.array("params")
        else:
            state, master = self.optimizer.state_dict(), self._master
        steps = np.full(step_stop - step_start, state["step"], np.int64)
        return {"params": (master, self.start, self.numel),
                "adam.m": (state["m"], self.start, self.numel),
                "adam.v": (state["v"], self.start, self.numel),
                "adam.step": (steps, step_start, 1)}

    def load_shards(self, read):
        """Load parameters and optimizer state written by shards() at any world size or stage.

        read: callable read(name, offset, length) -> 1-D array of the elements [offset,
        offset + length) of the global vector `name` (e.g. rtxmpi.checkpoint's reader). Reads only
        this rank's slice, then all_gathers the parameters; drops any accumulated gradients.
        Collective; read (when collective, as a Checkpoint's) is called the same number of times
        on every rank, also with offload="nvme" (chunk counts padded with empty reads). Raises
        CheckpointError when read returns the wrong length.
        """
        n = self.stop - self.start

        def fetch(name, offset, length):
            return read_range(read, name, offset, length)

        if self.store is not None:  # chunk by chunk into the files and the model's shard
            self._load_nvme(fetch, int(fetch("adam.step", 0, 1)[0]))
            self._gather_params()
            self.zero_grad()
            return
        self.optimizer.load_state_dict({"step": int(fetch("adam.step", 0, 1)[0]),
                                        "m": fetch("adam.m", self.start, n),
                                        "v": fetch("adam.v", self.start, n)})
        params = fetch("params", self.start, n)
        self._master[...] = _to_host(params) if self.offload else self.xp.asarray(params)
        self._gather_params()
        self.zero_grad()

    def _load_nvme(self, fetch, step):
        if step < 0:
            raise CheckpointError(f"optimizer state step must be >= 0, got {step}")
        target = (self.provider.shard if self.provider is not None
                  else self.model.flat_data[self.start:self.stop])

        def fill(lo, hi):
            values = {name: _to_host(fetch(name, self.start + lo, hi - lo))
                      for name in NVME_TENSORS}
            target[lo:hi] = self.xp.asarray(values["params"], dtype=target.dtype)
            return values

        self.store.write_chunks(fill)
        # read() is collective (it agrees on errors): a rank whose shard has fewer chunks (shards
        # differ by an element, or are empty) pads with empty reads, so the calls pair up
        rounds = np.array([self.store.num_chunks], np.int64)
        if self.group.world_size > 1:
            self.group.all_reduce(rounds, op="max")
        for _ in range(int(rounds[0]) - self.store.num_chunks):
            for name in NVME_TENSORS:
                fetch(name, self.start, 0)
        self.optimizer.step_count = step

    # -- memory accounting ---------------------------------------------------------------------
    def memory_bytes(self):
        """Bytes this rank holds: {"params", "grads", "optimizer", "total"}.

        params: the model's full flat_data (stage 3: only this rank's shard), plus the master copy
        when offloaded, plus the padded all_gather send buffer on a rank whose shard is short
        (stages 1, 2); grads: the full flat_grad (backward writes into it; stage 2 keeps the
        reduced shard in this rank's slice of it; stage 3: only the reduced shard), plus the host
        copy of the shard when offloaded; optimizer: every state array of the sharded optimizer
        (m, v, decay mask, scratch). Transient buffers (the W*S all_gather result, stage-2
        packed buckets, stage-3 gathered units and unit gradients: see provider.peak_bytes) are
        not counted. offload="nvme": optimizer is the most bytes of chunk buffers in memory at
        once (offload_max_chunks chunks of master parameters, m and v) plus the optimizer's
        scratch, and two more keys give the bytes in files: "params_on_disk" (master
        parameters), "optimizer_on_disk" (m, v); total counts memory only. Local.
        """
        model = self.model
        if self.provider is not None:
            params, grads = self.provider.shard.nbytes, self.provider.grad.nbytes
        else:
            params = model.flat_data.nbytes + self._send.nbytes
            grads = model.flat_grad.nbytes
        if self.offload == "cpu":
            params += self._master.nbytes
        if self._host_grad is not None:
            grads += self._host_grad.nbytes
        optimizer = optimizer_bytes(self.optimizer)
        out = {"params": int(params), "grads": int(grads)}
        if self.store is not None:
            optimizer += self.store.memory_bound_bytes()
            tensor_bytes = self.store.disk_bytes() // len(NVME_TENSORS)
            out.update(params_on_disk=int(tensor_bytes), optimizer_on_disk=int(2 * tensor_bytes))
        out.update(optimizer=int(optimizer), total=int(params + grads + optimizer))
        return out
