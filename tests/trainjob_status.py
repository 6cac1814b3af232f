"""TrainJob status documents as Kubeflow Trainer v2.1 writes them.

`TrainerSim` replays the Trainer's status code on a small model of the TrainJob's JobSet, so every document has a
shape the controller can actually produce:

- pkg/controller/trainjob_controller.go `Reconcile`: every reconcile first removes `Failed`
  (`meta.RemoveStatusCondition`), sets it again (reason TrainingRuntimeNotSupported) when the runtime is refused,
  then `setSuspendedCondition`: `Suspended` True while `spec.suspend` is, False (reason Resumed) once a suspended
  job is resumed, untouched otherwise; then the runtime's status.
- pkg/runtime/framework/plugins/jobset `Status`: the JobSet's `Completed` and `Failed` conditions, only when
  True, become the TrainJob's `Complete` and `Failed`; `jobsStatus` lists the JobSet's replicatedJobsStatus (the
  runtime's replicated jobs in order, every counter written, zeros included). Without a JobSet yet (the Get fails)
  the status keeps what the controller set.
- `meta.SetStatusCondition` updates a condition of the same type in place (lastTransitionTime only when its
  status changes) and appends a new type at the end. `status` is omitted while empty.
- JobSet (the runtime's failurePolicy restarts the whole JobSet up to maxRestarts): a node that fails bumps the
  replicated job's `failed` counter, then the Jobs are recreated (counters back to the new Jobs'); when restarts
  run out the JobSet is `Failed`. Kueue creates the TrainJob suspended, resumes it on admission, and suspends it
  again when it is preempted.

`SCENARIOS` names one document per shape, with the verdict Argo must reach for it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

Verdict = Literal["succeeded", "failed", "running"]

SUSPENDED, COMPLETE, FAILED = "Suspended", "Complete", "Failed"
NODE = "node"
EVENTS = (
    "kueue-suspend",
    "admit",
    "jobset-created",
    "pods-running",
    "node-failed",
    "restarted",
    "completed",
    "failed",
    "runtime-refused",
)


def minimal_manifest(nodes: int = 2) -> dict[str, Any]:
    """A TrainJob like the ones the compiler renders (workflows/trainjob.py), cut down."""
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "korean-llm-7x2kq-cpt-m4n8z", "namespace": "llm-training"},
        "spec": {
            "runtimeRef": {"name": "posttrain-torch"},
            "trainer": {"image": "trainer:test", "command": ["torchrun"], "numNodes": nodes, "numProcPerNode": 8},
        },
    }


@dataclass
class TrainerSim:
    """One TrainJob, its JobSet, and the status the Trainer writes after each event."""

    manifest: dict[str, Any] = field(default_factory=minimal_manifest)
    replicated_jobs: tuple[str, ...] = (NODE,)
    suspend: bool = False
    runtime_supported: bool = True
    jobset: dict[str, dict[str, int]] | None = None
    jobset_verdict: str | None = None
    conditions: list[dict[str, str]] = field(default_factory=list)
    jobs_status: list[dict[str, Any]] | None = None
    clock: datetime = field(default_factory=lambda: datetime(2026, 5, 1, 9, 0, tzinfo=timezone.utc))

    # ------------------------------------------------------------------ the controller's code

    def _now(self) -> str:
        self.clock += timedelta(seconds=7)
        return self.clock.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _set(self, type_: str, status: str, reason: str, message: str) -> None:
        """meta.SetStatusCondition."""
        for cond in self.conditions:
            if cond["type"] == type_:
                if cond["status"] != status:
                    cond["lastTransitionTime"] = self._now()
                cond.update(status=status, reason=reason, message=message)
                return
        self.conditions.append(
            {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": self._now()}
        )

    def reconcile(self) -> None:
        """TrainJobReconciler.Reconcile, status part."""
        self.conditions = [c for c in self.conditions if c["type"] != FAILED]
        if not self.runtime_supported:
            self._set(FAILED, "True", "TrainingRuntimeNotSupported", "unsupported runtime")
        if self.suspend:
            self._set(SUSPENDED, "True", "Suspended", "TrainJob is suspended")
        elif any(c["type"] == SUSPENDED and c["status"] == "True" for c in self.conditions):
            self._set(SUSPENDED, "False", "Resumed", "TrainJob is resumed")
        if not self.runtime_supported or self.jobset is None:
            return
        if self.jobset_verdict == "Completed":
            self._set(COMPLETE, "True", "AllJobsCompleted", "jobset completed successfully")
        if self.jobset_verdict == "Failed":
            self._set(FAILED, "True", "FailedJobs", "jobset failed: a job failed")
        self.jobs_status = [{"name": name, **counts} for name, counts in self.jobset.items()]

    # ------------------------------------------------------------------ the world around it

    def _counts(self, **counts: int) -> dict[str, int]:
        return {"ready": 0, "succeeded": 0, "failed": 0, "active": 0, "suspended": 0, **counts}

    def apply(self, event: str) -> None:
        """An event in the TrainJob's life, then a reconcile. Events that cannot happen in the current state
        (a JobSet verdict is final; Kueue does not suspend a finished job) change nothing."""
        finished = self.jobset_verdict is not None
        if event == "kueue-suspend" and not finished:
            self.suspend = True
            if self.jobset is not None:
                self.jobset = {name: self._counts(suspended=1) for name in self.replicated_jobs}
        elif event == "admit" and self.suspend:
            self.suspend = False
            if self.jobset is not None:
                self.jobset = {name: self._counts(active=1) for name in self.replicated_jobs}
        elif event == "jobset-created" and self.jobset is None and self.runtime_supported:
            state = {"suspended": 1} if self.suspend else {"active": 1}
            self.jobset = {name: self._counts(**state) for name in self.replicated_jobs}
        elif event == "pods-running" and self.jobset is not None and not self.suspend and not finished:
            # Initializers run to completion before the node job starts.
            *before, last = self.replicated_jobs
            self.jobset = {**{n: self._counts(succeeded=1) for n in before}, last: self._counts(active=1, ready=1)}
        elif event == "node-failed" and self.jobset is not None and not self.suspend and not finished:
            self.jobset[self.replicated_jobs[-1]] = self._counts(failed=1)
        elif event == "restarted" and self.jobset is not None and not self.suspend and not finished:
            self.jobset = {name: self._counts(active=1) for name in self.replicated_jobs}
        elif event == "completed" and self.jobset is not None and not self.suspend and not finished:
            self.jobset = {name: self._counts(succeeded=1) for name in self.replicated_jobs}
            self.jobset_verdict = "Completed"
        elif event == "failed" and self.jobset is not None and not self.suspend and not finished:
            self.jobset[self.replicated_jobs[-1]] = self._counts(failed=1)
            self.jobset_verdict = "Failed"
        elif event == "runtime-refused" and self.jobset is None:
            self.runtime_supported = False
        self.reconcile()

    def run(self, *events: str) -> TrainerSim:
        for event in events:
            self.apply(event)
        return self

    # ------------------------------------------------------------------ results

    def verdict(self) -> Verdict:
        """The controller's own verdict: Failed True, else Complete True, else still running."""
        if any(c["type"] == FAILED and c["status"] == "True" for c in self.conditions):
            return "failed"
        if any(c["type"] == COMPLETE and c["status"] == "True" for c in self.conditions):
            return "succeeded"
        return "running"

    def document(self) -> dict[str, Any]:
        """The TrainJob as `kubectl get -o json` shows it."""
        doc = copy.deepcopy(self.manifest)
        status: dict[str, Any] = {}
        if self.conditions:
            status["conditions"] = copy.deepcopy(self.conditions)
        if self.jobs_status is not None:
            status["jobsStatus"] = copy.deepcopy(self.jobs_status)
        if status:
            doc["status"] = status
        return doc


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: dict[str, Any]
    expected: Verdict


def _refused_runtime() -> TrainerSim:
    return TrainerSim(runtime_supported=False)


def _with_initializers() -> TrainerSim:
    return TrainerSim(replicated_jobs=("dataset-initializer", "model-initializer", NODE))


_BUILDERS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "created-no-status": (TrainerSim, ()),
    "jobset-created": (TrainerSim, ("jobset-created",)),
    "running": (TrainerSim, ("jobset-created", "pods-running")),
    "node-failed-restarting": (TrainerSim, ("jobset-created", "pods-running", "node-failed")),
    "restarted": (TrainerSim, ("jobset-created", "pods-running", "node-failed", "restarted")),
    "complete": (TrainerSim, ("jobset-created", "pods-running", "completed")),
    "failed": (TrainerSim, ("jobset-created", "pods-running", "failed")),
    "failed-after-restarts": (TrainerSim, ("jobset-created", "pods-running", "node-failed", "restarted", "failed")),
    "kueue-suspended": (TrainerSim, ("kueue-suspend",)),
    "kueue-suspended-jobset": (TrainerSim, ("kueue-suspend", "jobset-created")),
    "kueue-admitted": (TrainerSim, ("kueue-suspend", "jobset-created", "admit")),
    "kueue-running": (TrainerSim, ("kueue-suspend", "jobset-created", "admit", "pods-running")),
    "kueue-complete": (TrainerSim, ("kueue-suspend", "jobset-created", "admit", "pods-running", "completed")),
    "kueue-failed": (TrainerSim, ("kueue-suspend", "jobset-created", "admit", "pods-running", "failed")),
    "kueue-preempted": (TrainerSim, ("kueue-suspend", "jobset-created", "admit", "pods-running", "kueue-suspend")),
    "kueue-readmitted-complete": (
        TrainerSim,
        ("kueue-suspend", "jobset-created", "admit", "pods-running", "kueue-suspend", "admit", "completed"),
    ),
    "runtime-refused": (TrainerSim, ("runtime-refused",)),
    "runtime-refused-suspended": (TrainerSim, ("kueue-suspend", "runtime-refused")),
    "runtime-refused-suspended-again": (TrainerSim, ("kueue-suspend", "runtime-refused", "admit")),
    "runtime-refused-at-creation-suspended": (_refused_runtime, ("kueue-suspend",)),
    "initializers-running": (_with_initializers, ("jobset-created", "pods-running")),
    "initializers-complete": (_with_initializers, ("jobset-created", "pods-running", "completed")),
}


def scenario(name: str) -> Scenario:
    factory, events = _BUILDERS[name]
    sim = factory().run(*events)
    return Scenario(name, sim.document(), sim.verdict())


SCENARIOS = [scenario(name) for name in _BUILDERS]
