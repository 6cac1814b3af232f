"""The hyperparameter search's stage side and the local search: trials (stages/trials.py), the selection
(stages/hpo.py, `python -m stages hpo-select`) and Optuna under --local (workflows/search.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from training_fixtures import child_env, make_run_dir, run_stage

import workflows.local as local
from run.config_hash import config_hash
from run.names import katib_parameter_name
from run.run_dir import RunDir
from run.search import search_fingerprint, search_path, trials_dir
from run.tracking import local_store_uri
from spec.loading import load_pipeline
from spec.search import HpoSpec, SearchParameter
from stages.__main__ import main as stages_main
from stages.trials import METRICS_FILE_ENV
from workflows import stage_process
from workflows.search import distribution, grid_values, sampler, search_in_runner, trial_budget

HPO = (
    "{objective: {metric: eval_loss}, algorithm: tpe, max_trials: 4, parallel_trials: 1, trial_max_steps: 2, "
    "seed: 7, max_failed_trials: 2, parameters: ["
    "{path: training.learning_rate, type: log_uniform, min: 1.0e-4, max: 1.0e-2}, "
    "{path: lora.r, type: categorical, values: [4, 8]}, "
    "{path: training.warmup_ratio, type: uniform, min: 0.0, max: 0.1}]}"
)
# korean-llm's local profile, down to prepare and a LoRA sft with a search
SEARCHED = [
    "tracking.wandb_project=null",
    "stages.cpt.enabled=false",
    "stages.rlhf.enabled=false",
    "stages.evaluate.enabled=false",
    "stages.deploy.enabled=false",
    "stages.sft.method=lora",
    "stages.sft.training.max_steps=3",
    "stages.sft.data.eval_fraction=0.05",
    f"stages.sft.hpo={HPO}",
]
TRIAL = [
    "--trial-set",
    "training.learning_rate=0.001",
    "--trial-set",
    "lora.r=8",
    "--trial-set",
    "training.warmup_ratio=0",
]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_MODE", METRICS_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU: plain `python -m stages`, never torchrun


@pytest.fixture(scope="module")
def searched_run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A prepared run (no cpt) whose sft has a search, with two trials run: t-1 and t-2."""
    root = tmp_path_factory.mktemp("hpo") / "run"
    run_dir = make_run_dir(root, SEARCHED[1:], n_text=40, n_chat=80)
    metrics_file = root.parent / "katib" / "metrics.log"
    first = run_stage(run_dir, "sft", "--trial", "t-1", *TRIAL, **{METRICS_FILE_ENV: str(metrics_file)})
    assert first.returncode == 0, first.stdout + first.stderr
    (root.parent / "t-1.out").write_text(first.stdout, encoding="utf-8")
    second = [a.replace("0.001", "0.005").replace("lora.r=8", "lora.r=4") for a in TRIAL]
    done = run_stage(run_dir, "sft", "--trial", "t-2", *second)
    assert done.returncode == 0, done.stdout + done.stderr
    return run_dir


def trial_record(run_root: Path, name: str) -> dict[str, Any]:
    return json.loads((trials_dir(run_root, "sft") / name / "sft" / "stage.json").read_text(encoding="utf-8"))


def mlflow_runs(run_root: Path) -> list[Any]:
    client = MlflowClient(tracking_uri=local_store_uri(run_root))
    experiments = client.search_experiments()
    # get_run: search_runs leaves out the mlflow.parentRunId tag
    return [client.get_run(r.info.run_id) for r in client.search_runs([e.experiment_id for e in experiments])]


# --------------------------------------------------------------------------- a trial


def test_a_trial_trains_in_its_own_directory_and_reports_its_metrics(searched_run: RunDir) -> None:
    root = searched_run.root
    trial = trials_dir(root, "sft") / "t-1"
    spec = json.loads((trial / "spec.json").read_text(encoding="utf-8"))["stages"]["sft"]
    assert spec["training"]["learning_rate"] == 0.001 and spec["lora"]["r"] == 8
    assert spec["training"]["max_steps"] == 2 and spec["training"]["save_steps"] == 1  # checkpoints at 1 and 2
    assert spec["hpo"] is None
    record = trial_record(root, "t-1")
    assert record["status"] == "succeeded" and record["metrics"]["steps"] == 2
    assert sorted(p.name for p in (trial / "sft" / "checkpoints").glob("checkpoint-*")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    # prepare is the run's own, read through a relative link; the run's sft folder is never touched
    assert (trial / "prepare").is_symlink() and (trial / "prepare").resolve() == root / "prepare"
    assert not (root / "sft").exists()

    lines = (root.parent / "katib" / "metrics.log").read_text(encoding="utf-8").splitlines()
    assert lines[0] == f"eval_loss={record['metrics']['eval_loss']!r}"
    assert {line.split("=")[0] for line in lines} == set(record["metrics"])
    assert all(line in (root.parent / "t-1.out").read_text(encoding="utf-8") for line in lines)


def test_each_trial_is_an_mlflow_run_nested_under_the_pipeline_run(searched_run: RunDir) -> None:
    root = searched_run.root
    parent = json.loads((root / "tracking.json").read_text(encoding="utf-8"))["mlflow"]["parent_run_id"]
    trials = {r.data.tags.get("posttrain.trial"): r for r in mlflow_runs(root) if "posttrain.trial" in r.data.tags}
    assert {"t-1", "t-2"} <= set(trials)
    for name, run in trials.items():
        assert run.data.tags["mlflow.parentRunId"] == parent
        assert run.data.tags["posttrain.stage"] == "sft" and run.info.run_name == f"sft trial {name}"
        assert run.info.run_id == trial_record(root, name)["mlflow_run_id"]
        assert run.info.status == "FINISHED"
    assert trials["t-2"].data.params["learning_rate"] == "0.005"
    assert trials["t-2"].data.metrics["eval_loss"] == trial_record(root, "t-2")["metrics"]["eval_loss"]
    # a trial never ends the pipeline run, even as the last enabled stage, nor names it (t-1 opened it here)
    pipeline = MlflowClient(local_store_uri(root)).get_run(parent)
    assert pipeline.info.status == "RUNNING" and "posttrain.trial" not in pipeline.data.tags


def test_running_a_trial_again_is_a_no_op(searched_run: RunDir) -> None:
    before = trial_record(searched_run.root, "t-2")
    second = [a.replace("0.001", "0.005").replace("lora.r=8", "lora.r=4") for a in TRIAL]
    again = run_stage(searched_run, "sft", "--trial", "t-2", *second)
    assert again.returncode == 0, again.stderr
    assert "already completed with the same config" in again.stdout
    assert f"eval_loss={before['metrics']['eval_loss']!r}" in again.stdout
    assert trial_record(searched_run.root, "t-2") == before


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--trial", "t-9", "--trial-set", "training.learning_rate=abc"], "training.learning_rate=abc: not a number"),
        (["--trial", "t-9", "--trial-set", "training.learning_rate=0.5"], "outside the search space"),
        (["--trial", "t-9", "--trial-set", "lora.r=5"], "lora.r=5: not one of [4, 8]"),
        (["--trial", "t-9", "--trial-set", "lora.alpha=4"], "lora.alpha is not searched in stages.sft.hpo"),
        (["--trial", "t-9", "--trial-set", "lora.r"], "expected <path>=<value>"),
        (["--trial", "t-9", *TRIAL[:2]], "no value for lora.r, training.warmup_ratio"),
        (["--trial", "Trial_9", *TRIAL], "a trial name is lowercase letters, digits and '-'"),
        (["--trial", "../t-9", *TRIAL], "a trial name is lowercase letters, digits and '-'"),
        (TRIAL[:2], "--trial-set is for a trial"),
    ],
)
def test_bad_trial_arguments_end_with_one_error_line(tmp_path: Path, capsys, args: list[str], said: str) -> None:
    run_dir = make_run_dir(tmp_path / "run", SEARCHED[1:], n_text=20, n_chat=20)
    assert stages_main(["sft", "--run-dir", str(run_dir.root), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err
    assert not (run_dir.root / "hpo").exists() and not (run_dir.root / "sft").exists()


def test_a_trial_of_a_stage_without_a_search_is_refused(tmp_path: Path, capsys) -> None:
    run_dir = make_run_dir(tmp_path / "run", ["stages.cpt.enabled=false"], n_text=20, n_chat=20)
    assert stages_main(["sft", "--run-dir", str(run_dir.root), "--trial", "t-1", *TRIAL]) == 2
    assert "stages.sft has no hpo section" in capsys.readouterr().err


# --------------------------------------------------------------------------- selection after Katib


def optimal_trial(lr: str = "0.005", r: str = "4", name: str = "t-2", eval_loss: str = "1.25") -> dict[str, Any]:
    """status.currentOptimalTrial as Katib writes it (values are strings)."""
    return {
        "bestTrialName": name,
        "parameterAssignments": [
            {"name": katib_parameter_name("training.learning_rate"), "value": lr},
            {"name": katib_parameter_name("lora.r"), "value": r},
            {"name": katib_parameter_name("training.warmup_ratio"), "value": "0.0"},
        ],
        "observation": {"metrics": [{"name": "eval_loss", "latest": "1.5", "min": eval_loss, "max": "9.0"}]},
    }


@pytest.fixture
def copied_run(searched_run: RunDir, tmp_path: Path) -> RunDir:
    """The searched run, copied (links kept) so a test may change it."""
    shutil.copytree(searched_run.root, tmp_path / "run", symlinks=True)
    return RunDir(tmp_path / "run")


def test_hpo_select_sets_the_best_values_in_the_runs_spec(copied_run: RunDir, tmp_path: Path, capsys) -> None:
    before = copied_run.load_spec()
    fingerprint = search_fingerprint(before, "sft")
    optimal = tmp_path / "optimal.json"
    optimal.write_text(json.dumps(optimal_trial()), encoding="utf-8")
    argv = ["hpo-select", "--run-dir", str(copied_run.root), "--stage", "sft", "--optimal-trial", str(optimal)]
    assert stages_main(argv) == 0
    assert "best trial t-2 (eval_loss 1.25) of 2" in capsys.readouterr().out

    spec = copied_run.load_spec()
    assert spec.stages.sft.training.learning_rate == 0.005 and spec.stages.sft.lora.r == 4
    assert spec.stages.sft.training.warmup_ratio == 0.0
    assert spec.stages.sft.hpo == before.stages.sft.hpo and spec.stages.sft.training.max_steps == 3
    record = json.loads(search_path(copied_run.root, "sft").read_text(encoding="utf-8"))
    assert record["best_trial"] == "t-2" and record["best_objective"] == 1.25 and record["algorithm"] == "tpe"
    assert record["best_values"] == {"training.learning_rate": 0.005, "lora.r": 4, "training.warmup_ratio": 0.0}
    assert record["search"] == fingerprint == search_fingerprint(spec, "sft")  # the values are not the search
    trials = {t["name"]: t for t in record["trials"]}
    assert set(trials) == {"t-1", "t-2"} and trials["t-1"]["status"] == "succeeded"
    assert trials["t-1"]["values"] == {"training.learning_rate": 0.001, "lora.r": 8, "training.warmup_ratio": 0.0}
    assert trials["t-2"]["objective"] == trial_record(copied_run.root, "t-2")["metrics"]["eval_loss"]

    parent_id = json.loads((copied_run.root / "tracking.json").read_text(encoding="utf-8"))["mlflow"]["parent_run_id"]
    parent = MlflowClient(local_store_uri(copied_run.root)).get_run(parent_id)
    assert parent.data.params["hpo.sft.training.learning_rate"] == "0.005"
    assert parent.data.params["hpo.sft.lora.r"] == "4"
    assert parent.data.metrics["hpo.sft.eval_loss"] == 1.25
    assert parent.data.tags["posttrain.hpo.sft.best_trial"] == "t-2"

    # selecting the same outcome again changes nothing
    assert stages_main(argv) == 0
    assert copied_run.load_spec() == spec


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "cannot read it"),
        ("{not json", "not valid JSON"),
        (json.dumps({**optimal_trial(), "bestTrialName": ""}), "no successful trial"),
        (json.dumps(optimal_trial(r="5")), "best value lora.r=5: not one of [4, 8]"),
        (json.dumps(optimal_trial(lr="2")), "outside the search space"),
        (
            json.dumps({**optimal_trial(), "parameterAssignments": [{"name": "lora-alpha", "value": "4"}]}),
            "'lora-alpha' is not a parameter of stages.sft.hpo",
        ),
        (json.dumps({"bestTrialName": "t-2"}), "parameterAssignments is missing"),
    ],
)
def test_bad_optimal_trial_input_ends_with_one_error_line(
    copied_run: RunDir, tmp_path: Path, capsys, content: str | None, said: str
) -> None:
    spec_before = copied_run.spec_path.read_bytes()
    optimal = tmp_path / "optimal.json"
    if content is not None:
        optimal.write_text(content, encoding="utf-8")
    argv = ["hpo-select", "--run-dir", str(copied_run.root), "--stage", "sft", "--optimal-trial", str(optimal)]
    assert stages_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err
    assert copied_run.spec_path.read_bytes() == spec_before
    assert not search_path(copied_run.root, "sft").exists()


def test_prepare_run_again_keeps_the_values_a_search_selected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the cluster, prepare resolves spec.json from the form's parameters; run again in a run directory whose search
    selected, it keeps the selected values (the stages after it were trained with them)."""
    from test_parameters import _params_dir, prepare_step

    from spec.form import resolve_params_dir

    params = _params_dir(tmp_path, {}, "llama3-dolly")
    run = tmp_path / "run"
    best = {"training.learning_rate": 1e-4, "lora.r": 32, "training.warmup_ratio": 0.05}
    fingerprint = search_fingerprint(resolve_params_dir(params), "sft")
    search_path(run, "sft").parent.mkdir(parents=True)
    search_path(run, "sft").write_text(json.dumps({"search": fingerprint, "best_values": best}), encoding="utf-8")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prepare_step(run, params)  # it goes on to read dolly from the hub, and stops there: this machine is offline
    sft = RunDir(run).load_spec().stages.sft
    assert (sft.training.learning_rate, sft.lora.r, sft.training.warmup_ratio) == (1e-4, 32, 0.05)


# --------------------------------------------------------------------------- Optuna


def test_katib_algorithms_run_on_optunas_samplers() -> None:
    import optuna

    def hpo(algorithm: str, *parameters: dict[str, Any]) -> HpoSpec:
        return HpoSpec.model_validate(
            {"objective": {"metric": "eval_loss"}, "algorithm": algorithm, "max_trials": 20, "parameters": parameters}
        )

    lr = {"path": "training.learning_rate", "type": "log_uniform", "min": 1e-5, "max": 1e-3}
    assert isinstance(sampler(hpo("tpe", lr)), optuna.samplers.TPESampler)
    assert isinstance(sampler(hpo("random", lr)), optuna.samplers.RandomSampler)
    assert isinstance(sampler(hpo("bayesianoptimization", lr)), optuna.samplers.GPSampler)
    grid = hpo(
        "grid",
        {"path": "lora.r", "type": "categorical", "values": [8, 16]},
        {"path": "training.warmup_ratio", "type": "uniform", "min": 0.0, "max": 0.1, "step": 0.05},
        {"path": "training.gradient_accumulation_steps", "type": "int", "min": 1, "max": 7, "step": 3},
    )
    assert [grid_values(p) for p in grid.parameters] == [[8, 16], [0.0, 0.05, 0.1], [1, 4, 7]]
    assert trial_budget(grid) == 18  # the grid has 18 points, fewer than max_trials
    assert isinstance(sampler(grid), optuna.samplers.GridSampler)
    log = distribution(SearchParameter.model_validate(lr))
    assert log.log and (log.low, log.high) == (1e-5, 1e-3)


def test_trials_that_fail_fail_the_search_at_max_failed_trials(tmp_path: Path) -> None:
    # The trials really run, and fail: prepare's tokenizer is not there.
    run_dir = make_run_dir(tmp_path / "run", SEARCHED[1:], n_text=20, n_chat=20)
    shutil.rmtree(run_dir.root / "prepare" / "tokenizer")
    stage = stage_process.StageRun("sft")
    rows = [stage_process.StageRun("prepare"), stage]
    why = search_in_runner(run_dir.load_spec(), run_dir.root, stage, rows, child_env(), False, 0, lambda: None)
    assert why.startswith("[sft] the search failed: 2 of 2 trials failed")
    assert "max_failed_trials is 2" in why
    assert [(r.name, r.status) for r in rows] == [
        ("prepare", "pending"),
        ("sft trial 1/4", "failed"),
        ("sft trial 2/4", "failed"),
        ("sft", "pending"),
    ]
    log = next(trials_dir(run_dir.root, "sft").glob("*-2")) / "sft" / "logs" / "stage.log"
    assert "prepare/tokenizer" in log.read_text(encoding="utf-8")
    assert not search_path(run_dir.root, "sft").exists()


# --------------------------------------------------------------------------- --local end to end


@pytest.mark.slow
def test_local_runs_a_four_trial_search_then_the_stage_with_the_best_values(tmp_path: Path, capsys) -> None:
    loaded = load_pipeline("korean-llm", "local", SEARCHED)
    run_root = tmp_path / "run"
    assert local.run_local(loaded, run_root) == 0
    out = capsys.readouterr().out
    for n in range(1, 5):
        assert f"sft trial {n}/4: succeeded" in out

    record = json.loads(search_path(run_root, "sft").read_text(encoding="utf-8"))
    assert len(record["trials"]) == 4 and all(t["status"] == "succeeded" for t in record["trials"])
    best = min(record["trials"], key=lambda t: t["objective"])
    assert record["best_trial"] == best["name"] and record["best_values"] == best["values"]
    # the stage trained with the best values: the run's spec says so, and sft's record was made from that spec
    spec = RunDir(run_root).load_spec()
    assert spec.stages.sft.training.learning_rate == best["values"]["training.learning_rate"]
    assert spec.stages.sft.lora.r == best["values"]["lora.r"]
    sft = RunDir(run_root).read_result("sft")
    assert sft.status == "succeeded" and sft.config_hash == config_hash(spec, "sft") and sft.metrics["steps"] == 3
    assert f"best trial {best['name']}" in out

    client = MlflowClient(local_store_uri(run_root))
    parent = json.loads((run_root / "tracking.json").read_text(encoding="utf-8"))["mlflow"]["parent_run_id"]
    runs = mlflow_runs(run_root)
    trial_runs = [r for r in runs if "posttrain.trial" in r.data.tags]
    assert sorted(r.data.tags["posttrain.trial"] for r in trial_runs) == sorted(t["name"] for t in record["trials"])
    assert all(r.data.tags["mlflow.parentRunId"] == parent for r in trial_runs)
    (stage_run,) = [r for r in runs if r.info.run_name == "sft"]
    assert float(stage_run.data.params["learning_rate"]) == best["values"]["training.learning_rate"]
    assert client.get_run(parent).data.params["hpo.sft.lora.r"] == str(best["values"]["lora.r"])

    # A rerun does not search again, and takes the selected values for the run's own (no conflict).
    ended = {t["name"]: trial_record(run_root, t["name"])["ended_at"] for t in record["trials"]}
    assert local.run_local(load_pipeline("korean-llm", "local", SEARCHED), run_root) == 0
    out = capsys.readouterr().out
    assert "sft trial" not in out and "sft: done before" in out
    assert {name: trial_record(run_root, name)["ended_at"] for name in ended} == ended
    assert len(list(trials_dir(run_root, "sft").iterdir())) == 4

    # A search cut short (its last trial and the selection never happened) goes on from the trials that ended.
    last = sorted(ended)[-1]
    shutil.rmtree(trials_dir(run_root, "sft") / last)
    search_path(run_root, "sft").unlink()
    shutil.rmtree(run_root / "sft")
    assert local.run_local(load_pipeline("korean-llm", "local", SEARCHED), run_root) == 0
    out = capsys.readouterr().out
    assert out.count("done before eval_loss") == 3 and "sft trial 4/4: succeeded" in out
    assert {name: trial_record(run_root, name)["ended_at"] for name in ended if name != last} == {
        name: at for name, at in ended.items() if name != last
    }
    assert len(json.loads(search_path(run_root, "sft").read_text(encoding="utf-8"))["trials"]) == 4
