"""Expert parallelism (`distributed.expert_parallel`): a tiny qwen3_moe's experts split over two CPU processes
under torchrun (gloo has the all-to-all), the rest FSDP2-sharded, trains as one process does on the same global
batch, full and with LoRA (on attention and on each rank's experts; over two groups of two too); a run killed
after a checkpoint resumes from its shards to the same model; and the spec refuses what the sharding cannot run,
naming the field."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest
from training_fixtures import (
    assert_trains_as_one,
    grpo_settings,
    losses,
    make_preference_run_dir,
    make_run_dir,
    resume_sharded_run,
    run_stage,
    spec_error,
    torchrun_stage,
    wait_for_file,
)

from run.run_dir import RunDir
from spec.loading import load_pipeline
from stages.checkpoints import MARKER
from stages.contract import NotSupportedHere

# Four experts (two routed per token) of a tiny qwen3_moe; the router's load-balancing loss off, because it is
# computed over each process's own tokens (as under DDP) and would differ from one process's by design.
MOE = [
    "model.from_config.architecture=qwen3_moe",
    "model.from_config.num_experts=4",
    "model.from_config.num_experts_per_tok=2",
    "model.from_config.moe_intermediate_size=32",
]


def settings(stage: str, processes: int) -> list[str]:
    """Four steps of a global batch of 4 rows, checkpoints every 2; on `processes` ranks with expert parallelism."""
    common = [
        *MOE,
        f"stages.{stage}.training.max_steps=4",
        f"stages.{stage}.training.save_steps=2",
        f"stages.{stage}.training.logging_steps=1",
        f"stages.{stage}.training.router_aux_loss_coef=0",
        f"stages.{stage}.training.per_device_batch_size={4 // processes}",
    ]
    if processes > 1:
        common += [f"stages.{stage}.distributed.strategy=fsdp", f"stages.{stage}.distributed.expert_parallel=2"]
    if stage == "sft":  # adapters on attention and on every expert (each rank trains its experts' rows)
        common += ["stages.cpt.enabled=false", "stages.sft.lora.target_experts=true"]
    return common


def one_process(tmp_path: Path, stage: str, n_text: int, n_chat: int) -> RunDir:
    """The stage trained by one process on the same global batch: the reference."""
    single = make_run_dir(tmp_path / "one", settings(stage, 1), n_text, n_chat)
    done = run_stage(single, stage, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    return single


@pytest.mark.slow
def test_full_training_with_experts_over_two_processes_matches_one_and_resumes_from_its_shards(tmp_path: Path) -> None:
    single = one_process(tmp_path, "cpt", 160, 10)
    sharded = make_run_dir(tmp_path / "two", settings("cpt", 2), 160, 10)
    checkpoints = sharded.stage_dir("cpt") / "checkpoints"
    first = torchrun_stage(sharded, "cpt", hold_after_checkpoint=2, warm=False)  # its ranks SIGKILLed below
    wait_for_file(checkpoints / "checkpoint-2" / MARKER, first)  # type: ignore[arg-type]
    ranks = psutil.Process(first.pid).children(recursive=True)  # torchrun starts each in a session of its own
    for process in [psutil.Process(first.pid), *ranks]:  # the node is lost: every rank at once
        process.send_signal(signal.SIGKILL)
    psutil.wait_procs(ranks, timeout=60)
    first.wait(timeout=60)
    assert (checkpoints / "checkpoint-2" / "sharded").is_dir()  # the model's and optimizer's shards

    resume_sharded_run(sharded, "cpt", "checkpoint-2", expert_parallel=2)

    # the whole model, saved in the checkpoint's own layout, is the one process's model
    assert_trains_as_one(single, sharded, "cpt", steps=4)
    one = losses(single, "cpt")
    assert one[-1] < one[0]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_lora_with_experts_over_processes_matches_one(tmp_path: Path, processes: int) -> None:
    """LoRA on attention and on the experts, the experts spread over groups of two: one group, and two groups whose
    copies FSDP2 shards (each rank's local tensor then holds fewer experts than its module counts: the adapters must
    still be the spec's, rank r on the experts, none on the router)."""
    single = one_process(tmp_path, "sft", 10, 160)
    sharded = make_run_dir(tmp_path / "sharded", settings("sft", processes), 10, 160)
    process = torchrun_stage(sharded, "sft", processes=processes)
    assert process.wait(timeout=900) == 0, (sharded.root / "sft.torchrun.log").read_text()[-4000:]

    assert_trains_as_one(single, sharded, "sft", steps=4, weights="adapter_model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "method"), [("dpo", "full"), ("dpo", "lora"), ("orpo", "full")])
def test_preference_training_with_experts_over_two_processes_matches_one(
    tmp_path: Path, algorithm: str, method: str
) -> None:
    """rlhf with the experts spread over two processes: full DPO's reference is a second model loaded and spread as
    the policy was (`stages.rlhf.sharded_reference`), LoRA's the policy with its adapter off, ORPO has none; the
    losses and the saved weights or adapter are one process's. (KTO runs the same way; its KL term is estimated from
    each process's own rows, so it differs from one process's by design, as under DDP.)"""
    common = [
        *MOE,
        "stages.cpt.enabled=false",
        "stages.sft.enabled=false",
        f"stages.rlhf.algorithm={algorithm}",
        f"stages.rlhf.method={method}",
        "stages.rlhf.precompute_ref_log_probs=false",
        "stages.rlhf.training.max_steps=3",
        "stages.rlhf.training.logging_steps=1",
        "stages.rlhf.training.router_aux_loss_coef=0",
        "stages.rlhf.lora.target_experts=false",
    ]
    single = make_preference_run_dir(tmp_path / "one", [*common, "stages.rlhf.training.per_device_batch_size=4"])
    done = run_stage(single, "rlhf", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    ep = ["stages.rlhf.distributed.strategy=fsdp", "stages.rlhf.distributed.expert_parallel=2"]
    two = make_preference_run_dir(tmp_path / "two", [*common, "stages.rlhf.training.per_device_batch_size=2", *ep])
    process = torchrun_stage(two, "rlhf")
    assert process.wait(timeout=600) == 0, (two.root / "rlhf.torchrun.log").read_text()[-4000:]
    weights = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert_trains_as_one(single, two, "rlhf", steps=3, weights=weights, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_grpo_with_experts_over_two_processes_trains_as_ddp_does(tmp_path: Path, method: str) -> None:
    """GRPO with the experts spread over two processes, its reference the policy without its adapter (LoRA) or a
    second model spread as the policy was (full; `stages.rlhf.grpo_reference_sharded`): each rank samples its own
    prompts' completions as under DDP, joining the experts' token exchange at every forward of the generation; the
    same completions (their rewards), losses and adapter (or weights) as DDP on the same two processes."""
    common = [
        *MOE,
        *grpo_settings(method, steps=2),
        "stages.rlhf.training.router_aux_loss_coef=0",
        "stages.rlhf.lora.target_experts=false",
    ]
    runs = []
    for name, distributed in (("ddp", ["strategy=ddp"]), ("ep", ["strategy=fsdp", "expert_parallel=2"])):
        run = make_preference_run_dir(
            tmp_path / name, [*common, *(f"stages.rlhf.distributed.{d}" for d in distributed)]
        )
        process = torchrun_stage(run, "rlhf")
        assert process.wait(timeout=600) == 0, (run.root / "rlhf.torchrun.log").read_text()[-4000:]
        runs.append(run)
    ddp, ep = runs
    weights = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert_trains_as_one(ddp, ep, "rlhf", steps=2, weights=weights, atol=1e-4)
    assert not (ep.stage_dir("rlhf") / "reference").exists()  # not TRL's whole copy, read in every process
    rewards = [run.read_result("rlhf").metrics for run in runs]  # type: ignore[union-attr]
    assert rewards[0]["reward_last"] == rewards[1]["reward_last"] and rewards[0]["kl_last"] > 0


def test_the_spec_refuses_what_expert_parallelism_cannot_shard() -> None:
    ep = "stages.sft.distributed.expert_parallel=4"
    assert "set distributed.strategy to 'fsdp'" in spec_error("qwen3-30b-a3b", [ep])  # the pipeline's ZeRO-3
    fsdp = "stages.sft.distributed.strategy=fsdp"
    assert "must divide resources.gpus_per_node (8)" in spec_error(
        "qwen3-30b-a3b", ["stages.sft.distributed.expert_parallel=3", fsdp]
    )
    lora = "stages.sft.method=lora"
    assert "multiple of 8" in spec_error("qwen3-30b-a3b", [ep, fsdp, lora, "stages.sft.lora.r=12"])
    assert load_pipeline(
        "qwen3-30b-a3b", overrides=[ep, fsdp, lora, "stages.sft.lora.r=12", "stages.sft.lora.target_experts=false"]
    )
    assert "qlora's are 4-bit" in spec_error("qwen3-30b-a3b", [ep, fsdp, "stages.sft.method=qlora"])
    rlhf = ["stages.rlhf.distributed.expert_parallel=2", "stages.rlhf.distributed.strategy=fsdp"]
    assert "precompute_ref_log_probs: is true; with distributed.expert_parallel" in spec_error("qwen3-30b-a3b", rlhf)
    load_pipeline("qwen3-30b-a3b", overrides=[*rlhf, "stages.rlhf.precompute_ref_log_probs=false"])
    grpo = [*rlhf, "stages.rlhf.algorithm=grpo", "stages.rlhf.reward_functions=[{name: hangul_ratio}]"]
    assert load_pipeline("qwen3-30b-a3b", overrides=grpo).spec.stages.rlhf.beta > 0  # full: its reference spread too
    load_pipeline("qwen3-30b-a3b", overrides=[*grpo, "stages.rlhf.method=lora"])
    spec = load_pipeline("qwen3-30b-a3b", overrides=[ep, fsdp]).spec
    assert spec.stages.sft.distributed.expert_parallel == 4


def test_a_model_the_group_cannot_split_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Qwen3Config, Qwen3MoeConfig

    from stages.model_parallel import check_fits

    section = load_pipeline(
        "qwen3-30b-a3b", overrides=["stages.sft.distributed.strategy=fsdp", "stages.sft.distributed.expert_parallel=4"]
    ).spec.stages.sft
    monkeypatch.setenv("WORLD_SIZE", "8")
    check_fits("sft", section, Qwen3MoeConfig(num_experts=128))
    with pytest.raises(
        NotSupportedHere, match=r"stages\.sft\.distributed\.expert_parallel is 4, which does not divide the model's 6"
    ):
        check_fits("sft", section, Qwen3MoeConfig(num_experts=6))
    with pytest.raises(NotSupportedHere, match="qwen3 has no experts"):
        check_fits("sft", section, Qwen3Config())
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(NotSupportedHere, match="does not divide this run's 6 processes"):
        check_fits("sft", section, Qwen3MoeConfig(num_experts=128))
