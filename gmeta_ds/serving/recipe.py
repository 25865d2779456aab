"""``gmeta-ds export CHECKPOINT OUT --config RUN.yaml``: a run's weights as the self-contained
export serving loads (`gmeta_ds.serving.export`), with the run config's recipe.

The weights are a checkpoint (its shards reassembled, `gmeta_ds.checkpoint.export`) or a
weights file (the run's ``model.safetensors``); the fields and vocabularies come from the
run's data, rebuilt as ``gmeta-ds eval`` rebuilds them (deterministic by seed, cached for
logs); the model and embedding sections of the config, the label kind and the OOV id go into
model.json's recipe, from which `gmeta_ds.serving.load_adapter` rebuilds the zoo model; the
inner steps are the run's eval steps (``eval.inner_steps``). Imported by the CLI only: it
needs the training side (checkpoint, workloads), the serving package does not.
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from gmeta_ds.config import RunConfig
from gmeta_ds.embedding.tables import EmbeddingCollection
from gmeta_ds.models.protocol import model_hooks
from gmeta_ds.saved import write_model
from gmeta_ds.serving.export import serving_section


def export_run(cfg: RunConfig, source: Path, out: Path) -> Path:
    """Write the export of ``cfg``'s run with the weights of ``source`` to the folder ``out``."""
    from gmeta_ds.engine.ds_engine import load_weights
    from gmeta_ds.evaluation.baselines import oov_id
    from gmeta_ds.workloads.ctr import build_data, build_learner, eval_inner_steps, label_kind

    data = build_data(cfg)
    learner = build_learner(cfg, data.fields)
    if source.is_dir():
        from gmeta_ds import checkpoint

        with tempfile.TemporaryDirectory(dir=out.parent) as work:
            load_weights(learner, checkpoint.export(source, Path(work) / "weights.safetensors"))
    else:
        load_weights(learner, source)
    net = learner.net
    recipe = {"model": dataclasses.asdict(cfg.model), "embedding": dataclasses.asdict(cfg.embedding),
              "kind": label_kind(cfg), "oov_id": oov_id(cfg.data.source == "synthetic")}
    own = model_hooks(net).embedding
    tables = list(own.tables.values()) if isinstance(own, EmbeddingCollection) else []
    section = serving_section(cfg.model.name, eval_inner_steps(cfg), recipe)
    return write_model(out, learner.state_dict(), net, data.fields, tables, getattr(data, "vocab", {}),
                       learner.algorithm, section)
