"""`Layout`: one training job's parallel layout, and the one place its rules live.

    layout = Layout(dp=2, tp=2, pp=1, sp=1, micro_batches=2, zero_stage=1)
    layout.check(world_size=4, model=cfg, global_batch=32)   # ConfigError naming EVERY problem
    layout.reasons(4, cfg, 32)                                # ["rule: explanation", ...] or []

A Layout holds the degrees (dp, tp, pp, sp; mesh order in rtxmpi.mesh), the micro-batches per
step, the pipeline schedule and its virtual stages, the ZeRO stage, the offload, the activation
recomputation policy and Megatron sequence parallelism. `reasons` checks, all at once:
    world size  dp * tp * pp * sp == world_size (dp=None: world_size / (tp * pp * sp))
    schedule    a known one; with pp > 1 it is built and simulated (rtxmpi.parallel.schedule:
                1F1B needs micro_batches >= pp, interleaved a multiple of pp and virtual stages
                >= 2); virtual stages only with pp > 1 and the interleaved schedule
    zero        stage in ZERO_STAGES; with pp > 1 only PIPELINE_ZERO_STAGES, stage 3 there with
                tp = sp = 1
    offload     one of OFFLOADS; needs ZeRO stage >= 1; not with pp > 1
    recompute   one of RECOMPUTE (or unit indices: the Model checks those)
    sequence    sequence_parallel needs tp > 1; seq_len divisible by sp (tp * sp with
                sequence_parallel); sequence_parallel refused by a model that needs every
                position (under sp its whole-sequence units run whole on every sp rank)
    model       heads divisible by tp * sp, vocabulary and tensor-parallel widths by tp, at least
                one unit per (virtual) pipeline stage — read from ModelFacts, which a GPTConfig,
                a ViTConfig, any rtxmpi.nn Model or an object with `layout_facts()` gives
    batch       the split rtxmpi.data runs (batch_split, micro_batch_split; equal with pp > 1)
Each reason is 'rule: explanation'; the rule names the group above ("world size", "schedule" or
the schedule's name, "zero", "offload", "recompute", "sequence", "heads", "vocab", "width",
"layers", "batch", "micro-batches"), so the planner can count rejections by it.

The engines (hybrid, pipeline), the planner, the elastic re-plan and the command lines ask this
module and restate none of it. Pure and local: the same verdict on every rank. It imports no engine.
"""
import math
from dataclasses import dataclass, replace

from ..data import batch_split, micro_batch_split
from ..errors import ConfigError
from ..mesh import degree_problems as _degree_problems
from ..mesh import is_degree as _is_degree
from ..mesh import resolve_degrees
from ..nn.module import RECOMPUTE, Model
from ..nn.modules import WHOLE_HEAD, WHOLE_INPUT, PatchEmbedding
from .schedule import SCHEDULES as _SCHEDULE_OPS
from .schedule import build_schedule

SCHEDULES = tuple(_SCHEDULE_OPS)          # pipeline schedules: "gpipe", "1f1b", "interleaved"
ZERO_STAGES = (0, 1, 2, 3)                # 0: replicated optimizer (rtxmpi.parallel.zero)
PIPELINE_ZERO_STAGES = (0, 1, 2, 3)       # under pp > 1 (rtxmpi.parallel.pipeline_zero)
OFFLOADS = ("none", "cpu", "nvme")        # ZeRO offload (rtxmpi.parallel.offload)
WHOLE_SEQUENCE = WHOLE_INPUT + WHOLE_HEAD  # modules that need every position of a sample

__all__ = ["Layout", "ModelFacts", "model_facts", "no_positions", "resolve_degrees",
           "auto_micro_batches", "SCHEDULES", "ZERO_STAGES", "PIPELINE_ZERO_STAGES", "OFFLOADS", "RECOMPUTE"]


# ------------------------------------------------------------------------------- model facts
@dataclass(frozen=True)
class ModelFacts:
    """What the layout rules read of a model.

    n_units: units a pipeline places in stages (a transformer's blocks), each stage needs one;
    n_head: attention heads (split over tp * sp; None: none); vocab_size: rows of a vocabulary-split
    table (over tp; None: none); widths: the other dims tensor parallelism splits (over tp);
    seq_len: positions per sample (None: given to check); whole_sequence: the name of a module
    that needs every position of a sample (sequence_parallel refused; under sp it runs whole on
    every sp rank), or None; name: for messages."""

    n_units: int
    n_head: int = None
    vocab_size: int = None
    widths: tuple = ()
    seq_len: int = None
    whole_sequence: str = None
    name: str = "model"


def _leaves(module):
    children = getattr(module, "children", None)
    if children is None:
        return [module]
    return [leaf for child in children for leaf in _leaves(child)]


def _facts_of_modules(modules):
    leaves = [leaf for m in modules for leaf in _leaves(m)]
    heads = [int(m.n_head) for m in leaves if isinstance(getattr(m, "n_head", None), int)]
    vocab, widths = [], set()
    for m in leaves:
        for d in m.param_specs():
            if d.split == "vocab":
                vocab.append(d.shape[0])
            elif d.split == "column":
                widths.add(d.shape[-1])
            elif d.split == "row":
                widths.add(d.shape[0])
    whole = next((type(m).__name__ for m in leaves if isinstance(m, WHOLE_SEQUENCE)), None)
    return ModelFacts(n_units=max(len(modules) - 2, 1), n_head=math.gcd(*heads) if heads else None,
                      vocab_size=math.gcd(*vocab) if vocab else None, widths=tuple(sorted(widths)),
                      whole_sequence=whole, name="the model")


def model_facts(model):
    """ModelFacts of `model`: a ModelFacts; an object with `layout_facts()` (returning one); a
    GPTConfig or ViTConfig (or a model holding one as `.cfg`); an rtxmpi.nn Model or a list of
    its units (units between the first and the last are the pipeline's; heads, vocabulary and
    tensor-parallel widths from the modules' declarations). Raises ConfigError otherwise."""
    from ..nn.gpt import GPTConfig
    from ..nn.vit import ViTConfig

    if isinstance(model, ModelFacts):
        return model
    if hasattr(model, "layout_facts"):
        return model.layout_facts()
    cfg = getattr(model, "cfg", model)
    if isinstance(cfg, GPTConfig):
        return ModelFacts(n_units=cfg.n_layer, n_head=cfg.n_head, vocab_size=cfg.vocab_size,
                          seq_len=cfg.seq_len, name="GPT")  # widths: C, 4C divide as heads do
    if isinstance(cfg, ViTConfig):
        return ModelFacts(n_units=cfg.n_layer, n_head=cfg.n_head, seq_len=cfg.seq_len,
                          whole_sequence=PatchEmbedding.__name__, name="ViT")
    if isinstance(model, Model):
        return _facts_of_modules(model.modules)
    if isinstance(model, (list, tuple)):
        return _facts_of_modules([m[1] if isinstance(m, tuple) else m for m in model])
    raise ConfigError(f"cannot read the layout facts of a {type(model).__name__}: pass a GPTConfig, "
                      "a ViTConfig, an rtxmpi.nn Model, its units or a ModelFacts")


def no_positions(model):
    """model_facts(model) without a sequence length: for an engine, whose model checks each
    batch's positions as it comes (a batch may be shorter than the configured seq_len)."""
    return replace(model_facts(model), seq_len=None)


# -------------------------------------------------------------------------------- the degrees
# --------------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class Layout:
    """One training job's layout. dp, tp, pp, sp: parallel degrees (dp None, the default: the
    world's rest, see `resolved`); micro_batches per step; zero_stage (ZERO_STAGES); schedule: a
    SCHEDULES name with pp > 1 ("none", the default, is "1f1b" there; any, ignored, with
    pp == 1); offload (OFFLOADS); recompute
    (RECOMPUTE, or a list of unit indices, which the Model checks); virtual_stages: chunks per
    pipeline rank (interleaved); sequence_parallel: Megatron sequence parallelism inside tp.
    Constructing one checks nothing: `check`/`reasons`."""

    dp: int = None
    tp: int = 1
    pp: int = 1
    sp: int = 1
    micro_batches: int = 1
    zero_stage: int = 0
    schedule: str = "none"
    offload: str = "none"
    recompute: str = "none"
    virtual_stages: int = 1
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.schedule == "none" and _is_degree(self.pp) and self.pp > 1:
            object.__setattr__(self, "schedule", "1f1b")  # a pipeline's default, as the CLI's

    @property
    def degrees(self):
        return (self.dp, self.tp, self.pp, self.sp)

    def resolved(self, world_size):
        """This layout with dp filled in from world_size when it is None (unchanged when no dp
        fits: `check` says why)."""
        if self.dp is not None:
            return self
        dp, _ = _degree_problems(world_size, None, self.tp, self.pp, self.sp)
        return self if dp is None else replace(self, dp=dp)

    def flags(self):
        """The command-line flags (named as the fields) that run this layout (--offload nvme also needs the
        job's --offload-dir DIR)."""
        out = (f"--dp {self.dp} --tp {self.tp} --pp {self.pp} --sp {self.sp} "
               f"--micro-batches {self.micro_batches} --zero-stage {self.zero_stage}")
        out += f" --schedule {self.schedule}" if self.pp > 1 else ""
        out += f" --virtual-stages {self.virtual_stages}" if self.virtual_stages != 1 else ""
        out += " --sequence-parallel" if self.sequence_parallel else ""
        out += f" --offload {self.offload}" if self.offload != "none" else ""
        return out + (f" --recompute {self.recompute}" if self.recompute != "none" else "")

    def __str__(self):
        dp = "?" if self.dp is None else self.dp
        s = f"dp{dp} tp{self.tp} pp{self.pp} sp{self.sp} m{self.micro_batches} z{self.zero_stage}"
        s += f" {self.schedule}" if self.pp > 1 else ""
        s += f" v{self.virtual_stages}" if self.virtual_stages != 1 else ""
        s += " seq-par" if self.sequence_parallel else ""
        s += f" offload-{self.offload}" if self.offload != "none" else ""
        return s + (f" recompute-{self.recompute}" if self.recompute != "none" else "")

    # -- the rules -------------------------------------------------------------------------------
    def reasons(self, world_size, model=None, global_batch=None, *, seq_len=None,
                batch_name="global batch"):
        """Every reason this layout cannot run, as 'rule: explanation' strings ([] when it can).

        world_size: ranks; model: anything model_facts takes (None: no model rules); global_batch:
        samples per step (None: no batch rules); seq_len: positions per sample (default the
        model's); batch_name: how messages name the global batch (e.g. "--global-batch").
        Pure and local."""
        return [f"{rule}: {text}" for rule, text in
                self.problems(world_size, model, global_batch, seq_len=seq_len,
                              batch_name=batch_name)]

    def check(self, world_size, model=None, global_batch=None, *, seq_len=None,
              batch_name="global batch"):
        """Raise ConfigError naming every problem `reasons` finds (one: its explanation; more:
        all of them, numbered); return this layout with dp resolved. Same arguments as reasons."""
        problems = self.problems(world_size, model, global_batch, seq_len=seq_len,
                                 batch_name=batch_name)
        if len(problems) == 1:
            raise ConfigError(problems[0][1])
        if problems:
            raise ConfigError(f"the layout {self} has {len(problems)} problems: " + "; ".join(
                f"({i}) {text}" for i, (_, text) in enumerate(problems, 1)))
        return self.resolved(world_size)

    def problems(self, world_size, model=None, global_batch=None, *, seq_len=None,
                 batch_name="global batch"):
        """`reasons` as (rule, explanation) pairs, in the order: world size, model, sequence,
        batch, schedule, ZeRO stage, offload, recompute."""
        out = []
        dp, bad = _degree_problems(world_size, self.dp, self.tp, self.pp, self.sp)
        out += [("world size", text) for text in bad]
        if not all(_is_degree(d) for d in (self.tp, self.pp, self.sp)):
            return out  # nothing else can be judged without the degrees
        pp, m, V = self.pp, self.micro_batches, self.virtual_stages
        for name, value in (("micro_batches", m), ("virtual_stages", V)):
            if not _is_degree(value):
                out.append((name.replace("_", "-"), f"{name} must be an integer >= 1, got {value!r}"))
        facts = None if model is None else model_facts(model)
        if facts is not None:
            out += self._model_problems(facts)
        seq_len = seq_len if seq_len is not None else (facts.seq_len if facts else None)
        out += self._sequence_problems(facts, seq_len)
        if global_batch is not None and dp is not None and _is_degree(m):
            out += _batch_problems(global_batch, dp, m, pp > 1, batch_name)
        out += self._schedule_problems(_is_degree(m) and _is_degree(V))
        return out + self._state_problems()

    def _schedule_problems(self, counts_ok):
        pp, m, V, name = self.pp, self.micro_batches, self.virtual_stages, self.schedule
        if name not in SCHEDULES and not (pp == 1 and name == "none"):
            return [("schedule", f"unknown pipeline schedule {name!r}; choose one of "
                                 f"{sorted(SCHEDULES)}")]
        if pp == 1:
            if V != 1:
                return [("schedule", f"--virtual-stages {V} splits each pipeline rank's layers "
                                     "into chunks: it needs --pp > 1 and --schedule interleaved")]
            return []
        if not counts_ok:
            return []
        try:  # the schedule itself decides (built and simulated): 1F1B m >= pp, interleaved ...
            build_schedule(name, m, pp, V)
        except ConfigError as exc:
            return [(name, str(exc))]
        return []

    def _state_problems(self):
        """ZeRO stage and offload, alone and with a pipeline; the recomputation policy."""
        out, pp, z, off = [], self.pp, self.zero_stage, self.offload
        if z not in ZERO_STAGES:
            out.append(("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {z!r}"))
        elif pp > 1 and z not in PIPELINE_ZERO_STAGES:
            out.append(("zero", f"--zero-stage {z} with --pp {pp} is not supported; use one of "
                                f"{PIPELINE_ZERO_STAGES}"))
        elif pp > 1 and z == 3 and (self.tp > 1 or self.sp > 1):
            out.append(("zero", f"--zero-stage 3 with --pp {pp} shards stages of a plain model: "
                                f"tp({self.tp}) and sp({self.sp}) must be 1 (a tensor- or "
                                "sequence-parallel stage is not sharded); use --zero-stage 1 or 2"))
        if off not in OFFLOADS:
            out.append(("offload", f"unknown offload {off!r} (one of {', '.join(OFFLOADS)})"))
        elif off != "none" and z == 0:
            out.append(("offload", f"--offload {off} needs --zero-stage 1, 2 or 3 (stage 0 keeps "
                                   "a replicated optimizer)"))
        elif off != "none" and pp > 1:
            out.append(("offload", f"--offload {off} with --pp {pp} is not supported; use "
                                   "--offload none (ZeRO stages 1 and 2 shard each stage's "
                                   "optimizer state)"))
        if not isinstance(self.recompute, (list, tuple)) and self.recompute not in RECOMPUTE:
            out.append(("recompute", f"unknown recompute policy {self.recompute!r} (one of "
                                     f"{', '.join(RECOMPUTE)})"))
        return out

    def _sequence_problems(self, facts, seq_len):
        out, tp, sp, seq_par = [], self.tp, self.sp, self.sequence_parallel
        if seq_par and tp == 1:
            out.append(("sequence", "Megatron sequence parallelism splits the sequence over tp: "
                                    "it needs tp > 1 (for sequence parallelism without tp use "
                                    "sp, Ulysses)"))
        if facts is not None and facts.whole_sequence and seq_par:
            # under sp such units run whole on every sp rank (rtxmpi.parallel.parallelize)
            out.append(("sequence", f"{facts.whole_sequence} needs every position of a sample, "
                                    f"but Megatron sequence parallelism gives each tp rank only "
                                    f"some; use dp, tp and sp (Ulysses) for {facts.name}"))
        elif seq_len is not None:
            if seq_len % sp:
                out.append(("sequence", f"sequence length {seq_len} is not divisible by sp({sp}); "
                                        f"use a multiple of {sp}"))
            elif seq_par and tp > 1 and seq_len % (tp * sp):
                out.append(("sequence", f"sequence length {seq_len} is not divisible by tp * sp "
                                        f"= {tp * sp} (Megatron sequence parallelism)"))
        return out

    def _model_problems(self, f):
        out, tp, sp, pp, V = [], self.tp, self.sp, self.pp, self.virtual_stages
        if f.n_head is not None and f.n_head % (tp * sp):
            out.append(("heads", f"n_head {f.n_head} is not divisible by tp * sp = {tp * sp}"))
        if f.vocab_size is not None and f.vocab_size % tp:
            out.append(("vocab", f"vocab_size {f.vocab_size} is not divisible by tp {tp}"))
        odd = [w for w in f.widths if w % tp]
        if odd:
            out.append(("width", f"the tensor-parallel widths {odd} of {f.name} are not "
                                 f"divisible by tp {tp}"))
        if pp > f.n_units:
            out.append(("layers", f"--pp {pp} > n_layer {f.n_units}: every pipeline stage needs "
                                  f"at least one transformer block; use --pp <= {f.n_units} or a "
                                  "deeper --model"))
        elif pp > 1 and _is_degree(V) and pp * V > f.n_units:
            out.append(("layers", f"--pp {pp} x --virtual-stages {V} > n_layer {f.n_units}: "
                                  "every virtual stage needs at least one transformer block"))
        return out


def _batch_problems(global_batch, dp, micro_batches, equal, batch_name):
    """The batch split rtxmpi.data runs (never restated here)."""
    try:
        batch_split(global_batch, dp, batch_name, equal=equal)
    except ConfigError as exc:
        return [("batch", str(exc))]
    try:
        micro_batch_split(global_batch, dp, micro_batches, batch_name, equal=equal)
    except ConfigError as exc:
        return [("micro-batches", str(exc))]
    return []


def auto_micro_batches(layout, world_size, model, per_rank_batch):
    """`--micro-batches auto` for `layout` (its micro_batches ignored): 1 without a pipeline
    (pp == 1); with pp > 1 the smallest multiple of pp that divides per_rank_batch (every stage
    busy in the steady state, the largest micro-batch that gives that), else the smallest divisor
    of per_rank_batch that the layout's rules accept (1F1B needs >= pp; interleaved its own
    multiple). Pure and local. Raises ConfigError: the layout's own problems when it fails
    whatever the count (ZeRO-3 with pp, pp > layers, ...), else one naming the per-rank batch."""
    if layout.pp <= 1:
        return 1
    pp, b = layout.pp, per_rank_batch
    divisors = [m for m in range(1, b + 1) if b % m == 0]
    for m in [d for d in divisors if d % pp == 0] + [d for d in divisors if d % pp]:
        if not replace(layout, micro_batches=m).reasons(world_size, model):
            return m
    V = layout.virtual_stages if _is_degree(layout.virtual_stages) else 1
    replace(layout, micro_batches=pp * V).check(world_size, model)  # a count-independent error
    raise ConfigError(f"--micro-batches auto: no number of micro-batches that divides the per-rank "
                      f"batch {b} suits --pp {pp} --schedule {layout.schedule}; make the per-rank "
                      f"batch a multiple of {pp} (raise --global-batch)")
