"""Dense GEMV y = x @ W^T (+ bias) for 1..16 rows: both compute paths, split-K (reduced inside the launch,
counters reset), odd shapes, strided x and out, the gated activation fused in (gate_up + SiLU / GELU), the launch
heuristics, the errors, and when linear layers take the kernel instead of F.linear."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import tritonllm.kernels.dense_gemv_config as dense_gemv_config
import tritonllm.models.layers.linear as linear_module
from tests.helpers import DEVICE, TOLERANCES, dtypes, randn, seeds
from tritonllm.kernels.activation import GATED_ACTIVATIONS
from tritonllm.kernels.arrival_counters import _COUNTERS
from tritonllm.kernels.dense_gemv import dense_gemv, dense_gemv_ref, gated_dense_gemv_ref
from tritonllm.kernels.dense_gemv_config import (
    DENSE_GEMV_MAX_ROWS,
    MAX_GEMV_ROWS,
    GemvConfig,
    check_gemv_config,
    gemv_config,
    k_span,
    use_dense_gemv,
    use_gated_gemv,
)

# Small tiles so odd shapes span several N tiles, K tiles and splits; "auto" is the interpreter's own launch.
PATHS = {"auto": None, "cuda": GemvConfig(16, 32, 1, 4, 1, False), "dot": GemvConfig(16, 32, 1, 4, 2, True)}


def _config(path: str, split: int, prefetch: bool = False) -> GemvConfig | None:
    cfg = PATHS[path]
    if cfg is None:
        return None
    stages = 2 if prefetch else 1  # CUDA cores: load each weight tile one iteration ahead
    return GemvConfig(cfg.block_n, cfg.block_k, split, cfg.num_warps, stages, cfg.use_dot)


def _assert_matches(y, x, w, bias=None):
    # The fp32 sum differs from the reference's only in order; fp16/bf16 add one rounding of y, whose size
    # grows like sqrt(K) for unit-variance inputs.
    expected = dense_gemv_ref(x, w, bias)
    k = x.shape[-1]
    tol = TOLERANCES[x.dtype]
    torch.testing.assert_close(y.float(), expected, atol=tol["atol"] * math.sqrt(k), rtol=tol["rtol"])


@given(
    seed=seeds(),
    m=st.integers(1, MAX_GEMV_ROWS),
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    dtype=dtypes,
    has_bias=st.booleans(),
    path=st.sampled_from(list(PATHS)),
    split=st.sampled_from([1, 2, 3]),
    prefetch=st.booleans(),
)
@example(seed=1, m=1, n=37, k=300, dtype=torch.bfloat16, has_bias=True, path="cuda", split=3, prefetch=True)
@example(seed=2, m=16, n=300, k=77, dtype=torch.bfloat16, has_bias=False, path="dot", split=2, prefetch=False)
@example(seed=3, m=5, n=1, k=1, dtype=torch.float32, has_bias=True, path="dot", split=3, prefetch=False)
@example(seed=4, m=3, n=129, k=257, dtype=torch.float16, has_bias=True, path="cuda", split=2, prefetch=False)
def test_gemv_matches_reference(seed, m, n, k, dtype, has_bias, path, split, prefetch):
    x = randn(m, k, dtype=dtype, seed=seed)
    w = randn(n, k, dtype=dtype, seed=seed + 1)
    bias = randn(n, dtype=dtype, seed=seed + 2) if has_bias else None
    y = dense_gemv(x, w, bias, config=_config(path, split, prefetch))
    assert y.dtype == dtype and y.shape == (m, n)
    _assert_matches(y, x, w, bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize(("path", "prefetch"), [("cuda", False), ("cuda", True), ("dot", False)])
def test_every_path_split_and_dtype(path, prefetch, split, dtype):
    # An odd shape with a partial last N tile, a partial last K tile and uneven splits (7 K tiles in 2 or 3).
    m, n, k = 7, 45, 203
    x = randn(m, k, dtype=dtype, seed=split)
    w = randn(n, k, dtype=dtype, seed=split + 1)
    bias = randn(n, dtype=dtype, seed=split + 2)
    _assert_matches(dense_gemv(x, w, bias, config=_config(path, split, prefetch)), x, w, bias)


@pytest.mark.parametrize("path", ["cuda", "dot"])
def test_split_k_is_deterministic_and_leaves_its_counters_zeroed(path):
    # The last program of each N tile adds the partials in split order, whatever order programs finished in,
    # and resets the tile's arrival counter: a second launch through the same counters gives the same bits.
    x = randn(3, 200, dtype=torch.float32, seed=5)
    w = randn(40, 200, dtype=torch.float32, seed=6)
    bias = randn(40, dtype=torch.float32, seed=7)
    first = dense_gemv(x, w, bias, config=_config(path, 3))
    again = dense_gemv(x, w, bias, config=_config(path, 3))
    assert torch.equal(first, again)
    assert _COUNTERS and all(int(locks.abs().sum()) == 0 for locks in _COUNTERS.values())
    _assert_matches(first, x, w, bias)
    unsplit = dense_gemv(x, w, bias, config=_config(path, 1))
    torch.testing.assert_close(first, unsplit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["auto", "cuda", "dot"])
def test_strided_x_and_out(path):
    # x is a column slice of a wider activation (row stride != K); out a column slice of a wider buffer.
    m, n, k = 4, 24, 70
    wide = randn(m, k + 9, dtype=torch.float16, seed=8)
    x = wide[:, 5 : 5 + k]
    w = randn(n, k, dtype=torch.float16, seed=9)
    buf = torch.full((m, n + 3), 7.0, dtype=torch.float16, device=DEVICE)
    out = buf[:, 1 : 1 + n]
    y = dense_gemv(x, w, out=out, config=_config(path, 2))
    assert y is out
    _assert_matches(buf[:, 1 : 1 + n], x, w)
    assert buf[:, 0].eq(7).all() and buf[:, 1 + n :].eq(7).all()  # nothing written outside out


def test_leading_dims_flatten_into_rows():
    x = randn(2, 3, 48, dtype=torch.bfloat16, seed=10)
    w = randn(20, 48, dtype=torch.bfloat16, seed=11)
    y = dense_gemv(x, w)
    assert y.shape == (2, 3, 20)
    _assert_matches(y, x, w)


def _assert_gated_matches(y, x, w, activation, bias=None):
    # Fused and unfused round the same fp32 sums (in another order) to x's dtype before the activation, so an
    # output may differ by a rounding step of gate, of up and of the product.
    expected = gated_dense_gemv_ref(x, w, activation, bias)
    tol = TOLERANCES[x.dtype]
    torch.testing.assert_close(
        y.float(), expected.float(), atol=tol["atol"] * math.sqrt(x.shape[-1]), rtol=3 * tol["rtol"]
    )


@given(
    seed=seeds(),
    m=st.integers(1, MAX_GEMV_ROWS),
    inter=st.integers(1, 150),
    k=st.integers(1, 300),
    dtype=dtypes,
    has_bias=st.booleans(),
    path=st.sampled_from(list(PATHS)),
    prefetch=st.booleans(),
    activation=st.sampled_from(GATED_ACTIVATIONS),
)
@example(seed=5, m=1, inter=37, k=300, dtype=torch.bfloat16, has_bias=False, path="cuda", prefetch=True,
         activation="silu")  # fmt: skip
@example(seed=6, m=16, inter=150, k=77, dtype=torch.float16, has_bias=True, path="dot", prefetch=False,
         activation="gelu_tanh")  # fmt: skip
def test_gated_gemv_matches_projection_then_activation(seed, m, inter, k, dtype, has_bias, path, prefetch,
                                                       activation):  # fmt: skip
    x = randn(m, k, dtype=dtype, seed=seed)
    w = randn(2 * inter, k, dtype=dtype, seed=seed + 1, scale=2 / math.sqrt(k))  # gates of either sign, |g| ~ 2
    bias = randn(2 * inter, dtype=dtype, seed=seed + 2) if has_bias else None
    # A split config is refused nothing: the gated launch never splits K.
    y = dense_gemv(x, w, bias, config=_config(path, 3, prefetch), activation=activation)
    assert y.dtype == dtype and y.shape == (m, inter)
    _assert_gated_matches(y, x, w, activation, bias)


def test_gated_gemv_pairs_each_output_with_its_own_rows():
    # Outputs past the first program's tile, a last partial tile, and a strided, wider out buffer: every output j
    # must combine gate row j with up row I + j, and nothing outside out may be written.
    m, inter, k = 2, 21, 64
    x = randn(m, k, dtype=torch.float32, seed=30)
    w = randn(2 * inter, k, dtype=torch.float32, seed=31, scale=0.25)
    buf = torch.full((m, inter + 2), 7.0, dtype=torch.float32, device=DEVICE)
    out = buf[:, 1 : 1 + inter]
    dense_gemv(x, w, out=out, config=GemvConfig(4, 32, 1, 4, 1, False), activation="silu")
    _assert_gated_matches(out, x, w, "silu")
    assert buf[:, 0].eq(7).all() and buf[:, -1].eq(7).all()
    swapped = torch.cat([w[inter:], w[:inter]])  # up and gate exchanged: a different function of x
    assert not torch.allclose(out, gated_dense_gemv_ref(x, swapped, "silu"), atol=1e-3)


def _z(*shape, dtype=torch.float16):
    return torch.ones(shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((_z(17, 8), _z(4, 8)), {}, "use F.linear"),
        ((_z(0, 8), _z(4, 8)), {}, "1 to 16 rows"),
        ((_z(2, 8), _z(4, 8, dtype=torch.bfloat16)), {}, "share one dtype"),
        ((_z(2, 8), _z(4, 8), _z(4, dtype=torch.float32)), {}, "share one dtype"),
        ((_z(2, 8, dtype=torch.int32), _z(4, 8, dtype=torch.int32)), {}, "float16, bfloat16 or float32"),
        ((_z(2, 8), _z(4, 9)), {}, "match weight"),
        ((_z(8), _z(4, 8)), {}, "match weight"),
        ((_z(2, 8), _z(4, 8, 1)), {}, r"weight must be \[N, K\]"),
        ((_z(2, 8), _z(4, 8), _z(5)), {}, "bias must be"),
        ((_z(2, 16)[:, ::2], _z(4, 8)), {}, "contiguous last dim"),
        ((_z(2, 8), _z(8, 4).T), {}, "contiguous last dim"),
        ((_z(3, 2, 8).transpose(0, 1), _z(4, 8)), {}, "without a copy"),
        ((_z(2, 8), _z(4, 8)), {"out": _z(2, 5)}, "out must be"),
        ((_z(2, 8), _z(4, 8)), {"out": _z(2, 4, dtype=torch.float32)}, "out must be"),
        ((_z(2, 8), _z(4, 8)), {"config": GemvConfig(48, 32, 1, 4, 1, False)}, "block_n must be a positive power"),
        ((_z(2, 8), _z(4, 8)), {"config": GemvConfig(16, 32, 1, 3, 1, False)}, "num_warps"),
        ((_z(2, 8), _z(4, 8)), {"config": GemvConfig(16, 32, 0, 4, 1, False)}, "split_k must be"),
        ((_z(2, 8), _z(4, 8)), {"config": GemvConfig(16, 32, 1, 4, 0, False)}, "num_stages must be"),
        ((_z(2, 8), _z(4, 8)), {"config": GemvConfig(8, 32, 1, 4, 1, True)}, ">= 16"),
        ((_z(2, 8), _z(4, 8)), {"config": GemvConfig(1024, 2048, 1, 4, 1, False)}, "exceeds"),
        ((_z(2, 8), _z(4, 8)), {"config": (16, 32, 1, 4, 1, False)}, "must be a GemvConfig"),
        ((_z(2, 8), _z(4, 8)), {"activation": "relu"}, "activation must be None or one of silu, gelu_tanh"),
        ((_z(2, 8), _z(5, 8)), {"activation": "silu"}, "an even N"),
        ((_z(2, 8), _z(4, 8)), {"activation": "silu", "out": _z(2, 4)}, "out must be"),
        ((_z(2, 8), _z(4, 8)), {"activation": "silu", "config": GemvConfig(1, 32, 1, 4, 1, False)}, "block_n >= 2"),
    ],
)
def test_bad_inputs_are_refused(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dense_gemv(*args, **kwargs)


SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_hopper_launch_heuristics(dtype):
    sms = 132  # H200
    for m in range(1, MAX_GEMV_ROWS + 1):
        for k, n in (*SHAPES.values(), (4096, 128256), (300, 7)):
            cfg = gemv_config(m, n, k, dtype, sms, interpret=False)
            check_gemv_config(cfg, m)
            assert cfg.use_dot == (m > 1)
            if (k, n) in SHAPES.values():
                # Every SM gets work, and each row's slice of a weight tile is 256 B to 4 KB of contiguous loads.
                assert -(-n // cfg.block_n) * cfg.split_k >= sms
                assert 256 <= cfg.block_k * dtype.itemsize <= 4096
            if not cfg.use_dot:
                assert cfg.block_k >= k_span(dtype, cfg.num_warps)  # register-resident accumulator


def test_interpreter_launch_is_few_large_programs():
    for m, n, k in ((1, 300, 300), (16, 7, 1), (9, 4096, 4096)):
        cfg = gemv_config(m, n, k, torch.float16, 1, interpret=True)
        check_gemv_config(cfg, m)
        assert cfg.split_k == 1 and cfg.block_n >= min(n, 64) and cfg.block_k >= min(k, 512)


@pytest.mark.parametrize(
    ("rows", "device", "dtype", "interpret", "expected"),
    [
        (1, "cuda", torch.bfloat16, False, True),
        (8, "cuda", torch.float16, False, True),
        (9, "cuda", torch.bfloat16, False, False),
        (0, "cuda", torch.bfloat16, False, False),
        (1, "cuda", torch.float32, False, False),
        (1, "cpu", torch.bfloat16, False, False),
        (1, "cpu", torch.bfloat16, True, False),
        (1, "cuda", torch.bfloat16, True, False),
    ],
)
def test_dispatch_rule(rows, device, dtype, interpret, expected, monkeypatch):
    monkeypatch.setattr(dense_gemv_config, "dependent_launch", lambda device: {"PDL": True})
    assert use_dense_gemv(rows, torch.device(device), dtype, interpret, max_rows=8) is expected
    # The default limit (DENSE_GEMV_MAX_ROWS) is what linear layers use; 0 keeps them on F.linear.
    default = use_dense_gemv(rows, torch.device(device), dtype, interpret)
    assert default is (expected and rows <= DENSE_GEMV_MAX_ROWS)
    # Without dependent launch (GPUs before Hopper, TRITONLLM_PDL=0) linear layers keep cuBLAS.
    monkeypatch.setattr(dense_gemv_config, "dependent_launch", lambda device: {"PDL": False})
    assert not use_dense_gemv(rows, torch.device(device), dtype, interpret, max_rows=8)


def test_dispatch_rule_weight_limit(monkeypatch):
    # DENSE_GEMV_MAX_WEIGHT keeps weights above it on F.linear; None lets every size through.
    cuda = torch.device("cuda")
    monkeypatch.setattr(dense_gemv_config, "dependent_launch", lambda device: {"PDL": True})
    monkeypatch.setattr(dense_gemv_config, "DENSE_GEMV_MAX_WEIGHT", 4096 * 6144)
    assert use_dense_gemv(1, cuda, torch.bfloat16, False, max_rows=1, weight_numel=4096 * 6144)
    assert not use_dense_gemv(1, cuda, torch.bfloat16, False, max_rows=1, weight_numel=4096 * 6144 + 1)
    monkeypatch.setattr(dense_gemv_config, "DENSE_GEMV_MAX_WEIGHT", None)
    assert use_dense_gemv(1, cuda, torch.bfloat16, False, max_rows=1, weight_numel=4096 * 128256)


def test_gated_dispatch_rule_has_its_own_weight_limit(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(dense_gemv_config, "dependent_launch", lambda device: {"PDL": True})
    monkeypatch.setattr(dense_gemv_config, "DENSE_GEMV_MAX_WEIGHT", 100)
    monkeypatch.setattr(dense_gemv_config, "GATED_GEMV_MAX_WEIGHT", None)
    assert use_gated_gemv(1, cuda, torch.bfloat16, False, max_rows=1, weight_numel=4096 * 28672)
    assert not use_dense_gemv(1, cuda, torch.bfloat16, False, max_rows=1, weight_numel=4096 * 28672)
    assert not use_gated_gemv(2, cuda, torch.bfloat16, False, max_rows=1, weight_numel=64)
    assert not use_gated_gemv(1, cuda, torch.bfloat16, True, max_rows=1, weight_numel=64)  # interpreter
    monkeypatch.setattr(dense_gemv_config, "GATED_GEMV_MAX_WEIGHT", 0)  # off
    assert not use_gated_gemv(1, cuda, torch.bfloat16, False, max_rows=1, weight_numel=64)
    monkeypatch.setattr(dense_gemv_config, "GATED_GEMV_MAX_WEIGHT", None)
    monkeypatch.setattr(dense_gemv_config, "dependent_launch", lambda device: {"PDL": False})
    assert not use_gated_gemv(1, cuda, torch.bfloat16, False, max_rows=1, weight_numel=64)


def test_gated_linear_fuses_where_the_rule_allows(monkeypatch):
    w = randn(2 * 24, 40, dtype=torch.float16, seed=19, scale=0.3)
    bias = randn(2 * 24, dtype=torch.float16, seed=20)
    x = randn(1, 1, 40, dtype=torch.float16, seed=21)
    monkeypatch.setattr(linear_module, "use_gated_gemv", lambda rows, device, dtype, weight_numel: False)
    assert linear_module.gated_linear(x, w, "silu", bias) is None  # the caller runs the projection, then the act
    monkeypatch.setattr(linear_module, "use_gated_gemv", lambda rows, device, dtype, weight_numel: rows == 1)
    y = linear_module.gated_linear(x, w, "silu", bias)
    assert y.shape == (1, 1, 24)
    _assert_gated_matches(y.view(1, 24), x.view(1, 40), w, "silu", bias)
    assert linear_module.gated_linear(randn(2, 40, dtype=torch.float16, seed=22), w, "silu", bias) is None
    assert linear_module.gated_linear(x, w.float(), "silu") is None  # mismatched dtypes: left to F.linear


def test_linear_on_cpu_is_f_linear():
    x = randn(2, 3, 40, dtype=torch.float32, seed=12)
    w = randn(24, 40, dtype=torch.float32, seed=13)
    bias = randn(24, dtype=torch.float32, seed=14)
    assert torch.equal(linear_module.linear(x, w, bias), F.linear(x, w, bias))


def test_linear_routes_few_rows_through_the_kernel(monkeypatch):
    # With the rule forced on, `linear` flattens leading dims into rows, calls the kernel and restores the shape.
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return dense_gemv(*args, **kwargs)

    monkeypatch.setattr(linear_module, "use_dense_gemv", lambda rows, device, dtype, weight_numel: rows <= 4)
    monkeypatch.setattr(linear_module, "dense_gemv", spy)
    w = randn(24, 40, dtype=torch.float16, seed=15)
    bias = randn(24, dtype=torch.float16, seed=16)
    x = randn(2, 2, 40, dtype=torch.float16, seed=17)
    y = linear_module.linear(x, w, bias)
    assert calls == [(4, 40)] and y.shape == (2, 2, 24)
    _assert_matches(y, x, w, bias)
    linear_module.linear(randn(5, 40, dtype=torch.float16, seed=18), w, bias)  # 5 rows: F.linear
    with pytest.raises(RuntimeError):  # mismatched dtypes: F.linear's own error, not the kernel's
        linear_module.linear(x, w.float())
    assert len(calls) == 1
