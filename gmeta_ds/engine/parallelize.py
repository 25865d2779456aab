"""ZeRO applied to a `MetaLearner` from outside, in one place, before DeepSpeed wraps it.

The learner is single-device code that knows nothing of ZeRO stages: it runs with whatever
`parallelize` sets on it as plain state, ``active_split`` (the model's body split,
`gmeta_ds.functional.split`: the body once per micro-batch, the inner loop on the head) and
``runner`` (what its ``forward`` runs instead of its own meta-forward). This module decides
both from the ZeRO stage and ``meta.split_body``, as torchtitan's ``parallelize.py`` applies
each parallelism to a model that stays single-device.

ZeRO-3 partitions the parameters and fetches each submodule's slice from module hooks, under
which the functional inner loop cannot run (``functional_call`` swaps in fast weights, and a
second-order graph keeps references to tensors ZeRO-3 re-partitions in between). So a
micro-step runs either with a body split, whose body alone stays partitioned under
DeepSpeed's hooks while the rest is gathered (`step_parameters`), or with every parameter
gathered and the forward run through a parameter-less skeleton (`SkeletonForward`), which no
hook reaches.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from gmeta_ds.algorithms import MetaLearner, MetaOutput
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.split import BodySplit, check_split
from gmeta_ds.models.popularity import OFFSET_PREFIX, offset_of
from gmeta_ds.models.protocol import model_hooks

# Each learner `parallelize` gave a skeleton -> that skeleton, kept outside the learner (as
# torch's composable fully_shard keeps its state), for `single_process_template`.
_SKELETONS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def split_wanted(setting: "bool | str", zero_stage: int) -> bool:
    """Whether ``meta.split_body`` (``setting``) asks for the body split at this ZeRO stage:
    ``auto`` under ZeRO-3 (when the model offers one), ``true`` always, ``false`` never."""
    return setting is True or (setting == "auto" and zero_stage == 3)


def body_split(learner: MetaLearner) -> tuple[BodySplit | None, str]:
    """The model's body split for the learner's adapted parameters (`functional.split`), or
    None and why there is none."""
    net = learner.net
    if learner.adapted_fields:
        return None, "embedding rows adapt (meta.adapt names embedding.<field>)"
    if getattr(offset_of(net), "feature", None) is not None:
        return None, "the popularity feature enters the model's input rows (model.popularity_feature)"
    offer = model_hooks(net).split_body
    if offer is None:
        return None, f"{type(net).__name__} defines no split_body"
    # The popularity offset is added after the model's forward: never in its body.
    adapted = [n for n in learner.adapted if not n.startswith(OFFSET_PREFIX)]
    split = offer(adapted)
    if split is None:
        return None, (f"{type(net).__name__}.split_body has no body for meta.adapt "
                      f"{learner.algorithm.adapt} (everything, or its first layers, adapt)")
    why = check_split(net, split, adapted)
    return (None, why) if why else (split, "")


def _refuse_without_split(learner: MetaLearner, split: BodySplit | None, why: str) -> None:
    """``meta.split_body: true`` without a split is a `ConfigError` saying why."""
    if split is None and learner.algorithm.split_body is True:
        raise ConfigError([f"meta.split_body: true, but the model cannot be split: {why}"])


def check_split_body(learner: MetaLearner) -> None:
    """`parallelize`'s refusal of ``meta.split_body: true`` without a split, for the workloads'
    preflight (so ``gmeta-ds validate`` refuses what train refuses)."""
    if learner.algorithm.split_body is True:
        _refuse_without_split(learner, *body_split(learner))


@dataclass(eq=False)
class SkeletonForward:
    """A learner's forward when ZeRO-3 gathers all its parameters for each micro-step: its
    skeleton (`zero3_skeleton`) run with the learner's parameters and buffers, so the
    functional inner loop never goes through ZeRO-3's per-module fetch/release hooks, which
    would swap parameters out from under a second-order graph."""

    skeleton: nn.Module

    def __call__(self, learner: MetaLearner, batch, rows) -> MetaOutput:
        state = dict(learner.named_parameters())
        state.update(learner.named_buffers())
        return functional_call(self.skeleton, state, (batch, rows))


def zero3_skeleton(learner: MetaLearner) -> nn.Module:
    """A parameter-less copy of ``learner`` (on the meta device, held by no module, so
    DeepSpeed never sees it), made before ZeRO-3 partitions the learner. It never holds a
    second copy of the weights, not even briefly: every tensor is mapped to a meta tensor as
    it is copied."""
    memo: dict = {}
    for p in learner.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in learner.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(learner, memo)


def parallelize(learner: MetaLearner, zero_stage: int) -> BodySplit | None:
    """Set how ``learner`` runs at this ZeRO stage; call before DeepSpeed wraps it. Returns the
    body split its forward runs with (None: none), whose body `ds_engine.initialize` leaves
    under ZeRO-3's hooks. With a split (`split_wanted`) the forward runs the body once as an
    ordinary module call and the inner loop on the head; under ZeRO-3 the body then stays
    partitioned and only the rest is gathered per micro-step (`step_parameters`). ZeRO-3
    without a split: the forward runs through a skeleton (`SkeletonForward`) with every
    parameter gathered. ``meta.split_body: true`` without a split is a `ConfigError` saying why."""
    split, why = body_split(learner) if split_wanted(learner.algorithm.split_body, zero_stage) else (None, "")
    _refuse_without_split(learner, split, why)
    learner.active_split, learner.runner = None, None  # the skeleton below copies a plain learner
    if zero_stage == 3:
        _SKELETONS[learner] = zero3_skeleton(learner)
        if split is None:
            learner.runner = SkeletonForward(_SKELETONS[learner])
    learner.active_split = split
    return split


def step_parameters(learner: MetaLearner) -> list[nn.Parameter]:
    """What one micro-step needs gathered under ZeRO-3: every parameter, or with an active
    body split every parameter outside the body (DeepSpeed gathers the body layer by layer)."""
    split = learner.active_split
    if split is None:
        return list(learner.parameters())
    body = {id(p) for p in split.body.parameters()}
    return [p for p in learner.parameters() if id(p) not in body]


def single_process_template(learner: MetaLearner) -> MetaLearner:
    """What a plain single-process copy of ``learner`` is made from: the skeleton `parallelize`
    kept under ZeRO-3 (its parameters are not here once partitioned; the copy then needs
    ``to_empty`` before loading a state), else the learner itself."""
    return _SKELETONS.get(learner, learner)
