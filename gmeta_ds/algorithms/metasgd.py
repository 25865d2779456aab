"""Meta-SGD (Li et al., 2017): MAML with a learned inner learning rate per parameter element.

For every adapted parameter ``p`` the learner gains a meta-parameter ``alpha_p`` of p's shape,
initialised to ``meta.inner_lr`` (times ``meta.inner_lr_scale``'s multiplier); the inner step
is ``p - alpha_p * grad`` and both ``theta`` and ``alpha`` receive second-order meta-gradients
through the same ``engine.backward``.
The rates live in the learner (``inner_lrs.<name with . -> __>``, `meta_parameters`), so DeepSpeed owns,
partitions and checkpoints them like any dense parameter.
"""
from __future__ import annotations

import torch
from torch import nn

from gmeta_ds.algorithms.base import MetaAlgorithm
from gmeta_ds.errors import ConfigError


def _key(name: str) -> str:
    return name.replace(".", "__")


class MetaSGD(MetaAlgorithm):
    """Second-order MAML with meta-learned per-element inner learning rates; built with
    `MetaAlgorithm`'s arguments (documented there)."""

    first_order = False

    def meta_parameters(self, *, params, adapted, rows, embed_dim) -> dict[str, nn.Module]:
        """The learned rates: one per element of each adapted parameter, one per embedding
        dimension for the adapted rows, each starting at `rate`.

        Args:
            params (dict[str, Tensor]): the model's parameters by name.
            adapted (list[str]): the names of the adapted dense parameters.
            rows (list[str]): the names of the adapted rows (``embedding.<field>``).
            embed_dim (int | None): the model's embedding dimension (needed with ``rows``).

        Returns:
            ``{"inner_lrs": ParameterDict}`` of the rates (names with ``.`` -> ``__``).

        Raises:
            ConfigError: adapted rows and a model that states no int ``embed_dim``.
        """
        rates = {_key(n): torch.full_like(params[n], self.rate(n)) for n in adapted}
        # Deduplicated rows vary in number per micro-batch: one rate per embedding dimension.
        if rows and not (isinstance(embed_dim, int) and embed_dim > 0):
            raise ConfigError([f"meta.algorithm: metasgd learns one inner rate per embedding dimension for the "
                               f"adapted rows ({', '.join(rows)}): the model must state the tables' dim as "
                               f"model.embed_dim (an int), got {embed_dim!r}"])
        for name in rows:
            rates[_key(name)] = torch.full((embed_dim,), self.rate(name))
        return {"inner_lrs": nn.ParameterDict({k: nn.Parameter(v) for k, v in rates.items()})}

    def learning_rates(self, names, owned=None):
        """The learned rates (parameters of the learner) of the adapted names.

        Args:
            names (list[str]): the adapted names.
            owned (dict[str, nn.Module]): the learner's algorithm-owned modules; its
                ``inner_lrs`` holds the rates.

        Returns:
            rates (dict[str, Tensor]): name -> its rate tensor (the parameter's shape, or (d,)
                for rows).
        """
        rates = owned["inner_lrs"]
        return {n: rates[_key(n)] for n in names}
