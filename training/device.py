"""Where a run computes and in which precision: the one map of dtype names, and what `auto` resolves to.

    from training.device import DTYPES, resolve_device, resolve_dtype
    device = resolve_device("auto")          # cuda if a GPU is visible, else cpu; also "cpu", "cuda", "cuda:1"
    dtype = resolve_dtype("auto", device)    # bf16 on a GPU that supports it, else fp16 on CUDA; fp32 on CPU

Used by the training loop (train.device, train.dtype), sample.py and the benchmark scripts (--device, --dtype).
`key` names the setting in error messages, so that each says which flag or config key to change.
"""

import torch

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class DeviceError(RuntimeError):
    """A device that is not on this machine (a GPU that is not visible); the message names the setting to change."""

    user_error = True  # train.py prints it as one `error:` line (training/launch.py)


def resolve_device(name: str, key: str = "device") -> torch.device:
    """`auto` (cuda when a GPU is visible, else cpu) or a torch device name; a GPU that is not there is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{key}={name!r} is not a device: use auto, cpu, cuda or cuda:<index>") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{key}={name} but no CUDA GPU is visible: use {key}=auto or {key}=cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"{key}={name} but only {torch.cuda.device_count()} CUDA GPU(s) are visible: "
                              f"use an index below that, or {key}=cuda")
    return device


def resolve_dtype(name: str, device: torch.device, key: str = "dtype") -> torch.dtype:
    """`auto` (bf16 on a CUDA GPU that supports it, else fp16 on CUDA, fp32 on CPU) or a name of DTYPES."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise ValueError(f"unknown {key}={name!r}: choose one of {', '.join(['auto', *DTYPES])}")
    return DTYPES[name]
