"""The data section of a stage: where its rows are, their format, columns, roles and cleaning."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from spec.fields import FieldError, Int64, OneLine, StrictModel

DataFormat = Literal["text", "messages", "alpaca", "sharegpt", "preference"]


FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "messages": ("messages", "role", "content", "tools"),
    "alpaca": ("instruction", "input", "output", "system", "history"),
    "sharegpt": ("conversations", "system", "tools", "from", "value"),
    "preference": ("prompt", "chosen", "rejected", "system"),
}


"""The names `data.columns` may map, per format: the row's columns, and the keys inside each message."""


MESSAGE_KEYS = frozenset({"role", "content", "from", "value"})


"""The keys of FORMAT_COLUMNS that name a key inside each message, not a column of the row."""


ROLE_NAMES = ("user", "assistant", "system", "tool", "function_call")


"""The canonical roles `data.roles` maps to the tags a dataset uses (function_call: LLaMA-Factory's sharegpt turn whose
value is the assistant's call, as JSON)."""


FORMATS_WITH_ROLES = ("messages", "sharegpt")


"""The formats whose messages carry a role tag (`data.roles` applies to them only)."""


class CleaningSpec(StrictModel):
    """What prepare removes from a dataset, judged on each row's text (stages/cleaning.py says which text)."""

    unicode_nfc: bool = Field(
        True,
        description="NFC-normalize every string of every row: Korean exported by macOS tools comes decomposed "
        "(NFD, each syllable as jamo), which tokenizes into different, longer tokens than the same text composed.",
    )
    dedup: bool = Field(
        True,
        description="Drop rows whose text repeats one kept before, across all files of the stage, comparing the "
        "text NFC-normalized, casefolded, with whitespace runs collapsed.",
    )
    near_dedup_threshold: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Drop rows whose estimated Jaccard similarity to a row kept before reaches this (e.g. 0.8), "
        "by MinHash LSH over 4-character shingles of the text without spaces and punctuation (robust to Korean "
        "spacing variants). None: no near-duplicate removal.",
    )
    near_dedup_num_perm: Int64 = Field(
        128,
        ge=16,
        le=1024,
        description="MinHash permutations for near_dedup_threshold: more estimate the similarity better and cost "
        "proportionally more time and memory.",
    )
    min_chars: Int64 = Field(0, ge=0, description="Drop rows whose text has fewer characters (after NFC).")
    max_chars: Int64 | None = Field(
        None, gt=0, description="Drop rows whose text has more characters (after NFC); None: no limit."
    )
    min_hangul_ratio: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Drop rows whose Hangul share of letters is below this: Hangul syllables and jamo over all "
        "letters (Hangul, Latin, Hanja...; digits, punctuation, symbols and spaces do not count). Above 0, a row "
        "without letters is dropped too; 0 turns the check off.",
    )
    decontaminate: bool = Field(
        True,
        description="Drop rows that contain evaluation text: the documents (questions, answers, choices) of "
        "stages.evaluate.lm_eval_tasks (not applied to stages.evaluate.data, itself evaluation data). A row is "
        "contaminated when its words equal an evaluation text's, or when it shares decontamination_ngram "
        "consecutive words with one (case and punctuation ignored).",
    )
    decontamination_ngram: Int64 = Field(
        13,
        ge=3,
        le=100,
        description="Words in a row for decontaminate: a run this long shared with an evaluation text drops the "
        "row; evaluation texts shorter than this match only a row equal to them. 13 follows GPT-3 and lm-eval's "
        "decontamination; Korean words (eojeol) include their particles and endings, so the same overlap is fewer "
        "words in Korean.",
    )

    pii: Literal["mask", "drop", "off"] = Field(
        "mask",
        description="Korean personal data in every text field of a row (stages/pii.py): resident and alien "
        "registration numbers (with their check digit, or written with the hyphen), mobile and landline numbers, "
        "card numbers (Luhn), bank accounts beside a bank word, e-mail addresses and passport numbers. 'mask' "
        "replaces each with its kind's tag ([주민등록번호], [전화번호], ...), 'drop' drops the row, 'off' keeps them "
        "as they are. Counted per kind in prepare's record; with mask or drop the values reach neither the prepared "
        "data nor the quarantine nor the logs.",
    )

    @model_validator(mode="after")
    def _coherent(self) -> CleaningSpec:
        if self.max_chars is not None and self.max_chars <= self.min_chars:
            raise FieldError(
                ("max_chars",),
                f"max_chars ({self.max_chars}) must be greater than min_chars ({self.min_chars}), or no row is kept",
            )
        return self


class DataSpec(StrictModel):
    """One dataset a stage reads."""

    uri: OneLine = Field(
        description="Where the data is: a JSONL (.jsonl), JSON array (.json), CSV or TSV (.csv, .tsv, with a header "
        "row) file, each optionally .gz or .zst, a Parquet or Arrow (.arrow) file, a folder of them "
        "(read at every level, in sorted order), or a glob ('*' and '?' within a folder, '**' across folders), on a "
        "mounted volume (a path, 'file://', 'pvc://<claim>/<path>'), in S3 or an S3-compatible store "
        "('s3://bucket/<key, prefix or glob>'; keys and endpoint from cluster.secrets, or IRSA), or in GCS "
        "('gs://bucket/<name, prefix or glob>'; Workload Identity); 'hf://datasets/org/name' for a hub dataset, or "
        "'builtin:<name>' for the data generated offline by the project. '{data_version}' is replaced by the "
        "pipeline's data_version.",
        min_length=1,
    )
    format: DataFormat = Field(
        description="Row format: text ({'text'}), messages (OpenAI chat: tool calls too, i.e. a row's 'tools', "
        "assistant 'tool_calls' and 'tool' messages, and 'reasoning_content'), alpaca (instruction/input/output), "
        "sharegpt (conversations/from/value), preference (prompt/chosen/rejected)."
    )
    split: str = Field("train", description="Split to read for hub datasets.")
    revision: OneLine | None = Field(
        None,
        description="For a hub dataset (hf://): the commit, tag or branch to read, as `datasets.load_dataset` takes "
        "it. A commit sha pins the rows: a scheduled run trains on the same data until the pipeline names another, "
        "and an offline machine (HF_HUB_OFFLINE=1) reads the copy cached in HF_HOME at that commit. None: the "
        "dataset's main branch as it is when prepare runs.",
        min_length=1,
    )
    text_field: str = Field(
        "text", min_length=1, description="Field holding the text for the 'text' format (the same as columns.text)."
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Where the format's fields are in the dataset: the format's name → the dataset's column (or "
        "message key), as LLaMA-Factory's dataset_info 'columns'. text: text; alpaca: instruction, input, output, "
        "system, history (earlier [instruction, response] pairs); sharegpt: conversations, system, and the message "
        "keys from, value; messages: messages, and the message keys role, content; sharegpt and messages also tools "
        "(the functions offered); preference: prompt, chosen, rejected, system. E.g. {input: context, output: "
        "response} reads databricks-dolly-15k as alpaca. Names not "
        "given keep the format's own.",
    )
    roles: dict[str, str] = Field(
        default_factory=dict,
        description="The role tags the messages use (sharegpt and messages only): user, assistant, system or tool → "
        "the dataset's tag, as LLaMA-Factory's user_tag/assistant_tag/system_tag/observation_tag, e.g. {user: human, "
        "assistant: gpt}; and, for sharegpt, function_call → LLaMA-Factory's function_tag (a turn whose value is the "
        "assistant's call as JSON). "
        "A role given here accepts only its tag; one not given accepts the defaults (sharegpt: human or user, gpt "
        "or assistant, system; messages: the role's own name).",
    )
    max_samples: Int64 | None = Field(None, gt=0, description="Use at most this many rows (after validation).")
    weight: float | None = Field(
        None,
        gt=0,
        description="In a list of datasets (a mixture), this dataset's share of the stage's training rows, relative "
        "to the other datasets' weights (LLaMA-Factory's interleave_probs): the stage trains on as many rows as its "
        "datasets' training rows add up to, and this dataset makes up weight / (sum of weights) of them, a sample of "
        "its rows drawn with the stage's training.seed when it has more, its rows repeated (whole passes, then a "
        "sample) when it has fewer. Set on every dataset of the list or on none (none: every row of each, "
        "concatenated). Held-out rows are never resampled.",
    )
    eval_fraction: float = Field(
        0.02, ge=0.0, lt=0.5, description="Fraction of rows held out for evaluation (perplexity, eval loss)."
    )
    max_bad_row_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of rows that may fail validation; they are quarantined and counted, never "
        "silently dropped. 0 makes any bad row an error.",
    )
    encoding: Literal["utf-8", "cp949", "euc-kr"] = Field(
        "utf-8",
        description="Byte encoding of JSONL files. cp949 (or its subset euc-kr) reads Korean exports of legacy "
        "Windows tools as they are, without converting them first; Parquet and hub datasets are unaffected.",
    )
    cleaning: CleaningSpec = Field(
        default_factory=CleaningSpec,
        description="Normalization, filters, deduplication and decontamination of the rows read, judged on a row's "
        "text: a text row's text, a chat row's message contents, a preference row's prompt and chosen answer.",
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme = uri.split(":", 1)[0] if re.match(r"^[a-z][a-z0-9+.-]*:", uri) else ""
        if scheme and scheme not in {"hf", "builtin", "file", "pvc", "gs", "s3"}:
            raise ValueError(f"unsupported URI scheme {scheme!r}; use a path, hf://, builtin:, gs:// or s3://")
        return uri

    @model_validator(mode="after")
    def _mapping(self) -> DataSpec:
        known = FORMAT_COLUMNS[self.format]
        for key, column in self.columns.items():
            if key not in known:
                raise FieldError(
                    ("columns", key),
                    f"format {self.format!r} has no column {key!r}; it has {', '.join(known)}",
                )
            if not column:
                raise FieldError(("columns", key), "an empty column name")
        if "text" in self.columns and self.text_field not in ("text", self.columns["text"]):
            raise FieldError(
                ("columns", "text"),
                f"columns.text ({self.columns['text']!r}) and text_field ({self.text_field!r}) both name the text "
                "column; set one of them",
            )
        # Two names read from one column (or message key) is a mapping mistake, never a way to copy a value.
        for group in ([k for k in known if k not in MESSAGE_KEYS], [k for k in known if k in MESSAGE_KEYS]):
            seen: dict[str, str] = {}
            for key in group:
                column = self.columns.get(key, key)
                if column in seen:
                    first = seen[column]
                    names = [f"columns.{k}" if k in self.columns else f"{k} (not mapped)" for k in (first, key)]
                    raise FieldError(
                        ("columns", key if key in self.columns else first),
                        f"{names[0]} and {names[1]} both read {column!r}; map each to its own column",
                    )
                seen[column] = key
        if self.revision is not None and not self.uri.startswith("hf://"):
            raise FieldError(("revision",), "revision names a hub dataset's commit: it applies to hf:// URIs only")
        if self.roles and self.format not in FORMATS_WITH_ROLES:
            raise FieldError(
                ("roles",),
                f"format {self.format!r} has no role tags; roles applies to {' and '.join(FORMATS_WITH_ROLES)}",
            )
        tags: dict[str, str] = {}
        for role, tag in self.roles.items():
            if role not in ROLE_NAMES:
                raise FieldError(("roles", role), f"{role!r} is not a role; roles maps {', '.join(ROLE_NAMES)}")
            if not tag:
                raise FieldError(("roles", role), "an empty role tag")
            if tag in tags:
                raise FieldError(("roles", role), f"roles.{role} and roles.{tags[tag]} are both {tag!r}")
            tags[tag] = role
        return self


def _one_or_many(value: Any) -> str:
    return "tagged-datasets" if isinstance(value, list) else "tagged-dataset"


# The tag names start with "tagged-", which the spec's error lines leave out of a field's path (spec/loading.py).
StageData = Annotated[
    Annotated[DataSpec, Tag("tagged-dataset")] | Annotated[list[DataSpec], Tag("tagged-datasets")],
    Discriminator(_one_or_many),
]
"""A stage's data: one dataset, or a list of datasets (a mixture, each with its own uri, format, columns, cleaning
and weight)."""


def datasets(data: DataSpec | list[DataSpec] | None) -> list[DataSpec]:
    """A stage's datasets as a list ([] when it has none)."""
    if data is None:
        return []
    return list(data) if isinstance(data, list) else [data]


def dataset_loc(data: DataSpec | list[DataSpec], index: int) -> tuple[str | int, ...]:
    """The location of a stage's dataset within the stage's section, as FieldError takes it."""
    return ("data", index) if isinstance(data, list) else ("data",)


def check_mixture(data: DataSpec | list[DataSpec] | None, weighted: bool = True) -> None:
    """FieldError for a stage's data that is no mixture a stage can read: an empty list, weights on some datasets
    only, or a weight outside a list (or on any dataset when `weighted` is False: the evaluate stage's data)."""
    if data is None:
        return
    if not isinstance(data, list):
        if data.weight is not None:
            raise FieldError(
                ("data", "weight"), "weight is a dataset's share in a list of datasets; a single dataset has no share"
            )
        return
    if not data:
        raise FieldError(("data",), "an empty list of datasets; give one dataset or several")
    weights = [d.weight is not None for d in data]
    if not weighted and any(weights):
        at = weights.index(True)
        raise FieldError(
            ("data", at, "weight"),
            "held-out data is never resampled: every row of each dataset is evaluated; remove the weight",
        )
    if any(weights) and not all(weights):
        at = weights.index(False)
        raise FieldError(
            ("data", at, "weight"),
            "weights set on some datasets of the list only: set a weight on every dataset, or on none to take every "
            "row of each",
        )
