"""Deleting a run's unfinished training jobs, against a fake Kubernetes API server on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube, pytorchjob, running

from workflows.cleanup import delete_running_jobs, main

NS = "llm-training"
GROUP, PLURAL = "kubeflow.org", "pytorchjobs"
REPO = Path(__file__).resolve().parent.parent


def _jobs(fake: FakeKube) -> None:
    for name, workflow, stage, finished in [
        ("korean-llm-x7k2p-cpt-ab12c", "korean-llm-x7k2p", "cpt", "Succeeded"),
        ("korean-llm-x7k2p-sft-cd34e", "korean-llm-x7k2p", "sft", "Failed"),
        ("korean-llm-x7k2p-sft-ef56g", "korean-llm-x7k2p", "sft", None),
        ("korean-llm-x7k2p-rlhf-gh78i", "korean-llm-x7k2p", "rlhf", None),
        ("korean-llm-zz999-sft-jk90l", "korean-llm-zz999", "sft", None),  # another run of the same pipeline
    ]:
        fake.put(GROUP, "v1", PLURAL, pytorchjob(NS, name, workflow, "korean-llm", stage, finished))


def test_running_jobs_of_the_workflow_are_deleted_with_their_pods(capsys: pytest.CaptureFixture[str]) -> None:
    with running() as fake:
        _jobs(fake)
        deleted = delete_running_jobs(NS, "korean-llm-x7k2p", api_client=fake.api_client())
        left = set(fake.custom(GROUP, PLURAL))
        requests = list(fake.requests)
    assert deleted == ["korean-llm-x7k2p-rlhf-gh78i", "korean-llm-x7k2p-sft-ef56g"]
    assert left == {
        (NS, "korean-llm-x7k2p-cpt-ab12c"),  # finished: its record stays
        (NS, "korean-llm-x7k2p-sft-cd34e"),
        (NS, "korean-llm-zz999-sft-jk90l"),  # another workflow's
    }
    listing = requests[0]
    assert listing.method == "GET" and listing.path == f"/apis/{GROUP}/v1/namespaces/{NS}/{PLURAL}"
    assert listing.query["labelSelector"] == "workflows.argoproj.io/workflow=korean-llm-x7k2p"
    deletes = [r for r in requests if r.method == "DELETE"]
    assert [r.body["propagationPolicy"] for r in deletes] == ["Background", "Background"]
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"deleted PyTorchJob {NS}/korean-llm-x7k2p-rlhf-gh78i (workflow korean-llm-x7k2p)",
        f"deleted PyTorchJob {NS}/korean-llm-x7k2p-sft-ef56g (workflow korean-llm-x7k2p)",
    ]


def test_one_stage_only() -> None:
    with running() as fake:
        _jobs(fake)
        deleted = delete_running_jobs(NS, "korean-llm-x7k2p", api_client=fake.api_client(), stage="sft")
        left = set(fake.custom(GROUP, PLURAL))
        selector = fake.requests[0].query["labelSelector"]
    assert deleted == ["korean-llm-x7k2p-sft-ef56g"]
    assert (NS, "korean-llm-x7k2p-rlhf-gh78i") in left
    assert selector == "workflows.argoproj.io/workflow=korean-llm-x7k2p,posttrain.dev/stage=sft"


def test_a_job_without_any_condition_yet_is_unfinished() -> None:
    """A job the operator has not looked at yet (no status) holds a Kueue quota or pending pods: it goes too."""
    job = pytorchjob(NS, "korean-llm-x7k2p-sft-new00", "korean-llm-x7k2p", "korean-llm", "sft")
    del job["status"]
    finished_false = pytorchjob(NS, "korean-llm-x7k2p-sft-fls00", "korean-llm-x7k2p", "korean-llm", "sft")
    finished_false["status"]["conditions"].append({"type": "Failed", "status": "False"})
    with running() as fake:
        fake.put(GROUP, "v1", PLURAL, job)
        fake.put(GROUP, "v1", PLURAL, finished_false)
        deleted = delete_running_jobs(NS, "korean-llm-x7k2p", api_client=fake.api_client())
    assert deleted == ["korean-llm-x7k2p-sft-fls00", "korean-llm-x7k2p-sft-new00"]


def test_nothing_to_delete_exits_0(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with running() as fake:
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS, "--workflow", "korean-llm-x7k2p"]) == 0
    assert capsys.readouterr().out == "no unfinished job of workflow korean-llm-x7k2p\n"


def test_a_refused_delete_is_one_error_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with running(forbidden={("delete", PLURAL)}) as fake:
        _jobs(fake)
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS, "--workflow", "korean-llm-x7k2p"]) == 1
        assert len(fake.custom(GROUP, PLURAL)) == 5
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"error: could not delete the jobs of workflow korean-llm-x7k2p in namespace {NS}: the Kubernetes API "
        "answered 403 Forbidden (the identity lacks the RBAC verbs list and delete on pytorchjobs)"
    ]


def test_the_command_line_outside_a_cluster_says_so(tmp_path: Path) -> None:
    """No service account and no kubeconfig: one error line, exit 1, no traceback."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.cleanup", "--namespace", NS, "--workflow", "w"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: could not delete the jobs of workflow w in namespace llm-training: ")
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr


def _trainjob(name: str, workflow: str, stage: str, conditions: list[dict[str, str]] | None) -> dict[str, Any]:
    """A TrainJob as Trainer v2.1 shows it: labels of workflows/trainjob.py; conditions as its controller writes."""
    job: dict[str, Any] = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "app.kubernetes.io/part-of": "posttrain",
                "posttrain.dev/pipeline": "korean-llm",
                "posttrain.dev/stage": stage,
                "workflows.argoproj.io/workflow": workflow,
            },
        },
        "spec": {"runtimeRef": {"name": "posttrain-torch"}},
    }
    if conditions is not None:
        job["status"] = {"conditions": conditions}
    return job


def test_trainjobs_of_the_workflow_are_deleted_when_the_kind_is_trainjob(capsys: pytest.CaptureFixture[str]) -> None:
    """job_kind trainjob: the TrainJobs are listed by the same label; Complete or Failed True means finished."""
    group, version, plural = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
    suspended = {"type": "Suspended", "status": "True", "reason": "Suspended"}
    resumed = {"type": "Suspended", "status": "False", "reason": "Resumed"}
    complete = {"type": "Complete", "status": "True", "reason": "AllJobsCompleted"}
    failed = {"type": "Failed", "status": "True", "reason": "FailedJobs"}
    with running() as fake:
        _jobs(fake)  # PyTorchJobs of the same workflow: another kind, left alone
        for name, conditions in [
            ("korean-llm-x7k2p-cpt-aaaaa", [complete]),
            ("korean-llm-x7k2p-cpt-bbbbb", [resumed, complete]),
            ("korean-llm-x7k2p-sft-ccccc", [resumed, failed]),
            ("korean-llm-x7k2p-sft-ddddd", None),
            ("korean-llm-x7k2p-sft-eeeee", [suspended]),
            ("korean-llm-x7k2p-sft-fffff", [resumed]),
        ]:
            fake.put(group, version, plural, _trainjob(name, "korean-llm-x7k2p", name.split("-")[3], conditions))
        deleted = delete_running_jobs(NS, "korean-llm-x7k2p", api_client=fake.api_client(), kind="trainjob")
        left = set(fake.custom(group, plural))
        pytorchjobs = len(fake.custom(GROUP, PLURAL))
        listing = fake.requests[0]
    assert deleted == ["korean-llm-x7k2p-sft-ddddd", "korean-llm-x7k2p-sft-eeeee", "korean-llm-x7k2p-sft-fffff"]
    assert left == {
        (NS, "korean-llm-x7k2p-cpt-aaaaa"),
        (NS, "korean-llm-x7k2p-cpt-bbbbb"),
        (NS, "korean-llm-x7k2p-sft-ccccc"),
    }
    assert pytorchjobs == 5
    assert listing.path == f"/apis/{group}/{version}/namespaces/{NS}/{plural}"
    assert capsys.readouterr().out.splitlines()[0] == (
        f"deleted TrainJob {NS}/korean-llm-x7k2p-sft-ddddd (workflow korean-llm-x7k2p)"
    )


def test_the_trainjob_kind_on_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with running(forbidden={("list", "trainjobs")}) as fake:
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS, "--workflow", "w", "--kind", "trainjob"]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("answered 403 Forbidden (the identity lacks the RBAC verbs list and delete on trainjobs)")
    )


def test_a_variants_retry_deletes_its_own_stage_jobs_only() -> None:
    """Two variants of one workflow both train sft: the retry of one variant's sft reaps that variant's job only."""
    with running() as fake:
        for name, pipeline in [("wf-qwen-7b-sft-ab12c", "multi-qwen-7b"), ("wf-qwen-72b-sft-cd34e", "multi-qwen-72b")]:
            fake.put(GROUP, "v1", PLURAL, pytorchjob(NS, name, "wf", pipeline, "sft", None))
        deleted = delete_running_jobs(NS, "wf", api_client=fake.api_client(), stage="sft", pipeline="multi-qwen-72b")
        left = set(fake.custom(GROUP, PLURAL))
        selector = fake.requests[0].query["labelSelector"]
    assert deleted == ["wf-qwen-72b-sft-cd34e"]
    assert left == {(NS, "wf-qwen-7b-sft-ab12c")}
    assert selector == "workflows.argoproj.io/workflow=wf,posttrain.dev/stage=sft,posttrain.dev/pipeline=multi-qwen-72b"
