"""Sharding strategies of `ShardedEmbeddingCollection`, one file each, over a shared base:

- ``base.py`` — `Sharding` (the methods every strategy has: layout, initial_rows, input_dist,
  lookup, finish_gradients, direct_update, checksum, gather_table, gather_state, state,
  load_state), `ShardContext` (the rank's shards, optimizers, groups and counters the
  strategies share), `Request`; each table's placement is its `embedding.layout.TableLayout`;
- ``state.py`` — a table's checkpoint entries (the on-disk names), written and read back at any
  world size by `Sharding.state` / `load_state`;
- ``bags.py`` — the wire of exchanges that pool on the owners (`BagRequests`, one buffer per
  owner), which the flat and the hierarchical owner-pooled exchanges share;
- ``exchange.py`` — the ids to their owners and the rows back, for every strategy that looks
  rows up: each table's ids checked and deduplicated (one unique across tables where that is
  linear), then `RowExchange`: one all-to-all per group of tables (same dimension, placement,
  process group) for every strategy that adds to it, support and query together;
  ``hierarchical_rows.py`` its two-level form across hosts (each distinct id of a host crosses
  once);
- ``row_wise.py``, ``table_wise.py``, ``replicated.py``, ``dynamic.py``, ``owner_pooled.py``,
  ``hierarchical.py`` (pooled on the owner across hosts in two levels) — the strategies (`registry.SHARDINGS` names them; `base.strategy_name` picks a table's).

A new strategy is one file here with a subclass of `Sharding` and its name in
`gmeta_ds.registry.SHARDINGS` (CONTRIBUTING.md, "Adding a component").
"""
