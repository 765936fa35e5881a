#!/usr/bin/env bash
# The whole test suite: one-process tests, tests that launch their own mpiexec, then the MPI tests
# at -n 1, 2 and 4 (oversubscribed on small machines). Prints the first phase's 15 slowest tests,
# each phase's duration and a summary; the ranks' logs live in a temporary folder removed at the
# end. Exits non-zero if anything failed.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export RTXMPI_CHECK=1 RTXMPI_TIMEOUT_S=${RTXMPI_TIMEOUT_S:-120}
# Open MPI 5's btl/ofi (libfabric) sleeps 1 s when closed unused, in every MPI_Init of every
# rank; the suite runs on one node (shared memory; the multi-node tests pass --mca btl tcp,self)
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
RTXMPI_TEST_LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/rtxmpi-test-logs.XXXXXX") || exit 1
export RTXMPI_TEST_LOG_DIR  # ranks other than 0 log here (tests/mpi_pytest.py)
trap 'rm -rf "$RTXMPI_TEST_LOG_DIR"' EXIT
MPIEXEC="mpiexec --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none"
status=0
summary=()
suite_start=$SECONDS

phase() {  # phase NAME COMMAND...: run it, print its duration and verdict
  local name=$1 start=$SECONDS verdict=ok
  shift
  echo "== $name"
  "$@" || { verdict=FAILED; status=1; }
  local took=$((SECONDS - start))
  echo "== $name: $verdict in ${took} s"
  summary+=("$(printf '%-40s %-6s %5d s' "$name" "$verdict" "$took")")
}

mpi_tests() {  # mpi_tests N ARGS...: tests/mpi on N ranks, launched again (3 times in all) when
  # Open MPI failed before starting any rank (its PMIx server could not open its listening socket)
  local n=$1 attempt rc errors
  shift
  errors=$(mktemp "$RTXMPI_TEST_LOG_DIR/mpiexec-stderr.XXXXXX") || return 1
  for attempt in 1 2 3; do
    timeout 900 $MPIEXEC -n "$n" python tests/mpi_pytest.py -q --color=no tests/mpi "$@" 2>"$errors"
    rc=$?
    cat "$errors" >&2
    [ $rc != 0 ] && grep -q "PMIx server's listener thread failed to start" "$errors" || return $rc
    echo "== Open MPI did not start the job (attempt $attempt); launching it again"
  done
  return $rc
}

phase "one-process tests and launched-job tests" python -m pytest -q --color=no --durations=15 tests/unit tests/launched "$@"
for n in 1 2 4; do
  phase "MPI tests at -n $n" mpi_tests "$n" "$@"
done
echo "== summary"
printf '%s\n' "${summary[@]}"
printf '%-40s %-6s %5d s\n' "whole suite" "$([ $status = 0 ] && echo ok || echo FAILED)" $((SECONDS - suite_start))
exit $status
