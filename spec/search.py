"""The hyperparameter search of a training stage: its parameters, objective and algorithm."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from spec.fields import FieldError, Int32, Int64, Seed, StrictModel

HPO_ALGORITHMS = ("random", "tpe", "bayesianoptimization", "grid")


"""Search algorithms, named as Katib names them (Optuna's samplers run them under --local)."""


HPO_FIXED_FIELDS = ("enabled", "resources", "run_policy", "env", "hpo", "data", "method", "distributed")


"""Stage fields a search may not vary: the trial jobs' shape and data are the stage's own, so trials are comparable
and each one fits the pods the template was compiled with."""


TRAINING_METRICS = ("eval_loss", "perplexity", "train_loss_first", "train_loss_last")


"""What cpt and sft record in stage.json (eval_* and perplexity need held-out rows: data.eval_fraction > 0)."""


PREFERENCE_METRICS = (
    "eval_loss",
    "eval_rewards_margin",
    "eval_rewards_accuracy",
    "train_loss_first",
    "train_loss_last",
    "rewards_margin_first",
    "rewards_margin_last",
    "rewards_accuracy_first",
    "rewards_accuracy_last",
)


"""What rlhf records with dpo, orpo and kto."""


GRPO_METRICS = ("train_loss_first", "train_loss_last", "reward_first", "reward_last", "kl_first", "kl_last")


"""What rlhf records with grpo (no held-out loss)."""


def recorded_metrics(stage: str, algorithm: str | None = None) -> tuple[str, ...]:
    """The metrics a training stage writes into its stage.json, which a search may optimise."""
    if stage != "rlhf":
        return TRAINING_METRICS
    return GRPO_METRICS if algorithm == "grpo" else PREFERENCE_METRICS


SearchValue = Int64 | float | str | bool


class SearchParameter(StrictModel):
    """One dimension of a search: a field of the stage, and the values trials may give it."""

    path: str = Field(
        description="Dotted path of the field inside the stage's section, e.g. training.learning_rate, lora.r, "
        "training.warmup_ratio, beta."
    )
    type: Literal["uniform", "log_uniform", "int", "categorical"] = Field(
        description="uniform or log_uniform: a real number between min and max (log_uniform samples its logarithm, "
        "for learning rates); int: a whole number between min and max; categorical: one of values."
    )
    min: float | None = Field(None, description="Smallest value (uniform, log_uniform, int).")
    max: float | None = Field(None, description="Largest value (uniform, log_uniform, int).")
    step: float | None = Field(
        None, gt=0, description="Spacing of the values between min and max; required for uniform under grid search."
    )
    values: list[SearchValue] | None = Field(None, description="The choices (categorical): at least two, distinct.")

    @property
    def keys(self) -> tuple[str, ...]:
        """The path split at its dots."""
        return tuple(self.path.split("."))

    def candidates(self) -> list[SearchValue]:
        """Values whose validity decides the whole range: both ends, or every choice."""
        if self.type == "categorical":
            return list(self.values or [])
        if self.type == "int":
            return [int(self.min), int(self.max)]  # type: ignore[arg-type]
        return [self.min, self.max]  # type: ignore[list-item]

    @model_validator(mode="after")
    def _range(self) -> SearchParameter:
        if not re.match(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$", self.path):
            raise FieldError(
                ("path",), f"path must be dotted field names, e.g. training.learning_rate, got {self.path!r}"
            )
        if self.type == "categorical":
            for name in ("min", "max", "step"):
                if getattr(self, name) is not None:
                    raise FieldError((name,), f"a categorical parameter takes values, not {name}")
            values = self.values or []
            if len({json_key(v) for v in values}) < 2:
                raise FieldError(
                    ("values",),
                    f"a categorical parameter needs at least two distinct values to search over, got {values}: "
                    "set the field itself in the stage instead",
                )
            if len({json_key(v) for v in values}) != len(values):
                raise FieldError(("values",), f"values repeat: {values}")
            return self
        if self.values is not None:
            raise FieldError(("values",), f"a {self.type} parameter takes min and max, not values")
        if self.min is None or self.max is None:
            raise FieldError(("min" if self.min is None else "max",), f"a {self.type} parameter needs min and max")
        if self.min >= self.max:
            raise FieldError(("max",), f"max ({self.max:g}) must be greater than min ({self.min:g})")
        if self.type == "log_uniform" and self.min <= 0:
            raise FieldError(("min",), f"log_uniform samples the logarithm: min must be positive, got {self.min:g}")
        if self.type == "int":
            for name in ("min", "max", "step"):
                value = getattr(self, name)
                if value is not None and value != int(value):
                    raise FieldError((name,), f"an int parameter's {name} must be a whole number, got {value:g}")
        return self


def json_key(value: SearchValue) -> str:
    """A value as JSON, so True, 1 and 1.0 stay distinct choices."""
    return f"{type(value).__name__}:{value!r}"


def search_field_problem(section: type[BaseModel], parameter: SearchParameter) -> str | None:
    """Why a search parameter's path is not a field a search may vary in a stage of type `section`; None if it is."""
    model: type[BaseModel] = section
    for depth, key in enumerate(parameter.keys):
        fields = model.model_fields
        if key not in fields:
            known = ", ".join(sorted(fields))
            prefix = ".".join(parameter.keys[:depth]) or "the stage"
            return f"{parameter.path}: {prefix} has no field {key!r} (it has {known})"
        if depth == 0 and key in HPO_FIXED_FIELDS:
            return f"{parameter.path}: a search may not vary {key} (every trial runs the stage's own {key})"
        annotation = fields[key].annotation
        if depth < len(parameter.keys) - 1:
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return f"{parameter.path}: {'.'.join(parameter.keys[: depth + 1])} is a value, not a section"
            model = annotation
            continue
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return f"{parameter.path} is a section; name one of its fields"
        whole = annotation in (int, int | None)
        if whole and parameter.type in ("uniform", "log_uniform"):
            return f"{parameter.path} is a whole number: search it with type int or categorical"
        numeric = annotation in (int, float, int | None, float | None)
        if parameter.type != "categorical" and not numeric:
            return f"{parameter.path} is not a number: search it with type categorical"
    return None


class HpoObjective(StrictModel):
    """What the search optimises: a metric the stage records in its stage.json."""

    metric: str = Field(description="Metric name, e.g. eval_loss (cpt, sft, rlhf) or eval_rewards_accuracy (rlhf).")
    goal: Literal["minimize", "maximize"] = Field("minimize", description="Whether smaller or larger is better.")
    target: float | None = Field(
        None, description="Stop the search early once a trial reaches this value (Katib's objective goal)."
    )


class HpoSpec(StrictModel):
    """A hyperparameter search before the stage: short trials of the stage (Katib in the cluster, Optuna under
    --local); the stage then trains with the best trial's values."""

    parameters: list[SearchParameter] = Field(min_length=1, description="The search space.")
    objective: HpoObjective = Field(description="The metric to optimise.")
    algorithm: Literal["random", "tpe", "bayesianoptimization", "grid"] = Field(
        "tpe", description="Katib's algorithm name: random, tpe, bayesianoptimization or grid."
    )
    max_trials: Int64 = Field(12, ge=1, le=1000, description="Trials in all.")
    parallel_trials: Int32 = Field(2, ge=1, description="Trials running at once (each is a job of the stage's shape).")
    max_failed_trials: Int32 = Field(3, ge=0, description="The search fails once this many trials have failed.")
    trial_max_steps: Int64 = Field(50, gt=0, description="Optimizer steps each trial trains (its max_steps).")
    seed: Seed | None = Field(
        0, description="Seed of the search algorithm, so that a rerun tries the same values (None: a random one)."
    )

    @model_validator(mode="after")
    def _coherent(self) -> HpoSpec:
        paths = [p.path for p in self.parameters]
        for index, path in enumerate(paths):
            if path in paths[:index]:
                raise FieldError(("parameters", index, "path"), f"{path} is searched twice")
        if self.parallel_trials > self.max_trials:
            raise FieldError(
                ("parallel_trials",), f"parallel_trials ({self.parallel_trials}) exceeds max_trials ({self.max_trials})"
            )
        if self.algorithm == "grid":
            for index, parameter in enumerate(self.parameters):
                if parameter.type == "log_uniform":
                    raise FieldError(
                        ("parameters", index, "type"),
                        "grid search walks evenly spaced values: use uniform with a step, or categorical values",
                    )
                if parameter.type == "uniform" and parameter.step is None:
                    raise FieldError(("parameters", index, "step"), "grid search needs a step for a uniform parameter")
        if self.algorithm == "bayesianoptimization":
            for index, parameter in enumerate(self.parameters):
                if parameter.type == "uniform":
                    # Katib's scikit-optimize service samples every real-valued parameter on a log scale.
                    raise FieldError(
                        ("parameters", index, "type"),
                        "Katib's bayesianoptimization samples every real-valued parameter log-uniformly: use "
                        "log_uniform (min > 0), int or categorical, or another algorithm",
                    )
        return self
