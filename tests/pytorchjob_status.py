"""PyTorchJob status documents as the Kubeflow Training Operator (v1.7–v1.9) writes them.

Rather than hand-writing status blobs, `TrainingOperatorSim` replays the operator's own status code on a small
model of the job's pods, so every document has a shape the operator can actually produce:

- pkg/util/status.go: `setCondition` does nothing once the job has `Failed`, and nothing when a condition of
  the same type already has the same status and reason; otherwise `filterOutCondition` removes that type
  (and `Running`/`Restarting` remove each other; `Succeeded`/`Failed` set `Running` to False) and the new
  condition is appended at the end. `Created` is therefore always first.
- pkg/controller.v1/common/job.go `ReconcileJobs`: a finished job is left alone; `runPolicy.suspend` deletes
  the pods, sets `Running` False and appends `Suspended`; resuming sets `Suspended` False; a job past its
  `activeDeadlineSeconds` or backoff limit gets `Failed` (reason PyTorchJobFailed) WITHOUT any replica's
  `failed` counter changing; otherwise pods are reconciled (a failed pod whose restart policy retries it is
  deleted, counted in `failed`, and the job is `Restarting`).
- pkg/controller.v1/pytorch `UpdateJobStatus`: Master active → `Running`; Master succeeded → `Succeeded`
  (whatever the Workers are doing); a failed replica → `Restarting` unless its restart policy is Never,
  then `Failed`. Replicas are visited in Go map order, i.e. any order (`replica_order`).
- Replica counters are `omitempty`: a zero `active`/`succeeded`/`failed` is absent from the JSON.

`SCENARIOS` names one document per shape, with the verdict Argo must reach for it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

Verdict = Literal["succeeded", "failed", "running"]

KIND = "PyTorchJob"
MASTER, WORKER = "Master", "Worker"
RETRYABLE_EXIT_CODE = 137  # ExitCode policy retries exit codes >= 128 (killed by a signal: OOM, preemption)
PERMANENT_EXIT_CODE = 1

CREATED, RUNNING, RESTARTING = "Created", "Running", "Restarting"
SUCCEEDED, FAILED, SUSPENDED = "Succeeded", "Failed", "Suspended"


def _reason(reason: str) -> str:
    """commonutil.NewReason(kind, reason)."""
    return f"{KIND}{reason}"


@dataclass
class Pod:
    """The part of a pod the operator looks at."""

    phase: Literal["Pending", "Running", "Succeeded", "Failed"] = "Pending"
    exit_code: int | None = None


def minimal_manifest(workers: int = 0, restart_policy: str = "Never") -> dict[str, Any]:
    """A PyTorchJob like the ones the compiler renders: one Master, `workers` Workers."""
    template = {"spec": {"containers": [{"name": "pytorch", "image": "trainer:test", "command": ["torchrun"]}]}}
    replicas: dict[str, Any] = {
        MASTER: {"replicas": 1, "restartPolicy": restart_policy, "template": copy.deepcopy(template)}
    }
    if workers:
        replicas[WORKER] = {"replicas": workers, "restartPolicy": restart_policy, "template": copy.deepcopy(template)}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": KIND,
        "metadata": {"name": "korean-llm-7x2kq-cpt-m4n8z", "namespace": "llm-training"},
        "spec": {
            "nprocPerNode": "8",
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 0},
            "pytorchReplicaSpecs": replicas,
        },
    }


@dataclass
class TrainingOperatorSim:
    """One PyTorchJob, its pods, and the status the operator writes after each event."""

    manifest: dict[str, Any] = field(default_factory=minimal_manifest)
    replica_order: tuple[str, ...] = (MASTER, WORKER)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    replica_statuses: dict[str, dict[str, int]] = field(default_factory=dict)
    pods: dict[str, list[Pod]] = field(default_factory=dict)
    times: dict[str, str] = field(default_factory=dict)
    suspend_requested: bool = False
    created: bool = False
    _clock: datetime = field(default_factory=lambda: datetime(2026, 11, 2, 2, 0, tzinfo=timezone.utc))

    # ----------------------------------------------------------------- helpers

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    @property
    def replica_specs(self) -> dict[str, dict[str, Any]]:
        specs = self.manifest["spec"]["pytorchReplicaSpecs"]
        return {rtype: specs[rtype] for rtype in self.replica_order if rtype in specs}

    def _now(self) -> str:
        self._clock += timedelta(seconds=30)
        return self._clock.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _condition(self, ctype: str) -> dict[str, Any] | None:
        return next((c for c in self.conditions if c["type"] == ctype), None)

    def has_condition(self, ctype: str) -> bool:
        """util.hasCondition: a condition of this type with status True."""
        return any(c["type"] == ctype and c["status"] == "True" for c in self.conditions)

    def verdict(self) -> Verdict:
        """The operator's own verdict on the job."""
        if self.has_condition(FAILED):
            return "failed"
        if self.has_condition(SUCCEEDED):
            return "succeeded"
        return "running"

    # ----------------------------------------------------------------- pkg/util/status.go

    @staticmethod
    def _filter_out(conditions: list[dict[str, Any]], ctype: str) -> list[dict[str, Any]]:
        kept = []
        for cond in conditions:
            if ctype == RESTARTING and cond["type"] == RUNNING:
                continue
            if ctype == RUNNING and cond["type"] == RESTARTING:
                continue
            if cond["type"] == ctype:
                continue
            if ctype in (FAILED, SUCCEEDED) and cond["type"] == RUNNING:
                cond = {**cond, "status": "False"}
            kept.append(cond)
        return kept

    def set_condition(self, ctype: str, status: str, reason: str, message: str) -> None:
        """util.UpdateJobConditions → setCondition."""
        if self.has_condition(FAILED):
            return
        now = self._now()
        new = {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message,
            "lastUpdateTime": now,
            "lastTransitionTime": now,
        }
        current = self._condition(ctype)
        if current is not None and current["status"] == status and current["reason"] == reason:
            return
        if current is not None and current["status"] == status:
            new["lastTransitionTime"] = current["lastTransitionTime"]
        self.conditions = [*self._filter_out(self.conditions, ctype), new]

    # ----------------------------------------------------------------- the controller

    def create(self) -> TrainingOperatorSim:
        """The job is created: onOwnerCreateFunc appends Created."""
        self.created = True
        self.pods = {rtype: [] for rtype in self.replica_specs}
        self.set_condition(CREATED, "True", _reason("Created"), f"PyTorchJob {self.name} is created.")
        return self

    def sync(self, *, past_deadline: bool = False, past_backoff_limit: bool = False) -> TrainingOperatorSim:
        """One ReconcileJobs pass, writing the status."""
        if self.has_condition(SUCCEEDED) or self.has_condition(FAILED):
            return self  # finished: only cleanup and TTL from here on
        if self.suspend_requested:
            self.pods = {rtype: [] for rtype in self.replica_specs}
            for counters in self.replica_statuses.values():
                counters["active"] = 0
            message = f"PyTorchJob {self.name} is suspended."
            if self.has_condition(RUNNING):
                self.set_condition(RUNNING, "False", _reason("Suspended"), message)
            if not self.has_condition(SUSPENDED):
                self.set_condition(SUSPENDED, "True", _reason("Suspended"), message)
            return self
        if self.has_condition(SUSPENDED):
            self.set_condition(SUSPENDED, "False", _reason("Resumed"), f"PyTorchJob {self.name} is resumed.")
            self.times["startTime"] = self._now()
        if past_deadline or past_backoff_limit:
            self.times.setdefault("completionTime", self._now())
            self.pods = {rtype: [] for rtype in self.replica_specs}
            cause = (
                "it has reached the specified backoff limit"
                if past_backoff_limit
                else "it was active longer than specified deadline"
            )
            self.set_condition(FAILED, "True", _reason("Failed"), f"Job {self.name} has failed because {cause}")
            return self
        self._reconcile_pods()
        self._update_job_status()
        return self

    def _reconcile_pods(self) -> None:
        for rtype, spec in self.replica_specs.items():
            pods = self.pods.setdefault(rtype, [])
            while len(pods) < spec["replicas"]:
                pods.append(Pod())  # a missing pod is (re)created
            counters = {"active": 0, "succeeded": 0, "failed": 0}
            for i, pod in enumerate(list(pods)):
                if pod.phase == "Failed" and self._retries(spec["restartPolicy"], pod.exit_code):
                    pods[i] = Pod()  # deleted; recreated on the next pass
                    self.set_condition(
                        RESTARTING,
                        "True",
                        _reason("Restarting"),
                        f"job {self.name} is restarting because {rtype} replica(s) failed.",
                    )
                if pod.phase == "Running":
                    counters["active"] += 1
                elif pod.phase == "Succeeded":
                    counters["succeeded"] += 1
                elif pod.phase == "Failed":
                    counters["failed"] += 1
            self.replica_statuses[rtype] = counters
        self.times.setdefault("startTime", self._now())

    @staticmethod
    def _retries(policy: str, exit_code: int | None) -> bool:
        if policy in ("OnFailure", "Always"):
            return True
        return policy == "ExitCode" and exit_code is not None and exit_code >= 128

    def _update_job_status(self) -> None:
        for rtype, spec in self.replica_specs.items():
            counters = self.replica_statuses[rtype]
            replicas = spec["replicas"]
            succeeded, running, failed = counters["succeeded"], counters["active"], counters["failed"]
            if rtype == MASTER:
                if running > 0:
                    self.set_condition(RUNNING, "True", _reason("Running"), f"PyTorchJob {self.name} is running.")
                if replicas - succeeded == 0:
                    self.times.setdefault("completionTime", self._now())
                    self.set_condition(
                        SUCCEEDED,
                        "True",
                        _reason("Succeeded"),
                        f"PyTorchJob {self.name} is successfully completed.",
                    )
                    return
            if failed > 0 and replicas > succeeded + running:
                if spec["restartPolicy"] != "Never":
                    message = f"PyTorchJob {self.name} is restarting because {failed} {rtype} replica(s) failed."
                    self.set_condition(RESTARTING, "True", _reason("Restarting"), message)
                else:
                    self.times.setdefault("completionTime", self._now())
                    message = f"PyTorchJob {self.name} is failed because {failed} {rtype} replica(s) failed."
                    self.set_condition(FAILED, "True", _reason("Failed"), message)

    # ----------------------------------------------------------------- the world

    def pods_pending(self) -> TrainingOperatorSim:
        """Pods are created and wait for nodes (or for Kueue admission)."""
        for rtype, spec in self.replica_specs.items():
            self.pods[rtype] = [Pod() for _ in range(spec["replicas"])]
        return self.sync()

    def pods_running(self, *rtypes: str) -> TrainingOperatorSim:
        """Pending pods of these replica types (default: all) start."""
        for rtype in rtypes or tuple(self.replica_specs):
            for pod in self.pods.get(rtype, []):
                if pod.phase == "Pending":
                    pod.phase = "Running"
        return self.sync()

    def pod_exits(self, rtype: str, exit_code: int, index: int = 0) -> TrainingOperatorSim:
        """A pod's `pytorch` container exits: 0 succeeds it, anything else fails it."""
        pod = self.pods[rtype][index]
        pod.phase, pod.exit_code = ("Succeeded", 0) if exit_code == 0 else ("Failed", exit_code)
        return self.sync()

    def all_exit(self, rtype: str, exit_code: int = 0) -> TrainingOperatorSim:
        """Every pod of a replica type exits with the same code, seen in one sync."""
        for pod in self.pods[rtype]:
            pod.phase, pod.exit_code = ("Succeeded", 0) if exit_code == 0 else ("Failed", exit_code)
        return self.sync()

    def suspend(self) -> TrainingOperatorSim:
        """runPolicy.suspend is set to true (by a user or Kueue)."""
        self.suspend_requested = True
        return self.sync()

    def resume(self) -> TrainingOperatorSim:
        """runPolicy.suspend is set back to false."""
        self.suspend_requested = False
        return self.sync()

    def deadline_passes(self) -> TrainingOperatorSim:
        """activeDeadlineSeconds runs out."""
        return self.sync(past_deadline=True)

    def backoff_limit_exceeded(self) -> TrainingOperatorSim:
        """The backoff limit is exceeded (pod restarts, or new failures over the limit)."""
        return self.sync(past_backoff_limit=True)

    # ----------------------------------------------------------------- the document

    def status(self) -> dict[str, Any] | None:
        """`status` as the API server returns it (None before the operator has written any)."""
        if not self.created:
            return None
        status: dict[str, Any] = {"conditions": copy.deepcopy(self.conditions)}
        if self.replica_statuses:
            status["replicaStatuses"] = {}
            for rtype, counters in self.replica_statuses.items():
                selector = {
                    "training.kubeflow.org/job-name": self.name,
                    "training.kubeflow.org/operator-name": "pytorchjob-controller",
                    "training.kubeflow.org/replica-type": rtype.lower(),
                }
                entry: dict[str, Any] = {k: v for k, v in counters.items() if v}  # omitempty
                entry["labelSelector"] = {"matchLabels": selector}
                entry["selector"] = ",".join(f"{k}={v}" for k, v in selector.items())
                status["replicaStatuses"][rtype] = entry
        status.update(self.times)
        status["lastReconcileTime"] = self._clock.strftime("%Y-%m-%dT%H:%M:%SZ")
        return status

    def document(self) -> dict[str, Any]:
        """The whole PyTorchJob as Argo's executor reads it."""
        doc = copy.deepcopy(self.manifest)
        doc["metadata"].update(uid="5f0c6f1e-0000-4000-8000-000000000001", resourceVersion="4242", generation=1)
        doc["spec"]["runPolicy"]["suspend"] = self.suspend_requested
        if (status := self.status()) is not None:
            doc["status"] = status
        return doc


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    """A status shape, how the operator reaches it, and the verdict Argo must reach on it."""

    name: str
    build: Callable[[], TrainingOperatorSim]
    expected: Verdict
    why: str


def _sim(workers: int = 0, restart_policy: str = "Never", order: tuple[str, ...] = (MASTER, WORKER)):
    return TrainingOperatorSim(manifest=minimal_manifest(workers, restart_policy), replica_order=order)


def _restarting(workers: int, rtype: str) -> TrainingOperatorSim:
    return _sim(workers, "ExitCode").create().pods_pending().pods_running().pod_exits(rtype, RETRYABLE_EXIT_CODE)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("submitted", lambda: _sim(), "running", "no status yet: the operator has not seen the job"),
    Scenario("created-only", lambda: _sim().create(), "running", "conditions: [Created]"),
    Scenario("pods-pending", lambda: _sim(1).create().pods_pending(), "running", "replica statuses, no counters"),
    Scenario(
        "running-master-only", lambda: _sim().create().pods_pending().pods_running(), "running", "[Created, Running]"
    ),
    Scenario(
        "running-with-workers", lambda: _sim(3).create().pods_pending().pods_running(), "running", "Workers active"
    ),
    Scenario(
        "running-master-workers-pending",
        lambda: _sim(2).create().pods_pending().pods_running(MASTER),
        "running",
        "Master active, Workers still pending",
    ),
    Scenario(
        "restarting-master",
        lambda: _restarting(0, MASTER),
        "running",
        "ExitCode policy: Master.failed=1 while Restarting must not fail the step",
    ),
    Scenario(
        "restarting-worker",
        lambda: _restarting(2, WORKER),
        "running",
        "ExitCode policy: Worker.failed=1, [Created, Restarting]",
    ),
    Scenario(
        "restarting-then-running",
        lambda: _restarting(1, MASTER).pods_running(),
        "running",
        "the recreated pod runs: Running replaces Restarting",
    ),
    Scenario(
        "suspended",
        lambda: _sim(1).create().pods_pending().pods_running().suspend(),
        "running",
        "[Created, Running False, Suspended True]",
    ),
    Scenario("suspended-before-start", lambda: _sim().create().suspend(), "running", "[Created, Suspended]"),
    Scenario(
        "resumed-then-running",
        lambda: _sim(1).create().pods_pending().pods_running().suspend().resume().pods_pending().pods_running(),
        "running",
        "[Created, Suspended False, Running True]",
    ),
    Scenario(
        "succeeded-master-only",
        lambda: _sim().create().pods_pending().pods_running().pod_exits(MASTER, 0),
        "succeeded",
        "[Created, Running False, Succeeded], Master.succeeded=1",
    ),
    Scenario(
        "succeeded-workers-still-active",
        lambda: _sim(2).create().pods_pending().pods_running().pod_exits(MASTER, 0),
        "succeeded",
        "the job succeeds with its Master; Workers still active",
    ),
    Scenario(
        "succeeded-workers-succeeded",
        lambda: _sim(2).create().pods_pending().pods_running().all_exit(WORKER).pod_exits(MASTER, 0),
        "succeeded",
        "Workers counted succeeded first, then the Master",
    ),
    Scenario(
        "succeeded-after-restart",
        lambda: _restarting(1, MASTER).pods_running().pod_exits(MASTER, 0),
        "succeeded",
        "Master.failed counted earlier, Succeeded now",
    ),
    Scenario(
        "succeeded-after-suspend-resume",
        lambda: _sim().create().pods_pending().suspend().resume().pods_pending().pods_running().pod_exits(MASTER, 0),
        "succeeded",
        "[Created, Suspended False, Running False, Succeeded]",
    ),
    Scenario(
        "master-failed",
        lambda: _sim(1).create().pods_pending().pods_running().pod_exits(MASTER, PERMANENT_EXIT_CODE),
        "failed",
        "restartPolicy Never: [Created, Running False, Failed] at index 2",
    ),
    Scenario(
        "worker-failed",
        lambda: _sim(2).create().pods_pending().pods_running().pod_exits(WORKER, PERMANENT_EXIT_CODE, index=1),
        "failed",
        "restartPolicy Never: a Worker's failure fails the job",
    ),
    Scenario(
        "failed-worker-then-master-succeeded-same-sync",
        lambda: _race_worker_failed_master_succeeded(),
        "failed",
        "Worker visited first: Failed, then Succeeded is refused; Master.succeeded=1 but the job failed",
    ),
    Scenario(
        "deadline-exceeded-running",
        lambda: _sim(1).create().pods_pending().pods_running().deadline_passes(),
        "failed",
        "activeDeadlineSeconds: Failed, reason PyTorchJobFailed, no failed counter",
    ),
    Scenario(
        "deadline-exceeded-pending",
        lambda: _sim(1).create().pods_pending().deadline_passes(),
        "failed",
        "never scheduled: [Created, Failed] at index 1",
    ),
    Scenario(
        "backoff-limit-exceeded",
        lambda: _restarting(1, MASTER).pods_running().backoff_limit_exceeded(),
        "failed",
        "backoff limit: Failed with no new failed counter",
    ),
    Scenario(
        "failed-after-suspend-resume",
        lambda: (
            _sim(1)
            .create()
            .pods_pending()
            .pods_running()
            .suspend()
            .resume()
            .pods_pending()
            .pods_running()
            .pod_exits(MASTER, PERMANENT_EXIT_CODE)
        ),
        "failed",
        "[Created, Suspended False, Running False, Failed] at index 3",
    ),
    Scenario(
        "failed-while-restarting",
        lambda: _restarting(1, WORKER).deadline_passes(),
        "failed",
        "[Created, Restarting True, Failed]: Restarting keeps status True",
    ),
    Scenario(
        "failed-exitcode-permanent",
        lambda: (
            _sim(0, "ExitCode").create().pods_pending().pods_running().pod_exits(MASTER, 1).backoff_limit_exceeded()
        ),
        "failed",
        "ExitCode policy, permanent exit code: Restarting, then the backoff limit fails it",
    ),
)


def _race_worker_failed_master_succeeded() -> TrainingOperatorSim:
    sim = _sim(1, order=(WORKER, MASTER)).create().pods_pending().pods_running()
    sim.pods[WORKER][0] = Pod("Failed", PERMANENT_EXIT_CODE)
    sim.pods[MASTER][0] = Pod("Succeeded", 0)
    return sim.sync()


def scenario(name: str) -> Scenario:
    """The scenario called `name`."""
    return next(s for s in SCENARIOS if s.name == name)
