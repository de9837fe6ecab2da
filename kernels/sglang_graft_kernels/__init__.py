"""Triton kernels for GRAFT's GPU hot paths.

Each kernel has one torch reference in ``sglang_graft`` and is tested bit-exact against it
(``benchmark/gpu_check.sh``; on a CPU under the Triton interpreter, ``TRITON_INTERPRET=1``):

========================  ==========================================  ==================================
kernel                    what                                        reference
========================  ==========================================  ==================================
``tree_layout``           flatten: positions, depth, ancestor-or-     ``sglang_graft.tree.flatten.
                          self mask and bits, first-child / next-      flatten_torch``
                          sibling links, reachable depth
``tree_mask``             the verify mask written into a buffer:      ``full_tree_mask`` /
                          FULL (tree cells) or bit-packed rows         ``bitpacked_tree_mask``
``recycle_scatter``       recycling-matrix rows, last duplicate wins  ``RecyclingMatrix.update``
                          (each row written once: no write race)       (sort + ``index_copy_``)
``graft_step``            prune -> graft (under the root) -> flatten  ``sglang_graft.tree.
                          of a request in one program                  build_graft_tree``
========================  ==========================================  ==================================

One program per request (tree kernels) or per block of nodes (scatter); no host read, fixed
launch shapes, so every kernel can run inside a CUDA graph. Trees have at most 64 nodes
(ancestor sets are int64 bitmasks).
"""

from .graft_step import graft_step
from .recycle import recycle_scatter
from .tree_layout import MAX_NODES, tree_layout
from .tree_mask import tree_mask

__all__ = ["MAX_NODES", "tree_layout", "tree_mask", "recycle_scatter", "graft_step"]
