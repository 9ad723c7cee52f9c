"""Plan blob signatures: an HMAC-SHA256 of the whole blob under a secret key both sides hold.

    signed blob = blob | b"NVDNNSIG" | HMAC-SHA256(key, blob) (32 bytes)

The sha256 inside every blob proves integrity only: anyone can change a blob and recompute it.
A valid signature proves origin as far as a shared key can: the blob was signed by a holder of
the key and not changed since. It says nothing about what the kernels do, and whoever can
verify can also sign. Keys come from code (``key=``) or a file (NVDNN_PLAN_KEY_FILE,
``--key-file``), never from a command line, where ``ps`` shows them.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat

from . import config
from .errors import PlanFormatError, ValidationError

MAGIC = b"NVDNNSIG"
TRAILER = len(MAGIC) + 32
MIN_KEY = 32          # bytes: e.g. `head -c 32 /dev/urandom > plan.key`
MAX_KEY_FILE = 4096


def check_key(key, arg: str = "key") -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ValidationError(f"{arg}: a signing key is bytes, got {type(key).__name__}", arg=arg)
    key = bytes(key)
    if len(key) < MIN_KEY:
        raise ValidationError(f"{arg}: a signing key of {len(key)} bytes; use at least {MIN_KEY} random bytes",
                              arg=arg)
    return key


def read_key(path) -> bytes:
    """The key held in a file: all its bytes, from a regular file of at most 4 KB."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_KEY_FILE:
            raise ValidationError(f"key file {path}: not a regular file of at most {MAX_KEY_FILE} bytes", arg=str(path))
        with open(path, "rb") as source:
            data = source.read(MAX_KEY_FILE + 1)
    except OSError as exc:
        raise ValidationError(f"key file {path}: cannot be read ({exc.strerror or exc})", arg=str(path)) from None
    return check_key(data, f"key file {path}")


def resolve(key) -> bytes | None:
    """``key`` checked, else the NVDNN_PLAN_KEY_FILE key, else None (no signature involved)."""
    if key is not None:
        return check_key(key)
    path = config.get("NVDNN_PLAN_KEY_FILE")
    return read_key(path) if path else None


def trailer(body: bytes, key: bytes) -> bytes:
    return MAGIC + hmac.new(key, body, hashlib.sha256).digest()


def verify(body: bytes, signature: bytes | None, key: bytes) -> None:
    """Raise PlanFormatError('signature') unless ``signature`` is this key's trailer of ``body``."""
    if signature is None:
        raise PlanFormatError("the blob is not signed, and a signing key was given (key= or NVDNN_PLAN_KEY_FILE); "
                              "sign it with `nvdnn plan sign`", field="signature")
    if not hmac.compare_digest(signature, trailer(body, key)):
        raise PlanFormatError("does not match the key: the blob was changed after signing, or signed with "
                              "another key", field="signature")
