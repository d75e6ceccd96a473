"""Pure-PyTorch AWQ and GPTQ packing, unpacking and dequantization.

This module is the plain statement of the two checkpoint formats; the Triton kernels are checked against it and
the GPTQ method uses its bit-stream helpers to repack act-order weights once at load time.

AWQ (AutoAWQ `version: gemm`, 4-bit only), for a linear layer y = x @ W^T with W [N, K]:
    qweight [K, N // 8] int32: packed along N; nibble i of word c holds column 8 * c + AWQ_PACK_ORDER[i]
    qzeros  [K // g, N // 8] int32: same packing and order
    scales  [K // g, N] fp16
    W^T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]

GPTQ (AutoGPTQ / GPTQModel), bits in {2, 3, 4, 8}, G = ceil(K / g) groups:
    qweight [K * bits // 32, N] int32: packed along K as a little-endian bit stream (value k occupies stream bits
            bits*k .. bits*k + bits - 1 of its column); for 3 bits a value can straddle two words
    qzeros  [G, N * bits // 32] int32: the same bit stream along N
    scales  [G, N] fp16
    g_idx   [K] int32: the group of each input feature (non-monotonic under act-order / desc_act)
    W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
    checkpoint_format "gptq" (v1) stores z - 1 in qzeros (readers add 1); "gptq_v2" stores z itself.
"""

import math
from dataclasses import dataclass

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_PACK_ORDER[i]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j sits in nibble AWQ_UNPACK_ORDER[j]

GPTQ_BITS = (2, 3, 4, 8)
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(slots=True)
class AwqWeights:
    qweight: torch.Tensor  # [K, N // 8] int32, AWQ nibble order
    qzeros: torch.Tensor  # [K // g, N // 8] int32, AWQ nibble order
    scales: torch.Tensor  # [K // g, N] fp16


@dataclass(slots=True)
class GptqWeights:
    qweight: torch.Tensor  # [K * bits // 32, N] int32, bit stream along K
    qzeros: torch.Tensor  # [G, N * bits // 32] int32, bit stream along N (v1: zero - 1)
    scales: torch.Tensor  # [G, N] fp16
    g_idx: torch.Tensor  # [K] int32


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _block(bits: int) -> tuple[int, int]:
    """(values, words) of the smallest run of values that fills whole int32 words: 4-bit 8 values in 1 word, 3-bit
    32 values in 3 words."""
    values = 32 // math.gcd(bits, 32)
    return values, values * bits // 32


def pack_bits(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integers in [0, 2**bits) along `dim` into int32 words as a little-endian bit stream.

    Value i occupies stream bits bits*i .. bits*i + bits - 1; word w holds stream bits 32w .. 32w + 31. The length
    along `dim` must fill whole words (a multiple of 32 // bits, or of 32 for 3 bits).
    """
    v = values.movedim(dim, -1).to(torch.int64)
    length = v.shape[-1]
    per_block, words_per_block = _block(bits)
    if length % per_block:
        raise ValueError(
            f"{length} values of {bits} bits do not fill whole int32 words; need a multiple of {per_block}"
        )
    if v.numel() and (v.min() < 0 or v.max() >= 2**bits):
        raise ValueError(f"values to pack must lie in [0, {2**bits}); got [{int(v.min())}, {int(v.max())}]")
    v = v.reshape(*v.shape[:-1], length // per_block, per_block)
    words = torch.zeros(*v.shape[:-1], words_per_block, dtype=torch.int64, device=v.device)
    for i in range(per_block):
        word, shift = divmod(i * bits, 32)
        words[..., word] |= (v[..., i] << shift) & 0xFFFFFFFF
        if shift + bits > 32:  # the value straddles into the next word (3-bit only)
            words[..., word + 1] |= v[..., i] >> (32 - shift)
    words = words.reshape(*words.shape[:-2], -1)
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_bits`: int32 words along `dim` -> int32 values in [0, 2**bits)."""
    w = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    per_block, words_per_block = _block(bits)
    if w.shape[-1] % words_per_block:
        raise ValueError(f"{w.shape[-1]} words do not hold whole runs of {bits}-bit values")
    w = w.reshape(*w.shape[:-1], -1, words_per_block)
    mask = (1 << bits) - 1
    out = torch.empty(*w.shape[:-1], per_block, dtype=torch.int64, device=w.device)
    for i in range(per_block):
        word, shift = divmod(i * bits, 32)
        value = w[..., word] >> shift
        if shift + bits > 32:
            value = value | (w[..., word + 1] << (32 - shift))
        out[..., i] = value & mask
    out = out.reshape(*out.shape[:-2], -1)
    return out.to(torch.int32).movedim(-1, dim).contiguous()


def pack_awq_int(ints: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit ints -> [R, N // 8] int32 words in AWQ's interleaved nibble order."""
    rows, n = ints.shape
    if n % 8:
        raise ValueError(f"AWQ packs 8 columns per int32 word; the output size {n} is not a multiple of 8")
    grouped = ints.reshape(rows, n // 8, 8)[:, :, list(AWQ_PACK_ORDER)]
    return pack_bits(grouped.reshape(rows, n), 4, dim=1)


def unpack_awq_int(words: torch.Tensor) -> torch.Tensor:
    """[R, N // 8] AWQ words -> [R, N] 4-bit ints in column order."""
    nibbles = unpack_bits(words, 4, dim=1)
    rows, n = nibbles.shape
    return nibbles.reshape(rows, n // 8, 8)[:, :, list(AWQ_UNPACK_ORDER)].reshape(rows, n).contiguous()


def repack_awq_as_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, chunk_bytes: int = 2**28
) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ qweight [K, N // 8], qzeros [G, N // 8] -> the same 4-bit values in GPTQ's layout, on their device.

    qweight becomes [K // 8, N] packed along K, qzeros [G, N // 8] packed along N in column order; the zeros stay
    the true zeros (read them with zero offset 0, GPTQ v2's convention). Columns are converted in chunks so the
    int64 values of one chunk stay under about `chunk_bytes`.
    """
    k, words = qweight.shape
    if k % 8:
        raise ValueError(f"AWQ input size {k} must be a multiple of 8 to pack along K")
    step = max(1, chunk_bytes // (8 * 8 * k))  # AWQ words per chunk: 8 int64 values of K rows each
    out = torch.empty(k // 8, words * 8, dtype=torch.int32, device=qweight.device)
    for c in range(0, words, step):
        out[:, 8 * c : 8 * (c + step)] = pack_bits(unpack_awq_int(qweight[:, c : c + step]), 4, dim=0)
    return out, pack_bits(unpack_awq_int(qzeros), 4, dim=1)


def _group_min_max(weight: torch.Tensor, g_idx: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (output row, group) min and max of weight [N, K] -> two [N, G] tensors."""
    n = weight.shape[0]
    index = g_idx.long().unsqueeze(0).expand(n, -1)
    init = torch.zeros(n, num_groups, dtype=weight.dtype, device=weight.device)
    wmin = init.scatter_reduce(1, index, weight, "amin", include_self=False)
    wmax = init.scatter_reduce(1, index, weight, "amax", include_self=False)
    return wmin, wmax


def _quantize(
    weight: torch.Tensor, g_idx: torch.Tensor, num_groups: int, bits: int, sym: bool, min_zero: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest min/max quantization of weight [N, K] (fp32) in the groups of g_idx.

    Returns q [N, K] ints, zeros [N, G] ints and scales [N, G] fp16; the range always includes 0 so every weight
    lies within half a step of the grid (up to fp16 rounding of the scale).
    """
    maxq = 2**bits - 1
    wmin, wmax = _group_min_max(weight, g_idx, num_groups)
    wmin = wmin.clamp(max=0.0)
    wmax = wmax.clamp(min=0.0)
    if sym:
        wmax = torch.maximum(-wmin, wmax)
        wmin = -wmax
    degenerate = wmax - wmin <= 1e-8
    wmin = torch.where(degenerate, torch.full_like(wmin, -1.0), wmin)
    wmax = torch.where(degenerate, torch.full_like(wmax, 1.0), wmax)
    scales = ((wmax - wmin) / maxq).to(torch.float16)
    s = scales.float()
    if sym:
        zeros = torch.full_like(s, (maxq + 1) // 2, dtype=torch.int64)
    else:
        zeros = torch.round(-wmin / s).to(torch.int64).clamp(min_zero, maxq)
    group = g_idx.long()
    q = torch.round(weight / s[:, group]) + zeros[:, group]
    q = q.clamp(0, maxq).to(torch.int64)
    return q, zeros, scales


def pack_awq(weight: torch.Tensor, group_size: int = 128) -> AwqWeights:
    """Quantize a float weight [N, K] (nn.Linear layout) to AutoAWQ GEMM tensors (4-bit, asymmetric)."""
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    if k % g:
        raise ValueError(f"AWQ needs the input size {k} to be a multiple of group_size {g}")
    g_idx = torch.arange(k, device=weight.device) // g
    q, zeros, scales = _quantize(weight.float(), g_idx, k // g, bits=4, sym=False, min_zero=0)
    return AwqWeights(
        qweight=pack_awq_int(q.t().contiguous()),
        qzeros=pack_awq_int(zeros.t().contiguous()),
        scales=scales.t().contiguous(),
    )


def pack_gptq(
    weight: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    act_order: bool = False,
    g_idx: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> GptqWeights:
    """Quantize a float weight [N, K] (nn.Linear layout) to GPTQ tensors.

    act_order=True draws a random column order (as GPTQ's Hessian order would) and forms the groups of
    `group_size` consecutive columns in that order, so g_idx comes out non-monotonic. A given `g_idx` [K] sets the
    groups directly. Otherwise g_idx[k] = k // group_size (also what `static_groups` checkpoints store).

    v1 (`checkpoint_format="gptq"`) cannot store a zero of 0 (it writes zero - 1), so asymmetric zeros are kept
    >= 1 there; real weights straddle 0 and almost never need a zero of 0.
    """
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ bits={bits} is not supported; supported: {list(GPTQ_BITS)}")
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r}; supported: {list(GPTQ_CHECKPOINT_FORMATS)}")
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    num_groups = -(-k // g)
    device = weight.device
    if g_idx is None:
        if act_order:
            perm = torch.randperm(k, generator=generator).to(device)
            g_idx = torch.empty(k, dtype=torch.int64, device=device)
            g_idx[perm] = torch.arange(k, device=device) // g
        else:
            g_idx = torch.arange(k, device=device) // g
    else:
        if g_idx.shape != (k,) or g_idx.min() < 0:
            raise ValueError(f"g_idx must be [K={k}] non-negative group indices; got shape {tuple(g_idx.shape)}")
        num_groups = int(g_idx.max()) + 1
    v1 = checkpoint_format == "gptq"
    q, zeros, scales = _quantize(weight.float(), g_idx, num_groups, bits, sym, min_zero=1 if v1 else 0)
    stored_zeros = zeros - 1 if v1 else zeros
    return GptqWeights(
        qweight=pack_bits(q.t(), bits, dim=0),
        qzeros=pack_bits(stored_zeros.t(), bits, dim=1),
        scales=scales.t().contiguous(),
        g_idx=g_idx.to(torch.int32),
    )


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ qweight [K, N // 8], qzeros [G, N // 8] -> ints [K, N] and zeros [G, N] in column order."""
    return unpack_awq_int(qweight), unpack_awq_int(qzeros)


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, checkpoint_format: str = "gptq"
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ qweight [K * bits // 32, N], qzeros [G, N * bits // 32] -> ints [K, N] and true zeros [G, N].

    For v1 the stored field is zero - 1, so 1 is added back (a stored all-ones field reads as 2**bits, exactly
    as the v1 kernels of the quantization tools read it).
    """
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r}; supported: {list(GPTQ_CHECKPOINT_FORMATS)}")
    ints = unpack_bits(qweight, bits, dim=0)
    zeros = unpack_bits(qzeros, bits, dim=1)
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    return ints, zeros


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ tensors -> float32 W^T [K, N] = (q - z) * s."""
    ints, zeros = unpack_awq(qweight, qzeros)
    k = ints.shape[0]
    g = k if group_size == -1 else group_size
    group = torch.arange(k, device=ints.device) // g
    return (ints - zeros[group]).float() * scales[group].float()


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """GPTQ tensors -> float32 W^T [K, N] = (q - z[g_idx]) * s[g_idx]."""
    ints, zeros = unpack_gptq(qweight, qzeros, bits, checkpoint_format)
    group = g_idx.long()
    return (ints - zeros[group]).float() * scales[group].float()


def regular_g_idx(k: int, group_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The g_idx of a checkpoint without act-order: [K] int32 with g_idx[k] = k // group_size."""
    g = k if group_size == -1 else group_size
    return (torch.arange(k, device=device) // g).to(torch.int32)
