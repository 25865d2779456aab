"""The registries: registry.py declares every pluggable name (config validation reads them, no
torch), and each kind's home module binds them to what they build."""
from __future__ import annotations

import importlib

import pytest

from gmeta_ds.registry import REGISTRIES, Registry


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_every_declared_name_is_bound_by_its_home(registry):
    importlib.import_module(registry.home)
    assert [n for n in registry if not registry.bound(n)] == []


def test_a_name_looked_up_before_its_home_binds_it_names_the_home():
    things = Registry("thing", "thing.name", ("a", "b"), home="somewhere.things")
    assert list(things) == ["a", "b"] and "a" in things and things.names() == ("a", "b")
    with pytest.raises(LookupError, match="thing 'a' is declared but not bound: somewhere.things binds it"):
        things["a"]
    things.bind({"a": "collections:OrderedDict", "b": len})
    assert things["b"] is len and things["a"].__name__ == "OrderedDict"  # "module:attribute": imported on lookup
    with pytest.raises(KeyError, match="thing.name: 'c' is not one of a, b"):
        things["c"]


def test_bind_takes_declared_names_once_and_register_adds_new_ones():
    things = Registry("thing", "thing.name", ("a",), home="somewhere.things")
    with pytest.raises(ValueError, match="thing 'z' is not declared in gmeta_ds.registry"):
        things.bind({"z": 1})
    things.bind({"a": 1})
    with pytest.raises(ValueError, match="thing 'a' is bound already"):
        things.bind({"a": 2})
    things.register("mine", 3)
    assert things["mine"] == 3 and things.names() == ("a", "mine")
