"""The training loop's hooks: phases, the agreed step boundary, and recovery by re-entry.

    elastic.configure(policy="shrink", min_ranks=2)
    record = elastic.run(train, args)               # re-enters train(args) after a shrink

    def train(args):
        world = rtxmpi.init()
        loop = elastic.Loop(world)
        loop.track(tensors=..., meta=...)           # what survivors hand over after a failure
        for step in range(start, last + 1):
            loop.phase("forward", step)
            ...
            flags = loop.agree(overflow=not finite)   # + stop: a pre-emption signal on any rank
            ... optimizer step ...
            loop.applied(step)
            if flags.stop: save a checkpoint, stop

`run` catches RankFailure (and ULFM's MPI errors) under policy "shrink": the survivors shrink the
world (rtxmpi.elastic.shrink), exchange the newest replica's state when the loop tracked full
tensors, and call the function again; its resume code then restores from `recovered_state()`
(or, for sharded state, from the last committed checkpoint). Policy "grow" also spawns
replacements for the lost ranks before calling it again (rtxmpi.elastic.grow), and, while no slot
is free, retries at a step boundary every `grow_retry_s` seconds. It also admits new ranks that
`rtxmpi join` asks for (rtxmpi.elastic.admit): rank 0 finds the request at a step boundary, the
agreement carries it, and the next step spawns them as it spawns replacements. Objects of the
failed attempt are kept alive (MPI may still own their buffers) and are released with the process.
"""
import os
import sys
import time

import numpy as np

from ..comm import launch_rank, progress, replace_world, start_heartbeats
from ..comm.failure import (MPIError, failed_ranks, is_process_failure, lost_ranks, poll,
                            rank_failure, ulfm_enabled)
from ..control import agree
from ..errors import ConfigError, RankFailure
from . import exitreport
from .admit import parse_request, take_request, write_answer
from .evict import Processes, guard_resume
from .fault import FaultPlan
from .grow import SpawnFailed, agree_growth, hand_over, join, read_hosts, spawn, spawned
from .preempt import StopRequest
from .shrink import exchange_pieces, exchange_replica, shrink_world

PHASES = ("forward", "backward", "step", "save", "eval", "spawn", "grow")
POLICIES = ("off", "shrink", "grow", "restart")


class _Config:
    policy = "off"
    min_ranks = 1
    stuck_timeout_s = None  # heartbeats off
    stop = None  # the process's StopRequest, installed once
    recovered = None  # ReplicaState handed to the next attempt
    failure_time = None  # time.time() when this process saw the failure
    attempts = []  # Loop objects of failed attempts, kept alive
    shrinks = []  # (old world size, new world size) of each shrink
    current = None  # the Loop of the attempt in progress
    processes = None  # evict.Processes of the attempt's world (policies "shrink", "grow")
    grow_retry_s = 30.0
    grow_hosts = None  # a file of hosts to add to the allocation, re-read at every spawn
    full_size = None  # the world size before the first shrink: what "grow" restores
    grow_due = False  # spawn replacements before the next attempt
    next_grow = 0.0  # time.monotonic() of the next retry while running shrunk
    merged = None  # the communicator of survivors and replacements, spawned at a step boundary
    joined = False  # this process was spawned and has joined the world
    joining = False  # ... and has not received the state yet
    grows = []  # (old world size, new world size) of each growth
    faults = None  # this process's FaultPlan for the "grow" phase
    join_dir = None  # where rank 0 looks for `rtxmpi join` requests (the job's --ckpt-dir)
    max_ranks = None  # the most ranks a join may grow the world to (None: 4 x the first world)
    first_size = None  # the world size of this process's first attempt
    join = None  # the agreed join in progress: (request id, ranks, world size before, time agreed)
    join_time = None  # time.time() of the last join's agreement, until its first step at the new size
    resizes = []  # (old world size, new world size) of every shrink and growth, in order


class _GrowNow(Exception):
    """Raised at a step boundary once replacements are spawned: leave the attempt and hand over."""


_config = _Config()


def configure(policy="off", min_ranks=1, stuck_timeout_s=None, grow_retry_s=30.0, grow_hosts=None,
              join_dir=None, max_ranks=None):
    """Choose what a rank failure does. policy: "off" (the job fails, non-zero exit), "shrink"
    (survivors continue in the same processes while at least `min_ranks` remain), "grow" (shrink,
    then spawn replacements back to the launch's world size; while no slot is free, run shrunk
    and retry every `grow_retry_s` seconds; `grow_hosts`: a file of HOST[:SLOTS] lines re-read at
    every attempt, hosts to add to the allocation) or "restart" (the job fails; `rtxmpi run`
    relaunches it from the last committed checkpoint).
    stuck_timeout_s: with a number, control-plane heartbeats (rtxmpi.comm.heartbeat) report a
    rank that made no progress for that long, with its phase and step, as a RankFailure, and a
    shrink evicts it. join_dir: the job's directory (its --ckpt-dir), where rank 0 looks for
    `rtxmpi join` requests at every step boundary (admitted under "grow", refused otherwise);
    max_ranks: the most ranks a join may grow the world to (None: 4 x the first attempt's world
    size). Local; call it on every rank before `run`. Raises ConfigError."""
    if policy not in POLICIES:
        raise ConfigError(f"elastic policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(min_ranks, int) or min_ranks < 1:
        raise ConfigError(f"min_ranks must be an int >= 1, got {min_ranks!r}")
    if stuck_timeout_s is not None and not (isinstance(stuck_timeout_s, (int, float))
                                            and stuck_timeout_s > 0):
        raise ConfigError(f"stuck_timeout_s must be > 0 seconds, got {stuck_timeout_s!r}")
    if isinstance(grow_retry_s, bool) or not (isinstance(grow_retry_s, (int, float))
                                              and grow_retry_s > 0):
        raise ConfigError(f"grow_retry_s must be > 0 seconds, got {grow_retry_s!r}")
    _config.policy, _config.min_ranks = policy, min_ranks
    _config.stuck_timeout_s, _config.grow_retry_s = stuck_timeout_s, float(grow_retry_s)
    _config.grow_hosts = None if grow_hosts is None else os.fspath(grow_hosts)
    if max_ranks is not None and (isinstance(max_ranks, bool) or not isinstance(max_ranks, int)
                                  or max_ranks < 1):
        raise ConfigError(f"max_ranks must be an int >= 1, got {max_ranks!r}")
    _config.join_dir = None if join_dir is None else os.fspath(join_dir)
    _config.max_ranks = max_ranks


def _shrinking():
    return _config.policy in ("shrink", "grow")


def stop_request():
    """This process's StopRequest (SIGTERM/SIGUSR1/SIGINT/SIGUSR2 handlers installed on first use)."""
    if _config.stop is None:
        _config.stop = StopRequest().install()
    return _config.stop


def shrinks():
    """The shrinks this process has gone through: a list of (old world size, new world size),
    empty in the first attempt. Local."""
    return list(_config.shrinks)


def grows():
    """The growths this process has gone through (policy "grow"): a list of (old world size, new
    world size); a spawned process counts the one that started it. Local."""
    return list(_config.grows)


def resizes():
    """Every change of this process's world size, in order: a list of (old, new) for each shrink
    and growth (replacements or a join); a spawned process counts the growth that started it.
    Local."""
    return list(_config.resizes)


def recovered_state():
    """The surviving replica's state handed over by a shrink (a ReplicaState), else None. Taken
    once: the attempt that restores from it calls this."""
    state, _config.recovered = _config.recovered, None
    return state


class Loop:
    """Step-boundary hooks of one attempt of a training loop over `world` (see the module doc).

    Every rank of `world` creates it, after rtxmpi.init(). Attributes: stop (StopRequest),
    step, phase (the current ones), applied_step (last step whose update this rank applied).
    """

    def __init__(self, world):
        self.world = world
        self.stop = stop_request()
        self.launch_rank = launch_rank()
        # a replacement's MPI_COMM_WORLD rank is not a launch rank: the faults are the launch's
        self.faults = FaultPlan(self.launch_rank, PHASES, spec="" if _config.joined else None)
        if _config.stuck_timeout_s is not None and world.world_size > 1:
            start_heartbeats(_config.stuck_timeout_s)  # collective: every rank builds a Loop
        if _shrinking() and world.world_size > 1:  # to end a rank given up on
            _config.processes = Processes.exchange(world.backend.comm)
            if ulfm_enabled():
                guard_resume(world.backend.comm)
        self.step, self.phase_name, self.applied_step = 0, None, None
        self._tensors = self._meta = self._pieces = None
        self._close = []
        self._applied_meta = None
        self._grow_due = False
        if _config.first_size is None:
            _config.first_size = world.world_size
        _config.current = self

    def track(self, *, meta, tensors=None, pieces=None, close=(), step=None):
        """What survivors hand over after a failure. meta() -> JSON-able dict (the checkpoint meta);
        tensors() -> {name: full 1-D array} (data parallelism: every rank holds a full replica);
        pieces() -> rtxmpi.parallel.replica.ReplicaPieces (tensor/pipeline parallelism: the
        survivors rebuild the full model when one rank of every shard key survives); neither when
        state is sharded over dp (ZeRO): then a shrink reloads the last committed checkpoint.
        close: objects (or None) whose close() runs before the next attempt (open files such as
        the write-ahead log). step: the step the state is at now (0 fresh, S after a resume), so a
        failure before the next step still hands it over. Local."""
        self._meta, self._tensors, self._pieces = meta, tensors, pieces
        self._close = [c for c in close if c is not None]
        if step is not None:
            self._mark(step)

    def phase(self, name, step):
        """Mark the start of phase `name` (one of PHASES) of `step`. Local and cheap."""
        self.phase_name, self.step = name, step
        progress(name, step)
        if self.faults.faults:
            self.faults.at(name, step)
        if self._grow_due and name == "forward":  # agreed at the last step's boundary
            self._grow_due = False
            # the state first: a failure in this collective is recovered like any other
            state = _state(self.world, self, self.world.world_size)
            if _try_spawn(self.world, state):
                _config.recovered = state
                raise _GrowNow()

    def _mark(self, step, record=None):
        self.applied_step = step
        if (self._meta is not None and _shrinking()
                and (self._tensors is not None or self._pieces is not None)):
            self._applied_meta = self._meta()  # e.g. the data position as of this step
            if record is not None:
                self._applied_meta["record"] = dict(record)

    def agree(self, **flags):
        """control.agree(world, **flags, stop=<a stop was requested on this rank>, preempt=<by a
        pre-emption signal>): the step boundary's one agreed reduction; `.stop` is True on every
        rank when any rank got a signal, `.preempt` when any got one that was not an interrupt
        (Ctrl-C: stop and not preempt). Collective. Under policy "grow", while the world is
        smaller than at launch, also `grow`: rank 0's retry interval has passed, and the next
        step's "forward" phase spawns replacements. With a join directory, rank 0 also looks for
        a join request (one stat); under "grow" a valid one sets `join` and the next step's
        "forward" phase spawns the new ranks (one more small all_reduce carries the request)."""
        world, extra, asked = self.world, {}, None
        if _config.policy == "grow" and (_config.full_size or 0) > world.world_size:
            extra["grow"] = world.rank == 0 and time.monotonic() >= _config.next_grow
        if world.rank == 0 and _config.join_dir and _config.join is None:
            asked = _join_request(world)
        if _config.policy == "grow" and _config.join_dir:
            extra["join"] = asked is not None
        flags = agree(world, **flags, stop=self.stop.requested, preempt=self.stop.preempted, **extra)
        joins = "join" in extra and flags.join and _agree_join(world, asked, flags.stop)
        self._grow_due = bool(getattr(flags, "grow", False) or joins)
        return flags

    def applied(self, step, record=None):
        """This rank applied (or agreed to skip) the update of `step`. record: a JSON-able dict
        about the step (e.g. its metrics line), handed over in the replica's meta["record"].
        Call it before any collective that follows the update. Local."""
        self._mark(step, record)
        exitreport.progress()  # once: `rtxmpi run` tells a launch that did no work from a failure
        if _config.failure_time is not None:
            elapsed = time.time() - _config.failure_time
            _config.failure_time = None
            if self.world.rank == 0:
                print(f"elastic: step {step} completed {elapsed:.3f} s after the failure was seen "
                      f"(t={time.time():.6f})", flush=True)
        if _config.join_time is not None:
            elapsed = time.time() - _config.join_time
            _config.join_time = None
            if self.world.rank == 0:
                print(f"elastic: step {step} completed at {self.world.world_size} ranks "
                      f"{elapsed:.3f} s after the join was agreed (t={time.time():.6f})", flush=True)


def exit_after(main):
    """Run main() and exit the process with its status. After a shrink (or in a spawned
    replacement), every rank first meets the others in a barrier, then leaves with os._exit:
    Open MPI 5's MPI_Finalize can abort or hang once the failed rank was launch rank 0 (measured
    here), and the survivors' work is done and flushed. Without a shrink: a normal exit
    (MPI_Finalize). Call it on every rank."""
    exitreport.mark("start")  # for `rtxmpi run`: a 0 from mpiexec is done only if a rank says so
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    exitreport.mark("exit", code)
    if not _config.attempts and not _config.joined:
        sys.exit(code)
    from ..comm import world

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        world().barrier()
    except Exception as exc:  # noqa: BLE001 - leaving anyway; say why
        print(f"elastic: exit barrier failed: {exc}", file=sys.stderr, flush=True)
        os._exit(code or 1)
    # every rank is done. A peer that leaves the second barrier first may be reported failed to
    # one still completing it (ULFM): not an error; it only keeps the first from being cut short
    try:
        world().barrier()
    except Exception:  # noqa: BLE001
        pass
    os._exit(code)


def _as_failure(exc, world):
    if isinstance(exc, RankFailure):
        return exc
    if world is not None and is_process_failure(exc, world.backend.comm):
        return rank_failure(exc, world.backend.comm)
    return None


def run(fn, args):
    """Call fn(args); under policy "shrink", after a RankFailure shrink the world and call it again
    (with args.resume = True when args.ckpt_dir is set): the survivors restore from
    `recovered_state()`, or from the last committed checkpoint. Under policy "grow" the survivors
    first spawn replacements and hand them the state (a spawned process joins here, before its
    first call). Returns what fn returns. Raises RankFailure (policy "off"/"restart", or fewer
    than min_ranks survive), and whatever fn raises otherwise.
    """
    from ..comm import is_initialized, world

    if _config.policy == "grow" and spawned() and not _config.joined:
        join(getattr(args, "timeout_s", None))  # a failure here ends this process
        _config.joined = _config.joining = _config.grow_due = True
    try:
        return _run(fn, args)
    finally:  # a join agreed but not done: the job ended (or failed) before its next step
        if _config.join is not None:
            _answer_join(world().rank if is_initialized() else -1, False,
                         reason="the job ended (finished, stopped or failed) before the next step "
                                "boundary, where the new ranks would have started")


def _run(fn, args):
    from ..comm import is_initialized, world

    while True:
        try:
            if _config.grow_due:
                _config.grow_due = False
                _grow(args)
            return fn(args)
        except _GrowNow:  # replacements spawned at a step boundary of a shrunk attempt
            _config.attempts.append(_config.current)
            _close(_config.current)
            _config.current, _config.grow_due = None, True
        except (RankFailure, MPIError) as exc:
            group = world() if is_initialized() else None
            failure = _as_failure(exc, group)
            if failure is None or not _shrinking() or group is None:
                raise
            _config.merged = None  # a growth cut short: its spawned ranks are handled as lost
            recover(group, failure, _config.current)
            _config.current = None
            _config.grow_due = _config.policy == "grow"
            if getattr(args, "ckpt_dir", None):
                args.resume = True


def _fault_at(phase, state):
    """The launch's fault plan (RTXMPI_FAULT) at a growth phase ("spawn": survivors about to
    call MPI_Comm_spawn; "grow": the merged world before the state handover), at the step of
    `state`, the replica the ranks hold (None: -1). Local."""
    if _config.faults is None:  # the launch's faults, in a launched process only
        _config.faults = FaultPlan(launch_rank(), PHASES, spec="" if _config.joined else None)
    _config.faults.at(phase, -1 if state is None else state.step)


def _try_spawn(group, state):
    """Survivors: spawn the ranks missing since the launch; keep the merged communicator for
    `_grow`. state: the replica they hold (after a shrink, or for a join at a step boundary) or
    None. On SpawnFailed schedule the next attempt; rank 0 says so. Returns whether it spawned.
    Collective."""
    missing = _config.full_size - group.world_size
    joining = min(_config.join[1], missing) if _config.join else 0  # the part not yet placed
    start = time.monotonic()
    info = {}
    if group.rank == 0 and _config.grow_hosts:  # the spawn's root: the only rank that reads it
        try:
            hosts = read_hosts(_config.grow_hosts)
        except ConfigError as exc:  # written while the job runs: say so and retry later
            hosts = None
            print(f"elastic: {exc}; spawning without it", file=sys.stderr, flush=True)
        info = {"PMIX_ADD_HOST": hosts} if hosts else {}
    _fault_at("spawn", state)
    try:
        _config.merged = spawn(group, missing, info, _config.processes)
    except SpawnFailed as exc:
        # a member lost during the spawn fails it too: this collective reports that loss as the
        # failure it is (recovered as any other; a join stays pending), not as a missing slot
        group.barrier()
        _config.next_grow = time.monotonic() + _config.grow_retry_s
        lost = missing - joining
        if joining:  # the join is refused; lost ranks (if any) are retried as before
            _config.full_size -= joining
            _answer_join(group.rank, False, reason=f"no free slot (spawn of {missing} "
                         f"rank{'s' * (missing > 1)} failed: {exc}); the job continues at "
                         f"{group.world_size} ranks")
            if group.rank == 0:
                print(f"elastic: cannot admit {joining} joining rank{'s' * (joining > 1)} (spawn "
                      f"failed: {exc}; no free slot?); join refused, continuing at "
                      f"{group.world_size} ranks", file=sys.stderr, flush=True)
        if lost and group.rank == 0:
            print(f"elastic: cannot replace {lost} lost rank{'s' * (lost > 1)} (spawn failed: "
                  f"{exc}; no free slot?); continuing at {group.world_size} ranks, next attempt in "
                  f"{_config.grow_retry_s:g} s", file=sys.stderr, flush=True)
        return False
    if group.rank == 0:
        ranks = f"{missing} rank{'s' * (missing > 1)}"
        what = (f"{missing} replacement rank{'s' * (missing > 1)}" if not _config.join else
                f"{missing} joining rank{'s' * (missing > 1)}" if missing == _config.join[1] else
                f"{ranks} (a join of {_config.join[1]} and lost ranks replaced)")
        print(f"elastic: spawned {what} in {(time.monotonic() - start) * 1e3:.0f} ms",
              file=sys.stderr, flush=True)
    return True


def _join_request(world):
    """Rank 0: the pending join request as (id, ranks) when there is a valid one and the policy
    is "grow"; a bad one, or any under another policy, is answered (refused) here. Local."""
    raw = take_request(_config.join_dir)
    if raw is None:
        return None
    limit = _config.max_ranks or 4 * (_config.first_size or world.world_size)
    try:
        ident, ranks = parse_request(raw, max(_config.full_size or 0, world.world_size), limit)
    except ConfigError as exc:
        ident, reason = exc.request_id, str(exc)
    else:
        if _config.policy == "grow":
            return ident, ranks
        reason = (f"this job runs with --elastic {_config.policy}; joining needs --elastic grow "
                  "(and mpiexec --with-ft ulfm --prtemca state_base_recoverable 1)")
    print(f"elastic: join request refused: {reason}", file=sys.stderr, flush=True)
    write_answer(_config.join_dir, ident, False, reason=reason)
    return None


def _agree_join(world, asked, stopping):
    """After an agreement that carried `join`: every rank learns rank 0's request (id, ranks) and
    raises the world size grow restores by its ranks; refused when the job stops after this step.
    Returns whether the next step spawns. Collective."""
    values = np.array(asked or (0, 0), np.int64)
    world.all_reduce(values, op="max")
    ident, ranks = int(values[0]), int(values[1])
    if stopping:
        if world.rank == 0:
            write_answer(_config.join_dir, ident, False,
                         reason="the job stops after this step (a stop signal arrived)")
        return False
    _config.join = (ident, ranks, world.world_size, time.time())
    _config.full_size = max(_config.full_size or 0, world.world_size) + ranks
    if world.rank == 0:
        print(f"elastic: join of {ranks} rank{'s' * (ranks > 1)} agreed at step "
              f"{_config.current.step if _config.current else '?'}; spawning at the next step "
              f"boundary", file=sys.stderr, flush=True)
    return True


def _sync_join(group):
    """After a shrink under "grow": the survivors agree on the join in progress (a failure may
    have cut the all_reduce that carried it short on some of them) and on the world size growth
    restores. One MAX all_reduce of 4 int64. Collective."""
    join = _config.join or (0, 0, 0, 0.0)
    values = np.array([_config.full_size or 0, join[0], join[1], join[2]], np.int64)
    group.all_reduce(values, op="max")
    full, ident, ranks, before = (int(v) for v in values)
    _config.full_size = full or None
    if ranks and _config.join is None:
        _config.join = (ident, ranks, before, time.time())


def _answer_join(rank, admitted, **fields):
    """Answer the join in progress (rank 0 writes the file) and forget it. Local."""
    join, _config.join = _config.join, None
    if join is None:
        return
    if admitted:
        _config.join_time = join[3]
    if rank == 0:
        write_answer(_config.join_dir, join[0], admitted, **fields)


def _grow(args):
    """Survivors: spawn replacements (unless a step boundary already did), make survivors and
    replacements the world, and hand over the recovered state; a spawned process: receive it.
    A failure here raises RankFailure and is recovered like any other. Collective."""
    from ..comm import world

    state, group = _config.recovered, world()
    old_size = 0 if _config.joining else group.world_size
    if _config.joining:  # a spawned process, joined in run(): receive
        _config.joining = False
    else:
        _config.current = _Held(state)  # what a failure from here on hands to recover()
        if _config.merged is None and not _try_spawn(group, state):
            _config.current = None
            return  # run shrunk; Loop.agree retries
        merged, _config.merged = _config.merged, None
        group = replace_world(merged)
        _config.processes = None  # the table of the world before the merge (a join keeps it)
    _config.full_size, old_size, has_state, saved_size = agree_growth(
        group, _config.full_size or 0, old_size, state)
    if has_state and state is None:  # a new rank: hold nothing, but take part like a survivor
        _config.current = _Held(None, tensors=True)
    _fault_at("grow", state)
    _config.recovered = hand_over(group, state, saved_size) if has_state else None
    _config.current = _Held(_config.recovered)  # until the next attempt's Loop: what a failure hands over
    _config.grows.append((old_size, group.world_size))
    _config.resizes.append((old_size, group.world_size))
    if getattr(args, "ckpt_dir", None):
        args.resume = True
    if group.rank == 0:
        got = _config.recovered
        print(f"elastic: grew the world {old_size} -> {group.world_size} ranks; continuing from "
              + (f"rank 0's replica at step {got.step} (handed to the new ranks from memory)" if got
                 else "the last committed checkpoint, or the start (no replica to hand over)"),
              file=sys.stderr, flush=True)
    if _config.join is not None and group.world_size >= _config.full_size:
        got = _config.recovered
        _answer_join(group.rank, True, step=got.step if got else None,
                     old_world_size=_config.join[2], world_size=group.world_size,
                     **({} if got else {"note": "continuing from the last committed checkpoint"}))


class _Held:
    """A replica while it is handed over, as recover() reads a Loop: a survivor's ReplicaState
    (`state`), or on a new rank none, yet `tensors` so that it takes part in the exchange."""

    def __init__(self, state, tensors=False):
        self.applied_step = -1 if state is None else state.step
        self._tensors = (lambda: state.tensors if state else {}) if state or tensors else None
        self._pieces, self._close = None, []
        self._applied_meta = None if state is None else state.meta


def _end_processes(group, processes, ranks, survivors):
    """SIGKILL the processes of `ranks` that share this rank's node (every survivor there does;
    the lowest of them says so): a stopped or stuck process cannot act on an eviction, and one
    left running keeps mpiexec waiting. survivors: the ranks that go on. Returns the ranks whose
    process is ended (killed here, or gone)."""
    ended = []
    if processes is None:
        return ended
    for r in ranks:
        outcome = processes.kill(r)
        if outcome == "elsewhere":
            continue
        ended.append(r)
        node = processes.table[r, 3]
        if group.rank == min(s for s in survivors if processes.table[s, 3] == node):
            print(f"elastic: rank {r}'s process (pid {processes.table[r, 0]}) ended by SIGKILL from "
                  f"its node's surviving ranks", file=sys.stderr, flush=True)
    return ended


def _evict(group, beat, processes, failure):
    """Make the ranks that ULFM reports failed on the world, and those named by `failure` that
    the heartbeats find stuck, dead processes: ask each to kill itself (its heartbeat thread
    does, at its next beat) and SIGKILL those on this node. For the others, wait up to a beat
    period + 0.5 s until ULFM reports them failed, so that a slow rank that was not stuck after
    all does not rejoin the shrink. (A rank still alive after that is removed by the shrink once
    it dies: a shrink waits for every live rank.) Returns the ranks evicted."""
    comm = group.backend.comm
    stuck = {r for r in failure.ranks if beat is not None and beat.is_stuck(r)}
    named = sorted((stuck | set(failed_ranks(comm))) - {group.rank})
    survivors = [r for r in range(group.world_size) if r not in named]
    if beat is not None:
        for r in named:
            beat.evict(r, f"no progress; handled as a failed rank ({failure})")
    ended = _end_processes(group, processes, named, survivors)
    wait_s = (beat.period_s if beat is not None else 0.0) + 0.5
    alive = [r for r in named if r not in ended and r not in failed_ranks(comm)]
    deadline = time.monotonic() + wait_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.002)
        poll(comm)  # let MPI hear of the failure
        dead = set(failed_ranks(comm))
        alive = [r for r in alive if r not in dead]
    if alive:
        print(f"elastic: evicted ranks {alive} not yet reported failed after {wait_s:g} s",
              file=sys.stderr, flush=True)
    return named


def _state(group, loop, old_size):
    """The newest replica the ranks of `group` hold (a ReplicaState), or None: no step applied
    yet, sharded state, or no complete copy. The ranks first agree on what they hold (one MAX
    all_reduce of 3 bytes): a failure during a growth can leave some between attempts (a held
    replica) and others in the next one, and all must take part in the same exchange; a rank
    without a replica takes part in the tensors' exchange with none. Collective."""
    applied = -1 if loop is None or loop.applied_step is None else loop.applied_step
    has_tensors = loop is not None and loop._tensors is not None
    has_pieces = loop is not None and loop._pieces is not None
    kinds = np.array([has_tensors, has_pieces, not has_pieces], np.uint8)
    group.all_reduce(kinds, op="max")
    any_tensors, any_pieces, any_without_pieces = (bool(v) for v in kinds)
    if any_tensors and not any_pieces:
        tensors = loop._tensors if has_tensors else (lambda: {})
        meta = (lambda: loop._applied_meta) if loop is not None else (lambda: None)
        state = exchange_replica(group, applied if has_tensors else -1, tensors, meta, old_size)
        return state if state.step >= 0 else None  # no step applied anywhere yet: start over
    if any_pieces and not any_without_pieces and not any_tensors:  # None: no complete copy survived
        return exchange_pieces(group, applied, loop._pieces, lambda: loop._applied_meta, old_size)
    return None


def _close(loop):
    for c in loop._close if loop is not None else ():
        try:
            c.close()
        except Exception as exc:  # noqa: BLE001 - a broken file must not stop the recovery
            print(f"elastic: closing {c!r} after the failure: {exc}", file=sys.stderr, flush=True)


def recover(group, failure, loop):
    """Shrink after `failure` and prepare the next attempt's state (collective over survivors)."""
    _config.failure_time = seen = time.time()
    _config.attempts.append(loop)
    guard_resume(None)  # this process takes part in the shrink: a SIGCONT now must not end it
    beat, processes = group.backend.monitor.heartbeat, _config.processes
    # a stuck or stopped rank is alive: make it a failed one, which the shrink removes
    named = _evict(group, beat, processes, failure)
    old_comm = group.backend.comm
    new, old_size = shrink_world(group, _config.min_ranks)
    if _config.policy == "grow":
        _sync_join(new)
    lost = lost_ranks(old_comm, new.backend.comm)
    survivors = [r for r in range(old_size) if r not in lost]
    # ULFM's detector may have declared a stopped process dead that still exists: end it too
    _end_processes(group, processes, [r for r in lost if r not in named], survivors)
    if new.rank == 0 and processes is not None:  # for `rtxmpi run`: these will not report an exit
        for r in lost:
            exitreport.mark("evicted", pid=int(processes.table[r, 0]))
    # the survivors' rows: a failure before the next attempt (during a spawn) can end a process too
    _config.processes = None if processes is None else processes.subset(survivors, new.rank)
    _config.shrinks.append((old_size, new.world_size))
    _config.resizes.append((old_size, new.world_size))
    if _config.full_size is None:
        _config.full_size = old_size
    shrunk = time.time()
    state = _state(new, loop, old_size)
    _config.recovered = state
    _close(loop)
    if new.rank == 0:
        sources = getattr(state, "sources", None)
        where = (f"the shards of ranks {sources} at step {state.step} (a complete copy survived)"
                 if sources else
                 f"rank {state.source_rank}'s replica at step {state.step}" if state else
                 "the last committed checkpoint (no complete copy survived)"
                 if loop is not None and loop._pieces is not None else
                 "the last committed checkpoint" if loop is None or loop._tensors is None
                 else "the last committed checkpoint, or the start")
        states = "".join(f"; rank {r}: {beat.describe(r)}" for r in lost) if beat else ""
        print(f"elastic: {failure}{states}; shrank the world {old_size} -> {new.world_size} ranks in "
              f"{(shrunk - seen) * 1e3:.0f} ms; continuing from {where}", file=sys.stderr, flush=True)
    return new
