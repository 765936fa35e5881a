"""Pre-emption and Ctrl-C: a signal sets a stop request; ranks agree on it at the next step boundary.

A scheduler announces the end of an allocation with a signal (Slurm: `--signal=B:USR1@60`, or TERM
under `srun`, with `KillWait` seconds before SIGKILL). Python runs a signal handler between
bytecodes, so a rank blocked in MPI sees it when the call returns; the handler therefore only sets
a flag. At the next step boundary every rank passes its flag to one agreed reduction
(`rtxmpi.control.agree`), so a signal that reached one rank stops all of them after the same step.
The training loop then writes one committed checkpoint and exits with `EXIT_PREEMPTED` (75, a
scheduler requeues), or with `EXIT_INTERRUPTED` (130 = 128 + SIGINT, the shell's code for
Ctrl-C; not requeued) when every signal was an interrupt: SIGINT, or SIGUSR2, which `rtxmpi run`
sends through mpiexec for a Ctrl-C (prterun kills the ranks on SIGINT: docs/elastic.md). A
second SIGINT ends the process at once (SIGINT's default action).
The handler's one line (STOP_NOTE) promises no checkpoint: SIGTERM is also what mpiexec sends
when it tears the whole job down (a rank died without ULFM, an abort), and SIGKILL follows before
any step boundary; only the loop's final line, once the stop completed, names the checkpoint.
"""
import os
import shutil
import signal
import subprocess
import sys

EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: stopped on request with a committed checkpoint; rerun to continue
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: stopped by Ctrl-C (with a committed checkpoint)
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGUSR2)
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1) + INTERRUPT_SIGNALS
# What the handler can promise: nothing is saved yet, and a launcher tearing the job down (mpiexec
# after a rank died without ULFM, or after a CollectiveTimeout's abort) sends the same SIGTERM
# moments before SIGKILL. The training loop's final line says which checkpoint was committed.
STOP_NOTE = ("stop requested; will stop at the next step boundary and checkpoint there (with a "
             "checkpoint directory), if the job is not killed first")


class StopRequest:
    """A flag set by SIGTERM / SIGUSR1 (pre-emption) or SIGINT / SIGUSR2 (interrupt) by default.

    Attributes: requested (bool), signal (the first signal number that set it, or None),
    preempted (bool: set by a signal not in INTERRUPT_SIGNALS, or by request()).
    install() replaces the handlers of `signals` (main thread only); uninstall() restores them.
    Local: no communication; agree on `requested` and `preempted` at a step boundary.
    """

    def __init__(self, signals=DEFAULT_SIGNALS):
        self.signals = tuple(signals)
        self.requested = False
        self.preempted = False
        self.signal = None
        self._previous = {}

    def install(self):
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:  # a second Ctrl-C: stop now, as users expect
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            return
        self.preempted = self.preempted or signum not in INTERRUPT_SIGNALS
        if not self.requested:
            self.requested, self.signal = True, signum
            again = " (Ctrl-C again: stop at once)" if signum == signal.SIGINT else ""
            os.write(2, f"[rtxmpi pid {os.getpid()}] {signal.Signals(signum).name}: "
                        f"{STOP_NOTE}{again}\n".encode())

    def request(self, signum=None):
        """Set the flag from code (e.g. a time budget); the same effect as a pre-emption signal."""
        self.requested, self.signal, self.preempted = True, signum, True


def requeue(job_id=None, scontrol="scontrol"):
    """Ask Slurm to requeue this job (`scontrol requeue $SLURM_JOB_ID`); one process calls it.

    job_id: default $SLURM_JOB_ID. Prints "requeue: asking Slurm to requeue job N" first (Slurm
    may cancel this very process as soon as the requeue takes effect, before scontrol returns),
    then returns a one-line message saying what happened; never raises (a pre-empted job exits
    with its exit code whether or not the requeue worked).
    """
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return "requeue: not running under Slurm (no SLURM_JOB_ID); not requeued"
    if shutil.which(scontrol) is None:
        return f"requeue: {scontrol} not found; job {job_id} not requeued"
    print(f"requeue: asking Slurm to requeue job {job_id}", flush=True)
    try:
        done = subprocess.run([scontrol, "requeue", str(job_id)], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"requeue: scontrol requeue {job_id} failed: {exc}"
    if done.returncode:
        return f"requeue: scontrol requeue {job_id} failed: {(done.stderr or done.stdout).strip()}"
    return f"requeue: job {job_id} requeued"


def exit_preempted(message=None):
    """Flush and exit with EXIT_PREEMPTED (every rank calls it after the agreed stop)."""
    if message:
        print(message, flush=True)
    sys.stdout.flush()
    sys.exit(EXIT_PREEMPTED)
