"""Stage model folders are fingerprinted by content and held to their records (stages.modeling.ModelInputs), here on
records written by hand over tiny models (no training): the fingerprint follows every file; an adapter is refused
over a base other than the one it was trained on; a record without a fingerprint is refused; the fingerprints of
what loaded are recorded as the stage's inputs. Training stages, evaluate and deploy refusing a changed model are
in tests/reliability/test_upstream_changed.py, tests/test_evaluate.py and tests/test_deploy.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from training_fixtures import make_run_dir

from run.run_dir import RunDir, StageRefused
from stages.contract import StageContext
from stages.modeling import (
    ModelInputs,
    build_from_config,
    load_stage_model,
    load_starting_model,
    load_tokenizer,
    model_fingerprint,
)


def test_the_fingerprint_follows_every_file(tmp_path: Path) -> None:
    """Names and bytes of every file count, in subfolders too; nothing else does."""
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    first = model_fingerprint(folder)
    assert first.startswith("sha256:") and model_fingerprint(folder) == first
    (folder / "config.json").write_text('{"a": 1}')
    assert model_fingerprint(folder) != first
    (folder / "config.json").write_text("{}")
    assert model_fingerprint(folder) == first
    (folder / "config.json").rename(folder / "other.json")
    assert model_fingerprint(folder) != first
    (folder / "other.json").rename(folder / "config.json")
    (folder / "sub" / "extra.txt").write_text("x")
    assert model_fingerprint(folder) != first


def write_stage(
    run_dir: RunDir, stage: str, model: Any, extra: dict[str, Any], inputs: dict[str, tuple[str, str]]
) -> str:
    """`stage` saves `model` into its model folder and records it as the stage does; returns its fingerprint."""
    ctx = StageContext(run_dir, stage, run_dir.load_spec())
    assert ctx.begin()  # a training stage begins before it writes into its folder
    model.save_pretrained(ctx.model_dir)
    for name, (uri, fingerprint) in inputs.items():
        ctx.add_input(name, uri, fingerprint)
    fingerprint = model_fingerprint(ctx.model_dir)
    ctx.finish(extra={**extra, "model_fingerprint": fingerprint})
    return fingerprint


@pytest.fixture
def chain(tmp_path: Path) -> RunDir:
    """cpt left a full model; sft left a LoRA adapter trained over it (both recorded as the stages record them)."""
    run_dir = make_run_dir(tmp_path / "run", n_text=20, n_chat=20)
    spec = run_dir.load_spec()
    model = build_from_config(spec.model, load_tokenizer(run_dir, spec.model))
    full = {"model_kind": "full", "base": spec.model.name_or_path, "base_kind": "from_config"}
    cpt = write_stage(run_dir, "cpt", model, full, {})

    from peft import LoraConfig, get_peft_model

    adapter = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    extra = {"model_kind": "adapter", "base": "cpt/model", "base_kind": "stage"}
    write_stage(run_dir, "sft", adapter, extra, {"model": ("cpt/model", cpt)})
    return run_dir


def begun(run_dir: RunDir, stage: str) -> StageContext:
    ctx = StageContext(run_dir, stage, run_dir.load_spec())
    assert ctx.begin()
    return ctx


def test_what_loads_is_recorded_by_content(chain: RunDir) -> None:
    spec = chain.load_spec()
    ctx = begun(chain, "rlhf")
    load_starting_model(chain, spec, "rlhf", load_tokenizer(chain, spec.model), ModelInputs(ctx))
    inputs = {name: (ref.uri, ref.fingerprint) for name, ref in chain.read_result("rlhf").inputs.items()}
    assert inputs == {
        "model": ("sft/model", chain.read_result("sft").extra["model_fingerprint"]),
        "model_base": ("cpt/model", chain.read_result("cpt").extra["model_fingerprint"]),
    }


@pytest.mark.parametrize("consumer", ["rlhf", "evaluate"])
def test_an_adapter_over_another_base_than_it_was_trained_on_is_refused(chain: RunDir, consumer: str) -> None:
    """cpt ran again (a new model, recorded as cpt records it) after sft trained its adapter over the old one: cpt's
    record alone passes, sft's record of its base does not."""
    cpt_dir = chain.stage_dir("cpt") / "model"
    weights = cpt_dir / "model.safetensors"
    save_file({k: v + 0.01 for k, v in load_file(weights).items()}, weights)
    cpt = chain.read_result("cpt")
    cpt.extra["model_fingerprint"] = now = model_fingerprint(cpt_dir)
    chain.write_result(cpt)
    trained_on = chain.read_result("sft").inputs["model"].fingerprint

    spec = chain.load_spec()
    tokenizer = load_tokenizer(chain, spec.model)
    inputs = ModelInputs(begun(chain, consumer))
    with pytest.raises(StageRefused) as refused:
        if consumer == "rlhf":
            load_starting_model(chain, spec, consumer, tokenizer, inputs)
        else:
            load_stage_model(chain, spec, "sft", tokenizer, inputs, name="candidate")
    assert str(refused.value) == (
        f"[{consumer}] cpt/model is not the model sft's adapter was trained on: sft/stage.json records {trained_on} "
        f"for it, it is {now} now (cpt ran again after sft). An adapter fits only the weights it was trained on: "
        f"run sft again (python -m stages sft --run-dir {chain.root} --force), then {consumer}."
    )
    assert not chain.read_result(consumer).inputs  # nothing recorded as loaded


def test_a_record_without_a_fingerprint_is_refused(chain: RunDir) -> None:
    """A record from before fingerprints (or edited): nothing to hold the folder to."""
    sft = chain.read_result("sft")
    del sft.extra["model_fingerprint"]
    chain.write_result(sft)
    spec = chain.load_spec()
    with pytest.raises(StageRefused, match=r"^\[rlhf\] sft/stage.json records no content fingerprint of sft/model"):
        load_starting_model(chain, spec, "rlhf", load_tokenizer(chain, spec.model), ModelInputs(begun(chain, "rlhf")))
