"""Fine-tuning step throughput and memory: our GPT (attention=sdpa and attention=triton) against transformers' own
model class of the same architecture, per Llama-family model preset; full fine-tuning, and LoRA against
transformers + peft.

Every cell is its own process: random weights (the compute does not depend on them), --batch-size sequences of
--seq-len tokens, the train defaults (AdamW, fused on CUDA; lr, betas and weight decay of training/config.py).
- ours-sdpa, ours-triton: `python train.py model=<preset> attention=<x> ...` (scripts/common.py: run_train) on the
  offline stdlib data (byte tokens fit any vocabulary; its 300 documents hold ~0.5M val tokens, far more than a
  batch's 8 × 2048). The preset is used as is, e.g. qwen2.5-0.5b's model.loss_chunk_tokens=4096.
- transformers: this script again, `--hf-cell RUN_DIR` + the same train.py overrides: AutoModelForCausalLM.from_config
  (model/pretrained.py: hf_config of our config), attn_implementation="sdpa", fp32 parameters, torch.compile, our
  AdamW, bf16 autocast as our loop; a step is `model(input_ids=x, labels=x).loss` (labels shifted inside), backward,
  step, zero_grad. It writes a summary.json with our loop's keys, so both kinds of cell are read alike.
- LoRA (the *-lora backends): rank --lora-rank adapters with alpha --lora-alpha on every linear layer, the base frozen
  in the compute dtype. Ours: train.py init_from=<a random-weight Hugging Face directory of the preset, written once
  by GPT.save_pretrained> lora.rank=... (the real loading path); transformers + peft: the model built in bf16 (what
  peft users load), peft's get_peft_model(LoraConfig(target_modules="all-linear")), its adapters in fp32 (peft's
  autocast_adapter_dtype), bf16 autocast, compiled as the others. Their rows compare to the transformers + peft row.
Both run --warmup steps (compilation; the 2nd step is profiled for the SDPA kernel) and --steps measured steps, timed
as our loop does (training/metrics.py: Throughput): tokens/s is the median over windows of --log-interval steps (by
default four of 5), peak reserved memory the largest over the whole run, warm-up included; MFU = tokens/s ·
flops_per_token(our num_params()) / the GPU's bf16 peak. Left different: our step also clips gradients (folded into
fused AdamW) and steps the LR schedule; transformers materialises the fp32 logits and runs without its KV cache.

    # H200: SmolLM2-360M and Qwen2.5-0.5B shapes, B=8, T=2048, bf16, compiled (needs transformers installed)
    python scripts/bench_finetune.py --presets smollm2-360m,qwen2.5-0.5b
    # H200: LoRA against full fine-tuning and transformers + peft, Llama-3.2-1B shapes
    python scripts/bench_finetune.py --presets llama-3.2-1b \
        --backends sdpa,triton,sdpa-lora,triton-lora,transformers-lora
    # CPU smoke test (CI, with TRITON_INTERPRET=1 for the triton cell)
    python scripts/bench_finetune.py --presets llama-tiny --device cpu --dtype fp32 --no-compile --batch-size 2 \
        --seq-len 32 --steps 2 --warmup 2 --log-interval 1 --backends sdpa,triton,transformers --out /tmp/ft

Writes results.json (after every cell; a failed cell, OOM or error, is a result) and results.md (a table per preset)
to --out (default: a fresh outputs/bench/finetune-<date>_<time>/) and prints the table.
"""

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT, GPTConfig  # noqa: E402
from scripts.common import ROOT, choice_list, default_out, fmt, run_meta, run_train, write_report  # noqa: E402
from training import metrics  # noqa: E402
from training.config import Config  # noqa: E402
from training.device import DTYPES  # noqa: E402

ROWS = {"sdpa": "ours-sdpa", "triton": "ours-triton", "transformers": "transformers",  # --backends -> table row
        "sdpa-lora": "ours-sdpa LoRA", "triton-lora": "ours-triton LoRA", "transformers-lora": "transformers+peft LoRA"}
FULL = ("sdpa", "triton", "transformers")  # the default --backends: full fine-tuning

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="smollm2-360m,qwen2.5-0.5b", help="model presets (conf/model/), comma list")
    p.add_argument("--backends", type=choice_list(ROWS), default=list(FULL), help=f"of {','.join(ROWS)}")
    p.add_argument("--lora-rank", type=int, default=16, help="the *-lora cells' adapter rank")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048, help="model.block_size of every cell")
    p.add_argument("--steps", type=int, default=20, help="measured steps per cell")
    p.add_argument("--warmup", type=int, default=5, help="steps before measuring, compilation included (>= 2)")
    p.add_argument("--log-interval", type=int, default=5, help="steps per timed window (tokens/s: their median)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--hf-cell", type=Path, default=None, help=argparse.SUPPRESS)  # internal: run one transformers cell
    p.add_argument("--hf-lora", action="store_true", help=argparse.SUPPRESS)  # internal: ... with peft's LoRA
    p.add_argument("overrides", nargs="*", help="extra train.py overrides for every cell")
    args = p.parse_args(argv)
    if args.warmup < 2 or args.steps < 1:
        p.error("need --warmup >= 2 (the first step compiles, the second is profiled) and --steps >= 1")
    return args


def overrides(args: argparse.Namespace, preset: str) -> list[str]:
    """The train.py settings shared by a preset's cells; the transformers cell reads its run from them too."""
    steps = args.warmup + args.steps
    return [f"model={preset}", f"model.block_size={args.seq_len}", f"train.batch_size={args.batch_size}",
            f"train.max_steps={steps}", f"train.perf_warmup_steps={args.warmup}",
            f"train.log_interval={args.log_interval}", f"train.eval_interval={steps}", "train.eval_batches=1",
            "train.save_checkpoints=false", f"train.compile={args.compile}", f"train.dtype={args.dtype}",
            f"train.device={args.device}", "wandb.mode=disabled", *args.overrides]


def compose(train_overrides: list[str]) -> tuple[Config, GPTConfig]:
    """The run config train.py would build from these overrides, and the model config our loop derives from it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from training.config import register_configs
    from training.init import resolve_init

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg: Config = OmegaConf.to_object(hydra_compose("config", overrides=train_overrides))
    return cfg, resolve_init(cfg).gpt_config


def num_params(config: GPTConfig) -> int:
    with torch.device("meta"):  # shapes only
        return GPT(config).num_params()


def hf_cell(run_dir: Path, train_overrides: list[str], lora: bool) -> None:
    """One transformers cell: the run of these train.py overrides with transformers' model in place of ours (with
    lora: in bf16, peft's adapters on every linear layer, lora.rank and lora.alpha of the overrides); writes
    run_dir/summary.json with our loop's keys (training/loop.py: finish) and prints it as one JSON line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from model.pretrained import hf_config
    from training.device import resolve_device, resolve_dtype
    from training.optim import build_optimizer

    cfg, config = compose(train_overrides)
    t = cfg.train
    device = resolve_device(t.device.value, key="train.device")
    dtype = resolve_dtype(t.dtype, device, key="train.dtype")
    torch.manual_seed(t.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = t.tf32  # as our loop
    hf = AutoConfig.for_model(**hf_config(config, torch.float32), use_cache=False)  # no KV cache while training
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa")
    if lora:  # the base in the compute dtype, as peft users load it; peft keeps its adapters in fp32
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model.to(dtype), LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha,
                                                           target_modules="all-linear", lora_dropout=cfg.lora.dropout))
    model = model.to(device).train()
    optimizer = build_optimizer(model, t, device.type)  # ours: fused on CUDA, weight decay on matrices only
    step_model = torch.compile(model) if t.compile else model
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    x = torch.randint(0, config.vocab_size, (t.batch_size, config.block_size), device=device)

    def step() -> torch.Tensor:
        with autocast:
            loss = step_model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    throughput, rates, losses, kernel = metrics.Throughput(device, t.batch_size * config.block_size), [], [], None
    for i in range(t.max_steps):  # timed as training/loop.py: run
        if i == t.perf_warmup_steps:
            throughput.start()
        if i == 1:
            loss, kernel, _ = metrics.detect_sdpa_kernel(step)
        else:
            loss = step()
        throughput.count()
        if (i + 1) % t.log_interval == 0 or i + 1 in (1, t.max_steps):
            losses.append(loss.item())
            rates += [rate] if (rate := throughput.rate()) is not None else []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    median = sorted(rates)[len(rates) // 2]
    peak = metrics.peak_flops(name, dtype) if device.type == "cuda" else None
    n_params = num_params(config)
    frozen = n_params - sum(p.numel() for p in model.parameters() if p.requires_grad) if lora else 0
    flops = metrics.flops_per_token(n_params, config.n_layer, config.n_head, config.head_dim, config.block_size, frozen)
    summary = {"device": name, "sdpa_kernel": kernel, "first/train_loss": losses[0], "final/train_loss": losses[-1],
               "perf/tokens_per_sec_median": median, "perf/mfu_median": median * flops / peak if peak else None,
               # since the process started: the whole run, as the largest of our loop's per-log peaks
               **{f"{key}_max": value for key, value in metrics.memory_metrics(device).items()}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


def random_base(config: GPTConfig, out: Path) -> Path:
    """A Hugging Face directory of a random-weight model of config (GPT.save_pretrained), the LoRA cells' init_from;
    made once."""
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        GPT(config).to(torch.bfloat16).save_pretrained(str(out))
    return out


def run_cell(args: argparse.Namespace, preset: str, backend: str, work: Path) -> dict[str, Any]:
    run_dir, train_overrides = work / f"{preset}-{backend}", overrides(args, preset)
    kind, lora = backend.removesuffix("-lora"), backend.endswith("-lora")
    if lora:  # a frozen base: our LoRA runs take their weights from a directory (their byte tokens fit any vocabulary)
        base = random_base(compose(train_overrides)[1], work / f"{preset}-base")
        train_overrides += [f"init_from={base}", "data.encoding=bytes", f"lora.rank={args.lora_rank}",
                            f"lora.alpha={args.lora_alpha}"]
    if kind == "transformers":
        command = [sys.executable, __file__, "--hf-cell", str(run_dir), *(["--hf-lora"] if lora else []), "--",
                   *train_overrides]
    else:
        command = [sys.executable, "train.py", *train_overrides, f"attention={kind}", f"hydra.run.dir={run_dir}"]
    return {"preset": preset, "backend": ROWS[backend], **run_train(command, run_dir, args.timeout)}


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "–"


def markdown(results: dict[str, Any]) -> str:
    meta, cells = results["meta"], results["cells"]
    mem_key = "peak_reserved_gib" if any(c.get("peak_reserved_gib") for c in cells) else "peak_rss_gib"
    mem_label = {"peak_reserved_gib": "peak reserved GiB", "peak_rss_gib": "peak RSS GiB"}[mem_key]
    lines = [f"Fine-tuning step, ours vs transformers: random weights, B={meta['batch_size']}, T={meta['seq_len']}, "
             f"{meta['dtype']}, {'compiled' if meta['compile'] else 'eager'}, {meta['steps']} measured steps after "
             f"{meta['warmup']}, on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, transformers "
             f"{meta['transformers']}, {meta['date']})."]
    for preset, info in results["presets"].items():
        lines += ["", f"### {preset}: {info['n_params'] / 1e6:.1f}M parameters, vocabulary {info['vocab_size']}, "
                  f"model.loss_chunk_tokens={info['loss_chunk_tokens']} (ours)", "",
                  f"| model | tokens/s | vs transformers | MFU | {mem_label} | memory vs transformers | SDPA kernel |",
                  "|---|---|---|---|---|---|---|"]
        rows = [c for c in cells if c["preset"] == preset]
        # each row against transformers doing the same: full fine-tuning, or LoRA with peft
        refs = {lora: next((c for c in rows if c["backend"] == ROWS["transformers" + lora] and c["status"] == "ok"),
                           {}) for lora in ("", "-lora")}
        for c in sorted(rows, key=lambda c: list(ROWS.values()).index(c["backend"])):
            hf = refs["-lora" if c["backend"].endswith("LoRA") else ""]
            if c["status"] != "ok":
                lines.append(f"| {c['backend']} | {c['status']} |" + " |" * 5)
                continue
            lines.append(f"| {c['backend']} | {fmt(c['tokens_per_sec'], ',.0f')} | "
                         f"{ratio(c['tokens_per_sec'], hf.get('tokens_per_sec'))} | {fmt(c['mfu'], '.1%')} | "
                         f"{fmt(c[mem_key], '.2f')} | {ratio(c[mem_key], hf.get(mem_key))} | "
                         f"{c['sdpa_kernel'] or '–'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.hf_cell:
        hf_cell(args.hf_cell, args.overrides, args.hf_lora)
        return {}
    out = args.out or default_out("finetune")
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    meta = run_meta(presets=args.presets, backends=args.backends, batch_size=args.batch_size, seq_len=args.seq_len,
                    steps=args.steps, warmup=args.warmup, log_interval=args.log_interval, dtype=args.dtype,
                    compile=args.compile, transformers=transformers)
    presets = {}
    for preset in args.presets.split(","):
        config = compose(overrides(args, preset))[1]
        presets[preset] = {"n_params": num_params(config), **{key: getattr(config, key) for key in (
            "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "loss_chunk_tokens")}}
    results: dict[str, Any] = {"meta": meta, "presets": presets, "partial": True, "cells": []}
    with tempfile.TemporaryDirectory(prefix="finetune-") as work:
        for preset in presets:
            for backend in args.backends:
                cell = run_cell(args, preset, backend, Path(work))
                print(json.dumps(cell), flush=True)
                results["cells"].append(cell)
                meta["device"] = next((c["device"] for c in results["cells"] if c.get("device")), "unknown")
                write_report(out, results)  # after every cell: an interrupted run keeps what it measured
    results["partial"] = False
    table = markdown(results)
    write_report(out, results, table)
    print(table)
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
