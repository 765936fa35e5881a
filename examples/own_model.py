"""Your own model on rtxmpi: a residual MLP classifier with a block of its own, on a tabular task.

    python examples/own_model.py                      # one process (the layout below)
    mpiexec -n 4 python examples/own_model.py         # after the README's diff: dp x pp, ZeRO, recompute

The model is rtxmpi.nn modules (Linear, ClassificationHead) plus SwishBlock, a module written
here (a pre-LN residual MLP with the SiLU nonlinearity, which rtxmpi.nn does not ship), checked
with rtxmpi.nn.gradcheck before training. The data: scikit-learn's make_classification (4 classes,
20 features; no download). The loop is rtxmpi.train.fit's; rtxmpi.train.build_parallel builds the
engine of `layout` (docs/model.md "Your own model"). Rank 0 prints the loss and, at the end, the
held-out accuracy. Needs scikit-learn (pip install 'rtxmpi[vision]').
"""
import sys

import numpy as np

from rtxmpi.backend import to_host
from rtxmpi.data_vision import ImageBatchSampler, eval_slice
from rtxmpi.errors import ConfigError
from rtxmpi.nn import AdamW, ClassificationHead, LayerNorm, Linear, Model, Module, Sequential, gradcheck
from rtxmpi.parallel.layout import Layout
from rtxmpi.train import Task, TrainConfig, build_parallel, exit_status, fit

FEATURES, CLASSES, WIDTH, DEPTH = 20, 4, 64, 4
layout = Layout(dp=1)  # one process


class SwishBlock(Module):
    """y = x + proj(silu(fc(ln(x)))), silu(h) = h * sigmoid(h). x, y: (B, T, C); hidden 2C."""

    def __init__(self, c):
        self.inner = Sequential(("ln", LayerNorm(c)), ("fc", Linear(c, 2 * c, split="replicated")))
        self.outer = Sequential(("proj", Linear(2 * c, c, split="replicated")))

    def param_specs(self):
        return self.inner.param_specs() + self.outer.param_specs()

    def forward(self, params, x):
        h, inner = self.inner.forward(params[:4], x)
        s = 0.5 * (1.0 + np.tanh(0.5 * h))  # sigmoid(h), without overflow
        y, outer = self.outer.forward(params[4:], h * s)
        return x + y, (inner, h, s, outer)

    def backward(self, params, grads, cache, dy):
        inner, h, s, outer = cache
        da = self.outer.backward(params[4:], grads[4:], outer, dy)
        return dy + self.inner.backward(params[:4], grads[:4], inner, da * s * (1.0 + h * (1.0 - s)))


def make_model(seed=0, dtype=np.float32):
    """The one-process model: input projection, DEPTH SwishBlocks, a classifier over T = 1."""
    return Model([Sequential(("inp", Linear(FEATURES, WIDTH, split="replicated")))]
                 + [(f"block{i}", SwishBlock(WIDTH)) for i in range(DEPTH)]
                 + [Sequential(("head", ClassificationHead(WIDTH, CLASSES)))], seed=seed, dtype=dtype)


def load_data(seed=0, n=3000, val_fraction=0.2):
    """(train x, train y, held-out x, held-out y): standardized features as (N, 1, FEATURES)
    float32 (one position per sample), labels (N,) int64 in [0, CLASSES)."""
    try:
        from sklearn.datasets import make_classification
    except ImportError as exc:
        raise ConfigError("examples/own_model.py needs scikit-learn: pip install 'rtxmpi[vision]'") from exc
    x, y = make_classification(n, FEATURES, n_informative=12, n_redundant=4, n_classes=CLASSES,
                               class_sep=1.5, random_state=seed)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)[:, None, :]
    n_val = round(val_fraction * n)
    return x[n_val:], y[n_val:], x[:n_val], y[:n_val]


class OwnTask(Task):
    name = "own-model"

    def __init__(self, seed=0):
        self.seed, self.data = seed, load_data(seed)

    def build(self, world, config):
        built = self.built = build_parallel(
            lambda: make_model(self.seed), world, layout, global_batch=config.global_batch,
            optimizer=lambda params, mask: AdamW(params, lr=config.lr, decay_mask=mask))
        sampler = ImageBatchSampler(*self.data[:2], config.global_batch, seed=self.seed,
                                    dp_rank=built.data_rank, dp_size=built.data_size)
        return built.parts(sampler, config.global_batch, unit="samples")

    def describe(self, world, parts, config):
        return (f"own model: {self.built.num_params} parameters, {len(self.data[1])} train and "
                f"{len(self.data[3])} held-out samples; {world.world_size} rank(s), "
                f"layout {self.built.layout}")

    def held_out(self, world):
        """(mean loss, accuracy) over the held-out set, each rank its slice. Collective."""
        model, (x, y) = self.built.gathered_model(), self.data[2:]
        part = eval_slice(len(y), world.rank, world.world_size)
        loss = model.forward(x[part], y[part])[0]
        correct = (to_host(model.predict(x[part])).argmax(-1) == y[part]).sum()
        totals = np.array([loss * len(y[part]), correct], np.float64)
        world.all_reduce(totals, op="sum")
        return totals[0] / len(y), totals[1] / len(y)

    def evaluate(self, world, parts, config):
        return float(self.held_out(world)[0])

    def finish(self, world, parts, config, record):
        accuracy = self.held_out(world)[1]
        if world.rank == 0:
            print(f"held-out accuracy {accuracy:.4f} (chance {1 / CLASSES:.2f})")


def main():
    rng = np.random.default_rng(0)  # the block's gradients against finite differences (float64)
    gradcheck(SwishBlock(8), rng.standard_normal((3, 2, 8)), tol=1e-6)
    config = TrainConfig(steps=150, global_batch=32, lr=3e-3, log_every=50, progress=False)
    code = exit_status(lambda: fit(OwnTask(), config))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
