"""Programmatic dependent launch (Hopper and later): a kernel starts while the kernel before it in the stream is
still draining, so its launch and scheduling overlap that kernel's tail instead of following it.

A decode step at batch 1 is a chain of ~10 short kernels per layer, each paying a launch gap even inside a CUDA
graph; this hides that gap for every kernel here. The rule that keeps it correct: a kernel launched with
`dependent_launch(device)` calls `wait_for_previous_kernel` before it reads anything an earlier kernel may have
written or writes anything (and never returns early before it), so each kernel still sees everything before it
complete, and the kernels after it wait for it as before. Constants (weights) may be read before the wait: the
dense and W4A16 GEMVs load their first weight tile there, so that load overlaps the previous kernel's tail.
Loading a step's metadata (positions, slot mapping, sequence bounds) early as well in rotary, the KV write and
attention measured no faster on the H200 (batch-1 decode 223.0 vs 223.9-224.2 tok/s), so those kernels wait
first. Nor did prefetching attention's first K/V tiles into L2 (PTX prefetch.global.L2) before its wait: 0.5-4%
less time per layer at batch 1 in `bench_attention.py --chain`, no change in batch-1 decode, 0.2-1% slower mixed
steps.

On by default on compute capability >= 9 when compiled; `TRITONLLM_PDL=0` turns it off (for A/B timing).
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tritonllm.platform import INTERPRET


@functools.lru_cache(maxsize=8)
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITONLLM_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def dependent_launch(device: torch.device) -> dict:
    """Launch keywords for a kernel that starts with `wait_for_previous_kernel(PDL)`: PDL=True plus Triton's
    launch_pdl option where the GPU supports it, else PDL=False (the interpreter, CPUs, GPUs before Hopper)."""
    if INTERPRET or device.type != "cuda" or not _supported(device.index or 0):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished and its writes are visible, then let the next
    kernel launch (it waits the same way before touching memory). A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
