"""Where the GPU time of a training step goes: per-kernel CUDA time of GPT training steps, per attention backend.

Run from the repository root on a machine with a CUDA GPU:

    python scripts/profile_step.py                                   # GPT-2 124M, B=16, T=1024, compiled, sdpa+triton
    python scripts/profile_step.py --backends triton --no-bias --eager --out /tmp/prof
    python scripts/profile_step.py --attention-only 16,12,1024,64    # fwd+bwd of one attention shape, no model
    python scripts/profile_step.py --preset llama-3.2-1b --batch-size 8 --seq-len 2048 --lora-rank 16 --memory-snapshot

A step is what train.py runs: bf16 autocast forward and backward (the model returns the loss alone, no logits), the
gradient norm folded into fused AdamW (training/optim.py), the optimizer step and zero_grad. After --warmup steps
(compilation, autotuning), --steps steps run under torch.profiler. For each backend the script prints the GPU time per
step, split into categories (attention, matmul, inductor's fused elementwise/reduction kernels, optimizer, aten
copies/fills, other) and the top kernels, and writes profile.json to --out (default: a fresh folder under
outputs/bench/), with a Chrome trace per backend under --trace.
The wall time per step is measured over as many steps run without the profiler. `--attention-only` profiles repeated
forward+backward calls of the attention alone (the shape B,H,T,D, causal), to see each kernel of a benchmark row.
`--preset` takes a model preset of conf/model/ (random weights) instead of GPT-2 124M's shapes; `--lora-rank` trains
adapters on every linear layer of it with the base frozen in bf16, as a LoRA run does (model/lora.py). Peak reserved
and allocated memory are reported per backend, and the allocated memory of one step phase by phase (at the end of
forward: weights, optimizer state and what autograd saved; the peak of each phase); `--memory-snapshot` also writes
the allocator's history of one step (memory_<backend>.pickle, for https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT, GPTConfig  # noqa: E402
from model.attention import BACKENDS, get_attention  # noqa: E402
from model.config import LoRAConfig  # noqa: E402
from model.lora import add_lora  # noqa: E402
from scripts.common import choice_list, default_out, run_meta, write_report  # noqa: E402
from training.config import ActivationCheckpointing, TrainConfig  # noqa: E402
from training.optim import apply_step, build_optimizer, clip_gradients  # noqa: E402

# kernel-name substring -> category, first match wins (attention first: cuDNN's names contain "gemm"-like parts)
# (inductor's fused kernels are named triton_<poi|red|per>_fused_<ops>, so they go before the aten copy/fill kernels)
CATEGORIES = [
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel")),
    ("inductor", ("triton_",)),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "sm90_", "wgmma")),
    ("copy/fill", ("copy", "memcpy", "memset", "cat", "fill")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, needles in CATEGORIES:
        if any(n in low for n in needles):
            return cat
    return "other"


def kernel_times(prof: torch.profiler.profile, n_steps: int) -> dict[str, float]:
    """GPU kernel name -> milliseconds per step (device time of the kernels themselves)."""
    times: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation:  # kernels, not ranges
            times[e.name] += e.device_time / 1e3 / n_steps  # device_time is in us
    return dict(times)


def profile(fn: Callable[[], None], warmup: int, steps: int, trace: Path | None) -> tuple[dict[str, float], float]:
    """Per-step kernel times of fn, and the per-step wall time between synchronised points (ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / steps  # unprofiled: the profiler adds host overhead of its own
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(str(trace))
    return kernel_times(prof, steps), wall


def preset_config(preset: str, seq_len: int, attention: str) -> GPTConfig:
    """The model config of a preset (conf/model/<preset>.yaml) at seq_len; a preset without a vocabulary (the gpt2
    ones take the data's tokenizer's) gets GPT-2's."""
    from scripts.bench_finetune import compose

    cfg, config = compose([f"model={preset}", f"model.block_size={seq_len}", f"attention={attention}"])
    return config if cfg.model.vocab_size else replace(config, vocab_size=50257)


def model_config(attention: str, args: argparse.Namespace) -> GPTConfig:
    """GPT-2 124M's shapes (--n-layer, --no-bias), or a preset's at --seq-len."""
    if args.preset is None:
        config = GPTConfig(n_layer=args.n_layer, n_head=12, n_embd=768, block_size=args.seq_len, vocab_size=50257,
                           bias=not args.no_bias, attention=attention)
    else:
        config = preset_config(args.preset, args.seq_len, attention)
    return config if args.loss_chunk_tokens is None else replace(config, loss_chunk_tokens=args.loss_chunk_tokens)


def model_step(attention: str, args: argparse.Namespace) -> Callable[[], dict[str, float]]:
    """One training step of the model, as train.py runs it (single GPU, bf16, fused AdamW, clip 1.0); with
    --lora-rank, of adapters on a frozen bf16 base (training/loop.py: setup_model)."""
    torch.manual_seed(0)
    config = model_config(attention, args)
    model = GPT(config)
    if args.lora_rank:
        add_lora(model, LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=["all"]))
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    model = model.cuda()
    model.set_activation_checkpointing(args.activation_checkpointing)
    optimizer = build_optimizer(model, TrainConfig(), "cuda")
    scaler = torch.amp.GradScaler("cuda", enabled=False)  # bf16: no loss scaling
    step_model = model if args.eager else torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    never = torch.tensor(False, device="cuda")  # skip flag: the step is always applied
    x = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device="cuda")
    y = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device="cuda")

    def step(phases: bool = False) -> dict[str, float]:
        """One step; with phases, the allocated memory (GiB) after and at the peak of each part of it."""
        gib: dict[str, float] = {}

        def mark(phase: str) -> None:
            if phases:
                torch.cuda.synchronize()
                gib[f"{phase}_peak"] = torch.cuda.max_memory_allocated() / 2**30
                gib[f"{phase}_end"] = torch.cuda.memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()

        mark("before")  # weights and optimizer state
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = step_model(x, y, return_logits=args.with_logits)
        mark("forward")  # end: what autograd saved for backward
        loss.backward()
        mark("backward")  # end: the gradients
        clip_gradients(optimizer, params, 1.0, fold=True)
        apply_step(optimizer, scaler, skip=never)
        optimizer.zero_grad(set_to_none=True)
        mark("optimizer")
        return gib

    return step


def attention_step(attention: str, shape: tuple[int, ...]) -> Callable[[], None]:
    """Forward + backward of one attention call, q/k/v (B, H, T, D) bf16 contiguous, causal."""
    B, H, T, D = shape
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    attend = get_attention(attention)

    def step() -> None:
        q.grad = k.grad = v.grad = None
        attend(q, k, v, causal=True).backward(do)

    return step


def report(name: str, times: dict[str, float], wall: float, top: int) -> dict:
    by_cat: dict[str, float] = defaultdict(float)
    for kernel, ms in times.items():
        by_cat[category(kernel)] += ms
    total = sum(times.values())
    print(f"\n== {name}: wall {wall:.3f} ms/step, GPU kernels {total:.3f} ms/step "
          f"(GPU idle {max(wall - total, 0):.3f} ms)")
    print("| category | ms/step | share |\n|---|---|---|")
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {ms:.3f} | {ms / total:.1%} |")
    print(f"| kernel (top {top}) | category | ms/step |\n|---|---|---|")
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    for kernel, ms in ranked[:top]:
        print(f"| {kernel[:110]} | {category(kernel)} | {ms:.3f} |")
    return {"wall_ms": wall, "kernel_ms": total, "categories": dict(by_cat),
            "kernels": {k: ms for k, ms in ranked}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", type=choice_list(BACKENDS), default=["sdpa", "triton"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--preset", default=None, help="a model preset of conf/model/ instead of GPT-2 124M's shapes")
    p.add_argument("--lora-rank", type=int, default=0, help="train rank-r adapters on every linear layer, base frozen")
    p.add_argument("--memory-snapshot", action="store_true", help="write the allocator's history of one step")
    p.add_argument("--loss-chunk-tokens", type=int, default=None, help="model.loss_chunk_tokens (default: preset)")
    p.add_argument("--activation-checkpointing", default="none", choices=[m.value for m in ActivationCheckpointing])
    p.add_argument("--no-bias", action="store_true", help="model.bias=false (nanoGPT's default)")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--with-logits", action="store_true",
                   help="the step also returns the logits (train.py does not: see GPT.forward's return_logits)")
    p.add_argument("--attention-only", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   metavar="B,H,T,D")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--trace", action="store_true", help="also write a Chrome trace per backend")
    p.add_argument("--out", type=Path, default=None, help="default: a fresh folder under outputs/bench/")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    out = args.out or default_out("profile-step")
    out.mkdir(parents=True, exist_ok=True)
    results = {"meta": run_meta(torch.device("cuda"), args={k: v for k, v in vars(args).items() if k != "out"})}
    for backend in args.backends:
        fn = attention_step(backend, args.attention_only) if args.attention_only else model_step(backend, args)
        trace = out / f"trace_{backend}.json" if args.trace else None
        torch.cuda.reset_peak_memory_stats()
        times, wall = profile(fn, args.warmup, args.steps, trace)
        results[backend] = report(backend, times, wall, args.top)
        results[backend].update(peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                                peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30)
        print(f"peak reserved {results[backend]['peak_reserved_gib']:.2f} GiB, "
              f"allocated {results[backend]['peak_allocated_gib']:.2f} GiB")
        if not args.attention_only:
            torch.cuda.reset_peak_memory_stats()
            phases = results[backend]["memory_phases_gib"] = fn(phases=True)
            print("| allocated GiB | " + " | ".join(phases) + " |\n|---|" + "---|" * len(phases) + "\n| "
                  f"{backend} | " + " | ".join(f"{v:.2f}" for v in phases.values()) + " |")
        if args.memory_snapshot:
            torch.cuda.memory._record_memory_history()
            fn()
            torch.cuda.synchronize()
            torch.cuda.memory._dump_snapshot(str(out / f"memory_{backend}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        del fn
        torch.cuda.empty_cache()
    write_report(out, results, name="profile")


if __name__ == "__main__":
    main()
