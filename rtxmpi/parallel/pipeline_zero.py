"""ZeRO stages 1 and 2 inside a pipeline stage: the stage's optimizer state (stage 1) and reduced
gradient (stage 2) sharded over the stage's replica group.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, as Megatron-LM's distributed optimizer and DeepSpeed run it under pipeline
parallelism: each stage shards only its own parameters, over the ranks that hold the same stage
(its dp ranks, and its sp ranks under Ulysses: the engine's replica group, mesh.loss_group), never
across stages or across tp.

Shard layout: rtxmpi.parallel.zero's, on the stage's flat vector (num_params elements: its range
of the model, then the wte copy on the last stage with tied embeddings): replica rank r owns
[min(r*S, N), min((r+1)*S, N)), S = ceil(N / W).

Stage 1: the gradient is averaged over the group as without ZeRO (bucketed all_reduce, overlapped
with the stage's last backward); AdamW exists only for this rank's shard (m and v are 1/W of the
stage's), updates its slice of the parameters in place, and the updated slices are all-gathered.
Stage 2: after the schedule, the stage's gradient is reduce-scattered instead (half the bytes of an
all_reduce): each rank receives the group average of only its shard and zeroes the rest. The
pipeline accumulates every micro-batch into the stage's gradient before it is reduced, so the
whole gradient buffer stays (as in DeepSpeed, where ZeRO-2 and pipeline accumulation do not mix;
here stage 2 saves communication and keeps stage 1's memory). Not offered: stage 3 (a stage's
parameters are needed by every micro-batch of the schedule) and offload.

Gradient norm (clipping): each rank's shard, only the stage's own range (the wte copy is counted
on the first stage), tensor-split parameters on every tp rank and replicated ones on tp rank 0,
summed over the replica group and tp; the engine sums the stages.
"""
import numpy as np

from ..errors import ConfigError
from ..nn import grad_norm_sq
from . import tensor as tpl
from .layout import PIPELINE_ZERO_STAGES
from .zero import gather_shards, shard_decay_mask, shard_range, shard_size

STAGES = PIPELINE_ZERO_STAGES[1:]  # the sharded ones


class StageZero:
    """ZeRO stage 1 or 2 for one pipeline stage (rtxmpi.parallel.pipeline.PipelineStage,
    TensorParallelStage or ChunkedStage: `replicated` flags its own parameters, the tied copies
    follow them) over its replica `group` (None: a single replica).

    make_optimizer: callable (params_shard, decay_mask_shard) -> AdamW-like optimizer over this
    rank's slice of stage.flat_data (updated in place). Attributes: zero_stage, start, stop (this
    rank's shard of the stage's flat vector), optimizer. Collective methods: every rank of `group`
    (and of the stage's tp group) calls them in the same order.
    Raises ConfigError for a stage other than 1 or 2.
    """

    def __init__(self, stage, group, zero_stage, make_optimizer):
        if zero_stage not in STAGES:
            raise ConfigError(f"ZeRO under pipeline parallelism supports stages {STAGES}, got "
                              f"{zero_stage!r}: stage 3 would gather every stage's parameters for "
                              "each micro-batch; use --zero-stage 1 or 2 with --pp")
        self.st, self.group, self.zero_stage = stage, group, zero_stage
        st = stage
        self.numel = st.num_params
        W, r = (1, 0) if group is None else (group.world_size, group.rank)
        self.world = W
        self.start, self.stop = shard_range(self.numel, W, r)
        self.counts = [hi - lo for lo, hi in (shard_range(self.numel, W, k) for k in range(W))]
        self.shard_size = shard_size(self.numel, W)
        mask = shard_decay_mask(st.params, self.start, self.stop, xp=st.xp, dtype=st.dtype)
        self.optimizer = make_optimizer(st.flat_data[self.start:self.stop], mask)
        # parts of the shard the gradient norm counts (relative to start)
        own = st.params[:len(st.replicated)]  # the copies are counted on their owner's stage
        self._norm_ranges = tpl.norm_ranges(own, st.tp_rank, self.start, self.stop,
                                            replicated=st.replicated)

    def grad_shard(self):
        """This rank's slice of the stage's gradient (a view)."""
        return self.st.flat_grad[self.start:self.stop]

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
        """The optimizer on this rank's shard, then the updated shards all-gathered into every
        rank's stage.flat_data. Collective on the group."""
        self.optimizer.step(self.grad_shard(), lr=lr)
        if self.world > 1:
            self.st.flat_data[...] = self.gather(self.st.flat_data[self.start:self.stop])

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

