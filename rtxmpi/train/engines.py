"""The engine of any layout behind one set of calls, for any Model.

build_engine: the data-parallel engine of a ZeRO stage. Stage 0 is Replicated (DataParallel with a
whole optimizer on every rank), stages 1-3 ZeroDataParallel; both offer grad_norm, step(lr,
max_grad_norm, total_norm), shards, load_shards and full_params, so the training loop and the
checkpoint format are the same at every stage.

build_parallel: the engine of any Layout (dp, ZeRO 0-3 and offload, tp/sp, pp, recompute) from a
factory of the one-process Model, checked first, with what rtxmpi.train.Parts needs of it.
"""
import math
from dataclasses import dataclass

import numpy as np

from rtxmpi.checkpoint import Shard
from rtxmpi.nn import clip_grad_norm, decay_mask, grad_norm_sq
from rtxmpi.parallel.data import DEFAULT_BUCKET_BYTES, DataParallel
from rtxmpi.parallel.hybrid import build_hybrid
from rtxmpi.parallel.parallelize import TensorParallelModel
from rtxmpi.parallel.pipeline import build_pipeline
from rtxmpi.parallel.zero import ZeroDataParallel
from rtxmpi.train.task import Parts


class Replicated:
    """ZeRO stage 0: DataParallel with a whole optimizer on every rank, behind the calls of
    ZeroDataParallel. model: a Model; world: the data-parallel group; bucket_bytes: gradient
    bucket size; optimizer(params, decay_mask) -> an optimizer (e.g. rtxmpi.nn.AdamW)."""

    def __init__(self, model, world, bucket_bytes, optimizer):
        self.model, self.group = model, world
        self.ddp = DataParallel(model, world, bucket_bytes=bucket_bytes)
        self.optimizer = optimizer(model.flat_data, decay_mask(model.params))
        self.forward, self.backward, self.no_sync = self.ddp.forward, self.ddp.backward, self.ddp.no_sync
        self.zero_grad = self.ddp.zero_grad

    def grad_norm(self):
        return math.sqrt(grad_norm_sq(self.model.flat_grad))  # averaged: identical on every rank

    def full_params(self):
        return self.model.flat_data

    def step(self, lr=None, max_grad_norm=None, total_norm=None):
        self.ddp.check_step()  # before clipping: a refused step leaves the gradient as it was
        if max_grad_norm is not None:
            clip_grad_norm(self.model.flat_grad, max_grad_norm, total_norm=total_norm)
        self.ddp.step(self.optimizer, lr=lr)

    def shards(self):
        """Each rank writes an even 1/world_size of every replicated tensor (no duplicate bytes)."""
        r, n = self.group.rank, self.group.world_size
        shards = {name: Shard.even(full, r, n) for name, full in self.pieces().items()}
        return {name: (sh.data, sh.global_offset, sh.global_size) for name, sh in shards.items()}

    def pieces(self):
        """The full replicated tensors, by checkpoint name (also what a shrink hands over)."""
        state = self.optimizer.state_dict()
        return {"params": self.model.flat_data, "adam.m": state["m"], "adam.v": state["v"],
                "adam.step": np.array([state["step"]], np.int64)}

    def load_shards(self, read):
        n = self.model.flat_data.shape[0]
        self.optimizer.load_state_dict({"step": int(read("adam.step", 0, 1)[0]),
                                        "m": read("adam.m", 0, n), "v": read("adam.v", 0, n)})
        flat = self.model.flat_data
        flat[...] = self.model.xp.asarray(read("params", 0, n), dtype=flat.dtype)  # cupy: to device
        self.ddp.zero_grad()


def build_engine(model, world, *, zero_stage, optimizer, bucket_bytes=DEFAULT_BUCKET_BYTES, offload=None,
                 offload_dir=None):
    """The data-parallel engine of `zero_stage` over `world`: Replicated (0) or ZeroDataParallel
    (1, 2, 3; offload None, "cpu" or "nvme" with offload_dir). optimizer(params, decay_mask) ->
    an AdamW. Collective (every rank of world)."""
    if zero_stage == 0:
        return Replicated(model, world, bucket_bytes, optimizer)
    return ZeroDataParallel(model, world, stage=zero_stage, bucket_bytes=bucket_bytes,
                            optimizer=optimizer, offload_dir=offload_dir, offload=offload)


@dataclass
class ParallelEngine:
    """What build_parallel built. engine: the calls of the training loop (forward/backward or,
    pipelined, train_step; step, grad_norm, shards, load_shards, full_params); model: the Model
    the loop reads (this rank's: the whole model, its tensor-parallel shard or its pipeline
    stage); mesh: the DeviceMesh (None under plain data parallelism); layout: the checked Layout
    (dp resolved); data_rank, data_size: this rank's place among the ranks that read different
    samples (mesh.dp_rank, mesh.dp; the world's without a mesh); pipelined: pp > 1; replica: what
    an elastic shrink hands over (Parts.replica); make_model: the factory it was built from;
    num_params: the one-process model's parameter count."""

    engine: object
    model: object
    mesh: object
    layout: object
    data_rank: int
    data_size: int
    pipelined: bool
    replica: str
    make_model: object
    num_params: int
    _gathered: object = None

    @property
    def zero_stage(self):
        return self.layout.zero_stage

    def parts(self, sampler, tokens_per_step, **kwargs):
        """rtxmpi.train.Parts of this engine with `sampler` (reading data_rank of data_size) and
        tokens_per_step; kwargs: the other Parts fields (unit, bucket_mb, loss_unit, ...)."""
        if self.layout.offload == "nvme":
            kwargs.setdefault("close", self.engine.close)  # removes its offload files
        return Parts(self.model, self.engine, sampler, tokens_per_step, data_rank=self.data_rank,
                     data_size=self.data_size, zero_stage=self.zero_stage,
                     pipelined=self.pipelined, replica=self.replica, **kwargs)

    def gathered_model(self):
        """A one-process Model (make_model()'s, made once) holding the trained parameters, on
        every rank: for evaluation at any layout (each rank then reads its own held-out slice).
        Collective (engine.full_params: a gather under ZeRO-3, tp or pp), every rank of world."""
        full = self.engine.full_params()
        if self._gathered is None:
            self._gathered = self.make_model()
        flat = self._gathered.flat_data
        flat[...] = self._gathered.xp.asarray(full, dtype=flat.dtype)
        return self._gathered


def build_parallel(make_model, world, layout, *, optimizer, bucket_bytes=DEFAULT_BUCKET_BYTES,
                   offload_dir=None, global_batch=None, split=None):
    """The engine of `layout` (rtxmpi.parallel.layout.Layout) over `world` for the Model that
    make_model() returns: the one-process model (its units, seed, xp and dtype), the same on
    every rank; the engines shard it. layout.recompute is applied under every layout.

        dp (and ZeRO 0-3, offload)  build_engine: Replicated or ZeroDataParallel
        tp or sp > 1, pp == 1       build_hybrid: a TensorParallelModel of its units under
                                    HybridParallel (ZeRO 0) or ZeroHybridParallel (1-3)
        pp > 1                      build_pipeline(model=...): stages as ranges of its units
                                    (tensor-parallel stages with tp or sp > 1)
    optimizer(params, decay_mask) -> an AdamW-like optimizer; bucket_bytes: gradient bucket size;
    offload_dir: with layout.offload "nvme"; global_batch: samples per step, checked against the
    layout when given; split: body units per pipeline stage (None: balanced).
    Returns a ParallelEngine. Collective: every rank of world calls it with the same arguments.
    Raises ConfigError on every rank, before anything is built: every problem of the layout
    (Layout.check against world.world_size, the model and global_batch), then a model the layout
    cannot split (e.g. a module without a tensor-parallel version under tp > 1).
    """
    model = make_model()
    layout = layout.check(world.world_size, model, global_batch)
    num_params = model.num_params
    offload = None if layout.offload == "none" else layout.offload
    xp, dtype = model.xp, model.dtype
    if layout.pp > 1:
        def stage_model(mesh):
            if layout.tp == 1 and layout.sp == 1:
                return model
            return TensorParallelModel(model, mesh, xp=xp, dtype=dtype,
                                       sequence_parallel=layout.sequence_parallel)

        engine = build_pipeline(None, world, dp=layout.dp, pp=layout.pp, tp=layout.tp, sp=layout.sp,
                                micro_batches=layout.micro_batches, schedule=layout.schedule,
                                split=split, xp=xp, dtype=dtype, optimizer=optimizer,
                                sequence_parallel=layout.sequence_parallel,
                                bucket_bytes=bucket_bytes, zero_stage=layout.zero_stage,
                                virtual_stages=layout.virtual_stages, recompute=layout.recompute,
                                model=stage_model)
    elif layout.tp > 1 or layout.sp > 1:
        engine = build_hybrid(model, world, dp=layout.dp, tp=layout.tp, sp=layout.sp, xp=xp,
                              dtype=dtype, sequence_parallel=layout.sequence_parallel,
                              bucket_bytes=bucket_bytes, optimizer=optimizer,
                              zero_stage=layout.zero_stage, offload=offload, offload_dir=offload_dir)
        engine.model.recompute = layout.recompute
    else:
        model.recompute = layout.recompute
        engine = build_engine(model, world, zero_stage=layout.zero_stage, optimizer=optimizer,
                              bucket_bytes=bucket_bytes, offload=offload, offload_dir=offload_dir)
    mesh = getattr(engine, "mesh", None)
    data_rank, data_size = (mesh.dp_rank, mesh.dp) if mesh else (world.rank, world.world_size)
    replica = None if layout.zero_stage else "pieces" if mesh else "tensors"
    return ParallelEngine(engine, engine.model, mesh, layout, data_rank, data_size,
                          layout.pp > 1, replica, make_model, num_params)
