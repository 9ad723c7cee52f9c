"""Every NVDNN_* environment setting, in one table, read when used (never cached)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


def _flag(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _text(text: str) -> str | None:
    return text or None


_LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(text: str) -> str:
    level = text.strip().lower() or "warning"
    if level not in _LOG_LEVELS:
        raise ValueError(f"NVDNN_LOG_LEVEL={text!r}: use one of {', '.join(_LOG_LEVELS)}")
    return level


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], object]
    default: str
    doc: str


SETTINGS = {s.name: s for s in (
    Setting("NVDNN_CACHE_DIR", _text, "",
            "kernel cache folder (default: the platform's user cache dir, e.g. ~/.cache/nvdnn)"),
    Setting("NVDNN_NO_COMPILE", _flag, "0",
            "1: a kernel-cache miss raises CacheMissError instead of compiling (proves a pre-warm)"),
    Setting("NVDNN_DUMP_SOURCE", _text, "",
            "folder to write every rendered kernel source to (sources of failed compiles always go "
            "to a temp folder)"),
    Setting("NVDNN_RECORD", _text, "",
            "file to append every kernel spec this process needs, one JSON line each "
            "(replay with `nvdnn warm --spec-file FILE`)"),
    Setting("NVDNN_LOG_LEVEL", _log_level, "warning", "debug | info | warning | error"),
    Setting("NVDNN_PLAN_KEY_FILE", _text, "",
            "file holding a plan-blob signing key (32+ random bytes): Graph.serialize signs with it, and "
            "Graph.deserialize refuses any blob not signed with it"),
    Setting("NVDNN_UNMEASURED", _flag, "0",
            "1: choose kernel variants whose speed (or correctness) is not yet established on a GPU "
            "(README lists them); 0: they are never chosen"),
    Setting("NVDNN_CUDA_INCLUDE", _text, "",
            "folder holding cuda_fp16.h and friends (default: the nvidia-cuda-runtime package, "
            "then $CUDA_PATH/include)"),
)}


def get(name: str):
    """The parsed value of one setting, read from the environment now."""
    setting = SETTINGS[name]
    return setting.parse(os.environ.get(name, setting.default))


def configure_logging() -> None:
    """Apply NVDNN_LOG_LEVEL to the "nvdnn" loggers; when it is set, also print to stderr."""
    import logging
    import warnings
    try:
        level = get("NVDNN_LOG_LEVEL")
    except ValueError as exc:  # a typo in the environment must not break `import nvdnn`
        warnings.warn(f"nvdnn: {exc}; using 'warning'", stacklevel=3)
        level = "warning"
    logger = logging.getLogger("nvdnn")
    logger.setLevel(level.upper())
    if os.environ.get("NVDNN_LOG_LEVEL") and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("nvdnn %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def describe() -> list[dict]:
    """Every setting with its current raw value, for `nvdnn cache info` and the docs."""
    return [{"name": s.name, "value": os.environ.get(s.name, ""), "default": s.default, "doc": s.doc}
            for s in SETTINGS.values()]
