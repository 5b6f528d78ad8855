"""Sample text from one of our checkpoints or a Hugging Face model, streaming tokens to stdout as they are produced.

    python sample.py --init-from outputs/2026-11-29/12-00-00        # a run dir (its best.pt, else last.pt) or a .pt
    python sample.py --init-from gpt2 --prompt "Hello, I'm a language model," --num-samples 3 --max-new-tokens 100
    python sample.py --init-from HuggingFaceTB/SmolLM2-135M --prompt "Gravity is" --temperature 0.7 --top-p 0.9
    python sample.py --init-from path/to/hf-dir --prompt-file prompt.txt --temperature 0.8 --top-p 0.95 --seed 7
    python sample.py --init-from gpt2 --temperature 0 --prompt "The capital of France is"          # greedy

The tokenizer defaults to the one the model was trained with: our checkpoint's data.encoding, gpt2 for a Hugging
Face GPT-2, a Llama-family model's own tokenizer.json. An empty prompt starts from the end-of-text token (or the
tokenizer's BOS where it adds one). Generation uses a KV cache (model/generate.py): the prompt is prefilled once,
then each token attends to the cache. A prompt longer than block_size keeps its last block_size tokens, and a
context that outgrows block_size slides (each step then re-runs the last block_size tokens); --no-cache gives the
same tokens, slower. --attention takes any backend of model/attention.py; with triton the decode steps (one query)
run on SDPA, as the kernel handles only Tq == Tk.
"""

import argparse
import sys
from pathlib import Path

import torch

from data import get_encoding, stream_decoder
from model import GPT, GPTConfig
from model.attention import BACKENDS
from model.generate import stream
from model.pretrained import pretrained_encoding
from training.checkpoint import load_checkpoint
from training.device import DTYPES, resolve_device, resolve_dtype


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--init-from", required=True,
                   help="our checkpoint (.pt or run dir), a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a "
                        "Hugging Face hub id (owner/name) or a local Hugging Face model dir (config.json + "
                        "safetensors)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="",
                        help="prompt text; empty: start from the end-of-text token (or the BOS the tokenizer adds)")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens covering p")
    p.add_argument("--seed", type=int, default=1337, help="seeds torch's RNG once, before the first sample")
    p.add_argument("--num-samples", type=int, default=1, help="samples, one after the other, each from the prompt")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bf16 on a GPU that has it, "
                   "else fp16 on CUDA, fp32 on CPU")
    p.add_argument("--attention", choices=list(BACKENDS), default=None,
                   help="attention backend; default: the checkpoint's (ours) or sdpa")
    p.add_argument("--encoding", default=None,
                   help="tokenizer: bytes, gpt2, a tokenizer.json or model dir; default: the model's own")
    p.add_argument("--no-cache", action="store_true", help="re-run the whole context for every token")
    return p.parse_args(argv)


def our_checkpoint(init_from: str) -> Path | None:
    """The checkpoint file init_from means, if it is ours: a file, or a run dir's best.pt (else last.pt)."""
    path = Path(init_from)
    if path.is_file():
        return path
    for name in ("best.pt", "last.pt"):
        if (path / "checkpoints" / name).is_file():
            return path / "checkpoints" / name
    return None


def load_model(init_from: str, attention: str | None) -> tuple[GPT, str]:
    """The model (dropout off) and the encoding it was trained with."""
    checkpoint = our_checkpoint(init_from)
    if checkpoint is None:
        model = GPT.from_pretrained(init_from, **({"attention": attention} if attention else {}))
        return model, pretrained_encoding(init_from)
    state = load_checkpoint(checkpoint)
    overrides = {"attention": attention, "sdpa_backend": "auto"} if attention else {}
    model = GPT(GPTConfig(**{**state["model_config"], "dropout": 0.0, **overrides}))
    model.load_state_dict(state["model"])
    return model, state["config"]["data"]["encoding"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device, key="--device")
    dtype = resolve_dtype(args.dtype, device, key="--dtype")
    model, trained_encoding = load_model(args.init_from, args.attention)
    model = model.to(device=device, dtype=dtype).eval()
    enc = get_encoding(args.encoding or trained_encoding)
    prompt = args.prompt_file.read_text() if args.prompt_file else args.prompt
    ids = enc.encode(prompt, allowed_special="all") or [enc.eot_token]
    if max(ids) >= model.config.vocab_size:
        sys.exit(f"the prompt's token ids reach {max(ids)}, beyond the model's vocabulary of "
                 f"{model.config.vocab_size}: pick the tokenizer it was trained with (--encoding)")
    idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)

    torch.manual_seed(args.seed)
    for i in range(args.num_samples):
        if i:
            print("\n" + "-" * 40)
        print(prompt, end="", flush=True)
        # A token may end inside a UTF-8 character: print only what decodes completely so far.
        decode = stream_decoder(enc, context=ids)
        tokens = stream(model, idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                        use_cache=not args.no_cache)
        for token in tokens:
            print(decode(token.item()), end="", flush=True)
        print(decode.flush())


if __name__ == "__main__":
    main()
