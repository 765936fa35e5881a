"""Data parallelism: bucketed gradient all_reduce that overlaps backward.

Source: PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020) and Horovod tensor fusion
(Sergeev & Del Balso, 2018). The model keeps every gradient in one flat buffer in parameter-index
order, so a bucket is a contiguous slice of that buffer: gradients are written straight into the
bucket (no copy). Buckets are fixed by parameter index (identical on every rank, never by arrival
order). Backward produces gradients from the last parameter to the first; when every parameter of
a bucket is final, its all_reduce starts asynchronously while backward goes on. The bucket that
completes last has nothing left to overlap with and is reduced with the blocking (faster) call.
After all buckets: the epilogue (`rtxmpi.kernels.grad_epilogue`) scales by 1/world_size (the
average) and flags non-finite values (`DataParallel.nonfinite`).

Uneven batches: when the global batch does not divide by the data-parallel size (8 samples over 3
ranks: 3, 3, 2; `rtxmpi.data.batch_split`), a plain average of the ranks' mean-loss gradients
would weight a sample on a smaller rank more. `grad_scale` / `weighted_micro_batches` give each
(micro-)batch the backward scale samples * dp / global_batch, so that the summed-then-averaged
gradient is exactly the mean over the global batch (each rank's loss is scaled by its share of
the samples before the average; docs/parallel.md).
"""
from contextlib import contextmanager

import numpy as np

from ..control import join_batches, raise_if_any_failed
from ..data import even_split, micro_batch_split
from ..errors import ConfigError, RtxmpiError
from ..kernels import grad_epilogue

DEFAULT_BUCKET_BYTES = 25 * 2**20


def check_batch_on_every_rank(group, model, idx, targets, what="data-parallel batch check"):
    """Check this rank's batch with `model.check_tokens(idx, targets)` (shape, dtype, length,
    token ids; rtxmpi.nn.GPT) and agree on the verdict over `group`, so that a bad batch on one
    rank raises on every rank before any of them enters the step's collectives. A model without
    check_tokens is not checked here (its forward validates). Collective: every rank of `group`
    calls it once per forward (one 1-byte MAX all_reduce). Raises ConfigError on every rank,
    naming each offending rank (world rank) and its error (rtxmpi.control.raise_if_any_failed).
    """
    error, check = None, getattr(model, "check_tokens", None)
    try:
        if check is not None:
            check(idx, targets)
    except ConfigError as exc:
        error = exc
    raise_if_any_failed(group, error, what)


def grad_scale(samples, global_batch, dp_size):
    """Backward scale for a (micro-)batch of `samples` samples whose loss is the mean over them.

    For an engine that sums gradients over dp_size ranks and divides by dp_size (DataParallel,
    ZeroDataParallel, HybridParallel), backward(cache, scale=grad_scale(...)) on every
    micro-batch of every rank makes the reduced gradient the mean over all `global_batch`
    samples, however they are split over ranks and micro-batches: samples * dp_size /
    global_batch (a ratio of ints, correctly rounded; with an even split into k micro-batches
    exactly 1.0 / k). Local.
    """
    return samples * dp_size / global_batch


def weighted_micro_batches(x, y, micro_batches, global_batch, dp_size):
    """Split this rank's batch into micro-batches, each weighted by its samples.

    x, y: (b, T) this rank's samples of a global batch of `global_batch` samples over `dp_size`
    data-parallel ranks (b = rtxmpi.data.batch_split(global_batch, dp_size)[dp_rank]; it may
    differ between ranks). Yields `micro_batches` tuples (x_m, y_m, scale, weight): x_m, y_m are
    contiguous rows split by rtxmpi.data.even_split (sizes differ by at most one, the first ones
    larger: the rule rtxmpi.data.micro_batch_split states), scale = grad_scale(len(x_m), global_batch,
    dp_size) is the backward scale, and weight = scale * micro_batches (computed exactly, as a
    ratio of ints) weights the micro-batch's mean loss: sum_m weight * loss_m / micro_batches,
    averaged over the dp ranks, is the mean loss over the global batch. With an even split
    (global_batch = dp_size * micro_batches * n) scale = 1.0 / micro_batches and weight = 1.0
    exactly, so the even case is the plain average bit for bit. Full global batches only (the
    weights assume `global_batch` samples in all). Local.
    Raises ConfigError when rtxmpi.data.micro_batch_split refuses the split (the smallest rank's
    batch, global_batch // dp_size, below micro_batches; global_batch < dp_size), decided from
    shared values, so on every rank alike.
    """
    micro_batch_split(global_batch, dp_size, micro_batches)  # the rule; raises ConfigError
    start = 0
    for n in even_split(len(x), micro_batches):
        x_m, y_m, start = x[start:start + n], y[start:start + n], start + n
        yield (x_m, y_m, grad_scale(n, global_batch, dp_size),
               n * dp_size * micro_batches / global_batch)


class Bucket:
    """Parameters [first, last] (inclusive, by index) and their flat-gradient slice [start, stop)
    (element offsets into model.flat_grad). index: position in launch order. pending: parameters
    of this bucket whose gradient is not final yet in the current backward (set to num_params
    when the backward starts; the all_reduce launches at 0). work: the async all_reduce's Work
    handle while it is in flight, else None."""

    __slots__ = ("index", "first", "last", "start", "stop", "pending", "work")

    def __init__(self, index, first, last, start, stop):
        self.index, self.first, self.last, self.start, self.stop = index, first, last, start, stop
        self.pending = 0
        self.work = None

    @property
    def num_params(self):
        return self.last - self.first + 1


def build_buckets(params, bucket_bytes, itemsize):
    """Split parameters into contiguous buckets of about `bucket_bytes`, filled from the last index.

    params: sequence of objects with `.offset` and `.size` (elements), contiguous in index order.
    bucket_bytes: target bucket size in bytes (> 0); itemsize: bytes per gradient element.
    Returns buckets in launch order (highest parameter indices first): a bucket closes once its
    parameters reach bucket_bytes, so a single parameter larger than bucket_bytes gets a bucket of
    its own. Local (pure): every rank computes the same buckets from the same parameters.
    """
    buckets, last, size = [], len(params) - 1, 0
    for i in range(len(params) - 1, -1, -1):
        size += params[i].size * itemsize
        if size >= bucket_bytes or i == 0:
            start = params[i].offset
            stop = params[last].offset + params[last].size
            buckets.append(Bucket(len(buckets), i, last, start, stop))
            last, size = i - 1, 0
    return buckets


class BucketReducer:
    """The bucket engine: launches each bucket's reduction over `group` as soon as every unit of
    it is final during a backward, and completes the rest after it (PyTorch DDP's reducer, Li et
    al., VLDB 2020). Used by DataParallel (units = parameters) and by each pipeline stage's dp
    replicas (units = the stage's units; rtxmpi.parallel.pipeline.PipelineParallel).

    buckets: from build_buckets (launch order; first/last are unit indices, start/stop element
    offsets into grad). n_units: number of units (every unit lies in exactly one bucket).
    grad: the 1-D contiguous gradient buffer; each bucket's slice grad[start:stop] is reduced in
    place. group: the ProcessGroup to reduce over. op: the all_reduce op ("sum": the caller
    applies its epilogue after finish(); "avg"). block_last: leave the bucket completed by the
    backward's last unit to finish(), which reduces it with the blocking (faster) call: nothing
    is left to overlap with it (DataParallel); False launches every bucket asynchronously as it
    completes (the pipeline: sends and deferred weight gradients still follow its backward).

    Attributes: launched (buckets launched asynchronously since the last arm()), reported (units
    reported since the last arm()).

    Collective: every rank of `group` arms, reports and finishes the same buckets; launch order
    is fixed by unit index, never by arrival order, so the collectives match on every rank.
    """

    def __init__(self, buckets, n_units, grad, group, op="sum", block_last=True):
        self.buckets, self.n_units, self.grad, self.group = buckets, n_units, grad, group
        self.op, self.block_last = op, bool(block_last)
        self._bucket_of = np.empty(n_units, np.int64)
        for b in buckets:
            self._bucket_of[b.first:b.last + 1] = b.index
        self.armed, self.launched, self.reported = False, 0, 0

    def arm(self):
        """Start a backward: every bucket waits for all of its units again. Local."""
        for b in self.buckets:
            b.pending, b.work = b.num_params, None
        self.armed, self.launched, self.reported = True, 0, 0

    def ready(self, u):
        """Unit u's gradient (an int index; its elements lie in its bucket's slice of grad) is final
        for this backward; called once per unit between arm() and finish().

        When the last pending unit of a bucket arrives its all_reduce starts asynchronously
        (except, with block_last, when u is the backward's last unit), and every bucket in flight
        is polled (Work.test) so it progresses while backward computes. Collective (async
        all_reduce on the group); raises RtxmpiError when u is reported again after its bucket
        was launched (a model or stage bug: the reduction would miss part of the gradient),
        CollectiveTimeout through the polled Work, CollectiveMismatch in checking mode."""
        bucket = self.buckets[self._bucket_of[u]]
        if bucket.pending == 0:
            raise RtxmpiError(f"unit {u} reported ready again after its bucket {bucket.index} "
                              f"was launched; every unit must report exactly once per backward")
        self.reported += 1
        bucket.pending -= 1
        if bucket.pending == 0 and not (self.block_last and self.reported == self.n_units):
            bucket.work = self.group.all_reduce(self._view(bucket), op=self.op, async_op=True)
            self.launched += 1
        for b in self.buckets:  # let in-flight reductions progress while backward computes
            if b.work is not None:
                b.work.test()

    def _view(self, bucket):
        """The bucket's slice of grad: a 1-D contiguous view, reduced in place."""
        return self.grad[bucket.start:bucket.stop]

    def finish(self):
        """After the backward: reduce the buckets not launched (blocking; all of them when not
        armed), then wait for the launched ones; grad then holds the reduction. Collective on
        the group; raises RtxmpiError (before any collective) when an armed backward reported
        fewer than n_units units, CollectiveTimeout when a rank does not join in time."""
        if self.armed and self.reported != self.n_units:
            self.armed = False
            raise RtxmpiError(f"backward reported {self.reported} of {self.n_units} unit "
                              "gradients; every unit must report exactly once")
        self.armed = False
        for b in self.buckets:  # launch order: the one completed last (no work yet) is blocking
            if b.work is None:
                self.group.all_reduce(self._view(b), op=self.op)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None


def check_synced_step(synced):
    """Refuse a step whose gradients the replicas may not share: raise RtxmpiError unless the
    last backward since the last step ran outside no_sync (synced). A backward under no_sync
    after a synchronized one adds a local gradient that never reaches the other replicas, so
    stepping would apply a different update on each.

    Local, with the same verdict on every rank of an SPMD program: it depends only on the order
    of the backward/no_sync/step calls, which every rank makes alike (a rank that does otherwise
    is caught by its collectives' deadline, or by checking mode).
    """
    if not synced:
        raise RtxmpiError("step() needs a synchronized backward last: no backward since the last "
                          "step, or the last one ran under no_sync() and its gradient never "
                          "reached the other replicas; run the last micro-batch's backward "
                          "outside no_sync() (or zero_grad() to drop the gradients)")


class DataParallel:
    """Wrap a model for data-parallel training over `group`.

    model: an object with `params` (each with `.offset`, `.size`), `flat_data` and `flat_grad`
    (1-D contiguous arrays, parameter-index order), `forward(idx, targets) -> (loss, cache)` and
    `backward(cache, scale=1.0, grad_ready=None)` that adds into flat_grad (rtxmpi.nn.GPT).
    group: the data-parallel ProcessGroup. bucket_bytes: target bucket size in bytes (25 MiB).
    Parameters are broadcast from group rank 0 when wrapped, so every replica starts identical.

    Attributes: buckets (list of Bucket, launch order, the same on every rank); nonfinite: None
    until a synchronized backward on more than one rank, then a 0-d bool array (the model's
    array module: numpy, or cupy without a device sync) that is True when an averaged gradient
    holds inf or NaN; identical on every rank, so a branch on it is agreed (read it with
    bool(); rtxmpi.kernels.grad_epilogue computes it).

    Collective: every rank of `group` must construct it, and call forward/backward/step the same
    number of times in the same order. Raises ConfigError (bucket_bytes <= 0).
    """

    def __init__(self, model, group, bucket_bytes=DEFAULT_BUCKET_BYTES, broadcast_params=True):
        if not bucket_bytes > 0:
            raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.model, self.group = model, group
        self.bucket_bytes = int(bucket_bytes)
        self.buckets = build_buckets(model.params, self.bucket_bytes, model.flat_grad.itemsize)
        self.reducer = BucketReducer(self.buckets, len(model.params), model.flat_grad, group)
        self._sync = True
        self._synced = False  # the last backward since the last step ran outside no_sync
        # after a synchronized multi-rank backward: 0-d bool array, True when an averaged
        # gradient is inf or NaN (identical on every rank, as the gradients are); else None
        self.nonfinite = None
        if broadcast_params and group.world_size > 1:
            group.broadcast(model.flat_data, src=0)

    # -- forward / backward -----------------------------------------------------------------
    def forward(self, idx, targets=None):
        """The wrapped model's forward: (loss, cache) for this rank's micro-batch.

        idx, targets: (B, T) integer token ids, this rank's samples. Collective (also inside
        no_sync): the batch is first checked on each rank and the verdict agreed over the group
        (check_batch_on_every_rank: one 1-byte all_reduce), so every rank calls forward the same
        number of times. Raises ConfigError on EVERY rank, naming each offending rank, when any
        rank's batch has a bad shape, dtype, length or token id.
        """
        check_batch_on_every_rank(self.group, self.model, idx, targets)
        return self.model.forward(idx, targets)

    @contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally without communicating (accumulation).

        The next backward outside no_sync reduces the accumulated sum; the last backward before
        step() must be that one (step refuses otherwise). Local: no collective in backward
        (forward still agrees on its batch check).
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def backward(self, cache, scale=1.0):
        """Backward of scale * loss; outside no_sync, also averages gradients over the group.

        After it returns (outside no_sync), model.flat_grad holds the group average of every rank's
        accumulated gradient. Collective outside no_sync (every rank of the group must call).
        """
        self._synced = False  # until this backward has completed
        if not self._sync or self.group.world_size == 1:
            self.model.backward(cache, scale=scale)
            self._synced = self._sync
            return
        self.reducer.arm()
        self.model.backward(cache, scale=scale, grad_ready=self.reducer.ready)
        self.reducer.finish()  # the bucket completed last is reduced blocking, then all awaited
        # the epilogue (rtxmpi.kernels; one fused pass on GPU): average, and flag inf/NaN
        _, self.nonfinite = grad_epilogue(self.model.flat_grad, 1.0 / self.group.world_size)
        self._synced = True

    # -- optimizer step ---------------------------------------------------------------------
    def step(self, optimizer, lr=None):
        """Apply `optimizer` (rtxmpi.nn.AdamW over model.flat_data) and zero the gradients.

        Refuses (RtxmpiError, check_step) unless the last backward since the last step ran
        outside no_sync. Local: no collective (the gradients are already identical on every rank).
        """
        self.check_step()
        optimizer.step(self.model.flat_grad, lr=lr)
        self.zero_grad()

    def zero_grad(self):
        """Drop the accumulated gradients without stepping (e.g. an agreed overflow skip). Local."""
        self.model.zero_grad()
        self._synced = False

    def check_step(self):
        """Raise RtxmpiError unless the last backward since the last step was synchronized
        (outside no_sync): check_synced_step. Local."""
        check_synced_step(self._synced)

    # -- uneven data ---------------------------------------------------------------------------
    def join(self, batches):
        """Iterate `batches` while EVERY rank still has one; all ranks stop at the same step
        (rtxmpi.control.join_batches). Collective."""
        return join_batches(self.group, batches)
