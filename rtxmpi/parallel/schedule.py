"""Pipeline schedules: which stage runs which forward/backward and exchanges what, in which order.

A pipeline of `stages` (p) stages runs `micro_batches` (m) micro-batches per step. A schedule is one
op list per stage; every rank builds the whole schedule (all p lists, a pure function of the
arguments) and checks it with `check_schedule` before anything is sent, so an impossible or broken
schedule raises ConfigError (a ValueError) on every rank, never a hang.

Ops (`Op(kind, micro_batch, peer)`, peer = the other stage of a send/recv, else None):
    "F" forward of micro_batch, "B" backward of micro_batch,
    "send_act"/"recv_act"   activations, stage s -> s + 1 (after F on s, before F on s + 1),
    "send_grad"/"recv_grad" activation gradients, stage s + 1 -> s (after B on s + 1, before B on s).
Execution semantics (what the executor does and the checker simulates): sends are non-blocking
(isend; completed at the end of the step), receives block until the matching send was posted,
messages on one (src, dst, kind) channel are received in the order they were sent.

Schedules:
    gpipe(m, p)       GPipe (Huang et al. 2019): all m forwards, then all m backwards; keeps m
                      micro-batches of activations per stage.
    one_f_one_b(m, p) 1F1B, non-interleaved (PipeDream-Flush; Narayanan et al. 2021, Megatron-LM):
                      stage s runs min(p - s - 1, m) warm-up forwards, then alternates one forward
                      and one backward, then drains the remaining backwards; at most p - s
                      micro-batches of activations in flight. Needs m >= p.
Both have the bubble fraction (p - 1) / (m + p - 1) when every stage costs the same.

`partition(costs, stages, split=None)` splits a sequence of layer costs into contiguous stages.
Pure Python: no communication, no arrays.
"""
from collections import deque, namedtuple

from ..errors import ConfigError

Op = namedtuple("Op", ["kind", "micro_batch", "peer"])
Op.__doc__ = """One step of a stage's schedule: kind in F, B, send_act, recv_act, send_grad,
recv_grad; micro_batch: 0-based index; peer: the other stage of a send/recv (None for F, B)."""

KINDS = ("F", "B", "send_act", "recv_act", "send_grad", "recv_grad")


# ------------------------------------------------------------------------------------- partition
def partition(costs, stages, split=None):
    """Split layers into `stages` contiguous, non-empty groups.

    costs: sequence of non-negative numbers, one per layer (e.g. parameter counts), in order.
    stages: int >= 1. split: None (balanced: the split minimizing the largest stage cost, found
    exactly by dynamic programming, O(stages * n^2)) or a sequence of `stages` positive ints, the number of layers in each stage, summing to len(costs).
    Returns a list of `stages` (start, stop) layer-index ranges covering 0..len(costs).
    Raises ConfigError when stages < 1, stages > len(costs) (a stage would have no layer), or
    split does not fit. Local (pure).
    """
    n = len(costs)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"pipeline stages must be an int >= 1, got {stages!r}")
    if stages > n:
        raise ConfigError(f"{stages} pipeline stages > {n} layers: every stage needs at least one "
                          f"layer; use pp <= {n}")
    if split is not None:
        split = list(split)
        if len(split) != stages or any(isinstance(k, bool) or not isinstance(k, int) or k < 1
                                       for k in split) or sum(split) != n:
            raise ConfigError(f"split={split} must be {stages} positive ints (layers per stage) "
                              f"summing to the {n} layers")
        bounds, start = [], 0
        for k in split:
            bounds.append((start, start + k))
            start += k
        return bounds
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ConfigError(f"layer costs must be >= 0, got {list(costs)}")
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-stage cost splitting the first i layers into k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


# ------------------------------------------------------------------------------------- schedules
def _with_comm(compute, stage, stages):
    """Insert the receives before and the sends after each F/B of one stage's compute order."""
    ops = []
    for kind, i in compute:
        if kind == "F":
            if stage > 0:
                ops.append(Op("recv_act", i, stage - 1))
            ops.append(Op("F", i, None))
            if stage < stages - 1:
                ops.append(Op("send_act", i, stage + 1))
        else:
            if stage < stages - 1:
                ops.append(Op("recv_grad", i, stage + 1))
            ops.append(Op("B", i, None))
            if stage > 0:
                ops.append(Op("send_grad", i, stage - 1))
    return ops


def _check_sizes(micro_batches, stages):
    for name, value in (("micro_batches", micro_batches), ("stages", stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


def gpipe(micro_batches, stages):
    """GPipe: every stage runs F of all micro-batches, then B of all. Returns one op list per
    stage (list of lists of Op). Raises ConfigError for sizes < 1."""
    _check_sizes(micro_batches, stages)
    m = micro_batches
    compute = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    return [_with_comm(compute, s, stages) for s in range(stages)]


def one_f_one_b(micro_batches, stages):
    """1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down
    backwards. Returns one op list per stage. Raises ConfigError for sizes < 1 or
    micro_batches < stages (the pipeline would never fill; use GPipe or more micro-batches)."""
    _check_sizes(micro_batches, stages)
    m, p = micro_batches, stages
    if m < p:
        raise ConfigError(f"1F1B needs micro_batches >= pipeline stages: {m} < {p}; use at least "
                          f"{p} micro-batches or the gpipe schedule")
    lists = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        compute = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            compute += [("F", warmup + i), ("B", i)]
        compute += [("B", i) for i in range(m - warmup, m)]
        lists.append(_with_comm(compute, s, p))
    return lists


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name, micro_batches, stages):
    """The named schedule ("gpipe" or "1f1b"), checked: one op list per stage.
    Raises ConfigError (unknown name, impossible sizes, a schedule that fails check_schedule)."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    lists = SCHEDULES[name](micro_batches, stages)
    check_schedule(lists, micro_batches)
    return lists


# ------------------------------------------------------------------------------------- checking
def check_schedule(lists, micro_batches):
    """Simulate the whole pipeline and raise ConfigError unless it runs to the end correctly.

    lists: one op list per stage (stage s's list is what rank s of the pp group executes).
    Checked: every op is known, with a valid peer (s - 1 for recv_act/send_grad, s + 1 for
    send_act/recv_grad); every stage runs F and B of every micro-batch exactly once, B(i) after
    F(i); F(i) on a stage > 0 only after its activation arrived, B(i) on a stage < last only after
    its gradient arrived, a send only after the F/B that produced it; every receive matches the
    next message sent on its channel (same micro-batch, in order); no deadlock (a state where
    unfinished stages all wait on receives nobody will send: the error names each stage's wait);
    every send is received. Collective in spirit, pure in fact: every rank runs it on the same
    lists and reaches the same verdict. Returns the number of simulated rounds.
    """
    p, m = len(lists), micro_batches
    if p < 1:
        raise ConfigError("a pipeline schedule needs at least one stage")
    peer_of = {"send_act": 1, "recv_act": -1, "send_grad": -1, "recv_grad": 1}
    for s, ops in enumerate(lists):
        for op in ops:
            if op.kind not in KINDS:
                raise ConfigError(f"stage {s}: unknown op {op}")
            if not 0 <= op.micro_batch < m:
                raise ConfigError(f"stage {s}: {op} names micro-batch {op.micro_batch}, not in "
                                  f"[0, {m})")
            if op.kind in peer_of and op.peer != s + peer_of[op.kind]:
                raise ConfigError(f"stage {s}: {op} must have peer {s + peer_of[op.kind]}")
    channels = {}  # (src, dst, what) -> deque of micro-batches sent, not yet received
    pc = [0] * p
    done = [{"F": set(), "B": set(), "act": set(), "grad": set()} for _ in range(p)]
    rounds = 0
    while True:
        progressed = False
        for s in range(p):
            ops, state = lists[s], done[s]
            while pc[s] < len(ops):
                op = ops[pc[s]]
                i, kind = op.micro_batch, op.kind
                if kind.startswith("recv_"):
                    what = kind[5:]
                    queue = channels.get((op.peer, s, what))
                    if not queue:
                        break  # blocked: nothing sent yet
                    if queue[0] != i:
                        raise ConfigError(f"stage {s}: {op} but the next {what} message from "
                                          f"stage {op.peer} is for micro-batch {queue[0]} "
                                          f"(receives must follow the send order)")
                    queue.popleft()
                    if i in state[what]:
                        raise ConfigError(f"stage {s}: {what} of micro-batch {i} received twice")
                    state[what].add(i)
                elif kind.startswith("send_"):
                    what = kind[5:]
                    producer = "F" if what == "act" else "B"
                    if i not in state[producer]:
                        raise ConfigError(f"stage {s}: {op} before {producer}({i}) produced it")
                    channels.setdefault((s, op.peer, what), deque()).append(i)
                elif kind == "F":
                    if i in state["F"]:
                        raise ConfigError(f"stage {s}: F({i}) runs twice")
                    if s > 0 and i not in state["act"]:
                        raise ConfigError(f"stage {s}: F({i}) before its activation was received")
                    state["F"].add(i)
                else:  # B
                    if i in state["B"]:
                        raise ConfigError(f"stage {s}: B({i}) runs twice")
                    if i not in state["F"]:
                        raise ConfigError(f"stage {s}: B({i}) before F({i})")
                    if s < p - 1 and i not in state["grad"]:
                        raise ConfigError(f"stage {s}: B({i}) before its gradient was received")
                    state["B"].add(i)
                pc[s] += 1
                progressed = True
        rounds += 1
        if all(pc[s] == len(lists[s]) for s in range(p)):
            break
        if not progressed:
            waits = "; ".join(f"stage {s} waits at op {pc[s]} {lists[s][pc[s]]}"
                              for s in range(p) if pc[s] < len(lists[s]))
            raise ConfigError(f"pipeline schedule deadlocks: {waits}")
    for s in range(p):
        for what in ("F", "B"):
            missing = sorted(set(range(m)) - done[s][what])
            if missing:
                raise ConfigError(f"stage {s} never runs {what} of micro-batches {missing}")
    left = {key: list(q) for key, q in channels.items() if q}
    if left:
        (src, dst, what), mbs = next(iter(left.items()))
        raise ConfigError(f"pipeline schedule sends {what} of micro-batches {mbs} from stage {src} "
                          f"to stage {dst} that are never received")
    return rounds
