"""Transformer layers as explicit forward/backward pairs (llm.c style).

Shape legend: B batch, T sequence length, C channels, H heads, hs = C // H head size, V vocabulary
size, N = B * T rows once (B, T, ...) is flattened for a 2-D matmul; for images Hi, Wi pixels,
Ci colour channels, P patch side, Np = (Hi / P) * (Wi / P) patches, K classes.

Conventions shared by every pair:
- `*_forward(inputs..., params...) -> (out, cache)`; `*_backward(dout, cache, ...) -> (dinput,
  param grads)`. The cache holds only what the backward needs.
- Weights are stored (C_in, C_out), so a linear layer is `y = x @ w + b`.
- Backward functions that produce parameter gradients take optional output arrays (`dw_out=`,
  `dparams=`) and ADD into them (`+=`) and return them; without, they return fresh arrays. This is
  how a model writes gradients straight into its flat gradient buffer and how micro-batches
  accumulate.
- A backward never modifies its cache or `dout`: calling it twice gives the same result twice.
- Everything is computed in the dtype of the inputs (no silent upcast) and uses only functions that
  numpy and cupy both provide; the array module comes from `xp_of`.

Inputs are not validated here (this is the inner loop); models validate once, at the edge.

On numpy the elementwise and row-wise layers (bias + GELU, softmax, LayerNorm, cross-entropy) run
rtxmpi.fused's one-pass CPU kernels when `fused.usable` accepts their arrays (float32 or float64,
C-contiguous), else the numpy code below, which is their reference (RTXMPI_FUSED=0 forces it).
"""
import math

import numpy as np

from rtxmpi import fused, kernels
from rtxmpi.backend import is_device_array, xp_of
from rtxmpi.kernels import LN_EPS, layernorm_reference

_GELU_K = math.sqrt(2.0 / math.pi)  # tanh-approximation constant (Hendrycks & Gimpel 2016)
_GELU_C = 0.044715


def _accumulate(value, out):
    """Return `value`, or add it into `out` and return `out`."""
    if out is None:
        return value
    out += value
    return out


# ----------------------------------------------------------------------------------- linear
def linear_forward(x, w, b=None):
    """y = x @ w + b.

    x: (..., C_in); w: (C_in, C_out); b: (C_out,) or None. Returns y: (..., C_out), cache.
    """
    c_in, c_out = w.shape
    y = x.reshape(-1, c_in) @ w
    if b is not None:
        y += b
    return y.reshape(x.shape[:-1] + (c_out,)), (x, w, b is not None)


def linear_backward(dy, cache, dw_out=None, db_out=None, defer=None):
    """Gradients of `linear_forward`.

    dy: (..., C_out). Returns dx: (..., C_in), dw: (C_in, C_out), db: (C_out,) or None (no bias).
    dw_out / db_out: arrays to add the gradients into (returned as dw / db).
    defer: None, or a list: only dx is computed now, and a callable that later adds the weight
    and bias gradients into dw_out / db_out (both needed then) is appended to it — the B/W split
    of zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
    dx is on the pipeline's critical path, the weight gradient is not. The same arithmetic as
    without defer, so the result is bitwise the same once the callable ran.
    """
    x, w, has_bias = cache
    c_in, c_out = w.shape
    x2 = x.reshape(-1, c_in)
    dy2 = dy.reshape(-1, c_out)
    dx = (dy2 @ w.T).reshape(x.shape)
    if defer is not None:
        def weight_grads():
            _accumulate(x2.T @ dy2, dw_out)
            if has_bias:
                _accumulate(kernels.column_sums(dy2)[0], db_out)
        defer.append(weight_grads)
        return dx, dw_out, db_out if has_bias else None
    dw = _accumulate(x2.T @ dy2, dw_out)
    db = _accumulate(kernels.column_sums(dy2)[0], db_out) if has_bias else None
    return dx, dw, db


# -------------------------------------------------------------------------------- embedding
def embedding_forward(idx, wte, wpe):
    """Token plus position embedding: x[b, t] = wte[idx[b, t]] + wpe[t].

    idx: (B, T) integer array with ids in [0, V); wte: (V, C); wpe: (T_max, C) with T <= T_max.
    Returns x: (B, T, C) in the dtype of wte, cache.
    """
    T = idx.shape[1]
    x = wte[idx]
    x += wpe[:T]
    return x, (idx, wte.shape, wpe.shape)


def embedding_backward(dx, cache, dwte_out=None, dwpe_out=None):
    """Gradients of `embedding_forward`.

    dx: (B, T, C). Returns dwte: (V, C), dwpe: (T_max, C) (rows >= T get nothing), added into
    dwte_out / dwpe_out when given (see token_embedding_backward for the repeated ids).
    """
    idx, wte_shape, wpe_shape = cache
    dwte = token_embedding_backward(dx, (idx, wte_shape), dwte_out)
    dwpe = position_embedding_backward(dx, wpe_shape, dwpe_out)[1]
    return dwte, dwpe


def token_embedding_forward(idx, wte):
    """x[b, t] = wte[idx[b, t]]. idx: (B, T) integer ids in [0, V); wte: (V, C).
    Returns x: (B, T, C) in the dtype of wte, cache."""
    return wte[idx], (idx, wte.shape)


def token_embedding_backward(dx, cache, dwte_out=None):
    """Gradient of `token_embedding_forward`. dx: (B, T, C). Returns dwte: (V, C), added into
    dwte_out when given. Rows of repeated token ids are summed by a stable sort and a segmented
    sum (`add.reduceat`): no atomics, so the result does not depend on thread timing."""
    idx, wte_shape = cache
    xp = xp_of(dx)
    C = dx.shape[-1]
    dwte = xp.zeros(wte_shape, dx.dtype) if dwte_out is None else dwte_out
    ids = idx.reshape(-1)
    if ids.size:
        order = xp.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        starts = xp.flatnonzero(sorted_ids[1:] != sorted_ids[:-1]) + 1
        starts = xp.concatenate([xp.zeros(1, dtype=starts.dtype), starts])
        dwte[sorted_ids[starts]] += xp.add.reduceat(dx.reshape(-1, C)[order], starts, axis=0)
    return dwte


def position_embedding_forward(x, wpe):
    """y[b, t] = x[b, t] + wpe[t] (learned absolute positions). x: (B, T, C); wpe: (T_max, C),
    T <= T_max. Returns y: (B, T, C) (a new array), cache."""
    return x + wpe[:x.shape[1]], wpe.shape


def position_embedding_backward(dy, cache, dwpe_out=None):
    """Gradients of `position_embedding_forward`. dy: (B, T, C). Returns dx = dy (the same
    array), dwpe: (T_max, C) (rows >= T get nothing), added into dwpe_out when given."""
    xp = xp_of(dy)
    dwpe = xp.zeros(cache, dy.dtype) if dwpe_out is None else dwpe_out
    dwpe[:dy.shape[1]] += dy.sum(axis=0)
    return dy, dwpe


# ---------------------------------------------------------------------------- patch embedding
def patchify(images, patch):
    """Cut images into non-overlapping square patches, row-major over the patch grid.

    images: (B, Hi, Wi, Ci) channels-last, Hi and Wi divisible by patch = P. Returns (B, Np, P*P*Ci);
    inside a patch the values run over (row, column, channel).
    """
    B, Hi, Wi, Ci = images.shape
    grid = images.reshape(B, Hi // patch, patch, Wi // patch, patch, Ci).transpose(0, 1, 3, 2, 4, 5)
    return grid.reshape(B, (Hi // patch) * (Wi // patch), patch * patch * Ci)


def unpatchify(patches, image_shape, patch):
    """Inverse of `patchify`. patches: (B, Np, P*P*Ci); image_shape: (B, Hi, Wi, Ci).
    Returns (B, Hi, Wi, Ci), a new array."""
    B, Hi, Wi, Ci = image_shape
    grid = patches.reshape(B, Hi // patch, Wi // patch, patch, patch, Ci).transpose(0, 1, 3, 2, 4, 5)
    return grid.reshape(image_shape).copy()


def patch_embedding_forward(images, w, b, patch):
    """Patch embedding of a vision transformer (Dosovitskiy et al. 2021): y = patchify(images) @ w + b.

    images: (B, Hi, Wi, Ci); w: (P*P*Ci, C); b: (C,); patch: P. Returns y: (B, Np, C), cache.
    """
    y, cache = linear_forward(patchify(images, patch), w, b)
    return y, (cache, images.shape, patch)


def patch_embedding_backward(dy, cache, dw_out=None, db_out=None):
    """Gradients of `patch_embedding_forward`. dy: (B, Np, C).
    Returns dimages: (B, Hi, Wi, Ci), dw, db (added into dw_out / db_out when given)."""
    lin_cache, image_shape, patch = cache
    dpatches, dw, db = linear_backward(dy, lin_cache, dw_out, db_out)
    return unpatchify(dpatches, image_shape, patch), dw, db


# -------------------------------------------------------------------------------- layernorm
def layernorm_forward(x, g, b, eps=LN_EPS):
    """Layer normalization over the last dim (Ba, Kiros & Hinton 2016).

    x: (..., C); g, b: (C,). y = (x - mean) / sqrt(var + eps) * g + b, biased variance.
    Returns y: (..., C), cache.
    """
    if fused.usable(x, g, b):
        y, xhat, rstd = fused.layernorm_forward(x, g, b, eps)
    else:
        y, xhat, _, rstd = layernorm_reference(x, g, b, eps)
    return y, (xhat, rstd, g)


def residual_layernorm_forward(a, x, g, b, eps=LN_EPS):
    """The residual add of a pre-LN block and the next LayerNorm: x1 = a + x, h = LayerNorm(x1).

    a, x: (..., C) (a, the branch output, is updated in place to x1 on numpy); g, b: (C,).
    Returns x1, h: (..., C), cache (layernorm_forward's: `layernorm_backward` takes it). On cupy
    one fused kernel (rtxmpi.kernels.residual_layernorm_forward), and the cache's xhat is built
    from its mean and rstd; numpy adds in place then normalizes, in one pass with rtxmpi.fused.
    """
    if is_device_array(x):
        x1, h, mean, rstd = kernels.residual_layernorm_forward(a, x, g, b, eps)
        rstd = rstd[..., None]
        xhat = x1 - mean[..., None]
        xhat *= rstd
        return x1, h, (xhat, rstd, g)
    if a.flags.writeable and fused.usable(a, x, g, b):
        h, xhat, rstd = fused.layernorm_forward(a, g, b, eps, residual=x)
        return a, h, (xhat, rstd, g)
    a += x
    h, cache = layernorm_forward(a, g, b, eps)
    return a, h, cache


def layernorm_backward(dy, cache, dg_out=None, db_out=None):
    """Gradients of `layernorm_forward`.

    dy: (..., C). Returns dx: (..., C), dg: (C,), db: (C,), added into dg_out / db_out when given.
    """
    xhat, rstd, g = cache
    if fused.usable(dy, xhat, rstd, g):
        dx, dg, db = fused.layernorm_backward(dy, xhat, rstd, g)
    else:  # one fused kernel and the column sums on cupy, the reference elsewhere
        dx, dg, db = kernels.layernorm_backward(dy, xhat, rstd, g)
    return dx, _accumulate(dg, dg_out), _accumulate(db, db_out)


# ------------------------------------------------------------------------------------- gelu
def gelu_forward(x):
    """GELU, tanh approximation (Hendrycks & Gimpel 2016), as in GPT-2.

    y = x * a with a = 0.5 * (1 + tanh(k * (x + 0.044715 * x^3))), k = sqrt(2 / pi).
    x: any shape. Returns y (same shape), cache.
    """
    xp = xp_of(x)
    a = x * x
    a *= _GELU_K * _GELU_C
    a += _GELU_K
    a *= x  # k * (x + c x^3)
    xp.tanh(a, out=a)
    a += 1.0
    a *= 0.5
    return x * a, (x, a)


def gelu_backward(dy, cache):
    """Gradient of `gelu_forward`. dy: same shape as x. Returns dx."""
    xp = xp_of(dy)
    x, a = cache
    # with tanh = 2a - 1:  dy/dx = a + x * k (1 + 3c x^2) * (1 - tanh^2) / 2
    #                            = a * (1 + 2k x (1 + 3c x^2) * (1 - a))
    dx = x * x
    dx *= 6.0 * _GELU_K * _GELU_C
    dx += 2.0 * _GELU_K
    dx *= x
    one_minus_a = xp.subtract(1.0, a)
    dx *= one_minus_a
    dx += 1.0
    dx *= a
    dx *= dy
    return dx


def bias_gelu_forward(h, b):
    """y = GELU(h + b): the bias of the linear before it, then the activation.

    h: (..., F) (updated in place to h + b on numpy); b: (F,). Returns y: (..., F), cache. On
    cupy one fused kernel (rtxmpi.kernels.bias_gelu_forward; the cache keeps u = h + b and the
    backward recomputes the gate); on numpy the in-place add then `gelu_forward`, the same
    operations as `linear_forward(x, w, b)` then `gelu_forward` (bit for bit), or one pass of
    rtxmpi.fused (the cache as cupy's).
    """
    if is_device_array(h):
        u, y = kernels.bias_gelu_forward(h, b)
        return y, (u, None)
    if fused.usable(h, b):
        return fused.bias_gelu_forward(h, b), (h, None)
    h += b
    return gelu_forward(h)


def bias_gelu_backward(dy, cache, db_out=None):
    """Gradients of `bias_gelu_forward`. dy: (..., F). Returns dh: (..., F) (= d(h + b)) and
    db: (F,), added into db_out when given. cupy: one fused kernel, then the bias-gradient sum."""
    if cache[1] is None and fused.usable(dy, cache[0]):
        dh, db = fused.bias_gelu_backward(dy, cache[0])
    elif cache[1] is None:
        dh, db = kernels.bias_gelu_backward(dy, cache[0])
    else:
        dh = gelu_backward(dy, cache)
        db = dh.reshape(-1, dh.shape[-1]).sum(axis=0)
    return dh, _accumulate(db, db_out)


# --------------------------------------------------------------------------------- softmax
def softmax_forward(x):
    """Numerically stable softmax over the last dim (max subtracted first). Returns a new array."""
    return kernels.softmax_forward(x.copy())


# ------------------------------------------------------------------------------- attention
def _heads(qkv, n_head):
    """(B, T, 3C) -> q, k, v views of shape (B, H, T, hs); columns of qkv are [q | k | v], and
    inside each block head h owns columns h*hs : (h+1)*hs."""
    B, T, C3 = qkv.shape
    hs = C3 // (3 * n_head)
    return qkv.reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)


def masked_softmax_forward(att, causal=True):
    """The attention probabilities from the scores, in place: att <- softmax(att [+ causal
    mask]) over the last dim. att: (..., T, T) scores (query rows, key columns); causal: mask
    the keys after each query. Returns att. One pass on numpy (rtxmpi.fused) and on cupy
    (rtxmpi.kernels)."""
    if fused.usable(att) and att.ndim >= 2 and (not causal or att.shape[-2] == att.shape[-1]):
        return fused.softmax_forward(att, causal)
    return kernels.softmax_forward(att, causal)


def softmax_backward(datt, att):
    """Gradient of a softmax over the last dim from its output: ds = att * (datt - sum(datt *
    att, -1)). datt, att: (..., T); datt is overwritten (scratch). Returns ds: a new array, or
    datt itself (rtxmpi.fused, rtxmpi.kernels on cupy)."""
    if datt.shape == att.shape and fused.usable(datt, att):
        return fused.softmax_backward(datt, att)
    return kernels.softmax_backward(datt, att)


def attention_core_forward(q, k, v, causal=True, out=None):
    """Scaled dot-product attention on split heads (Vaswani et al. 2017): y = softmax(q k^T /
    sqrt(hs) [+ causal mask]) v, what `attention_forward` computes between its projections.

    q, k, v: (B, H, T, hs); causal: as in `attention_forward`; out: None or a (B, H, T, hs)
    array (a view may be strided) to write y into. Returns y: (B, H, T, hs), cache (the scaled
    q, k, v and the (B, H, T, T) probabilities).
    """
    xp = xp_of(q)
    q = q * (1.0 / math.sqrt(q.shape[-1]))  # scaled copy (the cache keeps it for dk)
    att = q @ k.swapaxes(-1, -2)  # (B, H, T, T)
    masked_softmax_forward(att, causal)
    return xp.matmul(att, v, out=out), (q, k, v, att)


def attention_core_backward(dy, cache, out=None):
    """Gradients of `attention_core_forward`. dy: (B, H, T, hs); out: None or (dq, dk, dv)
    arrays (views may be strided) to write into. Returns dq, dk, dv: (B, H, T, hs)."""
    q, k, v, att = cache
    xp = xp_of(dy)
    dq, dk, dv = out if out is not None else (None,) * 3
    dv = xp.matmul(att.swapaxes(-1, -2), dy, out=dv)
    ds = softmax_backward(dy @ v.swapaxes(-1, -2), att)  # (B, H, T, T)
    dq = xp.matmul(ds, k, out=dq)
    dq *= 1.0 / math.sqrt(q.shape[-1])
    dk = xp.matmul(ds.swapaxes(-1, -2), q, out=dk)  # q is already scaled
    return dq, dk, dv


def attention_forward(x, w_qkv, b_qkv, w_proj, b_proj, n_head, causal=True):
    """Multi-head self-attention (Vaswani et al. 2017) with a fused qkv projection.

    x: (B, T, C); w_qkv: (C, 3C), b_qkv: (3C,) with columns [q | k | v], heads contiguous inside
    each; w_proj: (C, C), b_proj: (C,); n_head: H, dividing C; causal: True masks the future
    positions (a decoder), False lets every position see every other (an encoder, e.g. a ViT).
    att = softmax(q k^T / sqrt(hs) [+ causal mask]); y = concat_h(att v) @ w_proj + b_proj.
    Returns y: (B, T, C), cache (holds the (B, H, T, T) attention probabilities).
    `attention_backward` serves both: the mask only shapes att.
    """
    xp = xp_of(x)
    B, T, C = x.shape
    hs = C // n_head
    qkv, qkv_cache = linear_forward(x, w_qkv, b_qkv)  # (B, T, 3C)
    q, k, v = _heads(qkv, n_head)  # (B, H, T, hs) each, views
    yh = xp.empty((B, T, n_head, hs), dtype=x.dtype)
    # (B, H, T, hs) written as (B, T, H, hs); q comes back scaled (the cache keeps it for dk)
    _, (q, k, v, att) = attention_core_forward(q, k, v, causal, out=yh.transpose(0, 2, 1, 3))
    y, proj_cache = linear_forward(yh.reshape(B, T, C), w_proj, b_proj)
    return y, (qkv_cache, q, k, v, att, proj_cache, n_head)


def attention_backward(dy, cache, dparams=None):
    """Gradients of `attention_forward`.

    dy: (B, T, C). dparams: None or a sequence (dw_qkv, db_qkv, dw_proj, db_proj) to add into.
    Returns dx: (B, T, C), (dw_qkv, db_qkv, dw_proj, db_proj).
    """
    qkv_cache, q, k, v, att, proj_cache, n_head = cache
    xp = xp_of(dy)
    dw_qkv, db_qkv, dw_proj, db_proj = dparams if dparams is not None else (None,) * 4
    B, T, C = dy.shape
    hs = C // n_head
    dyh, dw_proj, db_proj = linear_backward(dy, proj_cache, dw_proj, db_proj)
    dyh = dyh.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)  # (B, H, T, hs)
    dqkv = xp.empty((B, T, 3, n_head, hs), dtype=dy.dtype)
    # dq, dk, dv: (B, H, T, hs) views into dqkv
    attention_core_backward(dyh, (q, k, v, att), out=tuple(dqkv.transpose(2, 0, 3, 1, 4)))
    dx, dw_qkv, db_qkv = linear_backward(dqkv.reshape(B, T, 3 * C), qkv_cache, dw_qkv, db_qkv)
    return dx, (dw_qkv, db_qkv, dw_proj, db_proj)


# ------------------------------------------------------------------------------------- mlp
def mlp_forward(x, w_fc, b_fc, w_proj, b_proj):
    """Position-wise MLP: y = gelu(x @ w_fc + b_fc) @ w_proj + b_proj.

    x: (B, T, C); w_fc: (C, 4C), b_fc: (4C,); w_proj: (4C, C), b_proj: (C,).
    Returns y: (B, T, C), cache. The fc bias goes with the GELU (`bias_gelu_forward`: one fused
    kernel on cupy).
    """
    h, fc_cache = linear_forward(x, w_fc)
    a, gelu_cache = bias_gelu_forward(h, b_fc)
    y, proj_cache = linear_forward(a, w_proj, b_proj)
    return y, (fc_cache, gelu_cache, proj_cache)


def mlp_backward(dy, cache, dparams=None, defer=None):
    """Gradients of `mlp_forward`.

    dy: (B, T, C). dparams: None or (dw_fc, db_fc, dw_proj, db_proj) to add into.
    defer: None or a list: the two linears' weight gradients (and the proj bias's) are deferred
    into it (see linear_backward; dparams needed then); the fc bias gradient comes with dh.
    Returns dx: (B, T, C), (dw_fc, db_fc, dw_proj, db_proj).
    """
    fc_cache, gelu_cache, proj_cache = cache
    dw_fc, db_fc, dw_proj, db_proj = dparams if dparams is not None else (None,) * 4
    da, dw_proj, db_proj = linear_backward(dy, proj_cache, dw_proj, db_proj, defer=defer)
    dh, db_fc = bias_gelu_backward(da, gelu_cache, db_fc)
    dx, dw_fc, _ = linear_backward(dh, fc_cache, dw_fc, defer=defer)
    return dx, (dw_fc, db_fc, dw_proj, db_proj)


# ----------------------------------------------------------------------------------- block
# Parameter order inside a block (forward order); shapes for C channels.
BLOCK_PARAM_NAMES = ("ln1.g", "ln1.b", "attn.w_qkv", "attn.b_qkv", "attn.w_proj", "attn.b_proj",
                     "ln2.g", "ln2.b", "mlp.w_fc", "mlp.b_fc", "mlp.w_proj", "mlp.b_proj")


def block_param_shapes(C):
    """[(name, shape, decay)] for one block, in BLOCK_PARAM_NAMES order. Matrices decay; biases
    and LayerNorm parameters do not."""
    shapes = ((C,), (C,), (C, 3 * C), (3 * C,), (C, C), (C,),
              (C,), (C,), (C, 4 * C), (4 * C,), (4 * C, C), (C,))
    return [(name, shape, len(shape) == 2) for name, shape in zip(BLOCK_PARAM_NAMES, shapes)]


def block_forward(x, params, n_head, causal=True):
    """Pre-LN transformer block (GPT-2): x = x + attn(ln1(x)); x = x + mlp(ln2(x)).

    x: (B, T, C); params: sequence of 12 arrays in BLOCK_PARAM_NAMES order (shapes from
    `block_param_shapes(C)`); n_head: H; causal: as in `attention_forward`. Returns y: (B, T, C),
    cache. On cupy the residual add
    and ln2 are one fused kernel (rtxmpi.kernels.residual_layernorm_forward), and the MLP's bias
    and GELU another (`mlp_forward`); numpy computes the same operations unfused.
    """
    g1, b1, w_qkv, b_qkv, w_aproj, b_aproj, g2, b2, w_fc, b_fc, w_mproj, b_mproj = params
    h1, ln1_cache = layernorm_forward(x, g1, b1)
    a, attn_cache = attention_forward(h1, w_qkv, b_qkv, w_aproj, b_aproj, n_head, causal)
    x1, h2, ln2_cache = residual_layernorm_forward(a, x, g2, b2)  # x1 = x + attn(ln1(x))
    y, mlp_cache = mlp_forward(h2, w_fc, b_fc, w_mproj, b_mproj)
    y += x1
    return y, (ln1_cache, attn_cache, ln2_cache, mlp_cache)


def block_backward(dy, cache, dparams=None, ready=None, defer=None):
    """Gradients of `block_forward`.

    dy: (B, T, C). dparams: None or 12 arrays (BLOCK_PARAM_NAMES order) to add into.
    ready: optional callable ready(j), called once per local parameter index j (0..11) as soon as
    that gradient is final, in the order 11, 10, ..., 0.
    defer: None or a list: the MLP's weight and bias gradients (j = 8..11, two thirds of the
    block's weight-gradient FLOPs) are deferred into it (see linear_backward; dparams needed
    then) and ready is not called for them.
    Returns dx: (B, T, C), tuple of the 12 gradients.
    """
    ln1_cache, attn_cache, ln2_cache, mlp_cache = cache
    d = list(dparams) if dparams is not None else [None] * 12
    notify = ready if ready is not None else (lambda j: None)

    dh2, d[8:12] = mlp_backward(dy, mlp_cache, d[8:12], defer=defer)
    for j in (11, 10, 9, 8) if defer is None else ():
        notify(j)
    dx1, d[6], d[7] = layernorm_backward(dh2, ln2_cache, d[6], d[7])
    notify(7)
    notify(6)
    dx1 += dy  # residual
    dh1, d[2:6] = attention_backward(dx1, attn_cache, d[2:6])
    for j in (5, 4, 3, 2):
        notify(j)
    dx, d[0], d[1] = layernorm_backward(dh1, ln1_cache, d[0], d[1])
    notify(1)
    notify(0)
    dx += dx1  # residual
    return dx, tuple(d)


# ------------------------------------------------------------------------------ mean pool
def mean_pool_forward(x):
    """Mean over the sequence: y[b] = mean_t x[b, t] (a classifier's pooling over patches).
    x: (B, T, C). Returns y: (B, C), cache."""
    return x.mean(axis=1), x.shape


def mean_pool_backward(dy, cache):
    """Gradient of `mean_pool_forward`. dy: (B, C). Returns dx: (B, T, C), a new array."""
    xp = xp_of(dy)
    B, T, C = cache
    dx = xp.empty(cache, dy.dtype)
    dx[...] = (dy * (1.0 / T))[:, None, :]
    return dx


# ---------------------------------------------------------------------------- cross-entropy
def crossentropy_forward(logits, targets):
    """Mean cross-entropy in nats over all N positions, via a stable log-softmax.

    logits: (B, T, V) float (N = B*T), or (B, K) with one label per sample (N = B); targets:
    integer ids in [0, V), shaped as logits without the last dim.
    Returns loss: 0-d array of the logits' dtype (call float() for a Python number), cache (holds
    the (N, V) softmax probabilities).
    """
    xp = xp_of(logits)
    V = logits.shape[-1]
    l2 = logits.reshape(-1, V)
    if fused.usable(l2):
        tgt = fused.targets_int64(targets)
        probs, nll = fused.crossentropy_forward(l2, tgt)
        return nll.mean(), (probs, tgt, logits.shape)
    tgt = targets.reshape(-1)
    rows = xp.arange(l2.shape[0])
    m = l2.max(axis=1, keepdims=True)
    probs = l2 - m
    target_shifted = probs[rows, tgt]  # logit[target] - max
    xp.exp(probs, out=probs)
    s = probs.sum(axis=1, keepdims=True)
    probs /= s
    nll = xp.log(s[:, 0])
    nll -= target_shifted  # -log p[target] = log(sum exp(l - max)) - (l[target] - max)
    return nll.mean(), (probs, tgt, logits.shape)


def crossentropy_backward(dloss, cache):
    """Gradient of `crossentropy_forward` times `dloss`.

    dloss: Python float, the scale of the loss (1.0 for the plain gradient; 1/k to average k
    micro-batches). Returns dlogits, shaped as the logits, = dloss * (softmax - onehot(targets)) / N.
    """
    probs, tgt, shape = cache
    N = probs.shape[0]
    c = float(dloss) / N
    if fused.usable(probs) and tgt.dtype == np.int64 and tgt.flags.c_contiguous:
        return fused.crossentropy_backward(probs, tgt, c).reshape(shape)
    xp = xp_of(probs)
    dlogits = probs * c
    dlogits[xp.arange(N), tgt] -= c
    return dlogits.reshape(shape)
