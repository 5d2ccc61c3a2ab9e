"""User errors: mistakes the user can fix, reported by the entry point as one line and exit status 2.

Standard library only, at the bottom of the import layers, so any package may raise them. Programming errors
stay ordinary exceptions (or asserts) and keep their tracebacks.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of every user-fixable error; train.py prints `kiln: error: <message>` and exits 2."""


class ConfigError(UserError, ValueError):
    """A configuration mistake: unknown key, wrong type or range, invalid combination, missing file."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used: incomplete, from another layout or shape, or unsafe to load."""


class DataError(UserError):
    """A dataset problem: unreadable file, malformed or empty record (the message names file and record)."""
