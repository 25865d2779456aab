"""What a client of `gmeta-ds serve` may make the server do beyond scoring: which folders the
reload endpoint loads (`ReloadPolicy`), and how long a connection may take to send a request's
headers (`header_deadline_protocol`).

Reloading is off unless the server was started with ``--allow-reload``: the endpoint reads a
folder of the server's machine, named by the request, and holds the reload lock while it loads
it, so a server reachable by clients it does not trust must not take paths from them. With it,
``POST /v2/repository/models/{name}/load`` reloads the export the server serves, or loads
``parameters.path`` when that folder, its symbolic links and ``..`` resolved, lies under one of
the ``--model-root`` folders given at start. Anything else is refused before any file is read:
403 naming why, 400 for a path that is not a string.

The header deadline closes a connection that has not sent a whole request head within
``--header-timeout`` seconds of connecting, or of the first byte of its next request (between
requests, uvicorn's keep-alive timeout applies): a client that sends half a header and stalls
no longer holds its socket and buffer for ever.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gmeta_ds.errors import ConfigError


class Refused(Exception):
    """A request the server will not carry out: ``status`` (403, 400), ``field``, the reason."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


@dataclass(frozen=True)
class ReloadPolicy:
    """Which folders the reload endpoint may load (module docstring): none unless ``allow``;
    then the export served and any folder under ``roots`` (resolved at start)."""

    allow: bool
    roots: tuple[Path, ...]

    @classmethod
    def of(cls, allow: bool, roots: tuple[str, ...] | list[str]) -> ReloadPolicy:
        """The policy of ``--allow-reload`` and the ``--model-root`` folders; a root that is not
        a folder, or roots without ``allow``, is a `ConfigError` (refused before listening)."""
        problems = [f"--model-root {root}: not a folder" for root in roots if not Path(root).is_dir()]
        if roots and not allow:
            problems.append("--model-root: the reload endpoint is off without --allow-reload; add it to let "
                            "POST /v2/repository/models/{name}/load load exports under these folders")
        if problems:
            raise ConfigError(problems, "gmeta-ds serve")
        return cls(allow, tuple(Path(root).resolve() for root in roots))

    def target(self, body, served: Path) -> Path:
        """The folder a reload request (its JSON ``body``) loads: ``parameters.path``, resolved,
        or ``served`` (the export being served) when it names none; `Refused` otherwise."""
        if not self.allow:
            raise Refused(403, "reload", "reloading is off on this server (start gmeta-ds serve with "
                                         "--allow-reload, and --model-root DIR for exports other than its own)")
        params = body.get("parameters") if isinstance(body, dict) else None
        if not isinstance(params, dict) or params.get("path") is None:
            return served
        raw = params["path"]
        if not isinstance(raw, str) or not raw or "\0" in raw:
            raise Refused(400, "parameters.path", f"expected the export folder's path (a string), got {raw!r:.80}")
        try:
            path = Path(raw).resolve()
        except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a symlink loop
            raise Refused(400, "parameters.path", f"{raw!r:.200} cannot be resolved ({exc})") from None
        if path == served.resolve() or any(path.is_relative_to(root) for root in self.roots):
            return path
        where = ", ".join(map(str, self.roots)) or "none given"
        raise Refused(403, "parameters.path", f"{raw!r:.200} ({str(path)[:200]}) is not under a folder this server "
                                              f"loads from (--model-root: {where})")


def header_deadline_protocol(seconds: float) -> type:
    """uvicorn's httptools protocol, closing a connection whose request head is not complete
    ``seconds`` after it connected or began its request (module docstring). One timer per
    request head, set and cancelled on the event loop: no cost a request would notice."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as exc:
        why = (f"--header-timeout needs uvicorn's httptools parser, which is not installed ({exc}); install the "
               "serve extra: pip install 'gmeta-ds[serve]'")
        raise ConfigError([why], "gmeta-ds serve") from None

    class HeaderDeadline(HttpToolsProtocol):
        """HttpToolsProtocol with a deadline on each request head."""

        header_timeout_s = seconds
        deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self.deadline is None:  # the first request's was armed at connection
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self.deadline = self.loop.call_later(self.header_timeout_s, self._late)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _late(self) -> None:
            self.deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
