"""The cluster planner (rtxmpi.parallel.cluster): its costs against published formulas and runs,
its search, and `rtxmpi plan --profile CLUSTER_PROFILE`."""
import importlib.util
import json
import os

import pytest

from rtxmpi import cli
from rtxmpi.nn.gpt import GPTConfig
from rtxmpi.nn.vit import ViTConfig
from rtxmpi.parallel.cluster import (ClusterLayout, Options, _Model, cluster_estimate,
                                     cluster_plan, collective_seconds, enumerate_cluster_layouts,
                                     layout_problems)
from rtxmpi.parallel.cluster_profile import load_cluster_profile

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "published_layouts.json")
A100 = load_cluster_profile("dgx-a100")
V, S = 51200, 2048


def _sets():
    with open(DATA) as f:
        return json.load(f)["sets"]


def _rows():
    return [pytest.param(st, dict(zip(st["columns"], row)), id=f"{st['name'].split()[0]}-{row[0]}B")
            for st in _sets() for row in st["rows"]]


def _load_bench():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "cluster_planner.py")
    spec = importlib.util.spec_from_file_location("cluster_planner_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_published = _load_bench().published_setup  # (config, layout, options) of a published row


# ------------------------------------------------------------------ the published table
@pytest.mark.parametrize("st, r", _rows())
def test_published_layout_is_admitted_predicted_within_15_percent_and_not_beaten_by_the_pick(st, r):
    cfg, L, opt = _published(st, r)
    profile = load_cluster_profile(st["profile"])
    assert layout_problems(cfg, L, r["global_batch"], r["gpus"], profile) == []
    e = cluster_estimate(cfg, L, r["global_batch"], profile, opt)
    assert e.peak_bytes <= profile.usable_bytes, f"{L} refused: {e.peak_bytes / 2**30:.1f} GiB"
    if st["metric"] == "tflops_per_gpu":
        ratio = e.tflops_per_device / r["tflops_per_gpu"]
    else:
        ratio = r["step_s"] / e.step_s  # predicted throughput / published
    assert 0.85 <= ratio <= 1.15, f"predicted / published throughput {ratio:.3f}"
    plan = cluster_plan(cfg, r["global_batch"], r["gpus"], profile, opt)
    assert plan.best.step_s <= e.step_s * (1 + 1e-9)
    assert any(x.layout == L for x in plan.ranked)  # the search reaches the published layout


# ------------------------------------------------------- rows checked without the table's numbers
@pytest.mark.parametrize("st, r", [p for p in _rows() if "Narayanan" in p.values[0]["name"]])
def test_hardware_flops_equal_narayanans_formula(st, r):
    """96 B s l h^2 (1 + s / 6h + V / 16 l h): the FLOPs with full recomputation, eq. (3) of
    Narayanan et al. 2021; ours come from the module declarations (biases and LayerNorms add
    a few parts in 10^4)."""
    B, l, h = r["global_batch"], r["n_layer"], r["n_embd"]
    cfg, _, _ = _published(st, r)
    theirs = 96 * B * S * l * h * h * (1 + S / (6 * h) + V / (16 * l * h))
    ours = _Model(cfg).hardware_flops_per_sample("full") * B
    assert ours == pytest.approx(theirs, rel=2e-3)


@pytest.mark.parametrize("st, r", [p for p in _rows() if "Korthikanti" in p.values[0]["name"]])
def test_model_flops_reproduce_korthikantis_mfu_from_their_step_time(st, r):
    cfg, _, _ = _published(st, r)
    flops = _Model(cfg).model_flops_per_sample() * r["global_batch"]
    mfu = flops / (r["step_s"] * r["gpus"] * 312e12)
    assert 100 * mfu == pytest.approx(r["mfu_percent"], abs=0.6)


def test_1t_published_layout_needs_recomputation_and_fits_with_it():
    """Korthikanti et al. 2022, Table 2: without recomputation a 1T layer keeps
    s b h (10 + 24 / t) + 5 a s^2 b / t bytes per micro-batch; 64 in flight on the first stage of
    pp 64 is far above 80 GB. With full recomputation each layer keeps 2 s b h."""
    cfg = GPTConfig(vocab_size=V, seq_len=S, n_layer=128, n_head=160, n_embd=25600)
    L = ClusterLayout(6, 8, 64, 1, 512, "1f1b", recompute="none")
    e = cluster_estimate(cfg, L, 3072, A100, Options(overlap_grad_reduce=False))
    sbh = S * 25600
    per_layer = sbh * (10 + 24 / 8) + 5 * 160 * S * S / 8
    assert e.memory["activations"] >= 64 * 2 * per_layer
    assert e.peak_bytes > A100.usable_bytes
    full = cluster_estimate(cfg, ClusterLayout(6, 8, 64, 1, 512, "1f1b", recompute="full"), 3072,
                            A100, Options(overlap_grad_reduce=False))
    assert full.memory["activations"] == pytest.approx(64 * (2 * 2 * sbh + sbh * 2), rel=1e-6)
    assert full.peak_bytes <= A100.usable_bytes


def test_sequence_parallel_selective_activations_are_34_sbh_over_t():
    cfg = GPTConfig(vocab_size=V, seq_len=S, n_layer=8, n_head=64, n_embd=6144)
    L = ClusterLayout(1, 8, 1, 1, 1, recompute="selective", sequence_parallel=True)
    e = cluster_estimate(cfg, L, 1, A100)
    logits = 4 * S * V / 8
    per_layer = 34 * S * 6144 / 8
    assert e.memory["activations"] == pytest.approx(8 * per_layer + S * 6144 * 2 / 8 + logits)


def test_mixed_precision_state_is_18_bytes_per_parameter_and_zero_shards_it():
    cfg = GPTConfig(vocab_size=V, seq_len=S, n_layer=24, n_head=24, n_embd=2304)
    P = _Model(cfg).costs.num_params
    state = {}
    for z in (0, 1, 2, 3):
        m = cluster_estimate(cfg, ClusterLayout(8, 1, 1, 1, 1, zero_stage=z), 8, A100).memory
        state[z] = m["params"] + m["grads"] + m["optimizer"]
    assert state[0] == pytest.approx(18 * P, rel=1e-3)  # bf16 2 + fp32 grad 4 + master 4 + Adam 8
    assert state[1] == pytest.approx((6 + 12 / 8) * P, rel=1e-3)
    assert state[2] == pytest.approx((2 + 16 / 8) * P, rel=1e-3)
    assert state[3] == pytest.approx(18 / 8 * P, rel=1e-3)


# ------------------------------------------------------------------------- the cost model
def test_pipeline_bubble_is_p_minus_1_over_v_m_for_equal_stages():
    cfg = GPTConfig(vocab_size=64, seq_len=S, n_layer=64, n_head=32, n_embd=4096)
    for sched, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
        L = ClusterLayout(1, 8, 8, 1, 32, sched, v, recompute="full")
        e = cluster_estimate(cfg, L, 32, A100)
        per_micro_batch = (e.compute_s + e.tp_comm_s) / 32
        assert e.bubble_s / (32 * per_micro_batch) == pytest.approx(7 / (v * 32), rel=0.02)


def test_hierarchical_all_reduce_inside_a_node_is_a_ring_and_nics_are_shared():
    p, n = A100, 2**30
    eff_intra, eff_inter = p.efficiency(n, False), p.efficiency(n / 8, True)
    ring = 2 * 7 / 8 * n / (p.intra_gbps * 1e9 * eff_intra) + 2 * 7 * p.intra_latency_us * 1e-6
    assert collective_seconds(p, "all_reduce", n, 8, 8) == pytest.approx(ring)
    # 8 per node on 4 nodes: inside-node reduce-scatter / all-gather, then 1/8 over the NICs,
    # each device with nics_per_node * nic_gbps / devices_per_node of them
    inter = 2 * 3 / 4 * (n / 8) / (p.nic_gbps * 1e9 * eff_inter) + 2 * 3 * p.inter_latency_us * 1e-6
    assert collective_seconds(p, "all_reduce", n, 32, 8) == pytest.approx(ring + inter)
    # one device per node (dp stride 8 when tp = 8): everything over the shared NICs
    assert collective_seconds(p, "all_reduce", n, 4, 1) > collective_seconds(p, "all_reduce", n, 4, 4)


def test_overlap_hides_the_gradient_reduction_except_the_last_bucket():
    cfg = GPTConfig(vocab_size=V, seq_len=S, n_layer=24, n_head=24, n_embd=2304)
    L = ClusterLayout(32, 1, 1, 1, 16, recompute="full")
    off = cluster_estimate(cfg, L, 512, A100, Options(overlap_grad_reduce=False))
    on = cluster_estimate(cfg, L, 512, A100, Options(overlap_grad_reduce=True))
    assert 0 < on.dp_exposed_s < off.dp_exposed_s
    assert on.step_s < off.step_s


def test_a_vit_plans_from_its_declarations():
    plan = cluster_plan(ViTConfig.named("base"), 256, 16, A100)
    assert plan.best is not None and plan.best.mfu > 0
    assert all(not layout_problems(ViTConfig.named("base"), e.layout, 256, 16, A100)
               for e in plan.ranked[:20])


# ------------------------------------------------------------------------------ the search
def test_1t_search_reaches_every_micro_batch_count_and_megatrons_layout():
    cfg = GPTConfig(vocab_size=V, seq_len=S, n_layer=128, n_head=160, n_embd=25600)
    layouts = enumerate_cluster_layouts(cfg, 3072, 3072, A100)
    counts = {L.micro_batches for L in layouts if (L.dp, L.tp, L.pp) == (6, 8, 64)}
    assert counts == {c for c in range(64, 513) if 512 % c == 0}  # 1F1B: m >= pp
    assert ClusterLayout(6, 8, 64, 1, 512, "1f1b", recompute="full") in layouts
    assert all(L.tp <= 8 and 160 % L.tp == 0 and 128 % L.pp == 0 for L in layouts)
    sample = layouts[:: max(1, len(layouts) // 200)]
    assert all(layout_problems(cfg, L, 3072, 3072, A100) == [] for L in sample)


@pytest.mark.parametrize("L, rule", [
    (ClusterLayout(2, 16, 1, 1, 1), "tp"),
    (ClusterLayout(8, 4, 1, 1, 1, sequence_parallel=False), "batch"),
    (ClusterLayout(1, 4, 8, 1, 4, "1f1b"), "1f1b"),
    (ClusterLayout(1, 4, 8, 1, 12, "interleaved", 2), "interleaved"),
    (ClusterLayout(2, 4, 4, 1, 8, "1f1b", zero_stage=3), "zero"),
    (ClusterLayout(1, 1, 3, 1, 8, "1f1b"), "layers"),
    (ClusterLayout(1, 1, 1, 1, 8, recompute="blocks"), "recompute"),
])
def test_layout_problems_name_the_rule(L, rule):
    cfg = GPTConfig(vocab_size=V, seq_len=S, n_layer=32, n_head=32, n_embd=4096)
    devices = L.dp * L.tp * L.pp
    problems = layout_problems(cfg, L, 8 if rule != "batch" else 7, devices, A100)
    assert any(p.startswith(rule + ":") for p in problems), problems


# --------------------------------------------------------------------------- rtxmpi plan
GPT_1T = ["--n-layer", "128", "--n-head", "160", "--n-embd", "25600", "--vocab-size", "51200",
          "--seq-len", "2048"]


def test_plan_with_a_cluster_profile_prints_the_table_and_the_reason(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    code = cli.main(["plan", "--profile", "dgx-a100", *GPT_1T, "--global-batch", "3072",
                     "--devices", "3072", "--top", "3", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    assert "| # | layout | memory/device | bubble % | exposed comm s | step s | tokens/s |" in out
    assert "Chosen: dp" in out and "MFU" in out and "384 nodes of 8" in out
    data = json.loads(out_json.read_text())
    assert len(data["ranked"]) == 3 and data["ranked"][0]["peak_bytes"] <= A100.usable_bytes


def test_plan_with_a_cluster_profile_and_no_fitting_layout_exits_1(capsys):
    code = cli.main(["plan", "--profile", "dgx-a100", *GPT_1T, "--global-batch", "3072",
                     "--world-size", "3072", "--mem-per-device", "2G"])
    assert code == 1
    assert "No layout fits" in capsys.readouterr().out


def test_a_device_count_no_layout_splits_is_named_as_such(capsys):
    code = cli.main(["plan", "--profile", "dgx-a100", *GPT_1T, "--global-batch", "3072",
                     "--world-size", "30"])
    out = capsys.readouterr().out
    assert code == 1
    assert "No layout of 30 devices: no dp x tp x pp = 30 passes the layout rules" in out
    assert "No layout fits" not in out


@pytest.mark.parametrize("extra", [["--show-rejected"], ["--ranks-per-node", "4"],
                                   ["--recompute", "some"], ["--calibrate"]])
def test_plan_cluster_flag_mistakes_exit_2_with_one_error_line(capsys, extra):
    code = cli.main(["plan", "--profile", "dgx-h100", "--global-batch", "8", "--world-size", "8",
                     *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_cluster_only_flags_without_a_cluster_profile_exit_2(capsys):
    code = cli.main(["plan", "--model", "tiny", "--world-size", "2", "--dtype", "bf16"])
    assert code == 2 and "cluster profile" in capsys.readouterr().err


def test_gpt_size_flags_apply_to_the_cpu_planner_too(capsys):
    code = cli.main(["plan", "--model", "tiny", "--n-layer", "4", "--world-size", "2", "--top", "1"])
    assert code == 0 and "(4 layers" in capsys.readouterr().out


def test_the_runtime_accepts_the_layouts_the_cluster_search_proposes():
    """Layout.reasons, the runtime's own rules, agree with the cluster search for the layouts it
    can run (selective recomputation has no runtime equivalent)."""
    cfg = GPTConfig(vocab_size=512, seq_len=256, n_layer=8, n_head=8, n_embd=512)
    layouts = enumerate_cluster_layouts(cfg, 32, 16, A100, recompute=("none", "full"))
    assert layouts and all(L.runtime_layout() is not None for L in layouts)
    for L in layouts[:: max(1, len(layouts) // 150)]:
        assert L.runtime_layout().reasons(16, cfg, 32) == [], L
    sel = ClusterLayout(2, 8, 1, 1, 16, recompute="selective")
    assert sel.runtime_layout() is None and "not a runtime option" in sel.flags()


def test_offload_moves_master_and_adam_to_the_host_and_pays_the_copies():
    cfg = GPTConfig(vocab_size=V, seq_len=S, n_layer=24, n_head=24, n_embd=2304)
    P = _Model(cfg).stage_params(1)
    on_device = cluster_estimate(cfg, ClusterLayout(8, 1, 1, 1, 1, zero_stage=1), 8, A100)
    offloaded = cluster_estimate(cfg, ClusterLayout(8, 1, 1, 1, 1, zero_stage=1, offload="cpu"), 8,
                                 A100)
    assert on_device.memory["optimizer"] == pytest.approx(12 * P / 8)
    assert offloaded.memory["optimizer"] == 0
    copies = P / 8 * (4 + 2) / (A100.host_link_gbps * 1e9)
    adam = P / 8 * 30 * 8 / (A100.host_memory_gbps * 1e9)  # 8 devices share the node's DRAM
    assert offloaded.optimizer_s == pytest.approx(copies + adam)
    assert offloaded.step_s > on_device.step_s


def test_offload_needs_zero_no_pipeline_and_the_hosts_bandwidths():
    cfg = GPTConfig(vocab_size=V, seq_len=S, n_layer=8, n_head=8, n_embd=1024)
    problems = layout_problems(cfg, ClusterLayout(8, 1, 1, 1, 1, offload="cpu"), 8, 8, A100)
    assert any(p.startswith("offload:") for p in problems)
    cpu = load_cluster_profile("ci-cpu")  # no host_link_gbps: the host is the device
    problems = layout_problems(cfg, ClusterLayout(2, 1, 1, 1, 4, zero_stage=1, offload="cpu"), 8, 2, cpu)
    assert any("host_link_gbps" in p for p in problems)
    both = ("none", "cpu")
    assert all(L.offload == "none" for L in enumerate_cluster_layouts(cfg, 8, 2, cpu, offloads=both))
    layouts = enumerate_cluster_layouts(cfg, 8, 8, A100, offloads=both)
    assert {L.offload for L in layouts if L.zero_stage and L.pp == 1} == {"none", "cpu"}
    assert all(L.offload == "none" for L in layouts if not L.zero_stage or L.pp > 1)


def test_plan_cluster_offload_flag(capsys):
    """7.5B on 8 GPUs in 12 GiB each: only layouts with the master and Adam state on the host fit
    (ZeRO 3 alone keeps 18 / 8 bytes per parameter, 16.9 GB)."""
    args = ["plan", "--profile", "dgx-a100", "--n-layer", "36", "--n-head", "32", "--n-embd", "4096",
            "--vocab-size", "51200", "--seq-len", "2048", "--global-batch", "8", "--world-size", "8",
            "--mem-per-device", "12G"]
    assert cli.main(args) == 1
    capsys.readouterr()
    assert cli.main(args + ["--offload", "none,cpu"]) == 0
    chosen = capsys.readouterr().out.split("Chosen: ")[1].split(" (")[0]
    assert "offload-cpu" in chosen and " z" in chosen
    assert cli.main(["plan", "--profile", "dgx-a100", "--global-batch", "8", "--world-size", "8",
                     "--offload", "nvme"]) == 2


def test_a_missing_profile_names_the_shipped_ones(capsys):
    assert cli.main(["plan", "--profile", "dgx-a10", "--world-size", "2"]) == 2
    assert "dgx-a100" in capsys.readouterr().err


def test_plan_auto_refuses_a_cluster_profile():
    from rtxmpi.errors import ConfigError
    from rtxmpi.parallel.planner import plan_for_job

    with pytest.raises(ConfigError, match="cluster profile"):
        plan_for_job(None, GPTConfig(), 8, profile_path="dgx-a100")


def test_flash_attention_drops_the_score_memory_and_traffic():
    cfg = GPTConfig(vocab_size=V, seq_len=8192, n_layer=8, n_head=64, n_embd=8192)
    L = ClusterLayout(1, 8, 1, 1, 1, sequence_parallel=True)
    plain = cluster_estimate(cfg, L, 1, A100)
    flash = cluster_estimate(cfg, L, 1, A100, Options(flash_attention=True))
    scores = 5 * 64 * 8192 * 8192 / 8  # bytes per block, Korthikanti et al. 2022
    assert plain.memory["activations"] - flash.memory["activations"] == pytest.approx(8 * scores)
    assert flash.step_s < plain.step_s
