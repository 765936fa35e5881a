"""tests/run.sh itself, with stand-ins for python and mpiexec on PATH (the phases take no time):
each phase's verdict and duration, the summary, the exit status, the ranks' log folder removed."""
import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
# a phase: leaves a rank log as tests/mpi_pytest.py does; the -n 2 phase fails
echo "ran: $*"
echo log > "$RTXMPI_TEST_LOG_DIR/$$.log"
[ "${FAIL_N:-none}" = "${RANKS:-}" ] && exit 1
exit 0
"""
FAKE_MPIEXEC = """#!/bin/sh
while [ "$1" != "-n" ]; do shift; done
RANKS=$2; export RANKS; shift 2
exec "$@"
"""


def run_suite(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("mpiexec", FAKE_MPIEXEC)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path),
                **env}
    return subprocess.run(["bash", str(REPO / "tests" / "run.sh"), "-k", "x"], capture_output=True,
                          text=True, env=full_env, timeout=60)


def test_each_phase_prints_its_verdict_and_duration_and_the_logs_are_removed(tmp_path):
    proc = run_suite(tmp_path, FAIL_N="2")
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr  # the -n 2 phase failed
    for name, verdict in (("one-process tests and launched-job tests", "ok"), ("MPI tests at -n 1", "ok"),
                          ("MPI tests at -n 2", "FAILED"), ("MPI tests at -n 4", "ok")):
        assert re.search(rf"^== {name}: {verdict} in \d+ s$", out, re.M), out
        assert re.search(rf"^{name} +{verdict} +\d+ s$", out, re.M), out  # the summary's row
    assert re.search(r"^whole suite +FAILED +\d+ s$", out, re.M), out
    assert "ran: tests/mpi_pytest.py -q --color=no tests/mpi -k x" in out  # the arguments passed on
    assert "ran: -m pytest -q --color=no --durations=15 tests/unit tests/launched -k x" in out  # slowest shown
    assert not list(tmp_path.glob("rtxmpi-test-logs.*"))  # written during the run, removed at its end


def test_a_passing_suite_exits_0(tmp_path):
    proc = run_suite(tmp_path)
    assert proc.returncode == 0 and re.search(r"^whole suite +ok +\d+ s$", proc.stdout, re.M), proc.stdout
