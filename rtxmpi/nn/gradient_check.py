"""`gradcheck`: a module's backward against float64 central finite differences of its forward."""
import numpy as np

from rtxmpi.errors import ConfigError, RtxmpiError
from rtxmpi.nn.module import Module, run_backward


class GradcheckError(RtxmpiError, AssertionError):
    """A module's analytic gradient disagrees with finite differences. Attribute: errors (dict of
    array name -> relative error)."""

    def __init__(self, message, errors):
        super().__init__(message)
        self.errors = errors


def gradcheck(module, x, targets=None, *, seed=0, eps=1e-6, tol=1e-6, samples=None):
    """Check every parameter and floating input gradient of `module` (rtxmpi.nn.Module) in float64.

    x: the input, an array or a tuple of arrays (float arrays are checked and cast to float64 on
    the host; integer ones, e.g. token ids, are passed as they are). targets: None, the objective
    is sum(forward(params, x)[0] * R) with R a fixed standard-normal array; or the targets of a
    head (a module with loss_forward), the objective is then its loss. The parameters are drawn
    from numpy.random.default_rng(seed): N(0, 0.5^2), plus 1 where declared init="ones"; a
    declaration with tied_to gets its own array. samples: None checks every element, an int that
    many random elements per array. eps: the finite-difference step.

    The relative error of an array is |a - n| / max(|a| + |n|, 1e-6) over its checked elements
    (a: backward, n: (f(p + eps) - f(p - eps)) / (2 eps)). backward is run on gradients that
    already hold values (it must add into them) and after the arrays forward saw are overwritten
    with NaN (its cache must not hold a parameter). Returns {name: relative error}, parameters
    by declared name, inputs as "x" or "x[i]". Raises GradcheckError naming the worst array when
    one exceeds tol; ConfigError when `module` is not a Module, or targets are given to a module
    without loss_forward. Local; numpy only.
    """
    if not isinstance(module, Module):
        raise ConfigError(f"gradcheck takes an rtxmpi.nn.Module, got {type(module).__name__}")
    if targets is not None and not hasattr(module, "loss_forward"):
        raise ConfigError(f"targets given but {type(module).__name__} has no loss_forward")
    rng = np.random.default_rng(seed)
    decls = module.param_specs()
    params = [rng.standard_normal(d.shape) * 0.5 + (1.0 if d.init == "ones" else 0.0)
              for d in decls]
    multi = isinstance(x, tuple)
    inputs = [_host64(a) for a in (x if multi else (x,))]

    def run(ps, xs):
        y, cache = module.forward(ps, tuple(xs) if multi else xs[0])
        return np.asarray(y), cache

    y, _ = run(params, inputs)
    R = rng.standard_normal(y.shape)

    def objective():
        y, _ = run(params, inputs)
        if targets is None:
            return float(np.sum(y * R))
        return float(module.loss_forward(y, targets)[0])

    # analytic: forward on copies that are then poisoned, backward on the originals
    seen = [p.copy() for p in params]
    y, cache = run(seen, [a.copy() if _is_float(a) else a for a in inputs])
    if targets is None:
        dy = R
    else:
        dy = module.loss_backward(1.0, module.loss_forward(y, targets)[1])
    for p in seen:
        p.fill(np.nan)
    before = [rng.standard_normal(d.shape) for d in decls]
    grads = [b.copy() for b in before]
    dx = run_backward(module, params, grads, cache, dy)
    analytic = [g - b for g, b in zip(grads, before)]
    names = [d.name for d in decls]
    arrays = list(params)
    dxs = dx if multi else (dx,)
    for i, a in enumerate(inputs):
        if not _is_float(a):
            continue
        if dxs is None or i >= len(dxs) or dxs[i] is None:
            raise GradcheckError(f"{type(module).__name__}.backward returned no gradient for "
                                 f"the floating input {_input_name(i, multi)}", {})
        names.append(_input_name(i, multi))
        arrays.append(a)
        analytic.append(np.asarray(dxs[i], dtype=np.float64))

    errors, numerics = {}, {}
    for name, a, g in zip(names, arrays, analytic):
        if g.shape != a.shape:
            raise GradcheckError(f"gradient of {name} has shape {g.shape}, expected {a.shape}",
                                 errors)
        picks = (np.arange(a.size) if samples is None
                 else rng.choice(a.size, size=min(int(samples), a.size), replace=False))
        numeric = np.empty(len(picks))
        for k, j in enumerate(picks):
            old = a.flat[j]
            a.flat[j] = old + eps
            plus = objective()
            a.flat[j] = old - eps
            minus = objective()
            a.flat[j] = old
            numeric[k] = (plus - minus) / (2 * eps)
        errors[name] = _relative_error(g.reshape(-1)[picks], numeric)
        numerics[name] = (picks, numeric)
    worst = max(errors, key=errors.get, default=None)
    if worst is not None and errors[worst] > tol:
        hint = ""
        if worst in names[:len(decls)]:  # a parameter: right from zeros, wrong added to values?
            y, cache = run([p.copy() for p in params], inputs)
            fresh = [np.zeros(d.shape) for d in decls]
            run_backward(module, params, fresh, cache, dy)
            picks, numeric = numerics[worst]
            if _relative_error(fresh[names.index(worst)].reshape(-1)[picks], numeric) <= tol:
                hint = (f"; from zeroed gradients it is right: backward sets the gradient of "
                        f"{worst} instead of adding into it (+=)")
        raise GradcheckError(f"{type(module).__name__}: the gradient of {worst} is off by a "
                             f"relative error of {errors[worst]:.2e} > tol {tol:.0e} "
                             f"(all: {', '.join(f'{k} {v:.1e}' for k, v in errors.items())}){hint}",
                             errors)
    return errors


def _relative_error(analytic, numeric):
    """|a - n| / max(|a| + |n|, 1e-6); inf when not finite."""
    err = float(np.linalg.norm(analytic - numeric)
                / max(np.linalg.norm(analytic) + np.linalg.norm(numeric), 1e-6))
    return err if np.isfinite(err) else float("inf")


def _is_float(a):
    return np.asarray(a).dtype.kind == "f"


def _host64(a):
    """A float64 host copy of a float array; integer arrays as they are."""
    if hasattr(a, "get"):
        a = a.get()
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def _input_name(i, multi):
    return f"x[{i}]" if multi else "x"
