"""MAML (Finn et al., 2017) and its first-order approximation FOMAML.

MAML: the outer loss is the mean query loss at the adapted parameters, with the inner
gradients kept in the graph, so backward yields the second-order meta-gradient
d L_q(phi(theta)) / d theta. FOMAML (``first_order``): inner gradients are detached, so
d phi / d theta = I and the meta-gradient is grad L_q evaluated at phi.
Both use `MetaAlgorithm.outer_loss` unchanged; first order is a flag, not a copy.
"""
from __future__ import annotations

from gmeta_ds.algorithms.base import MetaAlgorithm


class MAML(MetaAlgorithm):
    """Second-order MAML; built with `MetaAlgorithm`'s arguments (documented there)."""

    first_order = False


class FOMAML(MAML):
    """First-order MAML: same outer loss, inner gradients detached; built with
    `MetaAlgorithm`'s arguments (documented there)."""

    first_order = True
