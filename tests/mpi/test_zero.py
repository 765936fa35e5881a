"""ZeRO stages 1, 2 and 3 against plain DataParallel on the same global batch, at any world
size."""
from contextlib import nullcontext

import numpy as np
import pytest
from conftest import GLOBAL_BATCH, T, global_batch, local_slice

from rtxmpi.data import batch_split
from rtxmpi.errors import ConfigError, RtxmpiError
from rtxmpi.nn import GPT, AdamW, GPTConfig, clip_grad_norm, decay_mask
from rtxmpi.nn.params import layout
from rtxmpi.parallel.data import DataParallel, weighted_micro_batches
from rtxmpi.parallel.zero import (ShardedParams, ZeroDataParallel, gather_shards, optimizer_bytes,
                                  shard_range, shard_size)

LR = 1e-2


def make_model(seed=0, dtype=np.float64, **overrides):
    return GPT(GPTConfig.named("tiny", seq_len=T, **overrides), seed=seed, dtype=dtype)


def odd_model():
    """2095 parameters: padded shards at W = 2 and 4, units straddling shard boundaries."""
    cfg = GPTConfig(vocab_size=255, seq_len=T, n_layer=2, n_head=1, n_embd=5)
    return GPT(cfg, dtype=np.float64)


def small_buckets(model):
    return model.flat_grad.nbytes // 5


def adamw(params, mask):
    return AdamW(params, lr=LR, decay_mask=mask)


def train(world, wrapper, steps, first_step=0, max_grad_norm=None, accumulate=True, opt=None):
    """`steps` optimizer steps, each of two half micro-batches (the first under no_sync).

    wrapper: a ZeroDataParallel, or a DataParallel with its optimizer `opt`. Returns the norms.
    """
    norms = []
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step)
        half = GLOBAL_BATCH // 2
        parts = [(x[:half], y[:half]), (x[half:], y[half:])] if accumulate else [(x, y)]
        for i, (xb, yb) in enumerate(parts):
            _, cache = wrapper.forward(local_slice(world, xb), local_slice(world, yb))
            last = i == len(parts) - 1
            with nullcontext() if last else wrapper.no_sync():
                wrapper.backward(cache, scale=1.0 / len(parts))
        if opt is None:
            norms.append(wrapper.step(max_grad_norm=max_grad_norm))
        else:
            if max_grad_norm is not None:
                norms.append(clip_grad_norm(wrapper.model.flat_grad, max_grad_norm))
            wrapper.step(opt)
    return norms


def dp_run(world, steps, max_grad_norm=None):
    model = make_model()
    ddp = DataParallel(model, world, bucket_bytes=small_buckets(model))
    opt = adamw(model.flat_data, decay_mask(model.params, dtype=model.dtype))
    norms = train(world, ddp, steps, max_grad_norm=max_grad_norm, opt=opt)
    return model, norms


def gather_full(world, array, offset, global_size):
    """The global vector from every rank's shard under the ZeRO layout. Collective."""
    size = shard_size(global_size, world.world_size)
    assert (offset, offset + len(array)) == shard_range(global_size, world.world_size, world.rank)
    padded = np.zeros(size, array.dtype)
    padded[:len(array)] = array
    return world.all_gather(padded)[:global_size]


def gathered_state(world, zdp):
    return {name: gather_full(world, *entry) for name, entry in zdp.shards().items()}


def sliced_reader(full, world_size):
    """read(name, offset, length) over shards written at `world_size` (simulated with numpy)."""
    pieces = {name: [(start, vector[start:stop]) for start, stop in
                     (shard_range(len(vector), world_size, r) for r in range(world_size))]
              for name, vector in full.items()}

    def read(name, offset, length):
        out = []
        for start, piece in pieces[name]:
            lo, hi = max(offset, start), min(offset + length, start + len(piece))
            if hi > lo:
                out.append(piece[lo - start:hi - start])
        return np.concatenate(out) if out else np.zeros(0, full[name].dtype)

    return read


class FlatModel:
    """A raw flat vector with a fake backward that adds a given gradient (cache = gradient)."""

    def __init__(self, numel, dtype=np.float64):
        sizes = [numel // 2, numel - numel // 2] if numel > 1 else [numel]
        self.params = layout([(f"p{i}", (s,), i == 0) for i, s in enumerate(sizes)])
        self.flat_data = np.linspace(-1.0, 1.0, numel).astype(dtype)
        self.flat_grad = np.zeros(numel, dtype)

    def zero_grad(self):
        self.flat_grad.fill(0)

    def backward(self, cache, scale=1.0, grad_ready=None):
        self.flat_grad += scale * cache
        for i in reversed(range(len(self.params))):
            if grad_ready is not None:
                grad_ready(i)


# -- construction --------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_wrapping_broadcasts_parameters_from_rank_0(world, stage):
    model = make_model(seed=world.rank)
    zdp = ZeroDataParallel(model, world, stage=stage)
    np.testing.assert_array_equal(zdp.full_params(), make_model(seed=0).flat_data)


def test_bad_stage_offload_or_bucket_size_raise_config_error(world):
    model = make_model()
    for kwargs in ({"stage": 4}, {"stage": 0}, {"offload": "nvme"}, {"bucket_bytes": 0}):
        with pytest.raises(ConfigError):
            ZeroDataParallel(model, world, **kwargs)


def test_stage3_refuses_a_model_without_unit_hooks(world):
    with pytest.raises(ConfigError, match="stage 3 needs a model with parameter units"):
        ZeroDataParallel(FlatModel(10), world, stage=3)


@pytest.mark.parametrize("stage", [2, 3])
def test_shards_follow_the_padded_layout(world, stage):
    model = make_model()
    n = model.num_params
    zdp = ZeroDataParallel(model, world, stage=stage)
    for name, (array, offset, size) in zdp.shards().items():
        if name == "adam.step":
            assert (offset, offset + len(array), size) == (*shard_range(1, world.world_size,
                                                                        world.rank), 1)
            continue
        assert size == n
        assert (offset, offset + len(array)) == shard_range(n, world.world_size, world.rank)
    lengths = world.all_gather(np.array([len(zdp.shards()["params"][0])]))
    assert lengths.sum() == n


@pytest.mark.parametrize("numel", [0, 1, 7, 13])
def test_gather_shards_rebuilds_the_vector_from_padded_shards(world, numel):
    """Short and empty shards (numel < W, numel not divisible by W) are padded, gathered and
    stripped; with or without a reusable send buffer; the result does not alias the shard."""
    full = np.arange(numel, dtype=np.float32) * 3 + 1
    lo, hi = shard_range(numel, world.world_size, world.rank)
    shard = full[lo:hi].copy()
    np.testing.assert_array_equal(gather_shards(world, shard, numel), full)
    send = np.full(shard_size(numel, world.world_size), -1, np.float32)
    out = gather_shards(world, shard, numel, send=send)
    np.testing.assert_array_equal(out, full)
    out[lo:hi] = -2
    np.testing.assert_array_equal(shard, full[lo:hi])


# -- against plain DataParallel ------------------------------------------------------------
@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_dp_after_10_adamw_steps_with_accumulation(world, stage, max_grad_norm):
    # float64, as in test_data_parallel: Adam turns float32 round-off into visible differences
    reference, ref_norms = dp_run(world, 10, max_grad_norm)
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=stage, bucket_bytes=small_buckets(model),
                           optimizer=adamw)
    norms = train(world, zdp, 10, max_grad_norm=max_grad_norm)
    np.testing.assert_allclose(zdp.full_params(), reference.flat_data, rtol=1e-5, atol=1e-8)
    if max_grad_norm is not None:
        assert ref_norms[0] > max_grad_norm  # the clipping really happened
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-9)


@pytest.mark.parametrize("bucket_kind", ["one", "several", "one-column", "odd-size-model"])
def test_stage2_gradient_shard_matches_single_process_including_tied_embedding(world,
                                                                                bucket_kind):
    x, y = global_batch(0)
    # 2095 parameters: padded shards at W = 2 and 4; "one-column" (a bucket per element) on it
    # makes 2095 reduce_scatters, not the tiny model's 117504
    if bucket_kind in ("odd-size-model", "one-column"):
        x, y = np.minimum(x, 254), np.minimum(y, 254)
        reference, model = odd_model(), odd_model()
        assert model.num_params % 2
    else:
        reference, model = make_model(), make_model()
    _, cache = reference.forward(x, y)
    reference.backward(cache)
    bucket_bytes = {"one": 2**30, "one-column": 1}.get(bucket_kind, small_buckets(model))
    zdp = ZeroDataParallel(model, world, stage=2, bucket_bytes=bucket_bytes)
    _, cache = zdp.forward(local_slice(world, x), local_slice(world, y))
    zdp.backward(cache)
    if bucket_kind in ("several", "odd-size-model"):
        assert len(zdp.buckets) > 1
        if world.world_size > 1:  # some reductions really started while backward ran
            assert zdp.overlapped_buckets > 0
    outside = np.r_[model.flat_grad[:zdp.start], model.flat_grad[zdp.stop:]]
    assert not outside.any()  # other ranks' slices are dropped after the reduce_scatter
    grad = gather_full(world, zdp.grad_shard(), zdp.start, model.num_params)
    np.testing.assert_allclose(grad, reference.flat_grad, rtol=1e-9, atol=1e-12)
    # the tied wte gets the output-head term for every vocabulary row, the lookup term only for
    # rows of tokens in the batch: rows of absent tokens are non-zero too
    wte = reference.param("wte")
    absent = np.setdiff1d(np.arange(model.cfg.vocab_size), x)
    assert len(absent) and np.abs(wte.grad[absent]).sum() > 0
    wte_grad = grad[wte.offset:wte.offset + wte.size].reshape(wte.shape)
    np.testing.assert_allclose(wte_grad, wte.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_synchronized_backwards_before_a_step_add_like_dp(world, stage):
    reference = make_model()
    ddp = DataParallel(reference, world, bucket_bytes=small_buckets(reference))
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=stage, bucket_bytes=small_buckets(model))
    for wrapper in (ddp, zdp):
        for step in (0, 1):
            x, y = global_batch(step)
            _, cache = wrapper.forward(local_slice(world, x), local_slice(world, y))
            if step == 1:
                with wrapper.no_sync():  # a local micro-batch after a synchronized one
                    wrapper.backward(cache, scale=0.25)
            wrapper.backward(cache, scale=0.5)
    np.testing.assert_allclose(zdp.grad_shard(), reference.flat_grad[zdp.start:zdp.stop],
                               rtol=1e-12, atol=1e-15)


# -- stage 3: parameters gathered unit by unit ------------------------------------------------
@pytest.mark.parametrize("kind", ["tied", "untied", "odd-size-model"])
def test_stage3_gradient_shard_matches_single_process_including_tied_embedding(world, kind):
    x, y = global_batch(0)
    if kind == "odd-size-model":
        x, y = np.minimum(x, 254), np.minimum(y, 254)
        reference, model = odd_model(), odd_model()
    else:
        tie = kind == "tied"
        reference, model = make_model(tie_embeddings=tie), make_model(tie_embeddings=tie)
    ref_loss, cache = reference.forward(x, y)
    reference.backward(cache)
    zdp = ZeroDataParallel(model, world, stage=3)
    loss, cache = zdp.forward(local_slice(world, x), local_slice(world, y))
    zdp.backward(cache)
    grad = gather_full(world, zdp.grad_shard(), zdp.start, model.num_params)
    np.testing.assert_allclose(grad, reference.flat_grad, rtol=1e-9, atol=1e-12)
    losses = world.all_gather(np.array([loss]))
    np.testing.assert_allclose(losses.mean(), ref_loss, rtol=1e-12)
    # the tied wte holds the output-head term for every vocabulary row (rows of tokens absent
    # from the batch too) plus the lookup term: both before the reduction
    wte = reference.param("wte")
    absent = np.setdiff1d(np.arange(model.cfg.vocab_size), x)
    wte_grad = grad[wte.offset:wte.offset + wte.size].reshape(wte.shape)
    if model.cfg.tie_embeddings:
        assert len(absent) and np.abs(wte.grad[absent]).sum() > 0
    else:
        assert not wte.grad[absent].any()
    np.testing.assert_allclose(wte_grad, wte.grad, rtol=1e-9, atol=1e-12)


def test_stage3_logits_and_generation_match_the_unsharded_model(world):
    reference, model = make_model(), make_model()
    zdp = ZeroDataParallel(model, world, stage=3)
    x, _ = global_batch(0)
    np.testing.assert_allclose(model.logits(x), reference.logits(x), rtol=1e-12, atol=1e-14)
    out = model.generate(x[:, :4], 3, temperature=0)
    np.testing.assert_array_equal(out, reference.generate(x[:, :4], 3, temperature=0))
    assert zdp.provider.gathers > 0 or world.world_size == 1


def test_stage3_prefetch_is_issued_and_results_do_not_depend_on_it(world):
    runs = {}
    for prefetch in (True, False):
        model = make_model()
        zdp = ZeroDataParallel(model, world, stage=3, optimizer=adamw, prefetch=prefetch)
        train(world, zdp, 2, max_grad_norm=0.05)
        runs[prefetch] = zdp
    on, off = runs[True].provider, runs[False].provider
    np.testing.assert_array_equal(runs[True].full_params(), runs[False].full_params())
    assert off.prefetches == off.prefetch_hits == 0
    if world.world_size > 1:
        # every unit's gather but the first of each pass was started one unit ahead, and used
        assert on.prefetches > 0 and on.prefetch_hits == on.prefetches
        assert on.gathers == off.gathers
        assert on.prefetches >= on.gathers // 2


def test_stage3_keeps_only_shards_one_world_size_th_of_dp(world):
    model = make_model(dtype=np.float32)
    itemsize = model.flat_data.itemsize
    unit_bytes = [(model.params[b - 1].offset + model.params[b - 1].size
                   - model.params[a].offset) * itemsize for a, b in model.units]
    dp_total = 2 * model.flat_data.nbytes + optimizer_bytes(
        AdamW(model.flat_data.copy(), decay_mask=decay_mask(model.params)))
    zdp = ZeroDataParallel(model, world, stage=3)
    assert isinstance(model.provider, ShardedParams) and model.provider is zdp.provider
    assert model.flat_data is None and model.flat_grad is None  # no full buffer stays
    x, y = global_batch(0)
    _, cache = zdp.forward(local_slice(world, x), local_slice(world, y))
    zdp.backward(cache)
    zdp.step()
    mine = zdp.memory_bytes()
    W = world.world_size
    assert mine["params"] == mine["grads"] == (zdp.stop - zdp.start) * itemsize
    assert mine["total"] <= dp_total / W * 1.05 + max(unit_bytes)
    per_rank = world.all_gather(np.array([mine["total"]], np.int64))
    assert per_rank.sum() == dp_total  # the shards hold DP's state exactly once
    # transient: at most the unit in use and the one prefetched are gathered at once
    if W > 1:
        assert zdp.provider.peak_bytes["params"] <= 2 * max(unit_bytes)


def test_stage3_reduces_each_unit_gradient_with_one_uneven_reduce_scatter(world, monkeypatch):
    model = make_model(dtype=np.float64)
    units = [(model.params[a].offset, model.params[b - 1].offset + model.params[b - 1].size)
             for a, b in model.units]
    zdp = ZeroDataParallel(model, world, stage=3)
    x, y = global_batch(0)
    _, cache = zdp.forward(local_slice(world, x), local_slice(world, y))
    calls = {"reduce_scatter": [], "all_reduce": []}
    for name in calls:
        real = getattr(world, name)
        monkeypatch.setattr(world, name, lambda t, *args, real=real, name=name, **kw: (
            calls[name].append((t.shape, kw.get("counts"))) or real(t, *args, **kw)))
    zdp.backward(cache)
    monkeypatch.undo()
    W = world.world_size
    if W == 1:
        assert calls == {"reduce_scatter": [], "all_reduce": []}
        return
    assert calls["all_reduce"] == []  # no unit gradient is all_reduced any more
    ranges = [shard_range(zdp.numel, W, q) for q in range(W)]
    # backward reports the units last to first; each goes to the ranks whose shards it overlaps
    expected = [((b - a,), [max(0, min(b, stop) - max(a, start)) for start, stop in ranges])
                for a, b in reversed(units)]
    assert calls["reduce_scatter"] == expected
    assert zdp.provider.reductions == len(units)


# -- tiny vectors: empty shards ------------------------------------------------------------
@pytest.mark.parametrize("numel", [1, 3, 7])
@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_adamw_on_a_short_vector_with_empty_shards(world, stage, numel):
    W = world.world_size
    reference = FlatModel(numel)
    ref_opt = adamw(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    model = FlatModel(numel)
    zdp = ZeroDataParallel(model, world, stage=stage, bucket_bytes=1, optimizer=adamw)
    start, stop = shard_range(numel, W, world.rank)
    assert zdp.shards()["adam.m"][0].shape == (stop - start,)
    rng = np.random.default_rng(5)
    for _ in range(4):
        grads = rng.standard_normal((W, numel))  # every rank's gradient, the same on all
        reference.flat_grad[...] = grads.mean(axis=0)
        clip_grad_norm(reference.flat_grad, 0.5)
        ref_opt.step(reference.flat_grad)
        zdp.backward(grads[world.rank])
        zdp.step(max_grad_norm=0.5)
    np.testing.assert_allclose(model.flat_data, reference.flat_data, rtol=1e-12, atol=1e-14)


# -- step preconditions and uneven data --------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_refuses_without_a_synchronized_backward(world, stage):
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=stage)
    x, y = global_batch(0)
    _, cache = zdp.forward(local_slice(world, x), local_slice(world, y))
    with zdp.no_sync():
        zdp.backward(cache)
    with pytest.raises(RtxmpiError, match="synchronized backward"):
        zdp.step()
    zdp.backward(cache)
    zdp.step()
    with pytest.raises(RtxmpiError, match="synchronized backward"):
        zdp.step()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_after_a_synced_then_a_no_sync_backward_is_refused_on_every_rank(
        world, stage, assert_raised_on_every_rank):
    """The first micro-batch synchronized, the last under no_sync: the last one's gradient never
    reached the other replicas (stage 3: its sum was never averaged), so step refuses on every
    rank and changes nothing; after zero_grad the right order steps to the one-process
    parameters."""
    x, y = global_batch(0)
    half = GLOBAL_BATCH // 2
    parts = [(x[:half], y[:half]), (x[half:], y[half:])]
    reference = make_model()
    _, cache = reference.forward(x, y)
    reference.backward(cache)
    adamw(reference.flat_data, decay_mask(reference.params)).step(reference.flat_grad)
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=stage, bucket_bytes=small_buckets(model),
                           optimizer=adamw)
    before = zdp.full_params()
    for order in ("synced first", "no_sync first"):
        for i, (xb, yb) in enumerate(parts):
            _, cache = zdp.forward(local_slice(world, xb), local_slice(world, yb))
            with zdp.no_sync() if (i == 0) == (order == "no_sync first") else nullcontext():
                zdp.backward(cache, scale=0.5)
        if order == "synced first":
            assert_raised_on_every_rank(world, lambda: zdp.step(max_grad_norm=1e9), RtxmpiError,
                                        match=["under no_sync()"])
            np.testing.assert_array_equal(zdp.full_params(), before)
            zdp.zero_grad()
    zdp.step()
    np.testing.assert_allclose(zdp.full_params(), reference.flat_data, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("engine", ["dp", 1, 2, 3])
def test_uneven_global_batch_weighted_by_samples_matches_single_process(world, engine):
    """2 * world_size + 1 samples (5 over 2 ranks: 3, 2; 9 over 4: 3, 2, 2, 2), 2 micro-batches
    each: the weighted gradient and loss are the one-process mean over the global batch."""
    n = world.world_size
    B = 2 * n + 1
    x, y = (np.concatenate(pair)[:B] for pair in zip(global_batch(0), global_batch(1)))
    reference = make_model(dtype=np.float32)
    ref_loss, cache = reference.forward(x, y)
    reference.backward(cache)
    sizes = batch_split(B, n)
    rows = slice(sum(sizes[:world.rank]), sum(sizes[:world.rank + 1]))
    model = make_model(dtype=np.float32)
    wrapper = (DataParallel(model, world, bucket_bytes=small_buckets(model)) if engine == "dp"
               else ZeroDataParallel(model, world, stage=engine, bucket_bytes=small_buckets(model)))
    loss_sum = 0.0
    for m, (x_m, y_m, scale, weight) in enumerate(weighted_micro_batches(x[rows], y[rows], 2, B, n)):
        loss, cache = wrapper.forward(x_m, y_m)
        loss_sum += loss * weight
        with wrapper.no_sync() if m == 0 else nullcontext():
            wrapper.backward(cache, scale=scale)
    grad = model.flat_grad if engine == "dp" else wrapper.grad_shard()
    start, stop = (0, model.num_params) if engine == "dp" else (wrapper.start, wrapper.stop)
    np.testing.assert_allclose(grad, reference.flat_grad[start:stop], rtol=1e-5, atol=1e-7)
    losses = np.array([loss_sum / 2], np.float64)
    world.all_reduce(losses, op="avg")
    np.testing.assert_allclose(losses[0], ref_loss, rtol=1e-5)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [2, 3])
def test_uneven_batches_finish_together(world, stage):
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=stage, bucket_bytes=small_buckets(model))
    x, y = global_batch(0)
    batches = [(local_slice(world, x), local_slice(world, y))] * (3 if world.rank == 0 else 5)
    steps = 0
    for xb, yb in zdp.join(batches):
        _, cache = zdp.forward(xb, yb)
        zdp.backward(cache)
        zdp.step()
        steps += 1
    assert steps == 3
    weights = world.all_gather(zdp.full_params()).reshape(world.world_size, -1)
    assert (weights == weights[0]).all()


# -- checkpoint shards -------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shards_round_trip_at_the_same_world_size(world, stage):
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=stage, optimizer=adamw)
    train(world, zdp, 2)
    full = gathered_state(world, zdp)
    fresh_model = make_model(seed=1)
    fresh = ZeroDataParallel(fresh_model, world, stage=stage, optimizer=adamw)
    fresh.load_shards(lambda name, offset, length: full[name][offset:offset + length])
    np.testing.assert_array_equal(fresh.full_params(), zdp.full_params())
    for name, (array, _, _) in zdp.shards().items():
        np.testing.assert_array_equal(fresh.shards()[name][0], array)


@pytest.mark.parametrize("stages", [(1, 2), (2, 1), (3, 1), (2, 3)],
                         ids=["stage1-to-2", "stage2-to-1", "stage3-to-1", "stage2-to-3"])
def test_shards_written_at_another_world_size_and_stage_resume_the_run(world, stages):
    saved_stage, loaded_stage = stages
    model = make_model()
    zdp = ZeroDataParallel(model, world, stage=saved_stage, optimizer=adamw)
    train(world, zdp, 3)
    full = gathered_state(world, zdp)
    train(world, zdp, 3, first_step=3)  # the uninterrupted run
    for written_at in (3, world.world_size + 1):
        resumed_model = make_model(seed=2)
        resumed = ZeroDataParallel(resumed_model, world, stage=loaded_stage, offload="cpu",
                                   optimizer=adamw)
        resumed.load_shards(sliced_reader(full, written_at))
        assert resumed.optimizer.step_count == 3
        train(world, resumed, 3, first_step=3)
        np.testing.assert_allclose(resumed.full_params(), zdp.full_params(), rtol=1e-10,
                                   atol=1e-13)


def test_load_shards_refuses_a_short_read(world):
    zdp = ZeroDataParallel(make_model(), world, stage=2)

    def read(name, offset, length):
        return np.zeros(length + 1)

    with pytest.raises(Exception, match="returned shape"):
        zdp.load_shards(read)


# -- offload and memory ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_offload_gives_the_same_parameters(world, stage, dtype):
    plain_model, offload_model = make_model(dtype=dtype), make_model(dtype=dtype)
    plain = ZeroDataParallel(plain_model, world, stage=stage, optimizer=adamw)
    offloaded = ZeroDataParallel(offload_model, world, stage=stage, optimizer=adamw,
                                 offload="cpu")
    model_params = (offloaded.provider.shard if stage == 3
                    else offload_model.flat_data[offloaded.start:offloaded.stop])
    assert offloaded.shards()["params"][0] is not model_params
    assert not np.shares_memory(offloaded.optimizer.params, model_params)
    train(world, plain, 3, max_grad_norm=0.05)
    train(world, offloaded, 3, max_grad_norm=0.05)
    np.testing.assert_array_equal(offloaded.full_params(), plain.full_params())
    assert offloaded.memory_bytes()["params"] > plain.memory_bytes()["params"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_state_is_one_world_size_th_of_dp(world, stage):
    model = make_model(dtype=np.float32)
    flat_grad_bytes = model.flat_grad.nbytes
    dp_opt_bytes = optimizer_bytes(AdamW(model.flat_data.copy(),
                                         decay_mask=decay_mask(model.params)))
    zdp = ZeroDataParallel(model, world, stage=stage)
    mine = zdp.memory_bytes()
    per_rank = world.all_gather(np.array([mine["optimizer"]], np.int64))
    assert per_rank.sum() == dp_opt_bytes  # the shards hold DP's state exactly once
    S = shard_size(model.num_params, world.world_size)
    assert per_rank.max() == dp_opt_bytes // model.num_params * S  # ~1/W each
    if stage < 3:
        assert mine["grads"] >= flat_grad_bytes


# -- NVMe offload --------------------------------------------------------------------------------
def nvme(world, model, tmp_path, stage, **kwargs):
    """A ZeroDataParallel with offload="nvme" in small chunks (several per shard)."""
    kwargs.setdefault("offload_chunk_bytes", 4096)
    kwargs.setdefault("offload_max_chunks", 2)
    return ZeroDataParallel(model, world, stage=stage, optimizer=adamw, offload="nvme",
                            offload_dir=tmp_path / "offload", **kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_gives_bitwise_the_same_parameters(world, tmp_path, stage, dtype):
    # AdamW is elementwise, so a chunked update computes every element with the same operations
    # in the same dtype as the whole-shard update: bitwise equal, in float32 too
    plain = ZeroDataParallel(make_model(dtype=dtype), world, stage=stage, optimizer=adamw)
    offloaded = nvme(world, make_model(dtype=dtype), tmp_path, stage)
    assert offloaded.store.num_chunks > offloaded.store.max_chunks or offloaded.numel < 4096
    train(world, plain, 10, max_grad_norm=0.05)
    train(world, offloaded, 10, max_grad_norm=0.05)
    np.testing.assert_array_equal(offloaded.full_params(), plain.full_params())
    for name, (array, _, _) in plain.shards().items():
        np.testing.assert_array_equal(offloaded.shards()[name][0], array)
    offloaded.close()


@pytest.mark.parametrize("max_chunks", [1, 3])
def test_nvme_offload_never_holds_more_than_max_chunks(world, tmp_path, max_chunks):
    zdp = nvme(world, make_model(dtype=np.float32), tmp_path, 2, offload_chunk_bytes=1024,
               offload_max_chunks=max_chunks)
    train(world, zdp, 2)
    store = zdp.store
    assert store.chunks_read == store.chunks_written == 2 * store.num_chunks
    assert store.max_resident == min(max_chunks, store.num_chunks) or store.num_chunks == 0
    assert store.resident == 0
    zdp.close()


def test_nvme_offload_files_live_under_offload_dir_and_close_removes_them(world, tmp_path):
    zdp = nvme(world, make_model(), tmp_path, 1)
    rank_dir = tmp_path / "offload" / f"rank_{world.rank:05d}"
    n = zdp.stop - zdp.start
    assert sorted(p.name for p in rank_dir.iterdir()) == ["adam.m.bin", "adam.v.bin",
                                                          "params.bin"]
    assert all(p.stat().st_size == n * 8 for p in rank_dir.iterdir())
    zdp.close()
    assert not rank_dir.exists()


def test_nvme_memory_bytes_show_optimizer_state_on_disk(world, tmp_path):
    model = make_model(dtype=np.float32)
    zdp = nvme(world, model, tmp_path, 2, offload_chunk_bytes=1024, offload_max_chunks=2)
    in_memory = ZeroDataParallel(make_model(dtype=np.float32), world, stage=2).memory_bytes()
    mine = zdp.memory_bytes()
    n = zdp.stop - zdp.start
    assert mine["optimizer_on_disk"] == 2 * n * 4
    assert mine["params_on_disk"] == n * 4
    if zdp.store.num_chunks > 2:
        assert mine["optimizer"] <= 2 * 3 * 1024 + 2 * 1024 < in_memory["optimizer"]
    zdp.close()


def test_nvme_unwritable_offload_dir_raises_config_error_on_every_rank(world, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    offload_dir = blocker if world.rank == world.world_size - 1 else tmp_path / "ok"
    with pytest.raises(ConfigError, match=f"ranks \\[{world.world_size - 1}\\]"):
        ZeroDataParallel(make_model(), world, stage=1, offload="nvme", offload_dir=offload_dir)
    with pytest.raises(ConfigError, match="offload_dir"):
        ZeroDataParallel(make_model(), world, stage=1, offload="nvme")


@pytest.mark.parametrize("stages", [(2, 2), (1, 3), (3, 2)],
                         ids=["stage2-to-2", "stage1-to-3", "stage3-to-2"])
def test_nvme_checkpoint_round_trip_resumes_the_run(world, tmp_path, stages):
    saved_stage, loaded_stage = stages
    zdp = nvme(world, make_model(), tmp_path / "saved", saved_stage)
    train(world, zdp, 3)
    full = gathered_state(world, zdp)
    train(world, zdp, 3, first_step=3)
    resumed = nvme(world, make_model(seed=2), tmp_path / "resumed", loaded_stage)
    resumed.load_shards(sliced_reader(full, world.world_size + 1))
    assert resumed.optimizer.step_count == 3
    train(world, resumed, 3, first_step=3)
    if saved_stage == loaded_stage:  # same reduction order: the same bits
        np.testing.assert_array_equal(resumed.full_params(), zdp.full_params())
    else:  # stages sum gradients in different orders
        np.testing.assert_allclose(resumed.full_params(), zdp.full_params(), rtol=1e-10,
                                   atol=1e-13)
    zdp.close()
    resumed.close()


def test_nvme_load_calls_read_as_often_on_every_rank_when_chunk_counts_differ(world, tmp_path):
    # Checkpoint.read is collective: every rank must call it as often. Chunks of S - 1 elements
    # give the full shards (S) two chunks and the last, shorter shard one (2095 = 2 x 1048 - 1,
    # 4 x 524 - 1): load_shards pads with empty reads
    S = -(-2095 // world.world_size)
    plain = ZeroDataParallel(odd_model(), world, stage=2, optimizer=adamw)
    full = gathered_state(world, plain)
    zdp = nvme(world, odd_model(), tmp_path, 2, offload_chunk_bytes=max(1, S - 1) * 8)
    chunks = world.all_gather(np.array([zdp.store.num_chunks], np.int64))
    assert world.world_size == 1 or len(set(chunks.tolist())) == 2
    reader, calls = sliced_reader(full, world.world_size), [0]

    def read(name, offset, length):
        calls[0] += 1
        return reader(name, offset, length)

    zdp.load_shards(read)
    assert len(set(world.all_gather(np.array(calls, np.int64)).tolist())) == 1
    np.testing.assert_array_equal(zdp.full_params(), plain.full_params())
    zdp.close()
