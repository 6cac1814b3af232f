"""Untrusted input stays inert data and inside the volumes.

- UI parameters and overrides never reach a shell: hostile values (shell metacharacters, quotes, newlines, YAML
  and Argo `{{` syntax) through `prepare --params-dir` as the pod runs it, and hostile spec values through the
  rendered documents (test_security.py fuzzes the values given at submission).
- Paths from the spec or parameters cannot leave the run root or the mounted volumes (rules in stages/data.py):
  in the cluster a data path must resolve under the datasets or checkpoints mount; locally any path of the
  user's machine may be read; everywhere `pvc://` stays inside its claim and a data directory's symlinks stay
  inside the directory.
- Publishing a model to `pvc://` (stages.deploy.storage_uri) replaces its target folder: the folder must resolve,
  symlinks and `..` followed, strictly inside the checkpoints volume and away from every run directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from test_parameters import _params_dir
from test_security import HOSTILE, MARK, _executable_text, _expanded, _walk

from run.run_dir import RunDir
from run.serving import model_storage_uri
from spec.document import SpecError
from spec.loading import load_pipeline
from stages import deploy
from stages.__main__ import main as stages_main
from stages.contract import StageContext
from stages.data import DataError
from stages.prepared_data import read_dataset
from workflows.compile import compile_pipeline

ROW = '{"text": "서울은 아름답습니다."}\n'


# --------------------------------------------------------------------------- inert values


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=HOSTILE, uri=HOSTILE, description=HOSTILE)
def test_hostile_form_values_arrive_as_data_in_the_prepare_step(
    model: str, uri: str, description: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("params")
    values = {
        "base-model": f"{MARK}{model}",
        "sft-data": f"/mnt/datasets/{MARK}{uri}",
        "overrides": f"description={json.dumps(MARK + description)}",
    }
    run, outputs = tmp / "run", tmp / "outputs"
    code = stages_main(["prepare", "--run-dir", str(run), "--params-dir", str(_params_dir(tmp, values)),
                        "--outputs-dir", str(outputs)])  # fmt: skip
    if not (run / "spec.json").exists():  # refused as a whole, with a message: nothing was written
        assert code == 2 and not outputs.exists()
        return
    spec = RunDir(run).load_spec()
    assert spec.model.name_or_path == f"{MARK}{model}".strip()  # verbatim: no shell, no template expansion
    assert spec.stages.sft.data.uri == f"/mnt/datasets/{MARK}{uri}".strip()
    assert spec.description == MARK + description
    assert sorted(p.name for p in outputs.iterdir()) == sorted(f"run-{s}" for s in ("cpt", "sft", "rlhf",
                                                                                  "evaluate", "deploy"))  # fmt: skip
    assert {p.read_text() for p in outputs.iterdir()} <= {"true", "false"}
    assert code == 1  # the data is not there: prepare fails on it, naming it
    assert RunDir(run).read_result("prepare").status == "failed"


@settings(max_examples=15)
@given(value=HOSTILE)
def test_hostile_spec_values_stay_out_of_what_runs(value: str) -> None:
    text = f"{MARK}{value}"
    overrides = [
        f"description={json.dumps(text)}",
        f"model.name_or_path={json.dumps(text)}",
        f"stages.sft.data.uri={json.dumps('/mnt/datasets/' + text)}",
    ]
    try:
        spec = load_pipeline("korean-llm", overrides=overrides).spec
    except SpecError:
        return
    documents = _expanded(compile_pipeline(spec).documents())
    for filename, path, node in _executable_text(documents):
        assert MARK not in node, (filename, path)
    for filename, doc in documents.items():
        for path, node in _walk(doc):
            if isinstance(node, str) and MARK in node:  # form defaults, the description, the embedded spec only
                allowed = path[-1] in ("value", "workflows.argoproj.io/description") or "<base64>" in path
                assert allowed, (filename, path)


# --------------------------------------------------------------------------- paths


@pytest.fixture
def volumes(tmp_path: Path) -> tuple[Path, Path]:
    """A datasets and a checkpoints 'mount' under tmp_path, with a corpus on the datasets one."""
    datasets, checkpoints = tmp_path / "mnt" / "datasets", tmp_path / "mnt" / "checkpoints"
    (datasets / "corpus").mkdir(parents=True)
    (datasets / "corpus" / "a.jsonl").write_text(ROW, encoding="utf-8")
    (checkpoints / "runs").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.jsonl").write_text('{"text": "not yours"}\n', encoding="utf-8")
    return datasets, checkpoints


def cluster_spec(datasets: Path, checkpoints: Path, uri: str):
    overrides = [
        f"cluster.datasets.mount_path={datasets}",
        f"cluster.checkpoints.mount_path={checkpoints}",
        f"stages.cpt.data.uri={uri}",
    ]
    return load_pipeline("korean-llm", "local", overrides).spec


@pytest.mark.parametrize(
    "uri",
    ["{outside}/secret.jsonl", "{datasets}/../../outside/secret.jsonl", "/etc/passwd", "file:///etc/hostname"],
)
def test_in_the_cluster_data_must_be_on_a_volume(volumes: tuple[Path, Path], tmp_path: Path, uri: str) -> None:
    datasets, checkpoints = volumes
    uri = uri.format(outside=tmp_path / "outside", datasets=datasets)
    spec = cluster_spec(datasets, checkpoints, uri)
    run_root = checkpoints / "runs" / "korean-llm-abcde"  # where every compiled workflow's run directory is
    with pytest.raises(DataError, match=r"outside the mounted volumes; in the cluster data is read only from"):
        read_dataset(spec.stages.cpt.data, spec, "cpt", run_root)
    ok = cluster_spec(datasets, checkpoints, f"{datasets}/corpus")
    assert read_dataset(ok.stages.cpt.data, ok, "cpt", run_root).rows == [json.loads(ROW)]


def test_in_the_cluster_lm_eval_tasks_must_be_on_a_volume(volumes: tuple[Path, Path], tmp_path: Path) -> None:
    from stages.measures import include_dir

    datasets, checkpoints = volumes
    (datasets / "tasks").mkdir()
    (tmp_path / "outside" / "tasks").mkdir()
    run_root = checkpoints / "runs" / "korean-llm-abcde"

    def spec_with(path: Path):
        overrides = [
            f"cluster.datasets.mount_path={datasets}",
            f"cluster.checkpoints.mount_path={checkpoints}",
            f"stages.evaluate.lm_eval_include_path={path}",
        ]
        return load_pipeline("korean-llm", "local", overrides).spec

    assert include_dir(spec_with(datasets / "tasks"), run_root) == str(datasets / "tasks")
    outside = tmp_path / "outside" / "tasks"
    with pytest.raises(DataError, match=r"^stages\.evaluate\.lm_eval_include_path: .*outside the mounted volumes"):
        include_dir(spec_with(outside), run_root)
    assert include_dir(spec_with(outside), tmp_path / "runs" / "local") == str(outside)  # locally: any folder
    (datasets / "tasks" / "evil.py").symlink_to(tmp_path / "outside" / "secret.jsonl")
    with pytest.raises(DataError, match="is a symlink to"):
        include_dir(spec_with(datasets / "tasks"), run_root)


def test_locally_any_path_of_the_machine_may_be_read(volumes: tuple[Path, Path], tmp_path: Path) -> None:
    datasets, checkpoints = volumes
    spec = cluster_spec(datasets, checkpoints, str(tmp_path / "outside" / "secret.jsonl"))
    assert read_dataset(spec.stages.cpt.data, spec, "cpt", tmp_path / "runs" / "local").total == 1


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "local"])
def test_pvc_paths_stay_inside_their_claim(volumes: tuple[Path, Path], tmp_path: Path, cluster: bool) -> None:
    datasets, checkpoints = volumes
    spec = cluster_spec(datasets, checkpoints, "pvc://datasets-rwx/../../outside/secret.jsonl")
    run_root = checkpoints / "runs" / "x" if cluster else tmp_path / "runs" / "x"
    with pytest.raises(DataError, match=r"leaves the claim 'datasets-rwx'.*without '\.\.'"):
        read_dataset(spec.stages.cpt.data, spec, "cpt", run_root)
    inside = cluster_spec(datasets, checkpoints, "pvc://datasets-rwx/corpus/a.jsonl")
    assert read_dataset(inside.stages.cpt.data, inside, "cpt", run_root).total == 1


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "local"])
def test_a_symlink_out_of_a_data_directory_is_refused(
    volumes: tuple[Path, Path], tmp_path: Path, cluster: bool
) -> None:
    datasets, checkpoints = volumes
    (datasets / "corpus" / "b.jsonl").symlink_to(tmp_path / "outside" / "secret.jsonl")
    spec = cluster_spec(datasets, checkpoints, f"{datasets}/corpus")
    run_root = checkpoints / "runs" / "x" if cluster else tmp_path / "runs" / "x"
    with pytest.raises(DataError, match=r"b\.jsonl is a symlink to .*secret\.jsonl, outside the data directory"):
        read_dataset(spec.stages.cpt.data, spec, "cpt", run_root)
    (datasets / "corpus" / "b.jsonl").unlink()
    (datasets / "corpus" / "c.jsonl").symlink_to(datasets / "corpus" / "a.jsonl")  # inside: fine
    assert read_dataset(spec.stages.cpt.data, spec, "cpt", run_root).total == 2


def test_the_prepare_step_refuses_an_escaping_form_value(volumes: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    """End to end, as the pod runs it: the cpt-data parameter names a file outside the volumes."""
    datasets, checkpoints = volumes
    spec = cluster_spec(datasets, checkpoints, f"{datasets}/../../outside/secret.jsonl")
    run = RunDir(checkpoints / "runs" / "korean-llm-x")
    run.write_spec(spec.model_copy(update={"tracking": spec.tracking.model_copy(update={"wandb_project": None})}))
    assert stages_main(["prepare", "--run-dir", str(run.root)]) == 1
    err = capsys.readouterr().err
    assert "outside the mounted volumes" in err and "Traceback" not in err
    assert "not yours" not in err  # nothing of the file was read into the log
    assert not (run.root / "prepare" / "data" / "cpt").exists()


def test_a_stage_name_never_makes_a_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a stage"):
        RunDir(tmp_path).stage_dir("../../etc")
    with pytest.raises(SystemExit):
        stages_main(["../cpt", "--run-dir", str(tmp_path)])


# --------------------------------------------------------------------------- publishing on the checkpoints volume

RUN = "korean-llm-x7k2p"


@pytest.fixture
def deployed(volumes: tuple[Path, Path]) -> tuple[Path, Path]:
    """A run directory on the checkpoints 'mount' holding stage outputs and deploy's model; (checkpoints, run)."""
    _, checkpoints = volumes
    run = checkpoints / "runs" / RUN
    for relative in ("spec.json", "cpt/model/model.safetensors", "deploy/model/model.safetensors"):
        (run / relative).parent.mkdir(parents=True, exist_ok=True)
        (run / relative).write_bytes(b"weights" if relative.endswith(".safetensors") else b"{}")
    (checkpoints / "runs" / "other-run" / "sft").mkdir(parents=True)
    return checkpoints, run


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def publish_to(checkpoints: Path, run: Path, prefix: str) -> None:
    """What deploy does with `stages.deploy.storage_uri=<prefix>`: publish under `<prefix>/<run>`."""
    spec = load_pipeline("korean-llm", "local", [f"cluster.checkpoints.mount_path={checkpoints}"]).spec
    deploy.publish(spec, run / "deploy" / "model", f"{prefix.rstrip('/')}/{run.name}", run)


@pytest.mark.parametrize(
    ("prefix", "rule"),
    [
        ("pvc://checkpoints-rwx/runs", "overlaps"),  # the run directory itself
        ("pvc://checkpoints-rwx/runs/other-run", "overlaps"),  # inside another run's outputs
        ("pvc://checkpoints-rwx/models/../runs", "overlaps"),
        ("pvc://checkpoints-rwx/../../outside", "not a folder inside the checkpoints volume"),
        ("pvc://checkpoints-rwx/linked", "not a folder inside the checkpoints volume"),  # a symlink out of it
        ("pvc://checkpoints-rwx/to-runs", "overlaps"),  # a symlink onto the runs
    ],
)
def test_a_pvc_storage_uri_never_replaces_runs_or_leaves_the_volume(
    deployed: tuple[Path, Path], tmp_path: Path, prefix: str, rule: str
) -> None:
    checkpoints, run = deployed
    (checkpoints / "linked").symlink_to(tmp_path / "outside")
    (checkpoints / "to-runs").symlink_to(checkpoints / "runs")
    before, outside = files(checkpoints / "runs"), files(tmp_path / "outside")
    with pytest.raises(deploy.PublishError, match=rf"^stages\.deploy\.storage_uri \(pvc://.*{rule}"):
        publish_to(checkpoints, run, prefix)
    assert files(checkpoints / "runs") == before  # nothing deleted, nothing copied over a run
    assert files(tmp_path / "outside") == outside and not (tmp_path / "outside" / RUN).exists()


def test_a_pvc_storage_uri_inside_the_volume_gets_the_model(deployed: tuple[Path, Path]) -> None:
    checkpoints, run = deployed
    publish_to(checkpoints, run, "pvc://checkpoints-rwx/models/korean-llm")
    assert files(checkpoints / "models" / "korean-llm" / RUN) == {"model.safetensors": b"weights"}
    publish_to(checkpoints, run, "pvc://checkpoints-rwx/models/korean-llm")  # a retry replaces its own copy
    assert files(checkpoints / "models" / "korean-llm" / RUN) == {"model.safetensors": b"weights"}


@pytest.mark.slow
def test_the_deploy_stage_refuses_to_publish_over_its_run(volumes: tuple[Path, Path], capsys) -> None:
    """End to end, as the pod runs it: the storage URI names a folder that is a symlink onto the runs (a spec
    check cannot see that); deploy fails with one error naming the field, and the run directory is untouched."""
    from test_deploy import make_run

    _, checkpoints = volumes
    run_dir = make_run(checkpoints / "runs", RUN, gate="pass")
    (checkpoints / "published").symlink_to(checkpoints / "runs")
    spec = run_dir.load_spec()
    spec.cluster.checkpoints.mount_path = str(checkpoints)
    spec.stages.deploy.storage_uri = "pvc://checkpoints-rwx/published"
    run_dir.write_spec(spec)
    assert model_storage_uri(spec, RUN) == f"pvc://checkpoints-rwx/published/{RUN}"

    def upstream() -> dict[str, bytes]:
        return {name: data for name, data in files(run_dir.root).items() if not name.startswith("deploy/")}

    before = upstream()
    code = deploy.run(StageContext(run_dir, "deploy", run_dir.load_spec()))
    err = capsys.readouterr().err
    assert code == 1
    assert "[deploy] error: stages.deploy.storage_uri (pvc://checkpoints-rwx/published/" in err
    assert "Traceback" not in err
    assert upstream() == before
    assert run_dir.read_result("deploy").status == "failed"
