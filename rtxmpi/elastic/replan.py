"""Re-planning after a shrink (or a relaunch on other ranks): the parallel layout for the new
world size.

A shrink from N to N - k ranks usually breaks dp * tp * pp * sp = world_size. Without `--plan auto`
(which simply plans again for the new size) the layout is chosen by a fixed rule, so every
survivor picks the same one without talking and a user can predict it:

    keep the user's tp, pp and sp if they fit; else drop sp, then pp, then both (keeping tp);
    then the smaller divisors of tp, down to 1 (pure data parallelism); dp fills the rest.

"Fits" means the runtime can run it: dp * tp * pp * sp = new world size; the model divides (heads
by tp * sp, vocabulary by tp, at least one layer per stage); the sequence by sp (by tp * sp under
Megatron sequence parallelism, which is turned off when tp becomes 1); the runtime's own checks
(rtxmpi.parallel.hybrid.check_layout, rtxmpi.parallel.pipeline.check_pipeline: 1F1B needs
micro-batches >= pp, what composes with ZeRO); and the batch: a pipeline needs the global batch
divisible by dp and the per-rank batch by the micro-batches, while without one the global batch
may split unevenly over dp (docs/elastic.md) and the micro-batches are capped at the smallest
per-rank batch. Tensor parallelism is kept longest because a tp group is the most tightly coupled
(collectives in every layer) and usually the reason for the layout (the model's memory).
"""
from ..data import micro_batch_split
from ..errors import ConfigError
from ..parallel.hybrid import check_layout as runtime_check
from ..parallel.pipeline import auto_micro_batches, check_pipeline
from ..parallel.planner import Layout


def _divisors_desc(n):
    return [d for d in range(n, 0, -1) if n % d == 0]


def candidates(tp, pp, sp):
    """(tp, pp, sp) triples in the order the rule tries them (duplicates removed). Pure."""
    order = [(tp, pp, sp), (tp, pp, 1), (tp, 1, sp), (tp, 1, 1)]
    order += [(t, 1, 1) for t in _divisors_desc(tp)[1:]]
    seen, out = set(), []
    for c in order:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def _model_reason(cfg, tp, pp, sp):
    if cfg.n_head % (tp * sp):
        return f"n_head {cfg.n_head} is not divisible by tp * sp = {tp * sp}"
    if cfg.vocab_size % tp:
        return f"vocab_size {cfg.vocab_size} is not divisible by tp {tp}"
    if cfg.n_layer < pp:
        return f"n_layer {cfg.n_layer} < pp {pp} (every stage needs a block)"
    return None


def _batch_reason(global_batch, dp, pp, micro_batches):
    """None when the runtime splits the batch so (rtxmpi.data.micro_batch_split, the pipeline's
    equal rule when pp > 1), else its reason."""
    try:
        micro_batch_split(global_batch, dp, micro_batches, equal=pp > 1)
    except ConfigError as exc:
        return str(exc)
    return None


def replan(world_size, cfg, global_batch, *, tp=1, pp=1, sp=1, micro_batches=1, schedule="1f1b",
           zero_stage=0, sequence_parallel=False, virtual_stages=1):
    """The layout for `world_size` ranks by the module's rule, starting from the user's degrees.

    cfg: rtxmpi.nn.GPTConfig (seq_len is the training sequence length); global_batch: sequences
    per step. micro_batches: None for `--micro-batches auto` (chosen per candidate layout by
    rtxmpi.parallel.pipeline.auto_micro_batches: 1 without pp). virtual_stages: the interleaved schedule's chunks per pipeline rank (checked with
    a kept pp; without pp there are none). Returns (Layout (rtxmpi.parallel.planner),
    sequence_parallel (bool), why: '' when
    the user's tp/pp/sp were kept, else the reason they did not fit). Pure and local (the same
    answer on every rank). Raises ConfigError naming each candidate's reason when none fits.
    """
    if world_size < 1 or global_batch < 1:
        raise ConfigError(f"replan: world_size ({world_size}) and global_batch ({global_batch}) "
                          "must be >= 1")
    reasons = []
    for t, p, s in candidates(tp, pp, sp):
        model = t * p * s
        if world_size % model:
            reasons.append(f"tp {t} x pp {p} x sp {s} = {model} does not divide {world_size} ranks")
            continue
        dp = world_size // model
        m, auto_why = micro_batches, None
        if micro_batches is None and p > 1:  # --micro-batches auto, for this layout's batch
            try:
                m = auto_micro_batches(pp=p, per_rank_batch=max(1, global_batch // dp),
                                       schedule=schedule, n_layer=cfg.n_layer,
                                       zero_stage=zero_stage,
                                       virtual_stages=virtual_stages)
            except ConfigError as exc:
                m, auto_why = p, str(exc)
        elif p == 1:
            m = 1 if micro_batches is None else max(1, min(micro_batches, global_batch // dp))
        seq_par = sequence_parallel and t > 1
        layout = Layout(dp, t, p, s, m, zero_stage, schedule if p > 1 else "none")
        why = _model_reason(cfg, t, p, s) or _batch_reason(global_batch, dp, p, m) or auto_why
        if why is None:
            try:
                runtime_check(world_size, dp=dp, tp=t, pp=p, sp=s, seq_len=cfg.seq_len,
                              zero_stage=zero_stage, sequence_parallel=seq_par)
                check_pipeline(pp=p, micro_batches=m, schedule=schedule, n_layer=cfg.n_layer,
                               zero_stage=zero_stage, virtual_stages=virtual_stages if p > 1 else 1)
                if seq_par and cfg.seq_len % (t * s):
                    raise ConfigError(f"sequence length {cfg.seq_len} is not divisible by "
                                      f"tp * sp = {t * s} (Megatron sequence parallelism)")
            except ConfigError as exc:
                why = str(exc)
        if why is None:
            return layout, seq_par, "" if (t, p, s) == (tp, pp, sp) else reasons[0]
        reasons.append(f"{layout}: {why}")
    raise ConfigError(f"no parallel layout fits {world_size} ranks (elastic re-plan): "
                      + "; ".join(reasons))


def describe(dp, tp, pp, sp):
    """'dp 2 x tp 2 x pp 1 x sp 1'."""
    return f"dp {dp} x tp {tp} x pp {pp} x sp {sp}"


__all__ = ["replan", "candidates", "describe"]
