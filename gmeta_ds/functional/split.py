"""Splitting a model into a body that no task adapts and a head that the inner loop adapts.

When ``meta.adapt`` selects only the last part of a model (ANIL's classifier head, MeLU's last
decision layers), the first part, the *body*, depends on no task-specific parameter: its
output on a task's rows is the same before and after every inner step. So it runs **once** on
all T tasks' support and query rows as an ordinary module call, and only the head runs in the
functional, vmapped, twice-differentiable inner loop, on the body's features.

This is exact, also for second-order MAML: the inner gradients are taken with respect to the
head's parameters only, so the outer loss reaches each body parameter only through the
features, and the outer backward differentiates the body's graph exactly once
(``tests/unit/algorithms/test_split.py`` checks the body's meta-gradient against the unsplit
path). It is what lets ZeRO-3 keep the body partitioned: DeepSpeed's own module hooks gather
a body layer, run it, and release it, in the forward and again in the backward, while only
the (small) head is gathered for the whole micro-step (`gmeta_ds.engine.parallelize`).

A model offers a split with ``split_body(adapted) -> BodySplit | None`` (``adapted``: the
parameter names ``meta.adapt`` selects): ``body`` is a module over the model's own
submodules (not registered anywhere: the model's state dict is unchanged) mapping one task's
inputs ``(N, ...)`` to features ``(N, ...)``; ``head(features)`` is the rest, so that
``model(x) == head(body(x))``; no adapted parameter may lie in the body.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten


@dataclass
class BodySplit:
    """``model(x) == head(body(x))``; ``body`` holds no adapted parameter."""

    body: nn.Module
    head: Callable[[Tensor], Tensor]


class HeadModule(nn.Module):
    """``forward(features) = split.head(features)`` over ``net``'s own submodules, so
    `torch.func.functional_call` can run the head on adapted ("fast") parameters: its
    parameter names are the net's with the prefix ``net.``."""

    PREFIX = "net."

    def __init__(self, net: nn.Module, split: BodySplit):
        super().__init__()
        self.net = net
        self.__dict__["split"] = split  # a plain attribute: the body is not a submodule here

    def forward(self, features):
        return self.split.head(features)


def body_parameter_ids(split: BodySplit) -> set[int]:
    return {id(p) for p in split.body.parameters()}


def check_split(net: nn.Module, split: BodySplit, adapted: list[str]) -> str | None:
    """Why ``split`` cannot serve the adapted parameters ``adapted`` of ``net`` (None: it can)."""
    in_body = body_parameter_ids(split)
    params = dict(net.named_parameters())
    inside = [n for n in adapted if id(params[n]) in in_body]
    if inside:
        return f"adapted parameters lie in the model's body ({', '.join(inside[:3])})"
    if not in_body:
        return "the body would hold no parameter"
    return None


def _flat(x, tasks: int) -> list[Tensor]:
    leaves, _ = tree_flatten(x)
    return [leaf.reshape(tasks * leaf.shape[1], *leaf.shape[2:]) for leaf in leaves]


def body_features(body: nn.Module, xs, xq):
    """The body once on every task's support and query rows: inputs ``xs`` (a tensor or a
    tuple of tensors, each (T, S, ...)) and ``xq`` ((T, Q, ...)) -> features (T, S, ...) and
    (T, Q, ...). Support and query rows go through one call, so a partitioned body gathers
    each layer once per micro-batch."""
    leaves_s, spec = tree_flatten(xs)
    leaves_q, spec_q = tree_flatten(xq)
    if spec != spec_q:
        raise ValueError("support and query inputs differ in structure")
    t, s, q = leaves_s[0].shape[0], leaves_s[0].shape[1], leaves_q[0].shape[1]
    joined = [torch.cat([a, b]) for a, b in zip(_flat(xs, t), _flat(xq, t))]
    features = body(tree_unflatten(joined, spec))
    if not isinstance(features, Tensor):
        raise TypeError(f"the model's body returned {type(features).__name__}, expected one tensor")
    return (features[: t * s].reshape(t, s, *features.shape[1:]),
            features[t * s:].reshape(t, q, *features.shape[1:]))
