"""``gmeta-ds serve`` on Ray Serve: the same server, as replicas of a Ray deployment.

Each replica is the server of `gmeta_ds.serving.server` (`create_app`: the same endpoints,
request checks, 4xx answers, OIP v2 and plain JSON forms, cache and metrics of its own) mounted
with ``@serve.ingress``; only the batching differs: Ray Serve's ``@serve.batch`` gathers a
replica's concurrent requests (``max_batch``, ``max_wait_ms``) and hands them to the batcher's
`Batcher.run_batch`, the vectorised inner loop on the replica's inference thread. Ray's proxy
spreads requests over the replicas, on one machine or many.

Run it with Ray's own command, on a running cluster or a local one it starts::

    serve run gmeta_ds.serving.ray_app:build export=runs/demo-export replicas=2

`build` is an application builder: ``serve run`` and a ``serve deploy`` config file (its
``import_path`` and ``args``, as KubeRay's RayService takes them) pass it ``key=value``
arguments: ``export`` (the folder), ``replicas``, ``num_cpus`` (per replica) and any
`ServerOptions` field (``max_batch=64``, ``max_wait_ms=2``, ``model=MODULE:FUNCTION``, ...).
Ray is imported here only: ``pip install -e ".[ray]"``; the rest of the package imports without it.
"""
from __future__ import annotations

import dataclasses

import torch
from ray import serve

from gmeta_ds.errors import ConfigError
from gmeta_ds.serving.model import UserRequest
from gmeta_ds.serving.server import ServerOptions, create_app, options_from_arguments, quiet_gc


@serve.deployment
@serve.ingress()
class GmetaServe:
    """One replica: `create_app`'s application, its requests batched by ``@serve.batch``."""

    def __init__(self, export: str, options: dict):
        opts = ServerOptions(**options)
        torch.set_num_threads(opts.threads)
        self.asgi = create_app(export, opts, submit=self.submit)
        self.batcher = self.asgi.served.batcher
        self.batch.set_max_batch_size(opts.max_batch)
        self.batch.set_batch_wait_timeout_s(opts.max_wait_ms / 1000.0)
        quiet_gc()

    def __serve_build_asgi_app__(self):
        """The ASGI application Ray Serve mounts on this replica (``@serve.ingress()``)."""
        return self.asgi

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.001)
    async def batch(self, users: list[UserRequest]) -> list:
        """The users Ray gathered, adapted and scored as one batch (the sizes: `__init__`)."""
        return await self.batcher.run_batch(users)

    async def submit(self, user: UserRequest):
        """One user's (`Scored`, model); a user whose values do not encode raises its error."""
        outcome = await self.batch(user)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def build(args: dict) -> serve.Application:
    """The application ``serve run gmeta_ds.serving.ray_app:build export=DIR replicas=N`` runs
    (module docstring): ``args`` are strings from the command line, or typed values from a
    config file or Python."""
    args = dict(args)
    if "export" not in args:
        raise ConfigError(["export: missing; the export folder to serve (serve run "
                           "gmeta_ds.serving.ray_app:build export=DIR)"], "gmeta_ds.serving.ray_app")
    export = str(args.pop("export"))
    replicas = int(args.pop("replicas", 1))
    num_cpus = float(args.pop("num_cpus", 1))
    options = options_from_arguments(args, "gmeta_ds.serving.ray_app")
    deployment = GmetaServe.options(num_replicas=replicas, ray_actor_options={"num_cpus": num_cpus})
    return deployment.bind(export, dataclasses.asdict(options))
