"""Vision transformer (ViT, Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words") on flat
parameter buffers: a `Model` (rtxmpi.nn.module) of the shipped modules, `vit_units(cfg)`.

Shape legend: B batch, images (B, S, S, Ci) channels-last (S = image_size), P = patch_size,
Np = (S / P)^2 patches, T = Np + 1 positions (the class token first), C = n_embd, H = n_head,
K = n_classes, L = n_layer.

Units and parameter order (parameter index = forward order):
    unit 0, the embeddings: patch.w (P*P*Ci, C), patch.b (C,), cls (C,), pos (T, C);
    units 1..L, the blocks h{l} (bidirectional pre-LN TransformerBlock: ln1, attn, ln2, mlp);
    unit L+1, the head: ln_f.g, ln_f.b, head.w (C, K), head.b (K,).
The head classifies the class token's final representation (the paper's z_L^0), after the
final LayerNorm, with one linear layer (the paper's fine-tuning head).
"""
from dataclasses import dataclass, fields

import numpy as np

from rtxmpi.backend import xp_of
from rtxmpi.errors import ConfigError
from rtxmpi.nn.module import Model, Sequential
from rtxmpi.nn.modules import (ClassToken, ClassTokenHead, LayerNorm, PatchEmbedding,
                               PositionalEmbedding, TransformerBlock)

VIT_SIZES = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32},
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 64},
    "base": {"n_layer": 6, "n_head": 8, "n_embd": 128},
}


@dataclass(frozen=True)
class ViTConfig:
    """ViT hyper-parameters; validated on construction. The defaults fit scikit-learn's 8x8
    digits (rtxmpi.data_vision): one channel, 2x2 patches, 10 classes.

    Raises ConfigError for a non-positive size, image_size not divisible by patch_size, or n_embd
    not divisible by n_head.
    """

    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    n_classes: int = 10

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"ViTConfig.{f.name} must be a positive integer, got {value!r}")
        if self.image_size % self.patch_size:
            raise ConfigError(f"ViTConfig: image_size ({self.image_size}) must be divisible by "
                              f"patch_size ({self.patch_size})")
        if self.n_embd % self.n_head:
            raise ConfigError(f"ViTConfig: n_embd ({self.n_embd}) must be divisible by n_head "
                              f"({self.n_head})")

    @classmethod
    def named(cls, name, **overrides):
        """Config for a named size in VIT_SIZES ("tiny", "small", "base"), with overrides
        (e.g. image_size=32, channels=3). Raises ConfigError for an unknown name or field."""
        if name not in VIT_SIZES:
            raise ConfigError(f"unknown ViT size {name!r}; choose one of: {', '.join(VIT_SIZES)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown ViTConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**{**VIT_SIZES[name], **overrides})

    @property
    def n_patches(self):
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self):
        """Positions in the transformer: the class token and the patches."""
        return self.n_patches + 1


def vit_units(cfg):
    """The ViT's units as modules: Sequential(("patch", PatchEmbedding), ClassToken "cls",
    PositionalEmbedding "pos"), the blocks "h0" ... "h{L-1}" (bidirectional TransformerBlocks),
    Sequential(("ln_f", LayerNorm), ("head", ClassTokenHead)). Init: std 0.02, LayerNorm 1/0."""
    C = cfg.n_embd
    return ([Sequential(("patch", PatchEmbedding(cfg.patch_size, cfg.channels, C)),
                        ClassToken(C, "cls"), PositionalEmbedding(cfg.seq_len, C, "pos"))]
            + [(f"h{i}", TransformerBlock(C, cfg.n_head, causal=False)) for i in range(cfg.n_layer)]
            + [Sequential(("ln_f", LayerNorm(C)), ("head", ClassTokenHead(C, cfg.n_classes)))])


class ViT(Model):
    """Vision transformer classifier whose parameters and gradients are two flat buffers.

    cfg: ViTConfig; seed, xp, dtype, grad_alloc: as for rtxmpi.nn.GPT (initialization a function
    of (cfg, seed) only). Every engine that takes a GPT (DataParallel, ZeroDataParallel stages
    1-3, offload) takes a ViT. Raises ConfigError for a bad cfg, dtype or grad_alloc result.
    """

    def __init__(self, cfg, seed=0, xp=np, dtype=np.float32, grad_alloc=None):
        if not isinstance(cfg, ViTConfig):
            raise ConfigError(f"cfg must be a ViTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        super().__init__(vit_units(cfg), seed=seed, xp=xp, dtype=dtype, grad_alloc=grad_alloc)

    def check_images(self, images):
        """Raise ConfigError unless images is a non-empty (B, S, S, Ci) real array of the config's
        size with finite values. Local."""
        cfg = self.cfg
        want = (cfg.image_size, cfg.image_size, cfg.channels)
        shape = getattr(images, "shape", None)
        if getattr(images, "ndim", None) != 4 or tuple(shape[1:]) != want or shape[0] == 0:
            raise ConfigError(f"images must be a (B, {', '.join(map(str, want))}) array with "
                              f"B >= 1 (channels last), got "
                              f"{shape if shape is not None else type(images).__name__}")
        if images.dtype.kind not in "fiu":
            raise ConfigError(f"images must hold real numbers, got dtype {images.dtype}")
        if images.dtype.kind == "f" and not bool(xp_of(images).isfinite(images).all()):
            raise ConfigError("images hold NaN or infinite values")

    def check_batch(self, images, labels):
        """What `forward` checks, without computing anything: check_images, and labels a (B,)
        integer array in [0, n_classes) for the B images. Raises ConfigError. Local."""
        self.check_images(images)
        K = self.cfg.n_classes
        if getattr(labels, "shape", None) != (images.shape[0],) or labels.dtype.kind not in "iu":
            raise ConfigError(f"labels must be a ({images.shape[0]},) integer array, got "
                              f"{getattr(labels, 'shape', type(labels).__name__)} of dtype "
                              f"{getattr(labels, 'dtype', '?')}")
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= K:
            raise ConfigError(f"labels hold classes in [{lo}, {hi}] but n_classes is {K}; labels "
                              f"must be in [0, {K})")

    # the engines (rtxmpi.parallel.data.check_batch_on_every_rank) agree on this check's verdict
    check_tokens = check_batch

    def forward(self, images, labels):
        """Loss and cache for one (micro-)batch.

        images: (B, S, S, Ci) real array (cast to the model dtype); labels: (B,) integer classes
        in [0, n_classes). Host arrays are moved to the model's array module. Returns (loss,
        cache): loss is a Python float, the mean cross-entropy in nats over the B images.
        Raises ConfigError on a bad shape, dtype, value or label.
        """
        self.check_batch(images, labels)
        return super().forward(self.xp.asarray(images, dtype=self.dtype), self.xp.asarray(labels))

    def logits(self, images):
        """Class logits, no cache kept. images: (B, S, S, Ci). Returns (B, K) in the model dtype.
        Raises ConfigError like `forward`. (Collective when the provider is, as with ZeRO-3.)"""
        self.check_images(images)
        return self.predict(self.xp.asarray(images, dtype=self.dtype))
