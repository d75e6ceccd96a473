"""The `tritonllm` command: serve, generate, bench.

    tritonllm serve [MODEL] [--host H] [--port P] [engine options]
    tritonllm generate [--model MODEL] PROMPT [sampling options] [engine options]
    tritonllm bench [MODEL] [--num-prompts N] [--input-len L] [--output-len L] [--json PATH] [engine options]

Without a model, each command runs the built-in default model. `generate` takes exactly one positional
argument, the prompt, so a prompt can never be mistaken for a model name: a model goes in --model.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from tritonllm.entrypoints.args import add_engine_args, add_model_arg, engine_config_from_args, resolve_model
from tritonllm.runtime.errors import EngineDeadError

DEFAULT_SERVED_NAME = "tritonllm-default"
EPILOG = "Without a model, the built-in default model is used (a small Llama trained on Python's stdlib)."


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling options")
    g.add_argument("--max-tokens", type=int, default=64, help="Most tokens to generate (64).")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default).")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass; 1 = off.")
    g.add_argument("--top-k", type=int, default=-1, help="Keep the k most likely tokens; -1 = off.")
    g.add_argument("--min-p", type=float, default=0.0, help="Drop tokens below min-p x the top probability; 0 = off.")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats; 1 = off.")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="In [-2, 2]; 0 = off.")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="In [-2, 2]; 0 = off.")
    g.add_argument("--min-tokens", type=int, default=0, help="No EOS before this many tokens.")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="Stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true", help="Keep generating past EOS, up to --max-tokens.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonllm", description="A pure-Triton LLM inference engine.", epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics).",
        epilog=EPILOG,
    )
    add_model_arg(serve, positional=True)
    s = serve.add_argument_group("server options")
    s.add_argument("--host", default="127.0.0.1", help="Address to listen on (127.0.0.1; 0.0.0.0 for all).")
    s.add_argument("--port", type=int, default=8000, help="Port to listen on (8000).")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Name(s) clients use in the 'model' field; the first is reported in responses "
        f"(default: MODEL as given, or {DEFAULT_SERVED_NAME!r}).",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("TRITONLLM_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1/* (default: $TRITONLLM_API_KEY, unset = open).",
    )
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(serve)

    gen = sub.add_parser(
        "generate",
        help="Generate a continuation of PROMPT and stream it to the terminal.",
        description="Generate a continuation of PROMPT (greedy by default) and stream the text to stdout as it is "
        "produced; nothing else is written to stdout. PROMPT is the only positional argument (a model goes in "
        "--model); '-' reads the prompt from stdin, and '--' before it allows a prompt starting with '-'.",
        epilog=EPILOG,
    )
    gen.add_argument("prompt", metavar="PROMPT", help="The text to continue ('-' = read from stdin).")
    add_model_arg(gen, positional=False)
    gen.add_argument("--echo", action="store_true", help="Print the prompt before the continuation.")
    gen.add_argument("--chat", action="store_true", help="Send PROMPT as a user message through the chat template.")
    _add_sampling_args(gen)
    add_engine_args(gen)

    bench = sub.add_parser(
        "bench",
        help="Measure offline throughput and latency on a synthetic workload.",
        description="Run a seeded synthetic workload of random token ids (mixed lengths, EOS ignored so lengths "
        "are exact) through one engine; print requests/s, output tokens/s, and TTFT / TPOT percentiles.",
        epilog=EPILOG,
    )
    add_model_arg(bench, positional=True)
    b = bench.add_argument_group("workload options")
    b.add_argument("--num-prompts", type=int, default=256, help="Requests in the workload (256).")
    b.add_argument("--input-len", type=int, default=256, help="Mean prompt length in tokens (256).")
    b.add_argument("--output-len", type=int, default=128, help="Mean output length in tokens (128).")
    b.add_argument("--range-ratio", type=float, default=0.5, help="Lengths are uniform in mean x [1 - r, 1 + r] (0.5).")
    b.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default inf: all requests at once).",
    )
    b.add_argument("--num-warmup", type=int, default=2, help="Short requests run before timing (2).")
    b.add_argument("--json", default=None, metavar="PATH", help="Also write the results as JSON to PATH.")
    b.add_argument("--no-progress", action="store_true", help="No progress bar.")
    add_engine_args(bench)
    return parser


def _engine(args: argparse.Namespace, parser: argparse.ArgumentParser, serving: bool = False):
    from tritonllm.entrypoints.llm import DEFAULT_MODEL
    from tritonllm.runtime.engine import LLMEngine

    model = resolve_model(args, parser)
    config = engine_config_from_args(args, model or DEFAULT_MODEL, serving)
    return LLMEngine(config), model


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from tritonllm.entrypoints.openai.server import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine, model = _engine(args, parser, serving=True)
    names = args.served_model_name or [model or DEFAULT_SERVED_NAME]
    run_server(engine, args.host, args.port, names, args.api_key, args.log_level)


def cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from tritonllm.sampling_params import SamplingParams

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    engine, _ = _engine(args, parser)
    try:
        _generate(engine, args, text, params)
    finally:
        engine.shutdown()


def _generate(engine, args: argparse.Namespace, text: str, params) -> None:
    prompt: str | dict = text
    if args.chat:
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompt = {"prompt": rendered, "prompt_token_ids": engine.tokenizer.encode(rendered, add_special_tokens=False)}
    engine.add_request(None, prompt, params)
    out = sys.stdout
    if args.echo:
        out.write(text)
        out.flush()
    shown = 0
    while engine.has_unfinished_requests():
        for result in engine.step():
            completion = result.outputs[0].text
            if len(completion) > shown:
                out.write(completion[shown:])
                out.flush()
                shown = len(completion)
    out.write("\n")
    out.flush()


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    engine, model = _engine(args, parser)
    try:
        _bench(engine, model, args)
    finally:
        engine.shutdown()


def _bench(engine, model: str | None, args: argparse.Namespace) -> None:
    from tritonllm.entrypoints import bench

    tokenizer = engine.tokenizer
    vocab = min(engine.model_config.vocab_size, tokenizer.vocab_size)
    workload = bench.synthetic_workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        vocab,
        args.seed,
        args.request_rate,
        excluded_ids=tokenizer.all_special_ids,
    )
    if args.num_warmup > 0:
        bench.warm_up(engine, workload, args.num_warmup)
    result = bench.run_bench(engine, workload, progress=not args.no_progress)
    print(bench.format_result(result), flush=True)
    if args.json:
        settings = {
            "model": model or DEFAULT_SERVED_NAME,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "seed": args.seed,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device),
            "num_gpu_blocks": engine.num_blocks,
            "tensor_parallel_size": engine.config.tensor_parallel_size,
        }
        bench.write_json(args.json, result, settings)


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        COMMANDS[args.command](args, parser)
    except (ValueError, FileNotFoundError, EngineDeadError) as e:
        print(f"tritonllm {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tritonllm generate ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
