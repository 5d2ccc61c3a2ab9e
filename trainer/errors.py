"""User errors: mistakes in what the user gave kiln (config, checkpoint, data), as opposed to bugs.

The entry point prints any UserError as one line, `kiln: error: ...`, and exits with status 2; the type says
which input was wrong. Standard library only: everything may import it.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input; reported as one line, exit status 2."""


class ConfigError(UserError, ValueError):
    """A mistake in the configuration (TOML file or command line)."""


class CheckpointError(UserError):
    """A checkpoint or checkpoint folder kiln cannot or will not use (corrupt, unsafe, in use, another model)."""


class DataError(UserError):
    """A dataset kiln cannot read (missing, malformed record)."""
