"""Arrival counters for launches whose programs reduce among themselves: each program of a group increments its
group's counter after storing its share, and the one that sees the count reach the group size - 1 does the
reduction and sets the counter back to 0 (split-K GEMMs: quant_gemm_common.store_output; split-KV attention:
paged_attention_split.merge_splits_in_launch).

Counters are left zeroed after every launch, so one buffer per device is allocated once and shared by every such
kernel; a buffer that grows keeps the old one alive, since CUDA graphs captured earlier still point at it. Two
such launches must not run concurrently on different streams of one device (they would share counters).
"""

import torch
import triton

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counter buffers that captured graphs may still use


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least `count` arrival counters on `device`, kept for reuse."""
    counters = _COUNTERS.get(device)
    if counters is not None and counters.numel() >= count:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a kernel that reduces across its programs (split-K GEMM, split-KV attention) needs its counter buffer "
            "allocated before CUDA graph capture: run the model once eagerly at the captured batch sizes first "
            "(the graph runner's warm-up does)"
        )
    if counters is not None:
        _RETIRED.append(counters)
    counters = torch.zeros(max(4096, triton.next_power_of_2(count)), dtype=torch.int32, device=device)
    _COUNTERS[device] = counters
    return counters
