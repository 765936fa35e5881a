"""CPU fused kernels: the host twins of kernels/*.cu, one pass over memory per operation.

The compiled extension `rtxmpi._fused` (rtxmpi/_fused.c, built at install; optional) runs, on
numpy arrays, what rtxmpi.nn.layers, rtxmpi.kernels and rtxmpi.nn.optim otherwise compute with
several numpy passes and temporaries: bias + GELU forward and backward, softmax (causal or not)
forward and backward, (residual +) LayerNorm forward and backward, cross-entropy forward and
backward, the AdamW update, the gradient epilogue's scale-and-check and the clipping norm's sum
of squares. The numpy code in those modules stays the reference and the fallback: each caller
asks `usable(arrays...)` and runs its reference when the answer is no (no extension, fused path
turned off, cupy arrays, other dtypes or layouts).

| operation | versus the numpy reference |
|---|---|
| `adamw`, `grad_scale` | bit for bit (same operations and order, no contraction) |
| `sum_squares` | float64 rounding (8-lane float64 sums instead of BLAS's ddot) |
| `bias_gelu_*` | a few ulp (the gate as 1 / (1 + exp(-2z)), equal to 0.5 (1 + tanh z)) |
| `softmax_*`, `layernorm_*`, `crossentropy_*` | float rounding (8-lane row sums, ~1-ulp exp) |

Turned off by the environment variable RTXMPI_FUSED=0 (read once, at the first use; "1" or unset:
on), or in code by `set_enabled(False)`. Functions here take the arrays `usable` accepted
(numpy, float32 or float64, one dtype, C-contiguous, aligned) and do not check again; they are
local (no collective) and release the GIL.
"""
import numpy as np

from .backend import env_flag

try:  # built at install (pyproject.toml ext-modules, optional); the numpy references without it
    from . import _fused as _ext
except ImportError:
    _ext = None

_ENV = "RTXMPI_FUSED"
_enabled = None  # None: not decided yet (the environment is read at the first use)


def available():
    """True when the compiled extension rtxmpi._fused is importable."""
    return _ext is not None


def enabled():
    """True when the fused path runs: the extension is built and not turned off (RTXMPI_FUSED,
    `set_enabled`). Raises ConfigError when RTXMPI_FUSED is not a boolean (backend.env_flag)."""
    global _enabled
    if _enabled is None:
        _enabled = env_flag(_ENV, default=True)
    return _enabled and _ext is not None


def set_enabled(flag):
    """Turn the fused path on (True) or off (False: every caller runs its numpy reference) for
    this process, over RTXMPI_FUSED. Returns whether it ran before (`enabled()`)."""
    global _enabled
    previous = enabled()
    _enabled = bool(flag)
    return previous


def describe():
    """One line for `rtxmpi info`: which path the CPU layers run."""
    if _ext is None:
        return "numpy references (the compiled rtxmpi._fused was not built: pip install rebuilds it)"
    if not enabled():
        return f"numpy references ({_ENV}=0 or set_enabled(False))"
    return "fused (rtxmpi._fused)"


def usable(*arrays):
    """True when the fused path is on and every array is a numpy float32 or float64 array, all
    of one dtype, C-contiguous and aligned (what the kernels take)."""
    if not enabled():
        return False
    dtype = arrays[0].dtype if type(arrays[0]) is np.ndarray else None
    if dtype not in (np.float32, np.float64):
        return False
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != dtype or not (a.flags.c_contiguous and a.flags.aligned):
            return False
    return True


def _empty(shape, dtype):
    """Every output array of this module (tests fill them with NaN: an element a kernel does not
    write then shows)."""
    return np.empty(shape, dtype)


def _is64(a):
    return a.dtype == np.float64


def _rows(a):
    C = a.shape[-1]
    return (a.size // C if C else 0), C


# ------------------------------------------------------------------------------ bias + GELU
def bias_gelu_forward(h, b):
    """u = h + b written into h (in place); y = GELU(u), tanh approximation. h: (..., F) writable;
    b: (F,). Returns y: (..., F), a new array."""
    y = _empty(h.shape, h.dtype)
    _ext.bias_gelu_forward(h, b, y, *_rows(h), _is64(h))
    return y


def bias_gelu_backward(dy, u):
    """Gradients of `bias_gelu_forward` from u = h + b. dy, u: (..., F).
    Returns du (..., F) and db (F,) = du summed over rows, new arrays."""
    du = _empty(u.shape, u.dtype)
    db = _empty(u.shape[-1:], u.dtype)
    _ext.bias_gelu_backward(dy, u, du, db, *_rows(u), _is64(u))
    return du, db


# ---------------------------------------------------------------------------------- softmax
def softmax_forward(att, causal):
    """att <- softmax(att [+ causal mask]) over the last dim, in place. att: (..., T, T) when
    causal (row i of each (T, T) block keeps keys 0..i, the others become 0), else (..., T).
    Returns att."""
    _ext.softmax_forward(att, *_rows(att), bool(causal), _is64(att))
    return att


def softmax_backward(datt, att):
    """The scores' gradient from the probabilities' (datt) and the probabilities (att):
    att * (datt - sum(datt * att, -1)), written into datt. datt, att: (..., T). Returns datt."""
    _ext.softmax_backward(datt, att, *_rows(att), _is64(att))
    return datt


# -------------------------------------------------------------------------------- LayerNorm
def layernorm_forward(x, g, b, eps, residual=None):
    """LayerNorm over the last dim (biased variance); with `residual`, x += residual first, in
    place (the residual add of a pre-LN block). x: (..., C), writable when residual is given;
    g, b: (C,); residual: None or (..., C). Returns y, xhat (x's shape), rstd (..., 1)."""
    if residual is not None and not x.flags.writeable:
        raise ValueError("layernorm_forward: x must be writable to take the residual add")
    rows, C = _rows(x)
    y, xhat = _empty(x.shape, x.dtype), _empty(x.shape, x.dtype)
    rstd = _empty(x.shape[:-1] + (1,), x.dtype)
    _ext.layernorm_forward(x, g, b, y, xhat, rstd, residual, rows, C, float(eps), _is64(x))
    return y, xhat, rstd


def layernorm_backward(dy, xhat, rstd, g):
    """Gradients of `layernorm_forward` from its xhat and rstd. dy, xhat: (..., C); rstd (..., 1);
    g: (C,). Returns dx (..., C), dg (C,), db (C,), new arrays."""
    rows, C = _rows(dy)
    dx = _empty(dy.shape, dy.dtype)
    dg, db = _empty((C,), dy.dtype), _empty((C,), dy.dtype)
    _ext.layernorm_backward(dy, xhat, rstd, g, dx, dg, db, rows, C, _is64(dy))
    return dx, dg, db


# ---------------------------------------------------------------------------- cross-entropy
def targets_int64(targets):
    """Targets as the kernels take them: a 1-D C-contiguous int64 array (a copy when needed)."""
    return np.ascontiguousarray(targets.reshape(-1), dtype=np.int64)


def crossentropy_forward(logits, targets):
    """Per-position cross-entropy. logits: (N, V); targets: (N,) int64 (`targets_int64`).
    Returns probs (N, V) = softmax(logits) and nll (N,) = -log probs[target], new arrays.
    Raises IndexError for a target outside [0, V)."""
    N, V = logits.shape
    probs = _empty(logits.shape, logits.dtype)
    nll = _empty((N,), logits.dtype)
    _ext.crossentropy_forward(logits, targets, probs, nll, N, V, _is64(logits))
    return probs, nll


def crossentropy_backward(probs, targets, scale):
    """scale * (probs - onehot(targets)). probs: (N, V); targets: (N,) int64; scale: float.
    Returns (N, V), a new array. Raises IndexError for a target outside [0, V)."""
    N, V = probs.shape
    out = _empty(probs.shape, probs.dtype)
    _ext.crossentropy_backward(probs, targets, out, N, V, float(scale), _is64(probs))
    return out


# ---------------------------------------------------------------------- AdamW and epilogue
def adamw(p, g, m, v, decay_mask, beta1, beta2, decay, lrwd, eps_term, step_size, mode):
    """rtxmpi.kernels.adamw_step's update in one pass, p, m, v in place (its argument names: mode
    0 no decay, 1 p *= decay, 2 p -= lrwd * mask * p). p, g, m, v, decay_mask: 1-D, one length."""
    _ext.adamw(p, g, m, v, decay_mask if mode == 2 else None, p.size, beta1, beta2, decay, lrwd,
               eps_term, step_size, mode, _is64(p))
    return p


def grad_scale(grad, scale):
    """grad *= scale (rounded to grad's dtype) in place. Returns True when any scaled value is
    inf or NaN."""
    return _ext.grad_scale(grad, grad.size, float(scale), _is64(grad))


def sum_squares(grad):
    """The sum of grad's squares, accumulated in float64, as a Python float."""
    return _ext.sum_squares(grad, grad.size, _is64(grad))
