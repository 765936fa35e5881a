"""Process groups and collectives: `init()` returns the world `ProcessGroup`."""
import os

from mpi4py import MPI

from .. import fused
from ..backend import device_identity, env_flag, select_device, tune_host_allocator
from ..errors import ConfigError, RankFailure
from ..spawn_deadline import mpi_init_returned
from .group import ProcessGroup, validate_timeout
from .heartbeat import Heartbeat
from .launch import check_launch, check_slurm_ranks
from .monitor import Monitor, install_excepthook
from .node import node_ranks
from . import traced
from . import shm
from .nccl import DeviceGroup, agree_transport, make_world
from .work import Work

mpi_init_returned()  # importing mpi4py.MPI above ran MPI_Init
DEFAULT_TIMEOUT_S = 300.0
traced.install()  # collective spans while rtxmpi.observe.trace is on
BACKENDS = ("auto", "mpi", "nccl")

_world = None


def init(backend="auto", timeout_s=None, check=None):
    """Start rtxmpi on this process and return the world ProcessGroup.

    backend: "auto" (cupy arrays over NCCL when cupy, NCCL and a GPU are present, else CUDA-aware
    MPI, else host-staged MPI; numpy arrays always over MPI), "mpi" (host staging for cupy), or
    "nccl" (ConfigError on every rank when a rank lacks cupy, NCCL or a GPU). docs/gpu.md.
    timeout_s: deadline in seconds of every wait (default $RTXMPI_TIMEOUT_S or 300).
    check: checking mode, a fingerprint exchange before every collective (default $RTXMPI_CHECK).
    Collective: every process of the MPI job must call it once, first; later calls return the same
    group. Raises ConfigError (bad arguments; a Slurm launch without an MPI launcher; a bad
    RTXMPI_TIMEOUT_S, RTXMPI_CHECK, RTXMPI_FUSED, RTXMPI_HOST_MALLOC or SLURM_*/launcher count on any rank:
    raised on every rank).
    """
    global _world
    if _world is not None:
        return _world
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:  # this rank's environment: any rank's error is raised on every rank (agreed below)
        check_launch(size)  # SLURM_*/launcher variables: a malformed one is an error too
        if timeout_s is None:
            timeout_s = validate_timeout(os.environ.get("RTXMPI_TIMEOUT_S", DEFAULT_TIMEOUT_S),
                                         "RTXMPI_TIMEOUT_S")
        timeout_s = validate_timeout(timeout_s)
        check = env_flag("RTXMPI_CHECK") if check is None else bool(check)
        fused.enabled()  # RTXMPI_FUSED
        tune_host_allocator()  # numpy's freed temporaries stay in the process (backend.py)
        env_error = None
    except ConfigError as exc:
        env_error = str(exc)
    env_errors = [e for e in comm.allgather(env_error) if e]
    if env_errors:  # a rank alone with a bad value must not leave the others in a collective
        raise ConfigError(env_errors[0])
    shm.configure(comm)  # RTXMPI_SHM*: rank 0's settings on every rank (or ConfigError everywhere)
    monitor = Monitor(comm)
    monitor.start_watchdog()
    local_rank, _, _ = node_ranks(comm)
    try:  # srun tasks: SLURM_PROCID/LOCALID/STEP_NUM_TASKS must match MPI (ConfigError on every rank)
        check_slurm_ranks(rank, size, local_rank)
        slurm_error = None
    except ConfigError as exc:
        slurm_error = str(exc)
    slurm_errors = [e for e in comm.allgather(slurm_error) if e]
    if slurm_errors:
        raise ConfigError(slurm_errors[0])
    if size > 1:
        install_excepthook(rank)
    members = list(range(size))
    # cupy arrays: NCCL, else CUDA-aware MPI, else host staging (agreed by every rank)
    transport = agree_transport(comm, backend, device_identity(local_rank))
    _world = make_world(transport, comm, monitor, members, select_device(local_rank),
                        name="world", rank=rank, world_size=size, local_rank=local_rank,
                        timeout_s=timeout_s, check=check)
    return _world


def start_heartbeats(stuck_timeout_s, period_s=None):
    """Start control-plane heartbeats on the world (rtxmpi.comm.heartbeat): a wait then raises
    RankFailure naming a peer that made no progress for `stuck_timeout_s` seconds, with its last
    phase and step. Collective over the world; a second call is a no-op. Raises ConfigError."""
    monitor = world().backend.monitor
    if monitor.heartbeat is None:
        if not float(stuck_timeout_s) > 0:
            raise ConfigError(f"stuck_timeout_s must be > 0 seconds, got {stuck_timeout_s!r}")
        monitor.heartbeat = Heartbeat(world().backend.comm, stuck_timeout_s=stuck_timeout_s,
                                      period_s=period_s, waiting=monitor.is_waiting)
    return monitor.heartbeat


def progress(phase, step):
    """Record this rank's phase and step for the heartbeats (cheap; local)."""
    if _world is not None and _world.backend.monitor.heartbeat is not None:
        _world.backend.monitor.heartbeat.progress(phase, step)


def replace_world(comm):
    """Make `comm` the world group (e.g. the communicator ULFM's shrink returned) and return it.

    The new group numbers ranks 0..comm size-1 and keeps the old world's device, timeout_s and
    check; it has its own Monitor (control communicator, watchdog). Objects built on the old
    world keep the old group: rebuild them; their nonblocking all_reduces still queued on one
    node's shared-memory path fail with RankFailure (Work.wait raises it). Collective over
    `comm`. Raises ConfigError before init().
    """
    global _world
    old = world()
    shm.fail_queued(RankFailure("a nonblocking all_reduce of the old world had not completed "
                                "when the world was replaced (elastic shrink)", ranks=[]))
    rank, size = comm.Get_rank(), comm.Get_size()
    monitor = Monitor(comm)
    monitor.start_watchdog()
    local_rank, _, _ = node_ranks(comm)
    members = list(range(size))
    # the same device transport as before (a new NCCL communicator on first device collective)
    _world = make_world(getattr(old.backend, "transport", None), comm, monitor, members,
                        old.device, name="world", rank=rank, world_size=size,
                        local_rank=local_rank, timeout_s=old.timeout_s, check=old.check)
    if old.backend.monitor.heartbeat is not None:  # its peers are gone; start_heartbeats() again
        old.backend.monitor.heartbeat.stop()      # once the survivors' loop runs
    return _world


def world():
    """The world group created by init(). Raises ConfigError before init()."""
    if _world is None:
        raise ConfigError("rtxmpi.init() has not been called")
    return _world


def is_initialized():
    return _world is not None


def launch_rank():
    """This process's rank in the launch (MPI_COMM_WORLD): valid before init() and after an
    elastic shrink renumbered the world. Local."""
    return MPI.COMM_WORLD.Get_rank()


shared_zeros = shm.shared_zeros

__all__ = ["init", "world", "replace_world", "is_initialized", "launch_rank", "ProcessGroup", "DeviceGroup",
           "Work", "shared_zeros"]
