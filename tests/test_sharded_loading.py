"""A model loads once per job, not once per process (stages/sharded_loading.py).

FSDP2: rank 0 reads the weights, the other ranks build a skeleton on the meta device, and accelerate's preparation
broadcasts rank 0's weights into every rank's shards. Two CPU processes under torchrun with gloo run the stage's own
loading and accelerate's FSDP2 preparation (tests/sharded_loading_check.py) for a dense model, one with tied
embeddings and a mixture of experts, each saved as a Hugging Face checkpoint, in full training and under LoRA.

DeepSpeed ZeRO-3: the model is created partitioned (zero.Init) and the checkpoint loaded into the partitions. Two CPU
processes under torchrun run a whole training stage through its own code on DeepSpeed's CPU accelerator
(tests/zero3_loading_check.py), full training and LoRA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from training_fixtures import (
    EVAL_ROWS,
    REPO,
    checkpoint_run_dir,
    child_env,
    preference_rows,
    write_jsonl,
)

from run.run_dir import RunDir
from spec.loading import load_pipeline
from spec.training import DistributedSpec
from stages import distributed, sharded_loading

CHECK = Path(__file__).with_name("sharded_loading_check.py")
ZERO3_CHECK = Path(__file__).with_name("zero3_loading_check.py")
FAMILIES = {
    "qwen3": [],
    "gemma3": [],  # ties the LM head to the input embeddings
    "qwen3_moe": [
        "model.from_config.num_experts=4",
        "model.from_config.num_experts_per_tok=2",
        "model.from_config.moe_intermediate_size=32",
    ],
}


def pretrained_run_dir(root: Path, architecture: str, overrides: list[str]) -> RunDir:
    """`training_fixtures.pretrained_run_dir` with the family's shape settings."""
    return checkpoint_run_dir(root, architecture, [*FAMILIES[architecture], *overrides])


def run_check(tmp_path: Path, checks: list[tuple[str, RunDir]]) -> list[dict[str, dict[str, object]]]:
    """Each (stage, run directory)'s check, as rank 0 and rank 1 reported it."""
    out = tmp_path / "check"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(CHECK), str(out), *(f"{stage}={run_dir.root}" for stage, run_dir in checks)]
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_fsdp_loads_the_weights_on_rank_0_only_and_shards_them_to_the_others(tmp_path: Path) -> None:
    fsdp = ["stages.cpt.distributed.strategy=fsdp", "stages.sft.distributed.strategy=fsdp"]
    checks = [("cpt", pretrained_run_dir(tmp_path / name, name, fsdp)) for name in FAMILIES]
    checks.append(("sft", pretrained_run_dir(tmp_path / "lora", "qwen3", [*fsdp, "stages.cpt.enabled=false"])))
    ranks = run_check(tmp_path, checks)

    assert len(ranks[0]) == len(ranks[1]) == len(checks)
    for rank0, rank1 in zip(ranks[0].values(), ranks[1].values(), strict=True):
        assert rank0["loads_once"] and rank1["loads_once"]
        # Before the preparation: rank 0 holds the model, rank 1 a skeleton that holds no weight in memory.
        assert not rank0["skeleton"] and rank0["parameter_bytes"] > 0
        assert rank1["skeleton"] and rank1["parameter_bytes"] == 0, rank1
        # After it: every weight on every rank is what rank 0 loaded; buffers (rotary frequencies) agree.
        for report in (rank0, rank1):
            assert report["weights"] > 0
            assert report["differing_weights"] == [], report
            assert report["differing_buffers"] == [], report
        assert rank1["loss"] == pytest.approx(rank0["loss"], rel=1e-6)
        # The optimizer steps every sharded parameter, each once, and its state (what a checkpoint saves) has them
        # all: on a skeleton, accelerate's swap by data_ptr() would hand it one parameter many times over.
        for report in (rank0, rank1):
            assert report["optimizer_holds_each_once"], report
            assert report["optimizer_state_entries"] == report["trained_parameters"] > 0, report


def _section(stage_name: str) -> Any:
    """korean-llm's `stage_name` section, with a strategy and method of the caller's."""
    section = load_pipeline("korean-llm").spec.stage(stage_name)

    def stage(strategy: str, method: str = "full") -> Any:
        return section.model_copy(update={"method": method, "distributed": DistributedSpec(strategy=strategy)})

    return stage


def test_only_fsdp_over_several_processes_loads_once(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = _section("cpt")  # full training under FSDP
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not sharded_loading.loads_once(stage("fsdp"))
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert sharded_loading.loads_once(stage("fsdp"))
    assert sharded_loading.loads_once(stage("fsdp", "lora"))
    assert not sharded_loading.loads_once(stage("fsdp", "qlora"))  # 4-bit weights quantize as each rank loads
    assert not sharded_loading.loads_once(stage("ddp"))
    assert not sharded_loading.loads_once(stage("deepspeed_zero3"))


def test_rank_0_loads_onto_its_gpu_only_when_the_model_and_its_upcast_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1024**3
    monkeypatch.setattr(sharded_loading.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sharded_loading.torch.cuda, "mem_get_info", lambda device: (79 * gib, 80 * gib))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert sharded_loading.first_rank_placement(8 * 10**9) == {"device_map": {"": 0}}  # 48 GB of 67 GiB
    assert sharded_loading.first_rank_placement(30 * 10**9) == {}  # 180 GB: host memory
    monkeypatch.setattr(sharded_loading.torch.cuda, "is_available", lambda: False)
    assert sharded_loading.first_rank_placement(10**6) == {}


NO_PRECOMPUTE = "stages.rlhf.precompute_ref_log_probs=false"  # a reference model, not log-probabilities made ahead
ZERO3 = [
    "stages.cpt.distributed.strategy=deepspeed_zero3",
    "stages.sft.distributed.strategy=deepspeed_zero3",
    "stages.rlhf.distributed.strategy=deepspeed_zero3",
    "stages.cpt.training.max_steps=2",
    "stages.sft.training.max_steps=2",
    "stages.rlhf.training.max_steps=2",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "overrides"),
    # the LoRA stage merges its adapter as it ends (lora.merge_after): rank 0 alone reloads the base, whole
    [
        ("cpt", []),
        ("sft", ["stages.cpt.enabled=false", "stages.sft.method=lora", "stages.sft.lora.merge_after=true"]),
        # full DPO: the policy and its frozen reference both created partitioned, from the same checkpoint
        ("rlhf", ["stages.cpt.enabled=false", "stages.sft.enabled=false", "stages.rlhf.method=full", NO_PRECOMPUTE]),
    ],
    ids=["full", "lora", "dpo-full"],
)
def test_zero3_creates_the_model_partitioned_and_loads_the_checkpoint_into_it(
    tmp_path: Path, stage: str, overrides: list[str]
) -> None:
    run_dir = pretrained_run_dir(tmp_path / "run", "qwen3", [*ZERO3, *overrides])
    if stage == "rlhf":
        rows = preference_rows(24 + EVAL_ROWS)
        write_jsonl(run_dir.root / "prepare/data/rlhf/train.jsonl", rows[EVAL_ROWS:])
        write_jsonl(run_dir.root / "prepare/data/rlhf/eval.jsonl", rows[:EVAL_ROWS])
    checkpoint = load_file(run_dir.root / "checkpoint" / "model.safetensors")
    out = tmp_path / "check"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(ZERO3_CHECK), str(out), stage, "--run-dir", str(run_dir.root)]
    env = child_env(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    for rank in (0, 1):
        report = json.loads((out / f"rank-{rank}.json").read_text())
        assert report["shm_all_reduce"] is False  # gloo reduces: DeepSpeed's CPU op is never compiled (minutes)
        # transformers saw ZeRO-3 as the weights loaded; rank 0's merge reloaded the base whole, without it
        merged = [False] if stage == "sft" and rank == 0 else []
        again = [True] if stage == "rlhf" else []  # the reference loaded again, partitioned as well
        assert report["zero3_at_load"] == [True, *again, *merged], report
        # Every weight of the model was created partitioned; only LoRA's adapters (made afterwards) are whole.
        assert len(report["partitioned"]) == len(checkpoint), report
        assert all(".lora_" in name for name in report["whole"]), report
        assert (stage == "sft") == bool(report["whole"])
        # Each of the two ranks holds half of every weight (DeepSpeed pads a partition to an even split).
        half = report["model_elements"] / 2
        assert half <= report["held_elements"] <= half + len(report["partitioned"]), report
        # Gathered, the partitions are the checkpoint.
        assert report["checked_weights"] == len(checkpoint) and report["differing_weights"] == [], report
        if stage == "rlhf":  # the reference too: partitioned, half on each rank, the checkpoint's weights
            reference = report["reference"]
            assert len(reference["partitioned"]) == len(checkpoint) and reference["whole"] == [], reference
            assert half <= reference["held_elements"] <= half + len(checkpoint), reference
            assert reference["differing_weights"] == [], reference
        else:
            assert "reference" not in report

    result = run_dir.read_result(stage)
    assert result is not None and result.status == "succeeded" and result.metrics["steps"] == 2
    settings = json.loads((run_dir.stage_dir(stage) / "logs/distributed.json").read_text())
    assert settings["world_size"] == 2 and settings["deepspeed"]["zero_optimization"]["stage"] == 3
    model = run_dir.stage_dir(stage) / "model"
    # ZeRO-3 gathered whole weights to save (cpt); the adapter merged into a whole base (sft)
    assert not (model / "adapter_model.safetensors").exists()
    saved = load_file(model / "model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in checkpoint.items()}
    assert any(not torch.equal(saved[k].float(), checkpoint[k].float()) for k in saved)  # it trained


def test_zero3_over_several_processes_loads_partitioned(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = _section("sft")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not sharded_loading.partitions_at_load(stage("deepspeed_zero3"))
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert sharded_loading.partitions_at_load(stage("deepspeed_zero3"))
    assert sharded_loading.partitions_at_load(stage("deepspeed_zero3", "lora"))
    assert not sharded_loading.partitions_at_load(stage("deepspeed_zero2"))
    assert not sharded_loading.partitions_at_load(stage("fsdp"))
    assert not sharded_loading.partitions_at_load(stage("ddp"))


def test_zero_init_config_resolves_what_zero_init_reads_as_the_trainer_will(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distributed, "check_strategy", lambda stage, spec: None)  # no GPU here
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "8")
    sft = load_pipeline("korean-llm").spec.stage("sft")
    training = sft.training.model_copy(update={"per_device_batch_size": 2, "gradient_accumulation_steps": 4})
    section = sft.model_copy(
        update={"distributed": DistributedSpec(strategy="deepspeed_zero3", cpu_offload=True), "training": training}
    )

    config = distributed.zero_init_config("sft", section, "auto")
    assert "auto" not in json.dumps(config)
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 8 * 2 * 4
    assert config["gradient_clipping"] == training.max_grad_norm
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}  # partitions made in bf16
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
    assert "stage3_prefetch_bucket_size" not in zero  # DeepSpeed's default; the Trainer fills its own later
    assert distributed.zero_init_config("sft", section, distributed.torch.float16)["fp16"] == {"enabled": True}

    # The user's own config: its numbers kept, its "auto" filled, and the accelerate config's clipping applied.
    own = {"zero_optimization": {"stage": 3}, "train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"}
    user = section.distributed.model_copy(
        update={"deepspeed_config": own, "accelerate_config": {"deepspeed_config": {"gradient_clipping": 0.5}}}
    )
    config = distributed.zero_init_config("sft", section.model_copy(update={"distributed": user}), "auto")
    assert config["train_batch_size"] == 64 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_clipping"] == 0.5
