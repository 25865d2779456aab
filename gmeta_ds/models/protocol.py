"""The model contract (docs/api.md) as types: what a model must offer, the optional hooks it
may offer, and the one place that reads them (`model_hooks`).

Required: ``model(rows (N, F, d)) -> logits (N,)`` ((N, C) for multiclass labels) and the
parameters of an ``nn.Module``. Optional (`MetaModel`'s attributes; a model without one gets
the default of `ModelHooks`): ``row_fields``, ``embed_dim``, ``embedding``, ``embed``,
``split_body``, ``default_adapt``, and a recipe: a child module that is a `TaskRecipeSource`
(models/popularity.py's `PopularityOffset`), which shapes each task's adaptation through the
inner loop's hooks (`functional.inner.TaskRecipe`). Adding a recipe is one model file: a
module implementing `TaskRecipeSource`, attached to the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

from torch import Tensor, nn

from gmeta_ds.functional.inner import TaskRecipe
from gmeta_ds.functional.split import BodySplit

EMBEDDING_ATTR = "embedding"  # the attribute of a model's own tables (`MetaModel.embedding`)


@runtime_checkable
class TaskRecipeSource(Protocol):
    """A child module of a model that brings a recipe (`PopularityOffset`): per-row side input
    made from a task's ids, and the inner loop's hooks configured by the algorithm's settings."""

    def side_input(self, ids: Tensor, labels: Tensor | None = None) -> Tensor:
        """Per-row data of ids (..., F_single) -> (...); ``labels``: the rows are training rows."""

    def task_recipe(self, settings: Any, prefix: str) -> TaskRecipe:
        """The inner loop's hooks for an algorithm's ``settings`` (`AlgorithmSettings`); ``prefix``:
        this module's parameter names in the model (``<attribute>.``)."""


class MetaModel(Protocol):
    """What the meta-learner needs of a model. The attributes are optional hooks: read them
    through `model_hooks`, never by probing the model."""

    row_fields: Sequence[str]  # the single-hot fields, in the tasks' id-column order
    embed_dim: int  # the tables' dim
    embedding: Any  # its own (unsharded) `EmbeddingCollection`, or None when sharded
    embed: Callable[[Tensor, "dict | None"], Tensor]  # its own lookup (ids, multi) -> rows (N, F, d)
    split_body: Callable[[list[str]], "BodySplit | None"]  # body/head split for adapted names
    default_adapt: tuple[str, ...]  # meta.adapt globs when the run names none

    def __call__(self, rows: Tensor) -> Tensor:
        """One task's rows (N, F, d) -> logits (N,)."""

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters (as ``nn.Module``'s)."""


OPTIONAL_HOOKS = ("row_fields", "embed_dim", "embedding", "embed", "split_body", "default_adapt")


@dataclass(frozen=True)
class ModelHooks:
    """A model's optional hooks as read once (`model_hooks`): each as the model gives it, None
    when it has none; ``recipe``: its `TaskRecipeSource` child (``recipe_prefix``: that
    child's parameter prefix), or None."""

    row_fields: "Sequence[str] | None" = None
    embed_dim: Any = None
    embedding: Any = None
    embed: "Callable | None" = None
    split_body: "Callable | None" = None
    default_adapt: "Sequence[str] | None" = None
    recipe: "TaskRecipeSource | None" = None
    recipe_prefix: str = ""

    def task_recipe(self, settings: Any) -> "TaskRecipe | None":
        """The recipe's inner-loop hooks for the algorithm's ``settings``, or None without one."""
        return None if self.recipe is None else self.recipe.task_recipe(settings, self.recipe_prefix)


def model_hooks(net: nn.Module) -> ModelHooks:
    """The optional hooks of ``net`` (`MetaModel`): the one place that reads them. Cheap (a few
    attribute reads), so callers resolve them where they need them and see a model changed
    since (tables attached by ``gm.initialize`` or ``gm.load_model``)."""
    found = {name: getattr(net, name, None) for name in OPTIONAL_HOOKS}
    children = net.named_children() if isinstance(net, nn.Module) else ()
    recipe = next(((n, m) for n, m in children if isinstance(m, TaskRecipeSource)), None)
    if recipe is None:
        return ModelHooks(**found)
    return ModelHooks(**found, recipe=recipe[1], recipe_prefix=recipe[0] + ".")
