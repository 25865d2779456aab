"""The one adapter to ``deepspeed``: build the engine, checksums, consolidated weights.

DeepSpeed owns the dense `MetaLearner` only: its optimizer state (and gradients in ZeRO-2)
is partitioned across ranks; gradient accumulation over micro-batches and the averaged
reduction across ranks are DeepSpeed's. The outer loss of each micro-batch goes through
``engine.backward`` — never a plain ``.backward()`` — so its scaling (1/GAS, mean over
ranks, loss scaling in fp16) is DeepSpeed's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from gmeta_ds.ds_config import zero_stage


def check_device_support(ds_config: dict, source: str = "deepspeed") -> None:
    """Reject precisions this machine's accelerator cannot run, before any collective
    (DeepSpeed itself only raises after the process group is up)."""
    from gmeta_ds.errors import ConfigError

    if ds_config.get("fp16", {}).get("enabled", False) and not torch.cuda.is_available():
        raise ConfigError(["deepspeed.fp16.enabled: fp16 needs a CUDA GPU (DeepSpeed's CPU "
                           "accelerator has no fp16); use bf16 (ds_configs/zero2_bf16.json, "
                           "zero3_bf16.json) or fp32 on this machine"], source)


def check_ds_config(ds_config: dict, source: str = "deepspeed") -> None:
    """Run DeepSpeed's own config parser (pydantic models: unknown or mistyped ZeRO, bf16,
    ... keys) and the engine's optimizer checks on a resolved config, before any collective:
    ``deepspeed.initialize`` only raises them on every rank after the process group is up.
    The batch keys are re-expressed for one rank (the world size was checked already)."""
    import math

    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig

    from gmeta_ds.errors import ConfigError

    one_rank = {**ds_config, "train_batch_size": ds_config["train_micro_batch_size_per_gpu"]
                * ds_config["gradient_accumulation_steps"]}
    try:
        DeepSpeedConfig(one_rank)
    except Exception as exc:  # noqa: BLE001 - pydantic ValidationError, AssertionError, ValueError
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "errors.pydantic" not in ln]
        raise ConfigError([f"deepspeed: DeepSpeed rejects the config: {' | '.join(lines[:4])}"],
                          source) from exc
    problems = []
    optimizer = ds_config.get("optimizer")
    name = str(optimizer.get("type", "")) if isinstance(optimizer, dict) else ""
    if not name:
        problems.append("deepspeed.optimizer: missing (or without 'type'); gmeta_ds gives DeepSpeed no "
                        "optimizer of its own, e.g. {type: Adam, params: {lr: auto}}")
    elif name.lower() not in DEEPSPEED_OPTIMIZERS and getattr(torch.optim, name, None) is None:
        problems.append(f"deepspeed.optimizer.type: {name!r} is neither a DeepSpeed optimizer "
                        f"({', '.join(DEEPSPEED_OPTIMIZERS)}) nor one in torch.optim")
    lr = optimizer.get("params", {}).get("lr") if name else None
    number = isinstance(lr, (int, float)) and not isinstance(lr, bool)
    if name and not (number and math.isfinite(lr) and lr >= 0):
        problems.append(f"deepspeed.optimizer.params.lr: {lr!r} is not a number >= 0 (or 'auto')")
    clip = ds_config.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
        problems.append(f"deepspeed.gradient_clipping: {clip!r} is not a number >= 0")
    if problems:
        raise ConfigError(problems, source)


def initialize(module: nn.Module, ds_config: dict):
    """``deepspeed.initialize`` on the dense module; returns the engine.

    ZeRO-3 partitions the parameters themselves: the module first keeps a hook-free skeleton
    of itself (`MetaLearner.prepare_zero3`) and every micro-step runs inside `gathered`."""
    import deepspeed

    if zero_stage(ds_config) == 3:
        module.prepare_zero3()
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=ds_config)
    if zero_stage(ds_config) == 3:
        _remove_zero3_module_hooks(engine)
    return engine


def _remove_zero3_module_hooks(engine) -> None:
    """ZeRO-3 fetches and releases each submodule's parameters from module hooks, and wraps
    the module's tensor inputs (e.g. sharded embedding rows) in backward hooks. The learner
    runs its skeleton on parameters gathered for the whole micro-step instead, so those hooks
    would only release parameters a second-order graph still holds: remove them."""
    offload = getattr(engine.optimizer, "parameter_offload", None)
    remove = getattr(offload, "_remove_module_hooks", None)
    if remove is None:
        import deepspeed

        raise RuntimeError(f"ZeRO-3 with deepspeed {deepspeed.__version__}: the engine has no "
                           "parameter_offload._remove_module_hooks; use ZeRO-2 "
                           "(ds_configs/zero2.json) or the DeepSpeed version gmeta_ds was tested with")
    remove()


def is_partitioned(module: nn.Module) -> bool:
    """Whether ZeRO-3 partitions this module's parameters (it partitions all of them, so the
    first one tells; checked on every micro-step)."""
    first = next(iter(module.parameters()), None)
    return first is not None and hasattr(first, "ds_id")


@contextlib.contextmanager
def gathered(module: nn.Module):
    """Full parameters of a ZeRO-3 module for the duration of the block (read-only: nothing
    is broadcast back); a no-op for ZeRO 0-2. One micro-step's forward and ``engine.backward``
    run inside it, so the gradients land on full parameters and DeepSpeed's hooks
    reduce-scatter them into their partitions (the outer reduction stays DeepSpeed's)."""
    if not is_partitioned(module):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        yield


def to_device(obj, device):
    """``obj`` (a tensor, or a dataclass / dict / list / tuple holding tensors, e.g. a
    `TaskBatch`) with every tensor moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def full_state_dict(module: nn.Module) -> dict:
    """The module's state dict as plain (copied) tensors, gathered under ZeRO-3."""
    with gathered(module):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def numel(module: nn.Module) -> int:
    """Parameter count of a module, also when ZeRO-3 has partitioned it."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def checksums(module: nn.Module, embedding_prefix: str = "net.embedding.") -> tuple[float, float]:
    """(dense, embedding) float64 sums over all parameters of the (replicated) module."""
    dense = embedding = 0.0
    with gathered(module):
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
    """Load weights written by `save_weights` (or ``gmeta-ds export``); a missing, unreadable
    or non-safetensors file, and weights of another model, are a `ConfigError` naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from gmeta_ds.errors import ConfigError

    path = Path(path)
    if not path.is_file():
        what = "is a directory, expected a .safetensors file" if path.is_dir() else "does not exist"
        raise ConfigError([f"weights file {path} {what} (train first, or pass --weights to the "
                           "model.safetensors of gmeta-ds train or a gmeta-ds export file)"])
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ConfigError([f"weights file {path}: not a readable safetensors file ({exc}); expected "
                           "the model.safetensors of gmeta-ds train or a gmeta-ds export file"]) from exc
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: file {tuple(state[k].shape)}, model {tuple(expected[k].shape)}"
              for k in sorted(set(state) & set(expected)) if state[k].shape != expected[k].shape]
    differences = [f"{what} {_few(items)}" for what, items in
                   (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes)) if items]
    if differences:
        raise ConfigError([f"weights file {path} does not match the model built from the config "
                           f"(weights of another model?): {'; '.join(differences)}"])
    module.load_state_dict(state, strict=False)
    with torch.no_grad():
        for p in module.parameters():
            if not torch.isfinite(p).all():
                raise ConfigError([f"weights file {path} holds non-finite weights"])


def _few(items: list[str], n: int = 3) -> str:
    return "[" + ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "") + "]"
