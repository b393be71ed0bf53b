"""Our E2M1 -> bf16 upcast is inline PTX, which Triton's CPU interpreter cannot run (the CPU tests
take the exact ``_e2m1`` path instead) and which test_sm90_compile only compiles. Here the PTX text
itself is executed by a small emulator of the handful of instructions it uses, for every byte
value in every position of the 32-bit word, against the codes' exact values."""

import re
import struct

import pytest

pytest.importorskip("triton")

from k3serve.ops.moe_triton import _E2M1_TO_BF16_ASM  # noqa: E402

MASK = 0xFFFFFFFF
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _bf16_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _float_to_bf16(x: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    assert bits & 0xFFFF == 0, "the products here are exact: no rounding to emulate"
    return bits >> 16


def _prmt(a: int, b: int, sel: int) -> int:
    """Default mode: output byte i is byte (nibble i of sel) & 7 of {b, a}; bit 3 replicates its sign."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _mul_bf16x2(a: int, b: int) -> int:
    halves = [_float_to_bf16(_bf16_to_float(a >> s) * _bf16_to_float(b >> s)) for s in (0, 16)]
    return halves[0] | halves[1] << 16


def run_ptx(text: str, word: int) -> list[int]:
    """Executes the asm block on input $4 = word; returns $0..$3."""
    regs = {"$4": word}

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & MASK

    for stmt in text.replace("{", "").replace("}", "").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        dst, *src = [t.strip() for t in rest.split(",")]
        args = [val(s) for s in src]
        if op == "mov.b32":
            r = args[0]
        elif op == "prmt.b32":
            r = _prmt(*args)
        elif op == "shl.b32":
            r = (args[0] << args[1]) & MASK
        elif op == "shr.b32":
            r = args[0] >> args[1]
        elif op == "shf.l.wrap.b32":  # funnel shift of (hi = args[1], lo = args[0]), amount mod 32
            n = args[2] & 31
            r = ((args[1] << n) | (args[0] >> (32 - n))) & MASK if n else args[1]
        elif op == "and.b32":
            r = args[0] & args[1]
        elif op == "or.b32":
            r = args[0] | args[1]
        elif op == "lop3.b32":
            r = _lop3(*args)
        elif op == "mul.rn.bf16x2":
            r = _mul_bf16x2(*args)
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
        regs[dst] = r
    return [regs[f"${i}"] for i in range(4)]


def _code_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def test_emulator_knows_every_instruction_of_the_upcast():
    ops = {s.strip().partition(" ")[0] for s in _E2M1_TO_BF16_ASM.value.replace("{", "").replace("}", "").split(";")}
    assert ops - {"", ".reg"} <= {"mov.b32", "prmt.b32", "shl.b32", "shr.b32", "and.b32", "or.b32", "lop3.b32",
                                  "mul.rn.bf16x2"}


@pytest.mark.parametrize("position", range(4))
def test_upcast_ptx_gives_every_code_exactly(position):
    """Byte j of the word packs k = 2j (low nibble) and 2j + 1 (high); $0/$1 hold the low nibbles of
    bytes 0-1 / 2-3 as bf16x2, $2/$3 the high ones. Other bytes hold a pattern, so leakage between
    bytes shows too."""
    text = _E2M1_TO_BF16_ASM.value
    for byte in range(256):
        filler = [0x5A, 0xA5, 0xFF, 0x00][position]
        word = 0
        for j in range(4):
            word |= (byte if j == position else (filler + 37 * j) & 0xFF) << (8 * j)
        out = run_ptx(text, word)
        for j in range(4):
            b = (word >> (8 * j)) & 0xFF
            reg_lo, reg_hi, half = out[j // 2], out[2 + j // 2], 16 * (j % 2)
            assert _bf16_to_float(reg_lo >> half) == _code_value(b & 15), (hex(word), j, "low nibble")
            assert _bf16_to_float(reg_hi >> half) == _code_value(b >> 4), (hex(word), j, "high nibble")
            # -0.0 stays -0.0 (the sign bit), not only equal in value
            assert (reg_lo >> half) & 0x8000 == (0x8000 if b & 8 else 0)
            assert (reg_hi >> half) & 0x8000 == (0x8000 if b & 0x80 else 0)


def test_mma_layout_upcast_ptx_gives_every_code_exactly():
    """The MMA layout's upcast (``_E2M1_WORD_TO_BF16_ASM``) on words written by
    ``mxfp4.to_mma_layout``'s bit interleave: $i holds byte i's low nibble (even k) in its low
    half and its high nibble in its high half, every byte value in every position, signs of zero
    kept; other bytes hold a pattern, so leakage between bytes shows too."""
    import torch

    from k3serve.ops.moe_triton import _E2M1_WORD_TO_BF16_ASM
    from k3serve.ops.mxfp4 import _interleave_words

    text = _E2M1_WORD_TO_BF16_ASM.value
    for position in range(4):
        for byte in range(256):
            raw = [byte if j == position else (0x5A + 37 * j + position) & 0xFF for j in range(4)]
            w = _interleave_words(torch.tensor([raw], dtype=torch.uint8))[0].tolist()
            out = run_ptx(text, w[0] | w[1] << 8 | w[2] << 16 | w[3] << 24)
            for j, b in enumerate(raw):
                for half, code in ((0, b & 15), (16, b >> 4)):
                    bits = (out[j] >> half) & 0xFFFF
                    assert _bf16_to_float(bits) == _code_value(code), (position, byte, j, half)
                    assert bits & 0x8000 == (0x8000 if code & 8 else 0)


def test_emulator_knows_every_instruction_of_the_mma_upcast():
    from k3serve.ops.moe_triton import _E2M1_WORD_TO_BF16_ASM

    text = _E2M1_WORD_TO_BF16_ASM.value.replace("{", "").replace("}", "")
    ops = {s.strip().partition(" ")[0] for s in text.split(";")}
    assert ops - {"", ".reg"} <= {"mov.b32", "shl.b32", "shr.b32", "shf.l.wrap.b32", "and.b32", "or.b32",
                                  "mul.rn.bf16x2"}
