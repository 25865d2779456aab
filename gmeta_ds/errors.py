"""Exceptions that gmeta_ds raises for bad user input (config, data, launcher arguments)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A run configuration is invalid; ``problems`` lists every problem found, one per line,
    each naming the dotted key, the value given and what is allowed.

    Args:
        problems: one line per problem.
        source: where the configuration came from (a file, or the function that checked
            it), named in the message; None: not named.
    """

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration{where} ({len(self.problems)} problem(s)):\n{lines}")


class DataError(ValueError):
    """An interaction log on disk is missing, unreadable or malformed, or leaves no usable task;
    the message names the file, the line or column, and what was expected."""


class CollectiveTimeout(RuntimeError):
    """A collective (ours or DeepSpeed's) did not complete within ``train.collective_timeout_s``:
    a peer rank is stuck or gone. The message names the phase (meta-step N, checkpoint save,
    evaluation, final gather), the timeout, this rank and the last complete checkpoint."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, permissions, I/O error) on one or
    more ranks. Every rank raises it with the same message, naming the rank, the file and the
    cause; the incomplete checkpoint is removed and ``latest`` still names the previous one."""
