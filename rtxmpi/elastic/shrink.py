"""Shrink and continue (ULFM): survivors revoke the world, shrink it, and agree on the state.

Source: ULFM, Bland et al., "Post-failure recovery of MPI communication capability" (IJHPCA 2013):
`MPI_Comm_revoke` makes every survivor's pending and future operations on the communicator fail,
so all of them reach `MPI_Comm_shrink`, which returns a working communicator of the survivors.

State after a failure. With data parallelism every rank holds full copies of the parameters and
the optimizer state, so the survivors hold the model: each knows the last step whose update it
applied (`applied`); a failure can interrupt a step after some survivors applied it and before
others did, so the survivors take the largest applied step and the lowest rank that reached it
broadcasts its state (`ReplicaState`): nothing is lost beyond the step in progress, and no step
is applied twice. Where state is sharded (ZeRO), shards died with the rank: the job reloads its
last committed checkpoint at the new world size instead (`ReplicaState` is None).
"""
import json

import numpy as np

from ..backend import to_host
from ..comm import replace_world
from ..comm.failure import revoke
from ..comm.group import subgroup_comms
from ..errors import RankFailure


def shrink_world(world, min_ranks=1):
    """Revoke `world`'s communicator (and those of every group split from it), shrink it to the
    survivors and make that the world group.

    Returns (new world ProcessGroup, old world size). Collective over the survivors (each calls it
    after catching RankFailure). Raises RankFailure when fewer than `min_ranks` survive (on every
    survivor).
    """
    comm, monitor = world.backend.comm, world.backend.monitor
    old_size = comm.Get_size()
    # the sub-groups too: a survivor may be blocked in a transfer of a group without failed
    # members (a tp group) whose peer has already left for this shrink
    revoke((*world.backend.comms(), monitor.ctl, *subgroup_comms(monitor)))
    survivors = comm.Shrink()
    size = survivors.Get_size()
    if size < min_ranks:
        raise RankFailure(f"{old_size - size} of {old_size} ranks failed; {size} survive, fewer "
                          f"than min_ranks={min_ranks}: cannot continue", ranks=[])
    return replace_world(survivors), old_size


class ReplicaState:
    """A surviving replica's state, readable like a loaded Checkpoint (rtxmpi.checkpoint).

    Attributes: path (a description), step (the last applied step), world_size_saved, meta (the
    training loop's checkpoint meta at that step), ignored ([]); read(name, offset, length) returns
    a slice of a full tensor; rank_state(rank) is {} (per-rank generators restart from
    (seed, rank, step), as after a checkpoint loaded at another world size).
    """

    def __init__(self, step, tensors, meta, world_size_saved, source_rank):
        self.step, self.tensors, self.meta = step, tensors, meta
        self.world_size_saved = world_size_saved
        self.source_rank = source_rank
        self.path = f"<surviving replica on rank {source_rank}>"
        self.ignored = []

    def read(self, name, offset=0, length=None, out=None):
        full = self.tensors[name]
        piece = full[offset:] if length is None else full[offset:offset + length]
        if out is not None:
            out[...] = piece
            return out
        return piece.copy()

    def rank_state(self, rank):
        return {}


def _broadcast_bytes(group, payload, src):
    n = np.array([len(payload) if group.rank == src else 0], np.int64)
    group.broadcast(n, src=src)
    buf = np.frombuffer(payload, np.uint8).copy() if group.rank == src else np.empty(int(n[0]), np.uint8)
    group.broadcast(buf, src=src)
    return buf.tobytes()


def exchange_replica(group, applied, tensors_fn, meta_fn, old_size):
    """Agree on the newest applied step and broadcast that replica's state (collective).

    applied: the last step whose update this rank applied. tensors_fn() -> {name: 1-D array} of
    full tensors; meta_fn() -> JSON-able dict. Returns a ReplicaState on every rank.
    """
    step = np.array([applied], np.int64)
    group.all_reduce(step, op="max")
    owner = np.array([group.rank if applied == step[0] else group.world_size], np.int64)
    group.all_reduce(owner, op="min")
    src = int(owner[0])
    head = json.dumps(({n: [str(a.dtype), int(a.size)] for n, a in tensors_fn().items()}, meta_fn())
                      if group.rank == src else None).encode()
    layout, meta = json.loads(_broadcast_bytes(group, head, src))
    own = tensors_fn() if group.rank == src else None
    tensors = {}
    for name, (dtype, size) in layout.items():
        buf = (np.array(to_host(own[name])).reshape(-1) if own  # cupy: a host copy
               else np.empty(size, dtype))
        group.broadcast(buf, src=src)
        tensors[name] = buf
    return ReplicaState(int(step[0]), tensors, meta, old_size, src)


def _complete_step(table, keys):
    """The newest step at which the survivors' shard keys cover range(keys), with the lowest
    rank holding each key at that step: (step, {key: rank}), or (None, None). table: rows of
    (applied step, key, keys) per survivor, in new-rank order."""
    if any(int(row[2]) != keys for row in table):
        return None, None  # ranks of different layouts: nothing to assemble
    for step in sorted({int(row[0]) for row in table if row[0] >= 0}, reverse=True):
        sources = {}
        for rank, (applied, key, _) in enumerate(table):
            if applied == step and int(key) not in sources:
                sources[int(key)] = rank
        if len(sources) == keys:
            return step, sources
    return None, None


def exchange_pieces(group, applied, pieces_fn, meta_fn, old_size):
    """Rebuild the full model from the survivors' shards of a hybrid layout (collective).

    applied: the last step whose update this rank applied (-1: none). pieces_fn() -> this rank's
    rtxmpi.parallel.replica.ReplicaPieces (key, keys, {name: (where, values, global_size)}):
    called on every rank for the key, while its `.tensors` (the copies of the state) are read
    only on the ranks that broadcast them, so with replica_pieces (tensors built on first read)
    the other survivors copy nothing. meta_fn() -> JSON-able dict (called on one rank). The
    survivors agree on the newest step S at which every shard key is held by some survivor that
    applied S (ranks of one key hold identical state); the lowest such rank of each key
    broadcasts its pieces, keys in descending order (tp rank 0 writes the tp-replicated
    parameters last, as a checkpoint does), and the lowest of them its meta.
    Returns a ReplicaState of full tensors on every rank, or None on every rank when no complete
    copy survived (then reload the last committed checkpoint).
    """
    pieces = pieces_fn()
    mine = np.array([[applied, pieces.key, pieces.keys]], np.int64)
    table = group.all_gather(mine).tolist()
    step, sources = _complete_step(table, pieces.keys)
    if step is None:
        return None
    meta_src = min(sources.values())
    meta = json.loads(_broadcast_bytes(
        group, json.dumps(meta_fn() if group.rank == meta_src else None).encode(), meta_src))
    tensors = {}
    for key in sorted(sources, reverse=True):
        src = sources[key]
        own = pieces.tensors if group.rank == src else None
        head = None
        if own:  # [name, offset or the name whose positions it shares (None: its own), n, ...]
            first = {}
            head = [[name, int(where) if np.ndim(where) == 0 else first.setdefault(id(where), name),
                     int(values.size), str(values.dtype), int(size)]
                    for name, (where, values, size) in own.items()]
            head = [[name, None if at == name else at, *rest] for name, at, *rest in head]
        positions = {}  # name -> int64 positions received (params, m and v share one array)
        for name, at, n, dtype, size in json.loads(_broadcast_bytes(group, json.dumps(head).encode(),
                                                                    src)):
            values = np.ascontiguousarray(own[name][1]) if own else np.empty(n, dtype)
            group.broadcast(values, src=src)
            if at is None:
                where = np.ascontiguousarray(own[name][0], np.int64) if own else np.empty(n, np.int64)
                group.broadcast(where, src=src)
                positions[name] = where
            full = tensors.setdefault(name, np.zeros(size, values.dtype))
            if isinstance(at, int):
                full[at:at + n] = values
            else:
                full[positions[name if at is None else at]] = values
    state = ReplicaState(step, tensors, meta, old_size, meta_src)
    state.sources = [sources[k] for k in sorted(sources)]
    state.path = f"<surviving shards on ranks {state.sources}>"
    return state
