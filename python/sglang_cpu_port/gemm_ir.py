"""Register-blocked float32 ``x @ W^T`` kernels for a few rows, written in LLVM IR and compiled for
the host CPU with llvmlite (numba's code generator, already installed with SGLang).

The weight is read from a **packed** copy, ``[tiles, K, tile]`` (``tile`` = 32 output columns with
AVX-512, zero-padded to a whole tile), so one tile's weights stream contiguously. For each tile a kernel keeps
``rows x tile`` accumulators in vector registers and, for every ``k``, loads the tile's ``tile``
weights once and broadcasts each row's ``x[r, k]`` against them (the outer-product form of a GEMM
micro-kernel). Per weight load it does ``rows`` fused multiply-adds, so up to :data:`MAX_BLOCK` rows
cost about what one row costs while the weights stream from memory. Without AVX-512 (16 registers of
8 lanes) tiles are :data:`AVX2_TILE` columns and blocks up to :data:`AVX2_BLOCK` rows. More rows go
in blocks, the tiles in L2-sized chunks so each weight comes from memory once (:func:`product`).

Every output is the same chain, whatever the row count or the row's place in a block::

    out[r, j] = fma(x[r, K-1], w[j, K-1], ... fma(x[r, 1], w[j, 1], fma(x[r, 0], w[j, 0], 0.0)))

so a row's result depends on that row and the weight alone: the product is batch-invariant for any
number of rows (a request's verify rows are bit-identical whatever batch they are in, and one row
equals the same row among twelve).

Worked example (``x`` [3, K], one tile): the 3-row kernel runs ``k = 0 .. K-1``; at each ``k`` it
loads ``w_packed[tile, k, 0:32]`` (two 16-lane vectors) and does 3 x 2 vector FMAs with
``x[0, k]``, ``x[1, k]``, ``x[2, k]`` broadcast; after the last ``k`` it stores the 3 x 32 sums.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Dict, Optional

from sglang_cpu_port.llvm_jit import Compiled

logger = logging.getLogger(__name__)

TILE = 32  # AVX-512: output columns per packed tile, two 16-lane vectors
# AVX-512: rows one call keeps in registers, 12 x 2 accumulators + 2 weight vectors + 1 broadcast = 27
# of 32. Against blocks of 8 on an AVX-512 Xeon, SmolLM2-135M's linears + lm_head, one thread, ms per
# forward (``benchmark/studies/linear_rows.py --block-ab 8``): 12 rows 61.0 -> 50.5, 16 rows 65.2 -> 60.2,
# 24 rows 78.0 -> 69.0, 32 rows 90.9 -> 82.0; 1 to 8 rows alike (the same kernels).
MAX_BLOCK = 12
AVX2_TILE = 24  # AVX2 only: three 8-lane vectors
AVX2_BLOCK = 4  # AVX2 only: 4 x 3 accumulators + 3 weight vectors + 1 broadcast = 16 registers
CHUNK_BYTES = 1 << 19  # packed weights every row block reads in turn while they stay in L2
# How far ahead of its loads a kernel prefetches the packed weights it streams: two cache lines per
# ``k`` at this distance (``0``: none), into L2 (``prefetcht1``: L2's queue keeps more lines in flight
# than L1's fill buffers). Chosen on an AVX-512 Xeon, where the hardware prefetcher alone left 8 rows
# at 1.6x one row's time; SmolLM2-135M's linears, one thread, against 8 KiB into L1: 4 rows 48.4 ->
# 42.3 ms, 8 rows 55.3 -> 50.0, 1 row 42.0 -> 41.7 (``benchmark/studies/linear_rows.py --prefetch-ab`` compares
# with no prefetch).
PREFETCH_BYTES = 16384
PREFETCH_LOCALITY = 2  # llvm.prefetch's locality: 3 = L1 (t0), 2 = L2 (t1), 1 = t2, 0 = non-temporal

_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                          ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
_DRIVER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def kernel_ir(rows: int, name: str, lanes: int = 16, vecs: int = 2, tile: int = TILE,
              prefetch: int = PREFETCH_BYTES) -> str:
    """LLVM IR of ``void name(x, ldx, w_packed, tiles, K, out, ldo)`` for ``rows`` rows, each tile of
    ``tile = lanes * vecs`` columns in ``vecs`` vectors of ``lanes`` floats.

    x: ``rows`` rows of ``K`` floats, ``ldx`` apart; w_packed: ``[tiles, K, tile]``;
    out: ``rows`` rows of ``tiles * tile`` floats, ``ldo`` apart. ``tiles >= 1`` and ``K >= 1``.
    With ``prefetch`` > 0 each ``k`` also prefetches the two cache lines ``prefetch`` bytes ahead in
    the packed weights, into L2 (past a tile's end: the next tile's start; past the weight's end the hint is
    dropped: a prefetch never faults). Prefetches change no result.
    """
    assert lanes * vecs == tile
    vt = f"<{lanes} x float>"
    fma = f"@llvm.fma.v{lanes}f32"
    ir = [f"define void @{name}(float* noalias nocapture readonly %x, i64 %ldx, float* noalias nocapture "
          f"readonly %w, i64 %tiles, i64 %K, float* noalias nocapture %out, i64 %ldo) #0 {{",
          "entry:", "  br label %tile",
          "tile:", "  %t = phi i64 [0, %entry], [%tn, %tend]",
          "  %tk = mul i64 %t, %K", f"  %wb0 = mul i64 %tk, {tile}",
          "  %wb = getelementptr inbounds float, float* %w, i64 %wb0", "  br label %kloop",
          "kloop:", "  %k = phi i64 [0, %tile], [%kn, %kloop]"]
    for r in range(rows):
        for v in range(vecs):
            ir.append(f"  %a{r}_{v} = phi {vt} [zeroinitializer, %tile], [%n{r}_{v}, %kloop]")
    ir.append(f"  %wo = mul i64 %k, {tile}")
    for j in range(2 if prefetch else 0):
        ir += [f"  %pfo{j} = add i64 %wo, {(prefetch + 64 * j) // 4}",
               f"  %pfp{j} = getelementptr float, float* %wb, i64 %pfo{j}",  # not inbounds: may pass the end
               f"  %pfc{j} = bitcast float* %pfp{j} to i8*",
               f"  call void @llvm.prefetch.p0i8(i8* %pfc{j}, i32 0, i32 {PREFETCH_LOCALITY}, i32 1)"]
    for v in range(vecs):
        ir += [f"  %wo{v} = add i64 %wo, {lanes * v}",
               f"  %wp{v} = getelementptr inbounds float, float* %wb, i64 %wo{v}",
               f"  %wv{v} = bitcast float* %wp{v} to {vt}*",
               f"  %w{v} = load {vt}, {vt}* %wv{v}, align 4"]
    for r in range(rows):
        ir += [f"  %xo{r}a = mul i64 %ldx, {r}", f"  %xo{r} = add i64 %xo{r}a, %k",
               f"  %xp{r} = getelementptr inbounds float, float* %x, i64 %xo{r}",
               f"  %xs{r} = load float, float* %xp{r}, align 4",
               f"  %xi{r} = insertelement {vt} undef, float %xs{r}, i32 0",
               f"  %xb{r} = shufflevector {vt} %xi{r}, {vt} undef, <{lanes} x i32> zeroinitializer"]
        for v in range(vecs):
            ir.append(f"  %n{r}_{v} = call {vt} {fma}({vt} %xb{r}, {vt} %w{v}, {vt} %a{r}_{v})")
    ir += ["  %kn = add i64 %k, 1", "  %kd = icmp eq i64 %kn, %K", "  br i1 %kd, label %tend, label %kloop",
           "tend:", f"  %ob = mul i64 %t, {tile}"]
    for r in range(rows):
        ir += [f"  %oo{r}a = mul i64 %ldo, {r}", f"  %oo{r} = add i64 %oo{r}a, %ob"]
        for v in range(vecs):
            ir += [f"  %oo{r}_{v} = add i64 %oo{r}, {lanes * v}",
                   f"  %op{r}_{v} = getelementptr inbounds float, float* %out, i64 %oo{r}_{v}",
                   f"  %opv{r}_{v} = bitcast float* %op{r}_{v} to {vt}*",
                   f"  store {vt} %n{r}_{v}, {vt}* %opv{r}_{v}, align 4"]
    ir += ["  %tn = add i64 %t, 1", "  %td = icmp eq i64 %tn, %tiles", "  br i1 %td, label %done, label %tile",
           "done:", "  ret void", "}"]
    return "\n".join(ir)


def driver_ir(max_block: int, tile: int, name: str = "product") -> str:
    """LLVM IR of ``void name(x, ldx, rows, w_packed, tiles, K, out, ldo, chunk)``: :func:`product`'s
    loops in one call (``rows >= 1``, ``chunk >= 1`` tiles): for each chunk of tiles, the row blocks of
    up to ``max_block`` rows in turn, each through ``rows{block}`` of :func:`kernel_ir`. A call from
    Python costs a few microseconds, and in L2-sized chunks a forward of SmolLM2-135M's linears takes
    about 2,300 block calls at 8 rows, so the loops run here (``benchmark/studies/linear_rows.py
    --python-loops``).

    ``rows`` is split into blocks in order: ``max_block`` rows while more remain, then the rest, so
    the blocks (and each row's chain of fused multiply-adds) are those of a Python loop over them."""
    cases = " ".join(f"i64 {b}, label %b{b}" for b in range(2, max_block + 1))
    ir = [f"define void @{name}(float* %x, i64 %ldx, i64 %rows, float* %w, i64 %tiles, i64 %K, "
          "float* %out, i64 %ldo, i64 %per) #0 {",
          "entry:", "  br label %chunk",
          "chunk:", "  %start = phi i64 [0, %entry], [%next, %cend]",
          "  %left = sub i64 %tiles, %start", "  %short = icmp slt i64 %left, %per",
          "  %count = select i1 %short, i64 %left, i64 %per",
          "  %wo0 = mul i64 %start, %K", f"  %wo = mul i64 %wo0, {tile}",
          "  %wp = getelementptr float, float* %w, i64 %wo", f"  %oc = mul i64 %start, {tile}",
          "  br label %block",
          "block:", "  %done = phi i64 [0, %chunk], " + ", ".join(f"[%dn{b}, %b{b}]" for b in range(1, max_block + 1)),
          "  %rest = sub i64 %rows, %done", f"  %full = icmp sgt i64 %rest, {max_block}",
          f"  %bs = select i1 %full, i64 {max_block}, i64 %rest",
          "  %xo = mul i64 %done, %ldx", "  %xp = getelementptr float, float* %x, i64 %xo",
          "  %oo0 = mul i64 %done, %ldo", "  %oo = add i64 %oo0, %oc", "  %op = getelementptr float, float* %out, i64 %oo",
          f"  switch i64 %bs, label %b1 [{cases}]"]
    for b in range(1, max_block + 1):
        ir += [f"b{b}:",
               f"  call void @rows{b}(float* %xp, i64 %ldx, float* %wp, i64 %count, i64 %K, float* %op, i64 %ldo)",
               f"  %dn{b} = add i64 %done, {b}", f"  %bd{b} = icmp sge i64 %dn{b}, %rows",
               f"  br i1 %bd{b}, label %cend, label %block"]
    ir += ["cend:", "  %next = add i64 %start, %count", "  %cd = icmp sge i64 %next, %tiles",
           "  br i1 %cd, label %exit, label %chunk", "exit:", "  ret void", "}"]
    return "\n".join(ir)


class _Kernels:
    """The compiled kernels for 1 .. ``max_block`` rows and the packed ``tile`` width they read (kept
    alive with their engine): with AVX-512, tiles of 32 columns in two 16-lane vectors and blocks of
    up to 12 rows; with AVX2 only (16 vector registers of 8 lanes), tiles of 24 columns and blocks of up
    to 4 rows (``OMP_NUM_THREADS=1 python benchmark/studies/linear_rows.py`` on a Zen 4 without AVX-512: 4 rows
    of the 49152 x 576 lm_head 4.9 against 7.7 ms with the 32-column tiles, which left 2 rows a block).
    """

    def __init__(self, wide: Optional[bool] = None, prefetch: int = PREFETCH_BYTES,
                 max_block: Optional[int] = None) -> None:
        """``wide``: the AVX-512 shapes (True) or the AVX2 ones (False) whatever the host has (LLVM
        splits a 16-lane vector into two where the host has 8); ``None``: what the host has.
        ``prefetch``: :func:`kernel_ir`'s prefetch distance in bytes (0: none). ``max_block``: the
        most rows a kernel call keeps in registers (``None``: the shape's own, :data:`MAX_BLOCK` or
        :data:`AVX2_BLOCK`)."""
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        features = llvm.get_host_cpu_features()
        if features.get("avx512f", False) if wide is None else wide:
            self.max_block, self.tile, lanes = MAX_BLOCK, TILE, 16
        else:
            self.max_block, self.tile, lanes = AVX2_BLOCK, AVX2_TILE, 8
        self.max_block = max_block or self.max_block
        module = "\n\n".join(
            [f"declare <{lanes} x float> @llvm.fma.v{lanes}f32(<{lanes} x float>, <{lanes} x float>, "
             f"<{lanes} x float>)",
             "declare void @llvm.prefetch.p0i8(i8*, i32, i32, i32)",
             f'attributes #0 = {{ nounwind "prefer-vector-width"="{32 * lanes}" }}']
            + [kernel_ir(rows, f"rows{rows}", lanes=lanes, vecs=self.tile // lanes, tile=self.tile, prefetch=prefetch)
               for rows in range(1, self.max_block + 1)]
            + [driver_ir(self.max_block, self.tile)])
        self._compiled = Compiled(module)
        self.by_rows: Dict[int, ctypes._CFuncPtr] = {
            rows: _PROTO(self._compiled.address(f"rows{rows}")) for rows in range(1, self.max_block + 1)}
        self.product = _DRIVER(self._compiled.address("product"))

    def assembly(self) -> str:
        """The host code the kernels compiled to (for inspection)."""
        return self._compiled.assembly()


_LOCK = threading.Lock()
_KERNELS: Optional[_Kernels] = None
_FAILED: Optional[str] = None


def kernels() -> Optional[_Kernels]:
    """The kernels, compiled on first use; ``None`` where the host has no FMA (``llvm.fma`` would be
    a library call there) or compilation failed (:func:`failure` says why)."""
    global _KERNELS, _FAILED
    if _KERNELS is None and _FAILED is None:
        with _LOCK:
            if _KERNELS is None and _FAILED is None:
                try:
                    import llvmlite.binding as llvm

                    llvm.initialize_native_target()
                    if not llvm.get_host_cpu_features().get("fma", False):
                        _FAILED = "the CPU has no fused multiply-add"
                    else:
                        _KERNELS = _Kernels()
                except Exception as exc:  # noqa: BLE001 - reported by failure(), SGLang's product is kept
                    _FAILED = f"{type(exc).__name__}: {exc}"
                if _FAILED is not None:
                    logger.warning("sglang-graft CPU support: the small-row linear kernels are off (%s); "
                                   "float32 linears keep SGLang's own product", _FAILED)
    return _KERNELS


def failure() -> Optional[str]:
    """Why :func:`kernels` is ``None`` (``None`` when they compiled or were not asked for yet)."""
    return _FAILED


def product(kern: _Kernels, x_ptr: int, ldx: int, rows: int, packed_ptr: int, tiles: int, depth: int,
            out_ptr: int, ldo: int) -> None:
    """``out[r, :tiles * kern.tile] = x[r] @ W^T`` for ``rows`` rows; pointers to float32 memory laid out
    as :func:`kernel_ir` says.

    Rows go in blocks of up to ``kern.max_block``. With more than one block the tiles go in chunks of
    about :data:`CHUNK_BYTES`, every block over one chunk before the next, so the weights stream from
    memory once and the later blocks read them from L2. Worked example (AVX2, 6 rows, ``K`` = 576, one
    tile 54 KiB, so 9 tiles a chunk): for each chunk, rows 0-3 then rows 4-5 over the chunk's tiles.
    The loops run in one compiled call (:func:`driver_ir`).
    """
    kern.product(x_ptr, ldx, rows, packed_ptr, tiles, depth, out_ptr, ldo, chunk_tiles(kern, rows, tiles, depth))


def chunk_tiles(kern: _Kernels, rows: int, tiles: int, depth: int) -> int:
    """Tiles per chunk for :func:`product`: all of them for one block of rows, else about
    :data:`CHUNK_BYTES` of packed weights (at least one tile)."""
    return tiles if rows <= kern.max_block else max(1, CHUNK_BYTES // (4 * depth * kern.tile))
