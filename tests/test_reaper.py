"""The reaper against a fake Kubernetes API server on 127.0.0.1: only the unfinished jobs and Experiments of ended
workflows go, whatever ended them (success, failure, Argo's Terminate, deletion)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_argo import node, workflow_status
from fake_kube import FakeKube, pytorchjob, running
from katib_status import KatibSim

from workflows import reaper
from workflows.reaper import main, reap, workflow_end

NS = "llm-training"
REPO = Path(__file__).resolve().parent.parent
ARGO = ("argoproj.io", "v1alpha1", "workflows")
PYTORCHJOBS = ("kubeflow.org", "v1", "pytorchjobs")
TRAINJOBS = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
EXPERIMENTS = ("kubeflow.org", "v1beta1", "experiments")
FINISHED_AT = "2026-11-02T05:41:09Z"
TERMINATED = "Stopped with strategy 'Terminate'"


def _workflow(name: str, status: dict[str, Any] | None) -> dict[str, Any]:
    """A Workflow as the Kubernetes API returns it: submitted from korean-llm's template, with the labels Argo's
    controller sets."""
    labels = {"workflows.argoproj.io/creator": "system-serviceaccount-llm-training-posttrain-submitter"}
    if status and status.get("phase"):
        labels["workflows.argoproj.io/phase"] = status["phase"]
    if status and status.get("finishedAt"):
        labels["workflows.argoproj.io/completed"] = "true"
    wf: dict[str, Any] = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"workflowTemplateRef": {"name": "korean-llm"}, "arguments": {}},
    }
    if status is not None:
        wf["status"] = status
    return wf


def _running(wf: str) -> dict[str, Any]:
    return workflow_status("Running", [node("sft", "Running", workflow=wf)])


def _ended(wf: str, phase: str, message: str | None = None) -> dict[str, Any]:
    nodes = [node("sft", phase, finished=FINISHED_AT, workflow=wf)]
    return workflow_status(phase, nodes, finished=FINISHED_AT, message=message)


def _trainjob(name: str, workflow: str, complete: bool) -> dict[str, Any]:
    """A TrainJob as Trainer v2.1 shows it, with the labels of workflows/pytorchjob.py's job_metadata."""
    conditions = [{"type": "Suspended", "status": "False", "reason": "Resumed"}]
    if complete:
        conditions.append({"type": "Complete", "status": "True", "reason": "AllJobsCompleted"})
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "app.kubernetes.io/part-of": "posttrain",
                "posttrain.dev/pipeline": "korean-llm",
                "posttrain.dev/stage": "sft",
                "workflows.argoproj.io/workflow": workflow,
            },
        },
        "spec": {"runtimeRef": {"name": "posttrain-torch"}},
        "status": {"conditions": conditions},
    }


def _experiment(name: str, workflow: str, succeeded: bool) -> dict[str, Any]:
    """A Katib Experiment as Katib shows it (tests/katib_status.py), labelled as workflows/katib.py labels it."""
    sim = KatibSim(name=name).run("reconcile", "reconcile", "trial-running")
    if succeeded:
        sim.run(*["trial-succeeded", "trial-running"] * 4)
    document = sim.document()
    document["metadata"]["namespace"] = NS
    document["metadata"]["labels"] = {
        "app.kubernetes.io/part-of": "posttrain",
        "posttrain.dev/pipeline": "korean-llm",
        "posttrain.dev/stage": "sft",
        "workflows.argoproj.io/workflow": workflow,
    }
    return document


def _job(name: str, workflow: str, finished: str | None = None) -> dict[str, Any]:
    return pytorchjob(NS, name, workflow, "korean-llm", name.split("-")[3], finished)


def _namespace(fake: FakeKube) -> None:
    """Runs in every state, each with unfinished and finished jobs; jobs nobody's workflow owns; another namespace."""
    workflows = {
        "korean-llm-run01": _running("korean-llm-run01"),
        "korean-llm-pend2": None,  # submitted, not yet picked up by the controller: no status
        "korean-llm-succ3": _ended("korean-llm-succ3", "Succeeded"),
        "korean-llm-fail4": _ended("korean-llm-fail4", "Failed", "child 'korean-llm-fail4-12' failed"),
        "korean-llm-term5": _ended("korean-llm-term5", "Failed", TERMINATED),
        "korean-llm-errr6": _ended("korean-llm-errr6", "Error", "pod deleted"),
    }  # korean-llm-gone7: deleted, so not here
    for name, status in workflows.items():
        fake.put(*ARGO, _workflow(name, status))
    for name, workflow, finished in [
        ("korean-llm-run01-sft-aaaaa", "korean-llm-run01", None),  # running workflow: stays
        ("korean-llm-pend2-cpt-bbbbb", "korean-llm-pend2", None),
        ("korean-llm-succ3-rlhf-ccccc", "korean-llm-succ3", None),
        ("korean-llm-succ3-sft-ddddd", "korean-llm-succ3", "Succeeded"),  # finished: its record stays
        ("korean-llm-fail4-sft-eeeee", "korean-llm-fail4", None),
        ("korean-llm-term5-cpt-fffff", "korean-llm-term5", "Succeeded"),
        ("korean-llm-term5-sft-ggggg", "korean-llm-term5", "Failed"),
        ("korean-llm-term5-sft-hhhhh", "korean-llm-term5", None),
        ("korean-llm-errr6-sft-iiiii", "korean-llm-errr6", None),
        ("korean-llm-gone7-sft-jjjjj", "korean-llm-gone7", None),
    ]:
        fake.put(*PYTORCHJOBS, _job(name, workflow, finished))
    unlabelled = _job("someones-own-job-sft-kkkkk", "x", None)
    del unlabelled["metadata"]["labels"]["workflows.argoproj.io/workflow"]
    other_tool = _job("other-tool-job-sft-lllll", "korean-llm-term5", None)
    del other_tool["metadata"]["labels"]["app.kubernetes.io/part-of"]
    elsewhere = _job("korean-llm-term5-sft-mmmmm", "korean-llm-term5", None)
    elsewhere["metadata"]["namespace"] = "team-b"
    for job in (unlabelled, other_tool, elsewhere):
        fake.put(*PYTORCHJOBS, job)
    fake.put(*TRAINJOBS, _trainjob("korean-llm-term5-rlhf-nnnnn", "korean-llm-term5", complete=False))
    fake.put(*TRAINJOBS, _trainjob("korean-llm-term5-cpt-ooooo", "korean-llm-term5", complete=True))
    fake.put(*TRAINJOBS, _trainjob("korean-llm-run01-rlhf-ppppp", "korean-llm-run01", complete=False))
    fake.put(*EXPERIMENTS, _experiment("korean-llm-sft-qqqqq", "korean-llm-term5", succeeded=False))
    fake.put(*EXPERIMENTS, _experiment("korean-llm-sft-rrrrr", "korean-llm-term5", succeeded=True))
    fake.put(*EXPERIMENTS, _experiment("korean-llm-sft-sssss", "korean-llm-run01", succeeded=False))


REAPED = [
    f"experiment {NS}/korean-llm-sft-qqqqq (workflow korean-llm-term5 ended: Failed)",
    f"pytorchjob {NS}/korean-llm-errr6-sft-iiiii (workflow korean-llm-errr6 ended: Error)",
    f"pytorchjob {NS}/korean-llm-fail4-sft-eeeee (workflow korean-llm-fail4 ended: Failed)",
    f"pytorchjob {NS}/korean-llm-gone7-sft-jjjjj (workflow korean-llm-gone7 ended: deleted)",
    f"pytorchjob {NS}/korean-llm-succ3-rlhf-ccccc (workflow korean-llm-succ3 ended: Succeeded)",
    f"pytorchjob {NS}/korean-llm-term5-sft-hhhhh (workflow korean-llm-term5 ended: Failed)",
    f"trainjob {NS}/korean-llm-term5-rlhf-nnnnn (workflow korean-llm-term5 ended: Failed)",
]
"""What the reaper deletes in `_namespace`, in its order (Experiments first) and words."""


def _left(fake: FakeKube) -> set[tuple[str, str, str]]:
    """(plural, namespace, name) of every job and Experiment in the fake."""
    return {
        (plural, *key)
        for group, _, plural in (PYTORCHJOBS, TRAINJOBS, EXPERIMENTS)
        for key in fake.custom(group, plural)
    }


def test_only_the_unfinished_jobs_of_ended_workflows_are_deleted(capsys: pytest.CaptureFixture[str]) -> None:
    with running() as fake:
        _namespace(fake)
        before = _left(fake)
        reaped = reap(NS, api_client=fake.api_client())
        left = _left(fake)
        requests = list(fake.requests)
    deleted = {
        (plural, NS, name)
        for plural, name in [
            ("experiments", "korean-llm-sft-qqqqq"),
            ("pytorchjobs", "korean-llm-errr6-sft-iiiii"),
            ("pytorchjobs", "korean-llm-fail4-sft-eeeee"),
            ("pytorchjobs", "korean-llm-gone7-sft-jjjjj"),
            ("pytorchjobs", "korean-llm-succ3-rlhf-ccccc"),
            ("pytorchjobs", "korean-llm-term5-sft-hhhhh"),
            ("trainjobs", "korean-llm-term5-rlhf-nnnnn"),
        ]
    }
    assert left == before - deleted
    assert capsys.readouterr().out.splitlines() == [f"deleted {line}" for line in REAPED]
    assert [r.line() for r in reaped] == [f"deleted {line}" for line in REAPED]
    # Each kind listed once by the project's labels; each workflow read once; deletes take the pods along.
    lists = [r for r in requests if r.method == "GET" and not r.path.startswith("/apis/argoproj.io/")]
    assert [r.path.rsplit("/", 1)[1] for r in lists] == ["experiments", "pytorchjobs", "trainjobs"]
    assert {r.query["labelSelector"] for r in lists} == {
        "app.kubernetes.io/part-of=posttrain,workflows.argoproj.io/workflow"
    }
    gets = sorted(r.path.rsplit("/", 1)[1] for r in requests if r.path.startswith("/apis/argoproj.io/"))
    workflows = ["errr6", "fail4", "gone7", "pend2", "run01", "succ3", "term5"]
    assert gets == [f"korean-llm-{w}" for w in workflows]
    deletes = [r for r in requests if r.method == "DELETE"]
    assert len(deletes) == len(REAPED) and {r.body["propagationPolicy"] for r in deletes} == {"Background"}


def test_a_workflow_terminated_through_argo_is_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Workflow as Argo's Terminate (the UI's, `argo terminate`) leaves it, from the fake Argo server's
    terminate route: Failed, with the Terminate message and finishedAt; no exit handler ran, so its job still runs."""
    from fake_argo import running as argo_running

    from workflows.argo import ArgoClient

    with argo_running() as argo:
        argo.put_object("workflows", _workflow("korean-llm-term5", _running("korean-llm-term5")))
        for name, value in argo.env(ARGO_NAMESPACE=NS).items():
            monkeypatch.setenv(name, value)
        with ArgoClient.from_env(NS) as client:
            client.terminate_workflow("korean-llm-term5")
        terminated = argo.objects("workflows")[(NS, "korean-llm-term5")]
    assert (terminated["spec"]["shutdown"], terminated["status"]["message"]) == ("Terminate", TERMINATED)
    with running() as fake:
        fake.put(*ARGO, terminated)
        fake.put(*PYTORCHJOBS, _job("korean-llm-term5-sft-hhhhh", "korean-llm-term5"))
        assert [r.name for r in reap(NS, api_client=fake.api_client())] == ["korean-llm-term5-sft-hhhhh"]
        assert fake.custom("kubeflow.org", "pytorchjobs") == {}


@pytest.mark.parametrize(
    ("status", "ended"),
    [
        (None, None),
        (workflow_status("Pending", []), None),
        (workflow_status("Running", []), None),
        (workflow_status("Succeeded", [], finished=FINISHED_AT), "Succeeded"),
        (workflow_status("Failed", [], finished=FINISHED_AT, message=TERMINATED), "Failed"),
        (workflow_status("Error", [], finished=FINISHED_AT), "Error"),
        (workflow_status("Running", [], finished=FINISHED_AT), f"finished at {FINISHED_AT}"),
    ],
)
def test_when_a_workflow_counts_as_ended(status: dict[str, Any] | None, ended: str | None) -> None:
    with running() as fake:
        fake.put(*ARGO, _workflow("korean-llm-x7k2p", status))
        assert workflow_end(fake.api_client(), NS, "korean-llm-x7k2p") == ended


def test_dry_run_deletes_nothing_and_says_what_it_would(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with running() as fake:
        _namespace(fake)
        before = _left(fake)
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS, "--dry-run"]) == 0
        assert _left(fake) == before
        assert not [r for r in fake.requests if r.method == "DELETE"]
    assert capsys.readouterr().out.splitlines() == [f"would delete {line}" for line in REAPED]


def test_the_command_line_reaps_and_exits_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with running() as fake:
        _namespace(fake)
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS]) == 0
        assert capsys.readouterr().out.splitlines() == [f"deleted {line}" for line in REAPED]
        assert main(["--namespace", NS]) == 0  # the next schedule: nothing left to do
    assert capsys.readouterr() == ("", "")


def test_kinds_whose_crd_is_not_installed_have_nothing_to_reap(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without Katib and the Trainer, their lists answer 404: the PyTorchJobs are still reaped."""
    with running(unserved={"experiments", "trainjobs"}) as fake:
        _namespace(fake)
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS]) == 0
    assert capsys.readouterr().out.splitlines() == [f"deleted {line}" for line in REAPED if "pytorchjob" in line]


def _refused_run(monkeypatch: pytest.MonkeyPatch, **api: Any) -> None:
    """The reaper over the namespace's objects against an API that refuses (`running`'s arguments): exit 1, nothing
    deleted."""
    with running(**api) as fake:
        _namespace(fake)
        before = _left(fake)
        monkeypatch.setattr("workflows.cleanup.default_api_client", fake.api_client)
        assert main(["--namespace", NS]) == 1
        assert _left(fake) == before


def test_without_argo_workflows_served_nothing_counts_as_deleted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 404 that names no Workflow (the API does not serve Workflows: Argo's CRD is missing, or another version)
    is an error, never a reason to delete a job."""
    _refused_run(monkeypatch, unserved={"workflows"})
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"error: could not get workflow {NS}/korean-llm-term5: the Kubernetes API does not serve "
        "workflows.argoproj.io/v1alpha1 (is Argo Workflows installed?)"
    ]


@pytest.mark.parametrize(
    ("forbidden", "error"),
    [
        (
            ("list", "pytorchjobs"),
            f"could not list pytorchjobs in namespace {NS}: the Kubernetes API answered 403 Forbidden (the identity "
            "lacks the RBAC verb list on pytorchjobs)",
        ),
        (
            ("get", "workflows"),
            f"could not get workflow {NS}/korean-llm-term5: the Kubernetes API answered 403 Forbidden (the identity "
            "lacks the RBAC verb get on workflows)",
        ),
        (
            ("delete", "experiments"),
            f"could not delete experiment {NS}/korean-llm-sft-qqqqq: the Kubernetes API answered 403 Forbidden (the "
            "identity lacks the RBAC verb delete on experiments)",
        ),
    ],
)
def test_an_api_refusal_is_one_error_line_and_exit_1(
    forbidden: tuple[str, str], error: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _refused_run(monkeypatch, forbidden={forbidden})
    out, err = capsys.readouterr()
    assert (out, err.splitlines()) == ("", [f"error: {error}"])


def test_an_unreachable_api_is_one_error_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeKube().start()
    api_client = fake.api_client()
    fake.stop()  # nothing listens on its port any more
    api_client.configuration.retries = 0
    monkeypatch.setattr("workflows.cleanup.default_api_client", lambda: api_client)
    assert main(["--namespace", NS]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: could not reap in namespace {NS}: the Kubernetes API could not be reached (")


@pytest.mark.parametrize("argv", [[], ["--namespace", "$(POD_NAMESPACE)"], ["--namespace", NS, "--force"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """No namespace, the downward API's variable left unexpanded, an unknown flag."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_command_line_outside_a_cluster_says_so(tmp_path: Path) -> None:
    """No service account and no kubeconfig: one error line, exit 1, no traceback."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.reaper", "--namespace", NS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"error: could not reap in namespace {NS}: not running in a pod")
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr


def test_the_reaper_covers_every_job_kind_and_the_search() -> None:
    """A new `cluster.job_kind` is reaped without touching the reaper (its RBAC: tests/test_rbac.py)."""
    from workflows import cleanup

    assert set(reaper.RESOURCES) == {cleanup.EXPERIMENT_RESOURCE, *cleanup.JOB_RESOURCES.values()}
    assert reaper.RESOURCES[0] == cleanup.EXPERIMENT_RESOURCE
