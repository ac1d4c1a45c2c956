#!/usr/bin/env python3
"""Generate the committed dequantization test vectors in golden/dequant/<TYPE>.bin.

The oracle is gguf-py's numpy `gguf.quants.dequantize` (pip install gguf numpy). For every type the
file holds random blocks (random bytes, with the f16 d/m fields set to sane random values) and edge
cases: d/m = +-0, +-inf, NaN (quiet, signalling, negative), +-65504, subnormal and smallest-normal
halves, each with random, all-0x00 and all-0xFF quant bytes, plus pairs of special d and m values.
F16 is exhaustive (all 65536 bit patterns); F32 and BF16 are random bit patterns plus specials.
IQ4_NL and IQ4_XS are as the other quantized types (f16 d at byte 0); MXFP4 has random blocks and
special e8m0 scale bytes (0..3, 126..129, 253..255) with random, all-0x00 and all-0xFF quant bytes.
IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0 and TQ2_0 are as the other quantized
types too (their f16 d set to the same specials; IQ1_M's d is spread over its scale words).

File format (all little-endian):
    magic  b"LDQV"
    u32    version (1)
    u32    GGUF type id
    u32    n_blocks
    u8     src[n_blocks * block_bytes]
    u32    expected_f32_bits[n_blocks * block_elems]

The Rust test (references/tests/dequant_vectors.rs) compares bits, treating NaN as equal to NaN.
Run from anywhere: python3 tests/peers/gen_dequant_vectors.py
"""

import os
import struct
import sys

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "golden", "dequant")

# Byte offsets of the f16 scale fields: (d offset, m/dmin offset or None).
FIELDS = {
    T.Q4_0: (0, None),
    T.Q4_1: (0, 2),
    T.Q5_0: (0, None),
    T.Q5_1: (0, 2),
    T.Q8_0: (0, None),
    T.Q2_K: (80, 82),
    T.Q3_K: (108, None),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208, None),
    # The codebook types (after the original 13, so the random stream of those is unchanged).
    T.IQ4_NL: (0, None),
    T.IQ4_XS: (0, None),
}

# The lattice and ternary types, written after MXFP4 (so the random stream of every earlier type
# is unchanged): the f16 d's byte offset. IQ1_M has no d field: its f16 d is the top nibbles of
# its four u16 scale words (bytes 48..56), set by put_iq1m_d.
LATE_FIELDS = {
    T.IQ1_S: (0, None),
    T.IQ1_M: ("iq1m", None),
    T.IQ2_XXS: (0, None),
    T.IQ2_XS: (0, None),
    T.IQ2_S: (0, None),
    T.IQ3_XXS: (0, None),
    T.IQ3_S: (0, None),
    T.TQ1_0: (52, None),
    T.TQ2_0: (64, None),
}

# MXFP4's scale is one e8m0 byte (2^(e-128) as gguf-py's e8m0_to_fp32_half has it), not an f16.
E8M0_SPECIALS = [0, 1, 2, 3, 126, 127, 128, 129, 253, 254, 255]

SPECIALS = [
    0x0000,  # +0
    0x8000,  # -0
    0x7C00,  # +inf
    0xFC00,  # -inf
    0x7E00,  # quiet NaN
    0x7C01,  # signalling NaN
    0xFE00,  # negative NaN
    0x7BFF,  # 65504
    0xFBFF,  # -65504
    0x0001,  # smallest subnormal
    0x03FF,  # largest subnormal
    0x0400,  # smallest normal
]
PAIR_SPECIALS = [0x0000, 0x7C00, 0xFC00, 0x7E00, 0x7BFF]
N_RANDOM = {32: 256, 256: 32}


def sane_half(rng, scale):
    return np.float16(rng.standard_normal() * scale).view(np.uint16)


def put_half(block, off, bits):
    if off == "iq1m":
        return put_iq1m_d(block, bits)
    block[off : off + 2] = np.array([bits], dtype=np.uint16).view(np.uint8)


def put_iq1m_d(block, bits):
    # IQ1_M: nibble i of d's bits is the top nibble of scale word i (bytes 48 + 2i, 49 + 2i).
    for i in range(4):
        hi = 49 + 2 * i
        block[hi] = (int(block[hi]) & 0x0F) | (((int(bits) >> (4 * i)) & 0x0F) << 4)


def quant_blocks(qtype, rng):
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    d_off, m_off = {**FIELDS, **LATE_FIELDS}[qtype]
    blocks = []

    def fresh(fill):
        if fill is None:
            b = rng.integers(0, 256, size=block_bytes, dtype=np.uint8)
        else:
            b = np.full(block_bytes, fill, dtype=np.uint8)
        put_half(b, d_off, sane_half(rng, 0.02))
        if m_off is not None:
            put_half(b, m_off, sane_half(rng, 0.02))
        return b

    for _ in range(N_RANDOM[block_elems]):
        blocks.append(fresh(None))
    for fill in (None, 0x00, 0xFF):
        for off in [d_off] + ([m_off] if m_off is not None else []):
            for bits in SPECIALS:
                b = fresh(fill)
                put_half(b, off, bits)
                blocks.append(b)
    if m_off is not None:
        for dbits in PAIR_SPECIALS:
            for mbits in PAIR_SPECIALS:
                for sign in (0, 0x8000):
                    b = fresh(None)
                    put_half(b, d_off, dbits)
                    put_half(b, m_off, mbits ^ sign)
                    blocks.append(b)
    return np.stack(blocks)


def mxfp4_blocks(rng):
    block_elems, block_bytes = GGML_QUANT_SIZES[T.MXFP4]
    blocks = []
    for _ in range(N_RANDOM[block_elems]):
        b = rng.integers(0, 256, size=block_bytes, dtype=np.uint8)
        b[0] = rng.integers(100, 156)
        blocks.append(b)
    for fill in (None, 0x00, 0xFF):
        for e in E8M0_SPECIALS:
            b = rng.integers(0, 256, size=block_bytes, dtype=np.uint8) if fill is None else \
                np.full(block_bytes, fill, dtype=np.uint8)
            b[0] = e
            blocks.append(b)
    return np.stack(blocks)


def float_blocks(qtype, rng):
    if qtype == T.F16:
        return np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    if qtype == T.BF16:
        specials = [0, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC0, 1, 0x007F, 0x0080, 0x7F7F, 0xFF7F]
        bits = np.concatenate([np.array(specials, dtype=np.uint16),
                               rng.integers(0, 2**16, size=4096, dtype=np.uint16)])
        return bits.view(np.uint8).reshape(-1, 2)
    specials = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00000, 1, 0x007FFFFF,
                0x00800000, 0x7F7FFFFF, 0xFF7FFFFF]
    bits = np.concatenate([np.array(specials, dtype=np.uint32),
                           rng.integers(0, 2**32, size=4096, dtype=np.uint32)])
    return bits.view(np.uint8).reshape(-1, 4)


def expected_bits(qtype, blocks):
    with np.errstate(all="ignore"):
        out = dequantize(np.ascontiguousarray(blocks).reshape(-1), qtype)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(-1).view(np.uint32)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(0x11D1FF)
    total = 0
    for qtype in [T.F32, T.F16, T.BF16, *FIELDS, T.MXFP4, *LATE_FIELDS]:
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        if qtype in (T.F32, T.F16, T.BF16):
            blocks = float_blocks(qtype, rng)
        elif qtype == T.MXFP4:
            blocks = mxfp4_blocks(rng)
        else:
            blocks = quant_blocks(qtype, rng)
        assert blocks.shape[1] == block_bytes
        bits = expected_bits(qtype, blocks)
        assert bits.size == blocks.shape[0] * block_elems
        data = (b"LDQV" + struct.pack("<III", 1, int(qtype), blocks.shape[0]) + blocks.tobytes()
                + bits.astype("<u4").tobytes())
        path = os.path.join(OUT, f"{qtype.name}.bin")
        with open(path, "wb") as f:
            f.write(data)
        total += len(data)
        print(f"{qtype.name:5} {blocks.shape[0]:6} blocks {len(data):8} bytes", file=sys.stderr)
    print(f"total {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
