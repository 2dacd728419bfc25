"""Exceptions that reach users.

Anything a user can cause (a bad config value, a missing file, a malformed component
spec) is raised as an :class:`AsyncRLError` subclass whose message names the field,
file or stage at fault; the CLI prints it without a traceback.
"""

from __future__ import annotations


class AsyncRLError(Exception):
    """Base class for errors caused by user input; printed without a traceback."""


class ConfigError(AsyncRLError):
    """One or more problems in a config; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str] | str):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ModelError(AsyncRLError):
    """A model that cannot be loaded, built or exported: unsupported architecture or
    option, missing/unexpected/mis-shaped tensors, unreadable files. The message names
    the directory or file and every problem found."""


class RolloutError(AsyncRLError):
    """Rollout stopped: too many consecutive episode failures, a bad batch, or a wait that timed out."""


class TrajectorySchemaError(RolloutError):
    """A trajectory or batch broke a schema rule of :mod:`asyncrl.rollout.trajectory`.

    ``rule`` and ``field`` name what was broken; the message also names the workflow,
    the sample and the trajectory (or batch row) when they are known.
    """

    def __init__(self, message: str, *, rule: str, field: str):
        self.rule = rule
        self.field = field
        super().__init__(message)


class EngineRequestError(AsyncRLError, ValueError):
    """A generation request (or engine setting) the inference engine cannot serve: a prompt
    plus ``max_new_tokens`` beyond the KV capacity, bad sampling parameters, too many samples.
    Raised on the caller's thread; the message names the field."""


class EngineClosed(AsyncRLError, RuntimeError):
    """The inference engine was shut down: raised by later calls and by the requests it failed."""


class CheckpointError(AsyncRLError):
    """A checkpoint that cannot be written or read: incomplete or corrupt files, a tree that
    does not match its template, a value that cannot be stored without pickle. The message
    names the checkpoint directory, the file and the key at fault."""


class EngineCrashed(RuntimeError):
    """The inference engine's own thread died; training must stop at once.

    Raised by every later ``generate``/``submit`` of that engine. ``engine_traceback``
    is the formatted traceback of the engine thread's exception, and is part of the message.
    """

    def __init__(self, message: str, engine_traceback: str = ""):
        self.engine_traceback = engine_traceback
        text = message if not engine_traceback else f"{message}\n--- engine traceback ---\n{engine_traceback.rstrip()}"
        super().__init__(text)


class TrainerError(AsyncRLError):
    """The trainer cannot run a step: a batch that does not fit the mesh or the config
    (row count, shapes, versions), a bad mesh, or too many non-finite updates in a row.
    The message names the field or config key at fault."""
