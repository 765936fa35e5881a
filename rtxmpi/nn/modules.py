"""The shipped modules: thin adapters of rtxmpi.nn.layers to the module protocol (module.py).

Shape legend as in rtxmpi.nn.layers: B batch, T sequence, C channels, H heads, V vocabulary,
K classes; images (B, Hi, Wi, Ci) channels-last, P patch side, Np patches.

Each module's cache is its layer's cache with the parameters taken out (backward gets them again
as `params`), so a provider may free parameters between the passes. Init stds follow GPT-2: 0.02
for matrices and embeddings unless given; biases 0, LayerNorm gains 1.
"""
from numbers import Integral

from rtxmpi.backend import xp_of
from rtxmpi.errors import ConfigError
from rtxmpi.nn import layers
from rtxmpi.nn.module import Module, ParamDecl

STD = 0.02


def _positive(owner, **sizes):
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
            raise ConfigError(f"{owner}: {name} must be a positive integer, got {value!r}")


class Embedding(Module):
    """Token embedding: y[b, t] = weight[x[b, t]]. x: (B, T) integer ids in [0, V) (not checked:
    validate at the model's edge). y: (B, T, C). Parameter `name` (V, C), split "vocab". Backward
    needs no parameter and returns None (ids have no gradient)."""

    backward_needs_params = False

    def __init__(self, vocab_size, n_embd, name="wte", std=STD):
        _positive("Embedding", vocab_size=vocab_size, n_embd=n_embd)
        self.decl = ParamDecl(name, (vocab_size, n_embd), True, "vocab", std)

    def param_specs(self):
        return [self.decl]

    def forward(self, params, x):
        return layers.token_embedding_forward(x, params[0])

    def backward(self, params, grads, cache, dy):
        layers.token_embedding_backward(dy, cache, grads[0])
        return None


class PositionalEmbedding(Module):
    """Learned absolute positions: y[b, t] = x[b, t] + weight[t]. x: (B, T, C), T <= max_len
    (else ConfigError). Parameter `name` (max_len, C), replicated."""

    backward_needs_params = False

    def __init__(self, max_len, n_embd, name="wpe", std=STD):
        _positive("PositionalEmbedding", max_len=max_len, n_embd=n_embd)
        self.decl = ParamDecl(name, (max_len, n_embd), True, "replicated", std)

    def param_specs(self):
        return [self.decl]

    def forward(self, params, x):
        if x.shape[1] > params[0].shape[0]:
            raise ConfigError(f"PositionalEmbedding: {x.shape[1]} positions but max_len is "
                              f"{params[0].shape[0]}")
        return layers.position_embedding_forward(x, params[0])

    def backward(self, params, grads, cache, dy):
        return layers.position_embedding_backward(dy, cache, grads[0])[0]


class PatchEmbedding(Module):
    """Vision-transformer patch embedding: y = patchify(x) @ w + b. x: (B, Hi, Wi, Ci) with Hi, Wi
    divisible by `patch` (else ConfigError); y: (B, Np, C). Parameters w (P*P*Ci, C), b (C,),
    replicated."""

    def __init__(self, patch, channels, n_embd, std=STD):
        _positive("PatchEmbedding", patch=patch, channels=channels, n_embd=n_embd)
        self.patch, self.channels = patch, channels
        self.decls = [ParamDecl("w", (patch * patch * channels, n_embd), True, "replicated", std),
                      ParamDecl("b", (n_embd,), False)]

    def param_specs(self):
        return list(self.decls)

    def forward(self, params, x):
        P = self.patch
        if x.ndim != 4 or x.shape[1] % P or x.shape[2] % P or x.shape[3] != self.channels:
            raise ConfigError(f"PatchEmbedding: images must be (B, Hi, Wi, {self.channels}) with "
                              f"Hi, Wi divisible by {P}, got shape {x.shape}")
        y, (lin, shape, patch) = layers.patch_embedding_forward(x, *params, self.patch)
        return y, (lin[0], shape)

    def backward(self, params, grads, cache, dy):
        x, shape = cache
        return layers.patch_embedding_backward(dy, ((x, params[0], True), shape, self.patch),
                                               *grads)[0]


class LayerNorm(Module):
    """LayerNorm over the last dim. x, y: (..., C). Parameters g (C,) ones, b (C,) zeros,
    replicated."""

    def __init__(self, n_embd):
        _positive("LayerNorm", n_embd=n_embd)
        self.decls = [ParamDecl("g", (n_embd,), False, init="ones"), ParamDecl("b", (n_embd,), False)]

    def param_specs(self):
        return list(self.decls)

    def forward(self, params, x):
        y, (xhat, rstd, _) = layers.layernorm_forward(x, *params)
        return y, (xhat, rstd)

    def backward(self, params, grads, cache, dy):
        return layers.layernorm_backward(dy, cache + (params[0],), *grads)[0]

    def residual_forward(self, params, a, x):
        """The residual add of a pre-LN block and this LayerNorm: x1 = a + x, h = LayerNorm(x1),
        one kernel on cupy (layers.residual_layernorm_forward). a, x: (..., C); a is updated in
        place to x1 on numpy. Returns x1, h, cache (for `backward`, which gives dx1)."""
        x1, h, (xhat, rstd, _) = layers.residual_layernorm_forward(a, x, *params)
        return x1, h, (xhat, rstd)


class Linear(Module):
    """y = x @ w + b. x: (..., C_in); y: (..., C_out). Parameters w (C_in, C_out) and, with bias,
    b (C_out,). split: "column" (w and b split on C_out) or "row" (w split on C_in, b whole)."""

    def __init__(self, c_in, c_out, bias=True, split="column", std=STD):
        _positive("Linear", c_in=c_in, c_out=c_out)
        if split not in ("column", "row", "replicated"):
            raise ConfigError(f"Linear: split must be 'column', 'row' or 'replicated', got {split!r}")
        self.decls = [ParamDecl("w", (c_in, c_out), True, split, std)]
        if bias:
            self.decls.append(ParamDecl("b", (c_out,), False, "column" if split == "column"
                                        else "replicated"))

    def param_specs(self):
        return list(self.decls)

    def forward(self, params, x):
        y, (x, _, _) = layers.linear_forward(x, *params)
        return y, x

    def backward(self, params, grads, cache, dy):
        return layers.linear_backward(dy, (cache, params[0], len(self.decls) == 2), *grads)[0]


class GELU(Module):
    """GELU, tanh approximation (layers.gelu_forward). x, y: any shape. No parameters."""

    backward_needs_params = False

    def param_specs(self):
        return []

    def forward(self, params, x):
        return layers.gelu_forward(x)

    def backward(self, params, grads, cache, dy):
        return layers.gelu_backward(dy, cache)


class BiasGELU(Module):
    """y = GELU(x + b): the bias of a bias-free Linear before it, then the activation (MLP's fc
    bias and GELU), one kernel on cupy (layers.bias_gelu_forward). x, y: (..., F); x is updated
    in place to x + b on numpy (pass a fresh array, e.g. a Linear's output). Parameter `name`
    (F,) zeros, split "column"."""

    backward_needs_params = False

    def __init__(self, width, name="b"):
        _positive("BiasGELU", width=width)
        self.decl = ParamDecl(name, (width,), False, "column")

    def param_specs(self):
        return [self.decl]

    def forward(self, params, x):
        return layers.bias_gelu_forward(x, params[0])

    def backward(self, params, grads, cache, dy):
        return layers.bias_gelu_backward(dy, cache, grads[0])[0]


class AttentionCore(Module):
    """Scaled dot-product attention on split heads: softmax(q k^T / sqrt(hs) [+ causal mask]) v,
    MultiHeadAttention between its projections (its `core`; Ulysses runs it on the full sequence
    of some heads, rtxmpi.parallel.sequence). x: (q, k, v), each (B, H, T, hs); y: (B, H, T, hs);
    backward returns (dq, dk, dv). No parameters. scores_forward / scores_backward are its
    softmax step alone (what the planner's calibration times)."""

    backward_needs_params = False

    def __init__(self, causal=True):
        self.causal = bool(causal)

    def param_specs(self):
        return []

    def forward(self, params, x):
        q, k, v = x
        return layers.attention_core_forward(q, k, v, self.causal)

    def backward(self, params, grads, cache, dy):
        return layers.attention_core_backward(dy, cache)

    def scores_forward(self, att):
        """att (..., T, T) scores -> the probabilities, in place (mask, softmax). Returns att."""
        return layers.masked_softmax_forward(att, self.causal)

    def scores_backward(self, datt, att):
        """The scores' gradient from the probabilities' (datt, overwritten) and att."""
        return layers.softmax_backward(datt, att)


def _attention_cache_with(cache, w_qkv, w_proj):
    """A layers.attention_forward cache holding these weights (None: taken out)."""
    qkv, q, k, v, att, proj, n_head = cache
    return ((qkv[0], w_qkv, qkv[2]), q, k, v, att, (proj[0], w_proj, proj[2]), n_head)


def _mlp_cache_with(cache, w_fc, w_proj):
    """A layers.mlp_forward cache holding these weights (None: taken out)."""
    fc, gelu, proj = cache
    return ((fc[0], w_fc, fc[2]), gelu, (proj[0], w_proj, proj[2]))


class MultiHeadAttention(Module):
    """Multi-head self-attention with a fused qkv projection; causal (a decoder) or bidirectional
    (an encoder). x, y: (B, T, C). Parameters w_qkv (C, 3C) and b_qkv (3C,) column-split (whole
    heads per rank), w_proj (C, C) row-split, b_proj (C,) replicated. proj_std: the std of w_proj
    (GPT-2 scales the residual projections by 1 / sqrt(2 * n_layer))."""

    def __init__(self, n_embd, n_head, causal=True, std=STD, proj_std=STD):
        _positive("MultiHeadAttention", n_embd=n_embd, n_head=n_head)
        if n_embd % n_head:
            raise ConfigError(f"MultiHeadAttention: n_embd ({n_embd}) must be divisible by "
                              f"n_head ({n_head})")
        self.n_head, self.causal = n_head, bool(causal)
        self.core = AttentionCore(causal)  # what runs between the projections
        C = n_embd
        self.decls = [ParamDecl("w_qkv", (C, 3 * C), True, "column", std),
                      ParamDecl("b_qkv", (3 * C,), False, "column"),
                      ParamDecl("w_proj", (C, C), True, "row", proj_std),
                      ParamDecl("b_proj", (C,), False)]

    def param_specs(self):
        return list(self.decls)

    def forward(self, params, x):
        y, cache = layers.attention_forward(x, *params, self.n_head, self.causal)
        return y, _attention_cache_with(cache, None, None)

    def backward(self, params, grads, cache, dy):
        cache = _attention_cache_with(cache, params[0], params[2])
        return layers.attention_backward(dy, cache, grads)[0]


class MLP(Module):
    """Position-wise MLP with GELU: y = gelu(x @ w_fc + b_fc) @ w_proj + b_proj; hidden 4C.
    x, y: (..., C). Parameters w_fc (C, 4C) and b_fc column-split, w_proj (4C, C) row-split,
    b_proj (C,) replicated."""

    def __init__(self, n_embd, std=STD, proj_std=STD):
        _positive("MLP", n_embd=n_embd)
        C = n_embd
        self.decls = [ParamDecl("w_fc", (C, 4 * C), True, "column", std),
                      ParamDecl("b_fc", (4 * C,), False, "column"),
                      ParamDecl("w_proj", (4 * C, C), True, "row", proj_std),
                      ParamDecl("b_proj", (C,), False)]

    def param_specs(self):
        return list(self.decls)

    def forward(self, params, x):
        y, cache = layers.mlp_forward(x, *params)
        return y, _mlp_cache_with(cache, None, None)

    def backward(self, params, grads, cache, dy):
        return layers.mlp_backward(dy, _mlp_cache_with(cache, params[0], params[2]), grads)[0]


class TransformerBlock(Module):
    """Pre-LN transformer block: x = x + attn(ln1(x)); y = x + mlp(ln2(x)). x, y: (B, T, C).
    Parameters: ln1.*, attn.*, ln2.*, mlp.* of LayerNorm, MultiHeadAttention, LayerNorm, MLP (the
    order of layers.BLOCK_PARAM_NAMES). Runs layers.block_forward / block_backward, which fuse the
    residual add with ln2 and the fc bias with the GELU on cupy. Reports each gradient as it is
    final (ready(j), j = 11 ... 0); defer (Module): the MLP's weight and bias gradients."""

    reports_ready = True
    defers_weight_grads = True

    def __init__(self, n_embd, n_head, causal=True, std=STD, proj_std=STD):
        self.n_head, self.causal = n_head, bool(causal)
        self.parts = (("ln1", LayerNorm(n_embd)),
                      ("attn", MultiHeadAttention(n_embd, n_head, causal, std, proj_std)),
                      ("ln2", LayerNorm(n_embd)), ("mlp", MLP(n_embd, std, proj_std)))

    def param_specs(self):
        return [ParamDecl(f"{prefix}.{d.name}", d.shape, d.decay, d.split, d.init)
                for prefix, m in self.parts for d in m.param_specs()]

    def forward(self, params, x):
        y, (ln1, attn, ln2, mlp) = layers.block_forward(x, params, self.n_head, self.causal)
        return y, ((ln1[0], ln1[1]), _attention_cache_with(attn, None, None), (ln2[0], ln2[1]),
                   _mlp_cache_with(mlp, None, None))

    def backward(self, params, grads, cache, dy, ready=None, defer=None):
        ln1, attn, ln2, mlp = cache
        cache = (ln1 + (params[0],), _attention_cache_with(attn, params[2], params[4]),
                 ln2 + (params[6],), _mlp_cache_with(mlp, params[8], params[10]))
        return layers.block_backward(dy, cache, grads, ready=ready, defer=defer)[0]

    def forward_with(self, params, x, attn, mlp):
        """`forward` with other attention and MLP modules over the same parameter slots (e.g.
        their tensor-parallel versions on local shards: rtxmpi.parallel.parallelize), between
        this block's LayerNorms: the same operations in the same order. params: the 12 arrays
        (attn's at 2:6, mlp's at 8:12). Returns y, cache (for `backward_with`)."""
        ln1, ln2 = self.parts[0][1], self.parts[2][1]
        h1, c_ln1 = ln1.forward(params[0:2], x)
        a, c_attn = attn.forward(params[2:6], h1)
        x1, h2, c_ln2 = ln2.residual_forward(params[6:8], a, x)  # x1 = x + attn(ln1(x))
        y, c_mlp = mlp.forward(params[8:12], h2)
        y += x1
        return y, (c_ln1, c_attn, c_ln2, c_mlp)

    def backward_with(self, params, grads, cache, dy, attn, mlp):
        """Gradients of `forward_with` (the same attn and mlp): adds into grads, returns dx."""
        ln1, ln2 = self.parts[0][1], self.parts[2][1]
        c_ln1, c_attn, c_ln2, c_mlp = cache
        dh2 = mlp.backward(params[8:12], grads[8:12], c_mlp, dy)
        dx1 = ln2.backward(params[6:8], grads[6:8], c_ln2, dh2)
        dx1 += dy  # residual
        dh1 = attn.backward(params[2:6], grads[2:6], c_attn, dx1)
        dx = ln1.backward(params[0:2], grads[0:2], c_ln1, dh1)
        dx += dx1  # residual
        return dx


class LMHead(Module):
    """Language-model head with cross-entropy: logits = x @ W.T, W (V, C). x: (B, T, C); y: the
    logits (B, T, V). tied_to: None, W is this module's parameter `name` (split "vocab"); or the
    full name of an earlier (V, C) parameter it shares (e.g. "wte": tied embeddings).
    loss_forward(logits, targets (B, T) ids) -> (mean cross-entropy in nats, 0-d array, cache);
    loss_backward(scale, cache) -> dlogits of scale * loss. defer (Module): W's gradient."""

    defers_weight_grads = True

    def __init__(self, vocab_size, n_embd, tied_to=None, name="lm_head", std=STD):
        _positive("LMHead", vocab_size=vocab_size, n_embd=n_embd)
        self.decl = ParamDecl(name, (vocab_size, n_embd), True, "vocab", std, tied_to)

    def param_specs(self):
        return [self.decl]

    def forward(self, params, x):
        y, (x, _, _) = layers.linear_forward(x, params[0].T)
        return y, x

    def backward(self, params, grads, cache, dy, defer=None):
        return layers.linear_backward(dy, (cache, params[0].T, False), dw_out=grads[0].T,
                                      defer=defer)[0]

    def loss_forward(self, y, targets):
        return layers.crossentropy_forward(y, targets)

    def loss_backward(self, scale, cache):
        return layers.crossentropy_backward(scale, cache)


class ClassificationHead(Module):
    """Classifier with cross-entropy: logits = mean_t(x) @ w + b. x: (B, T, C); y: the logits
    (B, K). Parameters w (C, K), b (K,), replicated. loss_forward(logits, targets (B,) ids in
    [0, K)) -> (mean cross-entropy, cache); loss_backward(scale, cache) -> dlogits."""

    def __init__(self, n_embd, n_classes, std=STD):
        _positive("ClassificationHead", n_embd=n_embd, n_classes=n_classes)
        self.decls = [ParamDecl("w", (n_embd, n_classes), True, "replicated", std),
                      ParamDecl("b", (n_classes,), False)]

    def param_specs(self):
        return list(self.decls)

    def forward(self, params, x):
        pooled, pool_cache = layers.mean_pool_forward(x)
        y, (pooled, _, _) = layers.linear_forward(pooled, *params)
        return y, (pool_cache, pooled)

    def backward(self, params, grads, cache, dy):
        pool_cache, pooled = cache
        dpooled = layers.linear_backward(dy, (pooled, params[0], True), *grads)[0]
        return layers.mean_pool_backward(dpooled, pool_cache)

    def loss_forward(self, y, targets):
        return layers.crossentropy_forward(y, targets)

    def loss_backward(self, scale, cache):
        return layers.crossentropy_backward(scale, cache)


class ClassToken(Module):
    """A learned class token put before the sequence (ViT, Dosovitskiy et al. 2021):
    y[:, 0] = token, y[:, 1:] = x. x: (B, T, C); y: (B, T + 1, C). Parameter `name` (C,),
    replicated, not decayed. Backward needs no parameter."""

    backward_needs_params = False

    def __init__(self, n_embd, name="cls", std=STD):
        _positive("ClassToken", n_embd=n_embd)
        self.decl = ParamDecl(name, (n_embd,), False, "replicated", std)

    def param_specs(self):
        return [self.decl]

    def forward(self, params, x):
        xp = xp_of(x)
        B, T, C = x.shape
        y = xp.empty((B, T + 1, C), x.dtype)
        y[:, 0] = params[0]
        y[:, 1:] = x
        return y, None

    def backward(self, params, grads, cache, dy):
        grads[0] += dy[:, 0].sum(axis=0)
        return dy[:, 1:]


class ClassTokenHead(Module):
    """Classifier on the class token with cross-entropy (ViT): logits = x[:, 0] @ w + b; the
    other positions get no gradient. x: (B, T, C); y: the logits (B, K). Parameters w (C, K),
    b (K,), replicated. loss_forward(logits, targets (B,) ids in [0, K)) -> (mean cross-entropy,
    cache); loss_backward(scale, cache) -> dlogits. (ClassificationHead pools by the mean.)"""

    def __init__(self, n_embd, n_classes, std=STD):
        _positive("ClassTokenHead", n_embd=n_embd, n_classes=n_classes)
        self.decls = [ParamDecl("w", (n_embd, n_classes), True, "replicated", std),
                      ParamDecl("b", (n_classes,), False)]

    def param_specs(self):
        return list(self.decls)

    def forward(self, params, x):
        y, (token, _, _) = layers.linear_forward(x[:, 0], *params)
        return y, (token, x.shape)

    def backward(self, params, grads, cache, dy):
        token, shape = cache
        dx = xp_of(dy).zeros(shape, dy.dtype)
        dx[:, 0] = layers.linear_backward(dy, (token, params[0], True), *grads)[0]
        return dx

    def loss_forward(self, y, targets):
        return layers.crossentropy_forward(y, targets)

    def loss_backward(self, scale, cache):
        return layers.crossentropy_backward(scale, cache)


# The modules that work on a whole sample's positions, which sequence parallelism cannot split:
WHOLE_INPUT = (PatchEmbedding, ClassToken)  # make the positions from the whole input
WHOLE_HEAD = (ClassificationHead, ClassTokenHead)  # read every position of a sample
