"""`python -m stages check-data --spec FILE`: each enabled stage's data checked on its first rows, before a run starts.

What prepare would refuse only after minutes of reading (or, under `--local`, after the run directory and the
stages' processes exist) is found here in well under a second, with the data plane's own readers and validation:

- the data URI names readable data: the file, folder or glob exists and has data files (`stages.sources`);
- the first SAMPLE_ROWS rows of each of its files (at most MAX_SAMPLED_FILES files) decode in `data.encoding`, are
  JSON objects (or Parquet rows) and validate as `data.format` through `data.columns` and `data.roles`
  (`stages.normalize`), as prepare's workers do with every row.

A sampled row that prepare would quarantine is a problem only where prepare would fail on it: with
`max_bad_row_fraction: 0` (the default) any bad row fails the dataset; with a fraction above 0, only a file whose
sampled rows all fail the same way (a wrong encoding, format or column mapping, not a bad row), or a dataset read
whole here whose bad rows are over the fraction. With `max_samples` only the rows prepare reads are sampled.

Each distinct problem is one line naming the stage, the file and line, and the field or column: the lines of a
file that are not in its encoding are one line (the first bad line and byte, and what to do), a column the mapping
names and no sampled row has is one line, and rows that fail alike are one line (the first, with the others'
line numbers). At most MAX_PROBLEMS lines per stage.

Data this machine may not see is skipped: hub datasets (`hf://`) and builtin data always, buckets (`s3://`,
`gs://`) unless `--remote` (prepare's own check, in the pod, reads their first object), and with `--visible-only`
(for `submit --dry-run`, whose data lives on the cluster's volumes) a local path that does not exist here.

Exit 0 when nothing is wrong; 2 with one `error:` line per problem on stderr. prepare runs the same check
(`check_data`) before its workers start.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from run.exits import EXIT_OK, EXIT_USAGE
from spec.data import datasets
from spec.document import SpecError
from spec.quoting import quoted
from stages.data import (
    DataError,
    RawRow,
    RowError,
    _excerpt,
    _UnmappedColumn,
    check_stage_format,
    data_field,
    max_row_bytes,
    parse_row,
    resolve_path,
)
from stages.normalize import ColumnMap, FieldError, MissingField, _normalize
from stages.pii import mask

if TYPE_CHECKING:
    from spec.data import DataSpec
    from spec.pipeline import PipelineSpec
    from stages.sources import SourceObject

DATA_STAGES = ("cpt", "sft", "rlhf", "evaluate")
"""Stages that read a dataset, in DAG order."""

SAMPLE_ROWS = 20
"""Rows read from the start of each file."""

MAX_SAMPLED_FILES = 32
"""Files of a folder, glob or prefix sampled (the first, in the order prepare reads them); all are listed."""

MAX_PROBLEMS = 5
"""Problem lines per stage; more are counted on a last line."""

REMOTE_PREFIXES = ("s3://", "gs://")
SKIPPED_PREFIXES = ("hf://", "builtin:")


def data_specs(spec: PipelineSpec) -> dict[str, list[DataSpec]]:
    """The datasets of every enabled stage that has data (one, or the list of a mixture)."""
    out = {}
    for stage in DATA_STAGES:
        section = spec.stage(stage)
        data = getattr(section, "data", None)
        if section.enabled and data is not None:
            out[stage] = datasets(data)
    return out


def dataset_index(spec: PipelineSpec, stage: str, index: int) -> int | None:
    """The index that names a stage's dataset in the spec: its place in the stage's list, None for a single one."""
    return index if isinstance(getattr(spec.stage(stage), "data", None), list) else None


@dataclass
class _Group:
    """Sampled rows of one file that fail alike: the first one's error, and the other lines."""

    first: RowError
    lines: list[int] = field(default_factory=list)


@dataclass
class _FileSample:
    """What the first rows of one file showed."""

    uri: str
    rows: int = 0
    bad: int = 0
    ended: bool = False
    """The whole file was read."""
    groups: dict[tuple[str, str], _Group] = field(default_factory=dict)
    unmapped: _UnmappedColumn = field(default_factory=_UnmappedColumn)
    with_tools: int | None = None
    """The line of the first valid row with tools, tool calls or tool answers."""


def check_data(
    spec: PipelineSpec, run_root: Path | None = None, *, remote: bool = False, visible_only: bool = False
) -> list[str]:
    """The problems of every enabled stage's data, one line each (without `error: `); [] when there are none.
    `run_root`: the run directory that will read it (in the cluster, data must lie on its volumes); `remote`:
    sample buckets too; `visible_only`: skip local paths that do not exist on this machine."""
    problems: list[str] = []
    for stage, mixture in data_specs(spec).items():
        for i, data in enumerate(mixture):
            index = dataset_index(spec, stage, i)
            problems += check_stage_data(
                spec, stage, data, run_root, remote=remote, visible_only=visible_only, index=index
            )
    return problems


def check_stage_data(
    spec: PipelineSpec,
    stage: str,
    data: DataSpec,
    run_root: Path | None = None,
    *,
    remote: bool = False,
    visible_only: bool = False,
    index: int | None = None,
) -> list[str]:
    """The problems of one dataset of a stage (see the module docstring; `index`: its place in the stage's list)."""
    uri = spec.data_uri(data)
    field = data_field(stage, index)
    where = f"{field} ({quoted(uri)})"
    if uri.startswith(SKIPPED_PREFIXES) or (uri.startswith(REMOTE_PREFIXES) and not remote):
        return []
    try:
        check_stage_format(stage, data.format, index)
    except DataError as exc:
        return [str(exc)]
    try:
        if visible_only and not uri.startswith(REMOTE_PREFIXES) and not _visible(uri, spec):
            return []
        from stages.sources import list_objects

        objects = list_objects(uri, spec, run_root)
        if uri.startswith(REMOTE_PREFIXES):
            objects = objects[:1]  # a request per object: the first shows a wrong format, mapping or encoding
        samples = _sample(objects[:MAX_SAMPLED_FILES], data)
    except DataError as exc:
        return [f"{field}: {exc}"]
    return _problems(samples, data, field, where) + _tools_problem(samples, spec, where)


def uses_tools(row: dict[str, Any]) -> bool:
    """Whether a canonical chat row offers functions, calls one or answers a call."""
    messages = row.get("messages") or []
    return "tools" in row or any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def _tools_problem(samples: list[_FileSample], spec: PipelineSpec, where: str) -> list[str]:
    """One line when the data has tool calls and the model's chat template, known before the run, has no tool
    syntax (prepare finds it too, with the tokenizer, for a model whose template only the hub has)."""
    first = next((s for s in samples if s.with_tools is not None), None)
    if first is None:
        return []
    name, text = known_template(spec)
    if text is None or "tool_calls" in text:
        return []
    return [
        f"{where}: {quoted(first.uri)}:{first.with_tools}: a conversation with tools, and the model's chat template "
        f"({name}) has no tool syntax: it would drop the calls or refuse them; train tool calls on a model whose "
        "template has it (Qwen2.5, Qwen3), or set model.chat_template to such a template"
    ]


def known_template(spec: PipelineSpec) -> tuple[str, str | None]:
    """The model's chat template as this machine can know it before the run: model.chat_template, the family
    template of a model built from config, or a local model folder's own; (name, None) when only the hub has it."""
    from stages.chat import FAMILY_TEMPLATE, TemplateError, template_text

    model = spec.model
    name = model.chat_template or (FAMILY_TEMPLATE[model.from_config.architecture] if model.from_config else None)
    if name is not None:
        try:
            return name, template_text(name)
        except TemplateError:
            return name, None  # a template file that is not here: the stage says so
    try:
        folder = resolve_path(model.name_or_path, spec)
    except DataError:
        return model.name_or_path, None
    for candidate in (folder / "chat_template.jinja", folder / "tokenizer_config.json"):
        try:
            text = candidate.read_text(encoding="utf-8")
            if candidate.suffix == ".json":
                text = json.loads(text).get("chat_template")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
        return f"{model.name_or_path}'s own", text if isinstance(text, str) else None
    return model.name_or_path, None


def _visible(uri: str, spec: PipelineSpec) -> bool:
    """Whether a local data path (or a glob's folder) exists on this machine."""
    from stages.sources import has_wildcards

    path = resolve_path(uri, spec)
    if has_wildcards(path.as_posix()) and not path.exists():
        parts = path.parts
        first = next(i for i, part in enumerate(parts) if has_wildcards(part))
        path = Path(*parts[:first]) if first else Path(".")
    return path.exists() or path.is_symlink()


def _sample(objects: list[SourceObject], data: DataSpec) -> list[_FileSample]:
    """The first rows of each file through parsing and validation, in prepare's order; with max_samples, no more
    rows in all than prepare reads at least."""
    mapping = ColumnMap.of(data)
    limit = max_row_bytes()
    budget = data.max_samples
    samples = []
    for obj in objects:
        if budget is not None and budget <= 0:
            break
        wanted = SAMPLE_ROWS if budget is None else min(SAMPLE_ROWS, budget)
        sample = _FileSample(obj.uri)
        raws = _first_rows(obj, wanted + 1, limit, data.encoding)  # one more: whether the file ends within the sample
        sample.ended = len(raws) <= wanted
        for raw in raws[:wanted]:
            _see(sample, parse_row(raw, limit, data.encoding), mapping)
        if not raws:
            raise DataError(f"{quoted(obj.uri)}: empty file: no rows (an export that failed?)")
        samples.append(sample)
        if budget is not None:
            budget -= sample.rows
    return samples


def _first_rows(obj: SourceObject, n: int, limit: int, encoding: str) -> list[RawRow]:
    """The first `n` raw rows of a file or object, read as prepare reads them."""
    import tempfile

    from stages.file_formats import object_rows

    rows = object_rows(obj, limit, encoding, Path(tempfile.gettempdir()))
    try:
        return list(islice(rows, n))
    finally:
        rows.close()


def _see(sample: _FileSample, raw: RawRow, mapping: ColumnMap) -> None:
    """Validate one parsed row as prepare's workers do, and file its error with those like it."""
    sample.rows += 1
    error, present = raw.error, None
    if error is None:
        try:
            row = _normalize(raw.value, mapping)
            if sample.with_tools is None and uses_tools(row):
                sample.with_tools = raw.line
        except FieldError as exc:
            error = RowError(raw.file, raw.line, exc.field, exc.error, _excerpt(raw.value), exc.mapping)
            present = exc.present if isinstance(exc, MissingField) else None
    if error is None:
        sample.unmapped.stop()
        return
    sample.bad += 1
    if error.field or present is not None:
        sample.unmapped.see(error.field, present, error, mapping)
    else:
        sample.unmapped.stop()
    if error.undecodable is not None:
        key = ("", "undecodable")
    else:  # the same problem at the same place, whichever message of the row it is in
        key = (re.sub(r"\[\d+\]", "[]", error.field), re.sub(r"\[\d+\]", "[]", error.error))
    group = sample.groups.setdefault(key, _Group(error))
    if group.first is not error:
        group.lines.append(error.line)


def _problems(samples: list[_FileSample], data: DataSpec, field: str, where: str) -> list[str]:
    """The lines to print for a stage's sampled files: only what prepare would fail on (module docstring)."""
    whole = all(s.ended for s in samples) and bool(samples)  # the dataset was read whole here
    rows, bad = sum(s.rows for s in samples), sum(s.bad for s in samples)
    strict = data.max_bad_row_fraction == 0 or (whole and rows and bad / rows > data.max_bad_row_fraction)
    problems = []
    for sample in samples:
        if not sample.bad:
            continue
        if sample.unmapped.rows:  # every sampled row lacks the same mapped column: the mapping is wrong
            problems.append(str(sample.unmapped.error(where, field, every=sample.ended)))
            continue
        for group in sample.groups.values():
            alike = len(group.lines) + 1 == sample.rows  # every sampled row of the file fails this way
            if strict or alike:
                problems.append(f"{where}: {_group_line(group, sample, field)}")
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS + 1
        problems = [*problems[: MAX_PROBLEMS - 1], f"{where}: and {more} more problems in the first rows of its files"]
    if data.cleaning.pii != "off":  # a value an error quotes is masked as prepare masks it (stages/pii.py)
        problems = [mask(line)[0] for line in problems]
    return problems


def _group_line(group: _Group, sample: _FileSample, field: str) -> str:
    """One line for rows of a file that fail alike: the first, and how many more."""
    first = group.first
    if first.undecodable is not None:
        others = len(group.lines)
        of = "its first" if not sample.ended else "its"
        more = f", and so are {others} more of {of} {sample.rows} lines" if others else ""
        message = first.undecodable.message(first.file, f"{field}.encoding", more)
        return f"{quoted(first.file)}:{first.line}: {message}"
    if not group.lines:
        return str(first)
    shown = ", ".join(str(n) for n in group.lines[:5]) + (", ..." if len(group.lines) > 5 else "")
    return f"{first} (also line{'s' if len(group.lines) > 1 else ''} {shown})"


def main(argv: list[str] | None = None) -> int:
    """`python -m stages check-data --spec FILE [--run-dir DIR] [--remote] [--visible-only]`."""
    parser = argparse.ArgumentParser(
        prog="python -m stages check-data",
        description="Check each enabled stage's data on its first rows; exit 2 with one error: line per problem.",
    )
    parser.add_argument("--spec", required=True, type=Path, help="A resolved spec, as JSON (what spec.json holds).")
    parser.add_argument("--run-dir", type=Path, help="The run directory that will read the data (its rules apply).")
    parser.add_argument("--remote", action="store_true", help="Sample the first object of s3:// and gs:// data too.")
    parser.add_argument(
        "--visible-only", action="store_true", help="Skip local paths that do not exist on this machine."
    )
    args = parser.parse_args(argv)
    from spec.loading import spec_from_json

    try:
        spec = spec_from_json(args.spec.read_text(encoding="utf-8"), str(args.spec))
    except OSError as exc:
        print(f"error: {args.spec}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    problems = check_data(spec, args.run_dir, remote=args.remote, visible_only=args.visible_only)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return EXIT_USAGE if problems else EXIT_OK
