"""The loader: fused shards land in their rows, sharded checkpoints, dtypes, every mismatch reported at once."""

import json

import pytest
import torch
from hypothesis import given, settings
from safetensors.torch import save_file

from tests.helpers import DEVICE, seeds
from tests.models.checkpoints import hf_model, tiny_config, write_checkpoint
from tests.models.paged_runner import PagedRunner
from tritonllm.models import registry
from tritonllm.models.llama import LlamaForCausalLM
from tritonllm.models.loader import load_model, resolve_dtype, resolve_model_path
from tritonllm.runtime.forward_context import set_forward_context


def _save(path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def _state_dict(config: dict, seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hf_model(config, seed).state_dict().items()}


@settings(max_examples=3)
@given(seed=seeds())
def test_sharded_checkpoint_fills_fused_rows(seed, tmp_path_factory):
    """q/k/v and gate/up (weights and Qwen2's q/k/v biases) land in their row ranges of the fused parameters."""
    config = tiny_config("Qwen2ForCausalLM")
    path = tmp_path_factory.mktemp("sharded")
    hf = write_checkpoint(config, path, seed, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 1
    model, cfg = load_model(str(path), device="cpu")
    ref = hf.state_dict()
    ours = dict(model.named_parameters())
    for i in range(cfg.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias"):
            fused = torch.cat([ref[f"{attn}.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")])
            assert torch.equal(ours[f"{attn}.qkv_proj.{kind}"], fused)
        assert torch.equal(
            ours[f"{mlp}.gate_up_proj.weight"],
            torch.cat([ref[f"{mlp}.gate_proj.weight"], ref[f"{mlp}.up_proj.weight"]]),
        )
    for name, p in ours.items():
        if name in ref:
            assert torch.equal(p, ref[name]), name


def test_tied_head_shares_the_embedding_and_skips_lm_head(tmp_path):
    config = tiny_config("LlamaForCausalLM", tie_word_embeddings=True)
    tensors = _state_dict(config, seed=1)
    tensors["lm_head.weight"] = torch.randn(config["vocab_size"], config["hidden_size"])  # redundant, ignored
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(8)  # recomputed, ignored
    _save(tmp_path, config, tensors)
    model, _ = load_model(str(tmp_path), device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_every_mismatch_is_reported_at_once(tmp_path):
    config = tiny_config("LlamaForCausalLM", tie_word_embeddings=False)
    tensors = _state_dict(config, seed=2)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(3, 3)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(97, 64)  # a shard of the fused gate_up_proj
    _save(tmp_path, config, tensors)
    with pytest.raises(ValueError) as e:
        load_model(str(tmp_path), device="cpu")
    msg = str(e.value)
    assert "missing (2)" in msg
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "model.norm.weight" in msg
    assert "unexpected (1): model.layers.0.self_attn.extra_proj.weight" in msg
    assert "mis-shaped (2)" in msg
    assert "model.layers.0.mlp.down_proj.weight (expected shape [64, 96], found [64, 95])" in msg
    assert "model.layers.1.mlp.up_proj.weight (expected shape [96, 64], found [97, 64])" in msg


def test_untied_head_without_lm_head_is_missing(tmp_path):
    config = tiny_config("MistralForCausalLM")
    tensors = _state_dict(config, seed=3)
    del tensors["lm_head.weight"]
    _save(tmp_path, config, tensors)
    with pytest.raises(ValueError, match=r"missing \(1\): lm_head.weight"):
        load_model(str(tmp_path), device="cpu")


def test_dtypes(tmp_path):
    config = tiny_config("Qwen3ForCausalLM", dtype="bfloat16")
    write_checkpoint(config, tmp_path, seed=4)
    (tmp_path / "config.json").write_text(json.dumps(config))  # keep the declared bfloat16
    model, cfg = load_model(str(tmp_path), device="cpu")
    assert cfg.torch_dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for dtype in ("float16", torch.float16, "torch.float16"):
        model, _ = load_model(str(tmp_path), dtype=dtype, device="cpu")
        assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert torch.get_default_dtype() == torch.float32  # the loader restores it
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        load_model(str(tmp_path), dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        resolve_dtype(torch.float64, cfg)


def test_half_precision_model_tracks_fp32(tmp_path):
    """The same checkpoint loaded as fp16 and as fp32 gives nearly the same logits (fp16 rounding only)."""
    config = tiny_config("LlamaForCausalLM")
    write_checkpoint(config, tmp_path, seed=5)
    tokens = torch.randint(0, config["vocab_size"], (6,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = {}
    for dtype in (torch.float32, torch.float16):
        model, _ = load_model(str(tmp_path), dtype=dtype, device=DEVICE)
        logits[dtype] = PagedRunner(model, seed=0).step([(0, tokens)])[0]
    assert logits[torch.float16].dtype == torch.float32
    torch.testing.assert_close(logits[torch.float16], logits[torch.float32], atol=1e-2, rtol=1e-2)


def test_dummy_weights_need_only_config_json(tmp_path):
    config = tiny_config("Qwen2ForCausalLM")
    (tmp_path / "config.json").write_text(json.dumps(config))
    a, _ = load_model(str(tmp_path), load_format="dummy", device="cpu")
    b, _ = load_model(str(tmp_path), load_format="dummy", device="cpu")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name  # reproducible
        assert pa.std() > 0 or "norm" in name
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        load_model(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tmp_path), load_format="pt", device="cpu")


def test_profiling_pass_without_cache(tmp_path):
    """No metadata (memory profiling): attention skips the cache and the model still returns [T, H]."""
    config = tiny_config("MistralForCausalLM")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, cfg = load_model(str(tmp_path), load_format="dummy", device=DEVICE)
    with torch.no_grad(), set_forward_context(None):
        hidden = model(torch.arange(5, device=DEVICE), torch.arange(5, device=DEVICE))
    assert hidden.shape == (5, cfg.hidden_size) and torch.isfinite(hidden).all()
    assert model.compute_logits(hidden).shape == (5, cfg.vocab_size)


def test_missing_paths_and_offline_hub_ids(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        resolve_model_path(str(tmp_path / "does-not-exist"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        load_model("tritonllm-tests/no-such-model-7f3a", device="cpu")
    assert "tritonllm-tests/no-such-model-7f3a" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)


class RenamedNormLlama(LlamaForCausalLM):
    """A checkpoint that names the final norm differently and carries a tensor the model does not use."""

    @staticmethod
    def map_weight_name(name: str) -> str | None:
        if name.endswith(".attn_scale"):
            return None
        return name.replace("model.final_layernorm.", "model.norm.")


def test_map_weight_name_hook(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_paths", dict(registry._paths))
    monkeypatch.setattr(registry, "_classes", dict(registry._classes))
    registry.register_model("RenamedNormLlama", RenamedNormLlama)
    config = tiny_config("LlamaForCausalLM")
    tensors = _state_dict(config, seed=6)
    tensors["model.final_layernorm.weight"] = tensors.pop("model.norm.weight")
    tensors["model.layers.0.attn_scale"] = torch.ones(1)
    _save(tmp_path, {**config, "architectures": ["RenamedNormLlama"]}, tensors)
    model, cfg = load_model(str(tmp_path), device="cpu")
    assert type(model) is RenamedNormLlama and cfg.architecture == "RenamedNormLlama"
    assert torch.equal(model.model.norm.weight, tensors["model.final_layernorm.weight"])
