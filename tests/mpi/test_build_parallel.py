"""rtxmpi.train.build_parallel at every layout of the world size against one process: the model
of examples/own_model.py (a user module, SwishBlock) and the ViT, float64, three clipped AdamW
steps on the same global batches; the layout's recompute applied; evaluation at any layout."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from conftest import GLOBAL_BATCH

from rtxmpi.nn import AdamW, ViT, ViTConfig, clip_grad_norm, decay_mask
from rtxmpi.parallel.layout import Layout
from rtxmpi.train import build_parallel

MAX_GRAD_NORM, LR, STEPS = 0.5, 1e-2, 3
VIT = ViTConfig(n_layer=2, n_head=4, n_embd=16, n_classes=5)
_spec = importlib.util.spec_from_file_location(
    "own_model", Path(__file__).resolve().parents[2] / "examples" / "own_model.py")
own = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(own)


def own_model():
    return own.make_model(seed=3, dtype=np.float64)


def vit():
    return ViT(VIT, seed=3, dtype=np.float64)


def own_batch(step):
    rng = np.random.default_rng(step)
    return rng.standard_normal((GLOBAL_BATCH, 1, own.FEATURES)), rng.integers(0, own.CLASSES, GLOBAL_BATCH)


def vit_batch(step):
    rng = np.random.default_rng(50 + step)
    return rng.random((GLOBAL_BATCH, 8, 8, 1)), rng.integers(0, VIT.n_classes, GLOBAL_BATCH)


def adamw(params, mask):
    return AdamW(params, lr=LR, decay_mask=mask)


def reference(make, batch):
    model = make()
    opt = adamw(model.flat_data, decay_mask(model.params, dtype=model.dtype))
    for step in range(STEPS):
        model.backward(model.forward(*batch(step))[1])
        clip_grad_norm(model.flat_grad, MAX_GRAD_NORM)
        opt.step(model.flat_grad)
        model.zero_grad()
    return model.flat_data


def train(built, batch):
    """STEPS clipped steps through the engine's calls, each data rank on its rows; the loss."""
    engine, b = built.engine, GLOBAL_BATCH // built.data_size
    for step in range(STEPS):
        x, y = (a[built.data_rank * b:(built.data_rank + 1) * b] for a in batch(step))
        if built.pipelined:
            loss = engine.train_step(x, y)
        else:
            loss, cache = engine.forward(x, y)
            engine.backward(cache)
        engine.step(max_grad_norm=MAX_GRAD_NORM, total_norm=engine.grad_norm())
    return loss


def layouts(n, vit_model=False):
    """Layouts of world size n: dp with every ZeRO stage, tp, pp, and dp x pp at 4 ranks."""
    out = [Layout(dp=None, zero_stage=z, recompute="blocks") for z in (0, 1, 2, 3)]
    if n > 1:
        out += [Layout(dp=None, tp=2, zero_stage=1, recompute="blocks"),
                Layout(dp=None, pp=2, micro_batches=2, schedule="1f1b", zero_stage=1,
                       recompute="blocks")]
    if n == 4 and not vit_model:
        out += [Layout(dp=2, pp=2, micro_batches=2, schedule="gpipe", recompute="blocks")]
    return out


@pytest.mark.parametrize("i", range(7))
@pytest.mark.parametrize("name", ["own", "vit"])
def test_every_layout_matches_one_process(world, name, i):
    make, batch = (own_model, own_batch) if name == "own" else (vit, vit_batch)
    cases = layouts(world.world_size, vit_model=name == "vit")
    if i >= len(cases):
        pytest.skip(f"{len(cases)} layouts at world size {world.world_size}")
    layout = cases[i]
    built = build_parallel(make, world, layout, optimizer=adamw, global_batch=GLOBAL_BATCH)
    assert built.layout.dp * layout.tp * layout.pp == world.world_size
    assert built.pipelined == (layout.pp > 1) and built.zero_stage == layout.zero_stage
    recomputed = built.model.recompute if built.pipelined else built.model.recompute_units
    assert recomputed, "the layout's recompute was not applied"  # the stage's units / the model's
    train(built, batch)
    np.testing.assert_allclose(built.engine.full_params(), reference(make, batch), rtol=1e-9,
                               atol=1e-11)
    gathered = built.gathered_model()  # collective; every rank evaluates the one-process model
    x, y = batch(STEPS)
    want = make()
    want.flat_data[...] = reference(make, batch)
    assert gathered.forward(x, y)[0] == pytest.approx(want.forward(x, y)[0], rel=1e-10)
