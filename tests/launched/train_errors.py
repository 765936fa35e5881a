"""Many refused command lines of examples/train.py checked in ONE mpiexec launch.

Each bad-flag case used to be its own launch (2-3 s of process start each on 2 cores). Here one
job of n ranks imports examples/train.py and calls its `main(argv)` once per case, on every rank,
capturing each rank's exit status and what it wrote to stderr. That runs the same code a user's
launch does (argument parsing, `rtxmpi.init()`, check_args at the real world size, main()'s one-line
error handler, the status handed to sys.exit); only the process exit itself is left out, and one
real launch per test file (tests/launched/test_train.py) proves that part: mpiexec ends with 2
and one line on stderr.

    results = refused(n, [argv, ...], tmp_path)   # -> [Refusal, ...] in case order
"""
import json
import sys
from dataclasses import dataclass

from conftest import REPO, launch_env, mpiexec_argv, run_command, write_script

TRAIN = REPO / "examples" / "train.py"

DRIVER = """
import contextlib, importlib.util, io, json, sys, traceback
from mpi4py import MPI

spec = importlib.util.spec_from_file_location("train_main", {train!r})
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)
results = []
for argv in json.loads(open(sys.argv[1]).read()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train.main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # noqa: BLE001 - reported as the traceback a user would see
            traceback.print_exc()
            code = "exception"
    results.append([code, err.getvalue()])
gathered = MPI.COMM_WORLD.gather(results)
if MPI.COMM_WORLD.Get_rank() == 0:
    print("RESULTS " + json.dumps(gathered), flush=True)
"""


@dataclass
class Refusal:
    """One case: the exit status main() gave on each rank and each rank's stderr."""

    argv: list
    codes: list
    stderr: list

    def __str__(self):
        return f"{self.argv}: exit {self.codes}\n" + "\n".join(
            f"--- rank {r} stderr\n{text[-2000:]}" for r, text in enumerate(self.stderr))


def refused(n, cases, tmp_path, outer_timeout_s=120):
    """Run examples/train.py's main(argv) for every argv in `cases` on n ranks of one mpiexec job.
    Returns a Refusal per case, in order. Fails (AssertionError with the job's output) when the
    job itself did not finish with its report."""
    script = write_script(tmp_path, DRIVER.format(train=str(TRAIN)), name="refused.py")
    case_file = tmp_path / "cases.json"
    case_file.write_text(json.dumps([[str(a) for a in argv] for argv in cases]))
    proc = run_command(mpiexec_argv(n) + [sys.executable, script, case_file],
                       outer_timeout_s=outer_timeout_s,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache"), cwd=tmp_path)
    report = proc.lines("RESULTS ")
    assert proc.returncode == 0 and not proc.outer_timeout and report, str(proc)
    per_rank = json.loads(report[0][len("RESULTS "):])
    return [Refusal(list(argv), [per_rank[r][i][0] for r in range(n)],
                    [per_rank[r][i][1] for r in range(n)]) for i, argv in enumerate(cases)]


def assert_one_line_error(refusal, message, code=2):
    """Every rank exited with `code`; rank 0 alone wrote one `error: ` line holding `message`,
    with no traceback and no usage text."""
    assert refusal.codes == [code] * len(refusal.codes), str(refusal)
    first, *others = refusal.stderr
    assert message in first, str(refusal)
    assert first.count("error: ") == 1 and not any("error: " in text for text in others), str(refusal)
    assert not any("Traceback" in text or "usage:" in text for text in refusal.stderr), str(refusal)
