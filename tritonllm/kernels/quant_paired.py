"""4-bit weights to 16-bit floats two values per instruction, for the tl.dot W4A16 kernel (quant_gemm.py).

A 4-bit field OR-ed into the low mantissa bits of a power of two reads as that power plus the field: fp16 1024
(0x6400) has a spacing of 1 up to 2048, bf16 128 (0x4300) up to 256. Masking both 16-bit halves of a word at once
(one LOP3) gives two such floats, and one paired FMA (t * scale + bias, bias = -(power + z)) leaves q - z, a small
integer, exactly. In GPTQ order value p sits at bits 4p, so the halves hold values j and j + 4 at the same offset:
    bf16: shift the word right by 4j, mask 0x000F000F (the field must stay below the exponent's lowest bit);
    fp16: shift right by 8 (j // 2), mask 0x000F000F, or for odd j 0x00F000F0, which reads 1024 + 16q: scaled by
          1/16 it is 64 + q, so the bias is -(64 + z).
Against the fp32 route (per value a LOP3, an FADD, an FMUL and half an F2FP) this takes about 1.4 instructions per
value; the scale multiplies the MMA's fp32 result once per K tile instead (one group per tile) or the 16-bit
values (q - z exact, times s rounded once, the reference's rounding).

The PTX runs compiled on NVIDIA GPUs. Triton's interpreter has no inline assembly: there `_emulate` performs the
same bit operations on the same constants with integer and fp32 arithmetic, so the CPU tests check the constants,
the pairing and the value order, and the compiled tests check the PTX.
"""

import triton
import triton.language as tl


@triton.constexpr_function
def pair_spec(j, bf16):
    """How values j and j + 4 of a word become q - z as two 16-bit floats, as 16-bit patterns (one half each):
    shift the word right by `shift`, keep `mask`, OR in `magic`, then t * `scale` + (`bias` + z * `bias_step`)."""
    if bf16:
        return dict(shift=4 * j, mask=0x000F, magic=0x4300, scale=0x3F80, bias=0xC300, bias_step=1)
    if j % 2 == 0:
        return dict(shift=8 * (j // 2), mask=0x000F, magic=0x6400, scale=0x3C00, bias=0xE400, bias_step=1)
    return dict(shift=8 * (j // 2), mask=0x00F0, magic=0x6400, scale=0x2C00, bias=0xD400, bias_step=16)


@triton.constexpr_function
def pair_ptx(j, bf16, scaled):
    """$0, $1: values j and j + 4 minus z (16-bit floats), times $4 when `scaled`; $2: the word; $3: the bias and
    $4 the scale in both halves."""
    spec = pair_spec(j, bf16)
    both = {name: spec[name] | spec[name] << 16 for name in ("mask", "magic", "scale")}
    pairs = "bf16x2" if bf16 else "f16x2"
    body = []
    src = "$2"
    if spec["shift"]:
        body.append(f"shr.u32 t, $2, {spec['shift']};")
        src = "t"
    body += [
        f"lop3.b32 t, {src}, {both['mask']:#010x}, {both['magic']:#010x}, 0xea;",  # (a & b) | c
        f"mov.b32 c, {both['scale']:#010x};",
        f"fma.rn.{pairs} t, t, c, $3;",
    ]
    if scaled:  # (q - z) * s, rounded once; bf16 has no paired multiply before sm_90: an FMA with -0
        body += ["mov.b32 c, 0x80008000;", f"fma.rn.{pairs} t, t, $4, c;"]
    body.append("mov.b32 {$0, $1}, t;")
    return "{ .reg .b32 t, c; " + " ".join(body) + " }"


@triton.constexpr_function
def _field(j, bf16, name):
    return pair_spec(j, bf16)[name]


@triton.jit
def _half_to_f32(bits, BF16: tl.constexpr):
    """The value of 16-bit float patterns (int32, normal numbers only) as fp32, by integer operations."""
    if BF16:
        f = (bits << 16).to(tl.float32, bitcast=True)
    else:
        exponent = ((bits >> 10) & 0x1F) - 15 + 127
        f = (((bits & 0x8000) << 16) | (exponent << 23) | ((bits & 0x3FF) << 13)).to(tl.float32, bitcast=True)
    return f


@triton.jit
def _emulate(words, bias, s, j: tl.constexpr, BF16: tl.constexpr, SCALED: tl.constexpr):
    """`pair_ptx`'s operations for the interpreter: the shift, the LOP3 and the FMA per half, and the scale, in fp32
    (exact until the one rounding at the end, as the paired FMAs round)."""
    mask: tl.constexpr = _field(j, BF16, "mask")
    magic: tl.constexpr = _field(j, BF16, "magic")
    t = ((words >> _field(j, BF16, "shift")) & (mask | (mask << 16))) | (magic | (magic << 16))
    scale = _half_to_f32(tl.full([1], _field(j, BF16, "scale"), tl.int32), BF16)
    b = _half_to_f32(bias & 0xFFFF, BF16)
    lo = _half_to_f32(t & 0xFFFF, BF16) * scale + b
    hi = _half_to_f32((t >> 16) & 0xFFFF, BF16) * scale + b
    if SCALED:
        lo = lo * s.to(tl.float32)
        hi = hi * s.to(tl.float32)
    if BF16:
        out = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    else:
        out = lo.to(tl.float16), hi.to(tl.float16)
    return out


@triton.jit
def dequant_pair(words, z, s, j: tl.constexpr, BF16: tl.constexpr, SCALED: tl.constexpr, EMULATE: tl.constexpr):
    """(value j - z, value j + 4 - z) of 4-bit words (int32, GPTQ order) as fp16 (bf16 when BF16), exact, or times
    the scales s (in the same dtype) rounded once when SCALED; z: int32 zeros, z and s broadcast against the words.
    EMULATE: without inline assembly (Triton's interpreter)."""
    bias = _field(j, BF16, "bias") + z * _field(j, BF16, "bias_step")
    bias = bias | (bias << 16)
    if EMULATE:
        out = _emulate(words, bias, s, j, BF16, SCALED)
    else:
        if SCALED:
            s_bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            s_bits = s_bits | (s_bits << 16)
        else:
            s_bits = bias
        asm: tl.constexpr = pair_ptx(j, BF16, SCALED)
        if BF16:
            out = tl.inline_asm_elementwise(asm, "=h,=h,r,r,r", [words, bias, s_bits], (tl.bfloat16, tl.bfloat16), True, 1)
        else:
            out = tl.inline_asm_elementwise(asm, "=h,=h,r,r,r", [words, bias, s_bits], (tl.float16, tl.float16), True, 1)
    return out


@triton.jit
def dequant_words_paired(words, z, s, BF16: tl.constexpr, SCALED: tl.constexpr, EMULATE: tl.constexpr):
    """Every value of 4-bit words [KW, BLOCK_N] as q - z (or (q - z) * s when SCALED) in fp16 (bf16 when BF16), as
    [KW * 8, BLOCK_N] in K order (value p of word row r is row r * 8 + p); z (int32) and s (16-bit floats)
    broadcast against the words."""
    v0, v4 = dequant_pair(words, z, s, 0, BF16, SCALED, EMULATE)
    v1, v5 = dequant_pair(words, z, s, 1, BF16, SCALED, EMULATE)
    v2, v6 = dequant_pair(words, z, s, 2, BF16, SCALED, EMULATE)
    v3, v7 = dequant_pair(words, z, s, 3, BF16, SCALED, EMULATE)
    # join stacks on a new last axis: [KW, BLOCK_N, 2 (p & 1), 2 (p >> 1 & 1), 2 (p >> 2)]
    w = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    w = tl.reshape(tl.permute(w, (0, 4, 3, 2, 1)), (w.shape[0] * 8, w.shape[1]))
    if not EMULATE:
        w = _opaque(w, BF16)
    return w


@triton.jit
def _opaque(w, BF16: tl.constexpr):
    """w itself, through an asm block with side effects. Triton picks the MMA operand layout (kWidth) from the
    narrowest type it finds walking back from a tl.dot operand, and halves it for every tl.join on the way: the joins
    above would give x and w 8-bit-style operand layouts (no ldmatrix, 2x slower on the H200, Triton 3.6). The walk
    stops at an op with side effects; ptxas drops the move."""
    if BF16:
        out = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], tl.bfloat16, False, 2)
    else:
        out = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], tl.float16, False, 2)
    return out


@triton.constexpr_function
def columns_ptx(bf16):
    """Pack 2 (two neighbouring columns' words per call): $0..$7 value p - z of both words as one pair each
    (column n low, column n + 1 high); $8, $9 the words; $10, $11 their bias for even pairs, $12, $13 for odd ones.
    The words' low halves (values 0-3) and high halves (values 4-7) are first gathered into one register each."""
    pairs = "bf16x2" if bf16 else "f16x2"
    body = ["prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    body += ["prmt.b32 b0, $10, $11, 0x5410;", "prmt.b32 b1, $12, $13, 0x5410;"]
    body += [f"mov.b32 c0, {pair_spec(0, bf16)['scale'] * 0x10001:#010x};"]
    body += [f"mov.b32 c1, {pair_spec(1, bf16)['scale'] * 0x10001:#010x};"]
    for p in range(8):
        spec = pair_spec(p % 4, bf16)
        src = "lo" if p < 4 else "hi"
        if spec["shift"]:
            body.append(f"shr.u32 t, {src}, {spec['shift']};")
            src = "t"
        odd = p % 2 if not bf16 else 0
        body += [
            f"lop3.b32 t, {src}, {spec['mask'] * 0x10001:#010x}, {spec['magic'] * 0x10001:#010x}, 0xea;",
            f"fma.rn.{pairs} ${p}, t, c{odd}, b{odd};",
        ]
    return "{ .reg .b32 lo, hi, t, b0, b1, c0, c1; " + " ".join(body) + " }"


@triton.jit
def dequant_columns(words, z, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """The 8 values of 4-bit words [KW, BLOCK_N] (int32, GPTQ order) minus z (int32, broadcast), exactly, as 8
    tensors [KW, BLOCK_N] of fp16 (bf16 when BF16), value p of each word in the p-th. Neighbouring columns come out
    paired in one register, the layout the MMA's B tile is stored in."""
    even = _field(0, BF16, "bias") + z * _field(0, BF16, "bias_step")
    odd = _field(1, BF16, "bias") + z * _field(1, BF16, "bias_step")
    if EMULATE:
        v0, v4 = _emulate(words, even | (even << 16), z, 0, BF16, False)
        v1, v5 = _emulate(words, odd | (odd << 16), z, 1, BF16, False)
        v2, v6 = _emulate(words, even | (even << 16), z, 2, BF16, False)
        v3, v7 = _emulate(words, odd | (odd << 16), z, 3, BF16, False)
    else:
        even = even + words * 0  # bias per element: broadcast to the words' shape, packed two columns at a time
        odd = odd + words * 0
        if BF16:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                columns_ptx(BF16), "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, even, odd],
                (tl.bfloat16,) * 8, True, 2,
            )  # fmt: skip
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                columns_ptx(BF16), "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [words, even, odd],
                (tl.float16,) * 8, True, 2,
            )  # fmt: skip
    return v0, v1, v2, v3, v4, v5, v6, v7
