"""Typed errors. Each names what was wrong (``arg``) so callers can act on it."""
from __future__ import annotations


class NvdnnError(Exception):
    """Base of every error nvdnn raises on purpose."""

    def __init__(self, message: str, *, arg: str | None = None):
        super().__init__(message)
        self.arg = arg


class ValidationError(NvdnnError, ValueError):
    """An input breaks a rule: wrong shape, bad argument value, mismatched tensors."""


class DTypeError(ValidationError, TypeError):
    """An array or argument has a data type the operation does not take."""


class DeviceError(ValidationError):
    """Arrays live on the wrong device, or no usable GPU is present."""


class UnsupportedError(NvdnnError):
    """A valid request that no kernel can run here (arch, alignment, data type)."""


class CompileError(NvdnnError):
    """NVRTC rejected a rendered kernel. Carries the log, the spec uri and the source path."""

    def __init__(self, message: str, *, uri: str = "", log: str = "", source_path: str | None = None):
        detail = f"{message}\n  spec: {uri}\n  source: {source_path or '(not written; set NVDNN_DUMP_SOURCE)'}"
        if log:
            detail += "\n  NVRTC log:\n" + "\n".join("    " + line for line in log.strip().splitlines())
        super().__init__(detail)
        self.reason, self.uri, self.log, self.source_path = message, uri, log, source_path

    def with_source(self, source_path: str | None) -> "CompileError":
        return CompileError(self.reason, uri=self.uri, log=self.log, source_path=source_path)


class CacheMissError(NvdnnError):
    """NVDNN_NO_COMPILE is set and a kernel is not in the cache."""


class CacheError(NvdnnError):
    """A cache entry or bundle is malformed."""


class PlanFormatError(NvdnnError):
    """A plan blob is malformed, tampered with or built for another machine; ``field`` names what."""

    def __init__(self, message: str, *, field: str):
        super().__init__(f"{field}: {message}", arg=field)
        self.field = field


class NvdnnWarning(UserWarning):
    """Degraded but working: for example a cache folder that cannot be written."""
