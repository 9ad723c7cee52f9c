"""The graph API on the CPU: random pointwise graphs (valid ones against a direct float64 NumPy
computation of the same expression, invalid ones that must fail with a ValidationError naming the
culprit), fusion into register chains, workspace layout, variant packs, step ordering, plan indices.

Nothing here needs a GPU: planning is deviceless with ``arch="sm_90"``, ``execute`` uses the NumPy
backend, and the few ``build()`` calls compile with NVRTC only.
"""
from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

import nvdnn
from nvdnn.errors import DTypeError, ValidationError
from nvdnn.graph.execution import WORKSPACE_ALIGN
from nvdnn.graph.ops import SCHEMAS
from nvdnn.kernels import pointwise


ARCH = "sm_90"
# Example counts: together well over 1500 random graphs (valid and invalid), in a few seconds.
N_VALID = 700
N_INVALID_PER_KIND = 35      # x 26 kinds of defect
N_BUILD = 5

_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])
STEPS = ("validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans")


# -- the direct float64 formulas the graphs are checked against -------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


UNARY = {
    "identity": lambda x: x,
    "neg": lambda x: -x,
    "abs": np.abs,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "relu": lambda x, slope=0.0, clip=math.inf: np.minimum(np.where(x > 0, x, slope * x), clip),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x * _sigmoid(x),
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "elu": lambda x, alpha=1.0: np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0))),
    "softplus": lambda x, beta=1.0, threshold=20.0: np.where(
        beta * x > threshold, x, np.log1p(np.exp(beta * np.minimum(x, threshold / beta))) / beta),
    "scale": lambda x, alpha=1.0: alpha * x,
}
BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power,
}
UNARY_METHODS = tuple(UNARY)   # "gelu_tanh" is g.gelu(x, approximate="tanh")
OP_CHOICES = UNARY_METHODS + tuple(BINARY)


# -- a random graph builder that computes every value alongside -------------------------------------

class Builder:
    """Builds graph nodes and, next to each, its float64 value by the formulas above. Domain guards
    (extra graph nodes, computed the same way) keep log/sqrt/rsqrt/pow/div/exp finite."""

    def __init__(self, g, data):
        self.g, self.data = g, data
        self.inputs: list = []          # (tensor, array given to execute)
        self.pool: list = []            # (tensor, float64 value): candidates for operands
        self.results: list = []         # op results in creation order
        self.values: dict[int, np.ndarray] = {}
        self.node_names = 0

    def draw(self, strategy):
        return self.data.draw(strategy)

    def input(self, dims, name, array, uid=None):
        t = self.g.tensor(dims=dims, name=name, uid=uid)
        array = array.astype(nvdnn.dtypes.BY_NAME[t.data_type].np)  # execute takes the tensor's own type
        self.inputs.append((t, array))
        self.values[t.uid] = array.astype(np.float64)
        self.pool.append(t)
        return t

    def _record(self, t, value):
        value = np.asarray(value, dtype=np.float64)
        assert value.shape == tuple(t.dims), (t, value.shape)
        self.values[t.uid] = value
        return t

    def _name(self):
        """Sometimes an explicit node name (unique, so its '<name>.out' is too)."""
        if self.draw(st.integers(0, 3)) == 0:
            self.node_names += 1
            return f"node_{self.node_names}"
        return None

    # guards: graph nodes that move a value into a safe domain
    def _bounded(self, t, limit):
        if np.max(np.abs(self.values[t.uid])) > limit:
            t = self._record(self.g.tanh(t), np.tanh(self.values[t.uid]))
        return t

    def _positive(self, t):
        if np.min(self.values[t.uid]) < 0.25:
            a = self._record(self.g.abs(t), np.abs(self.values[t.uid]))
            t = self._record(self.g.add(a, 0.5), self.values[a.uid] + 0.5)
        return t

    def _away_from_zero(self, t):
        if np.min(np.abs(self.values[t.uid])) < 0.25:
            a = self._record(self.g.abs(t), np.abs(self.values[t.uid]))
            t = self._record(self.g.add(a, 0.5), self.values[a.uid] + 0.5)
        return t

    def pick(self):
        if self.draw(st.booleans()):
            return self.pool[-1]
        return self.pool[self.draw(st.integers(0, len(self.pool) - 1))]

    def random_op(self):
        op = self.draw(st.sampled_from(OP_CHOICES))
        x = self._bounded(self.pick(), 1e3)
        if op in BINARY:
            return self._binary(op, x)
        return self._unary(op, x)

    def _unary(self, op, x):
        g, draw, name = self.g, self.draw, self._name()
        if op == "exp":
            x = self._bounded(x, 8.0)
        if op in ("log", "sqrt", "rsqrt"):
            x = self._positive(x)
        v = self.values[x.uid]
        with np.errstate(over="ignore"):
            if op == "relu":
                slope = draw(st.sampled_from([0.0, 0.01, 0.2, 0.5]))
                clip = draw(st.sampled_from([None, math.inf, 0.5, 1.0, 6.0]))
                form = draw(st.integers(0, 3))
                if form == 0:
                    out = g.relu(x, name=name)
                    slope, clip = 0.0, None
                elif form == 1:
                    out = g.relu(x, slope, name=name)
                    clip = None
                elif form == 2 and clip is not None:
                    out = g.relu(x, slope, clip, name=name)
                else:
                    out = g.relu(x, negative_slope=slope, clip=clip, name=name)
                expected = UNARY["relu"](v, slope, math.inf if clip is None else clip)
            elif op in ("gelu", "gelu_tanh"):
                approximate = "tanh" if op == "gelu_tanh" else draw(st.sampled_from([None, "none"]))
                out = g.gelu(x, name=name) if approximate is None else g.gelu(x, approximate=approximate,
                                                                               name=name)
                expected = UNARY[op](v)
            elif op in ("elu", "scale"):
                alpha = draw(st.floats(-2.0, 2.0) if op == "scale" else st.floats(0.1, 2.0))
                if draw(st.booleans()):
                    out = getattr(g, op)(x, alpha, name=name)
                else:
                    out = getattr(g, op)(x, alpha=alpha, name=name)
                expected = UNARY[op](v, alpha)
            elif op == "softplus":
                beta = draw(st.sampled_from([None, 0.5, 1.0, 2.5]))
                threshold = draw(st.sampled_from([5.0, 20.0, 30.0]))
                if beta is None:
                    out, beta, threshold = g.softplus(x, name=name), 1.0, 20.0
                else:
                    out = g.softplus(x, beta=beta, threshold=threshold, name=name)
                expected = UNARY[op](v, beta, threshold)
            else:
                out = getattr(g, op)(x, name=name)
                expected = UNARY[op](v)
        return self._record(out, expected)

    def _scalar(self, op):
        if op == "power":
            value = self.draw(st.sampled_from([2, 0.5, -1.0, 1.5, -0.5, 3]))
        else:
            value = self.draw(st.floats(0.25, 3.0)) * self.draw(st.sampled_from([1, -1]))
        kind = self.draw(st.integers(0, 3))
        if kind == 0:
            return np.float32(value)
        if kind == 1:
            return round(value) or 1     # a Python int
        return value

    def _binary(self, op, a):
        g, draw, name = self.g, self.draw, self._name()
        scalar = draw(st.booleans())
        if scalar:
            s = self._scalar(op)
            if op == "power":
                a = self._bounded(a, 10.0)
                a = self._positive(a)
            out = getattr(g, op)(a, s, name=name)
            with np.errstate(over="ignore"):
                return self._record(out, BINARY[op](self.values[a.uid], float(s)))
        b = self._bounded(self.pick(), 1e3)
        if draw(st.booleans()):
            a, b = b, a
        if op == "div":
            b = self._away_from_zero(b)
        if op == "power":
            a = self._positive(self._bounded(a, 10.0))
            b = self._bounded(b, 3.0)
        out = getattr(g, op)(a, b, name=name)
        return self._record(out, BINARY[op](self.values[a.uid], self.values[b.uid]))


def random_shape(data, min_rank=1):
    rank = data.draw(st.integers(min_rank, 4))
    return [data.draw(st.integers(1, 9)) for _ in range(rank)]


def broadcast_dims(data, shape):
    """``shape`` with some dims set to 1 (cuDNN: same rank, 1 in broadcast dims)."""
    return [1 if data.draw(st.integers(0, 3)) == 0 else s for s in shape]


def random_graph(data, n_ops=None, mark_outputs=True, name="graph", io=None):
    """A random valid pointwise graph; returns its Builder."""
    io = io or data.draw(st.sampled_from(["float32", "float32", "float16", "bfloat16"]))
    g = nvdnn.Graph(io_data_type=io, arch=ARCH, name=name)
    b = Builder(g, data)
    shape = random_shape(data)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    positive = data.draw(st.booleans())
    n_inputs = data.draw(st.integers(1, 4))
    explicit_uids = data.draw(st.booleans())
    for i in range(n_inputs):
        dims = shape if i == 0 else broadcast_dims(data, shape)
        low, high = (0.25, 4.0) if positive else (-3.0, 3.0)
        array = rng.uniform(low, high, size=dims)
        b.input(dims, f"in{i}", array, uid=100 + 7 * i if explicit_uids else None)
    for _ in range(data.draw(st.integers(1, 7)) if n_ops is None else n_ops):
        b.results.append(b.random_op())
        b.pool.append(b.results[-1])
    if mark_outputs and b.results:
        produced = [t for t in b.g.tensors.values() if t.producer is not None]
        marked = {b.results[-1].uid} | {t.uid for t in produced if data.draw(st.integers(0, 3)) == 0}
        for k, uid in enumerate(sorted(marked)):
            t = g.tensors[uid].set_output(True)
            if data.draw(st.integers(0, 4)) == 0:
                t.set_name(f"out{k}")
    return b


def _misordered_groups(g) -> list[str]:
    """Groups that read a tensor some later group (or none) writes."""
    written, bad = set(), []
    for gr in g.groups:
        bad += [f"{gr.describe()} reads {t.name}" for t in gr.inputs
                if t.producer is not None and t.uid not in written]
        written.add(gr.output.uid)
    return bad


def _minimal_misordered_graph():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[4, 8], name="x")
    y = g.tensor(dims=[4, 8], name="y")
    a = g.exp(x)                 # head of group 0
    b = g.tanh(y)                # head of group 1
    g.add(a, b).set_output(True)  # joins group 0's chain, and reads group 1's output
    return g.validate().build_operation_graph()


@functools.lru_cache(maxsize=1)
def group_order_bug() -> bool:
    """Whether fusion still emits groups out of dependency order (see the xfail test below). While it
    does, the random-graph property records such graphs instead of failing on them; once fixed, the
    property enforces the order on every random graph."""
    return bool(_misordered_groups(_minimal_misordered_graph()))


def consumers_of(g):
    consumers = {uid: [] for uid in g.tensors}
    for node in g.nodes:
        for t in node.inputs:
            consumers[t.uid].append(node)
    return consumers


def check_fusion(g):
    """Independent checks of fusion.partition's result against the chain rule."""
    groups = g.groups
    assert sum(len(gr.nodes) for gr in groups) == len(g.nodes)
    flat = [n for gr in groups for n in gr.nodes]
    assert sorted(map(id, flat)) == sorted(map(id, g.nodes))        # each node exactly once
    consumers = consumers_of(g)
    group_of = {id(n): i for i, gr in enumerate(groups) for n in gr.nodes}
    for node in g.nodes:
        fusable = [t for t in node.inputs if t.producer is not None and t.is_virtual
                   and len(consumers[t.uid]) == 1 and t.dims == node.output.dims
                   and node.inputs.count(t) == 1]
        gr = groups[group_of[id(node)]]
        position = gr.nodes.index(node)
        if fusable:
            assert position > 0 and gr.nodes[position - 1] is fusable[0].producer, node
        else:
            assert position == 0, node
    seen_outputs, misordered = set(), False
    for gr in groups:
        assert len(gr.steps) == len(gr.nodes)
        for (kernel_op, rhs), node in zip(gr.steps, gr.nodes):
            schema = SCHEMAS[node.op]
            if pointwise.OPS[schema.kernel_op].arity == 1:
                assert (kernel_op, rhs) == (schema.kernel_op, "")
            elif len(node.inputs) == 1:      # scalar operand (or scale's alpha)
                assert rhs == "p" and kernel_op in (schema.kernel_op, pointwise.REVERSED[schema.kernel_op])
            else:
                assert rhs.startswith("x") and kernel_op in (schema.kernel_op,
                                                             pointwise.REVERSED[schema.kernel_op])
        for t in gr.inputs:   # topological: a group reads only what earlier groups wrote
            if t.producer is not None and t.uid not in seen_outputs:
                misordered = True
                assert group_order_bug(), f"{gr.describe()} reads {t.name} before its group runs"
        seen_outputs.add(gr.output.uid)
        # interior chain values never leave registers
        for node in gr.nodes[:-1]:
            assert node.output.is_virtual and len(consumers[node.output.uid]) == 1
    # every shared (or reshaped) virtual intermediate is a group output: materialized
    outputs = {gr.output.uid for gr in groups}
    for t in g.tensors.values():
        if t.producer is not None and t.is_virtual and consumers[t.uid]:
            if len(consumers[t.uid]) > 1 or consumers[t.uid][0].output.dims != t.dims:
                assert t.uid in outputs, t
    itemsize = nvdnn.dtypes.BY_NAME[g.intermediate_data_type].itemsize
    expected_ws = sum(-(-math.prod(gr.output.dims) * itemsize // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
                      for gr in groups if gr.output.is_virtual)
    assert g.get_workspace_size() == expected_ws
    return misordered


def check_plans(g):
    assert len(g.candidates) == len(g.groups) and len(g.chosen) == len(g.groups)
    for gr, specs, chosen in zip(g.groups, g.candidates, g.chosen):
        assert specs, gr.describe()
        assert 0 <= chosen < len(specs)
        assert len(set(specs)) == len(specs)
        for spec in specs:
            assert spec.steps == tuple(gr.steps)
            assert len(spec.inputs) == len(gr.inputs)
            assert spec.n_params == len(gr.params)
            assert spec.output == gr.output.data_type
            assert pointwise.unsupported_reason(spec, ARCH) is None
    assert g.get_execution_plan_count() == max(len(c) for c in g.candidates)


def pack_for(b, outputs, out_dtypes, data):
    """A variant pack keyed by tensors, uids or names at random; output arrays poisoned with NaN."""
    def key(t):
        return data.draw(st.sampled_from([t, t.uid, t.name]))
    pack = {key(t): array for t, array in b.inputs}
    arrays = {}
    for t, dtype in zip(outputs, out_dtypes):
        arrays[t.uid] = np.full(t.dims, np.nan, dtype=dtype)
        pack[key(t)] = arrays[t.uid]
    return pack, arrays


# -- valid random graphs ----------------------------------------------------------------------------

@settings(max_examples=N_VALID, **_SETTINGS)
@given(data=st.data())
def test_random_valid_graphs_match_direct_numpy(data):
    b = random_graph(data)
    g = b.g
    assert g.validate() is g and g._state == "validated"
    assert g.build_operation_graph() is g and g._state == "fused"
    wide = any(len(gr.inputs) > 8 for gr in g.groups)
    event(f"kernel groups: {len(g.groups)}")
    assume(not wide)                                    # > 8 inputs: see test_chain_of_nine_inputs_plans
    if check_fusion(g):
        event("known bug: groups out of dependency order")

    outputs = [t for t in g.tensors.values() if t.producer is not None and not t.is_virtual]
    assert outputs
    out_dtypes = [nvdnn.dtypes.BY_NAME[t.data_type].np for t in outputs]
    pack, arrays = pack_for(b, outputs, out_dtypes, data)
    before = [a.copy() for _, a in b.inputs]
    assert g.execute(pack, backend="numpy") is None
    for (_, a), copy in zip(b.inputs, before):
        np.testing.assert_array_equal(a, copy)          # inputs untouched
    for t in outputs:
        expected = b.values[t.uid]
        assert np.all(np.isfinite(expected)), t
        got = arrays[t.uid]  # in the output's type: the float64 value rounded, give or take an ulp
        rounded = expected.astype(got.dtype).astype(np.float64)
        np.testing.assert_allclose(got.astype(np.float64), rounded, rtol=2 * float(ml_dtypes.finfo(got.dtype).eps),
                                   atol=1e-6, err_msg=t.name)

    assert g.create_execution_plans() is g and g._state == "planned"
    assert g.check_support() is g and g._state == "supported"
    check_plans(g)
    explained = g.explain()
    assert f"{len(g.nodes)} ops in {len(g.groups)} kernels" in explained
    for index, specs in enumerate(g.candidates):
        assert f"* [{g.chosen[index]}] {specs[g.chosen[index]].uri}" in explained


@settings(max_examples=N_BUILD, **_SETTINGS)
@given(data=st.data())
def test_random_graphs_build_deviceless(data):
    b = random_graph(data, n_ops=data.draw(st.integers(1, 4)))
    g = b.g
    assert g.build() is g and g._state == "built"
    chosen = [specs[c] for specs, c in zip(g.candidates, g.chosen)]
    for spec in chosen:
        binary = g.binaries[spec]
        assert binary.uri == spec.uri and binary.arch == ARCH and binary.entry == spec.entry
        assert binary.cubin.startswith(b"\x7fELF")
    again = nvdnn.Graph.deserialize(g.serialize())
    assert again.explain() == g.explain()


# -- invalid random graphs --------------------------------------------------------------------------

class Run:
    """Tracks the stage a scenario is in, and what the one failing call must raise."""

    def __init__(self):
        self.stage = "setup"
        self.expected = None

    def expect(self, stage, needles, cls=ValidationError, arg=None):
        self.expected = (stage, [str(n) for n in needles], cls, arg)

    def at(self, stage, fn, *args, **kwargs):
        self.stage = stage
        return fn(*args, **kwargs)


def _base(data, run, mark=True, n_ops=None):
    name = data.draw(st.sampled_from(["graph", "g_main", "attention-block"]))
    b = random_graph(data, n_ops=data.draw(st.integers(1, 4)) if n_ops is None else n_ops,
                     mark_outputs=mark, name=name)
    run.stage = "setup"
    return b


def _node_name(data, op, g):
    name = data.draw(st.sampled_from([None, "culprit"]))
    return name, name or f"{op}{len(g.nodes)}"      # the default node name


def _call_op(g, op, inputs, name):
    if op == "gelu_tanh":
        return g.gelu(*inputs, approximate="tanh", name=name)
    return getattr(g, op)(*inputs, name=name)


def d_mismatched_dims(data, run):
    b = _base(data, run)
    g = b.g
    p = b.pick()
    axes = [a for a, d in enumerate(p.dims) if d > 1]
    if not axes:
        p = g.tensor(dims=[4] * len(p.dims), name="wide")
        axes = list(range(len(p.dims)))
    axis = data.draw(st.sampled_from(axes))
    dims = list(p.dims)
    dims[axis] = data.draw(st.sampled_from([d for d in range(2, 12) if d != p.dims[axis]]))
    bad = g.tensor(dims=dims, name="mismatched")
    op = data.draw(st.sampled_from(sorted(BINARY)))
    pair = (p, bad) if data.draw(st.booleans()) else (bad, p)
    run.expect("op", ["mismatched", f"axis {axis - len(dims)}"])
    run.at("op", getattr(g, op), *pair)


def d_different_rank(data, run):
    b = _base(data, run)
    g = b.g
    p = b.pick()
    if len(p.dims) > 1 and data.draw(st.booleans()):
        dims = list(p.dims[1:]) if data.draw(st.booleans()) else random_shape(data)[:len(p.dims) - 1] or [3]
    else:
        dims = [data.draw(st.integers(1, 9))] + list(p.dims)
    assume(len(dims) != len(p.dims))
    bad = g.tensor(dims=dims, name="other_rank")
    op = data.draw(st.sampled_from(sorted(BINARY)))
    pair = (p, bad) if data.draw(st.booleans()) else (bad, p)
    run.expect("op", ["other_rank"])
    run.at("op", getattr(g, op), *pair)


def d_bad_dtype_input(data, run):
    b = _base(data, run, mark=False)
    g = b.g
    p = b.pick()
    dt = data.draw(st.sampled_from(["int32", "int64", "float8_e4m3", "float8_e5m2", "e4m3", "i32"]))
    bad = g.tensor(dims=list(p.dims), data_type=dt, name="badtype")
    op = data.draw(st.sampled_from(OP_CHOICES))
    inputs = (bad,) if op in UNARY else ((p, bad) if data.draw(st.booleans()) else (bad, p))
    out = _call_op(g, op, inputs, None)
    g.relu(out).set_output(True)
    run.expect("validate", ["badtype", nvdnn.dtypes.dtype(dt).name], DTypeError, "badtype")
    run.at("validate", g.validate)


def d_bad_dtype_output(data, run):
    b = _base(data, run)
    g = b.g
    t = b.results[-1]
    dt = data.draw(st.sampled_from(["int32", "float8_e5m2", "int64"]))
    t.set_data_type(dt)
    run.expect("validate", [t.name, dt], DTypeError, t.name)
    run.at("validate", g.validate)


def d_bad_intermediate_dtype(data, run):
    dt = data.draw(st.sampled_from(["int32", "float8_e4m3"]))
    g = run.at("setup", nvdnn.Graph, intermediate_data_type=dt, arch=ARCH)
    x = g.tensor(dims=random_shape(data), name="x")
    h = _call_op(g, data.draw(st.sampled_from(UNARY_METHODS)), (x,), None)
    g.relu(h).set_output(True)
    run.expect("validate", [h.name, dt], DTypeError, h.name)
    run.at("validate", g.validate)


def d_io_int32(data, run):
    g = run.at("setup", nvdnn.Graph, io_data_type=data.draw(st.sampled_from(["int32", "int64"])), arch=ARCH)
    x = g.tensor(dims=random_shape(data), name="int_input")
    g.exp(x).set_output(True)
    run.expect("validate", ["int_input"], DTypeError, "int_input")
    run.at("validate", g.validate)


def d_no_output(data, run):
    b = _base(data, run, mark=False)
    run.expect("validate", [b.g.name, "set_output"], ValidationError, "outputs")
    run.at("validate", b.g.validate)


def d_no_operations(data, run):
    g = run.at("setup", nvdnn.Graph, arch=ARCH, name="empty_graph")
    for i in range(data.draw(st.integers(0, 2))):
        g.tensor(dims=random_shape(data), name=f"lonely{i}")
    run.expect("validate", ["empty_graph"], ValidationError, "graph")
    run.at("validate", g.validate)


def d_virtual_input(data, run):
    b = _base(data, run)
    g = b.g
    p = b.pick()
    ghost = g.tensor(dims=list(p.dims), name="ghost", is_virtual=True)
    if data.draw(st.booleans()):
        g.add(p, ghost).set_output(True)
    run.expect("validate", ["ghost"], ValidationError, "ghost")
    run.at("validate", g.validate)


def d_duplicate_name(data, run):
    b = _base(data, run)
    g = b.g
    taken = data.draw(st.sampled_from(sorted(g._names)))
    how = data.draw(st.sampled_from(["tensor", "set_name", "op"]))
    if how == "tensor":
        run.expect("construct", [taken], ValidationError, "name")
        run.at("construct", g.tensor, dims=[2], name=taken)
    elif how == "set_name":
        fresh = g.tensor(dims=[2], name="fresh")
        run.expect("construct", [taken], ValidationError, "name")
        run.at("construct", fresh.set_name, taken)
    else:
        nodes = [n for n in g.nodes if n.output.name == f"{n.name}.out"]
        if not nodes:
            run.expect("construct", [taken], ValidationError, "name")
            run.at("construct", g.tensor, dims=[2], name=taken)
        node = data.draw(st.sampled_from(nodes))
        run.expect("op", [node.output.name], ValidationError, "name")
        run.at("op", g.exp, b.pick(), name=node.name)


def d_duplicate_uid(data, run):
    b = _base(data, run)
    g = b.g
    uid = data.draw(st.sampled_from(sorted(g.tensors)))
    run.expect("construct", [uid, g.tensors[uid].name], ValidationError, "uid")
    run.at("construct", g.tensor, dims=[3], name="dup_uid", uid=uid)


def d_bad_uid(data, run):
    g = run.at("setup", nvdnn.Graph, arch=ARCH)
    uid = data.draw(st.sampled_from([-1, -100, "3", 2.0, True, [1]]))
    run.expect("construct", ["uid"], ValidationError, "uid")
    run.at("construct", g.tensor, dims=[3], name="bad_uid", uid=uid)


def d_bad_dims(data, run):
    g = run.at("setup", nvdnn.Graph, arch=ARCH)
    dims = random_shape(data)
    bad = data.draw(st.sampled_from([0, -1, -7, 2.0, True, "3", None]))
    if data.draw(st.integers(0, 5)) == 0:
        dims = []
    else:
        dims[data.draw(st.integers(0, len(dims) - 1))] = bad
    run.expect("construct", ["bad_dims"], ValidationError, "dims")
    run.at("construct", g.tensor, dims=dims, name="bad_dims")


def d_bad_strides(data, run):
    g = run.at("setup", nvdnn.Graph, arch=ARCH)
    dims = random_shape(data)
    good = list(nvdnn.graph.tensor.contiguous_strides(dims))
    kind = data.draw(st.integers(0, 2))
    strides = good + [1] if kind == 0 else good[1:] if kind == 1 and len(good) > 1 else \
        [float(s) for s in good] if kind == 2 else []
    run.expect("construct", ["bad_strides", len(dims)], ValidationError, "strides")
    run.at("construct", g.tensor, dims=dims, strides=strides, name="bad_strides")


def d_foreign_tensor(data, run):
    b = _base(data, run)
    g = b.g
    other = nvdnn.Graph(arch=ARCH, name="elsewhere")
    p = b.pick()
    foreign = other.tensor(dims=list(p.dims), name=p.name)   # same name, other graph
    op = data.draw(st.sampled_from(OP_CHOICES))
    name, expected_name = _node_name(data, op, g)
    if op in UNARY:
        inputs, position = (foreign,), 0
    elif data.draw(st.booleans()):
        inputs, position = (p, foreign), 1
    else:
        inputs, position = (foreign, p), 0
    run.expect("op", [expected_name, g.name], ValidationError, f"input{position}")
    run.at("op", _call_op, g, op, inputs, name)


def d_not_a_tensor(data, run):
    b = _base(data, run)
    g = b.g
    p = b.pick()
    junk = data.draw(st.sampled_from(["x", None, [1.0, 2.0], np.ones(3), object()]))
    op = data.draw(st.sampled_from(OP_CHOICES))
    name, expected_name = _node_name(data, op, g)
    if op in UNARY:
        inputs, position = (junk,), 0
    elif data.draw(st.booleans()):
        inputs, position = (2.0, p), 0          # scalar first: the API takes the scalar second
    else:
        inputs, position = (p, junk), 1
    run.expect("op", [expected_name], ValidationError, f"input{position}")
    run.at("op", _call_op, g, op, inputs, name)


def d_compute_dtype(data, run):
    dt = data.draw(st.sampled_from(["float16", "bfloat16", "fp16", "int32", "float8_e4m3"]))
    run.expect("construct", ["compute_data_type"], DTypeError, "compute_data_type")
    run.at("construct", nvdnn.Graph, compute_data_type=dt, arch=ARCH)


def d_unknown_dtype(data, run):
    which = data.draw(st.sampled_from(["io_data_type", "intermediate_data_type", "compute_data_type", "tensor"]))
    dt = data.draw(st.sampled_from(["float64", "double", "", "fp4", 3, "Float32"]))
    if which == "tensor":
        g = nvdnn.Graph(arch=ARCH)
        run.expect("construct", ["oddtype"], DTypeError)
        run.at("construct", g.tensor, dims=[2], data_type=dt, name="oddtype")
    else:
        run.expect("construct", [which], DTypeError, which)
        run.at("construct", nvdnn.Graph, **{which: dt}, arch=ARCH)


def d_bad_arch(data, run):
    arch = data.draw(st.sampled_from(["sm_99", "sm_1", "gfx90a", "sm_90f", "SM_90", "sm_090", "90", 90,
                                      "", "sm_80a", "compute_90"]))
    run.expect("construct", ["arch"], ValidationError, "arch")
    run.at("construct", nvdnn.Graph, arch=arch)


def d_bad_op_parameter(data, run):
    b = _base(data, run)
    g = b.g
    op, kw = data.draw(st.sampled_from([("elu", "beta"), ("relu", "slope"), ("tanh", "alpha"),
                                        ("softplus", "alpha"), ("scale", "beta"), ("exp", "base"),
                                        ("gelu", "approximate")]))
    p = b.pick()
    if op == "gelu":
        value = data.draw(st.sampled_from(["erf", "TANH", None, True]))
        run.expect("op", ["approximate"], ValidationError, "approximate")
        run.at("op", g.gelu, p, approximate=value)
    else:
        run.expect("op", [kw, op], ValidationError, kw)
        run.at("op", getattr(g, op), p, **{kw: 1.0})


def d_bad_name(data, run):
    b = _base(data, run)
    t = data.draw(st.sampled_from(sorted(b.g.tensors.values(), key=lambda t: t.uid)))
    run.expect("construct", ["name"], ValidationError, "name")
    run.at("construct", t.set_name, data.draw(st.sampled_from(["", None, 5, b"bytes"])))


def d_steps_out_of_order(data, run):
    b = _base(data, run)
    g = b.g
    done = data.draw(st.integers(0, 3))
    for step in STEPS[:done]:
        getattr(g, step)()
    state = g._state
    if done >= 2 and data.draw(st.booleans()):        # a change after fusing makes the graph new again
        g.tensor(dims=[1], name="late_addition")
        state, done = "new", 0
    # the steps each call needs done first
    calls = {"build_operation_graph": 1, "create_execution_plans": 2, "check_support": 3, "build_plans": 4,
             "get_workspace_size": 2, "get_execution_plan_count": 4, "serialize": 5}
    call = data.draw(st.sampled_from(sorted(c for c, need in calls.items() if need > done)))
    run.expect(call, [f"is {state}"], ValidationError, "graph")
    run.stage = call
    try:
        getattr(g, call)()
    except ValidationError as exc:
        missing = STEPS[done:]
        assert any(f"{s}()" in str(exc) for s in missing), (str(exc), missing)
        raise


def d_bad_plan_index(data, run):
    b = _base(data, run)
    g = b.g
    g.validate().build_operation_graph().create_execution_plans().check_support()
    count = g.get_execution_plan_count()
    index = data.draw(st.sampled_from([count, count + 5, -1, 1.0, "0", True, None]))
    run.expect("build_plan_at_index", ["index"], ValidationError, "index")
    run.at("build_plan_at_index", g.build_plan_at_index, index)


def d_bad_policy(data, run):
    b = _base(data, run)
    g = b.g
    g.validate().build_operation_graph().create_execution_plans().check_support()
    policy = data.draw(st.sampled_from(["fastest", "ALL", "", None, 1]))
    run.expect("build_plans", ["policy"], ValidationError, "policy")
    run.at("build_plans", g.build_plans, policy)


def d_bad_variant_pack_key(data, run):
    b = _base(data, run)
    g = b.g
    g.validate().build_operation_graph()
    outputs = [t for t in g.tensors.values() if t.producer is not None and not t.is_virtual]
    pack, _ = pack_for(b, outputs, [np.float32] * len(outputs), data)
    virtual = [t for t in g.tensors.values() if t.is_virtual]
    other = nvdnn.Graph(arch=ARCH).tensor(dims=[2], name="in0")
    key = data.draw(st.sampled_from(["no_such_tensor", 987654, other] + virtual))
    pack = dict(pack)
    if data.draw(st.booleans()):
        pack = {key: np.zeros(2, np.float32), **pack}
    else:
        pack[key] = np.zeros(2, np.float32)
    run.expect("execute", [key.name if isinstance(key, nvdnn.Tensor) else key], ValidationError, "variant_pack")
    run.at("execute", g.execute, pack, backend="numpy")


def d_bad_backend(data, run):
    b = _base(data, run)
    g = b.g
    g.validate().build_operation_graph()
    backend = data.draw(st.sampled_from(["cpu", "CUDA", "", None, "torch"]))
    run.expect("execute", ["backend"], ValidationError, "backend")
    run.at("execute", g.execute, {}, backend=backend)


DEFECTS = {f.__name__[2:]: f for f in (
    d_mismatched_dims, d_different_rank, d_bad_dtype_input, d_bad_dtype_output, d_bad_intermediate_dtype,
    d_io_int32, d_no_output, d_no_operations, d_virtual_input, d_duplicate_name, d_duplicate_uid, d_bad_uid,
    d_bad_dims, d_bad_strides, d_foreign_tensor, d_not_a_tensor, d_compute_dtype, d_unknown_dtype,
    d_bad_arch, d_bad_op_parameter, d_bad_name, d_steps_out_of_order, d_bad_plan_index, d_bad_policy,
    d_bad_variant_pack_key, d_bad_backend)}


@pytest.mark.parametrize("kind", sorted(DEFECTS))
@settings(max_examples=N_INVALID_PER_KIND, **_SETTINGS)
@given(data=st.data())
def test_random_invalid_graphs_raise_validation_errors(kind, data):
    run = Run()
    try:
        DEFECTS[kind](data, run)
    except Exception as exc:  # noqa: BLE001 - the point: which type it is
        assert run.expected is not None, f"{kind}: setup raised {type(exc).__name__}: {exc}"
        stage, needles, cls, arg = run.expected
        assert run.stage == stage, f"{kind}: raised at {run.stage}, expected at {stage}: {exc!r}"
        assert isinstance(exc, cls), f"{kind}: {type(exc).__name__} ({exc}) is not a {cls.__name__}"
        for needle in needles:
            assert needle in str(exc), f"{kind}: {needle!r} not in message {str(exc)!r}"
        if arg is not None:
            assert exc.arg == arg, f"{kind}: arg {exc.arg!r}, expected {arg!r}"
    else:
        pytest.fail(f"{kind}: nothing raised (expected at {run.expected and run.expected[0]})")


# -- direct tests -----------------------------------------------------------------------------------

def _bias_act_graph(dims=(8, 64)):
    g = nvdnn.Graph(arch=ARCH, name="bias_act")
    x = g.tensor(dims=list(dims), name="x")
    b = g.tensor(dims=[1, dims[1]], name="b")
    y = g.relu(g.gelu(g.add(x, b))).set_output(True)
    return g, x, b, y


def test_bias_gelu_relu_fuses_into_one_group():
    g, x, b, y = _bias_act_graph()
    g.validate().build_operation_graph()
    assert len(g.groups) == 1
    (group,) = g.groups
    assert group.steps == [("add", "x1"), ("gelu", ""), ("relu", "")]
    assert group.inputs == [x, b] and group.output is y
    assert group.params == [0.0, math.inf]          # relu's slope and clip: kernel arguments
    assert g.get_workspace_size() == 0


def test_explain_lists_kernel_groups_and_uris():
    g = nvdnn.Graph(arch=ARCH, name="explained")
    x = g.tensor(dims=[4, 32], name="x")
    h = g.exp(x)
    g.relu(h).set_output(True)
    g.sigmoid(h).set_output(True)
    assert "0 kernels" in g.explain()
    g.validate().build_operation_graph().create_execution_plans().check_support()
    text = g.explain()
    lines = text.splitlines()
    assert lines[0].startswith("graph 'explained' (supported): 3 ops in 3 kernels, workspace 512 bytes")
    for index, group in enumerate(g.groups):
        assert f"kernel {index}: {group.describe()}" in text
        for c, spec in enumerate(g.candidates[index]):
            assert f"    {'*' if c == g.chosen[index] else ' '} [{c}] {spec.uri}" in lines
    assert "pointwise[exp](x) -> exp0.out" in text
    assert sum(line.strip().startswith("* [") for line in lines) == 3


def test_shared_intermediate_is_materialized_in_aligned_workspace():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[3, 5], name="x")
    h = g.exp(x)                                   # 60 bytes, two consumers -> one 256-byte slot
    y1 = g.relu(h).set_output(True)
    k = g.tanh(g.add(h, 1.0))                      # a chain whose value is shared too
    y2 = g.mul(k, k).set_output(True)
    g.validate().build_operation_graph()
    assert [gr.output for gr in g.groups] == [h, y1, k, y2]
    assert g.groups[2].steps == [("add", "p"), ("tanh", "")]
    assert g.get_workspace_size() == 2 * WORKSPACE_ALIGN
    offsets, _, total = g._workspace_layout(g._shapes([t.dims for t in g._io]), [None] * len(g.groups))
    assert sorted(offsets) == sorted([h.uid, k.uid]) and total == 2 * WORKSPACE_ALIGN
    assert all(o % WORKSPACE_ALIGN == 0 for o in offsets.values())
    assert sorted(offsets.values()) == [0, WORKSPACE_ALIGN]


@pytest.mark.parametrize("intermediate,itemsize", [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_workspace_rounds_each_tensor_up_to_256_bytes(intermediate, itemsize):
    g = nvdnn.Graph(arch=ARCH, intermediate_data_type=intermediate)
    x = g.tensor(dims=[10, 30], name="x")
    b = g.tensor(dims=[1, 30], name="b")
    h1 = g.add(x, b)
    h2 = g.sqrt(g.abs(x))
    for t in (h1, h2):
        g.relu(t).set_output(True)
        g.neg(t).set_output(True)
    g.validate().build_operation_graph()
    slot = -(-300 * itemsize // 256) * 256
    assert g.get_workspace_size() == 2 * slot
    offsets, _, _ = g._workspace_layout(g._shapes([t.dims for t in g._io]), [None] * len(g.groups))
    assert sorted(offsets.values()) == [0, slot] and slot % WORKSPACE_ALIGN == 0


@pytest.mark.parametrize("op,kernel_op", [("sub", "rsub"), ("div", "rdiv"), ("power", "rpow"),
                                          ("add", "add"), ("mul", "mul"), ("maximum", "max"),
                                          ("minimum", "min")])
def test_chain_value_as_second_operand_uses_the_reversed_op(op, kernel_op):
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[4, 8], name="x")
    b = g.tensor(dims=[4, 8], name="b")
    h = g.exp(x)
    getattr(g, op)(b, h).set_output(True)
    g.validate().build_operation_graph()
    assert len(g.groups) == 1
    assert g.groups[0].steps == [("exp", ""), (kernel_op, "x1")]
    assert g.groups[0].inputs == [x, b]


@pytest.mark.parametrize("op,kernel_op", [("add", "add"), ("sub", "sub"), ("mul", "mul"), ("div", "div"),
                                          ("maximum", "max"), ("minimum", "min"), ("power", "pow")])
def test_scalar_binary_is_a_p_step(op, kernel_op):
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[4, 8], name="x")
    getattr(g, op)(x, 2.0).set_output(True)
    g.validate().build_operation_graph()
    assert g.groups[0].steps == [(kernel_op, "p")]
    assert g.groups[0].params == [2.0]
    xa = np.linspace(0.5, 3.0, 32, dtype=np.float32).reshape(4, 8)
    ya = np.zeros((4, 8), np.float32)
    g.execute({x: xa, g.groups[0].output: ya}, backend="numpy")
    np.testing.assert_allclose(ya, BINARY[op](xa.astype(np.float64), 2.0), rtol=1e-7)


def test_scalar_in_a_chain_keeps_its_slot_order():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[16], name="x")
    y = g.scale(g.add(g.elu(x, alpha=0.5), 2.0), 3.0).set_output(True)
    g.validate().build_operation_graph().create_execution_plans().check_support()
    (group,) = g.groups
    assert group.steps == [("elu", ""), ("add", "p"), ("mul", "p")]
    assert group.params == [0.5, 2.0, 3.0]
    spec = g.candidates[0][g.chosen[0]]
    assert spec.n_params == 3
    xa = np.linspace(-2, 2, 16, dtype=np.float32)
    ya = np.zeros(16, np.float32)
    g.execute({x: xa, y: ya}, backend="numpy")
    xd = xa.astype(np.float64)
    np.testing.assert_allclose(ya, 3.0 * (np.where(xd > 0, xd, 0.5 * np.expm1(xd)) + 2.0), rtol=1e-7)


@pytest.mark.parametrize("form", ["tensor", "uid", "name", "mixed"])
def test_variant_pack_keys_may_be_tensors_uids_or_names(form):
    g, x, b, y = _bias_act_graph((3, 4))
    g.validate().build_operation_graph()
    xa = np.arange(12, dtype=np.float32).reshape(3, 4) / 4 - 1
    ba = np.array([[0.5, -0.25, 1.0, 0.0]], dtype=np.float32)
    ya = np.full((3, 4), np.nan, dtype=np.float32)
    keys = {"tensor": (x, b, y), "uid": (x.uid, b.uid, y.uid), "name": ("x", "b", y.name),
            "mixed": (x.uid, "b", y)}[form]
    g.execute(dict(zip(keys, (xa, ba, ya))), backend="numpy")
    z = xa.astype(np.float64) + ba
    expected = np.maximum(0.5 * z * (1 + _erf(z / math.sqrt(2))), 0)
    np.testing.assert_allclose(ya, expected, rtol=1e-6, atol=1e-7)


def _ones(*shape):
    return np.ones(shape, np.float32)


def test_variant_pack_rejects_a_virtual_or_unknown_key():
    g, x, b, y = _bias_act_graph((3, 4))
    g.validate().build_operation_graph()
    hidden = g.nodes[0].output
    for key, needle in ((hidden, hidden.name), ("nope", "nope"), (12345, "12345")):
        with pytest.raises(ValidationError, match=needle) as info:
            g.execute({x: _ones(3, 4), b: _ones(1, 4), y: _ones(3, 4), key: _ones(1)}, backend="numpy")
        assert info.value.arg == "variant_pack"


def test_missing_output_key_names_the_tensor():
    g, x, b, y = _bias_act_graph((3, 4))
    g.validate().build_operation_graph()
    with pytest.raises(ValidationError, match=y.name):
        g.execute({x: _ones(3, 4), b: _ones(1, 4)}, backend="numpy")


def test_missing_input_key_names_the_tensor():
    g, x, b, y = _bias_act_graph((3, 4))
    g.validate().build_operation_graph()
    with pytest.raises(ValidationError, match="'b'"):
        g.execute({x: _ones(3, 4), y: _ones(3, 4)}, backend="numpy")


@pytest.mark.parametrize("done,call,step", [
    (0, "build_operation_graph", "validate"),
    (1, "create_execution_plans", "build_operation_graph"),
    (2, "check_support", "create_execution_plans"),
    (3, "build_plans", "check_support"),
    (3, "serialize", "check_support"),
    (2, "get_execution_plan_count", "create_execution_plans"),
    (0, "get_workspace_size", "validate"),  # the next step from the state, not the call's own prerequisite
])
def test_a_step_before_its_prerequisite_names_the_step_to_run(done, call, step):
    g, *_ = _bias_act_graph()
    for s in STEPS[:done]:
        getattr(g, s)()
    state = g._state
    with pytest.raises(ValidationError, match=rf"is {state}; run {step}\(\) first") as info:
        getattr(g, call)()
    assert info.value.arg == "graph"
    assert g._state == state                       # a refused step changes nothing


def test_changing_the_graph_after_a_step_starts_over():
    g, x, b, y = _bias_act_graph()
    g.validate().build_operation_graph().create_execution_plans().check_support()
    g.exp(x).set_output(True)
    assert g._state == "new" and g.groups == [] and g.candidates == []
    with pytest.raises(ValidationError, match="graph 'bias_act' is new"):
        g.check_support()


def test_plan_count_and_index_out_of_range():
    g, *_ = _bias_act_graph()
    with pytest.raises(ValidationError, match="validate"):
        g.get_execution_plan_count()
    with pytest.raises(ValidationError, match="validate"):
        g.build_plan_at_index(0)
    g.validate().build_operation_graph().create_execution_plans().check_support()
    count = g.get_execution_plan_count()
    pw = nvdnn.kernels.pointwise
    assert not g.candidates[0][0].row_tiles  # 16 vectors per row: too narrow for row tiles by default
    assert count == len(g.candidates[0]) == 1 + len(pw.TILES) + len(pw.ROW_TILES)  # heuristic, then tiles
    for bad in (count, count + 1, -1, 1.5, "0", None, True):
        with pytest.raises(ValidationError, match="index") as info:
            g.build_plan_at_index(bad)
        assert info.value.arg == "index"
    assert g._state == "supported" and g.binaries == {}


def test_unknown_arch_is_a_validation_error_on_arch():
    with pytest.raises(ValidationError, match="sm_99") as info:
        nvdnn.Graph(arch="sm_99")
    assert info.value.arg == "arch"
    assert nvdnn.Graph(arch="sm_90a").arch == "sm_90a"


def test_compute_data_type_must_be_float32():
    with pytest.raises(DTypeError) as info:
        nvdnn.Graph(compute_data_type="float16")
    assert info.value.arg == "compute_data_type"


def test_non_packed_output_strides_are_refused():
    # No public call makes an op output non-packed; force it to reach validate's rule.
    g, x, b, y = _bias_act_graph((4, 6))
    y.strides = (1, 4)
    with pytest.raises(ValidationError, match=rf"tensor '{y.name}': output strides \[1, 4\]") as info:
        g.validate()
    assert info.value.arg == y.name


def test_strided_and_broadcast_inputs_plan_without_a_gpu():
    g = nvdnn.Graph(arch=ARCH, io_data_type="float16")
    x = g.tensor(dims=[2, 3, 4, 8], strides=nvdnn.graph.tensor.nhwc_strides([2, 3, 4, 8]), name="x")
    c = g.tensor(dims=[1, 3, 1, 1], name="c")
    y = g.silu(g.mul(x, c)).set_output(True)
    g.validate().build_operation_graph().create_execution_plans().check_support()
    spec = g.candidates[0][0]
    assert spec.inputs == ("float16", "float16") and spec.output == "float16"
    assert spec.access[0] == "gat" and y.data_type == "float16"


# -- library bugs, pinned: each flips to XPASS (and fails) once fixed ------------------------------

def test_groups_run_in_dependency_order():
    g = _minimal_misordered_graph()
    # today: kernel 0 = exp -> add(x, tanh1.out) reads the workspace slot kernel 1 (tanh) writes later.
    # Seen on an H200: with the workspace filled with 7.0 the output is exactly exp(x) + 7.
    assert _misordered_groups(g) == []
    assert sum(len(gr.nodes) for gr in g.groups) == 3


def test_groups_run_in_dependency_order_through_an_output():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[4, 8], name="x")
    y = g.tensor(dims=[4, 8], name="y")
    a = g.exp(x)
    b = g.tanh(g.neg(y)).set_output(True)
    g.mul(a, b).set_output(True)
    g.validate().build_operation_graph()
    assert _misordered_groups(g) == []


def test_set_output_after_fusion_is_picked_up():
    g, x, b, y = _bias_act_graph((3, 4))
    h = g.nodes[0].output
    g.validate().build_operation_graph()
    h.set_output(True)
    ha, ya = np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)
    g.execute({x: _ones(3, 4), b: np.full((1, 4), 0.5, np.float32), h: ha, y: ya}, backend="numpy")
    np.testing.assert_allclose(ha, 1.5)


def test_set_name_after_fusion_is_picked_up():
    g, x, b, y = _bias_act_graph((3, 4))
    g.validate().build_operation_graph()
    y.set_name("result")
    ya = np.zeros((3, 4), np.float32)
    g.execute({"x": _ones(3, 4), "b": _ones(1, 4), "result": ya}, backend="numpy")
    assert ya.any()


def test_chain_of_nine_inputs_plans():
    g = nvdnn.Graph(arch=ARCH)
    xs = [g.tensor(dims=[4, 8], name=f"x{i}") for i in range(9)]
    v = xs[0]
    for t in xs[1:]:
        v = g.add(v, t)
    v.set_output(True)
    g.validate().build_operation_graph().create_execution_plans().check_support()
    assert all(len(gr.inputs) <= 8 for gr in g.groups)


def test_relu_clip_none_means_no_clip_positionally_too():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[4], name="x")
    assert g.relu(x, 0.0, None).producer.params == (0.0, math.inf)


@pytest.mark.parametrize("call", ["elu_str_alpha", "scale_none", "softplus_list"])
def test_bad_op_parameter_values_are_validation_errors(call):
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[4], name="x")
    fn = {"elu_str_alpha": lambda: g.elu(x, "big"),
          "scale_none": lambda: g.scale(x, None),
          "softplus_list": lambda: g.softplus(x, beta=[1.0])}[call]
    with pytest.raises(ValidationError):
        fn()


def test_extra_positional_parameters_are_refused():
    g = nvdnn.Graph(arch=ARCH)
    x = g.tensor(dims=[4], name="x")
    with pytest.raises(ValidationError):
        g.exp(x, 3.0)


@pytest.mark.parametrize("kwargs", [{"dims": 5}, {"dims": None}, {"dims": [2, 3], "strides": 3}])
def test_non_sequence_dims_or_strides_are_validation_errors(kwargs):
    g = nvdnn.Graph(arch=ARCH)
    with pytest.raises(ValidationError):
        g.tensor(name="x", **kwargs)


@pytest.mark.parametrize("name", ["", 7])
def test_tensor_names_are_checked_like_set_name(name):
    g = nvdnn.Graph(arch=ARCH)
    with pytest.raises(ValidationError):
        g.tensor(dims=[2], name=name)


def test_cuda_execute_refuses_numpy_arrays_naming_the_tensor():
    g, x, b, y = _bias_act_graph((3, 4))
    g.build()
    with pytest.raises(ValidationError, match="backend='numpy'") as info:
        g.execute({x: np.ones((3, 4), np.float32), b: np.ones((1, 4), np.float32),
                   y: np.zeros((3, 4), np.float32)})
    assert info.value.arg == x.name
