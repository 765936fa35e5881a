"""The MPI_Init deadline of a spawned process (rtxmpi/spawn_deadline.py): armed by the
interpreter option, it ends a process blocked in a C call that holds the GIL (as MPI_Init does
inside `import mpi4py.MPI`), and does nothing once MPI_Init returned or without the option."""
import subprocess
import sys
from pathlib import Path

import pytest

from rtxmpi import spawn_deadline

MODULE = Path(spawn_deadline.__file__)
# the module by path (importing the rtxmpi package would run MPI_Init), then a blocking C call
# that keeps the GIL: libc's sleep through ctypes.PyDLL
CHILD = f"""
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("spawn_deadline", {str(MODULE)!r})
deadline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(deadline)
deadline.arm()
if sys.argv[1] == "returned":
    deadline.mpi_init_returned()
ctypes.PyDLL(None).sleep(int(sys.argv[2]))
print("woke up")
"""


def child(options, *args):
    return subprocess.run([sys.executable, *options, "-c", CHILD, *args], capture_output=True,
                          text=True, timeout=60)


def test_a_spawned_process_blocked_holding_the_gil_ends_at_the_deadline():
    done = child(spawn_deadline.interpreter_options(0.5), "blocked", "30")
    assert done.returncode == 1 and "woke up" not in done.stdout
    assert "Timeout (0:00:00.500000)!" in done.stderr, done.stderr


def test_no_deadline_once_mpi_init_returned_or_without_the_option():
    assert child(spawn_deadline.interpreter_options(0.5), "returned", "1").stdout == "woke up\n"
    assert child([], "blocked", "1").stdout == "woke up\n"
    assert spawn_deadline.interpreter_options(None) == []


@pytest.mark.parametrize("value, expected", [("30.0", 30.0), ("0.25", 0.25), ("0", None),
                                             ("-1", None), ("nan", None), ("inf", None),
                                             ("soon", None), (True, None)])
def test_the_option_is_read_as_a_positive_finite_number_of_seconds(monkeypatch, value, expected):
    monkeypatch.setattr(sys, "_xoptions", {spawn_deadline.XOPTION: value})
    assert spawn_deadline.deadline_s() == expected
