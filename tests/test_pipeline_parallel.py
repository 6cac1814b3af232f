"""Pipeline parallelism (`distributed.pipeline_parallel`): a tiny model's layers cut into two stages over two CPU
processes under torchrun (gloo, torch's 1F1B schedule) train as one process does on the same global batch, and a run
stopped by SIGTERM resumes from its shards to the same model, saved as one Hugging Face folder; two pipelines of two
stages (FSDP2 over the pipelines) train a tied-embedding Gemma 3 as one process does; rlhf's ORPO, DPO and KTO, their
losses taken on the last stage (DPO's and KTO's reference log-probabilities computed through the stages first), train
as one process does, and GRPO samples its completions through the stages and trains as one process (or DDP) does; and
the spec and the stage refuse what the cut cannot run, naming the
field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from training_fixtures import (
    SAVED,
    assert_four_train_sft_as_one,
    assert_trains_as_one,
    folder_weights,
    grpo_settings,
    losses,
    make_preference_run_dir,
    make_run_dir,
    preempt_after_checkpoint,
    resume_sharded_run,
    run_ok,
    run_stage,
    spec_error,
    torchrun_stage,
)

from run.run_dir import RunDir
from spec.document import SpecError
from spec.loading import load_pipeline
from stages.contract import NotSupportedHere
from stages.pipeline_parallel import check_fits, layer_ranges, pad_rows
from stages.pipeline_preference import (
    OddsRatioLoss,
    PairedRows,
    UnpairedLoss,
    UnpairedRows,
    refuse_unsupported_dpo,
)
from stages.training import read_log_history

PIPELINE = ["stages.cpt.distributed.strategy=fsdp", "stages.cpt.distributed.pipeline_parallel=2"]
PIPELINE_SFT = [setting.replace("stages.cpt.", "stages.sft.") for setting in PIPELINE]
PIPELINE_RLHF = [setting.replace("stages.cpt.", "stages.rlhf.") for setting in PIPELINE]


def cpt_settings(per_device: int, stage: str = "cpt") -> list[str]:
    """Four steps of `stage` (cpt unless named), each of two micro-batches of `per_device` rows; checkpoints and
    held-out loss every 2."""
    return [
        f"stages.{stage}.training.max_steps=4",
        f"stages.{stage}.training.save_steps=2",
        f"stages.{stage}.training.eval_steps=2",
        f"stages.{stage}.training.logging_steps=1",
        f"stages.{stage}.training.per_device_batch_size={per_device}",
        f"stages.{stage}.training.gradient_accumulation_steps=2",
    ]


# A tiny Qwen3-MoE with its router balance loss off, as pipeline stages cut one
MOE = [
    *[f"model.from_config.{key}" for key in ("architecture=qwen3_moe", "num_experts=4", "num_experts_per_tok=2")],
    "model.from_config.moe_intermediate_size=32",
]


def two_stages_train_as_one(root: Path, stage: str, common: list[str], weights: str = "model.safetensors") -> RunDir:
    """`stage` with the `common` settings on one process, and cut into two stages on two (torchrun): both succeed
    and train as one (`assert_trains_as_one`, 4 logged steps). Returns the cut run."""
    rows = (160, 10) if stage == "cpt" else (10, 160)
    single = make_run_dir(root / "one", common, *rows)
    done = run_stage(single, stage, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    cut = make_run_dir(root / "two", [*common, *(PIPELINE if stage == "cpt" else PIPELINE_SFT)], *rows)
    process = torchrun_stage(cut, stage)
    assert process.wait(timeout=600) == 0, (cut.root / f"{stage}.torchrun.log").read_text()[-4000:]
    assert_trains_as_one(single, cut, stage, steps=4, weights=weights)
    return cut


@pytest.mark.slow
def test_two_stages_train_as_one_process_and_resume_from_their_shards(tmp_path: Path) -> None:
    """One pipeline of two stages: stopped as a preempted pod is (SIGTERM to torchrun), the ranks checkpoint
    together at the end of the next step; the rerun resumes from the shards and ends where one process ends, its
    model one folder of a file per stage that transformers loads."""
    single = make_run_dir(tmp_path / "one", cpt_settings(2), 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]

    # Its ranks start as the pod starts them (fresh `python -m stages` processes): the other tests' fork.
    cut = make_run_dir(tmp_path / "two", [*cpt_settings(2), *PIPELINE], 160, 10)
    preempt_after_checkpoint(cut, "cpt", warm=False)

    resume_sharded_run(cut, "cpt", "checkpoint-3", warm=False, pipeline_parallel=2)
    assert_trains_as_one(single, cut, "cpt", steps=4)
    model = cut.stage_dir("cpt") / "model"
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert not list(model.glob(".stage-*"))
    one, two = single.read_result("cpt"), cut.read_result("cpt")
    assert one is not None and two is not None
    assert abs(one.metrics["eval_loss"] - two.metrics["eval_loss"]) < 1e-5  # every held-out row, through the stages
    history = read_log_history(cut.stage_dir("cpt") / "logs/log_history.json")
    assert [e["step"] for e in history if "eval_loss" in e] == [2, 4, 4]  # during training, and at its end

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model)  # the next stage, evaluate and vLLM read it so
    assert loaded.config.num_hidden_layers == 2


@pytest.mark.slow
def test_two_stages_train_a_lora_adapter_as_one_process_and_resume_from_their_shards(tmp_path: Path) -> None:
    """LoRA cut in two: each stage trains its layers' adapters, the first also the embedding and the last the head,
    which PEFT trains whole beside them (lora.modules_to_save); stopped by SIGTERM and resumed from the shards, the
    stages save one PEFT adapter folder, the one a single process saves."""
    lora = [
        "stages.cpt.enabled=false",
        "stages.sft.method=lora",
        "stages.sft.lora.modules_to_save=[embed_tokens, lm_head]",
        *cpt_settings(2, "sft"),
    ]
    single = make_run_dir(tmp_path / "one", lora, 10, 160)
    done = run_stage(single, "sft", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]

    cut = make_run_dir(tmp_path / "two", [*lora, *PIPELINE_SFT], 10, 160)
    preempt_after_checkpoint(cut, "sft")
    resume_sharded_run(cut, "sft", "checkpoint-3", pipeline_parallel=2)

    assert_trains_as_one(single, cut, "sft", steps=4, weights="adapter_model.safetensors")
    adapter = folder_weights(cut.stage_dir("sft") / "model", "adapter_model.safetensors")
    assert any(".layers.0." in name for name in adapter) and any(".layers.1." in name for name in adapter)
    assert {name for name in adapter if "lora_" not in name} == {
        "base_model.model.model.embed_tokens.weight",
        "base_model.model.lm_head.weight",
    }
    config = [json.loads((run.stage_dir("sft") / "model/adapter_config.json").read_text()) for run in (single, cut)]
    for settings in config:
        settings.pop("base_model_name_or_path")  # each run's own folder
        settings["target_modules"] = sorted(settings["target_modules"])  # PEFT writes a set
    assert config[0] == config[1]
    assert not list((cut.stage_dir("sft") / "model").glob(".stage-*"))


@pytest.mark.slow
def test_two_stages_train_in_float8_as_one_process(tmp_path: Path) -> None:
    """training.fp8 with the cut: each stage's linear layers run in float8 (torchao), scaled per micro-batch as one
    process scales its accumulation steps, so the two train alike."""
    cut = two_stages_train_as_one(tmp_path, "cpt", [*cpt_settings(2), "stages.cpt.training.fp8=true"])
    assert "[cpt] fp8: 14 linear layers in float8, 1 not" in (cut.root / "cpt.torchrun.log").read_text()


@pytest.mark.slow
def test_two_stages_cut_a_mixture_of_experts_whose_balance_loss_is_off(tmp_path: Path) -> None:
    """A tiny Qwen3-MoE cut in two, each stage's experts whole on its rank: with the router balance loss off (it is
    taken over every layer's routers at once), the stages train as one process does."""
    cut = two_stages_train_as_one(
        tmp_path, "cpt", [*cpt_settings(2), *MOE, "stages.cpt.training.router_aux_loss_coef=0"]
    )
    assert any(".mlp.experts." in name for name in folder_weights(cut.stage_dir("cpt") / "model"))


@pytest.mark.slow
def test_two_stages_train_lora_on_a_mixture_s_experts_as_one_process(tmp_path: Path) -> None:
    """LoRA on attention and on the stacked experts (lora.target_experts, PEFT's parameter adapters) of a tiny
    Qwen3-MoE cut in two, balance loss off: the adapter saved is one process's."""
    lora = [
        "stages.cpt.enabled=false",
        "stages.sft.method=lora",
        "stages.sft.lora.target_experts=true",
        *cpt_settings(2, "sft"),
        *MOE,
        "stages.sft.training.router_aux_loss_coef=0",
    ]
    cut = two_stages_train_as_one(tmp_path, "sft", lora, weights="adapter_model.safetensors")
    adapter = folder_weights(cut.stage_dir("sft") / "model", "adapter_model.safetensors")
    assert any(".layers.1.mlp.experts." in name for name in adapter)


@pytest.mark.slow
def test_two_pipelines_of_two_stages_train_a_tied_model_as_one_process(tmp_path: Path) -> None:
    """Four processes: Gemma 3 (its head tied to the embedding, held by the first and the last stage, their
    gradients summed) cut in two, FSDP2 over two pipelines, each pipeline its own rows."""
    mesh = ["stages.sft.distributed.strategy=fsdp", "stages.sft.distributed.pipeline_parallel=2"]
    # 2 micro-batches of 2 rows in each of the 2 pipelines: the one process's 2 x 4 rows a step
    common = ["model.from_config.architecture=gemma3", "stages.sft.training.gradient_accumulation_steps=2"]
    cut = assert_four_train_sft_as_one(tmp_path, common, mesh)
    written = json.loads((cut.stage_dir("sft") / "logs/distributed.json").read_text())
    assert written["pipeline_parallel"] == 2 and written["world_size"] == 4
    assert "lm_head.weight" not in folder_weights(cut.stage_dir("sft") / "model")  # saved once, as the embedding
    assert losses(cut, "sft")[-1] < losses(cut, "sft")[0]


@pytest.mark.slow
def test_two_pipelines_of_two_stages_spread_a_mixture_s_experts_and_train_as_one_process(tmp_path: Path) -> None:
    """Four processes: a tiny Qwen3-MoE cut in two, each stage's experts spread over its two ranks (one per pipeline,
    exchanging the routed tokens), the rest FSDP2-sharded over the pipelines; stopped by SIGTERM and resumed from the
    shards, the losses and the whole weights saved are one process's."""
    moe = [*MOE, "stages.cpt.training.router_aux_loss_coef=0"]
    single = make_run_dir(tmp_path / "one", [*cpt_settings(2), *moe], 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    mesh = [*PIPELINE, "stages.cpt.distributed.expert_parallel=2"]
    cut = make_run_dir(tmp_path / "four", [*cpt_settings(1), *moe, *mesh], 160, 10)  # 1 row x 2 pipelines
    preempt_after_checkpoint(cut, "cpt", processes=4)
    resume_sharded_run(cut, "cpt", "checkpoint-3", pipeline_parallel=2, expert_parallel=2, processes=4)
    log = (cut.root / "cpt.torchrun.log").read_text()
    assert "stage 2/2: layers 1-1 of 2, 2 micro-batches a step, 2 pipeline(s), its experts spread over 2 ranks" in log
    assert_trains_as_one(single, cut, "cpt", steps=4)
    assert any(".layers.1.mlp.experts." in name for name in folder_weights(cut.stage_dir("cpt") / "model"))


@pytest.mark.slow
def test_stages_split_over_pairs_that_spread_their_experts_train_as_one_process(tmp_path: Path) -> None:
    """Four processes, one pipeline: a tiny Qwen3-MoE cut in two, each stage's attention split over a pair of ranks
    (tensor_parallel 2) and its experts spread over the same pair (expert_parallel 2: each rank runs its experts on
    its half of the pair's rows); the losses and the whole weights saved are one process's."""
    moe = [*MOE, "stages.cpt.training.router_aux_loss_coef=0"]
    single = make_run_dir(tmp_path / "one", [*cpt_settings(2), *moe], 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    mesh = [*PIPELINE, "stages.cpt.distributed.tensor_parallel=2", "stages.cpt.distributed.expert_parallel=2"]
    cut = make_run_dir(tmp_path / "four", [*cpt_settings(2), *moe, *mesh], 160, 10)
    process = torchrun_stage(cut, "cpt", processes=4)
    assert process.wait(timeout=600) == 0, (cut.root / "cpt.torchrun.log").read_text()[-4000:]
    log = (cut.root / "cpt.torchrun.log").read_text()
    assert "1 pipeline(s), each layer split over 2 ranks, its experts spread over 2 ranks" in log
    assert_trains_as_one(single, cut, "cpt", steps=4, atol=5e-5)


@pytest.mark.slow
def test_lora_on_attention_and_experts_trains_as_one_process_where_the_stages_spread_their_experts(
    tmp_path: Path,
) -> None:
    """Four processes, the same mesh as above, LoRA on attention and on the stacked experts (lora.target_experts):
    each rank multiplies the tokens routed to its experts by its experts' rows of the whole adapter (low-rank grouped
    products, `stages.expert_lora`); the adapter saved is one process's."""
    lora = [
        "stages.cpt.enabled=false",
        "stages.sft.method=lora",
        "stages.sft.lora.target_experts=true",
        *MOE,
        "stages.sft.training.router_aux_loss_coef=0",
    ]
    single = make_run_dir(tmp_path / "one", [*lora, *cpt_settings(2, "sft")], 10, 160)
    done = run_stage(single, "sft", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    mesh = [*PIPELINE_SFT, "stages.sft.distributed.expert_parallel=2"]
    cut = make_run_dir(tmp_path / "four", [*lora, *cpt_settings(1, "sft"), *mesh], 10, 160)
    process = torchrun_stage(cut, "sft", processes=4)
    assert process.wait(timeout=600) == 0, (cut.root / "sft.torchrun.log").read_text()[-4000:]
    assert_trains_as_one(single, cut, "sft", steps=4, weights="adapter_model.safetensors")
    adapter = folder_weights(cut.stage_dir("sft") / "model", "adapter_model.safetensors")
    assert any(".layers.1.mlp.experts.lora_B" in name for name in adapter)


@pytest.mark.slow
def test_four_stages_of_uneven_layers_train_as_one_process(tmp_path: Path) -> None:
    """Four processes, one pipeline: 5 layers cut 2-1-1-1, two middle stages that neither read tokens nor compute
    the loss, 4 micro-batches of 1 row a step."""
    common = [
        "model.from_config.num_hidden_layers=5",
        "stages.cpt.training.max_steps=3",
        "stages.cpt.training.logging_steps=1",
        "stages.cpt.training.per_device_batch_size=1",
        "stages.cpt.training.gradient_accumulation_steps=4",
    ]
    single = make_run_dir(tmp_path / "one", common, 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    cut = make_run_dir(
        tmp_path / "four", [*common, *PIPELINE[:1], "stages.cpt.distributed.pipeline_parallel=4"], 160, 10
    )
    process = torchrun_stage(cut, "cpt", processes=4)
    assert process.wait(timeout=600) == 0, (cut.root / "cpt.torchrun.log").read_text()[-4000:]
    log = (cut.root / "cpt.torchrun.log").read_text()
    assert "pipeline stage 2/4: layers 2-2 of 5" in log
    # the model read once, by rank 0: each other rank receives its stage's weights alone (a layer's 11; the last
    # stage's norm and head besides)
    assert "pipeline stage 2/4: 11 weights from rank 0" in log and "pipeline stage 4/4: 13 weights from rank 0" in log
    assert "pipeline stage 1/4: " not in log.replace("pipeline stage 1/4: layers", "")
    assert_trains_as_one(single, cut, "cpt", steps=3)


@pytest.mark.slow
def test_two_stages_each_split_over_two_ranks_train_as_one_process(tmp_path: Path) -> None:
    """Four processes, one pipeline: two stages, each stage's layers split over two ranks by the family's
    tensor-parallel plan (pipeline_parallel 2 x tensor_parallel 2, the head split by vocabulary); stopped by SIGTERM
    and resumed from the shards, the whole weights saved are one process's."""
    single = make_run_dir(tmp_path / "one", cpt_settings(2), 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    mesh = [*PIPELINE, "stages.cpt.distributed.tensor_parallel=2"]
    cut = make_run_dir(tmp_path / "four", [*cpt_settings(2), *mesh], 160, 10)
    preempt_after_checkpoint(cut, "cpt", processes=4)
    resume_sharded_run(cut, "cpt", "checkpoint-3", pipeline_parallel=2, processes=4)
    log = (cut.root / "cpt.torchrun.log").read_text()
    assert "layers 1-1 of 2, 2 micro-batches a step, 1 pipeline(s), each layer split over 2 ranks" in log
    # A split layer's gradient is summed in another order; over accumulated micro-batches Adam turns that into
    # up to 2e-5 on the few weights whose gradient is near zero (the same without pipelines). A partial gradient
    # summed twice (q_norm, k_norm: `sum_partial_gradients_per_backward`) is 7e-3 off.
    assert_trains_as_one(single, cut, "cpt", steps=4, atol=5e-5)
    written = json.loads((cut.stage_dir("cpt") / "logs/distributed.json").read_text())
    assert (written["pipeline_parallel"], written["tensor_parallel"], written["world_size"]) == (2, 2, 4)


@pytest.mark.slow
def test_two_pipelines_of_split_stages_train_as_one_process(tmp_path: Path) -> None:
    """Eight processes: two stages x two pipelines x two tensor-parallel ranks, FSDP2 sharding each stage's split
    weights over the pipelines (2-D DTensors), a checkpoint taken on the way; each pipeline its own rows, one row per
    micro-batch: the one process's 2 x 2 rows a step."""
    one = make_run_dir(tmp_path / "one", ["stages.cpt.training.max_steps=3", *cpt_settings(2)[1:]], 160, 10)
    done = run_stage(one, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    mesh = [*PIPELINE, "stages.cpt.distributed.tensor_parallel=2"]
    cut = make_run_dir(tmp_path / "eight", ["stages.cpt.training.max_steps=3", *cpt_settings(1)[1:], *mesh], 160, 10)
    process = torchrun_stage(cut, "cpt", processes=8)
    assert process.wait(timeout=900) == 0, (cut.root / "cpt.torchrun.log").read_text()[-4000:]
    assert (
        "2 micro-batches a step, 2 pipeline(s), each layer split over 2 ranks"
        in (cut.root / "cpt.torchrun.log").read_text()
    )
    assert_trains_as_one(one, cut, "cpt", steps=3, atol=5e-5)
    assert (cut.stage_dir("cpt") / "checkpoints/checkpoint-2/sharded").is_dir()


@pytest.mark.slow
def test_two_stages_each_split_over_two_ranks_train_a_lora_adapter_as_one_process(tmp_path: Path) -> None:
    """LoRA with pipeline_parallel 2 x tensor_parallel 2: the adapters drawn whole before the cut, each split with its
    layer as PEFT splits them (a column-wise layer's B by rows, a row-wise layer's A by columns); stopped by SIGTERM
    and resumed from the shards, the stages save the adapter one process saves."""
    lora = ["stages.cpt.enabled=false", "stages.sft.method=lora", *cpt_settings(2, "sft")]
    single = make_run_dir(tmp_path / "one", lora, 10, 160)
    done = run_stage(single, "sft", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    cut = make_run_dir(tmp_path / "four", [*lora, *PIPELINE_SFT, "stages.sft.distributed.tensor_parallel=2"], 10, 160)
    preempt_after_checkpoint(cut, "sft", processes=4)
    resume_sharded_run(cut, "sft", "checkpoint-3", pipeline_parallel=2, tensor_parallel=2, processes=4)
    assert_trains_as_one(single, cut, "sft", steps=4, weights="adapter_model.safetensors")
    adapter = folder_weights(cut.stage_dir("sft") / "model", "adapter_model.safetensors")
    assert any(".layers.1.self_attn.o_proj.lora_A" in name for name in adapter)


@pytest.mark.slow
def test_two_stages_each_split_over_two_ranks_train_in_float8_as_one_process(tmp_path: Path) -> None:
    """pipeline_parallel 2 x tensor_parallel 2 with training.fp8: each stage's layers converted to float8 before the
    split, each weight's scale taken over the whole weight, as one process in float8. float8 rounding turns the
    split's summation order into whole rounding steps (TP alone ends as far from one process with 2 micro-batches a
    step), hence the weights' tolerance."""
    import torch

    fp8 = [*cpt_settings(2), "stages.cpt.training.fp8=true"]
    single = make_run_dir(tmp_path / "one", fp8, 160, 10)
    done = run_stage(single, "cpt", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    cut = make_run_dir(tmp_path / "four", [*fp8, *PIPELINE, "stages.cpt.distributed.tensor_parallel=2"], 160, 10)
    process = torchrun_stage(cut, "cpt", processes=4)
    assert process.wait(timeout=600) == 0, (cut.root / "cpt.torchrun.log").read_text()[-4000:]
    assert "[cpt] fp8: 14 linear layers in float8, 1 not" in (cut.root / "cpt.torchrun.log").read_text()
    torch.testing.assert_close(torch.tensor(losses(cut, "cpt")), torch.tensor(losses(single, "cpt")), rtol=1e-4, atol=0)
    expected, got = folder_weights(single.stage_dir("cpt") / "model"), folder_weights(cut.stage_dir("cpt") / "model")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1.5e-2, msg=name)


def orpo_settings(method: str, per_device: int, microbatches: int, algorithm: str = "orpo") -> list[str]:
    """rlhf's ORPO (or `algorithm`) alone (cpt and sft off), full or LoRA: three logged steps of `microbatches`
    micro-batches of `per_device` pairs."""
    return [
        "stages.cpt.enabled=false",
        "stages.sft.enabled=false",
        f"stages.rlhf.algorithm={algorithm}",
        f"stages.rlhf.method={method}",
        "stages.rlhf.training.max_steps=3",
        "stages.rlhf.training.logging_steps=1",
        f"stages.rlhf.training.per_device_batch_size={per_device}",
        f"stages.rlhf.training.gradient_accumulation_steps={microbatches}",
    ]


ORPO_LOGGED = ("nll_loss", "log_odds_ratio", "logps/chosen", "eval_rewards/accuracies", "eval_nll_loss")
DPO_LOGGED = ("entropy", "mean_token_accuracy", "logits/chosen", "logps/rejected", "eval_rewards/chosen")
KTO_LOGGED = ("kl", "entropy", "logits/chosen", "logps/rejected", "rewards/margins", "eval_kl", "eval_rewards/chosen")
PAIRED_RESULTS = (
    "rewards_margin_first",
    "rewards_margin_last",
    "rewards_accuracy_last",
    "eval_loss",
    "eval_rewards_margin",
)
KTO_RESULTS = ("rewards_margin_first", "rewards_margin_last", "kl_first", "kl_last", "eval_loss", "eval_kl")


def assert_orpo_trains_as_one(
    single: RunDir,
    cut: RunDir,
    method: str,
    logged: tuple[str, ...] = ORPO_LOGGED,
    results: tuple[str, ...] = PAIRED_RESULTS,
) -> None:
    """The cut run trained ORPO (or DPO, KTO: their `logged` metrics and stage.json `results`) as the single process
    did: the losses, the saved weights or adapter, and TRL's metrics during training (logged every step) and on the
    held-out rows."""
    assert_trains_as_one(single, cut, "rlhf", steps=3, weights=SAVED[method], atol=1e-4)
    one, two = single.read_result("rlhf"), cut.read_result("rlhf")
    assert one is not None and two is not None
    for name in results:
        assert abs(one.metrics[name] - two.metrics[name]) < 1e-4, (name, one.metrics[name], two.metrics[name])
    histories = [read_log_history(run.stage_dir("rlhf") / "logs/log_history.json") for run in (single, cut)]
    for key in logged:
        a, b = ([entry[key] for entry in history if key in entry] for history in histories)
        assert len(a) == len(b) > 0, key
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (key, a, b)


@pytest.mark.slow
def test_orpo_on_two_stages_trains_a_lora_adapter_as_one_process(tmp_path: Path) -> None:
    """rlhf's ORPO cut in two: each micro-batch holds its pairs' chosen and rejected rows, the last stage takes TRL's
    odds-ratio loss and metrics from its logits (`stages.pipeline_preference`); the two train the adapter as one
    process does over the same micro-batches (full training: the four-process test below)."""
    method = "lora"
    common = orpo_settings(method, per_device=2, microbatches=2)
    single = make_preference_run_dir(tmp_path / "one", common)
    run_ok(single, "rlhf", OMP_NUM_THREADS="1")
    cut = make_preference_run_dir(tmp_path / "two", [*common, *PIPELINE_RLHF])
    process = torchrun_stage(cut, "rlhf")
    assert process.wait(timeout=600) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    assert_orpo_trains_as_one(single, cut, method)
    assert "pipeline stage 2/2: layers 1-1 of 2" in (cut.root / "rlhf.torchrun.log").read_text()


@pytest.mark.slow
def test_orpo_on_two_pipelines_of_two_stages_trains_a_tied_model_as_one_process(tmp_path: Path) -> None:
    """Four processes: Gemma 3 (its head tied to the embedding) fully trained with ORPO over two pipelines of two
    stages, each pipeline its own pairs (FSDP2's average over the pipelines is DDP's), against one process whose
    accumulation steps are both pipelines' micro-batches; each pipeline's micro-batch logged as one of its steps."""
    gemma = "model.from_config.architecture=gemma3"
    single = make_preference_run_dir(tmp_path / "one", [gemma, *orpo_settings("full", per_device=2, microbatches=4)])
    run_ok(single, "rlhf", OMP_NUM_THREADS="1")
    common = [gemma, *orpo_settings("full", per_device=2, microbatches=2), *PIPELINE_RLHF]
    cut = make_preference_run_dir(tmp_path / "four", common)
    process = torchrun_stage(cut, "rlhf", processes=4)
    assert process.wait(timeout=900) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    assert_orpo_trains_as_one(single, cut, "full")


def rlhf_alone_and_on_split_stages(root: Path, common: list[str]) -> tuple[RunDir, RunDir]:
    """rlhf with the `common` settings on one process, and on four (torchrun): two stages, each split over a pair
    (tensor parallelism). Both succeed; returns both runs."""
    single = make_preference_run_dir(root / "one", common)
    run_ok(single, "rlhf", OMP_NUM_THREADS="1")
    split = [*PIPELINE_RLHF, "stages.rlhf.distributed.tensor_parallel=2"]
    cut = make_preference_run_dir(root / "four", [*common, *split])
    process = torchrun_stage(cut, "rlhf", processes=4)
    assert process.wait(timeout=900) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    return single, cut


REFERENCED = {"dpo": (DPO_LOGGED, PAIRED_RESULTS, "64 train pairs"), "kto": (KTO_LOGGED, KTO_RESULTS, "128 train rows")}
"""A preference algorithm with a reference: its logged metrics, its stage.json results, its rows a reference pass
counts."""


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dpo", "kto"])
def test_dpo_and_kto_on_two_stages_train_as_one_process(tmp_path: Path, algorithm: str) -> None:
    """rlhf's full DPO (KTO) cut in two: the reference's log-probabilities computed once through the stages before
    training (the starting weights), then the loss and TRL's metrics on the last stage (KTO: each micro-batch holds
    its completions, then their mismatched completions, the KL term's rows, held constant); the two train as one
    process does over the same micro-batches."""
    logged, results, counted = REFERENCED[algorithm]
    common = orpo_settings("full", per_device=2, microbatches=2, algorithm=algorithm)
    single = make_preference_run_dir(tmp_path / "one", common)
    run_ok(single, "rlhf", OMP_NUM_THREADS="1")
    cut = make_preference_run_dir(tmp_path / "two", [*common, *PIPELINE_RLHF])
    process = torchrun_stage(cut, "rlhf")
    assert process.wait(timeout=600) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    assert_orpo_trains_as_one(single, cut, "full", logged, results)
    log = (cut.root / "rlhf.torchrun.log").read_text()
    assert f"reference log-probabilities of {counted}, through the stages" in log


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dpo", "kto"])
def test_dpo_and_kto_with_lora_on_two_pipelines_of_two_stages_train_as_one_process(
    tmp_path: Path, algorithm: str
) -> None:
    """Four processes: DPO's (KTO's) adapter over two pipelines of two stages, its reference TRL's frozen copy of the
    starting adapter (`ref`, made before the cut so that FSDP2 shards it with the adapter), against one process whose
    accumulation steps are both pipelines' micro-batches. Each pipeline's micro-batch is logged as its own entry (a
    micro-batch's desirable and undesirable KTO rows differ in count, so a mean over pipelines would differ)."""
    logged, results, _ = REFERENCED[algorithm]
    single = make_preference_run_dir(tmp_path / "one", orpo_settings("lora", 2, 4, algorithm=algorithm))
    run_ok(single, "rlhf", OMP_NUM_THREADS="1")
    common = [*orpo_settings("lora", 2, 2, algorithm=algorithm), *PIPELINE_RLHF]
    cut = make_preference_run_dir(tmp_path / "four", common)
    process = torchrun_stage(cut, "rlhf", processes=4)
    assert process.wait(timeout=900) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    assert_orpo_trains_as_one(single, cut, "lora", logged, results)
    assert "ref" not in {path.name for path in (cut.stage_dir("rlhf") / "model").iterdir()}  # the adapter alone


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "method"), [("dpo", "lora"), ("dpo", "full"), ("kto", "full")])
def test_dpo_and_kto_with_the_reference_at_each_step_train_as_one_process(
    tmp_path: Path, algorithm: str, method: str
) -> None:
    """`precompute_ref_log_probs: false`: each step's (and each held-out batch's) reference log-probabilities through
    the stages first, forward only (LoRA: with TRL's frozen `ref` adapter; full: each stage's frozen copy of its
    starting weights, run by a schedule of its own), then the step; two stages train as one process that computes
    its reference at each step does (full: with its whole frozen copy)."""
    common = [*orpo_settings(method, 2, 2, algorithm=algorithm), "stages.rlhf.precompute_ref_log_probs=false"]
    single = make_preference_run_dir(tmp_path / "one", common)
    run_ok(single, "rlhf", OMP_NUM_THREADS="1")
    cut = make_preference_run_dir(tmp_path / "two", [*common, *PIPELINE_RLHF])
    process = torchrun_stage(cut, "rlhf")
    assert process.wait(timeout=600) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    logged, results, _ = REFERENCED[algorithm]
    assert_orpo_trains_as_one(single, cut, method, logged, results)
    assert "reference log-probabilities of" not in (cut.root / "rlhf.torchrun.log").read_text()  # none precomputed


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dpo", "kto"])
def test_full_dpo_and_kto_with_the_reference_at_each_step_on_stages_split_over_pairs_train_as_one_process(
    tmp_path: Path, algorithm: str
) -> None:
    """Four processes: two stages, each split over a pair (tensor parallelism), full DPO or KTO with the reference at
    each step: each stage's frozen copy of its starting weights is split as the policy is and run by its own schedule;
    the four train as one process that computes its reference at each step from its whole frozen copy."""
    common = [*orpo_settings("full", 2, 2, algorithm=algorithm), "stages.rlhf.precompute_ref_log_probs=false"]
    single, cut = rlhf_alone_and_on_split_stages(tmp_path, common)
    logged, results, _ = REFERENCED[algorithm]
    assert_orpo_trains_as_one(single, cut, "full", logged, results)
    log = (cut.root / "rlhf.torchrun.log").read_text()
    assert "each layer split over 2 ranks" in log
    assert "reference log-probabilities of" not in log  # none precomputed


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_grpo_on_two_stages_samples_and_trains_as_one_process(tmp_path: Path, method: str) -> None:
    """rlhf's GRPO cut in two: each prompt's completions sampled through the stages (transformers' pipeline forward,
    each stage caching its own layers, both seeded as the one process), scored on both, then TRL's loss on the last
    stage from its logits; the two sample the same completions and train as one process does over the same
    micro-batches: the rewards, the losses, TRL's metrics (the KL term's too), the adapter (LoRA: the reference is the
    policy without it) or the weights (full: the reference is each stage's frozen copy of its starting weights, run
    by a schedule of its own, where one process reads TRL's whole copy)."""
    common = [*grpo_settings(method, steps=3), "stages.rlhf.training.gradient_accumulation_steps=2"]
    single = make_preference_run_dir(tmp_path / "one", common)
    run_ok(single, "rlhf", OMP_NUM_THREADS="1")
    cut = make_preference_run_dir(tmp_path / "two", [*common, *PIPELINE_RLHF])
    process = torchrun_stage(cut, "rlhf")
    assert process.wait(timeout=600) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    assert_trains_as_one(single, cut, "rlhf", steps=3, weights=SAVED[method], atol=1e-4)
    logged = ["reward", "entropy", "clip_ratio/region_mean", "completions/mean_length", "num_tokens", "kl"]
    assert_grpo_logged_alike(single, cut, logged)
    assert not (cut.stage_dir("rlhf") / "reference").exists()  # no whole copy saved for TRL to read


def assert_grpo_logged_alike(one: RunDir, other: RunDir, keys: list[str]) -> None:
    """Both runs logged TRL's GRPO metrics `keys` at each of their 3 steps, within 1e-4 (the KL term grew from 0)."""
    histories = [read_log_history(run.stage_dir("rlhf") / "logs/log_history.json") for run in (one, other)]
    for key in keys:
        a, b = ([entry[key] for entry in history if key in entry] for history in histories)
        assert len(a) == len(b) == 3, (key, a, b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (key, a, b)
    if "kl" in keys:
        kl = [entry["kl"] for entry in histories[1] if "kl" in entry]
        assert kl[0] == 0 < kl[-1]  # the policy leaves its reference


@pytest.mark.slow
def test_grpo_on_two_stages_resumes_from_their_shards_as_one_process_trains(tmp_path: Path) -> None:
    """GRPO's adapter on two stages, stopped as a preempted pod is (SIGTERM to torchrun) after its second checkpoint:
    the ranks checkpoint together at the end of the next step (each its RNG, which its sampling goes on from), and the
    rerun resumes from the shards, samples what one uninterrupted process samples and ends with its adapter."""
    common = [*grpo_settings("lora", steps=4), "stages.rlhf.training.gradient_accumulation_steps=2"]
    common += ["stages.rlhf.training.save_steps=2"]
    single = make_preference_run_dir(tmp_path / "one", common)
    run_ok(single, "rlhf", OMP_NUM_THREADS="1")
    cut = make_preference_run_dir(tmp_path / "two", [*common, *PIPELINE_RLHF])
    preempt_after_checkpoint(cut, "rlhf")
    resume_sharded_run(cut, "rlhf", "checkpoint-3", pipeline_parallel=2)
    assert_trains_as_one(single, cut, "rlhf", steps=4, weights=SAVED["lora"], atol=1e-4)
    one, two = (run.read_result("rlhf").metrics for run in (single, cut))  # type: ignore[union-attr]
    assert two["reward_last"] == pytest.approx(one["reward_last"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_grpo_on_two_stages_split_over_pairs_trains_as_one_process(tmp_path: Path, method: str) -> None:
    """Four processes: two stages, each split over a pair (tensor parallelism), sample GRPO's completions through the
    stages (a pair's ranks alike, seeded as the pipeline) and train as one process does: the adapter, or the weights
    against each stage's frozen copy split as the policy is."""
    common = [*grpo_settings(method, steps=3), "stages.rlhf.training.gradient_accumulation_steps=2"]
    single, cut = rlhf_alone_and_on_split_stages(tmp_path, common)
    assert_trains_as_one(single, cut, "rlhf", steps=3, weights=SAVED[method], atol=1e-4)
    assert_grpo_logged_alike(single, cut, ["reward", "kl", "entropy", "num_tokens"])
    assert "each layer split over 2 ranks" in (cut.root / "rlhf.torchrun.log").read_text()


@pytest.mark.slow
def test_grpo_on_two_pipelines_of_two_stages_trains_a_lora_adapter_as_ddp_does(tmp_path: Path) -> None:
    """Four processes: GRPO's adapter over two pipelines of two stages (FSDP2 over the pipelines, which every
    pipeline's sampling steps join until the longest ends), each pipeline sampling its own prompts' completions
    seeded as the DDP process it stands for, TRL's gathers and advantages over the pipelines; against DDP over two
    processes: the same rewards, losses, metrics and adapter."""
    common = [*grpo_settings("lora", steps=3), "stages.rlhf.training.gradient_accumulation_steps=2"]
    ddp = make_preference_run_dir(tmp_path / "ddp", [*common, "stages.rlhf.distributed.strategy=ddp"])
    process = torchrun_stage(ddp, "rlhf", processes=2)
    assert process.wait(timeout=600) == 0, (ddp.root / "rlhf.torchrun.log").read_text()[-4000:]
    cut = make_preference_run_dir(tmp_path / "four", [*common, *PIPELINE_RLHF])
    process = torchrun_stage(cut, "rlhf", processes=4)
    assert process.wait(timeout=900) == 0, (cut.root / "rlhf.torchrun.log").read_text()[-4000:]
    assert_trains_as_one(ddp, cut, "rlhf", steps=3, weights=SAVED["lora"], atol=1e-4)
    assert_grpo_logged_alike(ddp, cut, ["reward", "reward_std", "kl", "entropy", "num_tokens"])


def test_preference_pairs_are_laid_out_as_the_schedule_splits_them() -> None:
    """Each micro-batch: its pairs' chosen rows, then their rejected rows, padded to the width; a short batch's
    missing pairs are rows without labels, left out of the loss and of the divisor."""
    import torch

    def pair(prompt: list[int], chosen: list[int], rejected: list[int]) -> dict[str, list[int]]:
        row: dict[str, list[int]] = {}
        for half, answer in (("chosen", chosen), ("rejected", rejected)):
            row[f"{half}_input_ids"] = prompt + answer
            row[f"{half}_attention_mask"] = [1] * (len(prompt) + len(answer))
            row[f"{half}_labels"] = [-100] * len(prompt) + answer
        return row

    collate = PairedRows(pairs=2, microbatches=2, width=5, pad_token_id=0)
    batch = collate([pair([1, 2], [3], [4, 5]), pair([6], [7, 8], [9]), pair([1], [2], [3])])
    ids, target = batch["input_ids"], batch["labels"]
    assert ids.shape == (8, 5) and target.shape == (8, 3, 5) and batch["position_ids"].shape == (8, 5)
    # micro-batch 0: chosen of pairs 0 and 1, then their rejected; micro-batch 1: pair 2 and a pair without rows
    assert ids[:4].tolist() == [[1, 2, 3, 0, 0], [6, 7, 8, 0, 0], [1, 2, 4, 5, 0], [6, 9, 0, 0, 0]]
    assert ids[4:].tolist() == [[1, 2, 0, 0, 0], [0] * 5, [1, 3, 0, 0, 0], [0] * 5]
    assert target[0].tolist() == [[1, 2, 3, -100, -100], [-100, -100, 3, -100, -100], [1, 1, 1, 0, 0]]
    assert target[2, 0].tolist() == [-100] * 5  # ORPO's NLL takes the chosen rows alone
    assert target[5].tolist() == [[-100] * 5, [-100] * 5, [0] * 5]
    loss = OddsRatioLoss(odds_ratio_loss=None, beta=0.1, pairs=2, microbatches=2)
    loss.begin(target, train=True)
    assert loss.divisor == 2
    loss.begin(collate([pair([1], [2], [3])])["labels"], train=True)
    assert loss.divisor == 1  # the Trainer's accumulation steps of a short last step: the one that holds a pair
    empty = collate([])["labels"]  # an eval batch of a pipeline out of pairs
    loss.begin(empty, train=False)
    logits = torch.zeros(4, 5, 7, requires_grad=True)
    assert loss(logits, empty[:4]).item() == 0.0 and loss(logits, empty[4:]).item() == 0.0
    assert len(loss.records) == 2 and not torch.stack(loss.records).any()  # no pairs: nothing recorded
    from trl import DPOConfig

    refuse_unsupported_dpo("rlhf", DPOConfig(output_dir="unused", bf16=False))  # TRL's defaults: computed here
    with pytest.raises(NotSupportedHere, match=r"stages\.rlhf\.training\.extra_args: loss_type, ld_alpha under"):
        refuse_unsupported_dpo("rlhf", DPOConfig(output_dir="unused", bf16=False, loss_type=["ipo"], ld_alpha=0.5))


def test_kto_rows_are_laid_out_with_their_mismatched_completions() -> None:
    """KTO: each micro-batch its completions, then their mismatched completions (KL rows: the prompt and another
    row's completion), the reference log-probabilities and labels in the target; the KL term held constant."""
    from types import SimpleNamespace

    import torch

    def row(prompt: list[int], answer: list[int], other: list[int], label: bool) -> dict[str, object]:
        return {"prompt_ids": prompt, "completion_ids": answer, "KL_completion_ids": other, "label": label}

    collate = UnpairedRows(rows=2, microbatches=2, width=4, pad_token_id=0, kl=True)
    features = [row([1, 2], [3], [4, 5, 6], True), row([7], [4, 5, 6], [3], False), row([8], [9], [9], True)]
    features[0] |= {"ref_logps": -1.5, "ref_KL_logps": -2.5}
    features[1] |= {"ref_logps": -3.0, "ref_KL_logps": -1.0}
    batch = collate(features)
    ids, target = batch["input_ids"], batch["labels"]
    assert ids.shape == (8, 4) and target.shape == (8, 3, 4) and target.dtype == torch.float64
    # micro-batch 0: rows 0 and 1, then their KL rows (truncated to the width from the start); micro-batch 1: row 2
    assert ids[:4].tolist() == [[1, 2, 3, 0], [7, 4, 5, 6], [1, 2, 4, 5], [7, 3, 0, 0]]
    assert ids[4:].tolist() == [[8, 9, 0, 0], [0] * 4, [8, 9, 0, 0], [0] * 4]
    assert target[0].tolist() == [[-1.5, 1, -100, -100], [-100, -100, 3, -100], [1, 1, 1, 0]]
    assert target[1, 0, 1] == 0  # undesirable
    assert target[2].tolist() == [[-2.5, -100, -100, -100], [-100, -100, 4, 5], [0] * 4]  # attends nothing counted
    trainer = SimpleNamespace(
        beta=0.5, loss_type="kto", calculate_KL=True, desirable_weight=1.0, undesirable_weight=1.0
    )
    loss = UnpairedLoss(trainer, rows=2, microbatches=2)
    loss.begin(target, train=True)
    assert loss.divisor == 2
    logits = torch.randn(4, 4, 10, requires_grad=True)
    value = loss(logits, target[:4])
    value.backward()
    assert logits.grad is not None and not logits.grad[2:].any()  # the KL rows add nothing to the gradient
    # the loss by hand: log-probabilities of the completions and the KL rows, the KL term clamped at 0
    logps = torch.log_softmax(logits.detach().float(), -1)
    own = torch.stack([logps[0, 1, 3], logps[1, 0:3, :].gather(-1, torch.tensor([[4], [5], [6]])).sum()])
    mismatched = torch.stack([logps[2, 1:3].gather(-1, torch.tensor([[4], [5]])).sum(), logps[3, 0, 3]])
    kl = (mismatched - torch.tensor([-2.5, -1.0])).mean().clamp(min=0)
    ratios = own - torch.tensor([-1.5, -3.0])
    expected = torch.stack([1 - torch.sigmoid(0.5 * (ratios[0] - kl)), 1 - torch.sigmoid(0.5 * (kl - ratios[1]))])
    torch.testing.assert_close(value, expected.mean() / 2)
    apo = UnpairedRows(rows=2, microbatches=2, width=4, pad_token_id=0, kl=False)  # no KL term: no KL rows
    assert apo([row([1], [2], [3], True)])["input_ids"].shape == (4, 4)


def test_the_layers_are_cut_into_consecutive_even_runs() -> None:
    assert layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert layer_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert [len(r) for r in layer_ranges(80, 3)] == [27, 27, 26]


def test_every_micro_batch_gets_the_planned_shape_without_new_labels() -> None:
    import torch

    batch = {
        "input_ids": torch.tensor([[5, 6, 7]]),
        "labels": torch.tensor([[5, 6, 7]]),
        "position_ids": torch.tensor([[0, 1, 0]]),
    }
    padded = pad_rows(batch, rows=2, width=5, pad_token_id=0)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0, 0], [0, 0, 0, 0, 0]]
    assert padded["labels"].tolist() == [[5, 6, 7, -100, -100], [-100] * 5]
    assert padded["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]  # the padding runs on


def test_the_spec_refuses_what_the_pipeline_cannot_run() -> None:
    pp = "stages.sft.distributed.pipeline_parallel=2"
    full, fsdp = "stages.sft.method=full", "stages.sft.distributed.strategy=fsdp"
    grads = "stages.sft.training.gradient_accumulation_steps=4"
    assert "set distributed.strategy to 'fsdp'" in spec_error("llama3-dolly", [pp, full])
    assert "does not shard 4-bit weights" in spec_error("llama3-dolly", [pp, fsdp, "stages.sft.method=qlora"])
    accumulation = "stages.sft.training.gradient_accumulation_steps=1"
    assert "one per stage at least" in spec_error("llama3-dolly", [pp, fsdp, full, accumulation])
    odd = ["stages.sft.distributed.pipeline_parallel=3", fsdp, full]
    odd.append("stages.sft.training.gradient_accumulation_steps=4")
    odd.append("stages.sft.resources.gpus_per_node=8")
    assert "must divide the stage's 8 GPUs" in spec_error("llama3-dolly", odd)
    tp = "stages.sft.distributed.tensor_parallel=2"
    split = [pp, fsdp, full, tp, "stages.sft.training.gradient_accumulation_steps=2"]
    assert load_pipeline("llama3-dolly", overrides=split).spec.stages.sft.distributed.tensor_parallel == 2
    lora = ["stages.sft.method=lora", "stages.sft.lora.modules_to_save=[lm_head]"]
    assert "which tensor_parallel does not split" in spec_error("llama3-dolly", [*split, *lora])
    load_pipeline("llama3-dolly", overrides=[*split, lora[0]])
    load_pipeline("llama3-dolly", overrides=[*split, "stages.sft.training.fp8=true"])
    nodes = ["stages.sft.resources.gpus_per_node=2", "stages.sft.resources.nodes=3"]
    assert "2 times tensor_parallel 2 must divide the stage's 6 GPUs" in spec_error("llama3-dolly", [*split, *nodes])
    moe_split = [*split, "stages.sft.training.router_aux_loss_coef=0", "stages.sft.distributed.expert_parallel=2"]
    load_pipeline("qwen3-30b-a3b", overrides=moe_split)  # each stage's experts spread whole over its pairs
    wide = [*moe_split, "stages.sft.distributed.tensor_parallel=4"]  # a group of experts spans whole pairs, not 4
    assert "with expert_parallel 2, tensor_parallel 4 must divide it" in spec_error("qwen3-30b-a3b", wide)
    # without tensor_parallel each stage spreads its experts over its own GPUs
    spread = [pp, fsdp, full, grads, "stages.sft.training.router_aux_loss_coef=0"]
    spread.append("stages.sft.distributed.expert_parallel=8")
    load_pipeline("qwen3-30b-a3b", overrides=spread)  # 2 nodes of 8: a stage's 8 GPUs
    error = spec_error("qwen3-30b-a3b", [*spread, "stages.sft.resources.nodes=1"])
    assert "expert_parallel: 8 must divide the 4 GPUs of each of the 2 pipeline stages" in error
    assert "would split Qwen/Qwen3-30B-A3B-Base's experts too" in spec_error("qwen3-30b-a3b", moe_split[:-1])
    rlhf = ["stages.rlhf.distributed.pipeline_parallel=2", "stages.rlhf.distributed.strategy=fsdp"]
    rlhf.append("stages.rlhf.training.gradient_accumulation_steps=2")
    full_rlhf = "stages.rlhf.method=full"
    grpo = "stages.rlhf.algorithm=grpo"
    rlhf.append("stages.rlhf.reward_functions=[{name: hangul_ratio}]")
    lora = "stages.rlhf.method=lora"
    load_pipeline("korean-llm", overrides=[*rlhf, grpo, lora])  # sampled through the stages; its reference: no adapter
    load_pipeline("korean-llm", overrides=[*rlhf, grpo, full_rlhf])  # its reference: each stage's frozen copy
    load_pipeline("korean-llm", overrides=[*rlhf, grpo, full_rlhf, "stages.rlhf.distributed.tensor_parallel=2"])
    spread = [*rlhf, grpo, lora, "stages.rlhf.distributed.expert_parallel=2"]
    assert "expert_parallel: is 2; rlhf's grpo samples through pipeline stages whose" in spec_error(
        "korean-llm", spread
    )
    no_precompute = [*rlhf, "stages.rlhf.precompute_ref_log_probs=false", full_rlhf]
    load_pipeline("korean-llm", overrides=no_precompute)  # each stage's frozen copy, run at each step
    kto = "stages.rlhf.algorithm=kto"
    load_pipeline("korean-llm", overrides=[*no_precompute, kto])
    load_pipeline("korean-llm", overrides=[*rlhf, kto])
    load_pipeline("korean-llm", overrides=[*no_precompute, lora])  # the adapter switched off at each step
    load_pipeline("korean-llm", overrides=[*rlhf, full_rlhf])  # dpo, its reference precomputed
    load_pipeline("korean-llm", overrides=[*rlhf, full_rlhf, "stages.rlhf.algorithm=orpo"])
    # a mixture of experts the spec knows (a hub model's name, or model.from_config) cuts with its balance loss off
    moe = [pp, fsdp, grads]
    assert "trains with its router balance loss off" in spec_error("qwen3-30b-a3b", moe)
    assert "is 0.001;" in spec_error("qwen3-30b-a3b", [*moe, "stages.sft.training.router_aux_loss_coef=0.001"])
    load_pipeline("qwen3-30b-a3b", overrides=[*moe, "stages.sft.training.router_aux_loss_coef=0"])
    with pytest.raises(SpecError, match=r"stages\.sft\.training\.router_aux_loss_coef: is unset"):
        load_pipeline("qwen3-30b-a3b", profile="local", overrides=moe)  # its tiny qwen3_moe from config
    spec = load_pipeline("llama3-dolly", overrides=[pp, fsdp, full, grads]).spec
    assert spec.stages.sft.distributed.pipeline_parallel == 2


def test_a_model_the_stages_cannot_cut_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig, Qwen3MoeConfig

    section = load_pipeline("korean-llm", overrides=PIPELINE).spec.stages.cpt
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_fits("cpt", section, LlamaConfig(num_hidden_layers=4))
    balanced = Qwen3MoeConfig(num_hidden_layers=4, output_router_logits=True)
    with pytest.raises(NotSupportedHere, match=r"stages\.cpt\.distributed\.pipeline_parallel is 2, but qwen3_moe"):
        check_fits("cpt", section, balanced)
    check_fits("cpt", section, Qwen3MoeConfig(num_hidden_layers=4, output_router_logits=False))  # balance loss off
    with pytest.raises(NotSupportedHere, match="more than the model's 1 layers"):
        check_fits("cpt", section, LlamaConfig(num_hidden_layers=1))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(NotSupportedHere, match="does not divide this run's 3 processes"):
        check_fits("cpt", section, LlamaConfig(num_hidden_layers=4))
    # each stage's layers split too (tensor_parallel): full fine-tuning of a dense model whose heads it divides
    split = load_pipeline("korean-llm", overrides=[*PIPELINE, "stages.cpt.distributed.tensor_parallel=2"])
    section = split.spec.stages.cpt
    monkeypatch.setenv("WORLD_SIZE", "6")
    dense = LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    with pytest.raises(NotSupportedHere, match="is 2 times tensor_parallel 2, which does not divide this run's 6"):
        check_fits("cpt", section, dense)
    monkeypatch.setenv("WORLD_SIZE", "8")
    check_fits("cpt", section, dense)
    with pytest.raises(NotSupportedHere, match=r"with pipeline_parallel splits a mixture of experts \(qwen3_moe\)"):
        check_fits("cpt", section, Qwen3MoeConfig(num_hidden_layers=4, output_router_logits=False))
    with pytest.raises(NotSupportedHere, match=r"tensor_parallel is 2, which does not divide the model's 1 key"):
        check_fits("cpt", section, LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1))
    check_fits("cpt", section.model_copy(update={"training": section.training.model_copy(update={"fp8": True})}), dense)
    # each stage's experts spread over its own ranks (expert_parallel): the processes of a stage must hold whole groups
    spread = load_pipeline("korean-llm", overrides=[*PIPELINE, "stages.cpt.distributed.expert_parallel=4"])
    section, moe = spread.spec.stages.cpt, Qwen3MoeConfig(num_hidden_layers=4, num_experts=8)
    check_fits("cpt", section, moe)  # 8 processes: 4 a stage
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(NotSupportedHere, match=r"expert_parallel is 4, which does not divide the 2 processes of each"):
        check_fits("cpt", section, moe)


def test_local_says_what_this_machine_makes_of_the_stages_before_anything_starts() -> None:
    from workflows.plan import local_mesh

    two = "stages.cpt.training.gradient_accumulation_steps=2"
    spec = load_pipeline("korean-llm", profile="local", overrides=[*PIPELINE, two]).spec
    assert local_mesh(spec, 4) == ([], [])
    errors, _ = local_mesh(spec, 3)
    assert errors and errors[0].startswith("stages.cpt.distributed.pipeline_parallel is 2, which does not divide the 3")
    assert local_mesh(spec, 0)[1] == [
        "stages.cpt.distributed.pipeline_parallel is 2, but this machine runs cpt as one process: it trains unsplit"
    ]
    split = [*PIPELINE, two, "stages.cpt.distributed.tensor_parallel=2"]
    spec = load_pipeline("korean-llm", profile="local", overrides=split).spec
    assert local_mesh(spec, 4) == ([], [])
    errors, _ = local_mesh(spec, 6)  # each divides 6; a pipeline of 2 stages of 2 ranks does not
    assert errors == [
        "stages.cpt.distributed.pipeline_parallel 2 times tensor_parallel 2 does not divide the 6 processes --local "
        "runs cpt with (one per GPU here): each pipeline takes 4"
    ]
    spread = [*PIPELINE, two, *MOE, "stages.cpt.training.router_aux_loss_coef=0"]
    spec = load_pipeline("korean-llm", profile="local", overrides=[*spread, "stages.cpt.distributed.expert_parallel=4"])
    assert local_mesh(spec.spec, 8) == ([], [])
    errors, _ = local_mesh(spec.spec, 4)  # 4 divides 4; the 2 ranks of a stage do not hold a group of 4
    assert errors == [
        "stages.cpt.distributed.expert_parallel 4 does not divide the 2 processes of each of the 2 pipeline stages "
        "--local runs cpt with (one per GPU here): each stage spreads its experts over its own processes"
    ]


def test_grpo_rows_start_at_zero_and_score_the_completion_tokens_as_trl_s_left_padded_rows() -> None:
    """`CompletionRows` moves each prompt's own tokens to position 0 (TRL pads prompts on the left), its completion
    after them; `CompletionLoss.scores` takes each completion token's log-probability (under the temperature) from the
    logits at the position before it, and scores the tokens past a completion's end 0, as TRL's fused head does."""
    from stages.pipeline_grpo import START, CompletionLoss, CompletionRows

    prompt_ids = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]])  # 0: padding
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor([[9, 10, 2], [11, 2, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    batch = CompletionRows("rlhf", rows=4, width=8, pad_token_id=0)(ids, mask, completion=3)
    assert batch["input_ids"].tolist() == [
        [7, 8, 9, 10, 2, 0, 0, 0],
        [5, 6, 7, 8, 11, 2, 0, 0],
        [0] * 8,  # rows the step lacks: padding, row -1
        [0] * 8,
    ]
    assert batch["labels"].tolist() == [[0, 2], [1, 4], [-1, 0], [-1, 0]]
    logits = torch.randn(2, 8, 16)
    loss = CompletionLoss(trainer=None, temperature=0.7, microbatches=2)
    loss.begin({}, completion_ids, completion_mask, recording=True)
    logps, entropies = loss.scores(logits, batch["labels"][:2], entropy=True)
    for row in range(2):
        for token in range(3):
            position = int(batch["labels"][row, START]) + token - 1
            expected = (logits[row, position] / 0.7).log_softmax(-1)[completion_ids[row, token]]
            expected = expected * completion_mask[row, token]
            assert abs(float(logps[row, token] - expected)) < 1e-6
    assert logps[1, 2] == 0 and entropies is not None and entropies[1, 2] == 0 < float(entropies[0, 2])
    with pytest.raises(NotSupportedHere, match=r"max_seq_length \(6\) is shorter than a prompt of 4 tokens"):
        CompletionRows("rlhf", rows=4, width=6, pad_token_id=0)(ids, mask, completion=3)


def test_a_stage_s_generation_cache_reads_its_length_from_a_layer_it_holds() -> None:
    """`stage_cache`: transformers reads a cache's length from layer 0, which only the first stage holds; on the
    others every layer they do not hold is one of theirs (of the same kind, sliding or full)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from stages.pipeline_grpo import stage_cache

    config = Gemma3TextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    cache = stage_cache(model, range(2, 4))
    assert cache.layers[0] is cache.layers[2] and cache.layers[1] is cache.layers[3]
    cache.layers[2].update(torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5, 8))
    cache.layers[3].update(torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5, 8))
    assert cache.get_seq_length() == 5
