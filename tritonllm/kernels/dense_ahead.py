"""Dequantize + matmul with the next layer's dense W^T written ahead of time, on a second stream.

At high concurrency every 4-bit linear layer writes its dense W^T and then multiplies by it (quant_dense.py). The
write is bound by memory and the matmul by the tensor cores, and the weights do not depend on the activations, so
while layer j's matmul runs, layer j+1's W^T can be written on a side stream into the other of two buffers. The
order of the layers is learned from the calls of one forward pass; a call that does not match the prediction
writes its own W^T, so a wrong guess costs time, never correctness.

A model's forward pass is one scope (`DenseAhead.forward_hooks`): the first call of a pass writes its own W^T,
and no write is left pending when the pass ends, which keeps a pass captured in a CUDA graph self-contained.
Without a GPU the same bookkeeping runs with every write in order, which is how the tests check it.

Off until timed on a GPU (docs/benchmarks.md): `TRITONLLM_DENSE_AHEAD=1` turns it on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# A layer's identity across passes: its packed weights' address and shape, and the dtype of the W^T it needs.
Key = tuple[int, tuple[int, ...], torch.dtype]
Writer = Callable[[torch.Tensor], object]  # writes a layer's W^T [K, N] into the view it is given


@dataclass(slots=True)
class _Layer:
    shape: tuple[int, int]  # W^T's [K, N]
    write: Writer


@dataclass(slots=True)
class _Pending:
    key: Key
    slot: int
    ready: torch.cuda.Event | None


class DenseAhead:
    """Two W^T buffers for one device and what was learned of the order the layers run in."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.buffers: list[torch.Tensor] = []  # two flat byte buffers
        self.layers: dict[Key, _Layer] = {}
        self.successor: dict[Key, Key] = {}
        self.previous: Key | None = None  # the pass's last call
        self.pending: _Pending | None = None

    def dense_weight(self, key: Key, shape: tuple[int, int], write: Writer) -> torch.Tensor:
        """This layer's W^T [K, N], ready on the current stream: written ahead by the call before it when that call
        guessed this layer, else written now. Then the layer predicted to come next starts on the side stream."""
        self.layers[key] = _Layer(shape, write)
        if self.previous is not None:
            self.successor[self.previous] = key
        self.previous = key
        following = self.successor.get(key)
        pending, self.pending = self.pending, None
        if pending is not None:
            self._wait(pending)  # its buffer is read below, or written again
        grown = self._reserve(key, following)
        if pending is not None and pending.key == key and not grown:
            slot = pending.slot
        else:
            slot = 0
            write(self._view(slot, key))
        if following is not None:
            self._write_ahead(following, 1 - slot)
        return self._view(slot, key)

    def end_pass(self) -> None:
        """Join whatever is still pending (a pass that failed, or a last call that guessed a successor) and forget
        the pass's last call, so the next pass starts fresh."""
        if self.pending is not None:
            self._wait(self.pending)
            self.pending = None
        self.previous = None

    def forward_hooks(self, model: nn.Module) -> None:
        """Make each forward pass of `model` one scope, whatever path calls it (eager, captured, profiling)."""
        model.register_forward_pre_hook(lambda module, args: self._enter())
        model.register_forward_hook(lambda module, args, output: self._leave(), always_call=True)

    def _enter(self) -> None:
        global _active
        self.end_pass()
        _active = self

    def _leave(self) -> None:
        global _active
        self.end_pass()
        _active = None

    def _write_ahead(self, key: Key, slot: int) -> None:
        view = self._view(slot, key)
        if self.stream is None:
            self.layers[key].write(view)
            self.pending = _Pending(key, slot, None)
            return
        # Everything queued so far, the previous layer's matmul on this buffer included, precedes the write.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.layers[key].write(view)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.pending = _Pending(key, slot, ready)

    def _wait(self, pending: _Pending) -> None:
        if pending.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(pending.ready)

    def _reserve(self, *keys: Key | None) -> bool:
        """Grow both buffers to hold these layers' W^T (in the first pass; nothing may be pending). True if they
        grew, which drops what they held."""
        size = max(self._bytes(key) for key in keys if key is not None)
        if self.buffers and self.buffers[0].numel() >= size:
            return False
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return True

    def _bytes(self, key: Key) -> int:
        k, n = self.layers[key].shape
        return k * n * key[2].itemsize

    def _view(self, slot: int, key: Key) -> torch.Tensor:
        return self.buffers[slot][: self._bytes(key)].view(key[2]).view(self.layers[key].shape)


_active: DenseAhead | None = None


def active() -> DenseAhead | None:
    """The scope of the forward pass in progress, if its model has one and it is not turned off."""
    return _active


def enable_dense_ahead(model: nn.Module, device: torch.device) -> DenseAhead | None:
    """Write 4-bit layers' W^T ahead during `model`'s forward passes (None unless turned on)."""
    if os.environ.get("TRITONLLM_DENSE_AHEAD", "0") != "1":
        return None
    ahead = DenseAhead(device)
    ahead.forward_hooks(model)
    return ahead
