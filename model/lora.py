"""LoRA: low-rank adapters on the linear layers of a frozen GPT (Hu et al., 2021), in PEFT's format in and out.

    from model.lora import add_lora, merge_lora, save_adapter, load_adapter
    add_lora(model, LoRAConfig(rank=16, alpha=32, targets=["all"]))  # base frozen; only the adapters train
    save_adapter(model, "adapter/", base="HuggingFaceTB/SmolLM2-135M")   # PEFT's adapter directory
    load_adapter(base_model, "adapter/")                                 # ours, or one PEFT wrote
    merge_lora(model)                                                    # W += (alpha / rank) B A: plain Linear again

An adapted layer computes y = W x + b + (alpha / rank) · B A dropout(x), with A (rank, in) and B (out, rank) per
target, A initialised as PEFT does (Kaiming-uniform) and B at zero, so that before the first step the model is the
base model. Targets are the names users know, mapped onto our fused projections (TARGETS): q, k and v are row blocks
of attn.c_attn, gate and up (llama) the halves of mlp.c_fc, o and down the output projections, and `all` every one
the family has. The base matmul stays fused: one `LoRALinear` per fused projection adds the deltas of its adapted
blocks (the A of all of them in one matmul, their B inside the base's where the shapes allow: [x | z] [W | B]ᵀ).
Each (A, B) pair is PEFT's lora_A / lora_B of the Hugging Face module it belongs to (q_proj, ...): `peft_state` and
`from_peft_state` rename them, for the llama family (GPT-2's fused c_attn is one module to PEFT: export a GPT-2
merged).
"""

import json
import math
import re
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig, LoRAConfig

# A LoRA target -> (our module in a block, which of its row blocks): the blocks are model/pretrained.py's HF_MODULES.
TARGETS: dict[str, dict[str, tuple[str, int]]] = {
    "llama": {"q": ("attn.c_attn", 0), "k": ("attn.c_attn", 1), "v": ("attn.c_attn", 2), "o": ("attn.c_proj", 0),
              "gate": ("mlp.c_fc", 0), "up": ("mlp.c_fc", 1), "down": ("mlp.c_proj", 0)},
    "gpt2": {"q": ("attn.c_attn", 0), "k": ("attn.c_attn", 1), "v": ("attn.c_attn", 2), "o": ("attn.c_proj", 0),
             "up": ("mlp.c_fc", 0), "down": ("mlp.c_proj", 0)},
}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names
PEFT_PREFIX = "base_model.model."  # PEFT's name of the wrapped transformers model in its state dict


class LoRAError(ValueError):
    """LoRA settings or an adapter that do not fit the model; the message names the fix."""


def chosen_targets(config: GPTConfig, lora: LoRAConfig) -> list[str]:
    """The target names lora.targets means for this model (`all`: every target of its family), in TARGETS' order."""
    known = TARGETS[config.family]
    names = set(known) if "all" in lora.targets else set(lora.targets)
    unknown = sorted(names - set(known))
    if unknown:
        raise LoRAError(f"lora.targets: {', '.join(unknown)} is no linear layer of a {config.family} model: choose "
                        f"among {', '.join(known)} or all")
    return [name for name in known if name in names]


def blocks(config: GPTConfig, module: str) -> list[int]:
    """The output sizes of a fused projection's row blocks (one per TARGETS index), in order."""
    hs = config.head_dim
    if module == "attn.c_attn":
        return [config.n_head * hs, config.n_kv_head * hs, config.n_kv_head * hs]
    if module == "mlp.c_fc" and config.family == "llama":
        return [config.mlp_width, config.mlp_width]
    return [config.mlp_width if module == "mlp.c_fc" else config.n_embd]


class _LoRAMatmul(torch.autograd.Function):
    """y = W x + B z with z = s · A x' (x' = x, or the dropout of x when given), for a frozen W: the passes over the
    large (..., in) and (..., out) tensors kept to what the shapes need.
    - in <= out (q/k/v, gate/up): y = [x | z] [W | B]ᵀ, one matmul, so the (..., out) delta B z is never written and
      added; backward [dz | dx] = dy [B | W], again one matmul (dy, the larger, read once).
    - in > out (down): y = W x + B z (the sum fuses into the residual add); backward dz = dy B first, then
      dx = [dy | s·dz] [W ; A], so that the adapter's share of the (..., in) dx is never written and added.
    dA = s·dzᵀ x' and dB = dyᵀ z; W gets none. Computed in the autocast dtype where autocast is on, else in x's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, xd: Tensor | None, a: Tensor, b: Tensor, weight: Tensor, scale: float) -> Tensor:
        if weight.requires_grad:
            raise LoRAError("an adapted layer's base weight requires grad: LoRA trains the adapters on a frozen base "
                            "(to train the weights too, merge_lora and fine-tune the merged model)")
        on = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if on else x.dtype
        ctx.dtypes, ctx.dtype, ctx.scale, ctx.dropout = (x.dtype, a.dtype, b.dtype), dtype, scale, xd is not None
        with torch.autocast(x.device.type, enabled=False):
            x, w, b_ = x.to(dtype), weight.to(dtype), b.to(dtype)
            xa = x if xd is None else xd.to(dtype)
            z = F.linear(xa, a.to(dtype)) * scale  # (..., n·rank)
            ctx.save_for_backward(xa, z, a, b, weight)
            if weight.shape[1] <= weight.shape[0]:
                return F.linear(torch.cat([x, z], -1), torch.cat([w, b_], 1))
            return F.linear(x, w) + F.linear(z, b_)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor | None, Tensor, Tensor, None, None]:
        xa, z, a, b, weight = ctx.saved_tensors
        dtype, (out, width) = ctx.dtype, weight.shape
        dy, a_, b_, w = dy.to(dtype), a.to(dtype), b.to(dtype), weight.to(dtype)
        dxa = None  # the gradient of the dropout's output, when there is one
        if width <= out:
            # [B | W], not the forward's [W | B]: a tensor of its own, which a compiled graph builds here again instead
            # of keeping the forward's (the size of the weights) alive until the backward.
            dz, dx = (dy @ torch.cat([b_, w], 1)).split([z.shape[-1], width], -1)  # (..., n·rank), (..., in)
            gz = dz * ctx.scale  # the gradient of A x'
            dxa = gz @ a_
            if not ctx.dropout:
                dx, dxa = dx + dxa, None
        else:
            gz = (dy @ b_) * ctx.scale
            if ctx.dropout:
                dx, dxa = dy @ w, gz @ a_
            else:
                dx = torch.cat([dy, gz], -1) @ torch.cat([w, a_], 0)  # (..., in)
        da = gz.reshape(-1, gz.shape[-1]).T @ xa.reshape(-1, width)  # (n·rank, in)
        db = dy.reshape(-1, out).T @ z.reshape(-1, z.shape[-1])  # (out, n·rank)
        x_dtype, a_dtype, b_dtype = ctx.dtypes
        return (dx.to(x_dtype), None if dxa is None else dxa.to(x_dtype), da.to(a_dtype), db.to(b_dtype), None,
                None)


class LoRALinear(nn.Linear):
    """A frozen nn.Linear (its weight and bias, the same Parameters, under the same names) plus adapters on some of
    its row blocks: lora_A[name] (rank, in) and lora_B[name] (block rows, rank) for each adapted block `name`."""

    def __init__(self, base: nn.Linear, parts: list[tuple[str | None, int]], lora: LoRAConfig) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the base's Parameters are taken as they are
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.parts = parts  # (target or None: not adapted, rows) per row block, in output order
        self.adapted = [name for name, _ in parts if name]  # in output order (a ParameterDict sorts its keys)
        self.rank, self.scale = lora.rank, lora.alpha / lora.rank
        self.lora_dropout = nn.Dropout(lora.dropout)
        kw = {"device": base.weight.device, "dtype": torch.float32}  # adapters in fp32 whatever the base's dtype
        self.lora_A = nn.ParameterDict({name: torch.empty(lora.rank, self.in_features, **kw) for name in self.adapted})
        self.lora_B = nn.ParameterDict({name: torch.zeros(rows, lora.rank, **kw) for name, rows in parts if name})
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's (and nn.Linear's) init; B at zero: no change yet

    def forward(self, x: Tensor) -> Tensor:
        # The A of every adapted block in one matmul, the B of all of them with the base weight (_LoRAMatmul): B
        # block-diagonal (out, n·rank), each block's rows reading its own rank columns (none for a block without
        # adapter). The scale goes on the narrow z, so that the backward scales (..., n·rank) values, not (..., out).
        a = torch.cat([self.lora_A[name] for name in self.adapted])  # (n·rank, in)
        b = torch.block_diag(*[self.lora_B[name] if name else a.new_zeros(rows, 0) for name, rows in self.parts])
        xd = self.lora_dropout(x) if self.training and self.lora_dropout.p > 0 else None
        y = _LoRAMatmul.apply(x, xd, a, b, self.weight, self.scale)  # (..., out)
        return y if self.bias is None else y + self.bias

    def delta_weight(self) -> Tensor:
        """(alpha / rank) B A for every row block (zeros where not adapted): what merging adds to the weight, fp32."""
        return self.scale * torch.cat([self.lora_B[name] @ self.lora_A[name] if name else
                                       self.weight.new_zeros(rows, self.in_features, dtype=torch.float32)
                                       for name, rows in self.parts])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora={[n for n, _ in self.parts if n]}, rank={self.rank}, scale={self.scale}"


def adapted_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRALinear modules by name (transformer.h.<i>.<module>)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_lora(model: nn.Module, lora: LoRAConfig) -> None:
    """Adapters on the targets of lora in every block of model (a GPT), in place; every other parameter frozen."""
    if lora.rank < 1:
        raise LoRAError(f"lora.rank={lora.rank}: adapters need a rank >= 1")
    if adapted_modules(model):
        raise LoRAError("the model has adapters already: merge them first (merge_lora)")
    config: GPTConfig = model.config
    chosen = chosen_targets(config, lora)
    model.requires_grad_(False)
    modules = {TARGETS[config.family][name][0] for name in chosen}
    for block in model.transformer.h:
        for module in sorted(modules):
            parent, attr = block.get_submodule(module.rsplit(".", 1)[0]), module.rsplit(".", 1)[1]
            names = {index: name for name, (m, index) in TARGETS[config.family].items()
                     if m == module and name in chosen}
            parts = [(names.get(i), rows) for i, rows in enumerate(blocks(config, module))]
            setattr(parent, attr, LoRALinear(getattr(parent, attr), parts, lora))


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its weight (W += (alpha / rank) B A, computed in fp32) and make its layer a plain
    nn.Linear again, in place: the model then computes what it did, with no adapter left."""
    for name, m in adapted_modules(model).items():
        parent, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        with torch.no_grad():
            m.weight.copy_(m.weight.float() + m.delta_weight())
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight, plain.bias = m.weight, m.bias
        setattr(parent, attr, plain)


def fingerprint(model: nn.Module) -> int:
    """A CRC32 of the model's frozen weights (the base of its adapters): their names, shapes and dtypes, and up to 1024
    evenly spaced values of each, so that it costs nothing at any size. A checkpoint of adapters records its base's,
    and the base they are loaded onto must match it."""
    crc = 0
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            continue
        values = p.detach().flatten()[:: max(1, p.numel() // 1024)][:1024].to("cpu", torch.float64)
        crc = zlib.crc32(f"{name}{tuple(p.shape)}{p.dtype}".encode(), crc)
        crc = zlib.crc32(values.numpy().tobytes(), crc)
    return crc


def lora_config_of(model: nn.Module) -> LoRAConfig:
    """The LoRAConfig of a model's adapters (add_lora's)."""
    modules = list(adapted_modules(model).values())
    if not modules:
        raise LoRAError("the model has no adapters")
    m = modules[0]
    names = {name for module in modules for name, _ in module.parts if name}
    family = model.config.family
    return LoRAConfig(rank=m.rank, alpha=m.scale * m.rank, dropout=m.lora_dropout.p,
                      targets=[t for t in TARGETS[family] if t in names])


# --- PEFT's format ---


def check_peft_family(config: GPTConfig) -> None:
    """LoRAError unless PEFT's adapter names exist for the model's family."""
    if config.family != "llama":
        raise LoRAError("PEFT adapters are written and read for the llama family (Llama, Qwen2, SmolLM2); GPT-2's "
                        "fused c_attn is one module to PEFT: export a GPT-2 merged instead")


def hf_module(config: GPTConfig, layer: str, target: str) -> str:
    """The Hugging Face module (transformers' name) that a target of block `layer` is part of, e.g.
    model.layers.0.self_attn.q_proj."""
    from model.pretrained import HF_MODULES  # imports huggingface_hub: only for PEFT's format

    check_peft_family(config)
    module, index = TARGETS["llama"][target]
    return f"model.layers.{layer}.{HF_MODULES[module][index]}"


def peft_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters under PEFT's names (base_model.model.<HF module>.lora_A.weight / lora_B.weight), as
    adapter_model.safetensors holds them."""
    state = {}
    for name, m in adapted_modules(model).items():
        layer = re.fullmatch(r"transformer\.h\.(\d+)\..+", name).group(1)
        for target in m.lora_A:
            key = PEFT_PREFIX + hf_module(model.config, layer, target)
            state[f"{key}.lora_A.weight"] = m.lora_A[target].detach()
            state[f"{key}.lora_B.weight"] = m.lora_B[target].detach()
    return state


def from_peft_state(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """PEFT's adapter tensors renamed to ours (transformer.h.<i>.<module>.lora_A.<target>); LoRAError for tensors
    the model's adapters have no place for, or places left empty."""
    ours = {}
    for name, m in adapted_modules(model).items():
        layer = re.fullmatch(r"transformer\.h\.(\d+)\..+", name).group(1)
        for target in m.lora_A:
            key = PEFT_PREFIX + hf_module(model.config, layer, target)
            for kind in ("A", "B"):
                ours[f"{name}.lora_{kind}.{target}"] = f"{key}.lora_{kind}.weight"
    missing, unexpected = sorted(set(ours.values()) - state.keys()), sorted(state.keys() - set(ours.values()))
    params = dict(model.named_parameters())
    shapes = [f"{key} {tuple(state[key].shape)} vs {tuple(params[name].shape)}" for name, key in ours.items()
              if key in state and state[key].shape != params[name].shape]  # another model's widths
    if missing or unexpected or shapes:
        raise LoRAError("the adapter does not fit the model: " + "; ".join(
            f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
            for what, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)) if keys))
    return {name: state[key] for name, key in ours.items()}


def save_adapter(model: nn.Module, out_dir: str | Path, base: str | None = None) -> None:
    """PEFT's adapter directory: adapter_config.json (base: base_model_name_or_path) and adapter_model.safetensors,
    which peft.PeftModel.from_pretrained(<the base as a transformers model>, out_dir) loads."""
    from safetensors.torch import save_file

    lora, out = lora_config_of(model), Path(out_dir)
    modules = sorted({hf_module(model.config, "0", t).rsplit(".", 1)[1] for t in lora.targets})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "inference_mode": True}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in peft_state(model).items()}, out / ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def is_adapter_dir(path: str | Path) -> bool:
    """Whether path is an adapter directory (it holds adapter_config.json), ours or PEFT's."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(adapter_dir: str | Path) -> str | None:
    """The model an adapter directory's adapters belong to (adapter_config.json's base_model_name_or_path: a hub id or
    a path, relative ones from the working directory, as transformers reads it); None where it names none."""
    path = Path(adapter_dir)
    base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or None
    if base is not None and Path(base).resolve() == path.resolve():  # loading it would recurse forever
        raise LoRAError(f"{path}: base_model_name_or_path names this adapter directory itself: set it to the hub id "
                        "or directory of the model its adapters were trained on")
    return base


def adapter_encoding(adapter_dir: str | Path) -> str | None:
    """The tokenizer an adapter directory carries (its tokenizer.json: scripts/export_hf.py --adapter writes the run's,
    PEFT users often save the base's there), as data.encoding names it; None: it has none (use its base's)."""
    path = Path(adapter_dir)
    return str(path.resolve()) if (path / "tokenizer.json").is_file() else None


def read_adapter(adapter_dir: str | Path) -> tuple[LoRAConfig, dict[str, Tensor], str | None]:
    """An adapter directory's LoRAConfig (its targets read from the tensors), PEFT-named tensors and base model
    (base_model_name_or_path); LoRAError for what our adapters cannot express."""
    from safetensors.torch import load_file

    path = Path(adapter_dir)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise LoRAError(f"{path} is no adapter directory: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (PEFT's "
                        "save_pretrained, or scripts/export_hf.py --adapter)")
    config: dict[str, Any] = json.loads((path / ADAPTER_CONFIG).read_text())
    unsupported = [f"{key}={config[key]}" for key, off in
                   (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("rank_pattern", {}),
                    ("alpha_pattern", {}), ("modules_to_save", None), ("layers_to_transform", None))
                   if config.get(key, off) not in (off, None, {}, [])]
    if config.get("peft_type") != "LORA" or unsupported:
        what = ", ".join(unsupported) or f"peft_type={config.get('peft_type')}"
        raise LoRAError(f"{path}: {what} is not supported: plain LoRA adapters only (one rank and alpha)")
    from model.pretrained import HF_MODULES

    state = load_file(path / ADAPTER_WEIGHTS)
    leaves = {key.split(".lora_")[0].rsplit(".", 1)[1] for key in state}  # q_proj, ...
    by_leaf = {HF_MODULES[module][index].rsplit(".", 1)[1]: target
               for target, (module, index) in TARGETS["llama"].items()}
    unknown = sorted(leaves - by_leaf.keys())
    if unknown:
        raise LoRAError(f"{path}: adapters on {', '.join(unknown)}, which our model has no target for")
    lora = LoRAConfig(rank=config["r"], alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0),
                      targets=[by_leaf[leaf] for leaf in sorted(leaves)])
    return lora, state, config.get("base_model_name_or_path")


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> None:
    """Add the adapters of an adapter directory (ours or PEFT's) to a base model, in place (add_lora, then their
    tensors)."""
    lora, state, _ = read_adapter(adapter_dir)
    check_peft_family(model.config)  # before add_lora, whose message would speak of lora.targets
    add_lora(model, lora)
    model.load_state_dict(from_peft_state(model, state), strict=False)
