"""SGLang's float32 ``x @ W^T`` against the CPU port's small-row kernels, on one model's layer shapes.

One forward's linear layers and lm_head (by default SmolLM2-135M: 30 layers of qkv 576 -> 960,
o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576, distinct weights per layer so the weights stream
from memory as in serving, and the 49152 x 576 lm_head), for 1 to 256 rows, one thread; milliseconds
per forward, the median of ``--repeats``.

    OMP_NUM_THREADS=1 python benchmark/studies/linear_rows.py

``--python-loops`` adds the kernels driven from Python, a call per row block and chunk of tiles (as
before the loops moved into the compiled driver, ``gemm_ir.driver_ir``); the products take turns
within each repeat, so a machine's drift moves them alike. ``--prefetch-ab`` adds the kernels
compiled without their software prefetch (``gemm_ir.PREFETCH_BYTES``); ``--block-ab B`` the kernels
compiled with blocks of at most ``B`` rows (``gemm_ir.MAX_BLOCK``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sglang_cpu_port import gemm_ir
from sglang_cpu_port.linear import MAX_ROWS, rows_linear

SMOLLM2 = {"layers": 30, "hidden": 576, "qkv": 960, "intermediate": 1536, "vocab": 49152}


def forward_ms(products: dict, weights, lm_head, rows: int, hidden: int, intermediate: int,
               repeats: int) -> dict:
    """Median ms of one forward's linears per product, the products taking turns in each repeat."""
    x, x_mlp = torch.randn(rows, hidden), torch.randn(rows, intermediate)

    def once(product):
        for qkv, o, gate_up, down in weights:
            product(x, qkv), product(x, o), product(x, gate_up), product(x_mlp, down)
        product(x, lm_head)

    times = {name: [] for name in products}
    for name, product in products.items():
        once(product)
    for _ in range(repeats):
        for name, product in products.items():
            start = time.perf_counter()
            once(product)
            times[name].append(time.perf_counter() - start)
    return {name: round(1e3 * statistics.median(t), 1) for name, t in times.items()}


def python_loop_product(kern, x_ptr, ldx, rows, packed_ptr, tiles, depth, out_ptr, ldo) -> None:
    """``gemm_ir.product`` with its loops in Python: a call per row block and chunk of tiles."""
    tile = kern.tile
    chunk = gemm_ir.chunk_tiles(kern, rows, tiles, depth)
    for start in range(0, tiles, chunk):
        count = min(chunk, tiles - start)
        for done in range(0, rows, kern.max_block):
            block = min(kern.max_block, rows - done)
            kern.by_rows[block](x_ptr + 4 * done * ldx, ldx, packed_ptr + 4 * start * depth * tile, count, depth,
                                out_ptr + 4 * (done * ldo + start * tile), ldo)


def swapped(name: str, value):
    """:func:`rows_linear` with ``gemm_ir.<name>`` set to ``value`` during each call: ``product`` ->
    :func:`python_loop_product` (the loops in Python), ``_KERNELS`` -> other compiled kernels."""
    def product(x, weight):
        kept = getattr(gemm_ir, name)
        setattr(gemm_ir, name, value)
        try:
            return rows_linear(x, weight)
        finally:
            setattr(gemm_ir, name, kept)
    return product


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--python-loops", action="store_true", help="add the kernels driven from Python")
    ap.add_argument("--prefetch-ab", action="store_true", help="add the kernels without software prefetch")
    ap.add_argument("--block-ab", type=int, help="add the kernels with blocks of at most this many rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = SMOLLM2
    h, i = m["hidden"], m["intermediate"]
    weights = [(torch.randn(m["qkv"], h), torch.randn(h, h), torch.randn(2 * i, h), torch.randn(h, i))
               for _ in range(m["layers"])]
    lm_head = torch.randn(m["vocab"], h)
    products = {"torch": torch.nn.functional.linear, "kernels": rows_linear}
    if args.python_loops:
        products["kernels, loops in Python"] = swapped("product", python_loop_product)
    if args.prefetch_ab:
        products["kernels, no prefetch"] = swapped("_KERNELS", gemm_ir._Kernels(prefetch=0))
    if args.block_ab:
        products[f"kernels, blocks of {args.block_ab}"] = swapped("_KERNELS", gemm_ir._Kernels(max_block=args.block_ab))
    print("| rows | " + " | ".join(f"{name} ms" for name in products) + " |\n|---|" + "---|" * len(products))
    report = {}
    for rows in args.rows:
        assert rows <= MAX_ROWS, f"the kernels take at most {MAX_ROWS} rows"
        report[rows] = forward_ms(products, weights, lm_head, rows, h, i, args.repeats)
        print(f"| {rows} | " + " | ".join(str(report[rows][name]) for name in products) + " |", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
