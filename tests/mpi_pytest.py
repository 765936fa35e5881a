"""Run pytest on every rank of an MPI job; only rank 0 prints, other ranks log to files.

Usage: mpiexec -n N python tests/mpi_pytest.py [pytest args...]
The exit code is non-zero on any rank whose tests failed, so mpiexec fails too. On failure,
a rank other than 0 prints the tail of its log so the failure is visible.
"""
import os
import sys

import pytest
from mpi4py import MPI

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
args = sys.argv[1:] + ["--with-mpi", "-p", "no:cacheprovider"]
if rank != 0:
    log_dir = os.environ.get("RTXMPI_TEST_LOG_DIR", "/tmp/rtxmpi-test-logs")
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"n{size}_rank{rank}.log")
    log = open(log_path, "w")
    os.dup2(log.fileno(), 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    args += ["-q"]
code = pytest.main(args)
if rank != 0 and code not in (0, 5):
    sys.stdout.flush()
    with open(log_path) as f:
        sys.stderr.write(f"---- rank {rank} of {size} failed; its log ({log_path}) ends:\n")
        sys.stderr.write("".join(f.readlines()[-60:]))
sys.stdout.flush()
sys.exit(0 if code == 5 else code)
