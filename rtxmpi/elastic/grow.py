"""Grow back after a shrink: spawn replacement ranks, merge them into the world, hand them the state.

Survivors (`spawn`): `MPI_Comm_spawn` of the lost count of processes running this program with
its arguments (`sys.executable` + `sys.argv`), on free slots of the job's allocation, then
`MPI_Intercomm_merge` with the survivors first, so they keep ranks 0..k-1 and the new ranks take
k..n-1. Spawned processes (`spawned()`: they have an MPI parent) start their own world with
`rtxmpi.init()`, then `join` the merge. Both sides then make the merged communicator the world
(`rtxmpi.comm.replace_world`) and `hand_over` the survivors' state: the newest replica, broadcast
from memory (rtxmpi.elastic.shrink.exchange_replica), or nothing when the survivors reload a
checkpoint (sharded state).

Open MPI 5 (PRRTE): the spawned processes form a job of their own, which must be recoverable
(`mpiexec --prtemca state_base_recoverable 1`), else one of them that fails, or exits without
MPI_Finalize as survivors do (rtxmpi.elastic.exit_after), ends the whole job. A spawn that finds
no free slot fails at once (MPI_ERR_SPAWN or MPI_ERR_UNKNOWN) and the survivors go on shrunk.
Capacity that comes back (a node the scheduler returns) is named in a hosts file, re-read at every
attempt (`read_hosts`) and passed to the spawn as PMIX_ADD_HOST, which adds it to the allocation.
"""
import re
import sys

import numpy as np

from ..comm import init, replace_world
from ..comm.dynamic import merge_with_parent, spawn_merged, spawned
from ..errors import ConfigError, SpawnFailed
from .shrink import exchange_replica

__all__ = ["spawned", "spawn", "join", "read_hosts", "agree_growth", "hand_over", "SpawnFailed"]

HOST = re.compile(r"[A-Za-z0-9_.-]+(:[1-9][0-9]{0,5})?")


def read_hosts(path):
    """The hosts file `path` as PMIX_ADD_HOST's value ("node7:4,node8"), None when it is missing
    or lists none. One HOST[:SLOTS] per line; blank lines and text after `#` are ignored.
    Raises ConfigError naming the file and line of a bad entry."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 20).splitlines()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"grow hosts file {path}: {exc.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if not HOST.fullmatch(entry):
            raise ConfigError(f"grow hosts file {path} line {number}: {entry[:80]!r} is not "
                              f"HOST[:SLOTS] (e.g. node7:4)")
        hosts.append(entry)
    return ",".join(hosts) or None


def spawn(world, count, info=None, processes=None):
    """Start `count` processes of this program and merge them after the ranks of `world`.

    info: {key: value} MPI_Info hints for MPI_Comm_spawn, read on rank 0 only (e.g.
    {"PMIX_ADD_HOST": "node7:4"}). Returns the merged intracommunicator (errors returned, not
    fatal). Collective over `world`. Raises SpawnFailed on every rank when MPI_Comm_spawn fails
    (also for a survivor that died during it: the next collective reports that one).
    processes: the world's rtxmpi.elastic.evict.Processes or None; a rank process of this node
    that ends during the spawn counts as a failure (the spawn watchdog revokes the world). A rank
    still blocked in the spawn or merge after world.timeout_s seconds exits with status 5
    (rtxmpi.comm.dynamic)."""
    return spawn_merged(world.backend.comm, count, sys.argv, info, timeout_s=world.timeout_s,
                        peer_lost=None if processes is None else processes.gone)


def join(timeout_s=None):
    """In a spawned process: start rtxmpi on the spawned processes, merge with the parent's ranks
    (after them) and make the merged communicator the world. Returns the world ProcessGroup.
    Collective over the spawned processes and the parent's `spawn`."""
    world = init(timeout_s=timeout_s)
    return replace_world(merge_with_parent(world.timeout_s))


def agree_growth(world, full_size, old_size, state):
    """What the new ranks learn from the survivors after a merge, agreed over `world` (one MAX
    all_reduce; the new ranks pass 0, 0, None): (the launch's world size, the world size before
    the merge, whether the survivors hand over a replica, the world size it was saved at).
    Collective."""
    values = np.array([full_size, old_size, state is not None,
                       0 if state is None else state.world_size_saved], np.int64)
    world.all_reduce(values, op="max")
    return int(values[0]), int(values[1]), bool(values[2]), int(values[3])


def hand_over(world, state, saved_size):
    """Broadcast the survivors' ReplicaState `state` to every rank of `world` (the new ranks pass
    None). Collective; call only when the survivors hold one (`agree_growth`). Returns a
    ReplicaState on every rank."""
    applied = -1 if state is None else state.step
    return exchange_replica(world, applied, lambda: state.tensors, lambda: state.meta, saved_size)

