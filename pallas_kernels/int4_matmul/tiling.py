"""The INT4 kernel's output / contraction tiles from its shapes (m rows per block, K -> N), within a VMEM budget.

Per grid step the kernel pays a fixed cost (~0.35 us, JAX's Pallas TPU matmul guide) on top of its data, so a
block of few rows (a decode step's 16) wants few, wide steps: an expert's whole [K, N/2] in one step at
GLM-5's widths. The rule: among the (tk, tn) whose VMEM (`vmem_bytes`) fits `VMEM_BUDGET`, the fewest steps
per row block on the busiest of a chip's two TensorCores, ceil(N / tn / 2) x (K / tk) (the output-tile axis
is the one the cores split; the row-block axis is dynamic and not split, kernel.py), then the fewest steps
in all, then the wider tn (the activations are re-read per output tile); at least two output tiles when N
has them; at most `MAX_UNROLLED` (chunk, sub-tile) pieces per step (the kernel body unrolls over them).
"""
from __future__ import annotations

PER_WORD = 8                 # 4-bit values per int32 word
LANES = 128
# v5p's default scoped VMEM limit for Mosaic is 16 MiB; 4 MiB of it are left to Mosaic's own spills
VMEM_BUDGET = 12 * 2**20
SUB_TILE = 512               # output columns dequantised at once (a [8G, 512] fp32 tile and its cast)
MAX_UNROLLED = 32
CORES = 2                    # TensorCores per chip (v4 / v5p megacore) that split the output tiles


def divisors(size: int, multiple: int) -> list[int]:
    """Divisors of ``size`` that are multiples of ``multiple``, largest first (``[size]`` when none is)."""
    found = [t for t in range(size // multiple * multiple, 0, -multiple) if size % t == 0]
    return found or [size]


def fitting_tile(size: int, preferred: int, multiple: int) -> int:
    """The largest divisor of ``size`` that is a multiple of ``multiple`` and at most ``preferred`` (else size)."""
    return next((t for t in divisors(size, multiple) if t <= preferred and t % multiple == 0), size)


def sub_tile(tn: int) -> int:
    """Columns the kernel dequantises at once: the largest lane-multiple divisor of tn up to `SUB_TILE`."""
    return fitting_tile(tn, SUB_TILE, LANES)


def vmem_bytes(m: int, tk: int, tn: int, group_size: int, x_itemsize: int, scale_itemsize: int) -> int:
    """VMEM of one kernel instance: double-buffered blocks (activations [m, tk], packed words [tk/8, tn] int32,
    scales [tk/8G, 8, tn] with the 8 group rows padded to the dtype's sublane tile, fp32 output [m, tn]), the
    fp32 accumulator [m, tn], and one dequantised chunk [8G, sub-tile] in fp32 and the activation dtype."""
    chunk = PER_WORD * group_size
    scale_rows = max(PER_WORD, 32 // scale_itemsize)
    blocks = (m * tk * x_itemsize + tk // PER_WORD * tn * 4 + tk // chunk * scale_rows * tn * scale_itemsize
              + m * tn * 4)
    return 2 * blocks + m * tn * 4 + chunk * sub_tile(tn) * (4 + x_itemsize)


def pick_tiles(m: int, K: int, N: int, group_size: int, x_itemsize: int = 2, scale_itemsize: int = 2,
               budget: int = VMEM_BUDGET) -> tuple[int, int]:
    """(tk, tn) by the module's rule; the smallest tiles when nothing fits the budget."""
    chunk = PER_WORD * group_size
    tns = [t for t in divisors(N, LANES) if N // t >= 2] or divisors(N, LANES)
    fits = [(tk, tn) for tn in tns for tk in divisors(K, chunk)
            if vmem_bytes(m, tk, tn, group_size, x_itemsize, scale_itemsize) <= budget
            and tk // chunk * (tn // sub_tile(tn)) <= MAX_UNROLLED]
    if not fits:
        return divisors(K, chunk)[-1], tns[-1]
    return min(fits, key=lambda t: (-(-N // t[1] // CORES) * (K // t[0]), (N // t[1]) * (K // t[0]), -t[1]))
