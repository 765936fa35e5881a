"""ZeRO stages 1, 2 and 3 inside a pipeline stage: the stage's optimizer state (stage 1), reduced
gradient (stage 2) and parameters (stage 3) sharded over the stage's replica group.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, as Megatron-LM's distributed optimizer and DeepSpeed run it under pipeline
parallelism, and torchtitan's FSDP + PP for stage 3: each stage shards only its own parameters,
over the ranks that hold the same stage (its dp ranks, and its sp ranks under Ulysses: the
engine's replica group, mesh.loss_group), never across stages or across tp.

Shard layout: rtxmpi.parallel.zero's, on the stage's flat vector (num_params elements: its range
of the model, then the copies of tied parameters it uses, e.g. the wte on the last stage with
tied embeddings): replica rank r owns [min(r*S, N), min((r+1)*S, N)), S = ceil(N / W).

Stage 1: the gradient is averaged over the group as without ZeRO (bucketed all_reduce, overlapped
with the stage's last backward); AdamW exists only for this rank's shard (m and v are 1/W of the
stage's), updates its slice of the parameters in place, and the updated slices are all-gathered.
Stage 2: after the schedule, the stage's gradient is reduce-scattered instead (half the bytes of an
all_reduce): each rank receives the group average of only its shard and zeroes the rest. The
pipeline accumulates every micro-batch into the stage's gradient before it is reduced, so the
whole gradient buffer stays (as in DeepSpeed, where ZeRO-2 and pipeline accumulation do not mix;
here stage 2 saves communication and keeps stage 1's memory).
Stage 3: the stage keeps only its shard of the parameters and of the reduced gradient; its units
take their parameters from a rtxmpi.parallel.zero.ShardedParams provider over the stage's slots
(one per unit with parameters, one per tied copy: PipelineStage.use_provider). For every
micro-batch a unit's parameters are gathered just before its forward and again before its
backward (also before a recomputed unit's rerun), the next unit of the same pass prefetched, and
freed after; each backward reduce_scatters a unit's gradient into its owners' shards once it is
final, and completes every reduction before the stage's next pipeline message. After the
schedule the tied copies' gradients are summed over their group (each a gather of the
parameter's range over the replicas, transiently) and the shard averaged. Per micro-batch
traffic: 2 gathers of the stage's parameters (a recomputed unit reruns on backward's gather) and
one reduce_scatter of its gradient, against stage 2's one reduce_scatter per step: memory for
communication.
Interleaved 1F1B: a rank's chunks share one provider over all their slots (ChunkedStage).
Not offered: offload; stage 3 with tensor- or sequence-parallel stages (refused by
rtxmpi.parallel.layout.Layout: a TensorParallelStage keeps its model's layout for tp gathers).

Gradient norm (clipping): each rank's shard, only the stage's own range (the wte copy is counted
on the first stage), tensor-split parameters on every tp rank and replicated ones on tp rank 0,
summed over the replica group and tp; the engine sums the stages.
"""
import numpy as np

from ..errors import ConfigError
from ..nn import grad_norm_sq
from . import tensor as tpl
from .layout import PIPELINE_ZERO_STAGES
from .zero import (ShardedParams, gather_range, gather_shards, optimizer_bytes, shard_decay_mask,
                   shard_range, shard_size)

STAGES = PIPELINE_ZERO_STAGES[1:]  # the sharded ones


class _Solo:
    """The replica group of a stage without data parallelism (ShardedParams never calls it)."""

    world_size, rank = 1, 0


class _Slots:
    """A stage as ShardedParams reads a model: its params (offsets in the stage vector) and
    its slots as parameter-index ranges."""

    def __init__(self, st):
        self.params = st.params
        self.units = [(ks[0], ks[-1] + 1) for ks in st.slot_params]


class StageZero:
    """ZeRO stage 1, 2 or 3 for one pipeline stage (rtxmpi.parallel.pipeline.PipelineStage,
    TensorParallelStage or ChunkedStage at stages 1 and 2: `replicated` flags its own parameters,
    the tied copies follow them; a PipelineStage or ChunkedStage at stage 3) over its replica
    `group` (None: a single replica).

    make_optimizer: callable (params_shard, decay_mask_shard) -> AdamW-like optimizer over this
    rank's slice of the stage's flat vector (updated in place: stage.flat_data's slice, or at
    stage 3 the provider's shard). Attributes: zero_stage, start, stop (this rank's shard of the
    stage's flat vector), optimizer, provider (stage 3: the ShardedParams the stage's units take
    their parameters from; else None). Collective methods: every rank of `group` (and of the
    stage's tp group) calls them in the same order.
    Raises ConfigError for a stage other than 1, 2 or 3, or stage 3 on a tensor-parallel stage
    (its use_provider refuses).
    """

    def __init__(self, stage, group, zero_stage, make_optimizer):
        if zero_stage not in STAGES:
            raise ConfigError(f"ZeRO under pipeline parallelism supports stages {STAGES}, got "
                              f"{zero_stage!r}")
        self.st, self.group, self.zero_stage = stage, group, zero_stage
        st = stage
        self.numel = st.num_params
        W, r = (1, 0) if group is None else (group.world_size, group.rank)
        self.world = W
        self.start, self.stop = shard_range(self.numel, W, r)
        self.counts = [hi - lo for lo, hi in (shard_range(self.numel, W, k) for k in range(W))]
        self.shard_size = shard_size(self.numel, W)
        mask = shard_decay_mask(st.params, self.start, self.stop, xp=st.xp, dtype=st.dtype)
        self.provider = None
        if zero_stage == 3:  # keep only the shard; the stage's full buffers go
            self.provider = ShardedParams(_Slots(st), group if group is not None else _Solo(),
                                          st.flat_data[self.start:self.stop].copy())
            st.use_provider(self.provider)
            self.optimizer = make_optimizer(self.provider.shard, mask)
        else:
            self.optimizer = make_optimizer(st.flat_data[self.start:self.stop], mask)
        # parts of the shard the gradient norm counts (relative to start)
        own = st.params[:len(st.replicated)]  # the copies are counted on their owner's stage
        self._norm_ranges = tpl.norm_ranges(own, st.tp_rank, self.start, self.stop,
                                            replicated=st.replicated)

    def grad_shard(self):
        """This rank's slice of the stage's gradient (a view; stage 3: the provider's)."""
        if self.provider is not None:
            return self.provider.grad
        return self.st.flat_grad[self.start:self.stop]

    def finish_step(self, tied):
        """Stage 3, after the schedule (every backward has reduced its units into the shards,
        as sums): each tied parameter's gradient (tied: the engine's [(index, group, Param)])
        gathered over the replica group, summed over its tied group and put back into the
        shard; then the shard averaged over the replicas. Collective on the group and on each
        tied group, in order."""
        grad = self.provider.grad
        for k, group, _ in tied:
            lo, hi = self.st.vector_range(k)
            whole = gather_range(self.group if self.world > 1 else None, grad, self.numel, lo, hi)
            group.all_reduce(whole, op="sum")
            a, b = max(lo, self.start), min(hi, self.stop)
            if b > a:
                grad[a - self.start:b - self.start] = whole[a - lo:b - lo]
        if self.world > 1:
            grad *= grad.dtype.type(1.0 / self.world)

    def reduce_scatter(self):
        """Stage 2, after the schedule: the group average of this rank's shard of the stage's
        gradient, in place; the rest of the buffer is zeroed. Collective on the group."""
        grad = self.st.flat_grad
        if self.world > 1:
            shard = self.group.reduce_scatter(grad, op="avg", counts=self.counts)
            grad[self.start:self.stop] = shard
        grad[:self.start] = 0
        grad[self.stop:] = 0

    def grad_norm_sq(self):
        """Squared L2 norm of the stage's reduced gradient (its own range, the wte copy not
        counted). Collective on the group and the stage's tp group; the same on their ranks."""
        grad = self.grad_shard()
        sq = np.array([sum(grad_norm_sq(grad[lo:hi]) for lo, hi in self._norm_ranges)],
                      np.float64)
        if self.world > 1:
            self.group.all_reduce(sq, op="sum")
        if self.st.tp > 1:
            self.st.tp_group.all_reduce(sq, op="sum")
        return float(sq[0])

    def step(self, lr=None):
        """The optimizer on this rank's shard, then (stages 1, 2) the updated shards
        all-gathered into every rank's stage.flat_data; at stage 3 units are gathered when used.
        Collective on the group (stages 1, 2; local at stage 3)."""
        self.optimizer.step(self.grad_shard(), lr=lr)
        if self.world > 1 and self.provider is None:
            self.st.flat_data[...] = self.gather(self.st.flat_data[self.start:self.stop])

    def stage_vector(self):
        """The stage's whole parameter vector (num_params): stage.flat_data, or at stage 3 a new
        array gathered from the shards (transiently the whole stage). Collective on the group
        at stage 3."""
        if self.provider is None:
            return self.st.flat_data
        return self.gather(self.provider.shard)

    def load_params(self, values):
        """Set the stage's parameters from its whole vector `values` (num_params): this rank's
        slice at stage 3, all of flat_data otherwise. Local."""
        if self.provider is None:
            self.st.flat_data[...] = values
        else:
            self.provider.shard[...] = values[self.start:self.stop]

    def memory_bytes(self):
        """{"params", "grads", "optimizer", "total"}: bytes of the stage's model state this rank
        holds: the whole stage's parameters and gradients (stage 3: only the shards) and the
        sharded optimizer's arrays. Gathered units and unit gradients are transient and not
        counted (provider.peak_bytes). Local."""
        if self.provider is not None:
            params, grads = self.provider.shard.nbytes, self.provider.grad.nbytes
        else:
            params, grads = self.st.flat_data.nbytes, self.st.flat_grad.nbytes
        optimizer = optimizer_bytes(self.optimizer)
        return {"params": int(params), "grads": int(grads), "optimizer": int(optimizer),
                "total": int(params + grads + optimizer)}

    def gather(self, shard):
        """The whole stage vector (numel) from every rank's shard: rank k's shard lands at
        k * S, so the padded all_gather's first numel elements are the vector. Collective on the
        group."""
        return gather_shards(self.group if self.world > 1 else None, shard, self.numel)

    def full_state(self):
        """{"step", "m", "v"}: the optimizer state of the whole stage vector (gathered over the
        group: transiently a whole stage's m and v). Collective on the group."""
        state = self.optimizer.state_dict()
        return {"step": state["step"], "m": self.gather(state["m"]), "v": self.gather(state["v"])}

    def load_full_state(self, state):
        """Load {"step", "m", "v"} given for the whole stage vector: keeps this rank's slice.
        Local."""
        self.optimizer.load_state_dict({"step": state["step"],
                                        "m": state["m"][self.start:self.stop],
                                        "v": state["v"][self.start:self.stop]})

