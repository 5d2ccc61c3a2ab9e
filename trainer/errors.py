"""User errors: mistakes in the configuration, a checkpoint or the data, as opposed to bugs in kiln.

The entry point catches UserError once and prints it as one line, `kiln: error: ...`, with exit status 2.
Standard library only: the config layer imports it.
"""


class UserError(Exception):
    """A mistake the user can fix; reported as one line, exit status 2, no traceback."""


class ConfigError(UserError, ValueError):
    """A mistake in the configuration (a key, a value, a combination, a missing file)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded into this run (corrupt, another model or layout)."""


class DataError(UserError):
    """A dataset or tokenizer that cannot be read (the file and record are named)."""
