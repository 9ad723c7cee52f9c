"""The plan blob header's schema: every field's type, range and length, checked before anything
is built from it, so a re-sealed header can only fail as a PlanFormatError naming the field.

The schema is a table (HEADER) of small checkers; what it cannot say alone (the same number of
dims and strides, a launch index inside the kernel table) is checked after the table, still
before the graph is rebuilt. Kernel keys and digests must be 64 lowercase hex characters (KEY). Bounds are generous for real plans and small
enough that nothing downstream overflows or runs long on them.
"""
from __future__ import annotations

import math
import re

from .cache import KEY_PATTERN
from .errors import PlanFormatError

KEY = KEY_PATTERN   # a sha256 hexdigest, as the cache checks its keys: kernel keys and image digests
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ARCH = re.compile(r"sm_[1-9][0-9]*[af]?\Z")
MAX_RANK = 32                            # far above any kernel's (pointwise and reductions take 8)
MAX_DIM = 1 << 40                        # one dim; a tensor holds at most MAX_ELEMENTS
MAX_ELEMENTS = 1 << 48
MAX_STRIDE = 1 << 48
MAX_ITEMS = 1 << 16                      # tensors, nodes, groups, kernels of one plan (whole models)
MAX_CUBIN = 256 << 20
MAX_WORKSPACE = 1 << 48
_MAX_TEXT = 1024
_MAX_URI = 1 << 16                       # a uri grows with a fused chain's steps
_MAX_NUMBER = 1 << 53                    # ints exact as float64; params and attrs are scalars


def fail(field: str, message: str):
    raise PlanFormatError(message, field=field)


# -- checkers: each takes (value, field name) and raises PlanFormatError naming the field --------

def text(max_len: int = _MAX_TEXT, pattern: re.Pattern | None = None, what: str = "a string"):
    def check(value, field):
        if not isinstance(value, str) or not value or len(value) > max_len:
            fail(field, f"{value!r:.80} is not a non-empty string of at most {max_len} characters")
        if pattern is not None and not pattern.fullmatch(value):
            fail(field, f"{value!r:.80} is not {what}")
    return check


def integer(low: int, high: int):
    def check(value, field):
        if type(value) is not int or not low <= value <= high:
            fail(field, f"{value!r:.80} is not an integer in {low}..{high}")
    return check


def boolean(value, field):
    if type(value) is not bool:
        fail(field, f"{value!r:.80} is not true or false")


def number(value, field):
    """A float (inf and nan included: relu's clip is inf) or an int that floats hold exactly."""
    if type(value) is int and abs(value) <= _MAX_NUMBER or type(value) is float:
        return
    fail(field, f"{value!r:.80} is not a number (ints up to 2^53)")


def plain(depth: int = 2):
    """A JSON scalar, or a list of them nested at most ``depth`` deep (spec fields, attributes)."""
    def check(value, field):
        if isinstance(value, list):
            if depth == 0 or len(value) > MAX_ITEMS:
                fail(field, "nested too deep or too long")
            for i, item in enumerate(value):
                plain(depth - 1)(item, f"{field}[{i}]")
        elif isinstance(value, str):
            if len(value) > _MAX_TEXT:
                fail(field, f"a string of {len(value)} characters, more than {_MAX_TEXT}")
        elif value is not None and not isinstance(value, bool):
            number(value, field)
    return check


def seq(item, low: int, high: int):
    def check(value, field):
        if not isinstance(value, list) or not low <= len(value) <= high:
            fail(field, f"is not a list of {low}..{high} items")
        for i, element in enumerate(value):
            item(element, f"{field}[{i}]")
    return check


def pair(first, second):
    def check(value, field):
        if not isinstance(value, list) or len(value) != 2:
            fail(field, "is not a [name, value] pair")
        first(value[0], f"{field}[0]")
        second(value[1], f"{field}[1]")
    return check


def mapping(value_check, max_items: int = 64):
    """A JSON object with identifier keys (a spec's fields)."""
    def check(value, field):
        if not isinstance(value, dict) or len(value) > max_items:
            fail(field, f"is not an object of at most {max_items} fields")
        for name, item in value.items():
            text(64, _IDENT, "an identifier")(name, f"{field}.<key>")
            value_check(item, f"{field}.{name}")
    return check


def obj(fields: dict, exact: bool = True):
    """A JSON object with these fields (``exact``: and no others)."""
    def check(value, field):
        if not isinstance(value, dict):
            fail(field, f"{type(value).__name__} where an object is expected")
        for name, item in fields.items():
            where = f"{field}.{name}" if field else name
            if name not in value:
                fail(where, "missing")
            item(value[name], where)
        extra = sorted(set(value) - set(fields)) if exact else []
        if extra:
            fail(f"{field}.{extra[0]}" if field else str(extra[0])[:64], "is not a field of this format")
    return check


UID = integer(0, (1 << 31) - 1)
NAME = text()
DTYPE = text(32, _IDENT, "a data type name")
ALIGNMENT = integer(1, 16)
OUTPUT = obj({"uid": UID, "name": NAME, "data_type": DTYPE, "virtual": boolean, "alignment": ALIGNMENT})
TENSOR = obj({"uid": UID, "name": NAME, "dims": seq(integer(1, MAX_DIM), 1, MAX_RANK),
              "strides": seq(integer(-MAX_STRIDE, MAX_STRIDE), 1, MAX_RANK), "data_type": DTYPE,
              "virtual": boolean, "alignment": ALIGNMENT})
NODE = obj({"name": NAME, "op": text(64, _IDENT, "an op name"), "inputs": seq(UID, 0, 16),
            "params": seq(number, 0, 16), "roles": seq(text(64, _IDENT, "a role name"), 0, 16),
            "attrs": seq(pair(text(64, _IDENT, "an attribute name"), plain(2)), 0, 32),
            "outputs": seq(OUTPUT, 1, 16)})
GRAPH = obj({"name": NAME, "io_data_type": DTYPE, "intermediate_data_type": DTYPE, "compute_data_type": DTYPE,
             "tensors": seq(TENSOR, 1, MAX_ITEMS), "nodes": seq(NODE, 1, MAX_ITEMS)})
SPEC = obj({"family": text(64, _IDENT, "a kernel family name"), "fields": mapping(plain(2))})
GROUP = obj({"spec": SPEC, "launches": seq(integer(0, MAX_ITEMS - 1), 1, 16)})
KERNEL = obj({"key": text(64, KEY, "64 lowercase hex characters"), "uri": text(_MAX_URI),
              "entry": text(256, _IDENT, "a C identifier"), "arch": text(16, _ARCH, "an arch name such as sm_90"),
              "size": integer(1, MAX_CUBIN), "sha256": text(64, KEY, "64 lowercase hex characters")})
SIZES = seq(obj({"size": integer(1, MAX_CUBIN)}, exact=False), 1, MAX_ITEMS)
HEADER = obj({"nvdnn_version": text(64), "arch": text(16, _ARCH, "an arch name such as sm_90"), "nvrtc": text(32),
              "graph": GRAPH, "uids": seq(UID, 1, MAX_ITEMS), "workspace_size": integer(0, MAX_WORKSPACE),
              "groups": seq(GROUP, 1, MAX_ITEMS), "kernels": seq(KERNEL, 1, MAX_ITEMS)})


def check_sizes(header) -> None:
    """The cubin sizes alone: what the framing needs to find the cubins and the checksum."""
    if not isinstance(header, dict):
        fail("header", "not a JSON object")
    if "kernels" not in header:
        fail("kernels", "missing")
    SIZES(header["kernels"], "kernels")


def check_header(header: dict) -> None:
    """The whole header against the table, then the rules between fields."""
    HEADER(header, "")
    for i, t in enumerate(header["graph"]["tensors"]):
        where = f"graph.tensors[{i}]"
        if len(t["strides"]) != len(t["dims"]):
            fail(f"{where}.strides", f"{len(t['strides'])} strides for {len(t['dims'])} dims")
        if math.prod(t["dims"]) > MAX_ELEMENTS:
            fail(f"{where}.dims", f"{math.prod(t['dims'])} elements, more than 2^48")
    for i, node in enumerate(header["graph"]["nodes"]):
        if node["roles"] and len(node["roles"]) != len(node["inputs"]):
            fail(f"graph.nodes[{i}].roles", f"{len(node['roles'])} roles for {len(node['inputs'])} inputs")
    kernels = header["kernels"]
    for i, group in enumerate(header["groups"]):
        for j, index in enumerate(group["launches"]):
            if index >= len(kernels):
                fail(f"groups[{i}].launches[{j}]", f"kernel {index} of a table of {len(kernels)}")
