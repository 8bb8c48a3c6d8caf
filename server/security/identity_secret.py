"""The server secret that keys caller identities (HMAC), and where it is kept.

Identities are HMAC-SHA256(secret, api_key, user_id): without the secret an
identity hash says nothing about the key behind it, and with the same secret
the same caller gets the same identity across restarts (request logs, usage).

The secret comes from, in order: ``--identity-secret-file`` (its content),
``$PROTOSERVE_IDENTITY_SECRET``, or the file ``identity_secret`` in the data
directory (``--data-dir``, ``$PROTOSERVE_DATA_DIR``, else
``$XDG_DATA_HOME/protoserve``, else ``~/.local/share/protoserve``), which the
first start creates: 32 random bytes, hex, mode 0600, written atomically so
two servers starting together end up with the same secret.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

SECRET_ENV = "PROTOSERVE_IDENTITY_SECRET"
DATA_DIR_ENV = "PROTOSERVE_DATA_DIR"
SECRET_FILE_NAME = "identity_secret"
# A shorter secret could be guessed, and with it every weak API key from its identity hash.
MIN_SECRET_BYTES = 32
_GENERATED_BYTES = 32


def default_data_dir() -> Path:
    """``$PROTOSERVE_DATA_DIR``, else ``$XDG_DATA_HOME/protoserve``, else ``~/.local/share/protoserve``."""
    explicit = os.environ.get(DATA_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "protoserve"


def _checked(secret: bytes, source: str) -> bytes:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the identity secret from {source} is {len(secret)} bytes; it must be at least {MIN_SECRET_BYTES} "
            "(e.g. `openssl rand -hex 32`)"
        )
    return secret


def _create(path: Path) -> None:
    """Write a new random secret at ``path`` unless one is there; never replaces an existing file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_hex(_GENERATED_BYTES).encode("ascii") + b"\n")
            out.flush()
            os.fsync(out.fileno())
        # link, not rename: a secret another server wrote first is kept, and both use it.
        os.link(temp, path)
        log.info("created the identity secret %s", path)
    except FileExistsError:
        pass
    finally:
        temp.unlink(missing_ok=True)


def stored_secret(data_dir: Path) -> bytes:
    """The secret kept in ``data_dir``, created on first use."""
    path = data_dir / SECRET_FILE_NAME
    if not path.exists():
        _create(path)
    return _checked(path.read_bytes(), str(path))


def load_identity_secret(secret_file: str | os.PathLike[str] | None, data_dir: str | os.PathLike[str] | None) -> bytes:
    """The server's identity secret from the flag's file, the environment or the data directory.

    Raises ValueError or OSError with a message fit for the command line.
    """
    if secret_file is not None:
        return _checked(Path(secret_file).read_bytes(), str(secret_file))
    from_env = os.environ.get(SECRET_ENV)
    if from_env:
        return _checked(from_env.encode("utf-8"), f"${SECRET_ENV}")
    directory = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    try:
        return stored_secret(directory)
    except OSError as exc:
        raise OSError(
            f"cannot keep the identity secret in {directory} ({exc.strerror or exc}); "
            f"give --data-dir, --identity-secret-file or ${SECRET_ENV}"
        ) from exc
