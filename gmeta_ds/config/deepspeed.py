"""Resolve a DeepSpeed config against the run config (layer 0: no torch, no deepspeed).

DeepSpeed's batch keys map onto tasks:
  train_micro_batch_size_per_gpu = meta.tasks_per_micro_batch (T, tasks per micro-batch)
  gradient_accumulation_steps    = micro-batches per meta-step on each rank (GAS)
  train_batch_size               = meta.tasks_per_meta_step (B = T x GAS x world size)
"auto" values are filled from the run config; values that contradict it are errors.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path, PurePath

from gmeta_ds.config import AUTO, BOUNDS, DEFAULT_MICRO_BATCH, MAX_CONFIG_BYTES, SUPPORTED_ZERO_STAGES, RunConfig
from gmeta_ds.errors import ConfigError

# The DeepSpeed configs shipped as package data (the checkout's top-level ``ds_configs/`` is a
# symlink to this folder), named ``ds_configs/<file>.json`` in run configs and docs.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "ds_configs"
SHIPPED_PREFIX = "ds_configs"
MAX_WORLD = 2**20  # ranks of one job (and WORLD_SIZE's bound): beyond any cluster, inside every counter


@dataclass(frozen=True)
class BatchPlan:
    """Tasks per micro-batch (T), micro-batches per meta-step per rank (GAS), world size (W);
    tasks per meta-step over all ranks = T x GAS x W."""

    tasks_per_micro_batch: int
    grad_accum_steps: int
    world_size: int

    @property
    def tasks_per_meta_step(self) -> int:
        return self.tasks_per_micro_batch * self.grad_accum_steps * self.world_size

    def describe(self) -> str:
        return (f"{self.tasks_per_micro_batch} tasks/micro-batch x {self.grad_accum_steps} "
                f"accumulation steps x {self.world_size} ranks = {self.tasks_per_meta_step} "
                "tasks/meta-step")


def zero_stage(ds: dict) -> int:
    """The DeepSpeed config's ZeRO stage (0 when it has no ``zero_optimization``)."""
    return ds.get("zero_optimization", {}).get("stage", 0)


def shipped_ds_configs() -> list[str]:
    """The documented names of the shipped DeepSpeed configs (``ds_configs/zero0.json``, ...)."""
    return sorted(f"{SHIPPED_PREFIX}/{p.name}" for p in SHIPPED_DIR.glob("*.json"))


def shipped_ds_config(name: str) -> Path | None:
    """The packaged file for a shipped name (``ds_configs/zero2.json``, ``./ds_configs/zero2.json``),
    or None when ``name`` is not one."""
    path = PurePath(name)
    parts = [part for part in path.parts if part != "."]
    if path.is_absolute() or len(parts) != 2 or parts[0] != SHIPPED_PREFIX:
        return None
    packaged = SHIPPED_DIR / parts[1]
    return packaged if packaged.is_file() else None


def missing_ds_config_hint() -> str:
    return "shipped DeepSpeed configs: " + (", ".join(shipped_ds_configs()) or f"none found in {SHIPPED_DIR}")


def find_ds_config_file(name: str, config_dir: str) -> Path:
    """Resolve a ``deepspeed:`` path: as given (absolute or from cwd), next to the run config,
    or, for a shipped name (``ds_configs/zero2.json``) found in neither, the package's copy."""
    candidates = list(dict.fromkeys([Path(name), Path(config_dir) / name]))
    for path in candidates:
        if path.is_file():
            return path
    if Path(name).is_dir():
        raise ConfigError([f"deepspeed: {name!r} is a directory, expected a DeepSpeed JSON file"])
    packaged = shipped_ds_config(name)
    if packaged is not None:
        return packaged
    tried = ", ".join(str(p) for p in candidates)
    raise ConfigError([f"deepspeed: file {name!r} not found (tried {tried}); {missing_ds_config_hint()}"])


def load_ds_config(cfg: RunConfig) -> tuple[dict, str]:
    """The raw DeepSpeed config dict and where it came from."""
    if isinstance(cfg.deepspeed, dict):
        return copy.deepcopy(cfg.deepspeed), "deepspeed (inline)"
    path = find_ds_config_file(cfg.deepspeed, cfg.config_dir)
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError([f"deepspeed: {path} holds {path.stat().st_size} bytes; a DeepSpeed config is a "
                           f"few KB (at most {MAX_CONFIG_BYTES}): is it the right file?"])
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_refuse_duplicates)
    except RecursionError:
        raise ConfigError([f"deepspeed: {path}: its objects nest too deeply"]) from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError([f"deepspeed: {path} is not valid JSON: {exc}"]) from exc
    if not isinstance(data, dict):
        raise ConfigError([f"deepspeed: {path} must hold a JSON object, got {type(data).__name__}"])
    return data, str(path)


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a repeated key (``json`` keeps the last one silently)."""
    data: dict = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"key {key!r} appears twice in one object; keep one")
        data[key] = value
    return data


# Sections gmeta_ds reads (and DeepSpeed requires to be objects): a number or list here would
# otherwise fail deep inside the resolution with an AttributeError.
_SECTIONS = ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16", "checkpoint")


def _check_sections(ds: dict, source: str) -> None:
    problems = [f"deepspeed.{key}: expected a JSON object, got {ds[key]!r}"
                for key in _SECTIONS if key in ds and not isinstance(ds[key], dict)]
    params = ds.get("optimizer", {}).get("params", {}) if isinstance(ds.get("optimizer"), dict) else {}
    if not isinstance(params, dict):
        problems.append(f"deepspeed.optimizer.params: expected a JSON object, got {params!r}")
    if problems:
        raise ConfigError(problems, source)


def _as_int(value, key: str, problems: list[str], where: str):
    if value == AUTO or value is None:
        return None
    limit = BOUNDS["meta.tasks_per_meta_step"][0]  # every batch key counts tasks
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
        problems.append(f"deepspeed.{key}: {value!r} is not a positive integer <= {limit} or 'auto' "
                        f"({where})")
        return None
    return value


RUN_CONFIG = "the run config"


def _ds_where(source: str) -> str:
    """Where the DeepSpeed config's keys were read: its file, or the run config's inline dict."""
    return "inline in the run config's deepspeed:" if source == "deepspeed (inline)" else f"in {source}"


def _resolve_batch(cfg: RunConfig, ds: dict, world: int, problems: list[str],
                   source: str = "deepspeed (inline)", world_from: str = "the launch") -> BatchPlan | None:
    """The batch plan; each problem names where its keys come from: ``meta.*`` from the run
    config (file + ``--set``), ``deepspeed.*`` from the DeepSpeed config (``source``), the
    world size from ``world_from``."""
    where = _ds_where(source)
    ds_mb, ds_tb, ds_gas = (_as_int(ds.get(key), key, problems, where) for key in (
        "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"))
    meta_t, meta_b = cfg.meta.tasks_per_micro_batch, cfg.meta.tasks_per_meta_step
    t = meta_t if meta_t != AUTO else (ds_mb or DEFAULT_MICRO_BATCH)
    if meta_t != AUTO and ds_mb is not None and ds_mb != meta_t:
        problems.append(f"meta.tasks_per_micro_batch ({meta_t}) contradicts "
                        f"deepspeed.train_micro_batch_size_per_gpu ({ds_mb}); set one to 'auto' "
                        f"(meta.* in {RUN_CONFIG}, deepspeed.* {where})")
    b = meta_b if meta_b != AUTO else (ds_tb or t * (ds_gas or 1) * world)
    if meta_b != AUTO and ds_tb is not None and ds_tb != meta_b:
        problems.append(f"meta.tasks_per_meta_step ({meta_b}) contradicts "
                        f"deepspeed.train_batch_size ({ds_tb}); set one to 'auto' "
                        f"(meta.* in {RUN_CONFIG}, deepspeed.* {where})")
    if b % (t * world):
        b_from = (f"deepspeed.train_batch_size {where}" if meta_b == AUTO and ds_tb else
                  f"T x deepspeed.gradient_accumulation_steps x W {where}" if meta_b == AUTO else None)
        t_from = (f"deepspeed.train_micro_batch_size_per_gpu {where}" if meta_t == AUTO and ds_mb else
                  f"the default {DEFAULT_MICRO_BATCH}" if meta_t == AUTO else None)
        origin = ("B and T from the run config's meta.*" if b_from is None and t_from is None else
                  f"B from {b_from or 'the run config'}, T from {t_from or 'the run config'}")
        b_key = "meta.tasks_per_meta_step" if b_from is None else "deepspeed.train_batch_size"
        t_key = "meta.tasks_per_micro_batch" if t_from is None else "deepspeed.train_micro_batch_size_per_gpu"
        fix = f"set {b_key} to a multiple of {t * world}"
        if b % world == 0:
            fix += (f", or lower {t_key} to a divisor of {b} / {world} = {b // world} "
                    f"(e.g. {_largest_divisor(b // world, t)})")
        problems.append(f"meta.tasks_per_meta_step ({b}) must be a multiple of "
                        f"meta.tasks_per_micro_batch ({t}) x world size ({world}) = {t * world} "
                        f"({origin}, W from {world_from}); {fix}")
        return None
    gas = b // (t * world)
    if ds_gas is not None and ds_gas != gas:
        problems.append(f"deepspeed.gradient_accumulation_steps ({ds_gas}) contradicts "
                        f"{b} tasks/meta-step / ({t} tasks/micro-batch x {world} ranks of {world_from}) = "
                        f"{gas}; "
                        f"set it to 'auto' (deepspeed.* {where}, the tasks from {RUN_CONFIG}'s meta.*)")
    return BatchPlan(t, gas, world)


def _largest_divisor(n: int, below: int) -> int:
    """The largest divisor of ``n`` that is at most ``below`` (1 at least); O(sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return max(d for d in small + [n // d for d in small] if d <= below)


def _fill_optimizer(ds: dict, lr: float) -> None:
    opt = ds.get("optimizer")
    if opt is None:
        return
    params = opt.setdefault("params", {})
    if params.get("lr", AUTO) == AUTO:
        params["lr"] = lr


def resolve_ds_config(cfg: RunConfig, world_size: int,
                      world_from: str = "the launch") -> tuple[dict, BatchPlan]:
    """The DeepSpeed config to pass to ``deepspeed.initialize``, with every "auto" filled;
    ``world_from`` says where ``world_size`` came from, in the batch keys' errors.

    Raises `ConfigError` listing every contradiction; called on every rank before any
    collective so a bad config fails everywhere the same way.
    """
    if not 1 <= world_size <= MAX_WORLD:  # --world-size, a hostfile's slots x hosts, WORLD_SIZE
        raise ConfigError([f"world size {world_size}: expected 1 to {MAX_WORLD} ranks"])
    ds, source = load_ds_config(cfg)
    _check_sections(ds, source)
    problems: list[str] = []
    plan = _resolve_batch(cfg, ds, world_size, problems, source, world_from)
    stage = zero_stage(ds)
    if stage not in SUPPORTED_ZERO_STAGES:
        problems.append(f"deepspeed.zero_optimization.stage: {stage!r} is not supported; "
                        f"supported stages: {', '.join(map(str, SUPPORTED_ZERO_STAGES))} "
                        f"({_ds_where(source)})")
    _fill_optimizer(ds, cfg.train.lr)
    if plan is not None and cfg.train.nonfinite == "skip" and plan.grad_accum_steps != 1:
        problems.append(f"train.nonfinite: 'skip' needs one micro-batch per rank and meta-step "
                        f"(gradient accumulation 1), but {plan.describe()}; raise "
                        "meta.tasks_per_micro_batch or use 'abort'")
    if problems:  # each problem names its source: run config (meta.*, train.*) or DeepSpeed file
        raise ConfigError(problems)
    ds["train_micro_batch_size_per_gpu"] = plan.tasks_per_micro_batch
    ds["gradient_accumulation_steps"] = plan.grad_accum_steps
    ds["train_batch_size"] = plan.tasks_per_meta_step
    ds.setdefault("steps_per_print", 10**9)  # gmeta_ds logs its own metrics
    return ds, plan


def dense_state_bytes(ds: dict, n_params: int, world_size: int) -> dict:
    """Bytes per rank of the dense model's parameters, gradients and Adam state under the
    resolved config's ZeRO stage (stage 1 partitions optimizer state, stage 2 also gradients,
    stage 3 also parameters between micro-steps (gathered in full during one);
    bf16/fp16 keep 2-byte parameters and gradients; the optimizer state is Adam's two moments
    plus, under ZeRO 1-3 or half precision, DeepSpeed's fp32 master copy of the parameters'
    partition, which its ZeRO optimizers keep even for fp32 parameters; CPU offload moves the
    optimizer state to host memory, still counted here). Per parameter in fp32: ZeRO-0 16
    bytes, ZeRO-1 8 + 12/W, ZeRO-2 4 + 16/W, ZeRO-3 20/W: the storages a ZeRO-3 rank holds
    after training are exactly these (benchmarks/hf_memory.py)."""
    stage = zero_stage(ds)
    half = ds.get("bf16", {}).get("enabled", False) or ds.get("fp16", {}).get("enabled", False)
    weight = 2 if half else 4
    optimizer = (12 if half or stage >= 1 else 8) * n_params  # Adam moments (+ fp32 master copy)
    grads = weight * n_params
    params = weight * n_params
    return {"stage": stage, "params": params // world_size if stage >= 3 else params,
            "grads": grads // world_size if stage >= 2 else grads,
            "optimizer": optimizer // world_size if stage >= 1 else optimizer}


def size_text(n: int) -> str:
    """A byte count for people: ``1.50 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def for_sites(ds: dict, plan: BatchPlan, count: int) -> tuple[dict, BatchPlan]:
    """The DeepSpeed config and plan of one of ``count`` sites sharing the run's ranks: each
    site's meta-step is its ranks' share of the run's (T x GAS x W / count tasks), so the
    sites together process the one-site run's batch (a copy; ``count`` 1: as they are)."""
    if count <= 1:
        return ds, plan
    site = BatchPlan(plan.tasks_per_micro_batch, plan.grad_accum_steps, plan.world_size // count)
    return {**ds, "train_batch_size": site.tasks_per_meta_step}, site
