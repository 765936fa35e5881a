"""One-process parts of rtxmpi.elastic: fault specs, the stop request, requeue, the supervisor
(named apart from tests/launched/test_elastic.py: pytest imports test files by basename)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from rtxmpi.elastic import EXIT_INTERRUPTED, EXIT_PREEMPTED, PHASES, StopRequest, configure, requeue
from rtxmpi.elastic import exitreport
from rtxmpi.elastic.fault import FaultPlan, parse_faults
from rtxmpi.elastic.supervisor import Supervisor, hostfile_slots, launch_size
from rtxmpi.errors import ConfigError


def test_fault_spec_parses_action_rank_step_phase_seconds():
    (f,) = parse_faults("kill:2:7:backward:0.005", PHASES)
    assert (f.action, f.rank, f.step, f.phase, f.seconds) == ("kill", 2, 7, "backward", 0.005)
    (g, h) = parse_faults("stall:0:3, usr1:1:4:save", PHASES)
    assert (g.phase, g.seconds, h.action, h.phase) == ("forward", 3600.0, "usr1", "save")


@pytest.mark.parametrize("spec", ["boom:1:2", "kill:1", "kill:x:2", "kill:1:2:nowhere",
                                  "kill:1:2:forward:soon"])
def test_bad_fault_spec_is_a_config_error_naming_the_part(spec):
    with pytest.raises(ConfigError, match="RTXMPI_FAULT part"):
        parse_faults(spec, PHASES)


def test_fault_fires_once_only_on_its_rank_and_not_after_a_restart(monkeypatch):
    monkeypatch.setenv("RTXMPI_FAULT", "usr1:1:3")
    stop = StopRequest(signals=(signal.SIGUSR1,)).install()
    try:
        FaultPlan(0, PHASES).at("forward", 3)  # another rank's fault
        assert not stop.requested
        monkeypatch.setenv("RTXMPI_RESTART", "1")
        assert FaultPlan(1, PHASES).faults == []  # relaunched by rtxmpi run: no repeat
        monkeypatch.setenv("RTXMPI_RESTART", "0")
        plan = FaultPlan(1, PHASES)
        plan.at("forward", 2)
        assert not stop.requested
        plan.at("forward", 3)
        assert stop.requested and stop.signal == signal.SIGUSR1
        assert plan.faults[0].fired
    finally:
        stop.uninstall()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_the_stop_request_and_uninstall_restores(signum, capfd):
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signum)
        assert stop.requested and stop.signal == signum
    finally:
        stop.uninstall()
    note = capfd.readouterr().err  # promises no checkpoint: mpiexec's teardown SIGTERMs too
    assert f"{signal.Signals(signum).name}: stop requested; will stop at the next step boundary" in note
    assert "if the job is not killed first" in note
    assert signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler, None) or \
        signal.getsignal(signum) != stop._handle


@pytest.mark.parametrize("signals, preempted", [((signal.SIGINT,), False), ((signal.SIGUSR2,), False),
                                                ((signal.SIGINT, signal.SIGTERM), True),
                                                ((signal.SIGUSR1, signal.SIGUSR2), True)])
def test_interrupts_stop_without_counting_as_a_preemption(signals, preempted, capfd):
    stop = StopRequest().install()
    try:
        for signum in signals:
            os.kill(os.getpid(), signum)
        assert stop.requested and stop.signal == signals[0] and stop.preempted == preempted
    finally:
        stop.uninstall()
    assert EXIT_INTERRUPTED == 130 and f"{signals[0].name}: stop requested" in capfd.readouterr().err


def test_a_second_sigint_ends_the_process_at_once(tmp_path):
    code = ("import os, signal, sys, time\n"
            "from rtxmpi.elastic import StopRequest\n"
            "stop = StopRequest().install()\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "assert stop.requested\n"
            "print('first', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGINT and proc.stdout == "first\n", proc.stderr
    assert "Ctrl-C again: stop at once" in proc.stderr


def test_requeue_outside_slurm_says_so_and_does_not_raise(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert "not running under Slurm" in requeue()
    assert "not found" in requeue("123", scontrol="no-such-scontrol-here")


def test_configure_refuses_unknown_policy_and_bad_min_ranks():
    with pytest.raises(ConfigError, match="policy"):
        configure("expand")
    with pytest.raises(ConfigError, match="min_ranks"):
        configure("shrink", min_ranks=0)
    configure("off")


@pytest.mark.parametrize("retry_s", [0, -1.0, "30", True, float("nan")])
def test_configure_refuses_a_bad_grow_retry_interval(retry_s):
    with pytest.raises(ConfigError, match="grow_retry_s must be > 0 seconds"):
        configure("grow", grow_retry_s=retry_s)
    configure("off")


def test_grow_hosts_file_is_read_as_add_host_and_a_bad_line_is_named(tmp_path):
    from rtxmpi.elastic.grow import read_hosts
    path = tmp_path / "hosts"
    assert read_hosts(path) is None  # not written yet: nothing to add
    path.write_text("# returned\nnode7:4\n\nnode8  # one slot\n")
    assert read_hosts(path) == "node7:4,node8"
    path.write_text("node7:4\nnode8 slots=2\n")
    with pytest.raises(ConfigError, match=r"hosts line 2: 'node8 slots=2' is not HOST\[:SLOTS\]"):
        read_hosts(path)
    path.write_text("node7:0\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_hosts(path)


def test_train_config_names_the_grow_retry_flag():
    from rtxmpi.train import TrainConfig
    with pytest.raises(ConfigError, match="--grow-retry-s must be > 0 seconds, got 0"):
        TrainConfig(steps=1, elastic="grow", grow_retry_s=0,
                    names={"grow_retry_s": "--grow-retry-s"}).validate(1)


def test_hostfile_slots_and_launch_size(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# nodes\nnode1 slots=2\nnode2 slots=3  # big\nnode3\n\n")
    assert hostfile_slots(hosts) == 6
    assert launch_size(4, hostfile=hosts) == 4
    assert launch_size(4, hostfile=hosts, max_ranks=8) == 6  # grows into the new slots
    hosts.write_text("node1 slots=2\n")
    assert launch_size(4, hostfile=hosts, max_ranks=8) == 2
    hosts.write_text("node1 slots=zero\n")
    with pytest.raises(ConfigError, match="line 1"):
        hostfile_slots(hosts)
    with pytest.raises(ConfigError, match="--hostfile"):
        hostfile_slots(tmp_path / "missing")


def test_supervisor_refuses_inconsistent_numbers():
    with pytest.raises(ConfigError, match="--min-ranks"):
        Supervisor(["true"], n=2, min_ranks=3)
    with pytest.raises(ConfigError, match="no command"):
        Supervisor([], n=2)


def launcher(tmp_path, body):
    """A fake mpiexec: runs `body` (python) with the attempt's -n and command in sys.argv."""
    path = tmp_path / "fake_mpiexec.py"
    path.write_text("import os, sys, time\n" + body)
    return [sys.executable, str(path)]


def test_supervisor_relaunches_failures_with_resume_then_gives_up(tmp_path):
    """The fake job fails at once, which would count as an early failure (backoff, then give up
    after --max-early-failures): early_failure_s=0 turns that off to test --max-restarts alone."""
    log = tmp_path / "log"
    fake = launcher(tmp_path, f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + "
                              "' restart=' + os.environ['RTXMPI_RESTART'] + '\\n')\nsys.exit(9)\n")
    out = open(tmp_path / "out", "w")
    status = Supervisor(["job"], n=2, max_restarts=2, mpiexec=fake, out=out,
                        early_failure_s=0).run()
    out.close()
    assert status == 9
    assert log.read_text().splitlines() == ["-n 2 job restart=0", "-n 2 job --resume restart=1",
                                            "-n 2 job --resume restart=2"]
    text = (tmp_path / "out").read_text()
    assert "giving up: the job failed 3 times" in text and text.count(", exit 9, ") == 3


def test_supervisor_ends_a_finished_jobs_launcher_that_waits_for_an_evicted_process(tmp_path,
                                                                                   monkeypatch):
    """The ranks report: one exited 0, the other was evicted by a shrink; the fake mpiexec keeps
    waiting (for that process, on a node without survivors): SIGTERM, and the attempt is done."""
    from rtxmpi.elastic import supervisor
    monkeypatch.setattr(supervisor, "FINISHED_GRACE_S", 0.5)
    fake = launcher(tmp_path, "folder = os.environ['RTXMPI_EXIT_DIR']\n"
                              "for name, text in (('start.11', ''), ('start.12', ''), "
                              "('exit.11', '0'), ('evicted.12', '')):\n"
                              "    open(os.path.join(folder, name), 'w').write(text)\n"
                              "time.sleep(60)\n")
    out = open(tmp_path / "out", "w")
    start = time.monotonic()
    status = Supervisor(["job"], n=2, mpiexec=fake, out=out).run()
    out.close()
    text = (tmp_path / "out").read_text()
    assert status == 0 and time.monotonic() - start < 30, text
    assert "every rank finished or was evicted, yet mpiexec still runs" in text
    assert "attempt 2" not in text and ", exit 0, " in text and "done" in text


@pytest.mark.parametrize("status", [0, EXIT_PREEMPTED, EXIT_INTERRUPTED, 2, 4])
def test_supervisor_does_not_relaunch_done_preempted_interrupted_bad_flags_or_diverged(tmp_path, status):
    fake = launcher(tmp_path, f"sys.exit({status})\n")
    out = open(tmp_path / "out", "w")
    assert Supervisor(["job"], n=1, mpiexec=fake, out=out).run() == status
    out.close()
    assert (tmp_path / "out").read_text().count("rtxmpi run: attempt") == 1


def test_supervisor_grows_into_hostfile_slots_between_restarts(tmp_path):
    hosts, log = tmp_path / "hosts", tmp_path / "log"
    hosts.write_text("a slots=2\n")
    fake = launcher(tmp_path, f"open({str(log)!r}, 'a').write(sys.argv[2] + '\\n')\n"
                              f"open({str(hosts)!r}, 'w').write('a slots=2\\nb slots=2\\n')\n"
                              "sys.exit(0 if os.environ['RTXMPI_RESTART'] == '1' else 1)\n")
    out = open(tmp_path / "out", "w")
    assert Supervisor(["job"], n=2, max_ranks=4, hostfile=str(hosts), mpiexec=fake,
                      out=out, backoff_s=0).run() == 0  # its first attempt fails early
    out.close()
    assert log.read_text().split() == ["2", "4"]


def test_supervisor_forwards_sigterm_as_sigusr1_and_escalates_after_the_grace(tmp_path):
    got = tmp_path / "got"
    fake = launcher(tmp_path, "import signal\n"
                              f"signal.signal(signal.SIGUSR1, lambda s, f: open({str(got)!r}, 'w')"
                              ".write('usr1'))\n"
                              "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))\n"
                              "os.kill(os.getppid(), signal.SIGTERM)\n"
                              "time.sleep(30)\n")
    out = open(tmp_path / "out", "w")
    status = Supervisor(["job"], n=1, grace_s=0.5, mpiexec=fake, out=out).run()
    out.close()
    assert got.read_text() == "usr1"
    assert status == 128 + signal.SIGTERM
    text = (tmp_path / "out").read_text()
    assert "asking the ranks to stop" in text and "grace period of 0.5 s over" in text


def test_supervisor_forwards_sigint_as_sigusr2_and_a_second_sigint_without_the_grace(tmp_path):
    got = tmp_path / "got"
    fake = launcher(tmp_path, "import signal\n"
                              f"signal.signal(signal.SIGUSR2, lambda s, f: open({str(got)!r}, 'a')"
                              ".write('usr2 ' + os.environ['RTXMPI_JOB_ID']))\n"
                              "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))\n"
                              "os.kill(os.getppid(), signal.SIGINT)\n"
                              "time.sleep(1)\n"
                              "os.kill(os.getppid(), signal.SIGINT)\n"
                              "time.sleep(30)\n")
    out = open(tmp_path / "out", "w")
    start = time.monotonic()
    status = Supervisor(["job"], n=1, grace_s=60, mpiexec=fake, out=out).run()
    out.close()
    assert got.read_text().startswith("usr2 run-") and time.monotonic() - start < 30
    assert status == 128 + signal.SIGINT
    text = (tmp_path / "out").read_text()
    assert "SIGINT: asking the ranks to stop (SIGUSR2 via mpiexec)" in text
    assert "SIGINT again: SIGTERM to mpiexec now" in text


def test_every_attempt_gets_one_job_id(tmp_path, monkeypatch):
    monkeypatch.delenv("RTXMPI_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    log = tmp_path / "log"
    fake = launcher(tmp_path, f"open({str(log)!r}, 'a').write(os.environ['RTXMPI_JOB_ID'] + "
                              "' ' + os.environ['RTXMPI_RESTART'] + '\\n')\nsys.exit(9)\n")
    out = open(tmp_path / "out", "w")
    Supervisor(["job"], n=1, max_restarts=1, mpiexec=fake, out=out, early_failure_s=0).run()
    out.close()
    assert log.read_text().splitlines() == ["4711 0", "4711 1"]


def test_a_killed_supervisor_leaves_no_job_behind(tmp_path):
    """The launcher runs in its own session but gets SIGTERM when the supervisor dies."""
    import subprocess
    import time
    pid_file = tmp_path / "pid"
    fake = launcher(tmp_path, f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    code = ("import sys; from rtxmpi.elastic.supervisor import Supervisor; "
            f"sys.exit(Supervisor(['job'], n=1, mpiexec={fake!r}).run())")
    supervisor = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        child = int(pid_file.read_text())
        supervisor.kill()
        supervisor.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            if open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break  # a zombie: dead, waiting for init to reap it
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the launcher outlived its supervisor")
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


PRTERUN_TAIL = ("--------------------------------------------------------------------------\n"
                "prterun detected that one or more processes exited with non-zero status,\n"
                "   Exit code:    1\n"
                "--------------------------------------------------------------------------\n")


@pytest.mark.parametrize("stderr, cause", [
    ("Traceback (most recent call last):\n  File \"train.py\", line 1\n"
     "ModuleNotFoundError: No module named 'nosuchmod'\n" + PRTERUN_TAIL,
     "cause: ModuleNotFoundError: No module named 'nosuchmod'"),
])
def test_instant_failures_back_off_then_give_up_naming_the_cause(tmp_path, stderr, cause):
    log = tmp_path / "log"
    fake = launcher(tmp_path, f"open({str(log)!r}, 'a').write(f'{{time.monotonic()}}\\n')\n"
                              f"sys.stderr.write({stderr!r})\nsys.exit(1)\n")
    out = open(tmp_path / "out", "w")
    status = Supervisor(["job"], n=2, max_restarts=10, mpiexec=fake, out=out, backoff_s=0.2,
                        max_early_failures=3).run()
    out.close()
    assert status == 1
    starts = [float(t) for t in log.read_text().split()]
    assert len(starts) == 3  # not --max-restarts 10
    assert starts[1] - starts[0] >= 0.2 and starts[2] - starts[1] >= 0.4  # doubling backoff
    text = (tmp_path / "out").read_text()
    assert "waiting 0.2 s before relaunching" in text and "waiting 0.4 s" in text
    assert "giving up: 3 launches in a row failed within 60 s without completing a training step" in text
    assert cause in text and "last stderr lines of the job:" in text
    assert text.count("failed early (exit status 1, no training step done)") == 3 + 2


@pytest.mark.parametrize("stderr, cause", [
    ("prterun has detected an attempt to run as root.\n\nRunning as root is *strongly* "
     "discouraged\n", "mpiexec refuses to run as root: export OMPI_ALLOW_RUN_AS_ROOT=1"),
    ("There are not enough slots available in the system to satisfy the 4\nslots that were "
     "requested by the application:\n", "not enough slots for the ranks asked for"),
    ("prterun was unable to find the specified executable file, and therefore did\nnot launch "
     "the job.\n   Executable: pythn\n", "mpiexec cannot find the program to run"),
    ("python: can't open file '/work/trian.py': [Errno 2] No such file or directory\n" + PRTERUN_TAIL,
     "python: can't open file '/work/trian.py'"),
])
def test_a_known_permanent_cause_gives_up_at_once_with_the_summary(tmp_path, stderr, cause):
    """Root without Open MPI's variables, too few slots, no such program or script: the same
    command fails the same way, so no relaunch and no backoff (rtxmpi.elastic.supervisor)."""
    log = tmp_path / "log"
    fake = launcher(tmp_path, f"open({str(log)!r}, 'a').write('x\\n')\n"
                              f"sys.stderr.write({stderr!r})\nsys.exit(1)\n")
    out = open(tmp_path / "out", "w")
    status = Supervisor(["job"], n=4, max_restarts=10, mpiexec=fake, out=out, backoff_s=5).run()
    out.close()
    text = (tmp_path / "out").read_text()
    assert status == 1 and log.read_text() == "x\n", text  # one launch
    assert f"giving up at once: {cause}" in text and "a relaunch would fail the same way" in text
    assert "waiting" not in text and f"  cause: {cause}" in text
    assert "failed early (exit status 1, no training step done): a known permanent cause, not " \
        "relaunched" in text


def test_a_failure_after_training_progress_is_relaunched_at_once(tmp_path):
    """A rank that completed a step wrote a progress report (elastic.exitreport.progress)."""
    fake = launcher(tmp_path, "d = os.environ['RTXMPI_EXIT_DIR']\n"
                              "open(os.path.join(d, f'progress.{os.getpid()}'), 'w').close()\n"
                              "sys.exit(0 if os.environ['RTXMPI_RESTART'] == '2' else 9)\n")
    out = open(tmp_path / "out", "w")
    assert Supervisor(["job"], n=1, mpiexec=fake, out=out, max_early_failures=1).run() == 0
    out.close()
    text = (tmp_path / "out").read_text()
    assert text.count("failed (exit status 9); relaunching") == 2 and "waiting" not in text


def test_a_launcher_that_cannot_start_gives_up_at_once(tmp_path):
    out = open(tmp_path / "out", "w")
    status = Supervisor(["job"], n=1, mpiexec=[str(tmp_path / "no-mpiexec")], out=out).run()
    out.close()
    text = (tmp_path / "out").read_text()
    assert status == 127 and "cannot start" in text and "No such file" in text
    assert text.count("rtxmpi run: attempt") == 1


def test_progress_report_is_written_once(tmp_path, monkeypatch):
    monkeypatch.setattr(exitreport, "_progress_marked", False)
    env = {exitreport.ENV: str(tmp_path)}
    assert not exitreport.progressed(tmp_path)
    exitreport.progress(environ=env)
    (tmp_path / f"progress.{os.getpid()}").unlink()
    exitreport.progress(environ=env)  # the second call writes nothing
    assert not exitreport.progressed(tmp_path)
    (tmp_path / "progress.1").write_text("")
    assert exitreport.progressed(tmp_path)


def test_a_signal_during_the_backoff_stops_without_relaunching(tmp_path):
    """The fake job fails at once and leaves a helper that SIGTERMs the supervisor (this process)
    while it waits out the backoff: it stops there, 128 + SIGTERM, no second launch."""
    fake = launcher(tmp_path, "import subprocess\n"
                              "subprocess.Popen([sys.executable, '-c', 'import os, signal, time; "
                              "time.sleep(0.3); os.kill(%d, signal.SIGTERM)' % os.getppid()])\n"
                              "sys.exit(1)\n")
    out = open(tmp_path / "out", "w")
    start = time.monotonic()
    status = Supervisor(["job"], n=1, mpiexec=fake, out=out, backoff_s=20).run()
    out.close()
    assert status == 128 + signal.SIGTERM and time.monotonic() - start < 15
    assert (tmp_path / "out").read_text().count("rtxmpi run: attempt") == 1
