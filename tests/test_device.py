"""training/device.py (CPU; CUDA's presence is faked): `auto` device and dtype, the dtype names, and the errors that
name the setting to change."""

import pytest
import torch
from helpers import make_cfg

from training.device import DTYPES, resolve_device, resolve_dtype
from training.loop import train

CUDA = torch.device("cuda")  # only a name: nothing runs on it


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)


@pytest.mark.parametrize("gpus, expected", [(0, "cpu"), (1, "cuda")])
def test_auto_device_is_cuda_when_a_gpu_is_visible_else_cpu(monkeypatch, gpus, expected):
    fake_gpus(monkeypatch, gpus)
    assert resolve_device("auto") == torch.device(expected)


def test_named_devices_resolve_to_themselves(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert [resolve_device(name) for name in ("cpu", "cuda", "cuda:1")] == [
        torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 1)]


def test_cuda_without_a_gpu_names_the_key_and_the_fix(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(RuntimeError, match=r"^train.device=cuda but no CUDA GPU is visible: use train.device=auto or "
                                           r"train.device=cpu$"):
        resolve_device("cuda", key="train.device")


def test_a_gpu_index_past_the_visible_gpus_is_refused(monkeypatch):
    fake_gpus(monkeypatch, 1)
    with pytest.raises(RuntimeError, match=r"--device=cuda:1 but only 1 CUDA GPU\(s\) are visible"):
        resolve_device("cuda:1", key="--device")


def test_a_name_that_is_no_device_is_refused():
    with pytest.raises(ValueError, match=r"device='gpu' is not a device: use auto, cpu, cuda or cuda:<index>"):
        resolve_device("gpu")


@pytest.mark.parametrize("device, bf16, expected", [(torch.device("cpu"), True, torch.float32),
                                                    (CUDA, True, torch.bfloat16), (CUDA, False, torch.float16)])
def test_auto_dtype_is_bf16_on_a_gpu_with_it_else_fp16_on_cuda_and_fp32_on_cpu(monkeypatch, device, bf16, expected):
    fake_gpus(monkeypatch, 1, bf16=bf16)
    assert resolve_dtype("auto", device) == expected


def test_dtype_names_map_to_torch_dtypes_on_any_device():
    assert DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert all(resolve_dtype(name, device) == dtype for name, dtype in DTYPES.items()
               for device in (torch.device("cpu"), CUDA))


def test_an_unknown_dtype_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown --dtype='bf17': choose one of auto, bf16, fp16, fp32"):
        resolve_dtype("bf17", torch.device("cpu"), key="--dtype")


def test_training_with_cuda_without_a_gpu_fails_naming_the_key(tmp_path, monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(RuntimeError, match="train.device=cuda but no CUDA GPU is visible"):
        train(make_cfg(tmp_path, "train.device=cuda"), tmp_path / "run", root=tmp_path)
    assert not (tmp_path / "run").exists()
