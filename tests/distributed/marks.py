"""When the ranks of these tests can run here.

Under Triton's interpreter (CI, any CPU machine) ranks are CPU processes over gloo. Compiled kernels need CUDA
tensors, so there tests that hand CPU tensors to Triton kernels cannot run, and an engine with two ranks puts
one on each GPU.
"""

import pytest
import torch

from tritonllm.platform import INTERPRET

cpu_kernels = pytest.mark.skipif(
    not INTERPRET, reason="runs Triton kernels on CPU ranks, which only the interpreter (TRITON_INTERPRET=1) serves"
)
two_ranks = pytest.mark.skipif(
    not INTERPRET and torch.cuda.device_count() < 2, reason="tensor_parallel_size=2 on GPUs needs 2 visible GPUs"
)
