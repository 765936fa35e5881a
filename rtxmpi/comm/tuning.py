"""Online choice among the algorithms of one collective, from times measured during the run.

The cross-memory all_reduce of one node has two algorithms with bitwise the same result
(shm.py): the system calls, which let each rank fold its segment while its peers are
descheduled, and the bounce through shared slots, pipelined in rounds that need every rank
running at once. Which is faster depends on where the host runs the ranks' CPUs, which can
change during a run and which no rank can see (two vCPUs of a virtual machine on one physical
core read as two CPUs). So one rank measures them and picks, per message size
class, as STAR-MPI does for MPI's collectives (Faraj, Yuan and Lowenthal, "STAR-MPI: self tuned
adaptive routines for MPI collective operations", ICS 2006): explore each algorithm for a few
calls, use the fastest, and check the others now and then, less often while they keep losing,
and at once when the chosen one has become slower than another was.
"""
import statistics

TRIALS = 5  # samples of each algorithm before choosing, and the window of each one's times
RECHECK = 32  # calls between checks of another algorithm, after a choice
MAX_RECHECK = 1024  # the interval doubles while the checks confirm the choice, up to this
MARGIN = 0.95  # another algorithm wins when its median is below this times the chosen one's
MAX_PATIENCE = RECHECK  # calls before a check for a slowdown, doubling from TRIALS while they lose


class _Class:
    __slots__ = ("samples", "chosen", "calls", "interval", "due", "turn", "trial", "periodic",
                 "patience")

    def __init__(self, choices):
        self.samples = {a: [] for a in choices}  # the last TRIALS seconds of each algorithm
        self.chosen = None  # None: exploring
        self.calls = 0  # calls of the chosen one since the choice or the last check
        self.interval = RECHECK
        self.due = None  # an algorithm to check at the next call (the chosen one slowed down)
        self.turn = 0  # which of the others the next periodic check runs
        self.trial = None  # the algorithm whose check beat the chosen median: TRIALS calls
        self.periodic = False  # the check under way is the periodic one (not `due`)
        self.patience = TRIALS  # calls of the chosen one before a check for a slowdown


class OnlineChoice:
    """Pick one of a few algorithms (small ints) for each message size class (byte counts of
    the same bit length, i.e. between consecutive powers of two) and set of choices, from the
    seconds each call took.

    Exploring, pick() returns the algorithm with the fewest samples (the first of `choices` on
    a tie) until each has TRIALS; the one with the lowest median is chosen. Then every
    `interval` calls (RECHECK at first) pick() returns one of the others (in turn), once. If that
    call was slower than the chosen one's median, or the trial it then starts loses, the
    interval doubles, up to MAX_RECHECK. The trial is TRIALS calls in a row; the other becomes
    the choice if their median is below MARGIN times the chosen one's (one fast call is too
    often noise). And once `patience` calls (TRIALS at first) of the chosen one have run since
    the last check and their median is above another's over MARGIN, that other one is checked at
    the next call (the host changed); each such check that loses doubles the patience, up to
    MAX_PATIENCE (two algorithms within noise of each other would otherwise trade checks all the
    time), and a new choice resets it. One choice: pick() returns it. record() takes the
    algorithm that ran; a caller that may fall back to another records only the calls that ran
    the pick (a fallback would count as a check). Local: one rank decides, and the caller makes
    the others follow.
    """

    def __init__(self):
        self._classes = {}

    def _class(self, nbytes, choices):
        key = (int(nbytes).bit_length(), choices)
        entry = self._classes.get(key)
        if entry is None:
            entry = self._classes[key] = _Class(choices)
        return entry

    def pick(self, nbytes, choices):
        """The algorithm (one of the tuple `choices`, fixed for a size) to run for `nbytes`."""
        if len(choices) == 1:
            return choices[0]
        entry = self._class(nbytes, choices)
        if entry.chosen is None:
            return min(choices, key=lambda a: len(entry.samples[a]))
        if entry.trial is not None:
            return entry.trial
        if entry.due is not None:
            return entry.due
        if entry.calls >= entry.interval:
            others = [a for a in choices if a != entry.chosen]
            return others[entry.turn % len(others)]
        return entry.chosen

    def record(self, nbytes, choices, algorithm, seconds):
        """The call of `nbytes` bytes (with `choices`, as picked) ran `algorithm` in `seconds`."""
        entry = self._class(nbytes, choices)
        samples = entry.samples[algorithm]
        if entry.chosen is not None and algorithm != entry.chosen and entry.trial is None:
            del samples[:]  # a check: the older times are from before whatever changed
        samples.append(seconds)
        del samples[:-TRIALS]
        if entry.chosen is None:
            if min(len(s) for s in entry.samples.values()) >= TRIALS:
                entry.chosen = min(choices, key=lambda a: statistics.median(entry.samples[a]))
                entry.calls, entry.interval = 0, RECHECK
            return
        chosen = statistics.median(entry.samples[entry.chosen])
        if algorithm == entry.chosen:
            entry.calls += 1
            if entry.due is None and entry.trial is None and entry.calls >= entry.patience:
                times = {a: statistics.median(s) for a, s in entry.samples.items()
                         if a != algorithm and s}
                best = min(times, key=times.get, default=None)
                if best is not None and times[best] < MARGIN * chosen:
                    entry.due = best
            return
        if entry.trial is None:  # the first call of a check
            entry.periodic, entry.due, entry.calls = entry.due is None, None, 0
            if seconds >= chosen:
                self._keep(entry)
                return
            entry.trial = algorithm
        if len(samples) < TRIALS:
            return
        entry.trial = None
        if statistics.median(samples) < MARGIN * chosen:
            entry.chosen, entry.interval, entry.patience = algorithm, RECHECK, TRIALS
        else:
            self._keep(entry)

    @staticmethod
    def _keep(entry):
        """A check lost: the next one of its kind comes later (the periodic one checks the next
        other algorithm)."""
        if entry.periodic:
            entry.turn += 1
            entry.interval = min(2 * entry.interval, MAX_RECHECK)
        else:
            entry.patience = min(2 * entry.patience, MAX_PATIENCE)

    def exploring(self):
        """Whether some size class seen so far has not chosen yet."""
        return any(entry.chosen is None for entry in self._classes.values())

    def chosen(self, nbytes, choices):
        """The algorithm chosen for `nbytes`' class with `choices`, or None while it explores."""
        entry = self._classes.get((int(nbytes).bit_length(), choices))
        return None if entry is None else entry.chosen
