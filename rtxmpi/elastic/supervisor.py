"""`rtxmpi run`: launch an MPI job, forward pre-emption signals, relaunch it after a failure.

    rtxmpi run -n 4 --min-ranks 2 --max-restarts 3 -- python examples/train.py --ckpt-dir ck --resume

Each attempt runs `mpiexec -n N [mpiexec args] COMMAND` in its own session, with $RTXMPI_RESTART
set to the attempt's restart count (0 first). What the exit status means:

  0                 done: the supervisor exits 0.
  75 (pre-empted)   the job stopped on request with a committed checkpoint: not relaunched; the
                    supervisor exits 75 (a scheduler's requeue brings it back).
  2 (bad flags)     relaunching cannot help: the supervisor exits 2.
  anything else     a failure (a rank died, a collective timed out): relaunched, from the latest
                    committed checkpoint (the resume flag, default --resume, is added to COMMAND
                    when missing), on the ranks available then, until --max-restarts relaunches
                    have failed; then the supervisor exits with the last status.

mpiexec's 0 counts as done only when a rank process reported exit code 0 (elastic.exitreport:
prterun also exits 0 after losing a node's daemon mid-run); without reports, as mpiexec says.

Ranks available: with --hostfile, the file is re-read before every launch and its slots counted
(a node removed from it is not used again, a node added is), capped by --max-ranks (default -n);
without one, -n. Fewer than --min-ranks: give up.

Signals: SIGTERM, SIGUSR1 or SIGINT to the supervisor reach the ranks as SIGUSR1 through mpiexec
(prterun forwards USR1/USR2 but turns TERM into SIGKILL of the ranks, so no handler would run); the
ranks stop at the next step boundary with a checkpoint. After --grace-s seconds mpiexec gets
SIGTERM, 5 s later the whole session SIGKILL.
"""
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ..errors import ConfigError
from . import exitreport
from .preempt import EXIT_PREEMPTED

EXIT_CONFIG = 2
KILL_AFTER_S = 5.0


def hostfile_slots(path):
    """Total slots in an Open MPI hostfile (`host slots=K`, `host` alone counts 1; # comments).
    Raises ConfigError when the file cannot be read or a slots value is not a positive int."""
    try:
        lines = open(path).read().splitlines()
    except OSError as exc:
        raise ConfigError(f"--hostfile {path}: {exc.strerror}") from None
    total = 0
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        slots = 1
        for field in fields[1:]:
            if field.startswith("slots="):
                try:
                    slots = int(field.split("=", 1)[1])
                except ValueError:
                    slots = 0
                if slots < 1:
                    raise ConfigError(f"--hostfile {path} line {number}: bad {field!r}; use slots=K, K >= 1")
        total += slots
    return total


def launch_size(n, *, hostfile=None, max_ranks=None):
    """Ranks for the next launch: min(slots in the hostfile, max_ranks or n), or n without one."""
    if hostfile is None:
        return n
    return min(hostfile_slots(hostfile), max_ranks or n)


def _detach_but_follow_parent():
    """In the child before exec: a session of its own (so the grace-period SIGKILL reaches the
    launcher's whole group), and SIGTERM when the supervisor dies (Linux PR_SET_PDEATHSIG), so a
    killed supervisor leaves no job behind."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class Supervisor:
    """Runs attempts of one job until it succeeds, is pre-empted, or restarts run out.

    command: argv of the per-rank program. n: ranks of the first launch. min_ranks, max_ranks,
    max_restarts, grace_s: see the module doc. mpiexec: argv prefix of the launcher (without -n).
    Raises ConfigError for inconsistent numbers.
    """

    def __init__(self, command, *, n, min_ranks=1, max_ranks=None, max_restarts=3, grace_s=30.0,
                 hostfile=None, mpiexec=("mpiexec",), resume_flag="--resume", out=sys.stderr):
        if not command:
            raise ConfigError("rtxmpi run: no command; use rtxmpi run -n N -- python train.py ...")
        if n < 1 or min_ranks < 1 or min_ranks > n or (max_ranks is not None and max_ranks < n):
            raise ConfigError(f"rtxmpi run: need 1 <= --min-ranks ({min_ranks}) <= -n ({n}) <= "
                              f"--max-ranks ({max_ranks if max_ranks is not None else n})")
        if max_restarts < 0 or not grace_s >= 0:
            raise ConfigError("rtxmpi run: --max-restarts and --grace-s must be >= 0")
        self.command, self.n, self.min_ranks, self.max_ranks = list(command), n, min_ranks, max_ranks
        self.max_restarts, self.grace_s, self.hostfile = max_restarts, grace_s, hostfile
        self.mpiexec, self.resume_flag, self.out = list(mpiexec), resume_flag, out
        self.attempts = []  # (restart, ranks, exit status, seconds, what happened)
        self.process = None
        self.stop_signal = None

    def say(self, text):
        print(f"rtxmpi run: {text}", file=self.out, flush=True)

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        first = self.stop_signal is None
        self.stop_signal = signum
        if self.process is not None and self.process.poll() is None and first:
            self.say(f"{signal.Signals(signum).name}: asking the ranks to stop (SIGUSR1 via "
                     f"mpiexec); SIGTERM in {self.grace_s:g} s")
            self._send(signal.SIGUSR1)

    def _send(self, signum, group=False):
        try:
            if group:
                os.killpg(self.process.pid, signum)
            else:
                self.process.send_signal(signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _wait(self):
        """Wait for the attempt; enforce the grace period after a forwarded stop."""
        escalated = killed = None
        while True:
            try:
                return self.process.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            if self.stop_signal is None:
                continue
            now = time.monotonic()
            escalated = escalated or now + self.grace_s
            if killed is None and now >= escalated:
                self.say(f"grace period of {self.grace_s:g} s over: SIGTERM to mpiexec")
                self._send(signal.SIGTERM)
                killed = now + KILL_AFTER_S
            elif killed is not None and now >= killed:
                self._send(signal.SIGKILL, group=True)

    # -- attempts ----------------------------------------------------------------------------
    def argv(self, ranks, restart):
        command = list(self.command)
        if restart and self.resume_flag and self.resume_flag not in command:
            command.append(self.resume_flag)
        hostfile = ["--hostfile", self.hostfile] if self.hostfile else []
        return self.mpiexec + ["-n", str(ranks)] + hostfile + command

    def run(self):
        """Run attempts until done; returns the exit status for the supervisor process."""
        handlers = {s: signal.signal(s, self._on_signal)
                    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        try:
            return self._run()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)

    def _run(self):
        restart, status = 0, 1
        while True:
            ranks = launch_size(self.n, hostfile=self.hostfile, max_ranks=self.max_ranks)
            if ranks < self.min_ranks:
                self.say(f"only {ranks} ranks available (--min-ranks {self.min_ranks}): giving up")
                break
            argv = self.argv(ranks, restart)
            self.say(f"attempt {restart + 1}: {shlex.join(argv)}")
            reports = tempfile.mkdtemp(prefix="rtxmpi-exit-")  # exitreport: how the ranks ended
            env = dict(os.environ, RTXMPI_RESTART=str(restart), **{exitreport.ENV: reports})
            start = time.monotonic()
            self.process = subprocess.Popen(argv, env=env, preexec_fn=_detach_but_follow_parent)
            status = self._wait()
            seconds = time.monotonic() - start
            self.process = None
            status, note = exitreport.reconcile(status, reports)
            shutil.rmtree(reports, ignore_errors=True)
            if note:
                self.say(note)
            what = ("done" if status == 0 else "pre-empted (checkpoint committed)"
                    if status == EXIT_PREEMPTED else "configuration error" if status == EXIT_CONFIG
                    else "stopped by a signal" if self.stop_signal is not None
                    else f"failed (exit status {status})")
            self.attempts.append((restart, ranks, status, seconds, what))
            if status in (0, EXIT_PREEMPTED, EXIT_CONFIG) or self.stop_signal is not None:
                break
            if restart >= self.max_restarts:
                self.say(f"giving up: the job failed {restart + 1} times "
                         f"(--max-restarts {self.max_restarts})")
                break
            restart += 1
            self.say(f"attempt {restart} {what}; relaunching from the latest committed checkpoint")
        self.summary()
        if self.stop_signal is not None and status not in (0, EXIT_PREEMPTED):
            return 128 + self.stop_signal
        return status

    def summary(self):
        self.say("summary")
        for restart, ranks, status, seconds, what in self.attempts:
            print(f"  attempt {restart + 1}: {ranks} ranks, exit {status}, {seconds:.1f} s, {what}",
                  file=self.out, flush=True)
