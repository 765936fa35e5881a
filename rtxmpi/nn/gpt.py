"""GPT-2 style decoder-only transformer on flat parameter buffers (Radford et al. 2019).

Shape legend: B batch, T sequence length (T <= seq_len), C = n_embd, H = n_head, V = vocab_size,
L = n_layer.

Parameter order (parameter index = position in `model.params` = forward order):
    0 wte (V, C), 1 wpe (seq_len, C),
    then for each block l: h{l}.ln1.g, h{l}.ln1.b, h{l}.attn.w_qkv, h{l}.attn.b_qkv,
        h{l}.attn.w_proj, h{l}.attn.b_proj, h{l}.ln2.g, h{l}.ln2.b, h{l}.mlp.w_fc, h{l}.mlp.b_fc,
        h{l}.mlp.w_proj, h{l}.mlp.b_proj,
    ln_f.g, ln_f.b, and lm_head (V, C) only when the embeddings are untied.
The output head computes logits = ln_f(x) @ W.T with W = wte (tied) or lm_head (untied).

Units and parameter providers (the hook ZeRO-3 uses): the parameters are grouped into `units`,
contiguous ranges of parameter indices in forward order: unit 0 = the embeddings (wte, wpe), units
1..L = the blocks, unit L+1 = the head (ln_f.g, ln_f.b, and lm_head when untied). The passes walk
the units in order and take every parameter and gradient array from `model.provider`:

    provider.fetch(u, then=None) -> list of unit u's parameter arrays (shaped as the params);
        `then` names the unit the model will fetch next (None: none soon), a prefetch hint
    provider.release(u)          -> the model is done with the arrays fetch(u) returned
    provider.grads(u)            -> list of arrays to add unit u's gradients into (the same
        arrays on every call until grads_ready(u))
    provider.grads_ready(u)      -> unit u's gradient for this backward is final
    provider.transient           -> True when released arrays may be freed or reused: the model
        then keeps no reference to them in its caches and fetches again for backward

Forward fetches units 0, 1, ..., L+1 (the tied head also fetches unit 0 again, after L+1);
backward fetches L+1 (and 0, tied), L, ..., 1 (the embedding backward needs no parameters) and
reports grads_ready(L+1), ..., grads_ready(0); with tied embeddings unit 0's gradient buffer
holds the head's contribution from the start of backward until grads_ready(0). The default
provider, `FlatParams`, hands out the views into flat_data / flat_grad: no copies, no change.
"""
import math
from dataclasses import dataclass, fields

import numpy as np

from rtxmpi.backend import xp_of
from rtxmpi.errors import ConfigError
from rtxmpi.nn import layers
from rtxmpi.nn.params import bind, layout
from rtxmpi.observe.trace import span

MODEL_SIZES = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64},
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 128},
    "base": {"n_layer": 6, "n_head": 8, "n_embd": 256},
}


@dataclass(frozen=True)
class GPTConfig:
    """Model hyper-parameters; validated on construction.

    Raises ConfigError for a non-positive size or n_embd not divisible by n_head.
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"for example n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))}")

    @classmethod
    def named(cls, name, **overrides):
        """Config for a named size in MODEL_SIZES ("tiny", "small", "base"), with overrides
        (e.g. seq_len=256). Raises ConfigError for an unknown name or field."""
        if name not in MODEL_SIZES:
            raise ConfigError(
                f"unknown model size {name!r}; choose one of: {', '.join(MODEL_SIZES)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown GPTConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**{**MODEL_SIZES[name], **overrides})

    @property
    def head_size(self):
        return self.n_embd // self.n_head


def param_layout(cfg):
    """The flat layout of a GPT's parameters without allocating it: list[ParamSpec] in parameter
    index order (see the module docstring)."""
    C, V = cfg.n_embd, cfg.vocab_size
    entries = [("wte", (V, C), True), ("wpe", (cfg.seq_len, C), True)]
    for l in range(cfg.n_layer):
        entries += [(f"h{l}.{name}", shape, decay)
                    for name, shape, decay in layers.block_param_shapes(C)]
    entries += [("ln_f.g", (C,), False), ("ln_f.b", (C,), False)]
    if not cfg.tie_embeddings:
        entries.append(("lm_head", (V, C), True))
    return layout(entries)


def _init_flat(cfg, specs, seed):
    """GPT-2 initialization in float64 on the host: N(0, 0.02) for matrices and embeddings,
    std 0.02 / sqrt(2 * n_layer) for the residual projections (attn.w_proj, mlp.w_proj), biases 0,
    LayerNorm gains 1. Drawn parameter by parameter in index order from one generator."""
    rng = np.random.default_rng(seed)
    flat = np.zeros(specs[-1].stop, dtype=np.float64)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for spec in specs:
        view = flat[spec.offset:spec.stop]
        if spec.name.endswith(".g"):
            view[:] = 1.0
        elif len(spec.shape) == 2:
            std = resid_std if spec.name.endswith("w_proj") else 0.02
            view[:] = rng.standard_normal(spec.size) * std
    return flat


class FlatParams:
    """The default parameter provider: each unit's arrays are the Param views into the model's
    flat_data / flat_grad; fetch and release cost nothing and nothing is ever freed."""

    transient = False

    def __init__(self, model):
        self._data = [[p.data for p in model.params[a:b]] for a, b in model.units]
        self._grad = [[p.grad for p in model.params[a:b]] for a, b in model.units]

    def fetch(self, unit, then=None):
        return self._data[unit]

    def release(self, unit):
        pass

    def grads(self, unit):
        return self._grad[unit]

    def grads_ready(self, unit):
        pass


# Which arrays of a layer cache are parameters (rtxmpi.nn.layers keeps them for backward): a
# transient provider's caches hold None there, and backward puts freshly fetched arrays back.
def _block_cache_with(cache, params):
    """A block cache (layers.block_forward) holding `params` (12 arrays, or None) as weights."""
    g1, _, w_qkv, _, w_aproj, _, g2, _, w_fc, _, w_mproj, _ = params or (None,) * 12
    (xhat1, rstd1, _), attn, (xhat2, rstd2, _), (fc, gelu, mproj) = cache
    qkv, q, k, v, att, aproj, n_head = attn
    return ((xhat1, rstd1, g1),
            ((qkv[0], w_qkv, qkv[2]), q, k, v, att, (aproj[0], w_aproj, aproj[2]), n_head),
            (xhat2, rstd2, g2),
            ((fc[0], w_fc, fc[2]), gelu, (mproj[0], w_mproj, mproj[2])))


def _linear_cache_with(cache, w):
    return (cache[0], w, cache[2])


def _layernorm_cache_with(cache, g):
    return (cache[0], cache[1], g)


class _Cache:
    """What `GPT.forward` keeps for `GPT.backward`."""

    __slots__ = ("emb", "blocks", "ln_f", "head", "ce")

    def __init__(self, emb, blocks, ln_f, head, ce):
        self.emb, self.blocks, self.ln_f, self.head, self.ce = emb, blocks, ln_f, head, ce


class GPT:
    """GPT-2 style language model whose parameters and gradients are two flat buffers.

    cfg: GPTConfig; seed: int, initialization is a function of (cfg, seed) only (same values on
    numpy and cupy, any dtype being a cast of the float64 draw); xp: numpy or cupy; dtype: float
    dtype of parameters, gradients and activations; grad_alloc: callable(n, dtype) returning a
    zeroed 1-D C-contiguous array of n elements of `dtype` for flat_grad (default xp.zeros; e.g.
    rtxmpi.shared_zeros, whose memory the node's peers can map, so that the data-parallel
    all_reduce of the gradient buckets folds straight from it). Raises ConfigError for a bad cfg,
    dtype or grad_alloc result.

    Attributes: cfg, xp, dtype, params (list[Param] in index order), flat_data, flat_grad (1-D
    contiguous, length num_params), num_params, units (list of (first, stop) parameter-index
    ranges: embeddings, each block, head), provider (FlatParams(self) unless use_provider()).
    """

    def __init__(self, cfg, seed=0, xp=np, dtype=np.float32, grad_alloc=None):
        if not isinstance(cfg, GPTConfig):
            raise ConfigError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise ConfigError(f"GPT dtype must be a floating type, got {dtype.name}")
        self.cfg, self.xp, self.dtype = cfg, xp, dtype
        specs = param_layout(cfg)
        self.num_params = specs[-1].stop
        self.flat_data = xp.asarray(_init_flat(cfg, specs, seed).astype(dtype))
        self.flat_grad = (grad_alloc or xp.zeros)(self.num_params, dtype=dtype)
        grad = self.flat_grad
        if (getattr(grad, "shape", None) != (self.num_params,) or grad.dtype != dtype
                or not grad.flags.c_contiguous or type(grad) is not type(self.flat_data)):
            raise ConfigError(f"grad_alloc returned {type(grad).__name__} "
                              f"{getattr(grad, 'shape', None)} {getattr(grad, 'dtype', None)}; "
                              f"expected a C-contiguous {type(self.flat_data).__name__} "
                              f"({self.num_params},) {dtype}")
        self.params = bind(specs, self.flat_data, self.flat_grad)
        self._by_name = {p.name: p for p in self.params}
        self._ln_f = self.params[2 + 12 * cfg.n_layer: 4 + 12 * cfg.n_layer]
        self._head = self.params[0] if cfg.tie_embeddings else self.params[-1]
        L = cfg.n_layer
        self.units = [(0, 2)] + [(2 + 12 * l, 14 + 12 * l) for l in range(L)] + [
            (2 + 12 * L, len(self.params))]
        self.provider = FlatParams(self)

    def use_provider(self, provider, drop_flat=False):
        """Take parameters and gradients from `provider` (see the module docstring) from now on.

        drop_flat: also let go of flat_data, flat_grad and the Param views (they become None), so
        that only the provider holds parameter memory (ZeRO-3); load_flat then raises ConfigError
        and zero_grad does nothing. Local.
        """
        self.provider = provider
        if drop_flat:
            self.flat_data = self.flat_grad = None
            for p in self.params:
                p.data = p.grad = None

    # ------------------------------------------------------------------ parameters
    def param(self, name):
        """The Param called `name` (e.g. "h0.attn.w_qkv"). Raises ConfigError if unknown."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(f"no parameter named {name!r}; see [p.name for p in model.params]")

    def zero_grad(self):
        """Set every gradient to zero (the whole flat_grad buffer; nothing once dropped)."""
        if self.flat_grad is not None:
            self.flat_grad.fill(0)

    def load_flat(self, array):
        """Copy a flat parameter vector (numpy or cupy, any float dtype, length num_params) into
        flat_data (cast to the model dtype). Raises ConfigError on a wrong size or rank."""
        if self.flat_data is None:
            raise ConfigError("this model's parameters are held by its provider (ZeRO-3): load "
                              "them through it, e.g. ZeroDataParallel.load_shards")
        shape = getattr(array, "shape", None)
        if shape != (self.num_params,):
            raise ConfigError(f"load_flat expects a 1-D array of {self.num_params} elements "
                              f"(model.num_params), got shape {shape}")
        if self.xp is np and xp_of(array) is not np:
            array = array.get()  # a cupy array into a numpy model: copy to the host first
        self.flat_data[...] = self.xp.asarray(array, dtype=self.dtype)

    # ------------------------------------------------------------------ validation
    def check_tokens(self, idx, targets):
        """Raise ConfigError unless idx, targets are (B, T) integer arrays of the same shape,
        1 <= T <= cfg.seq_len, B >= 1, ids in [0, vocab_size): what `forward` checks, without
        computing anything (engines run it first and agree on the verdict over their ranks,
        rtxmpi.control.raise_if_any_failed). Local."""
        self._check_ids(idx, "idx")
        self._check_ids(targets, "targets")
        if targets.shape != idx.shape:
            raise ConfigError(f"targets shape {targets.shape} must equal idx shape {idx.shape}")

    def _check_ids(self, arr, what):
        """Validate a (B, T) id array (ConfigError)."""
        if getattr(arr, "ndim", None) != 2:
            raise ConfigError(f"{what} must be a (B, T) integer array, got shape "
                              f"{getattr(arr, 'shape', type(arr).__name__)}")
        if arr.dtype.kind not in "iu":
            raise ConfigError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
        B, T = arr.shape
        if T > self.cfg.seq_len:
            raise ConfigError(f"{what} has T={T} positions but the model's seq_len is "
                              f"{self.cfg.seq_len}; crop the input or build the model with "
                              f"seq_len>={T}")
        if B == 0 or T == 0:
            raise ConfigError(f"{what} must have at least one position, got shape {arr.shape}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ConfigError(f"{what} holds token ids in [{lo}, {hi}] but vocab_size is "
                              f"{self.cfg.vocab_size}; ids must be in [0, {self.cfg.vocab_size})")

    # ------------------------------------------------------------------ passes
    def _logits(self, idx):
        """All units forward: logits (B, T, V) and the caches (_Cache without ce)."""
        P, L, last = self.provider, self.cfg.n_layer, len(self.units) - 1
        wte, wpe = P.fetch(0, then=1)
        x, emb_cache = layers.embedding_forward(idx, wte, wpe)  # the cache keeps no parameter
        P.release(0)
        block_caches = []
        for u in range(1, L + 1):
            params = P.fetch(u, then=u + 1)
            with span(f"block {u} forward", "compute", layer=u):
                x, cache = layers.block_forward(x, params, self.cfg.n_head)
            block_caches.append(_block_cache_with(cache, None) if P.transient else cache)
            P.release(u)
        tied = self.cfg.tie_embeddings
        head = P.fetch(last, then=0 if tied else None)
        w = P.fetch(0)[0] if tied else head[2]
        h, ln_f_cache = layers.layernorm_forward(x, head[0], head[1])
        logits, head_cache = layers.linear_forward(h, w.T)
        if tied:
            P.release(0)
        P.release(last)
        if P.transient:
            ln_f_cache = _layernorm_cache_with(ln_f_cache, None)
            head_cache = _linear_cache_with(head_cache, None)
        return logits, _Cache(emb_cache, block_caches, ln_f_cache, head_cache, None)

    def forward(self, idx, targets):
        """Loss and cache for one (micro-)batch.

        idx, targets: (B, T) integer arrays, T <= cfg.seq_len, ids in [0, vocab_size); host
        arrays are moved to the model's array module. Returns (loss, cache): loss is a Python
        float, the mean cross-entropy in nats over all B*T positions; cache is for `backward`.
        Raises ConfigError on a bad shape, dtype, length or id.
        """
        self.check_tokens(idx, targets)
        idx, targets = self.xp.asarray(idx), self.xp.asarray(targets)
        logits, cache = self._logits(idx)
        loss, cache.ce = layers.crossentropy_forward(logits, targets)
        return float(loss), cache

    def backward(self, cache, scale=1.0, grad_ready=None):
        """Add the gradient of `scale * loss` into flat_grad (never overwrites, so successive
        calls accumulate micro-batches; call zero_grad() between optimizer steps).

        cache: from `forward` (not consumed; backward twice adds twice). grad_ready: optional
        callable grad_ready(i), called exactly once per parameter index i as soon as param i's
        gradient for this backward is final, in roughly reverse index order; the tied wte
        (index 0) comes last, after the embedding backward. (With a provider, "flat_grad" is
        wherever provider.grads() points.)
        """
        notify = grad_ready if grad_ready is not None else (lambda i: None)
        P, L, last = self.provider, self.cfg.n_layer, len(self.units) - 1
        tied = self.cfg.tie_embeddings
        dlogits = layers.crossentropy_backward(scale, cache.ce)
        head = P.fetch(last, then=0 if tied else L)
        head_grads = P.grads(last)
        if tied:
            w, dw = P.fetch(0, then=L)[0], P.grads(0)[0]
        else:
            w, dw = head[2], head_grads[2]
        head_cache, ln_f_cache = cache.head, cache.ln_f
        if P.transient:
            head_cache = _linear_cache_with(head_cache, w.T)
            ln_f_cache = _layernorm_cache_with(ln_f_cache, head[0])
        dh, _, _ = layers.linear_backward(dlogits, head_cache, dw_out=dw.T)
        if tied:
            P.release(0)
        else:
            notify(self._head.index)
        g, b = self._ln_f
        dx, _, _ = layers.layernorm_backward(dh, ln_f_cache, head_grads[0], head_grads[1])
        P.release(last)
        notify(b.index)
        notify(g.index)
        P.grads_ready(last)
        for u in range(L, 0, -1):
            block_cache, params = cache.blocks[u - 1], P.fetch(u, then=u - 1 or None)
            if P.transient:
                block_cache = _block_cache_with(block_cache, params)
            base = self.units[u][0]
            with span(f"block {u} backward", "compute", layer=u):
                dx, _ = layers.block_backward(dx, block_cache, P.grads(u),
                                              ready=lambda j, base=base: notify(base + j))
            P.release(u)
            P.grads_ready(u)
        dwte, dwpe = P.grads(0)
        layers.embedding_backward(dx, cache.emb, dwte, dwpe)
        notify(1)
        notify(0)
        P.grads_ready(0)

    def logits(self, idx):
        """Next-token logits, no cache kept. idx: (B, T) ids, T <= seq_len.
        Returns (B, T, V) in the model dtype. Raises ConfigError like `forward`.
        (Collective when the provider is, as with ZeRO-3.)"""
        self._check_ids(idx, "idx")
        return self._logits(self.xp.asarray(idx))[0]

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, rng=None):
        """Autoregressive sampling: append `max_new_tokens` tokens to each row of idx.

        idx: (B, T0) ids; the context is cropped to the last seq_len tokens at each step.
        temperature: > 0 divides the logits; 0 means greedy (argmax). top_k: None or int >= 1,
        sample only among the k most likely tokens. rng: numpy.random.Generator (default: a fresh
        unseeded one); each step draws B uniforms and samples on the host in float64.
        Returns (B, T0 + max_new_tokens) ids in the model's array module and idx's int dtype.
        """
        xp = self.xp
        if temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and not (1 <= int(top_k) <= self.cfg.vocab_size):
            raise ConfigError(f"top_k must be None or in [1, {self.cfg.vocab_size}], got {top_k}")
        if max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        rng = rng if rng is not None else np.random.default_rng()
        out = xp.asarray(idx)
        for _ in range(int(max_new_tokens)):
            logits = self.logits(out[:, -self.cfg.seq_len:])[:, -1, :]  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(axis=-1)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < self.cfg.vocab_size:
                    kth = xp.sort(logits, axis=-1)[:, -int(top_k)][:, None]
                    logits = xp.where(logits < kth, -xp.inf, logits)
                probs = layers.softmax_forward(logits)
                nxt = xp.asarray(_sample_rows(probs if xp is np else probs.get(), rng))
            out = xp.concatenate([out, nxt.astype(out.dtype)[:, None]], axis=1)
        return out


def _sample_rows(probs, rng):
    """Inverse-CDF sampling of one index per row of a (B, V) host array of probabilities, in
    float64; never returns an index of probability 0."""
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[0]) * cdf[:, -1]
    choice = (cdf <= u[:, None]).sum(axis=-1)  # first index whose cdf exceeds u
    last_positive = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    return np.minimum(choice, last_positive)
