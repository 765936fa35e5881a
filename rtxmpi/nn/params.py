"""Parameters as views into one flat, contiguous buffer.

A model lays its parameters out once, in parameter-index order (the order of `model.params`, which
is forward order), back to back with no gaps. `flat_data` holds the values and `flat_grad` the
gradients with the same layout, so a gradient bucket, a ZeRO shard or a checkpoint slice is just a
`[start:stop]` range of a 1-D array, and each `Param` is a pair of reshaped views into it.
"""
from dataclasses import dataclass

import numpy as np

from rtxmpi.errors import ConfigError


@dataclass(frozen=True)
class ParamSpec:
    """Where one parameter lives in the flat buffers.

    name: dotted name ("h0.attn.w_qkv"); shape: tuple of ints; offset: first element in the flat
    buffer; decay: whether weight decay applies (matrices and embeddings yes, biases and LayerNorm
    gains/biases no).
    """

    name: str
    shape: tuple
    offset: int
    decay: bool

    @property
    def size(self):
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def stop(self):
        """One past the last element in the flat buffer (`offset + size`)."""
        return self.offset + self.size


def layout(entries):
    """Lay parameters out back to back, in the given order.

    entries: iterable of (name, shape, decay). Returns list[ParamSpec] with contiguous offsets
    starting at 0. Raises ConfigError on a duplicate name or a negative dimension.
    """
    specs, offset, seen = [], 0, set()
    for name, shape, decay in entries:
        shape = tuple(int(d) for d in shape)
        if name in seen:
            raise ConfigError(f"duplicate parameter name {name!r}")
        if any(d < 0 for d in shape):
            raise ConfigError(f"parameter {name!r} has a negative dimension in shape {shape}")
        seen.add(name)
        spec = ParamSpec(name, shape, offset, bool(decay))
        specs.append(spec)
        offset = spec.stop
    return specs


class Param:
    """A parameter bound to the model's flat buffers.

    Attributes: name, shape, offset, size, decay (from its ParamSpec), index (position in
    `model.params`), data and grad (views of shape `shape` into flat_data / flat_grad; writing
    into them writes the flat buffers).
    """

    __slots__ = ("spec", "index", "data", "grad")

    def __init__(self, spec, index, flat_data, flat_grad):
        self.spec, self.index = spec, index
        self.data = flat_data[spec.offset:spec.stop].reshape(spec.shape)
        self.grad = flat_grad[spec.offset:spec.stop].reshape(spec.shape)

    name = property(lambda self: self.spec.name)
    shape = property(lambda self: self.spec.shape)
    offset = property(lambda self: self.spec.offset)
    size = property(lambda self: self.spec.size)
    decay = property(lambda self: self.spec.decay)

    def __repr__(self):
        return (f"Param({self.name!r}, shape={self.shape}, offset={self.offset}, "
                f"decay={self.decay})")


def bind(specs, flat_data, flat_grad):
    """Bind specs to flat buffers. flat_data, flat_grad: 1-D contiguous arrays of length
    `specs[-1].stop`. Returns list[Param] in the order of `specs`."""
    total = specs[-1].stop if specs else 0
    for label, flat in (("flat_data", flat_data), ("flat_grad", flat_grad)):
        if flat.ndim != 1 or flat.shape[0] != total:
            raise ConfigError(f"{label} must be 1-D with {total} elements, got shape {flat.shape}")
    return [Param(spec, i, flat_data, flat_grad) for i, spec in enumerate(specs)]


def decay_mask(params, xp=np, dtype=np.float32):
    """1-D mask over the flat layout: 1 where weight decay applies, 0 elsewhere.

    params: list of Param or ParamSpec (contiguous layout from offset 0). Returns an `xp` array of
    `dtype` and length `sum(p.size)`. Slice it like the parameter buffer for a shard.
    """
    total = max((p.offset + p.size for p in params), default=0)
    mask = np.zeros(total, dtype=dtype)
    for p in params:
        if p.decay:
            mask[p.offset:p.offset + p.size] = 1
    return mask if xp is np else xp.asarray(mask)
