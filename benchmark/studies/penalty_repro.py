"""Greedy requests with penalties under concurrency on a plain SGLang server (no speculation).

Sends 16 greedy requests (4 of them each with frequency, presence or repetition penalties) alone,
then 3 rounds concurrently with random arrival times, and counts requests whose output differs from
their output alone. Run it with the overlap scheduler (SGLang's default) and without:

    .venv/bin/python benchmark/studies/penalty_repro.py                               # overlap scheduler
    .venv/bin/python benchmark/studies/penalty_repro.py --disable-overlap-schedule
    .venv/bin/python benchmark/studies/penalty_repro.py --speculative EAGLE3          # vs speculation (below)

``--speculative ALGO [MODEL DRAFT]`` instead sends each of the 16 requests alone to a plain server
without the overlap scheduler and to a server with ``--speculative-algorithm ALGO`` (3 steps, topk 2, 8
draft tokens; the tiny Llama and its random EAGLE-3 head unless MODEL and DRAFT are given: with a random
head a step rarely accepts more than one token, and one token per step is counted exactly), and counts
the requests whose outputs differ, by penalty kind.

The tiny fixtures come from ``test/tiny_models.py`` (built into a temporary directory).
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import sys
import tempfile
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parents[1]  # benchmark/
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "test"))

from local_server import SGLangServer  # noqa: E402

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "x = 1\nx = 1\nx = 1\nx = 1\n",
           "The quick brown fox", "class Config:\n    def __init__(self"]
PENALTIES = [{}, {"frequency_penalty": 0.8}, {"presence_penalty": 0.6}, {"repetition_penalty": 1.3}]


def generate(url: str, prompt: str, n: int, delay: float, **sp) -> list[int]:
    time.sleep(delay)
    r = requests.post(url + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sp}}, timeout=300)
    r.raise_for_status()
    return r.json()["output_ids"]


def against_speculation(model: Path, draft: Path, algorithm: str, reqs: list, tmp: str) -> None:
    spec = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"]
    outs = {}
    for name, args in (("plain", ["--disable-overlap-schedule"]), (algorithm, spec)):
        with SGLangServer(model, args, log_path=Path(tmp) / f"{name}.log") as srv:
            outs[name] = [generate(srv.url, p, n, 0.0, **sp) for p, n, sp in reqs]
    kinds = {}
    for (_, _, sp), a, b in zip(reqs, outs["plain"], outs[algorithm]):
        kind = next(iter(sp), "none")
        total, differ = kinds.get(kind, (0, 0))
        kinds[kind] = (total + 1, differ + (a != b))
    print(f"{algorithm} against no speculation (each request alone, greedy): " + ", ".join(
        f"{kind} {d} of {t} differ" for kind, (t, d) in kinds.items()))


def main() -> None:
    from tiny_models import build_all

    extra = sys.argv[1:]
    if extra[:1] == ["--speculative"]:
        reqs = [(PROMPTS[i % 4], 20 + (i * 5) % 40, PENALTIES[i % 4]) for i in range(16)]
        with tempfile.TemporaryDirectory() as tmp:
            if len(extra) >= 4:
                model, draft = Path(extra[2]), Path(extra[3])
            else:
                models = build_all(Path(tmp))
                model, draft = models["llama"], models["llama-eagle3"]
            against_speculation(model, draft, extra[1], reqs, tmp)
        return
    rng = random.Random(0)
    reqs = [(PROMPTS[i % 4], 20 + (i * 5) % 40, PENALTIES[i % 4]) for i in range(16)]
    with tempfile.TemporaryDirectory() as tmp:
        models = build_all(Path(tmp))
        with SGLangServer(models["llama"], extra, log_path=Path(tmp) / "server.log") as srv:
            alone = [generate(srv.url, p, n, 0.0, **sp) for p, n, sp in reqs]
            diverged = {"penalty": 0, "plain": 0}
            for _ in range(3):
                with cf.ThreadPoolExecutor(16) as pool:
                    futs = [pool.submit(generate, srv.url, p, n, rng.random(), **sp) for p, n, sp in reqs]
                    outs = [f.result() for f in futs]
                for out, ref, (_, _, sp) in zip(outs, alone, reqs):
                    diverged["penalty" if sp else "plain"] += out != ref
    print(f"flags {extra or '(default: overlap scheduler)'}: over 3 rounds, {diverged['penalty']} of 36 penalty "
          f"requests and {diverged['plain']} of 12 plain requests differ from their output alone")


if __name__ == "__main__":
    main()
