"""Everything an engine is built from, with vLLM's names and defaults where they mean the same."""

from dataclasses import dataclass

# 80 GB-class GPUs and up. On an H200, 1000 chat-like requests (docs/benchmarks.md) ran at 11.7k output tok/s with
# 256 sequences and 8k tokens a step, 13.4k with 1024 and 16k.
LARGE_GPU_MEMORY = 70 * 2**30


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    model: str  # a local checkpoint directory or a Hugging Face hub id
    tokenizer: str | None = None  # defaults to the model's directory
    revision: str | None = None
    dtype: str = "auto"  # auto (the checkpoint's), float16, bfloat16, float32
    quantization: str | None = None  # None = as the checkpoint says; "awq" / "gptq" must agree with it
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    device: str | None = None  # default: cuda when available, else cpu through Triton's interpreter
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes for the KV cache, on any device
    num_gpu_blocks: int | None = None  # KV blocks, overriding both budgets above
    max_num_seqs: int | None = None  # default: by GPU memory (`batch_limits`)
    max_num_batched_tokens: int | None = None  # default: by GPU memory (`batch_limits`); longer prompts are chunked
    serving: bool = False  # an online server: smaller default steps, for inter-token latency
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs (decode steps run eagerly, as prefill steps always do)
    # Schedule and launch the next step before the current one's tokens reach the host, so host work overlaps
    # the GPU's (one rank only). Outputs are the same either way.
    async_scheduling: bool = True
    tensor_parallel_size: int = 1  # ranks the model is sharded over, one process (and GPU) each; docs/distributed.md

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (16 or 32 are typical), got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_model_len", "kv_cache_memory", "num_gpu_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None for the default), got {value}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (or None for the default), got {self.max_num_seqs}")

    def batch_limits(self, device_memory: int | None) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens): the values set, else defaults for a device of `device_memory`
        bytes (None: not a GPU). As vLLM's: GPUs of LARGE_GPU_MEMORY or more hold the KV of 1024 sequences of
        chat-like lengths many times over, and bigger steps keep their GEMMs busy. The token budget does not grow
        with max_model_len: a longer prompt is prefilled in chunks, and a 128k-token step would stall every decode
        of the batch for as long as it runs."""
        large = device_memory is not None and device_memory >= LARGE_GPU_MEMORY
        seqs = 1024 if large else 256
        tokens = (8192 if self.serving else 16384) if large else 8192
        return self.max_num_seqs or seqs, self.max_num_batched_tokens or tokens

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        if self.max_model_len is None:
            return max_position_embeddings
        if self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{max_position_embeddings}; lower max_model_len"
            )
        return self.max_model_len
