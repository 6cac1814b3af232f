"""GRPO reward functions (built-ins, user functions of the modules the pipeline file allows, the errors, and what a
form cannot make them import), and the other preference algorithms run for a few steps: GRPO with hangul_ratio,
ORPO and KTO."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from safetensors.torch import load_file
from training_fixtures import make_preference_run_dir, run_ok

from spec.document import SpecError
from spec.loading import load_pipeline
from spec.training import RewardFunction
from stages.__main__ import main as stage_main
from stages.rewards import RewardError, build_reward_functions, end_format, hangul_ratio, length_window

END = 7  # an end-of-turn token id, for the format reward


def chat(text: str) -> list[dict[str, str]]:
    """A completion as GRPO passes it for chat data: one assistant message."""
    return [{"role": "assistant", "content": text}]


# --------------------------------------------------------------------------- built-ins


def test_hangul_ratio_counts_syllables_among_letters() -> None:
    completions = ["서울은 아름답습니다.", "Seoul is beautiful.", "서울 is 2024년", "", "12345 !?", chat("한국 ok")]
    assert hangul_ratio(completions=completions) == pytest.approx([1.0, 0.0, 3 / 5, 0.0, 0.0, 2 / 4])
    assert hangul_ratio(completions=["ㅋㅋ 좋아"]) == pytest.approx([2 / 4])  # bare jamo are letters, not syllables


def test_length_window() -> None:
    scores = length_window(completions=["abc", "  abcdefg  ", "가" * 20, chat("가나다라마")], min=5, max=10)
    assert scores == pytest.approx([3 / 5, 1.0, 0.5, 1.0])
    assert length_window(completions=["", "x" * 1000]) == [1.0, 1.0]  # no window: everything fits


def test_format_checks_end_of_turn_and_thinking_tags() -> None:
    completions = ["답입니다.", "<think>생각</think>답", "<think>생각이 끝나지", "답</think>", "잘림", "답<|im_end|>"]
    ids = [[1, END], [1, 2, END], [1, 2, 3], [1, END], [1, 2], [1, 2]]
    scores = end_format(completions=completions, completion_ids=ids, end_token_ids=[END])
    assert scores == [1.0, 1.0, 0.0, 0.5, 0.5, 1.0]
    assert end_format(completions=["잘림"], completion_ids=[[1]], require_end=False) == [1.0]
    assert end_format(completions=["<think>"], completion_ids=[[END]], end_token_ids=[END], closed_think=False) == [1.0]


# --------------------------------------------------------------------------- the spec's reward functions


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of user reward functions on sys.path."""
    package = tmp_path / "myrewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "korean.py").write_text(
        textwrap.dedent(
            """
            def polite(prompts, completions, ending="요.", **kwargs):
                return [1.0 if c[0]["content"].endswith(ending) else 0.0 for c in completions]

            def no_kwargs(prompts, completions):
                return [0.0 for _ in completions]

            def needs_more(completions, reference, **kwargs):
                return [0.0 for _ in completions]

            NOT_A_FUNCTION = 3

            from os.path import join as imported_function
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "myrewards.korean"
    for name in ("myrewards", "myrewards.korean"):
        sys.modules.pop(name, None)


def test_builtins_and_user_functions_with_weights_and_args(user_module: str) -> None:
    specs = [
        RewardFunction(name="hangul_ratio", weight=2.0),
        RewardFunction(name="format", args={"closed_think": False}),
        RewardFunction(name=f"{user_module}:polite", weight=0.5, args={"ending": "다."}),
    ]
    rewards, weights = build_reward_functions(specs, end_token_ids=[END], modules=[user_module])
    assert [r.__name__ for r in rewards] == ["hangul_ratio", "format", "polite"]
    assert weights == [2.0, 1.0, 0.5]

    # Called as GRPOTrainer calls them: keywords only, with extra ones they ignore.
    kwargs = {"prompts": [[]] * 2, "completion_ids": [[1, END], [1]], "trainer_state": None, "log_metric": print}
    completions = [chat("좋습니다."), chat("fine")]
    assert rewards[0](completions=completions, **kwargs) == [1.0, 0.0]
    assert rewards[1](completions=completions, **kwargs) == [1.0, 0.0]  # the stage's end-of-turn id is bound
    assert rewards[2](completions=completions, **kwargs) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("myrewards.missing:polite", "cannot import module 'myrewards.missing'"),
        ("no_such_package_xyz.rewards:f", "cannot import module 'no_such_package_xyz.rewards'"),
        ("myrewards.korean:absent", "has no attribute 'absent'"),
        ("myrewards.korean:NOT_A_FUNCTION", "is not a function defined in 'myrewards.korean'"),
        ("myrewards.korean:imported_function", "is not a function defined in 'myrewards.korean'"),
        ("myrewards.korean:no_kwargs", "does not take **kwargs"),
        ("myrewards.korean:needs_more", "cannot be called as"),
        ("hangul", "use a built-in"),
        ("torch.hub:load", "module 'torch.hub' is not in stages.rlhf.reward_modules"),
        ("transformers:AutoModelForCausalLM.from_pretrained", "use a built-in"),
    ],
)
def test_bad_reward_functions_name_the_spec_field(user_module: str, name: str, error: str) -> None:
    specs = [RewardFunction(name="hangul_ratio"), RewardFunction(name=name)]
    allowed = [user_module, "myrewards.missing", "no_such_package_xyz.rewards"]
    with pytest.raises(RewardError, match=r"stages\.rlhf\.reward_functions\[1\]\.name") as caught:
        build_reward_functions(specs, modules=allowed)
    assert error in str(caught.value)


def test_a_module_not_allowed_is_never_imported(user_module: str) -> None:
    """The allow-list is checked before the import: a module's top-level code (a hubconf.py, say) never runs."""
    with pytest.raises(RewardError, match=r"not in stages\.rlhf\.reward_modules"):
        build_reward_functions([RewardFunction(name=f"{user_module}:polite")], modules=[])
    assert user_module not in sys.modules


def test_builtin_with_unknown_args_names_the_args_field() -> None:
    with pytest.raises(ValidationError, match=r"are not arguments of the hangul_ratio reward"):
        RewardFunction(name="hangul_ratio", args={"min": 1})
    with pytest.raises(SpecError, match=r"stages\.rlhf\.reward_functions\[0\]\.args: \['lenght'\]"):
        load_pipeline("korean-llm", overrides=["stages.rlhf.reward_functions=[{name: length, args: {lenght: 1}}]"])


def test_the_spec_names_only_built_ins_and_allowed_modules() -> None:
    """What a run may import is decided in the pipeline file: torch.hub:load (which runs a repository's
    hubconf.py) or a from_pretrained path with trust_remote_code in its args are refused before anything runs."""
    grpo = ["stages.rlhf.algorithm=grpo", "stages.rlhf.data.format=messages"]
    hub = "stages.rlhf.reward_functions=[{name: 'torch.hub:load', args: {repo_or_dir: /tmp/x, trust_repo: true}}]"
    with pytest.raises(SpecError, match=r"reward_functions\[0\]\.name: 'torch.hub:load': module 'torch.hub' is not"):
        load_pipeline("korean-llm", overrides=[*grpo, hub])
    pretrained = "stages.rlhf.reward_functions=[{name: 'transformers:AutoModelForCausalLM.from_pretrained'}]"
    with pytest.raises(SpecError, match=r"is neither a built-in reward"):
        load_pipeline("korean-llm", overrides=[*grpo, pretrained])
    allowed = [
        "stages.rlhf.reward_modules=[acme.rewards]",
        "stages.rlhf.reward_functions=[{name: 'acme.rewards:polite'}]",
    ]
    spec = load_pipeline("korean-llm", overrides=[*grpo, *allowed]).spec
    assert spec.stages.rlhf.reward_functions[0].name == "acme.rewards:polite"


# --------------------------------------------------------------------------- the algorithms, a few steps each

ALONE = [  # rlhf straight from the base model: no cpt or sft to run first
    "stages.cpt.enabled=false",
    "stages.sft.enabled=false",
    "stages.rlhf.training.max_steps=2",
    "stages.rlhf.training.save_steps=2",
    "stages.rlhf.training.logging_steps=1",
    "stages.rlhf.training.max_seq_length=64",
]


@pytest.mark.slow
def test_grpo_full_with_hangul_ratio(tmp_path: Path) -> None:
    overrides = [
        *ALONE,
        "stages.rlhf.algorithm=grpo",
        "stages.rlhf.method=full",
        "stages.rlhf.num_generations=2",
        "stages.rlhf.reward_functions=[{name: hangul_ratio}, {name: format, weight: 0.5}]",
    ]
    run_dir = make_preference_run_dir(tmp_path / "run", overrides, n_train=8)
    run_ok(run_dir, "rlhf")

    result = run_dir.read_result("rlhf")
    assert result is not None and result.status == "succeeded"
    assert result.extra["algorithm"] == "grpo" and result.extra["model_kind"] == "full"
    assert result.extra["reference"] == "starting model: frozen copy"
    assert result.metrics["steps"] == 2
    assert 0.0 <= result.metrics["reward_first"] <= 1.5 and "kl_last" in result.metrics
    model_dir = run_dir.stage_dir("rlhf") / "model"
    assert load_file(model_dir / "model.safetensors") and (model_dir / "tokenizer.json").is_file()
    # The base is built from a config, so the reference GRPO loads was written next to the stage, as safetensors.
    assert (run_dir.stage_dir("rlhf") / "reference" / "model.safetensors").is_file()


@pytest.mark.slow
def test_orpo_with_a_fresh_adapter(tmp_path: Path) -> None:
    run_dir = make_preference_run_dir(tmp_path / "run", [*ALONE, "stages.rlhf.algorithm=orpo"], n_train=8)
    run_ok(run_dir, "rlhf")

    result = run_dir.read_result("rlhf")
    assert result is not None and result.status == "succeeded"
    assert result.extra["model_kind"] == "adapter" and result.extra["reference"] == "none"
    assert {"rewards_margin_first", "rewards_accuracy_last", "eval_rewards_margin"} <= result.metrics.keys()
    assert (run_dir.stage_dir("rlhf") / "model" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_kto_full_with_a_frozen_reference(tmp_path: Path) -> None:
    overrides = [
        *ALONE,
        "stages.rlhf.algorithm=kto",
        "stages.rlhf.method=full",
        "stages.rlhf.precompute_ref_log_probs=false",
    ]
    run_dir = make_preference_run_dir(tmp_path / "run", overrides, n_train=8)
    run_ok(run_dir, "rlhf")

    result = run_dir.read_result("rlhf")
    assert result is not None and result.status == "succeeded"
    assert result.extra["model_kind"] == "full" and result.extra["reference"] == "starting model: frozen copy"
    assert result.metrics["steps"] == 2 and "kl_first" in result.metrics and "eval_loss" in result.metrics
    assert (run_dir.stage_dir("rlhf") / "model" / "model.safetensors").is_file()


def test_a_bad_reward_function_fails_the_stage_with_the_field(tmp_path: Path) -> None:
    overrides = [
        *ALONE,
        "stages.rlhf.algorithm=grpo",
        "stages.rlhf.reward_modules=[no_such_package_xyz]",
        "stages.rlhf.reward_functions=[{name: hangul_ratio}, {name: 'no_such_package_xyz:reward'}]",
    ]
    run_dir = make_preference_run_dir(tmp_path / "run", overrides, n_train=8)
    assert stage_main(["rlhf", "--run-dir", str(run_dir.root)]) == 1
    result = run_dir.read_result("rlhf")
    assert result.status == "failed"
    assert "stages.rlhf.reward_functions[1].name" in result.message and "no_such_package_xyz" in result.message
