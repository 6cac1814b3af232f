"""FSDP2 loads a model once per job: rank 0 reads the weights, the other ranks build a skeleton on the meta device,
and accelerate's preparation broadcasts rank 0's weights into every rank's shards (stages/sharded_loading.py).

Two CPU processes under torchrun with gloo run the stage's own loading and accelerate's FSDP2 preparation
(tests/sharded_loading_check.py) for a dense model, one with tied embeddings and a mixture of experts, each saved
as a Hugging Face checkpoint, in full training and under LoRA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from training_fixtures import child_env, make_run_dir

from run.run_dir import RunDir
from spec.loading import load_pipeline
from spec.training import DistributedSpec
from stages import sharded_loading
from stages.modeling import build_from_config, load_tokenizer

CHECK = Path(__file__).with_name("sharded_loading_check.py")
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
    """A run directory whose base model is a Hugging Face checkpoint on disk (safetensors, config, tokenizer) of
    `architecture`, its stages set by `overrides`."""
    family = [f"model.from_config.architecture={architecture}", *FAMILIES[architecture]]
    run_dir = make_run_dir(root, [*family, *overrides], n_text=24, n_chat=24)
    spec = run_dir.load_spec()
    tokenizer = load_tokenizer(run_dir, spec.model)
    checkpoint = root / "checkpoint"
    build_from_config(spec.model, tokenizer).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    model = spec.model.model_copy(update={"from_config": None, "name_or_path": str(checkpoint)})
    run_dir.write_spec(spec.model_copy(update={"model": model}))
    return run_dir


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


def test_only_fsdp_over_several_processes_loads_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cpt = load_pipeline("korean-llm").spec.stage("cpt")  # full training under FSDP

    def stage(strategy: str, method: str = "full") -> Any:
        return cpt.model_copy(update={"method": method, "distributed": DistributedSpec(strategy=strategy)})

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
