"""AdamW on flat buffers, gradient-norm clipping and the learning-rate schedule.

Everything works on 1-D arrays: the model's whole flat buffer or any shard of it (ZeRO), updated in
place with a fixed number of full-buffer array operations per step and no per-parameter loop.
"""
import math

from rtxmpi import fused
from rtxmpi.backend import xp_of
from rtxmpi.errors import ConfigError
from rtxmpi.kernels import adamw_step


def _check_flat(name, array, like=None):
    if getattr(array, "ndim", None) != 1:
        raise ConfigError(f"{name} must be a 1-D array (a flat buffer or a shard of it), got "
                          f"shape {getattr(array, 'shape', type(array).__name__)}")
    if like is not None and array.shape != like.shape:
        raise ConfigError(f"{name} has shape {array.shape} but the parameters have shape "
                          f"{like.shape}; pass the matching flat slice")


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019) and bias correction (Kingma &
    Ba 2015), the same update as torch.optim.AdamW:

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p = p * (1 - lr * wd * mask) - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

    params: 1-D float array (the flat parameter buffer or a shard of it), updated IN PLACE.
    decay_mask: None (decay everything) or a 1-D array of the same length, 1 where decay applies
    and 0 where not (see `rtxmpi.nn.decay_mask`). State: m, v (params' dtype and length), step.
    Raises ConfigError for a bad shape or hyper-parameter.
    """

    def __init__(self, params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 decay_mask=None):
        _check_flat("params", params)
        if getattr(params, "dtype", None) is None or params.dtype.kind != "f":
            raise ConfigError(f"params must be a floating array, got dtype {params.dtype}")
        if decay_mask is not None:
            _check_flat("decay_mask", decay_mask, like=params)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"betas must each be in [0, 1), got {betas}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ConfigError(f"lr ({lr}), eps ({eps}) and weight_decay ({weight_decay}) "
                              f"must be >= 0")
        xp = xp_of(params)
        self.params, self.lr, self.betas = params, float(lr), (float(b1), float(b2))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        # on params' device (a numpy mask is copied to the GPU for cupy params)
        self.decay_mask = None if decay_mask is None else xp.array(decay_mask, dtype=params.dtype)
        self.m = xp.zeros_like(params)
        self.v = xp.zeros_like(params)
        self.step_count = 0
        self._tmp = xp.empty_like(params)

    def step(self, grad, lr=None):
        """One update of `params` in place from `grad` (same shape, any float dtype).

        lr: overrides the constructor's rate for this step (schedules); weight decay uses it too.
        """
        _check_flat("grad", grad, like=self.params)
        lr = self.lr if lr is None else float(lr)
        b1, b2 = self.betas
        self.step_count += 1
        adamw_step(self.params, grad, self.m, self.v, lr=lr, beta1=b1, beta2=b2, eps=self.eps,
                   weight_decay=self.weight_decay, step=self.step_count,
                   decay_mask=self.decay_mask, tmp=self._tmp)

    def state_dict(self):
        """{"step": int, "m": array, "v": array}; m and v are the live arrays (copy to keep)."""
        return {"step": self.step_count, "m": self.m, "v": self.v}

    def load_state_dict(self, state):
        """Restore from a `state_dict()` (arrays copied in; numpy or cupy, cast to params' dtype).
        Raises ConfigError when a key is missing or a length differs."""
        for key in ("step", "m", "v"):
            if key not in state:
                raise ConfigError(f"optimizer state is missing {key!r}; expected step, m, v")
        xp = xp_of(self.params)
        for key in ("m", "v"):
            _check_flat(f"state[{key!r}]", state[key], like=self.params)
            getattr(self, key)[...] = xp.asarray(state[key], dtype=self.params.dtype)
        step = int(state["step"])
        if step < 0:
            raise ConfigError(f"optimizer state step must be >= 0, got {step}")
        self.step_count = step


def grad_norm_sq(grad):
    """Sum of squares of a gradient array (any shape), as a Python float accumulated in float64.

    For a distributed global norm each rank computes this on its shard, the caller all-reduces
    the sum and passes sqrt(total) to `clip_grad_norm(..., total_norm=)`.
    """
    xp = xp_of(grad)
    g = grad.reshape(-1)
    if fused.usable(g):  # one pass, no float64 copy
        return fused.sum_squares(g)
    g = g.astype(xp.float64, copy=False)
    return float(xp.dot(g, g))


def clip_grad_norm(grad, max_norm, total_norm=None):
    """Scale `grad` in place so its L2 norm is at most `max_norm` (as torch's clip_grad_norm_).

    grad: float array (any shape). total_norm: the norm to use, e.g. a global norm already
    all-reduced over ranks; computed from `grad` when None. Returns the norm before clipping,
    a Python float. Raises ConfigError when max_norm <= 0.
    """
    if not max_norm > 0:
        raise ConfigError(f"max_norm must be > 0, got {max_norm}")
    norm = math.sqrt(grad_norm_sq(grad)) if total_norm is None else float(total_norm)
    if norm > max_norm:
        grad *= max_norm / (norm + 1e-6)
    return norm


def cosine_lr(step, base_lr, warmup_steps, total_steps, min_lr=0.0):
    """Linear warmup then cosine decay to min_lr (Loshchilov & Hutter 2017, without restarts).

    step: 1-based number of the optimizer step the rate is for (docs/design.md, "Contracts").
    Steps 1..warmup_steps ramp linearly to base_lr (step/warmup_steps * base_lr); steps up to
    total_steps follow half a cosine from base_lr to min_lr; later steps stay at min_lr.
    Raises ConfigError when warmup_steps > total_steps or a value is negative.
    """
    if warmup_steps < 0 or total_steps < 0 or base_lr < 0 or min_lr < 0:
        raise ConfigError("cosine_lr needs warmup_steps, total_steps, base_lr, min_lr >= 0, got "
                          f"{warmup_steps}, {total_steps}, {base_lr}, {min_lr}")
    if warmup_steps > total_steps:
        raise ConfigError(f"warmup_steps ({warmup_steps}) must be <= total_steps ({total_steps})")
    if warmup_steps > 0 and step <= warmup_steps:
        return base_lr * max(step, 0) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
