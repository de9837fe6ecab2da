"""GRAFT served by SGLang on one GPU, against no speculation and SGLang's EAGLE-3: one run, one report.

    bash benchmark/gpu_serve_check.sh --out DIR            # on the GPU machine (the GPU bundle beside the tree)
    bash benchmark/gpu_serve_check.sh --dry-run --out DIR  # on a CPU: the same flow on CPU servers (CI)

``DIR/gpu_serve.json`` is rewritten after every phase (a run cut short keeps what it measured); each
server's log is ``DIR/<server>.log``. Phases:

1. ``imports`` (its own short process, first): versions, the device, whether the CUDA profile without
   sgl-kernel serves ``sgl_kernel``, SGLang's serving modules and GRAFT's worker import;
2. ``models``: the tiny Llama + EAGLE-3 head and the tiny Qwen3-MoE + head (``test/tiny_models.py``);
3. ``servers``, started together: Llama without speculation, with SGLang's EAGLE-3 (GRAFT's default
   draft shape), with GRAFT's defaults as the device resolves them; Qwen3-MoE without speculation and
   with GRAFT. On CUDA: float32, CUDA graphs and the overlap scheduler on (SGLang's defaults),
   ``--attention-backend triton --sampling-backend pytorch``; the speculative servers count the
   synchronizing CUDA operations of their steps (``SGLANG_GRAFT_SYNC_DEBUG=1``). The dry run forces
   GRAFT's CUDA step on the CPU (``--speculative-graft-sync-free on``);
4. ``greedy``: every prompt alone, then all at once; each speculative server's output ids against its
   model's server without speculation (token-exact counts, the first differing position);
5. ``sampling``: seeded requests with temperature, top-p and top-k complete with the length asked;
6. ``edges``: the context-edge requests (``request_edges.py``): HTTP code, ids, finish reason alike;
7. ``server_info``: per GRAFT server its verify-budget states (memory taken, graph replays), verify mask
   layouts, synchronizing operations in decode steps, step economy and phase times;
8. ``timing``: output tokens per second at batch 1 and batch 8 for each Llama server, same prompts;
9. ``graph``: time allowing, GRAFT with ``--speculative-graft-graph on``: token-exact and its replays.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmark"), str(ROOT / "test")]

from local_server import CPU_ARGS, SGLangServer  # noqa: E402
from request_edges import EDGE_CASES, edge_body  # noqa: E402

# What SGLang imports to serve GRAFT on CUDA: the launcher, managers, model runner, EAGLE V2 worker,
# Triton attention backend, the check's target and draft models, and GRAFT's worker and plugin.
SERVING_MODULES = (
    "sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.models.llama", "sglang.srt.models.llama_eagle3",
    "sglang.srt.models.qwen3", "sglang.srt.models.qwen3_moe", "sglang_graft.sglang.worker",
    "sglang_graft.sglang.plugin",
)
DRY_RUN_EDGES = [EDGE_CASES[0], EDGE_CASES[4], EDGE_CASES[6]]  # (1990, 34), (2040, None), (2043, None): 200, 200, 400
GPU_ARGS = ["--device", "cuda", "--dtype", "float32", "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--mem-fraction-static", "0.08", "--max-total-tokens", "24576", "--max-running-requests", "8",
            "--cuda-graph-max-bs-decode", "8", "--skip-server-warmup", "--log-level", "info"]
DRAFT_SHAPE = ["--speculative-num-steps", "6", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"]


def prompts(count: int) -> list[list[int]]:
    """Token-id prompts of 24-200 tokens: repeated patterns (retrieval has chains to graft) and
    pseudo-random stretches (it has none), alternating."""
    out = []
    for i in range(count):
        n = 24 + (i * 37) % 177
        if i % 2 == 0:
            out.append([20 + (j * (i + 3)) % (40 + i) for j in range(n)])
        else:
            out.append([(j * 2654435761 + i * 97) % 4000 + 50 for j in range(n)])
    return out


class Report:
    """The JSON report, written after every phase."""

    def __init__(self, out: Path, dry_run: bool):
        self.path = out / "gpu_serve.json"
        self.data: dict = {"dry_run": dry_run, "phases": {}, "errors": {}}
        if self.path.exists():  # the imports phase ran first, in its own process
            previous = json.loads(self.path.read_text())
            self.data["phases"].update(previous.get("phases", {}))
            self.data["errors"].update(previous.get("errors", {}))

    def phase(self, name: str, fn, *args):
        """Run one phase; its result (or its error, with the traceback's end) goes in the report."""
        start = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            result = fn(*args)
            self.data["phases"][name] = result
        except Exception as exc:  # noqa: BLE001 -- recorded; later phases may still run
            result = None
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            print(self.data["errors"][name], flush=True)
        self.data.setdefault("seconds", {})[name] = round(time.monotonic() - start, 1)
        self.write()
        return result

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def phase_imports(dry_run: bool) -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for dist in ("triton", "transformers", "sglang", "apache-tvm-ffi", "xgrammar"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    timings = {}
    for name in SERVING_MODULES:
        start = time.monotonic()
        importlib.import_module(name)
        timings[name] = round(time.monotonic() - start, 2)
    import sglang
    import sglang_cuda_standin

    where = Path(sglang.__file__).resolve().parents[1]
    bundle = os.environ.get("GPU_BUNDLE_AT")
    info.update(sglang_from="the GPU bundle" if bundle and where.is_relative_to(Path(bundle).resolve()) else "installed",
                cuda_standin=sglang_cuda_standin.standin_active(), import_s=timings)
    if not dry_run and not info["cuda_standin"]:
        import sgl_kernel

        info["sgl_kernel"] = getattr(sgl_kernel, "__version__", "?")
    return info


def phase_models(models: Path) -> dict:
    from tiny_models import build_eagle3_head, build_target, build_tokenizer

    models.mkdir(parents=True, exist_ok=True)
    if not (models / "tokenizer" / "tokenizer.json").exists():
        build_tokenizer(models / "tokenizer")
    for kind, seed in (("llama", 1), ("qwen3-moe", 2)):
        if not (models / kind / "config.json").exists():
            build_target(kind, models / "tokenizer", models / kind)
        if not (models / f"{kind}-eagle3" / "config.json").exists():
            build_eagle3_head(models / kind, models / f"{kind}-eagle3", seed=seed)
    return {"built": sorted(p.name for p in models.iterdir())}


def server_specs(models: Path, dry_run: bool) -> dict:
    """name -> (model dir, extra args, env): the servers of phase 3."""
    graft_cuda = ["--speculative-graft-sync-free", "on"] if dry_run else []  # the CUDA default, forced on a CPU
    syncs = {"SGLANG_GRAFT_SYNC_DEBUG": "1"}  # off CUDA its report says so (the hooks still run)

    def graft(model: str) -> tuple:
        return (models / model, ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path",
                                 str(models / f"{model}-eagle3"), *graft_cuda], syncs)

    return {
        "llama-none": (models / "llama", [], {}),
        "llama-eagle3": (models / "llama", ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                            str(models / "llama-eagle3"), *DRAFT_SHAPE], syncs),
        "llama-graft": graft("llama"),
        "moe-none": (models / "qwen3-moe", [], {}),
        "moe-graft": graft("qwen3-moe"),
    }


class Servers:
    """The check's servers, started together, stopped together; a server that fails to start is
    reported with its log's end and left out of the phases that need it."""

    def __init__(self, out: Path, dry_run: bool, timeout: float):
        self.out, self.dry_run, self.timeout = out, dry_run, timeout
        self.up: dict[str, SGLangServer] = {}
        self.failed: dict[str, str] = {}

    def start(self, specs: dict) -> dict:
        base = CPU_ARGS if self.dry_run else GPU_ARGS

        def launch(item):
            name, (model, args, env) = item
            srv = SGLangServer(model, args, log_path=self.out / f"{name}.log", timeout=self.timeout, env=env,
                               base_args=base)
            start = time.monotonic()
            try:
                srv.start()
            except Exception as exc:  # noqa: BLE001 -- reported, the others go on
                srv.stop()
                return name, None, f"{type(exc).__name__}: {str(exc)[-2500:]}", time.monotonic() - start
            return name, srv, None, time.monotonic() - start

        started = {}
        with cf.ThreadPoolExecutor(len(specs)) as pool:
            for name, srv, error, seconds in pool.map(launch, specs.items()):
                started[name] = round(seconds, 1)
                if srv is None:
                    self.failed[name] = error
                else:
                    self.up[name] = srv
        return {"start_s": started, "failed": self.failed}

    def stop(self) -> None:
        for srv in self.up.values():
            srv.stop()
        self.up.clear()


def generate(srv: SGLangServer, body: dict, timeout: float = 300) -> dict:
    r = requests.post(srv.url + "/generate", json=body, timeout=timeout)
    return {"code": r.status_code, **(r.json() if r.status_code == 200 else {"error": r.text[:500]})}


def greedy_outputs(srv: SGLangServer, batch: list, new_tokens: int) -> dict:
    """Each prompt alone, then all at once: output ids and meta info."""
    body = lambda ids: {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,  # noqa
                                                               "ignore_eos": True}}
    alone = [generate(srv, body(ids)) for ids in batch]
    with cf.ThreadPoolExecutor(len(batch)) as pool:
        together = list(pool.map(lambda ids: generate(srv, body(ids)), batch))
    return {"alone": alone, "together": together}


def compare(reference: list, outputs: list) -> dict:
    """Token-exact counts of ``outputs`` against ``reference`` (lists of responses), with the first
    differing position of each prompt that differs."""
    diffs = []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        a, b = ref.get("output_ids"), out.get("output_ids")
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a or [], b or [])) if x != y), min(len(a or []), len(b or [])))
            diffs.append({"prompt": i, "first_diff": first, "codes": [ref["code"], out["code"]]})
    return {"identical": len(reference) - len(diffs), "total": len(reference), "diffs": diffs}


def accept_length(responses: list) -> float | None:
    """Output tokens per verify step over ``responses`` (SGLang's ``spec_verify_ct``)."""
    steps = sum(r.get("meta_info", {}).get("spec_verify_ct", 0) or 0 for r in responses)
    tokens = sum(r.get("meta_info", {}).get("completion_tokens", 0) for r in responses)
    return round(tokens / steps, 3) if steps else None


PAIRS = {"llama-eagle3": "llama-none", "llama-graft": "llama-none", "moe-graft": "moe-none"}


def phase_greedy(servers: Servers, batch: list, new_tokens: int, outputs: dict) -> dict:
    """``outputs`` is filled with each server's responses (the graph phase compares against them)."""
    with cf.ThreadPoolExecutor(len(servers.up)) as pool:
        for name, result in zip(servers.up, pool.map(lambda s: greedy_outputs(s, batch, new_tokens),
                                                        servers.up.values())):
            outputs[name] = result
    out = {}
    for spec, plain in PAIRS.items():
        if spec in outputs and plain in outputs:
            ref = outputs[plain]["alone"]
            out[spec] = {"alone": compare(ref, outputs[spec]["alone"]),
                         "together": compare(ref, outputs[spec]["together"]),
                         "accept_length": accept_length(outputs[spec]["alone"] + outputs[spec]["together"])}
    out["plain_batch_invariant"] = {p: compare(outputs[p]["alone"], outputs[p]["together"])
                                    for p in ("llama-none", "moe-none") if p in outputs}
    return out


def phase_sampling(servers: Servers, batch: list, new_tokens: int) -> dict:
    out = {}
    for name in ("llama-graft", "moe-graft", "llama-eagle3"):
        srv = servers.up.get(name)
        if srv is None:
            continue
        params = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": new_tokens, "ignore_eos": True}
        with cf.ThreadPoolExecutor(len(batch)) as pool:
            got = list(pool.map(lambda a: generate(srv, {"input_ids": a[1], "sampling_params": {**params, "sampling_seed": a[0]}}),
                                enumerate(batch)))
        out[name] = {"completed": sum(r["code"] == 200 and len(r["output_ids"]) == new_tokens for r in got),
                     "total": len(got), "accept_length": accept_length(got),
                     "graft_verify": sorted({r.get("meta_info", {}).get("graft_verify", "-") for r in got})}
    return out


def phase_edges(servers: Servers, cases: list) -> dict:
    def ask(srv, case):
        r = generate(srv, edge_body(*case))
        return [r["code"], r.get("output_ids"), (r.get("meta_info") or {}).get("finish_reason")]

    answers = {}
    for name in ("llama-none", "llama-graft"):
        srv = servers.up.get(name)
        if srv is not None:
            alone = [ask(srv, case) for case in cases]
            with cf.ThreadPoolExecutor(len(cases)) as pool:
                together = list(pool.map(lambda c: ask(srv, c), cases))
            answers[name] = (alone, together)
    if len(answers) < 2:
        return {"skipped": "a Llama server is missing"}
    ref = answers["llama-none"][0]
    alone, together = answers["llama-graft"]
    return {"codes": [a[0] for a in ref], "alone_equal": sum(a == b for a, b in zip(ref, alone)),
            "together_equal": sum(a == b for a, b in zip(ref, together)), "total": len(ref),
            "differ": [list(case) for case, a, b, c in zip(cases, ref, alone, together) if not a == b == c]}


def server_info(srv: SGLangServer) -> dict:
    info = requests.get(srv.url + "/server_info", timeout=60).json()
    return (info.get("internal_states") or [{}])[0]


def phase_server_info(servers: Servers) -> dict:
    out = {}
    for name, srv in servers.up.items():
        if name.endswith("-none"):
            continue
        state = server_info(srv)
        graft = state.get("graft") or {}
        economy = graft.get("economy") or {}
        out[name] = {
            "cuda_syncs": state.get("cuda_syncs"),
            "budget_states": graft.get("budget_states"), "start_up": graft.get("start_up"),
            "verify_masks": graft.get("verify_masks"),
            "graph": graft.get("graph"), "sync_free": graft.get("sync_free"),
            "step_time": economy.get("step_time"), "steps": economy.get("steps"),
            "budget_histogram": economy.get("budget_histogram"), "mean_draft_passes": economy.get("mean_draft_passes"),
            "expected_vs_committed": economy.get("expected_vs_committed"),
            "avg_spec_accept_length": state.get("avg_spec_accept_length"),
        }
    return out


def phase_timing(servers: Servers, batch: list, new_tokens: int) -> dict:
    """Output tokens per second, each Llama server alone on the machine's attention (one at a time)."""
    out = {}
    body = lambda ids: {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,  # noqa
                                                               "ignore_eos": True}}
    for name in ("llama-none", "llama-eagle3", "llama-graft"):
        srv = servers.up.get(name)
        if srv is None:
            continue
        generate(srv, body(batch[0]))  # warm
        start = time.monotonic()
        one = [generate(srv, body(ids)) for ids in batch[:4]]
        t1 = time.monotonic() - start
        start = time.monotonic()
        with cf.ThreadPoolExecutor(len(batch)) as pool:
            many = list(pool.map(lambda ids: generate(srv, body(ids)), batch))
        t8 = time.monotonic() - start
        out[name] = {"batch1_tok_s": round(sum(len(r["output_ids"]) for r in one) / t1, 1),
                     f"batch{len(batch)}_tok_s": round(sum(len(r["output_ids"]) for r in many) / t8, 1),
                     "accept_length": accept_length(one + many)}
    base = out.get("llama-none")
    if base:
        for name, row in out.items():
            row["ratio_batch1"] = round(row["batch1_tok_s"] / base["batch1_tok_s"], 3)
    return out


def phase_graph(out_dir: Path, models: Path, dry_run: bool, batch: list, new_tokens: int, timeout: float,
                reference: dict) -> dict:
    servers = Servers(out_dir, dry_run, timeout)
    name, (model, args, env) = "llama-graft-graph", server_specs(models, dry_run)["llama-graft"]
    started = servers.start({name: (model, [*args, "--speculative-graft-graph", "on"], env)})
    if name not in servers.up:
        return started
    try:
        got = greedy_outputs(servers.up[name], batch, new_tokens)
        graph = (server_info(servers.up[name]).get("graft") or {}).get("graph")
    finally:
        servers.stop()
    return {**started, "alone": compare(reference["alone"], got["alone"]),
            "together": compare(reference["together"], got["together"]), "graph": graph}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU servers (the CI check of this script)")
    ap.add_argument("--phase", choices=("imports", "serve"), default="serve")
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip the optional phases past this")
    ap.add_argument("--models", type=Path, default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, args.dry_run)
    if args.phase == "imports":
        report.phase("imports", phase_imports, args.dry_run)
        return 1 if "imports" in report.data["errors"] else 0
    deadline = time.monotonic() + args.budget_s
    models = args.models or args.out / "models"
    n_prompts, new_tokens = (4, 16) if args.dry_run else (8, 64)
    batch = prompts(n_prompts)
    if report.phase("models", phase_models, models) is None:
        return 1
    start_timeout = 480.0 if args.dry_run else 300.0  # a loaded 2-core machine starts five CPU servers slowly
    servers = Servers(args.out, args.dry_run, timeout=start_timeout)
    try:
        report.phase("servers", servers.start, server_specs(models, args.dry_run))
        outputs: dict = {}
        report.phase("greedy", phase_greedy, servers, batch, new_tokens, outputs)
        report.phase("sampling", phase_sampling, servers, batch, new_tokens)
        # the dry run checks the flow with one case of each kind (a limit, the default length into the
        # context's end, a refused prompt); the edge tests serve them all on CPU servers
        report.phase("edges", phase_edges, servers, DRY_RUN_EDGES if args.dry_run else EDGE_CASES)
        report.phase("server_info", phase_server_info, servers)
        report.phase("timing", phase_timing, servers, batch[:2] if args.dry_run else batch, 8 if args.dry_run else 128)
    finally:
        servers.stop()
    reference = outputs.get("llama-none")
    if reference is not None and time.monotonic() < deadline - 120:
        report.phase("graph", phase_graph, args.out, models, args.dry_run, batch, new_tokens, start_timeout, reference)
    report.data["complete"] = True
    report.write()
    return 1 if report.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
