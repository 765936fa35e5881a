"""`rtxmpi run`: launch an MPI job, forward pre-emption signals, relaunch it after a failure.

    rtxmpi run -n 4 --min-ranks 2 --max-restarts 3 -- python train.py --ckpt-dir ck --resume

Each attempt runs `mpiexec -n N [mpiexec args] COMMAND` in its own session, with $RTXMPI_RESTART
set to the attempt's restart count (0 first). What the exit status means:

  0                 done: the supervisor exits 0.
  75 (pre-empted)   the job stopped on request with a committed checkpoint: not relaunched; the
                    supervisor exits 75 (a scheduler's requeue brings it back).
  130 (Ctrl-C)      the job stopped on SIGINT with a committed checkpoint: not relaunched.
  2 (bad flags)     relaunching cannot help: the supervisor exits 2.
  4 (diverged)      every step was skipped or the final loss is not finite: a relaunch would
                    resume from the last checkpoint and hide it; the supervisor exits 4.
  anything else     a failure (a rank died, a collective timed out): relaunched, from the latest
                    committed checkpoint (the resume flag, default --resume, is added to COMMAND
                    when missing), on the ranks available then, until --max-restarts relaunches
                    have failed (or --max-early-failures early ones in a row, below); then the
                    supervisor exits with the last status.

mpiexec's 0 counts as done only when a rank process reported exit code 0 (elastic.exitreport:
prterun also exits 0 after losing a node's daemon mid-run); without reports, as mpiexec says.

Ranks available: with --hostfile, the file is re-read before every launch and its slots counted
(a node removed from it is not used again, a node added is), capped by --max-ranks (default -n);
without one, -n. Fewer than --min-ranks: give up.

Early failures: a launch that fails within --early-failure-s seconds (default 60) without any
rank completing a training step (elastic.exitreport progress reports; a command without reports
is judged by the time alone) cannot be helped by an instant relaunch: a typo in the script, a
missing module, root without Open MPI's root variables, too few slots. The supervisor waits
--backoff-s seconds (doubling after each such failure in a row, at most BACKOFF_MAX_S) before the
next launch, and after --max-early-failures of them in a row gives up with a summary naming the
cause (a known launcher message, or the last Python exception line) and the last lines the job
wrote to stderr; it exits with the last status. An early failure whose stderr shows a known
permanent cause (KNOWN_CAUSES: root without Open MPI's root variables, not enough slots, mpiexec
cannot find the program, python cannot open the script) is not relaunched at all: the supervisor
gives up at once with the same summary. The job's stderr is copied through as it comes
(and its tail kept for that summary); stdout is inherited unchanged.

A finished job whose launcher still waits: when the reports say every rank process exited or
was evicted by a shrink, and one exited 0 (exitreport.finished), and mpiexec has not ended
FINISHED_GRACE_S seconds later, it waits for an evicted rank's process that no survivor could
end (stopped, on a node without survivors): mpiexec gets SIGTERM (prterun then kills the ranks
left, stopped ones too), 5 s later the session SIGKILL, and the attempt counts as done.

Signals: SIGTERM or SIGUSR1 to the supervisor reach the ranks as SIGUSR1 through mpiexec, SIGINT
(Ctrl-C) as SIGUSR2 (prterun forwards USR1/USR2 but turns TERM and INT into SIGTERM then SIGKILL
of the ranks within 0.5 s, so no checkpoint could be written); the ranks stop at the next step
boundary with a checkpoint and exit 75, or 130 after Ctrl-C. mpiexec runs in a session of its
own, so a terminal's Ctrl-C reaches the supervisor only. A second SIGINT sends SIGTERM to mpiexec
at once; otherwise after --grace-s seconds mpiexec gets SIGTERM, 5 s later the whole session
SIGKILL. Every attempt gets the same $RTXMPI_JOB_ID (the one given, else $SLURM_JOB_ID, else one
made here), so a relaunch takes over the checkpoint directory lock of the attempt before it
(rtxmpi.checkpoint.lock).
"""
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..errors import ConfigError
from . import exitreport
from .preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED

EXIT_CONFIG = 2
EXIT_DIVERGED = 4
KILL_AFTER_S = 5.0
FINISHED_GRACE_S = 10.0  # a finished job's mpiexec normally ends well within this
BACKOFF_MAX_S = 60.0
TAIL_BYTES = 8192  # of the job's stderr, kept for the summary
TAIL_LINES = 6

# (text the launcher or Python prints, what to tell the user): known causes of early failures.
# Each is permanent: the same command in the same environment fails the same way, so an early
# failure with one of them is not relaunched (a missing module is not among them: an environment
# being installed or a file system being mounted may fix it; it gets the backoff).
KNOWN_CAUSES = (
    ("attempt to run as root", "mpiexec refuses to run as root: export OMPI_ALLOW_RUN_AS_ROOT=1 "
                               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (or add --allow-run-as-root to "
                               "--mpiexec)"),
    ("not enough slots available", "not enough slots for the ranks asked for: add --oversubscribe "
                                   "to --mpiexec, give a --hostfile, or use fewer ranks"),
    ("unable to find the specified executable", "mpiexec cannot find the program to run: check "
                                                "the command's first word (after --)"),
    ("can't open file", None),  # python's own line names the script: it is the cause
)
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)\b.*|.*can't open file.*"
                             r"|cannot start .*)$")


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


class StderrTail:
    """Copies a child's stderr pipe to `sink` as it comes (chunks, so progress bars still show)
    and keeps the last TAIL_BYTES of it, read on a daemon thread."""

    def __init__(self, pipe, sink):
        self.pipe, self.sink, self.data = pipe, sink, bytearray()
        self.thread = threading.Thread(target=self._copy, name="rtxmpi-run-stderr", daemon=True)
        self.thread.start()

    def _copy(self):
        fd = self.pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            try:
                buffer = getattr(self.sink, "buffer", None)
                if buffer is not None:
                    buffer.write(chunk)
                    buffer.flush()
                else:
                    self.sink.write(chunk.decode("utf-8", "replace"))
                    self.sink.flush()
            except (OSError, ValueError):
                pass  # our stderr is gone: keep draining the pipe so the job never blocks
            self.data += chunk
            del self.data[:-TAIL_BYTES]

    def lines(self, wait_s=1.0):
        """The meaningful lines of the tail (separator lines dropped). Waits up to `wait_s` for
        the end of the stream (ranks that outlive mpiexec may hold the pipe open)."""
        self.thread.join(wait_s)
        text = bytes(self.data).decode("utf-8", "replace")
        return [line.strip() for line in re.split(r"[\r\n]+", text)
                if line.strip() and line.strip().strip("-=*") != ""]


def failure_cause(lines):
    """One line naming why a job failed, from the last lines of its stderr: a known launcher
    message, else the last Python exception line (`ModuleNotFoundError: ...`), else None."""
    return permanent_cause(lines) or next(
        (line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), None)


def permanent_cause(lines):
    """The cause line when the stderr lines hold one of KNOWN_CAUSES (a failure that the same
    command in the same environment repeats: root without Open MPI's variables, too few slots,
    no such program or script), else None."""
    text = "\n".join(lines)
    for needle, cause in KNOWN_CAUSES:
        if needle in text:
            return cause or next(line for line in lines if needle in line)
    return None


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
    max_restarts, grace_s, early_failure_s (0: no early-failure detection), max_early_failures,
    backoff_s: see the module doc. mpiexec: argv prefix of the launcher (without -n). out: where
    the supervisor's own lines go; the job's stderr is copied to sys.stderr.
    Raises ConfigError for inconsistent numbers.
    """

    def __init__(self, command, *, n, min_ranks=1, max_ranks=None, max_restarts=3, grace_s=30.0,
                 hostfile=None, mpiexec=("mpiexec",), resume_flag="--resume", out=sys.stderr,
                 early_failure_s=60.0, max_early_failures=3, backoff_s=2.0):
        if not command:
            raise ConfigError("rtxmpi run: no command; use rtxmpi run -n N -- python train.py ...")
        if n < 1 or min_ranks < 1 or min_ranks > n or (max_ranks is not None and max_ranks < n):
            raise ConfigError(f"rtxmpi run: need 1 <= --min-ranks ({min_ranks}) <= -n ({n}) <= "
                              f"--max-ranks ({max_ranks if max_ranks is not None else n})")
        if max_restarts < 0 or not grace_s >= 0:
            raise ConfigError("rtxmpi run: --max-restarts and --grace-s must be >= 0")
        if not early_failure_s >= 0 or not backoff_s >= 0 or max_early_failures < 1:
            raise ConfigError(f"rtxmpi run: need --early-failure-s ({early_failure_s}) >= 0, "
                              f"--backoff-s ({backoff_s}) >= 0, --max-early-failures "
                              f"({max_early_failures}) >= 1")
        self.early_failure_s, self.max_early_failures = early_failure_s, max_early_failures
        self.backoff_s = backoff_s
        self.tail = []  # the last attempt's stderr lines
        self.command, self.n, self.min_ranks, self.max_ranks = list(command), n, min_ranks, max_ranks
        self.max_restarts, self.grace_s, self.hostfile = max_restarts, grace_s, hostfile
        self.mpiexec, self.resume_flag, self.out = list(mpiexec), resume_flag, out
        self.attempts = []  # (restart, ranks, exit status, seconds, what happened)
        self.process = None
        self.stop_signal = None
        self._stop_now = False  # a second SIGINT: SIGTERM to mpiexec without the grace period
        self.job_id = (os.environ.get("RTXMPI_JOB_ID") or os.environ.get("SLURM_JOB_ID")
                       or f"run-{socket.gethostname()}-{os.getpid()}-{int(time.time())}")
        self.reports = None  # the attempt's exit-report folder
        self.ended_finished = False  # the attempt's mpiexec was ended after the job finished

    def say(self, text):
        print(f"rtxmpi run: {text}", file=self.out, flush=True)

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        first = self.stop_signal is None
        if first:
            self.stop_signal = signum
        running = self.process is not None and self.process.poll() is None
        if running and first:
            forward = signal.SIGUSR2 if signum == signal.SIGINT else signal.SIGUSR1
            self.say(f"{signal.Signals(signum).name}: asking the ranks to stop ({forward.name} via "
                     f"mpiexec); SIGTERM in {self.grace_s:g} s"
                     + ("; Ctrl-C again: stop at once" if signum == signal.SIGINT else ""))
            self._send(forward)
        elif running and signum == signal.SIGINT:
            self.say("SIGINT again: SIGTERM to mpiexec now")
            self._stop_now = True

    def _send(self, signum, group=False):
        try:
            if group:
                os.killpg(self.process.pid, signum)
            else:
                self.process.send_signal(signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _wait(self):
        """Wait for the attempt; enforce the grace period after a forwarded stop, and end a
        finished job's mpiexec that still waits for an evicted process."""
        escalated = killed = finished_at = None
        polls = 0
        self._stop_now = False
        while True:
            try:
                return self.process.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if killed is not None:
                if now >= killed:
                    self._send(signal.SIGKILL, group=True)
                continue
            polls += 1
            if self.stop_signal is None and self.reports and polls % 5 == 0:
                if finished_at is None and exitreport.finished(self.reports):
                    finished_at = now
                if finished_at is not None and now >= finished_at + FINISHED_GRACE_S:
                    self.say(f"every rank finished or was evicted, yet mpiexec still runs "
                             f"{FINISHED_GRACE_S:g} s later (waiting for an evicted rank's process "
                             f"that no survivor could end): SIGTERM to mpiexec")
                    self._send(signal.SIGTERM)
                    self.ended_finished, killed = True, now + KILL_AFTER_S
                continue
            if self.stop_signal is None:
                continue
            escalated = now if self._stop_now and killed is None else escalated or now + self.grace_s
            if killed is None and now >= escalated:
                if not self._stop_now:  # a second SIGINT said so already
                    self.say(f"grace period of {self.grace_s:g} s over: SIGTERM to mpiexec")
                self._send(signal.SIGTERM)
                killed = now + KILL_AFTER_S

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

    def _sleep(self, seconds):
        """Wait `seconds`; False as soon as a stop signal arrives."""
        deadline = time.monotonic() + seconds
        while self.stop_signal is None and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return self.stop_signal is None

    def _run(self):
        restart, status, early_in_a_row = 0, 1, 0
        while True:
            ranks = launch_size(self.n, hostfile=self.hostfile, max_ranks=self.max_ranks)
            if ranks < self.min_ranks:
                self.say(f"only {ranks} rank{'' if ranks == 1 else 's'} available (--min-ranks {self.min_ranks}): giving up")
                break
            argv = self.argv(ranks, restart)
            self.say(f"attempt {restart + 1}: {shlex.join(argv)}")
            reports = tempfile.mkdtemp(prefix="rtxmpi-exit-")  # exitreport: how the ranks ended
            env = dict(os.environ, RTXMPI_RESTART=str(restart), RTXMPI_JOB_ID=self.job_id,
                       **{exitreport.ENV: reports})
            start = time.monotonic()
            try:
                self.process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE,
                                                preexec_fn=_detach_but_follow_parent)
            except OSError as exc:  # no such launcher: no relaunch can help
                shutil.rmtree(reports, ignore_errors=True)
                status, self.tail = 127, [f"cannot start {argv[0]}: {exc.strerror}"]
                self.attempts.append((restart, ranks, status, 0.0, "launcher not started"))
                self.say(f"{self.tail[0]}; check --mpiexec: giving up")
                break
            tail = StderrTail(self.process.stderr, sys.stderr)
            self.reports, self.ended_finished = reports, False
            status = self._wait()
            if self.ended_finished:
                status = 0  # done by the reports; mpiexec's status is that of our SIGTERM
            seconds = time.monotonic() - start
            self.process = None
            self.tail = tail.lines()
            status, note = exitreport.reconcile(status, reports)
            progressed = exitreport.progressed(reports)
            shutil.rmtree(reports, ignore_errors=True)
            if note:
                self.say(note)
            failed = (status not in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED, EXIT_CONFIG, EXIT_DIVERGED)
                      and self.stop_signal is None)
            early = (failed and not progressed and seconds < self.early_failure_s)
            early_in_a_row = early_in_a_row + 1 if early else 0
            what = ("done" if status == 0 else "pre-empted (checkpoint committed)"
                    if status == EXIT_PREEMPTED else "interrupted by Ctrl-C (checkpoint committed)"
                    if status == EXIT_INTERRUPTED else "bad flags or arguments: not relaunched"
                    if status == EXIT_CONFIG else "diverged: not relaunched"
                    if status == EXIT_DIVERGED
                    else "stopped by a signal" if self.stop_signal is not None
                    else f"failed early (exit status {status}, no training step done)" if early
                    else f"failed (exit status {status})")
            permanent = permanent_cause(self.tail) if early else None
            if permanent:
                what += ": a known permanent cause, not relaunched"
            self.attempts.append((restart, ranks, status, seconds, what))
            if not failed:
                break
            if permanent:
                self.say(f"giving up at once: {permanent}; a relaunch would fail the same way")
                break
            if early_in_a_row >= self.max_early_failures:
                self.say(f"giving up: {early_in_a_row} launches in a row failed within "
                         f"{self.early_failure_s:g} s without completing a training step "
                         f"(--max-early-failures {self.max_early_failures}); relaunching cannot "
                         f"help: fix the command or its environment")
                break
            if restart >= self.max_restarts:
                self.say(f"giving up: the job failed {restart + 1} time{'' if restart == 0 else 's'} "
                         f"(--max-restarts {self.max_restarts})")
                break
            restart += 1
            if early:
                wait_s = min(self.backoff_s * 2 ** (early_in_a_row - 1), BACKOFF_MAX_S)
                cause = failure_cause(self.tail)
                self.say(f"attempt {restart} {what}{f': {cause}' if cause else ''}; waiting "
                         f"{wait_s:g} s before relaunching")
                if not self._sleep(wait_s):
                    break  # a signal arrived while waiting: nothing is running, stop here
            else:
                self.say(f"attempt {restart} {what}; relaunching from the latest committed "
                         f"checkpoint")
        self.summary(status)
        if self.stop_signal is not None and status not in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED):
            return 128 + self.stop_signal
        return status

    def summary(self, status=0):
        """Every attempt; after a failure also its cause and the last lines of its stderr."""
        self.say("summary")
        for restart, ranks, code, seconds, what in self.attempts:
            print(f"  attempt {restart + 1}: {ranks} rank{'' if ranks == 1 else 's'}, exit {code}, {seconds:.1f} s, {what}",
                  file=self.out, flush=True)
        if status in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED) or not self.attempts or not self.tail:
            return
        cause = failure_cause(self.tail)
        lines = ([f"  cause: {cause}"] if cause else []) + ["  last stderr lines of the job:"]
        lines += [f"    {line}" for line in self.tail[-TAIL_LINES:]]
        print("\n".join(lines), file=self.out, flush=True)
