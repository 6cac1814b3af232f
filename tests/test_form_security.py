"""What a person who may only submit (the posttrain-submitter role, the Argo UI's form, `submit --set`) can and
cannot change per run.

The attacks tried against the form: a GRPO reward function that imports `torch.hub:load` (which runs a
repository's hubconf.py) or reaches `from_pretrained(trust_remote_code=True)`; an empty, relaxed or reversed gate;
another team's registered model, whose champion alias the run would move; trainer arguments in
`training.extra_args` that upload the model to the Hugging Face Hub with the pods' token (`push_to_hub`, `hub_*`),
move the outputs, or set anything but an optimizer or loss knob. Each is refused on the submitter's machine before
any request (`submit --set`) and again by the prepare step in the cluster (the form's `overrides` parameter), which
fails at once, names the parameter line and writes no spec.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
from fake_argo import FakeArgo
from test_parameters import _params_dir, prepare_step
from test_submit import _run

from spec import form as spec_form
from spec.document import SpecError
from spec.loading import load_pipeline
from spec.training import FORM_EXTRA_ARGS, TRAINER_ARGS_OWNED, refused_trainer_arg
from workflows import parameters as params
from workflows.importers import PASS_THROUGH

HUB = (
    "stages.rlhf.reward_functions=[{name: 'torch.hub:load', args: {repo_or_dir: /mnt/datasets/x, model: x, "
    "source: local, trust_repo: true}}]"
)
PRETRAINED = (
    "stages.rlhf.reward_functions=[{name: 'transformers:AutoModelForCausalLM.from_pretrained', "
    "args: {pretrained_model_name_or_path: /mnt/datasets/x, trust_remote_code: true}}]"
)

# submit says the template fixes it, prepare that the form cannot set it.
FILE_ONLY = "cannot change per run|cannot be set from the form"
HUB_REFUSED = (
    r"extra_args\.(push_to_hub|hub_\w+) is refused: the trainer would upload the model to the Hugging Face Hub"
)

ATTACKS = [
    pytest.param(
        ["stages.rlhf.algorithm=grpo", HUB],
        r"module 'torch\.hub' is not in stages\.rlhf\.reward_modules",
        id="torch-hub",
    ),
    pytest.param(["stages.rlhf.algorithm=grpo", PRETRAINED], "is neither a built-in reward", id="from-pretrained"),
    pytest.param(["stages.rlhf.reward_modules=[torch.hub]"], FILE_ONLY, id="allow-list"),
    pytest.param(["stages.evaluate.gate=[]"], "would no longer hold the rule perplexity", id="empty-gate"),
    pytest.param(["stages.evaluate.gate.0.max_regression=.inf"], "Input should be a finite number", id="inf-gate"),
    pytest.param(["stages.evaluate.gate.0.max_regression=1000"], "never remove, relax or reverse", id="relaxed"),
    pytest.param(["stages.evaluate.gate.0.higher_is_better=true"], "never remove, relax or reverse", id="reversed"),
    pytest.param(
        ["stages.evaluate.gate=[{metric: perplexity, higher_is_better: false, max_regression: 0.05}]"],
        r"kobest_boolq/acc",
        id="rule-dropped",
    ),
    pytest.param(["stages.deploy.registered_model=other-team-model"], FILE_ONLY, id="other-model"),
    pytest.param(["stages.sft.training.extra_args.push_to_hub=true"], HUB_REFUSED, id="push-to-hub"),
    pytest.param(
        ["stages.sft.training.extra_args.optim=adamw_torch", "stages.sft.training.extra_args.hub_model_id=me/leak"],
        HUB_REFUSED,
        id="hub-model-id",
    ),
    pytest.param(
        ["stages.rlhf.training.extra_args={adam_beta2: 0.95, hub_strategy: all_checkpoints, hub_private_repo: false}"],
        HUB_REFUSED,
        id="hub-section",
    ),
    pytest.param(
        ["stages.sft.training.extra_args.output_dir=/mnt/datasets/shared"],
        r"extra_args\.output_dir is set by the spec",
        id="output-dir",
    ),
    pytest.param(
        ["stages.cpt.training.extra_args.torch_compile_backend=cudagraphs"],
        r"stages\.cpt\.training\.extra_args\.torch_compile_backend cannot be set from the form",
        id="not-allowlisted",
    ),
    pytest.param(
        ["stages.sft.training.learning_rate=1e-4", "stages.sft.training={extra_args: {save_only_model: true}}"],
        r"(line 2|=\{extra_args: \{save_only_model: true\}\}): stages\.sft\.training\.extra_args\.save_only_model "
        "cannot be set from the form",
        id="not-allowlisted-section",
    ),
    pytest.param(
        [
            "stages.sft.hpo={parameters: [{path: training.extra_args.push_to_hub, type: categorical, "
            "values: [true, false]}], objective: {metric: eval_loss}}"
        ],
        r"training\.extra_args is a value, not a section",
        id="searched-extra-arg",
    ),
]


@pytest.mark.parametrize(("overrides", "refusal"), ATTACKS)
def test_the_form_cannot_run_code_or_loosen_the_gate_at_submit(
    fake: FakeArgo, capsys: pytest.CaptureFixture[str], overrides: list[str], refusal: str
) -> None:
    argv = [arg for override in overrides for arg in ("--set", override)]
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight", *argv)
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(refusal, err), err
    assert fake.requests == []  # refused on this machine: nothing was created or even asked for


@pytest.mark.parametrize(("overrides", "refusal"), ATTACKS)
def test_the_form_cannot_run_code_or_loosen_the_gate_in_prepare(
    tmp_path: Path, overrides: list[str], refusal: str
) -> None:
    """The cluster's prepare step, as the pod runs it, with the attack in the form's overrides parameter."""
    form = _params_dir(tmp_path, {spec_form.OVERRIDES: "\n".join(overrides)})
    run = tmp_path / "run"
    proc = prepare_step(run, form)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: parameter overrides, line ") and "Traceback" not in proc.stderr
    assert re.search(refusal, proc.stderr), proc.stderr
    assert not (run / "spec.json").exists()


def test_the_form_may_tighten_the_gate(tmp_path: Path) -> None:
    tighter = [
        "stages.evaluate.gate.0.max_regression=0",
        "stages.evaluate.gate.2={metric: eval_loss, higher_is_better: false}",
    ]
    doc = params.embedded_document(load_pipeline("korean-llm").spec)
    with pytest.raises(SpecError, match="is not an index of the list"):  # a list grows by replacing it whole
        spec_form.resolve_parameters(doc, {spec_form.OVERRIDES: "\n".join(tighter)})
    whole = (
        "stages.evaluate.gate=[{metric: perplexity, higher_is_better: false, max_regression: 0}, "
        "{metric: kobest_boolq/acc, max_regression: 0.005}, {metric: eval_loss, higher_is_better: false}]"
    )
    spec = spec_form.resolve_params_dir(_params_dir(tmp_path, {spec_form.OVERRIDES: whole}))
    assert [(r.metric, r.max_regression) for r in spec.stages.evaluate.gate] == [
        ("perplexity", 0.0),
        ("kobest_boolq/acc", 0.005),
        ("eval_loss", 0.0),
    ]


def test_the_pipeline_file_still_chooses_its_rewards_and_gate() -> None:
    """A registrar (the pipeline file, `--render`, `register --set`) may name allowed modules and any gate."""
    loaded = load_pipeline(
        "korean-llm",
        overrides=[
            "stages.rlhf.algorithm=grpo",
            "stages.rlhf.reward_modules=[acme_rewards.korean]",
            "stages.rlhf.reward_functions=[{name: hangul_ratio}, {name: 'acme_rewards.korean:polite'}]",
            "stages.evaluate.gate=[]",
            "stages.deploy.registered_model=korean-llm-experimental",
        ],
    )
    assert loaded.spec.stages.evaluate.gate == []
    assert loaded.spec.stages.rlhf.reward_modules == ["acme_rewards.korean"]


FORM_KNOBS = [
    "stages.sft.training.extra_args.optim=adamw_torch_fused",
    "stages.sft.training.extra_args.adam_beta2=0.95",
    "stages.sft.training.extra_args.neftune_noise_alpha=5",
    "stages.rlhf.training.extra_args={adam_epsilon: 1.0e-6, label_smoothing_factor: 0.1, temperature: 0.7}",
]


def test_the_form_may_set_optimizer_and_loss_knobs(
    tmp_path: Path, fake: FakeArgo, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [arg for knob in FORM_KNOBS for arg in ("--set", knob)]
    code, _, err = _run(capsys, "korean-llm", "--skip-preflight", *argv)
    assert (code, err) == (0, "")
    spec = spec_form.resolve_params_dir(_params_dir(tmp_path, {spec_form.OVERRIDES: "\n".join(FORM_KNOBS)}))
    assert spec.stages.sft.training.extra_args == {"optim": "adamw_torch_fused", "adam_beta2": 0.95,
                                                   "neftune_noise_alpha": 5}  # fmt: skip
    assert spec.stages.rlhf.training.extra_args == {"adam_epsilon": 1e-6, "label_smoothing_factor": 0.1,
                                                    "temperature": 0.7}  # fmt: skip


def test_the_pipeline_files_own_extra_args_stay_as_it_set_them() -> None:
    """A registrar's extra_args (any key but the refused ones) reach the run; the form may change the knobs beside
    them, never them: not changed, not removed with the section."""
    registered = load_pipeline(
        "korean-llm", overrides=["stages.sft.training.extra_args={dataloader_prefetch_factor: 4, optim: adamw_torch}"]
    )
    assert registered.spec.stages.sft.training.extra_args == {"dataloader_prefetch_factor": 4, "optim": "adamw_torch"}
    doc = params.embedded_document(registered.spec)
    kept = spec_form.resolve_parameters(
        doc, {spec_form.OVERRIDES: "stages.sft.training.extra_args.optim=adamw_torch_fused"}
    )
    assert kept.stages.sft.training.extra_args == {"dataloader_prefetch_factor": 4, "optim": "adamw_torch_fused"}
    same = spec_form.resolve_parameters(
        doc, {spec_form.OVERRIDES: "stages.sft.training.extra_args.dataloader_prefetch_factor=4"}
    )
    assert same.stages.sft.training.extra_args == registered.spec.stages.sft.training.extra_args
    for change in ("extra_args.dataloader_prefetch_factor=8", "extra_args={optim: adamw_torch}", "extra_args={}"):
        with pytest.raises(
            SpecError, match=r"^parameter overrides, line 1: .*dataloader_prefetch_factor cannot be set"
        ):
            spec_form.resolve_parameters(doc, {spec_form.OVERRIDES: f"stages.sft.training.{change}"})


@pytest.mark.parametrize(
    "key",
    ["push_to_hub", "hub_model_id", "hub_strategy", "hub_private_repo", "hub_token", "hub_always_push",
     "log_completions_hub_repo", "trackio_space_id", "vllm_server_base_url", "model_init_kwargs",
     "ref_model_init_kwargs"],
)  # fmt: skip
def test_the_pipeline_file_cannot_send_data_out_through_extra_args_either(key: str) -> None:
    with pytest.raises(SpecError, match=rf"stages\.rlhf\.training\.extra_args\.{key}: extra_args\.{key} is refused"):
        load_pipeline("korean-llm", overrides=[f"stages.rlhf.training.extra_args.{key}=x"])


def _trainer_config_fields() -> set[str]:
    """Every field of the config classes the training stages build (transformers and TRL as installed)."""
    from transformers import TrainingArguments
    from trl import DPOConfig, GRPOConfig, KTOConfig, SFTConfig

    with warnings.catch_warnings():  # trl.experimental says it is experimental
        warnings.simplefilter("ignore")
        from trl.experimental.orpo import ORPOConfig

    classes = (TrainingArguments, SFTConfig, DPOConfig, KTOConfig, ORPOConfig, GRPOConfig)
    return {f.name for cls in classes for f in dataclasses.fields(cls) if f.init}


def test_every_trainer_argument_that_reaches_out_is_owned_or_refused() -> None:
    """Checked against the installed transformers and TRL, so a new upload or download setting fails here first:
    anything naming the hub, a URL, a host, a directory or path, a tracker, or kwargs of a model load."""
    fields = _trainer_config_fields()
    reaching = {
        name
        for name in fields
        if re.search(r"hub|url|host|trackio|report_to|init_kwargs", name) or name.endswith(("_dir", "_path"))
    }
    assert {"push_to_hub", "hub_model_id", "hub_token", "output_dir", "vllm_server_base_url"} <= reaching
    assert sorted(n for n in reaching if n not in TRAINER_ARGS_OWNED and refused_trainer_arg(n) is None) == []
    # The form's keys are real settings, none owned or refused, and cover what recipe importers pass through.
    assert sorted(set(FORM_EXTRA_ARGS) - fields) == []
    assert [k for k in FORM_EXTRA_ARGS if k in TRAINER_ARGS_OWNED or refused_trainer_arg(k)] == []
    assert sorted(set(PASS_THROUGH) - set(FORM_EXTRA_ARGS)) == []
