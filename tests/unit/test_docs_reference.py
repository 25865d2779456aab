"""The reference pages stay generated from the code: docs/configuration.md equals what the
config dataclasses render, and the public API's docstrings document every parameter in a
Google-style ``Args:`` section (what mkdocstrings renders on the site, mkdocs.yml)."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import gmeta_ds
import gmeta_ds.serving
from gmeta_ds.config import reference

ROOT = Path(__file__).resolve().parents[2]


def args_section(doc: str | None) -> set[str]:
    """The parameter names a Google-style docstring lists under ``Args:``."""
    names, inside = set(), False
    for line in inspect.cleandoc(doc or "").splitlines():
        if re.fullmatch(r"(Args|Arguments):\s*", line):
            inside = True
        elif inside and line and not line[0].isspace():
            inside = False
        elif inside and (match := re.match(r"\s{4}\**(\w+)\s*(\([^)]*\))?:", line)):
            names.add(match.group(1))
    return names


def parameters(fn) -> list[str]:
    """``fn``'s named parameters (not self/cls, *args or **kwargs)."""
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    try:
        signature = inspect.signature(fn)
    except ValueError:  # an exception class that keeps Exception's own (*args) signature
        return []
    return [p.name for p in signature.parameters.values()
            if p.name not in ("self", "cls") and p.kind not in skip]


def public_callables():
    """(qualified name, callable, its docstrings) of every public function, class and method of
    ``gmeta_ds`` (its _PUBLIC names) and ``gmeta_ds.serving`` (its __all__)."""
    names = [(f"gmeta_ds.{n}", getattr(gmeta_ds, n)) for n in gmeta_ds._PUBLIC]
    names += [(f"gmeta_ds.serving.{n}", getattr(gmeta_ds.serving, n)) for n in gmeta_ds.serving.__all__]
    for qual, obj in names:
        if inspect.isclass(obj):
            # A subclass that keeps its base's constructor (MAML on MetaAlgorithm) is documented
            # there: its parameters are the base's, listed in the base's docstrings.
            owner = next(c for c in obj.__mro__ if "__init__" in vars(c))
            init = vars(owner)["__init__"]
            yield qual, obj, [obj.__doc__, getattr(init, "__doc__", None), owner.__doc__]
            for name, member in vars(obj).items():
                if not name.startswith("_") and inspect.isfunction(member):
                    yield f"{qual}.{name}", member, [member.__doc__]
        elif inspect.isfunction(obj):
            yield qual, obj, [obj.__doc__]


def missing_args() -> dict[str, list[str]]:
    """Qualified name -> its parameters that no ``Args:`` section of its docstrings names."""
    out = {}
    for qual, obj, docs in public_callables():
        if dataclasses.is_dataclass(obj) and not docs[0]:
            docs = [None]
        said = set().union(*(args_section(d) for d in docs))
        missing = [p for p in parameters(obj) if p not in said]
        if missing:
            out[qual] = missing
    return out


def test_configuration_page_is_generated():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == reference.render(), (
        "docs/configuration.md is stale: run python -m gmeta_ds.config.reference > docs/configuration.md")


def test_every_config_key_is_on_the_page_with_its_text():
    rows = {key: doc for key, _, _, doc in reference.config_keys()}
    assert {"meta.algorithm", "embedding.tables.<table>.kind", "deepspeed"} <= set(rows)
    assert not [key for key, doc in rows.items() if not doc], "config fields without a comment"
    assert "one of maml, fomaml, reptile, metasgd" in reference.allowed("meta.algorithm", str)
    assert "at most 10000 steps" in reference.allowed("meta.inner_steps", int)


def test_args_section_parser():
    doc = """Do it.

    Args:
        x: the input.
        y (int): the count,
            on two lines.
        **kw: ignored.

    Returns:
        z: not a parameter.
    """
    assert args_section(doc) == {"x", "y", "kw"}


def test_public_api_documents_every_parameter():
    missing = missing_args()
    assert not missing, f"public names whose docstring lacks an Args entry for these parameters: {missing}"


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "reference").glob("*.md")), ids=lambda p: p.name)
def test_reference_pages_name_existing_objects(page):
    for target in re.findall(r"^::: ([\w.]+)$", page.read_text(), flags=re.MULTILINE):
        module, _, name = target.rpartition(".")
        assert hasattr(__import__(module, fromlist=[name]), name), f"{page.name}: {target} does not exist"


def test_reference_pages_cover_the_public_api():
    pages = "".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    shown = set(re.findall(r"^::: [\w.]+\.(\w+)$", pages, flags=re.MULTILINE))
    assert not (set(gmeta_ds._PUBLIC) | set(gmeta_ds.serving.__all__)) - shown
