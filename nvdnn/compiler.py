"""NVRTC: CUDA C source → cubin for an explicit arch, with no GPU needed.

Calls NVRTC through cuda-bindings (``cuda.bindings.nvrtc``) so the cubin comes
back at its real size (CuPy 14.2's ``getCUBIN`` drops the last byte). The CUDA
headers come from the nvidia-cuda-runtime package, NVDNN_CUDA_INCLUDE or
$CUDA_PATH/include.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import config
from .errors import CompileError, DeviceError, ValidationError

_ARCH = re.compile(r"sm_([1-9][0-9]*)([af]?)\Z")
# Arch-specific ('a') targets exist from sm_90, family ('f') targets from sm_100.
_SUFFIX_FROM = {"": 0, "a": 90, "f": 100}

# Options that change the machine code, in a fixed order: part of the cache key.
BASE_OPTIONS = ("-std=c++17", "-default-device", "--minimal", "-Xptxas=-v")


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    registers: int
    spill_bytes: int
    stack_bytes: int


@functools.lru_cache(maxsize=1)
def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


def _check(result, what: str):
    status = result[0]
    nvrtc = _nvrtc()
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {nvrtc.nvrtcGetErrorString(status)[1].decode()}")
    return result[1] if len(result) == 2 else result[1:]


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    return tuple(_check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def parse_arch(arch: str) -> str:
    """Validate an arch name such as ``sm_80``, ``sm_90`` or ``sm_90a``."""
    match = _ARCH.match(arch) if isinstance(arch, str) else None
    if match is None or int(match.group(1)) not in supported_archs() or (
            int(match.group(1)) < _SUFFIX_FROM[match.group(2)]):
        known = ", ".join(f"sm_{a}" for a in supported_archs())
        raise ValidationError(f"arch: {arch!r} is not an arch NVRTC {nvrtc_version()} can build for; "
                              f"use one of {known} (sm_90 and later also take an 'a' suffix, "
                              "sm_100 and later an 'f')", arg="arch")
    return arch


def arch_number(arch: str) -> int:
    return int(_ARCH.match(arch).group(1))


def device_arch(device_id: int | None = None) -> str:
    """The arch of a CUDA device (the current one by default)."""
    try:
        import cupy
        device = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
        return "sm_" + device.compute_capability
    except Exception as exc:  # CUDA driver missing, no device, bad id
        raise DeviceError(f"arch: no CUDA device to take the arch from ({exc}); pass arch='sm_90' "
                          "(or another) to build without a GPU", arg="arch") from exc


def resolve_arch(arch: str | None) -> str:
    return parse_arch(arch) if arch is not None else parse_arch(device_arch())


@functools.lru_cache(maxsize=1)
def include_dir() -> str:
    """The folder with cuda_fp16.h / cuda_bf16.h, or an error saying how to get one."""
    tried = []
    override = config.get("NVDNN_CUDA_INCLUDE")
    candidates = [override] if override else []
    try:
        from cuda import pathfinder
        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            candidates.append(found)
    except Exception as exc:  # pathfinder absent or failing: fall through to CUDA_PATH
        tried.append(f"cuda.pathfinder: {exc}")
    if os.environ.get("CUDA_PATH"):
        candidates.append(os.path.join(os.environ["CUDA_PATH"], "include"))
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "cuda_fp16.h")):
            return folder
        tried.append(folder)
    raise CompileError("CUDA headers (cuda_fp16.h) not found; install them with "
                       "`pip install 'nvidia-cuda-runtime==13.0.*'`, or set NVDNN_CUDA_INCLUDE or CUDA_PATH "
                       f"to a CUDA toolkit (tried: {'; '.join(tried) or 'nothing'})")


@functools.lru_cache(maxsize=1)
def headers_version() -> str:
    """CUDART_VERSION of the headers in use: they are compiled into every kernel, so keyed."""
    text = Path(include_dir(), "cuda_runtime_api.h").read_text(errors="replace")
    match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return match.group(1) if match else "unknown"


def _loaded_nvrtc_path() -> str | None:
    """The libnvrtc file this process loaded (Linux), so a later process can recognize it."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libnvrtc." in line and "builtins" not in line:
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return None


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
        return [st.st_size, st.st_mtime_ns]
    except OSError:
        return None


def toolchain() -> dict:
    """NVRTC and header versions, with the files they came from (loads NVRTC)."""
    version = nvrtc_version()
    files = {p: _stat(p) for p in (_loaded_nvrtc_path(), os.path.join(include_dir(), "cuda_runtime_api.h")) if p}
    return {"nvrtc": version, "headers": headers_version(), "files": files, "env": _header_env()}


def _header_env() -> dict:
    """The settings that steer which CUDA headers are picked."""
    return {name: os.environ.get(name, "") for name in ("NVDNN_CUDA_INCLUDE", "CUDA_PATH")}


def remembered_toolchain(record) -> dict | None:
    """``record`` (from an earlier ``toolchain()``) if its files and header settings are unchanged;
    checked without loading NVRTC. Anything malformed is simply not remembered."""
    if not (isinstance(record, dict) and isinstance(record.get("nvrtc"), str)
            and isinstance(record.get("headers"), str) and record.get("env") == _header_env()
            and isinstance(record.get("files"), dict) and len(record["files"]) == 2):
        return None
    for path, stat in record["files"].items():
        if not isinstance(stat, list) or _stat(path) != stat:
            return None
    return record


def options_for(arch: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Normalized options (no machine paths): what the cache key covers."""
    return (f"-arch={arch}",) + BASE_OPTIONS + tuple(extra)


_RESOURCE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_bytes": re.compile(r"(\d+) bytes spill stores"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
}


def _resource(log: str, name: str) -> int:
    return max((int(m) for m in _RESOURCE[name].findall(log)), default=0)


def compile_cubin(source: str, *, name: str, options: tuple[str, ...], uri: str = "",
                  source_path: str | None = None) -> CompileResult:
    """Compile one translation unit; raise CompileError with the log when NVRTC refuses it."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options] + [f"-I{include_dir()}".encode()]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        raw = bytearray(size)  # NVRTC writes into it: never an immutable (possibly shared) bytes object
        _check(nvrtc.nvrtcGetProgramLog(prog, raw), "nvrtcGetProgramLog")
        log = bytes(raw).rstrip(b"\0").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC {nvrtc_version()} could not compile {name}", uri=uri, log=log,
                               source_path=source_path)
        if re.search(r"\bwarning #", log):  # generated code must be clean: a warning is a template bug
            raise CompileError(f"NVRTC {nvrtc_version()} warned about generated code in {name}", uri=uri,
                               log=log, source_path=source_path)
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        image = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        cubin = bytes(image)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompileResult(cubin, log, _resource(log, "registers"), _resource(log, "spill_bytes"),
                         _resource(log, "stack_bytes"))
