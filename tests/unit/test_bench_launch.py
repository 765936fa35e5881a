"""`rtxmpi bench NAME` (rtxmpi/bench_launch.py) and bench/run_all.py writing RESULTS.md."""
import importlib.util
import os
import shlex
import subprocess
import sys

import pytest

from rtxmpi import bench_launch
from rtxmpi.cli import main as rtxmpi_main
from rtxmpi.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HELLO = '''"""A benchmark-shaped MPI job: every rank prints its rank, the world size and its argv."""
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
for r in range(comm.size):
    if r == comm.rank:
        print(f"rank {comm.rank} of {comm.size} args {sys.argv[1:]}", flush=True)
    comm.Barrier()
'''


@pytest.fixture
def bench_dir(tmp_path):
    (tmp_path / "hello.py").write_text(HELLO)
    (tmp_path / "driver.py").write_text('import subprocess\nsubprocess.run(["mpiexec", "-n", "2", "x"])\n')
    (tmp_path / "declared.py").write_text('LAUNCH = "self"\nprint("no mpi here")\n')
    (tmp_path / "_common.py").write_text("")
    (tmp_path / "run_all.py").write_text("")
    return str(tmp_path)


def test_launch_mode_from_the_constant_or_an_mpiexec_command_line(bench_dir):
    assert bench_launch.launch_mode(os.path.join(bench_dir, "hello.py")) == "mpi"
    assert bench_launch.launch_mode(os.path.join(bench_dir, "driver.py")) == "self"
    assert bench_launch.launch_mode(os.path.join(bench_dir, "declared.py")) == "self"
    assert bench_launch.available(bench_dir) == ["declared", "driver", "hello"]


def test_repository_benchmarks_are_classified():
    directory = os.path.join(ROOT, "bench")
    assert bench_launch.launch_mode(os.path.join(directory, "checkpoint.py")) == "mpi"
    assert bench_launch.launch_mode(os.path.join(directory, "collectives.py")) == "mpi"
    assert bench_launch.launch_mode(os.path.join(directory, "scaling.py")) == "self"
    assert bench_launch.launch_mode(os.path.join(directory, "memory.py")) == "self"


def test_mpi_benchmark_runs_under_mpiexec_with_this_machines_flags(bench_dir):
    argv, mode = bench_launch.command("hello", 4, ["--size", "8"], bench_dir)
    assert mode == "mpi" and os.path.basename(argv[0]) == "mpiexec"
    assert argv[1:argv.index("-n")] == ["--oversubscribe", "--bind-to", "none", "--mca",
                                          "mpi_yield_when_idle", "1"]
    assert argv[argv.index("-n") + 1] == "4"
    assert argv[-3:] == [os.path.join(bench_dir, "hello.py"), "--size", "8"]
    argv, mode = bench_launch.command("declared", 4, [], bench_dir)
    assert mode == "self" and argv == [sys.executable, os.path.join(bench_dir, "declared.py")]
    argv, _ = bench_launch.command("hello", 2, [], bench_dir, launcher="srun --mpi=pmix")
    assert argv[:4] == ["srun", "--mpi=pmix", "-n", "2"]


def test_unknown_benchmark_or_bad_rank_count_is_a_config_error(bench_dir):
    with pytest.raises(ConfigError, match="no benchmark 'nope'.*declared, driver, hello"):
        bench_launch.command("nope", 2, [], bench_dir)
    with pytest.raises(ConfigError, match="no benchmark 'run_all'"):
        bench_launch.command("run_all", 2, [], bench_dir)
    with pytest.raises(ConfigError, match="-n 0"):
        bench_launch.command("hello", 0, [], bench_dir)
    assert rtxmpi_main(["bench", "nope", "--bench-dir", bench_dir]) == 2


def test_rtxmpi_bench_runs_the_job_and_passes_arguments_through(bench_dir):
    env = bench_launch.environment()
    proc = subprocess.run([sys.executable, "-m", "rtxmpi.cli", "bench", "hello", "-n", "2",
                           "--bench-dir", bench_dir, "--size-mb", "8", "--", "-n", "3"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 of 2 args ['--size-mb', '8', '-n', '3']" in proc.stdout
    assert "rank 1 of 2 args ['--size-mb', '8', '-n', '3']" in proc.stdout
    assert "[rtxmpi bench]" in proc.stderr and "mpiexec" in proc.stderr


def test_rtxmpi_bench_dry_run_prints_only_the_command_on_stdout(bench_dir):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-m", "rtxmpi.cli", "bench", "hello", "-n", "2",
                           "--bench-dir", bench_dir, "--dry-run", "--size-mb", "8"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert "OMP_NUM_THREADS=1" in argv[:3], proc.stdout  # what the real run adds (not set here)
    launcher = [a for a in argv if "=" not in a]
    assert "mpiexec" in launcher[0] and argv[-2:] == ["--size-mb", "8"], proc.stdout
    assert "rank 0" not in proc.stdout and proc.stderr == ""


def load_run_all():
    spec = importlib.util.spec_from_file_location("run_all", os.path.join(ROOT, "bench", "run_all.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_are_written_whole_from_the_latest_outputs(tmp_path, monkeypatch):
    run_all = load_run_all()
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Memory\n\nhand-written diary of 2026-11-29\n\n"
                       "<!-- run_all:memory begin -->\nold memory table\n<!-- run_all:memory end -->\n\n"
                       "<!-- run_all:checkpoint begin -->\nold checkpoint table\n"
                       "<!-- run_all:checkpoint end -->\n")
    outcome = {"checkpoint": True, "timeline": False}
    monkeypatch.setattr(run_all, "run_one", lambda name, n, extra, args, out_dir:
                        (outcome[name], f"new {name} at {n} ranks", 1.0, False))
    status = run_all.main(["--only", "checkpoint,timeline", "--results", str(results),
                           "--out-dir", str(tmp_path / "out")])
    text = results.read_text()
    assert status == 1  # timeline failed
    assert "hand-written diary" not in text
    assert "old memory table" in text  # not run: carried over
    assert "old checkpoint table" not in text and "new checkpoint at 2 ranks" in text
    assert "Not measured yet: `rtxmpi bench timeline`." in text  # failed, never measured before
    assert "timeline" not in run_all.previous_blocks(text)
    titles = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert titles == ["Machine"] + [row[1] for row in run_all.BENCHES]
    assert run_all.summary("memory") in text and run_all.summary("memory").startswith("Per-rank memory")
    assert run_all.previous_blocks(text)["memory"] == "old memory table"


def test_run_all_table_order_and_dry_run():
    run_all = load_run_all()
    names = [row[0] for row in run_all.BENCHES]
    assert names[:8] == ["convergence", "collectives", "scaling", "peers", "fused", "gpu_train",
                         "memory", "checkpoint"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run_all.py"), "--dry-run",
                           "--only", "checkpoint,elastic"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("rtxmpi bench checkpoint -n") == 1


def test_one_run_section_folds_its_heading():
    run_all = load_run_all()
    one = "Measured 2026-12-04 09:00 UTC, commit abc, 5 s.\n\n#### `rtxmpi bench memory`\n\n| a |\n"
    assert run_all.one_heading(one) == ("Measured 2026-12-04 09:00 UTC, commit abc, 5 s: "
                                        "`rtxmpi bench memory`.\n\n| a |\n")
    two = ("Measured 2026-12-04 09:00 UTC, commit abc, 5 s.\n\n#### `rtxmpi bench checkpoint -n 2`"
           "\n\n| a |\n\n#### `rtxmpi bench checkpoint -n 4`\n\n| b |\n")
    assert run_all.one_heading(two) == two
