"""SASS instructions per packed word in the W4A16 kernels' main loop, compiled for sm_90 on any machine.

    python benchmarks/sass_stats.py                                  # every fused launch of the H200 table
    python benchmarks/sass_stats.py --kernel dot --block-m 16 --block-n 128 --block-k 64 --warps 4 --stages 3

No GPU needed: Triton compiles for a Hopper target and its bundled cuobjdump disassembles the cubin. The W4A16
GEMV issues about as many instructions as the SMs can (ncu on an H200: 72% of issue slots, 37% of DRAM
bandwidth), so instructions per packed word (8 4-bit values) in the loop are the figure to cut; it is counted
over the largest loop of the SASS (the K loop) and divided by the words each thread reads per iteration.
Figures are for the Triton installed here (kernels compiled by another version can differ).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU target, also on a machine without one

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tritonllm.kernels.quant_gemm import _quant_gemm_kernel  # noqa: E402
from tritonllm.kernels.quant_gemm_config import HOPPER_TABLE  # noqa: E402
from tritonllm.kernels.quant_gemv import _quant_gemv_kernel  # noqa: E402
from tritonllm.kernels.quant_gemv_f16 import _quant_gemv_f16_kernel  # noqa: E402

_POINTERS = {
    "x_ptr": "*fp16",
    "qweight_ptr": "*i32",
    "qzeros_ptr": "*i32",
    "scales_ptr": "*fp16",
    "bias_ptr": "*fp16",
    "out_ptr": "*fp16",
    "partial_ptr": "*fp32",
    "lock_ptr": "*i32",
}
# As a launch on contiguous tensors specializes them: 16-divisible pointers and row strides, unit column strides.
_DIV16 = {*_POINTERS, "N", "K", "k_per_split", "stride_p_s", "stride_x_m", "stride_qw_k", "stride_qz_g", "stride_s_g"}
_DIV16.add("stride_out_m")
_UNIT = {"stride_x_k", "stride_qw_n", "stride_qz_n", "stride_s_n", "stride_out_n"}
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int):
    signature, attrs, values = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _UNIT:
            signature[name], values[name] = "constexpr", 1
        else:
            signature[name] = _POINTERS.get(name, "i32")
            if name in _DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def disassemble(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The instructions of the largest backward branch's range: the kernel's K loop."""
    instrs = [(int(addr, 16), text) for addr, text in _INSTR.findall(sass)]
    best: list[str] = []
    for addr, text in instrs:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in instrs if int(target.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def report(kind: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int, group: int) -> None:
    common = dict(BITS=4, GROUP_SIZE=group, ZERO_OFFSET=0, HAS_BIAS=False, SPLIT=True)
    common.update(GROUPS="tile", BLOCK_N=block_n, BLOCK_K=block_k)
    if kind == "gemv":  # the fp32 GEMV
        cc = compile_sm90(_quant_gemv_kernel, dict(common, PREFETCH=stages > 1), warps, 1)
        label = f"gemv n{block_n} k{block_k} w{warps} st{stages}"
    elif kind == "gemv_f16":
        del common["BITS"]
        extra = dict(PREFETCH=stages > 1, BLOCK_M=block_m, INTERPRET=False)
        cc = compile_sm90(_quant_gemv_f16_kernel, dict(common, **extra), warps, 1)
        label = f"gemv_f16 m{block_m} n{block_n} k{block_k} w{warps} st{stages}"
    else:
        extra = dict(DOT_PRECISION="tf32", INTERPRET=False, BLOCK_M=block_m, SWAP_AB=False)
        cc = compile_sm90(_quant_gemm_kernel, dict(common, **extra), warps, stages)
        label = f"dot m{block_m} n{block_n} k{block_k} w{warps} st{stages}"
    loop = main_loop(disassemble(cc.asm["cubin"]))
    words = block_n * block_k / 8 / (32 * warps)  # packed words each thread reads per iteration
    mix = ", ".join(f"{op} {n}" for op, n in Counter(map(opcode, loop)).most_common(12))
    print(f"{label}: {len(loop)} instructions per iteration, {len(loop) / words:.1f} per packed word ({mix})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kernel", choices=["gemv", "gemv_f16", "dot"], default=None, help="default: the table's launches"
    )
    parser.add_argument("--block-m", type=int, default=16)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90, fp16, 4-bit, group {args.group_size}")
    if args.kernel is None:  # every distinct fused launch of the H200 table (split-K does not change the loop)
        launches = dict.fromkeys(
            (replace(r.config, split_k=1), "dot" if not r.config.gemv else "gemv_f16" if r.paired_only else "gemv")
            for r in HOPPER_TABLE
            if not r.config.dequant
        )
        for c, kind in launches:
            report(kind, c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, args.group_size)
        return
    report(args.kernel, args.block_m, args.block_n, args.block_k, args.warps, args.stages, args.group_size)


if __name__ == "__main__":
    main()
