"""Where kernels run: compiled on a CUDA GPU, or through Triton's interpreter on the CPU.

Triton decides between the two when a kernel is decorated, so this module must run before any
`@triton.jit` in tritonllm. `tritonllm/__init__.py` imports it first; every kernel module imports it too,
so importing `tritonllm.kernels.x` directly is just as safe.

Rule: without a usable CUDA device, `TRITON_INTERPRET=1` is set unless the user set it already
(`TRITON_INTERPRET=0` on a machine without CUDA leaves kernels uncallable; we do not override a choice).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def default_device() -> torch.device:
    """The device models and caches live on when the caller names none."""
    return torch.device("cuda" if HAS_CUDA and not INTERPRET else "cpu")


def device_memory(requested: str | None) -> int | None:
    """Total memory in bytes of the GPU an engine asking for `requested` (None: the default device) runs on;
    None when that is not a GPU. With several ranks each has a GPU of its own; they are taken to be alike."""
    device = torch.device(requested) if requested else default_device()
    index = device.index or 0
    if device.type != "cuda" or not HAS_CUDA or index >= torch.cuda.device_count():
        return None  # not a GPU, or one that is not there: the engine's own checks name the problem
    return torch.cuda.get_device_properties(index).total_memory


def check_kernel_device(*tensors: torch.Tensor) -> None:
    """Fail early when a tensor sits where the kernels cannot reach it."""
    for t in tensors:
        if INTERPRET and t.device.type != "cpu":
            raise ValueError(
                f"Triton's interpreter is on (TRITON_INTERPRET=1) but a tensor is on {t.device}; "
                "move inputs to the CPU or unset TRITON_INTERPRET to run compiled on the GPU"
            )
        if not INTERPRET and t.device.type != "cuda":
            raise ValueError(
                f"compiled Triton kernels need CUDA tensors, got one on {t.device}; "
                "move inputs to the GPU or set TRITON_INTERPRET=1 before importing tritonllm"
            )
