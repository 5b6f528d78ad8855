"""Generation throughput with and without the KV cache, and the memory bandwidth the cached decode achieves.

For each batch size: one random prompt of --prompt-len tokens, then --new-tokens greedy tokens, with the cache
(prefill once, then one query per token against the cache) and without it (the whole context re-run per token).
Each cell is the median of --repeats timed runs after one warm-up run; timings are synchronised on CUDA.

    # H200: GPT-2 124M shapes, bf16 (auto on that GPU), 1024-token prompt (the run in docs/results/)
    python scripts/bench_generate.py --model gpt2 --prompt-len 1024 --new-tokens 256 --batch-sizes 1,16
    # CPU smoke test
    python scripts/bench_generate.py --model tiny --device cpu --dtype fp32 --prompt-len 32 --new-tokens 8 \
        --batch-sizes 1,2 --repeats 1 --out /tmp/bench_generate

Model: `--model gpt2` is GPT-2 124M (12 layers, 12 heads, 768 wide, vocabulary 50257 unpadded as from_pretrained)
with random weights, so no hub access is needed: throughput does not depend on the values. GPT-2's 1024 positions
cannot hold a 1024-token prompt plus new tokens without the window sliding (which re-runs the full window for every
token, i.e. no cache at all), so its block_size is prompt + new tokens (--block-size to choose); the extra position
rows cost nothing per decoded token.

Bandwidth: a decode step of a sequence reads the cached keys and values of every layer, 2 · n_layer · T_ctx ·
n_embd · bytes (T_ctx: the tokens in the cache at that step), averaged over the decode; plus the weights once per
step for the whole batch (every parameter except the position table: the tied embedding is read by the LM head).
Achieved bytes/s = bytes read during the decode / decode time, reported for the KV cache alone and for KV + weights,
against --peak-bw (the H200's ~4.3 TB/s copy bandwidth). At batch 1 the weights dominate and eager PyTorch's kernel
launches (~15 per layer) bound the step; larger batches read more cache per weight read.

Writes results.json and results.md to --out (default: a fresh outputs/bench/generation-<date>_<time>/; results worth
keeping go to docs/results/) and prints the table.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT, GPTConfig  # noqa: E402
from model.attention import BACKENDS  # noqa: E402
from model.generate import stream  # noqa: E402
from scripts.common import default_out, run_meta, write_report  # noqa: E402
from training.device import DTYPES, resolve_device, resolve_dtype  # noqa: E402

MODELS = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257),
          "tiny": dict(n_layer=2, n_head=2, n_embd=64, vocab_size=257)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    p.add_argument("--attention", default="sdpa", choices=list(BACKENDS),
                   help="triton: prefill and uncached steps on the kernel, cached decode steps on SDPA")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="default: prompt-len + new-tokens (no sliding)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--modes", default="cache,no-cache")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median), after one warm-up run")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: bf16 on a GPU that has it, else fp16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--peak-bw", type=float, default=4.3e12, help="bytes/s to compare with (H200 copy bandwidth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=default_out("generation"))
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model: GPT, prompt: torch.Tensor, new_tokens: int,
                   use_cache: bool) -> tuple[float, float, torch.Tensor]:
    """(seconds to the first token, seconds for the remaining new_tokens - 1, the tokens (B, new_tokens))."""
    device = prompt.device
    sync(device)
    start = time.perf_counter()
    tokens = stream(model, prompt, new_tokens, temperature=0.0, use_cache=use_cache)
    out = [next(tokens)]
    sync(device)
    first = time.perf_counter()
    out.extend(tokens)
    sync(device)
    return first - start, time.perf_counter() - first, torch.cat(out, dim=1)


def bench_cell(model: GPT, prompt: torch.Tensor, args: argparse.Namespace, use_cache: bool) -> dict[str, Any]:
    timed_generate(model, prompt, min(args.new_tokens, 8), use_cache)  # warm-up: kernels, allocator, autotuning
    runs = [timed_generate(model, prompt, args.new_tokens, use_cache) for _ in range(args.repeats)]
    ttft = statistics.median(r[0] for r in runs)
    decode_s = statistics.median(r[1] for r in runs)
    B, c, n = prompt.size(0), model.config, args.new_tokens
    elem = next(model.parameters()).element_size()
    cell: dict[str, Any] = {
        "mode": "cache" if use_cache else "no-cache", "batch_size": B, "ttft_s": ttft, "decode_s": decode_s,
        "tokens_per_sec": B * n / (ttft + decode_s),  # end to end, prefill included
        "decode_tokens_per_sec": B * (n - 1) / decode_s,  # the tokens after the first
        "ms_per_step": 1e3 * decode_s / (n - 1),
    }
    if use_cache:
        # Decode step i (i = 1 .. n-1) attends over prompt_len + i cached tokens, in every layer and sequence.
        contexts = [args.prompt_len + i for i in range(1, n)]
        kv_bytes_per_token = 2 * c.n_layer * statistics.fmean(contexts) * c.n_embd * elem  # one sequence, one step
        weight_bytes = (sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()) * elem
        kv_bw = B * kv_bytes_per_token * (n - 1) / decode_s
        total_bw = kv_bw + weight_bytes * (n - 1) / decode_s
        cell.update({"kv_bytes_per_token": kv_bytes_per_token, "weight_bytes_per_step": weight_bytes,
                     "kv_bytes_per_sec": kv_bw, "kv_frac_of_peak": kv_bw / args.peak_bw,
                     "total_bytes_per_sec": total_bw, "total_frac_of_peak": total_bw / args.peak_bw})
    cell["tokens"] = runs[0][2][0].tolist()  # the first sequence's greedy tokens, to compare the modes (not saved)
    return cell


def markdown(cells: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Generation with and without the KV cache: {meta['model']} ({meta['shapes']}), {meta['dtype']}, "
             f"attention={meta['attention']}",
             "",
             f"{meta['device']}, torch {meta['torch']}, {meta['date']}. Prompt {meta['prompt_len']} tokens, "
             f"{meta['new_tokens']} new greedy tokens, block_size {meta['block_size']}, median of {meta['repeats']}. "
             f"Peak bandwidth for the fractions: {meta['peak_bw'] / 1e12:.1f} TB/s.",
             "",
             "| batch | mode | tokens/s (end to end) | decode tokens/s | ms/step | time to first token ms | "
             "KV bytes/token | KV GB/s (% peak) | KV + weights GB/s (% peak) | tokens = cache's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        kv = (f"{c['kv_bytes_per_token'] / 1e6:.1f} MB", f"{c['kv_bytes_per_sec'] / 1e9:.0f} "
              f"({100 * c['kv_frac_of_peak']:.1f}%)", f"{c['total_bytes_per_sec'] / 1e9:.0f} "
              f"({100 * c['total_frac_of_peak']:.1f}%)") if c["mode"] == "cache" else ("–", "–", "–")
        lines.append(f"| {c['batch_size']} | {c['mode']} | {c['tokens_per_sec']:,.0f} | "
                     f"{c['decode_tokens_per_sec']:,.0f} | {c['ms_per_step']:.2f} | {1e3 * c['ttft_s']:.1f} | "
                     f"{' | '.join(kv)} | {c.get('matches_cache', '–')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device, key="--device")
    dtype = resolve_dtype(args.dtype, device, key="--dtype")
    block_size = args.block_size or args.prompt_len + args.new_tokens
    torch.manual_seed(args.seed)
    config = GPTConfig(**MODELS[args.model], block_size=block_size, pad_vocab_multiple=1, attention=args.attention)
    model = GPT(config).to(device=device, dtype=dtype).eval()

    cells = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        prompt = torch.randint(0, config.vocab_size, (B, args.prompt_len), device=device)
        for mode in args.modes.split(","):
            cell = bench_cell(model, prompt, args, use_cache=mode == "cache")
            cells.append(cell)
            print(f"B={B} {mode}: {cell['tokens_per_sec']:,.0f} tok/s end to end, "
                  f"{cell['decode_tokens_per_sec']:,.0f} tok/s decode", flush=True)
        batch = [c for c in cells if c["batch_size"] == B]
        cached = next((c["tokens"] for c in batch if c["mode"] == "cache"), None)
        for c in batch:
            tokens = c.pop("tokens")
            if cached is not None:
                # Leading greedy tokens equal to the cached run's (low precision can flip a near-tie later on).
                c["matches_cache"] = next((i for i, (a, b) in enumerate(zip(tokens, cached, strict=True)) if a != b),
                                          len(cached))

    meta = run_meta(device, model=args.model, shapes=", ".join(f"{k}={v}" for k, v in MODELS[args.model].items()),
                    attention=args.attention, dtype=str(dtype).removeprefix("torch."), prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens, block_size=block_size, repeats=args.repeats, peak_bw=args.peak_bw)
    results = {"meta": meta, "cells": cells}
    table = markdown(cells, meta)
    write_report(args.out, results, table)
    print(table)
    return results


if __name__ == "__main__":
    main()
