"""Pieces the benchmarks share: timing, the copy bandwidth they are measured against, environment facts, and
writing results as JSON + markdown. Imported by the scripts in this directory (run them from anywhere)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

import tritonllm  # noqa: F401  (sets TRITON_INTERPRET before triton is used without a GPU)
from tritonllm.kernels import dense_gemv_config
from tritonllm.kernels.dependent_launch import dependent_launch
from tritonllm.platform import default_device

T = TypeVar("T")


def bench_device(name: str | None = None) -> torch.device:
    return torch.device(name) if name else default_device()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call. On a GPU: triton's do_bench (CUDA events, L2 flushed between calls, so
    every call reads its inputs from HBM); elsewhere a wall-clock loop."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


STREAM_BYTES = 512 << 20  # weights one timed graph streams through: ~10x the H200's L2
_STREAM_REPS = 15


def stream_copies(item: T) -> list[T]:
    """`item` (a tensor or a tuple of tensors) and clones of it, together at least STREAM_BYTES: more than L2
    holds, so each call in `stream_us` reads its weights from HBM."""
    tensors = item if isinstance(item, tuple) else (item,)
    if tensors[0].device.type != "cuda":  # stream_us times one call there
        return [item]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    count = max(2, -(-STREAM_BYTES // nbytes))
    clones = [tuple(t.clone() for t in tensors) if isinstance(item, tuple) else item.clone() for _ in range(count - 1)]
    return [item, *clones]


def stream_us(call: Callable[[T], object], weights: list[T], device: torch.device) -> float:
    """Microseconds per call when consecutive calls read different weights, as a step's layers do: one CUDA graph
    calls `call(w)` for each of `weights`, replayed back to back, no flush (a flush leaves L2 full of dirty lines
    that the next kernel's reads must first write back, which no layer pays) and no host time between calls.
    Elsewhere: time_ms."""
    if device.type != "cuda":
        return time_ms(lambda: call(weights[0]), device, warmup_ms=1, rep_ms=20) * 1e3
    for w in weights[:2]:
        call(w)  # compile, allocate split-K counters
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(_STREAM_REPS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2**30) -> float:
    """Device memory bandwidth as a large copy achieves it: (bytes read + bytes written) / time, in GB/s.
    The roofline every benchmark here compares against, measured in the same run on the same device."""
    if device.type != "cuda":
        nbytes = min(nbytes, 2**26)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup_ms=50, rep_ms=300)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def fixed_and_rate(nbytes: Sequence[float], us: Sequence[float]) -> tuple[float, float]:
    """Least squares of us = fixed + nbytes / rate over launches of one kind at several sizes: (fixed us, rate in
    GB/s). `fixed` is what a launch pays whatever it reads (the launch, dependent round trips, the tail), the rate
    is how fast it streams once running; a target in % of copy bandwidth at some size needs both."""
    if len(nbytes) != len(us) or len(set(nbytes)) < 2:
        raise ValueError(f"a fit needs times at two or more distinct sizes, got sizes {list(nbytes)}")
    mean_b, mean_t = sum(nbytes) / len(nbytes), sum(us) / len(us)
    sxx = sum((b - mean_b) ** 2 for b in nbytes)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(nbytes, us, strict=True)) / sxx  # us per byte
    if slope <= 0:  # times that do not grow with the size: all of it fixed
        return mean_t, math.inf
    return mean_t - slope * mean_b, 1e-3 / slope


def add_kernel_override_args(p: argparse.ArgumentParser) -> None:
    """Flags that override kernel choices for A/B runs: when linear layers take the dense GEMV and its gated
    launch (tritonllm/kernels/dense_gemv_config.py)."""
    p.add_argument(
        "--dense-gemv-max-rows", type=int, default=None, help="Override DENSE_GEMV_MAX_ROWS (0: F.linear always)."
    )
    p.add_argument(
        "--dense-gemv-max-weight",
        type=int,
        default=None,
        help="Override DENSE_GEMV_MAX_WEIGHT: the GEMV only for weights of at most this many elements (-1: any).",
    )
    p.add_argument(
        "--gated-gemv-max-weight",
        type=int,
        default=None,
        help="Override GATED_GEMV_MAX_WEIGHT: gate_up + activation fused for weights up to this size (0: never, "
        "-1: any).",
    )


def apply_kernel_override_args(args: argparse.Namespace) -> None:
    if args.dense_gemv_max_rows is not None:
        dense_gemv_config.DENSE_GEMV_MAX_ROWS = args.dense_gemv_max_rows
    if args.dense_gemv_max_weight is not None:
        dense_gemv_config.DENSE_GEMV_MAX_WEIGHT = None if args.dense_gemv_max_weight < 0 else args.dense_gemv_max_weight
    if args.gated_gemv_max_weight is not None:
        dense_gemv_config.GATED_GEMV_MAX_WEIGHT = None if args.gated_gemv_max_weight < 0 else args.gated_gemv_max_weight


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        # kernels launched before their predecessor finishes (tritonllm/kernels/dependent_launch.py)
        "dependent_launch": bool(dependent_launch(device).get("launch_pdl")),
        "dense_gemv": {
            "max_rows": dense_gemv_config.DENSE_GEMV_MAX_ROWS,
            "max_weight": dense_gemv_config.DENSE_GEMV_MAX_WEIGHT,
            "gated_max_weight": dense_gemv_config.GATED_GEMV_MAX_WEIGHT,
        },
    }
    try:
        root = Path(__file__).resolve().parent.parent
        top, commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if Path(top).resolve() == root:  # not an exported tree inside some other checkout
            info["commit"] = commit
    except (OSError, ValueError, subprocess.CalledProcessError):
        pass
    return info


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out_dir: str | os.PathLike, name: str, results: dict[str, Any], markdown: str) -> None:
    """<out_dir>/<name>.json and <out_dir>/<name>.md; the markdown is printed too."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown + "\n")
    print(markdown, flush=True)
    print(f"\nwrote {out / (name + '.json')} and {out / (name + '.md')}", flush=True)


@contextlib.contextmanager
def kernel_compiles() -> Iterator[list[dict[str, Any]]]:
    """The kernel variants Triton meets for the first time in this process inside the block (compiled, or loaded
    from its disk cache), each with the seconds it took: what a warm-up left for the timed run. Stays empty under
    the interpreter, which compiles nothing."""
    import triton

    found: list[dict[str, Any]] = []
    compiling: dict[str, tuple[float, dict[str, Any]]] = {}  # key -> (start, its entry in found)
    hooks = (triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook)

    def before(*, key, repr, compile, **_: Any) -> None:
        entry = {
            "kernel": repr.split("[", 1)[0],
            "variant": _describe_variant(repr, compile, str(key)),
            "key": str(key),  # Triton's own: every argument's type and specialization, then the options
            "seconds": None,
        }
        found.append(entry)
        compiling[str(key)] = (time.perf_counter(), entry)

    def after(*, key, **_: Any) -> None:
        if str(key) in compiling:
            start, entry = compiling.pop(str(key))
            entry["seconds"] = time.perf_counter() - start

    triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = before, after
    try:
        yield found
    finally:
        triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = hooks


# An argument in the specialization list opening Triton's cache key: ('*bf16', 'D'), ('i32', None), ('constexpr', 4).
_KEY_ARGUMENT = re.compile(r"\('([^']*)', ('[^']*'|[^()]*?)\)")


def _describe_variant(repr: str, compile: dict[str, Any], key: str) -> str:
    """name[launch options] plus what tells variants of one kernel apart, read from Triton's cache key: the constexpr
    values (integer arguments equal to 1 among them), the integer arguments specialized as multiples of 16 and the
    pointers that are not 16-byte aligned. The bare repr where the key does not parse."""
    names = list(compile.get("signature", {}))
    arguments = _KEY_ARGUMENT.findall(key.rsplit("]{", 1)[0])
    if len(arguments) != len(names):
        return repr
    described = list(zip(names, arguments, strict=True))
    constants = ", ".join(f"{n}={value.strip(chr(39))}" for n, (kind, value) in described if kind == "constexpr")
    divisible = ", ".join(n for n, (kind, value) in described if kind[:1] in "iu" and value == "'D'")
    unaligned = ", ".join(n for n, (kind, value) in described if kind.startswith("*") and value != "'D'")
    return (
        f"{repr.split('(', 1)[0]} constants({constants}) ints divisible by 16({divisible}) "
        f"pointers off 16-byte alignment({unaligned})"
    )


def compile_summary(found: list[dict[str, Any]]) -> dict[str, Any]:
    """Count, seconds and the variants per kernel of a `kernel_compiles` list."""
    per_kernel: dict[str, list[str]] = {}
    keys: dict[str, list[str]] = {}
    for entry in found:
        per_kernel.setdefault(entry["kernel"], []).append(entry["variant"])
        keys.setdefault(entry["kernel"], []).append(entry["key"])
    return {
        "variants": len(found),
        "seconds": sum(e["seconds"] or 0.0 for e in found),
        "per_kernel": dict(sorted(per_kernel.items(), key=lambda kv: -len(kv[1]))),
        "keys": keys,
    }


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
