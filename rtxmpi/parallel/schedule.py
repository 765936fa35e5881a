"""Pipeline schedules: which stage runs which forward/backward and exchanges what, in which order.

A pipeline of `stages` (p) stages runs `micro_batches` (m) micro-batches per step. A schedule is one
op list per stage; every rank builds the whole schedule (all p lists, a pure function of the
arguments) and checks it with `check_schedule` before anything is sent, so an impossible or broken
schedule raises ConfigError (a ValueError) on every rank, never a hang.

Ops (`Op(kind, micro_batch, peer, chunk=0)`, peer = the other stage of a send/recv, else None):
    "F" forward of micro_batch, "B" backward of micro_batch,
    "send_act"/"recv_act"   activations, stage s -> s + 1 (after F on s, before F on s + 1),
    "send_grad"/"recv_grad" activation gradients, stage s + 1 -> s (after B on s + 1, before B on s).
With virtual stages (interleaved, V chunks per rank) `chunk` is the model chunk v the op runs on:
rank s's chunk v is virtual stage c = v * p + s, and "s + 1" above reads "the rank of virtual
stage c + 1", i.e. (c + 1) % p (rank p - 1's chunk v feeds rank 0's chunk v + 1).
Execution semantics (what the executor does and the checker simulates): sends are non-blocking
(isend; completed at the end of the step), receives block until the matching send was posted,
messages on one (src, dst, kind, receiving chunk) channel are received in the order they were
sent (the executor's tags name micro-batch and chunk).

Schedules:
    gpipe(m, p)       GPipe (Huang et al. 2019): all m forwards, then all m backwards; keeps m
                      micro-batches of activations per stage.
    one_f_one_b(m, p) 1F1B, non-interleaved (PipeDream-Flush; Narayanan et al. 2021, Megatron-LM):
                      stage s runs min(p - s - 1, m) warm-up forwards, then alternates one forward
                      and one backward, then drains the remaining backwards; at most p - s
                      micro-batches of activations in flight. Needs m >= p.
Both have the bubble fraction (p - 1) / (m + p - 1) when every stage costs the same.
    interleaved(m, p, V) interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): each rank holds V
                      model chunks (virtual stages v * p + s); forwards go in groups of p
                      micro-batches chunk by chunk, (p - s - 1) * 2 + (V - 1) * p warm-up
                      forwards, then one forward one backward; needs m divisible by p. Bubble
                      (p - 1) / (V m + p - 1) with equal chunks: the ramps are V times shorter, for
                      V times more point-to-point messages.

`partition(costs, stages, split=None)` splits a sequence of layer costs into contiguous stages.
Pure Python: no communication, no arrays.
"""
from collections import deque, namedtuple

from ..errors import ConfigError

Op = namedtuple("Op", ["kind", "micro_batch", "peer", "chunk"], defaults=[0])
Op.__doc__ = """One step of a stage's schedule: kind in F, B, send_act, recv_act, send_grad,
recv_grad; micro_batch: 0-based index; peer: the other stage of a send/recv (None for F, B);
chunk: the model chunk (virtual stage chunk * stages + stage) it runs on, 0 unless interleaved."""

KINDS = ("F", "B", "send_act", "recv_act", "send_grad", "recv_grad")


def receiving_chunk(kind, chunk, stage, stages):
    """The model chunk that receives what a send op carries: chunk `chunk` of stage `stage` (of
    `stages`) is virtual stage c = chunk * stages + stage; a "send_act" goes to virtual stage
    c + 1, a "send_grad" to c - 1, which is chunk (c +- 1) // stages of rank (c +- 1) % stages
    (the op's peer). With one chunk per stage it is 0. The executor tags messages with it and
    check_schedule / replay match sends to receives by it. Pure."""
    return (chunk * stages + stage + (1 if kind == "send_act" else -1)) // stages


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


def _chunk_comm(compute, stage, stages, chunks):
    """`_with_comm` for virtual stages: compute is a list of (kind, micro_batch, chunk)."""
    ops, last = [], stages * chunks - 1
    for kind, i, v in compute:
        c = v * stages + stage  # this op's virtual stage
        if kind == "F":
            if c > 0:
                ops.append(Op("recv_act", i, (c - 1) % stages, v))
            ops.append(Op("F", i, None, v))
            if c < last:
                ops.append(Op("send_act", i, (c + 1) % stages, v))
        else:
            if c < last:
                ops.append(Op("recv_grad", i, (c + 1) % stages, v))
            ops.append(Op("B", i, None, v))
            if c > 0:
                ops.append(Op("send_grad", i, (c - 1) % stages, v))
    return ops


def interleaved(micro_batches, stages, chunks):
    """Interleaved 1F1B with `chunks` (V) model chunks per stage (Megatron-LM's virtual pipeline,
    Narayanan et al. 2021, sec. 2.2). Rank s's k-th forward runs chunk (k // p) % V on micro-batch
    (k // (p V)) p + k % p, its k-th backward chunk V - 1 - (k // p) % V on the same micro-batch
    formula; min((p - s - 1) * 2 + (V - 1) * p, m V) warm-up forwards, then one forward and one
    backward alternately, then the remaining backwards. Returns one op list per stage.
    Raises ConfigError for sizes < 1, micro_batches not divisible by stages (the micro-batch groups
    of p would be ragged), or chunks < 2 (that is 1f1b)."""
    _check_sizes(micro_batches, stages)
    m, p, V = micro_batches, stages, chunks
    if isinstance(V, bool) or not isinstance(V, int) or V < 2:
        raise ConfigError(f"interleaved 1F1B needs at least 2 virtual stages per rank, got {V!r}; "
                          "with 1 use the 1f1b schedule")
    if m % p:
        raise ConfigError(f"interleaved 1F1B runs micro-batches in groups of the {p} stages: "
                          f"micro_batches {m} must be a multiple of {p}")
    total = m * V

    def forward(k):
        return "F", (k // (p * V)) * p + k % p, (k // p) % V

    def backward(k):
        return "B", (k // (p * V)) * p + k % p, V - 1 - (k // p) % V

    lists = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (V - 1) * p, total)
        compute = [forward(k) for k in range(warmup)]
        for j in range(total - warmup):
            compute += [forward(warmup + j), backward(j)]
        compute += [backward(j) for j in range(total - warmup, total)]
        lists.append(_chunk_comm(compute, s, p, V))
    return lists


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def build_schedule(name, micro_batches, stages, chunks=1):
    """The named schedule ("gpipe", "1f1b", or "interleaved" with `chunks` >= 2 virtual stages per
    rank), checked: one op list per stage. Raises ConfigError (unknown name, impossible sizes,
    chunks != 1 for a non-interleaved schedule, a schedule that fails check_schedule)."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved":
        lists = interleaved(micro_batches, stages, chunks)
    elif chunks != 1:
        raise ConfigError(f"virtual stages ({chunks}) need the interleaved schedule, not {name!r}")
    else:
        lists = SCHEDULES[name](micro_batches, stages)
    check_schedule(lists, micro_batches, chunks)
    return lists


# ------------------------------------------------------------------------------------- execution
def _walk(lists, visit):
    """Run every stage's op list under the execution semantics of this module (sends never block;
    a receive blocks until a message is on its channel (src, dst, kind, receiving chunk) and takes
    the oldest), each stage in turn as far as it can go, until every stage has finished. The one
    walk behind check_schedule (the checks) and replay (the timing).

    visit(s, op, message): called as stage s executes op, in execution order; for a send it
    returns the message's payload (any value), for a receive `message` is the payload of the send
    it matched (None for other ops); it may raise ConfigError. Raises ConfigError when a receive's
    oldest message is for another micro-batch (receives must follow the send order), and on a
    deadlock (unfinished stages all wait on receives nobody will send; the error names each
    stage's wait). Returns (rounds, left): the number of passes over the stages, and {channel:
    [micro-batches sent but never received]} for the channels not emptied. Pure."""
    p = len(lists)
    channels = {}  # (src, dst, what, receiving chunk) -> deque of (micro-batch, payload)
    pc, rounds = [0] * p, 0
    while True:
        progressed = False
        for s in range(p):
            ops = lists[s]
            while pc[s] < len(ops):
                op = ops[pc[s]]
                if op.kind.startswith("recv_"):
                    queue = channels.get((op.peer, s, op.kind[5:], op.chunk))
                    if not queue:
                        break  # blocked: nothing sent yet
                    if queue[0][0] != op.micro_batch:
                        raise ConfigError(f"stage {s}: {op} but the next {op.kind[5:]} message "
                                          f"from stage {op.peer} is for micro-batch "
                                          f"{queue[0][0]} (receives must follow the send order)")
                    visit(s, op, queue.popleft()[1])
                elif op.kind.startswith("send_"):
                    payload = visit(s, op, None)
                    to_chunk = receiving_chunk(op.kind, op.chunk, s, p)
                    channels.setdefault((s, op.peer, op.kind[5:], to_chunk), deque()).append(
                        (op.micro_batch, payload))
                else:
                    visit(s, op, None)
                pc[s] += 1
                progressed = True
        rounds += 1
        if all(pc[s] == len(lists[s]) for s in range(p)):
            break
        if not progressed:
            waits = "; ".join(f"stage {s} waits at op {pc[s]} {lists[s][pc[s]]}"
                              for s in range(p) if pc[s] < len(lists[s]))
            raise ConfigError(f"pipeline schedule deadlocks: {waits}")
    return rounds, {key: [i for i, _ in q] for key, q in channels.items() if q}


def replay(lists, cost):
    """Makespan and per-stage busy time of op lists when each compute op of stage s takes
    cost[s][op.kind] seconds (F, B, and any other compute kind, e.g. a deferred "W") and messages
    are free: each op starts when its stage is free and (receives) its message was sent; the same
    walk and execution semantics as check_schedule (_walk; run check_schedule first: a broken
    schedule raises here only for a receive out of send order or a deadlock, as ConfigError).
    Returns (makespan, [busy per stage]); the bubble fraction of stage s is
    1 - busy[s] / makespan. Pure."""
    p = len(lists)
    clock, busy = [0.0] * p, [0.0] * p

    def visit(s, op, message):
        if op.kind.startswith("recv_"):
            clock[s] = max(clock[s], message)  # message: the sender's clock at the send
        elif op.kind.startswith("send_"):
            return clock[s]
        else:
            clock[s] += cost[s][op.kind]
            busy[s] += cost[s][op.kind]

    _walk(lists, visit)
    return max(clock), busy


# ------------------------------------------------------------------------------------- checking
def check_schedule(lists, micro_batches, chunks=1):
    """Simulate the whole pipeline and raise ConfigError unless it runs to the end correctly.

    lists: one op list per stage (stage s's list is what rank s of the pp group executes);
    chunks: model chunks per stage (V; virtual stage of chunk v on stage s: c = v * p + s).
    Checked: every op is known, with a valid chunk and peer (the stage of virtual stage c - 1 for
    recv_act/send_grad, of c + 1 for send_act/recv_grad, which must exist); every stage runs F and
    B of every micro-batch exactly once per chunk, B(i) after F(i); F(i) on a virtual stage > 0
    only after its activation arrived, B(i) on one < last only after its gradient arrived, a send
    only after the F/B that produced it; every receive matches the next message sent on its
    channel (same micro-batch, in order); no deadlock (a state where unfinished stages all wait on
    receives nobody will send: the error names each stage's wait); every send is received.
    Collective in spirit, pure in fact: every rank runs it on the same lists and reaches the same
    verdict. Returns the number of simulated rounds.
    """
    p, m, V = len(lists), micro_batches, chunks
    if p < 1:
        raise ConfigError("a pipeline schedule needs at least one stage")
    last = p * V - 1
    peer_of = {"send_act": 1, "recv_act": -1, "send_grad": -1, "recv_grad": 1}
    for s, ops in enumerate(lists):
        for op in ops:
            if op.kind not in KINDS:
                raise ConfigError(f"stage {s}: unknown op {op}")
            if not 0 <= op.micro_batch < m:
                raise ConfigError(f"stage {s}: {op} names micro-batch {op.micro_batch}, not in "
                                  f"[0, {m})")
            if not 0 <= op.chunk < V:
                raise ConfigError(f"stage {s}: {op} names chunk {op.chunk}, not in [0, {V})")
            if op.kind in peer_of:
                c = op.chunk * p + s + peer_of[op.kind]  # the other end's virtual stage
                if not 0 <= c <= last or op.peer != c % p:
                    want = c % p if 0 <= c <= last else "none (no such virtual stage)"
                    raise ConfigError(f"stage {s}: {op} must have peer {want}")
    done = [{"F": set(), "B": set(), "act": set(), "grad": set()} for _ in range(p)]

    def visit(s, op, message):
        state, kind, v = done[s], op.kind, op.chunk
        i, c = (op.micro_batch, v), v * p + s  # (micro-batch, chunk); virtual stage
        name = f"micro-batch {op.micro_batch}" + (f" chunk {v}" if V > 1 else "")
        if kind.startswith("recv_"):
            what = kind[5:]
            if i in state[what]:
                raise ConfigError(f"stage {s}: {what} of {name} received twice")
            state[what].add(i)
        elif kind.startswith("send_"):
            producer = "F" if kind == "send_act" else "B"
            if i not in state[producer]:
                raise ConfigError(f"stage {s}: {op} before {producer}({name}) produced it")
        elif kind == "F":
            if i in state["F"]:
                raise ConfigError(f"stage {s}: F({name}) runs twice")
            if c > 0 and i not in state["act"]:
                raise ConfigError(f"stage {s}: F({name}) before its activation was received")
            state["F"].add(i)
        else:  # B
            if i in state["B"]:
                raise ConfigError(f"stage {s}: B({name}) runs twice")
            if i not in state["F"]:
                raise ConfigError(f"stage {s}: B({name}) before F({name})")
            if c < last and i not in state["grad"]:
                raise ConfigError(f"stage {s}: B({name}) before its gradient was received")
            state["B"].add(i)

    rounds, left = _walk(lists, visit)
    for s in range(p):
        for what in ("F", "B"):
            missing = sorted(set((i, v) for i in range(m) for v in range(V)) - done[s][what])
            if missing:
                where = [i for i, _ in missing] if V == 1 else missing
                raise ConfigError(f"stage {s} never runs {what} of micro-batches {where}"
                                  + (" (micro-batch, chunk)" if V > 1 else ""))
    if left:
        (src, dst, what, _), mbs = next(iter(left.items()))
        raise ConfigError(f"pipeline schedule sends {what} of micro-batches {mbs} from stage {src} "
                          f"to stage {dst} that are never received")
    return rounds
