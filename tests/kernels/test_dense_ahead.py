"""Dense W^T written ahead: every call gets its own layer's W^T whatever order the passes take, a pass that repeats
the last one writes each layer once, and a failed pass leaves nothing behind."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tests.helpers import DEVICE, assert_close, randn, seeds
from tritonllm.kernels import dense_ahead
from tritonllm.kernels.dense_ahead import DenseAhead
from tritonllm.kernels.quant_gemm import gptq_gemm, gptq_gemm_ref
from tritonllm.kernels.quant_gemm_config import QuantGemmConfig
from tritonllm.quant.pack import pack_bits


class _Pass(nn.Module):
    """A forward pass that asks for the listed layers' W^T in order and checks each one on arrival."""

    def __init__(self, weights: dict[str, torch.Tensor], writes: list[str]) -> None:
        super().__init__()
        self.weights, self.writes = weights, writes

    def forward(self, order: list[str], fail_after: int | None = None) -> None:
        for i, name in enumerate(order):
            if i == fail_after:
                raise RuntimeError("a layer failed")
            weight = self.weights[name]
            key = (hash(name), tuple(weight.shape), weight.dtype)
            got = dense_ahead.active().dense_weight(key, tuple(weight.shape), self._writer(name))
            assert torch.equal(got, weight), f"call {i} ({name}) got another layer's W^T"

    def _writer(self, name: str):
        def write(view: torch.Tensor) -> None:
            self.writes.append(name)
            view.copy_(self.weights[name])

        return write


@given(
    seed=seeds(),
    shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    orders=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=8), min_size=1, max_size=5),
)
def test_each_call_gets_its_own_layer(seed, shapes, dtype, orders):
    g = torch.Generator().manual_seed(seed)
    weights = {f"l{i}": torch.randn(k, n, generator=g).to(dtype) for i, (k, n) in enumerate(shapes)}
    writes: list[str] = []
    model = _Pass(weights, writes)
    DenseAhead(torch.device("cpu")).forward_hooks(model)
    previous = None
    for raw in orders:
        order = [f"l{i % len(shapes)}" for i in raw]
        writes.clear()
        model(order)
        assert dense_ahead.active() is None
        if order == previous and len(set(order)) == len(order):
            assert writes == order, "a pass that repeats the last one writes each layer once, in order"
        previous = order


def test_a_failed_pass_leaves_nothing_pending():
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(6, 4, generator=g) for name in "abc"}
    writes: list[str] = []
    model = _Pass(weights, writes)
    ahead = DenseAhead(torch.device("cpu"))
    ahead.forward_hooks(model)
    model(list("abc"))
    with pytest.raises(RuntimeError, match="a layer failed"):
        model(list("abc"), fail_after=1)  # "b" was written ahead, then the pass stopped
    assert dense_ahead.active() is None and ahead.pending is None
    writes.clear()
    model(list("cab"))  # another order: each guess from the earlier passes misses
    assert sorted(writes[:3]) == ["a", "b", "c"]


def test_buffers_grow_for_a_larger_layer_and_keep_serving():
    g = torch.Generator().manual_seed(1)
    weights = {"small": torch.randn(3, 5, generator=g), "large": torch.randn(16, 9, generator=g)}
    model = _Pass(weights, [])
    ahead = DenseAhead(torch.device("cpu"))
    ahead.forward_hooks(model)
    model(["small", "large", "small"])
    assert ahead.buffers[0].numel() == 16 * 9 * 4
    model(["small", "large", "small"])


class _QuantStack(nn.Module):
    """Packed 4-bit layers applied one after the other, each through dequantize + matmul."""

    def __init__(self, dims: list[int], group_size: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.group_size = group_size
        self.layers = []
        for k, n in itertools.pairwise(dims):
            qweight = pack_bits(torch.randint(0, 16, (k, n), generator=g), 4, dim=0).to(DEVICE)
            qzeros = pack_bits(torch.randint(0, 16, (k // group_size, n), generator=g), 4, dim=1).to(DEVICE)
            scales = ((torch.rand(k // group_size, n, generator=g) + 0.5) / (8 * k**0.5)).to(torch.float16)
            self.layers.append((qweight, qzeros, scales.to(DEVICE)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qweight, qzeros, scales in self.layers:
            x = gptq_gemm(x, qweight, qzeros, scales, 4, self.group_size, config=SMALL_DEQUANT)
        return x


SMALL_DEQUANT = QuantGemmConfig(1, 32, 32, 1, 4, 1, dequant=True)  # several tiles on these shapes


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantized_layers_match_the_reference_with_weights_written_ahead(dtype):
    model = _QuantStack([64, 96, 32, 64], group_size=32, seed=2)
    ahead = DenseAhead(DEVICE)
    ahead.forward_hooks(model)
    for seed in range(3):  # the first pass learns the order, the next ones write ahead
        x = randn(5, 64, dtype=dtype, seed=seed)
        expected = x
        for layer in model.layers:
            expected = gptq_gemm_ref(expected, *layer, 4, model.group_size).to(dtype)
        assert_close(model(x), expected, dtype, scale=2.0 * len(model.layers))
    assert len(ahead.successor) == len(model.layers) - 1  # the layers' calls went through it


@pytest.mark.parametrize(("setting", "on"), [(None, False), ("0", False), ("1", True)])
def test_the_switch_decides_whether_a_model_gets_hooks(setting, on, monkeypatch):
    if setting is None:
        monkeypatch.delenv("TRITONLLM_DENSE_AHEAD", raising=False)
    else:
        monkeypatch.setenv("TRITONLLM_DENSE_AHEAD", setting)
    model = _Pass({}, [])
    ahead = dense_ahead.enable_dense_ahead(model, torch.device("cpu"))
    assert (ahead is not None) == on
    assert (len(model._forward_pre_hooks) == 1) == on
