"""An API script is quiet: building tasks into a store, reading them, evaluating and saving a
model print no 'Exception ignored' tracebacks at exit (a store array's file was closed by a
__del__ that found its module torn down) and no torch warning about read-only arrays."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    from tests.unit.test_saved_model import KEYS, Tower, _engine, _log
    import gmeta_ds as gm
    out = sys.argv[1]
    _log().to_parquet(out + "/log.parquet")
    data = gm.build_tasks(out + "/log.parquet", cache_dir=out + "/cache", **KEYS)
    for split in (data.train, data.test):
        split.ids[0:5], split.labels[0:5]  # opens the store's files
    engine = _engine(Tower(), data)
    engine.evaluate(data.test, bootstrap_resamples=0)
    engine.save_model(out + "/model", data)
    print("done")
""")


def test_an_api_script_exits_without_tracebacks_or_array_warnings(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=240, cwd=REPO, check=False)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert "not writable" not in proc.stderr, proc.stderr[-3000:]


def test_the_default_task_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    from gmeta_ds.config import DataConfig
    from gmeta_ds.data.builder import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root(DataConfig().cache_dir) == tmp_path / "xdg" / "gmeta_ds"
    assert cache_root(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root(DataConfig().cache_dir) == Path("~/.cache/gmeta_ds").expanduser()
