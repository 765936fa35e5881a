"""rtxmpi.comm.monitor.abort ends the process even when MPI_Abort does not return (seen under
ULFM after a peer died: the launcher's teardown waited on the dead process, and the job hung)."""
import signal
import subprocess
import sys
import time

SCRIPT = """
import time, types
from rtxmpi.comm import monitor

class World:
    def Abort(self, code):
        time.sleep(120)  # an MPI_Abort that never returns

monitor.MPI = types.SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False,
                                    COMM_WORLD=World())
monitor.ABORT_GRACE_S = 0.5
monitor.abort(1)
"""


def test_abort_kills_the_rank_when_mpi_abort_hangs():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, timeout=60)
    assert proc.returncode in (-signal.SIGKILL, -signal.SIGALRM), proc
    assert time.monotonic() - t0 < 30


GIL_HELD = """
import ctypes, types
from rtxmpi.comm import monitor

class World:
    def Abort(self, code):
        ctypes.PyDLL(None).sleep(120)  # mpi4py calls MPI_Abort holding the GIL: no thread runs

monitor.MPI = types.SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False,
                                    COMM_WORLD=World())
monitor.ABORT_GRACE_S = 0.5
monitor.abort(1)
"""


def test_abort_ends_the_rank_when_mpi_abort_hangs_holding_the_gil():
    """mpi4py's Comm.Abort does not release the GIL, so a Python timer thread cannot fire while
    MPI_Abort hangs: the fallback must not need the interpreter."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", GIL_HELD], capture_output=True, timeout=60)
    assert proc.returncode < 0, proc  # ended by a signal
    assert time.monotonic() - t0 < 30
