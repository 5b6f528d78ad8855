"""Hugging Face checkpoints in and out of our GPT: GPT-2, Llama and Qwen2 (config.json + safetensors, one file or
shards with their model.safetensors.index.json).

    model = GPT.from_pretrained("gpt2")                          # gpt2 | gpt2-medium | gpt2-large | gpt2-xl
    model = GPT.from_pretrained("HuggingFaceTB/SmolLM2-135M")    # a hub id: Llama, Qwen2 or GPT-2 architecture
    model = GPT.from_pretrained("path/to/dir", block_size=256, dropout=0.1, attention="naive")
    model.save_pretrained("out-dir")                             # transformers' AutoModelForCausalLM loads it

The shapes come from the checkpoint's config.json; overrides may only crop block_size (to at most its positions) and
set dropout, attention, sdpa_backend and loss_chunk_tokens. The vocabulary is not padded (pad_vocab_multiple=1) so
the logits match Hugging Face's exactly; an export drops padded rows. Every weight is checked: a missing, unexpected
or wrongly shaped tensor is an error that lists the keys, never a weight silently left at its random init. An
unreachable hub is a `HubUnavailableError` that names the local-directory alternative; it fails in seconds (one
probe request) rather than after the hub client's retries.

Names: GPT-2's are ours (its Conv1D weights transposed). Llama's q/k/v projections are concatenated into our fused
c_attn and its gate/up projections into our fused c_fc (HF_MODULES); an export splits them again. GPT-2's have one key
and value head per query head: a GPT-2 with grouped-query attention is exported with its key-value heads repeated.
"""

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from model.config import RUN_KEYS, GPTConfig
from model.gpt import GPT

GPT2_REPOS = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# What a model directory may hold besides the weights; an export copies the tokenizer's files from its source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")  # where newer transformers versions keep the chat template
DOWNLOAD = ["config.json", "*.safetensors", INDEX, *TOKENIZER_FILES]
# The config.json key in which scripts/export_hf.py records the run's tokenizer, as data.encoding names it: bytes or a
# tiktoken encoding, which no tokenizer file carries, or "tokenizer.json" for the file beside it.
ENCODING_KEY = "flashgpt_encoding"
OVERRIDABLE = ("block_size", *RUN_KEYS)  # a crop of the positions, and this run's settings (model/config.py)
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "qwen2": "llama"}  # config.json model_type -> our family
# GPT-2 stores these projections as Conv1D, weight (in, out); nn.Linear holds (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# HF's causal-mask buffers, not weights (present in the hub files, absent from newer save_pretrained output).
SKIPPED = (".attn.bias", ".attn.masked_bias")
# GPT-2 config.json settings our model implements only at these values (key: (value, default when absent)).
GPT2_SETTINGS: dict[str, tuple[Any, Any]] = {
    "layer_norm_epsilon": (1e-5, 1e-5),
    "scale_attn_weights": (True, True),
    "scale_attn_by_inverse_layer_idx": (False, False),
    "add_cross_attention": (False, False),
    "tie_word_embeddings": (True, True),
}
# Our module in a Llama block -> the Hugging Face modules it holds, concatenated along the output dimension.
HF_MODULES = {
    "ln_1": ["input_layernorm"],
    "attn.c_attn": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "attn.c_proj": ["self_attn.o_proj"],
    "ln_2": ["post_attention_layernorm"],
    "mlp.c_fc": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.c_proj": ["mlp.down_proj"],
}
LLAMA_TOP = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}


class PretrainedError(RuntimeError):
    """A pretrained checkpoint that cannot be loaded into our GPT; the message names the offending keys or files."""

    user_error = True  # its message names the fix: train.py prints it as one `error:` line (training/launch.py)


class HubUnavailableError(PretrainedError):
    """The Hugging Face Hub cannot be reached (offline, no network, ...) and the model is not in the local cache."""


def resolve(name_or_dir: str | Path) -> Path:
    """The local model directory: name_or_dir itself, or the snapshot of a GPT-2 name or hub id in the Hugging Face
    cache (downloaded there once: config, weights and tokenizer files)."""
    path = Path(name_or_dir)
    if path.is_dir():
        missing = [f for f in ("config.json",) if not (path / f).is_file()]
        if not (path / WEIGHTS).is_file() and not (path / INDEX).is_file():
            missing.append(f"{WEIGHTS} (or {INDEX} with its shards)")
        if missing:
            raise PretrainedError(f"{path} is not a Hugging Face model directory: it lacks {', '.join(missing)}")
        return path
    name = str(name_or_dir)
    if name in GPT2_REPOS:
        return _download(GPT2_REPOS[name])
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and path.suffix not in (".pt", ".dcp"):  # a missing checkpoint is none
        return _download(name)
    raise ValueError(f"init_from={name!r}: expected 'scratch', one of our checkpoints (a .pt file or .dcp directory; "
                     f"relative paths start at {Path.cwd()}), a GPT-2 name "
                     f"({', '.join(GPT2_REPOS)}), a Hugging Face hub id (owner/name) or a local Hugging Face model dir "
                     f"(config.json + {WEIGHTS})")


def _download(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import get_session

    try:  # already cached: no network at all
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        if constants.HF_HUB_OFFLINE:
            raise ConnectionError("HF_HUB_OFFLINE is set and the files are not in the local cache")
        # One request without retries: when the hub is unreachable the download below would retry for ~25 s.
        get_session().head(constants.ENDPOINT, timeout=10)
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD))
    except Exception as e:  # network, HTTP and offline-mode errors alike: the remedy is the same
        raise HubUnavailableError(
            f"cannot download {repo_id} from the Hugging Face Hub ({type(e).__name__}: {e}). Download its "
            f"config.json, safetensors and tokenizer files where the hub is reachable (e.g. `hf download {repo_id} "
            "--local-dir model-dir`), copy that directory here and pass it instead of the name: "
            "init_from=/path/to/model-dir (train.py), --init-from /path/to/model-dir (sample.py) or "
            "GPT.from_pretrained('/path/to/model-dir'); or point HF_HOME at a cache that holds the model."
        ) from e


def config_from_dir(model_dir: Path, **overrides: Any) -> GPTConfig:
    """Our GPTConfig for a Hugging Face model directory: its shapes, plus the allowed overrides."""
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"from_pretrained: cannot override {unknown}, the checkpoint fixes the shapes "
                         f"(allowed: {', '.join(OVERRIDABLE)})")
    hf = json.loads((model_dir / "config.json").read_text())
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise PretrainedError(f"{model_dir / 'config.json'}: model_type={model_type!r} is not an architecture this "
                              f"model implements ({', '.join(MODEL_TYPES)})")
    shapes, unsupported = (_gpt2_config if model_type == "gpt2" else _llama_config)(hf)
    if unsupported:
        raise PretrainedError(f"{model_dir / 'config.json'} is not a {model_type} this model implements: "
                              + "; ".join(unsupported))
    positions = shapes.pop("block_size")
    block_size = overrides.pop("block_size", None) or positions
    if block_size > positions:
        raise ValueError(f"model.block_size={block_size} exceeds the checkpoint's {positions} positions "
                         f"(n_positions / max_position_embeddings): use a block_size <= that")
    return GPTConfig(block_size=block_size, pad_vocab_multiple=1, **shapes, **overrides)


def _gpt2_config(hf: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    unsupported = [f"{key}={hf.get(key, default)!r} (need {value!r})" for key, (value, default)
                   in GPT2_SETTINGS.items() if hf.get(key, default) != value]
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        unsupported.append(f"activation_function={hf['activation_function']!r} (need the tanh GELU, gelu_new)")
    shapes = dict(family="gpt2", block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                  n_head=hf["n_head"], n_embd=hf["n_embd"], intermediate_size=hf.get("n_inner"), bias=True)
    return shapes, unsupported


def _llama_config(hf: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    unsupported = []
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf['hidden_act']!r} (need silu)")
    if hf.get("head_dim") not in (None, n_embd // n_head):
        unsupported.append(f"head_dim={hf['head_dim']} (need hidden_size / num_attention_heads = {n_embd // n_head})")
    if hf.get("use_sliding_window"):
        unsupported.append("use_sliding_window=true (need full attention)")
    # transformers >= 5 writes rope_parameters; older config.json files rope_theta and rope_scaling.
    rope = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e4)}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = {"rope_type": "llama3", **{k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                                   "original_max_position_embeddings")}}
    elif rope_type != "default":
        unsupported.append(f"rope type {rope_type!r} (need default or llama3)")
    if hf["model_type"] == "qwen2":  # biases on q, k and v only
        bias, qkv_bias = False, True
    else:
        bias = qkv_bias = bool(hf.get("attention_bias", False))
        if hf.get("mlp_bias", False) != bias:
            unsupported.append(f"attention_bias={bias} with mlp_bias={hf.get('mlp_bias')} (need both equal)")
    shapes = dict(family="llama", block_size=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                  n_layer=hf["num_hidden_layers"], n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
                  n_embd=n_embd, intermediate_size=hf["intermediate_size"], rope_theta=float(rope["rope_theta"]),
                  rope_scaling=scaling, norm_eps=hf.get("rms_norm_eps", 1e-6), bias=bias, qkv_bias=qkv_bias,
                  tie_embeddings=hf.get("tie_word_embeddings", False))
    return shapes, unsupported


def pretrained_encoding(model_dir: Path) -> str:
    """The tokenizer a pretrained model (its directory, from `resolve`) was trained with, as data.encoding names it:
    the one our export recorded (ENCODING_KEY), else tiktoken's gpt2 for GPT-2, else the model directory (its
    tokenizer.json, read by data/tokenizers.py)."""
    hf = json.loads((model_dir / "config.json").read_text())
    encoding = hf.get(ENCODING_KEY) or ("gpt2" if hf.get("model_type") == "gpt2" else "tokenizer.json")
    if encoding != "tokenizer.json":
        return encoding
    if not (model_dir / "tokenizer.json").is_file():
        raise PretrainedError(f"{model_dir} has no tokenizer.json: set the tokenizer yourself with data.encoding="
                              "<path to a tokenizer.json or a model dir that holds one> (sample.py: --encoding)")
    return str(model_dir.resolve())


def hf_names(name: str, config: GPTConfig) -> list[str]:
    """The Hugging Face tensors that make up our tensor `name` (concatenated along dim 0, in this order)."""
    if config.family == "gpt2":
        return [name]
    if name in LLAMA_TOP:
        return [LLAMA_TOP[name]]
    layer, module, kind = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)", name).groups()
    return [f"model.layers.{layer}.{hf}.{kind}" for hf in HF_MODULES[module]]


def ours(model: GPT) -> dict[str, torch.Size]:
    """The model's tensors that a checkpoint holds: a tied LM head is the token embedding."""
    return {name: p.shape for name, p in model.state_dict().items()
            if not (name == "lm_head.weight" and model.config.tie_embeddings)}


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's model.safetensors, or of the shards its index lists."""
    if (model_dir / WEIGHTS).is_file():
        return load_file(model_dir / WEIGHTS)
    shards = sorted(set(json.loads((model_dir / INDEX).read_text())["weight_map"].values()))
    return {name: t for shard in shards for name, t in load_file(model_dir / shard).items()}


def convert_state_dict(hf_state: dict[str, torch.Tensor], model: GPT) -> dict[str, torch.Tensor]:
    """Hugging Face tensors renamed to model's (fused where ours are fused, GPT-2's Conv1D weights transposed,
    position embeddings cropped to block_size), all in fp32. Raises PretrainedError listing missing, unexpected and
    mis-shaped keys."""
    config = model.config
    if config.family == "gpt2":  # GPT2LMHeadModel's names start with transformer.; the hub's gpt2 files' do not
        hf_state = {(k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): t
                    for k, t in hf_state.items() if not k.endswith(SKIPPED)}
    expected, state, missing, used = ours(model), {}, [], set()
    for name in expected:
        parts = hf_names(name, config)
        missing += [p for p in parts if p not in hf_state]
        if any(p not in hf_state for p in parts):
            continue
        used.update(parts)
        tensor = torch.cat([hf_state[p] for p in parts]) if len(parts) > 1 else hf_state[parts[0]]
        if config.family == "gpt2" and name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        if name == "transformer.wpe.weight":
            tensor = tensor[: config.block_size]
        state[name] = tensor.float().contiguous()
    tied_head = {"lm_head.weight"} if config.tie_embeddings else set()  # a copy of the embedding, if present
    unexpected = sorted(set(hf_state) - used - tied_head)
    shapes = [f"{name}: checkpoint {tuple(t.shape)} vs model {tuple(expected[name])}"
              for name, t in state.items() if t.shape != expected[name]]
    problems = [f"{label}: {', '.join(keys)}" for label, keys in
                (("missing", sorted(missing)), ("unexpected", unexpected), ("shape mismatch", shapes)) if keys]
    if problems:
        raise PretrainedError(f"the checkpoint's weights do not fit the {config.family} model of its config.json: "
                              + "; ".join(problems))
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def load_pretrained(name_or_dir: str | Path, **overrides: Any) -> GPT:
    """GPT with the weights of a GPT-2 name, hub id or local Hugging Face directory (see the module docstring)."""
    model_dir = resolve(name_or_dir)
    return load_from_dir(model_dir, config_from_dir(model_dir, **overrides))


def load_from_dir(model_dir: Path, config: GPTConfig) -> GPT:
    """GPT of config (config_from_dir's, maybe with other run settings) with the weights of model_dir."""
    with torch.device("meta"):  # shapes only: no random init of weights that are overwritten next
        model = GPT(config)
    state = convert_state_dict(load_weights(model_dir), model)
    model.load_state_dict(state, strict=True, assign=True)
    if model.config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight  # assign=True gave the two names separate parameters
    return model


def hf_config(config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of our config: GPT2LMHeadModel, LlamaForCausalLM, or Qwen2ForCausalLM when only q/k/v have
    biases. Raises PretrainedError for settings those architectures cannot express."""
    c, torch_dtype = config, str(dtype).removeprefix("torch.")
    if c.family == "gpt2":  # grouped-query attention is exported with its key-value heads repeated (_all_heads)
        if not c.tie_embeddings or c.qkv_bias != c.bias:
            raise PretrainedError(f"GPT2LMHeadModel cannot hold this GPT-2 model (tie_embeddings={c.tie_embeddings}, "
                                  f"qkv_bias={c.qkv_bias}, bias={c.bias}): a GPT-2 export needs tie_embeddings=true "
                                  "and qkv_bias == bias")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
                "n_positions": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head,
                "n_inner": c.mlp_width, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "tie_word_embeddings": True, "torch_dtype": torch_dtype}
    common = {"vocab_size": c.vocab_size, "hidden_size": c.n_embd, "intermediate_size": c.mlp_width,
              "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
              "hidden_act": "silu", "max_position_embeddings": c.block_size, "rms_norm_eps": c.norm_eps,
              "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "tie_word_embeddings": c.tie_embeddings,
              "torch_dtype": torch_dtype}
    if c.qkv_bias and not c.bias:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False, **common}
    if c.qkv_bias != c.bias:
        raise PretrainedError("a Llama export needs qkv_bias == bias (Llama's attention_bias covers q, k, v and o)")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": c.head_dim,
            "attention_bias": c.bias, "mlp_bias": c.bias, **common}


def save_pretrained(model: GPT, out_dir: str | Path, extra_config: dict[str, Any] | None = None) -> None:
    """Write config.json + model.safetensors of model into out_dir (see GPT.save_pretrained). Each file is written
    to a temporary name and renamed, so an interrupted export never leaves a torn file."""
    config, out = model.config, Path(out_dir)
    dtype = model.transformer.wte.weight.dtype
    hf = {**hf_config(config, dtype), **(extra_config or {})}
    tensors, kept = {}, ours(model)
    for name, t in model.state_dict().items():
        if name not in kept:
            continue
        if name in ("transformer.wte.weight", "lm_head.weight"):
            t = t[: config.vocab_size]  # padded rows are never produced by the tokenizer
        if config.family == "gpt2" and ".attn.c_attn." in name:
            t = _all_heads(t, config)
        if config.family == "gpt2" and name.endswith(CONV1D_WEIGHTS):
            t = t.t()
        parts = hf_names(name, config)
        if len(parts) == 3:  # llama's fused q, k, v
            pieces = t.split([config.n_head * config.head_dim] + [config.n_kv_head * config.head_dim] * 2)
        else:  # one tensor, or llama's fused gate and up
            pieces = t.chunk(len(parts))
        for part, piece in zip(parts, pieces, strict=True):
            tensors[part] = piece.detach().to("cpu").contiguous().clone()
    if config.family == "gpt2" and not config.bias:  # GPT2LMHeadModel always has biases: zeros are exact
        for name, t in list(tensors.items()):
            bias = name.removesuffix(".weight") + ".bias"
            if name.endswith(".weight") and name not in ("transformer.wte.weight", "transformer.wpe.weight"):
                tensors[bias] = t.new_zeros(t.size(-1) if name.endswith(CONV1D_WEIGHTS) else t.size(0))
    out.mkdir(parents=True, exist_ok=True)
    _atomic(out / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    _atomic(out / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(hf, indent=2) + "\n"))


def _all_heads(t: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """GPT-2's c_attn (weight or bias, output rows first) with a key and a value head per query head, as
    GPT2LMHeadModel holds it: each of our n_kv_head key-value heads repeated for the query heads it serves (as
    attention repeats it), which computes the same."""
    hs, group = config.head_dim, config.n_head // config.n_kv_head
    q, k, v = t.split([config.n_head * hs, config.n_kv_head * hs, config.n_kv_head * hs])
    return torch.cat([q, *(x.unflatten(0, (config.n_kv_head, hs)).repeat_interleave(group, 0).flatten(0, 1)
                           for x in (k, v))])


def _atomic(path: Path, write: Any) -> None:
    """write(tmp), flushed to disk, then renamed over path: readers see the old file or the new one, never a torn
    one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(str(tmp))
        os.chmod(tmp, 0o644)  # safetensors creates its files readable by their owner only
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
