"""Validating a row of a known format and writing it in the canonical form every stage reads.

Canonical forms, what every later stage reads:

    text        {"text": str}
    chat        {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}
                (formats messages, alpaca and sharegpt); with formats messages and sharegpt an assistant
                message may also have "tool_calls": [{"type": "function", "function": {"name": str,
                "arguments": {...}}}], a "tool" message answers them, and the row may have "tools" (the
                functions offered, as JSON schemas): the form transformers' chat templates read. sharegpt's
                `function_call` turn (LLaMA-Factory's) becomes an assistant message with its tool_calls
    preference  {"prompt": [messages...], "chosen": [{"role": "assistant", "content": str}],
                 "rejected": [{"role": "assistant", "content": str}]}

Column mapping (`data.columns`, `data.text_field`, `data.roles`): a format's fields may have other names in a
dataset, as in LLaMA-Factory's dataset_info. `columns` maps the format's name to the dataset's column (or, for
`from`/`value` and `role`/`content`, to the key inside each message), `roles` maps user/assistant/system to the
tags the messages use. Every source (JSONL, Parquet, hub, builtin) goes through the same mapping, in
`normalize_row`; errors name the dataset's column and the mapping that led there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spec.data import FORMAT_COLUMNS, MESSAGE_KEYS, DataSpec

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "function_call",  # LLaMA-Factory's: an assistant turn whose value is its tool call(s), as JSON
    "observation": "tool",  # LLaMA-Factory's tool answer
    "tool": "tool",
}

"""The role tags a sharegpt dataset may use when `data.roles` does not say (tag → role)."""


class FieldError(Exception):
    """A field of a row is wrong; raised by the validators, turned into a RowError with file and line."""

    def __init__(self, field: str, error: str) -> None:
        super().__init__(f"{field}: {error}")
        self.field = field
        self.error = error
        self.mapping = ""  # the spec fields that renamed `field`, set by normalize_row


class MissingField(FieldError):
    """A required field is not in its row (or message); `present` are the keys that are."""

    def __init__(self, field: str, error: str, present: list[str]) -> None:
        super().__init__(field, error)
        self.present = present


_FORMAT_KEYS = {
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
    "preference": ("chosen", "rejected"),
}


@dataclass(frozen=True)
class ColumnMap:
    """Where a format's fields are in a dataset: `data.columns`, `data.text_field` and `data.roles` resolved."""

    fmt: str
    renames: dict[str, str]
    """The format's name → the dataset's, for the names the spec changes (text_field included, as 'text')."""
    sources: dict[str, str]
    """The format's name → the spec field that renames it ('columns.output', 'text_field')."""
    roles: dict[str, str]
    """The role tags the messages may use → the canonical role."""
    text_field: str = "text"
    """The text column, for the hint that a row looks like the text format."""

    @classmethod
    def of(cls, data: DataSpec) -> ColumnMap:
        """The mapping of a dataset spec."""
        return cls.build(data.format, data.text_field, data.columns, data.roles)

    @classmethod
    def build(
        cls,
        fmt: str,
        text_field: str = "text",
        columns: dict[str, str] | None = None,
        roles: dict[str, str] | None = None,
    ) -> ColumnMap:
        """The mapping of format `fmt` with these settings (validated as DataSpec validates them)."""
        columns = columns or {}
        renames = {k: v for k, v in columns.items() if v != k}
        sources = {k: f"columns.{k}" for k in renames}
        if fmt == "text" and "text" not in columns and text_field != "text":
            renames["text"], sources["text"] = text_field, "text_field"
        text_column = columns.get("text", text_field)
        return cls(fmt, renames, sources, _role_table(fmt, roles or {}), text_column)

    def name(self, key: str) -> str:
        """The dataset's name for the format's field `key`."""
        return self.renames.get(key, key)

    def note(self, field: str) -> str:
        """The spec fields that renamed parts of a field path, e.g. 'columns.output' for 'response', or
        'columns.conversations, columns.from' for 'dialog[0].speaker'."""
        top = re.match(r"[^\[.]*", field).group()  # type: ignore[union-attr]
        parts = [self._renamed_by(top, message_key=False), self.renamed(field) if "." in field else ""]
        return ", ".join(p for p in parts if p)

    def renamed(self, field: str) -> str:
        """The spec field that renamed the last name of a field path (a column, or a key of a message), or ''."""
        if "." in field:
            return self._renamed_by(field.rsplit(".", 1)[1], message_key=True)
        return self._renamed_by(field, message_key=False)

    def _renamed_by(self, name: str, message_key: bool) -> str:
        for key in FORMAT_COLUMNS[self.fmt]:
            if (key in MESSAGE_KEYS) == message_key and key in self.sources and self.renames[key] == name:
                return self.sources[key]
        return ""


def _role_table(fmt: str, roles: dict[str, str]) -> dict[str, str]:
    """Tag → role for a format's messages: the format's default tags, where `roles` names a role its tag instead."""
    default = SHAREGPT_ROLES if fmt == "sharegpt" else {r: r for r in ROLES}
    table = {tag: role for tag, role in default.items() if role not in roles and tag not in roles.values()}
    return table | {tag: role for role, tag in roles.items()}


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _format_hint(row: dict[str, Any], fmt: str, text_field: str) -> str:
    """' (the row looks like format X ...)' when a missing field is explained by another format."""
    keys = {**_FORMAT_KEYS, "text": (text_field,)}
    for other, needed in keys.items():
        if other != fmt and all(k in row for k in needed):
            return f" (the row has {', '.join(repr(k) for k in needed)}: is it in format {other!r}?)"
    return ""


def _required(row: dict[str, Any], key: str, cm: ColumnMap) -> Any:
    """The value of the format's field `key` (under its mapped name); MissingField when the row lacks it."""
    column = cm.name(key)
    if column not in row:
        if column != key and key in row:  # the mapping is what sends the reader elsewhere
            hint = f" (the row has {key!r}, the format's own name: is {cm.sources[key]} wrong?)"
        else:
            hint = _format_hint(row, cm.fmt, cm.text_field)
        raise MissingField(column, "missing" + hint, sorted(str(k) for k in row))
    return row[column]


def _string(value: Any, path: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise FieldError(path, f"expected a string, got {_type_name(value)}")
    if not allow_empty and not value.strip():
        raise FieldError(path, "empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = f"\\u{ord(value[exc.start]):04x}"
        raise FieldError(
            path, f"a lone surrogate {surrogate} at character {exc.start + 1}: half of a character, not text"
        ) from None
    return value


def _message_list(
    value: Any, path: str, role_key: str = "role", content_key: str = "content", roles: dict[str, str] | None = None
) -> list[dict[str, str]]:
    """Validate a list of chat messages (role/content, or from/value for sharegpt) into canonical messages;
    `roles` maps the tags the messages may use to canonical roles."""
    if not isinstance(value, list):
        raise FieldError(path, f"expected a list of messages, got {_type_name(value)}")
    if not value:
        raise FieldError(path, "empty list: a conversation needs at least one message")
    roles = roles or {r: r for r in ROLES}
    out = []
    for i, message in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(message, dict):
            raise FieldError(
                where, f"expected an object with {role_key!r} and {content_key!r}, got {_type_name(message)}"
            )
        if role_key not in message:
            raise MissingField(f"{where}.{role_key}", "missing", sorted(str(k) for k in message))
        role = message[role_key]
        if not isinstance(role, str):
            raise FieldError(f"{where}.{role_key}", f"expected a string, got {_type_name(role)}")
        if role not in roles:
            raise FieldError(f"{where}.{role_key}", f"unknown role {role!r} (expected one of {', '.join(roles)})")
        role = roles[role]
        if role == "system" and i != 0:
            raise FieldError(f"{where}.{role_key}", "a system message may only come first")
        if role == "function_call":  # the call as LLaMA-Factory writes it: {"name", "arguments"} or a list of them
            if content_key not in message:
                raise MissingField(f"{where}.{content_key}", "missing", sorted(str(k) for k in message))
            value = _string(message[content_key], f"{where}.{content_key}")
            try:
                call = json.loads(value)
            except ValueError as exc:
                raise FieldError(f"{where}.{content_key}", f"a function call that is not JSON ({exc})") from None
            calls = _tool_calls(call if isinstance(call, list) else [call], f"{where}.{content_key}")
            out.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        calls = message.get("tool_calls")
        if content_key not in message and not calls:
            raise MissingField(f"{where}.{content_key}", "missing", sorted(str(k) for k in message))
        if calls is not None and role != "assistant":
            raise FieldError(f"{where}.tool_calls", f"only an assistant message calls tools, this one is {role!r}")
        calls = _tool_calls(calls, f"{where}.tool_calls") if calls else None
        if calls and message.get(content_key) is None:
            content = ""  # a turn that only calls tools
        else:
            content = _string(message[content_key], f"{where}.{content_key}", allow_empty=calls is not None)
        reasoning = message.get("reasoning_content")
        if role == "assistant" and reasoning is not None:
            reasoning = _string(reasoning, f"{where}.reasoning_content", allow_empty=True)
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
        entry: dict[str, Any] = {"role": role, "content": content}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":  # which call it answers, where the data says (templates that need it read it)
            entry |= {k: _string(message[k], f"{where}.{k}") for k in ("name", "tool_call_id") if message.get(k)}
        out.append(entry)
    return out


def _tool_calls(value: Any, path: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them: `{"type": "function", "function": {"name",
    "arguments": {...}}}` each. OpenAI's form (the arguments as a JSON string) and a bare `{"name", "arguments"}`
    are taken too."""
    if not isinstance(value, list):
        raise FieldError(path, f"expected a list of tool calls, got {_type_name(value)}")
    calls = []
    for i, call in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(call, dict):
            raise FieldError(where, f"expected an object with a function's name and arguments, got {_type_name(call)}")
        function, at = (call["function"], f"{where}.function") if "function" in call else (call, where)
        if not isinstance(function, dict):
            raise FieldError(at, f"expected an object with 'name' and 'arguments', got {_type_name(function)}")
        if "name" not in function:
            raise MissingField(f"{at}.name", "missing", sorted(str(k) for k in function))
        name = _string(function["name"], f"{at}.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise FieldError(f"{at}.arguments", f"a string that is not JSON ({exc})") from None
        if not isinstance(arguments, dict):
            raise FieldError(f"{at}.arguments", f"expected an object of arguments, got {_type_name(arguments)}")
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return calls


def _tools(row: dict[str, Any], cm: ColumnMap) -> list[dict[str, Any]] | None:
    """The functions a row offers the model (its tools column: JSON schemas, a list or, as LLaMA-Factory keeps
    them, a JSON string of one), each as `{"type": "function", "function": {"name", ...}}`; None without any."""
    column = cm.name("tools")
    value = row.get(column)
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except ValueError as exc:
            raise FieldError(column, f"a string that is not JSON ({exc})") from None
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise FieldError(column, f"expected a list of function schemas, got {_type_name(value)}")
    tools = []
    for i, tool in enumerate(value):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FieldError(f"{column}[{i}]", "expected a function schema with a 'name' (and 'parameters')")
        tools.append({"type": "function", "function": function})
    return tools


def _conversation(messages: list[dict[str, str]], path: str, role_key: str = "role") -> list[dict[str, str]]:
    """Check the shape of a training conversation: user first, an assistant turn, the assistant last."""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    first = len(messages) - len(turns)
    if not turns:
        raise FieldError(path, "only a system message: no user or assistant turn")
    if turns[0]["role"] != "user":
        raise FieldError(f"{path}[{first}].{role_key}", f"the first turn must be 'user', got {turns[0]['role']!r}")
    if not any(m["role"] == "assistant" for m in turns):
        raise FieldError(path, "no assistant turn: nothing to learn from")
    if turns[-1]["role"] != "assistant":
        last = len(messages) - 1
        raise FieldError(f"{path}[{last}].{role_key}", "the conversation must end with an assistant turn")
    for i, message in enumerate(messages):
        if message["role"] == "tool" and not (messages[i - 1]["role"] == "tool" or "tool_calls" in messages[i - 1]):
            raise FieldError(
                f"{path}[{i}].{role_key}", "a tool message answers tool calls: the message before it has none"
            )
    return messages


def _system(row: dict[str, Any], cm: ColumnMap, messages: list[dict[str, str]], path: str) -> list[dict[str, str]]:
    """`messages` after the system prompt of the row's system column, if it has one (null, missing or blank: none).
    `path` names the messages, for the error when they start with a system message of their own."""
    column = cm.name("system")
    value = row.get(column)
    if value is None or not _string(value, column, allow_empty=True).strip():
        return messages
    if messages and messages[0]["role"] == "system":
        raise FieldError(column, f"a system prompt, but {path}[0] is a system message too: keep one of them")
    return [{"role": "system", "content": value}, *messages]


def _history(row: dict[str, Any], cm: ColumnMap) -> list[dict[str, str]]:
    """The turns before this one of an alpaca row: its history column, a list of [instruction, response] pairs."""
    column = cm.name("history")
    value = row.get(column)
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError(column, f"expected a list of [instruction, response] pairs, got {_type_name(value)}")
    turns = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            got = f"a list of {len(pair)}" if isinstance(pair, list) else _type_name(pair)
            raise FieldError(f"{column}[{i}]", f"expected a pair [instruction, response], got {got}")
        turns.append({"role": "user", "content": _string(pair[0], f"{column}[{i}][0]")})
        turns.append({"role": "assistant", "content": _string(pair[1], f"{column}[{i}][1]")})
    return turns


def _normalize_text(row: dict[str, Any], cm: ColumnMap) -> dict[str, Any]:
    return {"text": _string(_required(row, "text", cm), cm.name("text"))}


def _normalize_messages(row: dict[str, Any], cm: ColumnMap) -> dict[str, Any]:
    path, role_key = cm.name("messages"), cm.name("role")
    messages = _message_list(_required(row, "messages", cm), path, role_key, cm.name("content"), cm.roles)
    out: dict[str, Any] = {"messages": _conversation(messages, path, role_key)}
    tools = _tools(row, cm)
    if tools is not None:
        out["tools"] = tools
    return out


def _normalize_alpaca(row: dict[str, Any], cm: ColumnMap) -> dict[str, Any]:
    instruction = _string(_required(row, "instruction", cm), cm.name("instruction"))
    extra = _string(row.get(cm.name("input")) or "", cm.name("input"), allow_empty=True)
    output = _string(_required(row, "output", cm), cm.name("output"))
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    turns = [*_history(row, cm), {"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return {"messages": _system(row, cm, turns, cm.name("instruction"))}


def _normalize_sharegpt(row: dict[str, Any], cm: ColumnMap) -> dict[str, Any]:
    path, role_key = cm.name("conversations"), cm.name("from")
    messages = _message_list(_required(row, "conversations", cm), path, role_key, cm.name("value"), cm.roles)
    # checked before the system column is put in front, so that error paths index the row's own list
    messages = _conversation(messages, path, role_key)
    out: dict[str, Any] = {"messages": _system(row, cm, messages, path)}
    tools = _tools(row, cm)
    if tools is not None:
        out["tools"] = tools
    return out


def _completion(value: Any, path: str) -> list[dict[str, str]]:
    """A chosen/rejected answer: a string, or a list of assistant messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": _string(value, path)}]
    messages = _message_list(value, path)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            raise FieldError(f"{path}[{i}].role", f"expected 'assistant' in a completion, got {m['role']!r}")
    return messages


def _normalize_preference(row: dict[str, Any], cm: ColumnMap) -> dict[str, Any]:
    path = cm.name("prompt")
    prompt = _required(row, "prompt", cm)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": _string(prompt, path)}]
    else:
        prompt = _message_list(prompt, path)
        if prompt[-1]["role"] != "user":
            raise FieldError(
                f"{path}[{len(prompt) - 1}].role", f"the prompt must end with a user turn, got {prompt[-1]['role']!r}"
            )
    prompt = _system(row, cm, prompt, path)
    chosen = _completion(_required(row, "chosen", cm), cm.name("chosen"))
    rejected = _completion(_required(row, "rejected", cm), cm.name("rejected"))
    if chosen == rejected:
        raise FieldError(cm.name("rejected"), f"identical to {cm.name('chosen')!r}: the pair teaches no preference")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


NORMALIZERS: dict[str, Callable[[dict[str, Any], ColumnMap], dict[str, Any]]] = {
    "text": _normalize_text,
    "messages": _normalize_messages,
    "alpaca": _normalize_alpaca,
    "sharegpt": _normalize_sharegpt,
    "preference": _normalize_preference,
}


def normalize_row(
    value: Any,
    fmt: str,
    text_field: str = "text",
    columns: dict[str, str] | None = None,
    roles: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The canonical form of one row of format `fmt`, its fields read through `columns` and `roles` (see
    DataSpec); FieldError names the field that is wrong."""
    return _normalize(value, ColumnMap.build(fmt, text_field, columns, roles))


def _normalize(value: Any, cm: ColumnMap) -> dict[str, Any]:
    """normalize_row with the mapping resolved once per dataset; a FieldError is marked with the spec fields
    that renamed its field."""
    if not isinstance(value, dict):
        raise FieldError("", f"expected a JSON object per row, got {_type_name(value)}")
    try:
        return NORMALIZERS[cm.fmt](value, cm)
    except FieldError as exc:
        exc.mapping = cm.note(exc.field)
        raise
