"""Export one of our runs (a run dir, a .pt file or a .dcp directory) as a Hugging Face model directory.

AutoModelForCausalLM.from_pretrained(out_dir) gives our logits; AutoTokenizer the run's tokenizer where it had one.

    python scripts/export_hf.py outputs/2026-11-29/12-00-00 exported/       # the run's best checkpoint, else last
    python scripts/export_hf.py outputs/2026-11-29/12-00-00 exported/ --checkpoint last --dtype bf16
    python scripts/export_hf.py path/to/step.pt exported/ --overwrite

Writes config.json + model.safetensors (GPT.save_pretrained) and copies the run's tokenizer.json (data.encoding) with
the other model.pretrained.TOKENIZER_FILES beside it; a byte-level run gets a tokenizer.json of the same ids
(data.tokenizers.byte_tokenizer). config.json gets the tokenizer's end-of-text id as eos_token_id, init_from's
bos/eos/pad_token_id when it was a Hugging Face model on this machine with the same tokenizer (a hub id only if
already cached: nothing is downloaded), and the run's data.encoding as flashgpt_encoding (model.pretrained:
ENCODING_KEY), so that sample.py --init-from and train.py init_from=<out_dir> tokenize as the run did. Other tiktoken
encodings (gpt2, ...) have no file to write: a note says what to use. A GPT-2 with grouped-query attention is
exported with its key-value heads repeated (GPT2LMHeadModel has none): the same logits. --dtype fp32 (default) keeps
the trained weights exactly; bf16/fp16 halve the files. out_dir is never one of our run directories.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import HFTokenizer, get_encoding  # noqa: E402
from data.tokenizers import EOT, byte_tokenizer, is_tiktoken  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.pretrained import ENCODING_KEY, GPT2_REPOS, INDEX, TOKENIZER_FILES, WEIGHTS, PretrainedError  # noqa: E402
from training.checkpoint import load_checkpoint  # noqa: E402
from training.device import DTYPES  # noqa: E402
from training.init import RUN_MARKS, is_run_dir  # noqa: E402
from training.resume import CheckpointError, find_checkpoint  # noqa: E402

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
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


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = args.out_dir
    check_out_dir(out, args.overwrite)
    checkpoint = checkpoint_of(args.run, args.checkpoint)
    try:
        state = load_checkpoint(checkpoint)
    except CheckpointError as e:
        sys.exit(str(e))
    # dropout off, and an attention backend every machine has: neither changes the weights
    model = GPT(GPTConfig(**{**state["model_config"], "dropout": 0.0, "attention": "sdpa", "sdpa_backend": "auto"}))
    model.load_state_dict(state["model"])
    extra, files = tokenizer_export(state["config"]["data"]["encoding"], state["config"].get("init_from", "scratch"))
    try:
        model.to(DTYPES[args.dtype]).save_pretrained(str(out), extra_config=extra)
    except PretrainedError as e:  # a setting the Hugging Face architecture cannot express
        sys.exit(f"cannot export {checkpoint}: {e}")
    for name, content in files.items():  # each to a temporary name, then renamed: never a torn file
        (tmp := out / f".{name}.{os.getpid()}.tmp").write_bytes(content)
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
