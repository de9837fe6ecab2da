"""SGLang's float32 ``x @ W^T`` against the CPU port's small-row kernels, on one model's layer shapes.

One forward's linear layers and lm_head (by default SmolLM2-135M: 30 layers of qkv 576 -> 960,
o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576, distinct weights per layer so the weights stream
from memory as in serving, and the 49152 x 576 lm_head), for 1 to 256 rows, one thread; milliseconds
per forward, the median of ``--repeats``.

    OMP_NUM_THREADS=1 python benchmark/linear_rows.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sglang_cpu_port.linear import MAX_ROWS, rows_linear

SMOLLM2 = {"layers": 30, "hidden": 576, "qkv": 960, "intermediate": 1536, "vocab": 49152}


def forward_ms(product, weights, lm_head, rows: int, hidden: int, intermediate: int, repeats: int) -> float:
    x, x_mlp = torch.randn(rows, hidden), torch.randn(rows, intermediate)

    def once():
        for qkv, o, gate_up, down in weights:
            product(x, qkv), product(x, o), product(x, gate_up), product(x_mlp, down)
        product(x, lm_head)

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = SMOLLM2
    h, i = m["hidden"], m["intermediate"]
    weights = [(torch.randn(m["qkv"], h), torch.randn(h, h), torch.randn(2 * i, h), torch.randn(h, i))
               for _ in range(m["layers"])]
    lm_head = torch.randn(m["vocab"], h)
    products = {"torch": torch.nn.functional.linear, "kernels": rows_linear}
    print("| rows | torch x @ W^T ms | kernels ms |\n|---|---|---|")
    report = {}
    for rows in args.rows:
        assert rows <= MAX_ROWS, f"the kernels take at most {MAX_ROWS} rows"
        report[rows] = {name: round(forward_ms(p, weights, lm_head, rows, h, i, args.repeats), 1)
                        for name, p in products.items()}
        print(f"| {rows} | {report[rows]['torch']} | {report[rows]['kernels']} |", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
