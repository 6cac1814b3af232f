"""Distributed training: two CPU processes under torchrun (DDP over gloo) follow the same loss trajectory as
one process on the same global batch; FSDP and DeepSpeed are configured from the spec and refused on CPU; FSDP2's
mixed precision reduces gradients and returns the loss in float32."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from training_fixtures import child_env, make_run_dir, run_stage, stage_script

from spec.loading import load_pipeline
from stages.distributed import check_strategy, deepspeed_config, fsdp_settings, strategy_arguments
from stages.modeling import NotSupportedHere
from stages.training import read_log_history

# Three full global batches of 4 rows (the data packs into more than 12 rows): at the end of an epoch DDP would
# fill an uneven last batch with rows from the start, and the runs would no longer see the same rows.
STEPS = ["stages.cpt.training.max_steps=3", "stages.cpt.training.logging_steps=1"]


def loss_trajectory(run_dir) -> list[float]:
    history = read_log_history(run_dir.stage_dir("cpt") / "logs/log_history.json")
    return [e["loss"] for e in history if "loss" in e]


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_matches_one_process(tmp_path: Path) -> None:
    single = make_run_dir(tmp_path / "one", [*STEPS, "stages.cpt.training.per_device_batch_size=4"], 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]

    ddp = make_run_dir(tmp_path / "two", [*STEPS, "stages.cpt.training.per_device_batch_size=2"], 160, 10)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [*torchrun, str(stage_script(ddp.root)), "cpt", "--run-dir", str(ddp.root)]
    done = subprocess.run(command, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    assert single.read_result("cpt").metrics["tokens"] == 3 * 4 * 256  # full rows, no short last batch
    result = ddp.read_result("cpt")
    assert result is not None and result.status == "succeeded"
    assert result.metrics["tokens"] == single.read_result("cpt").metrics["tokens"]  # the same global batches
    one, two = loss_trajectory(single), loss_trajectory(ddp)
    assert len(one) == len(two) == 3
    assert one[-1] < one[0]
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_zero2", "deepspeed_zero3"])
def test_sharded_strategies_need_gpus(strategy: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    spec = load_pipeline("korean-llm", profile="local", overrides=[f"stages.cpt.distributed.strategy={strategy}"]).spec
    with pytest.raises(NotSupportedHere, match=rf"stages\.cpt\.distributed\.strategy is '{strategy}'"):
        check_strategy("cpt", spec.stages.cpt.distributed)


def test_strategy_settings_follow_the_spec() -> None:
    spec = load_pipeline("korean-llm").spec  # the cluster spec: cpt on FSDP, sft on DDP
    cpt = spec.stages.cpt.distributed

    fsdp = fsdp_settings(cpt, ["Qwen3DecoderLayer"], recompute=True)
    assert fsdp["fsdp"] is True
    assert fsdp["activation_checkpointing"] is False and fsdp["fsdp_config"]["activation_checkpointing"] is True
    assert fsdp["fsdp_config"]["version"] == 2
    assert fsdp["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["Qwen3DecoderLayer"]
    assert fsdp["fsdp_config"]["state_dict_type"] == "FULL_STATE_DICT"

    zero3 = deepspeed_config(cpt.model_copy(update={"strategy": "deepspeed_zero3", "cpu_offload": True}))
    assert zero3["zero_optimization"]["stage"] == 3
    assert zero3["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    zero2 = deepspeed_config(cpt.model_copy(update={"strategy": "deepspeed_zero2"}))
    assert zero2["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in zero2["zero_optimization"]

    ddp = strategy_arguments("sft", spec.stages.sft, model=None)
    assert "fsdp" not in ddp and "deepspeed" not in ddp


def test_fsdp2_reduces_gradients_and_returns_the_loss_in_float32(tmp_path: Path) -> None:
    """accelerate's own bf16 policy reduces in bf16 and rounds the loss to bf16 (its logged value at 0.4%): the
    stage's arguments give FSDP2 float32 reductions and outputs, through accelerate's real preparation."""
    check = Path(__file__).with_name("fsdp_precision_check.py")
    out = tmp_path / "precision.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(check)]
    done = subprocess.run([*command, str(out)], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert json.loads(out.read_text()) == {
        "param_dtype": "torch.bfloat16",
        "reduce_dtype": "torch.float32",
        "output_dtype": "None",
        "loss_dtype": "torch.float32",
        "grad_dtypes": ["torch.float32"],
    }
