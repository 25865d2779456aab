"""Build DeepSpeed's CPU ops that the slow tests use, ahead of them (``make ops``; ``.ci/run``
runs it in the background while the wheel check installs).

DeepSpeed JIT-builds an op on its first use into ``TORCH_EXTENSIONS_DIR``: CPU Adam for the
optimizer-offload configs (``tests/launch/test_deepspeed_launcher.py``, ``zero2_offload``) and
FusedAdam for the checkpoint a gmeta_ds of before torch's Adam wrote
(``tests/launch/test_op_builds.py``). Each build is ~3 CPU-minutes of C++ on this machine's 2
cores; built here first, the tests find ninja's outputs up to date and load them. Run it with
the environment the tests run with (the venv's ``bin`` first on ``PATH``, the same
``TORCH_EXTENSIONS_DIR``), else the tests rebuild. Exit 1 naming the op that failed to build.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

OPS = ("CPUAdamBuilder", "FusedAdamBuilder")


def main() -> int:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the CPU accelerator's builders, as the tests
    # the folder tests/conftest.py gives the suite when TORCH_EXTENSIONS_DIR is unset
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))
    from deepspeed.accelerator import get_accelerator

    where = os.environ["TORCH_EXTENSIONS_DIR"]
    for name in OPS:
        start = time.monotonic()
        try:
            get_accelerator().create_op_builder(name).load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - a compiler error of any kind: name the op, let the tests build
            print(f"build_ops: {name} failed to build into {where}: {exc}", file=sys.stderr)
            return 1
        print(f"build_ops: {name} ready in {where} ({time.monotonic() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
