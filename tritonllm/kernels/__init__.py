"""Triton kernels, one op per file: `_<op>_kernel`, the wrapper `<op>`, and the reference `<op>_ref`."""

from tritonllm import platform as _platform  # noqa: F401  (must precede every triton.jit)
