"""Dynamic batching: concurrent requests become one vectorised adaptation.

Requests wait in a queue; one worker takes the first, then whatever arrives within
``max_wait_s`` up to ``max_batch`` users (no wait when the last batch held one user and
nobody else is waiting: at low load a request runs at once), and runs them as one batch on
a single inference thread (torch runs there; the event loop keeps accepting requests
meanwhile). Each user's rows
are padded to the longest of its batch (`Encoder.pad`). A request whose values cannot be
encoded fails alone; the rest of its batch is scored. The model is read from ``holder`` once
per batch, so a reload (`ModelHolder.swap`) takes effect between batches and a batch never
mixes versions.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from gmeta_ds.serving.encoding import RequestError
from gmeta_ds.serving.model import Scored, ServedModel, UserRequest


@dataclass
class ModelHolder:
    """The model requests are served with now."""

    model: ServedModel

    def swap(self, model: ServedModel) -> ServedModel:
        old, self.model = self.model, model
        return old


class Batcher:
    """The queue and its worker (module docstring); ``observe(batch_size, done)`` is told
    about every batch run (the server's metrics)."""

    def __init__(self, holder: ModelHolder, max_batch: int, max_wait_s: float,
                 observe: Callable[[int, dict], None]):
        self.holder, self.max_batch, self.max_wait_s, self.observe = holder, max_batch, max_wait_s, observe
        self.queue: asyncio.Queue = asyncio.Queue()
        # torch's thread count is per thread under OpenMP: the inference thread takes this one's
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="gmeta-serve", initializer=torch.set_num_threads,
                                       initargs=(torch.get_num_threads(),))
        self.worker: asyncio.Task | None = None
        self.last_size = 0  # users in the last batch run

    def start(self) -> None:
        self.worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.worker is not None:
            self.worker.cancel()
            await asyncio.gather(self.worker, return_exceptions=True)
        self.pool.shutdown(wait=True)

    async def submit(self, user: UserRequest) -> tuple[Scored, ServedModel]:
        """The user's result and the model (version) that scored it."""
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((user, future))
        return await future

    async def _collect(self) -> list:
        """The next batch: the first waiting request, then more until full or the wait ends."""
        loop = asyncio.get_running_loop()
        batch = [await self.queue.get()]
        if self.last_size == 1 and self.queue.empty():
            return batch  # one user at a time lately: waiting would only add latency
        deadline = loop.time() + self.max_wait_s
        while len(batch) < self.max_batch:
            try:
                batch.append(self.queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                left = deadline - loop.time()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), left))
            except asyncio.TimeoutError:
                break
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._collect()
            self.last_size = len(batch)
            outcomes = await self.run_batch([u for u, _ in batch])
            for (_, future), outcome in zip(batch, outcomes):
                if future.done():
                    continue
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    async def run_batch(self, users: list[UserRequest]) -> list:
        """One batch on the inference thread: each user's (`Scored`, the model that scored it),
        or the exception it failed with. This queue's worker calls it, and so does the Ray
        Serve deployment's ``@serve.batch`` method (`gmeta_ds.serving.ray_app`), which batches
        instead of `_collect`."""
        model = self.holder.model
        try:
            outcomes = await asyncio.get_running_loop().run_in_executor(self.pool, predict_batch, model, users,
                                                                        self.observe)
        except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the server
            outcomes = [exc] * len(users)
        return [o if isinstance(o, Exception) else (o, model) for o in outcomes]


def predict_batch(model: ServedModel, users: list[UserRequest], observe) -> list:
    """Each user's `Scored`, or the `RequestError` of a user whose values do not encode. A user
    is encoded apart from its batch: whatever its values raise (a `RequestError` naming the
    field, or anything the encoder did not foresee) is that user's 400, and the batch runs the
    others."""
    encoded, good = [], []
    outcomes: list = [None] * len(users)
    for i, user in enumerate(users):
        try:
            encoded.append(model.encode(user))
            good.append(i)
        except RequestError as exc:
            outcomes[i] = exc
        except Exception as exc:  # noqa: BLE001 - one request's values never fail its batch-mates
            outcomes[i] = RequestError("request", f"its values cannot be encoded ({type(exc).__name__}: {exc})")
    if good:
        results, done = model.predict_encoded([users[i] for i in good], encoded)
        observe(len(good), done)
        for i, result in zip(good, results):
            outcomes[i] = result
    return outcomes
