"""Sample text from one of our checkpoints or a Hugging Face model, streaming tokens to stdout as they are produced.

    python sample.py --init-from outputs/2026-11-29/12-00-00        # a run dir (its best, else last) or a checkpoint
    python sample.py --init-from gpt2 --prompt "Hello, I'm a language model," --num-samples 3 --max-new-tokens 100
    python sample.py --init-from HuggingFaceTB/SmolLM2-135M --prompt "Gravity is" --temperature 0.7 --top-p 0.9
    python sample.py --init-from path/to/hf-dir --prompt-file prompt.txt --temperature 0.8 --top-p 0.95 --seed 7
    python sample.py --init-from gpt2 --temperature 0 --prompt "The capital of France is"          # greedy
    python sample.py --init-from gpt2 --prompt "Once upon a time" --prompt "In 1905," --num-samples 4  # 8 rows
    python sample.py --init-from outputs/<lora run> --merge            # a LoRA run: its base + adapters, merged
    python sample.py --init-from HuggingFaceTB/SmolLM2-135M --adapter path/to/adapter   # a PEFT adapter directory
    python sample.py --init-from path/to/adapter                # on the base its adapter_config.json names

The tokenizer defaults to the one the model was trained with: our checkpoint's data.encoding, the one the config.json
of our export records (scripts/export_hf.py), gpt2 for a Hugging Face GPT-2, a Llama-family model's own
tokenizer.json. An empty prompt starts from the end-of-text token (or the tokenizer's BOS where it adds one). Every
prompt (--prompt may be given several times) times --num-samples makes one row of a single batch, generated together;
one row streams as it is produced, several are printed when done.
LoRA: a LoRA run's checkpoint (its adapters alone) generates from its base (the run's init_from) with the adapters
beside the weights, or folded into them with --merge (the same tokens). --adapter adds a PEFT adapter directory (ours,
scripts/export_hf.py --adapter, or one PEFT wrote) to the model --init-from names; an adapter directory as --init-from
goes on the base its adapter_config.json names (base_model_name_or_path). The tokenizer is the adapter directory's
tokenizer.json where it holds one, else its base's.
Generation uses a static KV cache (model/generate.py): the prompts are prefilled once, then each token attends to its
row's cache, on a GPU in a replayed CUDA graph (--compile fuses its kernels first: faster steps, a slower start). A
prompt longer than block_size keeps its last block_size tokens, and a context that outgrows block_size slides (each
step then re-runs the last block_size tokens); --no-cache gives the same tokens, slower. --attention takes any
backend of model/attention.py; with triton the prefill runs on our FlashAttention kernel and the decode steps on our
decode kernel. SDPA picks its own kernel here, even for a checkpoint trained with one pinned
(attention.sdpa_backend): the pinned kernel may not exist on the machine that samples.

A bad argument is a usage error (exit status 2, `sample.py: error: ...` naming the flag): a count below 1, a sampling
setting out of range, a missing prompt file, a device that is not there, the triton backend off a GPU or a tokenizer
that does not exist, or an --adapter that is no adapter directory we read, found before the model loads; a model that
cannot be found or read (a corrupt checkpoint, a run directory without one, a LoRA run's base that is not here), an
adapter that does not fit it, or a tokenizer that does not fit it, once it does.
"""

import argparse
import math
from pathlib import Path

import tiktoken
import torch

from data import DataUnavailableError, Encoding, get_encoding, stream_decoder
from data.tokenizers import tokenizer_file
from kernels import env
from model import GPT, GPTConfig
from model.attention import BACKENDS
from model.generate import stream
from model.lora import LoRAError, adapter_base, adapter_encoding, is_adapter_dir, load_adapter, merge_lora, read_adapter
from model.pretrained import GPT2_REPOS, PretrainedError, pretrained_encoding, resolve
from training.checkpoint import load_checkpoint
from training.device import DTYPES, resolve_device, resolve_dtype
from training.init import checkpoint_model, is_run_dir
from training.resume import CheckpointError, find_checkpoint

# The loaders sample.py shares with train.py word their errors for train.py's config keys (init_from=,
# data.encoding=): sample.py checks its own arguments first, so that a mistake names the flag to change.
TOKENIZERS = (f"bytes, a tiktoken encoding ({', '.join(tiktoken.list_encoding_names())}), a tokenizer.json or a "
              "model directory holding one")


class UsageError(Exception):
    """A bad argument found only once the model is known: reported as argparse reports the others."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def sampling_temperature(text: str) -> float:
    """argparse type: a finite float >= 0 (0: greedy)."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: greedy), got {text}")
    return value


def probability(text: str) -> float:
    """argparse type: a float in (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def encoding_name(text: str) -> str:
    """argparse type: a tokenizer that exists (whether its file parses is found when it loads)."""
    try:
        tokenizer_file(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no tokenizer here: use {TOKENIZERS}") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sample.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--init-from", required=True,
                   help="our checkpoint (.pt or run dir, a LoRA run's too), a GPT-2 name (gpt2, gpt2-medium, "
                        "gpt2-large, gpt2-xl), a Hugging Face hub id (owner/name), a local Hugging Face model dir "
                        "(config.json + safetensors) or a PEFT adapter dir (on the base its adapter_config.json names)")
    p.add_argument("--adapter", default=None,
                   help="a PEFT adapter dir (adapter_config.json + adapter_model.safetensors) added to the model "
                        "--init-from names")
    p.add_argument("--merge", action="store_true",
                   help="fold the adapters (a LoRA run's, --adapter's) into the weights before generating")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append",
                        help="prompt text, may be repeated (one batch); empty: start from the end-of-text token (or "
                             "the BOS the tokenizer adds)")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=sampling_temperature, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=probability, default=None,
                   help="sample among the most likely tokens covering p, in (0, 1]")
    p.add_argument("--seed", type=int, default=1337, help="seeds torch's RNG once, before the first sample")
    p.add_argument("--num-samples", type=positive_int, default=1,
                   help="samples of each prompt, generated together in one batch")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bf16 on a GPU that has it, "
                   "else fp16 on CUDA, fp32 on CPU")
    p.add_argument("--attention", choices=list(BACKENDS), default=None,
                   help="attention backend; default: the checkpoint's (ours) or sdpa")
    p.add_argument("--encoding", type=encoding_name, default=None,
                   help="tokenizer: bytes, gpt2, a tokenizer.json or model dir; default: the model's own")
    p.add_argument("--no-cache", action="store_true", help="re-run the whole context for every token")
    p.add_argument("--compile", action="store_true",
                   help="fuse the decode step with torch.compile before capturing it (GPU; faster steps, slower start)")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """What parsing cannot check by itself, before any model loads (no network either): exits with usage on a
    mistake. args.device becomes the torch.device it names."""
    if args.prompt_file is not None and args.prompt_file.is_dir():
        p.error(f"argument --prompt-file: {args.prompt_file} is a directory: name a text file")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        p.error(f"argument --prompt-file: no such file: {args.prompt_file}")
    if args.adapter is not None:
        try:  # its files and settings, before the base model loads (its tensors are small)
            read_adapter(args.adapter)
        except LoRAError as e:
            p.error(f"argument --adapter: {e}")
    try:
        args.device = resolve_device(args.device, key="--device")  # its messages name the flag they are given
        if args.attention is not None:
            check_attention(args.attention, args.device, given=True)
    except (ValueError, RuntimeError, UsageError) as e:
        p.error(str(e))
    return args


def check_attention(attention: str, device: torch.device, given: bool) -> None:
    """UsageError for the triton backend off a GPU: our kernels run on CPU tensors only through Triton's interpreter
    (TRITON_INTERPRET=1)."""
    if attention == "triton" and device.type != "cuda" and not env.INTERPRET:
        whose = "triton" if given else "the checkpoint's backend, triton,"
        raise UsageError(f"argument --attention: {whose} runs our kernels on a CUDA GPU, not on {device} (there only "
                         "under TRITON_INTERPRET=1, slowly): use --attention sdpa, or --device cuda")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    return check_args(p, p.parse_args(argv))


def our_checkpoint(init_from: str) -> Path | None:
    """The checkpoint init_from means, if it is ours: a .pt file or .dcp directory, or a run dir's best (else last)."""
    return find_checkpoint(init_from, names=("best", "last"))


def load_model(init_from: str, attention: str | None, encoding: str | None, adapter: str | None = None,
               merge: bool = False) -> tuple[GPT, str]:
    """The model (dropout off) and its encoding: `encoding`, else the one it was trained with (with an adapter: its
    directory's tokenizer.json, else its base's). adapter: an adapter directory added to the model init_from names
    (merged first if it has adapters of its own); an adapter directory as init_from goes on the base it names.
    merge: every adapter folded into the weights."""
    if adapter is not None:  # on the model init_from names, its own adapters merged: one set at a time
        model, encoding = load_model(init_from, attention, encoding or adapter_encoding(adapter), merge=True)
        add_adapter(model, adapter, "--adapter")
    elif is_adapter_dir(init_from):
        base = adapter_base_of(init_from)
        try:
            model, encoding = load_model(base, attention, encoding or adapter_encoding(init_from), merge=True)
        except UsageError as e:  # the base is named in the adapter's config, not on the command line
            raise UsageError(f"{e} (the base model that {init_from}'s adapter_config.json names: pass the base as "
                             f"--init-from and the adapter as --adapter {init_from})") from None
        add_adapter(model, init_from, "--init-from")
    else:
        model, encoding = load_named(init_from, attention, encoding)
    if merge:
        merge_lora(model)
    return model, encoding


def adapter_base_of(adapter_dir: str) -> str:
    """The base model an adapter directory given as --init-from names; UsageError where it names none."""
    try:
        base = adapter_base(adapter_dir)
    except LoRAError as e:
        raise UsageError(f"argument --init-from: {e}") from None
    if base is None:
        raise UsageError(f"argument --init-from: {adapter_dir}'s adapter_config.json names no base model "
                         f"(base_model_name_or_path): pass the base as --init-from and the adapter as --adapter "
                         f"{adapter_dir}")
    return base


def add_adapter(model: GPT, adapter_dir: str, flag: str) -> None:
    """The adapters of adapter_dir on model; UsageError naming flag for an adapter of another model."""
    try:
        load_adapter(model, adapter_dir)
    except LoRAError as e:
        raise UsageError(f"argument {flag}: {e}") from None


def load_named(init_from: str, attention: str | None, encoding: str | None) -> tuple[GPT, str]:
    """The model of our checkpoint (a LoRA run's: its base with its adapters, unmerged) or of a Hugging Face model,
    dropout off, and its encoding: `encoding`, else the one it was trained with."""
    checkpoint = our_checkpoint(init_from)
    if checkpoint is None:
        if is_run_dir(init_from):
            raise UsageError(f"argument --init-from: {init_from} is a run directory without checkpoints (no "
                             "checkpoints/best or last .pt or .dcp): give a run that saved one, or a checkpoint")
        try:  # a local directory, or the snapshot of a GPT-2 name or hub id (downloaded once)
            model_dir = resolve(init_from)
        except ValueError:  # none of those; resolve's message speaks of train.py's init_from
            raise UsageError(f"argument --init-from: {init_from!r} is no file or directory here, nor a GPT-2 name "
                             f"({', '.join(GPT2_REPOS)}) or a Hugging Face hub id (owner/name)") from None
        except PretrainedError as e:  # a directory that is no model, an unreachable hub
            raise UsageError(f"argument --init-from: {e}") from None
        try:
            model = GPT.from_pretrained(str(model_dir), **({"attention": attention} if attention else {}))
            return model, encoding or pretrained_encoding(model_dir)
        except PretrainedError as e:  # an architecture or weights that are not ours, no tokenizer
            raise UsageError(f"argument --init-from: {e}") from None
    try:
        state = load_checkpoint(checkpoint, tensors=False, verify=False)  # its config: checkpoint_model checks it
        # SDPA picks its own kernel: one pinned for training (attention.sdpa_backend) may not run where this samples.
        overrides = {"dropout": 0.0, "sdpa_backend": "auto", **({"attention": attention} if attention else {})}
        model = checkpoint_model(checkpoint, GPTConfig(**{**state["model_config"], **overrides}))
    except CheckpointError as e:  # truncated, empty, not ours (a bare state dict), adapters on another base
        raise UsageError(f"argument --init-from: {e}") from None
    except (PretrainedError, ValueError) as e:  # a LoRA run's base (its init_from) that does not load here
        if "base" not in state:
            raise
        raise UsageError(f"argument --init-from: {checkpoint} holds adapters on init_from={state['base']['init_from']}"
                         f", which does not load here: {e}") from None
    return model, encoding or state["config"]["data"]["encoding"]


def prepare(args: argparse.Namespace) -> tuple[GPT, Encoding, list[str], list[list[int]]]:
    """The model on its device, its tokenizer, the prompts and their token ids; UsageError for a model that cannot
    be found, or a tokenizer that is missing or does not fit the model."""
    prompts = [args.prompt_file.read_text()] if args.prompt_file else args.prompt or [""]
    model, encoding = load_model(args.init_from, args.attention, args.encoding, args.adapter, args.merge)
    if args.attention is None:  # the checkpoint's backend (--attention was checked before loading)
        check_attention(model.config.attention, args.device, given=False)
    if args.encoding is None:
        try:  # a tokenizer recorded by training (a Hugging Face cache folder) may not exist on this machine
            tokenizer_file(encoding)
        except ValueError:
            raise UsageError(f"the model's tokenizer {encoding!r} is not on this machine: pass --encoding "
                             f"({TOKENIZERS})") from None
    try:
        enc = get_encoding(encoding)
    except (ValueError, DataUnavailableError) as e:  # a file that is no tokenizer.json, tiktoken's files offline
        raise UsageError(f"the tokenizer {encoding!r} does not load: {e}") from None
    ids = [enc.encode(prompt, allowed_special="all") or [enc.eot_token] for prompt in prompts]
    top = max(max(row) for row in ids)
    if top >= model.config.vocab_size:
        raise UsageError(f"the prompt's token ids reach {top}, beyond the model's vocabulary of "
                         f"{model.config.vocab_size}: pick the tokenizer it was trained with (--encoding)")
    dtype = resolve_dtype(args.dtype, args.device, key="--dtype")
    return model.to(device=args.device, dtype=dtype).eval(), enc, prompts, ids


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = check_args(p, p.parse_args(argv))
    try:
        model, enc, prompts, ids = prepare(args)
    except UsageError as e:
        p.error(str(e))
    # Every prompt num_samples times, right-padded into one batch (B, longest prompt) with each row's length.
    rows = [(prompt, row) for prompt, row in zip(prompts, ids, strict=True) for _ in range(args.num_samples)]
    idx = torch.nn.utils.rnn.pad_sequence([torch.tensor(row) for _, row in rows], batch_first=True).to(args.device)
    torch.manual_seed(args.seed)
    tokens = stream(model, idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                    use_cache=not args.no_cache, lengths=[len(row) for _, row in rows], compile=args.compile)
    if len(rows) == 1:  # stream the one sample as it is produced
        prompt, row = rows[0]
        print(prompt, end="", flush=True)
        # A token may end inside a UTF-8 character: print only what decodes completely so far.
        decode = stream_decoder(enc, context=row)
        for token in tokens:
            print(decode(token.item()), end="", flush=True)
        print(decode.flush())
        return
    new = torch.cat(list(tokens), dim=1).tolist()  # (B, max_new_tokens)
    for i, ((prompt, row), sample) in enumerate(zip(rows, new, strict=True)):
        if i:
            print("\n" + "-" * 40)
        decode = stream_decoder(enc, context=row)
        print(prompt + "".join(decode(t) for t in sample) + decode.flush())


if __name__ == "__main__":
    main()
