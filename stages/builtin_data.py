"""The offline Korean datasets (`builtin:<name>` data URIs), generated deterministically from konlpy's corpus files.

The text is never stored in this repository: it is read from the installed `konlpy` package (located with
`importlib.util.find_spec`, without importing konlpy, which needs Java). The Constitution of the Republic of
Korea (`kolaw/constitution.txt`) and ten National Assembly bills (`kobill/*.txt`) become five datasets:

- `korean-corpus` (text): the preamble, one document per article of the main body, and eight bills.
- `korean-instructions` (messages): questions about articles, chapters and bills, answered from the corpus.
- `korean-preferences` (preference): the right answer chosen; a wrong article, a truncated or a garbled
  answer rejected.
- `korean-heldout` (text): the supplementary provisions (부칙) and two bills that no other dataset uses.
- `korean-dolly` (alpaca through `columns: {input: context, output: response}`): rows shaped exactly like
  databricks-dolly-15k, `{instruction, context, response, category}` with dolly's eight categories, so that a
  pipeline written for dolly runs offline on it.

and one folder of lm-eval-harness tasks (`builtin:korean-lm-eval` as `stages.evaluate.lm_eval_include_path`):

- `ko_constitution_mc` (multiple choice): the start of an article, and its true continuation among four (the
  other three continue other articles). It asks what cpt was trained on: did the model learn the corpus?

Every row but korean-dolly's is already in the canonical form of its kind (see `stages.data`); korean-dolly's
are in dolly's own column names, which the spec's `columns` maps. The same installed files always give the same
rows (fixed seeds, sorted files).
"""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from spec.lm_eval_tasks import LM_EVAL_TASKS

SEED = 20101115
"""Seed of every random choice below (phrasings, system prompts, rejected answers)."""

HELDOUT_BILLS = 2
"""The last bills (by file name) go to korean-heldout only."""

SYSTEM_PROMPT = "당신은 대한민국 헌법과 국회 법률안을 정확하게 안내하는 한국어 도우미입니다."


class BuiltinDataError(Exception):
    """The builtin data cannot be generated (konlpy missing, corpus files changed shape)."""


@dataclass(frozen=True)
class Article:
    """One article (조) of the constitution."""

    number: int
    text: str
    chapter: int
    chapter_title: str
    section_title: str | None = None


@dataclass
class Chapter:
    """One chapter (장) of the constitution."""

    number: int
    title: str
    articles: list[Article] = field(default_factory=list)


@dataclass(frozen=True)
class Bill:
    """One National Assembly bill (의안)."""

    file: str
    number: str
    title: str
    reason: str
    text: str


@dataclass(frozen=True)
class Constitution:
    """The parsed constitution."""

    title: str
    preamble: str
    chapters: list[Chapter]
    supplementary: list[str]
    """Articles of the supplementary provisions (부칙), one string each."""

    @property
    def articles(self) -> list[Article]:
        return [a for c in self.chapters for a in c.articles]


# --------------------------------------------------------------------------- locating and parsing the corpus


def corpus_dir() -> Path:
    """`konlpy/data/corpus` of the installed konlpy package, found without importing it."""
    spec = importlib.util.find_spec("konlpy")
    if spec is None or not spec.submodule_search_locations:
        raise BuiltinDataError(
            "the builtin datasets are generated from the konlpy package's corpus, but konlpy is not installed "
            "(pip install 'konlpy==0.6.0'; Java is not needed)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "corpus"
    if not (path / "kolaw" / "constitution.txt").is_file():
        raise BuiltinDataError(f"{path}/kolaw/constitution.txt is missing from the installed konlpy package")
    return path


def source_files() -> list[Path]:
    """The corpus files the datasets are made of, in a fixed order."""
    root = corpus_dir()
    return [root / "kolaw" / "constitution.txt", *sorted((root / "kobill").glob("*.txt"))]


_CHAPTER = re.compile(r"^\s*제(\d+)장\s+(.+?)\s*$")
_SECTION = re.compile(r"^\s*제(\d+)절\s+(.+?)\s*$")
_ARTICLE = re.compile(r"^\s*제(\d+)조\s")


@cache
def constitution() -> Constitution:
    """Parse `kolaw/constitution.txt` into preamble, chapters with articles, and supplementary provisions."""
    path = corpus_dir() / "kolaw" / "constitution.txt"
    lines = path.read_text(encoding="utf-8").splitlines()
    title = lines[0].strip()
    preamble: list[str] = []
    chapters: list[Chapter] = []
    supplementary: list[str] = []
    section: str | None = None
    current: list[str] | None = None  # lines of the article being read
    in_supplementary = False

    def close_article() -> None:
        nonlocal current
        if current is not None:
            number = int(_ARTICLE.match(current[0]).group(1))  # type: ignore[union-attr]
            chapter = chapters[-1]
            text = "\n".join(current)
            chapter.articles.append(Article(number, text, chapter.number, chapter.title, section))
        current = None

    for raw in lines[1:]:
        line = raw.strip()
        if not line:
            continue
        if "부칙" in line and not _ARTICLE.match(line):
            close_article()
            in_supplementary = True
        elif in_supplementary:
            if _ARTICLE.match(line) or not supplementary:
                supplementary.append(line)
            else:
                supplementary[-1] += "\n" + line
        elif m := _CHAPTER.match(line):
            close_article()
            chapters.append(Chapter(int(m.group(1)), m.group(2)))
            section = None
        elif m := _SECTION.match(line):
            close_article()
            section = f"제{m.group(1)}절 {m.group(2)}"
        elif _ARTICLE.match(line):
            close_article()
            current = [line]
        elif current is not None:
            current.append(line)
        else:
            preamble.append(line)
    close_article()
    if len(chapters) < 10 or sum(len(c.articles) for c in chapters) < 100 or not supplementary:
        raise BuiltinDataError(f"{path}: unexpected layout (found {len(chapters)} chapters)")
    return Constitution(title, "\n".join(preamble), chapters, supplementary)


def _join_wrapped(lines: list[str]) -> str:
    """Join lines wrapped mid-word: after a line ending in a space the next follows a space, else directly."""
    out = ""
    line_ended_with_space = False
    for line in lines:
        out += line.strip() if not out or not line_ended_with_space else " " + line.strip()
        line_ended_with_space = line.rstrip("\n").endswith((" ", "\t", "."))
    return re.sub(r"\s+", " ", out).strip()


@cache
def bills() -> list[Bill]:
    """Parse `kobill/*.txt` (sorted by file name): title, bill number, the reason for the proposal, full text."""
    result = []
    for path in sorted((corpus_dir() / "kobill").glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        title_lines = []
        for line in lines:
            if line.strip().startswith("(") or re.match(r"^\s*의\s*안", line):
                break
            if line.strip():
                title_lines.append(line.strip())
        number = next((ln.strip() for ln in lines if re.fullmatch(r"\s*\d{4}\s*", ln)), path.stem[-4:])
        start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("제안이유")), None)
        if start is None or not title_lines:
            raise BuiltinDataError(f"{path}: no title or no '제안이유' section")
        body = []
        for line in lines[start + 1 :]:
            if re.match(r"^\s*(주요내용|참고사항|- \d+ -|법률\s+제)", line):
                break
            if line.strip():
                body.append(line)
        reason = _join_wrapped(body)
        sentences = re.split(r"(?<=[.])\s+", reason)
        summary = " ".join(sentences[:2])[:400]
        title = re.sub(r"\s+", " ", " ".join(title_lines)).replace(" ·", "·").strip()
        clean = "\n".join(ln.rstrip() for ln in lines if ln.strip())
        result.append(Bill(path.name, number, title, summary, clean))
    if len(result) <= HELDOUT_BILLS:
        raise BuiltinDataError("the konlpy kobill corpus has too few bills")
    return result


# --------------------------------------------------------------------------- the datasets


def _heading(article: Article) -> str:
    parts = [f"제{article.chapter}장 {article.chapter_title}"]
    if article.section_title:
        parts.append(article.section_title)
    return " ".join(parts)


def korean_corpus() -> list[dict[str, Any]]:
    """Text documents for continued pre-training: preamble, each article (with its heading), eight bills."""
    con = constitution()
    docs = [f"{con.title}\n전문\n{con.preamble}"]
    docs += [f"{con.title} {_heading(a)}\n{a.text}" for a in con.articles]
    docs += [bill.text for bill in bills()[:-HELDOUT_BILLS]]
    return [{"text": d} for d in docs]


def korean_heldout() -> list[dict[str, Any]]:
    """Text documents no training dataset contains: the supplementary provisions and the last two bills."""
    con = constitution()
    docs = [f"{con.title} 부칙\n{article}" for article in con.supplementary]
    docs += [bill.text for bill in bills()[-HELDOUT_BILLS:]]
    return [{"text": d} for d in docs]


_ASK_TEXT = (
    "대한민국헌법 제{n}조의 내용을 알려 주세요.",
    "헌법 제{n}조는 무엇이라고 규정하고 있나요?",
    "제{n}조 조문을 그대로 보여 주세요.",
    "우리나라 헌법 제{n}조를 알려 줘.",
)
_ASK_CHAPTER = (
    "헌법 제{n}조는 어느 장에 속하나요?",
    "대한민국헌법 제{n}조가 들어 있는 장은 무엇인가요?",
)
_ASK_TITLE = ("헌법 제{k}장의 제목은 무엇인가요?", "대한민국헌법 제{k}장은 무엇을 다루나요?")


def _chat(rng: random.Random, turns: list[tuple[str, str]]) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
    for question, answer in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def _chapter_answer(chapter: Chapter) -> str:
    first, last = chapter.articles[0].number, chapter.articles[-1].number
    return (
        f"제{chapter.number}장의 제목은 「{chapter.title}」입니다. "
        f"제{first}조부터 제{last}조까지 {len(chapter.articles)}개 조문으로 이루어져 있습니다."
    )


def korean_instructions() -> list[dict[str, Any]]:
    """Chat rows: article text, article → chapter, chapter titles (one and two turns), bill titles and reasons."""
    rng = random.Random(SEED)
    con = constitution()
    rows = []
    for a in con.articles:
        rows.append(_chat(rng, [(rng.choice(_ASK_TEXT).format(n=a.number), a.text)]))
        where = f"제{a.chapter}장 「{a.chapter_title}」" + (f" {a.section_title}" if a.section_title else "")
        rows.append(
            _chat(rng, [(rng.choice(_ASK_CHAPTER).format(n=a.number), f"제{a.number}조는 {where}에 속합니다.")])
        )
    for c in con.chapters:
        rows.append(_chat(rng, [(rng.choice(_ASK_TITLE).format(k=c.number), _chapter_answer(c))]))
        rows.append(
            _chat(
                rng,
                [
                    (f"헌법 제{c.number}장의 제목을 알려 주세요.", f"제{c.number}장의 제목은 「{c.title}」입니다."),
                    ("그 장의 첫 조문은 무엇인가요?", c.articles[0].text),
                ],
            )
        )
    for b in bills()[:-HELDOUT_BILLS]:
        rows.append(
            _chat(
                rng,
                [(f"의안번호 {b.number} 법률안의 제목은 무엇인가요?", f"의안번호 {b.number}는 「{b.title}」입니다.")],
            )
        )
        rows.append(_chat(rng, [(f"「{b.title}」의 제안이유를 요약해 주세요.", b.reason)]))
    return rows


def _garble(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    if len(words) < 3:
        return text[::-1]
    shuffled = words[:]
    while shuffled == words:
        rng.shuffle(shuffled)
    return " ".join(shuffled)


def korean_preferences() -> list[dict[str, Any]]:
    """Preference rows: the article asked for is chosen; another article, a truncation or a garble rejected."""
    rng = random.Random(SEED + 1)
    con = constitution()
    articles = con.articles
    rows = []
    for a in articles:
        prompt = [{"role": "user", "content": rng.choice(_ASK_TEXT).format(n=a.number)}]
        kind = rng.choice(("other", "truncated", "garbled"))
        if kind == "other":
            rejected = rng.choice([o for o in articles if o.number != a.number]).text
        elif kind == "truncated":
            rejected = a.text[: max(4, len(a.text) * 2 // 5)]
        else:
            rejected = _garble(a.text, rng)
        rows.append(_preference(prompt, a.text, rejected))
    for c in con.chapters:
        prompt = [{"role": "user", "content": f"헌법 제{c.number}장의 제목은 무엇인가요?"}]
        wrong = rng.choice([o for o in con.chapters if o.number != c.number])
        rows.append(
            _preference(
                prompt,
                f"제{c.number}장의 제목은 「{c.title}」입니다.",
                f"제{c.number}장의 제목은 「{wrong.title}」입니다.",
            )
        )
    return rows


def _preference(prompt: list[dict[str, str]], chosen: str, rejected: str) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


DOLLY_COLUMNS = {"input": "context", "output": "response"}
"""How a spec reads korean-dolly, as databricks-dolly-15k, in format alpaca: `data.columns`."""

DOLLY_CATEGORIES = (
    "open_qa",
    "closed_qa",
    "information_extraction",
    "summarization",
    "brainstorming",
    "classification",
    "creative_writing",
    "general_qa",
)
"""dolly-15k's categories. closed_qa, information_extraction and summarization rows read a context (an article or
the cover page of a bill); the others have none."""

_CIRCLED = "①②③④⑤⑥⑦⑧⑨⑩⑪⑫⑬⑭⑮⑯⑰⑱⑲⑳"


def _first_sentence(article: Article) -> str:
    """The first sentence of an article, without `제N조` and the paragraph mark ①."""
    line = re.sub(rf"^제\d+조\s*[{_CIRCLED}]?\s*", "", article.text.splitlines()[0])
    return re.split(r"(?<=다\.)\s", line)[0]


def _paragraphs(article: Article) -> list[str]:
    """The paragraphs (항) of an article, without their marks; one for an article without ① ②."""
    body = re.sub(r"^제\d+조\s*", "", article.text)
    return [re.sub(rf"^[{_CIRCLED}]\s*", "", p).strip() for p in re.split(rf"\n(?=[{_CIRCLED}])", body)]


def _object_particle(word: str) -> str:
    """을 after a final consonant (받침), 를 after a vowel: the object particle that follows `word`."""
    last = word[-1]
    return "을" if "가" <= last <= "힣" and (ord(last) - ord("가")) % 28 else "를"


def _bill_cover(bill: Bill) -> str:
    """The start of a bill: title, proposers, number, date and the reasons for it, up to its text (법률 제 호), its
    main points (주요내용) or the third page, without page marks (a reason may run over a page break)."""
    lines = []
    for line in bill.text.splitlines():
        if mark := re.fullmatch(r"\s*- (\d+) -\s*", line):
            if int(mark[1]) >= 3:
                break
            continue
        if re.match(r"^\s*(법률\s+제|주요내용|참고사항)", line):
            break
        lines.append(line)
    return "\n".join(lines).strip()


def _dolly(category: str, instruction: str, response: str, context: str = "") -> dict[str, str]:
    return {"instruction": instruction, "context": context, "response": response, "category": category}


def _dolly_without_context(rng: random.Random, con: Constitution, train_bills: list[Bill]) -> list[dict[str, str]]:
    """open_qa, general_qa, brainstorming, classification and creative_writing: the question holds all it needs."""
    articles = con.articles
    rows = [_dolly("open_qa", rng.choice(_ASK_TEXT).format(n=a.number), a.text) for a in rng.sample(articles, 40)]
    for c in con.chapters:
        rows.append(_dolly("general_qa", rng.choice(_ASK_TITLE).format(k=c.number), _chapter_answer(c)))
        picked = sorted(rng.sample(c.articles, min(5, len(c.articles))), key=lambda a: a.number)
        ideas = "\n".join(f"- 제{a.number}조: {_first_sentence(a)}" for a in picked)
        rows.append(
            _dolly(
                "brainstorming",
                f"헌법 제{c.number}장 「{c.title}」에 담긴 내용을 몇 가지 들어 주세요.",
                f"제{c.number}장 「{c.title}」에는 이런 내용이 있습니다.\n{ideas}",
            )
        )
    for a in sorted(rng.sample(articles, 12), key=lambda a: a.number):
        where = f"제{a.chapter}장 「{a.chapter_title}」" + (f" {a.section_title}" if a.section_title else "")
        rows.append(
            _dolly("general_qa", rng.choice(_ASK_CHAPTER).format(n=a.number), f"제{a.number}조는 {where}에 속합니다.")
        )
    for b in train_bills:
        rows.append(
            _dolly(
                "general_qa",
                f"의안번호 {b.number} 법률안의 제목은 무엇인가요?",
                f"의안번호 {b.number}는 「{b.title}」입니다.",
            )
        )
    large = [c for c in con.chapters if len(c.articles) >= 4]
    for _ in range(20):
        first, second = rng.sample(large, 2)
        picked = sorted(rng.sample(first.articles, 2) + rng.sample(second.articles, 2), key=lambda a: a.number)
        items = "\n".join(f"- 제{a.number}조: {_first_sentence(a)}" for a in picked)
        answer = "\n".join(f"- 제{a.number}조: {a.chapter_title}" for a in picked)
        rows.append(
            _dolly(
                "classification",
                f"다음 헌법 조문을 「{first.title}」에 관한 것과 「{second.title}」에 관한 것으로 "
                f"분류해 주세요.\n{items}",
                answer,
            )
        )
    poems = (
        ("헌법 제{n}조를 시민에게 알리는 짧은 안내문을 써 주세요.", "시민 여러분께 알립니다. 대한민국헌법 제{n}조는 "
         "「{s}」라고 정하고 있습니다. 이 조문은 제{k}장 「{t}」에 속하며, 우리 모두가 함께 지켜 가야 할 약속입니다."),
        ("헌법 제{n}조의 내용을 어린이에게 들려주는 이야기로 써 주세요.", "우리나라에서 가장 높은 법인 헌법에는 "
         "제{n}조가 있어요. 제{n}조는 「{s}」라고 말해요. 이 약속은 「{t}」{p} 다루는 제{k}장에 들어 있답니다."),
        ("헌법 제{n}조를 주제로 네 줄짜리 시를 지어 주세요.", "제{n}조가 조용히 말하네\n「{s}」\n「{t}」의 자리에서\n"
         "오늘도 우리를 지키네"),
    )  # fmt: skip
    for a in rng.sample(articles, 25):
        ask, answer = rng.choice(poems)
        title = a.chapter_title
        fields = {"n": a.number, "s": _first_sentence(a), "k": a.chapter, "t": title, "p": _object_particle(title)}
        rows.append(_dolly("creative_writing", ask.format(**fields), answer.format(**fields)))
    return rows


def _dolly_with_context(rng: random.Random, con: Constitution, train_bills: list[Bill]) -> list[dict[str, str]]:
    """closed_qa, information_extraction and summarization: the answer is in the context."""
    multi = [a for a in con.articles if len(_paragraphs(a)) > 1]
    rows = []
    for a in rng.sample(multi, 30):
        paragraphs = _paragraphs(a)
        question, answer = rng.choice(
            (
                ("이 조문은 몇 개의 항으로 이루어져 있나요?", f"{len(paragraphs)}개의 항으로 이루어져 있습니다."),
                ("이 조문의 제2항은 무엇을 정하고 있나요?", f"제2항은 「{paragraphs[1]}」라고 정하고 있습니다."),
                ("이 조문은 헌법 몇 조인가요?", f"대한민국헌법 제{a.number}조입니다."),
            )
        )
        rows.append(_dolly("closed_qa", question, answer, a.text))
    for a in rng.sample(multi, 20):
        listed = "\n".join(f"- 제{i}항: {p}" for i, p in enumerate(_paragraphs(a), start=1))
        rows.append(_dolly("information_extraction", "다음 조문의 각 항을 목록으로 정리해 주세요.", listed, a.text))
    for a in rng.sample(multi, 20):
        summary = (
            f"제{a.number}조는 {len(_paragraphs(a))}개 항으로 되어 있으며, 첫 항에서 「{_first_sentence(a)}」라고 "
            "정합니다."
        )
        rows.append(_dolly("summarization", "다음 조문을 한 문장으로 요약해 주세요.", summary, a.text))
    for b in train_bills:
        cover = _bill_cover(b)
        date = re.search(r"발의연월일\s*:\s*(\d{4})\.\s*(\d+)\.\s*(\d+)", cover)
        when = f"{date[1]}년 {int(date[2])}월 {int(date[3])}일" if date else "의안에 적혀 있지 않습니다"
        facts = f"- 의안번호: {b.number}\n- 제목: {b.title}\n- 발의연월일: {when}"
        rows.append(
            _dolly("information_extraction", "다음 의안에서 의안번호, 제목, 발의연월일을 뽑아 주세요.", facts, cover)
        )
        rows.append(_dolly("summarization", "다음 의안의 제안이유를 두 문장 이내로 요약해 주세요.", b.reason, cover))
    return rows


def korean_dolly() -> list[dict[str, Any]]:
    """Rows shaped like databricks-dolly-15k ({instruction, context, response, category}), in dolly's categories,
    from the articles of the main body and the training bills (never the held-out ones); in a fixed shuffled order."""
    rng = random.Random(SEED + 3)
    con, train_bills = constitution(), bills()[:-HELDOUT_BILLS]
    rows = _dolly_without_context(rng, con, train_bills) + _dolly_with_context(rng, con, train_bills)
    rng.shuffle(rows)
    return rows


def korean_sharegpt() -> list[dict[str, Any]]:
    """The korean-instructions conversations in ShareGPT's shape ({"conversations": [{"from": "system"|"human"|
    "gpt", "value": ...}]}), as most public instruction sets ship."""
    tags = {"system": "system", "user": "human", "assistant": "gpt"}
    return [
        {"conversations": [{"from": tags[m["role"]], "value": m["content"]} for m in row["messages"]]}
        for row in korean_instructions()
    ]


class BuiltinDataset(NamedTuple):
    """How a builtin dataset is read: the `data.format` and `data.columns` a spec gives it, and its generator."""

    format: str
    generate: Callable[[], list[dict[str, Any]]]
    columns: dict[str, str] = {}  # noqa: RUF012 (a NamedTuple field, never mutated)


BUILTIN_DATASETS: dict[str, BuiltinDataset] = {
    "korean-corpus": BuiltinDataset("text", korean_corpus),
    "korean-instructions": BuiltinDataset("messages", korean_instructions),
    "korean-preferences": BuiltinDataset("preference", korean_preferences),
    "korean-heldout": BuiltinDataset("text", korean_heldout),
    "korean-dolly": BuiltinDataset("alpaca", korean_dolly, DOLLY_COLUMNS),
    "korean-sharegpt": BuiltinDataset("sharegpt", korean_sharegpt),
}
"""Name → how to read it and its generator."""


def builtin_dataset(name: str) -> list[dict[str, Any]]:
    """The rows of the builtin dataset `name`."""
    if name not in BUILTIN_DATASETS:
        raise BuiltinDataError(f"unknown builtin dataset {name!r}; known: {', '.join(sorted(BUILTIN_DATASETS))}")
    return BUILTIN_DATASETS[name].generate()


# --------------------------------------------------------------------------- the lm-eval tasks

MC_EXAMPLES = 60
"""Questions of ko_constitution_mc (of the 112 articles whose first line has at least MC_MIN_WORDS words)."""
MC_CHOICES = 4
MC_MIN_WORDS = 6
MC_START_WORDS = 6
MC_CONTINUATION_WORDS = 6


def _article_words(article: Article) -> list[str]:
    """The words of an article's first line, without `제N조` and the paragraph mark ①."""
    words = article.text.splitlines()[0].split()[1:]
    return words[1:] if words and words[0] == "①" else words


def ko_constitution_mc() -> list[dict[str, Any]]:
    """Multiple-choice rows {article, context, choices, answer}: `context` is the start of an article (the first
    half of its first line, at most MC_START_WORDS words), `choices[answer]` the words that follow, the other
    choices the same part of three other articles."""
    rng = random.Random(SEED + 2)
    split: dict[int, tuple[str, str]] = {}  # article number -> (its start, its continuation)
    for article in constitution().articles:
        words = _article_words(article)
        if len(words) >= MC_MIN_WORDS:
            cut = min(len(words) // 2, MC_START_WORDS)
            split[article.number] = (" ".join(words[:cut]), " ".join(words[cut : cut + MC_CONTINUATION_WORDS]))
    rows = []
    for number in sorted(rng.sample(sorted(split), MC_EXAMPLES)):
        start, truth = split[number]
        others = sorted({cont for n, (_, cont) in split.items() if n != number and cont != truth})
        choices = rng.sample(others, MC_CHOICES - 1)
        answer = rng.randrange(MC_CHOICES)
        choices.insert(answer, truth)
        rows.append(
            {"article": number, "context": f"대한민국헌법 제{number}조 {start}", "choices": choices, "answer": answer}
        )
    return rows


def _mc_task(name: str, data_file: Path) -> dict[str, Any]:
    """The lm-eval task YAML of a multiple-choice task over a local JSONL file (score: loglikelihood of each
    choice after the context; acc_norm divides it by the choice's length in characters)."""
    return {
        "task": name,
        "dataset_path": "json",
        # datasets reads data_files relative to the working directory, not to this YAML: write an absolute path.
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }


BUILTIN_LM_EVAL_TASKS: dict[str, tuple[Callable[[str, Path], dict[str, Any]], Callable[[], list[dict[str, Any]]]]] = {
    "ko_constitution_mc": (_mc_task, ko_constitution_mc),
}
"""Task name → (its YAML given the data file, the generator of its rows)."""


def write_lm_eval_tasks(name: str, folder: Path) -> tuple[dict[str, int], str]:
    """Write the builtin task folder `name` into `folder` (a `<task>.yaml` and `<task>.jsonl` per task, nothing
    else: it replaces what was there); returns the rows per task and the fingerprint of the tasks (their YAML
    with the data file named relatively, and their rows), which does not depend on where `folder` is."""
    from stages.data import sha256_rows, write_jsonl

    if name != LM_EVAL_TASKS:
        raise BuiltinDataError(f"unknown builtin lm-eval task folder {name!r}; known: {LM_EVAL_TASKS}")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (p for p in folder.iterdir() if p.is_file()):
        stale.unlink()
    counts: dict[str, int] = {}
    described = []
    for task, (config, generate) in BUILTIN_LM_EVAL_TASKS.items():
        rows = generate()
        data_file = folder.absolute() / f"{task}.jsonl"
        write_jsonl(data_file, rows)
        text = yaml.safe_dump(config(task, data_file), sort_keys=False, allow_unicode=True)
        (folder / f"{task}.yaml").write_text(text, encoding="utf-8")
        counts[task] = len(rows)
        described.append({"config": config(task, Path(data_file.name)), "rows": sha256_rows(rows)})
    return counts, sha256_rows(described)
