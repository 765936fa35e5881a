"""Hardware profile for the planner: what one rank computes and moves per second, measured here.

    mpiexec -n 4 rtxmpi plan --calibrate --save-profile prof.json ...   # measure, then plan
    rtxmpi plan --profile prof.json ...                                 # reuse it anywhere

A `HardwareProfile` holds the numbers the planner's cost model (rtxmpi/parallel/planner.py) needs:

  compute, per rank, measured on local rank 0 while the node's other ranks wait in MPI (as a
  rank does between its pipeline stages), "speed(1)" below:
    dense_flops      float32 GEMM (tokens, C) @ (C, 4C), FLOP/s
    attn_flops       batched attention matmuls (B*H, T, hs) @ (B*H, hs, T), FLOP/s
    score_fwd_ns     ns per attention-score element: causal bias add + softmax (the forward)
    score_bwd_ns     ns per score element: the softmax backward (4 passes over the scores)
    gelu_ns          ns per MLP hidden element, GELU forward + backward
    ln_ns            ns per activation element, LayerNorm forward + backward
    adam_ns          ns per parameter of one AdamW step
    copy_ns          ns per float32 element copied (4 MiB arrays): ZeRO offload's host copies
    block_call_us    us for one block forward + backward at 8 tokens: the fixed cost of the ~70
                     numpy calls a block makes, paid per block and micro-batch
    ref_model, ref_ms  the reference run: one GPT forward + backward (rtxmpi.nn.GPT, the model
                     the plan is for, `micro_batch` sequences), in ms at speed(1). The kernels run
                     on warm, reused buffers; the model allocates fresh activations and misses
                     caches, so the planner scales its kernel sum by ref_ms / (the kernel sum of
                     this run): the model factor
    ref_small        {"micro_batch": a quarter of the reference's, "ms_ratio": its time / the
                     reference's}, both alone and interleaved: the planner interpolates the model
                     factor between the two working-set sizes (log-linear, clamped), since small
                     micro-batches stay in cache and run closer to the kernels' rates
    ref_block        {"n_layer": 1, "ms_ratio": the same model with one block, its CPU time / the
                     reference's}: the planner interpolates the factor in the blocks a process
                     holds (log-linear between 1 and n_layer): a pipeline stage of one block may
                     run its block faster than the whole model does (its activations and weights
                     stay in cache between forward and backward; 2-11% on the CI machine kind)
  all compute times (kernels, ref_ms, ref_small, ref_block) are CPU time (time.thread_time,
  clock = "cpu"): the work, unaffected by time slices other processes take; the wall times of
  the sharing runs below then measure the sharing alone, absolutely (fit_sharing work_ms)
  sharing (the crux when ranks outnumber cores): the reference run is also timed with k = half
  and k = all of a node's ranks computing at once (ref_busy_ms: {k: ms}; for k = half the mean
  over balanced_subsets of the local ranks, so that the time does not depend on which cores the
  scheduler put the ranks on), and a processor-sharing model is fitted to the three times:
    speed(k) = min(1, effective_cores / (k + wait_weight * (R - k)))     (R = ranks per node)
    effective_cores  cores the node's ranks get (fewer than its cores when other jobs run)
    wait_weight      the share of a core a rank takes while it waits in MPI (Open MPI with
                     mpi_yield_when_idle and rtxmpi's waits spin with sched_yield: 0 would be a
                     sleeping waiter, 1 a busy one)
    contention       ref_busy_ms[R] / ref_ms (1.0: every rank has its own core)
  The planner uses speed(k) / speed(1) for the k ranks of a node computing at once.
  sync_s           {n: seconds}: what a collective among n ranks costs beyond its alpha-beta time
                   when the ranks compute between collectives (~ one block's share of the
                   reference run, all ranks busy, at most 20 ms): they arrive at different
                   moments, and the early ones wait (scheduling jitter when ranks outnumber
                   cores); measured as the mean time a rank spends inside an 8-byte all_reduce
                   after computing, the median of rounds spread over the calibration
                   (_sync_rounds: the scheduler's state holds for seconds)
  communication, alpha-beta fits t(bytes) = alpha_s + factor(op, n) * bytes / bw_bytes_per_s per
  operation and group size n, measured with every group of that size in the world communicating
  at once (as the dp/tp groups of a layout do): factor is 2(n-1)/n for all_reduce, (n-1)/n for
  all_gather, reduce_scatter and all_to_all, 1 for send_recv (one direction, both ways at once).
  links["intra"] are groups inside one node; links["inter"] groups whose ranks are on different
  nodes (measured only when the world spans several nodes; otherwise a copy of the default
  profile's, labelled so in `notes`).

Sources: the alpha-beta (Hockney) model and the ring factors of Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH" (2005); busbw as in nccl-tests.

`default_profile()` is a documented fallback measured once on the CI machine kind (2 cores, Open
MPI 5 shared memory, numpy 1 thread per rank, November 2026); its `source` says "default" and
the planner prints that it is not a measurement of this machine.
"""
import json
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..comm.node import launch_comm, library_version, node_ranks
from ..errors import ConfigError
from ..exchange import all_gather_json, broadcast_json

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SYNC_ROUNDS = 5  # sync-wait rounds at the end of the calibration (one more after each phase)
PROFILE_VERSION = 1


def ring_factor(op, n):
    """Bytes each rank moves per byte of the operation's buffer (the busbw factor), for a group
    of n ranks: all_reduce 2(n-1)/n, all_gather / reduce_scatter / all_to_all (n-1)/n,
    send_recv 1; 0 when n == 1 (no communication)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ConfigError(f"unknown communication op {op!r}; known: {OPS}")


@dataclass
class HardwareProfile:
    """Measured (or default) rates of one kind of machine; see the module docstring for fields.

    links: {"intra"|"inter": {op: {str(group size): [alpha_s, bw_bytes_per_s]}}}.
    machine: facts (host, cpu, cores, MPI library, numpy); source: "calibrated ..." or "default ...".
    """

    source: str
    ranks_per_node: int
    cores_per_node: int
    dense_flops: float
    attn_flops: float
    score_fwd_ns: float
    score_bwd_ns: float
    gelu_ns: float
    ln_ns: float
    adam_ns: float
    block_call_us: float
    contention: float
    effective_cores: float
    wait_weight: float
    ref_busy_ms: dict
    links: dict
    ref_model: dict
    ref_ms: float
    sync_s: dict = field(default_factory=dict)
    ref_small: dict = field(default_factory=dict)
    ref_block: dict = field(default_factory=dict)
    copy_ns: float = 1.0  # profiles saved before it was measured: the CI machine kind's
    clock: str = "wall"  # "cpu": rates and ref_ms are CPU time, sharing fitted absolutely
    machine: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    version: int = PROFILE_VERSION

    @property
    def is_default(self):
        return self.source.startswith("default")

    def comm_time_s(self, op, nbytes, n, inter=False):
        """Seconds for one `op` on a buffer of `nbytes` in a group of n ranks (alpha-beta model,
        the nearest measured group size's alpha and bandwidth, scaled by ring_factor). 0 for n==1
        or nbytes == 0."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        table = self.links["inter" if inter else "intra"].get(op)
        if not table:
            raise ConfigError(f"hardware profile has no {op} measurements ({self.source})")
        sizes = sorted(int(k) for k in table)
        nearest = min(sizes, key=lambda s: (abs(s - n), -s))
        alpha, bw = table[str(nearest)]
        return alpha + ring_factor(op, n) * nbytes / bw

    def sync_time_s(self, n):
        """Seconds a collective among n ranks waits, beyond alpha-beta, when the ranks compute
        between collectives (they arrive at different moments: scheduling jitter, uneven shares
        of the cores); the nearest measured group size; 0 for n == 1 or when not measured."""
        if n <= 1 or not self.sync_s:
            return 0.0
        sizes = sorted(int(k) for k in self.sync_s)
        return float(self.sync_s[str(min(sizes, key=lambda s: (abs(s - n), -s)))])

    def with_reference(self, busy_ms, note=None, work_ms=None):
        """A copy whose sharing model comes from `busy_ms` ({k: wall ms}, e.g. from
        ReferenceRun.sample pooled over a benchmark): ref_busy_ms, contention, effective_cores
        and wait_weight are refitted; the kernel rates and links stay. On a "cpu"-clock profile
        the work stays ref_ms unless `work_ms` (the same runs' CPU time at k = 1) is given; on
        a "wall"-clock one ref_ms becomes busy_ms[1]."""
        data = json.loads(json.dumps(asdict(self)))
        busy = {int(k): float(v) for k, v in busy_ms.items()}
        if self.clock == "cpu":
            work = float(work_ms) if work_ms else self.ref_ms
            C, w = fit_sharing(busy, self.ranks_per_node, self.cores_per_node, work_ms=work)
        else:
            work = busy[1]
            C, w = fit_sharing(busy, self.ranks_per_node, self.cores_per_node)
        data.update(ref_ms=work, ref_busy_ms={str(k): v for k, v in busy.items()},
                    contention=max(1.0, busy[max(busy)] / work), effective_cores=C,
                    wait_weight=w, notes=self.notes + ([note] if note else []))
        return HardwareProfile.from_dict(data)

    def save(self, path):
        """Write the profile as JSON (no pickle). Raises ConfigError when it cannot be written."""
        try:
            with open(path, "w") as f:
                json.dump(asdict(self), f, indent=1, sort_keys=True)
        except OSError as exc:
            raise ConfigError(f"cannot write hardware profile {path}: {exc}") from None

    @classmethod
    def load(cls, path):
        """Read a profile written by `save`. Raises ConfigError on a missing file, bad JSON, or
        missing / unknown fields (the message names them)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read hardware profile {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise ConfigError(f"hardware profile {path} is not valid JSON: {exc}") from None
        return cls.from_dict(data, what=path)

    @classmethod
    def from_dict(cls, data, what="profile"):
        known = set(cls.__dataclass_fields__)
        if not isinstance(data, dict):
            raise ConfigError(f"{what}: a hardware profile is a JSON object")
        required = {n for n, f in cls.__dataclass_fields__.items()
                    if f.default is f.default_factory is __import__("dataclasses").MISSING}
        missing, unknown = sorted(required - set(data)), sorted(set(data) - known)
        if missing or unknown:
            raise ConfigError(f"{what}: not a hardware profile (missing fields {missing}, unknown "
                              f"fields {unknown}); write one with `rtxmpi plan --calibrate "
                              f"--save-profile FILE`")
        profile = cls(**data)
        for name in ("dense_flops", "attn_flops", "effective_cores"):
            if not float(getattr(profile, name)) > 0:
                raise ConfigError(f"{what}: {name} must be > 0, got {getattr(profile, name)}")
        if profile.clock not in ("cpu", "wall"):
            raise ConfigError(f"{what}: clock must be 'cpu' or 'wall', got {profile.clock!r}")
        for scope in ("intra", "inter"):
            if scope not in profile.links:
                raise ConfigError(f"{what}: links has no {scope!r} table")
        return profile


# Measured on the CI machine kind (2 cores, Debian 12, Open MPI 5.0 shared memory, numpy with one
# BLAS thread per rank, 4 ranks, November 2026) by `calibrate`; inter-node numbers from the veth
# pair between two network namespaces (docs/operations.md: 16 MiB all_reduce ~17.5 ms).
_DEFAULT = {
    "source": "default (not measured on this machine: 2-core CI machine, 4 ranks, Nov 2026; run "
              "`rtxmpi plan --calibrate` under mpiexec for this machine's numbers)",
    "ranks_per_node": 4, "cores_per_node": 2,
    "dense_flops": 1.0e11, "attn_flops": 4.0e10,
    "score_fwd_ns": 3.5, "score_bwd_ns": 2.3, "gelu_ns": 10.0, "ln_ns": 7.0, "adam_ns": 4.0,
    "copy_ns": 1.0,
    "block_call_us": 470.0,
    "contention": 2.0, "effective_cores": 2.0, "wait_weight": 0.3,
    "ref_busy_ms": {"1": 190.0, "2": 245.0, "4": 380.0},
    "ref_model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 256, "seq_len": 128,
                  "tie_embeddings": True, "micro_batch": 8},
    "ref_ms": 190.0,
    "sync_s": {"2": 1e-4, "4": 3e-4},
    "links": {
        "intra": {
            "all_reduce": {"2": [5e-06, 2.5e9], "4": [2e-05, 1.5e9]},
            "all_gather": {"2": [6e-06, 2.5e9], "4": [2e-05, 1.5e9]},
            "reduce_scatter": {"2": [6e-06, 1.0e9], "4": [2e-05, 1.0e9]},
            "all_to_all": {"2": [8e-06, 2.5e9], "4": [3e-05, 1.5e9]},
            "send_recv": {"2": [4e-06, 3.0e9]},
        },
        "inter": {
            "all_reduce": {"2": [1e-04, 9.6e8]},
            "all_gather": {"2": [1e-04, 9.6e8]},
            "reduce_scatter": {"2": [1e-04, 9.6e8]},
            "all_to_all": {"2": [1e-04, 9.6e8]},
            "send_recv": {"2": [6e-05, 9.6e8]},
        },
    },
    "machine": {"note": "defaults; see rtxmpi/parallel/calibrate.py"},
    "notes": ["default profile: every number is a fallback, not a measurement of this machine"],
}


def default_profile():
    """The documented fallback HardwareProfile (see _DEFAULT's comment); source starts with
    "default". A fresh copy each call."""
    return HardwareProfile.from_dict(json.loads(json.dumps(_DEFAULT)), what="default profile")


# --------------------------------------------------------------------------------- measurement
def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _machine_facts(group, nodes):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"host": socket.gethostname(), "cpu": cpu, "cores_per_node": _cores(),
            "world_size": group.Get_size(), "nodes": nodes, "python": platform.python_version(),
            "numpy": np.__version__, "mpi": library_version(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _time_min(fn, comm, reps, active=True, clock=time.perf_counter):
    """Min over reps of the time of fn() between barriers; ranks with active=False only wait.
    Returns this rank's min (inf when inactive)."""
    best = float("inf")
    for _ in range(reps):
        comm.Barrier()
        if active:
            t0 = clock()
            fn()
            best = min(best, clock() - t0)
    comm.Barrier()
    return best


def _time_median(fn, comm, reps, active=True, clock=time.perf_counter):
    """Like _time_min, the median instead of the min. clock=time.thread_time measures the CPU
    time this thread spent (immune to time slices other processes took)."""
    times = []
    for _ in range(reps):
        comm.Barrier()
        if active:
            t0 = clock()
            fn()
            times.append(clock() - t0)
    comm.Barrier()
    return float(np.median(times)) if times else float("inf")


def _compute_kernels(C, H, T, tokens):
    """The model's hot kernels at one shape, as closures over the shipped modules (rtxmpi.nn
    .modules), with the unit each is divided by."""
    from ..nn.modules import GELU, AttentionCore, LayerNorm, TransformerBlock

    rng = np.random.default_rng(0)
    B = max(1, tokens // T)
    hs = C // H
    a = rng.standard_normal((B * T, C)).astype(np.float32)
    w = (rng.standard_normal((C, 4 * C)) * 0.02).astype(np.float32)
    q = rng.standard_normal((B, H, T, hs)).astype(np.float32)
    att = rng.standard_normal((B, H, T, T)).astype(np.float32)
    datt = att.copy()
    h = rng.standard_normal((B, T, 4 * C)).astype(np.float32)
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    g = np.ones(C, np.float32)
    S = att.size
    core, gelu_module, norm = AttentionCore(causal=True), GELU(), LayerNorm(C)
    ln_params, ln_grads = [g, g], [np.zeros(C, np.float32), np.zeros(C, np.float32)]

    def gemm():
        a @ w

    def attn():
        q @ q.swapaxes(-1, -2)

    def score_fwd():  # the core's causal mask and softmax, between its matmuls
        att[...] = datt
        core.scores_forward(att)

    copy_s = lambda: att.__setitem__(Ellipsis, datt)  # noqa: E731  (subtracted from score_fwd)

    probs = core.scores_forward(datt.copy())
    dprobs = np.empty_like(probs)

    def score_bwd():  # the core's softmax backward (it overwrites the probabilities' gradient)
        dprobs[...] = datt
        core.scores_backward(dprobs, probs)

    copy_b = lambda: dprobs.__setitem__(Ellipsis, datt)  # noqa: E731  (subtracted from score_bwd)

    def gelu():
        y, cache = gelu_module.forward(None, h)
        gelu_module.backward(None, None, cache, h)

    def ln():
        y, cache = norm.forward(ln_params, x)
        norm.backward(ln_params, ln_grads, cache, x)

    from ..nn.optim import AdamW

    n_adam = 1 << 18
    p = np.zeros(n_adam, np.float32)
    opt = AdamW(p, lr=1e-3, decay_mask=np.ones(n_adam, np.float32))
    grad = rng.standard_normal(n_adam).astype(np.float32)
    xs = rng.standard_normal((1, 8, C)).astype(np.float32)
    block = TransformerBlock(C, H)
    block_params = [(rng.standard_normal(d.shape) * 0.02).astype(np.float32)
                    for d in block.param_specs()]
    block_grads = [np.zeros_like(b) for b in block_params]

    src = rng.standard_normal(1 << 20).astype(np.float32)  # 4 MiB: past the caches, as a shard
    dst = np.empty_like(src)

    def block_call():  # one block forward + backward at 8 tokens: the per-call cost
        y, cache = block.forward(block_params, xs)
        block.backward(block_params, block_grads, cache, y)

    return {
        "block_call_us": (block_call, 1e3, "ns"),  # seconds / 1e3 * 1e9 = us
        "dense_flops": (gemm, 2.0 * B * T * C * 4 * C, "flops"),
        "attn_flops": (attn, 2.0 * B * H * T * T * hs, "flops"),
        "score_fwd_ns": (score_fwd, S, "ns", copy_s),
        "score_bwd_ns": (score_bwd, S, "ns", copy_b),
        "gelu_ns": (gelu, h.size, "ns"),
        "ln_ns": (ln, x.size, "ns"),
        "adam_ns": (lambda: opt.step(grad), n_adam, "ns"),
        "copy_ns": (lambda: np.copyto(dst, src), src.size, "ns"),
    }


def _rate(kind, units, seconds):
    return units / seconds if kind == "flops" else seconds / units * 1e9


def _measure_compute(comm, group, local_rank, ranks_per_node, cfg, micro_batch, reps):
    """Per-kernel alone rates (local rank 0 of each node computing, the others in a barrier;
    median of reps) and the reference model: one GPT forward + backward of `micro_batch`
    sequences, with 1, half and all of the node's ranks computing at once. comm: the
    communicator whose barriers bracket the timings; group: the ProcessGroup over the same
    ranks for the exchanges. Returns (rates, {k: ms}), group rank 0's on every rank."""
    C, H, T = cfg.n_embd, cfg.n_head, cfg.seq_len
    kernels = _compute_kernels(C, H, T, micro_batch * T)
    rates = {}
    for name, spec in kernels.items():
        fn, units, kind = spec[:3]
        fn()  # warm-up (page faults, BLAS init)
        t = _time_median(fn, comm, reps, active=local_rank == 0, clock=time.thread_time)
        if len(spec) > 3:  # subtract the re-fill copy that keeps the input the same every rep
            t -= _time_median(spec[3], comm, reps, active=local_rank == 0, clock=time.thread_time)
        rates[name] = _rate(kind, units, max(t, 1e-9))
    ref = ReferenceRun(group, cfg, micro_batch, comm=comm)
    # interleaved rounds, medians over them: 3 at the default reps = 5 (5 rounds before the
    # balanced subsets made the k = half part of a round R - 1 runs instead of 1; with 4 rounds
    # a calibration took a median 1.24x as long, paired runs at load 5-11), each round's
    # k = half time a mean over placements
    busy_ms = ref.median_ms(ref.sample(max(3, reps - 2)))
    rates["ref_cpu_ms"] = ref.median_ms(ref.cpu)[1]
    # the same run at a quarter of the micro-batch, alone, interleaved with the full one: how the
    # model factor changes when the working set shrinks (smaller micro-batches stay in cache)
    # and the same model with one block (what a pipeline stage of one block runs), at the full
    # micro-batch: how the factor changes with the blocks a process holds (a block's activations
    # and weights stay in cache between its forward and backward when fewer blocks run between)
    small_batch = max(1, micro_batch // 4)
    small = ReferenceRun(group, cfg, small_batch, comm=comm)
    one = ReferenceRun(group, _one_block(cfg), micro_batch, comm=comm) if cfg.n_layer > 1 else None
    ratios, ratios_one = [], []
    for _ in range(5):
        t_big = _time_min(ref._step, comm, 1, active=local_rank == 0, clock=time.thread_time)
        t_small = _time_min(small._step, comm, 1, active=local_rank == 0, clock=time.thread_time)
        if one is not None:
            t_one = _time_min(one._step, comm, 1, active=local_rank == 0, clock=time.thread_time)
        if local_rank == 0:
            ratios.append(t_small / t_big)
            if one is not None:
                ratios_one.append(t_one / t_big)
    ref_small = {"micro_batch": small_batch, "ms_ratio": float(np.median(ratios))} \
        if ratios else None
    ref_block = {"n_layer": 1, "ms_ratio": float(np.median(ratios_one))} if ratios_one else {}
    # rates measured on local rank 0: take the node-0 values everywhere (broadcast; ref_cpu_ms:
    # ranks with local rank 0, node 0's)
    rates, busy_ms, rates["ref_small"], rates["ref_block"] = broadcast_json(
        group, [rates, {str(k): v for k, v in busy_ms.items()}, ref_small, ref_block])
    return rates, {int(k): v for k, v in busy_ms.items()}


def _one_block(cfg):
    from dataclasses import replace

    return replace(cfg, n_layer=1)


def balanced_subsets(ranks_per_node, k):
    """The local ranks that compute in the k-rank reference runs: a list of k-tuples of local
    ranks of a node of `ranks_per_node` (R) whose mean time does not depend on where the
    scheduler put the ranks. k = 1: [(0,)]; k >= R: [all]; otherwise R - 1 subsets, local rank
    0 with k - 1 others taken cyclically from 1..R-1 (for R = 4, k = 2: (0,1), (0,2), (0,3)).

    Why: without binding (`--bind-to none`, Open MPI's default when ranks outnumber cores) the
    scheduler spreads R ranks evenly over the cores, and a waiting rank spins, so two computing
    ranks that landed on the same core stay there: one fixed pair of computing ranks measured
    2x slower or not at all slower depending on the placement of that job (the k = 2 reference
    on 2 cores was 135-180 or 274-367 ms). Every other rank computes together with rank 0 in
    exactly k - 1 of the R - 1 subsets, so for any even placement of R ranks on P cores rank 0
    shares its core with the same number of computing ranks summed over the subsets, (k - 1) *
    (R / P - 1): the mean over the subsets is the mean over placements, what the ranks of a
    layout that are not bound see on average."""
    R = ranks_per_node
    if k >= R:
        return [tuple(range(R))]
    if k <= 1:
        return [(0,)]
    others = list(range(1, R))
    return [tuple(sorted({0} | {others[(i + j) % (R - 1)] for j in range(k - 1)}))
            for i in range(R - 1)]


class ReferenceRun:
    """One GPT forward + backward of `micro_batch` sequences of `cfg`, timed with k = 1, half and
    all of each node's ranks computing at once (the others waiting in a barrier); for k between
    1 and all, every subset of `balanced_subsets` computes in turn and the round's time is their
    mean (placement-independent, see there). Collective: every rank of `group` (a ProcessGroup:
    the exchanges) builds it and calls sample() together; comm (default: the group's MPI
    communicator) brackets each run with barriers. Benchmarks interleave sample() with what
    they measure and refit with HardwareProfile.with_reference, so the profile sees the same
    machine load as the runs."""

    def __init__(self, group, cfg, micro_batch, comm=None):
        from ..nn.gpt import GPT

        self.group, self.comm = group, _mpi_comm(group) if comm is None else comm
        self.local_rank, on_node, _ = node_ranks(self.comm)
        size = np.array([on_node], np.int64)
        group.all_reduce(size, op="max")
        self.ranks_per_node = int(size[0])
        self.model = GPT(cfg, seed=0)
        self.idx = np.random.default_rng(1).integers(0, cfg.vocab_size, (micro_batch, cfg.seq_len))
        R = self.ranks_per_node
        self.ks = sorted({1, (R + 1) // 2, R})
        self.subsets = {k: balanced_subsets(R, k) for k in self.ks}
        self.cpu = {k: [] for k in self.ks}
        self._step()  # warm-up

    def _step(self):
        loss, cache = self.model.forward(self.idx, self.idx)
        self.model.backward(cache)

    def sample(self, reps=1):
        """{k: [seconds, ...]}: one value per round, reps interleaved rounds over k (the k order
        rotating): the mean wall time of the computing ranks, averaged over k's balanced subsets.
        The same runs' CPU times (time.thread_time: the work, without the time slices other
        processes took), averaged alike, accumulate in self.cpu ({k: [seconds, ...]}).
        Collective."""
        samples = {k: [] for k in self.ks}
        for rep in range(reps):  # interleaved, so a change of machine load hits every k alike
            for k in self.ks[rep % len(self.ks):] + self.ks[:rep % len(self.ks)]:
                walls, cpus = [], []
                for subset in self.subsets[k]:
                    self.comm.Barrier()
                    t, c = float("inf"), float("inf")
                    if self.local_rank in subset:
                        t0, c0 = time.perf_counter(), time.thread_time()
                        self._step()
                        t, c = time.perf_counter() - t0, time.thread_time() - c0
                    self.comm.Barrier()
                    times = self.group.all_gather(np.array([t, c], np.float64)).reshape(-1, 2)
                    done = [(w, u) for w, u in times.tolist() if w != float("inf")]
                    walls.append(np.mean([w for w, _ in done]))
                    cpus.append(np.mean([u for _, u in done]))
                samples[k].append(float(np.mean(walls)))
                self.cpu[k].append(float(np.mean(cpus)))
        return samples

    @staticmethod
    def median_ms(samples):
        """{k: ms}: the median over rounds (a round the machine's other load disturbed does not
        move it) of sample()'s per-round values."""
        return {k: float(np.median(v)) * 1e3 for k, v in samples.items()}


def fit_sharing(busy_ms, ranks_per_node, cores, work_ms=None):
    """Fit (effective_cores, wait_weight) of speed(k) = min(1, C / (k + w (R - k))) to reference
    times {k: ms} with k ranks of a node computing (the others waiting): least squares on log
    times over a grid, C in [0.05, max(cores, R)], w in [0, 1]. With work_ms (the run's CPU
    time: its work at full speed) the fit is absolute, busy_ms[k] / work_ms = 1 / speed(k), so
    a machine whose other jobs take cores shows as a smaller C even at k = 1; without, relative
    to k = 1 (busy_ms[k] / busy_ms[1] = speed(1) / speed(k)). With only k = 1 and R measured
    (R <= 2), w is fixed at 0.5; with one rank per node (R = 1) C = cores, or with work_ms
    the C that gives speed(1). Returns (C, w)."""
    R = ranks_per_node
    ks = sorted(int(k) for k in busy_ms)
    t1 = busy_ms[ks[0]] if ks[0] in busy_ms else busy_ms[str(ks[0])]
    ref = float(work_ms) if work_ms else t1
    obs = {k: (busy_ms[k] if k in busy_ms else busy_ms[str(k)]) / ref for k in ks}
    if R <= 1:  # nothing shares: every core available (or the measured slowdown), waiters half-busy
        return (float(max(1, cores)) if not work_ms else min(1.0, 1.0 / max(obs[1], 1e-9))), 0.5
    best = (float("inf"), 1.0, 0.5)
    c_hi = max(float(cores), float(R))
    weights = [0.5] if len(ks) < 3 else [i / 50 for i in range(51)]
    # descending C, strict improvement only: when no rank ever gets a whole core the ratios do
    # not depend on C, and the largest such C (one computing rank exactly fills a core) is kept
    for ci in range(int(c_hi * 20), 0, -1):
        C = ci / 20
        for w in weights:
            def speed(k):
                return min(1.0, C / (k + w * (R - k)))
            base = 1.0 if work_ms else speed(ks[0])
            err = sum((np.log(base / speed(k)) - np.log(obs[k])) ** 2 for k in ks)
            if err < best[0] - 1e-12:
                best = (err, C, w)
    return best[1], best[2]


def _measure_sync(comm, group, ranks_of_node, cfg, segment_s, reps, rounds=5):
    """{str(n): seconds}: how long a rank waits inside an 8-byte all_reduce among every group of
    n ranks (consecutive ranks of a node, all groups at once) right after computing for about
    segment_s (a GEMM loop of at most 200 GEMMs): the time from entering the all_reduce to
    leaving it, averaged over the group's ranks and `reps` repetitions per round; the median of
    `rounds` rounds (a round the scheduler disturbed more does not move it), clamped to
    [0, segment_s]. The ranks' mean wait is E[last arrival] - E[own arrival], what the
    collective adds to the step beyond its alpha-beta time; alpha of an 8-byte all_reduce (a few
    us) is not subtracted. Measured directly, not as the difference of two loop timings, whose
    noise is as large as the wait itself on a loaded machine. comm: the MPI communicator the
    groups are split from; group: the ProcessGroup over its ranks for the exchanges."""
    return _sync_median(_sync_rounds(comm, group, ranks_of_node, cfg, segment_s, reps, rounds),
                        segment_s)


def _sync_median(rounds, segment_s):
    """{n: seconds} from _sync_rounds' {n: [seconds per round]}: the median, in [0, segment_s]."""
    return {n: float(min(max(0.0, np.median(v)), segment_s)) for n, v in rounds.items()}


def _sync_rounds(comm, group, ranks_of_node, cfg, segment_s, reps, rounds):
    """{str(n): [seconds, one per round]}: _measure_sync's rounds, before the median."""
    C = cfg.n_embd
    rng = np.random.default_rng(2)
    a = rng.standard_normal((256, C)).astype(np.float32)
    w = rng.standard_normal((C, 4 * C)).astype(np.float32)
    ones = []
    for _ in range(20):
        t0 = time.perf_counter()
        a @ w
        ones.append(time.perf_counter() - t0)
    one = max(1e-5, float(np.median(ones)))
    loops = np.array([max(1, min(200, int(segment_s / one)))], np.int64)
    loops = int(group.broadcast(loops, src=0)[0])
    flag, total_flag = np.zeros(1, np.float64), np.zeros(1, np.float64)
    out = {}
    R = max(len(r) for r in ranks_of_node)
    rank = comm.Get_rank()
    for n in sorted({2, R}):
        partitions = _sync_partitions(ranks_of_node, n) if 2 <= n <= R else None
        if not partitions:
            continue
        subs = [comm.Split(next(i for i, g in enumerate(groups) if rank in g), key=rank)
                for groups in partitions]
        waits = []
        for _ in range(rounds):
            comm.Barrier()
            waited = 0.0
            for sub in subs:  # every pairing in each round: the mean over placements
                for _ in range(reps):
                    for _ in range(loops):
                        a @ w
                    t = time.perf_counter()
                    sub.Allreduce(flag, total_flag)
                    waited += time.perf_counter() - t
            total = group.all_reduce(np.array([waited], np.float64), op="sum")
            waits.append(float(total[0]) / (comm.Get_size() * reps * len(subs)))
        out[str(n)] = waits
        for sub in subs:
            sub.Free()
    return out


def _sync_partitions(ranks_of_node, n):
    """Ways to split every node's ranks into groups of n for the sync-wait rounds (None when n
    does not divide a node's ranks). n = 2: the R - 1 rounds of a round-robin tournament (the
    circle method), so every pair of a node's ranks is a group exactly once and the mean wait
    does not depend on where the scheduler put the ranks (R = 4: {0,1}{2,3}, {0,2}{3,1},
    {0,3}{1,2}); two ranks that share a core wait for each other's time slices, two on
    different cores hardly at all, and one fixed pairing measured 1.6-7.7 ms at R = 4 on
    2 cores from one calibration to the next. Otherwise consecutive groups of n (n = R: the
    node). Nodes of different sizes: each node has its own rounds, and a node with fewer rounds
    than the largest repeats them, so every partition still holds every rank of every node."""
    if any(len(ranks) % n for ranks in ranks_of_node):
        return None
    local = [_node_rounds(len(ranks), n) for ranks in ranks_of_node]
    return [[[ranks[i] for i in g] for ranks, rounds in zip(ranks_of_node, local)
             for g in rounds[p % len(rounds)]]
            for p in range(max(len(rounds) for rounds in local))]


def _node_rounds(R, n):
    """_sync_partitions for one node of R ranks (local indices): a list of partitions."""
    if n != 2 or R == 2:
        return [[list(range(i, i + n)) for i in range(0, R, n)]]
    others = list(range(1, R))
    return [[[0, others[r]]] + [[others[(r + i) % (R - 1)], others[(r - i) % (R - 1)]]
                                for i in range(1, R // 2)] for r in range(R - 1)]


def _pairs_within(ranks_of_node, n):
    """Split each node's ranks into consecutive groups of n (None when n does not divide)."""
    groups = []
    for ranks in ranks_of_node:
        if len(ranks) % n:
            return None
        groups += [ranks[i:i + n] for i in range(0, len(ranks), n)]
    return groups


def _measure_op(comm, op, sizes, reps, group):
    """Median-of-reps slowest-rank time of `op` on this communicator for each byte size.
    group: the rtxmpi ProcessGroup over the same ranks: all_reduce, all_gather and
    reduce_scatter run through it (its shared-memory mailbox and cross-memory paths, what
    training runs: rtxmpi/comm/shm.py), the others through MPI; the slowest time too."""
    n = comm.Get_size()
    out = []
    for nbytes in sizes:
        count = max(n, nbytes // 4 // n * n)
        send = np.ones(count, np.float32)
        recv = np.empty(count, np.float32)
        peer = comm.Get_rank() ^ 1 if n >= 2 else 0

        def run():
            if op == "all_reduce":
                group.all_reduce(send)  # in place, as training's buckets and tp activations
            elif op == "all_gather":
                group.all_gather(send[:count // n])
            elif op == "reduce_scatter":
                group.reduce_scatter(send)
            elif op == "all_to_all":
                comm.Alltoall(send, recv)
            elif peer < n:
                comm.Sendrecv(send, peer, 0, recv, peer, 0)
        run()
        times = []
        for _ in range(reps):
            comm.Barrier()
            t0 = time.perf_counter()
            run()
            slowest = group.all_reduce(np.array([time.perf_counter() - t0]), op="max")
            times.append(float(slowest[0]))
        out.append((count * 4, float(np.median(times))))
    return out


def _fit(points, op, n):
    """Least-squares alpha, bw from (bytes, seconds) with t = alpha + factor * bytes / bw."""
    f = ring_factor(op, n)
    x = np.array([b * f for b, _ in points], np.float64)
    y = np.array([t for _, t in points], np.float64)
    A = np.stack([np.ones_like(x), x], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(A, y, rcond=None)
    if inv_bw <= 0:  # noise: fall back to the largest message alone
        inv_bw = y[-1] / x[-1]
    return [float(max(alpha, 1e-7)), float(1.0 / inv_bw)]


def calibrate(group, cfg=None, micro_batch=None, sizes=None, reps=5, progress=None):
    """Measure this machine's HardwareProfile. Collective: every rank of `group` must call it.

    group: a ProcessGroup (rtxmpi.init()); a duplicate of its MPI communicator runs the
    benchmarks, the group the exchanges of their results.
    cfg: the GPTConfig the plan is for (default: the "small" model at seq_len 128): the kernels
    run at its shapes and one forward + backward of it is the reference run. micro_batch:
    sequences of the reference run (default: enough for about 1024 tokens). sizes: message sizes
    in bytes for the alpha-beta fits (default 4 KiB, 256 KiB, 4 MiB). reps: repetitions per
    measurement (medians). progress: None, or a callable given one line (str) at the start and
    after each phase, on every rank. Takes about 25 s at 4 ranks on 2 idle cores (December 2026),
    minutes on a loaded machine.
    Returns the same HardwareProfile on every rank. Raises ConfigError on bad arguments.
    """
    from ..nn.gpt import GPTConfig

    cfg = GPTConfig.named("small", seq_len=128) if cfg is None else cfg
    if not isinstance(cfg, GPTConfig):
        raise ConfigError(f"calibrate: cfg must be a GPTConfig, got {type(cfg).__name__}")
    micro_batch = max(1, 1024 // cfg.seq_len) if micro_batch is None else micro_batch
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1 \
            or isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ConfigError(f"calibrate: micro_batch and reps must be integers >= 1, got "
                          f"{micro_batch!r}, {reps!r}")
    comm = _mpi_comm(group).Dup()
    try:
        return _calibrate(comm, group, cfg, micro_batch, sizes or [4096, 1 << 18, 1 << 22], reps,
                          progress or (lambda line: None))
    finally:
        comm.Free()


def _mpi_comm(group):
    """The MPI communicator under `group` (COMM_WORLD for a backend without one)."""
    return getattr(getattr(group, "backend", None), "comm", None) or launch_comm()


def _subgroup(group, comm, color, key):
    """(communicator, rtxmpi group) over the ranks of `color` (collective). The group runs
    without checking mode (on every rank alike): a profile measures the transport, not the
    fingerprint exchange of RTXMPI_CHECK=1, a debugging aid."""
    sub = group.split(color, key=key)
    sub.check = False
    return sub.backend.comm, sub


def _calibrate(comm, group, cfg, micro_batch, sizes, reps, progress):
    t_start = time.perf_counter()
    rank, size = comm.Get_rank(), comm.Get_size()
    done = []  # the phases measured so far

    def phase_done(name):
        done.append(name)
        progress(f"calibrate: [{len(done)}/{phases}] {name} measured "
                 f"({time.perf_counter() - t_start:.0f} s so far)")

    local_rank, _, _ = node_ranks(comm)
    host_of = all_gather_json(group, socket.gethostname())
    names = sorted(set(host_of))
    ranks_of_node = [[r for r in range(size) if host_of[r] == h] for h in names]
    ranks_per_node = max(len(r) for r in ranks_of_node)
    link_sizes = [n for n in sorted({2, 4, ranks_per_node}) if _pairs_within(ranks_of_node, n)]
    inter = len(names) > 1 and all(len(r) == ranks_per_node for r in ranks_of_node)
    phases = 2 + len(link_sizes) + inter
    progress(f"calibrate: measuring this machine at {size} ranks in {phases} phases (compute, "
             f"links at {', '.join(map(str, link_sizes)) or 'no'} ranks, "
             f"{'inter-node links, ' if inter else ''}sync); about 25 s at 4 ranks on 2 idle "
             f"cores, minutes on a loaded machine")
    cores = int(group.all_reduce(np.array([_cores()], np.int64), op="min")[0])
    rates, busy_ms = _measure_compute(comm, group, local_rank, ranks_per_node, cfg, micro_batch,
                                      reps)
    ref_ms = rates.pop("ref_cpu_ms")  # the work of the reference run (CPU time, k = 1)
    phase_done("compute")
    effective, wait_weight = fit_sharing(busy_ms, ranks_per_node, cores, work_ms=ref_ms)
    notes = []
    if ranks_per_node == 1:
        notes.append(f"CPU sharing not measured (one rank per node): effective_cores = the "
                     f"{cores} cores, wait_weight 0.5; calibrate with the ranks per node you "
                     f"will train with")
    contention = max(1.0, busy_ms[ranks_per_node] / ref_ms)
    # one block's forward + backward with every rank busy: the compute between collectives
    segment = min(0.02, busy_ms[ranks_per_node] * 1e-3 / max(1, 2 * cfg.n_layer))
    # the sync wait changes with the scheduler's state, which holds for seconds: its rounds are
    # spread over the whole calibration (one after the compute and after each link measurement,
    # SYNC_ROUNDS at the end), so one state does not decide it
    sync_rounds = {}

    def sample_sync(rounds=1):
        for n, waits in _sync_rounds(comm, group, ranks_of_node, cfg, segment, 2, rounds).items():
            sync_rounds.setdefault(n, []).extend(waits)

    sample_sync()
    links = {"intra": {}, "inter": {}}
    for n in link_sizes:
        groups = _pairs_within(ranks_of_node, n)
        color = next(i for i, g in enumerate(groups) if rank in g)
        sub, sub_group = _subgroup(group, comm, color, rank)
        for op in OPS:
            if op == "send_recv" and n != 2:
                continue
            links["intra"].setdefault(op, {})[str(n)] = _fit(
                _measure_op(sub, op, sizes, reps, sub_group), op, n)
            sample_sync()
        phase_done(f"links at {n} ranks")
    if inter:
        # one rank per node per group: local rank i of every node together
        sub, sub_group = _subgroup(group, comm,
                                   ranks_of_node[names.index(host_of[rank])].index(rank), rank)
        n = sub.Get_size()
        for op in OPS:
            if op == "send_recv" and n != 2:
                continue
            links["inter"].setdefault(op, {})[str(n)] = _fit(
                _measure_op(sub, op, sizes, reps, sub_group), op, n)
        phase_done("inter-node links")
    else:
        links["inter"] = default_profile().links["inter"]
        notes.append("inter-node links not measured (one node): the default profile's are used")
    if not links["intra"]:
        links["intra"] = default_profile().links["intra"]
        notes.append("intra-node links not measured (one rank per node): defaults used")
    sample_sync(SYNC_ROUNDS)
    sync = _sync_median(sync_rounds, segment)
    phase_done("sync")
    notes.append(f"calibration took {time.perf_counter() - t_start:.1f} s")
    facts = broadcast_json(group, _machine_facts(comm, len(names)) if rank == 0 else None)
    profile = HardwareProfile(
        source=f"calibrated on {facts['host']} at {facts['date']} ({size} ranks, "
               f"{len(names)} node(s))",
        ranks_per_node=ranks_per_node, cores_per_node=cores, contention=float(contention),
        effective_cores=float(effective), wait_weight=float(wait_weight),
        ref_busy_ms={str(k): float(v) for k, v in busy_ms.items()}, sync_s=sync,
        links=links, machine=facts, notes=notes,
        ref_model={"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                   "vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len,
                   "tie_embeddings": cfg.tie_embeddings, "micro_batch": micro_batch},
        ref_ms=float(ref_ms), clock="cpu",
        **{k: (v if k in ("ref_small", "ref_block") else float(v)) for k, v in rates.items()})
    # rank 0's measurements on every rank (the JSON a saved profile holds)
    return HardwareProfile.from_dict(broadcast_json(group, asdict(profile) if rank == 0 else None))
