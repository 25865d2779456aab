"""``sites``: meta-training across sites with local outer steps and a periodic synchronisation.

A run's ranks form ``count`` sites of equal size, numbered site by site (site s holds ranks
s W/count .. (s+1) W/count - 1). Inside a site the run is what it is on one site (DeepSpeed's
reduction, tables sharded over the site's ranks); across sites nothing is exchanged except
every ``sync_every`` meta-steps, when the sites' changes since the last synchronisation are
averaged and applied by the outer optimizer (plain averaging by default, DiLoCo's outer
Nesterov step on request: `gmeta_ds/engine/outer_sync.py`, docs/sites.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from gmeta_ds.config.checks import one_of

DELTA_DTYPES = ("fp32", "bf16", "int8")


@dataclass
class SitesConfig:
    """Sites and their synchronisation (DiLoCo for meta-learning)."""

    count: int = 1                            # sites the ranks form (1: one site, nothing of this section applies)
    sync_every: int = 50                      # H: meta-steps between synchronisations (and one at the end)
    # The outer optimizer (SGD) on the averaged change. Default: plain averaging (lr 1, no
    # momentum), which kept the demo's held-out AUC at synchronous training's over H = 10..200;
    # DiLoCo's outer step (lr 0.7, momentum 0.9, Nesterov) cost it 0.005-0.02 (docs/sites.md).
    outer_lr: float = 1.0
    outer_momentum: float = 0.0            # momentum of the outer SGD (DiLoCo: 0.9)
    nesterov: bool = False                 # Nesterov momentum for the outer SGD
    delta_dtype: str = "fp32"                 # what the changes cross sites as: fp32, bf16 or int8 (+ scales)


def validate_sites(sites: SitesConfig, problems: list[str]) -> None:
    """``sites.*`` on its own: counts >= 1, rates in range, a known wire format."""
    for key in ("count", "sync_every"):
        value = getattr(sites, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"sites.{key}: {value!r} must be an integer >= 1")
    if not sites.outer_lr > 0:
        problems.append(f"sites.outer_lr: {sites.outer_lr!r} must be > 0")
    if not 0 <= sites.outer_momentum < 1:
        problems.append(f"sites.outer_momentum: {sites.outer_momentum!r} must be in [0, 1)")
    if sites.nesterov and sites.outer_momentum == 0 and sites.count > 1:
        problems.append("sites.nesterov: true needs sites.outer_momentum > 0 (set nesterov: false for "
                        "plain averaging with outer_lr 1, outer_momentum 0)")
    one_of(problems, "sites.delta_dtype", sites.delta_dtype, DELTA_DTYPES)


def validate_sites_run(cfg, stage: int | None, problems: list[str]) -> None:
    """What a run over several sites needs of the other sections (``cfg``: the `RunConfig`;
    ``stage``: the DeepSpeed config's ZeRO stage when known)."""
    if cfg.sites.count <= 1:
        return
    if cfg.task != "ctr":
        problems.append(f"sites.count: {cfg.sites.count} sites are for task: ctr (got task: {cfg.task})")
    dynamic = [n for n, t in cfg.embedding.tables.items() if t.kind == "dynamic"]
    if dynamic:
        problems.append(f"sites.count: {cfg.sites.count} sites cannot synchronise dynamic tables ({', '.join(dynamic)}:"
                        " each site admits ids into rows of its own); use static tables")
    if stage is not None and stage >= 3:
        problems.append(f"sites.count: {cfg.sites.count} sites need ZeRO stage 0, 1 or 2 (got {stage}): each "
                        "rank keeps the dense anchor of the last synchronisation whole")
    resume = cfg.train.resume
    if resume not in (None, "auto"):
        problems.append(f"train.resume: {resume!r} with sites.count: {cfg.sites.count}: use 'auto' (every "
                        "site resumes from the newest checkpoint of its own folder)")
