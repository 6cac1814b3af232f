"""Katib Experiment status documents as Katib (v0.18–v0.19) writes them.

`KatibSim` replays the experiment controller's status code on a small model of the Experiment's trials, so every
document has a shape Katib can actually produce:

- pkg/controller.v1beta1/experiment/experiment_controller.go `Reconcile`: a completed Experiment (Succeeded or
  Failed True) is left alone unless it is restartable and its maxTrialCount was raised above its trial count, which
  marks it `Restarting`; one not yet `Created` gets `Created`, a startTime and a zero completionTime (JSON null);
  otherwise, once trials exist, `UpdateExperimentStatus`, then (if not completed) new trials up to
  parallelTrialCount and maxTrialCount. The status is written once, at the end of a reconcile.
- util/status_util.go: the trial summary (the best trial by the objective; the objective metric's min or max as the
  metric strategy of its type says) and `UpdateExperimentStatusCondition`: goal reached → Succeeded; failed plus
  metrics-unavailable trials ≥ maxFailedTrialCount (non-zero) → Failed; completed trials ≥ maxTrialCount →
  Succeeded; the suggestion exhausted with no active trial → Succeeded; else Running. Each verdict sets completionTime.
- pkg/apis/controller/experiments/v1beta1/util.go `setCondition`: nothing when a condition of the type has the same
  status and reason; otherwise that type is removed and the new condition appended. Succeeded/Failed first set an
  existing `Running` to False (moved to the end); `MarkExperimentStatusRestarting` removes Succeeded and Failed.
- The validating webhook refuses a spec change to a completed Experiment unless it succeeded by max trials with
  resumePolicy LongRunning or FromVolume, and a maxTrialCount not above the trial count.
- `currentOptimalTrial` is a struct, so it is always written (`{"observation": {}}` before any metric); counters
  and trial lists are `omitempty`.

`SCENARIOS` names one document per shape, with the verdict Argo must reach for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

Verdict = Literal["succeeded", "failed", "running"]
TrialState = Literal["Pending", "Running", "Succeeded", "Failed", "MetricsUnavailable", "Killed", "EarlyStopped"]

CREATED, RUNNING, RESTARTING, SUCCEEDED, FAILED = "Created", "Running", "Restarting", "Succeeded", "Failed"
EVENTS = (
    "reconcile",
    "trial-running",
    "trial-succeeded",
    "trial-better",
    "trial-failed",
    "trial-metrics-unavailable",
    "suggestion-exhausted",
    "raise-max-trials",
)
"""What happens to an Experiment between two reconciles (`KatibSim.apply`)."""


@dataclass
class Trial:
    """The part of a Trial the experiment controller looks at."""

    name: str
    state: TrialState = "Pending"
    value: float | None = None


@dataclass
class KatibSim:
    """One Experiment, its trials, and the status Katib writes after each reconcile."""

    name: str = "hpo-test-sft-k2x9q"
    objective_type: Literal["minimize", "maximize"] = "minimize"
    goal: float | None = None
    max_trials: int = 4
    parallel: int = 2
    max_failed: int = 1
    resume_policy: Literal["Never", "LongRunning", "FromVolume"] = "Never"
    conditions: list[dict[str, str]] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    start_time: str | None = None
    completion_time: str | None = None
    created: bool = False
    exhausted: bool = False
    clock: datetime = field(default_factory=lambda: datetime(2026, 5, 1, 9, 0, tzinfo=timezone.utc))

    # ------------------------------------------------------------------ util.go

    def _now(self) -> str:
        self.clock += timedelta(seconds=11)
        return self.clock.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _get(self, kind: str) -> dict[str, str] | None:
        return next((c for c in self.conditions if c["type"] == kind), None)

    def _has(self, kind: str) -> bool:
        condition = self._get(kind)
        return condition is not None and condition["status"] == "True"

    def _remove(self, kind: str) -> None:
        self.conditions = [c for c in self.conditions if c["type"] != kind]

    def _set(self, kind: str, status: str, reason: str) -> None:
        current = self._get(kind)
        if current is not None and current["status"] == status and current["reason"] == reason:
            return
        now = self._now()
        transition = current["lastTransitionTime"] if current is not None and current["status"] == status else now
        self._remove(kind)
        self.conditions.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": f"Experiment is {kind.lower()}",
                "lastUpdateTime": now,
                "lastTransitionTime": transition,
            }
        )

    def completed(self) -> bool:
        return self._has(SUCCEEDED) or self._has(FAILED)

    def _finish(self, kind: str, reason: str) -> None:
        running = self._get(RUNNING)
        if running is not None:
            self._set(RUNNING, "False", running["reason"])
        self._set(kind, "True", reason)
        self.completion_time = self._now()

    # ------------------------------------------------------------------ status_util.go

    def _count(self, *states: str) -> int:
        return sum(t.state in states for t in self.trials)

    def _goal_reached(self) -> bool:
        values = [t.value for t in self.trials if t.value is not None]
        if self.goal is None or not values:
            return False
        best = min(values) if self.objective_type == "minimize" else max(values)
        return best <= self.goal if self.objective_type == "minimize" else best >= self.goal

    def _update_condition(self, goal_reached: bool, suggestion_done: bool) -> None:
        completed = self._count("Succeeded", "Failed", "Killed", "EarlyStopped", "MetricsUnavailable")
        failed = self._count("Failed", "MetricsUnavailable")
        active = self._count("Pending", "Running")
        if goal_reached:
            self._finish(SUCCEEDED, "ExperimentGoalReached")
        elif self.max_failed and failed >= self.max_failed:
            self._finish(FAILED, "ExperimentFailed")
        elif completed >= self.max_trials:
            self._finish(SUCCEEDED, "ExperimentMaxTrialsReached")
        elif suggestion_done and active == 0:
            self._finish(SUCCEEDED, "ExperimentSuggestionEndReached")
        else:
            self._set(RUNNING, "True", "ExperimentRunning")

    def _restartable(self) -> bool:
        succeeded = self._get(SUCCEEDED)
        return (
            succeeded is not None
            and succeeded["status"] == "True"
            and succeeded["reason"] == "ExperimentMaxTrialsReached"
            and self.resume_policy in ("LongRunning", "FromVolume")
        )

    # ------------------------------------------------------------------ experiment_controller.go

    def reconcile(self) -> None:
        if self.completed():
            if self._restartable() and self.max_trials > len(self.trials):
                self._remove(SUCCEEDED)
                self._remove(FAILED)
                self._set(RESTARTING, "True", "ExperimentRestarting")
            elif not self._count("Running"):
                return
        if not self.created:
            self.created = True
            self.start_time = self.start_time or self._now()
            self._set(CREATED, "True", "ExperimentCreated")
            return
        if self.trials and not self.completed():
            self._update_condition(self._goal_reached(), False)
        if self.completed():
            return
        completed = self._count("Succeeded", "Failed", "Killed", "EarlyStopped")
        active = self._count("Pending", "Running")
        if self.exhausted:
            if active == 0:
                self._update_condition(False, True)
            return
        wanted = min(self.parallel, self.max_trials - completed) - active
        for _ in range(max(wanted, 0)):
            self.trials.append(Trial(name=f"{self.name}-{len(self.trials):08d}"))

    def raise_max_trials(self, to: int) -> bool:
        """A user edit of maxTrialCount: the webhook's rule; True if admitted."""
        if self.completed() and not self._restartable():
            return False
        if to <= len(self.trials):
            return False
        self.max_trials = to
        return True

    # ------------------------------------------------------------------ events

    def apply(self, event: str) -> None:
        """One event between reconciles, then the reconcile it triggers."""
        pending = [t for t in self.trials if t.state == "Pending"]
        running = [t for t in self.trials if t.state == "Running"]
        if event == "trial-running" and pending:
            pending[0].state = "Running"
        elif event in ("trial-succeeded", "trial-better") and (running or pending):
            # A short trial can start and finish between two reconciles.
            (running or pending)[0].state = "Succeeded"
            (running or pending)[0].value = 0.5 if event == "trial-better" else 2.0
        elif event == "trial-failed" and (running or pending):
            (running or pending)[0].state = "Failed"
        elif event == "trial-metrics-unavailable" and running:
            running[0].state = "MetricsUnavailable"
        elif event == "suggestion-exhausted":
            self.exhausted = True
        elif event == "raise-max-trials":
            self.raise_max_trials(len(self.trials) + 2)
        self.reconcile()

    def run(self, *events: str) -> KatibSim:
        for event in events:
            self.apply(event)
        return self

    # ------------------------------------------------------------------ the document

    def _best(self) -> Trial | None:
        scored = [t for t in self.trials if t.value is not None]
        if not scored:
            return None
        pick = min if self.objective_type == "minimize" else max
        return pick(scored, key=lambda t: t.value)  # type: ignore[arg-type, return-value]

    def status(self) -> dict[str, Any] | None:
        if not self.created:
            return None
        status: dict[str, Any] = {"startTime": self.start_time, "completionTime": self.completion_time}
        status["conditions"] = [dict(c) for c in self.conditions]
        optimal: dict[str, Any] = {"observation": {}}
        if (best := self._best()) is not None:
            optimal["bestTrialName"] = best.name
            optimal["parameterAssignments"] = [
                {"name": "training-learning-rate", "value": "0.0003"},
                {"name": "lora-r", "value": "16"},
            ]
            value = str(best.value)
            optimal["observation"] = {"metrics": [{"name": "eval_loss", "min": value, "max": value, "latest": value}]}
        status["currentOptimalTrial"] = optimal
        lists = {
            "pendingTrialList": "Pending",
            "runningTrialList": "Running",
            "succeededTrialList": "Succeeded",
            "failedTrialList": "Failed",
            "metricsUnavailableTrialList": "MetricsUnavailable",
        }
        for key, state in lists.items():
            if names := [t.name for t in self.trials if t.state == state]:
                status[key] = names
        counters = {
            "trials": len(self.trials),
            "trialsPending": self._count("Pending"),
            "trialsRunning": self._count("Running"),
            "trialsSucceeded": self._count("Succeeded"),
            "trialsFailed": self._count("Failed"),
            "trialMetricsUnavailable": self._count("MetricsUnavailable"),
        }
        status.update({key: value for key, value in counters.items() if value})
        return status

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "apiVersion": "kubeflow.org/v1beta1",
            "kind": "Experiment",
            "metadata": {"name": self.name, "namespace": "posttrain"},
            "spec": {
                "objective": {"type": self.objective_type, "objectiveMetricName": "eval_loss"},
                "algorithm": {"algorithmName": "tpe"},
                "parameters": [
                    {
                        "name": "lora-r",
                        "parameterType": "categorical",
                        "feasibleSpace": {"list": ["8", "16"]},
                    }
                ],
                "maxTrialCount": self.max_trials,
                "parallelTrialCount": self.parallel,
                "maxFailedTrialCount": self.max_failed,
                "resumePolicy": self.resume_policy,
            },
        }
        if self.goal is not None:
            doc["spec"]["objective"]["goal"] = self.goal
        if (status := self.status()) is not None:
            doc["status"] = status
        return doc

    def verdict(self) -> Verdict:
        """Katib's own verdict; a restarted search is running again."""
        if self._has(FAILED):
            return "failed"
        if self._has(SUCCEEDED):
            return "succeeded"
        return "running"

    def argo_verdict(self) -> Verdict:
        """What the pipeline's wait must decide: Katib's verdict, except that a restarted search fails (its best
        trial is not final, and the compiler's searches never resume)."""
        return "failed" if self._get(RESTARTING) is not None else self.verdict()


@dataclass(frozen=True)
class Scenario:
    """A named status shape and the verdict the Argo wait must reach on it."""

    name: str
    sim: KatibSim
    expected: Verdict
    why: str

    @property
    def doc(self) -> dict[str, Any]:
        return self.sim.document()


def _scenarios() -> list[Scenario]:
    out = [
        Scenario("created-no-status", KatibSim(), "running", "just created: no status yet"),
        Scenario("created", KatibSim().run("reconcile"), "running", "Created, completionTime null"),
        Scenario(
            "trials-pending",
            KatibSim().run("reconcile", "reconcile"),
            "running",
            "the first trials exist, no condition beyond Created yet",
        ),
        Scenario(
            "running",
            KatibSim().run("reconcile", "reconcile", "trial-running"),
            "running",
            "Running True",
        ),
        Scenario(
            "running-one-failed",
            KatibSim(max_failed=2).run("reconcile", "reconcile", "trial-running", "trial-failed"),
            "running",
            "one failed trial, under maxFailedTrialCount",
        ),
        Scenario(
            "max-trials-reached",
            KatibSim().run(
                "reconcile",
                "reconcile",
                "trial-running",
                "trial-succeeded",
                "trial-running",
                "trial-better",
                "trial-running",
                "trial-succeeded",
                "trial-running",
                "trial-succeeded",
            ),
            "succeeded",
            "every trial done: Running False, Succeeded True at index 2",
        ),
        Scenario(
            "goal-reached",
            KatibSim(goal=1.0).run("reconcile", "reconcile", "trial-running", "trial-better"),
            "succeeded",
            "a trial reached the objective's goal",
        ),
        Scenario(
            "goal-reached-maximize",
            KatibSim(goal=1.0, objective_type="maximize").run(
                "reconcile", "reconcile", "trial-running", "trial-succeeded"
            ),
            "succeeded",
            "maximize: a trial reached the goal from above",
        ),
        Scenario(
            "max-failed-trials-reached",
            KatibSim(max_failed=2).run(
                "reconcile", "reconcile", "trial-running", "trial-failed", "trial-running", "trial-failed"
            ),
            "failed",
            "failed trials reached maxFailedTrialCount: Running False, Failed True at index 2",
        ),
        Scenario(
            "metrics-unavailable",
            KatibSim().run("reconcile", "reconcile", "trial-running", "trial-metrics-unavailable"),
            "failed",
            "a trial without its objective metric counts as failed",
        ),
        Scenario(
            "goal-reached-at-first-look",
            KatibSim(goal=1.0).run("reconcile", "reconcile", "trial-better"),
            "succeeded",
            "a trial reached the goal before Katib saw it run: no Running condition, Succeeded at index 1",
        ),
        Scenario(
            "failed-at-first-look",
            KatibSim().run("reconcile", "reconcile", "trial-failed"),
            "failed",
            "the first trial failed before Katib saw it run: Failed at index 1",
        ),
        Scenario(
            "suggestion-exhausted",
            KatibSim(max_trials=8).run(
                "reconcile",
                "reconcile",
                "trial-running",
                "trial-succeeded",
                "suggestion-exhausted",
                "trial-running",
                "trial-succeeded",
                "trial-running",
                "trial-succeeded",
            ),
            "succeeded",
            "grid search walked every point",
        ),
    ]
    restarted = KatibSim(resume_policy="LongRunning").run(
        "reconcile",
        "reconcile",
        "trial-running",
        "trial-succeeded",
        "trial-running",
        "trial-succeeded",
        "trial-running",
        "trial-succeeded",
        "trial-running",
        "trial-succeeded",
    )
    assert restarted.raise_max_trials(6)
    restarted.apply("reconcile")
    out.append(
        Scenario(
            "restarting",
            restarted,
            "failed",
            "a LongRunning search restarted with more trials: Restarting True, completionTime still set; the "
            "compiler's searches never resume, so a restart fails the wait instead of passing for finished",
        )
    )
    finished_again = KatibSim(**{k: getattr(restarted, k) for k in restarted.__dataclass_fields__})
    finished_again.trials = [Trial(t.name, t.state, t.value) for t in restarted.trials]
    finished_again.conditions = [dict(c) for c in restarted.conditions]
    finished_again.run("trial-running", "trial-succeeded", "trial-running", "trial-succeeded")
    out.append(
        Scenario(
            "restarted-then-succeeded",
            finished_again,
            "failed",
            "after a restart Restarting stays True, also once the search succeeds again",
        )
    )
    return out


SCENARIOS = _scenarios()


def scenario(name: str) -> Scenario:
    return next(s for s in SCENARIOS if s.name == name)
