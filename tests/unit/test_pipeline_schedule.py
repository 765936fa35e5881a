"""Pipeline schedules, the schedule checker and the stage partition (pure, one process)."""
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import GPT, GPTConfig
from rtxmpi.nn.module import Model, Sequential
from rtxmpi.nn.modules import ClassificationHead, Linear
from rtxmpi.parallel.pipeline import body_costs, stage_costs, stage_layout, stage_units, unit_layout
from rtxmpi.parallel.schedule import (Op, build_schedule, check_schedule, gpipe, one_f_one_b,
                                      partition, receiving_chunk, replay)

SIZES = [(1, 1), (4, 1), (1, 2), (4, 2), (8, 4), (3, 3), (16, 4), (5, 3)]


@pytest.mark.parametrize("m,p", SIZES)
def test_gpipe_passes_the_checker(m, p):
    check_schedule(gpipe(m, p), m)


@pytest.mark.parametrize("m,p", [(m, p) for m, p in SIZES if m >= p])
def test_1f1b_passes_the_checker(m, p):
    check_schedule(one_f_one_b(m, p), m)


def compute(ops):
    return [(op.kind, op.micro_batch) for op in ops if op.kind in ("F", "B")]


def test_1f1b_order_is_warmup_steady_cooldown():
    lists = one_f_one_b(4, 2)
    assert compute(lists[0]) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                 ("B", 2), ("B", 3)]
    assert compute(lists[1]) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                 ("F", 3), ("B", 3)]


def in_flight(ops):
    """Most micro-batches whose forward ran and backward did not, at any time."""
    peak = live = 0
    for kind, _ in compute(ops):
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_1f1b_keeps_at_most_p_minus_s_activations_gpipe_keeps_m():
    m, p = 8, 4
    assert [in_flight(ops) for ops in one_f_one_b(m, p)] == [4, 3, 2, 1]
    assert [in_flight(ops) for ops in gpipe(m, p)] == [m] * p


def test_every_send_has_its_receive():
    for lists in (gpipe(6, 3), one_f_one_b(6, 3)):
        sends = sorted((s, op.peer, op.kind[5:], op.micro_batch)
                       for s, ops in enumerate(lists) for op in ops if op.kind.startswith("send"))
        recvs = sorted((op.peer, s, op.kind[5:], op.micro_batch)
                       for s, ops in enumerate(lists) for op in ops if op.kind.startswith("recv"))
        assert sends == recvs and len(sends) == 2 * 6 * 2


def test_checker_finds_a_deadlock():
    lists = one_f_one_b(4, 2)
    # a cycle: stage 0 waits for gradient 0 before sending any activation, stage 1 for activation 0
    lists[0] = [Op("recv_grad", 0, 1)] + [op for op in lists[0] if op != Op("recv_grad", 0, 1)]
    with pytest.raises(ConfigError, match="deadlocks: stage 0 waits at op 0"):
        check_schedule(lists, 4)


def test_checker_finds_a_send_without_receive():
    lists = gpipe(2, 2)
    lists[1] = [op for op in lists[1] if op != Op("recv_act", 1, 0)]
    with pytest.raises(ConfigError, match="before its activation was received"):
        check_schedule(lists, 2)
    lists = gpipe(2, 2)
    lists[0].append(Op("send_act", 1, 1))  # a second send of the same activation
    with pytest.raises(ConfigError, match="never received"):
        check_schedule(lists, 2)


def test_checker_finds_receives_out_of_send_order():
    lists = gpipe(2, 2)
    ops = lists[1]
    a, b = ops.index(Op("recv_act", 0, 0)), ops.index(Op("recv_act", 1, 0))
    ops[a], ops[b] = ops[b], ops[a]
    with pytest.raises(ConfigError, match="receives must follow the send order"):
        check_schedule(lists, 2)


def test_checker_finds_missing_backward_and_bad_peer():
    lists = gpipe(2, 1)
    lists[0] = lists[0][:-1]
    with pytest.raises(ConfigError, match="never runs B of micro-batches \\[1\\]"):
        check_schedule(lists, 1 + 1)
    lists = gpipe(2, 2)
    lists[0][1] = Op("send_act", 0, 0)
    with pytest.raises(ConfigError, match="must have peer 1"):
        check_schedule(lists, 2)


def test_impossible_settings_raise_value_error():
    with pytest.raises(ValueError, match="1F1B needs micro_batches >= pipeline stages"):
        build_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zigzag", 4, 2)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        build_schedule("gpipe", 0, 2)


def test_partition_is_contiguous_and_balanced():
    assert partition([1] * 4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert partition([5, 1, 1, 1, 1, 5], 3) == [(0, 1), (1, 5), (5, 6)]
    bounds = partition([3, 1, 4, 1, 5, 9, 2, 6], 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == 8
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))
    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    assert max(sum(costs[a:b]) for a, b in bounds) == 14  # the optimum, e.g. [3,1,4,1,5] [9] [2,6]


def test_partition_refuses_impossible_splits():
    with pytest.raises(ConfigError, match="every stage needs at least one layer"):
        partition([1, 1], 3)
    with pytest.raises(ConfigError, match="summing to the 3 layers"):
        partition([1, 1, 1], 2, split=[1, 1])
    assert partition([1, 1, 1], 2, split=[2, 1]) == [(0, 2), (2, 3)]


def test_stage_layout_of_a_gpt_counts_embeddings_and_head():
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16)
    assert stage_layout(cfg, 2) == [(0, 2), (2, 4)]
    assert stage_layout(cfg, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # balanced by compute, not parameters: a large vocabulary makes the head (2 V C per token)
    # cost more than three blocks, while the embeddings' V x C parameters cost almost nothing
    big_vocab = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=4096)
    costs = stage_costs(big_vocab)
    assert costs[0] < 1.01 * costs[1] and costs[-1] > 3 * costs[1]
    assert stage_layout(big_vocab, 2) == [(0, 3), (3, 4)]
    with pytest.raises(ConfigError, match="every stage needs"):
        stage_layout(cfg, 5)


def test_unit_layout_of_a_gpt_is_its_stage_layout():
    for tied in (True, False):
        cfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, seq_len=16, vocab_size=4096,
                        tie_embeddings=tied)
        model = GPT(cfg)
        assert body_costs(model) == stage_costs(cfg)
        for stages in (1, 2, 3, 4):
            assert unit_layout(model, stages) == stage_layout(cfg, stages)
    # blocks (0, 3), (3, 4) of 6 units: units 0..3 (embeddings, blocks 0-2), 4..5 (block 3, head)
    assert [stage_units(b, 6) for b in [(0, 3), (3, 4)]] == [(0, 4), (4, 6)]
    assert stage_units((0, 4), 6) == (0, 6)


def test_unit_layout_of_another_model_balances_the_parameters_each_unit_uses():
    """Body units r0..r2 of C x C + C each; the input unit's D x C + C counted with r0 and the
    head's C x K + K with r2: with D = 4 C the input makes r0 the heaviest, alone on stage 0."""
    C, D, K = 8, 32, 3
    model = Model([Sequential(("inp", Linear(D, C))), ("r0", Linear(C, C)), ("r1", Linear(C, C)),
                   ("r2", Linear(C, C)), Sequential(("head", ClassificationHead(C, K)))])
    unit = C * C + C
    assert body_costs(model) == [unit + D * C + C, unit, unit + C * K + K]
    assert unit_layout(model, 2) == [(0, 1), (1, 3)]
    assert unit_layout(model, 2, split=[2, 1]) == [(0, 2), (2, 3)]
    with pytest.raises(ConfigError, match="every stage needs"):
        unit_layout(model, 4)
    head_only = Model([Sequential(("inp", Linear(D, C))), Sequential(("head", ClassificationHead(C, K)))])
    assert unit_layout(head_only, 1) == [(0, 0)]
    with pytest.raises(ConfigError, match="every stage needs at least one"):
        unit_layout(head_only, 2)


@pytest.mark.parametrize("stages,chunks", [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3)])
def test_interleaved_1f1b_is_checked_and_has_the_virtual_stage_bubble(stages, chunks):
    """Narayanan et al. 2021 sec. 2.2: with equal chunks the bubble is (p-1) / (V m + p-1)."""
    for m in (stages, 2 * stages):
        lists = build_schedule("interleaved", m, stages, chunks)  # simulated by check_schedule
        for s, ops in enumerate(lists):  # every (micro-batch, chunk) forward and backward once
            for kind in ("F", "B"):
                runs = sorted((op.micro_batch, op.chunk) for op in ops if op.kind == kind)
                assert runs == [(i, v) for i in range(m) for v in range(chunks)], (s, kind)
        cost = [{"F": 1.0, "B": 2.0}] * stages
        makespan, busy = replay(lists, cost)
        bubble = 1 - sum(busy) / (stages * makespan)
        assert bubble == pytest.approx((stages - 1) / (chunks * m + stages - 1))
        one = replay(build_schedule("1f1b", m, stages), [{"F": chunks, "B": 2.0 * chunks}] * stages)
        assert makespan < one[0]  # the same work, shorter ramps


def test_interleaved_1f1b_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="must be a multiple of 4"):
        build_schedule("interleaved", 6, 4, 2)
    with pytest.raises(ConfigError, match="at least 2 virtual stages"):
        build_schedule("interleaved", 4, 2, 1)
    with pytest.raises(ConfigError, match="need the interleaved schedule"):
        build_schedule("1f1b", 4, 2, 2)


def test_check_schedule_catches_a_wrong_virtual_stage_peer():
    lists = build_schedule("interleaved", 2, 2, 2)
    k = next(j for j, op in enumerate(lists[1]) if op.kind == "send_act" and op.chunk == 0)
    lists[1][k] = lists[1][k]._replace(peer=1)  # chunk 0 of stage 1 feeds stage 0's chunk 1
    with pytest.raises(ConfigError, match="must have peer 0"):
        check_schedule(lists, 2, 2)


@pytest.mark.parametrize("stages,chunks", [(2, 2), (4, 2), (2, 3)])
def test_receiving_chunk_is_the_chunk_of_the_matching_receive(stages, chunks):
    """Every send of an interleaved schedule is received by its peer on the chunk
    receiving_chunk names (rank p - 1's chunk v feeds rank 0's chunk v + 1, and back)."""
    lists = build_schedule("interleaved", 2 * stages, stages, chunks)
    recvs = {(s, op.kind[5:], op.micro_batch, op.chunk) for s, ops in enumerate(lists)
             for op in ops if op.kind.startswith("recv_")}
    sends = [(s, op) for s, ops in enumerate(lists) for op in ops if op.kind.startswith("send_")]
    assert sends and all((op.peer, op.kind[5:], op.micro_batch,
                          receiving_chunk(op.kind, op.chunk, s, stages)) in recvs for s, op in sends)
    assert receiving_chunk("send_act", 0, stages - 1, stages) == 1
    assert receiving_chunk("send_grad", 1, 0, stages) == 0
    assert receiving_chunk("send_act", 0, 0, stages) == 0
