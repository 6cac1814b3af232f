"""What a person who may only submit (the posttrain-submitter role, the Argo UI's form, `submit --set`) can and
cannot change per run.

The attacks tried against the form: a GRPO reward function that imports `torch.hub:load` (which runs a
repository's hubconf.py) or reaches `from_pretrained(trust_remote_code=True)`; an empty, relaxed or reversed gate;
another team's registered model, whose champion alias the run would move. Each is refused on the submitter's
machine before any request (`submit --set`) and again by the prepare step in the cluster (the form's `overrides`
parameter), which fails at once, names the parameter line and writes no spec.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fake_argo import FakeArgo
from test_parameters import _params_dir, prepare_step
from test_submit import _run

from workflows import parameters as params
from workflows.loading import SpecError, load_pipeline

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
    form = _params_dir(tmp_path, {params.OVERRIDES: "\n".join(overrides)})
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
        params.resolve_parameters(doc, {params.OVERRIDES: "\n".join(tighter)})
    whole = (
        "stages.evaluate.gate=[{metric: perplexity, higher_is_better: false, max_regression: 0}, "
        "{metric: kobest_boolq/acc, max_regression: 0.005}, {metric: eval_loss, higher_is_better: false}]"
    )
    spec = params.resolve_params_dir(_params_dir(tmp_path, {params.OVERRIDES: whole}))
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
