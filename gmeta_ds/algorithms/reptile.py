"""Reptile (Nichol et al., 2018).

Meta-gradient of each adapted parameter: ``theta - mean_t(phi_t)`` (the average move of the
inner loop, phi after ``inner_steps`` first-order SGD steps on the support set). It enters
``engine.backward`` through the surrogate ``sum <theta, (theta - mean phi).detach()>``, whose
gradient is exactly that; with an outer SGD step of size eps this is
``theta <- theta + eps (mean phi - theta)``.

Parameters that are not adapted (e.g. embedding tables) get the first-order gradient of the
query loss at phi, as in FOMAML, so they still learn; the query loss is also what is logged.
"""
from __future__ import annotations

from gmeta_ds.algorithms.base import MetaAlgorithm, MetaOutput, meta_output


class Reptile(MetaAlgorithm):
    """First-order Reptile with the surrogate outer loss described above; built with
    `MetaAlgorithm`'s arguments (documented there)."""

    first_order = True

    def outer_loss(self, inner, lrs, theta, support, query) -> MetaOutput:
        """The query loss at the adapted parameters (detached from them) plus the surrogate
        whose gradient is ``theta - mean_t(phi_t)``.

        Args:
            inner (InnerLoop): the first-order inner loop.
            lrs (LearningRates): adapted name -> inner learning rate.
            theta (Params): the adapted meta-parameters, whose average move is the gradient.
            support (tuple): the T tasks' support inputs (x, labels, mask).
            query (tuple): the T tasks' query inputs (x, labels, mask).

        Returns:
            The `MetaOutput` whose loss is the mean query loss plus the surrogate.
        """
        out = self.run(inner, lrs, theta, support, query, detach_query=True)
        surrogate = sum((theta[n] * (theta[n] - out.fast[n].mean(dim=0)).detach()).sum() for n in theta)
        return meta_output(out.query_loss.mean() + surrogate, out)
