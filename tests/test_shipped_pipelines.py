"""Every shipped pipeline runs with --local as itself: its own model family (a tiny random model of it) and its own
data format and column mapping: llama3-dolly (a Llama with Llama-3's template, dolly-shaped rows read through
`columns`) and qwen3-30b-a3b (a Qwen3 mixture of experts, ShareGPT rows, full fine-tuning and DPO; with LoRA on its
experts too), and the real vLLM engine serves the model each deployed. Then each local gate stops a candidate that
learned nothing: the pipeline trained again, on the same data, one step a stage at each learning rate divided by
10,000, against the champion the first run promoted. korean-llm's run is tests/test_local_dag.py's (launched as
its pods launch it, with the same checks), qwen-multi's tests/test_variants.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from worse_candidate import assert_the_gate_stopped_it, untrained_overrides

from workflows.submit import main as submit_main

MOE_ADAPTER = ("--set", "stages.sft.method=lora", "--set", "stages.rlhf.method=lora")
"""qwen3-30b-a3b with LoRA on attention and experts: the MoE adapter is saved, continued by DPO, evaluated (merged
into its base), and merged into full weights by deploy, the folder serving loads."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pipeline", "architecture", "stages", "extra"),
    [
        ("llama3-dolly", "LlamaForCausalLM", ("prepare", "sft", "evaluate", "deploy"), ()),
        ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", ("prepare", "sft", "rlhf", "evaluate", "deploy"), ()),
        ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", ("prepare", "sft", "rlhf", "evaluate", "deploy"), MOE_ADAPTER),
    ],
    ids=["llama3-dolly", "qwen3-30b-a3b", "qwen3-30b-a3b-lora-experts"],
)
def test_a_shipped_pipeline_runs_locally_as_itself(
    tmp_path: Path,
    pipeline: str,
    architecture: str,
    stages: tuple,
    extra: tuple,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    serves = not extra  # the real vLLM engine serves each pipeline's model once (a start takes a minute or more)
    if serves:
        request.getfixturevalue("real_vllm")
    # `python -m workflows.submit PIPELINE --local` as its main function in this process: the runs of this module
    # fork their stages from one warm-start server (the one the last local run of the process left idle).
    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)
    run_root = tmp_path / "run"
    code = submit_main([pipeline, "--local", "--run-dir", str(run_root), *extra])
    said = capsys.readouterr()
    assert code == 0, said.out[-4000:] + said.err[-4000:]
    assert "[profile local]" in said.out  # the runner said what the profile swapped
    # No terminal here (as in CI or a pod's log): each training stage's progress lines come as they are printed,
    # library noise does not, and the summary is one whole line per stage.
    lines = said.out.splitlines()
    for stage in (s for s in stages if s in ("cpt", "sft", "rlhf")):
        assert any(line.startswith(f"[{stage}] step ") and "loss" in line for line in lines), stage
    assert not any(line.startswith(("{'loss'", "{'train_runtime'")) for line in lines)
    assert any(line.split()[:2] == ["deploy", "succeeded"] for line in lines if line.startswith("  deploy "))
    # The deployed folder served by the real vLLM engine, answering chat requests through the family's template
    # (vLLM renders /v1/chat/completions with the tokenizer's own); champion moved only after that.
    if serves:
        assert any(line.split()[:2] == ["serve", "succeeded"] for line in lines if line.startswith("  serve "))
        deployed = json.loads((run_root / "deploy" / "stage.json").read_text())["extra"]
        served = deployed["served"]
        assert served["engine"] == "vllm" and served["engine_version"] == "0.32.0", served
        assert served["answers"] and all(a["answer"].strip() for a in served["answers"]), served["answers"]
        assert deployed["promoted"] == "false" and "is champion" in said.out

    for stage in stages:
        assert json.loads((run_root / stage / "stage.json").read_text())["status"] == "succeeded", stage
    if extra:  # the MoE adapter: LoRA on the experts' stacked weights, continued by DPO, merged by deploy
        from safetensors import safe_open

        with safe_open(str(run_root / "rlhf" / "model" / "adapter_model.safetensors"), "pt") as f:
            assert any("experts" in key for key in f.keys())  # noqa: SIM118 (safe_open has keys(), no __iter__)
        trained = "deploy"
    else:
        trained = "rlhf" if "rlhf" in stages else "sft"
    config = json.loads((run_root / trained / "model" / "config.json").read_text())
    assert config["architectures"] == [architecture]
    manifest = json.loads((run_root / "prepare" / "data" / "sft" / "manifest.json").read_text())
    spec = json.loads((run_root / "spec.json").read_text())
    assert manifest["format"] == spec["stages"]["sft"]["data"]["format"]
    if pipeline == "llama3-dolly":
        assert manifest["uri"] == "builtin:korean-dolly" and manifest["quarantined"] == 0
        assert spec["stages"]["sft"]["data"]["columns"] == {"input": "context", "output": "response"}
        # its sft searches first (the local profile: 4 trials), then trains with the best trial's values
        search = json.loads((run_root / "hpo" / "sft" / "search.json").read_text())
        assert [t["status"] for t in search["trials"]] == ["succeeded"] * 4
        assert spec["stages"]["sft"]["lora"]["r"] == search["best_values"]["lora.r"]
        assert spec["stages"]["sft"]["training"]["learning_rate"] == search["best_values"]["training.learning_rate"]
    elif pipeline == "qwen3-30b-a3b":
        assert manifest["format"] == "sharegpt" and config["num_local_experts"] == 4  # transformers 5 name
    if not extra:
        assert_the_gate_stops_a_candidate_that_learned_nothing(pipeline, spec, tmp_path, capsys)


def assert_the_gate_stops_a_candidate_that_learned_nothing(
    pipeline: str, spec: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pipeline again in the same folder (so against the champion the first run promoted), one step a stage at
    each learning rate divided by 10,000: the gate fails, deploy does not run, --fail-on-gate exits 3."""
    worse = tmp_path / "worse"
    code = submit_main([pipeline, "--local", "--run-dir", str(worse), "--fail-on-gate", *untrained_overrides(spec)])
    said = capsys.readouterr()
    assert code == 3, said.out[-4000:] + said.err[-4000:]
    assert_the_gate_stopped_it(worse)
