"""Serving a meta-learned model: adapt to each user at request time, score their candidates.

`load_adapter` (also ``gm.load_adapter``) loads an export folder into a `ServedModel` in this
process (no DeepSpeed, no process group); ``gmeta-ds serve`` (`gmeta_ds.serving.server`) puts it
behind HTTP. docs/serving.md walks from a trained run to a first request.
"""
from gmeta_ds.serving.model import Scored, ServedModel, UserRequest, load_adapter

__all__ = ["load_adapter", "ServedModel", "UserRequest", "Scored"]
