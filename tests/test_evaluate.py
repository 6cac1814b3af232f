"""The evaluate stage on a briefly trained tiny model: perplexity, lm-eval over local task files (and the builtin
task folder prepare generates), the gate against the base model and against a registered champion, stage.json, the
report, and a run with nothing to evaluate."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from training_fixtures import chat_rows, make_run_dir, run_stage, text_rows, write_jsonl

import stages.evaluate as evaluate
import stages.gate as gate
import stages.measures as measures
import stages.registry as registry
from run.run_dir import RunDir, StageRefused, StageResult
from spec.lm_eval_tasks import LM_EVAL_TASKS
from spec.loading import load_pipeline
from spec.pipeline import PipelineSpec
from spec.release import GateRule
from stages.builtin_data import write_lm_eval_tasks
from stages.contract import StageContext
from stages.data import BUILTIN_TASKS_DIR, DataError, sha256_file
from stages.modeling import load_stage_model, load_tokenizer, model_fingerprint
from stages.packing import tokenize_conversation, tokenize_document

pytestmark = pytest.mark.slow

OVERRIDES = [
    "stages.sft.enabled=false",
    "stages.rlhf.enabled=false",
    "stages.cpt.training.max_steps=8",
    "stages.cpt.training.save_steps=8",
    "stages.cpt.training.logging_steps=1",
    "stages.evaluate.max_new_tokens=8",
    "stages.evaluate.limit=8",  # of the profile's ko_constitution_mc questions
]

TASK_YAML = """\
task: tiny_ko
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("ARGO_WORKFLOW_NAME", raising=False)


def tracking(root: Path) -> str:
    return f"tracking.mlflow_tracking_uri=sqlite:///{root.parent / 'mlflow.db'}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A run in which cpt trained a few steps (the candidate) and evaluate has held-out text and chat rows and the
    builtin lm-eval tasks, as prepare writes them."""
    root = tmp_path_factory.mktemp("evaluate") / "run"
    run_dir = make_run_dir(root, [*OVERRIDES, tracking(root)], n_text=120, n_chat=40)
    write_jsonl(root / "prepare/data/evaluate/eval.jsonl", text_rows(12, seed=7) + chat_rows(4, seed=7))
    write_lm_eval_tasks(LM_EVAL_TASKS, root / BUILTIN_TASKS_DIR)
    done = run_stage(run_dir, "cpt")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An lm-eval task over a local JSONL file (6 questions), as an offline cluster defines one."""
    folder = tmp_path_factory.mktemp("tasks")
    subjects = ["서울은", "김치는", "부산은", "한강은", "고양이는", "제주도는"]
    rows = [{"question": s, "choices": [" 아름답습니다.", " 학생들은"], "answer": 0} for s in subjects]
    write_jsonl(folder / "tiny_ko.jsonl", rows)
    (folder / "tiny_ko.yaml").write_text(TASK_YAML.format(data=folder / "tiny_ko.jsonl"), encoding="utf-8")
    return folder


def heldout_fingerprint(run_dir: RunDir) -> str:
    return sha256_file(run_dir.root / "prepare/data/evaluate/eval.jsonl")


def register_champion(run_dir: RunDir, spec: PipelineSpec, name: str, art: Path, tags: dict[str, str]) -> None:
    """The cpt model of `run_dir`, registered as `name` with the champion alias and the given version tags."""
    from mlflow import MlflowClient

    uri = spec.tracking.mlflow_tracking_uri
    client = MlflowClient(uri, registry_uri=uri)
    experiment = client.create_experiment(f"source-of-{name}", artifact_location=art.as_uri())
    source_run = client.create_run(experiment).info.run_id
    client.log_artifacts(source_run, str(run_dir.stage_dir("cpt") / "model"), "model")
    client.create_registered_model(name)
    version = client.create_model_version(name, source=f"runs:/{source_run}/model", run_id=source_run, tags=tags)
    client.set_registered_model_alias(name, "champion", version.version)


def spec_of(run_dir: RunDir) -> PipelineSpec:
    return load_pipeline(
        "korean-llm", "local", ["tracking.wandb_project=null", *OVERRIDES, tracking(run_dir.root)]
    ).spec


def run_evaluate(run_dir: RunDir, spec: PipelineSpec, outputs: Path) -> StageResult:
    """evaluate in this process, forced (each test changes the evaluate section)."""
    run_dir.write_spec(spec)
    ctx = StageContext(run_dir, "evaluate", spec, force=True, outputs_dir=outputs)
    assert evaluate.run(ctx) == 0
    result = run_dir.read_result("evaluate")
    assert result is not None
    return result


# --------------------------------------------------------------------------- perplexity


def test_perplexity_scores_documents_and_assistant_turns(trained: RunDir) -> None:
    spec = trained.load_spec()
    tokenizer = load_tokenizer(trained, spec.model)
    model = load_stage_model(trained, spec, "cpt", tokenizer)
    text, chat = text_rows(1, seed=3)[0], chat_rows(2, seed=3)[1]

    # A document: every token after the first is scored, the closing eos included.
    ids = tokenize_document(tokenizer, text["text"])
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    measured = measures.perplexity(model, tokenizer, [text], max_len=256)
    assert measured["eval_tokens"] == len(ids) - 1
    assert measured["eval_loss"] == pytest.approx(expected, rel=1e-4)
    assert measured["perplexity"] == pytest.approx(math.exp(expected), rel=1e-4)

    # A conversation: only the assistant's tokens are scored, as sft trains them.
    chat_ids, labels = tokenize_conversation(tokenizer, chat["messages"], assistant_only_loss=True)
    scored = sum(1 for label in labels[1:] if label != -100)
    assert 0 < scored < len(chat_ids) - 1
    with torch.no_grad():
        chat_loss = model(input_ids=torch.tensor([chat_ids]), labels=torch.tensor([labels])).loss.item()
    assert measures.perplexity(model, tokenizer, [chat], max_len=256)["eval_tokens"] == scored

    # Both: the loss per scored token over all rows (not the mean of the rows' losses).
    both = measures.perplexity(model, tokenizer, [text, chat], max_len=256)
    pooled = (expected * (len(ids) - 1) + chat_loss * scored) / (len(ids) - 1 + scored)
    assert both["eval_loss"] == pytest.approx(pooled, rel=1e-4) and both["eval_rows"] == 2

    # Rows longer than max_len are cut and counted.
    assert measures.perplexity(model, tokenizer, [text], max_len=8)["eval_rows_truncated"] == 1


def test_lm_eval_runs_a_task_defined_over_local_files(trained: RunDir, task_dir: Path) -> None:
    spec = trained.load_spec()
    tokenizer = load_tokenizer(trained, spec.model)
    model = load_stage_model(trained, spec, "cpt", tokenizer)
    metrics = measures.lm_eval_metrics(model, tokenizer, ["tiny_ko"], str(task_dir), limit=4, max_len=256)
    assert set(metrics) == {"tiny_ko/acc", "tiny_ko/acc_stderr", "tiny_ko/n_samples"}
    assert (metrics["tiny_ko/acc"] * 4).is_integer() and 0.0 <= metrics["tiny_ko/acc"] <= 1.0  # 4 of 6 questions
    # lm-eval's standard error of a mean over the 4 questions: the sample standard deviation / sqrt(n).
    p = metrics["tiny_ko/acc"]
    assert metrics["tiny_ko/n_samples"] == 4 and metrics["tiny_ko/acc_stderr"] == pytest.approx(
        math.sqrt(p * (1 - p) / 3)
    )


def test_the_builtin_task_is_measured_for_the_candidate_and_the_base(trained: RunDir, tmp_path: Path) -> None:
    spec = spec_of(trained)  # the local profile's evaluate section, as shipped
    section = spec.stages.evaluate
    assert section.lm_eval_tasks == ["ko_constitution_mc"] and section.lm_eval_include_path == "builtin:korean-lm-eval"
    assert measures.include_dir(spec, trained.root) == str(trained.root / BUILTIN_TASKS_DIR)
    extra = run_evaluate(trained, spec, tmp_path / "outputs").extra

    assert extra["errors"] == [] and extra["lm_eval_tasks"] == ["ko_constitution_mc"]
    for who in ("candidate", "base"):
        acc = extra[who]["ko_constitution_mc/acc"]
        assert (acc * 8).is_integer() and 0.0 <= acc <= 1.0  # 8 questions (limit)
        assert "ko_constitution_mc/acc_norm" in extra[who]
    (check,) = [c for c in extra["gate_checks"] if c["metric"] == "ko_constitution_mc/acc"]
    assert check["candidate"] == extra["candidate"]["ko_constitution_mc/acc"]
    assert check["reference"] == extra["base"]["ko_constitution_mc/acc"] and check["reference_name"] == "base model"
    markdown = (trained.stage_dir("evaluate") / "report" / "report.md").read_text(encoding="utf-8")
    assert "lm-eval tasks: ko_constitution_mc (limit 8)" in markdown
    base_acc = f"{extra['base']['ko_constitution_mc/acc']:.6g} ± {extra['base']['ko_constitution_mc/acc_stderr']:.2g}"
    assert f"| ko_constitution_mc/acc | 8 | {base_acc} |" in markdown  # n: the 8 questions of the limit


def test_a_builtin_task_folder_that_prepare_did_not_write_is_named(tmp_path: Path) -> None:
    spec = load_pipeline("korean-llm", "local", ["tracking.wandb_project=null"]).spec
    with pytest.raises(DataError, match=r"^stages\.evaluate\.lm_eval_include_path: builtin:korean-lm-eval: prepare "):
        measures.include_dir(spec, tmp_path / "run")


# --------------------------------------------------------------------------- the gate


def test_gate_rules() -> None:
    lower = GateRule(metric="perplexity", higher_is_better=False, max_regression=0.5)
    higher = GateRule(metric="kobest_boolq/acc", higher_is_better=True, max_regression=0.01)
    reference = {"perplexity": 10.0, "kobest_boolq/acc": 0.70}

    decision, _, checks = gate.apply_gate(
        [lower, higher], {"perplexity": 10.4, "kobest_boolq/acc": 0.695}, reference, "base model"
    )
    assert decision == "pass" and all(c.passed for c in checks)

    decision, reasons, _ = gate.apply_gate(
        [lower, higher], {"perplexity": 10.6, "kobest_boolq/acc": 0.8}, reference, "champion v3"
    )
    assert decision == "fail"
    assert "perplexity: candidate 10.6 vs champion v3 10" in reasons[0] and reasons[0].endswith("fails")

    # A metric that was not measured is a failure that says so, never a silent pass.
    decision, reasons, _ = gate.apply_gate([higher], {"perplexity": 9.0}, reference, "base model")
    assert (
        decision == "fail" and "kobest_boolq/acc: not measured for the candidate (measured: perplexity)" in reasons[0]
    )
    decision, reasons, _ = gate.apply_gate([higher], {"kobest_boolq/acc": 0.9}, {}, "champion v1")
    assert decision == "fail" and "no value for the champion v1" in reasons[0]


def test_gate_passes_against_the_base_model_with_the_report(trained: RunDir, task_dir: Path, tmp_path: Path) -> None:
    spec = spec_of(trained)
    section = spec.stages.evaluate
    section.lm_eval_tasks = ["tiny_ko"]
    section.lm_eval_include_path = str(task_dir)
    section.limit = 4
    section.gate = [
        GateRule(metric="perplexity", higher_is_better=False, max_regression=0.0),
        GateRule(metric="tiny_ko/acc", higher_is_better=True, max_regression=1.0),
    ]
    result = run_evaluate(trained, spec, tmp_path / "outputs")

    assert result.status == "succeeded"
    assert (tmp_path / "outputs" / "gate").read_text() == "pass"  # the Argo output deploy's `when` reads
    extra = result.extra
    assert extra["gate"] == "pass" and extra["reference"] == "base model" and extra["champion"] == {}
    candidate, base = extra["candidate"], extra["base"]
    assert candidate["perplexity"] < base["perplexity"]  # a few steps of cpt beat the random initialisation
    assert candidate["eval_rows"] == 16 and candidate["eval_tokens"] > 0 and "tiny_ko/acc" in base
    assert result.metrics["perplexity"] == candidate["perplexity"]
    assert [c["metric"] for c in extra["gate_checks"]] == ["perplexity", "tiny_ko/acc"]
    assert extra["gate_checks"][0]["reference"] == base["perplexity"]
    assert len(extra["candidate_generations"]) == len(section.prompts) == len(extra["base_generations"])

    report = trained.stage_dir("evaluate") / "report"
    markdown = (report / "report.md").read_text(encoding="utf-8")
    assert "**Gate: PASS** against the base model." in markdown
    assert "| metric | better | allowed regression | threshold | candidate | reference | result |" in markdown
    n = f"16 rows, {candidate['eval_tokens']:.0f} tokens"
    assert f"| perplexity | {n} | {base['perplexity']:.6g} | {candidate['perplexity']:.6g} |" in markdown
    assert "| prompt | base | candidate |" in markdown and f"| {section.prompts[0]} |" in markdown
    page = (report / "report.html").read_text(encoding="utf-8")
    assert "<th>candidate</th>" in page and section.prompts[0] in page and "data:image/png;base64," in page
    assert (report / "metrics.png").stat().st_size > 0 and (report / "loss_curves.png").stat().st_size > 0

    from mlflow import MlflowClient

    client = MlflowClient(spec.tracking.mlflow_tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.data.metrics["candidate/perplexity"] == pytest.approx(candidate["perplexity"])
    assert run.data.metrics["gate_passed"] == 1.0
    # lm-eval's standard errors and sample counts are kept: in stage.json and in MLflow.
    assert result.metrics["tiny_ko/acc_stderr"] == candidate["tiny_ko/acc_stderr"]
    assert result.metrics["tiny_ko/n_samples"] == 4
    assert run.data.metrics["candidate/tiny_ko/acc_stderr"] == pytest.approx(candidate["tiny_ko/acc_stderr"])
    assert run.data.metrics["base/tiny_ko/n_samples"] == 4
    assert {"report/report.md", "report/report.html"} <= {
        a.path for a in client.list_artifacts(run.info.run_id, "report")
    }


def test_gate_fails_against_a_champion_with_better_metrics(trained: RunDir, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    spec = spec_of(trained)
    spec.stages.deploy.registered_model = "tiny-champion-better"
    spec.stages.evaluate.gate = [GateRule(metric="perplexity", higher_is_better=False, max_regression=0.5)]
    uri = spec.tracking.mlflow_tracking_uri
    client = MlflowClient(uri, registry_uri=uri)
    client.create_registered_model("tiny-champion-better")
    tags = {"posttrain.metric.perplexity": "1.5", registry.HELDOUT_TAG: heldout_fingerprint(trained)}
    version = client.create_model_version("tiny-champion-better", source=str(tmp_path), tags=tags)
    client.set_registered_model_alias("tiny-champion-better", "champion", version.version)

    result = run_evaluate(trained, spec, tmp_path / "outputs")
    assert result.status == "succeeded"  # the stage did its job; the decision is the output
    assert (tmp_path / "outputs" / "gate").read_text() == "fail"
    extra = result.extra
    assert extra["gate"] == "fail" and extra["reference"] == "champion v1"
    assert extra["champion"] == {"perplexity": 1.5} and extra["champion_source"] == {"perplexity": "tag"}
    assert extra["champion_remeasured"] == {}  # measured on these very held-out rows: the recorded number holds
    assert extra["candidate"]["perplexity"] > 2.0
    assert "vs champion v1 1.5" in extra["gate_reasons"][0] and extra["gate_reasons"][0].endswith("fails")
    markdown = (trained.stage_dir("evaluate") / "report" / "report.md").read_text(encoding="utf-8")
    assert (
        "**Gate: FAIL** against the champion v1." in markdown
        and "| metric | n | base | champion | candidate |" in markdown
    )


def test_a_champion_without_recorded_metrics_is_measured_again(trained: RunDir, tmp_path: Path) -> None:
    spec = spec_of(trained)
    spec.stages.deploy.registered_model = "tiny-champion-unrecorded"
    register_champion(trained, spec, "tiny-champion-unrecorded", tmp_path / "art", tags={})

    extra = run_evaluate(trained, spec, tmp_path / "outputs").extra
    # The champion is this very model: measured again, it scores the same, and the gate holds.
    assert extra["champion_source"]["perplexity"] == "re-evaluated"
    assert extra["champion_remeasured"]["perplexity"].endswith("its numbers were measured on are not recorded")
    assert extra["champion"]["perplexity"] == pytest.approx(extra["candidate"]["perplexity"], rel=1e-5)
    assert extra["gate"] == "pass" and extra["reference"] == "champion v1"


def test_a_champion_measured_on_other_heldout_rows_is_measured_again(trained: RunDir, tmp_path: Path) -> None:
    spec = spec_of(trained)
    spec.stages.deploy.registered_model = "tiny-champion-old-heldout"
    spec.stages.evaluate.gate = [GateRule(metric="perplexity", higher_is_better=False, max_regression=0.5)]
    before = heldout_fingerprint(trained)
    # The champion's recorded perplexity (1.5, out of reach) was measured on the held-out rows of this run.
    tags = {"posttrain.metric.perplexity": "1.5", registry.HELDOUT_TAG: before}
    register_champion(trained, spec, "tiny-champion-old-heldout", tmp_path / "art", tags)
    extra = run_evaluate(trained, spec, tmp_path / "outputs").extra
    assert extra["champion_remeasured"] == {} and extra["gate"] == "fail"

    # The held-out set changes: 1.5 no longer compares with the candidate's number, so the champion is measured
    # again on the new rows (it is this very model: the same perplexity, and the gate holds).
    heldout = trained.root / "prepare/data/evaluate/eval.jsonl"
    original = heldout.read_bytes()
    try:
        write_jsonl(heldout, text_rows(10, seed=11) + chat_rows(3, seed=11))
        extra = run_evaluate(trained, spec, tmp_path / "outputs").extra
    finally:
        heldout.write_bytes(original)
    now = extra["heldout_fingerprint"]
    assert now != before and extra["champion_heldout_fingerprint"] == before
    assert extra["champion_source"]["perplexity"] == "re-evaluated"
    assert extra["champion"]["perplexity"] == pytest.approx(extra["candidate"]["perplexity"], rel=1e-5)
    assert extra["champion"]["eval_rows"] == 13 == extra["candidate"]["eval_rows"]
    why = extra["champion_remeasured"]["perplexity"]
    assert why == f"held-out numbers measured on other held-out rows ({before[:19]}; this run's are {now[:19]})"
    assert set(extra["champion_remeasured"]) == set(measures.HELDOUT_METRICS)
    assert extra["gate"] == "pass" and extra["reference"] == "champion v1"
    markdown = (trained.stage_dir("evaluate") / "report" / "report.md").read_text(encoding="utf-8")
    assert "champion measured again (eval_loss, perplexity" in markdown


def test_prompts_generated_in_one_batch_get_the_answers_they_get_alone(trained: RunDir) -> None:
    """Left padding: each prompt's greedy answer in the batch is the one it gets alone (text and chat)."""
    spec = trained.load_spec()
    tokenizer = load_tokenizer(trained, spec.model)
    model = load_stage_model(trained, spec, "cpt", tokenizer).eval()
    prompts = ["대한민국의 수도는", "헌법 제1조를 설명해 주세요. 국회는 법률을", "국민"]
    for chat in (False, True):
        together = measures.generate(model, tokenizer, prompts, 12, chat=chat)
        alone = [measures.generate(model, tokenizer, [prompt], 12, chat=chat)[0] for prompt in prompts]
        assert together == alone and all(together)
    assert measures.generate(model, tokenizer, [], 12, chat=True) == []


# --------------------------------------------------------------------------- the score cache


def later_run(run_dir: RunDir, name: str) -> RunDir:
    """Another run of the pipeline beside `run_dir`, with its data, tokenizer and trained candidate."""
    other = run_dir.root.parent / name
    shutil.rmtree(other, ignore_errors=True)
    shutil.copytree(run_dir.root, other)
    shutil.rmtree(other / "evaluate", ignore_errors=True)
    for task in (other / BUILTIN_TASKS_DIR).glob("*.yaml"):  # as its prepare writes them: data in its own folder
        task.write_text(task.read_text(encoding="utf-8").replace(str(run_dir.root), str(other)), encoding="utf-8")
    return RunDir(other)


def counted_base_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every load_base call from here on (the candidate of an adapter stage loads its base too)."""
    from stages import modeling

    calls: list[str] = []
    load_base = modeling.load_base

    def counting(*args: object, **kwargs: object) -> object:
        calls.append("load")
        return load_base(*args, **kwargs)

    monkeypatch.setattr(modeling, "load_base", counting)
    return calls


def test_a_later_run_takes_the_base_model_numbers_from_the_score_cache(
    trained: RunDir, task_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scores = trained.root.parent / ".scores"
    shutil.rmtree(scores, ignore_errors=True)
    spec = spec_of(trained)
    section = spec.stages.evaluate
    section.lm_eval_tasks, section.lm_eval_include_path, section.limit = ["tiny_ko"], str(task_dir), 4
    loads = counted_base_loads(monkeypatch)

    # A run whose lm-eval fails files the parts that were measured, not the failed one.
    with monkeypatch.context() as broken:
        broken.setattr(measures, "lm_eval_metrics", lambda *a, **k: (_ for _ in ()).throw(OSError("no GPU left")))
        first = run_evaluate(trained, spec, tmp_path / "outputs").extra
    assert first["base_cached"] == {} and any("lm-eval failed" in e for e in first["errors"])
    assert len(list(scores.glob("*.json"))) == 2  # held-out numbers and generations
    second = run_evaluate(trained, spec, tmp_path / "outputs").extra
    assert second["base_cached"] == {"heldout": "run", "generations": "run"}  # lm-eval measured, then filed
    assert len(list(scores.glob("*.json"))) == 3
    loaded = len(loads)

    # The next run of the pipeline measures only the candidate.
    later = later_run(trained, "run-later")
    third = run_evaluate(later, spec, tmp_path / "outputs").extra
    assert third["base_cached"] == {"heldout": "run", "lm_eval": "run", "generations": "run"}
    assert len(loads) == loaded  # the base model was not even loaded
    assert third["base"] == second["base"] and "tiny_ko/acc" in third["base"]
    assert third["base_generations"] == second["base_generations"] and third["gate"] == second["gate"]
    markdown = (later.stage_dir("evaluate") / "report" / "report.md").read_text(encoding="utf-8")
    assert "base model numbers from the score cache: heldout (run run), lm_eval (run run)" in markdown

    # What a number was measured on is part of its key: another limit measures lm-eval again, and only it.
    section.limit = 3
    fourth = run_evaluate(later, spec, tmp_path / "outputs").extra
    assert set(fourth["base_cached"]) == {"heldout", "generations"}
    assert fourth["base"]["perplexity"] == third["base"]["perplexity"]
    # Changed held-out rows: the perplexity is measured again.
    write_jsonl(later.root / "prepare/data/evaluate/eval.jsonl", text_rows(10, seed=11))
    fifth = run_evaluate(later, spec, tmp_path / "outputs").extra
    assert set(fifth["base_cached"]) == {"lm_eval", "generations"} and fifth["base"]["eval_rows"] == 10
    section.cache_scores = False
    assert run_evaluate(later, spec, tmp_path / "outputs").extra["base_cached"] == {}


def test_the_champion_numbers_come_from_the_score_cache_by_its_content(
    trained: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = spec_of(trained)
    spec.stages.deploy.registered_model = "tiny-champion-cached"
    fingerprint = model_fingerprint(trained.stage_dir("cpt") / "model")
    tags = {"posttrain.model_fingerprint": fingerprint}  # as deploy tags the files it registers
    register_champion(trained, spec, "tiny-champion-cached", tmp_path / "art", tags)
    first = run_evaluate(trained, spec, tmp_path / "outputs").extra
    assert first["champion_source"]["perplexity"] == "re-evaluated"

    def no_download(*args: object) -> Path:
        raise AssertionError("the champion was downloaded")

    monkeypatch.setattr(evaluate, "download_champion", no_download)
    second = run_evaluate(later_run(trained, "run-champion"), spec, tmp_path / "outputs").extra
    assert second["champion_source"]["perplexity"] == "cache"
    assert second["champion"] == first["champion"]
    assert second["champion_remeasured"] == first["champion_remeasured"]  # why they were needed again still holds
    assert second["gate"] == "pass" and second["reference"] == "champion v1"


def test_which_recorded_heldout_numbers_compare() -> None:
    same, other = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    assert evaluate.heldout_change({registry.HELDOUT_TAG: same}, same, None) is None
    assert "other held-out rows" in evaluate.heldout_change({registry.HELDOUT_TAG: other}, same, same)
    # A version registered without it: its evaluate data fingerprint, when the held-out rows are evaluate's data.
    assert evaluate.heldout_change({registry.EVALUATE_DATA_TAG: same}, other, same) is None
    assert "other evaluate data" in evaluate.heldout_change({registry.EVALUATE_DATA_TAG: other}, other, same)
    assert "not recorded" in evaluate.heldout_change({registry.EVALUATE_DATA_TAG: same}, other, None)
    assert "not recorded" in evaluate.heldout_change({}, same, same)


# --------------------------------------------------------------------------- nothing to evaluate


def test_a_run_that_prepare_ended_early_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "run"
    run_dir = RunDir(root)
    spec = load_pipeline(
        "korean-llm", "local", ["tracking.wandb_project=null", "stages.prepare.skip_if_unchanged=true"]
    ).spec
    root.mkdir()
    run_dir.write_spec(spec)
    prepare = StageContext(run_dir, "prepare", spec)
    assert prepare.begin()
    prepare.finish(extra={"unchanged": "true", "skip_if_unchanged": "true", "previous_run": "run-before"})

    ctx = StageContext(run_dir, "evaluate", spec, outputs_dir=tmp_path / "outputs")
    assert evaluate.run(ctx) == 0
    result = run_dir.read_result("evaluate")
    assert result is not None and result.status == "skipped" and "unchanged since run-before" in result.message
    assert (tmp_path / "outputs" / "gate").read_text() == "skipped"
    assert json.loads((root / "evaluate" / "stage.json").read_text())["extra"]["gate"] == "skipped"


# --------------------------------------------------------------------------- what is measured


def test_the_candidate_is_recorded_by_content(trained: RunDir, tmp_path: Path) -> None:
    result = run_evaluate(trained, spec_of(trained), tmp_path / "outputs")
    candidate = result.inputs["candidate"]
    assert candidate.uri == "cpt/model"
    assert candidate.fingerprint == trained.read_result("cpt").extra["model_fingerprint"]
    assert candidate.fingerprint == model_fingerprint(trained.stage_dir("cpt") / "model")


def test_a_candidate_changed_after_its_stage_recorded_it_is_refused(trained: RunDir, tmp_path: Path) -> None:
    """cpt/model rewritten after cpt recorded it: evaluate measures nothing and gates nothing."""
    run_dir = RunDir(tmp_path / "run")
    shutil.copytree(  # the run as cpt left it
        trained.root,
        run_dir.root,
        ignore=lambda folder, names: [
            n for n in names if n in ("checkpoints", ".lock") or Path(folder, n) == trained.root / "evaluate"
        ],
    )
    weights = run_dir.stage_dir("cpt") / "model" / "model.safetensors"
    save_file({k: v * 1.01 for k, v in load_file(weights).items()}, weights)

    ctx = StageContext(run_dir, "evaluate", spec_of(trained), outputs_dir=tmp_path / "outputs")
    with pytest.raises(StageRefused, match=r"^\[evaluate\] cpt/model changed after cpt recorded it: ") as refused:
        evaluate.run(ctx)
    assert "python -m stages cpt" in str(refused.value) and "--force" in str(refused.value)
    result = run_dir.read_result("evaluate")
    assert result.status == "failed" and result.message == str(refused.value)
    assert "candidate" not in result.inputs and not (run_dir.stage_dir("evaluate") / "report").exists()
    assert not (tmp_path / "outputs" / "gate").exists()


# --------------------------------------------------------------------------- the vLLM backend

LOSS_TOLERANCE = 5e-3
"""How far vLLM's held-out loss (nats per token) may lie from transformers' on the same bf16 tiny model: measured
8e-5 and 4e-4 (docs/stages.md, "evaluate: through vLLM"); bf16 kernels differ, the rows and tokens do not."""


def test_the_vllm_backend_measures_what_transformers_measures(
    trained: RunDir, task_dir: Path, tmp_path: Path, real_vllm: Path
) -> None:
    """backend: vllm saves each model, serves it with the real engine and measures it through the API: the same
    rows, tokens and lm-eval questions as the transformers backend, the loss within bf16 noise, the same answers to
    the multiple-choice questions, greedy generations that start alike."""
    spec = spec_of(trained)
    section = spec.stages.evaluate
    section.lm_eval_tasks, section.lm_eval_include_path = ["tiny_ko"], str(task_dir)
    section.cache_scores = False
    section.gate = [GateRule(metric="tiny_ko/acc", higher_is_better=True, max_regression=1.0)]
    local = run_evaluate(trained, spec, tmp_path / "transformers").extra
    section.backend = "vllm"
    served = run_evaluate(trained, spec, tmp_path / "vllm").extra

    assert local["engines"] == {"candidate": "transformers 5.23.0", "base": "transformers 5.23.0"}
    assert served["engines"] == {"candidate": "vllm 0.32.0", "base": "vllm 0.32.0"} and served["backend"] == "vllm"
    for who in ("candidate", "base"):
        ours, theirs = local[who], served[who]
        assert {k: theirs[k] for k in ("eval_rows", "eval_tokens", "tiny_ko/n_samples")} == {
            k: ours[k] for k in ("eval_rows", "eval_tokens", "tiny_ko/n_samples")
        }
        assert abs(theirs["eval_loss"] - ours["eval_loss"]) <= LOSS_TOLERANCE, (who, theirs, ours)
        assert theirs["eval_loss"] != ours["eval_loss"]  # measured by another engine, not copied
        assert theirs["tiny_ko/acc"] == ours["tiny_ko/acc"], who
        # The same first token; bf16 near-ties may part greedy decoding later (docs/stages.md).
        pairs = list(zip(local[f"{who}_generations"], served[f"{who}_generations"], strict=True))
        assert all(vllm[:1] == mine[:1] for mine, vllm in pairs), (who, pairs)
    assert any(mine for mine in local["base_generations"])  # the random base model does not stop at once
    evaluate_dir = trained.stage_dir("evaluate")
    log = (evaluate_dir / "logs" / "vllm-candidate.log").read_text(encoding="utf-8")
    assert "'load_format': 'safetensors'" in log and "'dtype': 'bfloat16'" in log  # as the argv asked
    assert not any((evaluate_dir / "vllm").iterdir())  # each saved model is deleted once measured


def test_a_vllm_that_does_not_start_fails_the_gate_with_its_log(
    trained: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server exits before it is ready: the models' metrics are missing, the errors hold the end of vLLM's
    log, the gate fails; no saved model is left behind."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'CUDA error: no kernel image is available'\nexit 3\n", encoding="utf-8")
    fake.chmod(0o755)
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(fake))
    spec = spec_of(trained)
    spec.stages.evaluate.backend = "vllm"
    spec.stages.evaluate.cache_scores = False
    result = run_evaluate(trained, spec, tmp_path / "outputs")

    extra = result.extra
    assert extra["gate"] == "fail" and (tmp_path / "outputs" / "gate").read_text() == "fail"
    assert "perplexity" not in extra["candidate"] and extra["engines"] == {}
    assert any(
        e.startswith("candidate: vLLM did not serve the model: vLLM exited with 3 before it was ready")
        and "no kernel image" in e
        for e in extra["errors"]
    ), extra["errors"]
    assert extra["candidate_generations"] == ["", ""]
    assert not any((trained.stage_dir("evaluate") / "vllm").iterdir())


def test_the_vllm_backend_without_vllm_is_refused_before_a_model_loads(
    trained: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", "off")
    spec = spec_of(trained)
    spec.stages.evaluate.backend = "vllm"
    trained.write_spec(spec)
    ctx = StageContext(trained, "evaluate", spec, force=True, outputs_dir=tmp_path / "outputs")
    assert evaluate.run(ctx) == 1
    result = trained.read_result("evaluate")
    assert result is not None and result.status == "failed"
    assert result.message.startswith(
        "stages.evaluate.backend is 'vllm' but there is no vLLM environment at POSTTRAIN_VLLM_PYTHON=off: "
    )
    assert not (tmp_path / "outputs" / "gate").exists() and "candidate" not in result.inputs


def test_one_backends_numbers_are_never_the_others_in_the_score_cache(trained: RunDir) -> None:
    """The cache keys of backend: vllm name it; those of transformers are what earlier runs filed (still found)."""
    spec = spec_of(trained)
    keys = measures.score_keys(StageContext(trained, "evaluate", spec), "sha256:rows")
    spec.stages.evaluate.backend = "vllm"
    served = measures.score_keys(StageContext(trained, "evaluate", spec), "sha256:rows")
    assert keys is not None and served is not None and set(keys) == set(served) == {"heldout", "lm_eval", "generations"}
    for part, key in keys.items():
        assert "backend" not in key and served[part] == {**key, "backend": "vllm"}
