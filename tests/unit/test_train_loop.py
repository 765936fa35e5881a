"""rtxmpi.train in one process: TrainConfig's checks, and fit() with a task of its own (the ViT on
the digits) checkpointing, resuming and refusing what it should."""
import json

import numpy as np
import pytest

from rtxmpi.errors import CheckpointError, ConfigError
from rtxmpi.train import Parts, Task, TrainConfig, build_engine, fit, flag_names
from rtxmpi.train.metrics import count, drop_metrics_after, metrics_line


def test_config_messages_name_the_field_or_the_mapped_flag():
    with pytest.raises(ConfigError, match=r"^stop_after_step needs ckpt_dir DIR$"):
        TrainConfig(steps=5, stop_after_step=2).validate(1)
    with pytest.raises(ConfigError, match=r"^--stop-after-step needs --ckpt-dir DIR$"):
        TrainConfig(steps=5, stop_after_step=2, names=flag_names()).validate(1)
    with pytest.raises(ConfigError, match=r"warmup_steps 9 must be in \[0, steps 5\]"):
        TrainConfig(steps=5, warmup_steps=9).validate(1)
    with pytest.raises(ConfigError, match=r"min_ranks 3 must be in \[1, world_size 2\]"):
        TrainConfig(min_ranks=3).validate(2)
    with pytest.raises(ConfigError, match="elastic 'expand'"):
        TrainConfig(elastic="expand").validate(1)
    TrainConfig().validate(1)


def test_config_derived_settings():
    config = TrainConfig(steps=100, lr=1e-3, run_dir="runs/a")
    assert config.final_lr == pytest.approx(1e-4) and config.warmup == 5
    assert config.metrics_path == "runs/a/metrics.jsonl" and config.last_step == 100
    assert TrainConfig(steps=10, stop_after_step=4, warmup_steps=0).last_step == 4


def test_metrics_lines_are_strict_json_and_a_resume_drops_later_steps(tmp_path):
    line = metrics_line({"step": 1, "loss": float("nan"), "grad_norm": 2.0, "skipped": True})
    assert json.loads(line) == {"step": 1, "loss": None, "grad_norm": None, "skipped": True}
    path = tmp_path / "m.jsonl"
    path.write_text("".join(metrics_line({"step": s}) for s in range(1, 6)) + '{"step": 6, "lo')
    drop_metrics_after(path, 3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()[:3]] == [1, 2, 3]
    assert count(2, "loss") == "2 losses"


class Digits(Task):
    """A tiny ViT on the digits: the task a user of rtxmpi.train writes."""

    name = "digits"

    def __init__(self, patch=2):
        from rtxmpi.data_vision import load_digits
        from rtxmpi.nn import ViTConfig

        self.data, self.cfg = load_digits(0.2), ViTConfig.named("tiny", patch_size=patch)

    def build(self, world, config):
        from rtxmpi.data_vision import ImageBatchSampler
        from rtxmpi.nn import AdamW, ViT

        model = ViT(self.cfg)
        engine = build_engine(model, world, zero_stage=0,
                              optimizer=lambda p, mask: AdamW(p, lr=config.lr, decay_mask=mask))
        sampler = ImageBatchSampler(self.data.train_images, self.data.train_labels,
                                    config.global_batch, dp_rank=world.rank, dp_size=world.world_size)
        return Parts(model, engine, sampler, tokens_per_step=config.global_batch, unit="images")

    def evaluate(self, world, parts, config):
        loss, _ = parts.model.forward(self.data.val_images[:50], self.data.val_labels[:50])
        return float(loss)

    def checkpoint_meta(self):
        return {"patch": self.cfg.patch_size}

    def check_checkpoint(self, meta, path):
        if meta["patch"] != self.cfg.patch_size:
            raise CheckpointError(f"{path}: patch {meta['patch']} != {self.cfg.patch_size}")


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def test_fit_stops_with_a_checkpoint_and_resumes_bitwise(tmp_path, capsys):
    pytest.importorskip("sklearn")
    common = dict(steps=8, global_batch=16, warmup_steps=1, eval_every=0, progress=False)
    straight = fit(Digits(), TrainConfig(**common, metrics_jsonl=str(tmp_path / "a.jsonl")))
    ckpt, metrics = str(tmp_path / "ck"), tmp_path / "b.jsonl"
    stopped = fit(Digits(), TrainConfig(**common, ckpt_dir=ckpt, stop_after_step=4,
                                        metrics_jsonl=str(metrics)))
    assert stopped["step"] == 4 and "val_loss" not in stopped
    assert "stopped after step 4 (stop_after_step); checkpoint of step 4 committed" in capsys.readouterr().out
    resumed = fit(Digits(), TrainConfig(**common, ckpt_dir=ckpt, resume=True, metrics_jsonl=str(metrics)))
    assert "continuing at step 5" in capsys.readouterr().out
    assert losses(metrics) == losses(tmp_path / "a.jsonl")  # same world size: bit for bit
    assert resumed["loss"] == straight["loss"] and resumed["val_loss"] == straight["val_loss"]
    assert np.isfinite(resumed["val_loss"])


def test_fit_refuses_a_checkpoint_of_another_model_and_a_used_directory(tmp_path):
    pytest.importorskip("sklearn")
    ckpt = str(tmp_path / "ck")
    fit(Digits(), TrainConfig(steps=2, global_batch=16, ckpt_dir=ckpt, progress=False))
    with pytest.raises(CheckpointError, match="patch 2 != 4"):
        fit(Digits(patch=4), TrainConfig(steps=4, global_batch=16, ckpt_dir=ckpt, resume=True,
                                         progress=False))
    with pytest.raises(ConfigError, match=r"ckpt_dir .* already holds checkpoints \(latest step 2\); "
                                          r"pass resume or use an empty directory"):
        fit(Digits(), TrainConfig(steps=4, global_batch=16, ckpt_dir=ckpt, progress=False))
