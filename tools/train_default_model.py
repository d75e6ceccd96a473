"""Reproduce tritonllm's built-in default model: a small Llama trained on Python's standard library.

Two stages, each reproducible from --seed:

    python tools/train_default_model.py prepare --out build/default_model   # CPU: corpus split + BPE tokenizer
    python tools/train_default_model.py train --out build/default_model     # GPU: train, evaluate, save

`prepare` reads the standard library of the Python running it (every *.py file outside site-packages),
splits it by file (a file is held out when crc32 of its path relative to the stdlib root, mod 20, is 0;
about 5% of files), trains a byte-level BPE tokenizer on the training files and writes the token streams
(documents separated by <|endoftext|>) as uint16 arrays. `train` fits a LlamaForCausalLM (transformers,
used here for training only) with AdamW and a cosine schedule, reports held-out loss/perplexity, and
saves config.json + model.safetensors + tokenizer files in Hugging Face format.
"""

import argparse
import json
import math
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
HELD_OUT_MODULUS = 20
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self"]

# ~4.3M parameters: bf16 weights stay under 8 MB.
MODEL_CONFIG = dict(
    hidden_size=256,
    intermediate_size=448,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    hidden_act="silu",
)


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts)
    return root, files


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_MODULUS == 0


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def prepare(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root, files = stdlib_files()
    splits: dict[str, list[str]] = {"train": [], "heldout": []}
    for f in files:
        text = read_text(f)
        if text:
            rel = f.relative_to(root).as_posix()
            splits["heldout" if is_held_out(rel) else "train"].append(text)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(splits["train"], trainer=trainer)

    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "add_bos_token": True,
                "model_max_length": MODEL_CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    eot = tokenizer.token_to_id(EOT)
    stats = {"python": sysconfig.get_python_version(), "vocab_size": tokenizer.get_vocab_size()}
    for name, texts in splits.items():
        ids: list[int] = []
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            ids.append(eot)
            ids.extend(enc.ids)
        np.asarray(ids, dtype=np.uint16).tofile(out / f"{name}.bin")
        stats[f"{name}_files"] = len(texts)
        stats[f"{name}_tokens"] = len(ids)
    (out / "corpus.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats))


def train(out: Path, seed: int, minutes: float, batch_size: int, seq_len: int, lr: float) -> None:
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    device = "cuda"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = tokenizer.token_to_id(EOT)
    data = {
        s: torch.from_numpy(np.fromfile(out / f"{s}.bin", dtype=np.uint16).astype(np.int64))
        for s in ("train", "heldout")
    }
    data = {s: t.to(device) for s, t in data.items()}

    config = LlamaConfig(vocab_size=VOCAB_SIZE, bos_token_id=eot, eos_token_id=eot, **MODEL_CONFIG)
    model = LlamaForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    generator = torch.Generator(device=device).manual_seed(seed)

    def batch(split: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = data[split]
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), device=device, generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1, device=device)
        window = tokens[idx]
        return window[:, :-1], window[:, 1:]

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(split: str) -> float:
        # Non-overlapping windows over the whole split: a deterministic figure.
        model.eval()
        tokens = data[split]
        n = (tokens.numel() - 1) // seq_len
        total, count = 0.0, 0
        for i in range(0, n, batch_size):
            rows = torch.arange(i, min(n, i + batch_size), device=device)
            idx = rows[:, None] * seq_len + torch.arange(seq_len + 1, device=device)
            window = tokens[idx]
            total += loss_of(window[:, :-1], window[:, 1:]).item() * rows.numel()
            count += rows.numel()
        model.train()
        return total / count

    # Step count fixed from a short timed probe (after warm-up steps) so the schedule fits the time budget.
    probe_steps = 30
    for step in range(probe_steps + 5):
        if step == 5:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = batch("train", generator)
        loss_of(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    step_time = (time.perf_counter() - t0) / probe_steps
    total_steps = int(minutes * 60 / step_time)
    warmup = max(1, total_steps // 50)

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    eval_generator = torch.Generator(device=device).manual_seed(seed + 1)
    log = []
    t0 = time.perf_counter()
    for step in range(total_steps):
        scale = (
            (step + 1) / warmup
            if step < warmup
            else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total_steps - warmup)))
        )
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.02)
        x, y = batch("train", generator)
        loss = loss_of(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 1000 == 0 or step == total_steps - 1:
            with torch.no_grad():
                heldout_sample = sum(loss_of(*batch("heldout", eval_generator)).item() for _ in range(8)) / 8
            entry = {"step": step, "loss": loss.item(), "heldout_sample_loss": heldout_sample}
            log.append({**entry, "seconds": round(time.perf_counter() - t0, 1)})
            print(log[-1], flush=True)
    train_seconds = time.perf_counter() - t0

    train_loss, heldout_loss = evaluate("train"), evaluate("heldout")
    model.to(torch.bfloat16)
    model.eval()
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([[eot] + tokenizer.encode(prompt, add_special_tokens=False).ids], device=device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=eot, pad_token_id=eot)
        samples[prompt] = tokenizer.decode(gen[0, ids.shape[1] :].tolist())
    model.save_pretrained(out / "checkpoint", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / "checkpoint" / name).write_bytes((out / name).read_bytes())
    report = {
        "seed": seed,
        "parameters": n_params,
        "steps": total_steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens_seen": total_steps * batch_size * seq_len,
        "train_seconds": round(train_seconds, 1),
        "train_loss": round(train_loss, 4),
        "heldout_loss": round(heldout_loss, 4),
        "heldout_perplexity": round(math.exp(heldout_loss), 3),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "greedy_samples": samples,
        "log": log,
    }
    (out / "checkpoint" / "training_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "log"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["prepare", "train"])
    parser.add_argument("--out", type=Path, default=Path("build/default_model"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=3.0, help="training time budget")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    if args.stage == "prepare":
        prepare(args.out)
    else:
        train(args.out, args.seed, args.minutes, args.batch_size, args.seq_len, args.lr)


if __name__ == "__main__":
    main()
