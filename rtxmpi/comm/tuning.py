"""Online choice between two algorithms of one collective, from times measured during the run.

The cross-memory all_reduce of one node has two algorithms with bitwise the same result
(shm.py): the system calls, which let each rank fold its segment while its peers are descheduled,
and the bounce through shared slots, pipelined in rounds that need every rank running at once.
Which is faster depends on where the host runs the ranks' CPUs, which can change during a run
and which no rank can see (two vCPUs of a virtual machine on one physical core read as two
CPUs). So one rank measures both and picks, per message size class, as STAR-MPI does for MPI's
collectives (Faraj, Yuan and Lowenthal, "STAR-MPI: self tuned adaptive routines for MPI
collective operations", ICS 2006): explore each algorithm for a few calls, use the faster, and
check the other now and then, less often while it keeps losing.
"""
import statistics

TRIALS = 5  # samples of each algorithm before choosing, and the window of the chosen one
RECHECK = 32  # calls between checks of the other algorithm, after a choice
MAX_RECHECK = 1024  # the interval doubles while the checks confirm the choice, up to this
MARGIN = 0.85  # a check reopens the choice when it took less than this times the chosen median


class _Class:
    __slots__ = ("samples", "chosen", "calls", "interval")

    def __init__(self):
        self.samples = ([], [])  # the last TRIALS seconds of algorithm 0 and 1
        self.chosen = None  # None: exploring
        self.calls = 0  # calls since the choice or the last check
        self.interval = RECHECK


class OnlineChoice:
    """Pick algorithm 0 or 1 for each message size class (byte counts of the same bit length,
    i.e. between consecutive powers of two), from the seconds each call took.

    Exploring, pick() returns the algorithm with fewer samples until each has TRIALS; the one
    with the lower median is chosen. Then every `interval` calls (RECHECK at first) pick()
    returns the other once: if that call took less than MARGIN times the chosen one's median,
    the class explores again (the margin keeps two equally fast algorithms from trading places
    on noise); otherwise the interval doubles, up to MAX_RECHECK. record() takes the algorithm
    that ran; a caller that may fall back to another records only the calls that ran the pick
    (a fallback would count as the check). Local: one rank decides, and the caller makes the
    others follow.
    """

    def __init__(self):
        self._classes = {}

    def _class(self, nbytes):
        key = int(nbytes).bit_length()
        entry = self._classes.get(key)
        if entry is None:
            entry = self._classes[key] = _Class()
        return entry

    def pick(self, nbytes):
        """0 or 1: the algorithm to run for a message of `nbytes` bytes."""
        entry = self._class(nbytes)
        if entry.chosen is None:
            return 0 if len(entry.samples[0]) <= len(entry.samples[1]) else 1
        if entry.calls >= entry.interval:
            return 1 - entry.chosen
        return entry.chosen

    def record(self, nbytes, algorithm, seconds):
        """The call of `nbytes` bytes ran `algorithm` (0 or 1) in `seconds`."""
        entry = self._class(nbytes)
        samples = entry.samples[algorithm]
        samples.append(seconds)
        del samples[:-TRIALS]
        if entry.chosen is None:
            if min(len(s) for s in entry.samples) >= TRIALS:
                medians = [statistics.median(s) for s in entry.samples]
                entry.chosen = 0 if medians[0] <= medians[1] else 1
                entry.calls, entry.interval = 0, RECHECK
            return
        if algorithm == entry.chosen:
            entry.calls += 1
            return
        entry.calls = 0  # the check of the other algorithm
        if seconds < MARGIN * statistics.median(entry.samples[entry.chosen]):
            entry.chosen = None  # it may have become faster: measure both again
            del entry.samples[1 - algorithm][:]
            del samples[:-1]
        else:
            entry.interval = min(2 * entry.interval, MAX_RECHECK)

    def chosen(self, nbytes):
        """The algorithm chosen for `nbytes`' class, or None while it explores (reports)."""
        entry = self._classes.get(int(nbytes).bit_length())
        return None if entry is None else entry.chosen
