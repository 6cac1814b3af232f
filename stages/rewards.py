"""GRPO reward functions: the built-ins and user functions named by import path.

`stages.rlhf.reward_functions` lists the rewards GRPO sums (each with a weight). An entry's `name` is either a
built-in or `package.module:function`, a function defined in a module that `stages.rlhf.reward_modules` lists (set
in the pipeline file only); its `args` are keyword arguments for that function. No other module is ever imported
for a reward: the spec refuses the name before the run starts, and `load_user_function` refuses it again here.

Built-ins (every score is in [0, 1]):
- `hangul_ratio`: the fraction of Hangul syllables (가-힣) among the letters of the completion;
- `length`: 1 inside the window `args.min`..`args.max` characters, falling off proportionally outside it;
- `format`: the fraction of format checks the completion passes: it ended by itself with an end-of-turn token
  (`args.require_end`, default true) and it leaves no thinking block unclosed (`args.closed_think`, default true).

A reward function has TRL's GRPOTrainer signature: it is called with the keyword arguments `prompts`,
`completions`, `completion_ids` and a few more (trainer state, logging hooks, dataset columns), so it takes
`**kwargs`, and it returns one float (or None) per completion. A completion is a string, or for chat data a list
with one assistant message; `completion_text` turns either into text.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from spec.training import BUILTIN_REWARDS, RewardFunction
from stages.tokenizer import ENDOFTEXT, IM_END, THINK_CLOSE, THINK_OPEN

RewardFn = Callable[..., list[float | None]]

# The keyword arguments GRPOTrainer passes to every reward function, besides the user's `args`.
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


class RewardError(ValueError):
    """A reward function of the spec cannot be used; the message names the spec field."""


# --------------------------------------------------------------------------- helpers


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, a list of chat messages as their contents joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence):
        return "".join(completion_text(message) for message in completion)
    return str(completion)


def is_hangul_syllable(char: str) -> bool:
    """A precomposed Hangul syllable (U+AC00 가 .. U+D7A3 힣)."""
    return "\uac00" <= char <= "\ud7a3"


# --------------------------------------------------------------------------- built-ins


def hangul_ratio(completions: list[Any], **kwargs: Any) -> list[float]:
    """Fraction of Hangul syllables among the letters of each completion (0 when it has no letters)."""
    scores = []
    for completion in completions:
        letters = [c for c in completion_text(completion) if c.isalpha()]
        scores.append(sum(is_hangul_syllable(c) for c in letters) / len(letters) if letters else 0.0)
    return scores


def length_window(
    completions: list[Any],
    min: int = 0,  # the spec's args are named min and max
    max: int | None = None,
    **kwargs: Any,
) -> list[float]:
    """1 for a completion of `min`..`max` characters (stripped); shorter ones score len/min, longer ones max/len."""
    scores = []
    for completion in completions:
        n = len(completion_text(completion).strip())
        if n < min:
            scores.append(n / min)
        elif max is not None and n > max:
            scores.append(max / n)
        else:
            scores.append(1.0)
    return scores


def end_format(
    completions: list[Any],
    completion_ids: list[list[int]] | None = None,
    require_end: bool = True,
    closed_think: bool = True,
    end_token_ids: Iterable[int] = (),
    end_texts: Iterable[str] = (IM_END, ENDOFTEXT),
    **kwargs: Any,
) -> list[float]:
    """Fraction of the enabled checks each completion passes:
    - require_end: it ended by itself: its last token is an end-of-turn id (`end_token_ids`, which the rlhf stage
      fills in from the tokenizer), or its text ends with one of `end_texts`; a completion cut off at the length
      limit fails;
    - closed_think: every `<think>` is closed by a `</think>` after it, and no `</think>` comes without one."""
    end_ids, ends = set(end_token_ids), tuple(end_texts)
    scores = []
    for i, completion in enumerate(completions):
        text = completion_text(completion)
        checks = []
        if require_end:
            ids = completion_ids[i] if completion_ids is not None else []
            checks.append(bool(ids and ids[-1] in end_ids) or text.rstrip().endswith(ends))
        if closed_think:
            checks.append(_think_tags_closed(text))
        scores.append(sum(checks) / len(checks) if checks else 1.0)
    return scores


def _think_tags_closed(text: str) -> bool:
    depth = 0
    position = 0
    while True:
        opened, closed = text.find(THINK_OPEN, position), text.find(THINK_CLOSE, position)
        if opened == closed == -1:
            return depth == 0
        if opened != -1 and (closed == -1 or opened < closed):
            depth, position = depth + 1, opened + len(THINK_OPEN)
        else:
            if depth == 0:
                return False
            depth, position = depth - 1, closed + len(THINK_CLOSE)


BUILTINS: dict[str, RewardFn] = {"hangul_ratio": hangul_ratio, "length": length_window, "format": end_format}
"""Built-in name (as the spec writes it, `spec.training.BUILTIN_REWARDS`) → function."""
assert set(BUILTINS) == set(BUILTIN_REWARDS)


# --------------------------------------------------------------------------- the spec's rewards


class Reward:
    """A reward function with the spec's args bound, named for TRL's logs (`rewards/<name>/mean`)."""

    def __init__(self, name: str, func: RewardFn, args: dict[str, Any]) -> None:
        self.__name__ = name
        self.func = func
        self.args = args

    def __call__(self, **kwargs: Any) -> list[float | None]:
        return self.func(**kwargs, **self.args)

    def __repr__(self) -> str:
        return f"Reward({self.__name__!r}, args={self.args!r})"


def load_user_function(path: str, field: str, modules: Iterable[str]) -> RewardFn:
    """The function `package.module:function` of one of the allowed `modules` (the pipeline file's
    stages.rlhf.reward_modules), defined in that module (not imported into it); RewardError naming `field`
    otherwise. Nothing is imported unless the module is allowed."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr.isidentifier():
        raise RewardError(f"{field} is {path!r}: use a built-in ({', '.join(BUILTINS)}) or 'package.module:function'")
    if module_name not in set(modules):
        raise RewardError(
            f"{field}: module {module_name!r} is not in stages.rlhf.reward_modules: only the modules the pipeline "
            "file lists are imported for a reward"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while the module runs
        raise RewardError(f"{field}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from exc
    func = getattr(module, attr, None)
    if func is None:
        raise RewardError(f"{field}: module {module_name!r} has no attribute {attr!r}")
    if not inspect.isfunction(func) or func.__module__ != module_name:
        # A class, a builtin or a function imported from elsewhere (from torch.hub import load) is not the
        # module's own reward: calling it could run whatever it wraps.
        raise RewardError(f"{field}: {path!r} is not a function defined in {module_name!r}")
    return func


def check_signature(func: RewardFn, args: dict[str, Any], field: str) -> None:
    """Refuse a function GRPOTrainer could not call: it must take the keywords TRL passes (and more: **kwargs)
    plus the spec's args, and require nothing else."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise RewardError(f"{field}: cannot read the signature of {func!r} ({exc})") from exc
    expected = "f(prompts, completions, completion_ids, **kwargs) -> list[float | None]"
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        raise RewardError(
            f"{field}: {getattr(func, '__name__', func)}{signature} does not take **kwargs; "
            f"a GRPO reward function is {expected}"
        )
    try:
        signature.bind(**dict.fromkeys(TRL_KEYWORDS), **args)
    except TypeError as exc:
        raise RewardError(
            f"{field}: {getattr(func, '__name__', func)}{signature} cannot be called as {expected} "
            f"with args {sorted(args)} ({exc})"
        ) from None


def check_builtin_args(func: RewardFn, args: dict[str, Any], field: str) -> None:
    """Refuse args a built-in does not name (its **kwargs would swallow a misspelt one silently)."""
    parameters = inspect.signature(func).parameters
    known = [p for p in parameters if p not in TRL_KEYWORDS and parameters[p].kind is not inspect.Parameter.VAR_KEYWORD]
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise RewardError(f"{field}: {unknown} are not arguments of this reward; it takes {known or 'none'}")


def build_reward_functions(
    rewards: list[RewardFunction], end_token_ids: Iterable[int] = (), modules: Iterable[str] = ()
) -> tuple[list[Reward], list[float]]:
    """The spec's reward functions, ready for GRPOTrainer(reward_funcs=...), and their weights. `end_token_ids`
    (the tokenizer's end-of-turn ids) go to the `format` built-in unless the spec sets them; user functions come
    only from `modules` (stages.rlhf.reward_modules)."""
    functions: list[Reward] = []
    for i, reward in enumerate(rewards):
        field = f"stages.rlhf.reward_functions[{i}].name"
        args = dict(reward.args)
        if reward.name in BUILTINS:
            func, name = BUILTINS[reward.name], reward.name
            if reward.name == "format":
                args.setdefault("end_token_ids", list(end_token_ids))
            check_builtin_args(func, args, f"stages.rlhf.reward_functions[{i}].args")
        else:
            func, name = load_user_function(reward.name, field, modules), reward.name.rpartition(":")[2]
            check_signature(func, args, field)
        functions.append(Reward(name, func, args))
    return functions, [reward.weight for reward in rewards]
