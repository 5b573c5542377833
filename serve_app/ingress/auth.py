"""API keys for the gRPC API: ``authorization: Bearer <key>`` metadata, keys from a file or an environment variable.

Keys are held as SHA-256 digests and compared in constant time. A config that
names a key source which is missing or empty is refused at start-up: a server
that meant to require keys must never come up open.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from calid.errors import CalidError


class AuthConfigError(CalidError):
    """The configured key source cannot be read or holds no key."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_keys(file: str | None = None, env: str | None = None) -> frozenset[bytes] | None:
    """The accepted keys' digests; None when no source is configured (authentication off).

    The file holds one key per line; blank lines and lines starting with ``#`` are skipped.
    The environment variable holds one or more keys separated by commas.
    """
    if file is None and env is None:
        return None
    keys: list[str] = []
    if file is not None:
        path = Path(file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise AuthConfigError(f"api_keys_file {path}: {e.strerror}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if env is not None:
        keys += [k.strip() for k in os.environ.get(env, "").split(",") if k.strip()]
    if not keys:
        where = " and ".join(x for x in (file and f"file {file}", env and f"${env}") if x)
        raise AuthConfigError(f"no API key found in {where}; add one or remove api_keys_file/api_keys_env")
    return frozenset(_digest(k) for k in keys)


def bearer(metadata) -> str | None:
    """The key of an ``authorization: Bearer <key>`` entry of gRPC invocation metadata."""
    for name, value in metadata or ():
        if name.lower() == "authorization":
            scheme, _, key = str(value).partition(" ")
            return key.strip() if scheme.lower() == "bearer" and key.strip() else None
    return None


def allowed(keys: frozenset[bytes] | None, key: str | None) -> bool:
    if keys is None:
        return True
    if key is None:
        return False
    d = _digest(key)
    return any(hmac.compare_digest(d, k) for k in keys)
