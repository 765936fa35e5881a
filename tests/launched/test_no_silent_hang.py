"""No silent hang (docs/design.md, "Invariants"): each test starts its own job under a hard outer timeout.

A rank that never arrives makes every other rank raise CollectiveTimeout naming the op, the
sequence number and the missing ranks, well within 3x the deadline, and the job ends non-zero;
an uncaught exception on one rank ends the job quickly; a Slurm launch without an MPI launcher is
refused with advice. Every test asserts the runtime fired first, not the outer timeout.
"""
import ast
import re

import pytest

TIMEOUT_S = 2.0
SLEEP_S = 60  # how long a missing rank stays away: far past every deadline here
REPORT = re.compile(r"^TIMEOUT rank=(\d+) elapsed_s=([\d.]+) op=(\S+) seq=(\d+) "
                    r"missing=(\[[\d, ]*\]) group=(\S+) text=(.*)$")

MISSING_RANK_JOB = """
import time
import numpy as np
import rtxmpi

world = rtxmpi.init(check={check}, timeout_s={timeout_s})
group = {group}
world.barrier()                       # world seq 1: every rank is up
if world.rank in {missing}:
    time.sleep({sleep_s})             # never calls the collective in time
start = time.monotonic()
try:
    {call}
except rtxmpi.CollectiveTimeout as exc:
    print(f"TIMEOUT rank={{world.rank}} elapsed_s={{time.monotonic() - start:.3f}} op={{exc.op}} "
          f"seq={{exc.seq}} missing={{exc.missing}} group={{exc.group}} text={{exc}}", flush=True)
    raise                             # uncaught: the runtime tears the job down
print(f"COMPLETED rank={{world.rank}}", flush=True)
"""


def missing_rank_job(*, call, missing, check=True, group="world", timeout_s=TIMEOUT_S):
    return MISSING_RANK_JOB.format(check=check, timeout_s=timeout_s, group=group, missing=missing,
                                   sleep_s=SLEEP_S, call=call)


def timeout_reports(launch):
    """{rank: (elapsed_s, op, seq, missing, group, text)} from the job's TIMEOUT lines."""
    reports = {}
    for line in launch.lines("TIMEOUT "):
        match = REPORT.match(line)
        assert match, f"unparsable report: {line}"
        rank, elapsed, op, seq, missing, group, text = match.groups()
        reports[int(rank)] = (float(elapsed), op, int(seq), ast.literal_eval(missing), group, text)
    return reports


def assert_every_waiting_rank_timed_out(launch, *, waiting, op, seq, missing, group="world"):
    assert not launch.outer_timeout, f"the outer timeout fired, not the runtime's:\n{launch}"
    assert launch.returncode != 0, f"the job exited 0 after a timeout:\n{launch}"
    assert launch.elapsed_s < SLEEP_S / 2, f"the job waited for the sleeping rank:\n{launch}"
    assert not launch.lines("COMPLETED"), launch
    reports = timeout_reports(launch)
    assert sorted(reports) == sorted(waiting), f"ranks that reported a timeout:\n{launch}"
    for rank, (elapsed_s, got_op, got_seq, got_missing, got_group, text) in reports.items():
        assert TIMEOUT_S * 0.9 <= elapsed_s < 3 * TIMEOUT_S, f"rank {rank} after {elapsed_s} s"
        assert (got_op, got_seq, got_missing, got_group) == (op, seq, missing, group), launch
        assert f"{op} #{seq} on group '{group}'" in text, text
        assert f"ranks that did not arrive: {missing}" in text, text


@pytest.mark.parametrize("check,call", [
    (True, "world.all_reduce(np.ones(4))"),
    (False, "world.all_reduce(np.ones(4))"),
    (False, "world.all_reduce(np.ones(4), async_op=True).wait()"),
], ids=["checking", "unchecked", "async_unchecked"])
def test_all_reduce_with_a_missing_rank_times_out_on_every_other_rank(run_mpi, check, call):
    launch = run_mpi(missing_rank_job(call=call, missing=[1], check=check), n=2)
    assert_every_waiting_rank_timed_out(launch, waiting=[0], op="all_reduce", seq=2, missing=[1])


def assert_every_rank_got_a_mismatch(launch, *rows):
    """Both ranks raised CollectiveMismatch (uncaught: the job ends non-zero) long before the
    deadline, naming each rank's call (rows: the text of each rank's call)."""
    assert not launch.outer_timeout and launch.returncode != 0, launch
    assert not timeout_reports(launch) and launch.elapsed_s < SLEEP_S / 2, launch
    for rank in (0, 1):
        assert f"[rtxmpi rank {rank}] uncaught CollectiveMismatch" in launch.stderr, launch
    for row in rows:
        assert row in launch.stderr, launch


def test_ranks_in_different_collectives_at_the_same_position_get_a_mismatch(run_mpi):
    """Checking off, rank 0 calls all_reduce #3 (the shared-memory mailbox, built by #2) while
    rank 1 calls barrier #3. Before, both waited until the deadline (and the diagnosis named the
    other op); now the barrier's arrival check is a mailbox call carrying its fingerprint, so
    both raise CollectiveMismatch at once, naming each rank's call (docs/comm.md)."""
    call = ("world.all_reduce(np.ones(4)); "
            "world.all_reduce(np.ones(4)) if world.rank == 0 else world.barrier()")
    launch = run_mpi(missing_rank_job(call=call, missing=[], check=False), n=2)
    assert_every_rank_got_a_mismatch(launch, "rank 0: all_reduce(count=4, dtype=float64, op=sum)",
                                     "rank 1: barrier(")


def test_ranks_in_one_call_with_different_algorithms_get_a_mismatch(run_mpi):
    """Checking off, rank 0 passes 32 KiB (the mailbox) and rank 1 32 KiB + 4 bytes (the
    cross-memory path). Before, both waited in all_reduce #2, in different algorithms, until the
    deadline; now the rank that sees its peer on the other path posts a call there that fails
    the peer's comparison, so both raise CollectiveMismatch with the two counts."""
    call = "world.all_reduce(np.ones(8192 + world.rank, np.float32))"
    launch = run_mpi(missing_rank_job(call=call, missing=[], check=False), n=2)
    assert_every_rank_got_a_mismatch(launch, "count=8192, dtype=float32", "count=8193, dtype=float32")


def test_barrier_with_two_missing_ranks_times_out_on_the_others(run_mpi):
    launch = run_mpi(missing_rank_job(call="world.barrier()", missing=[2, 3]), n=4)
    assert_every_waiting_rank_timed_out(launch, waiting=[0, 1], op="barrier", seq=2,
                                        missing=[2, 3])


def test_timeout_in_a_sub_group_names_world_ranks_of_that_group(run_mpi):
    # Odd ranks form a group [1, 3]; world rank 3 stays away; rank 1 times out in that group.
    # Even ranks stay out of rtxmpi (so they send no notices) and are torn down with the job.
    job = missing_rank_job(
        group="world.split(world.rank % 2)", missing=[3],
        call=f"group.all_reduce(np.ones(4)) if world.rank % 2 else time.sleep({SLEEP_S})")
    launch = run_mpi(job, n=4)
    reports = timeout_reports(launch)
    assert not launch.outer_timeout and launch.returncode != 0, launch
    assert 1 in reports, launch
    elapsed_s, op, seq, missing, group, text = reports[1]
    assert (op, seq, missing, group) == ("all_reduce", 1, [3], "world/split1:1"), text
    assert elapsed_s < 3 * TIMEOUT_S, text


def test_rank_arriving_after_the_deadline_but_within_the_probe_window_is_not_an_error(run_mpi):
    # the deadline passes at 2 s; the diagnosis listens until 4 s; rank 1 arrives at 3 s
    job = missing_rank_job(call="world.all_reduce(np.ones(4))", missing=[1]).replace(
        f"time.sleep({SLEEP_S})", f"time.sleep({1.5 * TIMEOUT_S})")
    launch = run_mpi(job, n=2)
    assert launch.returncode == 0 and not launch.outer_timeout, launch
    assert sorted(launch.lines("COMPLETED")) == ["COMPLETED rank=0", "COMPLETED rank=1"], launch
    assert not launch.lines("TIMEOUT"), launch


@pytest.mark.parametrize("others", ["finish_normally", "wait_in_barrier"])
def test_uncaught_exception_on_one_rank_ends_the_job_non_zero(run_mpi, others):
    job = f"""
        import rtxmpi

        world = rtxmpi.init(timeout_s=120)    # far longer than the test allows: not what ends it
        world.barrier()
        if world.rank == 1:
            raise RuntimeError("deliberate failure on rank 1")
        if {others == "wait_in_barrier"}:
            world.barrier()
        print(f"FINISHED rank={{world.rank}}", flush=True)
        """
    launch = run_mpi(job, n=2, outer_timeout_s=40)
    assert not launch.outer_timeout, f"the job hung after an uncaught exception:\n{launch}"
    assert launch.returncode != 0, launch
    assert launch.elapsed_s < 20, launch
    assert "deliberate failure on rank 1" in launch.stderr, launch
    assert "[rtxmpi rank 1] uncaught RuntimeError" in launch.stderr, launch


def test_slurm_tasks_without_an_mpi_launcher_are_refused(run_python):
    launch = run_python(["-c", "import rtxmpi; rtxmpi.init(); print('STARTED')"], SLURM_NTASKS=2)
    assert not launch.outer_timeout, launch
    assert launch.returncode != 0, launch
    assert "STARTED" not in launch.stdout
    assert "rtxmpi.errors.ConfigError" in launch.stderr, launch
    assert "Slurm started 2 tasks but MPI sees a world of 1" in launch.stderr, launch
    assert "srun --mpi=pmix -n 2" in launch.stderr and "mpiexec -n 2" in launch.stderr, launch


@pytest.mark.parametrize("env", [{"SLURM_NTASKS": 1}, {"SLURM_NTASKS": 2, "RTXMPI_ALLOW_SINGLETON": 1},
                                 {}], ids=["one_task", "allowed_singleton", "no_slurm"])
def test_singleton_starts_when_slurm_agrees_or_is_overridden(run_python, env):
    launch = run_python(["-c", "import rtxmpi; w = rtxmpi.init(); print('STARTED', w.world_size)"],
                        **env)
    assert launch.returncode == 0 and "STARTED 1" in launch.stdout, launch


@pytest.mark.parametrize("variable, value", [("RTXMPI_CHECK", "2"),
                                             ("RTXMPI_HOST_MALLOC", "banana"),
                                             ("RTXMPI_FUSED", "maybe"),
                                             ("RTXMPI_TIMEOUT_S", "soon"),
                                             ("SLURM_NTASKS", "four")])
def test_a_bad_environment_value_on_one_rank_is_a_config_error_on_every_rank(run_mpi, variable,
                                                                             value):
    """Only rank 1 has the bad value (an MPMD launch, a per-rank wrapper): init() agrees on it
    before its first shared step, so rank 0 raises too instead of waiting in a collective."""
    job = f"""
        import os
        if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
            os.environ[{variable!r}] = {value!r}
        import rtxmpi
        from rtxmpi.errors import ConfigError
        try:
            rtxmpi.init()
        except ConfigError as exc:
            print(f"REFUSED rank={{os.environ['OMPI_COMM_WORLD_RANK']}} {{exc}}", flush=True)
        else:
            print("STARTED", flush=True)
        """
    launch = run_mpi(job, n=2, outer_timeout_s=40)
    assert not launch.outer_timeout and "STARTED" not in launch.stdout, launch
    refused = sorted(launch.lines("REFUSED"))
    assert [line.split()[1] for line in refused] == ["rank=0", "rank=1"], launch
    assert all(variable in line for line in refused), launch
