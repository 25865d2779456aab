"""What launchers hand to a rank, checked before anything starts (layer 0: no torch).

- Hostfiles (``deepspeed --hostfile``): one ``HOST slots=N`` per line, ``#`` comments; checked
  with the file and line named (DeepSpeed's own parser accepts ``slots=0`` and trailing
  garbage, and reports duplicates without a line number).
- Where the DeepSpeed config comes from: the run config's ``deepspeed:`` key, DeepSpeed's
  ``--deepspeed_config FILE`` argument, or Accelerate's ``deepspeed_config_file`` (exported by
  ``accelerate launch`` as ``ACCELERATE_DEEPSPEED_CONFIG_FILE``). A launcher-level file
  overrides the run config's; two launcher-level files that disagree are an error.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

from gmeta_ds.errors import ConfigError

MAX_SLOTS = 4096  # ranks on one host
_HOST_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:\-\[\]]+)\s+slots=(?P<slots>\d+)\s*$")

# Accelerate settings that only make sense inside a DeepSpeed JSON we cannot see from its
# YAML; gmeta_ds needs the config file form (it resolves batch keys itself).
ACCELERATE_INLINE_KEYS = ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                          "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "ACCELERATE_GRADIENT_CLIPPING")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int


def parse_hostfile(path: str | Path) -> list[Host]:
    """The hosts of a DeepSpeed hostfile, in order; `ConfigError` naming every bad line."""
    path = Path(path)
    if not path.is_file():
        what = ("is a directory, expected a file of 'HOST slots=N' lines" if path.is_dir()
                else "does not exist")
        raise ConfigError([f"hostfile {str(path)!r} {what}"])
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    problems: list[str] = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"hostfile {str(path)!r} cannot be read as text ({exc})"]) from exc
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if match is None:
            problems.append(f"{path}:{number}: {raw.strip()!r} is not 'HOSTNAME slots=N'")
            continue
        name, slots = match["host"], int(match["slots"])
        if slots < 1:
            problems.append(f"{path}:{number}: host {name!r} has slots={slots}; need at least 1")
        elif slots > MAX_SLOTS:
            problems.append(f"{path}:{number}: host {name!r} has slots={slots}; at most {MAX_SLOTS} per host")
        if name in seen:
            problems.append(f"{path}:{number}: host {name!r} is listed again (first on line "
                            f"{seen[name]}); list each host once with its total slots")
        seen.setdefault(name, number)
        hosts.append(Host(name, slots, number))
    if not hosts and not problems:
        problems.append(f"{path}: no hosts (expected lines like 'node0 slots=8')")
    if problems:
        raise ConfigError(problems, str(path))
    return hosts


def hostfile_world_size(hosts: list[Host], num_gpus: int | None = None) -> int:
    """Ranks a hostfile launch starts: every host's slots, or ``num_gpus`` per host."""
    return sum(num_gpus if num_gpus else h.slots for h in hosts)


def launcher_ds_config(cli_path: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The DeepSpeed config file imposed by the launch (None: use the run config's).

    ``cli_path`` is ``--deepspeed_config``; Accelerate's comes from the environment. Raised
    on every rank before any collective when they disagree or a file is missing.
    """
    env = os.environ if env is None else env
    problems: list[str] = []
    sources: dict[str, str] = {}
    if cli_path:
        sources["--deepspeed_config"] = cli_path
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        accel = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if accel:
            sources["accelerate deepspeed_config_file"] = accel
        else:
            inline = [k for k in ACCELERATE_INLINE_KEYS if k in env]
            problems.append(
                "accelerate launch: DeepSpeed settings in the Accelerate YAML "
                f"({', '.join(inline) or 'no deepspeed_config_file'}) are not read by gmeta_ds; "
                "set deepspeed_config.deepspeed_config_file to a JSON in ds_configs/ "
                "(e.g. launch/accelerate/single_node.yaml) or drop distributed_type: DEEPSPEED "
                "and name the JSON in the run config's 'deepspeed:' key")
    from gmeta_ds.config.deepspeed import missing_ds_config_hint, shipped_ds_config

    for name, value in list(sources.items()):
        if not Path(value).is_file():
            packaged = None if Path(value).is_dir() else shipped_ds_config(value)
            if packaged is not None:  # ds_configs/zero2.json from outside the checkout
                sources[name] = str(packaged)
                continue
            what = ("is a directory, expected a JSON file" if Path(value).is_dir()
                    else f"does not exist ({missing_ds_config_hint()})")
            problems.append(f"{name}: DeepSpeed config file {value!r} {what}")
    if len(sources) == 2 and not problems:
        a, b = (Path(v).resolve() for v in sources.values())
        if a != b:
            problems.append("the launch names two different DeepSpeed configs: "
                            + " vs ".join(f"{k}={v!r}" for k, v in sources.items())
                            + "; pass one of them")
    if problems:
        raise ConfigError(problems)
    return next(iter(sources.values()), None)
