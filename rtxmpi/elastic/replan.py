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
(rtxmpi.parallel.layout.Layout's rules: 1F1B needs micro-batches >= pp, what composes with
ZeRO); and the batch: a pipeline needs the global batch divisible by dp and the per-rank batch
by the micro-batches, while without one the global batch may split unevenly over dp
(docs/elastic.md) and the micro-batches are capped at the smallest per-rank batch. Tensor
parallelism is kept longest because a tp group is the most tightly coupled (collectives in every
layer) and usually the reason for the layout (the model's memory).
"""
from dataclasses import replace

from ..errors import ConfigError
from ..parallel.layout import Layout, auto_micro_batches


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


def replan(world_size, cfg, global_batch, *, tp=1, pp=1, sp=1, micro_batches=1, schedule="1f1b",
           zero_stage=0, sequence_parallel=False, virtual_stages=1):
    """The layout for `world_size` ranks by the module's rule, starting from the user's degrees.

    cfg: what rtxmpi.parallel.layout.model_facts takes, e.g. a GPTConfig (its seq_len is the
    training sequence length); global_batch: sequences per step. micro_batches: None for
    `--micro-batches auto` (chosen per candidate by rtxmpi.parallel.layout.auto_micro_batches: 1
    without pp). virtual_stages: the interleaved schedule's chunks per pipeline rank (checked
    with a kept pp; without pp there are none). Returns (Layout (rtxmpi.parallel.layout),
    sequence_parallel (bool), why: '' when the user's tp/pp/sp were kept, else the reason they
    did not fit). Pure and local (the same answer on every rank). Raises ConfigError naming each
    candidate's reasons when none fits (Layout.problems).
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
        layout = Layout(dp, t, p, s, 1, zero_stage, schedule if p > 1 else "none",
                        virtual_stages=virtual_stages if p > 1 else 1,
                        sequence_parallel=sequence_parallel and t > 1)
        why = []
        if p == 1:
            m = 1 if micro_batches is None else max(1, min(micro_batches, global_batch // dp))
        elif micro_batches is None:  # --micro-batches auto, for this layout's batch
            try:
                m = auto_micro_batches(layout, world_size, cfg, max(1, global_batch // dp))
            except ConfigError as exc:
                m, why = p, [str(exc)]
        else:
            m = micro_batches
        layout = replace(layout, micro_batches=m)
        why = [text for _, text in layout.problems(world_size, cfg, global_batch)] or why
        if not why:
            return layout, layout.sequence_parallel, "" if (t, p, s) == (tp, pp, sp) else reasons[0]
        reasons.append(f"{layout}: {'; '.join(why)}")
    raise ConfigError(f"no parallel layout fits {world_size} ranks (elastic re-plan): "
                      + "; ".join(reasons))


def describe(dp, tp, pp, sp):
    """'dp 2 x tp 2 x pp 1 x sp 1'."""
    return f"dp {dp} x tp {tp} x pp {pp} x sp {sp}"


__all__ = ["replan", "candidates", "describe"]
