"""ZeRO on a device mesh: stages 1-3 for a `TensorParallelModel` (e.g. `ParallelGPT`) under tensor
(tp) and sequence (sp) parallelism (pp = 1), as `HybridParallel` trains it without ZeRO.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, composed with Megatron-LM tensor parallelism the way Megatron's distributed
optimizer and DeepSpeed do: ZeRO shards over the data-parallel replicas of each tensor-parallel
slice, never across tp.

Which ranks hold identical parameters: a TensorParallelModel's local flat vector (this tp rank's
slices of the model, `num_params` elements) is the same on every rank of `mesh.loss_group` = group("dp", "sp")
— the ranks that see different tokens and average their gradients. So the ZeRO group is
loss_group (dp x sp ranks), and each tp rank shards ITS OWN tp slice over it with
`rtxmpi.parallel.zero.ZeroDataParallel` (same shard layout, buckets, offload, stage-3 unit
gathers: it is a Model, with the unit hooks). Ranks of one tp group hold the same [start, stop)
range of their own local vectors. Per rank, model state is 1/(dp * sp) of the tp slice: 1/world
of the whole model at stage 3.

What differs from plain ZeRO:
- the gradient norm is the one-process model's: each rank's shard squared, the replicated
  parameters (LayerNorms, wpe, row-parallel biases: model.replicated) counted on tp rank 0
  only, summed over the mesh's world in one all_reduce (float64);
- checkpoints hold the one-process model's flat vectors (HybridParallel's format), so a run saved
  at (dp=2, tp=2, ZeRO-3) resumes at plain dp=4, at tp=4, at another stage, and back.
  `shards()` streams each tensor (params, adam.m, adam.v) unit by unit — the unit's tp slice
  from its owners over loss_group, then the tp slices all_gathered — and each world rank keeps
  what falls in its even 1/world piece: beyond its pieces, one whole unit at a time (see
  docs/parallel.md, "ZeRO with tensor and sequence parallelism"). `load_shards` reads, for this
  rank's shard only, the whole-model range of the parameters the shard overlaps (one read per
  tensor and call, the same count on every rank) and slices its tp part out of it.
"""
import bisect
import math
import os

import numpy as np

from ..errors import ConfigError
from ..nn import grad_norm_sq
from . import tensor as tpl
from .data import DEFAULT_BUCKET_BYTES
from .offload import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_CHUNKS
from .zero import (ZeroDataParallel, _default_optimizer, even_range, read_range, shard_range,
                   shard_size)

STATE_TENSORS = ("params", "adam.m", "adam.v")


class ZeroHybridParallel:
    """Train a TensorParallelModel (mesh pp = 1) with ZeRO stage 1, 2 or 3 over mesh.loss_group, tensor
    parallelism over tp and Ulysses over sp.

    model: rtxmpi.parallel.parallelize.TensorParallelModel. stage, bucket_bytes, optimizer (callable
    (params_shard, decay_mask_shard) -> optimizer, default AdamW), offload (None, "cpu", "nvme"),
    offload_dir, offload_chunk_bytes, offload_max_chunks, prefetch: as for
    rtxmpi.parallel.zero.ZeroDataParallel, which runs on this rank's tp slice over loss_group
    ("nvme" files: offload_dir/tp_TTTTT/rank_RRRRR/ with tp > 1, RRRRR the loss_group rank).
    Offers the training loop's engine calls (rtxmpi.train): forward, backward, no_sync,
    grad_norm, step(lr, max_grad_norm, total_norm), zero_grad, full_params, shards,
    load_shards, memory_bytes, close.

    Attributes: model, mesh, group (the mesh's world), zero (the ZeroDataParallel), stage,
    offload, optimizer, provider (stage 3: the ShardedParams; else None), start / stop (this
    rank's shard of its local vector), nonfinite.
    Collective: every rank of the mesh constructs it and calls the same methods in the same
    order (stage 3: forward and every backward too, as the units are gathered over loss_group).
    Raises ConfigError (on every rank) when mesh.pp > 1, and for what ZeroDataParallel refuses.
    """

    def __init__(self, model, stage=1, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 optimizer=None, offload=None, offload_dir=None, prefetch=True,
                 offload_chunk_bytes=DEFAULT_CHUNK_BYTES, offload_max_chunks=DEFAULT_MAX_CHUNKS):
        mesh = model.mesh
        if mesh.pp > 1:
            raise ConfigError(f"ZeroHybridParallel runs pp=1; got pp({mesh.pp}): ZeRO under "
                              "pipeline parallelism is the pipeline engine's")
        self.model, self.mesh, self.group = model, mesh, mesh.world
        self._tp_dir = None
        if offload_dir is not None and mesh.tp > 1:  # loss_group ranks repeat across tp slices
            offload_dir = self._tp_dir = os.path.join(offload_dir, f"tp_{mesh.tp_rank:05d}")
        error, z = None, None
        try:  # ZeroDataParallel agrees on its errors over loss_group: one tp slice only
            z = self.zero = ZeroDataParallel(model, mesh.loss_group, stage=stage,
                                             bucket_bytes=bucket_bytes,
                                             optimizer=optimizer or _default_optimizer,
                                             offload=offload, offload_dir=offload_dir,
                                             prefetch=prefetch,
                                             offload_chunk_bytes=offload_chunk_bytes,
                                             offload_max_chunks=offload_max_chunks)
        except ConfigError as exc:
            error = exc
        failed = np.array([error is not None], np.int64)
        mesh.world.all_reduce(failed, op="max")  # so that every slice raises, not only that one
        if failed[0]:
            if z is not None:
                z.close()
            raise error or ConfigError("ZeRO set-up failed on another tensor-parallel slice "
                                       "(its ranks print the reason)")
        self.stage, self.offload, self.optimizer, self.provider = (z.stage, z.offload,
                                                                   z.optimizer, z.provider)
        self.start, self.stop = z.start, z.stop
        self.no_sync, self.zero_grad = z.no_sync, z.zero_grad
        # the gradient-norm ranges of this shard: the tp-split parameters, and the replicated ones
        # on tp rank 0 only (the other tp ranks hold copies)
        self._norm_ranges = tpl.norm_ranges(model.params, mesh.tp_rank, self.start, self.stop,
                                            model.replicated)
        self._offsets = [p.offset for p in model.params]

    @property
    def nonfinite(self):
        """ZeroDataParallel.nonfinite of the ZeRO group (mesh.loss_group), stages 2 and 3: None
        before the first synchronized backward, then a 0-d bool array (the model's array
        module), True when THIS rank's averaged gradient shard holds inf or NaN. Always None at
        stage 1. Shards differ, so agree on it over the mesh (rtxmpi.control.agree) before
        branching; the training loop uses the global grad_norm instead. Local."""
        return self.zero.nonfinite

    def __repr__(self):
        m = self.mesh
        return (f"<ZeroHybridParallel stage={self.stage} dp={m.dp} tp={m.tp} sp={m.sp} "
                f"shard=[{self.start}, {self.stop}) of {self.zero.numel} (tp rank {m.tp_rank})>")

    # -- training -----------------------------------------------------------------------------
    def forward(self, idx, targets):
        """(loss, cache) for this rank's samples: idx, targets (B, T) = this dp rank's rows with
        the FULL sequence (mesh.batch_slice); this sp rank's positions are taken here. loss: mean
        over this rank's tokens (average it over mesh.loss_group). Collective on the mesh: the
        model's forward (TensorParallelModel.forward, the provider's gathers at stage 3) raises ConfigError
        on every rank when any rank's batch is bad."""
        return self.model.forward(idx, targets, full_sequence=True)

    def backward(self, cache, scale=1.0):
        """Backward of scale * loss; outside no_sync the gradient shard holds the loss_group
        average (stage 1: the whole local gradient). Collective (ZeroDataParallel.backward)."""
        self.zero.backward(cache, scale=scale)

    def grad_norm(self):
        """The one-process model's gradient L2 norm, the same on every rank: one float64
        all_reduce over the mesh's world of each shard's squared norm (replicated parameters
        counted on tp rank 0). Collective."""
        grad = self.zero.grad_shard()
        sq = np.array([sum(grad_norm_sq(grad[lo:hi]) for lo, hi in self._norm_ranges)],
                      np.float64)
        if self.group.world_size > 1:
            self.group.all_reduce(sq, op="sum")
        return math.sqrt(sq[0])

    def step(self, lr=None, max_grad_norm=None, total_norm=None):
        """Clip to the global norm (optional; total_norm: grad_norm() if already computed), the
        optimizer on this rank's shard, the parameter all_gather (stages 1, 2). Returns the norm
        before clipping when max_grad_norm is set, else None. Refuses (RtxmpiError, before any
        collective) unless the last backward since the last step ran outside no_sync.
        Collective."""
        self.zero.check_step()
        if max_grad_norm is not None and total_norm is None:
            total_norm = self.grad_norm()
        return self.zero.step(lr=lr, max_grad_norm=max_grad_norm, total_norm=total_norm)

    def close(self):
        """Remove this rank's offload files (offload="nvme"; and the tp_TTTTT directory once
        the last rank of the slice has left it). Local."""
        self.zero.close()
        if self._tp_dir is not None:
            try:
                os.rmdir(self._tp_dir)
            except OSError:  # another rank of this tp slice still has its files there
                pass

    def memory_bytes(self):
        """Bytes this rank holds (ZeroDataParallel.memory_bytes of its tp slice). Local."""
        return self.zero.memory_bytes()

    # -- whole-model views and checkpoints --------------------------------------------------------
    def full_params(self):
        """The one-process GPT's flat parameter vector (rtxmpi.nn.GPT layout), a new array, on
        every rank. Collective (stage 3: a gather over loss_group; then one over tp)."""
        return self.model.gather_full(self.zero.full_params())

    def shards(self):
        """{name: (data, global_offset, global_size)} of the one-process model's flat params,
        adam.m and adam.v, each world rank an even 1/world piece (HybridParallel's format), and
        adam.step on world rank 0. Streams unit by unit (embeddings, each block, head): the
        unit's tp slice is assembled over loss_group (a broadcast from each owner), its
        tp slices all_gathered into the whole unit, and each rank keeps what falls in its
        piece, so beyond its own pieces a rank holds one whole unit at a time. Collective."""
        r, n = self.group.rank, self.group.world_size
        size = self.model.full_num_params
        lo, hi = even_range(size, n, r)
        out = {}
        for name, (shard, _, _) in self.zero.shards().items():
            if name not in STATE_TENSORS:
                continue
            piece = self.model.xp.empty(hi - lo, shard.dtype)
            for unit in range(len(self.model.units)):
                f0, whole = self._whole_unit(unit, shard)
                a, b = max(lo, f0), min(hi, f0 + len(whole))
                if b > a:
                    piece[a - lo:b - lo] = whole[a - f0:b - f0]
            out[name] = (piece, lo, size)
        lo, hi = shard_range(1, n, r)
        out["adam.step"] = (np.full(hi - lo, self.optimizer.step_count, np.int64), lo, 1)
        return out

    def _whole_unit(self, unit, shard):
        """(offset in the one-process layout, values) of unit `unit` of the whole model, from
        every rank's shard of the local vectors. Collective (loss_group, then tp)."""
        model, xp = self.model, self.model.xp
        first, stop = model.units[unit]
        a = model.params[first].offset
        b = model.params[stop - 1].offset + model.params[stop - 1].size
        local = xp.empty(b - a, shard.dtype)
        group = self.zero.group
        S = shard_size(self.zero.numel, group.world_size)
        for q in range(group.world_size):  # one broadcast per owner of a part of [a, b)
            lo, hi = max(a, q * S), min(b, (q + 1) * S)
            if hi <= lo:
                continue
            if q == group.rank:
                local[lo - a:hi - a] = xp.asarray(shard[lo - self.start:hi - self.start])
            if group.world_size > 1:
                group.broadcast(local[lo - a:hi - a], src=q)
        tp = self.mesh.tp
        pieces = (model.tp_group.all_gather(local).reshape(tp, -1) if tp > 1
                  else local.reshape(1, -1))
        specs = model.full_specs[first:stop]
        f0 = specs[0].offset
        whole = xp.empty(specs[-1].stop - f0, shard.dtype)
        for i, (p, spec) in enumerate(zip(model.params[first:stop], specs), first):
            parts = [pieces[t, p.offset - a:p.offset - a + p.size].reshape(p.shape)
                     for t in range(tp)]
            whole[spec.offset - f0:spec.stop - f0] = model.unshard(i, parts).reshape(-1)
        return f0, whole

    def load_shards(self, read):
        """Load a checkpoint of the one-process model's flat vectors (any layout, stage, world
        size wrote it): read(name, offset, length) -> 1-D array. Reads, for this rank's shard,
        the whole-model range of the parameters it overlaps; drops accumulated gradients.
        Collective (read is called the same number of times on every rank). Raises
        CheckpointError when read returns the wrong length."""
        def read_local(name, offset, length):
            if name not in STATE_TENSORS:
                return read(name, offset, length)
            return self._read_local(read, name, int(offset), int(length))

        self.zero.load_shards(read_local)

    def _read_local(self, read, name, lo, length):
        """Elements [lo, lo + length) of this tp rank's local vector `name`, from one read of
        the whole-model range of the parameters they touch."""
        hi = lo + length
        first = max(0, bisect.bisect_right(self._offsets, lo) - 1)
        touched = [i for i in range(first, len(self.model.params))
                   if self.model.params[i].offset < hi and length > 0]
        full_specs = self.model.full_specs
        f0 = full_specs[touched[0]].offset if touched else 0
        f1 = full_specs[touched[-1]].stop if touched else 0
        values = read_range(read, name, f0, f1 - f0)
        out = np.empty(length, values.dtype)
        for i in touched:
            p, spec = self.model.params[i], full_specs[i]
            piece = self.model.shard(i, values[spec.offset - f0:spec.stop - f0].reshape(spec.shape))
            a, b = max(lo, p.offset), min(hi, p.offset + p.size)
            out[a - lo:b - lo] = np.ascontiguousarray(piece).reshape(-1)[a - p.offset:b - p.offset]
        return out


__all__ = ["ZeroHybridParallel", "STATE_TENSORS"]
