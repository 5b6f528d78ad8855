"""Hugging Face GPT-2 checkpoints into our GPT: hub names or local model directories (config.json + model.safetensors).

    model = GPT.from_pretrained("gpt2")                     # gpt2 | gpt2-medium | gpt2-large | gpt2-xl, cached by HF
    model = GPT.from_pretrained("path/to/dir", block_size=256, dropout=0.1, attention="naive")

The shapes come from the checkpoint's config.json; overrides may only crop block_size (to at most n_positions) and
set dropout, attention and sdpa_backend. The vocabulary is not padded (pad_vocab_multiple=1) so the logits match
Hugging Face's exactly. Every weight is checked: a missing, unexpected or wrongly shaped tensor is an error that
lists the keys, never a weight silently left at its random init. An unreachable hub is a `HubUnavailableError` that
names the local-directory alternative; it fails in seconds (one probe request) rather than after the hub client's
retries.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from model.gpt import GPT, GPTConfig

GPT2_REPOS = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
FILES = ("config.json", "model.safetensors")
OVERRIDABLE = ("block_size", "dropout", "attention", "sdpa_backend")
# GPT-2 stores these projections as Conv1D, weight (in, out); nn.Linear holds (out, in).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# HF's causal-mask buffers, not weights (present in the hub files, absent from newer save_pretrained output).
SKIPPED = (".attn.bias", ".attn.masked_bias")
# config.json settings our model implements only at these values (key: (value, default when absent)).
REQUIRED_SETTINGS: dict[str, tuple[Any, Any]] = {
    "model_type": ("gpt2", None),
    "layer_norm_epsilon": (1e-5, 1e-5),
    "n_inner": (None, None),  # None means 4 * n_embd, our MLP's width
    "scale_attn_weights": (True, True),
    "scale_attn_by_inverse_layer_idx": (False, False),
    "add_cross_attention": (False, False),
    "tie_word_embeddings": (True, True),
}


class PretrainedError(RuntimeError):
    """A pretrained checkpoint that cannot be loaded into our GPT; the message names the offending keys or files."""


class HubUnavailableError(PretrainedError):
    """The Hugging Face Hub cannot be reached (offline, no network, ...) and the model is not in the local cache."""


def resolve(name_or_dir: str | Path) -> Path:
    """The local directory holding config.json + model.safetensors: name_or_dir itself, or a GPT-2 name's snapshot in
    the Hugging Face cache (downloaded there once)."""
    path = Path(name_or_dir)
    if path.is_dir():
        missing = [f for f in FILES if not (path / f).is_file()]
        if missing:
            raise PretrainedError(f"{path} is not a Hugging Face model directory: it lacks {', '.join(missing)}")
        return path
    if str(name_or_dir) not in GPT2_REPOS:
        raise ValueError(f"init_from={str(name_or_dir)!r}: expected 'scratch', one of our checkpoints (.pt), a GPT-2 "
                         f"name ({', '.join(GPT2_REPOS)}) or a local Hugging Face model dir ({' + '.join(FILES)})")
    return _download(GPT2_REPOS[str(name_or_dir)])


def _download(repo_id: str) -> Path:
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import get_session

    def fetch(local_files_only: bool) -> Path:
        paths = [hf_hub_download(repo_id, f, local_files_only=local_files_only) for f in FILES]
        return Path(paths[0]).parent  # one snapshot folder holds both

    try:  # already cached: no network at all
        return fetch(local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    try:
        if constants.HF_HUB_OFFLINE:
            raise ConnectionError("HF_HUB_OFFLINE is set and the files are not in the local cache")
        # One request without retries: when the hub is unreachable the download below would retry for ~25 s.
        get_session().head(constants.ENDPOINT, timeout=10)
        return fetch(local_files_only=False)
    except Exception as e:  # network, HTTP and offline-mode errors alike: the remedy is the same
        raise HubUnavailableError(
            f"cannot download {repo_id} from the Hugging Face Hub ({type(e).__name__}: {e}). Download its "
            f"{' and '.join(FILES)} where the hub is reachable (e.g. `hf download {repo_id} {' '.join(FILES)} "
            f"--local-dir gpt2-dir`), copy that directory here and pass it instead of the name: "
            "init_from=/path/to/gpt2-dir (train.py), --init-from /path/to/gpt2-dir (sample.py) or "
            "GPT.from_pretrained('/path/to/gpt2-dir'); or point HF_HOME at a cache that holds the model."
        ) from e


def config_from_dir(model_dir: Path, **overrides: Any) -> GPTConfig:
    """Our GPTConfig for a Hugging Face GPT-2 directory: its shapes, plus the allowed overrides."""
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"from_pretrained: cannot override {unknown}, the checkpoint fixes the shapes "
                         f"(allowed: {', '.join(OVERRIDABLE)})")
    hf = json.loads((model_dir / "config.json").read_text())
    unsupported = [f"{key}={hf.get(key, default)!r} (need {value!r})" for key, (value, default)
                   in REQUIRED_SETTINGS.items() if hf.get(key, default) != value]
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        unsupported.append(f"activation_function={hf['activation_function']!r} (need the tanh GELU, gelu_new)")
    if unsupported:
        raise PretrainedError(f"{model_dir / 'config.json'} is not a GPT-2 this model implements: "
                              + "; ".join(unsupported))
    n_positions = hf["n_positions"]
    block_size = overrides.pop("block_size", None) or n_positions
    if block_size > n_positions:
        raise ValueError(f"model.block_size={block_size} exceeds the checkpoint's n_positions={n_positions} "
                         "(its position embeddings): use a block_size <= that")
    return GPTConfig(block_size=block_size, vocab_size=hf["vocab_size"], pad_vocab_multiple=1, n_layer=hf["n_layer"],
                     n_head=hf["n_head"], n_embd=hf["n_embd"], bias=True, **overrides)


def pretrained_config(name_or_dir: str | Path, **overrides: Any) -> GPTConfig:
    """The GPTConfig that load_pretrained(name_or_dir, **overrides) builds, without loading the weights."""
    return config_from_dir(resolve(name_or_dir), **overrides)


def convert_state_dict(hf_state: dict[str, torch.Tensor], model: GPT) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 tensors renamed to model's, Conv1D weights transposed, position embeddings cropped to
    block_size, all in fp32. Raises PretrainedError listing missing, unexpected and mis-shaped keys."""
    expected = {name: p.shape for name, p in model.state_dict().items()}
    ours: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, tensor in hf_state.items():
        name = key.removeprefix("transformer.")  # GPT2LMHeadModel's prefix; the hub's gpt2 files have none
        if name.endswith(SKIPPED):
            continue
        if name == "lm_head.weight":  # tied to wte: loaded through it
            continue
        name = f"transformer.{name}"
        if name not in expected:
            unexpected.append(key)
            continue
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        if name == "transformer.wpe.weight":
            tensor = tensor[: model.config.block_size]
        ours[name] = tensor.float().contiguous()
    if "transformer.wte.weight" in ours:
        ours["lm_head.weight"] = ours["transformer.wte.weight"]
    missing = sorted(set(expected) - set(ours))
    shapes = [f"{name}: checkpoint {tuple(ours[name].shape)} vs model {tuple(shape)}"
              for name, shape in expected.items() if name in ours and ours[name].shape != shape]
    problems = [f"{label}: {', '.join(keys)}" for label, keys in
                (("missing", missing), ("unexpected", sorted(unexpected)), ("shape mismatch", shapes)) if keys]
    if problems:
        raise PretrainedError("the checkpoint's weights do not fit GPT-2 of its config.json: " + "; ".join(problems))
    return ours


def load_pretrained(name_or_dir: str | Path, **overrides: Any) -> GPT:
    """GPT with the weights of a GPT-2 name or a local Hugging Face directory (see the module docstring)."""
    model_dir = resolve(name_or_dir)
    with torch.device("meta"):  # shapes only: no random init of weights that are overwritten next
        model = GPT(config_from_dir(model_dir, **overrides))
    state = convert_state_dict(load_file(model_dir / "model.safetensors"), model)
    model.load_state_dict(state, strict=True, assign=True)
    model.lm_head.weight = model.transformer.wte.weight  # assign=True gave the two names separate parameters
    return model
