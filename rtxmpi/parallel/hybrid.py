"""`HybridParallel`: trains a TensorParallelModel (rtxmpi.parallel.parallelize: any Model's units,
e.g. the GPT's as `ParallelGPT`, split over a DeviceMesh's tp and sp axes) with data parallelism
over the dp and sp axes; `build_hybrid` builds mesh, model and engine for a training job.

Every sp rank computes the mean loss over its own positions; the batch is split over dp; so the
global loss and the gradient of every (dp, sp)-replicated parameter are averages over
mesh.group("dp", "sp") (mesh.loss_group), which `HybridParallel` takes with the bucketed
all_reduce of rtxmpi.parallel.data.DataParallel. The engine never computes a layer: the model's
parallel modules do (tensor and Ulysses collectives inside them).
"""
import math

import numpy as np

from ..errors import ConfigError
from ..mesh import DeviceMesh
from ..nn.gpt import GPTConfig
from ..nn.optim import AdamW, clip_grad_norm
from ..nn.params import decay_mask
from .data import DEFAULT_BUCKET_BYTES, DataParallel
from .layout import Layout, no_positions
from .parallelize import ParallelGPT, TensorParallelModel
from .zero import even_range
from .zero_hybrid import ZeroHybridParallel


class HybridParallel:
    """Train a TensorParallelModel on a DeviceMesh with pp = 1: tensor parallelism over tp,
    Ulysses over sp, bucketed data parallelism (DataParallel, all_reduce overlapping backward)
    over mesh.loss_group = group("dp", "sp"), and AdamW on this rank's slice.

    model: TensorParallelModel (e.g. ParallelGPT); optimizer: callable (flat_params, decay_mask)
    -> optimizer (default AdamW).
    Offers the calls the training loop uses for every engine (rtxmpi.train): forward,
    backward, no_sync, grad_norm, step(lr, max_grad_norm, total_norm), zero_grad, full_params,
    shards, load_shards; a checkpoint holds the FULL model's flat vectors, so it loads at any
    layout. Collective: every rank of the mesh constructs it and calls the same methods in the same
    order. Raises ConfigError when mesh.pp > 1 (the pipeline engine owns that axis).
    """

    def __init__(self, model, bucket_bytes=DEFAULT_BUCKET_BYTES, optimizer=None):
        mesh = model.mesh
        if mesh.pp > 1:
            raise ConfigError(f"HybridParallel runs pp=1; got pp({mesh.pp}): use the pipeline "
                              "engine (rtxmpi.parallel.pipeline) for pipeline parallelism")
        self.model, self.mesh = model, mesh
        self.group = mesh.world  # the engine spans the mesh; gradients average over loss_group
        self.ddp = DataParallel(model, mesh.loss_group, bucket_bytes=bucket_bytes,
                                broadcast_params=False)  # identical by construction
        make = optimizer or (lambda params, mask: AdamW(params, decay_mask=mask))
        self.optimizer = make(model.flat_data, decay_mask(model.params, model.xp, model.dtype))
        self.no_sync, self.zero_grad = self.ddp.no_sync, self.ddp.zero_grad

    def forward(self, idx, targets):
        """(loss, cache) for this rank's samples: idx, targets (B, T) = this dp rank's rows of
        the global batch with the FULL sequence (mesh.batch_slice); this sp rank's positions are
        taken here (or after the model's whole-input units, e.g. a ViT's images: then targets
        are per sample, TensorParallelModel.whole_input / whole_head). loss: mean over this
        rank's tokens (samples with whole_head; average over mesh.loss_group).
        Collective on the mesh; raises ConfigError on every rank when any rank's batch is bad
        (TensorParallelModel.forward)."""
        return self.model.forward(idx, targets, full_sequence=True)

    def backward(self, cache, scale=1.0):
        """Backward, then (outside no_sync) gradients averaged over mesh.loss_group."""
        self.ddp.backward(cache, scale=scale)

    def grad_norm(self):
        """Global gradient L2 norm (the one-process model's), the same on every rank."""
        return math.sqrt(self.model.grad_norm_sq())

    def step(self, lr=None, max_grad_norm=None, total_norm=None):
        """Clip to the global norm (optional), then AdamW on this rank's slice. Refuses
        (RtxmpiError, before any collective) unless the last backward since the last step ran
        outside no_sync (DataParallel.check_step). Collective (the norm, on tp)."""
        self.ddp.check_step()
        if max_grad_norm is not None:
            if total_norm is None:
                total_norm = self.grad_norm()
            clip_grad_norm(self.model.flat_grad, max_grad_norm, total_norm=total_norm)
        self.ddp.step(self.optimizer, lr=lr)

    def full_params(self):
        """The one-process model's flat parameter vector (model.full_specs layout). Collective on
        tp."""
        return self.model.gather_full(self.model.flat_data)

    def shards(self):
        """{name: (data, global_offset, global_size)}: each world rank writes an even
        1/world_size of the FULL flat params and AdamW m and v (as the data-parallel engine), so
        the checkpoint is the one-process model's and loads at any layout. Collective on tp."""
        r, n = self.mesh.rank, self.mesh.world_size
        state = self.optimizer.state_dict()
        pieces = {"params": self.full_params(), "adam.m": self.model.gather_full(state["m"]),
                  "adam.v": self.model.gather_full(state["v"]),
                  "adam.step": np.array([state["step"]], np.int64)}
        out = {}
        for name, full in pieces.items():  # this rank's even piece of each
            size = int(full.shape[0])
            start, stop = even_range(size, n, r)
            out[name] = (full[start:stop], start, size)
        return out

    def load_shards(self, read):
        """Load from a checkpoint of full flat vectors (`read(name, start, stop)`). Local reads."""
        model = self.model
        n = model.full_specs[-1].stop
        self.optimizer.load_state_dict({
            "step": int(read("adam.step", 0, 1)[0]),
            "m": model.local_from_full(read("adam.m", 0, n)),
            "v": model.local_from_full(read("adam.v", 0, n))})
        model.flat_data[...] = model.local_from_full(read("params", 0, n))
        self.ddp.zero_grad()


def build_hybrid(cfg, group, *, dp=None, tp=1, sp=1, seed=0, dtype=np.float32,
                 sequence_parallel=False, bucket_bytes=DEFAULT_BUCKET_BYTES, optimizer=None,
                 xp=np, zero_stage=0, offload=None, offload_dir=None):
    """The mesh (pp = 1), model and HybridParallel engine for a training job: returns the engine
    (engine.model, engine.mesh). cfg: a GPTConfig (the model is a ParallelGPT), or a Model's
    units (Modules or (name, Module) pairs: a TensorParallelModel of them). xp: numpy or cupy,
    where the model computes.
    zero_stage 1-3: a ZeroHybridParallel instead (ZeRO over mesh.loss_group, with offload None,
    "cpu" or "nvme" + offload_dir; rtxmpi.parallel.zero_hybrid). Collective on `group`. Raises
    ConfigError (layout, or a model that does not divide by tp / sp) on every rank."""
    Layout(dp, tp, 1, sp, zero_stage=zero_stage, offload=offload or "none",
           sequence_parallel=sequence_parallel).check(group.world_size, no_positions(cfg))
    mesh = DeviceMesh(dp=dp, tp=tp, pp=1, sp=sp, group=group)
    kind = ParallelGPT if isinstance(cfg, GPTConfig) else TensorParallelModel
    model = kind(cfg, mesh, seed=seed, xp=xp, dtype=dtype, sequence_parallel=sequence_parallel)
    if zero_stage:
        return ZeroHybridParallel(model, stage=zero_stage, bucket_bytes=bucket_bytes,
                                  optimizer=optimizer, offload=offload,
                                  offload_dir=offload_dir)
    return HybridParallel(model, bucket_bytes=bucket_bytes, optimizer=optimizer)


__all__ = ["ParallelGPT", "TensorParallelModel", "HybridParallel", "build_hybrid"]
