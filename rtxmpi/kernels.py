"""Fused kernels: CUDA sources in `kernels/*.cu`, each with a numpy reference of identical semantics.

Every public function here takes numpy or cupy arrays and dispatches on `xp_of`:

- numpy arrays run the reference, written with whole-array operations in a fixed order, or its
  one-pass CPU twin in `rtxmpi.fused` (bit for bit for AdamW and the epilogue's scale) when
  `fused.usable` accepts the arrays. The CPU training path calls these (AdamW in
  `rtxmpi.nn.optim`, the data-parallel epilogue in `rtxmpi.parallel.data`), so the parity tests
  of those layers exercise them.
- cupy float32 arrays (contiguous) run the CUDA kernel, compiled on first use with
  `cupy.RawModule` (NVRTC) for the current device and cached per device. Other dtypes and
  layouts run the same reference on cupy (correct, not fused).

| function | kernel (kernels/) | semantics versus the reference |
|---|---|---|
| `grad_epilogue` | grad_epilogue.cu | bit for bit (one multiply, RNE casts) |
| `adamw_step` | adamw.cu | bit for bit in float32 (no FMA, IEEE sqrt and divide) |
| `bias_gelu_forward` / `_backward` | bias_gelu.cu | a few ulp (CUDA tanhf vs libm tanh) |
| `residual_layernorm_forward` | residual_layernorm.cu | float32 rounding (tree-ordered sums) |
| `softmax_forward` / `_backward` | softmax.cu | float32 rounding (expf, tree-ordered sums) |
| `layernorm_backward`, `column_sums` | layernorm_backward.cu | float32 rounding (sums in a fixed order: deterministic) |

The kernel sources are compiled by the test suite with `nvcc -arch=sm_80` and `sm_90` and with
NVRTC (tests/unit/test_kernels_compile.py), so a kernel that does not compile never lands. Where
the kernels live: `$RTXMPI_KERNEL_DIR`, else `kernels/` next to the `rtxmpi` package.

Sources: AdamW (Loshchilov & Hutter 2019; Kingma & Ba 2015), GELU tanh approximation (Hendrycks &
Gimpel 2016), LayerNorm (Ba, Kiros & Hinton 2016), attention softmax (Vaswani et al. 2017); mixed-precision loss scaling's non-finite
check (Micikevicius et al. 2018).
"""
import math
import os
import threading

import numpy as np

from . import fused
from .backend import bfloat16, cupy_module, xp_of

GELU_K = math.sqrt(2.0 / math.pi)  # tanh-approximation constant, as rtxmpi.nn.layers
GELU_C = 0.044715
LN_EPS = 1e-5

# kernel file -> the extern "C" functions rtxmpi launches from it
KERNEL_FUNCTIONS = {
    "grad_epilogue": ("grad_epilogue_f32", "grad_epilogue_f32x4"),
    "adamw": ("adamw_f32", "adamw_f32x4"),
    "bias_gelu": ("bias_gelu_forward_f32", "bias_gelu_backward_f32"),
    "residual_layernorm": ("residual_layernorm_forward_f32",),
    "softmax": ("softmax_forward_f32", "softmax_backward_f32"),
    "layernorm_backward": ("layernorm_backward_dx_f32", "column_sums_f32"),
}
KERNEL_FILES = tuple(KERNEL_FUNCTIONS)
THREADS = 256
_INCLUDE = '#include "common.cuh"'
_modules = {}  # (kernel file, device id) -> cupy.RawModule
_lock = threading.Lock()


# ------------------------------------------------------------------------------ the sources
def kernel_dir():
    """Directory holding kernels/*.cu: $RTXMPI_KERNEL_DIR, else <repository>/kernels."""
    env = os.environ.get("RTXMPI_KERNEL_DIR")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")


def kernel_source(name):
    """The CUDA source of kernels/<name>.cu as handed to NVRTC: common.cuh inlined in place of its
    #include (NVRTC then needs no include path). Raises FileNotFoundError naming the directory."""
    directory = kernel_dir()
    path = os.path.join(directory, name + ".cu")
    if not os.path.exists(path):
        raise FileNotFoundError(f"CUDA kernel source {path} not found; set RTXMPI_KERNEL_DIR to "
                                "the directory holding rtxmpi's kernels/*.cu")
    with open(path) as f:
        source = f.read()
    with open(os.path.join(directory, "common.cuh")) as f:
        common = f.read().replace("#pragma once", "")
    return source.replace(_INCLUDE, common)


def _kernel(name, function):
    """cupy.RawKernel `function` of kernels/<name>.cu for the current device (compiled once)."""
    if function not in KERNEL_FUNCTIONS[name]:
        raise KeyError(f"{function} is not a kernel of kernels/{name}.cu")
    cp = cupy_module()
    key = (name, cp.cuda.Device().id)
    module = _modules.get(key)
    if module is None:
        with _lock:
            module = _modules.get(key)
            if module is None:
                module = cp.RawModule(code=kernel_source(name), options=("-std=c++17",))
                _modules[key] = module
    return module.get_function(function)


def _grid(n_items):
    cp = cupy_module()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    return (max(1, min(-(-n_items // THREADS), sms * 32)),), (THREADS,)


def _fused_ok(*arrays):
    """True when every array is a C-contiguous float32 cupy array (the kernels' only layout)."""
    return all(a is not None and not isinstance(a, np.ndarray) and a.dtype == np.float32
               and a.flags.c_contiguous for a in arrays)


def _row_threads(C):
    """Threads per block of the one-row-per-block kernels: about 4 columns each, 32 to 1024."""
    return min(1024, max(32, 32 * -(-min(C, 1024) // 128)))


def _aligned16(*arrays):
    return all(a.data.ptr % 16 == 0 for a in arrays if a is not None)


# ------------------------------------------------------------------------ (a) grad epilogue
_CASTS = {None: 0, "float16": 1, "bfloat16": 2}


def grad_epilogue(grad, scale, cast=None):
    """After the gradient all_reduce: scale in place, flag non-finite values, optionally cast.

    grad: floating array (any shape), updated IN PLACE to grad * scale (scale rounded to grad's
    dtype first; e.g. 1 / dp_world_size for the data-parallel average).
    cast: None, "float16" or "bfloat16": also return a rounded (nearest-even) copy. On numpy the
    bfloat16 copy has ml_dtypes' bfloat16 dtype; on cupy (no bfloat16 dtype) it is a uint16 array
    of bfloat16 bit patterns (view it as ml_dtypes.bfloat16 after `cupy.asnumpy`).
    Returns (out, nonfinite): out is grad itself (cast None) or the new cast array; nonfinite a
    0-d bool array of grad's module, True when any scaled value, or any cast value, is inf or NaN
    (a float16 cast overflows above 65504). Local: no collective (agree on the flag across ranks
    before acting on it). Raises ValueError (unknown cast), TypeError (non-floating grad; bfloat16
    on numpy without ml_dtypes).
    """
    if cast not in _CASTS:
        raise ValueError(f"grad_epilogue: cast must be None, 'float16' or 'bfloat16', got {cast!r}")
    xp = xp_of(grad)
    if grad.dtype.kind != "f":
        raise TypeError(f"grad_epilogue: grad must be a floating array, got {grad.dtype}")
    if xp is not np and _fused_ok(grad):
        return _grad_epilogue_gpu(xp, grad, scale, cast)
    if cast is None and fused.usable(grad):
        return grad, np.asarray(fused.grad_scale(grad, scale), dtype=bool)
    grad *= grad.dtype.type(scale)
    nonfinite = not _all_finite(xp, grad)
    out = grad
    if cast is not None:
        if cast == "bfloat16" and xp is np and bfloat16 is None:
            raise TypeError("grad_epilogue: cast='bfloat16' on numpy needs the ml_dtypes package")
        if xp is np:
            with np.errstate(over="ignore"):  # an overflow is what the flag reports
                out = grad.astype(np.float16 if cast == "float16" else bfloat16)
            nonfinite = nonfinite or not bool(np.isfinite(out.astype(np.float32)).all())
        else:  # cupy without the fused kernel (non-float32 or strided grad)
            out, bad = _cast_on_device(xp, grad, cast)
            nonfinite = nonfinite or bad
    return out, xp.asarray(nonfinite, dtype=bool)


def _all_finite(xp, a):
    """True when every element of the floating array `a` (numpy or cupy, any shape) is finite.

    Exact: a finite sum proves every element finite (inf and NaN propagate into any sum); only
    when the sum is not finite (a non-finite element, or an overflowing sum) check elementwise.
    Returns a Python bool (on cupy: one device sync). Local."""
    if a.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum only means: look closer
        total = a.sum(dtype=a.dtype)
    if bool(xp.isfinite(total)):
        return True
    return bool(xp.isfinite(a).all())


def _cast_on_device(xp, grad, cast):
    """grad (cupy floating array, any shape) rounded to `cast` ("float16" or "bfloat16", nearest
    even, via float32) on the device. Returns (out, nonfinite): out of grad's shape, float16, or
    uint16 bfloat16 bit patterns (NaN stays a quiet NaN); nonfinite a Python bool, True when any
    rounded value is inf or NaN (a float16 overflow above 65504 included). Local."""
    value = grad.astype(xp.float32)
    if cast == "float16":
        out = value.astype(xp.float16)
        return out, not bool(xp.isfinite(out).all())
    bits = value.view(xp.uint32)  # round to nearest even on the upper 16 bits; NaN stays NaN
    rounded = ((bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    nan = xp.isnan(value)
    out = xp.where(nan, ((bits >> 16) | xp.uint32(0x40)).astype(xp.uint16), rounded)
    return out, bool(((out & 0x7F80) == 0x7F80).any())


def _grad_epilogue_gpu(cp, grad, scale, cast):
    """grad_epilogue's fused kernel (kernels/grad_epilogue.cu): one pass that scales the
    C-contiguous float32 cupy `grad` in place by float32(scale), writes the optional cast copy
    (kind 1 float16, 2 bfloat16 bits as uint16) and raises a device flag on any non-finite
    scaled or cast value. Returns (out, nonfinite): out is grad (cast None) or the cast array;
    nonfinite a 0-d cupy bool array (no host sync). Local; on the current stream."""
    n = grad.size
    flag = cp.zeros((), cp.int32)
    kind = _CASTS[cast]
    out = cp.empty(grad.shape, cp.uint16) if kind else flag
    vec = _aligned16(grad) and (not kind or out.data.ptr % 8 == 0)
    name = "grad_epilogue_f32x4" if vec else "grad_epilogue_f32"
    grid, block = _grid(-(-n // 4) if vec else n)
    if n:
        _kernel("grad_epilogue", name)(grid, block, (grad, out, flag, np.int64(n),
                                                     np.float32(scale), np.int32(kind)))
    if kind == 1:
        out = out.view(cp.float16)
    return (out if kind else grad), flag.astype(bool)


# ------------------------------------------------------------------------------- (b) AdamW
def adamw_step(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decay_mask=None,
               tmp=None):
    """One AdamW update in place (the update of `rtxmpi.nn.AdamW.step`, which calls this):

        m = b1 (m - g) + g;   v = b2 (v - g^2) + g^2
        p = p (1 - lr wd)                  (no mask; skipped when wd or lr is 0)
        p = p - lr wd (mask p)             (with decay_mask)
        p = p - m / (sqrt(v) + eps sqrt(1 - b2^t)) * lr sqrt(1 - b2^t) / (1 - b1^t)

    the last line being Adam's lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps) rearranged so no
    temporary is divided twice. p, m, v: 1-D float arrays of one length and dtype (updated in
    place); g: same length, any float dtype; decay_mask: None or 1-D, p's dtype, 1 where decay
    applies; step: t >= 1, the 1-based count of updates including this one; tmp: optional scratch
    array like p (the reference allocates one otherwise). Python-float hyper-parameters are
    rounded to p's dtype once. float32 cupy arrays run kernels/adamw.cu in one pass, bit for bit
    equal to this reference. Local: no collective. Inputs are validated by rtxmpi.nn.AdamW.
    """
    b1, b2 = float(beta1), float(beta2)
    lr, wd = float(lr), float(weight_decay)
    sqrt_bias2 = math.sqrt(1.0 - b2 ** step)
    eps_term = float(eps) * sqrt_bias2
    step_size = lr * sqrt_bias2 / (1.0 - b1 ** step)
    decay_mode = 0 if not (wd and lr) else (1 if decay_mask is None else 2)
    xp = xp_of(p)
    if xp is not np and _fused_ok(p, g, m, v) and (decay_mode != 2 or _fused_ok(decay_mask)):
        n = p.size
        vec = _aligned16(p, g, m, v, decay_mask if decay_mode == 2 else None)
        grid, block = _grid(-(-n // 4) if vec else n)
        if n:
            _kernel("adamw", "adamw_f32x4" if vec else "adamw_f32")(
                grid, block, (p, g, m, v, decay_mask if decay_mode == 2 else p, np.int64(n),
                              np.float32(b1), np.float32(b2), np.float32(1.0 - lr * wd),
                              np.float32(lr * wd), np.float32(eps_term), np.float32(step_size),
                              np.int32(decay_mode)))
        return p
    if fused.usable(p, g, m, v) and (decay_mode != 2 or fused.usable(p, decay_mask)):
        return fused.adamw(p, g, m, v, decay_mask, b1, b2, 1.0 - lr * wd, lr * wd, eps_term,
                           step_size, decay_mode)
    if tmp is None:
        tmp = xp.empty_like(p)
    m -= g  # m = b1 m + (1 - b1) g  =  b1 (m - g) + g, without a temporary
    m *= b1
    m += g
    xp.multiply(g, g, out=tmp)  # v = b2 v + (1 - b2) g^2  =  b2 (v - g^2) + g^2
    v -= tmp
    v *= b2
    v += tmp
    if decay_mode == 1:
        p *= 1.0 - lr * wd
    elif decay_mode == 2:  # p -= lr * wd * mask * p
        xp.multiply(decay_mask, p, out=tmp)
        tmp *= lr * wd
        p -= tmp
    xp.sqrt(v, out=tmp)
    tmp += eps_term
    xp.divide(m, tmp, out=tmp)
    tmp *= step_size
    p -= tmp
    return p


# ---------------------------------------------------------------------------- (c) bias+GELU
def _gelu_gate(xp, u):
    """a = 0.5 (1 + tanh(k (u + c u^3))), in rtxmpi.nn.layers.gelu_forward's operation order."""
    a = u * u
    a *= GELU_K * GELU_C
    a += GELU_K
    a *= u
    xp.tanh(a, out=a)
    a += 1.0
    a *= 0.5
    return a


def bias_gelu_forward(h, b):
    """u = h + b (bias broadcast over rows); y = GELU(u), tanh approximation (as GPT-2).

    h: (..., C) float; b: (C,) same dtype. Returns (u, y), both h's shape and dtype: u is the
    pre-activation `bias_gelu_backward` needs. Equal to rtxmpi.nn.layers.gelu_forward(h + b)
    bit for bit on numpy; float32 cupy arrays run kernels/bias_gelu.cu (a few ulp: tanhf).
    Local. Raises ValueError when b's length is not h's last dim.
    """
    _check_bias(h, b)
    xp = xp_of(h)
    if xp is not np and _fused_ok(h, b):
        u, y = xp.empty_like(h), xp.empty_like(h)
        if h.size:
            _kernel("bias_gelu", "bias_gelu_forward_f32")(
                *_grid(h.size), (h, b, u, y, np.int64(h.size), np.int64(b.size),
                                 np.float32(GELU_K * GELU_C), np.float32(GELU_K)))
        return u, y
    u = h + b
    return u, u * _gelu_gate(xp, u)


def bias_gelu_backward(dy, u):
    """Gradients of `bias_gelu_forward` from its pre-activation u.

    dy, u: (..., C) same shape and dtype. Returns (du, db): du = dL/du = dL/dh (u's shape), db =
    du summed over every row, (C,). du equals rtxmpi.nn.layers.gelu_backward bit for bit on numpy.
    Local. Raises ValueError when shapes differ.
    """
    if dy.shape != u.shape or u.ndim == 0:
        raise ValueError(f"bias_gelu_backward: dy {tuple(dy.shape)} and u {tuple(u.shape)} must "
                         "have the same shape, at least 1-D")
    xp = xp_of(u)
    C = u.shape[-1]
    if xp is not np and _fused_ok(dy, u):
        du = xp.empty_like(u)
        if u.size:
            _kernel("bias_gelu", "bias_gelu_backward_f32")(
                *_grid(u.size), (dy, u, du, np.int64(u.size), np.float32(GELU_K * GELU_C),
                                 np.float32(GELU_K), np.float32(6.0 * GELU_K * GELU_C),
                                 np.float32(2.0 * GELU_K)))
    else:
        a = _gelu_gate(xp, u)
        du = u * u
        du *= 6.0 * GELU_K * GELU_C
        du += 2.0 * GELU_K
        du *= u
        du *= xp.subtract(1.0, a)
        du += 1.0
        du *= a
        du *= dy
    return du, column_sums(du.reshape(-1, C))[0]


def _check_bias(h, b):
    if h.ndim == 0 or b.shape != (h.shape[-1],):
        raise ValueError(f"bias of shape {tuple(b.shape)} does not match the last dim of "
                         f"{tuple(h.shape)}; expected ({h.shape[-1] if h.ndim else '?'},)")


# ------------------------------------------------------------------- (d) residual+LayerNorm
def residual_layernorm_forward(x, r, g, b, eps=LN_EPS):
    """s = x + r (the residual stream); y = LayerNorm(s) over the last dim, biased variance.

    x, r: (..., C) same shape and dtype; g, b: (C,). Returns (s, y, mean, rstd): s and y x's
    shape; mean and rstd x.shape[:-1] (rstd = 1 / sqrt(var + eps)). On numpy, y equals
    rtxmpi.nn.layers.layernorm_forward(x + r, g, b, eps)'s numpy reference bit for bit (within
    float rounding when that layer runs rtxmpi.fused) (its cache's xhat is
    (s - mean) * rstd); float32 cupy arrays run kernels/residual_layernorm.cu, one block per row,
    equal to float32 rounding. Local. Raises ValueError for mismatched shapes.
    """
    if x.shape != r.shape or x.ndim == 0:
        raise ValueError(f"residual_layernorm_forward: x {tuple(x.shape)} and r "
                         f"{tuple(r.shape)} must have the same shape, at least 1-D")
    _check_bias(x, g)
    _check_bias(x, b)
    xp = xp_of(x)
    C = x.shape[-1]
    if xp is not np and _fused_ok(x, r, g, b) and C > 0:
        rows = x.size // C
        s, y = xp.empty_like(x), xp.empty_like(x)
        mean, rstd = xp.empty(x.shape[:-1], xp.float32), xp.empty(x.shape[:-1], xp.float32)
        if rows:
            _kernel("residual_layernorm", "residual_layernorm_forward_f32")(
                (rows,), (_row_threads(C),), (x, r, g, b, s, y, mean, rstd, np.int32(C), np.float32(eps)))
        return s, y, mean, rstd
    s = x + r
    y, _, mean, rstd = layernorm_reference(s, g, b, eps)
    return s, y, mean[..., 0], rstd[..., 0]


def layernorm_reference(x, g, b, eps=LN_EPS):
    """LayerNorm over the last dim with biased variance, in x's dtype (the numpy reference).

    x: (..., C); g, b: (C,). Returns (y, xhat, mean, rstd): y and xhat x's shape, mean and rstd
    (..., 1) with rstd = 1 / sqrt(var + eps). rtxmpi.nn.layers.layernorm_forward is this function.
    """
    xp = xp_of(x)
    mean = x.mean(axis=-1, keepdims=True)
    xhat = x - mean
    var = (xhat * xhat).mean(axis=-1, keepdims=True)
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.reciprocal(rstd, out=rstd)
    xhat *= rstd
    y = xhat * g
    y += b
    return y, xhat, mean, rstd


# ------------------------------------------------------------------------------ (e) softmax
_MAX_ROWS = 2**31 - 1  # grid.x limit of the one-row-per-block kernels


def softmax_forward(att, causal=False):
    """att <- softmax(att [+ causal mask]) over the last dim, in place, max subtracted first.

    att: (..., T) float; causal: att holds (..., T, T) scores (query rows, key columns) and row i
    of each (T, T) block keeps keys 0..i (the others become 0). Returns att. Float32 cupy arrays
    run kernels/softmax.cu (float32 rounding: expf, tree-ordered sums); others the reference,
    whole-array operations. Local. Raises ValueError when causal and the last two dims differ.
    """
    if causal and (att.ndim < 2 or att.shape[-2] != att.shape[-1]):
        raise ValueError(f"softmax_forward: a causal mask needs (..., T, T) scores, got "
                         f"{tuple(att.shape)}")
    xp = xp_of(att)
    T = att.shape[-1] if att.ndim else 0
    if xp is not np and _fused_ok(att) and T and att.size // T <= _MAX_ROWS:
        rows = att.size // T
        if rows:
            _kernel("softmax", "softmax_forward_f32")(
                (rows,), (_row_threads(T),), (att, np.int64(rows), np.int32(T),
                                              np.int32(att.shape[-2] if att.ndim > 1 else 1),
                                              np.int32(bool(causal))))
        return att
    if causal:
        keep = xp.tri(T, T, 0, dtype=bool)
        att += xp.where(keep, 0.0, -xp.inf).astype(att.dtype)
    att -= att.max(axis=-1, keepdims=True)
    xp.exp(att, out=att)
    s = att.sum(axis=-1, keepdims=True)
    att *= xp.reciprocal(s, out=s)  # a multiply is cheaper than a broadcast divide
    return att


def softmax_backward(datt, att):
    """The scores' gradient from the probabilities' gradient `datt` and the probabilities `att`
    (softmax_forward's output): datt * att - att * sum(datt * att, -1).

    datt, att: (..., T); datt is overwritten. Returns the gradient: datt itself for float32
    cupy arrays of one shape (kernels/softmax.cu, float32 rounding), else a new array. Local.
    """
    xp = xp_of(att)
    T = att.shape[-1] if att.ndim else 0
    if (xp is not np and datt.shape == att.shape and _fused_ok(datt, att) and T
            and att.size // T <= _MAX_ROWS):
        rows = att.size // T
        if rows:
            _kernel("softmax", "softmax_backward_f32")(
                (rows,), (_row_threads(T),), (datt, att, np.int64(rows), np.int32(T)))
        return datt
    ds = datt * att
    row = ds.sum(axis=-1, keepdims=True)
    xp.multiply(att, row, out=datt)
    ds -= datt
    return ds


# ------------------------------------------------------------------ (f) LayerNorm backward
def layernorm_backward(dy, xhat, rstd, g):
    """Gradients of LayerNorm from its forward's xhat = (x - mean) * rstd and rstd.

    dy, xhat: (..., C) same shape; rstd: (..., 1); g: (C,). Returns (dx, dg, db): dx = rstd *
    (dy g - mean(dy g) - xhat mean(dy g xhat)), dy's shape, new; dg = sum(dy xhat) and db =
    sum(dy) over every row, (C,). Float32 cupy arrays run kernels/layernorm_backward.cu (float32
    rounding; column sums in a fixed order, no atomics); others the reference. Local.
    """
    xp = xp_of(dy)
    C = g.shape[0]
    rows = dy.size // C if C else 0
    if (xp is not np and dy.shape == xhat.shape and _fused_ok(dy, xhat, rstd, g) and rows
            and rstd.size == rows and rows <= _MAX_ROWS):
        dx = xp.empty_like(dy)
        _kernel("layernorm_backward", "layernorm_backward_dx_f32")(
            (rows,), (_row_threads(C),), (dy, xhat, rstd, g, dx, np.int32(C)))
        db, dg = column_sums(dy.reshape(rows, C), xhat.reshape(rows, C))
        return dx, dg, db
    dyx = dy * xhat
    dg = dyx.reshape(-1, C).sum(axis=0)
    db = dy.reshape(-1, C).sum(axis=0)
    dyx *= g  # = dxhat * xhat, dxhat = dy * g
    proj_mean = dyx.mean(axis=-1, keepdims=True)
    dx = dy * g
    dx -= dx.mean(axis=-1, keepdims=True)
    xp.multiply(xhat, proj_mean, out=dyx)
    dx -= dyx
    dx *= rstd
    return dx, dg, db


def column_sums(a, b=None):
    """Sums over the rows of a 2-D array: (a.sum(axis=0), (a * b).sum(axis=0) or None).

    a, b: (rows, C) same shape. Float32 cupy arrays run kernels/layernorm_backward.cu's
    column_sums_f32 (up to 256 chunks of rows, each summed in order, then the chunks: float32
    rounding, deterministic); others numpy's or cupy's sum. Local.
    """
    xp = xp_of(a)
    if (xp is not np and a.ndim == 2 and a.size and _fused_ok(a)
            and (b is None or (b.shape == a.shape and _fused_ok(b)))):
        rows, C = a.shape
        per = -(-rows // 256)
        chunks = -(-rows // per)
        partial = xp.empty(((1 if b is None else 2) * chunks, C), xp.float32)
        threads = min(256, 32 * -(-C // 32))
        _kernel("layernorm_backward", "column_sums_f32")(
            (-(-C // threads), chunks), (threads,),
            (a, a if b is None else b, partial, np.int64(rows), np.int32(C), np.int64(per),
             np.int32(b is not None)))
        sums = partial.reshape(-1, chunks, C).sum(axis=1)
        return sums[0], None if b is None else sums[1]
    return a.sum(axis=0), None if b is None else (a * b).sum(axis=0)


def gpu_available():
    """True when cupy is installed and sees a CUDA device (the fused kernels can run)."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
