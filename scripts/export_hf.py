"""Export one of our runs (a run dir, a .pt file or a .dcp directory) as a Hugging Face model directory.

AutoModelForCausalLM.from_pretrained(out_dir) gives our logits; AutoTokenizer the run's tokenizer where it had one.

    python scripts/export_hf.py outputs/2026-11-29/12-00-00 exported/       # the run's best checkpoint, else last
    python scripts/export_hf.py outputs/2026-11-29/12-00-00 exported/ --checkpoint last --dtype bf16
    python scripts/export_hf.py path/to/step.pt exported/ --overwrite

Writes config.json + model.safetensors (GPT.save_pretrained) and copies the run's tokenizer.json (data.encoding) with
the other model.pretrained.TOKENIZER_FILES beside it. config.json gets the tokenizer's end-of-text id as eos_token_id,
and init_from's bos/eos/pad_token_id when it was a Hugging Face model on this machine with the same tokenizer (a hub
id only if already cached: nothing is downloaded). tiktoken encodings (bytes, gpt2) have no file to copy: a note says
what to use. --dtype fp32 (default) keeps the trained weights exactly; bf16/fp16 halve the files.
"""

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import HFTokenizer, get_encoding  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.pretrained import GPT2_REPOS, INDEX, TOKENIZER_FILES, WEIGHTS  # noqa: E402
from training.checkpoint import load_checkpoint  # noqa: E402
from training.device import DTYPES  # noqa: E402
from training.resume import CheckpointError, find_checkpoint  # noqa: E402

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a run directory (its best checkpoint, else last), a .pt file or a .dcp dir")
    p.add_argument("out_dir", type=Path, help="the Hugging Face model directory to write")
    p.add_argument("--checkpoint", choices=["best", "last"], default="best", help="which of a run dir's to prefer")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="dtype of the exported weights")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty out_dir")
    return p.parse_args(argv)


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


def tokenizer_export(encoding: str, init_from: str) -> tuple[dict[str, Any], dict[str, Path]]:
    """config.json's token ids and the tokenizer files to copy ({name in out_dir: source}) for the run's tokenizer."""
    enc, ids, files = None, {}, {}
    try:
        enc = get_encoding(encoding)
        ids["eos_token_id"] = enc.eot_token
    except Exception as e:  # moved since training, tiktoken files not downloadable: the weights are still worth it
        print(f"warning: cannot load the run's tokenizer {encoding!r} ({e}): no tokenizer files or eos_token_id "
              "exported", file=sys.stderr)
    if isinstance(enc, HFTokenizer):
        given = Path(encoding).expanduser()  # not resolved: a hub cache's tokenizer.json links into its blobs/
        folder = given if given.is_dir() else given.parent
        files = {"tokenizer.json": folder / "tokenizer.json" if given.is_dir() else given}
        files |= {name: folder / name for name in TOKENIZER_FILES[1:] if (folder / name).is_file()}
    elif encoding == "bytes":
        print("note: the tokenizer is raw UTF-8 bytes (ids 0-255) plus <|endoftext|> = 256, which no Hugging Face "
              "tokenizer file describes: encode with list(text.encode('utf-8'))")
    elif enc is not None or encoding == "gpt2":
        hint = "AutoTokenizer.from_pretrained('gpt2')" if encoding == "gpt2" else f"tiktoken.get_encoding({encoding!r})"
        print(f"note: the tokenizer is tiktoken's {encoding!r}; no tokenizer files are written: use {hint}")
    source, hf = source_config(init_from)
    if source is not None and (enc is not None or encoding == "gpt2"):
        same = (enc.path == source.resolve() / "tokenizer.json" if isinstance(enc, HFTokenizer)
                else encoding == "gpt2" and hf.get("model_type") == "gpt2")
        if same:
            ids |= {key: hf[key] for key in TOKEN_IDS if hf.get(key) is not None}
        else:
            print(f"note: the run's tokenizer is not init_from's ({source}): its token ids are not copied")
    return ids, files


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = args.out_dir
    if out.exists() and not args.overwrite and (not out.is_dir() or any(out.iterdir())):
        sys.exit(f"{out} already exists and is not an empty directory: choose another out_dir or pass --overwrite")
    checkpoint = checkpoint_of(args.run, args.checkpoint)
    try:
        state = load_checkpoint(checkpoint)
    except CheckpointError as e:
        sys.exit(str(e))
    # dropout off, and an attention backend every machine has: neither changes the weights
    model = GPT(GPTConfig(**{**state["model_config"], "dropout": 0.0, "attention": "sdpa", "sdpa_backend": "auto"}))
    model.load_state_dict(state["model"])
    ids, files = tokenizer_export(state["config"]["data"]["encoding"], state["config"].get("init_from", "scratch"))
    model.to(DTYPES[args.dtype]).save_pretrained(str(out), extra_config=ids)
    for name, source in files.items():  # each to a temporary name, then renamed: never a torn file
        shutil.copyfile(source, tmp := out / f".{name}.{os.getpid()}.tmp")
        os.replace(tmp, out / name)
    for stale in (INDEX, *TOKENIZER_FILES):  # left by an earlier export into this directory: not this model's
        if stale not in files and (out / stale).is_file():
            (out / stale).unlink()
            print(f"removed stale {out / stale}")
    with safe_open(out / WEIGHTS, "pt") as f:
        n_params = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    arch, dtype = json.loads((out / "config.json").read_text())["architectures"][0], DTYPES[args.dtype]
    print(f"exported {checkpoint} (step {state['step']}) -> {out}\n  {arch}, {n_params:,} parameters, "
          f"{str(dtype).removeprefix('torch.')}\n  files: {', '.join(['config.json', WEIGHTS, *files])}")
    return out


if __name__ == "__main__":
    main()
