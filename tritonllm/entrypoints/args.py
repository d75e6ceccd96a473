"""Engine options shared by every command (serve, generate, bench), named and defaulted as in vLLM."""

from __future__ import annotations

import argparse
import re

from tritonllm.models.loader import LOAD_FORMATS
from tritonllm.runtime.engine_config import EngineConfig

DTYPES = ("auto", "float16", "bfloat16", "float32")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512MiB', '2GB', '1.5G' -> bytes (KiB/MiB/GiB are powers of 2, KB/MB/GB of 10)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write bytes (1073741824) or e.g. 512MiB, 4GiB")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if "i" in unit:
        scale = 1024 ** ("kmgt".index(unit[0]) + 1)
    else:
        scale = _UNITS[unit[:1]]
    return int(number * scale)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_arg(parser: argparse.ArgumentParser, positional: bool) -> None:
    """MODEL as an optional positional (serve, bench) and/or --model (every command)."""
    where = "a local checkpoint directory or a Hugging Face hub id; default: the built-in default model"
    if positional:
        parser.add_argument("model_positional", nargs="?", metavar="MODEL", help=f"Model to load: {where}.")
    parser.add_argument(
        "--model", default=None, help=f"Model to load ({where})." + (" Same as MODEL." if positional else "")
    )


def resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    positional = getattr(args, "model_positional", None)
    if positional is not None and args.model is not None and positional != args.model:
        parser.error(f"the model is given twice, as MODEL ({positional!r}) and --model ({args.model!r}); give one")
    return positional if positional is not None else args.model


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine options")
    g.add_argument("--tokenizer", default=None, help="Tokenizer directory or hub id (default: the model's).")
    g.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of the model.")
    g.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="Weights and activations dtype; auto = the checkpoint's."
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="Quantization method (awq or gptq); by default read from the checkpoint, which it must agree with.",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="auto/safetensors read the weights; dummy fills random weights from config.json (benchmarks).",
    )
    g.add_argument(
        "--device",
        default=None,
        help="cuda, cuda:1, cpu, ... (default: cuda if available, else cpu + Triton's interpreter).",
    )
    g.add_argument(
        "--max-model-len", type=_positive_int, default=None, help="Context length (default: the model's maximum)."
    )
    g.add_argument("--block-size", type=_positive_int, default=16, help="Tokens per KV-cache block (power of two).")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="Fraction of GPU memory the engine may use; the KV cache gets what the model leaves (default 0.9).",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV-cache size in bytes or with a unit (4GiB, 512MiB), on any device; overrides --gpu-memory-utilization.",
    )
    g.add_argument(
        "--num-gpu-blocks",
        type=_positive_int,
        default=None,
        help="Number of KV-cache blocks; overrides both memory budgets.",
    )
    g.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=None,
        help="Most sequences in one batch (default: 1024 on GPUs of 70 GiB or more, else 256).",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=None,
        help="Token budget of one step; longer prompts are prefilled in chunks (default: 16384 offline / 8192 "
        "when serving on GPUs of 70 GiB or more, else 8192).",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse the KV cache of shared prompt prefixes (on by default).",
    )
    g.add_argument("--seed", type=int, default=0, help="Seed of the engine's sampling (requests without a seed).")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Run decode steps eagerly instead of replaying CUDA graphs captured at start.",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Launch the next step before the current one's tokens reach the host, overlapping host work "
        "with the GPU's (on by default; one rank only). Outputs are the same either way.",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_positive_int,
        default=1,
        help="Ranks (GPUs) to shard the model over, one worker process each (default 1). Under torchrun it must "
        "equal WORLD_SIZE. See docs/distributed.md.",
    )


def engine_config_from_args(args: argparse.Namespace, model: str, serving: bool = False) -> EngineConfig:
    """An EngineConfig from parsed options; ValueError (with the reason) for a combination it rejects."""
    return EngineConfig(
        model=model,
        serving=serving,
        tokenizer=args.tokenizer,
        revision=args.revision,
        dtype=args.dtype,
        quantization=args.quantization,
        load_format=args.load_format,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
    )
