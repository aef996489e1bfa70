"""The root of every error a user can act on.

``lazytrain`` prints a ``LazyTrainError`` as one message (what was wrong, the value, what to
do) and exits with status 2; any other exception is a bug and keeps its traceback. Each part
raises its own subclass; they also derive from the builtin they refine (``ValueError``,
``MemoryError``, ``OSError``) so callers that catch those keep working.
"""


class LazyTrainError(Exception):
    """A bad input, an unusable machine or a run that cannot go on: the message says what to do."""


class ConfigError(LazyTrainError, ValueError):
    """A config key holds a value LazyTrain cannot use (the message names the key)."""
