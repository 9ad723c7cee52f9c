"""Random graphs over every op of the tables (pointwise SCHEMAS and ANCHORS) with random
attributes, dims, strides and data types: whatever the input, building, validating, planning
(deviceless, arch sm_90) and running the NumPy backend either works or raises an nvdnn error.
No compile: this is validation only, 10,000+ graphs in seconds."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import nvdnn
from nvdnn import dtypes
from nvdnn.errors import NvdnnError, ValidationError
from nvdnn.graph.anchors import ANCHORS
from nvdnn.graph.ops import SCHEMAS

N_GRAPHS = 10_000
OPS = sorted(set(SCHEMAS) | set(ANCHORS))
DATA_TYPES = ("float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "int32", "int64")
# values an attribute may be given: right and wrong types, ranges, NaN, inf, huge, empty, nested
JUNK = (None, "x", "1", "no", "col", "row", "tf32", "fast", 0, 1, 2, 3, -1, -2, 0.0, 0.5, 1.0, 2.0, -1.0, 1e-5,
        math.nan, math.inf, -math.inf, True, False, np.int64(2), np.float32(1.5), np.bool_(True), (), (1,), (0, 1),
        (2, 2), (1, 2, 3), [0, -1], (0.0,), ("a",), ((1,),), 2 ** 31, 2 ** 40, 2 ** 63, -2 ** 63, {"a": 1}, b"x")
UNARY = tuple(name for name, schema in SCHEMAS.items() if schema.arity == 1)
HUGE = (2 ** 30, 2 ** 31, 2 ** 40, 2 ** 62, 2 ** 63)

_SETTINGS = dict(max_examples=N_GRAPHS, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
COUNTS = {"graphs": 0, "built": 0, "executed": 0, "refused": 0}


def _dims(data, like=None):
    """Small dims mostly; now and then a huge one, or dims related to ``like`` (its channels,
    trailing dims, lead dims, or the same)."""
    if like is not None and data.draw(st.booleans()):
        pick = data.draw(st.sampled_from(["same", "channel", "tail", "lead", "scalar"]))
        if pick == "same" or len(like) < 2:
            return list(like)
        return {"channel": [like[1]], "tail": list(like[1:]), "lead": list(like[:-1]), "scalar": [1]}[pick]
    rank = data.draw(st.integers(1, 5))
    if data.draw(st.integers(0, 19)) == 0:
        return [data.draw(st.sampled_from(HUGE + (1, 3))) for _ in range(rank)]
    return [data.draw(st.sampled_from((1, 1, 2, 3, 4, 8))) for _ in range(rank)]


def _tensor(data, g, name, like=None):
    dims = _dims(data, like)
    strides = None
    if data.draw(st.integers(0, 9)) == 0:  # a transposed or a broken layout
        strides = data.draw(st.sampled_from([
            list(reversed(nvdnn.graph.tensor.contiguous_strides(dims))), [1] * len(dims), [0] * len(dims),
            [-1] * len(dims), [2 ** 62] * len(dims)]))
    data_type = data.draw(st.sampled_from((None,) * 6 + DATA_TYPES))
    return g.tensor(dims=dims, strides=strides, data_type=data_type, name=name)


def _value(data, default):
    """The default half the time, else one of JUNK."""
    return data.draw(st.sampled_from((default,) * len(JUNK) + JUNK))


def _pointwise_node(data, g, op):
    schema = SCHEMAS[op]
    x = _tensor(data, g, "x")
    if schema.arity == 2:
        other = data.draw(st.sampled_from(["tensor", "scalar", "junk"]))
        if other == "tensor":
            return g._op(op, (x, _tensor(data, g, "b", like=x.dims)), ())
        return g._op(op, (x,), (_value(data, 1.0) if other == "junk" else 2.0,))
    params = tuple(_value(data, default) for _, default, *_ in schema.params)
    if data.draw(st.integers(0, 9)) == 0:
        params = params + (1.0,)  # one too many
    return g._op(op, (x,), params)


def _anchor_node(data, g, op):
    schema = ANCHORS[op]
    inputs, first = {}, None
    for role in schema.roles:
        if role in schema.required or data.draw(st.booleans()):
            inputs[role] = _tensor(data, g, role, like=None if first is None else first.dims)
            first = first or inputs[role]
    attrs = {name: _value(data, default) for name, default, *_ in schema.attrs}
    if data.draw(st.integers(0, 19)) == 0:
        attrs["no_such_attribute"] = 1
    return getattr(g, op)(**inputs, **attrs)


def _arrays(g):
    """A NumPy array per io tensor of its data type (fp8: uint8 bytes), or None if too large."""
    pack = {}
    for t in g._io:
        if math.prod(t.dims) > 4096:
            return None
        kind = dtypes.BY_NAME[t.data_type]
        host = np.uint8 if kind.storage_name == "numpy.uint8" else kind.np
        pack[t.name] = np.ones(t.dims, host) if t.producer is None else np.empty(t.dims, host)
    return pack


def _one_graph(data):
    op = data.draw(st.sampled_from(OPS))
    g = nvdnn.Graph(io_data_type=data.draw(st.sampled_from(DATA_TYPES[:3])), arch="sm_90", name="fuzz")
    out = _pointwise_node(data, g, op) if op in SCHEMAS else _anchor_node(data, g, op)
    then = data.draw(st.sampled_from((None,) * 3 + UNARY))
    if then is not None and not isinstance(out, tuple):  # a unary op after it: fusion's epilogue
        out = g._op(then, (out,), tuple(default for _, default, *_ in SCHEMAS[then].params))
    for t in out if isinstance(out, tuple) else (out,):
        t.set_output(True)
    g.validate().build_operation_graph().create_execution_plans().check_support()
    g.get_workspace_size()
    COUNTS["built"] += 1
    pack = _arrays(g)
    if pack is not None:
        g.execute(pack, backend="numpy")
        COUNTS["executed"] += 1


@settings(**_SETTINGS)
@given(data=st.data())
def test_random_graphs_over_every_op_raise_only_nvdnn_errors(data):
    COUNTS["graphs"] += 1
    try:
        _one_graph(data)
    except NvdnnError:
        COUNTS["refused"] += 1


def test_the_random_graphs_were_enough_and_covered_every_outcome():
    print(f"random graphs: {COUNTS}")
    assert COUNTS["graphs"] >= N_GRAPHS
    assert COUNTS["built"] > N_GRAPHS // 20 and COUNTS["executed"] > N_GRAPHS // 50 and COUNTS["refused"] > 0


# -- the cases the random graphs first found, each named by node, attribute and rule -----------------

def _x(g, dims=(2, 3, 4, 4)):
    return g.tensor(dims=list(dims), name="x")


CASES = {
    "normalized_ndim as a string": (lambda g: g.layer_norm(_x(g), normalized_ndim="1", name="n"),
                                    ["node 'n' (layer_norm)", "normalized_ndim='1'", "an int >= 1"]),
    "axes as a float": (lambda g: g.sum(_x(g), axes=0.0, name="n"), ["node 'n' (sum)", "axes=0.0", "ints"]),
    "stride as a float": (lambda g: g.max_pool2d(_x(g), stride=2.0, name="n"), ["stride=2.0", "an int >= 1"]),
    "eps as a string": (lambda g: g.batch_norm_training(_x(g), eps="x", name="n"), ["eps='x'", "finite real"]),
    "negative eps": (lambda g: g.instance_norm(_x(g), eps=-1.0, name="n"), ["eps=-1.0", ">= 0"]),
    "NaN eps": (lambda g: g.rms_norm(_x(g), eps=math.nan, name="n"), ["eps=nan", "finite real"]),
    "keepdims as a string": (lambda g: g.mean(_x(g), keepdims="no", name="n"), ["keepdims='no'", "True or False"]),
    "softplus beta 0": (lambda g: g.softplus(_x(g), beta=0.0, name="n"), ["node 'n' (softplus)", "beta=0.0",
                                                                           "other than 0"]),
    "relu clip NaN": (lambda g: g.relu(_x(g), clip=math.nan, name="n"), ["clip=nan", "not NaN"]),
    "causal as an int": (lambda g: g.softmax(_x(g), causal=1, name="n"), ["causal=1", "True or False"]),
    "batch_norm_backward on 1-D": (
        lambda g: g.batch_norm_backward(*(g.tensor(dims=[4], name=n) for n in ("dy", "x", "m", "s", "w")),
                                        name="n"), ["node 'n' (batch_norm_backward)", "'x'", "rank 2 or more"]),
    "gamma of the wrong dims": (lambda g: g.layer_norm(_x(g), g.tensor(dims=[3], name="w"), name="n"),
                                ["'gamma'", "[4]"]),
    "groups not dividing C": (lambda g: g.group_norm(_x(g), groups=2, name="n"), ["3 channels", "groups=2"]),
    "softmax axis out of range": (lambda g: g.softmax(_x(g), axis=4, name="n"), ["axis=4"]),
    "huge dims": (lambda g: g.tensor(dims=[2 ** 40, 2 ** 30], name="big"),
                  ["tensor 'big'", "element count", "2^62", "MAX_EXTENT"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_attributes_and_dims_are_named(case):
    build, needles = CASES[case]
    with pytest.raises(ValidationError) as caught:
        build(nvdnn.Graph(arch="sm_90"))
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))
