"""The export's safetensors reader (issue 49 item 5): what safetensors' own reader refuses is a
ConfigError naming the file (offsets that are floats, booleans, not contiguous or outside the
file, negative shapes, dtype lies, nested headers), a NaN or Inf weight is refused naming its
tensor, and a deeply nested model.json is a ConfigError, never a RecursionError."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import gmeta_ds as gm
from gmeta_ds.saved import read_meta
from gmeta_ds.serving.export import mapped_tensors


def _write(path, header, data: bytes):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_a_well_formed_file_is_mapped_as_written(tmp_path):
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "ids": torch.tensor([3, 1])},
              tmp_path / "ok.safetensors")
    got = mapped_tensors(tmp_path / "ok.safetensors")
    assert torch.equal(got["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert got["ids"].tolist() == [3, 1]


@pytest.mark.parametrize("header, data", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}}, 8),   # float offset
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}}, 8),  # boolean offset
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8),    # negative shape
    ({"a": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}}, 8),     # dtype lie
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),   # a gap before the data
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),   # overlap
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4),     # outside the file
    (b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 0),      # nested header
], ids=["float", "bool", "negative-shape", "dtype-lie", "gap", "overlap", "outside", "nested"])
def test_what_safetensors_refuses_is_refused_naming_the_file(tmp_path, header, data):
    path = _write(tmp_path / "bad.safetensors", header, b"\0" * data)
    with pytest.raises(gm.ConfigError, match=r"bad.safetensors: not a readable safetensors file"):
        mapped_tensors(path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_weight_that_is_not_finite_is_refused_naming_the_tensor(tmp_path, bad):
    weights = np.ones((4, 3), np.float32)
    weights[2, 1] = bad
    save_file({"fine": torch.ones(2), "head.weight": torch.from_numpy(weights)}, tmp_path / "m.safetensors")
    with pytest.raises(gm.ConfigError, match=r"m.safetensors: tensor 'head.weight' holds NaN or Inf"):
        mapped_tensors(tmp_path / "m.safetensors")


def test_a_deeply_nested_model_json_is_a_config_error(tmp_path):
    (tmp_path / "model.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(gm.ConfigError, match=r"model.json: not readable JSON"):
        read_meta(tmp_path)


@pytest.mark.parametrize("lacking", ["model", "embedding", "kind", "oov_id"])
def test_a_recipe_lacking_a_key_is_refused_naming_it(tmp_path, lacking):
    """A CLI export whose serving.recipe lacks a key (digest rewritten with it) was a KeyError
    traceback from gm.load_adapter and gmeta-ds serve; it is refused naming model.json and the key."""
    from tests.helpers import demo_export
    from tests.unit.test_saved_model import rewrite_meta

    folder = demo_export(tmp_path)
    meta = json.loads((folder / "model.json").read_text())
    del meta["serving"]["recipe"][lacking]
    rewrite_meta(folder, meta)
    with pytest.raises(gm.ConfigError, match=rf"model.json: 'serving.recipe' lacks {lacking}"):
        gm.load_adapter(folder)
