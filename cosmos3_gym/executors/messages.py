"""The messages between a client-mode engine (``client.py``) and its workers (``worker.py``), over a
``multiprocessing.connection`` connection.

Pickled with the standard pickler (``send_bytes``), not the connection's own ``send``: that one uses multiprocessing's
``ForkingPickler``, to which torch adds shared-memory reductions for tensors; standard pickling sends tensors by
value, so no shared-memory handle or semaphore outlives either process.
"""

from __future__ import annotations

import pickle
import traceback
from multiprocessing.connection import Connection

from ..errors import CheckpointError, InputError

# The file store through which the workers of one client join their process group (client.py: security model).
RENDEZVOUS_ENV_VAR = "COSMOS3_GYM_RENDEZVOUS_FILE"

# The error types a worker reports by name and the client raises again as themselves.
USER_ERRORS = {"CheckpointError": CheckpointError, "InputError": InputError}


def send(connection: Connection, message) -> None:
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Connection):
    return pickle.loads(connection.recv_bytes())


def error_reply(error: BaseException) -> tuple:
    """("error", kind, message, traceback): ``kind`` is a ``USER_ERRORS`` key when the error is one of them."""
    kind = next((name for name, cls in USER_ERRORS.items() if isinstance(error, cls)), type(error).__name__)
    return "error", kind, str(error), "".join(traceback.format_exception(error))
