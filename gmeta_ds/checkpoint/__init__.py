"""Checkpoints: DeepSpeed's own for the dense state, ours for sharded embeddings and the trainer.

Layout under ``OUTPUT_DIR/checkpoints``::

    step_00000040/                      one checkpoint (the tag)
      <DeepSpeed's files>               engine.save_checkpoint: dense weights, optimizer (ZeRO
                                        partitions), loss scaler
      dense.safetensors                 rank 0: the dense module's weights (export, no DeepSpeed)
      rank00000.safetensors             per rank: its embedding rows with their global ids, the
                                        sparse optimizers' per-row state, this rank's RNG states
      manifest.json                     rank 0, last: step, world size, plan, loader position,
                                        the SHA-256 and size of every file above
    latest                              the tag of the newest complete checkpoint

A checkpoint is complete when its manifest exists: rank 0 writes it after a barrier that every
rank reaches only once its files are on disk, then moves ``latest`` (atomic rename), then the
oldest checkpoints beyond ``train.keep_last`` are removed. A rank that dies mid-save leaves a
directory without a manifest, which loading never picks and the next save removes.

Embedding rows are saved by global id, so a checkpoint loads at any world size and plan
(resharding). Every file is verified against the manifest's hashes before anything is
deserialised, and DeepSpeed's pickled files are first opened with ``weights_only=True``, so a
file crafted to run code on unpickling is refused. Before any file is hashed, the manifest's
keys are type-checked, its files must be exactly the regular files inside the checkpoint
directory (no absolute path, no ``..``, no symbolic link, nothing unlisted) with the sizes it
records, and ``latest`` must name a ``step_*`` directory of its own folder: a damaged or
forged manifest is a `ConfigError` naming the file and the key, and hashing costs no more
than reading the checkpoint itself. The files must also be ones a save writes (by name) and
no larger than a save of the model writes them (`budget`: from its tables, dense shapes and
dynamic capacities), so a large file planted and listed is refused unread.

The package's modules: `layout` (names, ``latest``, `find`), `manifest` (reading and verifying),
`budget` (the files a save writes and their size bounds),
`rows` (per-rank embedding rows by global id, resharded on load), `saving`, `loading`,
`universal` (DeepSpeed's universal conversion, isolated) and `exporting`.
"""
from __future__ import annotations

from gmeta_ds.checkpoint.budget import capacities
from gmeta_ds.checkpoint.exporting import export
from gmeta_ds.checkpoint.layout import (
    FAULT_ENV, FAULT_FILL_ENV, FORMAT_VERSION, LATEST, MANIFEST, MANIFEST_MAX_BYTES, TAG, checkpoint_root, find,
    tag_of)
from gmeta_ds.checkpoint.loading import load, rank_files
from gmeta_ds.checkpoint.manifest import sha256, check_compatible, check_pickles, read_manifest, verify
from gmeta_ds.checkpoint.rows import load_shard_state, shard_state, table_meta
from gmeta_ds.checkpoint.saving import save
from gmeta_ds.checkpoint.universal import convert_to_universal, to_universal

__all__ = ["FAULT_ENV", "FAULT_FILL_ENV", "FORMAT_VERSION", "LATEST", "MANIFEST", "MANIFEST_MAX_BYTES", "TAG",
           "capacities", "convert_to_universal", "sha256", "check_compatible", "check_pickles", "checkpoint_root", "export", "find", "load",
           "load_shard_state", "rank_files", "read_manifest", "save", "shard_state", "table_meta", "tag_of", "to_universal",
           "verify"]
