"""The meta-learning engine: a `MetaLearner` on a DeepSpeed engine with its sharded tables,
started by `start_engine` (the one start-up of `gmeta_ds.initialize` and of the CLI's
training loop, resuming from a checkpoint at any world size), and `MetaEngine.meta_step`, one outer
step on a rank's micro-batches (`step_micro_batches`).

Per meta-step and rank: each micro-batch's fused embedding lookup of support and query ids,
the inner loop of every task, the outer loss -> ``engine.backward`` (DeepSpeed averages over
ranks and micro-batches at its accumulation boundary), ``engine.step``, then the sparse row
optimizers' step; a NaN/inf outer loss on any rank is caught before any update.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from gmeta_ds import checkpoint
from gmeta_ds.algorithms import MetaLearner
from gmeta_ds.algorithms.base import EMBEDDING_PREFIX, check_id_columns, check_task_fields, fused_ids, split_rows
from gmeta_ds.config.arguments import check, int_at_least
from gmeta_ds.config import DEFAULTS
from gmeta_ds.config.sites import DELTA_DTYPES
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.config.data import SUPPORT_SIZES
from gmeta_ds.data.tasks import TaskBatch, TaskData, TaskSet, collate
from gmeta_ds.config.deepspeed import BatchPlan, zero_stage
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import EmbeddingCollection, TableConfig
from gmeta_ds.engine import ds_engine, ds_internals
from gmeta_ds.engine.dist import on_wire
from gmeta_ds.engine.outer_sync import OuterSync
from gmeta_ds.engine.parallelize import single_process_template
from gmeta_ds.engine.sites import active_sites, data_part
from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation.held_out import EvalSettings, evaluate_held_out
from gmeta_ds.evaluation.scores import BASELINES, PER_USER_FILE, evaluate_problems, per_user_text  # noqa: F401 - BASELINES re-exported (api)
from gmeta_ds.models.protocol import model_hooks
from gmeta_ds.run.outputs import run_folder_problems, write_run_files
from gmeta_ds.run.profiling import phase

# "STEP:RANK": that rank SIGSTOPs itself (alive but stuck) in meta-step STEP (1-based) just before
# its last micro-batch's backward, so its peers wait in DeepSpeed's gradient all-reduce;
# "STEP:RANK:start": at the start of meta-step STEP (peers wait in our first collective). Tests only.
FAULT_STOP_ENV = "GMETA_DS_FAULT_STOP_AT"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


_fault_point: str | None = None  # `FAULT_STOP_ENV` as `arm_fault_stop` read it


def arm_fault_stop() -> None:
    """Read `FAULT_STOP_ENV` once, for this training (the CLI's ``train`` calls it at its
    start; the reliability tests set the variable), so `fault_stop` reads no environment in
    the hot path; unset, it costs one comparison with None."""
    global _fault_point
    _fault_point = os.environ.get(FAULT_STOP_ENV) or None


def fault_stop(point: str) -> None:
    """Fault injection for the reliability tests (`FAULT_STOP_ENV`, armed by `arm_fault_stop`)."""
    if _fault_point is not None and _fault_point == point:
        os.kill(os.getpid(), signal.SIGSTOP)


def _who_is_nonfinite(bad_batches: list[TaskBatch]) -> list[tuple[int, list[int]]]:
    """(rank, task ids of its micro-batches with a non-finite loss) of every rank that has
    any (collective when world > 1)."""
    mine = [i for b in bad_batches for i in b.task_ids.tolist()] or None
    world = dist.get_world_size() if dist.is_initialized() else 1
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    return [(r, ids) for r, ids in enumerate(everyone) if ids is not None]


class NonFiniteLoss(RuntimeError):
    """A meta-step's outer loss was NaN/inf on some rank (``train.nonfinite: abort``)."""


@dataclass
class StepResult:
    """One meta-step on this rank: mean query / support loss over its micro-batches
    (``nan`` when ``skipped``: a non-finite loss with ``nonfinite="skip"``).

    Args:
        query_loss: the mean outer (query) loss of this rank's micro-batches.
        support_loss: the mean inner (support) loss of this rank's micro-batches.
        skipped: the step was skipped for a non-finite loss (``nonfinite="skip"``).
        padding_efficiency: real rows / padded rows of the micro-batches (1.0: no padding).
    """

    query_loss: float
    support_loss: float
    skipped: bool
    padding_efficiency: float = 1.0  # real rows / padded rows of the micro-batches


def _nonfinite_anywhere(finite_here: bool) -> bool:
    """Whether the loss is NaN/inf on any rank (one small all-reduce when world > 1)."""
    bad = torch.tensor([0.0 if finite_here else 1.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        bad = on_wire(bad)
        dist.all_reduce(bad)
    return bad.item() > 0


class _AnyRank:
    """Whether a flag (a 0-dim bool tensor, on the engine's device) is set on any rank: the
    all-reduce is posted when built and waited for in `result`, so it runs under the work in
    between (the last micro-batch's backward) instead of making every rank wait for the
    slowest one first; one host sync, in `result`."""

    def __init__(self, flag: torch.Tensor):
        self.value = flag.reshape(1).float()
        self.work = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.work = dist.all_reduce(self.value, async_op=True)

    def result(self) -> bool:
        if self.work is not None:
            self.work.wait()
        return bool(self.value.item() > 0)


def step_micro_batches(engine, sharded: ShardedEmbeddingCollection | None, fields: list[str],
                       batches: list[TaskBatch], step: int = 0, nonfinite: str = DEFAULTS.train.nonfinite,
                       micro: ds_engine.MicroStep | None = None) -> StepResult:
    """One outer step: every micro-batch of this rank through backward, then the updates
    (DeepSpeed's at its accumulation boundary; the sparse optimizers' after the last one).

    The outer loss is checked for NaN/inf on every rank before any update (`_NonfiniteGuard`).
    Losses stay on the engine's device until the end (one host sync per meta-step for the
    statistics). At world 1 under ZeRO-0 in fp32 the backward runs in ``engine.no_sync()``:
    DeepSpeed would otherwise flatten every gradient into a buffer and all-reduce it over one
    rank, an exact identity (`ds_engine.reduction_is_identity`). ``micro``: how the engine's
    micro-steps run (`ds_engine.MicroStep`), decided once per engine (`MetaEngine.micro_step`);
    None: decided here."""
    if engine.device.type != "cpu":  # batches are collated on the host
        batches = [ds_engine.to_device(b, engine.device) for b in batches]
    micro = micro if micro is not None else ds_engine.MicroStep.of(engine)
    guard = _NonfiniteGuard(nonfinite, step)
    query, support = [], []
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        with phase("lookup"):
            rows = None
            if sharded is not None:
                ids, multi = fused_ids(batch)
                rows = split_rows(sharded.lookup_fields(ids, fields, multi), batch)
        with micro.gathered():  # ZeRO-3: what this micro-step needs
            with phase("inner_loop"):
                out = engine(batch, rows)
            skip = guard.check(out.loss, last)
            if not skip:
                if last:
                    fault_stop(f"{step + 1}:{_rank()}")
                with phase("outer_backward"), (engine.no_sync() if micro.skip_reduction else contextlib.nullcontext()):
                    engine.backward(out.loss)
        if skip:
            if sharded is not None:
                for p in sharded.parameters():
                    p.grad = None
            return StepResult(float("nan"), float("nan"), True, batch.padding_efficiency)
        guard.raise_if_any(batches)
        with phase("optimizer_step"):
            engine.step()
        query.append(out.query_loss.detach())
        support.append(out.support_loss.detach())
    if sharded is not None:
        with phase("sparse_step"):
            sharded.step()
    padding = sum(b.padding_efficiency for b in batches) / len(batches)
    losses = torch.stack([torch.stack(query), torch.stack(support)]).float().mean(dim=1).tolist()
    return StepResult(losses[0], losses[1], False, padding)


class _NonfiniteGuard:
    """A meta-step's NaN/inf check of the outer loss on every rank, before any update.
    ``abort``: one check per meta-step, a flag all-reduced while the last micro-batch runs its
    backward (nothing is updated yet then: DeepSpeed updates in the last ``engine.step``),
    then `NonFiniteLoss` on all ranks naming the meta-step, rank(s) and task ids. ``skip``
    (one micro-batch per meta-step) checks before the backward and drops the meta-step on all
    ranks, so no update happens at all."""

    def __init__(self, policy: str, step: int):
        self.policy, self.step = policy, step
        self.bad_here: list[torch.Tensor] = []
        self.pending: _AnyRank | None = None

    def check(self, loss: torch.Tensor, last: bool) -> bool:
        """Whether to skip this meta-step (``skip``: the loss is not finite on some rank)."""
        with phase("nonfinite_check"):
            finite = torch.isfinite(loss.detach()).all()
            if self.policy == "skip":
                return _nonfinite_anywhere(bool(finite))
            self.bad_here.append(~finite)
            if last:
                self.pending = _AnyRank(torch.stack(self.bad_here).any())
            return False

    def raise_if_any(self, batches: list[TaskBatch]) -> None:
        """``abort``, after the last backward: `NonFiniteLoss` when any rank saw NaN/inf."""
        if self.pending is None:
            return
        with phase("nonfinite_check"):
            if self.pending.result():
                flags = torch.stack(self.bad_here).tolist()
                where = _who_is_nonfinite([b for b, flag in zip(batches, flags) if flag])
                raise NonFiniteLoss(f"meta-step {self.step + 1}: non-finite outer loss on " + "; ".join(
                    f"rank {r} (tasks {ids})" for r, ids in where) + " (train.nonfinite: abort; "
                    "'skip' drops such meta-steps instead)")


_EVAL = DEFAULTS.eval  # `MetaEngine.evaluate`'s defaults are eval.*'s


class MetaEngine:
    """A meta-learner on a DeepSpeed engine with its embedding tables; made by `initialize`.

    ``engine``: the DeepSpeed engine (its ``module`` is the `MetaLearner`); ``embeddings``:
    this rank's `ShardedEmbeddingCollection` (None with ``sharding="dense"``); ``plan``: the
    `BatchPlan` (tasks per micro-batch, accumulation steps, world size); ``rank``.

    Args:
        engine (deepspeed.DeepSpeedEngine): the DeepSpeed engine whose ``module`` is the
            `MetaLearner`.
        embeddings: this rank's `ShardedEmbeddingCollection`; None when the tables are in the
            model (``sharding="dense"``) or there are none.
        tables: the tables' configs (an unsharded copy is made from them for evaluation).
        plan: the `BatchPlan`.
        ds_config: the resolved DeepSpeed config (written to summary.json).
        rank: this process's rank.
        seed: the run seed (task order, resampling, the baselines, fresh tables).
        nonfinite: ``abort`` or ``skip`` a meta-step whose outer loss is NaN or inf.
        initial: CPU copies of the learner's weights before training, which the non-meta
            baseline starts from; None: not kept.
    """

    def __init__(self, engine, embeddings: ShardedEmbeddingCollection | None, tables: list[TableConfig],
                 plan: BatchPlan, ds_config: dict, rank: int, seed: int, nonfinite: str = DEFAULTS.train.nonfinite,
                 initial: dict[str, torch.Tensor] | None = None):
        self.engine, self.embeddings, self.tables = engine, embeddings, tables
        self.plan, self.ds_config, self.rank, self.seed = plan, ds_config, rank, seed
        self.nonfinite = nonfinite
        self.fields = list(model_hooks(engine.module.net).row_fields or [])
        self.step = 0  # meta-steps done (restored by `resume`)
        self.outer: OuterSync | None = None  # across sites (`start_engine` with sites.count > 1)
        # The learner's weights before training (CPU copies; tables sharded outside it are
        # re-made from their configs): the non-meta baseline starts from them.
        self.initial = initial
        self.started = time.perf_counter()  # summary.json's elapsed_s (`run_summary`)
        self.last_query_loss: float | None = None  # the last meta-step's (summary.json's final_query_loss)
        self.ckpt_meta: dict | None = None  # what a checkpoint must match (`checkpoint_meta`; `start_engine`)

    @cached_property
    def micro_step(self) -> ds_engine.MicroStep:
        """How this engine's micro-steps run (ZeRO-3's gathering; DeepSpeed's reduction skipped
        where it is an identity), decided at the first meta-step: neither changes while the
        engine trains, so no meta-step asks DeepSpeed again."""
        return ds_engine.MicroStep.of(self.engine)

    @property
    def learner(self) -> MetaLearner:
        return self.engine.module

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def batches(self, tasks: TaskSet, step: int, bucket_by_length: bool = DEFAULTS.data.bucket_by_length,
                resample: bool = DEFAULTS.data.resample,
                resample_support: str = DEFAULTS.data.resample_support) -> list[TaskBatch]:
        """This rank's micro-batches of meta-step ``step``: the global batch of
        ``plan.tasks_per_meta_step`` tasks is the same at every world size (a seeded
        permutation per epoch), split over (micro-batch, rank). ``resample``: episode
        resampling (``data.resample``), each task's support and query redrawn from its rows,
        keyed by (seed, step); ``resample_support``: as ``data.resample_support``.

        Args:
            tasks: the training tasks (``data.train``).
            step: the meta-step, >= 0 (its epoch and place in the seeded permutation).
            bucket_by_length: sort each meta-batch by task length (less padding).
            resample: redraw each task's support and query from its rows.
            resample_support: ``full`` (the task's own support size) or, with ``resample``,
                ``random`` (a log-uniform size in [1, the support size]).

        Returns:
            This rank's ``plan.grad_accum_steps`` `TaskBatch` micro-batches.

        Raises:
            ConfigError: an argument of the wrong type or value, or tasks whose fields do not
                match the model's.
        """
        from gmeta_ds.data.loader import task_lengths

        problems = [] if isinstance(tasks, TaskSet) else [f"tasks: expected a gm.TaskSet (data.train), got "
                                                          f"{type(tasks).__name__}"]
        int_at_least(problems, "step", step, 0)
        if resample_support not in SUPPORT_SIZES or (resample_support != "full" and not resample):
            problems.append(f"resample_support: {resample_support!r} is not 'full' (or 'random' with resample=True)")
        check(problems, "MetaEngine.batches")
        check_task_fields(self.learner.net, tasks.fields, "MetaEngine.batches")
        lengths = task_lengths(tasks) if bucket_by_length else None
        sampler = MetaBatchSampler(len(tasks), self.plan.tasks_per_micro_batch, self.plan.grad_accum_steps,
                                   self.plan.world_size, self.rank, self.seed, lengths, part=data_part())
        key = (self.seed, step) if resample else None
        return [collate(tasks, ids, resample=key, support=resample_support) for ids in sampler.micro_batches(step)]

    def meta_step(self, batches: list[TaskBatch]) -> StepResult:
        """One outer step on this rank's micro-batches (collective): fused lookups of support
        and query rows, inner loops, ``engine.backward`` of each outer loss, DeepSpeed's step
        (averaged over ranks and micro-batches) and the sparse row optimizers' step.

        Args:
            batches: this rank's micro-batches of the step (`batches`), one per gradient
                accumulation step.

        Returns:
            The `StepResult` on this rank.

        Raises:
            ValueError: a number of micro-batches other than the gradient accumulation steps.
            ConfigError: batches of another type than the learner's.
            NonFiniteLoss: a NaN or inf outer loss on any rank with ``nonfinite="abort"``.
        """
        if len(batches) != self.plan.grad_accum_steps:
            raise ValueError(f"meta_step: got {len(batches)} micro-batches, expected "
                             f"{self.plan.grad_accum_steps} (gradient_accumulation_steps) per rank")
        kind = self.learner.batch_type  # the learner's micro-batch: a TaskBatch, a text workload's episodes
        if not all(isinstance(b, kind) for b in batches):
            raise ConfigError([f"batches: expected a list of {kind.__name__} (engine.batches(tasks, step))"],
                              "MetaEngine.meta_step")
        if self.embeddings is not None:  # the lookup reads the id columns by row_fields
            check_id_columns(self.learner.net, batches[0])
        warming = self.step < self.learner.algorithm.warmup_steps
        if warming != self.learner.algorithm.warming_up:  # the warm-up starts or ends (set together on both)
            for learner in {id(m): m for m in (self.learner, single_process_template(self.learner))}.values():
                learner.algorithm.warming_up = warming  # under ZeRO-3 the forward runs a copy's algorithm
        result = step_micro_batches(self.engine, self.embeddings, self.fields, batches, self.step, self.nonfinite,
                                    self.micro_step)
        self.step += 1
        self.last_query_loss = result.query_loss
        if self.outer is not None and self.outer.due(self.step):
            with phase("outer_sync"):
                self.outer.synchronise()
        return result

    def finish_sites(self) -> None:
        """After the last meta-step: the synchronisation that makes every site hold the same
        weights, unless that step ended with one (collective across sites; no-op on one site)."""
        if self.outer is None:
            return
        if not self.outer.due(self.step):
            self.outer.synchronise()
        self.outer.count_site_bytes()

    # ------------------------------------------------------------------ weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the learner in full (gathered under ZeRO-3), sharded tables under
        ``net.embedding.weights.<table>``; collective."""
        state = ds_engine.full_state_dict(self.learner)
        if self.embeddings is not None:
            for key, value in self.embeddings.gather_state(everywhere=True).items():
                state[f"{EMBEDDING_PREFIX}{key}"] = value
        return state

    def save_weights(self, path: str | Path) -> Path | None:
        """`state_dict` as safetensors, written by rank 0 (collective; None on other ranks).

        Args:
            path: the safetensors file to write (its folder is created).

        Returns:
            The file written on rank 0; None on other ranks.
        """
        state = self.state_dict()
        if self.rank != 0:
            return None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return ds_engine.save_weights(state, path)

    def save_model(self, path: str | Path, data: TaskData) -> Path | None:
        """The trained model as one folder that `gmeta_ds.load_model` reads back without running
        code (`gmeta_ds.saved`): every weight with the tables reassembled from their shards
        (model.safetensors), ``data``'s fields and vocabularies (raw values -> rows), the
        tables and the algorithm's settings (model.json, with each file's SHA-256). Written by
        rank 0 beside ``path`` and renamed into place (collective; None on other ranks).
        ``path`` may be new, empty or an earlier saved model; anything else is refused, on
        every rank, before the collective.

        Args:
            path: the model's folder: new, empty or an earlier saved model.
            data: the `TaskData` the model was trained on (its fields and vocabularies).

        Returns:
            The folder on rank 0; None on other ranks.

        Raises:
            ConfigError: a ``path`` or ``data`` of the wrong kind, or a folder that holds
                anything but a saved model.
        """
        from gmeta_ds.saved import target_problems

        where = "MetaEngine.save_model"
        problems = []
        if not (isinstance(path, Path) or isinstance(path, str) and path.strip()):
            problems.append(f"path: {path!r} is not a folder path (str or Path)")
        if not isinstance(data, TaskData):
            problems.append(f"data: expected the gm.TaskData the model was trained on (its fields and "
                            f"vocabularies), got {type(data).__name__}")
        check(problems, where)
        folder = Path(path)
        check(target_problems(folder), where)
        state = self.state_dict()
        if self.rank != 0:
            return None
        from gmeta_ds.saved import write_model

        net = self.learner.net
        own = model_hooks(net).embedding
        tables = self.tables or (list(own.tables.values()) if isinstance(own, EmbeddingCollection) else [])
        return write_model(folder, state, net, data.fields, tables, data.vocab, self.learner.algorithm)

    def single_process_learner(self, state: dict | None = None) -> MetaLearner:
        """A plain copy of the learner holding every weight (its tables inside the model, as
        ``model.embedding``): for evaluation, serving or export. Collective without ``state``.

        Args:
            state: every weight in full (`state_dict`'s keys); None: gathered now.

        Returns:
            A `MetaLearner` on the CPU, outside DeepSpeed.
        """
        state = self.state_dict() if state is None else state
        template = single_process_template(self.learner)
        learner = copy.deepcopy(template)
        if template is not self.learner:
            learner = learner.to_empty(device="cpu")
        if self.embeddings is not None:
            learner.net.embedding = EmbeddingCollection(self.tables, self.seed)
        learner.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        return learner

    def evaluate(self, tasks: TaskSet, inner_steps: int | None = None, tasks_per_batch: int = _EVAL.tasks_per_batch, *,
                 baselines: Iterable[str] = (), train: TaskSet | None = None, baseline_epochs: int = _EVAL.baseline_epochs,
                 baseline_lr: float = _EVAL.baseline_lr, baseline_batch_size: int = _EVAL.baseline_batch_size,
                 bootstrap_resamples: int = _EVAL.bootstrap_resamples, few_shot: Iterable[int] = (),
                 steps_curve: Iterable[int] = (), finetune_search: bool = False, valid: TaskSet | None = None,
                 states: dict[str, TaskSet] | None = None, synthetic: bool = False,
                 out: str | Path | None = None) -> dict:
        """Cold-start scores of ``tasks``: each adapted on its support set (first order,
        ``inner_steps``, default the algorithm's), scored on its query set (binary: AUC,
        per-task AUC, logloss, nDCG; regression: MAE, RMSE, nDCG), and the same without
        adaptation (``*_no_adapt``). The tasks are split over the ranks; every rank returns
        the same dict (collective). ``inner_steps=0`` scores without adapting (the adapted
        metrics then equal the ``*_no_adapt`` ones). A metric that is undefined on these tasks
        (AUC when every query label is one class) is None, with the reason under ``warnings``
        (`gmeta_ds.evaluation.scores.score`). ``gmeta-ds train``'s evaluation (`evaluation.held_out`).

        ``baselines`` (what ``gmeta-ds train`` reports next to the meta-learned model, scored
        on the same tasks; each needs ``train``, the training tasks): ``"non_meta"``, the same
        model from the same initial weights trained without meta-learning on every training
        interaction (Adam, ``baseline_epochs`` x ``baseline_lr``, batches of
        ``baseline_batch_size`` rows, seeded by the engine's seed), scored as is
        (``baseline_<metric>``) and fine-tuned on each support with the learner's inner loop
        (``baseline_finetune_<metric>``, per-user AUC included); ``"popularity"``, each item's
        shrunk training click rate (or mean rating) plus a per-user offset fitted on the
        support (``baseline_popularity_<metric>``, `gmeta_ds.evaluation.baselines`; item id 0
        is the out-of-vocabulary item, as in ``gm.build_tasks``' vocabularies, unless
        ``synthetic``: the embedded synthetic data, whose item 0 is a real item). Every rank
        computes them alone (no collective; deterministic on CPU). ``intervals``: each
        difference, meta-learned minus baseline, with a paired-bootstrap 95% interval
        (`gmeta_ds.evaluation.intervals`; 0 resamples: none).

        Opt-in, as ``eval.*`` asks ``gmeta-ds train`` for them (each costs predictions): the
        few-shot curve over ``few_shot`` support sizes, the inner-steps curve over
        ``steps_curve`` (``inner_steps_curve``), the fine-tune search on ``valid`` users
        (``finetune_search``, with ``"non_meta"``: ``baseline_finetune_tuned_*``), the cold-start
        ``states`` ({name: TaskSet}). ``out``: a folder for the run's ``summary.json`` and
        ``per_user.csv`` as ``gmeta-ds train`` writes them (`write_run`), for ``gmeta-ds report``.

        Args:
            tasks: the held-out tasks (``data.test``).
            inner_steps: inner steps on each support, >= 0; None: the algorithm's.
            tasks_per_batch: tasks adapted together, >= 1.
            baselines: any of ``"non_meta"`` and ``"popularity"`` (a str is one name).
            train: the training tasks, which the baselines need.
            baseline_epochs: the non-meta baseline's epochs over the training rows.
            baseline_lr: its Adam learning rate.
            baseline_batch_size: its batch size, in rows.
            bootstrap_resamples: paired-bootstrap resamples of each interval (0: none).
            few_shot: support sizes (>= 1) of the few-shot curve; empty: no curve.
            steps_curve: inner steps (>= 0) of the inner-steps curve; empty: no curve.
            finetune_search: tune the non-meta baseline's fine-tuning on ``valid``.
            valid: the validation tasks (``data.valid``), for ``finetune_search``.
            states: cold-start state name -> its tasks (``data.states``); None: none.
            synthetic: the tasks come from the synthetic generator (item 0 is a real item
                for the popularity baseline).
            out: a folder for summary.json and per_user.csv; None: nothing written.

        Returns:
            The scores, the same dict on every rank: metric -> value (None where undefined,
            with the reason under ``warnings``), the baselines' metrics, ``intervals`` and
            the curves asked for.

        Raises:
            ConfigError: an argument of the wrong type or value (each named), tasks whose
                fields do not match the model's, a baseline without ``train``, or an ``out``
                folder that holds anything but a run.
        """
        problems, wanted = evaluate_problems(
            tasks, inner_steps, tasks_per_batch, bootstrap_resamples, baselines, train,
            (baseline_epochs, baseline_lr, baseline_batch_size), self.initial is not None,
            {"few_shot": few_shot, "steps_curve": steps_curve, "finetune_search": finetune_search, "valid": valid,
             "states": states, "synthetic": synthetic, "out": out})
        check(problems, "MetaEngine.evaluate")
        check_task_fields(self.learner.net, tasks.fields, "MetaEngine.evaluate")
        check(run_folder_problems(Path(out)) if out is not None else [], "MetaEngine.evaluate")  # before any work
        learner = self.single_process_learner()
        steps = learner.algorithm.inner_steps if inner_steps is None else int(inner_steps)
        settings = EvalSettings(steps, self.seed, tasks_per_batch, bootstrap_resamples, "non_meta" in wanted, True,
                                finetune_search, "popularity" in wanted, baseline_epochs, baseline_lr,
                                baseline_batch_size, tuple(few_shot), tuple(steps_curve), synthetic)
        world = self.world_size if dist.is_initialized() else 1
        result, per_user = evaluate_held_out(learner, tasks, settings, train=train, valid=valid, states=states,
                                             baseline_start=self.initial_learner, rank=self.rank, world=world,
                                             everywhere=True, where="MetaEngine.evaluate")
        if out is not None:
            self.write_run(out, result, per_user)
        return result

    def write_run(self, out: str | Path, evaluation: dict, per_user: dict | None = None) -> Path | None:
        """This run's summary.json and per_user.csv as ``gmeta-ds train`` writes them, for
        ``gmeta-ds report``: collective (the checksums); rank 0 writes (`write_run_files`) and
        gets summary.json's path, the other ranks None.

        Args:
            out: a new, empty or earlier run's folder (anything else is refused, untouched).
            evaluation: `evaluate`'s result (summary.json's ``eval``).
            per_user: per_user.csv's columns (`per_user_columns`); None: no per_user.csv."""
        summary = self._run_summary(evaluation)
        if self.rank != 0:
            return None
        # the summary last: it names the run; without held-out users an earlier per_user.csv goes
        files = {PER_USER_FILE: None if per_user is None else per_user_text(per_user),
                 "summary.json": json.dumps(summary, indent=2) + "\n"}
        return write_run_files(Path(out), files) / "summary.json"

    def _run_summary(self, evaluation: dict) -> dict:
        """summary.json's keys of ``gmeta-ds train`` for this run so far (collective: checksums)."""
        dense, embedding = self.checksums()
        learner = self.learner
        config = {"seed": self.seed, "model": {"name": type(learner.net).__name__},
                  "meta": {"algorithm": algorithm_name(learner), "inner_steps": learner.algorithm.inner_steps,
                           "adapt": list(learner.adapted_names())}}
        return {"task": "api", "world_size": self.world_size, "meta_steps": self.step,
                "tasks_seen": self.step * self.plan.tasks_per_meta_step,
                "final_query_loss": self.last_query_loss, "dense_checksum": dense, "embedding_checksum": embedding,
                "eval": evaluation, "ds_config": self.ds_config, "config": config,
                "elapsed_s": time.perf_counter() - self.started}

    def checksums(self) -> tuple[float, float]:
        """summary.json's (``dense_checksum``, ``embedding_checksum``): float64 sums of every
        parameter, the tables' shards gathered (collective)."""
        dense, embedding = ds_engine.checksums(self.engine.module, EMBEDDING_PREFIX)
        if self.embeddings is not None:
            embedding = self.embeddings.checksum()
        return dense, embedding

    def initial_learner(self) -> MetaLearner:
        """A single-process copy of the learner holding the weights `initialize` started from
        (its tables freshly initialised from the tables' configs and the engine's seed)."""
        if self.initial is None:
            raise ConfigError(["the initial weights were not kept (the parameters were already partitioned "
                               "when gm.initialize got them)"], "MetaEngine.initial_learner")
        state = dict(self.initial)
        if self.embeddings is not None:
            fresh = EmbeddingCollection(self.tables, self.seed).state_dict()
            state.update({f"{EMBEDDING_PREFIX}{k}": v for k, v in fresh.items()})
        return self.single_process_learner(state)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, output_dir: str | Path, keep_last: int = DEFAULTS.train.keep_last) -> Path:
        """Checkpoint meta-step `step` under ``output_dir/checkpoints`` (collective): DeepSpeed's
        files, every rank's table rows by global id and sparse-optimizer state, a manifest
        with every file's SHA-256; ``latest`` moves only once all of it is on disk.
        ``keep_last``: complete checkpoints kept (0: all).

        Args:
            output_dir: the run's folder; checkpoints go under its ``checkpoints``.
            keep_last: complete checkpoints kept, >= 0 (0: all).

        Returns:
            The checkpoint's folder.

        Raises:
            ConfigError: ``output_dir`` or ``keep_last`` of the wrong kind.
            CheckpointWriteError: a file could not be written on some rank (every rank raises
                it, naming the rank, the file and the cause; ``latest`` is unchanged).
        """
        problems = []
        int_at_least(problems, "keep_last", keep_last, 0)
        if not (isinstance(output_dir, Path) or isinstance(output_dir, str) and output_dir.strip()):
            problems.append(f"output_dir: {output_dir!r} is not a directory path (str or Path)")
        check(problems, "MetaEngine.save_checkpoint")
        return checkpoint.save(self.engine, self.embeddings, {"step": self.step}, self.step, output_dir,
                               keep_last, self.ckpt_meta or checkpoint_meta(self.learner, self.embeddings),
                               self.checkpoint_extra())

    def checkpoint_extra(self) -> dict[str, torch.Tensor]:
        """This rank's entries of a checkpoint beyond the engine's and the tables' (the outer
        synchronisation's state across sites; {} on one site)."""
        return self.outer.state() if self.outer is not None else {}


def checkpoint_meta(learner: MetaLearner, embeddings, fields: list[str] | None = None,
                    algorithm: str | None = None) -> dict:
    """Tables, fields, algorithm and dense shapes: what a checkpoint must match to load
    (``fields``, ``algorithm``: as the caller names them; the CLI and the API each keep theirs),
    and the dynamic tables' capacities, which bound the bytes a load hashes (`checkpoint.budget`)."""
    if fields is None:  # the API's: the model's single-hot fields (the CLI names every field of its data)
        fields = list(model_hooks(learner.net).row_fields or [])
    algorithm = algorithm_name(learner) if algorithm is None else algorithm  # the CLI: meta.algorithm
    return {"tables": checkpoint.table_meta(embeddings), "fields": list(fields),
            "algorithm": algorithm, "capacities": checkpoint.capacities(embeddings),
            "dense_shapes": {n: list(v.shape) for n, v in learner.state_dict().items()}}


def algorithm_name(learner: MetaLearner) -> str:
    """The learner's algorithm as ``meta.algorithm`` names it: its class name in lower case
    (maml, fomaml, reptile, metasgd; a user's own class by its name)."""
    return type(learner.algorithm).__name__.lower()


# ---------------------------------------------------------------------------- start-up


@dataclass
class EngineSpec:
    """What `start_engine` starts: ``learner`` on DeepSpeed (``ds_config``, batch ``plan``), this
    rank's sharded ``embeddings`` (None: none outside the learner) and the ``tables``' configs.
    ``resume``: a checkpoint directory or "auto" (the newest complete one under ``output_dir``);
    ``fields``, ``algorithm``: what checkpoints record, as the caller names them
    (`checkpoint_meta`; None: the API's names); ``keep_initial``: a CPU copy of the weights
    before training (the non-meta baseline starts from it); ``sites``: the ``sites`` section."""

    learner: MetaLearner
    ds_config: dict
    plan: BatchPlan
    embeddings: ShardedEmbeddingCollection | None
    tables: list[TableConfig]
    rank: int
    seed: int
    nonfinite: str = DEFAULTS.train.nonfinite
    resume: str | None = None
    output_dir: str | Path | None = None
    fields: list[str] | None = None
    algorithm: str | None = None
    keep_initial: bool = False
    sites: object = None


def start_engine(spec: EngineSpec) -> tuple["MetaEngine", dict | None]:
    """The DeepSpeed engine of ``spec.learner`` as a `MetaEngine`, restored from the checkpoint
    ``spec.resume`` names at any world size: its manifest verified first against
    `checkpoint_meta` (taken before DeepSpeed partitions anything), ZeRO partitions of another
    world size through DeepSpeed's universal checkpoint; over several sites, with its
    `OuterSync`. Returns (engine, the resumed checkpoint's state and path, or None)."""
    learner, ds_config, plan, embeddings, output_dir = (spec.learner, spec.ds_config, spec.plan, spec.embeddings,
                                                        spec.output_dir)
    ckpt_meta = checkpoint_meta(learner, embeddings, spec.fields, spec.algorithm)
    found = checkpoint.find(spec.resume, output_dir) if spec.resume else None
    universal = manifest = None
    if found is not None:
        manifest = checkpoint.verify(found, ckpt_meta)
        if manifest["world_size"] != plan.world_size and zero_stage(ds_config) > 0:
            # ZeRO partitions were cut for the old world size: go through DeepSpeed's
            # universal checkpoint, which loads at any data-parallel size.
            universal = checkpoint.to_universal(found, output_dir, manifest)
            ds_config = ds_internals.with_load_universal(ds_config)
    initial = None
    if spec.keep_initial and not ds_engine.is_partitioned(learner):
        initial = {k: v.detach().to("cpu", copy=True) for k, v in learner.state_dict().items()}
    engine = ds_engine.initialize(learner, ds_config, resume=found)
    meta = MetaEngine(engine, embeddings, spec.tables, plan, ds_config, spec.rank, spec.seed, spec.nonfinite,
                      initial)
    meta.ckpt_meta = ckpt_meta  # what its checkpoints record (computed before DeepSpeed partitions anything)
    state = None
    if found is not None:
        state = {**checkpoint.load(found, manifest, engine, embeddings, universal), "checkpoint": found}
        meta.step = state["step"]
    if active_sites() is not None:
        meta.outer = start_outer_sync(meta, spec.sites, found, manifest, output_dir)
    return meta, state


def start_outer_sync(meta: MetaEngine, settings, found, manifest: dict | None, output_dir) -> OuterSync:
    """The engine's `OuterSync` across the running sites, after every site agreed on what it
    resumed (the same meta-step, model size and table rows; a `ConfigError` on every rank
    otherwise) and restored from the checkpoint when one was resumed."""
    sites = active_sites()
    outer = OuterSync(meta.engine, meta.embeddings, sites, settings)
    rows = sum(p.shape[0] for p in meta.embeddings.shards.values()) if meta.embeddings is not None else 0
    mine = torch.tensor([meta.step, outer.numel, rows, outer.every, DELTA_DTYPES.index(outer.dtype)],
                        dtype=torch.int64)
    every = [t.tolist() for t in sites.all_gather(mine)]
    if any(e != every[0] for e in every):
        where = "; ".join(f"site {s}: meta-step {e[0]}, {e[1]} dense values, {e[2]} rows on site rank "
                          f"{sites.site_rank}, sync_every {e[3]}, delta_dtype {DELTA_DTYPES[e[4]]}"
                          for s, e in enumerate(every))
        raise ConfigError([f"sites.count: the {sites.count} sites do not start from the same state ({where}); "
                           f"every site needs the same config and, resuming, a checkpoint of the same meta-step "
                           f"in its folder ({output_dir})"])
    if found is not None:
        outer.load(checkpoint.rank_files(found, manifest), str(found))
    return outer
