"""Paired bootstrap intervals of metric differences between two models over the same users.

The held-out users are the unit of resampling: each resample draws U users with replacement
(a row of multiplicities, `resample_counts`), and every metric of both models is recomputed
on that one weighted set of users, so the difference of the two is paired (the same users,
the same query rows). A user drawn k times counts k times in every metric:

* global AUC: the AUC of all query rows, each weighted by its user's multiplicity (a
  positive/negative pair weighs w_pos * w_neg; ties count 1/2), exact and rank-based
  (`weighted_auc`), not a mean of per-user AUCs;
* mean per-user AUC (``auc_per_task``): the multiplicity-weighted mean over the users whose
  query holds both classes;
* logloss, MAE: row-weighted means; RMSE: the root of the row-weighted mean squared error.

The interval is the percentile interval of the resampled differences; the point difference
is that of the unresampled users (the numbers `gmeta_ds.evaluation.metrics.score_tasks` reports). Seeded
and deterministic; vectorised over resamples in chunks, so 10,000 users x 1,000 resamples take
about a second (benchmarks/bootstrap.py).
"""
from __future__ import annotations

import numpy as np

from gmeta_ds.evaluation.metrics import per_task_auc

# Metrics whose difference (model minus baseline) gets an interval, by label kind.
METRICS = {"binary": ("auc", "auc_per_task", "logloss"), "regression": ("mae", "rmse")}
RESAMPLES = 1000
LEVEL = 0.95
# Floats per chunk of resamples (resamples x AUC segments): bounds the working memory.
CHUNK_ELEMENTS = 2**22
EPS = np.finfo(np.float64).eps


def resample_counts(n_users: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, n_users) ints: how often each user is drawn in each resample of
    ``n_users`` draws with replacement (every row sums to ``n_users``)."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n_users, size=(resamples, n_users), dtype=np.int64)
    draws += np.arange(resamples, dtype=np.int64)[:, None] * n_users
    return np.bincount(draws.ravel(), minlength=resamples * n_users).reshape(resamples, n_users)


class WeightedAUC:
    """Global AUC of fixed (labels, preds) rows under many weightings of their users.

    Prepared once (one sort): the rows in ascending score order cut into segments, each a run
    of negatives only, of positives only, or one group of tied scores holding both, as two
    sparse (segments x users) matrices counting each user's negatives / positives in each
    segment. Under user weights w, Z = S_neg w and P = S_pos w weigh each segment's
    negatives and positives; a positive outranks every negative of an earlier segment and
    ties those of its own (a mixed segment: 1/2 each), so the AUC is
    sum(P * (cumsum(Z) - Z / 2)) / (sum(P) * sum(Z)), exact in float64 for integer weights."""

    def __init__(self, labels: np.ndarray, preds: np.ndarray, user: np.ndarray, n_users: int):
        from scipy.sparse import csr_matrix  # not at import time, like sklearn in metrics.py

        order = np.argsort(preds, kind="stable")
        s, pos, u = preds[order], labels[order] > 0, user[order]
        group = np.concatenate(([0], np.cumsum(s[1:] != s[:-1])))
        n_groups = int(group[-1]) + 1 if len(group) else 0
        kind = (np.bincount(group, pos, n_groups) > 0) + 2 * (np.bincount(group, ~pos, n_groups) > 0)
        # a new segment at every group whose kind (1 pos, 2 neg, 3 mixed) differs from the last's, or is mixed
        new = np.ones(n_groups, dtype=bool)
        new[1:] = (kind[1:] != kind[:-1]) | (kind[1:] == 3)
        segment = (np.cumsum(new) - 1)[group]
        shape = (int(new.sum()), n_users)
        self.neg = csr_matrix((np.ones((~pos).sum()), (segment[~pos], u[~pos])), shape=shape)
        self.pos = csr_matrix((np.ones(pos.sum()), (segment[pos], u[pos])), shape=shape)

    def __call__(self, counts: np.ndarray) -> np.ndarray:
        """(B,) AUC under user weights ``counts`` (B, U); NaN where one class weighs 0."""
        step = max(1, CHUNK_ELEMENTS // max(1, self.neg.shape[0]))
        return np.concatenate([self._chunk(counts[i:i + step]) for i in range(0, len(counts), step)])

    def _chunk(self, counts: np.ndarray) -> np.ndarray:
        w = np.ascontiguousarray(counts.T, dtype=np.float64)  # users x resamples
        z, p = self.neg @ w, self.pos @ w
        tied = np.einsum("ij,ij->j", p, z)
        np.cumsum(z, axis=0, out=z)  # in place: a fresh array costs more in page faults than the sum
        num = np.einsum("ij,ij->j", p, z) - 0.5 * tied
        den = p.sum(axis=0) * z[-1]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def weighted_auc(labels: np.ndarray, preds: np.ndarray, user: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(B,) AUC of the rows (labels 0/1, preds, user index in [0, U)) with each row weighted by
    its user's count in each row of ``counts`` (B, U) ints (see `WeightedAUC`)."""
    counts = np.asarray(counts)
    return WeightedAUC(np.asarray(labels), np.asarray(preds), np.asarray(user), counts.shape[1])(counts)


class ModelMetrics:
    """One model's per-user sufficient statistics on the held-out query rows, for `METRICS`
    under any user weighting (``user``: each row's user index in [0, n_users))."""

    def __init__(self, labels: np.ndarray, preds: np.ndarray, user: np.ndarray, n_users: int, kind: str):
        self.kind = kind
        self.rows = np.bincount(user, minlength=n_users).astype(np.float64)
        if kind == "binary":
            p = np.clip(preds, EPS, 1.0 - EPS)
            loss = -(labels * np.log(p) + (1.0 - labels) * np.log1p(-p))
            self.loss = np.bincount(user, loss, minlength=n_users)
            self.auc = WeightedAUC(labels, preds, user, n_users)
            self.user_auc = per_task_auc(labels, preds, user)  # users 0..U-1 each have rows
        else:
            err = preds - labels
            self.abs = np.bincount(user, np.abs(err), minlength=n_users)
            self.sq = np.bincount(user, err * err, minlength=n_users)

    def __call__(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """{metric: (B,) values} under user weights ``w`` (B, U) float64."""
        rows = w @ self.rows
        if self.kind == "regression":
            return {"mae": w @ self.abs / rows, "rmse": np.sqrt(w @ self.sq / rows)}
        ok = ~np.isnan(self.user_auc)
        with np.errstate(invalid="ignore", divide="ignore"):
            per_user = w @ np.where(ok, self.user_auc, 0.0) / (w @ ok.astype(np.float64))
        return {"auc": self.auc(w), "auc_per_task": per_user, "logloss": w @ self.loss / rows}


def _interval(point: float, diffs: np.ndarray, level: float) -> dict:
    """{"diff", "low", "high"}: the point difference and the percentile interval of the
    resampled ones (None where undefined: JSON null, never NaN)."""
    finite = diffs[np.isfinite(diffs)]
    if not np.isfinite(point) or len(finite) == 0:
        return {"diff": None if not np.isfinite(point) else float(point), "low": None, "high": None}
    low, high = np.quantile(finite, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return {"diff": float(point), "low": float(low), "high": float(high)}


def paired_intervals(labels: np.ndarray, task: np.ndarray, pred: np.ndarray, baselines: dict[str, np.ndarray],
                     kind: str, resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict:
    """Paired bootstrap over users of ``pred`` (the meta-learned model) minus each baseline.

    labels, task, pred: (N,) the held-out query rows (any task id dtype); ``baselines``:
    {name: (N,) predictions of the same rows in the same order}. Returns {"resamples",
    "level", "seed", "users", "differences": {name: {metric: {"diff", "low", "high"}}}} with
    metrics `METRICS` [kind] (module docstring), every model scored on the same resamples."""
    _, user = np.unique(np.asarray(task), return_inverse=True)
    user = user.reshape(-1)
    n_users = int(user.max()) + 1 if len(user) else 0
    labels = np.asarray(labels, dtype=np.float64)
    out = {"resamples": int(resamples), "level": float(level), "seed": int(seed), "users": n_users,
           "differences": {}}
    if n_users == 0 or resamples < 1:
        return out
    w = np.vstack([np.ones((1, n_users)), resample_counts(n_users, resamples, seed)])  # row 0: the users as drawn
    mine = ModelMetrics(labels, np.asarray(pred, np.float64), user, n_users, kind)(w)
    for name, other in baselines.items():
        if not np.isfinite(other).all():  # a diverged fine-tune: its scores are null too
            out["differences"][name] = {m: _interval(np.nan, np.zeros(0), level) for m in METRICS[kind]}
            continue
        theirs = ModelMetrics(labels, np.asarray(other, np.float64), user, n_users, kind)(w)
        out["differences"][name] = {m: _interval(mine[m][0] - theirs[m][0], mine[m][1:] - theirs[m][1:], level)
                                    for m in METRICS[kind]}
    return out


def split_interval(points: list[dict], held_out_fraction: float, level: float = LEVEL) -> dict:
    """The mean over K user splits of one difference, with an interval counting both the
    split-to-split variance (training, initialisation, which users train and which are held
    out) and the user sampling: ``points`` are the K splits' {"diff", "low", "high"} (a
    `paired_intervals` entry each), ``held_out_fraction`` the share n / N of the N users the
    splits draw from that each one holds out (0 when every split draws new users: the
    synthetic generator's seeds).

    With d_k the splits' differences, s^2 their sample variance and w_k = ((high - low) /
    (2 z))^2 each split's paired-bootstrap variance, Var(mean d) = s^2 / K + (n / N) mean(w):
    the splits share users, so their differences covary by the per-user variance / N, which
    s^2 misses and no number of splits averages away (the corrected resampled t-test of
    Nadeau and Bengio, 2003, with that covariance estimated from the bootstrap rather than as
    n_test / n_train s^2; w also holds the per-split noise of a user's metric, so the term is
    conservative). The interval is mean +- sqrt(t^2 s^2 / K + z^2 (n / N) mean(w)): Student's t
    with K - 1 degrees of freedom for the splits' term, the normal quantile for the bootstrap's
    (estimated from many users). Simulated (tests/unit/test_intervals.py): 95-96% coverage at
    10 splits, conservative (97-98%) at 2-3; without the shared-user term, 79% at 10 splits.
    Returns {"diff", "low", "high", "splits", "sd"} (sd: the splits' standard deviation); None
    where a split's value is undefined."""
    from scipy.stats import norm, t as student

    if len(points) < 2 or any(p.get("diff") is None or p.get("low") is None for p in points):
        return {"diff": None, "low": None, "high": None, "splits": len(points), "sd": None}
    diffs = np.array([p["diff"] for p in points], dtype=np.float64)
    z = norm.ppf((1.0 + level) / 2.0)
    within = np.array([((p["high"] - p["low"]) / (2.0 * z)) ** 2 for p in points])
    k = len(diffs)
    between, shared = diffs.var(ddof=1) / k, held_out_fraction * within.mean()
    mean = float(diffs.mean())
    half = float(np.sqrt(student.ppf((1.0 + level) / 2.0, k - 1) ** 2 * between + z**2 * shared))
    return {"diff": mean, "low": mean - half, "high": mean + half, "splits": k, "sd": float(np.sqrt(between * k))}
