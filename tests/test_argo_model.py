"""Unit tests of tests/argo_model.py: the label-selector parser, gjson lookups and Argo's verdict."""

from __future__ import annotations

import pytest
from argo_model import (
    Operator,
    SelectorParseError,
    evaluate,
    gjson_get,
    gjson_string,
    parse_selector,
)
from hypothesis import given
from hypothesis import strategies as st
from pytorchjob_status import scenario

SUCCEEDED_JOB = {
    "status": {
        "conditions": [
            {"type": "Created", "status": "True"},
            {"type": "Running", "status": "False"},
            {"type": "Succeeded", "status": "True"},
        ],
        "replicaStatuses": {"Master": {"succeeded": 1}},
    }
}


# --------------------------------------------------------------------------- parser


@pytest.mark.parametrize(
    ("text", "key", "operator", "values"),
    [
        ("a.b = x", "a.b", Operator.EQUALS, {"x"}),
        ("a.b==x", "a.b", Operator.DOUBLE_EQUALS, {"x"}),
        ("a.b != x", "a.b", Operator.NOT_EQUALS, {"x"}),
        ("a.b in (x, y)", "a.b", Operator.IN, {"x", "y"}),
        ("a.b notin (x)", "a.b", Operator.NOT_IN, {"x"}),
        ("a.b", "a.b", Operator.EXISTS, set()),
        ("!a.b", "a.b", Operator.DOES_NOT_EXIST, set()),
        ("a.b > 0", "a.b", Operator.GREATER_THAN, {"0"}),
        ("a.b<10", "a.b", Operator.LESS_THAN, {"10"}),
        ("a.b =", "a.b", Operator.EQUALS, {""}),
        ("a.b in ()", "a.b", Operator.IN, {""}),
        ("a.b in (x,)", "a.b", Operator.IN, {"x", ""}),
        ("a.b = in", "a.b", Operator.EQUALS, {"in"}),
        ("example.com/Key = v", "example.com/Key", Operator.EQUALS, {"v"}),
        ("status.conditions.0.type == Succeeded", "status.conditions.0.type", Operator.DOUBLE_EQUALS, {"Succeeded"}),
    ],
)
def test_parses_each_operator(text: str, key: str, operator: Operator, values: set[str]) -> None:
    [req] = parse_selector(text)
    assert (req.key, req.operator, set(req.values)) == (key, operator, values)


def test_parses_a_list_sorted_by_key() -> None:
    reqs = parse_selector("z.b == 1, a.c, !m.n,  x in (p,q)")
    assert [r.key for r in reqs] == ["a.c", "m.n", "x", "z.b"]
    assert [str(r) for r in reqs] == ["a.c", "!m.n", "x in (p,q)", "z.b==1"]


def test_empty_selector_has_no_requirements() -> None:
    assert parse_selector("") == []
    assert parse_selector("   ") == []


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        # gjson array queries are not label keys: Argo rejects them when it parses the condition.
        ("status.conditions.#(type==Failed).status == True", "key"),
        ("status.conditions.#(type==Failed)#", "key"),
        ("status.conditions.#.type == Failed", "key"),
        ("status.conditions.*.type == Failed", "key"),
        ("a.b > -1", "values[0]"),  # '-1' is an integer but not a valid label value
        ("a.b > x", "must be an integer"),
        ("a.b > 1.5", "must be an integer"),
        ("a.b = x y", "expected: ',' or 'end of string'"),
        ("a.b = (x)", "expected: identifier"),
        ("a.b in x", "expected: '('"),
        ("a.b in (x", "expected: ',' or ')'"),
        ("a.b notin", "expected: '('"),
        ("a.b,", "identifier after ','"),
        (", a.b", "expected: !, identifier"),
        ("!a.b = x", "expected: ',' or 'end of string'"),
        ("!", "expected: identifier"),
        ("a.b = Has Space", "expected: ',' or 'end of string'"),
        ("a.b = " + "v" * 64, "no more than 63"),
        ("x" * 64 + " = v", "no more than 63"),
        ("Example.com/key = v", "prefix part"),
        ("/key = v", "prefix part must be non-empty"),
        ("a/b/c = v", "at most one '/'"),
        (".status.phase = Running", "key"),
        ("a.b =! x", "expected: identifier"),
        ("a.b <= 3", "expected: identifier"),
        ("a.b ~ x", "expected: in, notin"),
    ],
)
def test_rejects_what_labels_parse_rejects(text: str, fragment: str) -> None:
    with pytest.raises(SelectorParseError) as info:
        parse_selector(text)
    assert fragment in str(info.value)


def test_evaluate_raises_on_an_unparsable_condition() -> None:
    with pytest.raises(SelectorParseError):
        evaluate(SUCCEEDED_JOB, success_condition="status.conditions.#(type==Succeeded).status == True")
    with pytest.raises(SelectorParseError):
        evaluate(SUCCEEDED_JOB, failure_condition="status.conditions.#(type==Failed)")


# --------------------------------------------------------------------------- gjson


DOC = {
    "a": {"int": 3, "neg": -2, "float": 1.5, "big": 1e21, "whole": 2.0, "t": True, "f": False, "null": None},
    "s": "text",
    "list": [{"k": "first"}, {"k": "second"}],
    "obj": {"z": 1, "a": "<&>"},
    "numkey": {"0": "zero"},
}


@pytest.mark.parametrize(
    ("path", "exists", "string"),
    [
        ("a.int", True, "3"),
        ("a.neg", True, "-2"),
        ("a.float", True, "1.5"),
        ("a.big", True, "1000000000000000000000"),
        ("a.whole", True, "2"),
        ("a.t", True, "true"),
        ("a.f", True, "false"),
        ("a.null", True, ""),  # null exists; its String() is empty
        ("s", True, "text"),
        ("list.1.k", True, "second"),
        ("list.01.k", True, "second"),  # gjson reads the index as an unsigned number
        ("list.2.k", False, ""),
        ("list.k", False, ""),
        ("numkey.0", True, "zero"),  # on an object a number is just a key
        ("obj", True, '{"a":"\\u003c\\u0026\\u003e","z":1}'),
        ("list", True, '[{"k":"first"},{"k":"second"}]'),
        ("missing", False, ""),
        ("s.deeper", False, ""),
        ("a.int.x", False, ""),
    ],
)
def test_gjson_get(path: str, exists: bool, string: str) -> None:
    result = gjson_get(DOC, path)
    assert (result.exists, result.string) == (exists, string)


def test_gjson_escaped_dot_reads_a_dotted_key() -> None:
    assert gjson_get({"a.b": {"c": 1}}, "a\\.b.c").string == "1"
    assert not gjson_get({"a.b": {"c": 1}}, "a.b.c").exists


def test_gjson_refuses_unmodelled_syntax() -> None:
    with pytest.raises(ValueError, match="not modelled"):
        gjson_get(DOC, "list.#.k")


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_gjson_integers_read_back_exactly(value: int) -> None:
    assert gjson_string(value) == str(value)


# --------------------------------------------------------------------------- matching and the verdict


@pytest.mark.parametrize(
    ("condition", "doc", "matched"),
    [
        ("a != x", {}, True),  # != matches an absent key
        ("a notin (x)", {}, True),
        ("a = x", {}, False),
        ("a in (x, y)", {"a": "y"}, True),
        ("a == ", {"a": None}, True),  # null exists and reads as ''
        ("a", {"a": None}, True),
        ("!a", {"a": None}, False),
        ("!a", {}, True),
        ("a > 0", {}, False),  # > needs the key
        ("a > 0", {"a": 1}, True),
        ("a > 0", {"a": "1"}, True),  # compared as int64 whatever the JSON type
        ("a > 0", {"a": 0}, False),
        ("a < 5", {"a": -3}, True),
        ("a > 0", {"a": 1.5}, False),  # '1.5' does not parse as int64
        ("a > 0", {"a": True}, False),
        ("a > 0", {"a": 2**63}, False),  # overflows int64
        ("a = 1", {"a": 1.0}, True),  # a whole float reads as '1'
        ("a = true", {"a": True}, True),
        ("a = True", {"a": True}, False),
        ("a.0 = x", {"a": ["x"]}, True),
        ("a.b = c", {"a": {"b": {"c": 1}}}, False),
    ],
)
def test_single_requirement(condition: str, doc: dict, matched: bool) -> None:
    assert evaluate(doc, success_condition=condition) == ("succeeded" if matched else "running")
    assert evaluate(doc, failure_condition=condition) == ("failed" if matched else "succeeded")


def test_failure_requirements_are_ored() -> None:
    doc = {"a": "1", "b": "2"}
    assert evaluate(doc, "x", "a == 9, b == 2") == "failed"
    assert evaluate(doc, "x", "a == 9, b == 9") == "running"


def test_success_requirements_are_anded() -> None:
    doc = {"a": "1", "b": "2"}
    assert evaluate(doc, "a == 1, b == 2") == "succeeded"
    assert evaluate(doc, "a == 1, b == 3") == "running"


def test_failure_wins_over_success() -> None:
    assert evaluate({"a": "1"}, "a == 1", "a == 1") == "failed"


def test_no_conditions_succeed_at_once() -> None:
    assert evaluate({}, "", "") == "succeeded"
    assert evaluate({}, failure_condition="a == 1") == "succeeded"


def test_accepts_json_text() -> None:
    assert evaluate('{"status": {"phase": "Done"}}', "status.phase == Done") == "succeeded"


def test_naive_first_condition_check_never_sees_success() -> None:
    """The condition a first attempt would write: index 0 is always Created, so it waits forever."""
    naive = "status.conditions.0.type == Succeeded"
    assert evaluate(SUCCEEDED_JOB, success_condition=naive) == "running"
    document = scenario("succeeded-master-only").build().document()
    assert evaluate(document, success_condition=naive) == "running"
    assert evaluate(document, success_condition="status.replicaStatuses.Master.succeeded > 0") == "succeeded"


def test_last_condition_cannot_be_addressed() -> None:
    """gjson's '@reverse' and '-1' would pick the last condition, but neither is a label key."""
    with pytest.raises(SelectorParseError):
        parse_selector("status.conditions.@reverse.0.type == Failed")
    assert not gjson_get(SUCCEEDED_JOB, "status.conditions.-1.type").exists
