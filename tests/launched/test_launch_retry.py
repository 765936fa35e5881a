"""The harness launches a job again when Open MPI failed before starting it, and only then."""
import sys

from conftest import LAUNCH_ATTEMPTS, LAUNCHER_NOT_STARTED, run_command, write_script

FLAKY = """
import pathlib, sys
count = pathlib.Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n < int(sys.argv[2]):
    sys.stderr.write({message!r} + "\\n")
    sys.exit(int(sys.argv[3]))
print("RAN", n)
"""


def launch(tmp_path, fail_times, status, message=LAUNCHER_NOT_STARTED):
    script = write_script(tmp_path, FLAKY.format(message=message))
    count = tmp_path / "count"
    proc = run_command([sys.executable, script, count, fail_times + 1, status], outer_timeout_s=30)
    return proc, int(count.read_text())


def test_a_launch_open_mpi_could_not_start_is_launched_again(tmp_path):
    proc, launches = launch(tmp_path, LAUNCH_ATTEMPTS - 1, 213)
    assert proc.returncode == 0 and proc.lines("RAN") == [f"RAN {LAUNCH_ATTEMPTS}"], str(proc)
    assert launches == LAUNCH_ATTEMPTS


def test_attempts_are_bounded_and_the_last_failure_is_reported(tmp_path):
    proc, launches = launch(tmp_path, LAUNCH_ATTEMPTS + 2, 213)
    assert proc.returncode == 213 and LAUNCHER_NOT_STARTED in proc.stderr
    assert launches == LAUNCH_ATTEMPTS


def test_any_other_failure_is_not_launched_again(tmp_path):
    proc, launches = launch(tmp_path, 1, 3, message="a rank failed")
    assert proc.returncode == 3 and launches == 1
