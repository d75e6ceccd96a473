"""The `tritonllm` command: --help, generate (clean streamed text), bench (figures printed and written)."""

import json
import math
import subprocess
import sys

import pytest

from tests.entrypoints.serving_utils import ENGINE_ARGS
from tritonllm import SamplingParams
from tritonllm.entrypoints import bench
from tritonllm.entrypoints.cli import main


def test_help_explains_every_command(capsys):
    for argv in (["--help"], ["serve", "--help"], ["generate", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal width
    for option in (
        "--dtype",
        "--quantization",
        "--max-model-len",
        "--block-size",
        "--gpu-memory-utilization",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--no-enable-prefix-caching",
        "--kv-cache-memory",
        "--num-gpu-blocks",
        "--seed",
        "--device",
        "--load-format",
        "--tokenizer",
        "--tensor-parallel-size",
        "--host",
        "--port",
        "--served-model-name",
        "--api-key",
        "--max-tokens",
        "--temperature",
        "--num-prompts",
        "--input-len",
        "--output-len",
        "--json",
    ):
        assert option in text, option
    assert "PROMPT is the only positional argument" in text


def test_python_dash_m_runs_the_command():
    result = subprocess.run([sys.executable, "-m", "tritonllm", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "serve" in result.stdout and "generate" in result.stdout


def test_generate_streams_only_the_greedy_text(tiny_model_dir, reference_llm):
    prompt = "Hello, world!"
    want = reference_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    cmd = [sys.executable, "-m", "tritonllm", "generate", "--model", str(tiny_model_dir), prompt, "--max-tokens", "5"]
    result = subprocess.run(cmd + ENGINE_ARGS, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == want.outputs[0].text + "\n"
    assert result.stderr == ""  # no logs, no warnings, no progress bars


def test_generate_echo_and_stop_in_process(tiny_model_dir, reference_llm, capsys):
    prompt = [40, 41, 42]
    text = reference_llm.get_tokenizer().decode(prompt)
    free = reference_llm.generate(
        [text], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    stop = free.outputs[0].text[1:3] or "x"
    params = SamplingParams(temperature=0.0, max_tokens=6, stop=stop, ignore_eos=True)
    want = reference_llm.generate([text], params, use_tqdm=False)[0]
    capsys.readouterr()
    argv = ["generate", "--model", str(tiny_model_dir), "--echo", "--stop", stop, "--ignore-eos", "--max-tokens", "6"]
    assert main(argv + ENGINE_ARGS + ["--", text]) == 0  # "--": the prompt may start with "-"
    assert capsys.readouterr().out == text + want.outputs[0].text + "\n"


def test_bad_options_fail_with_a_clear_message(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "x", "-tp", "2", "--device", "cuda:1"]) == 1
    assert "choose the GPUs with CUDA_VISIBLE_DEVICES" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--tensor-parallel-size", "0"])
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dir), "x", "--block-size", "12"]) == 1
    assert "block_size must be a power of two" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "model-a", "--model", "model-b"])
    assert exit_info.value.code == 2
    assert "given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--kv-cache-memory", "lots"])
    assert "is not a size" in capsys.readouterr().err


def test_parse_bytes_units():
    from tritonllm.entrypoints.args import parse_bytes

    assert parse_bytes("1073741824") == 2**30
    assert parse_bytes("4GiB") == 4 * 2**30 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2k") == 2000
    assert parse_bytes("1.5GB") == 1_500_000_000


def test_bench_prints_and_writes_its_figures(tiny_model_dir, reference_llm, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", str(tiny_model_dir), "--num-prompts", "5", "--input-len", "6", "--output-len", "3"]
    argv += ["--num-warmup", "1", "--seed", "3", "--json", str(out), "--no-progress", *ENGINE_ARGS]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for figure in ("requests/s", "output tokens/s", "TTFT (ms)", "TPOT (ms)", "p50", "p90", "p99"):
        assert figure in printed, figure
    result = json.loads(out.read_text())
    # ignore_eos: every request generates exactly its drawn length.
    special = reference_llm.get_tokenizer().all_special_ids
    workload = bench.synthetic_workload(5, 6, 3, 0.5, 420, 3, excluded_ids=special)
    assert result["num_requests"] == 5
    assert result["output_tokens"] == sum(r.output_len for r in workload)
    assert result["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in workload)
    for key in ("ttft_ms", "tpot_ms"):
        s = result[key]
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"], key
    assert result["requests_per_s"] > 0 and result["output_tokens_per_s"] > 0
    assert result["settings"]["num_prompts"] == 5


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert bench.percentile(xs, 50) == 3.0
    assert bench.percentile(xs, 90) == pytest.approx(4.6)
    assert bench.percentile(xs, 0) == 1.0 and bench.percentile(xs, 100) == 5.0
    assert math.isnan(bench.percentile([], 50))
