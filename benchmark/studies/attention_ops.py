"""The CPU port's attention ops on one model's head shapes: a decode step and a verify of ``E`` tree
tokens (a chain mask) for ``--batch`` requests of ``--context`` tokens each, milliseconds per forward
(``--layers`` calls), the median of ``--repeats``; one thread. Default shapes: SmolLM2-135M (9 query
heads, 3 kv heads, head size 64, 30 layers).

    OMP_NUM_THREADS=1 python benchmark/studies/attention_ops.py --batch 8 --context 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sglang_cpu_port.attention import decode_attention_cpu, extend_attention_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--extend", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "HKV", "D"))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    h, hkv, d = args.heads
    bs, ctx, room = args.batch, args.context, args.context + max(args.extend)
    k_buf, v_buf = torch.randn(bs * room + 1, hkv, d), torch.randn(bs * room + 1, hkv, d)
    req_to_token = torch.zeros(bs + 1, room, dtype=torch.int32)
    for b in range(bs):
        req_to_token[b] = torch.arange(b * room, (b + 1) * room)
    pool_idx = torch.arange(bs)

    def ms(call) -> float:
        call()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.layers):
                call()
            times.append(time.perf_counter() - start)
        return round(1e3 * statistics.median(times), 1)

    q, out = torch.randn(bs, h, d), torch.empty(bs, h, d)
    seq = torch.full((bs,), ctx)
    report = {"decode": ms(lambda: decode_attention_cpu(
        q, k_buf, v_buf, 1.0, 1.0, out, None, None, torch.zeros(bs, dtype=torch.int64), torch.empty(0),
        req_to_token, pool_idx, seq, d ** -0.5, 0.0, False, 0, None, None))}
    for e in args.extend:
        qe, oe = torch.randn(bs * e, h, d), torch.empty(bs * e, h, d)
        chain = torch.ones(e, e, dtype=torch.bool).tril().repeat(bs, 1, 1).flatten()
        report[f"verify E={e}"] = ms(lambda: extend_attention_cpu(
            qe, None, None, oe, k_buf, v_buf, 1.0, 1.0, req_to_token, pool_idx, torch.full((bs,), ctx + e),
            torch.full((bs,), e), torch.arange(bs) * e, e, d ** -0.5, 0.0, False, 0, None, None, chain, True))
    print(json.dumps({"batch": bs, "context": ctx, "ms_per_forward": report}))


if __name__ == "__main__":
    main()
