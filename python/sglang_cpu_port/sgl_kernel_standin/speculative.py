"""``sgl_kernel.speculative`` of the CPU stand-in (used by SGLang's NGRAM worker on CPU)."""

from sglang_cpu_port.tree_ops import reconstruct_indices_from_tree_mask  # noqa: F401
