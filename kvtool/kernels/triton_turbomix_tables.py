"""The per-part device constants of the Triton ``turbomix`` kernels
(:mod:`kvtool.kernels.triton_turbomix`, :mod:`kvtool.kernels.triton_attention_parts`): a part's
padded tile width, its candidates' rotations as bf16 pieces, and its quantiser's tables, each
built once per (width, seeds or bits, device)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kvtool.codecs.rotation import is_power_of_two, rotation_matrix


def _width(n: int) -> int:
    """The padded (power-of-two, ≥ 16: tl.dot's least) tile width of an n-wide part."""
    return max(16, 1 << (n - 1).bit_length())


#: bytes of a rotation's bf16 pieces one dot of the scalar and pair encode may take whole
_WHOLE_ROTATION = 128 * 1024


def _rotation_rows(width: int, pieces: int) -> int:
    """Rows of the rotation per dot in the scalar and pair encode: all of them, unless its
    pieces pass :data:`_WHOLE_ROTATION` (a 192-wide part at D=256 — the ``small`` key's probe,
    Gemma's fitted ``quality`` keys — is 3 pieces of 256²: 432 KB of shared memory on sm_90,
    which has 227), then 32 at a time."""
    return width if pieces * width * width * 2 <= _WHOLE_ROTATION else min(width, 32)


@lru_cache(maxsize=64)
def _rotations(n: int, seeds: tuple[int, ...], device: torch.device) -> tuple[Any, Any, int]:
    """(Rᵀ pieces, R pieces) [C, RP, NP, NP] bf16, zero-padded, and RP: 1 where every entry is
    exact in bf16 (power-of-two widths: entries k/n once the float64 residue is dropped), else
    3 (hi + mid + lo is the float32 matrix)."""
    r = np.stack([rotation_matrix(n, seed).astype(np.float64) for seed in seeds])
    if is_power_of_two(n):  # the Hadamard rounds' k/n: drop the residue (<< fp32's resolution)
        r = np.round(r * n) / n
    r = torch.from_numpy(r).float()
    exact = bool((r.to(torch.bfloat16).float() == r).all())
    pieces, rest = [], r
    for _ in range(1 if exact else 3):
        pieces.append(rest.to(torch.bfloat16))
        rest = rest - pieces[-1].float()
    width = _width(n)
    out = []
    for mats_c in (torch.stack(pieces, 1).transpose(-1, -2), torch.stack(pieces, 1)):
        padded = torch.zeros((len(seeds), len(pieces), width, width), dtype=torch.bfloat16)
        padded[..., :n, :n] = mats_c
        out.append(padded.contiguous().to(device))
    return out[0], out[1], len(pieces)


#: per trellis width: (mask, multiplier) of :func:`trellis_hash`. Found by search: each maps the
#: 5 path bits and the code in a window onto 5 + bits bits one-to-one (``tests/
#: test_triton_turbomix_tables.py`` checks every combination)
TRELLIS_HASH = {2: (0xEAA, 0x2100000), 3: (0x3C924, 0x444000), 4: (0xF88888, 0x842100)}


def trellis_hash(window: np.ndarray, bits: int) -> np.ndarray:
    """The value-table index of a trellis code from its window (6·bits bits, LSB first: the 5
    codes before it, then the code): ``((window & mask) · multiplier mod 2³²) >> (27 − bits)``,
    what the Triton kernels compute (3 instructions where gathering the 5 path bits one by
    one took ~12)."""
    mask, mult = TRELLIS_HASH[bits]
    product = ((window.astype(np.uint64) & mask) * mult) & 0xFFFFFFFF
    return (product >> (27 - bits)).astype(np.int64)


def _hashed_state_values(n: int, bits: int) -> np.ndarray:
    """``state_values`` (entry ``state << bits | code``) at :func:`trellis_hash` indices."""
    from kvtool.codecs.trellis import state_values


    state, code = np.arange(32)[:, None], np.arange(1 << bits)[None, :]
    window = code << (5 * bits)
    for k in range(1, 6):  # state bit k-1: the path bit (top bit) of the code k before
        window = window | (((state >> (k - 1)) & 1) << ((6 - k) * bits - 1))
    out = np.empty(32 << bits, np.float32)
    out[trellis_hash(window, bits).reshape(-1)] = state_values(n, bits)
    return out


@lru_cache(maxsize=64)
def _tables(n: int, bits: int, quantizer: str, device: torch.device) -> dict[str, Any]:
    """The part's quantiser tables (the reference's float32 values; unused ones: a zero)."""
    from kvtool.codecs.lloyd_max import sphere_marginal_codebook
    from kvtool.codecs.trellis_tables import trellis_levels
    from kvtool.codecs.vq_tables import pair_codebook

    zero = np.zeros(1, np.float32)
    t = {"bnd": zero, "cent": zero, "pts": zero, "hsq": zero, "lvl": zero, "edge": zero,
         "slv": zero}
    if quantizer == "scalar":
        book = sphere_marginal_codebook(n, 1 << bits)
        t["bnd"], t["cent"] = book.boundaries, book.centroids
    elif quantizer == "pair":
        points = pair_codebook(bits) / np.float32(np.sqrt(n))
        t["pts"], t["hsq"] = points, (points ** 2).sum(axis=1) * np.float32(0.5)
    else:
        t["lvl"] = levels = trellis_levels(bits) / np.float32(np.sqrt(n))
        per_subset = levels.reshape(-1, 4).T
        t["edge"] = (per_subset[:, 1:] + per_subset[:, :-1]) * np.float32(0.5)
        t["slv"] = _hashed_state_values(n, bits)  # decoding's one load per coordinate
    return {k: torch.from_numpy(np.array(v, np.float32).reshape(-1)).to(device)
            for k, v in t.items()}



def _seeds(codec: Any) -> tuple[int, ...]:
    """Each of a ``turbomix`` codec's candidates' rotation seed."""
    from kvtool.codecs.turbomix import candidate_seed

    return tuple(candidate_seed(codec.seed, c) for c in range(codec.candidates))
