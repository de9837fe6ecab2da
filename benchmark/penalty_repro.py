"""Greedy requests with penalties under concurrency on a plain SGLang server (no speculation).

Sends 16 greedy requests (4 of them each with frequency, presence or repetition penalties) alone,
then 3 rounds concurrently with random arrival times, and counts requests whose output differs from
their output alone. Run it with the overlap scheduler (SGLang's default) and without:

    .venv/bin/python benchmark/penalty_repro.py                               # overlap scheduler
    .venv/bin/python benchmark/penalty_repro.py --disable-overlap-schedule

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

HERE = Path(__file__).resolve().parent
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


def main() -> None:
    from tiny_models import build_all

    extra = sys.argv[1:]
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
