"""The one adapter to ``deepspeed``: build the engine, checksums, consolidated weights.

DeepSpeed owns the dense `MetaLearner` only: its optimizer state (and gradients in ZeRO-2)
is partitioned across ranks; gradient accumulation over micro-batches and the averaged
reduction across ranks are DeepSpeed's. The outer loss of each micro-batch goes through
``engine.backward`` — never a plain ``.backward()`` — so its scaling (1/GAS, mean over
ranks, loss scaling in fp16) is DeepSpeed's. DeepSpeed's internals (private or undocumented
APIs) are reached only through `ds_internals`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from gmeta_ds.config.deepspeed import zero_stage
from gmeta_ds.engine import ds_internals
from gmeta_ds.engine.parallelize import parallelize, step_parameters


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
    The batch keys are re-expressed for the world size the parser reads (1 before DeepSpeed's
    communication starts, else the process group's; `ds_internals.parser_world_size`): the
    world size of the plan was checked already."""
    import math

    from gmeta_ds.errors import ConfigError

    as_seen = {**ds_config, "train_batch_size": ds_config["train_micro_batch_size_per_gpu"]
               * ds_config["gradient_accumulation_steps"] * ds_internals.parser_world_size()}
    try:
        ds_internals.parse_ds_config(as_seen)
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
    elif name.lower() not in ds_internals.optimizer_names() and getattr(torch.optim, name, None) is None:
        problems.append(f"deepspeed.optimizer.type: {name!r} is neither a DeepSpeed optimizer "
                        f"({', '.join(ds_internals.optimizer_names())}) nor one in torch.optim")
    torch_only = name and name.lower() not in ds_internals.optimizer_names() and getattr(torch.optim, name, None)
    if (torch_only and ds_config.get("zero_optimization", {}).get("stage", 0) >= 1
            and name.lower() not in ds_internals.zero_tested_torch_optimizers()
            and not ds_config.get("zero_allow_untested_optimizer")):
        problems.append(f"deepspeed.optimizer.type: {name!r} under ZeRO stage >= 1 is one DeepSpeed has not tested "
                        "with ZeRO (it accepts torch's Adam, AdamW and Adagrad); add "
                        "\"zero_allow_untested_optimizer\": true to the DeepSpeed config to use it anyway")
    lr = optimizer.get("params", {}).get("lr") if name else None
    number = isinstance(lr, (int, float)) and not isinstance(lr, bool)
    if name and not (number and math.isfinite(lr) and lr >= 0):
        problems.append(f"deepspeed.optimizer.params.lr: {lr!r} is not a number >= 0 (or 'auto')")
    clip = ds_config.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
        problems.append(f"deepspeed.gradient_clipping: {clip!r} is not a number >= 0")
    if problems:
        raise ConfigError(problems, source)


# Optimizer params DeepSpeed itself consumes before building its Adam (engine.py,
# ``_configure_basic_optimizer`` / ``get_optimizer_configuration``), in addition to those
# of ``torch.optim.AdamW.__init__``.
_DEEPSPEED_ADAM_KEYS = frozenset({"adam_w_mode", "torch_adam", "fp32_optimizer_states"})


def uses_offload_optimizer(ds_config: dict) -> bool:
    """Whether ZeRO keeps the optimizer state on the host (``offload_optimizer`` on cpu or
    nvme, or the deprecated ``cpu_offload``), read with DeepSpeed's own ZeRO config model,
    as ``DeepSpeedEngine.zero_use_cpu_optimizer`` does."""
    return ds_internals.offloads_optimizer(ds_config)


def with_torch_adam(ds_config: dict, written_with: dict | None = None) -> dict:
    """``ds_config`` with ``optimizer.params.torch_adam: true`` where DeepSpeed would otherwise
    JIT-build an Adam op it does not need (a copy; the input is left as it is). ``written_with``:
    the config of a ZeRO-0 checkpoint being resumed (`ds_internals.saved_ds_config`).

    For ``Adam`` / ``AdamW`` without optimizer offload, DeepSpeed builds ``FusedAdam``, whose
    C++ (CPU accelerator) or CUDA op it JIT-compiles with the host compiler on a machine's
    first run, ~1-2 min at 2 cores, and again whenever ``PATH`` differs from the last build's.
    With ``torch_adam`` DeepSpeed builds ``torch.optim.AdamW`` (``torch.optim.Adam`` only for
    ``Adam`` with ``adam_w_mode: false``) from the same params instead, the same update rule
    (decoupled weight decay, betas, eps), still created, wrapped (ZeRO 1-3, bf16/fp16) and
    checkpointed by DeepSpeed, so ``save_checkpoint`` / ``load_checkpoint`` and universal
    checkpoints hold the same exp_avg / exp_avg_sq state. It runs fused (``fused: true``, one
    pass per element; unless the params name ``fused`` or ``foreach``): the default for-each
    update makes temporaries the size of each flat ZeRO partition (2 x 4 bytes per parameter
    of the partition at the step's peak). Left alone: an explicit
    ``torch_adam`` (``false`` asks for FusedAdam), other optimizer types, params torch's AdamW
    does not take (e.g. ``bias_correction``), and optimizer offload, whose host-side step
    is DeepSpeed's CPU Adam (``DeepSpeedCPUAdam``, the vectorised ``cpu_adam`` op, built on
    first use), which ZeRO-Offload's host-side update is made for.

    A ZeRO-0 checkpoint written by FusedAdam (gmeta_ds before this default, or ``torch_adam:
    false``) resumes with FusedAdam: its state does not carry over to torch's Adam there.
    FusedAdam counts steps on one parameter per group only (torch's Adam would restart the
    others' bias correction at step 1), and under bf16 DeepSpeed wraps FusedAdam in
    ``FP16_Optimizer`` but torch's Adam in ``FP16_UnfusedOptimizer``, another state layout.
    ZeRO 1-3 keep one flat fp32 partition per group, which loads into either Adam."""
    import copy
    import inspect

    optimizer = ds_config.get("optimizer")
    if not isinstance(optimizer, dict) or str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        return ds_config
    params = optimizer.get("params") or {}
    accepted = set(inspect.signature(torch.optim.AdamW.__init__).parameters) - {"self", "params"}
    unknown = set(params) - accepted - _DEEPSPEED_ADAM_KEYS
    if "torch_adam" in params or unknown or uses_offload_optimizer(ds_config):
        return ds_config
    if (written_with is not None and zero_stage(ds_config) == 0 and zero_stage(written_with) == 0
            and not (written_with.get("optimizer") or {}).get("params", {}).get("torch_adam", False)):
        return ds_config  # a FusedAdam checkpoint: see above
    ds_config = copy.deepcopy(ds_config)
    params = ds_config["optimizer"].setdefault("params", {})
    params["torch_adam"] = True
    if "foreach" not in params and "fused" not in params:
        params["fused"] = True  # one pass per element: no whole-partition temporaries
    return ds_config


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)
HOST_MMAP_THRESHOLD = 1 << 20


def return_freed_host_memory(threshold: int = HOST_MMAP_THRESHOLD) -> bool:
    """Make the host allocator hand every freed block of ``threshold`` bytes or more back to
    the system at once (glibc ``mallopt(M_MMAP_THRESHOLD)``); whether it was set.

    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so
    the blocks that come and go every micro-step (ZeRO-3's gathered layers, reduced gradient
    buckets, optimizer temporaries) are afterwards served from the heap and stay resident once
    freed: on CPU they held ~800 MiB per rank of a 77M-parameter ZeRO-3 run that nothing used
    (`benchmarks/hf_memory.py`). A fixed threshold keeps them as mappings returned on free.
    Left alone when ``MALLOC_MMAP_THRESHOLD_`` is set in the environment (the user's choice,
    which glibc read at start-up) and off glibc (returns False)."""
    import ctypes
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def initialize(module: nn.Module, ds_config: dict, resume: Path | None = None):
    """``deepspeed.initialize`` on the dense module; returns the engine. ``resume``: the
    checkpoint folder the engine will load next, if any.

    The optimizer is torch's AdamW unless the config offloads it (`with_torch_adam`): a first
    run on a fresh machine compiles no DeepSpeed op (the CPU backend's shared-memory op is
    skipped in `gmeta_ds.engine.dist.skip_deepspeed_shm_op`).

    ``module``: a `MetaLearner`, first set up for the ZeRO stage by
    `gmeta_ds.engine.parallelize.parallelize`. ZeRO-3 partitions the parameters themselves.
    With a body split (`gmeta_ds.functional.split`) DeepSpeed's module hooks stay on the body
    only, which is gathered layer by layer in its forward and backward; the rest runs inside
    `MicroStep.gathered`. Without one, the learner's forward runs through a hook-free skeleton
    of it and every micro-step runs with all parameters gathered."""
    import deepspeed

    return_freed_host_memory()
    written_with = None
    if resume is not None and zero_stage(ds_config) == 0:
        written_with = ds_internals.saved_ds_config(resume)
    ds_config = with_torch_adam(ds_config, written_with)
    stage = zero_stage(ds_config)
    split = parallelize(module, stage)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=ds_config)
    if stage == 3:
        ds_internals.remove_zero3_module_hooks(engine)
        if split is not None:
            ds_internals.hook_zero3_body(engine, split.body)
    return engine


def is_partitioned(module: nn.Module) -> bool:
    """Whether ZeRO-3 partitions this module's parameters (it partitions all of them, so the
    first one tells)."""
    first = next(iter(module.parameters()), None)
    return first is not None and ds_internals.is_zero3_param(first)


@contextlib.contextmanager
def gathered(module: nn.Module, params: list | None = None):
    """Full parameters of a ZeRO-3 module (``params``: those only; default every one) for the
    duration of the block (read-only: nothing is broadcast back); a no-op for ZeRO 0-2. One
    micro-step's forward and ``engine.backward`` run inside `MicroStep.gathered`, so the
    gradients land on full parameters and DeepSpeed's hooks reduce-scatter them into their
    partitions (the outer reduction stays DeepSpeed's)."""
    if not is_partitioned(module):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()) if params is None else params):
        yield


@dataclasses.dataclass(frozen=True)
class MicroStep:
    """How every micro-step on one DeepSpeed engine runs, decided once (`of`): neither part
    changes while the engine trains (ZeRO partitions the parameters in `initialize`, after
    `parallelize` has set the learner's body split).

    ``gather``: what one micro-step's forward and backward of the `MetaLearner` need gathered
    under ZeRO-3, `parallelize.step_parameters` (with a body split all but the body, which
    DeepSpeed gathers layer by layer; else every parameter); None under ZeRO 0-2.
    ``skip_reduction``: `reduction_is_identity`, so the backward runs in ``engine.no_sync()``."""

    gather: tuple[nn.Parameter, ...] | None
    skip_reduction: bool

    @staticmethod
    def of(engine) -> MicroStep:
        """The micro-steps of ``engine`` (its ``module``: the `MetaLearner`)."""
        partitioned = is_partitioned(engine.module)
        return MicroStep(tuple(step_parameters(engine.module)) if partitioned else None,
                         reduction_is_identity(engine))

    def gathered(self):
        """``gather``'s parameters in full for the block (read-only, as `gathered`); under
        ZeRO 0-2 a no-op."""
        if self.gather is None:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.gather))


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


def full_state_dict(module: nn.Module, rank0_only: bool = False) -> dict:
    """The module's state dict as plain (copied) tensors, gathered under ZeRO-3 (collective
    then) one parameter at a time, so a rank never holds more than one gathered parameter
    beyond its copy. ``rank0_only``: under ZeRO-3 the other ranks keep no copy and get ``{}``
    (a rank that saves or evaluates the full model alone: the others' peak stays ZeRO-3's)."""
    if not is_partitioned(module):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    import torch.distributed as dist

    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    for names, tensor in _one_gathered_at_a_time(module):
        if keep:
            copy = tensor.detach().clone()
            state.update((name, copy) for name in names)
    return state


def _one_gathered_at_a_time(module: nn.Module):
    """Each distinct tensor of ``module``'s state dict with its names (tied ones share one),
    yielded while gathered under ZeRO-3 (one parameter at a time; collective then: every rank
    iterates it whole, in the same order)."""
    entries: dict[int, list] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        entries.setdefault(id(tensor), []).append((name, tensor))
    for same in entries.values():
        tensor = same[0][1]
        params = [tensor] if isinstance(tensor, nn.Parameter) else []
        with gathered(module, params) if params else contextlib.nullcontext():
            yield [name for name, _ in same], tensor


def gather_into(module: nn.Module, target: nn.Module | None) -> None:
    """Copy ``module``'s full weights into ``target``'s tensors of the same names (cast to
    their dtype), gathering one parameter at a time under ZeRO-3 (collective then: every rank
    calls it, ``target`` None where nothing is kept). No second copy of the model: a rank
    holds ``target`` and one gathered parameter."""
    dest = target.state_dict(keep_vars=True) if target is not None else None
    for names, tensor in _one_gathered_at_a_time(module):
        if dest is not None:
            with torch.no_grad():
                for name in names:
                    dest[name].copy_(tensor.detach())


def numel(module: nn.Module) -> int:
    """Parameter count of a module, also when ZeRO-3 has partitioned it."""
    return sum(ds_internals.full_numel(p) for p in module.parameters())


def checksums(module: nn.Module, embedding_prefix: str | None = None) -> tuple[float, float]:
    """(dense, embedding) float64 sums over all parameters of the (replicated) module; the
    embedding sum is over the parameters named ``embedding_prefix...`` (the caller's model
    tells where its tables are; None: no embedding parameters, all are dense)."""
    dense = embedding = 0.0
    for name, p in module.named_parameters():
        with gathered(module, [p]):  # one at a time under ZeRO-3 (collective then)
            value = p.detach().double().sum().item()
            if embedding_prefix and name.startswith(embedding_prefix):
                embedding += value
            else:
                dense += value
    return dense, embedding


def save_weights(state: dict, path: str | Path) -> Path:
    """Write a full state dict as safetensors (floating tensors as float32; integer ones, such
    as dynamic tables' ids, as they are), atomically (tmp file + rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    state = {k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous().cpu()
             for k, v in state.items()}
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
    from gmeta_ds.embedding.tables import DynamicRows

    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    # a dynamic table holds as many rows as it admitted: only its row width must match
    sized = {f"{prefix}.{name}" for prefix, m in module.named_modules() if isinstance(m, DynamicRows)
             for name in ("ids", "rows", "defaults")}
    shapes = [f"{k}: file {tuple(state[k].shape)}, model {tuple(expected[k].shape)}"
              for k in sorted(set(state) & set(expected))
              if (state[k].shape[1:] != expected[k].shape[1:] or state[k].dim() != expected[k].dim()
                  if k in sized else state[k].shape != expected[k].shape)]
    shapes += [f"{k}: file {state[k].dtype}, model {expected[k].dtype}" for k in sorted(sized & set(state))
               if k.endswith(".ids") and state[k].dtype != expected[k].dtype]
    differences = [f"{what} {_few(items)}" for what, items in
                   (("missing", missing), ("unexpected", unexpected), ("other shapes or types", shapes)) if items]
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


def reduction_is_identity(engine) -> bool:
    """Whether DeepSpeed's gradient reduction would leave every gradient as it is: one rank,
    ZeRO-0 (no partitioning, so ``engine.no_sync()`` is allowed) and fp32 gradients (no cast to
    a communication dtype and back). `meta_engine.step_micro_batches` then skips it
    (`MicroStep.skip_reduction`)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    return (world == 1 and engine.zero_optimization_stage() == 0 and not engine.fp16_enabled()
            and not engine.bfloat16_enabled())
