"""The exception type for mistakes a user can fix.

Every stage raises `EyasError` for bad input (a recipe key, a missing file, a shard from
another target); the CLI prints its message on one line and exits with status 2 instead
of a traceback. Programming errors stay ordinary exceptions and keep their traceback.
"""


class EyasError(Exception):
    """A user-facing error: the message says what is wrong and what to do."""


class UnsupportedTarget(EyasError):
    """A target eyas read and refuses (a masked LM, a linear-attention or recurrent family): no other copy of
    its config can help, so a caller that offers one on a read failure (`eyas plan`) passes this on as it is."""
