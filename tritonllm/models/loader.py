"""Build a registered model from a Hugging Face checkpoint directory (or hub id) and load its safetensors weights.

Checkpoint names map onto the model's parameters by their last path components: "...self_attn.k_proj.<x>" loads
into "...self_attn.qkv_proj.<x>" as shard 1 of the fused layer (per the model's `packed_modules_mapping`), whatever
<x> is (weight, bias, qweight, scales, ...). Each parameter's `weight_loader` places the tensor.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from tritonllm.distributed.parallel_state import get_tp_rank
from tritonllm.models.config import ModelConfig
from tritonllm.models.layers.weights import default_weight_loader
from tritonllm.models.registry import model_class_for
from tritonllm.platform import default_device
from tritonllm.quant.base import QuantConfig
from tritonllm.quant.pack import pack_bits

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
}
# Rotary caches some checkpoints saved; we recompute them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# What a model needs from a hub repo: config and weights, plus tokenizer and chat-template files.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "*.jinja"]
_DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def load_model(
    model: str,
    dtype: str | torch.dtype = "auto",
    quantization: str | None = None,
    device: str | torch.device | None = None,
    revision: str | None = None,
    load_format: str = "auto",
) -> tuple[nn.Module, ModelConfig]:
    """(model in eval mode on `device`, its ModelConfig) for a local directory or hub id.

    dtype: "auto" (config.json's dtype / torch_dtype, float32 if absent), or float16 / bfloat16 / float32 as a
    string or torch dtype. load_format "dummy" skips the weight files and fills parameters with random values
    (only config.json is read), for benchmarks. In a tensor-parallel group of W > 1 ranks
    (tritonllm.distributed.init_tensor_parallel) the model is this rank's shard: every layer is built at its
    per-rank size and loads only its slice of each checkpoint tensor.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    path = resolve_model_path(model, revision)
    config = ModelConfig.from_file(path)
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device) if device is not None else default_device()
    _, model_cls = model_class_for(config.architectures)
    quant_config = _get_quant_config(config, path, quantization)

    with torch.device(device), _default_dtype(torch_dtype):
        net = model_cls(config, quant_config)
    net.to(device)  # buffers built on the CPU (rotary caches) follow the parameters
    if load_format == "dummy":
        init_dummy_weights(net)
    else:
        load_weights(net, path, iterate_safetensors(path), config.tie_word_embeddings)
    for module in net.modules():
        method = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    net.eval()
    return net, config


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose auto, float16, bfloat16 or float32")
        return dtype
    if dtype is None or dtype == "auto":
        name = config.torch_dtype or "float32"
        if name not in _DTYPES:
            raise ValueError(
                f"{config.source} declares dtype {name!r}, which tritonllm cannot run; "
                "pass dtype='float16', 'bfloat16' or 'float32'"
            )
        return _DTYPES[name]
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r} is not supported; choose auto, float16, bfloat16 or float32")


def resolve_model_path(model: str | os.PathLike, revision: str | None = None) -> str:
    """A local directory as it is; anything else is a hub id fetched (or found in the cache) by huggingface_hub."""
    model = os.fspath(model)
    if os.path.isdir(model):
        return model
    looks_local = model.startswith((".", "/", "~")) or os.path.exists(model) or model.count("/") > 1
    if looks_local:
        raise FileNotFoundError(f"model directory {model!r} does not exist; pass a directory holding config.json")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_OFFLINE

    offline = HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return snapshot_download(
            repo_id=model, revision=revision, allow_patterns=_HUB_PATTERNS, local_files_only=offline
        )
    except Exception as e:  # hub errors come in many types; all mean the same thing to the caller
        where = (
            "HF_HUB_OFFLINE is set and it is not in the local cache; download it first or unset HF_HUB_OFFLINE"
            if offline
            else "it is not a local directory and could not be fetched from the Hugging Face hub "
            "(check the id and revision, your network, and HF_TOKEN for gated repos; with HF_HUB_OFFLINE=1 only "
            "the local cache is used)"
        )
        rev = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(f"cannot find model {model!r}{rev}: {where} ({type(e).__name__}: {e})") from e


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's .safetensors files: those named in model.safetensors.index.json, or the one file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(absent)}")
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no .safetensors weights in {path}; tritonllm reads safetensors only (convert .bin checkpoints, "
            "or use load_format='dummy' for random weights)"
        )
    return files


def iterate_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(
    model: nn.Module,
    source: str,
    weights: Iterator[tuple[str, torch.Tensor]],
    tie_word_embeddings: bool = False,
) -> None:
    """Load (name, tensor) pairs in Hugging Face naming into `model`; raise one error listing every problem."""
    packed = getattr(model, "packed_modules_mapping", _DEFAULT_PACKED)
    shard_of = {shard: (fused, i) for fused, shards in packed.items() for i, shard in enumerate(shards)}
    # Optional hook for checkpoints whose names differ from the model's beyond the fused layers:
    # map_weight_name(hf_name) -> the name to load into (before fusing), or None to skip the tensor.
    rename = getattr(model, "map_weight_name", None)
    params = dict(model.named_parameters())
    loaded: dict[str, set[int | None]] = defaultdict(set)
    unexpected: list[str] = []
    mis_shaped: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tie_word_embeddings and name == "lm_head.weight"):
            continue
        target = rename(name) if rename is not None else name
        if target is None:
            continue
        parts = target.split(".")
        shard: int | None = None
        if len(parts) >= 2 and parts[-2] in shard_of:
            parts[-2], shard = shard_of[parts[-2]]
        param_name = ".".join(parts)
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        loaded[param_name].add(shard)  # present, even if it fails below: report it once, as mis-shaped
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            mis_shaped.append(f"{name} ({e})")

    missing = []
    for param_name, param in params.items():
        parts = param_name.split(".")
        shards = packed.get(parts[-2], None) if len(parts) >= 2 else None
        expected = range(len(shards)) if shards else [None]
        for s in expected:
            if s in loaded[param_name] or getattr(param, "load_optional", False):
                continue
            missing.append(".".join([*parts[:-2], shards[s], parts[-1]]) if shards else param_name)

    problems = []
    if missing:
        problems.append(f"missing ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        problems.append(f"unexpected ({len(unexpected)}): " + ", ".join(unexpected))
    if mis_shaped:
        problems.append(f"mis-shaped ({len(mis_shaped)}): " + "; ".join(mis_shaped))
    if problems:
        raise ValueError(f"checkpoint {source} does not match {type(model).__name__}:\n  " + "\n  ".join(problems))


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random parameters, reproducible from `seed`, that run like a trained model's would.

    Norm weights N(1, std); other float weights N(0, std). Quantized layers: qweight words uniform over all 32
    bits, so every packed field q is uniform on [0, 2^bits); zero fields drawn so that the zero the kernels read
    (z = field + zero_offset, GPTQ v1's offset being 1) is uniform on [offset, 2^bits - offset), whose mean is
    q's: the dequantized weights (q - z) * s are centred like the dense ones. An offset left uncorrected makes
    every weight's mean -s, a bias that each layer multiplies by K times the input's mean: the residual stream of
    a Llama-8B-shaped GPTQ model then overflows fp16 within a few layers. Scales positive, sized so that the
    dequantized weights have a standard deviation of about `std`; other integer tensors (GPTQ's g_idx) keep the
    values the layer was built with (regular groups). Under tensor parallelism each rank fills only its own shards
    (vocabulary padding rows stay zero).
    """
    # id(scales parameter) -> mean scale; id(qzeros parameter) -> (bits, zero offset).
    scale_of: dict[int, float] = {}
    zeros_of: dict[int, tuple[int, int]] = {}
    for module in model.modules():
        config = getattr(getattr(module, "linear_method", None), "config", None)
        bits = getattr(config, "bits", None)
        scales, qzeros = getattr(module, "scales", None), getattr(module, "qzeros", None)
        if bits is None or not isinstance(scales, nn.Parameter) or not isinstance(qzeros, nn.Parameter):
            continue
        offset = getattr(config, "zero_offset", 0)
        zero_values = 2**bits - 2 * offset
        # q uniform on 2^bits values, z on zero_values: Var(q - z) = Var(q) + Var(z), Var of n values (n^2 - 1) / 12.
        scale_of[id(scales)] = std / ((4**bits - 1 + zero_values**2 - 1) / 12) ** 0.5
        zeros_of[id(qzeros)] = (bits, offset)
    # Parameters every rank holds whole draw from one stream, the same on every rank (replicas must agree); a
    # tensor-parallel rank's own slices draw from a stream of its own, so ranks hold different shards.
    rank = get_tp_rank()
    generators: dict[tuple[torch.device, bool], torch.Generator] = {}
    for name, p in model.named_parameters():
        sharded = getattr(p, "tp_sharded", False)
        g = generators.get((p.device, sharded))
        if g is None:
            stream_seed = seed + 7919 * (rank + 1) if sharded else seed
            g = generators[(p.device, sharded)] = torch.Generator(device=p.device).manual_seed(stream_seed)
        leaf = name.rsplit(".", 1)[-1]
        if id(p) in scale_of:
            p.uniform_(0.5 * scale_of[id(p)], 1.5 * scale_of[id(p)], generator=g)
        elif p.is_floating_point():
            module_name = name.rsplit(".", 2)[-2] if "." in name else ""
            p.normal_(1.0 if "norm" in module_name else 0.0, std, generator=g)
        elif id(p) in zeros_of:
            bits, offset = zeros_of[id(p)]
            # Fields are independent, so packing along dim 1 suits every layout (AWQ's nibble order, GPTQ's stream).
            fields = p.shape[1] * 32 // bits
            values = torch.randint(0, 2**bits - 2 * offset, (p.shape[0], fields), generator=g, device=p.device)
            p.copy_(pack_bits(values, bits, dim=1))
        elif leaf in ("qweight", "qzeros"):
            p.random_(-(2**31), 2**31, generator=g)
    for module in model.modules():
        zero_padding = getattr(module, "zero_padding", None)  # vocabulary padding rows of a sharded embedding
        if zero_padding is not None:
            zero_padding()


def _get_quant_config(config: ModelConfig, path: str, quantization: str | None) -> QuantConfig | None:
    if importlib.util.find_spec("tritonllm.quant.config") is None:
        # Format detection (tritonllm.quant.config) is not part of this build: only dense checkpoints load.
        if quantization is not None or config.quantization_config:
            wanted = quantization or config.quantization_config.get("quant_method", "?")
            raise ValueError(
                f"{config.source} needs quantization {wanted!r} but tritonllm.quant.config is not available; "
                "use an unquantized checkpoint"
            )
        return None
    import tritonllm.quant as quant

    get_quant_config = getattr(quant, "get_quant_config", None)
    if get_quant_config is None:
        from tritonllm.quant.config import get_quant_config
    return get_quant_config(config.raw, path, quantization)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
