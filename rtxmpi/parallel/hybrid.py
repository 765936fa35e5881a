"""`ParallelGPT`: the GPT of rtxmpi.nn split over a DeviceMesh's tp and sp axes, and
`HybridParallel`, which trains it with data parallelism over the dp and sp axes.

The model computes exactly what `rtxmpi.nn.GPT` computes (same config, same parameter names and
initialization: each rank draws the full GPT's parameters from the seed and keeps its tp slice,
`rtxmpi.parallel.tensor.shard_param`), with
- tensor parallelism over mesh.group("tp") (Megatron-LM): attention heads and the MLP's hidden
  width split (column-parallel qkv and fc, row-parallel projections), vocabulary-parallel
  embedding, head and cross-entropy; optionally Megatron sequence parallelism
  (`sequence_parallel=True`): LayerNorm/residual regions split along the sequence over tp;
- Ulysses sequence parallelism over mesh.group("sp"): each sp rank holds T/sp positions of each
  sample, attention runs on the full sequence of H/(tp*sp) heads after an all-to-all.
Every sp rank computes the mean loss over its own positions; the batch is split over dp; so the
global loss and the gradient of every (dp, sp)-replicated parameter are averages over
mesh.group("dp", "sp") (mesh.loss_group) — which `HybridParallel` takes with the bucketed
all_reduce of rtxmpi.parallel.data.DataParallel.

Shape legend: B this rank's samples, T positions per sample, Ts = T/sp this rank's positions,
C, H, V as in rtxmpi.nn.gpt; Cl = C/tp, Hl = H/tp, Fl = 4C/tp, Vl = V/tp.
"""
import math
import zlib

import numpy as np

from ..control import raise_if_any_failed
from ..errors import ConfigError
from ..mesh import DeviceMesh, resolve_degrees
from ..nn import layers
from ..nn.gpt import GPTConfig, _init_flat, param_layout
from ..nn.optim import AdamW, clip_grad_norm, grad_norm_sq
from ..nn.params import bind, decay_mask, layout
from . import tensor as tpl
from .data import DEFAULT_BUCKET_BYTES, DataParallel
from .sequence import check_heads, ulysses_attention_backward, ulysses_attention_forward
from .zero import even_range
from .zero_hybrid import ZeroHybridParallel

# block parameter positions (rtxmpi.nn.layers.BLOCK_PARAM_NAMES) used in the sequence-split region
# under sequence_parallel: ln1.g, ln1.b, attn.b_proj, ln2.g, ln2.b, mlp.b_proj
_SP_PARTIAL = (0, 1, 5, 6, 7, 11)


class _Cache:
    __slots__ = ("emb", "blocks", "head")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class ParallelGPT:
    """One rank's part of a GPT under tensor (tp) and sequence (sp) parallelism.

    cfg: GPTConfig; mesh: rtxmpi.mesh.DeviceMesh (uses group("tp") and group("sp")); seed: the
    same on every rank; xp, dtype: as for rtxmpi.nn.GPT; sequence_parallel: Megatron sequence
    parallelism inside tp.
    Raises ConfigError (on every rank: it depends only on shared arguments) when n_head, 4*n_embd
    or vocab_size is not divisible by tp, or n_head/tp not by sp.
    Collective (forward and backward): every rank of group("tp") and group("sp") calls them in the
    same order, tp peers with the same tokens.

    Attributes (as rtxmpi.nn.GPT, for this rank's slices): cfg, xp, dtype, params (the GPT's names,
    local shapes), flat_data, flat_grad, num_params (local), units, full_specs (the GPT's layout),
    full_num_params (the whole model's),
    mesh, tp_group, sp_group, tp, sp, tp_rank, sp_rank, vocab_start, sequence_parallel, provider
    (None, or ZeRO-3's unit provider after use_provider: the passes then fetch each unit's
    parameters from it and report each unit's gradient, as rtxmpi.nn.GPT's).
    """

    def __init__(self, cfg, mesh, seed=0, xp=np, dtype=np.float32, sequence_parallel=False):
        if not isinstance(cfg, GPTConfig):
            raise ConfigError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise ConfigError(f"ParallelGPT dtype must be a floating type, got {dtype.name}")
        self.cfg, self.mesh, self.xp, self.dtype = cfg, mesh, xp, dtype
        self.tp_group, self.sp_group = mesh.group("tp"), mesh.group("sp")
        tp, sp = mesh.tp, mesh.sp
        self.tp, self.sp, self.tp_rank, self.sp_rank = tp, sp, mesh.tp_rank, mesh.sp_rank
        self.sequence_parallel = bool(sequence_parallel) and tp > 1
        self.n_head_local = tpl.split_size(
            cfg.n_head, tp, "n_head", f" (tp={tp}): each tensor-parallel rank needs whole "
            f"attention heads; use n_head divisible by tp")
        tpl.split_size(4 * cfg.n_embd, tp, "MLP width 4*n_embd", f" (tp={tp})")
        self.vocab_start, _ = tpl.vocab_range(cfg.vocab_size, self.tp_rank, tp)
        check_heads(self.n_head_local, sp)
        self.full_specs = param_layout(cfg)
        self.full_num_params = self.full_specs[-1].stop
        specs = layout(tpl.local_layout(self.full_specs, tp))
        self.num_params = specs[-1].stop
        full = _init_flat(cfg, self.full_specs, seed)
        local = np.empty(self.num_params, np.float64)
        for spec, full_spec in zip(specs, self.full_specs):
            piece = tpl.shard_param(spec.name, full[full_spec.offset:full_spec.stop]
                                    .reshape(full_spec.shape), self.tp_rank, tp)
            local[spec.offset:spec.stop] = piece.reshape(-1)
        self.flat_data = xp.asarray(local.astype(dtype))
        self.flat_grad = xp.zeros(self.num_params, dtype=dtype)
        self.params = bind(specs, self.flat_data, self.flat_grad)
        L = cfg.n_layer
        self.units = [(0, 2)] + [(2 + 12 * l, 14 + 12 * l) for l in range(L)] + [
            (2 + 12 * L, len(self.params))]
        self.provider = None  # ZeRO-3 (use_provider); None: the Param views, read at each use

    def use_provider(self, provider, drop_flat=False):
        """Take parameters and gradients from `provider` from now on: the unit hooks of
        rtxmpi.nn.GPT (fetch, release, grads, grads_ready, transient; same units: embeddings,
        each block, head), which ZeRO-3 (rtxmpi.parallel.zero.ShardedParams) provides.

        drop_flat: also let go of flat_data, flat_grad and the Param views (they become None), so
        that only the provider holds parameter memory. The passes then fetch each unit when they
        need it (backward again), keep no parameter in their caches when the provider is
        transient, and report each unit's gradient final (grads_ready) when its piece ends.
        Local.
        """
        self.provider = provider
        if drop_flat:
            self.flat_data = self.flat_grad = None
            for p in self.params:
                p.data = p.grad = None

    # unit access: the provider's, or the live Param views (a pipeline stage re-points them)
    def _fetch(self, unit, then=None):
        if self.provider is None:
            a, b = self.units[unit]
            return [p.data for p in self.params[a:b]]
        return self.provider.fetch(unit, then=then)

    def _release(self, unit):
        if self.provider is not None:
            self.provider.release(unit)

    def _grads(self, unit):
        if self.provider is None:
            a, b = self.units[unit]
            return [p.grad for p in self.params[a:b]]
        return self.provider.grads(unit)

    def _grads_ready(self, unit):
        if self.provider is not None:
            self.provider.grads_ready(unit)

    @property
    def _transient(self):
        return self.provider is not None and self.provider.transient

    # ------------------------------------------------------------------ parameters
    def zero_grad(self):
        if self.flat_grad is not None:  # None once a provider holds the gradients (ZeRO-3)
            self.flat_grad.fill(0)

    def gather_full(self, local):
        """The full GPT flat vector (the layout of rtxmpi.nn.GPT) from every tp rank's `local`
        flat vector (num_params long: parameters, gradients or optimizer state). Collective on
        group("tp") (one all_gather). Returns an array of param_layout(cfg)[-1].stop elements."""
        xp, tp = self.xp, self.tp
        pieces = self.tp_group.all_gather(xp.ascontiguousarray(local)).reshape(tp, -1)
        out = xp.empty(self.full_specs[-1].stop, local.dtype)
        for p, full_spec in zip(self.params, self.full_specs):
            parts = [pieces[r, p.offset:p.offset + p.size].reshape(p.shape) for r in range(tp)]
            out[full_spec.offset:full_spec.stop] = tpl.unshard_param(p.name, parts).reshape(-1)
        return out

    def local_from_full(self, full):
        """This rank's local flat vector (num_params) from a full GPT flat vector. Local."""
        xp = self.xp
        out = xp.empty(self.num_params, self.dtype)
        for p, full_spec in zip(self.params, self.full_specs):
            piece = tpl.shard_param(p.name, xp.asarray(full[full_spec.offset:full_spec.stop])
                                    .reshape(full_spec.shape), self.tp_rank, self.tp)
            out[p.offset:p.offset + p.size] = piece.reshape(-1)
        return out

    def grad_norm_sq(self):
        """Squared L2 norm of the FULL model's gradient (float): the tp-split parts summed over
        group("tp"), the replicated ones counted once. Collective on group("tp")."""
        total = np.zeros(1, np.float64)
        for lo, hi in tpl.norm_ranges(self.params, self.tp_rank):
            total[0] += grad_norm_sq(self.flat_grad[lo:hi])
        if self.tp > 1:
            self.tp_group.all_reduce(total)
        return float(total[0])

    # ------------------------------------------------------------------ validation
    def check_tokens(self, idx, targets):
        """Raise ConfigError unless idx, targets are (B, Ts) integer arrays of the same shape,
        B, Ts >= 1, Ts * sp <= seq_len (Ts divisible by tp with sequence_parallel), ids in
        [0, vocab_size): what `forward` checks on this rank, without computing. Local."""
        self._check_ids(idx, "idx")
        self._check_ids(targets, "targets")
        if targets.shape != idx.shape:
            raise ConfigError(f"targets shape {targets.shape} must equal idx shape {idx.shape}")

    def _own_positions(self, idx, targets):
        """This sp rank's positions (mesh.seq_slice) of (B, T) idx and targets; ConfigError."""
        if getattr(idx, "ndim", None) != 2 or getattr(targets, "shape", None) != idx.shape:
            raise ConfigError(f"idx and targets must be (B, T) arrays of the same shape, got "
                              f"{getattr(idx, 'shape', None)} and {getattr(targets, 'shape', None)}")
        cols = self.mesh.seq_slice(idx.shape[1])
        return idx[:, cols], targets[:, cols]

    def _check_ids(self, arr, what):
        if getattr(arr, "ndim", None) != 2 or arr.dtype.kind not in "iu":
            raise ConfigError(f"{what} must be a (B, Ts) integer array, got "
                              f"{getattr(arr, 'shape', type(arr).__name__)}")
        B, Ts = arr.shape
        if B == 0 or Ts == 0:
            raise ConfigError(f"{what} must have at least one position, got shape {arr.shape}")
        if Ts * self.sp > self.cfg.seq_len:
            raise ConfigError(f"{what} has {Ts} positions per sp rank, {Ts * self.sp} in all, but "
                              f"the model's seq_len is {self.cfg.seq_len}")
        if self.sequence_parallel and Ts % self.tp:
            raise ConfigError(f"sequence_parallel: {Ts} positions per rank are not divisible by "
                              f"tp({self.tp}); use a sequence length divisible by tp * sp")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ConfigError(f"{what} holds token ids in [{lo}, {hi}] but vocab_size is "
                              f"{self.cfg.vocab_size}")

    def _check_same_tokens(self, idx, targets, error):
        """Checking mode: every tp rank must feed the same tokens (they compute one model
        together). Collective on tp (one all_gather of a crc32 per rank; a rank whose own check
        failed, `error`, sends -1 and is left out of the comparison). Returns `error`, or a
        ConfigError when the valid ranks' tokens differ."""
        crc = -1
        if error is None:
            host = [a if isinstance(a, np.ndarray) else a.get() for a in (idx, targets)]
            crc = zlib.crc32(np.ascontiguousarray(host[1]).tobytes(),
                             zlib.crc32(np.ascontiguousarray(host[0]).tobytes()))
        crcs = self.tp_group.all_gather(np.array([crc], np.int64))
        valid = crcs[crcs >= 0]
        if error is None and not (valid == valid[0]).all():
            return ConfigError(f"tensor-parallel ranks fed different tokens (crc32 per tp rank: "
                               f"{[hex(int(c)) for c in crcs]}); every tp rank of a dp/sp "
                               f"coordinate must read the same samples (mesh.batch_slice)")
        return error

    # ------------------------------------------------------------------ forward
    def forward(self, idx, targets, full_sequence=False):
        """Loss and cache for this rank's tokens.

        idx, targets: (B, Ts) ids: this rank's samples (its dp slice of the global batch, the same
        on every tp rank) at its positions [sp_rank * Ts, (sp_rank + 1) * Ts) (mesh.seq_slice);
        with full_sequence=True (B, T) ids of the whole sequence, this sp rank's positions taken
        here (T divisible by sp, part of the agreed check). Returns (loss, cache): loss is a Python float, the mean cross-entropy over this rank's
        B*Ts positions (the same on every tp rank; average it over mesh.loss_group for the global
        loss). Collective on the mesh: every rank of mesh.world calls it (HybridParallel and
        ZeroHybridParallel do), as its tp and sp collectives and the dp gradient reduction
        after it tie every rank's step together. Raises ConfigError on EVERY rank of the mesh,
        naming each offending rank, when any rank's tokens have a bad shape, dtype, length or id
        (check_tokens; one 1-byte MAX all_reduce over mesh.world agrees on it before any other
        collective), or in checking mode when tp ranks were fed different tokens.
        """
        error = None
        try:
            if full_sequence:
                idx, targets = self._own_positions(idx, targets)
            self.check_tokens(idx, targets)
        except ConfigError as exc:
            error = exc
        if self.tp_group.check and self.tp > 1:
            error = self._check_same_tokens(idx, targets, error)
        raise_if_any_failed(self.mesh.world, error, "tensor-parallel batch check")
        idx, targets = self.xp.asarray(idx), self.xp.asarray(targets)
        x, emb_cache = self.embed_forward(idx)
        blocks = []
        for l in range(self.cfg.n_layer):
            x, cache = self.block_forward(l, x)
            blocks.append(cache)
        loss, head_cache = self.head_forward(x, targets)
        return loss, _Cache(emb=emb_cache, blocks=blocks, head=head_cache)

    # The passes in pieces (what a pipeline stage runs; collective on group("tp") and group("sp")):
    # x is the activation between blocks: (B, Ts, C), or (B, Ts/tp, C) with sequence_parallel.
    def embed_forward(self, idx):
        """Token (vocabulary-parallel) plus position embedding of this rank's (B, Ts) ids, already
        validated (`forward` does). Returns x, cache."""
        Ts = idx.shape[1]
        wte, wpe = self._fetch(0, then=1)
        x, cache = tpl.vocab_embedding_forward(idx, wte, self.vocab_start, self.tp_group,
                                               self.sequence_parallel)  # cache: no parameter
        p0, Tl = self._positions(Ts)
        x += wpe[p0:p0 + Tl]
        self._release(0)
        return x, (cache, Ts)

    def block_forward(self, l, x):
        """Block l (0-based) on x. Returns y (the shape of x), cache."""
        params = self._fetch(l + 1, then=l + 2)
        y, cache = self._block_forward(x, params)
        if self._transient:
            cache = _block_cache_with(cache, None)
        self._release(l + 1)
        return y, cache

    def head_forward(self, x, targets):
        """ln_f, the vocabulary-parallel head and cross-entropy. targets: (B, Ts) ids.
        Returns (loss: Python float, the mean over this rank's positions), cache."""
        tp, sp_on = self.tp_group, self.sequence_parallel
        last, tied = len(self.units) - 1, self.cfg.tie_embeddings
        head = self._fetch(last, then=0 if tied else None)
        w = self._fetch(0)[0] if tied else head[2]
        h, ln_f_cache = layers.layernorm_forward(x, head[0], head[1])
        logits, head_cache = tpl.column_linear_forward(h, w.T, None, tp, sp_on)
        loss, ce_cache = tpl.vocab_crossentropy_forward(logits, targets, self.vocab_start, tp)
        if tied:
            self._release(0)
        self._release(last)
        if self._transient:
            ln_f_cache, head_cache = _head_caches_with(ln_f_cache, head_cache, None, None)
        return float(loss), (ln_f_cache, head_cache, ce_cache)

    def _positions(self, Ts):
        """(first position, count) of the activations this rank holds between layers."""
        p0 = self.sp_rank * Ts
        if self.sequence_parallel:
            Tl = Ts // self.tp
            return p0 + self.tp_rank * Tl, Tl
        return p0, Ts

    def _block_forward(self, x, params):
        g1, b1, w_qkv, b_qkv, w_aproj, b_aproj, g2, b2, w_fc, b_fc, w_mproj, b_mproj = params
        tp, sp_on = self.tp_group, self.sequence_parallel
        h1, ln1 = layers.layernorm_forward(x, g1, b1)
        qkv, c_qkv = tpl.column_linear_forward(h1, w_qkv, b_qkv, tp, sp_on)  # (B, Ts, 3Cl)
        a, c_att = ulysses_attention_forward(qkv, self.n_head_local, self.sp_group)
        x1, c_aproj = tpl.row_linear_forward(a, w_aproj, b_aproj, tp, sp_on)
        x1, h2, ln2 = layers.residual_layernorm_forward(x1, x, g2, b2)  # cupy: one fused kernel
        f, c_fc = tpl.column_linear_forward(h2, w_fc, None, tp, sp_on)  # (B, Ts, Fl)
        f, c_gelu = layers.bias_gelu_forward(f, b_fc)  # cupy: one fused kernel
        y, c_mproj = tpl.row_linear_forward(f, w_mproj, b_mproj, tp, sp_on)
        y += x1
        return y, (ln1, c_qkv, c_att, c_aproj, ln2, c_fc, c_gelu, c_mproj)

    # ------------------------------------------------------------------ backward
    def _partial(self, grads, which):
        """Gradient outputs for parameters of the sequence-split region: the real buffers, or
        (sequence_parallel) zeroed scratch views to be summed over tp by `_sum_partial`."""
        if not self.sequence_parallel:
            return grads, None
        scratch = self.xp.zeros(sum(grads[j].size for j in which), self.dtype)
        out, at = list(grads), 0
        for j in which:
            out[j] = scratch[at:at + grads[j].size].reshape(grads[j].shape)
            at += grads[j].size
        return out, scratch

    def _sum_partial(self, grads, which, scratch, partial):
        if scratch is None:
            return
        self.tp_group.all_reduce(scratch)
        for j in which:
            grads[j] += partial[j]

    def backward(self, cache, scale=1.0, grad_ready=None):
        """Add the gradient of `scale * loss` (this rank's loss) into flat_grad (accumulates).

        grad_ready: optional callable grad_ready(i), called once per parameter index i when its
        gradient for this backward is final (reverse index order; the tied wte last), as
        rtxmpi.nn.GPT.backward. Collective on group("tp") and group("sp").
        """
        notify = grad_ready if grad_ready is not None else (lambda i: None)
        head_start = self.units[-1][0]
        dx = self.head_backward(cache.head, scale)
        if not self.cfg.tie_embeddings:
            notify(len(self.params) - 1)
        notify(head_start + 1)
        notify(head_start)
        for l in range(self.cfg.n_layer - 1, -1, -1):
            dx = self.block_backward(l, dx, cache.blocks[l])
            base = self.units[l + 1][0]
            for j in range(11, -1, -1):
                notify(base + j)
        self.embed_backward(dx, cache.emb)
        notify(1)
        notify(0)

    def head_backward(self, cache, scale=1.0):
        """Adds the gradients of `scale * loss` of ln_f and the head (wte's rows when tied);
        returns dx (the shape of head_forward's x)."""
        ln_f_cache, head_cache, ce_cache = cache
        last, tied, L = len(self.units) - 1, self.cfg.tie_embeddings, self.cfg.n_layer
        dlogits = tpl.vocab_crossentropy_backward(scale, ce_cache)
        head = self._fetch(last, then=0 if tied else L)
        head_grads = self._grads(last)
        if tied:  # wte's gradient buffer holds the head's term until embed_backward adds its own
            w, dw = self._fetch(0, then=L)[0], self._grads(0)[0]
        else:
            w, dw = head[2], head_grads[2]
        if self._transient:
            ln_f_cache, head_cache = _head_caches_with(ln_f_cache, head_cache, head[0], w.T)
        dh, _, _ = tpl.column_linear_backward(dlogits, head_cache, self.tp_group, dw_out=dw.T)
        if tied:
            self._release(0)
        ln_grads = head_grads[:2]
        partial, scratch = self._partial(ln_grads, (0, 1))
        dx, _, _ = layers.layernorm_backward(dh, ln_f_cache, partial[0], partial[1])
        self._sum_partial(ln_grads, (0, 1), scratch, partial)
        self._release(last)
        self._grads_ready(last)
        return dx

    def block_backward(self, l, dy, cache):
        """Adds block l's gradients; returns dx (the shape of dy)."""
        params = self._fetch(l + 1, then=l or None)  # block l-1 next; the embedding needs none
        if self._transient:
            cache = _block_cache_with(cache, params)
        dx = self._block_backward(dy, cache, self._grads(l + 1))
        self._release(l + 1)
        self._grads_ready(l + 1)
        return dx

    def embed_backward(self, dx, cache):
        """Adds the gradients of wpe (this rank's positions) and wte (its vocabulary rows)."""
        emb_cache, Ts = cache
        if self.sequence_parallel:
            dx = tpl.gather_sequence(dx, self.tp_group)
        p0 = self.sp_rank * Ts
        dwte, dwpe = self._grads(0)
        dwpe[p0:p0 + Ts] += dx.sum(axis=0)
        tpl.vocab_embedding_backward(dx, emb_cache, dwte)
        self._grads_ready(0)

    def _block_backward(self, dy, cache, grads):
        ln1, c_qkv, c_att, c_aproj, ln2, c_fc, c_gelu, c_mproj = cache
        tp = self.tp_group
        d, scratch = self._partial(grads, _SP_PARTIAL)
        df, _, _ = tpl.row_linear_backward(dy, c_mproj, tp, d[10], d[11])
        df, _ = layers.bias_gelu_backward(df, c_gelu, d[9])
        dh2, _, _ = tpl.column_linear_backward(df, c_fc, tp, d[8])
        dx1, _, _ = layers.layernorm_backward(dh2, ln2, d[6], d[7])
        dx1 += dy
        da, _, _ = tpl.row_linear_backward(dx1, c_aproj, tp, d[4], d[5])
        dqkv = ulysses_attention_backward(da, c_att, self.sp_group)
        dh1, _, _ = tpl.column_linear_backward(dqkv, c_qkv, tp, d[2], d[3])
        dx, _, _ = layers.layernorm_backward(dh1, ln1, d[0], d[1])
        dx += dx1
        self._sum_partial(grads, _SP_PARTIAL, scratch, d)
        return dx


# Which arrays of a ParallelGPT cache are parameters: with a transient provider (ZeRO-3) the
# caches hold None there after forward, and backward puts freshly fetched arrays back.
def _block_cache_with(cache, params):
    """A block cache (ParallelGPT._block_forward) holding `params` (12 arrays, or None)."""
    g1, _, w_qkv, _, w_aproj, _, g2, _, w_fc, _, w_mproj, _ = params or (None,) * 12
    ln1, c_qkv, c_att, c_aproj, ln2, c_fc, c_gelu, c_mproj = cache
    return (_layernorm_cache_with(ln1, g1), _column_cache_with(c_qkv, w_qkv), c_att,
            _row_cache_with(c_aproj, w_aproj), _layernorm_cache_with(ln2, g2),
            _column_cache_with(c_fc, w_fc), c_gelu, _row_cache_with(c_mproj, w_mproj))


def _head_caches_with(ln_f_cache, head_cache, g, w_t):
    return _layernorm_cache_with(ln_f_cache, g), _column_cache_with(head_cache, w_t)


def _layernorm_cache_with(cache, g):  # layers.layernorm_forward: (xhat, rstd, g)
    return (cache[0], cache[1], g)


def _column_cache_with(cache, w):  # tensor.column_linear_forward: ((x, w, has_b), sp)
    (x, _, has_b), sequence_parallel = cache
    return ((x, w, has_b), sequence_parallel)


def _row_cache_with(cache, w):  # tensor.row_linear_forward: ((x, w, has_b), sp, has_bias)
    (x, _, has_b), sequence_parallel, has_bias = cache
    return ((x, w, has_b), sequence_parallel, has_bias)


class HybridParallel:
    """Train a ParallelGPT on a DeviceMesh with pp = 1: tensor parallelism over tp, Ulysses over
    sp, bucketed data parallelism (DataParallel, all_reduce overlapping backward) over
    mesh.loss_group = group("dp", "sp"), and AdamW on this rank's slice.

    model: ParallelGPT; optimizer: callable (flat_params, decay_mask) -> optimizer (default AdamW).
    Offers the calls the training loop uses for every engine (examples/train.py): forward,
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
        taken here. loss: mean over this rank's tokens (average over mesh.loss_group).
        Collective on the mesh; raises ConfigError on every rank when any rank's batch is bad
        (ParallelGPT.forward)."""
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
        """The full GPT flat parameter vector (rtxmpi.nn.GPT layout). Collective on tp."""
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


def check_layout(world_size, *, dp=None, tp=1, pp=1, sp=1, seq_len, zero_stage=0,
                 sequence_parallel=False):
    """Validate a training job's layout before anything is built (pure, local, the same verdict
    on every rank). Returns dp. Raises ConfigError: dp * tp * pp * sp != world_size (naming every
    factor), seq_len not divisible by sp (or by tp * sp under Megatron sequence parallelism,
    checked by the model), sequence_parallel with tp = 1, a ZeRO stage outside 0-3. ZeRO
    composes with tp and sp (zero_hybrid.py); under pp the pipeline engine's check_pipeline
    decides. (After an elastic shrink the layout is re-planned for the survivors:
    rtxmpi.elastic.replan.)"""
    dp, tp, pp, sp = resolve_degrees(world_size, dp=dp, tp=tp, pp=pp, sp=sp)
    if seq_len % sp:
        raise ConfigError(f"sequence length {seq_len} is not divisible by sp({sp}); use a multiple "
                          f"of {sp}")
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if sequence_parallel and tp == 1:
        raise ConfigError("Megatron sequence parallelism splits the sequence over tp: it needs "
                          "tp > 1 (for sequence parallelism without tp use sp, Ulysses)")
    return dp


def build_hybrid(cfg, group, *, dp=None, tp=1, sp=1, seed=0, dtype=np.float32,
                 sequence_parallel=False, bucket_bytes=DEFAULT_BUCKET_BYTES, optimizer=None,
                 xp=np, zero_stage=0, offload=None, offload_dir=None):
    """The mesh (pp = 1), ParallelGPT and HybridParallel engine for a training job: returns the
    engine (engine.model, engine.mesh). xp: numpy or cupy, where the model computes.
    zero_stage 1-3: a ZeroHybridParallel instead (ZeRO over mesh.loss_group, with offload None,
    "cpu" or "nvme" + offload_dir; rtxmpi.parallel.zero_hybrid). Collective on `group`. Raises
    ConfigError (layout, or a model that does not divide by tp / sp) on every rank."""
    mesh = DeviceMesh(dp=dp, tp=tp, pp=1, sp=sp, group=group)
    model = ParallelGPT(cfg, mesh, seed=seed, xp=xp, dtype=dtype,
                        sequence_parallel=sequence_parallel)
    if zero_stage:
        return ZeroHybridParallel(model, stage=zero_stage, bucket_bytes=bucket_bytes,
                                  optimizer=optimizer, offload=offload,
                                  offload_dir=offload_dir)
    return HybridParallel(model, bucket_bytes=bucket_bytes, optimizer=optimizer)


__all__ = ["ParallelGPT", "HybridParallel", "check_layout", "build_hybrid"]
