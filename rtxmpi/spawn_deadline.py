"""A deadline on MPI_Init in a process started by MPI_Comm_spawn.

A spawned process connects to the spawning ranks inside MPI_Init. When the spawn fails on their
side (one of them died during it), Open MPI 5 can leave the processes it already started
blocked there for good, and the launcher waits for them: the job never ends. So the spawning
side (rtxmpi.comm.dynamic.spawn_merged) starts its processes with the interpreter option
`-X rtxmpi_spawn_timeout_s=S`, and `import rtxmpi` there arms a timer before MPI_Init: unless
MPI_Init returns within S seconds, the process prints where it is blocked and exits with status
1. The timer is faulthandler's watchdog thread, which runs without the GIL (importing mpi4py.MPI
holds it through MPI_Init). This module imports no MPI: rtxmpi/__init__.py arms the timer
first, rtxmpi.comm cancels it once MPI_Init returned.
"""
import faulthandler
import math
import sys

XOPTION = "rtxmpi_spawn_timeout_s"
_armed = False


def interpreter_options(timeout_s):
    """The interpreter options that give a spawned process's MPI_Init a deadline of `timeout_s`
    seconds (None: no options, no deadline)."""
    return [] if timeout_s is None else ["-X", f"{XOPTION}={float(timeout_s)!r}"]


def deadline_s():
    """This process's MPI_Init deadline in seconds from its `-X rtxmpi_spawn_timeout_s` option;
    None when the option is absent or not a positive finite number. Local."""
    text = sys._xoptions.get(XOPTION)  # True for a bare `-X rtxmpi_spawn_timeout_s`
    try:
        value = float(text) if isinstance(text, str) else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def arm():
    """In a spawned process with a deadline: unless `mpi_init_returned()` is called within it,
    print every thread's stack on stderr and exit with status 1. Elsewhere nothing. Local; call
    before MPI_Init (before mpi4py.MPI is imported)."""
    global _armed
    timeout_s = deadline_s()
    if timeout_s is not None:
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
        _armed = True


def mpi_init_returned():
    """MPI_Init has returned: the deadline no longer applies. Local."""
    global _armed
    if _armed:
        faulthandler.cancel_dump_traceback_later()
        _armed = False
