"""Data-parallel training on CPU (gloo, 2 processes started by the real torchrun launcher, tiny model): DDP and FSDP2
runs finish, their losses match a single-process run with the same global batch (also with activation
checkpointing), their checkpoints resume on 1 and on 2 processes, in either mode, and a stop signal to one rank stops
every rank at the same step. In-process at world size 1: FSDP2's per-block compile (one graph for every block, one for
the head, no graph break), its reshard policy, units of several blocks and prefetch give the plain model's loss and
gradients; in bf16 the blocks get their rotary tables in fp32."""

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, SMALL, make_cfg, read_metrics, table_rows, train_losses, wait_for_training
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from model import GPT, GPTConfig
from training import distributed
from training.checkpoint import is_sharded, load_checkpoint
from training.config import Distributed, FsdpConfig, Reshard, TrainConfig
from training.loop import train
from training.optim import ShardAdamW, apply_step, build_optimizer, clip_gradients

# Global batch 8 sequences × 2 micro-batches in every run: 1 process × batch 8, or 2 processes × batch 4. Dropout off
# and fp32, so the runs differ only in the order of float reductions.
COMMON = ["train.dtype=fp32", "train.device=cpu", "train.grad_accum_steps=2", "train.log_interval=1",
          "train.eval_interval=2", "train.lr_decay_steps=6", "train.learning_rate=3e-3", "wandb.mode=disabled"]
TOLERANCE = 1e-5


def torchrun_cmd(tmp_path: Path, run_dir: Path, *overrides: str) -> list[str]:
    """train.py under `torchrun --standalone --nproc_per_node=2` (standalone: a free rendezvous port of its own)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
            *SMALL, *COMMON, "train.batch_size=4", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
            *overrides]


def torchrun(tmp_path: Path, run_dir: Path, *overrides: str) -> None:
    proc = subprocess.run(torchrun_cmd(tmp_path, run_dir, *overrides), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def single(tmp_path: Path, run_dir: Path, *overrides: str) -> dict:
    return train(make_cfg(tmp_path, *COMMON, "train.batch_size=8", *overrides), run_dir, root=tmp_path)


def val_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["val/loss"] for m in read_metrics(run_dir) if "val/loss" in m}


def assert_close(got: dict[int, float], expected: dict[int, float]) -> None:
    assert got and all(abs(got[s] - expected[s]) < TOLERANCE for s in got), (got, expected)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 6-step single-process run (the losses every other run must reproduce) and its data cache."""
    tmp_path = tmp_path_factory.mktemp("dist")
    single(tmp_path, tmp_path / "single", "train.max_steps=6")
    return tmp_path, tmp_path / "single"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_match_one_and_resume_anywhere(reference, mode):
    tmp_path, ref = reference
    run = tmp_path / mode
    torchrun(tmp_path, run, f"train.distributed={mode}", "train.max_steps=4")
    assert_close(train_losses(run), train_losses(ref))
    assert_close(val_losses(run), val_losses(ref))
    summary = json.loads((run / "summary.json").read_text())  # written once, by rank 0
    assert summary["world_size"] == 2 and summary["distributed"] == mode
    assert summary["global_batch_size"] == 8 * 2 and summary["global_batch_tokens"] == 8 * 2 * 32
    assert [m["step"] for m in read_metrics(run) if "train/loss" in m] == [1, 2, 3, 4]  # one writer: rank 0
    # FSDP2 writes sharded checkpoints (a directory per checkpoint, one file of shards per rank); DDP one file.
    written = sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith("."))
    assert written == (["best.dcp", "last.dcp"] if mode == "fsdp" else ["best.pt", "last.pt"])
    if mode == "fsdp":
        assert is_sharded(run / "checkpoints" / "last.dcp")
        assert len(list((run / "checkpoints" / "last.dcp").glob("*.distcp"))) == 2

    # Its checkpoint resumes on 1 process, and on 2 processes in the other mode: the steps of the reference run.
    single(tmp_path, tmp_path / f"{mode}-on-1", "train.max_steps=6", f"train.resume={run}")
    assert_close(train_losses(tmp_path / f"{mode}-on-1"), train_losses(ref))
    other = "fsdp" if mode == "ddp" else "ddp"
    torchrun(tmp_path, tmp_path / f"{mode}-on-{other}", f"train.distributed={other}", "train.max_steps=6",
             f"train.resume={run}")
    resumed = train_losses(tmp_path / f"{mode}-on-{other}")
    assert sorted(resumed) == [5, 6]
    assert_close(resumed, train_losses(ref))


@pytest.mark.parametrize("mode, checkpointing", [("ddp", "selective"), ("fsdp", "full")])
def test_two_processes_with_activation_checkpointing_match_one(reference, mode, checkpointing):
    tmp_path, ref = reference
    run = tmp_path / f"{mode}-{checkpointing}"
    torchrun(tmp_path, run, f"train.distributed={mode}", "train.max_steps=4",
             f"train.activation_checkpointing={checkpointing}")
    assert_close(train_losses(run), train_losses(ref))
    assert_close(val_losses(run), val_losses(ref))


def test_two_processes_with_fsdp_units_compiled_whole_match_one(reference):
    """train.fsdp.compile_units on 2 processes: units of one block, the first resharded after its forward and
    gathered again for its backward (auto on several GPUs), each unit one graph."""
    tmp_path, ref = reference
    run = tmp_path / "fsdp-units"
    torchrun(tmp_path, run, "train.distributed=fsdp", "train.max_steps=4", "train.compile=true",
             "train.fsdp.compile_units=true", "train.fsdp.blocks_per_unit=1")
    assert_close(train_losses(run), train_losses(ref))
    assert_close(val_losses(run), val_losses(ref))


def test_ddp_or_fsdp_without_torchrun_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="train.distributed=fsdp needs"):
        train(make_cfg(tmp_path, "train.distributed=fsdp"), tmp_path / "run", root=tmp_path)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_signal_to_one_rank_stops_all_at_the_same_step(reference, mode):
    tmp_path, _ = reference
    run = tmp_path / f"signal-{mode}"
    proc = subprocess.Popen(torchrun_cmd(tmp_path, run, f"train.distributed={mode}", "train.max_steps=100000",
                                         "train.eval_interval=1000000"),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert wait_for_training(run, lambda: proc.poll() is None, 5)
    (rank1,) = [pid for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                if "RANK=1" in Path(f"/proc/{pid}/environ").read_text().split("\0")]
    os.kill(int(rank1), signal.SIGTERM)  # torchrun forwards a SIGTERM to all; here only rank 1 gets it
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]  # no rank was left waiting in a collective
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "signal (on another rank)"  # rank 0 was not signalled, and stopped too
    assert load_checkpoint(run)["step"] == summary["stopped_at_step"] < 100000


def test_a_sharded_checkpoint_converts_to_one_file_and_exports(reference, tmp_path):
    """scripts/convert_checkpoint.py gathers an FSDP2 run's shards into the .pt checkpoint of the same state, which
    resumes; scripts/export_hf.py reads the run directly."""
    from scripts import convert_checkpoint, export_hf

    data, ref = reference
    run = data / "fsdp"  # written by test_two_processes_match_one_and_resume_anywhere[fsdp]
    if not run.is_dir():
        torchrun(data, run, "train.distributed=fsdp", "train.max_steps=4")
    out = convert_checkpoint.main([str(run), str(tmp_path / "last.pt")])
    sharded, single = load_checkpoint(run), load_checkpoint(out)
    assert single["step"] == sharded["step"] == 4
    for key in ("model", "optimizer"):
        (a, a_spec), (b, b_spec) = (torch.utils._pytree.tree_flatten(state[key]) for state in (sharded, single))
        assert a_spec == b_spec and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                        for x, y in zip(a, b, strict=True))
    assert set(single["optimizer"]["state"]) == set(single["model"]) - {"lm_head.weight"}  # tied: one entry
    resumed = tmp_path / "from-pt"
    train(make_cfg(data, *COMMON, "train.batch_size=8", "train.max_steps=6", f"train.resume={out}"), resumed, root=data)
    assert_close(train_losses(resumed), train_losses(ref))
    export_hf.main([str(run), str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_scaling_benchmark_runs_its_cells_and_ddp_follows_the_reference_curve(tmp_path):
    """scripts/bench_distributed.py on CPU (gloo): 1-process, DDP and global-batch reference cells, scaling
    efficiency, DDP's loss curve on the reference's (fp32: only reduction order differs), one table row per cell."""
    from scripts import bench_distributed

    results = bench_distributed.main([
        "--nproc", "2", "--backends", "sdpa", "--modes", "ddp", "--device", "cpu", "--model", "tiny",
        "--vocab-size", "0", "--dtype", "fp32", "--no-compile", "--batch-size", "2", "--seq-len", "32", "--steps", "4",
        "--warmup", "2", "--log-interval", "2", "--out", str(tmp_path / "out"), "model.n_layer=1", "model.n_embd=32",
        "model.n_head=2", "data.max_documents=10", f"data.cache_dir={tmp_path / 'cache'}"])
    cells = {c["mode"]: c for c in results["cells"]}
    assert set(cells) == {"single", "reference", "ddp"} and all(c["status"] == "ok" for c in cells.values()), cells
    ddp = cells["ddp"]
    assert ddp["global_batch"] == cells["reference"]["global_batch"] == 4 and ddp["scaling_efficiency"] > 0
    assert len(ddp["loss_curve"]) == 4 and ddp["loss_gap_max"] < TOLERANCE  # steps 1, 2, 4, 6
    rows = table_rows((tmp_path / "out" / "results.md").read_text())
    assert [(r["attention"], r["mode"], r["GPUs"]) for r in rows] == [
        ("sdpa", "single", "1"), ("sdpa", "reference", "1"), ("sdpa", "ddp", "2")]
    assert rows[2]["scaling efficiency"] == f"{ddp['scaling_efficiency']:.1%}"
    assert (tmp_path / "out" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_lora_run_under_fsdp2_matches_one_process_and_its_shards_hold_the_adapters_alone(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=300, max_position_embeddings=64)
                     ).save_pretrained(tmp_path / "base")
    lora = [f"init_from={tmp_path / 'base'}", "data.encoding=bytes", "lora.rank=4", "lora.alpha=8",
            "train.max_steps=4"]
    single(tmp_path, tmp_path / "single", *lora)
    torchrun(tmp_path, tmp_path / "fsdp", "train.distributed=fsdp", *lora)
    assert_close(train_losses(tmp_path / "fsdp"), train_losses(tmp_path / "single"))
    state = load_checkpoint(tmp_path / "fsdp")  # the shards gathered into this process
    assert state["model"] and all(".lora_" in k for k in state["model"]) and state["lora"]["rank"] == 4
    ref = load_checkpoint(tmp_path / "single")["model"]
    assert all((state["model"][k] - ref[k]).abs().max() < TOLERANCE for k in ref)


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of this process alone (FSDP2 at world size 1), destroyed after the test."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield distributed.Context(Distributed.fsdp, torch.device("cpu"))
    torch.distributed.destroy_process_group()


def sharded_and_plain(fsdp: FsdpConfig, ctx: distributed.Context, compile: bool = False, checkpointing: str = "none"
                      ) -> tuple[GPT, nn.Module, GPT]:
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    model = copy.deepcopy(plain)
    model.set_activation_checkpointing(checkpointing)
    _, step_model = distributed.wrap(model, ctx, torch.float32, compile, fsdp)
    return model, step_model, plain


def assert_same_loss_and_gradients(model: GPT, step_model: nn.Module, plain: GPT) -> None:
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    _, loss = step_model(x, y, return_logits=False)
    _, expected = plain(x, y, return_logits=False)
    (loss + expected).backward()
    assert abs(loss.item() - expected.item()) < 1e-6
    grads = {name: distributed.full_tensor(p.grad) for name, p in model.named_parameters()}
    assert all((grads[name] - p.grad).abs().max() < 1e-6 for name, p in plain.named_parameters())


def test_fsdp_compiles_every_block_into_one_graph_and_the_head_into_another_without_breaks_or_new_names(world_of_one):
    torch._dynamo.reset()  # no graph of an earlier test (the LM head's) is reused
    counters.clear()
    model, step_model, plain = sharded_and_plain(FsdpConfig(compile_blocks=True, compile_units=False), world_of_one,
                                                compile=True)
    assert step_model is model  # the blocks are compiled, not the model around FSDP2's hooks
    assert_same_loss_and_gradients(model, step_model, plain)
    # three blocks, one graph; one for the LM head with the loss
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    assert list(model.state_dict()) == list(plain.state_dict())  # no wrapper in the parameter names


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_fsdp_compile_units_runs_each_unit_as_one_graph_without_calling_its_blocks(world_of_one, checkpointing):
    torch._dynamo.reset()  # no graph of an earlier test (the LM head's) is reused
    counters.clear()
    fsdp = FsdpConfig(compile_units=True, blocks_per_unit=2, reshard_after_forward=Reshard.always)
    model, step_model, plain = sharded_and_plain(fsdp, world_of_one, compile=True, checkpointing=checkpointing)
    assert len(model.block_runs) == 2  # units [0, 1] and [2]
    called = []  # blocks entered through their __call__ (where FSDP2's per-module hooks are)
    for i, block in enumerate(model.transformer.h):
        block.register_forward_pre_hook(lambda block, args, i=i: called.append(i))
    assert_same_loss_and_gradients(model, step_model, plain)  # FSDP2 gathered each unit around its graph
    assert called == []
    # a graph per unit length (2 blocks, 1 block) and the LM head with the loss; no break
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    assert list(model.state_dict()) == list(plain.state_dict())


@pytest.mark.parametrize("gather_fp32", [False, True])
def test_fsdp_gather_fp32_gathers_fp32_weights_and_gives_the_plain_steps_loss_and_gradients_under_autocast(
        world_of_one, gather_fp32):
    """train.fsdp.gather_fp32: under the loop's bf16 autocast FSDP2 gathers the fp32 weights and the loss and
    gradients are the plain model's; by default it gathers them cast to bf16."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    model = copy.deepcopy(plain)
    _, step_model = distributed.wrap(model, world_of_one, torch.bfloat16, False, FsdpConfig(gather_fp32=gather_fp32))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = step_model(x, y, return_logits=False)
        _, expected = plain(x, y, return_logits=False)
    gathered = model.transformer.h[0].attn.c_proj.weight  # world size 1: every unit stays gathered after forward
    assert not isinstance(gathered, DTensor) and gathered.dtype == (torch.float32 if gather_fp32 else torch.bfloat16)
    if gather_fp32:
        (loss + expected).backward()
        assert abs(loss.item() - expected.item()) < 1e-6
        grads = {name: distributed.full_tensor(p.grad) for name, p in model.named_parameters()}
        assert all((grads[name] - p.grad).abs().max() < 1e-6 for name, p in plain.named_parameters())


@pytest.mark.parametrize("reshard, per_unit, gathered", [
    ("auto", 1, [0, 1, 2]), ("always", 1, []), ("never", 1, [0, 1, 2]),  # auto keeps all at world size 1
    ("always", 2, []), ("auto", 2, [0, 1, 2]),  # units [0, 1] and [2]
])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_fsdp_keeps_gathered_after_forward_the_units_its_reshard_policy_names(world_of_one, reshard, per_unit,
                                                                                gathered, prefetch):
    fsdp = FsdpConfig(reshard_after_forward=Reshard(reshard), blocks_per_unit=per_unit, prefetch=prefetch)
    model, step_model, plain = sharded_and_plain(fsdp, world_of_one)
    x = torch.randint(0, 64, (2, 16))
    step_model(x, x, return_logits=False)
    # FSDP2 registers the full weights on a block it keeps gathered, its DTensor shards on one it reshards
    kept = [i for i, block in enumerate(model.transformer.h) if not isinstance(block.attn.c_proj.weight, DTensor)]
    assert kept == gathered
    assert_same_loss_and_gradients(model, step_model, plain)


@pytest.mark.parametrize("reshard, per_unit, kept", [("auto", 1, [True] * 3), ("always", 1, [False] * 3),
                                                     ("auto", 2, [True] * 3)])
def test_fsdp_keeps_the_units_its_policy_keeps_gathered_between_micro_batches_and_reshards_after_the_last(
        world_of_one, reshard, per_unit, kept):
    fsdp = FsdpConfig(reshard_after_forward=Reshard(reshard), blocks_per_unit=per_unit)
    model, step_model, plain = sharded_and_plain(fsdp, world_of_one)
    x = torch.randint(0, 64, (2, 16))
    gathered = lambda: [not isinstance(block.attn.c_proj.weight, DTensor) for block in model.transformer.h]
    for last in (False, False, True):
        with distributed.gradient_sync(model, last):
            step_model(x, x, return_logits=False)[1].backward()
        assert gathered() == [k and not last for k in kept]
    with torch.no_grad():  # an optimizer step on the shards, which the next forward must gather
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            p.mul_(0.5), q.mul_(0.5)
    model.zero_grad(set_to_none=True)
    assert_same_loss_and_gradients(model, step_model, plain)


@pytest.mark.parametrize("policy, world_size, per_unit", [
    ("auto", 2, [True, True, False]), ("auto", 8, [True, True, False]), ("auto", 1, [False] * 3),
    ("always", 1, [True] * 3), ("always", 2, [True] * 3), ("never", 2, [False] * 3),
])
def test_reshard_policy_auto_keeps_the_last_unit_and_every_unit_at_world_size_1(policy, world_size, per_unit):
    assert [distributed.reshard_after_forward(Reshard(policy), last, world_size)
            for last in (False, False, True)] == per_unit


@pytest.mark.parametrize("blocks_of_params, first_unit", [(1, [0]), (2, [0, 1]), (2.5, [0, 1, 2]), (100, [0, 1, 2])])
def test_fsdp_with_blocks_per_unit_0_makes_units_of_the_fewest_blocks_that_reach_unit_params(
        world_of_one, monkeypatch, blocks_of_params, first_unit):
    per_block = sum(p.numel() for p in GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16,
                                                         vocab_size=64)).transformer.h[0].parameters())
    monkeypatch.setattr(distributed, "UNIT_PARAMS", int(blocks_of_params * per_block))
    model, step_model, plain = sharded_and_plain(FsdpConfig(blocks_per_unit=0), world_of_one)
    seen = []  # as block 0 starts (after FSDP2's pre-forward): the blocks its unit's all-gather brought in full
    model.transformer.h[0].register_forward_pre_hook(lambda block, args: seen.append(
        [i for i, b in enumerate(model.transformer.h) if not isinstance(b.attn.c_proj.weight, DTensor)]))
    assert_same_loss_and_gradients(model, step_model, plain)
    assert seen == [first_unit]


def test_fsdp_in_bf16_gives_the_blocks_their_rotary_tables_in_fp32(world_of_one):
    torch.manual_seed(0)
    model = GPT(GPTConfig(family="llama", n_layer=2, n_head=2, n_kv_head=1, n_embd=32, block_size=16, vocab_size=64))
    distributed.wrap(model, world_of_one, torch.bfloat16, False, FsdpConfig())
    seen = []  # registered after FSDP2's own pre-forward hook: what the block's forward receives
    model.transformer.h[1].register_forward_pre_hook(lambda block, args: seen.append([t.dtype for t in args[2]]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 16)))
    assert seen == [[torch.float32, torch.float32]]  # cos, sin: positions up to 128k need fp32's mantissa


def test_fsdp_local_optimizer_clips_and_steps_the_shards_as_stock_adamw_steps_the_dtensors(world_of_one):
    runs = {}
    for local in (False, True):
        model, step_model, _ = sharded_and_plain(FsdpConfig(), world_of_one)
        cfg = TrainConfig(distributed=Distributed.fsdp, fsdp=FsdpConfig(local_optimizer=local), learning_rate=1e-2)
        optimizer = build_optimizer(model, cfg, "cuda")  # fused, as on GPUs (CPU has the fused kernel too)
        assert isinstance(optimizer, ShardAdamW) == local
        torch.manual_seed(1)
        norms = []
        for _ in range(3):
            x = torch.randint(0, 64, (2, 16))
            step_model(x, x, return_logits=False)[1].backward()
            params = [p for p in model.parameters() if p.grad is not None]
            # the loop folds the clip into the local optimizer (fused kernel's grad_scale), not into the stock one
            norms.append(distributed.full_tensor(clip_gradients(optimizer, params, 0.05, fold=local)))
            apply_step(optimizer, torch.amp.GradScaler("cpu", enabled=False), skip=torch.tensor(False))
            optimizer.zero_grad(set_to_none=True)
        runs[local] = norms, [p.full_tensor() for p in model.parameters()]
    (norms, params), (local_norms, local_params) = runs[False], runs[True]
    assert all(n > 0.05 for n in norms)  # the clip acted on every step
    assert all(abs(a - b) < 1e-6 * a for a, b in zip(norms, local_norms, strict=True))
    assert all((a - b).abs().max() < 1e-6 for a, b in zip(params, local_params, strict=True))
