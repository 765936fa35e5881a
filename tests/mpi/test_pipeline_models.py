"""Pipeline parallelism of Models other than the GPT, against the same Model in one process: the
ViT (rtxmpi.nn.vit) and a residual MLP of Linear modules with a ClassificationHead whose last
residual weight is tied to its first (a tied parameter that is not an embedding).

Layouts (dp, tp, pp) from the world size n: pp = n and, at n = 4, pp = 2 x dp = 2 and pp = 2 x
tp = 2 (the ViT's tensor-parallel stages); interleaved virtual stages at pp = 2; ZeRO-3 stages at
pp = 2 x dp = 2 (4 ranks) and pp = 2 x dp = 1 (2 ranks)."""
import numpy as np
import pytest
from conftest import GLOBAL_BATCH

from rtxmpi.errors import ConfigError
from rtxmpi.mesh import DeviceMesh
from rtxmpi.nn import AdamW, ViT, ViTConfig, clip_grad_norm, decay_mask
from rtxmpi.nn.module import Model, Module, ParamDecl, Sequential
from rtxmpi.nn.modules import ClassificationHead, Linear
from rtxmpi.parallel.parallelize import TensorParallelModel
from rtxmpi.parallel.pipeline import PipelineParallel, build_pipeline

VIT = ViTConfig(n_layer=4, n_head=4, n_embd=32, n_classes=5)
D, C, K, T = 6, 16, 4, 5  # MLP input features, width, classes, positions


class Residual(Module):
    """y = x + x @ w + b on (..., C); w tied to the full parameter name `tied_to` when given."""

    def __init__(self, c, tied_to=None):
        self.linear, self.tied_to = Linear(c, c, split="replicated"), tied_to

    def param_specs(self):
        w, b = self.linear.param_specs()
        return [ParamDecl(w.name, w.shape, w.decay, w.split, w.init, self.tied_to), b]

    def forward(self, params, x):
        y, cache = self.linear.forward(params, x)
        return x + y, cache

    def backward(self, params, grads, cache, dy):
        return dy + self.linear.backward(params, grads, cache, dy)


def residual_mlp():
    """Units: the input projection, four residual units (r3's weight is r0's), the classifier."""
    return ([Sequential(("inp", Linear(D, C, split="replicated")))]
            + [(f"r{i}", Residual(C, tied_to="r0.w" if i == 3 else None)) for i in range(4)]
            + [Sequential(("head", ClassificationHead(C, K)))])


def features(step):
    rng = np.random.default_rng(step)
    return rng.standard_normal((GLOBAL_BATCH, T, D)), rng.integers(0, K, GLOBAL_BATCH)


def images(step):
    rng = np.random.default_rng(100 + step)
    shape = (GLOBAL_BATCH, VIT.image_size, VIT.image_size, VIT.channels)
    return rng.standard_normal(shape), rng.integers(0, VIT.n_classes, GLOBAL_BATCH)


def layouts(world, tp=True):
    """(dp, tp, pp) layouts of this world size."""
    n = world.world_size
    out = [(1, 1, n)]
    if n == 4:
        out += [(2, 1, 2)] + ([(1, 2, 2)] if tp else [])
    return out


def build(world, make, dp, tp, pp, **kwargs):
    mesh = DeviceMesh(dp=dp, tp=tp, pp=pp, group=world)
    model = make()
    if tp > 1:
        model = TensorParallelModel(model, mesh, dtype=np.float64)
    return mesh, PipelineParallel.from_mesh(model, mesh, micro_batches=4, **kwargs)


def check_stage_grads(engine, reference):
    """Every rank: its stage's gradient (gathered over tp) and its tied copies' equal the
    one-process model's."""
    st = engine.stage
    for start, grad in st.own_pieces(st.flat_grad[:st.own_size]):  # collective on tp
        np.testing.assert_allclose(grad, reference.flat_grad[start:start + grad.shape[0]],
                                   rtol=1e-9, atol=1e-12)
    for ch in getattr(st, "chunks", [st]):
        for k in ch.copies:  # a copy holds the summed gradient, as its owner does
            np.testing.assert_allclose(ch.tied_param(k).grad, reference.params[k].grad,
                                       rtol=1e-9, atol=1e-12)


def vit_model():
    return ViT(VIT, seed=0, dtype=np.float64)


def mlp_model():
    return Model(residual_mlp(), seed=0, dtype=np.float64)


MODELS = {"vit": (vit_model, images), "residual_mlp": (mlp_model, features)}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("name", MODELS)
def test_pipeline_gradients_match_single_process(world, name, schedule):
    make, batch = MODELS[name]
    x, y = batch(0)
    reference = make()
    ref_loss, cache = reference.forward(x, y)
    reference.backward(cache)
    for dp, tp, pp in layouts(world, tp=name == "vit"):
        mesh, engine = build(world, make, dp, tp, pp, schedule=schedule, bucket_bytes=1)
        rows = mesh.batch_slice(GLOBAL_BATCH)
        loss = engine.train_step(x[rows], y[rows])
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        check_stage_grads(engine, reference)
        if dp > 1:  # every bucket started during the last backward
            assert engine.dp_launched_in_backward == len(engine.buckets) > 1


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_follows_three_clipped_adamw_steps_of_one_process(world, name):
    """Loss curve and parameters; the tied weight's copy stays bitwise its owner's."""
    make, batch = MODELS[name]

    def optimizer(params, mask):
        return AdamW(params, lr=1e-2, decay_mask=mask)

    reference = make()
    ref_opt = optimizer(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    ref_losses = []
    for step in range(3):
        loss, cache = reference.forward(*batch(step))
        reference.backward(cache)
        clip_grad_norm(reference.flat_grad, 1.0)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        ref_losses.append(loss)
    for dp, tp, pp in layouts(world, tp=name == "vit"):
        mesh, engine = build(world, make, dp, tp, pp, optimizer=optimizer)
        rows = mesh.batch_slice(GLOBAL_BATCH)
        losses = []
        for step in range(3):
            x, y = batch(step)
            losses.append(engine.train_step(x[rows], y[rows]))
            engine.step(max_grad_norm=1.0)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
        full = engine.full_params()  # collective: every rank
        np.testing.assert_allclose(full, reference.flat_data, rtol=1e-8, atol=1e-11)
        st = engine.stage
        for k in st.copies:
            spec = st.full_specs[k]
            np.testing.assert_array_equal(st.tied_param(k).data.reshape(-1),
                                          full[spec.offset:spec.stop])


@pytest.mark.mpi(min_size=2)
def test_the_tied_weight_is_copied_to_the_last_stage_and_summed_over_its_group(world):
    _, engine = build(world, mlp_model, 1, 1, world.world_size)
    st, p = engine.stage, world.world_size
    tied = mlp_model().param("r0.w").index
    assert [k for k, _, _ in engine.tied] == ([tied] if st.stage in (0, p - 1) else [])
    assert st.copies == ([tied] if st.is_last else [])
    assert engine.tied_indices == [tied]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", MODELS)
def test_interleaved_virtual_stages_match_single_process(world, name):
    make, batch = MODELS[name]
    x, y = batch(1)
    reference = make()
    ref_loss, cache = reference.forward(x, y)
    reference.backward(cache)
    mesh, engine = build(world, make, world.world_size // 2, 1, 2, schedule="interleaved",
                         virtual_stages=2, bucket_bytes=1)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    assert engine.train_step(x[rows], y[rows]) == pytest.approx(ref_loss, rel=1e-12)
    check_stage_grads(engine, reference)


@pytest.mark.parametrize("name", MODELS)
def test_recomputed_units_give_bitwise_the_same_gradients_under_every_schedule(world, name):
    make, batch = MODELS[name]
    x, y = batch(2)
    p = world.world_size
    runs = [dict(schedule="1f1b"), dict(schedule="gpipe")]
    if p % 2 == 0:
        runs.append(dict(schedule="interleaved", virtual_stages=2))
    for run in runs:
        pp = 2 if "virtual_stages" in run else p
        grads, losses = [], []
        for recompute in ("none", "blocks"):
            model = make()
            model.recompute = recompute
            mesh = DeviceMesh(dp=p // pp, tp=1, pp=pp, group=world)
            engine = PipelineParallel.from_mesh(model, mesh, micro_batches=4, **run)
            rows = mesh.batch_slice(GLOBAL_BATCH)
            losses.append(engine.train_step(x[rows], y[rows]))
            grads.append(engine.stage.flat_grad.copy())
            chunks = getattr(engine.stage, "chunks", [engine.stage])
            assert all(bool(ch.recompute) == (recompute == "blocks") for ch in chunks)
        assert losses[0] == losses[1]
        np.testing.assert_array_equal(grads[1], grads[0])


@pytest.mark.parametrize("name", MODELS)
def test_checkpoint_pieces_cover_every_tensor_once_and_load_back(world, name):
    make, _ = MODELS[name]
    reference = make()
    dp, tp, pp = layouts(world, tp=name == "vit")[-1]
    _, engine = build(world, make, dp, tp, pp)
    for _, (data, offset, size) in engine.shards().items():
        cover = np.zeros(size, np.int64)
        cover[offset:offset + data.shape[0]] = 1
        world.all_reduce(cover)
        assert (cover == 1).all()
    engine.stage.flat_data[...] = 0
    calls = []

    def read(name, offset, length):  # a checkpoint's read is collective: same count everywhere
        calls.append(name)
        return (np.full(length, 2, np.int64) if name == "adam.step"
                else reference.flat_data[offset:offset + length])

    engine.load_shards(read)
    counts = world.all_gather(np.array([len(calls)]))
    assert (counts == counts[0]).all(), counts
    np.testing.assert_array_equal(engine.full_params(), reference.flat_data)
    for k in engine.stage.copies:  # a copy is loaded from its owner's range
        np.testing.assert_array_equal(engine.stage.tied_param(k).data, reference.params[k].data)


class Reshape(Module):
    """A view of x with the given shape after the batch dim (and back in backward)."""

    def __init__(self, shape):
        self.shape = shape

    def forward(self, params, x):
        return x.reshape(x.shape[:1] + self.shape), x.shape

    def backward(self, params, grads, cache, dy):
        return dy.reshape(cache)


@pytest.mark.mpi(min_size=2)
def test_an_activation_of_too_many_dims_raises_on_every_rank(world, assert_raised_on_every_rank):
    """The shape message between stages holds 7 dims: more raises ConfigError on every stage
    instead of leaving the next one waiting."""
    units = [Sequential(("inp", Linear(D, C, split="replicated"))),
             Reshape((T, 1, 1, 1, 1, 1, C))] + [Reshape((T, C))] * (world.world_size - 1) + [
        Sequential(("head", ClassificationHead(C, K)))]
    mesh = DeviceMesh(dp=1, tp=1, pp=world.world_size, group=world)
    engine = PipelineParallel.from_mesh(Model(units, dtype=np.float64), mesh, micro_batches=4,
                                        split=[1] * world.world_size)
    x, y = features(0)
    assert_raised_on_every_rank(world, lambda: engine.train_step(x, y), ConfigError,
                                match=["more than 7 dims"])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_pipeline_zero_follows_three_adamw_steps_of_one_process(world, name, zero_stage):
    """(dp, pp) = (2, 2) with ZeRO over each stage's dp pair: losses and parameters."""
    make, batch = MODELS[name]

    def optimizer(params, mask):
        return AdamW(params, lr=1e-2, decay_mask=mask)

    reference = make()
    ref_opt = optimizer(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    mesh, engine = build(world, make, 2, 1, 2, optimizer=optimizer, zero_stage=zero_stage,
                         bucket_bytes=1)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    for step in range(3):
        x, y = batch(step)
        ref_loss, cache = reference.forward(x, y)
        reference.backward(cache)
        assert engine.train_step(x[rows], y[rows]) == pytest.approx(ref_loss, rel=1e-10)
        clip_grad_norm(reference.flat_grad, 1.0)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        engine.step(max_grad_norm=1.0)
    np.testing.assert_allclose(engine.full_params(), reference.flat_data, rtol=1e-8, atol=1e-11)


def test_build_pipeline_builds_a_given_model_with_its_recompute_policy(world):
    x, y = images(3)
    reference = vit_model()
    ref_loss, _ = reference.forward(x, y)
    engine = build_pipeline(None, world, pp=world.world_size, micro_batches=4, recompute="blocks",
                            model=lambda mesh: vit_model())
    assert engine.stage.recompute and engine.mesh.pp == world.world_size
    assert engine.train_step(x, y) == pytest.approx(ref_loss, rel=1e-12)


# -- ZeRO-3 per stage: pp 2 x dp 2 at 4 ranks, pp 2 x dp 1 at 2 ------------------------------------
def zero3_dp(world):
    """dp of the ZeRO-3 pipeline tests (pp = 2), or skip at an odd world size."""
    if world.world_size % 2:
        pytest.skip("pp = 2 needs an even world size")
    return world.world_size // 2


def recomputed(make):
    def build_model():
        model = make()
        model.recompute = "blocks"
        return model
    return build_model


def shard_of(engine, reference):
    """This rank's shard of its stage vector (own range of each chunk, then the tied copies) in the
    one-process model's gradient."""
    z = engine.zero
    whole = np.concatenate([reference.flat_grad[ch.flat_start:ch.flat_stop]
                            for ch in getattr(engine.stage, "chunks", [engine.stage])]
                           + [reference.params[k].grad.reshape(-1) for k in engine.stage.copies])
    return whole[z.start:z.stop]


def read_from(world, engine):
    """A checkpoint reader (read(name, offset, length)) over every rank's engine.shards() pieces,
    each tensor assembled whole on every rank. Collective."""
    whole = {}
    for name, (data, offset, size) in engine.shards().items():
        full = np.zeros(size, np.int64 if name == "adam.step" else np.float64)
        full[offset:offset + data.shape[0]] = data
        world.all_reduce(full)
        whole[name] = full
    return lambda name, offset, length: whole[name][offset:offset + length]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
@pytest.mark.parametrize("name", MODELS)
def test_pipeline_zero3_with_recompute_follows_three_clipped_adamw_steps(world, name, schedule):
    """Each stage's parameters sharded over its dp ranks (dp 1: one shard, still gathered and
    reduced unit by unit) and recomputed units, under each schedule (interleaved: 2 chunks a
    rank on one provider): the loss, this rank's gradient shard and the parameters after clipped
    AdamW steps equal one process's; the tied copy stays its owner."""
    make, batch = MODELS[name]
    dp = zero3_dp(world)

    def optimizer(params, mask):
        return AdamW(params, lr=1e-2, decay_mask=mask)

    reference = make()
    ref_opt = optimizer(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    mesh, engine = build(world, recomputed(make), dp, 1, 2, optimizer=optimizer, zero_stage=3,
                         schedule=schedule, virtual_stages=2 if schedule == "interleaved" else 1)
    st, z = engine.stage, engine.zero
    chunks = getattr(st, "chunks", [st])
    assert st.flat_data is None and all(ch.recompute for ch in chunks) and not engine.deferred_w
    assert z.provider.shard.shape == engine.optimizer.m.shape == (z.stop - z.start,)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    for step in range(3):
        x, y = batch(step)
        ref_loss, cache = reference.forward(x, y)
        reference.backward(cache)
        assert engine.train_step(x[rows], y[rows]) == pytest.approx(ref_loss, rel=1e-10)
        if step == 0:
            np.testing.assert_allclose(z.grad_shard(), shard_of(engine, reference), rtol=1e-9,
                                       atol=1e-12)
        clip_grad_norm(reference.flat_grad, 1.0)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        engine.step(max_grad_norm=1.0)
    full = engine.full_params()  # collective: every rank
    np.testing.assert_allclose(full, reference.flat_data, rtol=1e-8, atol=1e-11)
    vector = z.stage_vector()  # collective on dp
    for k in st.copies:
        (lo, hi), spec = st.vector_range(k), st.full_specs[k]
        np.testing.assert_array_equal(vector[lo:hi], full[spec.offset:spec.stop])


@pytest.mark.mpi(min_size=4)
def test_pipeline_zero3_holds_half_the_parameters_and_gradients_of_zero2(world):
    """pp 2 x dp 2: a rank keeps its shard of the stage's parameters and gradient (stage 2: the
    whole stage's), the same optimizer shard, and gathered parameters of one unit at a time (with
    its tied copy) plus the next one's first slot (prefetched)."""
    x, y = features(0)
    held = {}
    for zero_stage in (2, 3):
        mesh, engine = build(world, mlp_model, 2, 1, 2, zero_stage=zero_stage)
        rows = mesh.batch_slice(GLOBAL_BATCH)
        engine.train_step(x[rows], y[rows])
        held[zero_stage] = engine.memory_bytes()
    st, z = engine.stage, engine.zero
    itemsize = np.dtype(st.dtype).itemsize
    assert held[3]["params"] == held[3]["grads"] == (z.stop - z.start) * itemsize
    assert held[2]["params"] == held[2]["grads"] == st.num_params * itemsize
    assert held[3]["optimizer"] == held[2]["optimizer"]
    assert held[3]["total"] < held[2]["total"] - 0.9 * st.num_params * itemsize
    slot_bytes = [(b - a) * itemsize for a, b in st.units]
    unit_bytes = max(sum(slot_bytes[k] for k in slots) for slots in st.fetches)
    assert 0 < engine.provider.peak_bytes["params"] <= unit_bytes + max(slot_bytes)
    assert unit_bytes + max(slot_bytes) < st.num_params * itemsize
    assert engine.provider.gathers > 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", MODELS)
def test_pipeline_zero3_checkpoint_loads_at_another_layout_and_back(world, name):
    """The stage-3 pipeline writes the one-process flat layout: a pipeline of another layout
    without ZeRO (pp 4 at 4 ranks, pp 1 x dp 2 at 2) loads it with the same parameters and
    AdamW state, and writes it back for a new stage-3 pipeline that then takes the same step."""
    make, batch = MODELS[name]
    dp = zero3_dp(world)
    mesh, engine = build(world, make, dp, 1, 2, zero_stage=3)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    x, y = batch(0)
    engine.train_step(x[rows], y[rows])
    engine.step(max_grad_norm=1.0)
    written = read_from(world, engine)
    n = engine.num_params
    other = (1, 1, 4) if world.world_size == 4 else (2, 1, 1)
    _, plain = build(world, make, *other)
    plain.load_shards(written)
    again = read_from(world, plain)
    for tensor in ("params", "adam.m", "adam.v", "adam.step"):
        size = 1 if tensor == "adam.step" else n
        np.testing.assert_array_equal(again(tensor, 0, size), written(tensor, 0, size))
    _, back = build(world, make, dp, 1, 2, zero_stage=3)
    back.load_shards(again)
    x, y = batch(1)
    losses = [e.train_step(x[rows], y[rows]) for e in (engine, back)]
    for e in (engine, back):
        e.step(max_grad_norm=1.0)
    assert losses[0] == losses[1]
    np.testing.assert_array_equal(back.full_params(), engine.full_params())
