"""GPT-2 style decoder-only transformer on flat parameter buffers (Radford et al. 2019): a
`Model` (rtxmpi.nn.module) of the shipped modules (rtxmpi.nn.modules), `gpt_units(cfg)`.

Shape legend: B batch, T sequence length (T <= seq_len), C = n_embd, H = n_head, V = vocab_size,
L = n_layer.

Parameter order (parameter index = position in `model.params` = forward order):
    0 wte (V, C), 1 wpe (seq_len, C),
    then for each block l: h{l}.ln1.g, h{l}.ln1.b, h{l}.attn.w_qkv, h{l}.attn.b_qkv,
        h{l}.attn.w_proj, h{l}.attn.b_proj, h{l}.ln2.g, h{l}.ln2.b, h{l}.mlp.w_fc, h{l}.mlp.b_fc,
        h{l}.mlp.w_proj, h{l}.mlp.b_proj,
    ln_f.g, ln_f.b, and lm_head (V, C) only when the embeddings are untied.
The output head computes logits = ln_f(x) @ W.T with W = wte (tied) or lm_head (untied).

Units and parameter providers (the hook ZeRO-3 uses; rtxmpi.nn.module.Model runs it): the
parameters are grouped into `units`, contiguous ranges of parameter indices in forward order:
unit 0 = the embeddings (wte, wpe), units 1..L = the blocks, unit L+1 = the head (ln_f.g, ln_f.b,
and lm_head when untied). The passes walk the units in order and take every parameter and
gradient array from `model.provider`:

    provider.fetch(u, then=None) -> list of unit u's parameter arrays (shaped as the params);
        `then` names the unit the model will fetch next (None: none soon), a prefetch hint
    provider.release(u)          -> the model is done with the arrays fetch(u) returned
    provider.grads(u)            -> list of arrays to add unit u's gradients into (the same
        arrays on every call until grads_ready(u))
    provider.grads_ready(u)      -> unit u's gradient for this backward is final
    provider.transient           -> True when released arrays may be freed or reused (the
        caches never hold a parameter: backward fetches again, whatever the provider)

Forward fetches units 0, 1, ..., L+1 (the tied head also fetches unit 0 again, after L+1);
backward fetches L+1 (and 0, tied), L, ..., 1 (the embedding backward needs no parameters) and
reports grads_ready(L+1), ..., grads_ready(0); with tied embeddings unit 0's gradient buffer
holds the head's contribution from the start of backward until grads_ready(0). The default
provider, `FlatParams`, hands out the views into flat_data / flat_grad: no copies, no change.
"""
import math
from dataclasses import dataclass, fields

import numpy as np

from rtxmpi.errors import ConfigError
from rtxmpi.nn import layers
from rtxmpi.nn.module import Model, Sequential, init_flat, own_layout
from rtxmpi.nn.modules import (STD, Embedding, LayerNorm, LMHead, PositionalEmbedding,
                               TransformerBlock)

MODEL_SIZES = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64},
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 128},
    "base": {"n_layer": 6, "n_head": 8, "n_embd": 256},
    "gpt2-small": {"n_layer": 12, "n_head": 12, "n_embd": 768},  # GPT-2 small's shape, bytes in
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
        """Config for a named size in MODEL_SIZES ("tiny", "small", "base", "gpt2-small"), with overrides
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


def gpt_units(cfg):
    """The GPT's units as modules: Sequential(Embedding "wte", PositionalEmbedding "wpe"), the
    blocks ("h0" ... "h{L-1}", causal TransformerBlocks), Sequential(LayerNorm "ln_f", LMHead:
    tied to "wte", or its own "lm_head"). GPT-2 init: std 0.02, and 0.02 / sqrt(2 * n_layer) for
    the residual projections (attn.w_proj, mlp.w_proj)."""
    C, V = cfg.n_embd, cfg.vocab_size
    proj_std = STD / math.sqrt(2 * cfg.n_layer)
    return ([Sequential(Embedding(V, C, "wte"), PositionalEmbedding(cfg.seq_len, C, "wpe"))]
            + [(f"h{l}", TransformerBlock(C, cfg.n_head, causal=True, proj_std=proj_std))
               for l in range(cfg.n_layer)]
            + [Sequential(("ln_f", LayerNorm(C)),
                          LMHead(V, C, tied_to="wte" if cfg.tie_embeddings else None))])


def param_layout(cfg):
    """The flat layout of a GPT's parameters without allocating it: list[ParamSpec] in parameter
    index order (see the module docstring)."""
    return own_layout(gpt_units(cfg))[1]


def _init_flat(cfg, specs, seed):
    """The GPT's initial flat vector in float64 on the host (init_flat of gpt_units(cfg)'s
    declarations); specs: param_layout(cfg)."""
    return init_flat(own_layout(gpt_units(cfg))[0], specs, seed)


class GPT(Model):
    """GPT-2 style language model whose parameters and gradients are two flat buffers.

    cfg: GPTConfig; seed: int, initialization is a function of (cfg, seed) only (same values on
    numpy and cupy, any dtype being a cast of the float64 draw); xp: numpy or cupy; dtype: float
    dtype of parameters, gradients and activations; grad_alloc: callable(n, dtype) returning a
    zeroed 1-D C-contiguous array of n elements of `dtype` for flat_grad (default xp.zeros; e.g.
    rtxmpi.shared_zeros, whose memory the node's peers can map, so that the data-parallel
    all_reduce of the gradient buckets folds straight from it); recompute: "none", "blocks" (the
    L blocks rerun their forward in backward) or unit indices (Model.recompute). Raises
    ConfigError for a bad cfg, dtype, grad_alloc result or recompute.

    Attributes: cfg, xp, dtype, params (list[Param] in index order), flat_data, flat_grad (1-D
    contiguous, length num_params), num_params, units (list of (first, stop) parameter-index
    ranges: embeddings, each block, head), modules (gpt_units(cfg)'s), provider (FlatParams(self)
    unless use_provider()); use_provider, param, zero_grad, load_flat as for every Model.
    """

    def __init__(self, cfg, seed=0, xp=np, dtype=np.float32, grad_alloc=None, recompute="none"):
        if not isinstance(cfg, GPTConfig):
            raise ConfigError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        super().__init__(gpt_units(cfg), seed=seed, xp=xp, dtype=dtype, grad_alloc=grad_alloc,
                         recompute=recompute)

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
    def forward(self, idx, targets):
        """Loss and cache for one (micro-)batch.

        idx, targets: (B, T) integer arrays, T <= cfg.seq_len, ids in [0, vocab_size); host
        arrays are moved to the model's array module. Returns (loss, cache): loss is a Python
        float, the mean cross-entropy in nats over all B*T positions; cache is for `backward`.
        Raises ConfigError on a bad shape, dtype, length or id.
        """
        self.check_tokens(idx, targets)
        return super().forward(self.xp.asarray(idx), self.xp.asarray(targets))

    def backward(self, cache, scale=1.0, grad_ready=None):
        """Add the gradient of `scale * loss` into flat_grad (never overwrites, so successive
        calls accumulate micro-batches; call zero_grad() between optimizer steps).

        cache: from `forward` (not consumed; backward twice adds twice). grad_ready: optional
        callable grad_ready(i), called exactly once per parameter index i as soon as param i's
        gradient for this backward is final, in roughly reverse index order; the tied wte
        (index 0) comes last, after the embedding backward. (With a provider, "flat_grad" is
        wherever provider.grads() points.)
        """
        super().backward(cache, scale, grad_ready)

    def logits(self, idx):
        """Next-token logits, no cache kept. idx: (B, T) ids, T <= seq_len.
        Returns (B, T, V) in the model dtype. Raises ConfigError like `forward`.
        (Collective when the provider is, as with ZeRO-3.)"""
        self._check_ids(idx, "idx")
        return self.predict(self.xp.asarray(idx))

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
