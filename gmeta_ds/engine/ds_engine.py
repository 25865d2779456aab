"""The one adapter to ``deepspeed``: build the engine, checksums, consolidated weights.

DeepSpeed owns the dense `MetaLearner` only: its optimizer state (and gradients in ZeRO-2)
is partitioned across ranks; gradient accumulation over micro-batches and the averaged
reduction across ranks are DeepSpeed's. The outer loss of each micro-batch goes through
``engine.backward`` — never a plain ``.backward()`` — so its scaling (1/GAS, mean over
ranks, loss scaling in fp16) is DeepSpeed's.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def initialize(module: nn.Module, ds_config: dict):
    """``deepspeed.initialize`` on the dense module; returns the engine."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=ds_config)
    return engine


def checksums(module: nn.Module, embedding_prefix: str = "net.embedding.") -> tuple[float, float]:
    """(dense, embedding) float64 sums over all parameters of the (replicated) module."""
    dense = embedding = 0.0
    for name, p in module.named_parameters():
        value = p.detach().double().sum().item()
        if name.startswith(embedding_prefix):
            embedding += value
        else:
            dense += value
    return dense, embedding


def save_weights(state: dict, path: str | Path) -> Path:
    """Write a full state dict as safetensors (float32), atomically (tmp file + rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    state = {k: v.detach().float().contiguous().cpu() for k, v in state.items()}
    save_file(state, str(tmp))
    os.replace(tmp, path)
    return path


def load_weights(module: nn.Module, path: str | Path) -> None:
    """Load weights written by `save_weights`; a missing file or mismatched names is an error
    naming the file."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist (train first, or pass "
                                "--weights to the file written by gmeta-ds train)")
    state = load_file(str(path))
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model built from the config: "
                         f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for p in module.parameters():
            if not torch.isfinite(p).all():
                raise ValueError(f"{path} holds non-finite weights")
