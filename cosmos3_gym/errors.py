"""Errors raised for bad user input.

Every check that rejects user input raises ``InputError`` (a ``ValueError``) with a message naming the field
and what was expected; the CLI turns it into one line on stderr and exit code 2.
"""


class InputError(ValueError):
    """Bad user input: the message names the field and what was expected."""


class CheckpointError(InputError):
    """A checkpoint (or a part of it) is missing, malformed or unreachable."""


class UnknownArgumentsError(InputError, TypeError):
    """Keyword arguments nobody takes. Also a ``TypeError``, as Python's own "unexpected keyword argument", so that
    wrappers that probe optional keywords (TorchRL's ``GymEnv`` offers ``frameskip=``) can tell it apart."""
