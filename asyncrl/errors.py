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
