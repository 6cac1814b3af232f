"""Tensor parallelism (`distributed.tensor_parallel`): each layer of a tiny model split over two CPU processes under
torchrun (gloo) trains as one process does on the same global batch, and a run stopped by SIGTERM resumes from its
shards to the same model; a mesh of four (pairs, FSDP2 over them) and a mixture of experts split both ways do too;
every family's plan splits its layers exactly (the same logits, loss and gradients as the whole model); and the spec
refuses what the split cannot run, naming the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from training_fixtures import (
    assert_four_train_sft_as_one,
    assert_trains_as_one,
    checkpoint_run_dir,
    child_env,
    folder_weights,
    grpo_settings,
    losses,
    make_preference_run_dir,
    make_run_dir,
    preempt_after_checkpoint,
    resume_sharded_run,
    run_ok,
    run_stage,
    runner_env,
    spec_error,
    torchrun_stage,
)

from spec.loading import load_pipeline
from stages.contract import NotSupportedHere


def settings(processes: int, tensor_parallel: int, accumulate: int = 1) -> list[str]:
    """Four cpt steps of a global batch of 4 rows, checkpoints every 2; over `processes` ranks in groups of
    `tensor_parallel` (the rest FSDP2), each step `accumulate` micro-batches."""
    common = [
        "stages.cpt.training.max_steps=4",
        "stages.cpt.training.save_steps=2",
        "stages.cpt.training.logging_steps=1",
        f"stages.cpt.training.per_device_batch_size={4 * tensor_parallel // processes // accumulate}",
        f"stages.cpt.training.gradient_accumulation_steps={accumulate}",
    ]
    if processes > 1:
        common += ["stages.cpt.distributed.strategy=fsdp", f"stages.cpt.distributed.tensor_parallel={tensor_parallel}"]
    return common


@pytest.mark.slow
def test_layers_split_over_two_processes_train_as_one_and_resume_from_their_shards(tmp_path: Path) -> None:
    """Stopped as a preempted pod is (SIGTERM to torchrun, which passes it to the ranks): the ranks save a checkpoint
    together at the end of the next step and stop; the rerun resumes from its shards and ends where one process
    ends, two micro-batches a step."""
    single = make_run_dir(tmp_path / "one", settings(1, 1, accumulate=2), 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]

    # Its ranks start as the pod starts them (fresh `python -m stages` processes): the other tests' fork.
    split = make_run_dir(tmp_path / "two", settings(2, 2, accumulate=2), 160, 10)
    preempt_after_checkpoint(split, "cpt", warm=False)

    resume_sharded_run(split, "cpt", "checkpoint-3", warm=False, tensor_parallel=2)

    # Two micro-batches a step: transformers' own hook summed q_norm's and k_norm's partial gradients again at the
    # second (7e-3 off after 3 steps; `sum_partial_gradients_per_backward`). Adam turns the split's summation order
    # into up to 2e-5 on the few weights whose gradient is near zero.
    assert_trains_as_one(single, split, "cpt", steps=4, atol=5e-5)
    one = losses(single, "cpt")
    assert one[-1] < one[0]


@pytest.mark.slow
def test_a_mixture_of_experts_split_both_ways_trains_as_one_process(tmp_path: Path) -> None:
    """Tensor and expert parallelism together: a tiny Qwen3-MoE's attention split over the pair and its experts
    shared out between them (transformers' plans, expert_parallel equal to tensor_parallel)."""
    moe = [
        "model.from_config.architecture=qwen3_moe",
        "model.from_config.num_experts=4",
        "model.from_config.num_experts_per_tok=2",
        "model.from_config.moe_intermediate_size=32",
        "stages.cpt.training.router_aux_loss_coef=0",  # computed over each process's own tokens by design
    ]
    single = make_run_dir(tmp_path / "one", [*moe, *settings(1, 1)], 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    split = make_run_dir(tmp_path / "two", [*moe, *settings(2, 2), "stages.cpt.distributed.expert_parallel=2"], 160, 10)
    process = torchrun_stage(split, "cpt")
    assert process.wait(timeout=600) == 0, (split.root / "cpt.torchrun.log").read_text()[-4000:]
    written = json.loads((split.stage_dir("cpt") / "logs/distributed.json").read_text())
    assert written["tensor_parallel"] == 2 and written["expert_parallel"] == 2
    assert_trains_as_one(single, split, "cpt", steps=4)


@pytest.mark.slow
def test_a_lora_adapter_split_with_its_layers_trains_as_one_process(tmp_path: Path) -> None:
    """LoRA on every linear layer of a tiny Qwen3 split over two processes: each adapter drawn at its whole layer's
    size, as one process draws it, and split by the layer's plan; stopped by SIGTERM and resumed from its shards,
    it is saved whole, one process's."""
    lora = [
        "stages.cpt.enabled=false",
        "stages.sft.method=lora",
        "stages.sft.training.max_steps=4",
        "stages.sft.training.save_steps=2",
        "stages.sft.training.logging_steps=1",
        "stages.sft.training.per_device_batch_size=4",
    ]
    single = make_run_dir(tmp_path / "one", lora, 10, 160)
    done = run_stage(single, "sft", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    mesh = ["stages.sft.distributed.strategy=fsdp", "stages.sft.distributed.tensor_parallel=2"]
    split = make_run_dir(tmp_path / "two", [*lora, *mesh], 10, 160)
    preempt_after_checkpoint(split, "sft")
    resume_sharded_run(split, "sft", "checkpoint-3", tensor_parallel=2)
    assert_trains_as_one(single, split, "sft", steps=4, weights="adapter_model.safetensors")


@pytest.mark.slow
def test_layers_split_over_two_processes_train_in_float8_as_one_process(tmp_path: Path) -> None:
    """training.fp8 on split layers: each converted layer keeps its plan's forward and multiplies its shard in
    float8, scaled over the whole weight, as one process does: the same loss at every step within 1e-4. float8's
    rounding turns the split's summation order into whole rounding steps of a few weights' gradients (up to 6e-3 in a
    weight after 4 steps of 3e-3), hence the weights' tolerance, the one of the pipeline-and-tensor-parallel test."""
    import torch

    single = make_run_dir(tmp_path / "one", [*settings(1, 1), "stages.cpt.training.fp8=true"], 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    split = make_run_dir(tmp_path / "two", [*settings(2, 2), "stages.cpt.training.fp8=true"], 160, 10)
    process = torchrun_stage(split, "cpt")
    assert process.wait(timeout=600) == 0, (split.root / "cpt.torchrun.log").read_text()[-4000:]
    assert "[cpt] fp8: 14 linear layers in float8, 1 not" in (split.root / "cpt.torchrun.log").read_text()
    ours, theirs = torch.tensor(losses(split, "cpt")), torch.tensor(losses(single, "cpt"))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=0)
    expected, got = folder_weights(single.stage_dir("cpt") / "model"), folder_weights(split.stage_dir("cpt") / "model")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1.5e-2, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "method"),
    [("dpo", "lora"), ("kto", "lora"), ("orpo", "lora"), ("orpo", "full"), ("dpo", "full"), ("kto", "full")],
)
def test_preference_training_on_split_layers_trains_as_one_process(tmp_path: Path, algorithm: str, method: str) -> None:
    """rlhf on layers split over two processes: with LoRA, DPO's and KTO's reference is the split policy with its
    adapter off, its log-probabilities computed as it trains (precompute_ref_log_probs false: TRL hashes the whole
    policy to precompute them); in full training a second split model loaded as the policy was (full DPO after a
    LoRA sft: both the sft adapter merged into the base, then split); ORPO has none. The losses and the saved adapter
    or weights are one process's (full training: Adam turns the split's summation order into up to 9e-5 on a few
    weights)."""
    after_lora_sft = (algorithm, method) == ("dpo", "full")
    common = [
        "stages.cpt.enabled=false",
        *(
            ["stages.sft.method=lora", "stages.sft.training.max_steps=2"]
            if after_lora_sft
            else ["stages.sft.enabled=false"]
        ),
        f"stages.rlhf.method={method}",
        f"stages.rlhf.algorithm={algorithm}",
        "stages.rlhf.precompute_ref_log_probs=false",
        "stages.rlhf.training.max_steps=3",
        "stages.rlhf.training.logging_steps=1",
        "stages.rlhf.training.per_device_batch_size=4",
    ]
    single = make_preference_run_dir(tmp_path / "one", common)
    if after_lora_sft:
        run_ok(single, "sft", OMP_NUM_THREADS="1")
    done = run_stage(single, "rlhf", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    split = ["stages.rlhf.distributed.strategy=fsdp", "stages.rlhf.distributed.tensor_parallel=2"]
    cut = make_preference_run_dir(tmp_path / "two", [*common, *split])
    if after_lora_sft:  # the same sft adapter
        shutil.copytree(single.stage_dir("sft"), cut.stage_dir("sft"), dirs_exist_ok=True)
    process = torchrun_stage(cut, "rlhf")
    assert process.wait(timeout=600) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    if method == "lora":
        assert_trains_as_one(single, cut, "rlhf", steps=3, weights="adapter_model.safetensors")
    else:
        assert_trains_as_one(single, cut, "rlhf", steps=3, atol=1e-4)
    written = json.loads((cut.stage_dir("rlhf") / "logs/distributed.json").read_text())
    assert written["tensor_parallel"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(("groups", "method"), [(1, "lora"), (2, "lora"), (1, "full")])
def test_grpo_on_split_layers_trains_as_ddp_does(tmp_path: Path, groups: int, method: str) -> None:
    """GRPO on layers split over pairs of processes (one pair; two pairs with FSDP2 over them) against DDP on one
    process per pair: a pair's ranks sample the same completions, seeded as the DDP process it stands for (TRL seeds
    every process apart), from the prompts that process draws (two steps per generation batch: TRL's count of it
    over every process would draw some prompts twice and others never); the same rewards, losses and adapter (or
    weights) as DDP. LoRA's reference is the split policy with its adapter off; full training's a second split model
    (`stages.rlhf.grpo_reference_sharded`), not TRL's whole one read from a saved copy."""
    common = [*grpo_settings(method, steps=3), "stages.rlhf.training.gradient_accumulation_steps=2"]
    ddp = make_preference_run_dir(tmp_path / "ddp", [*common, "stages.rlhf.distributed.strategy=ddp"])
    if groups == 1:
        done = run_stage(ddp, "rlhf", OMP_NUM_THREADS="1")
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        process = torchrun_stage(ddp, "rlhf", processes=groups)
        assert process.wait(timeout=600) == 0, (ddp.root / "rlhf.torchrun.log").read_text()[-4000:]
    split = ["stages.rlhf.distributed.strategy=fsdp", "stages.rlhf.distributed.tensor_parallel=2"]
    cut = make_preference_run_dir(tmp_path / "split", [*common, *split])
    process = torchrun_stage(cut, "rlhf", processes=2 * groups)
    assert process.wait(timeout=900) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    weights = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert_trains_as_one(ddp, cut, "rlhf", steps=3, weights=weights, atol=1e-4)
    rewards = [run.read_result("rlhf").metrics for run in (ddp, cut)]  # type: ignore[union-attr]
    # the mean over every rank's rows, a pair's copies included: the same up to float32 summation order
    assert rewards[0]["reward_last"] == pytest.approx(rewards[1]["reward_last"], rel=1e-6)
    assert rewards[0]["kl_last"] > 0
    assert (ddp.stage_dir("rlhf") / "reference").is_dir() == (method == "full")  # TRL's copy to read
    assert not (cut.stage_dir("rlhf") / "reference").exists()


def test_adapters_on_experts_are_refused_where_the_layers_are_split(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from stages.modeling import lora_config

    mesh = ["stages.sft.distributed.strategy=fsdp", "stages.sft.distributed.tensor_parallel=2"]
    section = load_pipeline("korean-llm", overrides=[*mesh, "stages.sft.lora.target_experts=true"]).spec.stages.sft
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    assert lora_config(section, model).target_parameters  # one process: the experts get adapters
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NotSupportedHere, match=r"lora\.target_experts puts adapters on the experts"):
        lora_config(section, model)


def test_new_template_tokens_are_refused_where_the_head_is_split(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from stages.modeling import lora_config

    mesh = ["stages.sft.distributed.strategy=fsdp", "stages.sft.distributed.tensor_parallel=2"]
    section = load_pipeline("korean-llm", overrides=mesh).spec.stages.sft
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    )
    lora_config(section, model, [298, 299])  # one process: the rows and the head train
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NotSupportedHere, match=r"distributed\.tensor_parallel does not split"):
        lora_config(section, model, [298, 299])


def test_the_spec_refuses_what_tensor_parallelism_cannot_split() -> None:
    tp = "stages.sft.distributed.tensor_parallel=2"
    assert "set distributed.strategy to 'fsdp'" in spec_error(
        "llama3-dolly", [tp, "stages.sft.distributed.strategy=ddp"]
    )
    fsdp = "stages.sft.distributed.strategy=fsdp"
    assert "4-bit weights are not split" in spec_error("llama3-dolly", [tp, fsdp, "stages.sft.method=qlora"])
    whole = ["stages.sft.method=lora", "stages.sft.lora.modules_to_save=[lm_head]"]
    assert "which tensor_parallel does not split" in spec_error("llama3-dolly", [tp, fsdp, *whole])
    experts = [tp, fsdp, "stages.sft.method=lora", "stages.sft.lora.target_experts=true"]
    assert "stages.sft.lora.target_experts: puts adapters on" in spec_error("qwen3-30b-a3b", experts)
    load_pipeline("llama3-dolly", overrides=experts)  # a dense model: no experts, nothing to refuse
    full = "stages.sft.method=full"
    assert "must divide resources.gpus_per_node (8)" in spec_error(
        "llama3-dolly", ["stages.sft.distributed.tensor_parallel=3", fsdp, full, "stages.sft.resources.gpus_per_node=8"]
    )
    # Llama-3-8B's 32 heads and 8 key/value heads: 16 splits the heads but not the key/value heads
    error = spec_error(
        "llama3-dolly",
        ["stages.sft.distributed.tensor_parallel=16", fsdp, full, "stages.sft.resources.gpus_per_node=16"],
    )
    assert "does not divide" in error and "use one of 1, 2, 4, 8" in error
    ep = ["stages.sft.distributed.expert_parallel=2", "stages.sft.distributed.tensor_parallel=4", fsdp, full]
    assert "tensor_parallel 4 must divide it" in spec_error("qwen3-30b-a3b", ep)
    # a mixture's experts split by the layer's plan do not checkpoint: the experts spread whole (expert_parallel)
    assert "would split Qwen/Qwen3-30B-A3B-Base's experts too" in spec_error("qwen3-30b-a3b", [tp, fsdp, full])
    load_pipeline("qwen3-30b-a3b", overrides=[tp, fsdp, full, "stages.sft.distributed.expert_parallel=2"])
    fp8 = load_pipeline("llama3-dolly", overrides=[tp, fsdp, full, "stages.sft.training.fp8=true"]).spec
    assert fp8.stages.sft.training.fp8 and fp8.stages.sft.distributed.tensor_parallel == 2
    rlhf = [
        "stages.rlhf.distributed.tensor_parallel=2",
        "stages.rlhf.distributed.strategy=fsdp",
        "stages.rlhf.method=full",
    ]
    # full dpo: its reference is a second split model, which precomputing would hash
    assert "stages.rlhf.precompute_ref_log_probs: is true" in spec_error("korean-llm", rlhf)
    load_pipeline("korean-llm", overrides=[*rlhf, "stages.rlhf.precompute_ref_log_probs=false"])
    lora = [*rlhf[:2], "stages.rlhf.method=lora"]
    assert "stages.rlhf.precompute_ref_log_probs: is true" in spec_error("korean-llm", lora)
    load_pipeline("korean-llm", overrides=[*lora, "stages.rlhf.precompute_ref_log_probs=false"])
    load_pipeline("korean-llm", overrides=[*lora, "stages.rlhf.algorithm=orpo"])  # no reference to compute
    load_pipeline("korean-llm", overrides=[*rlhf, "stages.rlhf.algorithm=orpo"])  # full training too
    grpo = [*rlhf, "stages.rlhf.algorithm=grpo", "stages.rlhf.reward_functions=[{name: hangul_ratio}]"]
    assert load_pipeline("korean-llm", overrides=grpo).spec.stages.rlhf.beta > 0  # full: its reference split too
    load_pipeline("korean-llm", overrides=[*grpo, "stages.rlhf.method=lora"])
    spec = load_pipeline("llama3-dolly", overrides=[tp, fsdp, full]).spec
    assert spec.stages.sft.distributed.tensor_parallel == 2


def test_a_model_the_group_cannot_split_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig, Qwen3MoeConfig

    from stages.model_parallel import check_fits

    section = load_pipeline(
        "korean-llm",
        overrides=["stages.cpt.distributed.strategy=fsdp", "stages.cpt.distributed.tensor_parallel=4"],
    ).spec.stages.cpt
    monkeypatch.setenv("WORLD_SIZE", "8")
    check_fits("cpt", section, LlamaConfig(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336))
    with pytest.raises(NotSupportedHere, match=r"stages\.cpt\.distributed\.tensor_parallel is 4, .* 2 key/value"):
        check_fits("cpt", section, LlamaConfig(num_attention_heads=32, num_key_value_heads=2))
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(NotSupportedHere, match="does not divide this run's 6 processes"):
        check_fits("cpt", section, LlamaConfig(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336))
    monkeypatch.setenv("WORLD_SIZE", "8")
    moe = Qwen3MoeConfig(num_attention_heads=32, num_key_value_heads=4, intermediate_size=768)
    with pytest.raises(NotSupportedHere, match=r"would split qwen3_moe's experts too, .*expert_parallel to 4 or"):
        check_fits("cpt", section, moe)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_mesh_of_two_groups_of_two_trains_sft_as_one_process(tmp_path: Path, method: str) -> None:
    """Four processes: layers split over pairs (tensor parallel), FSDP2 over the two pairs, each pair its own rows,
    two micro-batches a step (FSDP2 reduces once, after the second: each backward's partial q_norm and k_norm
    gradients are summed as they arrive). With LoRA the adapters split with their layers are averaged over the
    pairs once a step (`stages.model_parallel.average_split_adapters`: FSDP2 does not hold them)."""
    mesh = ["stages.sft.distributed.strategy=fsdp", "stages.sft.distributed.tensor_parallel=2"]
    assert_four_train_sft_as_one(tmp_path, ["stages.sft.training.gradient_accumulation_steps=2"], mesh, method)


CHECK = Path(__file__).with_name("tensor_parallel_check.py")
FAMILIES = {  # the local profile's tiny shape; Qwen2 derives its head width from the hidden size
    "qwen3": [],
    "llama": [],
    "mistral": [],
    "gemma3": [],  # ties the LM head to the input embeddings
    "exaone4": [],
    "qwen2": ["model.from_config.head_dim=16"],
}


@pytest.mark.slow
def test_every_family_splits_its_layers_exactly(tmp_path: Path) -> None:
    """Each family's tensor-parallel plan, as the stage loads it over two processes: the same logits, loss and
    gradients as the whole model on the same packed rows."""
    split = ["stages.cpt.distributed.strategy=fsdp", "stages.cpt.distributed.tensor_parallel=2"]
    runs = {
        family: checkpoint_run_dir(tmp_path / family, family, [*shape, *split]) for family, shape in FAMILIES.items()
    }
    out = tmp_path / "check"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(CHECK)]
    command += [str(out), *(f"{family}={run.root}" for family, run in runs.items())]
    done = subprocess.run(command, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for family in FAMILIES:
        report = json.loads((out / f"{family}.json").read_text())
        # attention (q, k, v, o) and the MLP (gate, up, down) of both layers at least
        assert report["split_parameters"] >= 14, (family, report)
        assert abs(report["loss_split"] - report["loss_whole"]) < 1e-5, (family, report)
        assert report["logits_cosine"] >= 0.9999, (family, report)  # the bar for a backend's conversion
        assert report["largest_gradient_difference"] < 1e-5 * max(1.0, report["largest_gradient"]), (family, report)


SPLIT_CPT = ["stages.cpt.distributed.strategy=fsdp", "stages.cpt.distributed.tensor_parallel=2"]


def test_local_says_what_this_machine_makes_of_the_groups_before_anything_starts() -> None:
    from workflows.plan import local_mesh

    spec = load_pipeline("korean-llm", profile="local", overrides=SPLIT_CPT).spec
    assert local_mesh(spec, 4) == ([], [])
    errors, warnings = local_mesh(spec, 3)
    assert errors == [
        "stages.cpt.distributed.tensor_parallel is 2, which does not divide the 3 processes --local runs cpt with "
        "(one per GPU here): set it to a divisor of 3, or CUDA_VISIBLE_DEVICES to a multiple of 2 GPUs"
    ]
    errors, warnings = local_mesh(spec, 0)
    assert errors == [] and warnings == [
        "stages.cpt.distributed.tensor_parallel is 2, but this machine runs cpt as one process: it trains unsplit"
    ]


def test_local_refuses_groups_its_gpus_cannot_form_with_one_error_and_nothing_written(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "workflows.submit", "korean-llm", "--local", "--run-dir", str(tmp_path / "run")]
    for item in SPLIT_CPT:
        command += ["--set", item]
    done = subprocess.run(
        command, env=runner_env(CUDA_VISIBLE_DEVICES="0,1,2"), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert "error: stages.cpt.distributed.tensor_parallel is 2, which does not divide the 3 processes" in output
    assert "Traceback" not in output
    assert not (tmp_path / "run").exists()
