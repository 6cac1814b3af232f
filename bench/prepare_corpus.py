"""Benchmark (not a test): the prepare stage on a synthetic Korean corpus at corpus scale, on CPU.

    python bench/prepare_corpus.py --sizes 20M,200M --kinds text,messages --num-proc 2
    python bench/prepare_corpus.py --sizes 1M --kinds text --keep          # a smoke run of the script itself

For each kind (`text`: CPT documents `{"text": ...}`; `messages`: SFT conversations `{"messages": [...]}`) and
each size (tokens, as the run's tokenizer counts them), it

1. writes a synthetic Korean corpus under `--workdir` (never into the repository): JSONL shards, the last
   `--zst-shards` of them `.jsonl.zst`. The text is konlpy's kolaw and kobill files (the wheel's
   `konlpy/data/corpus`, found without importing konlpy, which needs Java), about 900 sentences, recombined
   per document with a seeded generator: random windows of sentences, sentences spliced from two halves, word
   order swaps, shuffled sentence order, and per-document numbers, dates, names, places and amounts, so that
   exact-duplicate removal keeps every document (and near-duplicate removal, `--near-dedup`, should keep nearly
   all). The number of documents is the target over the mean tokens of a 2,000-document sample;
2. runs prepare as a pod does: a run directory holding the resolved spec (`korean-llm`, profile `local`, with
   overrides: the corpus as the stage's data, the other data stages off, `stages.prepare.num_proc`), then
   `python -m stages prepare --run-dir DIR` as a subprocess;
3. runs the baseline on the same files, in a subprocess too: `datasets.load_dataset("json", data_files=...)` →
   `.map(tokenize, batched=True, num_proc=N)` → TRL `pack_dataset(..., seq_length, strategy="bfd")`, where
   tokenize is the tokenizer plus eos for text, and for messages what SFTTrainer does with `assistant_only_loss`
   (the sft stage's default): `apply_chat_template` with TRL's `{% generation %}`-tagged training template
   (`get_training_chat_template`) and `return_assistant_tokens_mask=True`;
4. measures a training rank's reads, in a subprocess: `stages.packing.load_token_cache(run_dir, spec, stage)`,
   then `--read-rows` random rows of the train split.

The tokenizer is the same everywhere: a byte-level BPE with Qwen3's special tokens and chat template
(`stages.tokenizer.train_bpe_tokenizer`, `--vocab-size` entries), trained once on a separate sample of the
generated text and saved as a pretrained tokenizer directory; the spec names it in `model.name_or_path` (no
`model.from_config`), so prepare loads it as it loads a hub model's tokenizer in a pod, instead of training one on
the whole corpus as the local profile does.

Memory: a thread samples every 0.2 s the process and all its descendants (prepare's forked workers, the
baseline's `datasets` pool), summing PSS from /proc/<pid>/smaps_rollup (pages shared after fork count once) and
RSS; the peak of each sum is reported, with the parent's and the workers' shares at the PSS peak. Speed:
tokens / wall-clock seconds of the whole subprocess (interpreter start and imports included); prepare's tokens
are its cache's `train.tokens + eval.tokens` (meta.json), the baseline's the packed rows' tokens. Each measure
also records tokens per CPU second of the tree and the CPU time the rest of the machine took meanwhile
(`others_cpu_s`): on a shared machine the wall time is not the measured process' alone.

Results go to `--out` (JSON, rewritten after every size) and a markdown table at the end; docs/performance.md
("Corpus-scale prepare") reports a run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GENERATOR_VERSION = 1  # bump when the generated text changes: cached corpora are then made again
SAMPLE_DOCUMENTS = 2000  # documents tokenized to estimate the tokens per document
POD_MEMORY_GIB = 32.0  # stages.prepare.resources.memory of the shipped korean-llm pipeline (32Gi)
POD_CPUS = 8  # stages.prepare.resources.cpu of the same: prepare's num_proc in the pod
EXTRAPOLATE_TOKENS = (1_000_000_000, 20_000_000_000)
TARGET_GROWTH = 1.3  # peak at the largest size ≤ 1.3 × the peak at the smallest
TARGET_PEAK_GIB = 2.0
TARGET_READ_GIB = 1.0
STAGE_OF = {"text": "cpt", "messages": "sft"}
GIB = 2**30


# --------------------------------------------------------------------------- the synthetic corpus

SURNAMES = (
    "김이박최정강조윤장임한오서신권황안송류전홍고문양손배백허유남심노하곽성차주우구민진나지엄채원천방공현함변염여추"
    "도소석선설마길연위표명기반왕금옥육인맹"
)
GIVEN = "민서준지현우진수영하은도윤재호성연아름혜경철석태희정숙미선동훈승환예주유나다빈소율채원시후건"
PLACES = [
    "서울특별시", "부산광역시", "대구광역시", "인천광역시", "광주광역시", "대전광역시", "울산광역시", "세종특별자치시",
    "경기도", "강원특별자치도", "충청북도", "충청남도", "전북특별자치도", "전라남도", "경상북도", "경상남도",
    "제주특별자치도", "수원시", "성남시", "고양시", "용인시", "창원시", "청주시", "천안시", "전주시", "포항시",
]  # fmt: skip
BODIES = [
    "행정안전부", "교육부", "보건복지부", "국토교통부", "법무부", "기획재정부", "환경부", "고용노동부", "국회 사무처",
    "지방의회", "법제처", "감사원", "중소벤처기업부", "문화체육관광부", "농림축산식품부", "여성가족부",
]  # fmt: skip
SYSTEM_PROMPTS = [
    "당신은 한국의 법률과 행정을 쉽게 설명하는 도우미입니다.",
    "당신은 친절한 한국어 도우미입니다. 정확하고 간결하게 답하세요.",
    "당신은 입법 자료를 요약하는 전문가입니다.",
    "질문에 존댓말로, 근거를 들어 답하세요.",
]
QUESTIONS = [
    "{topic}에 대해 설명해 주세요.",
    "{topic}은 무엇을 뜻하나요?",
    "{place}에서 {topic}은 어떻게 적용되나요?",
    "{year}년 기준으로 {topic}의 내용을 알려 주세요.",
    "다음 내용을 요약해 주세요.\n{passage}",
    "{name} 의원이 발의한 법안의 취지가 궁금합니다. {topic} 관련 내용인가요?",
    "다음 조항을 쉬운 말로 풀어 주세요: {passage}",
]
FOLLOW_UPS = ["조금 더 자세히 알려 주세요.", "예를 들어 설명해 줄 수 있나요?", "그 근거는 무엇인가요?",
              "{topic}과의 차이는 무엇인가요?", "{place}의 경우는 어떤가요?"]  # fmt: skip


def konlpy_corpus_dir() -> Path:
    """The konlpy wheel's corpus folder (found without importing konlpy, which starts a JVM)."""
    spec = importlib.util.find_spec("konlpy")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("konlpy is not installed (pip install konlpy==0.6.0): its corpus is the benchmark's text")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "corpus"


def source_sentences() -> list[list[str]]:
    """The sentences of each kolaw and kobill file, in file order (whitespace runs collapsed)."""
    root = konlpy_corpus_dir()
    files = sorted(root.glob("kolaw/*.txt")) + sorted(root.glob("kobill/*.txt"))
    out = []
    for path in files:
        text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))
        sentences = [s for s in re.split(r"(?<=[.?!])\s+", text) if len(s) >= 8 and re.search("[가-힣]", s)]
        if sentences:
            out.append(sentences)
    if not out:
        raise SystemExit(f"no text under {root}/kolaw or kobill")
    return out


class KoreanCorpus:
    """Deterministic synthetic Korean documents: document `i` of a seed is always the same text."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.files = source_sentences()
        self.weights = [len(f) for f in self.files]
        self.all = [s for f in self.files for s in f]

    def _rng(self, i: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + i)

    def _name(self, rng: random.Random) -> str:
        return rng.choice(SURNAMES) + "".join(rng.choices(GIVEN, k=2))

    def _date(self, rng: random.Random) -> str:
        return f"{rng.randint(1988, 2026)}년 {rng.randint(1, 12)}월 {rng.randint(1, 28)}일"

    def _sentence(self, rng: random.Random, sentence: str) -> str:
        """A source sentence varied: spliced with another one's second half, two words swapped, an injected
        date, name, article number or amount."""
        words = sentence.split(" ")
        if len(words) > 4 and rng.random() < 0.4:
            other = rng.choice(self.all).split(" ")
            words = words[: rng.randint(2, len(words) - 2)] + other[len(other) // 2 :]
        if len(words) > 3 and rng.random() < 0.3:
            j = rng.randrange(len(words) - 1)
            words[j], words[j + 1] = words[j + 1], words[j]
        roll = rng.random()
        if roll < 0.12:
            words.insert(0, self._date(rng) + ",")
        elif roll < 0.22:
            words.insert(0, f"{self._name(rng)} 의원은")
        elif roll < 0.30:
            words.insert(rng.randrange(len(words)), f"제{rng.randint(1, 130)}조제{rng.randint(1, 9)}항")
        elif roll < 0.36:
            words.insert(rng.randrange(len(words)), f"{rng.randint(1, 9999):,}만 원")
        elif roll < 0.40:
            words.insert(0, f"{rng.choice(PLACES)}의")
        return " ".join(words)

    def _passage(self, rng: random.Random, sentences: int) -> list[str]:
        """`sentences` varied sentences from windows of 1-4 consecutive source sentences."""
        out: list[str] = []
        while len(out) < sentences:
            source = rng.choices(self.files, weights=self.weights)[0]
            start = rng.randrange(len(source))
            for s in source[start : start + rng.randint(1, 4)]:
                out.append(self._sentence(rng, s))
        return out[:sentences]

    def _topic(self, rng: random.Random) -> str:
        words = rng.choice(self.all).split(" ")
        start = rng.randrange(max(1, len(words) - 2))
        return " ".join(words[start : start + rng.randint(1, 3)]).strip(".,()「」")

    def text(self, i: int) -> dict[str, Any]:
        """A CPT document: a header line (place, body, notice number, date), then paragraphs."""
        rng = self._rng(i)
        n = min(160, max(3, round(rng.lognormvariate(math.log(12), 0.8))))
        sentences = self._passage(rng, n)
        if rng.random() < 0.5:
            rng.shuffle(sentences)
        place, body = rng.choice(PLACES), rng.choice(BODIES)
        notice = f"공고 제{rng.randint(2000, 2026)}-{rng.randint(1, 99999)}호"
        header = f"{place} {body} {notice} ({self._date(rng)})"
        paragraphs, at = [], 0
        while at < len(sentences):
            step = rng.randint(2, 6)
            paragraphs.append(" ".join(sentences[at : at + step]))
            at += step
        return {"text": "\n\n".join([header, *paragraphs])}

    def messages(self, i: int) -> dict[str, Any]:
        """An SFT conversation: an optional system prompt, 1-3 user/assistant turns."""
        rng = self._rng(i)
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []
        for turn in range(rng.choices((1, 2, 3), weights=(5, 3, 2))[0]):
            fill = {"topic": self._topic(rng), "place": rng.choice(PLACES), "year": rng.randint(1988, 2026),
                    "name": self._name(rng), "passage": " ".join(self._passage(rng, rng.randint(1, 3)))}  # fmt: skip
            question = rng.choice(QUESTIONS if turn == 0 else FOLLOW_UPS).format(**fill)
            n = min(60, max(2, round(rng.lognormvariate(math.log(7), 0.6))))
            answer = " ".join(self._passage(rng, n))
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return {"messages": messages}

    def document(self, kind: str, i: int) -> dict[str, Any]:
        return self.text(i) if kind == "text" else self.messages(i)


def count_tokens(tokenizer: Any, kind: str, row: dict[str, Any]) -> int:
    """Tokens of a row as the cache holds them: a document and its eos; a conversation through the chat template."""
    if kind == "text":
        return len(tokenizer(row["text"], add_special_tokens=False)["input_ids"]) + 1
    return len(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])


def build_tokenizer(workdir: Path, vocab_size: int, seed: int) -> Path:
    """The run's tokenizer (Qwen3's special tokens and template), trained once on a sample of both kinds."""
    path = workdir / f"tokenizer-v{GENERATOR_VERSION}-{vocab_size}"
    if (path / "tokenizer.json").is_file():
        return path
    from stages.tokenizer import train_bpe_tokenizer

    corpus = KoreanCorpus(seed + 7919)  # not the corpus' own documents
    texts = [corpus.text(i)["text"] for i in range(3000)]
    texts += ["\n".join(m["content"] for m in corpus.messages(i)["messages"]) for i in range(3000)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size, 32768, "qwen3")
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer.save_pretrained(str(staging))
    os.replace(staging, path)
    return path


def parse_size(text: str) -> int:
    """'20M' → 20_000_000 (K, M, B suffixes)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB]?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count such as 20M, 200M or 1.5B")
    return int(float(match.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "B": 10**9}[match.group(2)])


def write_corpus(
    workdir: Path, kind: str, tokens: int, tokenizer_path: Path, seed: int, shards: int, zst_shards: int
) -> dict[str, Any]:
    """The corpus of `kind` at about `tokens` tokens, written once (reused while its record exists)."""
    from transformers import AutoTokenizer

    name = f"{kind}-{tokens}-s{seed}-g{GENERATOR_VERSION}-{tokenizer_path.name}-{shards}x{zst_shards}"
    directory = workdir / "corpora" / name
    record = directory.parent / f"{name}.json"  # beside the data folder: a .json file in it would be data
    if record.is_file():
        return json.loads(record.read_text())
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    corpus = KoreanCorpus(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    sample = [count_tokens(tokenizer, kind, corpus.document(kind, i)) for i in range(SAMPLE_DOCUMENTS)]
    per_document = sum(sample) / len(sample)
    documents = max(SAMPLE_DOCUMENTS, math.ceil(tokens / per_document))
    started = time.perf_counter()
    names = [f"part-{k:05d}.jsonl" + (".zst" if k >= shards - zst_shards else "") for k in range(shards)]
    per_shard = math.ceil(documents / shards)
    size = 0
    for k, name in enumerate(names):
        with _open_shard(directory / name) as f:
            for i in range(k * per_shard, min(documents, (k + 1) * per_shard)):
                line = (json.dumps(corpus.document(kind, i), ensure_ascii=False) + "\n").encode("utf-8")
                f.write(line)
                size += len(line)
    info = {
        "kind": kind,
        "target_tokens": tokens,
        "documents": documents,
        "estimated_tokens": round(documents * per_document),
        "tokens_per_document": round(per_document, 1),
        "jsonl_bytes": size,
        "files": [str(directory / n) for n in names],
        "dir": str(directory),
        "seed": seed,
        "generate_s": round(time.perf_counter() - started, 1),
    }
    record.write_text(json.dumps(info, indent=2))
    return info


class _open_shard:
    """A shard file for writing bytes, zstd-compressed when its name ends in .zst."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Any:
        self.raw = open(self.path, "wb")
        if self.path.suffix == ".zst":
            import zstandard

            self.stream = zstandard.ZstdCompressor(level=3).stream_writer(self.raw)
            return self.stream
        return self.raw

    def __exit__(self, *exc: Any) -> None:
        if self.path.suffix == ".zst":
            self.stream.close()
        self.raw.close()


# --------------------------------------------------------------------------- memory of a process tree


def _rollup(pid: int) -> tuple[int, int] | None:
    """(PSS, RSS) bytes of a process from /proc/<pid>/smaps_rollup; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = dict(re.findall(r"^(Pss|Rss):\s+(\d+) kB", text, re.M))
    return int(fields.get("Pss", 0)) * 1024, int(fields.get("Rss", 0)) * 1024


def _descendants(root: int) -> list[int]:
    """The processes below `root` (children, their children...), from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def self_memory() -> dict[str, float]:
    """This process' PSS and RSS, and the RSS' anonymous and file-backed parts (memory-mapped files), GiB."""
    pss, rss = _rollup(os.getpid()) or (0, 0)
    status = dict(re.findall(r"^(RssAnon|RssFile):\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M))
    out = {"pss_gib": round(pss / GIB, 3), "rss_gib": round(rss / GIB, 3)}
    out.update({f"{k[3:].lower()}_gib": round(int(v) * 1024 / GIB, 3) for k, v in status.items()})
    return out


class TreeMemory:
    """The peak memory of a process and its descendants, sampled from a thread every `interval` seconds: PSS
    summed over the tree (pages shared after fork count once), RSS summed (they count in every process)."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval = pid, interval
        self.peak_pss = self.peak_rss = 0
        self.at_peak: dict[str, Any] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        parent = _rollup(self.pid)
        if parent is None:
            return
        workers = [m for m in map(_rollup, _descendants(self.pid)) if m is not None]
        pss = parent[0] + sum(m[0] for m in workers)
        rss = parent[1] + sum(m[1] for m in workers)
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss)
        if pss > self.peak_pss:
            self.peak_pss = pss
            self.at_peak = {"processes": 1 + len(workers), "parent_pss_gib": round(parent[0] / GIB, 3),
                            "children_pss_gib": round(sum(m[0] for m in workers) / GIB, 3)}  # fmt: skip

    def result(self) -> dict[str, Any]:
        return {"peak_pss_gib": round(self.peak_pss / GIB, 3), "peak_rss_gib": round(self.peak_rss / GIB, 3),
                "at_pss_peak": self.at_peak, "samples": self.samples}  # fmt: skip


def machine_cpu_s() -> float:
    """CPU seconds every process of the machine has run since boot (/proc/stat: user, nice, system, irq, softirq)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def run_measured(argv: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `argv` with its output in `log`; its wall time, CPU time (the tree's, once waited for), exit code and
    peak memory, and the CPU time the rest of the machine took meanwhile (`others_cpu_s`: other people's work on a
    shared machine slows the measure down; this benchmark's own sampler is in it, a few per cent of a core)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = machine_cpu_s()
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        with TreeMemory(process.pid) as memory:
            assert process.stdout is not None
            for line in process.stdout:  # each line with the seconds since the start: where the time goes
                out.write(f"{time.perf_counter() - started:8.1f}s {line.decode(errors='replace')}")
            code = process.wait()
    wall = time.perf_counter() - started
    busy = machine_cpu_s() - busy
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = {"exit_code": code, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
              "others_cpu_s": round(max(0.0, busy - cpu), 1), **memory.result(), "log": str(log)}  # fmt: skip
    if code != 0:
        result["log_tail"] = log.read_text(errors="replace").splitlines()[-25:]
    return result


# --------------------------------------------------------------------------- prepare, as a pod runs it


def write_run_dir(root: Path, kind: str, corpus_dir: str, tokenizer_path: Path, args: argparse.Namespace) -> None:
    """A run directory holding the resolved spec: korean-llm's local profile, the corpus as the stage's data."""
    from run.run_dir import RunDir
    from spec.loading import load_pipeline

    stage = STAGE_OF[kind]
    other = "sft" if stage == "cpt" else "cpt"
    overrides = [
        "tracking.wandb_project=null",
        "model.from_config=null",
        f"model.name_or_path={tokenizer_path}",
        f"stages.prepare.num_proc={args.num_proc}",
        f"stages.{stage}.data.uri={corpus_dir}",
        f"stages.{stage}.data.format={kind}",
        f"stages.{stage}.training.max_seq_length={args.seq_length}",
        f"stages.{other}.enabled=false",
        "stages.rlhf.enabled=false",
        "stages.evaluate.enabled=false",
        "stages.deploy.enabled=false",
    ]
    if args.near_dedup is not None:
        overrides.append(f"stages.{stage}.data.cleaning.near_dedup_threshold={args.near_dedup}")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    spec = load_pipeline("korean-llm", profile="local", overrides=overrides).spec
    if args.mixture:  # each file of the corpus a dataset of its own: prepare's mixture pass, every row kept
        data = getattr(spec.stages, stage).data
        files = sorted(str(path) for path in Path(corpus_dir).iterdir())
        getattr(spec.stages, stage).data = [data.model_copy(update={"uri": file}) for file in files]
    RunDir(root).write_spec(spec)


def cache_meta(root: Path, stage: str) -> dict[str, Any] | None:
    """The meta.json of the stage's token cache in a run directory (None when prepare built none)."""
    found = sorted((root / "prepare" / "cache" / stage).glob("*/meta.json"))
    return json.loads(found[0].read_text()) if found else None


def measure_prepare(root: Path, kind: str, log: Path) -> dict[str, Any]:
    result = run_measured([sys.executable, "-m", "stages", "prepare", "--run-dir", str(root)], log)
    meta = cache_meta(root, STAGE_OF[kind])
    if result["exit_code"] == 0 and meta is not None:
        result["tokens"] = meta["train"]["tokens"] + meta["eval"]["tokens"]
        result["rows"] = meta["train"]["rows"] + meta["eval"]["rows"]
        result["tokens_per_s"] = round(result["tokens"] / result["wall_s"])
        result["tokens_per_cpu_s"] = round(result["tokens"] / result["cpu_s"])
        record = json.loads((root / "prepare" / "stage.json").read_text())
        data = record.get("extra", {}).get("data", {}).get(STAGE_OF[kind], {})
        result["documents_read"] = data.get("read_rows")
        result["documents_kept"] = data.get("rows")
        result["dropped"] = {k: v for k, v in data.get("cleaning", {}).get("dropped", {}).items() if v}
        result["cache_bytes"] = sum(p.stat().st_size for p in (root / "prepare" / "cache").rglob("*") if p.is_file())
    return result


# --------------------------------------------------------------------------- the baseline (datasets + TRL)


def baseline(args: argparse.Namespace) -> dict[str, Any]:
    """load_dataset("json") → map(tokenize, batched, num_proc) → pack_dataset(bfd), timed phase by phase."""
    started = time.perf_counter()
    import datasets
    import pyarrow.compute as pc
    from transformers import AutoTokenizer
    from trl import pack_dataset
    from trl.chat_template_utils import get_training_chat_template

    imported = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = tokenizer.eos_token_id
    # SFTTrainer with assistant_only_loss (the sft stage's default): TRL's training template, {% generation %}-tagged
    template = get_training_chat_template(tokenizer) or tokenizer.chat_template

    def tokenize_text(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[*x, eos] for x in ids]}

    def tokenize_messages(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out = tokenizer.apply_chat_template(
            batch["messages"],
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    phases = {}
    at = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=args.files, split="train", cache_dir=args.cache_dir)
    phases["load_s"] = time.perf_counter() - at
    at = time.perf_counter()
    tokenize = tokenize_text if args.kind == "text" else tokenize_messages
    dataset = dataset.map(tokenize, batched=True, num_proc=args.num_proc, remove_columns=dataset.column_names)
    phases["tokenize_s"] = time.perf_counter() - at
    at = time.perf_counter()
    packed = pack_dataset(dataset, args.seq_length, strategy="bfd")
    phases["pack_s"] = time.perf_counter() - at
    lengths = pc.list_value_length(packed.with_format("arrow").data.column("input_ids"))
    return {
        "tokens": int(pc.sum(lengths).as_py()),
        "rows": len(packed),
        "documents": len(dataset),
        "chat_template": "trl training template" if template != tokenizer.chat_template else "the tokenizer's",
        "import_s": round(imported - started, 1),
        **{k: round(v, 1) for k, v in phases.items()},
        "datasets": datasets.__version__,
    }


def measure_baseline(kind: str, files: list[str], tokenizer_path: Path, cache: Path, log: Path,
                     args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    shutil.rmtree(cache, ignore_errors=True)
    record = log.with_suffix(".json")
    record.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "baseline", "--kind", kind, "--tokenizer",
            str(tokenizer_path), "--cache-dir", str(cache), "--seq-length", str(args.seq_length), "--num-proc",
            str(args.num_proc), "--record", str(record), "--files", *files]  # fmt: skip
    result = run_measured(argv, log, env={**os.environ, "HF_DATASETS_CACHE": str(cache)})
    if record.is_file():
        result.update(json.loads(record.read_text()))
    if "tokens" in result:
        result["tokens_per_s"] = round(result["tokens"] / result["wall_s"])
        result["tokens_per_cpu_s"] = round(result["tokens"] / result["cpu_s"])
        result["cache_bytes"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    return result


# --------------------------------------------------------------------------- a training rank's reads


def read_cache(args: argparse.Namespace) -> dict[str, Any]:
    """A training rank opening the token cache (`load_token_cache`) and reading random rows of its train split."""
    import datasets  # noqa: F401 -- what a training rank has imported anyway
    import torch  # noqa: F401

    from run.run_dir import RunDir
    from stages.packing import load_token_cache

    result: dict[str, Any] = {"after_imports": self_memory()}
    run_dir = RunDir(Path(args.run_dir))
    spec = run_dir.load_spec()
    at = time.perf_counter()
    cache = load_token_cache(run_dir, spec, args.stage)
    result["open_s"] = round(time.perf_counter() - at, 2)
    result["after_open"] = self_memory()
    rows = len(cache.train)
    picks = random.Random(0).sample(range(rows), min(args.read_rows, rows))
    at = time.perf_counter()
    tokens = sum(len(cache.train[i]["input_ids"]) for i in picks)
    result["read_ms_per_row"] = round((time.perf_counter() - at) * 1000 / max(1, len(picks)), 2)
    result["after_reads"] = self_memory()
    result.update(train_rows=rows, rows_read=len(picks), tokens_read=tokens)
    return result


def measure_reads(root: Path, stage: str, log: Path, rows: int) -> dict[str, Any]:
    record = log.with_suffix(".json")
    record.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "read", "--run-dir", str(root), "--stage", stage,
            "--read-rows", str(rows), "--record", str(record)]  # fmt: skip
    result = run_measured(argv, log)
    if record.is_file():
        result.update(json.loads(record.read_text()))
    return result


# --------------------------------------------------------------------------- the suite


def fit(points: list[tuple[int, float]]) -> dict[str, Any] | None:
    """fixed + per token × tokens through the smallest and the largest size; the figures at 1 B and 20 B."""
    if len(points) < 2:
        return None
    (t0, m0), (t1, m1) = points[0], points[-1]
    per_token = (m1 - m0) / (t1 - t0)
    fixed = m0 - per_token * t0
    out: dict[str, Any] = {"fixed_gib": round(fixed, 3), "gib_per_billion_tokens": round(per_token * 1e9, 3)}
    for tokens in EXTRAPOLATE_TOKENS:
        out[f"{tokens // 10**9}B_gib"] = round(fixed + per_token * tokens, 2)
    return out


def summarize(results: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    """The targets, per kind, between its smallest and largest size."""
    summary: dict[str, Any] = {}
    for kind in kinds:
        done = sorted((r for r in results if r["kind"] == kind and "tokens" in r.get("prepare", {})),
                      key=lambda r: r["prepare"]["tokens"])  # fmt: skip
        if not done:
            continue
        small, large = done[0]["prepare"], done[-1]["prepare"]
        points = [(r["prepare"]["tokens"], r["prepare"]["peak_pss_gib"]) for r in done]
        s: dict[str, Any] = {"sizes": [r["size"] for r in done], "peak_pss_gib": [p for _, p in points]}
        if len(done) > 1:
            growth = large["peak_pss_gib"] / small["peak_pss_gib"]
            s["memory_growth"] = round(growth, 3)
            s["memory_growth_met"] = growth <= TARGET_GROWTH
        s["memory_peak_met"] = large["peak_pss_gib"] <= TARGET_PEAK_GIB
        s["memory_fit"] = fit(points)
        at_peak = large.get("at_pss_peak", {})
        if at_peak.get("processes", 1) > 1:  # the pod's 8 workers: the parent plus 8 of these workers
            worker = at_peak["children_pss_gib"] / (at_peak["processes"] - 1)
            s["pod_workers_gib"] = round(POD_CPUS * worker, 2)
        base = done[-1].get("baseline", {})
        if "tokens_per_s" in base:
            s["speed_ratio"] = round(large["tokens_per_s"] / base["tokens_per_s"], 2)
            s["speed_ratio_cpu"] = round(large["tokens_per_cpu_s"] / base["tokens_per_cpu_s"], 2)
            s["speed_met"] = large["tokens_per_s"] >= base["tokens_per_s"]
            s["speed_met_per_cpu_s"] = large["tokens_per_cpu_s"] >= base["tokens_per_cpu_s"]  # a shared machine
        read = done[-1].get("read", {})
        if "after_reads" in read:
            s["read_rss_gib"] = read["after_reads"]["rss_gib"]
            s["read_met"] = read["after_reads"]["rss_gib"] < TARGET_READ_GIB
        summary[kind] = s
    return summary


def table(results: list[dict[str, Any]]) -> str:
    """The results as a markdown table: one line per kind and size."""
    head = (
        "| kind | size | tokens | prepare: wall s | tok/s | tok/CPU-s | peak PSS GiB (RSS) | baseline: wall s | tok/s "
        "| tok/CPU-s | peak PSS GiB (RSS) | speed ratio: wall, CPU | others' CPU s: prepare, baseline "
        "| rank RSS GiB: opened, read |"
    )
    lines = [head, "|" + " --- |" * 14]
    for r in results:
        p, b, d = r.get("prepare", {}), r.get("baseline", {}), r.get("read", {})

        def cell(m: dict[str, Any], key: str) -> str:
            if m.get("exit_code", 0) != 0:
                return f"failed ({m['exit_code']})"
            return f"{m[key]:,}" if key in m else "—"

        def memory(m: dict[str, Any]) -> str:
            return f"{m['peak_pss_gib']:.2f} ({m['peak_rss_gib']:.2f})" if "peak_pss_gib" in m else "—"

        ratio = "—"
        if "tokens_per_s" in p and "tokens_per_s" in b:
            ratio = (
                f"{p['tokens_per_s'] / b['tokens_per_s']:.2f}×, {p['tokens_per_cpu_s'] / b['tokens_per_cpu_s']:.2f}×"
            )
        reads = f"{d['after_open']['rss_gib']:.2f}, {d['after_reads']['rss_gib']:.2f}" if "after_reads" in d else "—"
        lines.append(
            f"| {r['kind']} | {r['size']} | {cell(p, 'tokens')} | {cell(p, 'wall_s')} | {cell(p, 'tokens_per_s')} "
            f"| {cell(p, 'tokens_per_cpu_s')} | {memory(p)} | {cell(b, 'wall_s')} | {cell(b, 'tokens_per_s')} "
            f"| {cell(b, 'tokens_per_cpu_s')} | {memory(b)} | {ratio} | {cell(p, 'others_cpu_s')}, "
            f"{cell(b, 'others_cpu_s')} | {reads} |"
        )
    return "\n".join(lines)


def versions() -> dict[str, Any]:
    import datasets
    import tokenizers
    import transformers
    import trl

    return {
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} GiB",
        "datasets": datasets.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "trl": trl.__version__,
    }


def suite(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = [(s, parse_size(s)) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    environment = {"argv": sys.argv, "num_proc": args.num_proc, "seq_length": args.seq_length,
                   "near_dedup": args.near_dedup, "mixture": args.mixture, **versions()}  # fmt: skip
    print(json.dumps(environment), flush=True)
    tokenizer_path = build_tokenizer(workdir, args.vocab_size, args.seed)
    results: list[dict[str, Any]] = []
    out = Path(args.out)
    for kind in kinds:
        for label, tokens in sizes:
            name = f"{kind}-{label}"
            result: dict[str, Any] = {"kind": kind, "size": label}
            results.append(result)
            try:
                corpus = write_corpus(workdir, kind, tokens, tokenizer_path, args.seed, args.shards, args.zst_shards)
                result["corpus"] = {k: v for k, v in corpus.items() if k != "files"}
                print(f"[{name}] corpus: {corpus['documents']:,} documents, ~{corpus['estimated_tokens']:,} tokens, "
                      f"{corpus['jsonl_bytes'] / GIB:.2f} GiB of JSONL", flush=True)  # fmt: skip
                root = workdir / "runs" / name
                write_run_dir(root, kind, corpus["dir"], tokenizer_path, args)
                result["prepare"] = measure_prepare(root, kind, workdir / "logs" / f"{name}-prepare.log")
                print(f"[{name}] prepare: {json.dumps(result['prepare'])}", flush=True)
                if result["prepare"]["exit_code"] == 0:
                    log = workdir / "logs" / f"{name}-read.log"
                    result["read"] = measure_reads(root, STAGE_OF[kind], log, args.read_rows)
                    print(f"[{name}] read: {json.dumps(result['read'])}", flush=True)
                if not args.skip_baseline:
                    cache = workdir / "baseline-cache" / name
                    log = workdir / "logs" / f"{name}-baseline.log"
                    result["baseline"] = measure_baseline(kind, corpus["files"], tokenizer_path, cache, log, args)
                    print(f"[{name}] baseline: {json.dumps(result['baseline'])}", flush=True)
                    if not args.keep:
                        shutil.rmtree(cache, ignore_errors=True)
                if not args.keep:
                    shutil.rmtree(root, ignore_errors=True)
            except Exception as exc:  # recorded; the suite goes on with the next size
                traceback.print_exc()
                result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            summary = summarize(results, kinds)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"environment": environment, "results": results, "summary": summary},
                                      indent=2, ensure_ascii=False) + "\n")  # fmt: skip
    if not args.keep:
        shutil.rmtree(workdir / "corpora", ignore_errors=True)
    print(table(results))
    print(json.dumps(summarize(results, kinds), indent=2))
    return 0 if all("error" not in r and r.get("prepare", {}).get("exit_code") == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="suite", choices=["suite", "baseline", "read"])
    parser.add_argument("--sizes", default="20M,200M", help="comma-separated token counts (K, M, B suffixes)")
    parser.add_argument("--kinds", default="text,messages", help="text (CPT documents), messages (SFT)")
    parser.add_argument("--num-proc", type=int, default=2, help="prepare's workers and the baseline's map processes")
    parser.add_argument("--workdir", default="/tmp/posttrain-bench", help="corpora, run directories, logs")
    parser.add_argument("--keep", action="store_true", help="keep corpora, run directories and baseline caches")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "prepare_corpus.json"))
    parser.add_argument("--seq-length", type=int, default=4096, help="max_seq_length of the stage and the packer")
    parser.add_argument(
        "--vocab-size", type=int, default=2048, help="entries of the BPE tokenizer (the local profile's 2048)"
    )
    parser.add_argument("--near-dedup", type=float, default=None, help="data.cleaning.near_dedup_threshold")
    parser.add_argument("--mixture", action="store_true", help="each corpus file a dataset of its own (a mixture)")
    parser.add_argument("--shards", type=int, default=4, help="files per corpus")
    parser.add_argument("--zst-shards", type=int, default=1, help="how many of them are .jsonl.zst")
    parser.add_argument("--read-rows", type=int, default=300, help="random rows a training rank reads")
    parser.add_argument("--skip-baseline", action="store_true", help="measure prepare alone")
    parser.add_argument("--seed", type=int, default=0)
    # the child commands' arguments
    parser.add_argument("--kind", choices=list(STAGE_OF))
    parser.add_argument("--files", nargs="*", default=[])
    parser.add_argument("--tokenizer")
    parser.add_argument("--cache-dir")
    parser.add_argument("--run-dir")
    parser.add_argument("--stage")
    parser.add_argument("--record")
    args = parser.parse_args(argv)
    if args.command == "suite":
        return suite(args)
    result = baseline(args) if args.command == "baseline" else read_cache(args)
    Path(args.record).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
