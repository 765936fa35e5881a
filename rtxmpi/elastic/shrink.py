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
from mpi4py import MPI

from ..comm import replace_world
from ..errors import RankFailure


def shrink_world(world, min_ranks=1):
    """Revoke `world`'s communicator, shrink it to the survivors and make that the world group.

    Returns (new world ProcessGroup, old world size). Collective over the survivors (each calls it
    after catching RankFailure). Raises RankFailure when fewer than `min_ranks` survive (on every
    survivor).
    """
    comm = world.backend.comm
    old_size = comm.Get_size()
    for c in (comm, world.backend.monitor.ctl):
        try:
            c.Revoke()
        except MPI.Exception:
            pass  # already revoked by a peer
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
        buf = np.ascontiguousarray(own[name]).reshape(-1).copy() if own else np.empty(size, dtype)
        group.broadcast(buf, src=src)
        tensors[name] = buf
    return ReplicaState(int(step[0]), tensors, meta, old_size, src)
