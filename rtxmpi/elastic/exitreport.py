"""Exit reports: each rank process tells `rtxmpi run` how it ended, so a launcher's exit status of
0 is not taken for a finished job when it is not one.

prterun exits 0 when it loses a node's daemon (measured with two network-namespace nodes, with or
without ULFM: the job is torn down mid-run, status 0), and in ULFM mode its status is no failure
signal at all (docs/elastic.md). So for each attempt the supervisor sets $RTXMPI_EXIT_DIR to an
empty folder; `elastic.exit_after` (every rank of a training script) writes `start.<pid>` when it
begins and `exit.<pid>` holding its exit code when it ends. After mpiexec returns 0: some rank
wrote exit code 0 -> done; ranks started but none ended with 0 -> a failure (relaunch). A command
that writes no reports (not an rtxmpi program, or all its ranks on hosts that cannot see the
folder) is judged by mpiexec's status alone, as before.

Evicted ranks: after a shrink, the survivors' rank 0 writes `evicted.<pid>` for each rank process
the shrink left out (elastic.loop). When every process that started has ended (an exit report)
or was evicted, and one ended with 0, the job is done even if mpiexec still waits: a stopped
process on a node without survivors is not ended by them (docs/elastic.md); `finished()` tells
the supervisor so, and it ends mpiexec.

Progress: the first training step a rank process completes writes `progress.<pid>` (`progress()`,
called by elastic.Loop.applied), so the supervisor can tell a launch that fails before doing any
work (a typo in the script, an environment problem: relaunching cannot help) from a failure in
the middle of training.
"""
import os

ENV = "RTXMPI_EXIT_DIR"


def mark(kind, code=None, environ=os.environ, pid=None):
    """Write report `kind` ("start" or "exit", with its code) of this process, or "evicted" of
    process `pid`; never raises."""
    folder = environ.get(ENV)
    if not folder:
        return
    try:
        with open(os.path.join(folder, f"{kind}.{pid or os.getpid()}"), "w") as f:
            f.write("" if code is None else str(code))
    except OSError:
        pass  # a host that cannot see the folder: the reports of the others decide


_progress_marked = False


def progress(environ=os.environ):
    """This process completed a training step: write `progress.<pid>` once (later calls do
    nothing, so it is free to call every step); never raises."""
    global _progress_marked
    if not _progress_marked:
        _progress_marked = True
        mark("progress", environ=environ)


def progressed(folder):
    """True when some rank process of the attempt wrote a progress report to `folder`."""
    try:
        return any(name.startswith("progress.") for name in os.listdir(folder))
    except OSError:
        return False


def finished(folder):
    """True when the reports in `folder` say the job is done: some rank process exited 0 and
    every process that started either wrote its exit report or was evicted."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    started = {n.split(".", 1)[1] for n in names if n.startswith("start.")}
    ended = {n.split(".", 1)[1] for n in names if n.startswith(("exit.", "evicted."))}
    if not started or not started <= ended:
        return False
    for name in names:
        if name.startswith("exit."):
            try:
                with open(os.path.join(folder, name)) as f:
                    if f.read().strip() == "0":
                        return True
            except OSError:
                continue
    return False


def reconcile(status, folder):
    """The attempt's status given mpiexec's `status` and the reports in `folder`.

    Returns (status, note): note is None when the status stands, else a one-line reason why a
    0 became a failure (status 1). Non-zero statuses are returned unchanged.
    """
    if status != 0:
        return status, None
    try:
        names = os.listdir(folder)
    except OSError:
        return status, None
    started = [n for n in names if n.startswith("start.")]
    codes = []
    for name in names:
        if name.startswith("exit."):
            try:
                with open(os.path.join(folder, name)) as f:
                    codes.append(f.read().strip())
            except OSError:
                continue
    if not started or "0" in codes:
        return status, None
    return 1, (f"mpiexec exited 0 but none of the {len(started)} rank process(es) that reported "
               f"finished (exit codes {sorted(codes) or 'none'}): a node or its daemon was lost")
