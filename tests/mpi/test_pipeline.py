"""Pipeline parallelism against the one-process reference on the same global batch.

Layouts (dp, tp, pp, sp) come from the world size n: pp = n (one pipeline through every rank) and,
at n = 4, pp = 2 x dp = 2, pp = 2 x tp = 2 (tensor-parallel stages, with and without Megatron
sequence parallelism) and pp = 2 x sp = 2 (Ulysses stages); at n = 1 the pipeline has one stage.
Both schedules, tied and untied embeddings.
"""
import numpy as np
import pytest
from conftest import GLOBAL_BATCH, T, global_batch

from rtxmpi.errors import CheckpointError, ConfigError
from rtxmpi.mesh import DeviceMesh
from rtxmpi.nn import GPT, AdamW, GPTConfig, clip_grad_norm, decay_mask
from rtxmpi.parallel import tensor as tpl
from rtxmpi.parallel.hybrid import ParallelGPT
from rtxmpi.parallel.pipeline import PipelineParallel
from rtxmpi.parallel.replica import replica_pieces


def config(tied=True, n_layer=4):
    return GPTConfig(seq_len=T, n_layer=n_layer, n_head=2, n_embd=32, tie_embeddings=tied)


def make_model(tied=True, dtype=np.float32, n_layer=4):
    return GPT(config(tied, n_layer), seed=3, dtype=dtype)


def layouts(world):
    """(dp, tp, pp, sp, sequence_parallel) layouts of this world size."""
    n = world.world_size
    out = [(1, 1, n, 1, False)]
    if n == 4:
        out += [(2, 1, 2, 1, False), (1, 2, 2, 1, False), (1, 2, 2, 1, True), (1, 1, 2, 2, False)]
    return out


def build(world, dp, pp, tp=1, sp=1, sequence_parallel=False, tied=True, dtype=np.float32,
          **kwargs):
    mesh = DeviceMesh(dp=dp, tp=tp, pp=pp, sp=sp, group=world)
    model = kwargs.pop("model", None)
    if model is None:
        model = (ParallelGPT(config(tied), mesh, seed=3, dtype=dtype,
                             sequence_parallel=sequence_parallel) if tp > 1 or sp > 1
                 else make_model(tied, dtype))
    return mesh, PipelineParallel.from_mesh(model, mesh, **kwargs)


def reference_grad(model, x, y):
    _, cache = model.forward(x, y)
    model.backward(cache)
    return model.flat_grad


def check_stage_grads(engine, reference):
    """Every rank: its stage's gradient (gathered over tp) equals the one-process one."""
    st = engine.stage
    start, grad = st.own_full(st.flat_grad[:st.own_size])  # collective on tp
    assert (start, start + grad.shape[0]) == (st.full_start, st.full_stop)
    np.testing.assert_allclose(grad, reference.flat_grad[start:start + grad.shape[0]],
                               rtol=1e-5, atol=1e-7)
    if st.tied_copy:  # the head's wte copy holds the full (summed) wte gradient too
        wte = tpl.shard_param("wte", reference.params[0].grad, st.tp_rank, st.tp)
        np.testing.assert_allclose(st.params[-1].grad, wte, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_gradients_match_single_process(world, schedule, tied):
    x, y = global_batch(0)
    reference = make_model(tied)
    reference_grad(reference, x, y)
    ref_loss, _ = make_model(tied).forward(x, y)
    for dp, tp, pp, sp, seq in layouts(world):
        mesh, engine = build(world, dp, pp, tp, sp, seq, tied=tied, micro_batches=4,
                             schedule=schedule, bucket_bytes=1)  # a bucket per unit
        rows = mesh.batch_slice(GLOBAL_BATCH)
        loss = engine.train_step(x[rows], y[rows])
        check_stage_grads(engine, reference)
        if dp * sp > 1:  # every dp (x sp) bucket started during the last backward, not after it
            assert engine.dp_launched_in_backward == len(engine.buckets) > 1
        assert loss == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.mpi(min_size=2)
def test_pipeline_with_a_given_split_matches_single_process(world):
    x, y = global_batch(1)
    reference = make_model()
    reference_grad(reference, x, y)
    pp = world.world_size
    split = [4 - (pp - 1)] + [1] * (pp - 1)  # uneven: the first stage takes the rest
    _, engine = build(world, 1, pp, micro_batches=pp, split=split)
    assert engine.layouts[0] == (0, split[0])
    engine.train_step(x, y)
    check_stage_grads(engine, reference)


@pytest.mark.mpi(min_size=2)
def test_deferred_weight_gradients_of_the_last_stage_are_bitwise_the_same(world):
    """The last stage's head and last-block MLP weight gradients computed after its last op
    (defer_weight_grads, the default) equal those computed inside each backward, bit for bit."""
    x, y = global_batch(5)
    grads = []
    for defer in (True, False):
        _, engine = build(world, 1, world.world_size, micro_batches=4, defer_weight_grads=defer)
        engine.train_step(x, y)
        assert engine.deferred_w == (defer and engine.stage.is_last)
        grads.append(engine.stage.flat_grad.copy())
    np.testing.assert_array_equal(grads[0], grads[1])


def test_pipeline_loss_curve_matches_single_process_over_10_steps(world):
    # float64 (as the DP test): Adam amplifies float32 round-off in near-zero gradients
    def optimizer(params, mask):
        return AdamW(params, lr=1e-2, decay_mask=mask)

    reference = make_model(dtype=np.float64)
    ref_opt = optimizer(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    ref_losses = []
    for step in range(10):
        x, y = global_batch(step)
        loss, cache = reference.forward(x, y)
        reference.backward(cache)
        clip_grad_norm(reference.flat_grad, 1.0)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        ref_losses.append(loss)
    for dp, tp, pp, sp, seq in [lay for lay in layouts(world) if not lay[4]][-3:]:
        # at n = 4: pp x dp, pp x tp and pp x sp
        mesh, engine = build(world, dp, pp, tp, sp, seq, dtype=np.float64, micro_batches=4,
                             optimizer=optimizer)
        rows = mesh.batch_slice(GLOBAL_BATCH)
        losses = []
        for step in range(10):
            x, y = global_batch(step)
            losses.append(engine.train_step(x[rows], y[rows]))
            engine.step(max_grad_norm=1.0)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-9)
        full = engine.full_params()  # collective: every rank
        np.testing.assert_allclose(full, reference.flat_data, rtol=1e-6, atol=1e-9)
        st = engine.stage
        if st.tied_copy:  # the two wte copies stay identical
            wte = tpl.shard_param("wte", full[:st.full_specs[0].size].reshape(st.full_specs[0].shape),
                                  st.tp_rank, st.tp)
            np.testing.assert_array_equal(st.params[-1].data, wte)


def test_eval_loss_is_the_forward_loss_and_leaves_no_gradient(world):
    x, y = global_batch(2)
    ref_loss, _ = make_model().forward(x, y)
    mesh, engine = build(world, 1, world.world_size, micro_batches=world.world_size)
    assert engine.forward(x, y)[0] == pytest.approx(ref_loss, rel=1e-5)
    assert engine.eval_loss(x, y) == pytest.approx(ref_loss, rel=1e-5)
    assert not engine.stage.flat_grad.any()


@pytest.mark.parametrize("which", ["first", "last"])
def test_checkpoint_pieces_cover_every_tensor_once_and_load_back(world, which):
    dp, tp, pp, sp, seq = layouts(world)[0 if which == "first" else -1]
    _, engine = build(world, dp, pp, tp, sp, seq, micro_batches=4)
    reference = make_model()
    pieces = engine.shards()  # collective on tp
    for name, (data, offset, size) in pieces.items():
        cover = np.zeros(size, np.int64)
        cover[offset:offset + data.shape[0]] = 1
        world.all_reduce(cover)
        assert (cover == 1).all(), name
    np.testing.assert_array_equal(engine.full_params(), reference.flat_data)
    engine.stage.flat_data[...] = 0
    moments = np.arange(reference.num_params, dtype=np.float32)
    calls = []

    def read(name, offset, length):  # a checkpoint's read is collective: same count everywhere
        calls.append(name)
        return (reference.flat_data[offset:offset + length] if name == "params" else
                np.full(length, 5, np.int64) if name == "adam.step" else
                moments[offset:offset + length])

    engine.load_shards(read)
    counts = world.all_gather(np.array([len(calls)]))
    assert (counts == counts[0]).all(), counts
    np.testing.assert_array_equal(engine.full_params(), reference.flat_data)
    assert engine.optimizer.step_count == 5
    start, m = engine.stage.own_full(engine.optimizer.m[:engine.stage.own_size])
    np.testing.assert_array_equal(m, moments[start:start + m.shape[0]])
    with pytest.raises(CheckpointError, match=r"returned shape \(2,\), expected \(1,\)"):
        engine.load_shards(lambda name, offset, length: np.zeros(length + 1))


# -- impossible settings: ConfigError (a ValueError) on every rank, nothing sent -------------------
def nothing_pending(group):
    """No message is waiting on the group's communicator (after a barrier)."""
    group.barrier()
    from mpi4py import MPI
    return not group.backend.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)


@pytest.mark.mpi(min_size=2)
def test_micro_batches_not_dividing_the_batch_raise_on_every_rank(world, assert_raised_on_every_rank):
    mesh, engine = build(world, 1, world.world_size, micro_batches=3, schedule="gpipe")
    x, y = global_batch(0)  # 8 rows, 3 micro-batches
    assert_raised_on_every_rank(world, lambda: engine.train_step(x, y), ValueError,
                                match=["not divisible by micro_batches 3"])
    assert nothing_pending(engine.pp_group)


@pytest.mark.mpi(min_size=2)
def test_1f1b_with_fewer_micro_batches_than_stages_raises_on_every_rank(
        world, assert_raised_on_every_rank):
    err = assert_raised_on_every_rank(
        world, lambda: build(world, 1, world.world_size, micro_batches=1), ValueError,
        match=["1F1B needs micro_batches >= pipeline stages"])
    assert isinstance(err, ConfigError)


@pytest.mark.mpi(min_size=2)
def test_more_stages_than_layers_raise_on_every_rank(world, assert_raised_on_every_rank):
    assert_raised_on_every_rank(
        world, lambda: build(world, 1, world.world_size, model=make_model(n_layer=1),
                             micro_batches=4), ValueError, match=["every stage needs"])


@pytest.mark.mpi(min_size=2)
def test_a_split_that_does_not_fit_raises_on_every_rank(world, assert_raised_on_every_rank):
    assert_raised_on_every_rank(
        world, lambda: build(world, 1, world.world_size, micro_batches=4,
                             split=[5] + [1] * (world.world_size - 1)), ValueError,
        match=["summing to the 4 layers"])


@pytest.mark.mpi(min_size=4)
def test_pipeline_refuses_a_plain_gpt_on_a_tensor_parallel_mesh(world, assert_raised_on_every_rank):
    mesh = DeviceMesh(dp=1, tp=2, pp=world.world_size // 2, group=world)
    assert_raised_on_every_rank(
        world, lambda: PipelineParallel.from_mesh(make_model(), mesh, micro_batches=2),
        ConfigError, match=["tp(2) or sp(1) > 1 needs the model as a ParallelGPT"])


@pytest.mark.mpi(min_size=2)
def test_token_ids_out_of_range_raise_on_every_rank(world, assert_raised_on_every_rank):
    _, engine = build(world, 1, world.world_size, micro_batches=world.world_size)
    x, y = global_batch(0)
    y = y.astype(np.int64)
    y[0, 0] = 300  # only the last stage reads y
    assert_raised_on_every_rank(world, lambda: engine.train_step(x, y), ValueError,
                                match=["token ids in [0, 256)"])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_pipeline_zero_matches_single_process_over_10_steps(world, zero_stage):
    """(dp, pp) = (2, 2), ZeRO over each stage's dp pair: the first gradient (stage 2: this
    rank's shard of it), the 10-step loss curve and the parameters equal one process's; AdamW
    state is this rank's shard only; the two wte copies stay identical."""
    def optimizer(params, mask):
        return AdamW(params, lr=1e-2, decay_mask=mask)

    reference = make_model(dtype=np.float64)
    ref_opt = optimizer(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    mesh, engine = build(world, 2, 2, dtype=np.float64, micro_batches=4, optimizer=optimizer,
                         zero_stage=zero_stage, bucket_bytes=1)
    st, z = engine.stage, engine.zero
    assert z.stop - z.start <= -(-st.num_params // 2) and engine.optimizer.m.shape == (
        z.stop - z.start,)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    for step in range(10):
        x, y = global_batch(step)
        ref_loss, cache = reference.forward(x, y)
        reference.backward(cache)
        loss = engine.train_step(x[rows], y[rows])
        assert loss == pytest.approx(ref_loss, rel=1e-9)
        if step == 0:  # this rank's shard of the stage's reduced gradient (whole at stage 1)
            grad = st.flat_grad[z.start:min(z.stop, st.own_size)]
            ref = reference.flat_grad[st.flat_start + z.start:st.flat_start + z.start + len(grad)]
            np.testing.assert_allclose(grad, ref, rtol=1e-9, atol=1e-12)
        clip_grad_norm(reference.flat_grad, 1.0)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        engine.step(max_grad_norm=1.0)
    full = engine.full_params()  # collective: every rank
    np.testing.assert_allclose(full, reference.flat_data, rtol=1e-6, atol=1e-9)
    if st.tied_copy:  # stage 0's wte (in full) and the last stage's copy: bitwise equal
        wte = st.full_specs[0]
        np.testing.assert_array_equal(st.params[-1].data, full[:wte.size].reshape(wte.shape))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_zero3_with_recompute_matches_single_process_over_10_steps(world, tied, schedule):
    """pp 2 x dp (world / 2), ZeRO-3 over each stage's dp ranks (dp 1 at 2 ranks: one shard,
    units still gathered and reduced one by one) with recomputed blocks, 1F1B and interleaved
    (2 chunks a rank, one block each): this rank's gradient
    shard, the 10-step loss curve and the parameters equal one process's; the wte copy on the
    last stage stays bitwise stage 0's wte."""
    if world.world_size % 2:
        pytest.skip("pp = 2 needs an even world size")

    def optimizer(params, mask):
        return AdamW(params, lr=1e-2, decay_mask=mask)

    reference = make_model(tied, dtype=np.float64)
    ref_opt = optimizer(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    model = make_model(tied, dtype=np.float64)
    model.recompute = "blocks"
    V = 2 if schedule == "interleaved" else 1
    mesh, engine = build(world, world.world_size // 2, 2, model=model, micro_batches=4,
                         optimizer=optimizer, zero_stage=3, schedule=schedule, virtual_stages=V)
    st, z = engine.stage, engine.zero
    chunks = getattr(st, "chunks", [st])
    assert all(ch.recompute for ch in chunks) and st.flat_data is None
    rows = mesh.batch_slice(GLOBAL_BATCH)
    for step in range(10):
        x, y = global_batch(step)
        ref_loss, cache = reference.forward(x, y)
        reference.backward(cache)
        loss = engine.train_step(x[rows], y[rows])
        assert loss == pytest.approx(ref_loss, rel=1e-9)
        if step == 0:  # this rank's shard of the stage vector (own range, then the wte copy)
            whole = np.concatenate([reference.flat_grad[ch.flat_start:ch.flat_stop]
                                    for ch in chunks])
            if st.tied_copy:
                whole = np.concatenate([whole, reference.params[0].grad.reshape(-1)])
            np.testing.assert_allclose(z.grad_shard(), whole[z.start:z.stop], rtol=1e-9,
                                       atol=1e-12)
        clip_grad_norm(reference.flat_grad, 1.0)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        engine.step(max_grad_norm=1.0)
    full = engine.full_params()  # collective: every rank
    np.testing.assert_allclose(full, reference.flat_data, rtol=1e-6, atol=1e-9)
    vector = z.stage_vector()  # collective on dp
    if st.tied_copy:
        wte = st.full_specs[0]
        np.testing.assert_array_equal(vector[st.num_params - wte.size:], full[:wte.size])


@pytest.mark.mpi(min_size=2)
def test_zero3_recomputation_gathers_a_unit_again_only_where_backward_would_not(world):
    """ZeRO-3 under pp 2: recomputing the blocks gathers nothing more (their backward gathers
    anyway, the rerun uses it); recomputing the embeddings (whose backward reads no parameter)
    gathers them once more per micro-batch, on stage 0 only (counted where there is something
    to gather: dp 2 at 4 ranks). Loss and gradient shards are bitwise those without
    recomputation."""
    if world.world_size % 2:
        pytest.skip("pp = 2 needs an even world size")
    x, y = global_batch(5)
    runs = {}
    for recompute in ("none", "blocks", [0]):
        model = make_model()
        model.recompute = recompute
        mesh, engine = build(world, world.world_size // 2, 2, model=model, micro_batches=4,
                             zero_stage=3)
        rows = mesh.batch_slice(GLOBAL_BATCH)
        engine.train_step(x[rows], y[rows])  # the first step also probes the shapes
        gathers = engine.provider.gathers
        loss = engine.train_step(x[rows], y[rows])
        runs[str(recompute)] = (loss, engine.zero.grad_shard().copy(),
                                engine.provider.gathers - gathers)
    base_loss, base_grad, base_gathers = runs["none"]
    for key, extra in (("blocks", 0), ("[0]", 4 if mesh.pp_rank == 0 and mesh.dp > 1 else 0)):
        loss, grad, gathers = runs[key]
        assert loss == base_loss, key
        np.testing.assert_array_equal(grad, base_grad)
        assert gathers == base_gathers + extra, (key, gathers, base_gathers)


@pytest.mark.mpi(min_size=4)
def test_zero3_stage_state_is_what_the_planner_counts_and_half_of_zero2(world):
    """pp 2 x dp 2: each rank's parameter, gradient and AdamW bytes (engine.memory_bytes) are
    planner.memory_breakdown's for its stage (the most over the stage's ranks); ZeRO-3 keeps
    about half of stage 2's parameters and gradients (dp 2) and the same optimizer shard."""
    from rtxmpi.parallel.layout import Layout
    from rtxmpi.parallel.planner import memory_breakdown

    held = {}
    for zero_stage in (2, 3):
        mesh, engine = build(world, 2, 2, micro_batches=4, zero_stage=zero_stage)
        got = engine.memory_bytes()
        mine = np.array([got["params"], got["grads"], got["optimizer"]], np.int64)
        stage_max = mine.copy()
        mesh.group("dp").all_reduce(stage_max, op="max")
        plan = memory_breakdown(config(), Layout(2, 1, 2, 1, 4, zero_stage, "1f1b"),
                                GLOBAL_BATCH)[mesh.pp_rank]
        assert stage_max.tolist() == [plan["params"], plan["grads"], plan["optimizer"]]
        held[zero_stage] = got
    assert held[3]["optimizer"] == held[2]["optimizer"]
    for kind in ("params", "grads"):
        assert held[3][kind] <= (held[2][kind] + 8) // 2
    assert held[3]["total"] < held[2]["total"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tied", [True, False])
def test_interleaved_virtual_stages_match_single_process(world, tied):
    """pp = 2 with V = 2 chunks a rank (virtual stages 0..3, one block each; dp = 2 at 4 ranks):
    every chunk's gradient and the loss equal one process's; 10 AdamW steps follow its loss
    curve and parameters; the checkpoint pieces cover each tensor once."""
    def optimizer(params, mask):
        return AdamW(params, lr=1e-2, decay_mask=mask)

    dp = world.world_size // 2
    reference = make_model(tied, dtype=np.float64)
    ref_opt = optimizer(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    mesh, engine = build(world, dp, 2, tied=tied, dtype=np.float64, micro_batches=4,
                         schedule="interleaved", virtual_stages=2, optimizer=optimizer,
                         bucket_bytes=1)
    st = engine.stage
    assert [ch.blocks for ch in st.chunks] == [(mesh.pp_rank, mesh.pp_rank + 1),
                                               (mesh.pp_rank + 2, mesh.pp_rank + 3)]
    rows = mesh.batch_slice(GLOBAL_BATCH)
    for step in range(10):
        x, y = global_batch(step)
        ref_loss, cache = reference.forward(x, y)
        reference.backward(cache)
        loss = engine.train_step(x[rows], y[rows])
        assert loss == pytest.approx(ref_loss, rel=1e-9)
        if step == 0:
            for ch in st.chunks:
                np.testing.assert_allclose(ch.flat_grad[:ch.own_size],
                                           reference.flat_grad[ch.flat_start:ch.flat_stop],
                                           rtol=1e-9, atol=1e-12)
        clip_grad_norm(reference.flat_grad, 1.0)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        engine.step(max_grad_norm=1.0)
    full = engine.full_params()  # collective: every rank
    np.testing.assert_allclose(full, reference.flat_data, rtol=1e-6, atol=1e-9)
    where, values, _ = replica_pieces(engine).tensors["params"]  # elastic handover: V ranges
    np.testing.assert_array_equal(full[where], values)
    for name, (data, offset, size) in engine.shards().items():
        cover = np.zeros(size, np.int64)
        cover[offset:offset + data.shape[0]] = 1
        world.all_reduce(cover)
        assert (cover == 1).all(), name


def test_recomputed_blocks_give_bitwise_the_same_stage_gradients_in_every_layout(world):
    """recompute "blocks" (each stage reruns its blocks' forward in backward): the same loss and
    stage gradient bits as keeping every activation, with tensor-parallel, Megatron
    sequence-parallel and Ulysses stages too."""
    x, y = global_batch(4)
    for dp, tp, pp, sp, seq in layouts(world):
        runs = []
        for recompute in ("none", "blocks"):
            mesh = DeviceMesh(dp=dp, tp=tp, pp=pp, sp=sp, group=world)
            model = (ParallelGPT(config(), mesh, seed=3, sequence_parallel=seq)
                     if tp > 1 or sp > 1 else make_model())
            model.recompute = recompute
            engine = PipelineParallel.from_mesh(model, mesh, micro_batches=4)
            assert bool(engine.stage.recompute) == (recompute == "blocks")
            rows = mesh.batch_slice(GLOBAL_BATCH)
            runs.append((engine.train_step(x[rows], y[rows]), engine.stage.flat_grad.copy()))
        assert runs[0][0] == runs[1][0]
        np.testing.assert_array_equal(runs[1][1], runs[0][1])
