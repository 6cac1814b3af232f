"""`python -m workflows.runs`: list, get, logs, stop, retry, delete against the fake Argo and Kubernetes servers, and
prune over real run directories with a real MLflow registry."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_argo import FakeArgo, PodLog
from fake_kube import FakeKube, pytorchjob
from fake_kube import running as kube_running

from spec.loading import load_pipeline
from workflows import runs
from workflows.compile import compile_pipeline

NS = "posttrain"
PIPELINE = "korean-llm"
RUN = "korean-llm-abcde"
OTHER = "korean-llm-zzzzz"


def _node(wf: str, name: str, phase: str, *, type_: str = "Pod", **extra: Any) -> tuple[str, dict[str, Any]]:
    node_id = f"{wf}-{name}"
    node = {"id": node_id, "name": f"{wf}.{name}", "displayName": name, "type": type_, "phase": phase}
    node.update(boundaryID=wf, startedAt=extra.pop("started", "2026-11-02T02:00:00Z"), **extra)
    return node_id, node


def _workflow(name: str, phase: str, nodes: list[tuple[str, dict[str, Any]]], created: str, **status: Any) -> dict:
    root = (name, {"id": name, "name": name, "displayName": name, "type": "DAG", "phase": phase})
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"posttrain.dev/pipeline": PIPELINE, "app.kubernetes.io/part-of": "posttrain"},
            "creationTimestamp": created,
        },
        "spec": {"workflowTemplateRef": {"name": PIPELINE}},
        "status": {"phase": phase, "startedAt": created, "nodes": dict([root, *nodes]), **status},
    }


def _job(run: str, stage: str) -> dict[str, Any]:
    """Node outputs naming the stage's job."""
    suffix = {"cpt": "q1w2e", "sft": "r4t5y"}[stage]
    return {"parameters": [{"name": "job-name", "value": f"{run}-{stage}-{suffix}"}]}


@pytest.fixture
def argo(fake: FakeArgo, monkeypatch: pytest.MonkeyPatch) -> FakeArgo:
    """The fake Argo server with a running run (in sft), a failed one and one of another pipeline."""
    monkeypatch.setenv("ARGO_NAMESPACE", NS)
    monkeypatch.setenv("COLUMNS", "200")  # the table as a wide terminal shows it
    running = [
        _node(RUN, "prepare", "Succeeded", finishedAt="2026-11-02T02:01:00Z"),
        _node(
            RUN,
            "cpt",
            "Succeeded",
            type_="Retry",
            finishedAt="2026-11-02T02:30:00Z",
            outputs=_job(RUN, "cpt"),
        ),
        _node(
            RUN,
            "sft",
            "Running",
            type_="Retry",
            started="2026-11-02T02:31:00Z",
            outputs=_job(RUN, "sft"),
        ),
    ]
    fake.put_object("workflows", _workflow(RUN, "Running", running, "2026-11-02T02:00:00Z", progress="2/5"))
    failed = [
        _node(OTHER, "prepare", "Succeeded", finishedAt="2026-11-01T02:01:00Z"),
        _node(OTHER, "cpt", "Failed", message="PyTorchJob failed: OOMKilled", finishedAt="2026-11-01T03:00:00Z"),
    ]
    fake.put_object(
        "workflows",
        _workflow(OTHER, "Failed", failed, "2026-11-01T02:00:00Z", message="child failed", progress="1/5"),
    )
    other = _workflow("llama3-dolly-aaaaa", "Succeeded", [], "2026-10-30T02:00:00Z")
    other["metadata"]["labels"]["posttrain.dev/pipeline"] = "llama3-dolly"
    fake.put_object("workflows", other)
    return fake


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    """The fake Kubernetes API with a kubeconfig pointing at it: the running run's sft job (running) and cpt job
    (succeeded), the other run's running job, and the sft job's pods with their logs."""
    with kube_running() as server:
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
            "users": [{"name": "fake", "user": {"token": server.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NS}}],
            "current-context": "fake",
        }
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig), encoding="utf-8")
        monkeypatch.setenv("KUBECONFIG", str(path))
        for job in (
            pytorchjob(NS, f"{RUN}-cpt-q1w2e", RUN, PIPELINE, "cpt", finished="Succeeded"),
            pytorchjob(NS, f"{RUN}-sft-r4t5y", RUN, PIPELINE, "sft"),
            pytorchjob(NS, f"{OTHER}-sft-u7i8o", OTHER, PIPELINE, "sft"),
        ):
            server.put("kubeflow.org", "v1", "pytorchjobs", job)
        job = f"{RUN}-sft-r4t5y"
        base = {"training.kubeflow.org/job-name": job}
        master = {**base, "training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": "0"}
        worker = {**base, "training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "0"}
        server.add_pod(NS, f"{job}-master-0", master, {"pytorch": [f"rank0 step {i}" for i in range(1, 6)]})
        server.add_pod(NS, f"{job}-worker-0", worker, {"pytorch": ["rank1 step 1"]})
        yield server


def _jobs(kube: FakeKube) -> set[str]:
    return {name for _, name in kube.custom("kubeflow.org", "pytorchjobs")}


# --------------------------------------------------------------------------- list and get


def test_list_selects_by_pipeline_and_phase(argo: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    assert runs.main(["list", "--pipeline", PIPELINE]) == 0
    out = capsys.readouterr().out
    assert out.index(RUN) < out.index(OTHER)  # newest first
    assert "llama3-dolly" not in out
    assert "2/5" in out and "sft" in out and "failed at cpt" in out
    assert "labelSelector=posttrain.dev%2Fpipeline%3Dkorean-llm" in argo.requests[-1].path

    assert runs.main(["list", "--pipeline", PIPELINE, "--phase", "Failed"]) == 0
    out = capsys.readouterr().out
    assert OTHER in out and RUN not in out

    assert runs.main(["list", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert RUN in out and OTHER not in out and "2 older runs not shown" in out


def test_get_shows_stages_jobs_and_link(argo: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    assert runs.main(["get", OTHER]) == 0
    out = capsys.readouterr().out
    assert "Failed" in out and "child failed" in out and "OOMKilled" in out
    assert f"/workflows/{NS}/{OTHER}" in out

    assert runs.main(["get", RUN]) == 0
    out = capsys.readouterr().out
    assert f"training jobs: {RUN}-cpt-q1w2e, {RUN}-sft-r4t5y" in out
    for stage in ("prepare", "cpt", "sft"):
        assert stage in out


def test_unknown_run_is_one_error_line(argo: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    assert runs.main(["get", "korean-llm-nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "korean-llm-nope" in err


def test_unreachable_server_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ARGO_SERVER", "http://127.0.0.1:9")
    assert runs.main(["list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the Argo server") and err.count("\n") == 1


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_list_and_get_print_json_or_yaml_for_scripts(
    argo: FakeArgo, capsys: pytest.CaptureFixture[str], output: str
) -> None:
    load = json.loads if output == "json" else yaml.safe_load
    assert runs.main(["list", "--pipeline", PIPELINE, "-o", output]) == 0
    listed = load(capsys.readouterr().out)
    assert [r["name"] for r in listed] == [RUN, OTHER]  # newest first, as the table
    running, failed = listed
    assert running == {
        "name": RUN,
        "namespace": NS,
        "pipeline": PIPELINE,
        "phase": "Running",
        "started": "2026-11-02T02:00:00Z",
        "finished": None,
        "duration_s": running["duration_s"],  # up to now
        "progress": "2/5",
        "stage": ["sft"],
        "failed_at": None,
    }
    assert running["duration_s"] > 0
    assert (failed["phase"], failed["failed_at"], failed["stage"]) == ("Failed", "cpt", [])

    assert runs.main(["list", "--limit", "1", "--output", output]) == 0
    captured = capsys.readouterr()
    assert [r["name"] for r in load(captured.out)] == [RUN]
    assert "2 older runs not shown" in captured.err  # stdout stays parseable

    assert runs.main(["get", OTHER, "-o", output]) == 0
    run = load(capsys.readouterr().out)
    assert (run["name"], run["phase"], run["message"]) == (OTHER, "Failed", "child failed")
    assert run["url"].endswith(f"/workflows/{NS}/{OTHER}")
    assert {s["name"]: s["message"] for s in run["stages"]} == {"prepare": None, "cpt": "PyTorchJob failed: OOMKilled"}

    assert runs.main(["get", RUN, "-o", output]) == 0
    run = load(capsys.readouterr().out)
    assert run["training_jobs"] == [f"{RUN}-cpt-q1w2e", f"{RUN}-sft-r4t5y"]
    stages = {s["name"]: s for s in run["stages"]}
    assert list(stages)[-1] == "sft"  # by start time
    assert (stages["prepare"]["phase"], stages["prepare"]["duration_s"]) == ("Succeeded", 60)
    assert (stages["cpt"]["finished"], stages["cpt"]["duration_s"]) == ("2026-11-02T02:30:00Z", 1800)
    assert (stages["sft"]["started"], stages["sft"]["finished"]) == ("2026-11-02T02:31:00Z", None)
    assert stages["sft"]["message"] is None


def test_list_output_refuses_an_unknown_format(argo: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        runs.main(["list", "-o", "wide"])
    assert exc.value.code == 2
    assert "invalid choice: 'wide'" in capsys.readouterr().err


@pytest.mark.parametrize(("final", "code"), [("Succeeded", 0), ("Failed", 1), ("Error", 1)])
def test_watch_follows_a_run_until_it_ends(
    argo: FakeArgo, capsys: pytest.CaptureFixture[str], final: str, code: int
) -> None:
    def status(phase: str, sft: str) -> dict[str, Any]:
        nodes = [_node(RUN, "prepare", "Succeeded", finishedAt="2026-11-02T02:01:00Z"), _node(RUN, "sft", sft)]
        return _workflow(RUN, phase, nodes, "2026-11-02T02:00:00Z")["status"]

    argo.statuses = [status("Running", "Running"), status("Running", "Running"), status(final, final)]
    assert runs.main(["watch", RUN, "--interval", "0"]) == code
    out = capsys.readouterr().out
    assert all(column in out for column in ("step", "phase", "started (UTC)", "duration"))  # submit --watch's table
    assert "prepare" in out and "sft" in out
    assert f"{RUN} {final}: {argo.url}/workflows/{NS}/{RUN}" in out
    gets = [r for r in argo.requests if r.method == "GET" and r.path.endswith(f"/workflows/{NS}/{RUN}")]
    assert len(gets) == 3  # until the final phase, no further


def test_watch_of_an_unknown_run_is_one_error_line(argo: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    assert runs.main(["watch", "korean-llm-nope", "--interval", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1 and "korean-llm-nope" in captured.err
    assert captured.out == ""


def test_unknown_command_says_which_was_meant(capsys: pytest.CaptureFixture[str]) -> None:
    assert runs.main(["lst"]) == 2
    assert capsys.readouterr().err == "error: unknown command 'lst'; did you mean 'list'?\n"
    assert runs.main(["wach", RUN]) == 2
    assert "did you mean 'watch'?" in capsys.readouterr().err
    assert runs.main(["frobnicate"]) == 2
    assert "commands: list, get, watch" in capsys.readouterr().err


# --------------------------------------------------------------------------- the namespace


def _kubeconfig(tmp_path: Path, namespace: str | None, name: str = "kubeconfig") -> Path:
    context: dict[str, str] = {"cluster": "c", "user": "u"}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [
            {"name": "other", "context": {"cluster": "c", "namespace": "wrong"}},
            {"name": "ctx", "context": context},
        ],
        "current-context": "ctx",
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_namespace_is_flag_then_argo_namespace_then_kubeconfig_then_posttrain(tmp_path: Path) -> None:
    from spec.cluster import ClusterSpec
    from workflows.namespace import DEFAULT_NAMESPACE, resolve_namespace

    assert DEFAULT_NAMESPACE == ClusterSpec().namespace == "posttrain"
    kubeconfig = str(_kubeconfig(tmp_path, "llm-training"))
    env = {"KUBECONFIG": kubeconfig, "ARGO_NAMESPACE": "from-env"}
    assert resolve_namespace("from-flag", env) == "from-flag"
    assert resolve_namespace(None, env) == "from-env"
    assert resolve_namespace(None, {"KUBECONFIG": kubeconfig}) == "llm-training"
    assert resolve_namespace(None, {"KUBECONFIG": str(_kubeconfig(tmp_path, None, "plain"))}) == "posttrain"
    assert resolve_namespace(None, {"KUBECONFIG": str(tmp_path / "missing")}) == "posttrain"
    (tmp_path / "broken").write_text("{not yaml", encoding="utf-8")
    assert resolve_namespace(None, {"KUBECONFIG": str(tmp_path / "broken")}) == "posttrain"
    # Several files, merged as kubectl merges them: the first current-context, the first definition of it.
    first = tmp_path / "first"
    first.write_text(yaml.safe_dump({"current-context": "ctx"}), encoding="utf-8")
    merged = os.pathsep.join([str(tmp_path / "missing"), str(first), kubeconfig])
    assert resolve_namespace(None, {"KUBECONFIG": merged}) == "llm-training"
    # No KUBECONFIG: ~/.kube/config.
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(_kubeconfig(tmp_path, "ml-training").read_text(), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        assert resolve_namespace(None, {}) == "ml-training"


def test_runs_acts_in_the_kubeconfig_contexts_namespace(
    argo: FakeArgo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = _workflow("korean-llm-elsew", "Succeeded", [], "2026-11-03T02:00:00Z")
    elsewhere["metadata"]["namespace"] = "llm-training"
    argo.put_object("workflows", elsewhere)
    monkeypatch.delenv("ARGO_NAMESPACE")
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, "llm-training")))
    assert runs.main(["list", "-o", "json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["korean-llm-elsew"]
    assert "/workflows/llm-training?" in argo.requests[-1].path

    monkeypatch.setenv("ARGO_NAMESPACE", NS)  # the variable beats the kubeconfig
    assert runs.main(["get", RUN, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["namespace"] == NS
    assert runs.main(["get", "korean-llm-elsew", "-n", "llm-training", "-o", "json"]) == 0  # the flag beats both
    assert json.loads(capsys.readouterr().out)["namespace"] == "llm-training"

    monkeypatch.delenv("ARGO_NAMESPACE")
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, None, "plain")))
    assert runs.main(["list", "-o", "json"]) == 0
    assert {r["namespace"] for r in json.loads(capsys.readouterr().out)} == {"posttrain"}


def test_runs_help_states_the_namespace_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        runs.main(["list", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "$ARGO_NAMESPACE, else the kubeconfig context's namespace, else posttrain" in help_text


# --------------------------------------------------------------------------- logs


def test_logs_of_a_step_come_through_the_argo_log_route(argo: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    stage = {"posttrain.dev/stage": "prepare"}
    argo.pod_logs += [
        PodLog(NS, RUN, f"{RUN}-prepare-111", ["resolving spec", "prepare done"], stage),
        PodLog(NS, RUN, f"{RUN}-prepare-111", ["executor noise"], stage, container="wait"),
        PodLog(NS, RUN, f"{RUN}-evaluate-222", ["not this one"], {"posttrain.dev/stage": "evaluate"}),
    ]
    assert runs.main(["logs", RUN, "--stage", "prepare", "--tail", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "prepare done\n"
    assert f"{RUN}-prepare-111" in captured.err
    assert "selector=posttrain.dev%2Fstage%3Dprepare" in argo.requests[-1].path

    assert runs.main(["logs", RUN, "--stage", "nope"]) == 2
    assert "has no stage 'nope'" in capsys.readouterr().err


def test_logs_of_a_training_stage_come_from_the_jobs_pod(
    argo: FakeArgo, kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    assert runs.main(["logs", RUN, "--stage", "sft", "--tail", "2"]) == 0
    assert capsys.readouterr().out == "rank0 step 4\nrank0 step 5\n"
    log_request = kube.requests[-1]
    assert log_request.path.endswith(f"/pods/{RUN}-sft-r4t5y-master-0/log")
    assert log_request.query["container"] == "pytorch"

    assert runs.main(["logs", RUN, "--stage", "sft", "--rank", "1"]) == 0
    assert capsys.readouterr().out == "rank1 step 1\n"
    assert runs.main(["logs", RUN, "--stage", "sft", "--rank", "2"]) == 2
    assert "no pod of rank 2" in capsys.readouterr().err


def test_logs_follow_streams_until_the_pod_ends(
    argo: FakeArgo, kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading

    pod = f"{RUN}-sft-r4t5y-master-0"
    kube.add_pod(
        NS,
        pod,
        {"training.kubeflow.org/job-name": f"{RUN}-sft-r4t5y", "training.kubeflow.org/replica-type": "master"},
        {"pytorch": ["step 1"]},
        finished=False,
    )

    def write_more() -> None:
        # Each line is appended once the client has asked for the followed log: the stream must deliver it.
        while not any(r.path.endswith(f"{pod}/log") for r in kube.requests):
            threading.Event().wait(0.01)
        kube.append_log(NS, pod, "pytorch", "step 2", "step 3")
        kube.finish_pod(NS, pod)

    writer = threading.Thread(target=write_more)
    writer.start()
    assert runs.main(["logs", RUN, "--stage", "sft", "--follow"]) == 0
    writer.join()
    assert capsys.readouterr().out == "step 1\nstep 2\nstep 3\n"
    assert kube.requests[-1].query["follow"] == "True"


# --------------------------------------------------------------------------- stop, retry, delete


def test_stop_leaves_the_jobs_to_the_exit_handler(
    argo: FakeArgo, kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    assert runs.main(["stop", RUN, "--message", "wrong data"]) == 0
    put = argo.requests[-1]
    assert put.method == "PUT" and put.path.endswith(f"/workflows/{NS}/{RUN}/stop")
    assert put.body == {"name": RUN, "namespace": NS, "message": "wrong data"}
    assert argo.objects("workflows")[(NS, RUN)]["spec"]["shutdown"] == "Stop"
    assert _jobs(kube) == {f"{RUN}-cpt-q1w2e", f"{RUN}-sft-r4t5y", f"{OTHER}-sft-u7i8o"}
    assert "exit handler" in capsys.readouterr().out


def test_stopping_a_run_frees_its_gpus_through_the_rendered_exit_handler(
    argo: FakeArgo, kube: FakeKube, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`runs stop`, then what Argo does with the stopped workflow: it ends Failed and runs the template's exit
    handler, whose cleanup step (its `when` holding for that status) runs its rendered command in a pod with the
    workflow's token. The command, as rendered, deletes the run's running job and nothing else."""
    from workflows import cleanup

    assert runs.main(["stop", RUN]) == 0
    assert argo.objects("workflows")[(NS, RUN)]["spec"]["shutdown"] == "Stop"
    template = compile_pipeline(load_pipeline("korean-llm").spec).documents()["workflowtemplate.yaml"]
    templates = {t["name"]: t for t in template["spec"]["templates"]}
    handler = templates[template["spec"]["onExit"]]
    (step,) = [s for group in handler["steps"] for s in group if s["name"] == "cleanup"]
    values = {"{{workflow.status}}": "Failed", "{{workflow.name}}": RUN, "{{workflow.namespace}}": NS}

    def resolve(text: str) -> str:
        for key, value in values.items():
            text = text.replace(key, value)
        return text

    left, op, right = resolve(step["when"]).split()
    assert op == "!=" and left != right  # Argo runs the step for a stopped (Failed) workflow
    assert resolve(step["when"].replace("{{workflow.status}}", "Succeeded")).split()[0] == "Succeeded"
    container = templates[step["template"]]["container"]
    assert templates[step["template"]]["serviceAccountName"] == "posttrain-workflow"
    argv = [resolve(arg) for arg in container["command"]]
    assert argv[:3] == ["python", "-m", "workflows.cleanup"]
    assert cleanup.main(argv[3:]) == 0
    assert _jobs(kube) == {f"{RUN}-cpt-q1w2e", f"{OTHER}-sft-u7i8o"}  # the running sft job is gone
    assert f"deleted PyTorchJob {NS}/{RUN}-sft-r4t5y" in capsys.readouterr().out


def test_stop_terminate_deletes_the_runs_running_jobs_only(
    argo: FakeArgo, kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    assert runs.main(["stop", "--terminate", RUN]) == 0
    assert argo.requests[-1].path.endswith(f"/workflows/{NS}/{RUN}/terminate")
    assert argo.objects("workflows")[(NS, RUN)]["spec"]["shutdown"] == "Terminate"
    # The run's running sft job is gone; its finished cpt job and the other run's running job stay.
    assert _jobs(kube) == {f"{RUN}-cpt-q1w2e", f"{OTHER}-sft-u7i8o"}
    deletes = [r for r in kube.requests if r.method == "DELETE"]
    assert [r.path.rsplit("/", 1)[1] for r in deletes] == [f"{RUN}-sft-r4t5y"]
    assert deletes[0].body == {"propagationPolicy": "Background"}
    out = capsys.readouterr().out
    assert f"terminated {NS}/{RUN}" in out and f"{RUN}-sft-r4t5y" in out


def test_stop_of_an_ended_run_stops_nothing(argo: FakeArgo, kube: FakeKube, capsys: pytest.CaptureFixture[str]) -> None:
    assert runs.main(["stop", OTHER]) == 0
    assert "already ended (Failed)" in capsys.readouterr().out
    assert not [r for r in argo.requests if r.method == "PUT"]


def test_terminate_without_cluster_access_says_so(
    argo: FakeArgo, kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    kube.forbidden.add(("delete", "pytorchjobs"))
    assert runs.main(["stop", "--terminate", RUN]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot delete the unfinished training jobs") and "403" in err


def test_retry(argo: FakeArgo, capsys: pytest.CaptureFixture[str]) -> None:
    assert runs.main(["retry", RUN]) == 2  # Running
    assert "only a Failed or Errored run" in capsys.readouterr().err

    selector = "displayName=prepare"
    assert runs.main(["retry", OTHER, "--restart-successful", "--node-field-selector", selector]) == 0
    put = argo.requests[-1]
    assert put.path.endswith(f"/workflows/{NS}/{OTHER}/retry")
    assert put.body == {"name": OTHER, "namespace": NS, "restartSuccessful": True, "nodeFieldSelector": selector}
    status = argo.objects("workflows")[(NS, OTHER)]["status"]
    assert status["phase"] == "Running"
    assert not {"prepare", "cpt"} & {n["displayName"] for n in status["nodes"].values()}  # both run again
    assert runs.main(["retry", OTHER, "--node-field-selector", selector]) == 2


def test_delete_removes_the_jobs_then_the_workflow(
    argo: FakeArgo, kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    assert runs.main(["delete", RUN]) == 0
    assert (NS, RUN) not in argo.objects("workflows") and (NS, OTHER) in argo.objects("workflows")
    assert _jobs(kube) == {f"{RUN}-cpt-q1w2e", f"{OTHER}-sft-u7i8o"}
    assert argo.requests[-1].method == "DELETE"
    assert f"deleted Workflow {NS}/{RUN}" in capsys.readouterr().out


# --------------------------------------------------------------------------- prune


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real MLflow registry (SQLite) where version 1 (run korean-llm-20260101-000000) is champion and version 2
    (run korean-llm-20260103-000000) is challenger, with deploy's lineage tags."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model(PIPELINE)
    for run in ("korean-llm-20260101-000000", "korean-llm-20260103-000000"):
        tags = {"posttrain.run": run, "posttrain.run_dir": f"/mnt/checkpoints/runs/{run}", "posttrain.gate": "pass"}
        client.create_model_version(PIPELINE, source=f"file:///models/{run}", tags=tags)
    client.set_registered_model_alias(PIPELINE, "champion", "1")
    client.set_registered_model_alias(PIPELINE, "challenger", "2")
    return uri


def _run_dir(root: Path, name: str, spec_json: str, age_days: float, stages: dict[str, dict[str, Any]]) -> Path:
    path = root / "runs" / name
    path.mkdir(parents=True)
    (path / "spec.json").write_text(spec_json, encoding="utf-8")
    for stage, record in stages.items():
        (path / stage).mkdir()
        (path / stage / "stage.json").write_text(json.dumps({"stage": stage, **record}), encoding="utf-8")
        (path / stage / "model").mkdir()
    written = 1_800_000_000 - age_days * 86400
    os.utime(path / "spec.json", (written, written))
    return path


@pytest.fixture
def checkpoints(tmp_path: Path, registry: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Eight runs of korean-llm (its resolved spec, tracking into the registry), oldest first: 01 champion, 02
    plain, 03 challenger, 04 served, 05 plain, 06 gate failed, 07 sft running, 08 newest; and one llama3-dolly run."""
    for name in ("ARGO_SERVER", "ARGO_WORKFLOW_NAME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    spec = load_pipeline(PIPELINE, None, [f"tracking.mlflow_tracking_uri={registry}"]).spec
    spec_json = spec.model_dump_json()
    enabled = spec.stages.enabled()
    done = {s: {"status": "succeeded", "extra": {"gate": "pass"} if s == "evaluate" else {}} for s in enabled}
    gate_failed = {s: r for s, r in done.items() if s != "deploy"}
    gate_failed["evaluate"] = {"status": "succeeded", "extra": {"gate": "fail"}}
    sft_running = {"prepare": done["prepare"], "cpt": done["cpt"], "sft": {"status": "running", "extra": {}}}
    for day, stages in enumerate((done, done, done, done, done, gate_failed, sft_running, done), start=1):
        _run_dir(tmp_path, f"korean-llm-202601{day:02d}-000000", spec_json, age_days=30 - day, stages=stages)
    dolly = load_pipeline("llama3-dolly", None, [f"tracking.mlflow_tracking_uri={registry}"]).spec
    _run_dir(tmp_path, "llama3-dolly-20260101-000000", dolly.model_dump_json(), 40, {})
    return tmp_path


def _left(root: Path) -> set[str]:
    return {p.name for p in (root / "runs").iterdir()}


def test_prune_keeps_newest_aliased_served_and_unfinished(
    checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    served = "pvc://checkpoints-rwx/runs/korean-llm-20260104-000000/deploy/model"
    argv = ["prune", "--keep-last", "1", "--pipeline", PIPELINE, "--checkpoints", str(checkpoints)]
    assert runs.main([*argv, "--served-uri", served, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete korean-llm-20260102-000000" in out
    assert len(_left(checkpoints)) == 9  # a dry run deletes nothing

    assert runs.main([*argv, "--served-uri", served]) == 0
    out = capsys.readouterr().out
    assert _left(checkpoints) == {
        "korean-llm-20260108-000000",  # the newest
        "korean-llm-20260107-000000",  # sft still running
        "korean-llm-20260104-000000",  # served
        "korean-llm-20260103-000000",  # challenger
        "korean-llm-20260101-000000",  # champion
        "llama3-dolly-20260101-000000",  # another pipeline
    }
    assert "keep korean-llm-20260101-000000: its model is korean-llm version 1, alias champion" in out
    assert "keep korean-llm-20260103-000000: its model is korean-llm version 2, alias challenger" in out
    assert f"keep korean-llm-20260104-000000: a serving revision uses its model ({served})" in out
    assert "keep korean-llm-20260107-000000: no final state: sft is running" in out
    for gone in ("02", "05", "06"):
        assert f"deleted korean-llm-202601{gone}-000000: number" in out
    assert "deleted 3 of 8 runs" in out


def test_prune_reads_the_served_model_from_the_inference_service(
    checkpoints: Path, kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = "llm-training"  # korean-llm's cluster.namespace
    previous = "pvc://checkpoints-rwx/runs/korean-llm-20260105-000000/deploy/model"
    kube.put(
        "serving.kserve.io",
        "v1beta1",
        "inferenceservices",
        {
            "apiVersion": "serving.kserve.io/v1beta1",
            "kind": "InferenceService",
            "metadata": {"name": PIPELINE, "namespace": namespace},
            "spec": {
                "predictor": {
                    "canaryTrafficPercent": 10,
                    "model": {
                        "modelFormat": {"name": "vllm"},
                        "storageUri": "pvc://checkpoints-rwx/runs/korean-llm-20260104-000000/deploy/model",
                    },
                }
            },
            "status": {"components": {"predictor": {"previousRolledoutRevision": f"{PIPELINE}-predictor-00004"}}},
        },
    )
    kube.put(
        "serving.knative.dev",
        "v1",
        "revisions",
        {
            "apiVersion": "serving.knative.dev/v1",
            "kind": "Revision",
            "metadata": {
                "name": f"{PIPELINE}-predictor-00004",
                "namespace": namespace,
                "annotations": {"serving.kserve.io/storage-initializer-sourceuri": previous},
            },
        },
    )
    argv = ["prune", "--keep-last", "1", "--pipeline", PIPELINE, "--checkpoints", str(checkpoints)]
    assert runs.main(argv) == 0
    out = capsys.readouterr().out
    assert "keep korean-llm-20260104-000000: a serving revision uses its model" in out  # the canary
    assert "keep korean-llm-20260105-000000: a serving revision uses its model" in out  # the previous revision
    assert {"korean-llm-20260104-000000", "korean-llm-20260105-000000"} <= _left(checkpoints)


def test_prune_deletes_nothing_when_serving_cannot_be_read(
    checkpoints: Path, kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    kube.forbidden.add(("get", "inferenceservices"))
    argv = ["prune", "--keep-last", "1", "--checkpoints", str(checkpoints)]
    assert runs.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read InferenceService llm-training/korean-llm (403")
    assert "nothing was deleted" in err and len(_left(checkpoints)) == 9


def test_prune_never_deletes_the_current_run_and_asks_argo_for_phases(
    checkpoints: Path, fake: FakeArgo, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARGO_NAMESPACE", NS)
    # The Argo server says 02 still runs (a retry between attempts) and 07 ended (its pod died mid-record).
    for name, phase in (("korean-llm-20260102-000000", "Running"), ("korean-llm-20260107-000000", "Failed")):
        fake.put_object("workflows", _workflow(name, phase, [], "2026-01-01T00:00:00Z"))
    monkeypatch.setenv("ARGO_WORKFLOW_NAME", "korean-llm-20260105-000000")
    argv = ["prune", "--keep-last", "1", "--pipeline", PIPELINE, "--checkpoints", str(checkpoints)]
    assert runs.main(argv) == 0
    out = capsys.readouterr().out
    assert "keep korean-llm-20260102-000000: its workflow is Running" in out
    assert "keep korean-llm-20260105-000000: it is the run doing the pruning" in out
    assert "deleted korean-llm-20260107-000000" in out


def test_prune_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert runs.main(["prune", "--checkpoints", str(tmp_path)]) == 2
    assert "needs --keep-last" in capsys.readouterr().err
    assert runs.main(["prune", "--keep-last", "0", "--checkpoints", str(tmp_path)]) == 2
    assert runs.main(["prune", "--keep-last", "2", "--checkpoints", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 2 and "is not a directory of runs" in err


def test_delete_renames_aside_first(checkpoints: Path) -> None:
    from workflows.retention import DELETING_PREFIX, delete_run, find_runs

    run = find_runs(checkpoints / "runs", PIPELINE)[-1]
    seen: list[str] = []
    import shutil

    original = shutil.rmtree

    def watching(path: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(Path(path).name)
        assert not run.path.exists()  # the run is no longer a run before anything is removed
        original(path, *args, **kwargs)

    shutil.rmtree = watching  # type: ignore[assignment]
    try:
        delete_run(run)
    finally:
        shutil.rmtree = original  # type: ignore[assignment]
    assert seen and seen[0].startswith(DELETING_PREFIX)
    assert run.name not in {r.name for r in find_runs(checkpoints / "runs")}


# --------------------------------------------------------------------------- the retention step


def test_retention_renders_a_last_step_that_never_follows_a_failure() -> None:
    spec = load_pipeline(PIPELINE, None, ["retention.keep_last=10", "retention.keep_days=3.5"]).spec
    template = compile_pipeline(spec).documents()["workflowtemplate.yaml"]
    templates = {t["name"]: t for t in template["spec"]["templates"]}
    tasks = templates["pipeline"]["dag"]["tasks"]
    assert tasks[-1] == {
        "name": "retention",
        "template": "retention",
        "depends": "serve.Succeeded || serve.Skipped || deploy.Skipped",
    }
    step = templates["retention"]
    assert step["container"]["command"] == [
        "python", "-m", "workflows.runs", "prune", "--pipeline", PIPELINE,
        "--checkpoints", spec.cluster.checkpoints.mount_path, "--keep-last", "10", "--keep-days", "3.5",
    ]  # fmt: skip
    mounts = {m["name"]: m for m in step["container"]["volumeMounts"]}
    assert not mounts["checkpoints"].get("readOnly")
    assert step["serviceAccountName"] == spec.cluster.service_account and step["automountServiceAccountToken"]
    assert step["container"]["securityContext"]["readOnlyRootFilesystem"] is True

    from schema_validation import require_schemas, validate_argo

    require_schemas()
    validate_argo(template)


def test_no_retention_no_step() -> None:
    spec = load_pipeline(PIPELINE, None, ["retention.keep_last=null"]).spec
    template = compile_pipeline(spec).documents()["workflowtemplate.yaml"]
    assert "retention" not in {t["name"] for t in template["spec"]["templates"]}


def test_retention_counts_in_the_deadline() -> None:
    from workflows.control_steps import RETENTION_POLICY
    from workflows.deadline import workflow_deadline
    from workflows.step_templates import worst_case_seconds

    on = load_pipeline(PIPELINE, None, ["retention.keep_last=3"]).spec
    off = load_pipeline(PIPELINE, None, ["retention.keep_last=null"]).spec
    extra = worst_case_seconds(RETENTION_POLICY, RETENTION_POLICY.active_deadline_seconds)
    assert workflow_deadline(on) - workflow_deadline(off) == pytest.approx(extra, abs=1)


def test_local_runner_prunes_its_runs_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from io import StringIO

    from rich.console import Console

    from workflows.local import run_retention

    for name in ("ARGO_SERVER", "ARGO_WORKFLOW_NAME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    spec = load_pipeline(PIPELINE, "local", ["retention.keep_last=1"]).spec
    gate = {"evaluate": {"gate": "pass"}}
    done = {s: {"status": "succeeded", "extra": gate.get(s, {})} for s in spec.stages.enabled()}
    names = [f"korean-llm-2026010{day}-000000" for day in (1, 2, 3)]
    for age, name in zip((3, 2, 1), names, strict=True):
        _run_dir(tmp_path, name, spec.model_dump_json(), age, done)
    out = StringIO()
    # The runner prunes after the run it made, which is not the newest here: it is kept all the same.
    assert run_retention(spec, tmp_path / "runs" / names[0], Console(file=out, width=200)) == 0
    assert _left(tmp_path) == {names[0], names[2]}
    assert f"retention: keep {names[0]}: it is the run doing the pruning" in out.getvalue()
