"""Shared by the GPU tests: the tiny model they build, why a GPU test skips, NCCL's safe settings, and
the report file GPU runs append to."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import torch

from megafleet_engine.models import tiny

SOURCE = "tiny://llama?hidden=256&heads=4&kv_heads=2&intermediate=512"  # head_dim 64, a common kernel shape
MAX_SEQUENCE_LENGTH = 256
NEW_TOKENS = 24
TEXTS = ["hello", "the quick brown fox jumps over", "a", "RL needs token log-probabilities"]
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "needs megatron-core (>= 0.19, Python >= 3.12), which is not installed"
    if not any(importlib.util.find_spec(name) for name in ("flash_attn", "flash_attn_3", "flashattn_hopper")):
        return "needs a flash-attention kernel (FA2 >= 2.7.3, FA3 or FA4) for megatron's dynamic engine"
    return None


GPU_SKIP = _gpu_skip_reason()


def scaled_reference_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny model's weights with q/k (peaked attention) and the output layer (peaked logits)
    scaled up, rounded to bf16 as the backend holds them."""
    weights = tiny.reference_weights(f"{SOURCE}&seed={seed}")
    scaled = {}
    for name, tensor in weights.items():
        factor = 4.0 if ("q_proj" in name or "k_proj" in name) else 10.0 if name == "lm_head.weight" else 1.0
        scaled[name] = (tensor * factor).to(torch.bfloat16)
    return scaled


def report(name: str, **measured: Any) -> None:
    """Append what a test measured to ``$MEGAFLEET_GPU_REPORT`` (when set)."""
    path = os.environ.get("MEGAFLEET_GPU_REPORT")
    if path:
        with open(path, "a") as file:
            file.write(json.dumps({"test": name, **measured}, default=str) + "\n")
