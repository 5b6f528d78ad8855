"""Generation speed, ours against transformers' `generate`: time to first token, tokens/s, and the bandwidth the
decode reaches.

For each batch size: random prompts of --prompt-len tokens, then --new-tokens greedy tokens, by each method:

    eager       ours, static KV cache, every decode step run eagerly
    graph       ours, the decode step replayed as a CUDA graph (the default on a GPU)
    compile     ours, the decode step fused by torch.compile, then replayed as a CUDA graph
    no-cache    ours, the whole context re-run per token
    hf-static   transformers' generate with cache_implementation="static" (transformers compiles its step on a GPU)
    hf-dynamic  transformers' generate with its default (dynamic) cache

each of ours for every --attention backend (sdpa: masked SDPA decode; triton: our FlashAttention prefill and our
split-KV decode kernel). Both models hold the same random weights (ours saved with save_pretrained and loaded by
transformers), so the greedy tokens can be compared; the table gives how many leading tokens of the first sequence
equal hf-static's (bf16 may flip a near-tie late on). Each cell is the median of --repeats timed runs after a
warm-up run of the same call (compilation, autotuning and graph capture happen there, not in the timings).

    # H200: GPT-2 124M shapes, bf16 (auto on that GPU), 1024-token prompt, 256 new tokens (the run in docs/results/)
    python scripts/bench_generate.py --model gpt2 --prompt-len 1024 --new-tokens 256 --batch-sizes 1,16
    # CPU smoke test
    python scripts/bench_generate.py --model tiny --device cpu --dtype fp32 --prompt-len 32 --new-tokens 8 \
        --batch-sizes 1,2 --methods eager,no-cache,hf-dynamic --repeats 1 --out /tmp/bench_generate

Time to first token: ours, the first token the stream yields; transformers, a generate call of one new token. The
rest of the decode is the total minus that. Model: `--model gpt2` is GPT-2 124M (12 layers, 12 heads, 768 wide,
vocabulary 50257 unpadded as from_pretrained) with random weights, so no hub access is needed: speed does not depend
on the values; `--model smollm2-135m` has SmolLM2-135M's shapes (Llama family, 9 query / 3 key-value heads). The
block_size is prompt + new tokens (--block-size to choose): GPT-2's 1024 positions cannot hold a 1024-token prompt
plus new tokens without sliding, and the extra position rows cost nothing per token.

Bandwidth: a decode step of a sequence reads the cached keys and values of every layer, 2 · n_layer · T_ctx ·
n_kv_head · head_dim · bytes (T_ctx: the tokens in the cache at that step), averaged over the decode; plus the weights
once per step for the whole batch (every parameter except the position table). Reported as bytes read during the
decode over the decode time, against --peak-bw (the H200's 4.8 TB/s HBM3e).

Writes results.json and results.md to --out (default: a fresh outputs/bench/generation-<date>_<time>/; results worth
keeping go to docs/results/) and prints the table.
"""

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT, GPTConfig  # noqa: E402
from model.attention import BACKENDS  # noqa: E402
from model.generate import stream  # noqa: E402
from scripts.common import choice_list, default_out, fmt, run_meta, write_report  # noqa: E402
from training.device import DTYPES, resolve_device, resolve_dtype  # noqa: E402

MODELS = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257),
          "smollm2-135m": dict(family="llama", n_layer=30, n_head=9, n_kv_head=3, n_embd=576, intermediate_size=1536,
                               vocab_size=49152, bias=False, rope_theta=100000.0, norm_eps=1e-5),
          "tiny": dict(n_layer=2, n_head=2, n_embd=64, vocab_size=257)}
OURS = ("eager", "graph", "compile", "no-cache")
THEIRS = ("hf-static", "hf-dynamic")
Run = Callable[[torch.Tensor, int], tuple[float, float, torch.Tensor]]  # (prompt, new) -> (ttft s, total s, tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    p.add_argument("--attention", type=choice_list(BACKENDS), default=["sdpa", "triton"],
                   help="our backends, comma-separated")
    p.add_argument("--methods", type=choice_list(OURS + THEIRS), default=["eager", "graph", "compile", *THEIRS],
                   help="comma-separated: " + ", ".join(OURS + THEIRS))
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="default: prompt-len + new-tokens (no sliding)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median), after one warm-up run")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: bf16 on a GPU that has it, else fp16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--peak-bw", type=float, default=4.8e12, help="bytes/s to compare with (H200 HBM3e)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=default_out("generation"))
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ours(model: GPT, method: str) -> Run:
    def run(prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, torch.Tensor]:
        sync(prompt.device)
        start = time.perf_counter()
        tokens = stream(model, prompt, new_tokens, temperature=0.0, use_cache=method != "no-cache",
                        cuda_graph=method != "eager", compile=method == "compile")
        out = [next(tokens)]
        sync(prompt.device)
        first = time.perf_counter()
        out.extend(tokens)
        sync(prompt.device)
        return first - start, time.perf_counter() - start, torch.cat(out, dim=1)

    return run


def theirs(hf: Any, method: str) -> Run:
    cache = {"cache_implementation": "static"} if method == "hf-static" else {}

    def generate(prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
        sync(prompt.device)
        start = time.perf_counter()
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **cache)
        sync(prompt.device)
        return time.perf_counter() - start, out[:, prompt.size(1):]

    def run(prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, torch.Tensor]:
        ttft, _ = generate(prompt, 1)
        total, tokens = generate(prompt, new_tokens)
        return ttft, total, tokens

    return run


def bench_cell(run: Run, prompt: torch.Tensor, model: GPT, args: argparse.Namespace) -> dict[str, Any]:
    run(prompt, args.new_tokens)  # warm-up: compilation, autotuning, graph capture, allocator
    runs = [run(prompt, args.new_tokens) for _ in range(args.repeats)]
    ttft = statistics.median(r[0] for r in runs)
    total = statistics.median(r[1] for r in runs)
    decode_s = max(total - ttft, 1e-9)
    B, c, n = prompt.size(0), model.config, args.new_tokens
    elem = next(model.parameters()).element_size()
    # Decode step i (i = 1 .. n-1) attends over prompt_len + i cached tokens, in every layer and sequence.
    context = statistics.fmean(args.prompt_len + i for i in range(1, n))
    kv_bytes_per_token = 2 * c.n_layer * context * c.n_kv_head * c.head_dim * elem
    positions = model.transformer.wpe.weight.numel() if "wpe" in model.transformer else 0  # a lookup, not a read
    weight_bytes = (sum(p.numel() for p in model.parameters()) - positions) * elem
    bytes_per_sec = (B * kv_bytes_per_token + weight_bytes) * (n - 1) / decode_s
    return {"batch_size": B, "ttft_s": ttft, "total_s": total, "tokens_per_sec": B * n / total,
            "decode_tokens_per_sec": B * (n - 1) / decode_s, "ms_per_step": 1e3 * decode_s / (n - 1),
            "bytes_per_sec": bytes_per_sec, "frac_of_peak": bytes_per_sec / args.peak_bw,
            "tokens": runs[0][2][0].tolist()}


def markdown(cells: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Generation: {meta['model']} ({meta['shapes']}), {meta['dtype']}",
             "",
             f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, {meta['date']}. Prompt "
             f"{meta['prompt_len']} tokens, {meta['new_tokens']} new greedy tokens, median of {meta['repeats']}. "
             f"Peak bandwidth for the fractions: {meta['peak_bw'] / 1e12:.1f} TB/s.",
             "",
             "| batch | method | tokens/s (end to end) | × hf-static | decode tokens/s | ms/step | time to first token "
             "ms | KV + weights GB/s (% peak) | tokens = hf-static's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['batch_size']} | {c['method']} | {c['tokens_per_sec']:,.0f} | "
                     f"{fmt(c.get('vs_hf_static'), '.2f')} | {c['decode_tokens_per_sec']:,.0f} | "
                     f"{c['ms_per_step']:.2f} | {1e3 * c['ttft_s']:.1f} | {c['bytes_per_sec'] / 1e9:.0f} "
                     f"({100 * c['frac_of_peak']:.1f}%) | {c.get('matches_hf_static', '–')} |")
    return "\n".join(lines) + "\n"


def hf_model(model: GPT, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' GPT-2 with our model's weights (save_pretrained, then loaded as any Hugging Face model)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device, key="--device")
    dtype = resolve_dtype(args.dtype, device, key="--dtype")
    block_size = args.block_size or args.prompt_len + args.new_tokens
    torch.manual_seed(args.seed)
    shapes = MODELS[args.model]
    models = {a: GPT(GPTConfig(**shapes, block_size=block_size, pad_vocab_multiple=1, attention=a)) for a in
              args.attention}
    first = models[args.attention[0]]
    for m in models.values():  # the same weights in every model
        m.load_state_dict(first.state_dict())
        m.to(device=device, dtype=dtype).eval()
    runs: dict[str, Run] = {}
    for method in args.methods:
        if method in THEIRS:
            runs[method] = theirs(hf_model(first, device, dtype), method)
        else:
            runs.update({f"{a}-{method}": ours(m, method) for a, m in models.items()})

    cells = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        prompt = torch.randint(0, shapes["vocab_size"], (B, args.prompt_len), device=device)
        for name, run in runs.items():
            cell = {"method": name, **bench_cell(run, prompt, first, args)}
            cells.append(cell)
            write_report(args.out, {"cells": [{k: v for k, v in c.items() if k != "tokens"} for c in cells]})
            print(f"B={B} {name}: {cell['tokens_per_sec']:,.0f} tok/s end to end, "
                  f"{cell['decode_tokens_per_sec']:,.0f} tok/s decode, ttft {1e3 * cell['ttft_s']:.1f} ms", flush=True)
        batch = [c for c in cells if c["batch_size"] == B]
        reference = next((c for c in batch if c["method"] == "hf-static"), None)
        expected = reference["tokens"] if reference is not None else None
        for c in batch:
            tokens = c.pop("tokens")
            if reference is not None and expected is not None:
                c["vs_hf_static"] = c["tokens_per_sec"] / reference["tokens_per_sec"]
                # Leading greedy tokens equal to transformers' (low precision can flip a near-tie later on).
                c["matches_hf_static"] = next(
                    (i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), len(tokens))

    import transformers

    meta = run_meta(device, model=args.model, shapes=", ".join(f"{k}={v}" for k, v in shapes.items()),
                    transformers=transformers.__version__, dtype=str(dtype).removeprefix("torch."),
                    prompt_len=args.prompt_len, new_tokens=args.new_tokens, block_size=block_size,
                    repeats=args.repeats, peak_bw=args.peak_bw)
    results = {"meta": meta, "cells": cells}
    table = markdown(cells, meta)
    write_report(args.out, results, table)
    print(table)
    return results


if __name__ == "__main__":
    main()
