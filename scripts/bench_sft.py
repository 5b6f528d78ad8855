"""Instruction fine-tuning throughput: examples packed into rows (data.packing=true) against one example per padded row,
ours (attention=sdpa and triton) and transformers' own model on the same padded rows; and the attention of packed rows
alone, our kernel against FlexAttention's document mask.

Data: --examples synthetic Alpaca-style rows (seeded; an instruction and an output of random words, lognormal
lengths, written once as a jsonl file), rendered with data.prompt_template=alpaca in byte tokens (data.encoding=bytes:
they fit any vocabulary), the loss on the outputs only. Weights: random, the model preset's shapes (the compute does
not depend on them). Every train cell is its own `python train.py` process (scripts/common.py: run_train) with
--batch-size rows of --seq-len tokens, timed as our loop times itself: the medians of perf/trained_tokens_per_sec (the
tokens the loss is on, the fair measure across packing and padding) and perf/tokens_per_sec over windows of
--log-interval steps after --warmup, peak reserved memory over the whole run. The transformers cell (this script with
--hf-cell) runs AutoModelForCausalLM (attn_implementation="sdpa", compiled, bf16 autocast, our AdamW) on the same
padded batches of our loader; the loss is ours on its logits.

Attention (--attention-shapes): the positions of one packed batch of these data, random q, k, v of the preset's heads,
fwd+bwd GPU time by CUDA-graph replay (scripts/bench_attention.py: gpu_ms) of: ours with the rows' example bounds
(documents), FlexAttention (compiled) with the document BlockMask, and for scale both kernels on the same rows without
boundaries (plain causal: what ignoring them would cost, and leak).

    # H200: SmolLM2-360M shapes, B=8 rows of T=2048
    python scripts/bench_sft.py --preset smollm2-360m
    # CPU smoke test (CI, with TRITON_INTERPRET=1 for the triton cells)
    python scripts/bench_sft.py --preset llama-tiny --device cpu --dtype fp32 --no-compile --batch-size 2 \
        --seq-len 64 --steps 2 --warmup 2 --log-interval 1 --examples 200 --out /tmp/sft

Writes results.json (after every cell) and results.md to --out (default: a fresh outputs/bench/sft-<date>_<time>/).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_finetune import compose, num_params  # noqa: E402
from scripts.common import attempt, choice_list, default_out, fmt, run_meta, run_train, write_report  # noqa: E402

CELLS = {"sdpa-packed": ("sdpa", True), "triton-packed": ("triton", True), "sdpa-padded": ("sdpa", False),
         "triton-padded": ("triton", False), "transformers-padded": ("transformers", False)}
WORDS = [f"{a}{b}{c}" for a in "bcdfgklmnprst" for b in "aeiou" for c in ("", "n", "r", "s")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-360m", help="model preset (conf/model/)")
    p.add_argument("--cells", type=choice_list(CELLS), default=list(CELLS), help=f"comma list of {','.join(CELLS)}")
    p.add_argument("--examples", type=int, default=6000, help="synthetic instruction rows")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--seq-len", type=int, default=2048, help="model.block_size")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attention-shapes", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the attention of packed rows alone (CUDA only)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None, help="the data, cache and run folders (default: <out>/work)")
    p.add_argument("--hf-cell", type=Path, default=None, help=argparse.SUPPRESS)  # internal: one transformers cell
    p.add_argument("overrides", nargs="*", help="extra train.py overrides for every cell")
    return p.parse_args(argv)


def write_examples(path: Path, n: int) -> Path:
    """n Alpaca-style rows of random words: instruction ~ lognormal around 60 characters, output around 250."""
    if not path.is_file():
        rng = np.random.default_rng(0)

        def text(median: float) -> str:
            chars = int(np.clip(rng.lognormal(np.log(median), 0.8), 8, 3000))
            return " ".join(rng.choice(WORDS, size=max(1, chars // 4)).tolist())

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"instruction": text(60), "input": "", "output": text(250)}) + "\n"
                                for _ in range(n)))
    return path


def overrides(args: argparse.Namespace, data: Path, cache: Path) -> list[str]:
    steps = args.warmup + args.steps
    return [f"model={args.preset}", f"model.block_size={args.seq_len}", "data=instruct_local",
            f"data.data_files=[{data}]", "data.prompt_template=alpaca", "data.encoding=bytes", "data.val_fraction=0.02",
            f"data.cache_dir={cache}", f"train.batch_size={args.batch_size}", f"train.max_steps={steps}",
            f"train.perf_warmup_steps={args.warmup}", f"train.log_interval={args.log_interval}",
            f"train.eval_interval={steps}", "train.eval_batches=1", "train.save_checkpoints=false",
            f"train.compile={args.compile}", f"train.dtype={args.dtype}", f"train.device={args.device}",
            "wandb.mode=disabled", *args.overrides]


def hf_cell(run_dir: Path, train_overrides: list[str]) -> None:
    """transformers' model on our loader's padded rows (module docstring); writes run_dir/summary.json with our loop's
    keys and prints it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from data import ExampleLoader, prepare_dataset
    from model.loss import IGNORE_INDEX
    from model.pretrained import hf_config
    from training import metrics
    from training.device import resolve_device, resolve_dtype
    from training.optim import build_optimizer

    cfg, config = compose(train_overrides)
    t = cfg.train
    device = resolve_device(t.device.value, key="train.device")
    dtype = resolve_dtype(t.dtype, device, key="train.dtype")
    torch.manual_seed(t.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = t.tf32
    loader = ExampleLoader(prepare_dataset(cfg.data), config.block_size, t.batch_size, device, t.seed,
                           vocab_size=config.vocab_size, overlong=cfg.data.overlong, packing=False)
    hf = AutoConfig.for_model(**hf_config(config, torch.float32), use_cache=False)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa").to(device).train()
    optimizer = build_optimizer(model, t, device.type)
    step_model = torch.compile(model) if t.compile else model
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    throughput = metrics.Throughput(device, t.batch_size * config.block_size)
    rates, trained_rates, losses = [], [], []
    for i in range(t.max_steps):
        if i == t.perf_warmup_steps:
            throughput.start()
        batch = loader.next_batch()
        with autocast:
            logits = step_model(input_ids=batch.x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.y.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        throughput.count((batch.y != IGNORE_INDEX).sum())
        if (i + 1) % t.log_interval == 0 or i + 1 in (1, t.max_steps):
            losses.append(loss.item())
            if (rate := throughput.rate()) is not None:
                rates.append(rate)
                trained_rates.append(throughput.trained_rate)
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "first/train_loss": losses[0], "final/train_loss": losses[-1],
               "perf/tokens_per_sec_median": median(rates), "perf/trained_tokens_per_sec_median": median(trained_rates),
               **{f"{key}_max": value for key, value in metrics.memory_metrics(device).items()}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


def run_cell(args: argparse.Namespace, name: str, train_overrides: list[str], work: Path) -> dict[str, Any]:
    kind, packing = CELLS[name]
    run_dir = work / name
    cell_overrides = [*train_overrides, f"data.packing={str(packing).lower()}"]
    if kind == "transformers":
        command = [sys.executable, __file__, "--hf-cell", str(run_dir), "--", *cell_overrides]
    else:
        command = [sys.executable, "train.py", *cell_overrides, f"attention={kind}", f"hydra.run.dir={run_dir}"]
    extra = {"trained_tokens_per_sec": "perf/trained_tokens_per_sec_median", "packing_fill": "data/packing_fill"}
    return {"cell": name, **run_train(command, run_dir, args.timeout, extra=extra)}


def attention_shapes(train_overrides: list[str], device: torch.device) -> dict[str, Any]:
    """fwd+bwd GPU ms of one packed batch's attention (module docstring), bf16."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from data import ExampleLoader, prepare_dataset
    from kernels import document_bounds, flash_attention
    from model.attention import flex_documents
    from scripts.bench_attention import gpu_ms

    cfg, config = compose(train_overrides)
    loader = ExampleLoader(prepare_dataset(cfg.data), config.block_size, cfg.train.batch_size, device, 0,
                           vocab_size=config.vocab_size, packing=True)
    positions = loader.next_batch().positions
    B, T = positions.shape
    H, H_kv, D = config.n_head, config.n_kv_head, config.head_dim
    q = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, T, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    documents = document_bounds(positions)
    masks = {"documents": flex_documents(positions),  # the model's own (attention=sdpa with packed rows)
             "causal": create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=device)}
    flex = torch.compile(flex_attention, dynamic=False)
    methods = {
        "ours (documents)": lambda: flash_attention(q, k, v, documents=documents),
        "flex (document mask)": lambda: flex(q, k, v, block_mask=masks["documents"], enable_gqa=H != H_kv),
        "ours (causal, no boundaries)": lambda: flash_attention(q, k, v),
        "flex (causal, no boundaries)": lambda: flex(q, k, v, block_mask=masks["causal"], enable_gqa=H != H_kv),
    }
    starts = (positions == 0).cpu().numpy()
    lengths = np.concatenate([np.diff(np.r_[np.flatnonzero(row), T]) for row in starts])  # the rows' segments
    out = {"shape": {"B": B, "T": T, "H": H, "H_kv": H_kv, "D": D}, "segments": len(lengths),
           "useful_fraction": float((lengths.astype(np.float64) ** 2).sum() / (B * T * T)),  # Σ lenᵢ² / (B T²)
           "max_abs_diff_vs_flex": (methods["ours (documents)"]() - methods["flex (document mask)"]()).abs().max()
           .item(),
           "ms": {}}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for name, fwd in methods.items():
            def step(fwd=fwd) -> None:
                fwd().backward(do)

            out["ms"][name] = attempt(lambda step=step: {"fwdbwd": gpu_ms(step, [q, k, v])})
    return out


def markdown(results: dict[str, Any]) -> str:
    meta, cells = results["meta"], results["cells"]
    lines = [f"Instruction fine-tuning, {meta['preset']} shapes ({meta['n_params'] / 1e6:.0f}M parameters), random "
             f"weights, {meta['batch_size']} rows of {meta['seq_len']} tokens, {meta['dtype']}, "
             f"{'compiled' if meta['compile'] else 'eager'}, {meta['steps']} measured steps after {meta['warmup']}, "
             f"{meta['examples']} synthetic Alpaca-style examples in byte tokens, on {meta.get('gpu', meta['device'])} "
             f"(torch {meta['torch']}, triton {meta['triton']}, {meta['date']}).", "",
             "| cell | trained tokens/s | vs transformers | vs own padded | tokens/s | row fill | peak reserved GiB |",
             "|---|---|---|---|---|---|---|"]
    by = {c["cell"]: c for c in cells if c["status"] == "ok"}
    hf = by.get("transformers-padded", {}).get("trained_tokens_per_sec")
    for c in cells:
        if c["status"] != "ok":
            lines.append(f"| {c['cell']} | {c['status']} |" + " |" * 5)
            continue
        rate = c["trained_tokens_per_sec"]
        padded = by.get(c["cell"].replace("packed", "padded"), {}).get("trained_tokens_per_sec")
        ratio = lambda a, b: f"{a / b:.2f}×" if a and b else "–"  # noqa: E731
        lines.append(f"| {c['cell']} | {fmt(rate, ',.0f')} | {ratio(rate, hf)} | "
                     f"{ratio(rate, padded) if 'packed' in c['cell'] else '–'} | {fmt(c['tokens_per_sec'], ',.0f')} | "
                     f"{fmt(c.get('packing_fill'), '.1%')} | {fmt(c.get('peak_reserved_gib'), '.2f')} |")
    att = results.get("attention")
    if att:
        s = att["shape"]
        lines += ["", f"Attention of one packed batch: B={s['B']}, T={s['T']}, {s['H']}/{s['H_kv']} heads, D={s['D']}, "
                  f"bf16, {att['segments']} segments (examples, and each row's padding; Σ lenᵢ² = "
                  f"{att['useful_fraction']:.1%} of B·T²); ours vs flex "
                  f"max |diff| {att['max_abs_diff_vs_flex']:.2e}.", "", "| method | fwd+bwd GPU ms |", "|---|---|"]
        for name, res in att["ms"].items():
            lines.append(f"| {name} | {fmt(res.get('fwdbwd'), '.3f') if 'fwdbwd' in res else res['status']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.hf_cell:
        hf_cell(args.hf_cell, args.overrides)
        return {}
    out = args.out or default_out("sft")
    work = args.work or out / "work"
    data = write_examples(work / "instructions.jsonl", args.examples)
    train_overrides = overrides(args, data, work / "cache")
    config = compose(train_overrides)[1]
    results: dict[str, Any] = {
        "meta": run_meta(preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                         warmup=args.warmup, dtype=args.dtype, compile=args.compile, examples=args.examples,
                         device=args.device, n_params=num_params(config),
                         **({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {})),
        "cells": []}
    for name in args.cells:
        results["cells"].append(run_cell(args, name, train_overrides, work))
        print(json.dumps(results["cells"][-1]), flush=True)
        write_report(out, results)
    if args.attention_shapes and args.device == "cuda":
        results["attention"] = attention_shapes(train_overrides, torch.device("cuda"))
        print(json.dumps(results["attention"]), flush=True)
    write_report(out, results, markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
