#!/usr/bin/env bash
# The whole test suite: one-process tests, tests that launch their own mpiexec, then the MPI tests
# at -n 1, 2 and 4 (oversubscribed on small machines). Exits non-zero if anything failed.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export RTXMPI_CHECK=1 RTXMPI_TIMEOUT_S=${RTXMPI_TIMEOUT_S:-120}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
MPIEXEC="mpiexec --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none"
status=0
echo "== one-process tests and launched-job tests"
python -m pytest -q --color=no tests/unit tests/launched "$@" || status=1
for n in 1 2 4; do
  echo "== MPI tests at -n $n"
  timeout 900 $MPIEXEC -n "$n" python tests/mpi_pytest.py -q --color=no tests/mpi "$@" || status=1
done
exit $status
