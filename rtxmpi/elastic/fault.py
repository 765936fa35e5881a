"""Fault injection for tests and the chaos suite: make one rank fail at a chosen step and phase.

    RTXMPI_FAULT="kill:2:7:backward:0.005"     # rank 2 is SIGKILLed 5 ms into step 7's backward

Spec: `ACTION:RANK:STEP[:PHASE[:SECONDS]]`, several separated by `,`. RANK is the launch rank
(MPI_COMM_WORLD rank, stable across shrinks); PHASE one of `elastic.PHASES` (default forward).
ACTION: `kill` (SIGKILL: a crash), `exit` (os._exit(1) without MPI_Finalize), `term` / `usr1`
/ `int` (deliver SIGTERM / SIGUSR1 to this process, as a scheduler would, or SIGINT, as a Ctrl-C
reaching one rank), `stop` (SIGSTOP: every thread of the process frozen, as by a debugger or a
frozen container), each SECONDS after the phase
starts (default 0; from a timer thread, so it lands inside the phase); `stall` (sleep SECONDS,
default 3600, in the phase: alive but making no progress). A fault fires at most once per
process, and only in the first launch (not when $RTXMPI_RESTART > 0, set by `rtxmpi run`).
"""
import os
import signal
import threading
import time

from ..errors import ConfigError

ACTIONS = ("kill", "exit", "term", "usr1", "int", "stop", "stall")
SIGNALS = {"term": signal.SIGTERM, "usr1": signal.SIGUSR1, "int": signal.SIGINT}


class Fault:
    __slots__ = ("action", "rank", "step", "phase", "seconds", "fired")

    def __init__(self, action, rank, step, phase, seconds):
        self.action, self.rank, self.step, self.phase = action, rank, step, phase
        self.seconds, self.fired = seconds, False

    def __repr__(self):
        return f"{self.action}:{self.rank}:{self.step}:{self.phase}:{self.seconds:g}"


def parse_faults(spec, phases):
    """Parse a RTXMPI_FAULT spec into a list of Fault; raises ConfigError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        fields = part.split(":")
        try:
            if not 3 <= len(fields) <= 5 or fields[0] not in ACTIONS:
                raise ValueError
            phase = fields[3] if len(fields) > 3 and fields[3] else "forward"
            if phase not in phases:
                raise ValueError
            default = 3600.0 if fields[0] == "stall" else 0.0
            seconds = float(fields[4]) if len(fields) > 4 else default
            faults.append(Fault(fields[0], int(fields[1]), int(fields[2]), phase, seconds))
        except ValueError:
            raise ConfigError(f"RTXMPI_FAULT part {part!r}: expected ACTION:RANK:STEP[:PHASE[:SECONDS]] "
                              f"with ACTION in {ACTIONS} and PHASE in {tuple(phases)}") from None
    return faults


def _act(action, where=""):
    os.write(2, f"[rtxmpi fault] {action} {where} pid={os.getpid()} t={time.time():.6f}\n".encode())
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "exit":
        os._exit(1)
    elif action in SIGNALS:
        os.kill(os.getpid(), SIGNALS[action])


class FaultPlan:
    """The faults of this process (launch rank `rank`), checked at every phase change."""

    def __init__(self, rank, phases, spec=None):
        spec = os.environ.get("RTXMPI_FAULT", "") if spec is None else spec
        first_launch = os.environ.get("RTXMPI_RESTART", "0") in ("", "0")
        self.faults = [f for f in parse_faults(spec, phases) if f.rank == rank] if first_launch else []

    def at(self, phase, step):
        for f in self.faults:
            if f.fired or f.step != step or f.phase != phase:
                continue
            f.fired = True
            where = f"launch rank {f.rank} step {step} phase {phase}"
            if f.action == "stall":
                os.write(2, f"[rtxmpi fault] stall {where} for {f.seconds:g} s\n".encode())
                time.sleep(f.seconds)
            elif f.seconds > 0:
                timer = threading.Timer(f.seconds, _act, args=(f.action, where))
                timer.daemon = True
                timer.start()
            else:
                _act(f.action, where)
