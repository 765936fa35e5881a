"""The data-parallel engine of a ZeRO stage behind one set of calls, for any Model.

Stage 0 is Replicated (DataParallel with a whole optimizer on every rank), stages 1-3
ZeroDataParallel; both offer grad_norm, step(lr, max_grad_norm, total_norm), shards, load_shards
and full_params, so the training loop and the checkpoint format are the same at every stage.
"""
import math

import numpy as np

from rtxmpi.checkpoint import Shard
from rtxmpi.nn import clip_grad_norm, decay_mask, grad_norm_sq
from rtxmpi.parallel.data import DataParallel
from rtxmpi.parallel.zero import ZeroDataParallel


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


def build_engine(model, world, *, zero_stage, optimizer, bucket_bytes=25 * 2**20, offload=None,
                 offload_dir=None):
    """The data-parallel engine of `zero_stage` over `world`: Replicated (0) or ZeroDataParallel
    (1, 2, 3; offload None, "cpu" or "nvme" with offload_dir). optimizer(params, decay_mask) ->
    an AdamW. Collective (every rank of world)."""
    if zero_stage == 0:
        return Replicated(model, world, bucket_bytes, optimizer)
    return ZeroDataParallel(model, world, stage=zero_stage, bucket_bytes=bucket_bytes,
                            optimizer=optimizer, offload_dir=offload_dir, offload=offload)
