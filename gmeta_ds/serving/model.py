"""A loaded export that adapts to users and scores their candidates (`load_adapter`), with a
cache of adapted parameters.

One call of `ServedModel.predict` takes a batch of users: each user's support rows are encoded,
users whose (user id, support) were adapted recently take their cached parameters, the others
are adapted together in one vectorised inner loop (users without support rows keep the
meta-initialisation), and every user's candidates are scored together. The cache
(`cachetools.TTLCache`: least recently used out when full, entries expire after ``ttl_s``)
keys on the user's id and a digest of its encoded support rows and labels, so a user whose
support changed is adapted again.
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from torch import nn

from gmeta_ds.serving.adapter import Adapted, Adapter, build_learner
from gmeta_ds.serving.encoding import Encoded, Encoder
from gmeta_ds.serving.export import open_export


@dataclass
class UserRequest:
    """One user: ``support`` and ``candidates`` map each field to one raw value per row (a
    multi-hot field: one list per row); ``labels`` the support's labels; ``user_id`` keys
    the cache (None: the support alone does).

    Args:
        support: field name -> one raw value per support row (a list per row when multi-hot).
        labels: the support rows' labels (clicks 0/1, or ratings for regression).
        candidates: field name -> one raw value per candidate row to score.
        user_id: the cache key with the support's digest; None: the support alone.
    """

    support: dict[str, list]
    labels: list[float]
    candidates: dict[str, list]
    user_id: str | None = None


@dataclass
class Scored:
    """A user's candidate scores (probabilities; ratings for regression), whether its adapted
    parameters came from the cache, and how many of its values were unknown.

    Args:
        scores: one probability per candidate (a rating for regression).
        cached: the adapted parameters came from the cache.
        unknown: values of the request outside the export's vocabularies.
        adapted: False when the support was empty (the meta-initialisation scored it).
    """

    scores: list[float]
    cached: bool
    unknown: int
    adapted: bool = field(default=True)


class AdaptedCache:
    """Adapted parameters by (user id, support digest): LRU with a TTL, thread-safe."""

    def __init__(self, size: int, ttl_s: float):
        from cachetools import TTLCache

        self.entries = TTLCache(maxsize=max(size, 1), ttl=ttl_s) if size > 0 else None
        self.lock = threading.Lock()

    def get(self, key) -> Adapted | None:
        if self.entries is None:
            return None
        with self.lock:
            return self.entries.get(key)

    def put(self, key, value: Adapted) -> None:
        if self.entries is not None:
            with self.lock:
                self.entries[key] = value

    def __len__(self) -> int:
        return 0 if self.entries is None else len(self.entries)


class ServedModel:
    """An export ready to adapt and score (module docstring): ``name``, ``version``
    (`Export.version`), ``inner_steps``. Built by `load_adapter`.

    Args:
        path: the export folder.
        model: the saved architecture (a module, or a function of the saved fields); None
            when the export holds its recipe.
        cache_size: users whose adapted parameters are kept (0: no cache).
        cache_ttl_s: seconds an adapted user stays in the cache.
        inner_steps: inner steps per user; None: the export's.
    """

    def __init__(self, path: str | Path, model: nn.Module | Callable | None = None, cache_size: int = 10000,
                 cache_ttl_s: float = 600.0, inner_steps: int | None = None):
        self.export = open_export(path)
        self.learner = build_learner(self.export, model)
        steps = self.export.serving["inner_steps"] if inner_steps is None else inner_steps
        self.adapter = Adapter(self.learner, steps)
        self.encoder = Encoder(self.export)
        self.cache = AdaptedCache(cache_size, cache_ttl_s)
        self.name, self.version, self.inner_steps = self.export.name, self.export.version, steps
        self.fields = self.export.fields

    def warm_up(self) -> None:
        """Adapt and score one user of all-zero ids (nothing cached, no unknown counted)."""
        zero = Encoded(np.zeros((1, len(self.encoder.single)), np.int64),
                       {f.name: [np.zeros(0, np.int64)] for f in self.encoder.multi}, np.zeros(1, np.float32), 0)
        self.adapter.score(self.adapter.adapt(self.encoder.pad([zero])), self.encoder.pad([zero]))

    def predict(self, users: list[UserRequest]) -> list[Scored]:
        """Adapt (or take from the cache) and score every user of the batch; a user's bad
        value raises `RequestError` naming it.

        Args:
            users: the batch's users.

        Returns:
            One `Scored` per user, in order.
        """
        return self.predict_encoded(users, [self.encode(u) for u in users])[0]

    def encode(self, user: UserRequest) -> tuple[Encoded, Encoded]:
        """A user's support and candidate rows as ids (`RequestError` naming a bad value).

        Args:
            user: the request to encode.

        Returns:
            (support rows, candidate rows) as encoded ids.
        """
        return (self.encoder.encode(user.support, user.labels, "support"),
                self.encoder.encode(user.candidates, None, "candidates"))

    def predict_encoded(self, users: list[UserRequest], rows: list[tuple[Encoded, Encoded]]) -> tuple[list, dict]:
        """`predict` of encoded users; also returns what it did.

        Args:
            users: the batch's users (their ``user_id`` keys the cache).
            rows: each user's (support, candidates) from `encode`.

        Returns:
            (one `Scored` per user, {``adapted``: users adapted now, ``adapt_s``, ``score_s``: seconds}).
        """
        keys = [(u.user_id, _digest(s)) for u, (s, _) in zip(users, rows)]
        params: list[Adapted | None] = [self.cache.get(k) for k in keys]
        cached = [p is not None for p in params]
        todo = [i for i, p in enumerate(params) if p is None and len(rows[i][0].labels)]
        start = time.perf_counter()
        if todo:
            for i, adapted in zip(todo, self.adapter.adapt(self.encoder.pad([rows[i][0] for i in todo]))):
                params[i] = adapted
                self.cache.put(keys[i], adapted)
        middle = time.perf_counter()
        initial = self.adapter.initial() if any(p is None for p in params) else None
        params = [initial if p is None else p for p in params]  # no support rows: the meta-initialisation
        scores = self.adapter.score(params, self.encoder.pad([c for _, c in rows]))
        done = {"adapted": len(todo), "adapt_s": middle - start, "score_s": time.perf_counter() - middle}
        return [Scored(scores[i, :len(c.labels)].tolist(), cached[i], s.unknown + c.unknown, bool(len(s.labels)))
                for i, (s, c) in enumerate(rows)], done


def _digest(rows: Encoded) -> str:
    """A digest of one user's encoded support rows and labels."""
    h = hashlib.blake2b(rows.ids.tobytes(), digest_size=16)
    h.update(rows.labels.tobytes())
    for name in sorted(rows.bags):
        for bag in rows.bags[name]:
            h.update(len(bag).to_bytes(4, "little") + bag.tobytes())
    return h.hexdigest()


def load_adapter(path: str | Path, model: nn.Module | Callable | None = None, cache_size: int = 10000,
                 cache_ttl_s: float = 600.0, inner_steps: int | None = None) -> ServedModel:
    """An export folder (``engine.save_model`` or ``gmeta-ds export --config``) ready to adapt
    to users and score their candidates, in this process, without DeepSpeed: ``model`` is the
    saved architecture (a module, or a function of the saved fields) and may be left out when
    the export holds its recipe (the CLI's). ``cache_size``: users (0 turns the cache off);
    ``inner_steps``: default the export's.

    Args:
        path: the export folder.
        model: the saved architecture (a module, or a function of the saved fields); None when
            the export holds its recipe.
        cache_size: users whose adapted parameters are kept (0: no cache).
        cache_ttl_s: seconds an adapted user stays in the cache.
        inner_steps: inner steps per user; None: the export's.

    Returns:
        The `ServedModel`.
    """
    return ServedModel(path, model, cache_size=cache_size, cache_ttl_s=cache_ttl_s, inner_steps=inner_steps)
