"""Meta-training throughput of one micro-batch: MAML forward + outer backward, no DeepSpeed.

What is timed, per micro-batch of T tasks (default 32): the fused embedding lookup of support
and query ids, ``inner_steps`` second-order SGD steps on the ``mlp.*`` decision layers of MeLU
(masked BCE on each task's support), the query loss averaged over tasks, and its backward to
every meta-parameter (MLP and embedding tables) — what the trainer does per micro-batch.

Variants (all compute the same numbers; this is checked before timing, exit 1 if not):

- ``gmeta_ds vmap``: ``MetaLearner(MeLU, MAML(..., vectorize=True))``;
- ``gmeta_ds loop``: the same with ``vectorize=False`` (per-task `torch.autograd.grad`);
- ``clone-per-task``: learn2learn style, written here: per task, fast weights ``p - lr * g``
  (``create_graph=True``) and a hand-written MLP forward over them (no torch.func);
- ``bare torch.func``: the same math with `torch.func.vmap` + `grad` + `functional_call` on
  the MLP, no gmeta_ds code: the reference gmeta_ds vmap aims to be within 1.1x of;
- with ``--compiled`` (``meta.compile: true``): ``gmeta_ds compiled``, the vmap variant under
  `torch.compile` (inductor, the row dimensions marked dynamic from the first call: one graph),
  ``compiled automatic``, with Dynamo's automatic dynamic shapes instead (a static graph for
  the first micro-batch's lengths, then one per dimension that changes), and ``compiled static``,
  a static graph per bucket of lengths (rows padded to the bucket's edge, masked out of the
  losses: `functional.compiled.pad_to_buckets`). They are built afresh for each
  ``--threads`` value (inductor fixes a kernel's threads when it compiles it); their compile
  time (untimed warm-up) and graph count are reported beside the speed.

Each variant runs with ``torch.set_num_threads(n)`` for each ``--threads`` value; variants are
interleaved in ``--rounds`` rounds (robust to background load), the median per-micro-batch
time of all timed iterations is reported. Results go to ``benchmarks/results/inner_loop.json``.

``--device cuda`` runs the variants on the GPU (timed with ``torch.cuda.synchronize``) after
checking that the device's loss and gradients equal the CPU's (rtol 1e-4); ``--out`` writes the
JSON elsewhere (benchmarks/gpu_check.sh).

Run from the repo root:  python benchmarks/inner_loop.py [--inner-steps 1] [--threads 1 2]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

try:
    import gmeta_ds  # noqa: F401
except ImportError:  # not installed: run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gmeta_ds.algorithms.base import MetaLearner
from gmeta_ds.algorithms.maml import MAML
from gmeta_ds.config import EmbeddingConfig, ModelConfig, SyntheticConfig
from gmeta_ds.data.synthetic import generate_synthetic, synthetic_fields
from gmeta_ds.data.tasks import collate
from gmeta_ds.functional.compiled import CompiledTasks
from gmeta_ds.models.melu import build_melu

RESULTS = Path(__file__).resolve().parent / "results" / "inner_loop.json"
ROUNDS_SHOWN = 3  # a variant's timings are shown as the medians of this many consecutive parts
CHECKED = ("mlp.0.weight", "embedding.weights.item_id")


# ------------------------------------------------------------------ references (no gmeta_ds)
def bce(logits, y, mask):
    """Masked mean BCE of one task (same formula as gmeta_ds.functional.inner.masked_bce)."""
    per_row = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
    return (per_row * mask).sum() / mask.sum().clamp(min=1.0)


def embed(net, b):
    """One lookup for support + query ids -> rows (T, S, F*d), (T, Q, F*d)."""
    t, s, f = b.support_ids.shape
    rows = net.embed(torch.cat([b.support_ids.reshape(-1, f), b.query_ids.reshape(-1, f)]), {})
    rows = rows.flatten(start_dim=-2)
    return rows[: t * s].reshape(t, s, -1), rows[t * s:].reshape(t, b.query_ids.shape[1], -1)


def mlp_by_hand(weights, x):
    """Linear/ReLU stack over a flat list [w0, b0, w1, b1, ...] -> logits (N,)."""
    n = len(weights) // 2
    for i in range(n):
        x = F.linear(x, weights[2 * i], weights[2 * i + 1])
        x = F.relu(x) if i < n - 1 else x
    return x.squeeze(-1)


def clone_per_task_loss(net, b, steps, lr):
    """learn2learn style: per task, fast weights p - lr * g with create_graph, Python loop."""
    xs, xq = embed(net, b)
    theta = list(net.mlp.parameters())
    losses = []
    for i in range(xs.shape[0]):
        fast = theta
        for _ in range(steps):
            loss = bce(mlp_by_hand(fast, xs[i]), b.support_y[i], b.support_mask[i])
            grads = torch.autograd.grad(loss, fast, create_graph=True)
            fast = [p - lr * g for p, g in zip(fast, grads)]
        losses.append(bce(mlp_by_hand(fast, xq[i]), b.query_y[i], b.query_mask[i]))
    return torch.stack(losses).mean()


def bare_func_loss(net, b, steps, lr):
    """The same math with torch.func.vmap + grad + functional_call on the MLP."""
    xs, xq = embed(net, b)
    mlp = net.mlp

    def task_loss(params, x, y, mask):
        return bce(functional_call(mlp, params, (x,)).squeeze(-1), y, mask)

    def one_task(params, xs, ys, ms, xq, yq, mq):
        for _ in range(steps):
            g = grad(task_loss)(params, xs, ys, ms)
            params = {n: p - lr * g[n] for n, p in params.items()}
        return task_loss(params, xq, yq, mq)

    theta = dict(mlp.named_parameters())
    per_task = vmap(one_task, in_dims=(None, 0, 0, 0, 0, 0, 0))(
        theta, xs, b.support_y, b.support_mask, xq, b.query_y, b.query_mask)
    return per_task.mean()


# ------------------------------------------------------------------ setup
def make_variants(net, steps, lr, compiled=False):
    """name -> fn(batch) returning the scalar outer loss (graph attached); with ``compiled``
    the two compiled variants too (their `CompiledTasks` as ``fn.compiled``)."""
    learners = {v: MetaLearner(net, MAML(steps, lr, ["mlp.*"], vectorize=v)) for v in (True, False)}
    variants = {
        "gmeta_ds vmap": lambda b: learners[True](b).loss,
        "gmeta_ds loop": lambda b: learners[False](b).loss,
        "clone-per-task": lambda b: clone_per_task_loss(net, b, steps, lr),
        "bare torch.func": lambda b: bare_func_loss(net, b, steps, lr),
    }
    if compiled:
        for name, how in (("gmeta_ds compiled", {}), ("compiled automatic", {"mark_dynamic": False}),
                          ("compiled static", {"static": True})):
            algorithm = MAML(steps, lr, ["mlp.*"], vectorize=True)
            algorithm.compiled = CompiledTasks(**how)
            learner = MetaLearner(net, algorithm)
            variants[name] = functools.partial(lambda learner, b: learner(b).loss, learner)
            variants[name].compiled = algorithm.compiled
    return variants


def make_batches(tasks_per_batch, n_batches):
    """``n_batches`` disjoint random micro-batches of the default synthetic train set."""
    train = generate_synthetic(SyntheticConfig(), seed=0).train
    order = np.random.default_rng(0).permutation(len(train))
    return [collate(train, order[i * tasks_per_batch:(i + 1) * tasks_per_batch])
            for i in range(n_batches)]


def to_device(batch, device):
    """The batch's tensors (and multi-hot bags) on ``device``."""
    moved = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            moved[f.name] = v.to(device)
        elif isinstance(v, dict):
            moved[f.name] = {k: type(j)(j.values.to(device), j.offsets.to(device)) for k, j in v.items()}
    return dataclasses.replace(batch, **moved)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def check_device(net, variants, batch, device) -> list[str]:
    """The gmeta_ds vmap variant's loss and checked gradients on ``device`` vs on the CPU."""
    params = dict(net.named_parameters())
    fn = variants["gmeta_ds vmap"]
    cpu_loss = step(net, fn, batch)
    cpu_grads = {p: params[p].grad.clone() for p in CHECKED}
    net.to(device)
    loss = step(net, fn, to_device(batch, device)).cpu()
    problems = []
    if not torch.allclose(loss, cpu_loss, rtol=1e-4, atol=1e-6):
        problems.append(f"{device} loss {loss.item():.8f} != cpu {cpu_loss.item():.8f}")
    for p in CHECKED:
        if not torch.allclose(params[p].grad.cpu(), cpu_grads[p], rtol=1e-4, atol=1e-6):
            err = (params[p].grad.cpu() - cpu_grads[p]).abs().max().item()
            problems.append(f"{device} grad {p} differs from cpu (max abs {err:.2e})")
    return problems


def step(net, fn, batch):
    """One micro-batch: outer loss + backward; returns the loss value."""
    net.zero_grad(set_to_none=True)
    loss = fn(batch)
    loss.backward()
    return loss.detach()


# ------------------------------------------------------------------ check and time
def check_agreement(net, variants, batch) -> list[str]:
    """Compare every variant's loss and checked gradients with the first one's."""
    params = dict(net.named_parameters())
    ref_name, got = None, {}
    for name, fn in variants.items():
        loss = step(net, fn, batch)
        got[name] = (loss, {p: params[p].grad.clone() for p in CHECKED})
        ref_name = ref_name or name
    ref_loss, ref_grads = got[ref_name]
    problems = []
    for name, (loss, grads) in got.items():
        if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=0.0):
            problems.append(f"{name}: loss {loss.item():.8f} != {ref_name} {ref_loss.item():.8f}")
        for p in CHECKED:
            if not torch.allclose(grads[p], ref_grads[p], rtol=1e-4, atol=1e-6):
                err = (grads[p] - ref_grads[p]).abs().max().item()
                problems.append(f"{name}: grad {p} differs from {ref_name} (max abs {err:.2e})")
    return problems


def time_variants(net, variants, batches, iters, warmup, rounds, device="cpu"):
    """Interleave the variants in rounds; return name -> per-iteration seconds."""
    times = {name: [] for name in variants}
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        for name, fn in variants.items():
            for i in range(warmup):
                step(net, fn, batches[i % len(batches)])
            for i in range(per_round):
                net.zero_grad(set_to_none=True)
                sync(device)
                start = time.perf_counter()
                fn(batches[i % len(batches)]).backward()
                sync(device)
                times[name].append(time.perf_counter() - start)
    return times


def summarize(times, threads, tasks, variants=None):
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = [{"variant": name, "threads": threads, "ms_per_micro_batch": 1e3 * m,
             "tasks_per_s": tasks / m, "vs_loop": m / med["gmeta_ds loop"],
             "vs_bare_func": m / med["bare torch.func"], "vs_vmap": m / med["gmeta_ds vmap"],
             "iters": len(times[name]), "min_ms": 1e3 * min(times[name]),
             "spread": [1e3 * statistics.median(r) for r in _rounds(times[name])]} for name, m in med.items()]
    for row in rows:
        compiled = getattr((variants or {}).get(row["variant"]), "compiled", None)
        if compiled is not None:
            row.update(compile_s=compiled.seconds, graphs=compiled.graphs, eager_fallback=compiled.failure)
    return rows


def _rounds(ts, rounds=ROUNDS_SHOWN):
    """The timings of one variant cut into its rounds (in order): their medians show the spread."""
    size = max(1, len(ts) // rounds)
    return [ts[i:i + size] for i in range(0, len(ts), size)]


def print_table(rows):
    print(f"{'variant':<17} {'thr':>3} {'ms/mb':>8} {'tasks/s':>8} "
          f"{'t/t_loop':>8} {'t/t_bare':>8} {'t/t_vmap':>8}  per round (ms)")
    for r in rows:
        spread = " ".join(f"{x:.1f}" for x in r["spread"])
        extra = f"  compile {r['compile_s']:.1f} s, {r['graphs']} graphs" if "compile_s" in r else ""
        print(f"{r['variant']:<17} {r['threads']:>3} {r['ms_per_micro_batch']:>8.2f} "
              f"{r['tasks_per_s']:>8.0f} {r['vs_loop']:>8.2f} {r['vs_bare_func']:>8.2f} {r['vs_vmap']:>8.2f}  "
              f"{spread}{extra}")


def write_json(params, rows, path=RESULTS):
    machine = {"platform": platform.platform(), "python": platform.python_version(),
               "torch": torch.__version__, "cpu_count": os.cpu_count(),
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    if torch.cuda.is_available():
        machine["cuda_device"] = torch.cuda.get_device_name(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"machine": machine, "parameters": params, "results": rows},
                              indent=2) + "\n")
    os.replace(tmp, path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner-steps", type=int, default=1)
    ap.add_argument("--inner-lr", type=float, default=0.1)
    ap.add_argument("--tasks", type=int, default=32, help="tasks per micro-batch")
    ap.add_argument("--batches", type=int, default=4, help="distinct micro-batches, cycled")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--iters", type=int, default=400, help="timed iterations per variant")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up iterations per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--compiled", action="store_true", help="add the torch.compile variants (meta.compile)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    mc = ModelConfig()
    net = build_melu(synthetic_fields(SyntheticConfig()), mc.embed_dim, mc.hidden, EmbeddingConfig(), seed=0)
    batches = make_batches(args.tasks, args.batches)
    variants = make_variants(net, args.inner_steps, args.inner_lr)
    problems = check_agreement(net, variants, batches[0])
    if problems:
        print("variants disagree:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"agreement ok: losses rtol 1e-5, grads {', '.join(CHECKED)} rtol 1e-4 atol 1e-6")
    if args.device != "cpu":
        problems = check_device(net, variants, batches[0], args.device)
        if problems:
            print("device disagrees with cpu:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        print(f"{args.device} == cpu: loss and grads {', '.join(CHECKED)} rtol 1e-4 atol 1e-6")
        batches = [to_device(b, args.device) for b in batches]
    rows = []
    for n in args.threads:
        torch.set_num_threads(n)
        if args.compiled:  # fresh compiled variants at each thread count, checked as they compile
            variants = make_variants(net, args.inner_steps, args.inner_lr, compiled=True)
            problems = check_agreement(net, variants, batches[0]) + [
                f"{name}: fell back to eager ({fn.compiled.failure})" for name, fn in variants.items()
                if getattr(fn, "compiled", None) is not None and fn.compiled.failure]
            if problems:
                print("compiled variants disagree:\n  " + "\n  ".join(problems), file=sys.stderr)
                return 1
            for b in batches:  # every length compiles before timing (compile time reported apart)
                for fn in variants.values():
                    step(net, fn, b)
        rows += summarize(time_variants(net, variants, batches, args.iters, args.warmup,
                                        args.rounds, args.device), n, args.tasks, variants)
    print_table(rows)
    params = {**vars(args), "out": str(args.out), "embed_dim": mc.embed_dim, "hidden": mc.hidden, "adapt": ["mlp.*"],
              "algorithm": "maml (second order)", "fields": len(synthetic_fields(SyntheticConfig())),
              "batch_shapes": [list(b.support_ids.shape) + [b.query_ids.shape[1]] for b in batches]}
    write_json(params, rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
