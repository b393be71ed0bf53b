"""MXFP4 (OCP MX, compressed-tensors ``mxfp4-pack-quantized``) pack/unpack/quant.

Kimi K3 checkpoints ship expert weights as MXFP4: FP4 E2M1 elements packed two
per byte (low nibble = even input index) plus one E8M0 power-of-two scale per
32 consecutive input elements of a row. Everything here is plain vectorised
torch so the same code serves as the CPU reference and the CUDA load path.

All arithmetic is done in fp32, where every MXFP4 value is exactly
representable (2^-128 = 0.5 * 2^-127 is an fp32 subnormal), so dequantisation
is exact. This assumes denormals are not flushed (``torch.set_flush_denormal``
left at its default). Values with |x| >= 2 under scale byte 254 exceed the fp32
range and become +-inf; real checkpoints do not use such scales.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "MXFP4_BLOCK_SIZE",
    "unpack_fp4",
    "pack_fp4_codes",
    "dequantize_mxfp4",
    "quantize_mxfp4",
    "mxfp4_bytes",
    "to_mma_layout",
    "from_mma_layout",
    "MMA_MAX_SCALE",
    "MMA_PAIR_TERMS",
]

MXFP4_BLOCK_SIZE = 32
_E8M0_BIAS = 127
_E8M0_NAN = 255
# Largest power-of-two exponent of an E2M1 value (6 = 1.5 * 2^2); the OCP
# shared-exponent rule subtracts it so the block amax lands in [4, 8).
_E2M1_EMAX = 2

# Indexed by the 4-bit code: bit 3 is the sign, so codes 8..15 mirror 0..7.
E2M1_VALUES: torch.Tensor = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Rounding boundaries between consecutive magnitude codes, paired with whether
# an exact tie goes up. Ties go to the even code (OCP round-to-nearest-even),
# i.e. up exactly when the upper code is even.
_E2M1_BOUNDARIES: tuple[tuple[float, bool], ...] = (
    (0.25, False),  # 0 | 1
    (0.75, True),   # 1 | 2
    (1.25, False),  # 2 | 3
    (1.75, True),   # 3 | 4
    (2.5, False),   # 4 | 5
    (3.5, True),    # 5 | 6
    (5.0, False),   # 6 | 7 ; everything above saturates to 7 (= 6.0)
)


def _exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^e for integer e in [-127, 127], built from bits.

    Built by hand because pow/exp2/ldexp are not guaranteed bit-exact on every
    backend, and 2^-127 needs the subnormal encoding.
    """
    biased = e.to(torch.int32) + _E8M0_BIAS  # 0..254
    bits = torch.where(
        biased > 0,
        biased << 23,
        torch.full_like(biased, 1 << 22),  # 2^-127 as an fp32 subnormal
    )
    return bits.view(torch.float32)


def _check_uint8(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8, got {t.dtype}")
    if t.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension")


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K], low nibble first."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Decode packed E2M1 nibbles to fp32 (no block scale applied)."""
    _check_uint8(packed, "packed")
    codes = _unpack_codes(packed)
    return E2M1_VALUES.to(packed.device)[codes.long()]


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte, even index in the low nibble."""
    _check_uint8(codes, "codes")
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes last dim must be even, got {codes.shape[-1]}")
    if codes.numel() and bool((codes > 0x0F).any()):
        raise ValueError("codes must be 4-bit values in [0, 15]")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def dequantize_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    check_scales: bool = True,
) -> torch.Tensor:
    """MXFP4 -> dense [..., N, K]; exact in fp32, then cast to ``dtype``.

    The NaN-scale check costs a device sync: keep it at load time, where a
    silent NaN scale is far more expensive than the check, and pass
    ``check_scales=False`` on the forward path (the loader already checked).
    """
    _check_uint8(packed, "packed (weight_packed)")
    _check_uint8(scale, "scale (weight_scale)")
    k = packed.shape[-1] * 2
    if packed.shape[:-1] != scale.shape[:-1] or k != scale.shape[-1] * MXFP4_BLOCK_SIZE:
        raise ValueError(
            "inconsistent MXFP4 shapes: weight_packed "
            f"{tuple(packed.shape)} (K={k}) needs weight_scale "
            f"{tuple(packed.shape[:-1]) + (k // MXFP4_BLOCK_SIZE,)} with K % 32 == 0, "
            f"got {tuple(scale.shape)}"
        )
    if scale.device != packed.device:
        raise ValueError(f"packed on {packed.device} but scale on {scale.device}")
    if check_scales and scale.numel() and bool((scale == _E8M0_NAN).any()):
        raise ValueError("weight_scale contains E8M0 byte 255 (NaN); checkpoint is invalid")

    values = unpack_fp4(packed)
    blocks = values.reshape(*scale.shape, MXFP4_BLOCK_SIZE)
    factors = _exp2_int(scale.to(torch.int32) - _E8M0_BIAS)
    out = (blocks * factors.unsqueeze(-1)).reshape(values.shape)
    return out.to(dtype)


def _round_to_e2m1_codes(mag: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 magnitudes -> nearest E2M1 magnitude code (0..7).

    Counting crossed boundaries is exact, branch-free and gives
    ties-to-even and saturation at 6 for free.
    """
    codes = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for boundary, tie_up in _E2M1_BOUNDARIES:  # 7 constants, not elements
        crossed = mag >= boundary if tie_up else mag > boundary
        codes += crossed.to(torch.uint8)
    return codes


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float [..., N, K] -> (weight_packed uint8 [..., K/2], weight_scale uint8 [..., K/32]).

    Shared exponent per OCP MX: floor(log2(amax)) - 2, clamped to [-127, 127].
    An all-zero block gets scale byte 0 (2^-127), which is what the clamp
    yields for log2(0) = -inf. Elements round to nearest E2M1, ties to even,
    saturating at +-6; the sign of zero is kept (negative tiny values -> -0).
    Input is cast to fp32 first (exact for bf16/fp16). Used by the loader
    (``--quantization mxfp4``), tests and offline tooling; never per step.
    """
    if not w.is_floating_point():
        raise TypeError(f"w must be a floating tensor, got {w.dtype}")
    if w.dim() < 1 or w.shape[-1] % MXFP4_BLOCK_SIZE != 0:
        raise ValueError(
            f"w last dim must be a multiple of {MXFP4_BLOCK_SIZE}, got shape {tuple(w.shape)}"
        )
    x = w.to(torch.float32)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("w contains non-finite values; MXFP4 cannot encode them")

    k = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], k // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)

    # frexp: amax = m * 2^e, m in [0.5, 1) => floor(log2(amax)) = e - 1 exactly
    # (also for subnormals, unlike log2 + floor which can misround).
    _, e = torch.frexp(amax)
    shared = e.to(torch.int32) - 1 - _E2M1_EMAX
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -_E8M0_BIAS))
    shared = shared.clamp(-_E8M0_BIAS, _E8M0_BIAS)

    scaled = blocks * _exp2_int(-shared).unsqueeze(-1)
    mag_codes = _round_to_e2m1_codes(scaled.abs())
    sign = torch.signbit(scaled).to(torch.uint8) << 3
    codes = (mag_codes | sign).reshape(x.shape)

    packed = pack_fp4_codes(codes)
    scale = (shared + _E8M0_BIAS).to(torch.uint8)
    return packed, scale.contiguous()


def mxfp4_bytes(n: int, k: int) -> int:
    """Storage for an [n, k] MXFP4 matrix: 4 bits/elem + 8 bits/32 = 4.25 bits/weight."""
    if n < 0 or k < 0 or k % MXFP4_BLOCK_SIZE != 0:
        raise ValueError(f"need n >= 0 and k a non-negative multiple of 32, got n={n}, k={k}")
    return n * (k // 2) + n * (k // MXFP4_BLOCK_SIZE)


# --- The MMA-operand layout (Hopper decode path) -------------------------------------------------
# A tensor-core MMA (mma.sync m16n8k16 / wgmma with A in registers) wants, from each lane
# (g = lane // 4, c = lane % 4) of the warp owning a 16-row block, the bf16 pairs
# (g, k 2c..2c+1), (g + 8, 2c..), (g, 2c + 8..), (g + 8, 2c + 8..) of every 16-wide k slice: four
# checkpoint bytes scattered over two rows. Stored as they come, a kernel loads bytes one at a time
# and re-pairs nibbles in registers (RESULTS.md eleventh session: LDS 179 + PRMT 316 of the K
# loop's 1,545 instructions). Here each 16-row block is rewritten, once at load time, so that a
# lane's bytes of one 32-code scale group are 8 contiguous bytes (two 32-bit words, one per k
# slice) whose bits are pre-arranged for a ~1.6-instruction-a-code upcast (below), and the low half
# of each bf16x2 register holds a byte's low nibble (even k), the high half its high nibble. Same
# shape and size as the checkpoint layout [..., N, K/2] (a permutation within each 16-row block), so
# N may be sliced in multiples of 16 after the rewrite.
#
# The bits of a word. The upcast wants byte i's two codes in register i with each sign at bf16 bit
# 15 (31) and each magnitude at bits 8-6 (24-22) (``_MMA_TARGET``: the code's value times 2^-126,
# made exact by one mul.bf16x2, which the Gluon kernel also gives the block scale), and gets
# register i as the OR of ``MMA_PAIR_TERMS[i]``: (r, m) = the word rotated left by r, masked by m.
# Registers 0-2 take one rotation each (0, 4, 10), register 3 the bits left, from two (a right
# shift by 2 and a left shift by 6): 9 integer instructions a word (sm_90 SASS: 5 LOP3, 2
# IMAD.SHL, 2 SHF) where the Hopper layout of OpenAI's triton_kernels ("HopperMXValueLayout":
# shifts 0, 3, 6 and byte 3 gathered from three places) takes 11. A search over every such layout
# (fifty-ninth session, bench/RESULTS.md) found none with one rotation a register (the fourth
# always needs two) and none with plain shifts only. The words are written and read back through
# these terms, so the kernels' PTX, the interpreter's emulation and this rewrite cannot disagree.

_MMA_ROWS = 16
_MMA_TARGET = 0x81C081C0  # sign 15, magnitude 8-6 of each bf16 half
MMA_PAIR_TERMS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, _MMA_TARGET),),
    ((4, _MMA_TARGET),),
    ((10, _MMA_TARGET),),
    ((30, 0x01000100), (6, 0x80C080C0)),
)


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    """32-bit left rotation of int64 words in [0, 2^32)."""
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF if r else x


def _check_terms() -> None:
    """Each register's terms cover its target bits once, and the four registers' sources are the
    word's 32 bits once each (so the layout is a bit permutation: it round-trips)."""
    sources = []
    for terms in MMA_PAIR_TERMS:
        assert sum(bin(m).count("1") for _, m in terms) == 8 and (
            sum(m for _, m in terms) == _MMA_TARGET), terms
        sources += [(t - r) % 32 for r, m in terms for t in range(32) if m >> t & 1]
    assert sorted(sources) == list(range(32)), sources


_check_terms()


def _interleave_words(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4] (bytes B0..B3 of a word) -> uint8 [..., 4], the bit layout above."""
    b = b.to(torch.int64)
    word = torch.zeros(b.shape[:-1], dtype=torch.int64, device=b.device)
    for i, terms in enumerate(MMA_PAIR_TERMS):
        c = b[..., i]  # low nibble to the low half, high nibble to the high half: sign 15, magnitude 8-6
        reg = ((c & 8) << 12) | ((c & 7) << 6) | ((c & 0x80) << 24) | ((c & 0x70) << 18)
        for r, m in terms:
            word |= _rotl(reg & m, (32 - r) % 32)
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)


def _deinterleave_words(w: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_interleave_words``: the upcast's own terms, then each half's code read back."""
    w = w.to(torch.int64)
    word = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)
    out = []
    for terms in MMA_PAIR_TERMS:
        reg = torch.zeros_like(word)
        for r, m in terms:
            reg |= _rotl(word, r) & m
        out.append(((reg >> 12) & 8) | ((reg >> 6) & 7) | ((reg >> 24) & 0x80) | ((reg >> 18) & 0x70))
    return torch.stack(out, -1).to(torch.uint8)


# Largest E8M0 byte whose 2^(E8M0 - 1) is a finite bf16: the bound for folding the block scale into
# the upcast's exact multiply (moe_gluon), i.e. weights up to 12 in magnitude.
MMA_MAX_SCALE = 128


def _check_mma_shape(packed: torch.Tensor) -> None:
    _check_uint8(packed, "packed")
    if packed.dim() < 2 or packed.shape[-2] % _MMA_ROWS or packed.shape[-1] % 16:
        raise ValueError(f"the MMA layout needs rows in multiples of {_MMA_ROWS} and K in multiples of 32, "
                         f"got packed {tuple(packed.shape)}")


def to_mma_layout(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint MXFP4 bytes [..., N, K/2] -> the MMA-operand layout, same shape: per 16-row block,
    per 32-code group, per lane (4g + c), per k slice s, the word of bytes (row g, byte 8s + c),
    (g + 8, 8s + c), (g, 8s + 4 + c), (g + 8, 8s + 4 + c), bits interleaved. The scales keep
    their layout."""
    _check_mma_shape(packed)
    *lead, n, kh = packed.shape
    d = len(lead)
    # row = 16 blk + 8 h + g; byte = 16 grp + 8 s + 4 o + c; word byte i = 2 o + h
    x = packed.reshape(*lead, n // 16, 2, 8, kh // 16, 2, 2, 4)  # blk, h, g, grp, s, o, c
    x = x.permute(*range(d), d, d + 3, d + 2, d + 6, d + 4, d + 5, d + 1)  # blk, grp, g, c, s, o, h
    return _interleave_words(x.reshape(*lead, n // 16, kh // 16, 32, 2, 4)).reshape(packed.shape).contiguous()


def from_mma_layout(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_mma_layout``: back to checkpoint bytes (reference paths, tests)."""
    _check_mma_shape(packed)
    *lead, n, kh = packed.shape
    d = len(lead)
    x = _deinterleave_words(packed.reshape(*lead, n // 16, kh // 16, 32, 2, 4))
    x = x.reshape(*lead, n // 16, kh // 16, 8, 4, 2, 2, 2)  # blk, grp, g, c, s, o, h
    x = x.permute(*range(d), d, d + 6, d + 2, d + 1, d + 4, d + 5, d + 3)  # blk, h, g, grp, s, o, c
    return x.reshape(packed.shape).contiguous()
