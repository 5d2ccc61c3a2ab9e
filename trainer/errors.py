"""kiln's user-error types: the entry point prints any UserError as one line and exits with status 2.

Standard library only, at the bottom of the import order, so every layer can raise them.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake by the user (configuration, checkpoint, data), not a kiln bug: one line, exit status 2."""


class ConfigError(UserError, ValueError):
    """A mistake in the configuration (a key, a value, a combination, a file it names)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed by this run (damaged, or saved with incompatible settings)."""


class DataError(UserError):
    """A data file or record that cannot be trained on; the message names the file and the record."""
