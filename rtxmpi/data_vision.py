"""Image classification data: scikit-learn's 8x8 digits, a seeded train / held-out split, and the
global-batch sampler of images.

The digits (`sklearn.datasets.load_digits`: 1,797 images of 8x8 pixels in 0..16, 10 classes)
ship inside scikit-learn, so nothing is downloaded at run time; install it with
`pip install rtxmpi[vision]`. As with the text sampler (rtxmpi.data.BatchSampler), global sample
`i` is a function of `(seed, i)` alone, so every data-parallel world size reads the same global
batch, and the position is one integer to checkpoint. Nothing here needs MPI.
"""
from dataclasses import dataclass, field

import numpy as np

from rtxmpi.data import SamplerPosition, _check_int, _check_rank, _epoch_keys, _permute, batch_split
from rtxmpi.errors import ConfigError


@dataclass(frozen=True)
class ImageDataset:
    """Images and labels in two splits. train_images, val_images: (N, S, S, Ci) float32 in [0, 1],
    channels last; train_labels, val_labels: (N,) int64 in [0, n_classes)."""

    train_images: np.ndarray = field(repr=False)
    train_labels: np.ndarray = field(repr=False)
    val_images: np.ndarray = field(repr=False)
    val_labels: np.ndarray = field(repr=False)
    n_classes: int


def load_digits(val_fraction=0.2, seed=0):
    """scikit-learn's 8x8 digits as an ImageDataset: images (N, 8, 8, 1) float32 scaled to [0, 1],
    10 classes. The held-out split is the first round(val_fraction * 1797) images of a
    permutation drawn from numpy.random.default_rng(seed), the train split the rest: a function
    of (val_fraction, seed) only. Raises ConfigError when scikit-learn is missing or val_fraction
    is outside (0, 1). Local; any number of ranks may call at once (no file is written).
    """
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction {val_fraction!r} is outside (0, 1); use e.g. 0.2")
    seed = _check_int("seed", seed, 0)
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise ConfigError("the digits data set needs scikit-learn: pip install "
                          "'rtxmpi[vision]' (or scikit-learn)") from None
    digits = sklearn_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_val = min(max(1, round(val_fraction * len(labels))), len(labels) - 1)
    val, train = order[:n_val], order[n_val:]
    return ImageDataset(np.ascontiguousarray(images[train]), labels[train],
                        np.ascontiguousarray(images[val]), labels[val], 10)


class ImageBatchSampler(SamplerPosition):
    """This rank's slice of each global batch of images, drawn from (seed, global sample index).

    images: (N, ...) array; labels: (N,) array. global_batch: samples per step over all
    data-parallel ranks, at least dp_size. dp_rank, dp_size: this rank's place in the
    data-parallel group (ints). start_sample: global samples already consumed (the resume
    position). Global sample i is image perm(i % N), perm the keyed bijection of [0, N) of
    (seed, epoch = i // N) that the text sampler uses (docs/data.md): every epoch visits each
    image once, in an order of its own, whatever the numpy version. Step k reads global samples
    [s, s + global_batch), s = samples_consumed, and rank r the slice that
    batch_split(global_batch, dp_size) gives it (rtxmpi.data.BatchSampler's rule): the slices of
    all ranks in rank order are the dp_size=1 batch bit for bit. Endless. Local: no rank talks
    to another.
    Raises ConfigError: global_batch smaller than dp_size, no images, labels not matching,
    a rank outside [0, dp_size), non-integer or negative sizes.
    """

    def __init__(self, images, labels, global_batch, *, seed=0, dp_rank=0, dp_size=1,
                 start_sample=0):
        if getattr(images, "ndim", 0) < 1 or len(images) == 0:
            raise ConfigError("ImageBatchSampler: no images")
        if getattr(labels, "shape", None) != (len(images),):
            raise ConfigError(f"ImageBatchSampler: labels shape "
                              f"{getattr(labels, 'shape', type(labels).__name__)} does not match "
                              f"{len(images)} images")
        self.images, self.labels = images, labels
        self.global_batch = _check_int("global_batch", global_batch, 1)
        self.dp_size = _check_int("dp_size", dp_size, 1)
        self.dp_rank = _check_rank(dp_rank, self.dp_size)
        sizes = batch_split(self.global_batch, self.dp_size)
        self.local_batch = sizes[self.dp_rank]
        self.local_offset = sum(sizes[:self.dp_rank])
        self.seed = _check_int("seed", seed, 0)
        self.samples_consumed = _check_int("start_sample", start_sample, 0)

    @property
    def epoch(self):
        """0-based epoch of the next sample."""
        return self.samples_consumed // len(self.images)

    def indices(self, samples):
        """Image indices of global samples `samples` (1-D int array). Pure."""
        n = len(self.images)
        samples = np.asarray(samples, np.int64)
        out = np.empty(samples.shape, np.int64)
        for epoch in np.unique(samples // n):
            sel = samples // n == epoch
            out[sel] = _permute(samples[sel] % n, n, _epoch_keys(self.seed, int(epoch))[0])
        return out

    def next_batch(self):
        """-> images (b, ...), labels (b,): this rank's b = local_batch samples of the next step."""
        lo = self.samples_consumed + self.local_offset
        idx = self.indices(np.arange(lo, lo + self.local_batch))
        self.samples_consumed += self.global_batch
        return self.images[idx], self.labels[idx]



def eval_slice(n, dp_rank=0, dp_size=1):
    """This rank's contiguous part of n held-out samples: a slice, batch_split's rule (every
    rank at least one sample). Sum the correct counts over ranks for the accuracy of all n.
    Raises ConfigError when n < dp_size or for a bad rank."""
    dp_size = _check_int("dp_size", dp_size, 1)
    dp_rank = _check_rank(dp_rank, dp_size)
    sizes = batch_split(n, dp_size, "held-out set")
    start = sum(sizes[:dp_rank])
    return slice(start, start + sizes[dp_rank])
