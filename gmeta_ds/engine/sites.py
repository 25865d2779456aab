"""A run over several sites: each site its own process group, one gloo group across sites.

With ``sites.count`` S > 1 the launcher's W ranks (numbered site by site: site s holds ranks
s W/S .. (s+1) W/S - 1) never form one process group. Each site is a process group of its own
(the default group of its ranks, rendezvous through the launcher's ``MASTER_ADDR:MASTER_PORT``
store under a per-site prefix), so everything inside a site runs as a run of W/S ranks does:
DeepSpeed's reduction, the sharded tables and their all-to-alls, checkpoints, collectives'
timeouts. Across sites there is one gloo group per site-local index r (rank r of every site,
by site: `Sites.cross`), the only way anything crosses a site's boundary, used by the outer
synchronisation (`outer_sync`) every ``sites.sync_every`` meta-steps and counted in
`Sites.sent` (bytes this rank put on the inter-site link, ring algorithms' share).

Data: each meta-step's batch of the one-site run is cut into S blocks, site s takes block s and
cuts it over its own ranks (`data_part`, `MetaBatchSampler`), so which tasks a site sees does
not depend on its number of ranks, and the sites together see the one-site run's batch.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gmeta_ds.errors import ConfigError

_ACTIVE: list = [None]  # the running `Sites`, set by `start_sites`, cleared by `stop_sites`


@dataclass
class Sites:
    """This rank's place among ``count`` sites of ``size`` ranks (``rank``, ``world``: the
    launcher's coordinates) and the gloo group across sites (``cross``: the ranks of this
    site-local index, one per site, ordered by site)."""

    count: int
    size: int
    rank: int
    world: int
    cross: object = field(repr=False, default=None)
    timeout: datetime.timedelta = datetime.timedelta(seconds=600)
    sent: int = 0  # bytes this rank sent across sites (ring all-reduce / all-gather shares)
    store: object = field(repr=False, default=None)  # the rendezvous store (rank 0 serves it)

    @property
    def site(self) -> int:
        return self.rank // self.size

    @property
    def site_rank(self) -> int:
        return self.rank % self.size

    def describe(self) -> str:
        return f"{self.count} sites x {self.size} rank(s)"

    # ------------------------------------------------------------------ collectives across sites
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (a host tensor) over the sites, in place."""
        if self.count > 1:
            self.cross.allreduce([t]).wait(self.timeout)
            self.sent += 2 * t.numel() * t.element_size() * (self.count - 1) // self.count
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every site's ``t`` (same shape on all sites), by site."""
        if self.count == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.count)]
        self.cross.allgather([out], [t.contiguous()]).wait(self.timeout)
        self.sent += t.numel() * t.element_size() * (self.count - 1)
        return out

    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every site's ``t`` whose first dimension differs between sites (padded on the wire)."""
        lengths = [int(n) for n in self.all_gather(torch.tensor([t.shape[0]], dtype=torch.int64))]
        longest = max(lengths)
        if longest == 0:
            return [t[:0] for _ in lengths]
        padded = torch.zeros((longest, *t.shape[1:]), dtype=t.dtype)
        padded[: t.shape[0]] = t
        return [part[:n] for part, n in zip(self.all_gather(padded), lengths)]


def active_sites() -> Sites | None:
    """The running `Sites` (None: one site, the launcher's world is the process group)."""
    return _ACTIVE[0]


def site_layout(count: int, rank: int, world: int, local_world: int) -> Sites:
    """`Sites` for the launcher's ``rank`` / ``world`` (checked: W a multiple of ``count``, and
    sites made of whole hosts or hosts made of whole sites); `ConfigError` naming the key."""
    if world % count:
        raise ConfigError([f"sites.count: {count} sites cannot share WORLD_SIZE={world} ranks evenly "
                           f"(expected a world size that is a multiple of {count})"])
    size = world // count
    if size % local_world and local_world % size:
        raise ConfigError([f"sites.count: {count} sites of {size} rank(s) would cut hosts of {local_world} ranks "
                           "unevenly (expected sites made of whole hosts, or hosts holding whole sites)"])
    return Sites(count, size, rank, world)


def start_sites(count: int, backend: str, timeout: datetime.timedelta, env_world) -> Sites:
    """Rendezvous of this rank's site as the default process group and of the cross-site gloo
    group, through one store at the launcher's ``MASTER_ADDR:MASTER_PORT`` (rank 0 serves it).
    ``env_world``: the launcher's (rank, world, local world)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    rank, world, local = env_world
    sites = site_layout(count, rank, world, local)
    sites.timeout = timeout
    # torchrun's agent serves the store at MASTER_PORT itself (TORCHELASTIC_USE_AGENT_STORE)
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, serve,
                     timeout=timeout, multi_tenant=True)
    dist.init_process_group(backend, store=PrefixStore(f"gmeta_ds/site{sites.site}/", store),
                            rank=sites.site_rank, world_size=sites.size, timeout=timeout)
    sites.cross = ProcessGroupGloo(PrefixStore(f"gmeta_ds/cross{sites.site_rank}/", store), sites.site,
                                   count, timeout)
    sites.store = store  # kept for the run: rank 0 serves it
    _ACTIVE[0] = sites
    return sites


def stop_sites(clean_exit: bool) -> None:
    """Forget the running `Sites`; on a clean exit first meet the other sites (a bounded
    barrier over the cross-site group), so no site closes its connections while another
    still uses them."""
    sites = _ACTIVE[0]
    _ACTIVE[0] = None
    if sites is not None and clean_exit and sites.cross is not None:
        try:
            sites.all_reduce(torch.zeros(1))
        except RuntimeError:  # a site that is gone: nothing left to meet
            return


def site_run(cfg, ds_config: dict, plan, env_world: tuple[int, int, int]):
    """(config, DeepSpeed config, plan) of this rank's site for a run of ``sites.count`` > 1
    sites, checked before any collective: the site's batch share (`ds_config.for_sites`), and
    for sites after the first their own folder, ``OUTPUT_DIR/sites/site-<s>`` (checkpoints,
    metrics), without the final evaluation (after the last synchronisation every site holds
    site 0's weights, which site 0 scores)."""
    import dataclasses

    from gmeta_ds.config.sites import validate_sites_run
    from gmeta_ds.config.deepspeed import for_sites, zero_stage

    problems: list[str] = []
    validate_sites_run(cfg, zero_stage(ds_config), problems)
    if dist.is_initialized():  # gmeta_ds.cli.main called in a process that started a group
        problems.append(f"sites.count: {cfg.sites.count} sites start their own process groups, but this "
                        "process has one already; start gmeta-ds train as its own process")
    if problems:
        raise ConfigError(problems)
    layout = site_layout(cfg.sites.count, *env_world)
    ds_config, plan = for_sites(ds_config, plan, cfg.sites.count)
    if layout.site > 0:
        cfg = dataclasses.replace(cfg, output_dir=site_dir(cfg.output_dir, layout.site),
                                  eval=dataclasses.replace(cfg.eval, enabled=False))
    return cfg, ds_config, plan


def site_dir(output_dir: str, site: int) -> str:
    """Where site ``site`` (> 0) of a run into ``output_dir`` writes its own files."""
    return str(os.path.join(output_dir, "sites", f"site-{site}"))


def data_part() -> tuple[int, int]:
    """(site, sites): which block of each meta-step's tasks this rank's site takes
    (`data.sampler.MetaBatchSampler`'s ``part``); (0, 1) on one site."""
    sites = active_sites()
    return (sites.site, sites.count) if sites is not None else (0, 1)


def describe_site_hosts(hosts: list[str], ranks_per_host: int, count: int) -> str:
    """``gmeta-ds validate --hostfile``'s line placing ``count`` sites on the hostfile's
    ``hosts`` (in its order, ``ranks_per_host`` each; ranks numbered site by site): whole hosts
    per site, or whole sites per host (the layout `site_layout` accepts)."""
    per_site = len(hosts) * ranks_per_host // count
    parts = [f"site {s}: {', '.join(hosts[s * per_site // ranks_per_host:((s + 1) * per_site - 1) // ranks_per_host + 1])}"
             for s in range(count)]
    return (f"sites on the hostfile's hosts: {'; '.join(parts)} (each site {max(1, per_site // ranks_per_host)} "
            f"host(s) x {min(per_site, ranks_per_host)} rank(s))")


def describe_sites(settings, world: int) -> str:
    """``gmeta-ds validate``'s line for ``sites.*`` at ``world`` ranks."""
    outer = (f"outer SGD lr {settings.outer_lr:g}, momentum {settings.outer_momentum:g}"
             + (", Nesterov" if settings.nesterov else ""))
    return (f"sites: {settings.count} sites x {world // settings.count} rank(s) (ranks numbered site by site), "
            f"synchronised every {settings.sync_every} meta-steps and after the last ({outer}; changes cross "
            f"sites as {settings.delta_dtype}); site s > 0 writes OUTPUT_DIR/sites/site-<s>")
