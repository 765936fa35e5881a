"""The planner at cluster scale: which (dp, tp, pp) layout, micro-batch size and count, pipeline
schedule, activation recomputation, sequence parallelism and ZeRO stage trains a transformer
fastest on N GPUs described by a ClusterProfile (rtxmpi.parallel.cluster_profile), within the
device memory. Closed forms only (no simulation per layout), so thousands of devices plan in
seconds.

    profile = load_cluster_profile("dgx-a100")
    plan = cluster_plan(GPTConfig(vocab_size=51200, seq_len=2048, n_layer=128, n_head=160,
                                  n_embd=25600), global_batch=3072, devices=3072, profile=profile)
    print(plan.table()); print(plan.reason())

The model side is rtxmpi.parallel.planner.model_costs: per-unit parameter counts from the module
declarations (a GPT, a ViT, a user's Model of the shipped modules), the blocks' width h, heads a,
positions s, the head's width V. Per block and micro-batch of b samples on tp devices, t = tp,
e = bytes per element of the compute dtype:
  FLOPs    forward 2 b s P_block / t (the block's matmuls: ~24 b s h^2 / t) + 4 b s^2 h / t
           (q k^T and att v over the full s x s); backward 2x; recomputation reruns the forward
           ("full") or the attention core ("selective"). Time = FLOPs / achievable FLOP/s.
  memory-bound element-wise work (LayerNorm, bias-dropout-add, GeLU, softmax, dropout, the
           layout changes around attention), bytes moved forward: e (11 b s h, / t under
           sequence parallelism; + 16 b s h / t) + 4.5 e a s^2 b / t; backward 2x; at the
           achievable memory bandwidth.
  tp       Megatron: 2 all_reduce forward and 2 backward of b s h e bytes inside the node (with
           sequence parallelism all_gather + reduce_scatter, the same bytes); full recomputation
           repeats the forward two. Not overlapped with compute.
  head     2 b s h V / t FLOPs forward (a vocabulary-parallel head), 2x backward, and the fp32
           cross-entropy's 3 passes over b s V / t logits.
Pipeline (equal blocks per stage, as Megatron-LM; the first stage also holds the embeddings, the
last the head): with per-micro-batch stage times t_i, m micro-batches and v virtual stages,
    pipeline time = m max(t_i) + (sum(t_i) - max(t_i)) / v + 2 (m v + p - 1) t_p2p
which for equal stages is the 1F1B / interleaved bubble (p - 1) / (v m) of Narayanan et al.
2021; t_p2p sends b s h e / t bytes (scatter-gather) between neighbouring stages, over NVLink when
they share a node (tp * dp < devices per node, mesh order pp, dp, tp as rtxmpi.mesh) else over the
node's NICs shared by its devices.
Data parallelism: the busiest stage's gradient (main_grad_bytes per parameter) is reduced
hierarchically: reduce-scatter over the group's k devices inside a node (NVLink), all_reduce of
1/k of it across the N = dp / k nodes (each device gets nics * nic_gbps / devices_per_node: every
device of a node communicates at once), all_gather inside the node; each step pays the
profile's latency and the bandwidth efficiency at its message size. ZeRO 1-2: reduce_scatter +
all_gather of the parameters; ZeRO 3: per micro-batch the parameters gathered for forward and
backward and the gradients reduce_scattered, overlapped with that micro-batch's compute. With
`overlap_grad_reduce` the reduction runs during the last micro-batch's backward except its last
bucket; without it (Megatron-LM 2021) it is exposed in full. The optimizer (Adam) is
memory-bound: 30 bytes moved per parameter of its shard.
Memory per device (busiest stage; mixed precision, Megatron-LM's accounting): parameters e P,
main gradients main_grad_bytes P, fp32 master 4 P (none when e = 4), Adam 8 P; ZeRO 1 shards the
master and Adam over dp, 2 also the gradients, 3 also the parameters (plus two gathered blocks);
offload "cpu" moves master and Adam to the host, and each step pays the gradient shard out and the
parameters back over host_link_gbps and Adam's 30 bytes per parameter on the node's DRAM
(host_memory_gbps, shared by the node's devices).
Activations per block and micro-batch (Korthikanti et al. 2022, Table 2; e = 2, scaled by e / 2):
none s b h (10 + 24 / t) + 5 a s^2 b / t, with sequence parallelism s b h 34 / t + 5 a s^2 b / t;
selective drops the 5 a s^2 b / t term; full keeps only the block input, 2 s b h (/ t under
sequence parallelism), plus one block's activations rebuilt during backward; with flash
attention (Options.flash_attention) no 5 a s^2 b / t term and no element-wise score traffic,
and backward recomputes q k^T. 1F1B keeps
min(m, p) micro-batches in flight on the first stage, interleaved (1 + (p - 1) / (p v)) times
that; the last stage also keeps the fp32 logits, 4 b s V / t. Peak within memory_gib -
reserved_gib.
Outputs: step time, tokens/s, TFLOP/s per device (hardware FLOPs, recomputation included, as
Narayanan et al. 2021 report) and MFU (model FLOPs without recomputation over the dtype's peak).
Pure and local.
"""
import math
import time
from dataclasses import dataclass

from ..errors import ConfigError
from .cluster_profile import ClusterProfile
from .planner import model_costs

RECOMPUTE_POLICIES = ("none", "selective", "full")
OFFLOADS = ("none", "cpu")  # ZeRO-Offload: master and Adam state in host memory, Adam on the CPU
SCHEDULES = ("1f1b", "interleaved")
ZERO_STAGES = (0, 1, 2, 3)
ADAM_BYTES_MOVED = 30  # per parameter: read grad, master, m, v (16), write master, m, v (12), param (2)
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8: bf16 activations


@dataclass(frozen=True)
class ClusterLayout:
    """One candidate: degrees dp, tp, pp; micro_batch samples per micro-batch and micro_batches
    per step on each data-parallel rank; schedule ("none" for pp = 1, "1f1b", "interleaved"
    with virtual_stages chunks per device); zero_stage; recompute (RECOMPUTE_POLICIES);
    sequence_parallel (Megatron's, inside tp); offload (OFFLOADS: "cpu" keeps the fp32 master
    and Adam state of the ZeRO shard in host memory and runs Adam there)."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    micro_batches: int
    schedule: str = "none"
    virtual_stages: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    offload: str = "none"

    def __str__(self):
        s = f"dp{self.dp} tp{self.tp} pp{self.pp} mb{self.micro_batch}x{self.micro_batches}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        s += " seq-par" if self.sequence_parallel else ""
        s += f" z{self.zero_stage}" if self.zero_stage else ""
        s += f" offload-{self.offload}" if self.offload != "none" else ""
        return s + (f" recompute-{self.recompute}" if self.recompute != "none" else "")

    def runtime_layout(self):
        """The rtxmpi.parallel.layout.Layout that runs this layout (full recomputation is the
        runtime's "blocks"), or None for selective recomputation, which the runtime has not."""
        from .layout import Layout

        if self.recompute == "selective":
            return None
        return Layout(self.dp, self.tp, self.pp, 1, self.micro_batches, self.zero_stage,
                      self.schedule, self.offload, "blocks" if self.recompute == "full" else "none",
                      self.virtual_stages, self.sequence_parallel)

    def flags(self):
        """The examples/train.py layout flags that run this layout; "selective" recomputation has
        no runtime flag (rtxmpi recomputes whole blocks: --recompute blocks is "full")."""
        out = (f"--dp {self.dp} --tp {self.tp} --pp {self.pp} --micro-batches "
               f"{self.micro_batches} --zero-stage {self.zero_stage}")
        if self.pp > 1:
            out += f" --schedule {self.schedule}"
            out += f" --virtual-stages {self.virtual_stages}" if self.virtual_stages > 1 else ""
        out += " --sequence-parallel" if self.sequence_parallel else ""
        out += f" --offload {self.offload}" if self.offload != "none" else ""
        return out + {"none": "", "full": " --recompute blocks",
                      "selective": " (selective recomputation: not a runtime option)"}[self.recompute]


@dataclass(frozen=True)
class Options:
    """What the training software does, which the hardware does not decide.

    dtype: compute dtype (None: the profile's default_dtype); main_grad_bytes: bytes per
    gradient element kept and reduced (4: fp32 main gradients, Megatron-LM's default;
    2: reduced in bf16); overlap_grad_reduce: the data-parallel reduction runs during backward
    and ZeRO-3's gathers during the micro-batch's compute (rtxmpi's bucketed DataParallel,
    Megatron-Core's --overlap-grad-reduce; Megatron-LM 2021 did not); bucket_bytes: the last
    bucket, never overlapped; flash_attention: attention never stores or moves the s x s
    scores (Dao et al. 2022) and its backward recomputes q k^T; off: they are materialized, as
    in Megatron-LM of 2021-22 and rtxmpi's layers."""

    dtype: str = None
    main_grad_bytes: int = 4
    overlap_grad_reduce: bool = True
    bucket_bytes: int = 25 * 2**20
    flash_attention: bool = False


@dataclass
class ClusterEstimate:
    """Predicted cost of one layout: seconds per step and its parts, bytes per device (peak over
    stages), throughput."""

    layout: ClusterLayout
    step_s: float
    compute_s: float
    bubble_s: float
    bubble: float
    tp_comm_s: float
    pp_comm_s: float
    dp_exposed_s: float
    optimizer_s: float
    peak_bytes: float
    memory: dict
    tokens_per_s: float
    tflops_per_device: float
    mfu: float

    @property
    def exposed_comm_s(self):
        return self.tp_comm_s + self.pp_comm_s + self.dp_exposed_s


# --------------------------------------------------------------------------------- collectives
def _ring(profile, nbytes, n, factor, inter, devices_per_node):
    """Seconds of one ring phase over n members moving factor * nbytes per member: the link's
    bandwidth (NVLink per device, or the node's NICs shared by its devices) at the profile's
    efficiency for the message, plus a latency per step."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    p = profile
    if inter:
        bw = p.nics_per_node * p.nic_gbps * 1e9 / devices_per_node
        lat = p.inter_latency_us * 1e-6
    else:
        bw, lat = p.intra_gbps * 1e9, p.intra_latency_us * 1e-6
    moved = factor * (n - 1) / n * nbytes
    return (n - 1) * lat * factor + moved / (bw * p.efficiency(nbytes, inter))


def collective_seconds(profile, op, nbytes, ranks, local_ranks):
    """Seconds of `op` ("all_reduce", "reduce_scatter", "all_gather") of nbytes per rank over
    `ranks` devices, `local_ranks` of them in each node: inside the node a ring over NVLink,
    across nodes a ring over the NICs on nbytes / local_ranks (hierarchical; the two
    all_reduce halves are a reduce_scatter and an all_gather)."""
    if ranks <= 1:
        return 0.0
    k = max(1, min(local_ranks, ranks))
    nodes = math.ceil(ranks / k)
    dpn = profile.devices_per_node
    factor = 2 if op == "all_reduce" else 1
    return (factor * _ring(profile, nbytes, k, 1, False, dpn)
            + _ring(profile, nbytes / k, nodes, factor, True, dpn))


# --------------------------------------------------------------------------------- cost model
class _Model:
    """The model's numbers the cost model reads (from planner.model_costs)."""

    def __init__(self, model):
        c = model_costs(model)
        self.costs = c
        self.h, self.a, self.s, self.V = c.n_embd, c.n_head, c.seq_len, c.head_width
        self.L = c.n_layer
        self.block_params = sum(c.block_params) / self.L
        self.rows = self.s if c.head_per_position else 1  # head rows per sample
        self.head_vocab = c.head_vocab
        self.first_vocab = c.first_vocab
        self.first_params, self.head_params = c.first_params, c.head_params + c.head_tied
        # forward FLOPs per sample without recomputation (model FLOPs)
        self.block_flops = 2 * self.s * self.block_params + 4 * self.s * self.s * self.h
        self.head_flops = 2 * self.rows * self.h * self.V
        self.first_flops = c.first_flops

    def stage_params(self, pp):
        """Parameters of the busiest of pp stages of equal blocks (the first holds the
        embeddings, the last the head and, when pp > 1, its copy of a tied table)."""
        if pp == 1:
            return self.L * self.block_params + self.first_params + self.costs.head_params
        return self.L // pp * self.block_params + max(self.first_params, self.head_params)

    def model_flops_per_sample(self):
        """Forward + backward FLOPs of one sample, no recomputation."""
        return 3 * (self.L * self.block_flops + self.head_flops + self.first_flops)

    def hardware_flops_per_sample(self, recompute):
        extra = {"none": 0.0, "full": self.L * self.block_flops,
                 "selective": self.L * 4 * self.s * self.s * self.h}[recompute]
        return self.model_flops_per_sample() + extra


def _block_times(M, p, L, flops, hbm, e, flash):
    """(forward s, backward s including recomputation, tp comm s) of one block and micro-batch."""
    b, t, s, h, a = L.micro_batch, L.tp, M.s, M.h, M.a
    dense = 2 * b * s * M.block_params / t
    attn = 4 * b * s * s * h / t
    scores = 0.0 if flash else 4.5 * e * a * s * s * b / t  # flash: the scores stay on chip
    elem = e * (11 * b * s * h / (t if L.sequence_parallel else 1) + 16 * b * s * h / t) + scores
    fwd = (dense + attn) / flops + elem / hbm
    bwd = 2 * (dense + attn) / flops + 2 * elem / hbm
    if flash:  # its backward recomputes q k^T
        bwd += attn / 2 / flops
    if L.recompute == "full":
        bwd += fwd
    elif L.recompute == "selective":
        bwd += attn / flops + scores / hbm
    comm = 0.0
    if t > 1:
        x = b * s * h * e
        one = collective_seconds(p, "all_reduce", x, t, t)
        comm = (4 + 2 * (L.recompute == "full")) * one
    return fwd, bwd, comm


def _memory(M, L, p, opt, e):
    """Bytes per device of the busiest stage: a dict of params, grads, optimizer, activations,
    transient, total."""
    b, t, s, h, a, pp, dp = L.micro_batch, L.tp, M.s, M.h, M.a, L.pp, L.dp
    blocks = M.L // pp
    P = M.stage_params(pp) / t
    master = 4 if e < 4 else 0
    params, grads, optim = e * P, opt.main_grad_bytes * P, (master + 8) * P
    z = L.zero_stage
    if z >= 1:
        optim /= dp
    if z >= 2:
        grads /= dp
    if z >= 3:
        params /= dp
    if L.offload == "cpu":
        optim = 0.0  # master and Adam state live in host memory
    sbh = s * b * h
    sp_div = t if L.sequence_parallel else 1
    core = (34 / t if L.sequence_parallel else 10 + 24 / t) * sbh
    full_layer = (core + (0 if opt.flash_attention else 5 * a * s * s * b / t)) * e / 2
    per_block = {"none": full_layer, "selective": core * e / 2, "full": 2 * sbh / sp_div * e / 2}
    kept = per_block[L.recompute]
    in_flight = 1 if pp == 1 else min(L.micro_batches, pp)
    if pp > 1 and L.schedule == "interleaved":
        in_flight *= 1 + (pp - 1) / (pp * L.virtual_stages)
    acts_first = in_flight * (blocks * kept + sbh * e / sp_div)  # + the embedding's output
    logits = 4 * b * M.rows * M.V / (t if M.head_vocab else 1)
    acts_last = blocks * kept + logits if pp > 1 else 0.0
    acts = max(acts_first + (logits if pp == 1 else 0.0), acts_last)
    transient = full_layer if L.recompute == "full" else 0.0
    if z == 3:
        transient += 2 * e * M.block_params / t
    total = params + grads + optim + acts + transient
    return {"params": params, "grads": grads, "optimizer": optim, "activations": acts,
            "transient": transient, "total": total}


def cluster_estimate(model, layout, global_batch, profile, options=Options()):
    """ClusterEstimate of one layout (check it with `layout_problems` first). model: anything
    planner.model_costs takes or a prepared _Model; global_batch: samples per step. Pure."""
    M = model if isinstance(model, _Model) else _Model(model)
    return _estimate(M, layout, global_batch, profile, options, {})


def _estimate(M, L, global_batch, p, opt, cache):
    dtype = opt.dtype or p.default_dtype
    e = DTYPE_BYTES[dtype]
    flops, hbm = p.flops(dtype), p.achievable_hbm_gbps * 1e9
    dpn = p.devices_per_node
    key = (L.micro_batch, L.tp, L.recompute, L.sequence_parallel)
    if key not in cache:
        cache[key] = _block_times(M, p, L, flops, hbm, e, opt.flash_attention)
    fwd, bwd, tp_comm = cache[key]
    b, t, pp, m, v = L.micro_batch, L.tp, L.pp, L.micro_batches, L.virtual_stages
    blocks = M.L // pp
    x = b * M.s * M.h * e  # one activation (b, s, h)
    edge = collective_seconds(p, "all_reduce", x, t, t) if t > 1 else 0.0
    head = (3 * 2 * b * M.rows * M.h * M.V / (t if M.head_vocab else 1) / flops
            + 3 * 3 * 4 * b * M.rows * M.V / (t if M.head_vocab else 1) / hbm
            + edge * M.head_vocab)
    first = 3 * b * M.first_flops / flops + 2 * x / hbm + edge * M.first_vocab
    stage = blocks * (fwd + bwd + tp_comm)
    t_first, t_last = stage + first, stage + head
    if pp == 1:
        stages_sum = t_max = t_first + head
    else:
        stages_sum = stage * (pp - 2) + t_first + t_last
        t_max = max(t_first, t_last)
    bubble_s = (stages_sum - t_max) / v
    p2p = 0.0
    if pp > 1:
        inter = t * L.dp >= dpn
        bw = p.nics_per_node * p.nic_gbps * 1e9 / dpn if inter else p.intra_gbps * 1e9
        lat = (p.inter_latency_us if inter else p.intra_latency_us) * 1e-6
        one = lat + (x / t) / (bw * p.efficiency(x / t, inter))
        p2p = 2 * (m * v + pp - 1) * one
    pipe_s = m * t_max + bubble_s + p2p
    # data parallelism over dp, k of them in a node (tp innermost in the mesh)
    P = M.stage_params(pp) / t
    local = max(1, min(L.dp, dpn // t))
    grad = P * opt.main_grad_bytes
    z = L.zero_stage
    dp_exposed = 0.0
    if L.dp > 1:
        if z == 0:
            dp_s = collective_seconds(p, "all_reduce", grad, L.dp, local)
        elif z in (1, 2):
            dp_s = (collective_seconds(p, "reduce_scatter", grad, L.dp, local)
                    + collective_seconds(p, "all_gather", P * e, L.dp, local))
        else:
            dp_s = 0.0
            per_mb = (2 * collective_seconds(p, "all_gather", P * e, L.dp, local)
                      + collective_seconds(p, "reduce_scatter", grad, L.dp, local))
            work = t_max - blocks * tp_comm if opt.overlap_grad_reduce else 0.0
            dp_exposed = m * max(0.0, per_mb - work) + per_mb / max(1, blocks)
        if z < 3:
            if opt.overlap_grad_reduce:
                last = dp_s * min(1.0, opt.bucket_bytes / grad)
                window = blocks * bwd
                dp_exposed = max(last, dp_s - window)
            else:
                dp_exposed = dp_s
    shard = P / L.dp if z >= 1 else P
    if L.offload == "cpu":  # gradient shard out, parameters back, Adam on the node's DRAM
        sharing = min(dpn, L.dp * t * pp)
        optimizer_s = (shard * (opt.main_grad_bytes + e) / (p.host_link_gbps * 1e9)
                       + shard * ADAM_BYTES_MOVED * sharing / (p.host_memory_gbps * 1e9))
    else:
        optimizer_s = shard * ADAM_BYTES_MOVED / hbm
    step = pipe_s + dp_exposed + optimizer_s
    devices = L.dp * t * pp
    memory = _memory(M, L, p, opt, e)
    hw = M.hardware_flops_per_sample(L.recompute) * global_batch
    model_flops = M.model_flops_per_sample() * global_batch
    peak = p.peak_tflops[dtype] * 1e12
    tp_total = m * (blocks * tp_comm)
    compute = m * t_max - tp_total
    return ClusterEstimate(
        layout=L, step_s=step, compute_s=compute, bubble_s=bubble_s,
        bubble=bubble_s / pipe_s if pp > 1 else 0.0, tp_comm_s=tp_total, pp_comm_s=p2p,
        dp_exposed_s=dp_exposed, optimizer_s=optimizer_s, peak_bytes=memory["total"],
        memory=memory, tokens_per_s=global_batch * M.s / step,
        tflops_per_device=hw / step / devices / 1e12, mfu=model_flops / step / devices / peak)


# ----------------------------------------------------------------------------------- search
def _divisors(n):
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def layout_problems(model, layout, global_batch, devices, profile):
    """Every reason `layout` cannot run (a list of 'rule: explanation', [] when it can), the
    cluster planner's rules: the degrees multiply to `devices`; tp within a node and dividing the
    heads (and a vocabulary-parallel table); pp dividing the blocks; the batch split into dp x
    micro_batch x micro_batches; 1F1B with micro_batches >= pp, interleaved with micro_batches
    a multiple of pp and virtual_stages >= 2 dividing the blocks per stage; sequence
    parallelism with tp > 1 and the positions divisible by tp; ZeRO 3 without pp; ZeRO with
    dp > 1. Pure."""
    M = model if isinstance(model, _Model) else _Model(model)
    L, out = layout, []
    if L.dp * L.tp * L.pp != devices:
        out.append(f"world size: dp({L.dp}) * tp({L.tp}) * pp({L.pp}) != {devices} devices")
    if L.tp > profile.devices_per_node:
        out.append(f"tp: {L.tp} > {profile.devices_per_node} devices per node (tp stays in a node)")
    if M.a % L.tp or (M.head_vocab and M.V % L.tp):
        out.append(f"heads: {M.a} heads (vocabulary {M.V}) not divisible by tp {L.tp}")
    if M.L % L.pp:
        out.append(f"layers: {M.L} blocks not divisible by pp {L.pp}")
    if L.dp * L.micro_batch * L.micro_batches != global_batch:
        out.append(f"batch: dp({L.dp}) * micro_batch({L.micro_batch}) * micro_batches"
                   f"({L.micro_batches}) != global batch {global_batch}")
    if L.pp == 1 and (L.schedule != "none" or L.virtual_stages != 1):
        out.append("schedule: a schedule needs pp > 1")
    if L.pp > 1:
        if L.schedule not in SCHEDULES:
            out.append(f"schedule: {L.schedule!r} is not one of {', '.join(SCHEDULES)}")
        elif L.micro_batches < L.pp:
            out.append(f"{L.schedule}: {L.micro_batches} micro-batches < pp {L.pp}")
        if L.schedule == "interleaved" and (L.micro_batches % L.pp or L.virtual_stages < 2 or
                                            (M.L // L.pp) % L.virtual_stages):
            out.append("interleaved: micro_batches a multiple of pp, virtual_stages >= 2 dividing "
                       "the blocks per stage")
        if L.schedule == "1f1b" and L.virtual_stages != 1:
            out.append("1f1b: virtual stages need the interleaved schedule")
    if L.sequence_parallel and (L.tp == 1 or M.s % L.tp):
        out.append(f"sequence: sequence parallelism needs tp > 1 dividing the {M.s} positions")
    if L.zero_stage not in ZERO_STAGES:
        out.append(f"zero: unknown stage {L.zero_stage}")
    elif L.zero_stage == 3 and L.pp > 1:
        out.append("zero: stage 3 with pp > 1")
    elif L.zero_stage and L.dp == 1:
        out.append("zero: dp = 1 leaves nothing to shard")
    if L.offload not in OFFLOADS:
        out.append(f"offload: {L.offload!r} is not one of {', '.join(OFFLOADS)}")
    elif L.offload != "none" and (not L.zero_stage or L.pp > 1):
        out.append("offload: needs ZeRO stage >= 1 and pp = 1")
    elif L.offload != "none" and not (profile.host_link_gbps and profile.host_memory_gbps):
        out.append(f"offload: the profile {profile.name!r} has no node.host_link_gbps and "
                   f"node.host_memory_gbps")
    if L.recompute not in RECOMPUTE_POLICIES:
        out.append(f"recompute: {L.recompute!r} is not one of {', '.join(RECOMPUTE_POLICIES)}")
    return out


def enumerate_cluster_layouts(model, global_batch, devices, profile, recompute=RECOMPUTE_POLICIES,
                              zero_stages=ZERO_STAGES, schedules=SCHEDULES,
                              max_micro_batches=None, offloads=("none",)):
    """Every valid ClusterLayout (layout_problems is empty for each): tp among the divisors of
    the heads up to the devices per node, pp among the divisors of the blocks, dp the rest
    dividing the batch, every micro-batch size dividing dp's share (so micro-batch counts up to
    the batch), 1F1B and interleaved (each virtual stage count) for pp > 1, each recompute
    policy, sequence parallelism on and off for tp > 1, the ZeRO stages that apply, each of
    `offloads` with ZeRO >= 1 and pp = 1 where the profile gives the host's bandwidths."""
    M = model if isinstance(model, _Model) else _Model(model)
    if set(offloads) - set(OFFLOADS) or not offloads:
        raise ConfigError(f"offloads must be a non-empty subset of {OFFLOADS}, got {offloads!r}")
    host = bool(profile.host_link_gbps and profile.host_memory_gbps)
    out = []
    for tp in _divisors(profile.devices_per_node):
        if devices % tp or M.a % tp or (M.head_vocab and M.V % tp):
            continue
        for pp in _divisors(M.L):
            if (devices // tp) % pp:
                continue
            dp = devices // (tp * pp)
            if global_batch % dp:
                continue
            for b in _divisors(global_batch // dp):
                m = global_batch // (dp * b)
                if (max_micro_batches and m > max_micro_batches) or (pp > 1 and m < pp):
                    continue
                scheds = [("none", 1)] if pp == 1 else []
                if pp > 1 and "1f1b" in schedules:
                    scheds.append(("1f1b", 1))
                if pp > 1 and "interleaved" in schedules and m % pp == 0:
                    scheds += [("interleaved", v) for v in _divisors(M.L // pp) if v > 1]
                seqpar = (False, True) if tp > 1 and M.s % tp == 0 else (False,)
                zs = [z for z in zero_stages if z == 0 or (dp > 1 and not (z == 3 and pp > 1))]
                for sched, v in scheds:
                    for r in recompute:
                        for sq in seqpar:
                            for z in zs:
                                for o in (offloads if z and pp == 1 and host else ("none",)):
                                    out.append(ClusterLayout(dp, tp, pp, b, m, sched, v, z, r, sq, o))
    return out


@dataclass
class ClusterPlan:
    """ranked: admitted estimates, fastest first (at equal time the least memory first);
    rejected_memory: how many valid layouts exceed the device memory; best_rejected: the fastest
    of those (or None); inputs; seconds: the search's wall time; considered: valid layouts
    estimated."""

    ranked: list
    rejected_memory: int
    best_rejected: object
    profile: ClusterProfile
    inputs: dict
    seconds: float = 0.0
    considered: int = 0

    @property
    def best(self):
        return self.ranked[0] if self.ranked else None

    def table(self, top=10):
        """Markdown table of the first `top` layouts."""
        rows = ["| # | layout | memory/device | bubble % | exposed comm s | step s | tokens/s | "
                "TFLOP/s/device | MFU % |", "|---|---|---|---|---|---|---|---|---|"]
        for i, e in enumerate(self.ranked[:top], 1):
            rows.append(f"| {i} | {e.layout} | {e.peak_bytes / 2**30:.1f} GiB | "
                        f"{100 * e.bubble:.1f} | {e.exposed_comm_s:.3f} | {e.step_s:.3f} | "
                        f"{e.tokens_per_s:,.0f} | {e.tflops_per_device:.1f} | {100 * e.mfu:.1f} |")
        if len(self.ranked) > top:
            rows.append(f"({len(self.ranked) - top} more layouts fit; --top K)")
        return "\n".join(rows)

    def reason(self):
        """One paragraph: why the first choice, against the best layout of other degrees."""
        p = self.profile
        if not self.considered:
            n = self.inputs["devices"]
            return (f"No layout of {n} devices: no dp x tp x pp = {n} passes the layout rules (tp "
                    f"divides the heads and at most {p.devices_per_node} devices per node, pp "
                    f"divides the blocks, dp the global batch {self.inputs['global_batch']}; "
                    f"with pp > 1 at least pp micro-batches). Profile: {p.name}.")
        if not self.ranked:
            extra = ""
            if self.best_rejected is not None:
                r = self.best_rejected
                extra = (f"; the fastest of them, {r.layout}, needs {r.peak_bytes / 2**30:.1f} GiB")
            return (f"No layout fits: {self.rejected_memory} of {self.considered} valid layouts "
                    f"exceed {p.usable_bytes / 2**30:.1f} GiB per device ({p.memory_gib:g} GiB - "
                    f"{p.reserved_gib:g} reserved){extra}. Profile: {p.name}.")
        b = self.best
        L = b.layout
        parts = [f"Chosen: {L} ({L.flags()}): predicted {b.step_s:.3f} s per step, "
                 f"{b.tokens_per_s:,.0f} tokens/s, {b.tflops_per_device:.1f} TFLOP/s per device, "
                 f"MFU {100 * b.mfu:.1f}%; compute {b.compute_s:.3f} s, pipeline bubble "
                 f"{b.bubble_s:.3f} s, exposed communication {b.exposed_comm_s:.3f} s (tp "
                 f"{b.tp_comm_s:.3f}, pp {b.pp_comm_s:.3f}, dp {b.dp_exposed_s:.3f}), "
                 f"{b.peak_bytes / 2**30:.1f} GiB of {p.usable_bytes / 2**30:.1f} per device."]
        degrees = (L.dp, L.tp, L.pp)
        other = next((e for e in self.ranked if (e.layout.dp, e.layout.tp, e.layout.pp) != degrees),
                     None)
        if other is not None:
            diffs = sorted([(other.compute_s - b.compute_s, "compute"),
                            (other.bubble_s - b.bubble_s, "bubble"),
                            (other.exposed_comm_s - b.exposed_comm_s, "exposed communication"),
                            (other.optimizer_s - b.optimizer_s, "optimizer")],
                           key=lambda d: -abs(d[0]))
            why = ", ".join(f"{d:+.3f} s {name}" for d, name in diffs if abs(d) >= 5e-4)
            parts.append(f"The best layout of other degrees, {other.layout}, is predicted "
                         f"{other.step_s:.3f} s ({100 * (other.step_s / b.step_s - 1):+.1f}%): "
                         f"{why or 'about the same costs'}.")
        if self.rejected_memory:
            parts.append(f"{self.rejected_memory} of {self.considered} valid layouts exceed the "
                         f"memory" + (f" (the fastest of them, {self.best_rejected.layout}, "
                                      f"{self.best_rejected.step_s:.3f} s, needs "
                                      f"{self.best_rejected.peak_bytes / 2**30:.1f} GiB)"
                                      if self.best_rejected is not None else "") + ".")
        parts.append(f"Searched {self.considered} layouts in {self.seconds:.2f} s. Profile: "
                     f"{p.name} ({p.devices_per_node} devices per node, "
                     f"{self.inputs['dtype']}).")
        return " ".join(parts)


def cluster_plan(model, global_batch, devices, profile, options=Options(),
                 recompute=RECOMPUTE_POLICIES, zero_stages=ZERO_STAGES, schedules=SCHEDULES,
                 max_micro_batches=None, layouts=None, offloads=("none",)):
    """Enumerate, estimate, keep what fits in profile.usable_bytes, rank by step time (at equal
    time the least memory first). model: anything planner.model_costs takes; global_batch:
    samples per step; devices: GPUs; layouts: an explicit candidate list instead. Pure.
    Raises ConfigError on bad inputs (a dtype the profile has no figures for among them)."""
    for name, value in (("global_batch", global_batch), ("devices", devices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if set(recompute) - set(RECOMPUTE_POLICIES) or not recompute:
        raise ConfigError(f"recompute must be a non-empty subset of {RECOMPUTE_POLICIES}, got "
                          f"{recompute!r}")
    dtype = options.dtype or profile.default_dtype
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    profile.flops(dtype)  # raises when the profile has no figure for it
    start = time.perf_counter()
    M = _Model(model)
    candidates = layouts if layouts is not None else enumerate_cluster_layouts(
        M, global_batch, devices, profile, recompute, zero_stages, schedules, max_micro_batches,
        offloads)
    limit = profile.usable_bytes
    ranked, rejected, best_rejected, cache = [], 0, None, {}
    for L in candidates:
        e = _estimate(M, L, global_batch, profile, options, cache)
        if e.peak_bytes > limit:
            rejected += 1
            if best_rejected is None or e.step_s < best_rejected.step_s:
                best_rejected = e
            continue
        ranked.append(e)
    ranked.sort(key=lambda e: (e.step_s, e.peak_bytes))
    inputs = {"global_batch": global_batch, "devices": devices, "dtype": dtype,
              "options": options}
    return ClusterPlan(ranked, rejected, best_rejected, profile, inputs,
                       time.perf_counter() - start, len(candidates))


# --------------------------------------------------------------------------- `rtxmpi plan`
def _estimate_json(e):
    return {"layout": vars(e.layout), "flags": e.layout.flags(), "step_s": e.step_s,
            "compute_s": e.compute_s, "bubble_s": e.bubble_s, "bubble": e.bubble,
            "tp_comm_s": e.tp_comm_s, "pp_comm_s": e.pp_comm_s, "dp_exposed_s": e.dp_exposed_s,
            "optimizer_s": e.optimizer_s, "peak_bytes": e.peak_bytes, "memory": e.memory,
            "tokens_per_s": e.tokens_per_s, "tflops_per_device": e.tflops_per_device,
            "mfu": e.mfu}


def _count(n):
    """1.01T, 175.0B, 6.6M, 202.2K: a parameter count in the unit that suits it."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit in 'TB' else 1}f}{unit}"
    return str(n)


def run_cli(args, model, what, devices, profile):
    """`rtxmpi plan --profile CLUSTER_PROFILE`: print the ranked table and the reason; return
    the exit status (0 planned, 1 nothing fits). Raises ConfigError for bad flags (the caller
    prints it, exit 2)."""
    import json
    from dataclasses import replace

    cpu_only = [flag for flag, given in (("--calibrate", args.calibrate),
                                         ("--ranks-per-node", args.ranks_per_node is not None),
                                         ("--device", args.device != "cpu"),
                                         ("--show-rejected", args.show_rejected)) if given]
    if cpu_only:
        raise ConfigError(f"{', '.join(cpu_only)}: not for a cluster profile ({profile.name}: "
                          f"{profile.devices_per_node} devices per node; rejected layouts are "
                          f"counted in the reason)")
    recompute = tuple(dict.fromkeys(r.strip() for r in args.recompute.split(",") if r.strip()))
    if not recompute or set(recompute) - set(RECOMPUTE_POLICIES):
        raise ConfigError(f"--recompute {args.recompute!r}: comma-separated policies from "
                          f"{', '.join(RECOMPUTE_POLICIES)}")
    if args.mem_per_device:
        from .planner import parse_bytes

        limit = parse_bytes(args.mem_per_device) / 2**30
        profile = replace(profile, memory_gib=limit + profile.reserved_gib)
    offloads = tuple(dict.fromkeys(o.strip() for o in args.offload.split(",") if o.strip()))
    if not offloads or set(offloads) - set(OFFLOADS):
        raise ConfigError(f"--offload {args.offload!r}: with a cluster profile, comma-separated "
                          f"from {', '.join(OFFLOADS)} (nvme is not modeled at cluster scale)")
    options = Options(dtype=args.dtype, overlap_grad_reduce=not args.no_overlap,
                      flash_attention=args.flash_attention)
    plan = cluster_plan(model, args.global_batch, devices, profile, options, recompute=recompute,
                        max_micro_batches=args.max_micro_batches, offloads=offloads)
    nodes = math.ceil(devices / profile.devices_per_node)
    c = model_costs(model)
    print(f"plan: {what} ({c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}, "
          f"{_count(c.num_params)} parameters), global batch {args.global_batch} x "
          f"{c.seq_len} positions, {devices} devices ({nodes} node{'s' if nodes > 1 else ''} of "
          f"{profile.devices_per_node}), {plan.inputs['dtype']}")
    print(f"profile: {profile.name} ({profile.path}): {profile.source}")
    print()
    print(plan.table(top=args.top))
    print()
    print(plan.reason())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inputs": {"model": what, "global_batch": args.global_batch,
                                  "devices": devices, "dtype": plan.inputs["dtype"],
                                  "recompute": recompute},
                       "profile": {"name": profile.name, "path": profile.path},
                       "ranked": [_estimate_json(e) for e in plan.ranked[:max(args.top, 1)]],
                       "rejected_memory": plan.rejected_memory, "considered": plan.considered,
                       "reason": plan.reason()}, f, indent=1)
    return 0 if plan.ranked else 1
