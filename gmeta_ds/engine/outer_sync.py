"""The outer synchronisation across sites: DiLoCo's outer step for meta-learning.

Between synchronisations every site meta-trains on its own (its ranks' tasks, DeepSpeed's
reduction and the table exchanges inside the site only). Every ``sites.sync_every`` meta-steps
(and after the last one) `OuterSync.synchronise`:

- **dense parameters** (everything DeepSpeed optimises): each site's outer gradient, the anchor
  (the weights of the last synchronisation) minus its weights now, is averaged over the sites
  and applied to the anchor by the outer optimizer (``torch.optim.SGD``: lr ``sites.outer_lr``,
  momentum ``sites.outer_momentum``, ``sites.nesterov``; by default lr 1 without momentum, the
  mean of the sites' weights; DiLoCo's step is lr 0.7, Nesterov momentum 0.9); every site
  restarts from the new anchor. Site-local rank r carries the r-th of W/S equal fragments
  across sites, then the site's ranks gather the averaged fragments: the dense change crosses
  sites once per site, not once per rank.
- **embedding rows**: only rows some site changed since the last synchronisation cross (ids +
  deltas, by rank r of every site for the shard rank r holds: the sites' plans are the same);
  a changed row becomes its anchor plus the mean over sites of the deltas (a site that did not
  touch it contributes 0), i.e. plain averaging; each table's sparse-optimizer state stays per
  site. A row's anchor is kept from its first update after a synchronisation
  (`ShardedEmbeddingCollection.before_update`), so memory grows with the rows touched, not the
  table.
- **on the wire** (``sites.delta_dtype``): fp32, bf16, or int8 with one fp32 scale per block of
  256 values (per row for rows); the dense fragment's rounding error is carried into the next
  synchronisation (error feedback), rows' is not (a row may not be touched again). Each rank
  sends one payload per synchronisation (every table's ids and deltas, and the dense fragment
  unless it is fp32, which goes by one all-reduce): on a wide-area link each collective costs
  latency and ~1 KB of framing whatever its size.

H = 1 with the default plain averaging (``outer_lr: 1, outer_momentum: 0``) is synchronous training over all
ranks whenever each site's update is linear in its averaged gradient: SGD (with or without
momentum and weight decay, no gradient clipping) for the dense optimizer and plain SGD for the
tables, for every algorithm (MAML, FOMAML, Reptile, Meta-SGD: their meta-gradients are means
over tasks). Adam, Adagrad and clipping are not linear: there H = 1 differs from synchronous.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from gmeta_ds.engine import ds_internals
from gmeta_ds.engine.dist import on_wire
from gmeta_ds.engine.sites import Sites

BLOCK = 256  # values per int8 scale on the dense fragment


def encode(x: torch.Tensor, dtype: str, rows: bool) -> tuple[torch.Tensor, ...]:
    """``x`` (fp32, 1-D or rows) as it crosses sites: (values,) or (int8 values, fp32 scales)."""
    if dtype == "fp32":
        return (x,)
    if dtype == "bf16":
        return (x.to(torch.bfloat16),)
    blocks = x if rows else x.reshape(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
    return torch.round(blocks / scale).clamp_(-127, 127).to(torch.int8).reshape(x.shape), scale.squeeze(1)


def decode(parts: tuple[torch.Tensor, ...], dtype: str, rows: bool) -> torch.Tensor:
    """The fp32 values `encode` sent."""
    if dtype != "int8":
        return parts[0].float()
    values, scale = parts
    blocks = values if rows else values.reshape(-1, BLOCK)
    return (blocks.float() * scale.unsqueeze(1)).reshape(values.shape)


class _Reader:
    """Reads one site's synchronisation payload (bytes) back into tensors, in the order written."""

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload, self.at = payload, 0

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out = self.payload[self.at:self.at + size].clone().view(dtype).reshape(shape)
        self.at += size
        return out

    def take_encoded(self, dtype: str, shape: tuple[int, ...], rows: bool) -> torch.Tensor:
        """The fp32 values `encode` wrote for ``shape``."""
        if dtype == "int8":
            blocks = shape[0] if rows else shape[0] // BLOCK
            values = self.take(torch.int8, shape)
            return decode((values, self.take(torch.float32, (blocks,))), dtype, rows)
        return decode((self.take(torch.bfloat16 if dtype == "bf16" else torch.float32, shape),), dtype, rows)


class OuterSync:
    """The anchor, the outer optimizer and the touched rows of one rank (see the module)."""

    def __init__(self, engine, embeddings, sites: Sites, settings) -> None:
        self.engine, self.embeddings, self.sites = engine, embeddings, sites
        self.dtype = settings.delta_dtype
        self.every = settings.sync_every
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        chunk = math.ceil(self.numel / sites.size / BLOCK) * BLOCK  # int8 blocks never straddle ranks
        self.fragment = (sites.site_rank * chunk, chunk)
        self.anchor = self._flat().clone()
        self.residual = torch.zeros(chunk)  # the dense fragment's carried rounding error
        self.outer = torch.optim.SGD([self.anchor], lr=settings.outer_lr, momentum=settings.outer_momentum,
                                     nesterov=settings.nesterov)
        self.touched: dict[str, torch.Tensor] = {}   # table -> bool per local row
        self.row_anchor: dict[str, dict] = {}        # table -> {"ids": [...], "rows": [...]}
        self.synchronisations = 0
        self.site_sent = 0  # `count_site_bytes`
        if embeddings is not None:
            for name, p in embeddings.shards.items():
                self.touched[name] = torch.zeros(p.shape[0], dtype=torch.bool)
                self.row_anchor[name] = {"ids": [], "rows": []}
            embeddings.before_update = self.remember_rows

    # ------------------------------------------------------------------ between synchronisations
    def _flat(self) -> torch.Tensor:
        """The dense parameters as one fp32 host vector."""
        return parameters_to_vector(p.detach() for p in self.params).float().cpu()

    def remember_rows(self, name: str, param: nn.Parameter) -> None:
        """Before table ``name``'s update: keep the anchor of rows changed for the first time
        since the last synchronisation (the rows its gradient names)."""
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:
            rows = grad._indices()[0].unique()
        else:
            rows = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().squeeze(1)
        rows = rows.cpu()
        mask = self.touched[name]
        new = rows[~mask[rows]]
        if len(new):
            mask[new] = True
            self.row_anchor[name]["ids"].append(new)
            self.row_anchor[name]["rows"].append(param.detach()[new.to(param.device)].float().cpu())

    def due(self, step: int) -> bool:
        """Whether meta-step ``step`` (1-based) ends with a synchronisation."""
        return step % self.every == 0

    # ------------------------------------------------------------------ the synchronisation
    def synchronise(self) -> None:
        """Average the sites' changes and restart every site from the result (collective over
        the site and across sites): one payload per rank and synchronisation (the touched rows
        of every table, and the dense fragment unless it is reduced in fp32), so the link
        carries two all-gathers (lengths, bytes), plus one all-reduce for an fp32 fragment."""
        delta = self._dense_delta()
        tables = {name: self._touched(name) for name in self.embeddings.shards} if self.embeddings else {}
        pieces = [torch.tensor([len(ids) for ids, _ in tables.values()], dtype=torch.int64)]
        if self.dtype != "fp32":
            parts = encode(delta, self.dtype, rows=False)
            self.residual = delta - decode(parts, self.dtype, rows=False)
            pieces += parts
        for name, (ids, anchor) in tables.items():
            change = self.embeddings.shards[name].detach()[ids.to(self.embeddings.shards[name].device)].float().cpu()
            pieces += [ids.to(torch.int32), *encode(change - anchor, self.dtype, rows=True)]
        payloads = self.sites.all_gather_rows(torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in pieces]))
        readers = [_Reader(p) for p in payloads]
        counts = [r.take(torch.int64, (len(tables),)) for r in readers]
        if self.dtype == "fp32":
            mean = self.sites.all_reduce(delta.clone()) / self.sites.count
        else:
            mean = sum(r.take_encoded(self.dtype, (len(delta),), rows=False) for r in readers) / self.sites.count
        self._step_dense(mean)
        for t, (name, (ids, anchor)) in enumerate(tables.items()):
            dim = self.embeddings.shards[name].shape[1]
            every = [(r.take(torch.int32, (int(n[t]),)), r.take_encoded(self.dtype, (int(n[t]), dim), rows=True))
                     for r, n in zip(readers, counts)]
            self._apply_rows(name, ids, anchor, every)
        self.synchronisations += 1

    def _dense_delta(self) -> torch.Tensor:
        """This rank's fragment of the outer gradient (anchor minus weights now), with the
        rounding error carried from the last synchronisation."""
        start, size = self.fragment
        delta = torch.zeros(size)
        local = (self.anchor - self._flat())[start:start + size]
        delta[: len(local)] = local
        return delta + self.residual

    def _step_dense(self, mean: torch.Tensor) -> None:
        """The outer optimizer's step on the anchor with the sites' mean fragment (gathered
        inside the site), written to the module."""
        self.anchor.grad = self._site_gather(mean)[: self.numel]
        self.outer.step()
        self.anchor.grad = None
        self._write_dense(self.anchor)

    def _site_gather(self, fragment: torch.Tensor) -> torch.Tensor:
        """Every site-local rank's fragment, in order (inside the site)."""
        if self.sites.size == 1:
            return fragment
        fragment = on_wire(fragment)
        parts = [torch.empty_like(fragment) for _ in range(self.sites.size)]
        dist.all_gather(parts, fragment)
        return torch.cat(parts).cpu()

    def _write_dense(self, flat: torch.Tensor) -> None:
        """Set the module's parameters (and DeepSpeed's fp32 master copy) to ``flat``."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        ds_internals.refresh_master_weights(self.engine)

    def _touched(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(local rows of table ``name`` changed since the last synchronisation, their anchors)."""
        kept = self.row_anchor[name]
        ids = torch.cat(kept["ids"]) if kept["ids"] else torch.zeros(0, dtype=torch.int64)
        anchor = torch.cat(kept["rows"]) if kept["rows"] else torch.zeros(0, self.embeddings.shards[name].shape[1])
        return ids, anchor

    def _apply_rows(self, name: str, ids: torch.Tensor, anchor: torch.Tensor, every: list) -> None:
        """Rows some site touched become their anchor plus the sites' mean delta (``every``:
        each site's (ids, deltas))."""
        shard = self.embeddings.shards[name]
        union, where = torch.cat([i for i, _ in every]).long().unique(return_inverse=True)
        total = torch.zeros(len(union), shard.shape[1])
        total.index_add_(0, where, torch.cat([d for _, d in every]))
        base = shard.detach()[union.to(shard.device)].float().cpu()
        base[torch.searchsorted(union, ids)] = anchor  # this site's touched rows start from their anchors
        with torch.no_grad():
            shard[union.to(shard.device)] = (base + total / self.sites.count).to(shard.dtype).to(shard.device)
        self.touched[name].zero_()
        self.row_anchor[name] = {"ids": [], "rows": []}

    def count_site_bytes(self) -> int:
        """Bytes the site's ranks sent to other sites so far, summed over the site (collective
        inside the site), kept as ``site_sent``."""
        total = on_wire(torch.tensor([self.sites.sent], dtype=torch.int64))
        if self.sites.size > 1:
            dist.all_reduce(total)
        self.site_sent = int(total)
        return self.site_sent

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, torch.Tensor]:
        """This rank's part of a checkpoint: the anchor and the outer optimizer's momentum (site
        rank 0), its dense fragment's carried error, and the anchors of the rows its shards
        changed since the last synchronisation, by global id."""
        out = {"outer.residual": self.residual.clone(), "outer.fragment": torch.tensor(self.fragment),
               "outer.synchronisations": torch.tensor(self.synchronisations)}
        if self.sites.site_rank == 0:
            out["outer.anchor"] = self.anchor.detach().clone()
            momentum = self.outer.state.get(self.anchor, {}).get("momentum_buffer")
            if momentum is not None:
                out["outer.momentum"] = momentum.clone()
        for name, kept in self.row_anchor.items():
            local = torch.cat(kept["ids"]) if kept["ids"] else torch.zeros(0, dtype=torch.int64)
            out[f"outer.table.{name}.ids"] = self.embeddings.plan.tables[name].layout.global_ids(self.embeddings.rank)[local]
            out[f"outer.table.{name}.rows"] = (torch.cat(kept["rows"]) if kept["rows"]
                                               else torch.zeros(0, self.embeddings.shards[name].shape[1]))
        return out

    def load(self, files: list[dict[str, torch.Tensor]], source: str) -> None:
        """Restore from every saved rank's file (``source``: the checkpoint, for errors), at
        any number of ranks per site: the carried error is re-cut into this rank's fragment,
        the rows' anchors go to the ranks that now hold their rows."""
        from gmeta_ds.errors import ConfigError

        if "outer.anchor" not in files[0]:
            raise ConfigError([f"{source}: the checkpoint has no outer-synchronisation state (written by a "
                               "run with sites.count: 1); resume it with sites.count: 1"])
        anchor = files[0]["outer.anchor"]
        if anchor.numel() != self.numel:
            raise ConfigError([f"{source}: outer.anchor holds {anchor.numel()} dense values, the model has "
                               f"{self.numel}"])
        with torch.no_grad():
            self.anchor.copy_(anchor)
        if "outer.momentum" in files[0]:
            self.outer.state[self.anchor]["momentum_buffer"] = files[0]["outer.momentum"].clone()
        errors = torch.cat([f["outer.residual"][: int(f["outer.fragment"][1])] for f in files])
        start, size = self.fragment
        self.residual = torch.zeros(size)
        part = errors[start:start + size]
        self.residual[: len(part)] = part
        self.synchronisations = int(files[0]["outer.synchronisations"])
        for name in self.row_anchor:
            self._load_rows(name, files)

    def _load_rows(self, name: str, files: list[dict[str, torch.Tensor]]) -> None:
        plan = self.embeddings.plan.tables[name]
        mine = plan.layout.global_ids(self.embeddings.rank)
        position = torch.full((plan.table.num_rows,), -1, dtype=torch.int64)
        position[mine] = torch.arange(len(mine))
        ids, rows = [], []
        for f in files:
            where = position[f[f"outer.table.{name}.ids"]]
            keep = (where >= 0) & ~self.touched[name][where.clamp_min(0)]
            ids.append(where[keep])
            rows.append(f[f"outer.table.{name}.rows"][keep])
            self.touched[name][where[keep]] = True
        self.row_anchor[name] = {"ids": ids, "rows": rows}
