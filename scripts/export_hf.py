"""Export one of our runs (a run dir, a .pt file or a .dcp directory) as a Hugging Face model directory, or a LoRA
run's adapters as a PEFT adapter directory.

AutoModelForCausalLM.from_pretrained(out_dir) gives our logits; AutoTokenizer the run's tokenizer where it had one.

    python scripts/export_hf.py outputs/2026-11-29/12-00-00 exported/       # the run's best checkpoint, else last
    python scripts/export_hf.py outputs/2026-11-29/12-00-00 exported/ --checkpoint last --dtype bf16
    python scripts/export_hf.py path/to/step.pt exported/ --overwrite
    python scripts/export_hf.py outputs/<lora run> adapter/ --adapter     # PEFT's adapter directory

Writes config.json + model.safetensors (GPT.save_pretrained) and copies the run's tokenizer.json (data.encoding) with
the other model.pretrained.TOKENIZER_FILES beside it; a byte-level run gets a tokenizer.json of the same ids
(data.tokenizers.byte_tokenizer). config.json gets the tokenizer's end-of-text id as eos_token_id, init_from's
bos/eos/pad_token_id when it was a Hugging Face model on this machine with the same tokenizer (a hub id only if
already cached: nothing is downloaded), and the run's data.encoding as flashgpt_encoding (model.pretrained:
ENCODING_KEY), so that sample.py --init-from and train.py init_from=<out_dir> tokenize as the run did. Other tiktoken
encodings (gpt2, ...) have no file to write: a note says what to use. A GPT-2 with grouped-query attention is
exported with its key-value heads repeated (GPT2LMHeadModel has none): the same logits. --dtype fp32 (default) keeps
the trained weights exactly; bf16/fp16 halve the files. out_dir is never one of our run directories.

A LoRA run (lora.rank > 0; its checkpoint holds the adapters alone) exports merged by default: its base (the run's
init_from, which must load here) with the adapters folded into the weights, a plain model as above. --adapter writes
the adapters alone, in fp32, as PEFT's adapter directory (adapter_config.json naming the run's init_from as
base_model_name_or_path, adapter_model.safetensors) with the run's tokenizer files beside them:
peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<init_from>), out_dir) gives our logits, and so do
sample.py --init-from out_dir and train.py init_from=out_dir. It needs no base on this machine; it is for the llama
family (Llama, Qwen2, SmolLM2): to PEFT a GPT-2's fused c_attn is one module, so export a GPT-2 LoRA run merged.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import HFTokenizer, get_encoding  # noqa: E402
from data.tokenizers import EOT, byte_tokenizer, is_tiktoken  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.config import LoRAConfig  # noqa: E402
from model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRAError, add_lora, peft_state, save_adapter  # noqa: E402
from model.pretrained import ENCODING_KEY, GPT2_REPOS, INDEX, TOKENIZER_FILES, WEIGHTS, PretrainedError  # noqa: E402
from training.checkpoint import load_checkpoint  # noqa: E402
from training.device import DTYPES  # noqa: E402
from training.init import RUN_MARKS, checkpoint_model, is_run_dir  # noqa: E402
from training.resume import CheckpointError, find_checkpoint  # noqa: E402

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# What an export writes, either kind: an earlier export's files that this one does not write are removed.
EXPORT_FILES = ("config.json", WEIGHTS, INDEX, *TOKENIZER_FILES, ADAPTER_CONFIG, ADAPTER_WEIGHTS)
# transformers' AutoTokenizer reads byte_tokenizer()'s tokenizer.json with this; decoding must not "clean up" spaces
# (transformers 4 does by default), or " ." would come back as ".".
BYTE_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT,
                         "clean_up_tokenization_spaces": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a run directory (its best checkpoint, else last), a .pt file or a .dcp dir")
    p.add_argument("out_dir", type=Path, help="the Hugging Face model directory to write")
    p.add_argument("--checkpoint", choices=["best", "last"], default="best", help="which of a run dir's to prefer")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="dtype of the exported weights")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty out_dir")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run's adapters alone, as PEFT's adapter directory (default: merged into its base)")
    args = p.parse_args(argv)
    if args.adapter and args.dtype != "fp32":
        p.error(f"argument --dtype: an adapter directory is written in fp32 (it is small; PEFT casts it to the "
                f"model's dtype): drop --dtype {args.dtype}, or export merged")
    return args


def checkpoint_of(path: Path, prefer: str) -> Path:
    """sample.py's rule (a .pt file or .dcp directory, or a run dir's best else last checkpoint), with last first
    when prefer == "last"."""
    found = find_checkpoint(path, names=("best", "last")[:: 1 if prefer == "best" else -1])
    if found is None:
        sys.exit(f"{path} is neither a checkpoint (.pt file, .dcp directory) nor a run directory holding "
                 "checkpoints/best or last")
    return found


def source_config(init_from: str) -> tuple[Path | None, dict[str, Any]]:
    """The Hugging Face model directory the run started from and its config.json, if it is on this machine."""
    if init_from == "scratch" or Path(init_from).suffix == ".pt":
        return None, {}
    try:
        path = Path(init_from)
        if not path.is_dir():  # a GPT-2 name or hub id: only from the local cache, never downloaded
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(GPT2_REPOS.get(init_from, init_from), "config.json")
            if not isinstance(cached, str):
                raise FileNotFoundError("not in the local Hugging Face cache")
            path = Path(cached).parent
        return path, json.loads((path / "config.json").read_text())
    except Exception as e:  # token ids are a convenience: say why they are missing, go on
        print(f"note: init_from={init_from!r} not readable ({type(e).__name__}: {e}): its token ids are not copied")
        return None, {}


def tokenizer_export(encoding: str, init_from: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """config.json's additions (token ids, ENCODING_KEY) and the tokenizer files to write ({name in out_dir:
    content}) for the run's tokenizer."""
    # What our loaders tokenize the export with (model.pretrained: pretrained_encoding): a tiktoken encoding by name,
    # else the tokenizer.json written beside it. Without it a GPT-2 export would be read as tiktoken's gpt2.
    enc, extra, files = None, {ENCODING_KEY: encoding if is_tiktoken(encoding) else "tokenizer.json"}, {}
    try:
        enc = get_encoding(encoding)
        extra["eos_token_id"] = enc.eot_token
    except Exception as e:  # moved since training, tiktoken files not downloadable: the weights are still worth it
        print(f"warning: cannot load the run's tokenizer {encoding!r} ({e}): no tokenizer files or eos_token_id "
              "exported", file=sys.stderr)
    if isinstance(enc, HFTokenizer):
        given = Path(encoding).expanduser()  # not resolved: a hub cache's tokenizer.json links into its blobs/
        folder = given if given.is_dir() else given.parent
        files = {"tokenizer.json": (folder / "tokenizer.json" if given.is_dir() else given).read_bytes()}
        files |= {name: (folder / name).read_bytes() for name in TOKENIZER_FILES[1:] if (folder / name).is_file()}
    elif encoding == "bytes":
        files = {"tokenizer.json": byte_tokenizer().to_str().encode(),
                 "tokenizer_config.json": json.dumps(BYTE_TOKENIZER_CONFIG, indent=2).encode()}
    elif is_tiktoken(encoding):
        hint = "AutoTokenizer.from_pretrained('gpt2')" if encoding == "gpt2" else f"tiktoken.get_encoding({encoding!r})"
        print(f"note: the tokenizer is tiktoken's {encoding!r}; no tokenizer files are written: use {hint} (sample.py "
              f"and train.py read its name from config.json's {ENCODING_KEY})")
    source, hf = source_config(init_from)
    if source is not None and (enc is not None or encoding == "gpt2"):
        same = (enc.path == source.resolve() / "tokenizer.json" if isinstance(enc, HFTokenizer)
                else encoding == "gpt2" and hf.get("model_type") == "gpt2")
        if same:
            extra |= {key: hf[key] for key in TOKEN_IDS if hf.get(key) is not None}
        else:
            print(f"note: the run's tokenizer is not init_from's ({source}): its token ids are not copied")
    return extra, files


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Exit with the fix unless out is a directory the export may write into: new, empty, or (overwrite) holding an
    earlier export; never a file, nor a run directory, whose records an export must not touch."""
    if out.exists() and not out.is_dir():
        sys.exit(f"{out} is a file, not a directory: choose another out_dir")
    if is_run_dir(out):
        sys.exit(f"{out} is a run directory (it holds {' or '.join(f'{m}/' for m in RUN_MARKS)}): an export never "
                 "writes into one, --overwrite or not; choose another out_dir")
    if out.exists() and not overwrite and any(out.iterdir()):
        sys.exit(f"{out} already exists and is not an empty directory: choose another out_dir or pass --overwrite")


def export_config(state: dict[str, Any]) -> GPTConfig:
    """The checkpoint's model with dropout off and an attention backend every machine has: neither changes the
    weights."""
    return GPTConfig(**{**state["model_config"], "dropout": 0.0, "attention": "sdpa", "sdpa_backend": "auto"})


def merged_model(checkpoint: Path, state: dict[str, Any]) -> GPT:
    """The checkpoint's model: its weights, or for a LoRA run its base with the adapters merged into them."""
    try:
        return checkpoint_model(checkpoint, export_config(state), merge=True)
    except CheckpointError as e:  # damaged, or adapters whose base changed
        sys.exit(str(e))
    except (PretrainedError, ValueError) as e:  # a LoRA run's base (its init_from) that does not load here
        if "base" not in state:
            raise
        sys.exit(f"cannot export {checkpoint} merged: its adapters' base, init_from={state['base']['init_from']}, "
                 f"does not load here ({e}); export the adapters alone with --adapter, or make the base available")


def adapter_model(checkpoint: Path, state: dict[str, Any]) -> GPT:
    """A LoRA run's adapters on a model without weights (meta tensors): all that save_adapter reads, so that the
    export needs no base here."""
    if "lora" not in state:
        sys.exit(f"{checkpoint} holds no adapters (its run trained every weight, lora.rank=0): export it without "
                 "--adapter, as a whole model")
    try:
        adapters = load_checkpoint(checkpoint)["model"]  # checked against its CRC32s: the adapters alone, small
    except CheckpointError as e:
        sys.exit(str(e))
    with torch.device("meta"):
        model = GPT(export_config(state))
        add_lora(model, LoRAConfig(**state["lora"]))
    model.load_state_dict(adapters, strict=False, assign=True)  # the adapters' tensors replace their meta ones
    try:
        peft_state(model)  # PEFT's names exist for the llama family only
    except LoRAError as e:
        sys.exit(f"cannot export {checkpoint} as an adapter: {e}")
    return model


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = args.out_dir
    check_out_dir(out, args.overwrite)
    checkpoint = checkpoint_of(args.run, args.checkpoint)
    try:  # its config: the tensors are checked as they load
        state = load_checkpoint(checkpoint, tensors=False, verify=False)
    except CheckpointError as e:
        sys.exit(str(e))
    model = adapter_model(checkpoint, state) if args.adapter else merged_model(checkpoint, state)
    extra, files = tokenizer_export(state["config"]["data"]["encoding"], state["config"].get("init_from", "scratch"))
    if args.adapter:
        save_adapter(model, out, base=state["base"]["init_from"])
        written = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    else:
        try:
            model.to(DTYPES[args.dtype]).save_pretrained(str(out), extra_config=extra)
        except PretrainedError as e:  # a setting the Hugging Face architecture cannot express
            sys.exit(f"cannot export {checkpoint}: {e}")
        written = ["config.json", WEIGHTS]
    for name, content in files.items():  # each to a temporary name, then renamed: never a torn file
        (tmp := out / f".{name}.{os.getpid()}.tmp").write_bytes(content)
        os.replace(tmp, out / name)
    for stale in EXPORT_FILES:  # left by an earlier export into this directory: not this model's
        if stale not in written and stale not in files and (out / stale).is_file():
            (out / stale).unlink()
            print(f"removed stale {out / stale}")
    with safe_open(out / written[1], "pt") as f:
        n_params = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    if args.adapter:
        lora = state["lora"]
        what = (f"LoRA adapters (rank {lora['rank']}, alpha {lora['alpha']:g}, targets {', '.join(lora['targets'])}) "
                f"for {state['base']['init_from']}")
    else:
        what = json.loads((out / "config.json").read_text())["architectures"][0]
    dtype = "float32" if args.adapter else str(DTYPES[args.dtype]).removeprefix("torch.")
    print(f"exported {checkpoint} (step {state['step']}) -> {out}\n  {what}, {n_params:,} parameters, {dtype}\n"
          f"  files: {', '.join([*written, *files])}")
    return out


if __name__ == "__main__":
    main()
