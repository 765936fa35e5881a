"""The per-step metrics file: one strict JSON line per step, written by rank 0, continued by a
resume (the lines of steps a resume re-runs are dropped first, so each step is logged once)."""
import json
import math


def count(n, noun):
    """'1 step', '2 steps', '1 loss', '3 losses': a count and its noun, pluralized."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def logged_step(line):
    """The step of a metrics JSONL line, or None for a blank, cut or foreign line (rank 0 reads
    the file between collectives: it must not raise on a line a killed run left half written)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def drop_metrics_after(path, step):
    """After a resume (a checkpoint, or an elastic shrink that reloaded one) from `step` (rank 0;
    0: none found): remove the lines of later steps from the metrics file, which the run writes
    again, so each step is logged once (as the write-ahead log keeps only the records up to the
    checkpoint). In place: the run's append handle keeps writing at the new end."""
    with open(path, "r+") as f:  # a line that does not parse (cut by a kill) is kept as it is
        lines = [line for line in f if line.strip() and (logged_step(line) or 0) <= step]
        f.seek(0)
        f.writelines(lines)
        f.truncate()


def last_logged_step(path):
    """The step of the file's last parseable line, or None."""
    with open(path) as f:
        logged = [n for n in map(logged_step, f) if n is not None]
    return logged[-1] if logged else None


def metrics_line(record):
    """A step's JSONL line, strict JSON. A skipped step (the ranks agreed that some gradient was
    not finite) has grad_norm null: no rank's own norm describes a step that was not taken. A
    non-finite number (a diverged loss) is written as null."""
    record = {**record, "grad_norm": None} if record.get("skipped") else record
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in record.items()}, allow_nan=False) + "\n"
