"""ZeRO stages 1-3 composed with tensor and sequence parallelism (rtxmpi.parallel.zero_hybrid),
against the one-process GPT on the same global batch.

Layouts (dp, tp, sp) whose product is the world size run: at -n 4 (2,2,1) and (2,1,2), at -n 2
(1,2,1) and (1,1,2); the others are skipped. The ZeRO group is mesh.loss_group (dp x sp)."""
import os

import numpy as np
import pytest
from conftest import GLOBAL_BATCH, global_batch

from rtxmpi.checkpoint import Shard, load_checkpoint, save_checkpoint
from rtxmpi.errors import ConfigError, RtxmpiError
from rtxmpi.mesh import DeviceMesh
from rtxmpi.nn import GPT, AdamW, GPTConfig, clip_grad_norm, decay_mask
from rtxmpi.parallel.hybrid import HybridParallel, ParallelGPT
from rtxmpi.parallel.layout import Layout
from rtxmpi.parallel.zero import zero_state_bytes
from rtxmpi.parallel.zero_hybrid import ZeroHybridParallel

LAYOUTS = [(2, 2, 1), (2, 1, 2), (1, 2, 1), (1, 1, 2)]
LR, CLIP = 1e-2, 0.5


def config(**overrides):
    return GPTConfig(**{"vocab_size": 256, "seq_len": 16, "n_layer": 2, "n_head": 4, "n_embd": 32,
                        **overrides})


def mesh_or_skip(world, dp, tp, sp):
    if dp * tp * sp != world.world_size:
        pytest.skip(f"layout dp={dp} tp={tp} sp={sp} needs {dp * tp * sp} ranks")
    return DeviceMesh(dp=dp, tp=tp, pp=1, sp=sp, group=world)


def optimizer(params, mask):
    return AdamW(params, lr=LR, decay_mask=mask)


def full_grad(engine):
    """The one-process model's gradient from the engine's shards (collective)."""
    grad, group, n = engine.zero.grad_shard(), engine.zero.group, engine.zero.numel
    send = np.zeros(-(-n // group.world_size), grad.dtype)
    send[:len(grad)] = grad
    local = group.all_gather(send)[:n] if group.world_size > 1 else grad
    return engine.model.gather_full(local)


def train_step(engine, mesh, step):
    """One synchronized step on the global batch of `step`; returns the mean loss."""
    x, y = global_batch(step)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    loss, cache = engine.forward(x[rows], y[rows])
    engine.backward(cache)
    losses = np.array([loss])
    mesh.loss_group.all_reduce(losses, op="avg")
    engine.step(max_grad_norm=CLIP)
    return float(losses[0])


def reference_curve(cfg, steps, dtype=np.float32):
    """Losses and final parameters of the one-process GPT, AdamW, clipping at CLIP."""
    model = GPT(cfg, seed=0, dtype=dtype)
    opt = AdamW(model.flat_data, lr=LR, decay_mask=decay_mask(model.params))
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        loss, cache = model.forward(x, y)
        model.backward(cache)
        clip_grad_norm(model.flat_grad, CLIP)
        opt.step(model.flat_grad)
        model.zero_grad()
        losses.append(loss)
    return losses, model.flat_data


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dp,tp,sp", LAYOUTS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_match_single_process(world, dp, tp, sp, stage):
    mesh = mesh_or_skip(world, dp, tp, sp)
    cfg = config()
    ref = GPT(cfg, seed=0)
    x, y = global_batch(0)
    ref_loss, cache = ref.forward(x, y)
    ref.backward(cache)
    engine = ZeroHybridParallel(ParallelGPT(cfg, mesh, seed=0, sequence_parallel=tp > 1),
                                stage=stage, bucket_bytes=4096)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    loss, cache = engine.forward(x[rows], y[rows])
    engine.backward(cache)
    losses = np.array([loss])
    mesh.loss_group.all_reduce(losses, op="avg")
    assert losses[0] == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(full_grad(engine), ref.flat_grad, rtol=1e-5, atol=2e-7)
    ref_norm = float(np.sqrt((ref.flat_grad.astype(np.float64) ** 2).sum()))
    assert engine.grad_norm() == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dp,tp,sp,stage,tied", [
    (2, 2, 1, 1, True), (2, 2, 1, 2, False), (2, 2, 1, 3, True), (2, 1, 2, 2, True),
    (2, 1, 2, 3, False), (1, 1, 2, 3, True)])
def test_loss_curve_and_parameters_match_single_process_over_10_steps(world, dp, tp, sp, stage,
                                                                      tied):
    mesh = mesh_or_skip(world, dp, tp, sp)
    cfg = config(tie_embeddings=tied)
    ref_losses, ref_params = reference_curve(cfg, 10)
    engine = ZeroHybridParallel(ParallelGPT(cfg, mesh, seed=0), stage=stage,
                                optimizer=optimizer, bucket_bytes=8192)
    losses = [train_step(engine, mesh, step) for step in range(10)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # AdamW divides by sqrt(v): float32 rounding in near-zero gradients moves a few parameters
    # by ~lr * 1e-3 over 10 steps (float64 HybridParallel runs: test_tensor_parallel.py)
    np.testing.assert_allclose(engine.full_params(), ref_params, rtol=1e-3, atol=1e-4)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dp,tp,sp", LAYOUTS)
@pytest.mark.parametrize("stage", [2, 3])
def test_micro_batches_under_no_sync_accumulate_the_whole_batch_gradient(world, dp, tp, sp,
                                                                         stage):
    mesh = mesh_or_skip(world, dp, tp, sp)
    cfg = config()
    ref = GPT(cfg, seed=0)
    x, y = global_batch(0)
    _, cache = ref.forward(x, y)
    ref.backward(cache)
    engine = ZeroHybridParallel(ParallelGPT(cfg, mesh, seed=0, sequence_parallel=tp > 1),
                                stage=stage, bucket_bytes=4096)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    xs, ys = np.split(x[rows], 2), np.split(y[rows], 2)
    _, cache = engine.forward(xs[0], ys[0])
    with engine.no_sync():
        engine.backward(cache, scale=0.5)
    _, cache = engine.forward(xs[1], ys[1])
    engine.backward(cache, scale=0.5)
    np.testing.assert_allclose(full_grad(engine), ref.flat_grad, rtol=1e-5, atol=2e-7)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_after_a_synced_then_a_no_sync_backward_is_refused_on_every_rank(
        world, stage, assert_raised_on_every_rank):
    """HybridParallel (stage 0) and ZeroHybridParallel over dp = world size: the first
    micro-batch synchronized, the last under no_sync, so step refuses on every rank and
    changes nothing; after zero_grad the right order gives the one-process gradient."""
    mesh = DeviceMesh(dp=world.world_size, group=world)
    cfg = config()
    ref = GPT(cfg, seed=0)
    x, y = global_batch(0)
    _, cache = ref.forward(x, y)
    ref.backward(cache)
    model = ParallelGPT(cfg, mesh, seed=0)
    engine = (HybridParallel(model, bucket_bytes=4096) if stage == 0 else
              ZeroHybridParallel(model, stage=stage, bucket_bytes=4096))
    rows = mesh.batch_slice(GLOBAL_BATCH)
    xs, ys = np.split(x[rows], 2), np.split(y[rows], 2)
    before = engine.full_params().copy()
    for order in ("synced first", "no_sync first"):
        for i in (0, 1):
            _, cache = engine.forward(xs[i], ys[i])
            if (i == 0) == (order == "no_sync first"):
                with engine.no_sync():
                    engine.backward(cache, scale=0.5)
            else:
                engine.backward(cache, scale=0.5)
        if order == "synced first":
            assert_raised_on_every_rank(world, lambda: engine.step(max_grad_norm=CLIP),
                                        RtxmpiError, match=["under no_sync()"])
            np.testing.assert_array_equal(engine.full_params(), before)
            engine.zero_grad()
    grad = (model.gather_full(model.flat_grad) if stage == 0 else full_grad(engine))
    np.testing.assert_allclose(grad, ref.flat_grad, rtol=1e-5, atol=2e-7)


@pytest.mark.mpi(min_size=4)
def test_zero3_dp2_tp2_checkpoint_resumes_at_other_layouts_on_the_same_curve(world, tmp_path):
    """Save a checkpoint (rtxmpi.checkpoint) of (dp 2, tp 2, ZeRO-3) after 5 steps; load it at
    (dp 4) and (tp 4) plain, at (dp 2, sp 2, ZeRO-1) and at (dp 2, tp 2, ZeRO-2): all continue
    the one-process curve to step 10."""
    if world.world_size != 4:
        pytest.skip("needs exactly 4 ranks")
    cfg = config()
    ref_losses, ref_params = reference_curve(cfg, 10)
    mesh = DeviceMesh(dp=2, tp=2, group=world)
    engine = ZeroHybridParallel(ParallelGPT(cfg, mesh, seed=0), stage=3, optimizer=optimizer)
    for step in range(5):
        train_step(engine, mesh, step)
    ckpt_dir = shared_dir(world, tmp_path / "ckpt")
    shards = engine.shards()  # streamed unit by unit: exactly the whole model's even pieces
    data, lo, size = shards["params"]
    assert size == engine.model.full_num_params
    np.testing.assert_array_equal(data, engine.full_params()[lo:lo + len(data)])
    save_checkpoint(world, ckpt_dir, 5, {name: Shard(*piece) for name, piece in shards.items()})
    read = load_checkpoint(world, ckpt_dir).read  # collective: the same reads on every rank
    for dp, tp, sp, stage in [(4, 1, 1, 0), (1, 4, 1, 0), (2, 1, 2, 1), (2, 2, 1, 2)]:
        mesh = DeviceMesh(dp=dp, tp=tp, sp=sp, group=world)
        model = ParallelGPT(cfg, mesh, seed=2)  # other initial values: the load must replace them
        resumed = (ZeroHybridParallel(model, stage=stage, optimizer=optimizer) if stage else
                   HybridParallel(model, optimizer=optimizer))
        resumed.load_shards(read)
        losses = [train_step(resumed, mesh, step) for step in range(5, 10)]
        np.testing.assert_allclose(losses, ref_losses[5:], rtol=1e-5, err_msg=f"{(dp, tp, sp)}")
        np.testing.assert_allclose(resumed.full_params(), ref_params, rtol=1e-3, atol=1e-4)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage,offload", [(1, None), (2, "cpu"), (3, None), (3, "cpu")])
def test_model_state_per_rank_is_the_planners_estimate_and_shrinks_with_the_zero_group(
        world, stage, offload):
    """Each rank's accounted bytes (largest over the ranks) equal zero_state_bytes for its tp
    slice over dp x sp ranks; at stage 3 that is 1/(dp*sp) of HybridParallel's model state."""
    n = world.world_size
    mesh = DeviceMesh(dp=n // 2, tp=2, group=world) if n % 2 == 0 else pytest.skip("even n")
    cfg = config()
    local, group = ParallelGPT(cfg, mesh).num_params, mesh.loss_group.world_size
    zero = ZeroHybridParallel(ParallelGPT(cfg, mesh), stage=stage, optimizer=optimizer,
                              offload=offload)
    train_step(zero, mesh, 0)
    held = zero.memory_bytes()
    largest = {k: held[k] for k in ("params", "grads", "optimizer")}
    for k in largest:
        buf = np.array([largest[k]], np.int64)
        world.all_reduce(buf, op="max")
        largest[k] = int(buf[0])
    expected = zero_state_bytes(local, group, stage, itemsize=4, offload=offload)
    assert largest == {k: expected[k] for k in largest}
    whole = zero_state_bytes(local, 1, 0)["total"]  # HybridParallel: the tp slice, whole
    if stage == 3 and offload is None:
        assert held["total"] <= whole / group + 6 * 4 * group  # + padding: < 1 element each


def test_zero_with_tp_and_sp_passes_the_layout_check_and_bad_stage_raises():
    assert Layout(None, 2, zero_stage=3).check(4, seq_len=16).dp == 2
    assert Layout(None, 1, 1, 2, zero_stage=2).check(4, seq_len=16).dp == 2
    with pytest.raises(ConfigError, match="ZeRO stage must be"):
        Layout(None, 2, zero_stage=4).check(4, seq_len=16)


def shared_dir(world, path):
    """Rank 0's `path` on every rank (the ranks share one file system here). Collective."""
    buf = np.zeros(1024, np.uint8)
    raw = str(path).encode()
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    world.broadcast(buf, src=0)
    return bytes(buf[buf != 0]).decode()


@pytest.mark.mpi(min_size=4)
def test_nvme_offload_under_tp_keeps_each_tp_slice_in_its_own_files(world, tmp_path):
    if world.world_size != 4:
        pytest.skip("needs exactly 4 ranks")
    cfg = config()
    ref_losses, _ = reference_curve(cfg, 3)
    mesh = DeviceMesh(dp=2, tp=2, group=world)
    offload_dir = shared_dir(world, tmp_path / "offload")
    engine = ZeroHybridParallel(ParallelGPT(cfg, mesh, seed=0), stage=2, optimizer=optimizer,
                                offload="nvme", offload_dir=offload_dir)
    files = (f"{offload_dir}/tp_{mesh.tp_rank:05d}/rank_{mesh.loss_group.rank:05d}/adam.m.bin")
    assert os.path.exists(files)
    losses = [train_step(engine, mesh, step) for step in range(3)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    world.barrier()
    engine.close()
    assert not os.path.exists(files)


@pytest.mark.mpi(min_size=4)
def test_nvme_offload_that_fails_on_one_tp_slice_raises_config_error_on_every_rank(world, tmp_path):
    if world.world_size != 4:
        pytest.skip("needs exactly 4 ranks")
    mesh = DeviceMesh(dp=2, tp=2, group=world)
    offload_dir = shared_dir(world, tmp_path / "offload")
    if world.rank == 0:
        os.makedirs(offload_dir, exist_ok=True)
        with open(os.path.join(offload_dir, "tp_00001"), "w") as f:  # a file: slice 1 fails
            f.write("in the way")
    world.barrier()
    with pytest.raises(ConfigError):
        ZeroHybridParallel(ParallelGPT(config(), mesh, seed=0), stage=2, optimizer=optimizer,
                           offload="nvme", offload_dir=offload_dir)
    world.barrier()
    assert not os.path.exists(f"{offload_dir}/tp_00000/rank_{mesh.loss_group.rank:05d}")
