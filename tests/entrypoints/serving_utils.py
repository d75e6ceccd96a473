"""A tiny random Llama checkpoint with a chat-template tokenizer, and a real server process around it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from tests.runtime.tiny_tokenizer import build_tokenizer_dir

API_KEY = "test-key"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 128
NUM_BLOCKS = 64
BLOCK_SIZE = 16
# Engine options shared by the server and the in-process reference, so their greedy answers must agree.
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks", str(NUM_BLOCKS), "--max-num-seqs", "64"]
ENGINE_KWARGS = {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks": NUM_BLOCKS, "max_num_seqs": 64}

_SHAPE = {"hidden": 32, "intermediate": 64, "heads": 2, "kv_heads": 1, "head_dim": 16, "layers": 1}


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    """One-layer fp32 Llama with random weights (HF names, safetensors) + the tiny BPE tokenizer (vocab 420).

    Weights are large enough that logits have clear winners: greedy answers do not hinge on rounding.
    """
    build_tokenizer_dir(path)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    v = max(vocab.values()) + 1
    h, i, nh, nkv, hd = (_SHAPE[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": v,
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": _SHAPE["layers"],
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": MAX_MODEL_LEN,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {
        "model.embed_tokens.weight": randn(v, h),
        "lm_head.weight": randn(v, h, std=4 * h**-0.5),
        "model.norm.weight": 1 + randn(h, std=0.1),
    }
    for layer in range(_SHAPE["layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = 1 + randn(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + randn(h, std=0.1)
        w[p + "self_attn.q_proj.weight"] = randn(nh * hd, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = randn(nkv * hd, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = randn(nkv * hd, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = randn(h, nh * hd, std=(nh * hd) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = randn(i, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = randn(i, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = randn(h, i, std=i**-0.5)
    save_file({k: t.contiguous() for k, t in w.items()}, str(path / "model.safetensors"))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tritonllm serve ...` on 127.0.0.1 and a free port; stopped by `stop()`."""

    def __init__(self, model_dir: Path, extra_args: list[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tritonllm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tritonllm", "serve", str(model_dir), "--port", str(self.port)]
        cmd += ["--served-model-name", SERVED_NAME, "--log-level", "warning", *ENGINE_ARGS, *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ})

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not healthy after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics (parsed as Prometheus text) by name, label sets summed; samples with labels
    besides model_name also under "name{label=value,...}"."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            if labels:
                key = f"{sample.name}{{{labels}}}"
                values[key] = values.get(key, 0.0) + sample.value
    return values


def wait_for_idle_pool(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free again; returns the last values."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["tritonllm:num_requests_running"] == 0 and m["tritonllm:num_requests_waiting"] == 0
        if idle and m["tritonllm:kv_cache_free_blocks"] == m["tritonllm:kv_cache_total_blocks"]:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)
