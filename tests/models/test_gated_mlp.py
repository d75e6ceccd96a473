"""The MLP's gate_up projection and activation fused into one GEMV launch where the rule allows it (decode rows on
a Hopper-class GPU), and the projection + activation kernel elsewhere: both give the same MLP output."""

import pytest
import torch

import tritonllm.models.layers.linear as linear_module
from tests.helpers import TOLERANCES, randn
from tests.models.checkpoints import tiny_config
from tritonllm.models.config import ModelConfig
from tritonllm.models.llama import LlamaMLP


def _mlp(hidden_act: str, mlp_bias: bool, dtype: torch.dtype) -> LlamaMLP:
    config = ModelConfig.from_dict(tiny_config("LlamaForCausalLM", hidden_act=hidden_act, mlp_bias=mlp_bias))
    mlp = LlamaMLP(config, None, "model.layers.0.mlp")
    for i, p in enumerate(mlp.parameters()):
        p.data = randn(*p.shape, dtype=dtype, seed=40 + i, scale=p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1)
    return mlp


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_fused_gate_up_matches_projection_then_activation(hidden_act, mlp_bias, monkeypatch):
    dtype = torch.float16
    mlp = _mlp(hidden_act, mlp_bias, dtype)
    x = randn(1, mlp.gate_up_proj.input_size, dtype=dtype, seed=50)
    calls = []
    launch = linear_module.dense_gemv

    def spy(*args, **kwargs):
        calls.append(kwargs.get("activation"))
        return launch(*args, **kwargs)

    monkeypatch.setattr(linear_module, "dense_gemv", spy)
    with torch.no_grad():
        monkeypatch.setattr(linear_module, "use_gated_gemv", lambda rows, device, dtype, weight_numel: False)
        unfused = mlp(x)
        assert "silu" not in calls and "gelu_tanh" not in calls
        monkeypatch.setattr(linear_module, "use_gated_gemv", lambda rows, device, dtype, weight_numel: rows == 1)
        calls.clear()
        fused = mlp(x)
        gated = [c for c in calls if c is not None]  # the down projection may take the plain GEMV (on a GPU)
        assert gated == [mlp.act_fn.kind]
        calls.clear()
        assert mlp(randn(3, x.shape[-1], dtype=dtype, seed=51)).shape == (3, x.shape[-1])  # 3 rows: unfused
        assert all(c is None for c in calls)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(fused, unfused, atol=4 * tol["atol"], rtol=4 * tol["rtol"])


def test_forward_gated_needs_two_equal_outputs():
    mlp = _mlp("silu", False, torch.float32)
    with pytest.raises(ValueError, match="two equal outputs"):
        mlp.down_proj.forward_gated(randn(1, mlp.down_proj.input_size, dtype=torch.float32, seed=52), "silu")
