"""Every DeepSpeed internal gmeta_ds relies on, in one place.

An internal is a private name (leading underscore), an undocumented attribute, module,
command-line flag, config constant or file name: something a DeepSpeed release may change
without notice. Each one is reached only through a small function or constant below, with a
comment on why gmeta_ds needs it; no other module of the package touches it. DeepSpeed's
public API (``deepspeed.initialize``, ``init_distributed``, ``zero.GatheredParameters``, the
engine's ``backward`` / ``step`` / ``save_checkpoint`` / ``load_checkpoint``) is used directly
elsewhere.

`check_internals` verifies, without a process group or a build, that the installed DeepSpeed
still has every internal; ``tests/unit/test_ds_internals.py`` runs it, so a DeepSpeed upgrade
that drops or renames one fails there, naming it and what it is for, instead of deep inside a
(distributed) run.

Tested with deepspeed `TESTED_WITH` (and torch 2.13.0); setup.cfg allows `SUPPORTED`.
Nothing here is model-specific.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TESTED_WITH = ("0.19.8",)  # deepspeed versions every internal below was tested with
SUPPORTED = ">=0.16,<0.20"  # what setup.cfg allows


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def _tested() -> str:
    return f"gmeta_ds is tested with deepspeed {', '.join(TESTED_WITH)} (setup.cfg allows {SUPPORTED})"


def _source(obj) -> str:
    """``obj``'s source with whitespace collapsed ('' where it cannot be read)."""
    try:
        return " ".join(inspect.getsource(obj).split())
    except (OSError, TypeError):
        return ""


# --- ZeRO-3 module hooks --------------------------------------------------------------------
# ZeRO-3 fetches and releases each submodule's parameters from module hooks, and wraps the
# module's tensor inputs in backward hooks. The learner runs a hook-free skeleton on parameters
# gathered for the whole micro-step (`ds_engine.gathered`), so those hooks would only release
# parameters a second-order graph still holds: they are removed right after
# ``deepspeed.initialize``. DeepSpeed has no public call for that; its own
# ``DeepSpeedZeRoOffload.destroy`` and ``deepspeed/compile/init_z3.py`` use this private one.
# Tested with deepspeed 0.19.8.
ZERO3_HOOKS_OWNER = "parameter_offload"  # engine.optimizer attribute (DeepSpeedZeroOptimizer_Stage3)
ZERO3_REMOVE_HOOKS = "_remove_module_hooks"  # its method (DeepSpeedZeRoOffload)


def remove_zero3_module_hooks(engine) -> None:
    """Remove the ZeRO-3 module hooks of ``engine`` (see above)."""
    offload = getattr(engine.optimizer, ZERO3_HOOKS_OWNER, None)
    remove = getattr(offload, ZERO3_REMOVE_HOOKS, None)
    if remove is None:
        raise RuntimeError(f"ZeRO-3 with deepspeed {deepspeed_version()}: the engine has no "
                           f"optimizer.{ZERO3_HOOKS_OWNER}.{ZERO3_REMOVE_HOOKS} (a DeepSpeed internal "
                           "gmeta_ds needs to run the meta-learner under ZeRO-3); use ZeRO-2 "
                           f"(ds_configs/zero2.json) or another deepspeed: {_tested()}")
    remove()


# With a body split (gmeta_ds.functional.split) the body is an ordinary module call, so its
# hooks are put back on it alone: ``_register_deepspeed_module`` is what
# ``DeepSpeedZeRoOffload.setup_zero_stage3_hooks`` runs on the root module (fetch before each
# submodule's forward and backward, release after), and the parameter coordinator's
# ``reset_step`` is what that root hook runs at the start of every forward. Tested with
# deepspeed 0.19.8.
ZERO3_REGISTER_HOOKS = "_register_deepspeed_module"  # DeepSpeedZeRoOffload method
ZERO3_COORDINATOR = "get_param_coordinator"  # DeepSpeedZeRoOffload method
# What DeepSpeedZeRoOffload.__init__ runs on every module of the engine's tree; the body's own
# wrapper modules (e.g. an encoder's pooling wrapper) are not in that tree.
ZERO3_MODULE_INIT = ("deepspeed.runtime.zero.partition_parameters", "_init_external_params")


def hook_zero3_body(engine, body) -> None:
    """Put ZeRO-3's fetch/release hooks (removed by `remove_zero3_module_hooks`) back on
    ``body`` and its submodules only: DeepSpeed then gathers each body layer for its forward
    and again for its backward and releases it after, prefetching as configured."""
    offload = getattr(engine.optimizer, ZERO3_HOOKS_OWNER, None)
    register = getattr(offload, ZERO3_REGISTER_HOOKS, None)
    coordinator = getattr(offload, ZERO3_COORDINATOR, None)
    if register is None or coordinator is None:
        raise RuntimeError(f"ZeRO-3 with deepspeed {deepspeed_version()}: the engine has no "
                           f"optimizer.{ZERO3_HOOKS_OWNER}.{ZERO3_REGISTER_HOOKS} (a DeepSpeed internal "
                           "gmeta_ds needs to keep the model's body partitioned); set "
                           f"meta.split_body: false or use another deepspeed: {_tested()}")
    init = getattr(importlib.import_module(ZERO3_MODULE_INIT[0]), ZERO3_MODULE_INIT[1])
    for module in body.modules():
        init(module)
    # Registered before the fetch hooks, so it runs first: a new trace step per body forward.
    body.register_forward_pre_hook(lambda module, args: coordinator().reset_step())
    register(body)


# --- ZeRO-3 parameter attributes ------------------------------------------------------------
# ZeRO-3 (``zero.Init._convert_to_deepspeed_param``) marks each partitioned parameter with
# ``ds_id`` and records its full size in ``ds_numel``: the parameter's own tensor is then an
# empty placeholder, so ``p.numel()`` is 0. Undocumented attributes; gmeta_ds reads them to
# tell a partitioned module from a plain one (gather around each micro-step or not) and to
# count parameters / gradient bytes. Tested with deepspeed 0.19.8.
ZERO3_ID_ATTR = "ds_id"
ZERO3_NUMEL_ATTR = "ds_numel"


def is_zero3_param(p) -> bool:
    """Whether ZeRO-3 partitions the parameter ``p``."""
    return hasattr(p, ZERO3_ID_ATTR)


def full_numel(p) -> int:
    """Element count of the whole parameter ``p``, also when ZeRO-3 partitioned it."""
    return getattr(p, ZERO3_NUMEL_ATTR, p.numel())


# --- The CPU shared-memory all-reduce op ----------------------------------------------------
# DeepSpeed's torch backend JIT-builds and maps a shared-memory all-reduce op when it is
# constructed (``deepspeed.comm.torch.TorchBackend.__init__`` calls the module function
# ``build_shm_op``); only ``inference_all_reduce`` (tensor-parallel inference) uses it, never
# training. Left alone it costs a C++ build at start-up, 66 MB of RAM per rank in /dev/shm
# that DeepSpeed never frees, and a busy-wait for peers' buffers that never appear across
# hosts. Replacing the module function before the backend is built skips it. Where that is
# not possible, the buffers are unlinked under the name DeepSpeed's C++ source gives them
# (``ops/csrc/cpu/comm/shm.cpp``: SHM_BUFFER_NAME, uid, MASTER_ADDR, MASTER_PORT, rank);
# neither the op nor the name is documented. Tested with deepspeed 0.19.8.
SHM_MODULE = "deepspeed.comm.torch"
SHM_BUILD = "build_shm_op"
SHM_BACKEND = "TorchBackend"
SHM_BUFFER_NAME = "deepspeed_allreduce_buffer"
SHM_SOURCE = Path("ops", "csrc", "cpu", "comm", "shm.cpp")  # under the deepspeed package


def _shm_module():
    # Not ``import deepspeed.comm.torch``: deepspeed.comm's attribute ``torch`` is torch itself.
    return importlib.import_module(SHM_MODULE)


def skip_shm_op() -> bool:
    """Keep the torch backend from building the shared-memory op (see above); call before
    ``deepspeed.init_distributed``. False where this DeepSpeed has no such hook."""
    ds_torch = _shm_module()
    if not hasattr(ds_torch, SHM_BUILD) or not hasattr(ds_torch, SHM_BACKEND):
        return False
    setattr(ds_torch, SHM_BUILD, lambda: None)
    return True


def shm_buffer_path(rank: int, addr: str, port: str) -> Path:
    """The /dev/shm file of rank ``rank``'s all-reduce buffer in a job rendezvousing at
    ``addr``:``port`` (MASTER_ADDR, MASTER_PORT)."""
    return Path(f"/dev/shm/{SHM_BUFFER_NAME}_{os.getuid()}_{addr}_{port}_{rank}")


# --- Process-group teardown ------------------------------------------------------------------
# DeepSpeed caches the groups it derives from the world (data parallel, ZeRO's intra-node
# group) in module globals of ``deepspeed.utils.groups``; only ``deepspeed.comm``'s own
# ``destroy_process_group`` forgets them. Torch's alone leaves them pointing at a destroyed
# group, and the next ``deepspeed.initialize`` in the same process (a second run in a notebook,
# a warm test worker) fails with "Group ... is not registered". ``deepspeed.comm.cdb`` (the
# current backend, None before ``init_distributed``; the package re-exports a stale copy, so
# it is read from ``deepspeed.comm.comm``) is an undocumented module global.
# Tested with deepspeed 0.19.8.
def destroy_world() -> None:
    """Destroy the default process group through DeepSpeed when DeepSpeed started it (so its
    cached groups go with it), through torch otherwise."""
    import torch.distributed as dist

    ds_comm = importlib.import_module("deepspeed.comm.comm")
    if getattr(ds_comm, "cdb", None) is not None and hasattr(ds_comm, "destroy_process_group"):
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


# --- Classes DeepSpeed pickles into its checkpoints -----------------------------------------
# DeepSpeed's ``.pt`` files are opened with ``torch.load(weights_only=True)`` before DeepSpeed
# loads them (`checkpoint.check_pickles`), so a crafted file cannot run code. These plain
# data holders (loss scaler, ZeRO stage, the fragment map of ZeRO partitions) are the only
# non-tensor classes DeepSpeed pickles there; their module paths are not an API. Tested with
# deepspeed 0.19.8 (ZeRO 0-3, fp32 / bf16, CPU).
PICKLED_CLASSES = (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                   ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                   ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                   ("deepspeed.utils.tensor_fragment", "fragment_address"))


def pickled_classes() -> list:
    """The classes of `PICKLED_CLASSES` this DeepSpeed has (a missing one is skipped here
    and reported by `check_internals`)."""
    found = []
    for module, name in PICKLED_CLASSES:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


# --- Universal checkpoints ------------------------------------------------------------------
# Resuming ZeRO-1/2 optimizer partitions at another world size goes through DeepSpeed's
# universal checkpoint: the converter module run as a script (its flags
# ``--inject_missing_state`` and the worker counts are undocumented), then the engine built
# with the config key ``checkpoint.load_universal`` (``runtime/constants.py``:
# LOAD_UNIVERSAL_CHECKPOINT). Tested with deepspeed 0.19.8.
UNIVERSAL_CONVERTER = "deepspeed.checkpoint.ds_to_universal"
UNIVERSAL_FLAGS = ("--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1")
LOAD_UNIVERSAL = "load_universal"


# ``python -m`` puts the working directory first on the child's sys.path, so a ``deepspeed/``
# folder in the directory a user starts from would run instead of DeepSpeed: ``-P`` (Python
# >= 3.11) leaves it out, and the caller also runs the command from an empty directory of its
# own (`checkpoint.to_universal`), which covers older Pythons and relative PYTHONPATH entries.
SAFE_PATH_FLAGS = ("-P",) if sys.version_info >= (3, 11) else ()


def universal_conversion_command(src: str | Path, dst: str | Path) -> list[str]:
    """The command converting the DeepSpeed checkpoint folder ``src`` into ``dst`` (absolute
    paths: it runs from another directory); it imports nothing from its working directory."""
    return [sys.executable, *SAFE_PATH_FLAGS, "-m", UNIVERSAL_CONVERTER,
            "--input_folder", os.path.abspath(src), "--output_folder", os.path.abspath(dst),
            *UNIVERSAL_FLAGS]


def with_load_universal(ds_config: dict) -> dict:
    """``ds_config`` (a copy) telling the engine to load a universal checkpoint."""
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), LOAD_UNIVERSAL: True}}


# --- DeepSpeed's config parser --------------------------------------------------------------
# ``deepspeed.runtime.config.DeepSpeedConfig`` (the parser ``deepspeed.initialize`` runs) and
# its optimizer names ``DEEPSPEED_OPTIMIZERS`` check a config on every rank before any
# collective (`ds_engine.check_ds_config`); ``deepspeed.initialize`` would only raise after
# the process group is up. Neither is documented. Tested with deepspeed 0.19.8.
CONFIG_MODULE = "deepspeed.runtime.config"


def refresh_master_weights(engine) -> None:
    """After the module's parameters were written from outside (the outer synchronisation
    across sites), make the optimizer's fp32 master copy follow them: ZeRO-1/2 and the bf16 /
    fp16 wrappers keep one (``refresh_fp32_params``, which their own checkpoint loading
    calls); a plain torch optimizer (ZeRO-0, fp32) steps the module's parameters themselves."""
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if refresh is not None:
        refresh()


def parse_ds_config(ds_config: dict) -> None:
    """Run DeepSpeed's own parser on ``ds_config`` (raises what it raises)."""
    importlib.import_module(CONFIG_MODULE).DeepSpeedConfig(ds_config)


def parser_world_size() -> int:
    """The world size DeepSpeed's config parser checks the batch keys against, read as it reads
    it: ``deepspeed.comm.get_world_size()``, 1 where that raises (DeepSpeed's communication
    never started in this process). Once anything started it (Accelerate's DeepSpeed plugin,
    ``deepspeed.init_distributed``, an earlier run in the process) it is the live process
    group's size. Tested with deepspeed 0.19.8 (``DeepSpeedConfig.__init__``)."""
    try:
        return int(importlib.import_module("deepspeed.comm").get_world_size())
    except (RuntimeError, AssertionError, AttributeError):  # what DeepSpeed's parser catches
        return 1


def optimizer_names() -> list[str]:
    """The optimizer types DeepSpeed itself builds (lower case)."""
    return list(importlib.import_module(CONFIG_MODULE).DEEPSPEED_OPTIMIZERS)


def zero_tested_torch_optimizers() -> list[str]:
    """The torch.optim optimizers DeepSpeed's ZeRO accepts without
    ``zero_allow_untested_optimizer`` (lower case), from DeepSpeed's own list
    (``deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS``, undocumented; 0.19.8: Adam,
    AdamW, Adagrad)."""
    supported = importlib.import_module("deepspeed.runtime.zero.utils").ZERO_SUPPORTED_OPTIMIZERS
    import torch

    return [cls.__name__.lower() for cls in supported if getattr(torch.optim, cls.__name__, None) is cls]


# --- ZeRO optimizer offload -----------------------------------------------------------------
# Whether ZeRO keeps the optimizer state on the host decides which Adam DeepSpeed builds (its
# CPU Adam for offload, `ds_engine.with_torch_adam` otherwise). It is read with DeepSpeed's own
# ZeRO config model (``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``, the device enum of
# ``deepspeed.runtime.zero.offload_config``), as ``DeepSpeedEngine.zero_use_cpu_optimizer``
# does, so deprecated spellings (``cpu_offload``) count too. Undocumented modules. Tested with
# deepspeed 0.19.8.
ZERO_CONFIG_MODULE = "deepspeed.runtime.zero.config"
OFFLOAD_CONFIG_MODULE = "deepspeed.runtime.zero.offload_config"


def offloads_optimizer(ds_config: dict) -> bool:
    """Whether ``ds_config``'s ZeRO section offloads the optimizer (to cpu or nvme)."""
    zero_config = importlib.import_module(ZERO_CONFIG_MODULE).DeepSpeedZeroConfig
    devices = importlib.import_module(OFFLOAD_CONFIG_MODULE).OffloadDeviceEnum
    offload = zero_config(**ds_config.get("zero_optimization", {})).offload_optimizer
    return offload is not None and offload.device in (devices.cpu, devices.nvme)


# --- The config a ZeRO-0 checkpoint was written with -----------------------------------------
# DeepSpeed saves the config it ran with under ``ds_config`` in its model-states file, at ZeRO
# 0-2 ``mp_rank_00_model_states.pt`` in the checkpoint's tag folder (``DeepSpeedEngine.
# _get_ckpt_name``, ``_common_checkpoint_state``); at ZeRO-0 that file also holds the whole
# optimizer state, whose layout depends on the Adam that wrote it (`ds_engine.with_torch_adam`).
# Neither the file name nor the key is documented. Tested with deepspeed 0.19.8.
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
SAVED_CONFIG_KEY = "ds_config"


def saved_ds_config(ckpt: str | Path) -> dict | None:
    """The DeepSpeed config the checkpoint folder ``ckpt`` was written with (ZeRO 0-2; None
    where its model-states file or the key is missing). Opened with ``weights_only=True``."""
    import torch

    path = Path(ckpt) / MODEL_STATES_FILE
    if not path.is_file():
        return None
    with torch.serialization.safe_globals(pickled_classes()):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    config = state.get(SAVED_CONFIG_KEY) if isinstance(state, dict) else None
    return config if isinstance(config, dict) else None


# --- The check ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Internal:
    what: str  # the internal, as DeepSpeed spells it
    why: str  # what gmeta_ds uses it for
    probe: Callable[[], bool]  # True when the installed DeepSpeed has it


def _has_zero3_hooks() -> bool:
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    return callable(getattr(DeepSpeedZeRoOffload, ZERO3_REMOVE_HOOKS, None))


def _has_body_hooks() -> bool:
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    return (callable(getattr(DeepSpeedZeRoOffload, ZERO3_REGISTER_HOOKS, None))
            and callable(getattr(DeepSpeedZeRoOffload, ZERO3_COORDINATOR, None))
            and "reset_step()" in _source(DeepSpeedZeRoOffload.setup_zero_stage3_hooks)
            and callable(getattr(importlib.import_module(ZERO3_MODULE_INIT[0]), ZERO3_MODULE_INIT[1], None)))


def _stage3_has_hooks_owner() -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return f"self.{ZERO3_HOOKS_OWNER} =" in _source(DeepSpeedZeroOptimizer_Stage3.__init__)


def _zero3_sets(attr: str) -> Callable[[], bool]:
    def probe() -> bool:
        from deepspeed.runtime.zero.partition_parameters import Init

        return f"param.{attr} =" in _source(Init._convert_to_deepspeed_param)
    return probe


def _has_shm_hook() -> bool:
    ds_torch = _shm_module()
    backend = getattr(ds_torch, SHM_BACKEND, None)
    # Replacing the module function works only while the backend looks it up when built.
    return (callable(getattr(ds_torch, SHM_BUILD, None)) and backend is not None
            and f"{SHM_BUILD}()" in _source(backend.__init__))


def _shm_name_matches() -> bool:
    import deepspeed

    path = Path(deepspeed.__file__).parent / SHM_SOURCE
    text = " ".join(path.read_text().split()) if path.is_file() else ""
    return all(s in text for s in (f'#define SHM_BUFFER_NAME "{SHM_BUFFER_NAME}"',
                                   '"%s_%d_%s_%s", SHM_BUFFER_NAME, getuid(), addr_string, port_string',
                                   '"%s_%d", shm_name_prefix, rank'))


def _has_world_teardown() -> bool:
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    return hasattr(ds_comm, "cdb") and callable(getattr(ds_comm, "destroy_process_group", None))


def _has_class(module: str, name: str) -> Callable[[], bool]:
    return lambda: isinstance(getattr(importlib.import_module(module), name, None), type)


def _converter_accepts_flags() -> bool:
    converter = importlib.import_module(UNIVERSAL_CONVERTER)
    argv = sys.argv
    sys.argv = ["ds_to_universal", "--input_folder", "in", "--output_folder", "out", *UNIVERSAL_FLAGS]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            converter.parse_arguments()
    except SystemExit:  # argparse: unknown flag
        return False
    finally:
        sys.argv = argv
    return callable(getattr(converter, "main", None))


def _load_universal_key() -> bool:
    return getattr(importlib.import_module("deepspeed.runtime.constants"),
                   "LOAD_UNIVERSAL_CHECKPOINT", None) == LOAD_UNIVERSAL


def _has_config_parser() -> bool:
    return isinstance(getattr(importlib.import_module(CONFIG_MODULE), "DeepSpeedConfig", None), type)


def _has_optimizer_names() -> bool:
    names = getattr(importlib.import_module(CONFIG_MODULE), "DEEPSPEED_OPTIMIZERS", None)
    return isinstance(names, (list, tuple, set)) and all(isinstance(n, str) for n in names) and "adam" in names


def _has_offload_model() -> bool:
    fields = getattr(importlib.import_module(ZERO_CONFIG_MODULE).DeepSpeedZeroConfig, "model_fields", {})
    devices = importlib.import_module(OFFLOAD_CONFIG_MODULE).OffloadDeviceEnum
    return "offload_optimizer" in fields and all(hasattr(devices, d) for d in ("cpu", "nvme"))


def _saves_config_in_model_states() -> bool:
    from deepspeed.runtime.engine import DeepSpeedEngine

    name = '"mp_rank_" + mp_rank_str + "_model_states.pt"'
    return (name in _source(DeepSpeedEngine._get_ckpt_name)
            and f"{SAVED_CONFIG_KEY}=self.config" in _source(DeepSpeedEngine._common_checkpoint_state))


INTERNALS = (
    Internal(f"DeepSpeedZeRoOffload.{ZERO3_REMOVE_HOOKS} (deepspeed.runtime.zero.parameter_offload)",
             "removing ZeRO-3's module hooks: the learner runs on parameters gathered per micro-step",
             _has_zero3_hooks),
    Internal(f"DeepSpeedZeRoOffload.{ZERO3_REGISTER_HOOKS} and {ZERO3_COORDINATOR}().reset_step "
             "(deepspeed.runtime.zero.parameter_offload)",
             "keeping a split model's body partitioned under ZeRO-3 (hooks on the body alone)", _has_body_hooks),
    Internal(f"DeepSpeedZeroOptimizer_Stage3.{ZERO3_HOOKS_OWNER} (deepspeed.runtime.zero.stage3)",
             "reaching ZeRO-3's module hooks from engine.optimizer", _stage3_has_hooks_owner),
    Internal(f"the ZeRO-3 parameter attribute {ZERO3_ID_ATTR} (zero.Init._convert_to_deepspeed_param)",
             "telling a ZeRO-3 partitioned module from a plain one", _zero3_sets(ZERO3_ID_ATTR)),
    Internal(f"the ZeRO-3 parameter attribute {ZERO3_NUMEL_ATTR} (zero.Init._convert_to_deepspeed_param)",
             "counting the parameters and gradient bytes of a partitioned module", _zero3_sets(ZERO3_NUMEL_ATTR)),
    Internal(f"{SHM_MODULE}.{SHM_BUILD}, called by {SHM_BACKEND}.__init__",
             "skipping the JIT build of the CPU shared-memory all-reduce op (inference only)", _has_shm_hook),
    Internal(f"the /dev/shm buffer name {SHM_BUFFER_NAME}_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> "
             f"(deepspeed/{SHM_SOURCE.as_posix()})",
             "removing the CPU all-reduce buffers DeepSpeed never unlinks", _shm_name_matches),
    *(Internal(f"{module}.{name}", "allow-listing DeepSpeed's pickled checkpoint classes for "
               "torch.load(weights_only=True)", _has_class(module, name))
      for module, name in PICKLED_CLASSES),
    Internal("deepspeed.comm.comm.cdb and deepspeed.comm.destroy_process_group",
             "a second run in the same process (DeepSpeed's cached groups forgotten at teardown)",
             _has_world_teardown),
    Internal(f"python -m {UNIVERSAL_CONVERTER} {' '.join(UNIVERSAL_FLAGS)}",
             "resuming ZeRO-1/2 optimizer state at another world size", _converter_accepts_flags),
    Internal(f"the config key checkpoint.{LOAD_UNIVERSAL} (deepspeed.runtime.constants.LOAD_UNIVERSAL_CHECKPOINT)",
             "loading a converted universal checkpoint", _load_universal_key),
    Internal(f"{CONFIG_MODULE}.DeepSpeedConfig", "checking the DeepSpeed config before any collective",
             _has_config_parser),
    Internal(f"{CONFIG_MODULE}.DEEPSPEED_OPTIMIZERS", "checking deepspeed.optimizer.type before any collective",
             _has_optimizer_names),
    Internal(f"{ZERO_CONFIG_MODULE}.DeepSpeedZeroConfig.offload_optimizer and "
             f"{OFFLOAD_CONFIG_MODULE}.OffloadDeviceEnum (cpu, nvme)",
             "telling whether ZeRO offloads the optimizer (which Adam DeepSpeed builds)", _has_offload_model),
    Internal(f"the checkpoint file {MODEL_STATES_FILE} and its key {SAVED_CONFIG_KEY} "
             "(DeepSpeedEngine._get_ckpt_name, _common_checkpoint_state)",
             "resuming a ZeRO-0 checkpoint with the Adam that wrote it", _saves_config_in_model_states),
)


def _has_refresh_fp32() -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return all(callable(getattr(cls, "refresh_fp32_params", None)) for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer))


INTERNALS = (*INTERNALS,
             Internal("deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS",
                      "refusing, before any collective, a torch optimizer ZeRO would assert on",
                      lambda: "adam" in zero_tested_torch_optimizers()),
             Internal("DeepSpeedZeroOptimizer.refresh_fp32_params and BF16_Optimizer.refresh_fp32_params",
                      "the outer synchronisation across sites (sites.count > 1)", _has_refresh_fp32))


def check_internals() -> list[str]:
    """One line per internal the installed DeepSpeed lacks (empty: all present)."""
    version = deepspeed_version()
    problems = []
    for internal in INTERNALS:
        try:
            present = internal.probe()
            detail = ""
        except Exception as exc:  # noqa: BLE001 - an import or attribute error is "missing"
            first = (str(exc).splitlines() or [""])[0][:200]
            present, detail = False, f" [{type(exc).__name__}: {first}]"
        if not present:
            problems.append(f"deepspeed {version}: {internal.what} is missing (used for {internal.why})"
                            f"{detail}; {_tested()}")
    return problems
