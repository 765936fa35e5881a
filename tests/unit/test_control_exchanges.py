"""The planner, the calibration and `rtxmpi info` exchange their control values through
ProcessGroup collectives on typed buffers (deadline, checking mode, trace), never through
mpi4py's pickled object collectives."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "rtxmpi"
PICKLED = {"bcast", "gather", "scatter", "allgather", "alltoall", "reduce", "allreduce", "scan",
           "exscan", "sendrecv"}  # mpi4py's lowercase object collectives


@pytest.mark.parametrize("module", ["parallel/planner.py", "parallel/calibrate.py", "cli.py"])
def test_no_pickled_mpi4py_collective_is_called(module):
    tree = ast.parse((ROOT / module).read_text())
    calls = [f"line {node.lineno}: .{node.func.attr}()" for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in PICKLED]
    assert calls == []
