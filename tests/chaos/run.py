"""Chaos suite: seeded random failures of examples/train.py; every run must end well.

    python tests/chaos/run.py                     # the CI set: 5 scenarios, seed 0
    python tests/chaos/run.py --scenarios 40 --seed 7 --keep /tmp/chaos

Each scenario launches a real job under a hard outer timeout with a fault injected through
RTXMPI_FAULT (rtxmpi/elastic/fault.py) at a random step, phase, delay and victim rank:

  shrink   a rank is SIGKILLed (forward, backward or while a checkpoint is written) under
           --elastic shrink with ULFM: the job must finish on 3 ranks with every step 1..N
           logged once and a final checkpoint of 3 ranks;
  sigterm  SIGTERM to one rank: exit 75, the committed checkpoint is of the step every rank
           stopped at, and --resume finishes with steps 1..N each once;
  stuck    one rank stalls in a phase with --stuck-timeout-s under shrink: it is reported with
           its phase and step, evicted, and the job finishes on 3 ranks;
  restart  a rank is SIGKILLed without ULFM under `rtxmpi run --max-restarts 2`: the relaunch
           resumes from the last committed checkpoint and finishes;
  crash    a rank is SIGKILLed with --elastic off: the job must end non-zero (no hang) with the
           last committed checkpoint intact (checksums verified);
  shrink2  two ranks die at different steps (--min-ranks 2): 4 -> 3 -> 2 ranks, as for shrink;
  hybrid   as shrink, with --tp 2 --dp 2, --pp 2 --dp 2 or --pp 2 --tp 2 (a random one): the
           survivors re-plan the layout for 3 ranks and rebuild the model from the surviving
           shards or the last checkpoint (docs/elastic.md, "Hybrid layouts");
  stopped  a rank is SIGSTOPped (forward, backward or save) under shrink with --stuck-timeout-s:
           it is reported with its phase and step and stopped heartbeats, SIGKILLed by its node's
           survivors, and the job finishes on 3 ranks (mpiexec exits: no rank left stopped).
           hybrid and stopped are not in the CI set (the first 5 kinds): --kinds hybrid,stopped.
  grow     a rank is SIGKILLed under --elastic grow (--deterministic), and in half of the
           scenarios a survivor too, while the replica is handed to the replacement: the job
           must finish back at 4 ranks, every step once, from memory (no checkpoint reloaded),
           with the losses and final state bitwise those of the run that lost no rank.
           Not in the CI set either: --kinds grow.
  spawn    as grow, and a survivor is SIGKILLed in the spawn phase (0-1 s in: before
           MPI_Comm_spawn, inside it or in the merge after it): no hang; the job finishes at 4
           ranks, or the spawn watchdog (exit 5) or a crash of the launcher ends it and a
           relaunch with --resume (as `rtxmpi run` does) finishes it; either way every step once
           and the final state bitwise the run that lost no rank.
           Not in the CI set: --kinds spawn.
  join     a 2-rank --elastic grow job is asked (rtxmpi.elastic.admit, as `rtxmpi join` does) for
           1 or 2 more ranks during a stall of rank 0 at a random step; in a third of the
           scenarios a member is killed while the state is handed to the new ranks, in another
           third a member dies two steps after the join: the job must answer "admitted", finish
           at 2 + K ranks with every step once (steps up to the join at 2 ranks, the rest at
           2 + K) and never reload a checkpoint. --kinds join.

Prints one line per scenario and `chaos: N scenarios tried, M passed`; exits 1 if any failed.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}") or "mpiexec"
LAUNCH = [MPIEXEC, "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "--bind-to", "none"]
ULFM = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca",
        "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "10"]
STEPS, CKPT_EVERY = 12, 4
ARGS = ["--model", "tiny", "--global-batch", "12", "--seq-len", "32", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--steps", str(STEPS),
        "--ckpt-every", str(CKPT_EVERY)]
KINDS = ("shrink", "sigterm", "stuck", "restart", "crash", "shrink2", "hybrid", "stopped", "grow",
         "join", "spawn")
RECOVERABLE = ["--prtemca", "state_base_recoverable", "1"]  # the replacements' job (docs/elastic.md)
HYBRID = (["--tp", "2", "--dp", "2"], ["--pp", "2", "--dp", "2", "--micro-batches", "2"],
          ["--pp", "2", "--tp", "2", "--micro-batches", "2"])
OUTER_TIMEOUT_S = 120
LOG = {"path": None}  # the current scenario's log file: every command with its output


def env(**extra):
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLURM_", "RTXMPI_"))}
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1", RTXMPI_TIMEOUT_S="30",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if os.environ.get("RTXMPI_CACHE_DIR"):
        e["RTXMPI_CACHE_DIR"] = os.environ["RTXMPI_CACHE_DIR"]
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run(argv, **extra):
    argv = ["timeout", "--kill-after=5", str(OUTER_TIMEOUT_S)] + [str(a) for a in argv]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=env(**extra),
                          start_new_session=True)
    if LOG["path"]:
        with open(LOG["path"], "a") as f:
            f.write(f"$ {extra} {' '.join(argv)}\nexit {done.returncode}\n--- stdout\n{done.stdout}"
                    f"\n--- stderr\n{done.stderr}\n")
    return done, time.monotonic() - start


def steps_logged(folder):
    path = folder / "m.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def latest(ckpt):
    from rtxmpi.checkpoint import latest_step
    return latest_step(ckpt)


def check_final(folder, world_size):
    """Steps 1..STEPS each once in the metrics, final checkpoint at STEPS of `world_size` ranks
    whose checksums verify. Returns None or what is wrong."""
    from rtxmpi.checkpoint import load_checkpoint, verify_checkpoint
    from rtxmpi.errors import CheckpointError
    steps = [r["step"] for r in steps_logged(folder)]
    if steps != list(range(1, STEPS + 1)):
        return f"steps logged {steps}"
    if latest(folder / "ckpt") != STEPS:
        return f"latest checkpoint {latest(folder / 'ckpt')} != {STEPS}"
    ckpt = load_checkpoint(None, folder / "ckpt", STEPS)
    if ckpt.world_size_saved != world_size:
        return f"final checkpoint of {ckpt.world_size_saved} ranks, expected {world_size}"
    try:
        verify_checkpoint(folder / "ckpt", STEPS)
    except CheckpointError as exc:
        return f"verify: {exc}"
    return None


def train_argv(folder, n, *extra, ulfm=False, prte=()):
    launch = LAUNCH[:1] + (ULFM if ulfm else []) + list(prte) + LAUNCH[1:]
    return launch + ["-n", n, sys.executable, TRAIN, *ARGS, "--ckpt-dir", folder / "ckpt",
                     "--metrics-jsonl", folder / "m.jsonl", *extra]


def grow_reference(root):
    """The uninterrupted deterministic 4-rank run the grow scenarios must equal (made once)."""
    folder = root / "grow-reference"
    if not (folder / "m.jsonl").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        done, t = run(train_argv(folder, 4, "--deterministic", ulfm=True, prte=RECOVERABLE))
        if done.returncode != 0:
            raise RuntimeError(f"the grow reference run failed: {done.stderr[-600:]}")
    return folder


def same_run(folder, reference):
    """None when the losses and the final checkpoint's state equal the reference's bit for bit."""
    import numpy as np
    from rtxmpi.checkpoint import load_checkpoint
    if [r["loss"] for r in steps_logged(folder)] != [r["loss"] for r in steps_logged(reference)]:
        return "losses differ from the run that lost no rank"
    got, want = (load_checkpoint(None, f / "ckpt", STEPS) for f in (folder, reference))
    for name in ("params", "adam.m", "adam.v", "adam.step"):
        if not np.array_equal(got.read(name), want.read(name)):
            return f"final {name} differs from the run that lost no rank"
    return None


def scenario(kind, rng, folder):
    """Run one scenario; returns (description, None when it passed else what went wrong)."""
    victim = rng.randrange(4 if kind in ("shrink", "stuck", "hybrid", "stopped", "grow", "spawn") else 2)
    step = rng.randrange(2, STEPS - 1)
    phase = rng.choice(["forward", "backward", "save"]) if kind != "stuck" else rng.choice(
        ["forward", "backward"])
    if phase == "save":
        step = rng.choice([s for s in range(CKPT_EVERY, STEPS, CKPT_EVERY)])
    delay = round(rng.uniform(0, 0.01), 4)
    if kind == "shrink":
        fault = f"kill:{victim}:{step}:{phase}:{delay}"
        done, t = run(train_argv(folder, 4, "--elastic", "shrink", ulfm=True), RTXMPI_FAULT=fault)
        if done.returncode != 0:
            return fault, f"exit {done.returncode}: {done.stderr[-600:]}"
        if "shrank the world 4 -> 3" not in done.stderr:
            return fault, "no shrink reported"
        return fault, check_final(folder, 3)
    if kind == "sigterm":
        fault = f"term:{victim}:{step}:{phase if phase != 'save' else 'backward'}:{delay}"
        done, t = run(train_argv(folder, 2), RTXMPI_FAULT=fault)
        if done.returncode != 75:
            return fault, f"exit {done.returncode}, expected 75: {done.stderr[-600:]}"
        stopped = steps_logged(folder)[-1]["step"]
        if latest(folder / "ckpt") != stopped:
            return fault, f"latest checkpoint {latest(folder / 'ckpt')} != stopped step {stopped}"
        done, t = run(train_argv(folder, 2, "--resume"))
        if done.returncode != 0:
            return fault, f"resume exit {done.returncode}: {done.stderr[-600:]}"
        return fault, check_final(folder, 2)
    if kind == "stuck":
        fault = f"stall:{victim}:{step}:{phase}:600"
        done, t = run(train_argv(folder, 4, "--elastic", "shrink", "--stuck-timeout-s", "5",
                                 ulfm=True), RTXMPI_FAULT=fault)
        if done.returncode != 0:
            return fault, f"exit {done.returncode}: {done.stderr[-600:]}"
        if f"last in phase '{phase}' of step {step}" not in done.stderr:
            return fault, "the stuck rank was not reported with its phase and step"
        return fault, check_final(folder, 3)
    if kind == "stopped":
        fault = f"stop:{victim}:{step}:{phase}"  # at the phase's start: its marker is known
        done, t = run(train_argv(folder, 4, "--elastic", "shrink", "--stuck-timeout-s", "5",
                                 ulfm=True), RTXMPI_FAULT=fault)
        if done.returncode != 0:
            return fault, f"exit {done.returncode}: {done.stderr[-600:]}"
        report = f"rank {victim}: last in phase '{phase}' of step {step}; its heartbeats stopped"
        if report not in done.stderr:
            return fault, "the stopped rank was not reported with its phase, step and stopped heartbeats"
        if f"elastic: rank {victim}'s process" not in done.stderr:
            return fault, "the stopped process was not ended by its node's survivors"
        return fault, check_final(folder, 3)
    if kind == "restart":
        fault = f"kill:{victim}:{step}:{phase}:{delay}"
        supervisor = [sys.executable, "-m", "rtxmpi.cli", "run", "-n", "2", "--max-restarts", "2",
                      "--mpiexec", " ".join(LAUNCH), "--"]
        command = train_argv(folder, 2)[len(LAUNCH) + 2:]
        done, t = run(supervisor + command, RTXMPI_FAULT=fault)
        if done.returncode != 0:
            return fault, f"exit {done.returncode}: {done.stderr[-600:]}"
        if "attempt 2:" not in done.stderr:
            return fault, "no relaunch"
        logged = [r["step"] for r in steps_logged(folder)]
        if sorted(set(logged)) != list(range(1, STEPS + 1)):
            return fault, f"steps logged {logged}"
        (folder / "m.jsonl").write_text("".join(  # re-run steps after the checkpoint: keep last
            json.dumps(r) + "\n" for r in {r["step"]: r for r in steps_logged(folder)}.values()))
        return fault, check_final(folder, 2)
    if kind == "crash":
        from rtxmpi.checkpoint import verify_checkpoint
        from rtxmpi.errors import CheckpointError
        fault = f"kill:{victim}:{step}:{phase}:{delay}"
        done, t = run(train_argv(folder, 2), RTXMPI_FAULT=fault)
        if done.returncode == 0 or done.returncode == 124:
            return fault, f"exit {done.returncode}: expected a non-zero exit, not a hang"
        last = latest(folder / "ckpt")
        if last is not None:
            try:
                verify_checkpoint(folder / "ckpt", last)
            except CheckpointError as exc:
                return fault, f"last committed checkpoint {last} does not verify: {exc}"
        return fault, None
    if kind == "shrink2":
        first, second = rng.sample(range(4), 2)
        later = rng.randrange(step + 1, STEPS)
        fault = f"kill:{first}:{step}:{phase}:{delay},kill:{second}:{later}:forward"
        done, t = run(train_argv(folder, 4, "--elastic", "shrink", "--min-ranks", "2", ulfm=True),
                      RTXMPI_FAULT=fault)
        if done.returncode != 0:
            return fault, f"exit {done.returncode}: {done.stderr[-600:]}"
        if "shrank the world 3 -> 2" not in done.stderr:
            return fault, "no second shrink reported"
        return fault, check_final(folder, 2)
    if kind == "hybrid":
        layout = rng.choice(HYBRID)
        if "--pp" in layout and phase == "backward":
            phase = "forward"  # a pipeline step runs inside the forward phase (train_step)
        fault = f"kill:{victim}:{step}:{phase}:{delay}"
        done, t = run(train_argv(folder, 4, "--elastic", "shrink", *layout, ulfm=True),
                      RTXMPI_FAULT=fault)
        what = f"{' '.join(layout[:4])} {fault}"
        if done.returncode != 0:
            return what, f"exit {done.returncode}: {done.stderr[-600:]}"
        if "shrank the world 4 -> 3" not in done.stderr or "layout for 3 ranks" not in done.stdout:
            return what, "no shrink or no re-planned layout reported"
        return what, check_final(folder, 3)
    if kind == "grow":
        fault = f"kill:{victim}:{step}:{phase}:{delay}"
        if rng.random() < 0.5:  # a survivor dies in the handover (at the state's step)
            other = rng.choice([r for r in range(4) if r != victim])
            applied = step if phase == "save" else step - 1
            fault += f",kill:{other}:{applied}:grow:{round(rng.uniform(0, 0.005), 4)}"
        done, t = run(train_argv(folder, 4, "--deterministic", "--elastic", "grow", ulfm=True,
                                 prte=RECOVERABLE), RTXMPI_FAULT=fault)
        if done.returncode != 0:
            return fault, f"exit {done.returncode}: {done.stderr[-600:]}"
        if "grew the world 3 -> 4" not in done.stderr:
            return fault, "no growth reported"
        if "last committed checkpoint" in done.stderr:
            return fault, "reloaded a checkpoint although a complete copy was alive"
        if "phase grow" in done.stderr:  # the second kill landed (the replica's step was as drawn)
            fault += " (in the handover)"
            if done.stderr.count("shrank the world 4 -> 3") != 2:
                return fault, "the kill in the handover was not recovered by a second shrink"
        return fault, check_final(folder, 4) or same_run(folder, grow_reference(folder.parent))
    if kind == "join":
        return join_scenario(rng, folder)
    if kind == "spawn":
        return spawn_scenario(rng, folder, victim, step, phase, delay)
    raise ValueError(kind)


def spawn_scenario(rng, folder, victim, step, phase, delay):
    """The `spawn` kind (module doc). Returns (description, None or what went wrong)."""
    other = rng.choice([r for r in range(4) if r != victim])
    applied = step if phase == "save" else step - 1  # the replica's step, or the one after it
    at = round(rng.uniform(0, 1.0), 3)  # before the spawn call, inside it, or in the merge
    fault = (f"kill:{victim}:{step}:{phase}:{delay},kill:{other}:{applied}:spawn:{at},"
             f"kill:{other}:{applied + 1}:spawn:{at}")
    argv = train_argv(folder, 4, "--deterministic", "--elastic", "grow", ulfm=True, prte=RECOVERABLE)
    done, t = run(argv, RTXMPI_FAULT=fault)
    if done.returncode == 124:
        return fault, "hung (outer timeout)"
    if "phase spawn" not in done.stderr:
        fault += " (the second kill did not land: a plain replace)"
    if check_final(folder, 4) is not None:  # ended early: by the spawn watchdog or the launcher
        watchdog = "leaves the job (exit 5)" in done.stderr
        if not (watchdog or done.returncode < 0 or done.returncode > 128):
            return fault, f"exit {done.returncode}: {done.stderr[-600:]}"
        fault += (" (ended by the spawn watchdog" if watchdog else
                  f" (the launcher ended on signal {abs(done.returncode) % 128}") + \
            "; relaunched with --resume)"
        done, t = run(argv + ["--resume"])
        if done.returncode == 124:
            return fault, "the relaunch hung (outer timeout)"
    elif done.returncode != 0:
        fault += f" (launcher exit {done.returncode} after every rank finished)"
    return fault, check_final(folder, 4) or same_run(folder, grow_reference(folder.parent))


def join_scenario(rng, folder):
    """The `join` kind (module doc). Returns (description, None or what went wrong)."""
    from rtxmpi.elastic import admit
    ranks, step = rng.choice([1, 2]), rng.randrange(2, STEPS - 3)
    fault, what = f"stall:0:{step}:forward:3", rng.choice(["none", "grow", "later"])
    victim = rng.randrange(2)
    if what == "grow":  # while the state of step S is handed over (S: the join's boundary)
        fault += f",kill:{victim}:{step}:grow:{round(rng.uniform(0, 0.005), 4)}"
    elif what == "later":
        fault += f",kill:{victim}:{step + 2}:backward:{round(rng.uniform(0, 0.01), 4)}"
    ckpt, asked = folder / "ckpt", []

    def ask():  # once step S-1 is logged: rank 0 then stalls 3 s in step S
        deadline = time.monotonic() + OUTER_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(r["step"] >= step - 1 for r in steps_logged(folder)):
                asked.append(admit.write_request(ckpt, ranks, timeout_s=OUTER_TIMEOUT_S))
                return
            time.sleep(0.02)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    done, t = run(train_argv(folder, 2, "--elastic", "grow", ulfm=True, prte=RECOVERABLE),
                  RTXMPI_FAULT=fault)
    thread.join(5)
    desc = f"+{ranks} {fault}"
    if done.returncode != 0:
        return desc, f"exit {done.returncode}: {done.stderr[-600:]}"
    answer = admit.read_answer(ckpt, asked[0]) if asked else None
    if not answer or not answer.get("admitted"):
        return desc, f"not admitted: {answer}"
    joined = answer["step"]
    if "[rtxmpi fault] kill" in done.stderr:
        desc += " (landed)"
        if "shrank the world" not in done.stderr:
            return desc, "the kill was not recovered by a shrink"
    if "last committed checkpoint" in done.stderr:
        return desc, "reloaded a checkpoint although a complete copy was alive"
    sizes = [r["world_size"] for r in steps_logged(folder)]
    if sizes != [2] * joined + [2 + ranks] * (STEPS - joined):
        return desc, f"world sizes per step {sizes} (joined at step {joined})"
    return desc, check_final(folder, 2 + ranks)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {KINDS}")
    p.add_argument("--keep", default=None, help="keep each scenario's folder under this directory")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    rng = random.Random(args.seed)
    root = Path(args.keep or tempfile.mkdtemp(prefix="rtxmpi-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RTXMPI_CACHE_DIR", str(root / "cache"))
    passed = 0
    for i in range(args.scenarios):
        kind = kinds[i % len(kinds)]
        folder = root / f"{i:03d}-{kind}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        start = time.monotonic()
        LOG["path"] = folder / "log.txt"
        what, problem = scenario(kind, rng, folder)
        ok = problem is None
        passed += ok
        print(f"chaos {i + 1}/{args.scenarios} {kind:8s} {what:32s} "
              f"{'ok' if ok else 'FAILED: ' + problem} ({time.monotonic() - start:.1f} s)", flush=True)
    print(f"chaos: {args.scenarios} scenarios tried, {passed} passed (seed {args.seed})", flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if passed == args.scenarios else 1


if __name__ == "__main__":
    sys.exit(main())
