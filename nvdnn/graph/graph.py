"""Graph: describe work, run the cuDNN frontend's five steps, execute.

    g = nvdnn.Graph(io_data_type="bfloat16")
    x = g.tensor(dims=[8, 4096], name="x")
    b = g.tensor(dims=[1, 4096], name="b")
    y = g.gelu(g.add(x, b)).set_output(True)
    g.build()                      # validate .. build_plans
    g.execute({x: xa, b: ba, y: ya})

Dynamic dims: every dim of a pointwise graph may change between executes (batch, rows,
spatial) as long as the kernel stays the same: the broadcast pattern (which dims are 1),
the rank and the vector width (last coalesced dim a multiple of 16 bytes) are static, and
a change to them is a ValidationError naming the tensor and the dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import arrays, callsite, compiler, dtypes, fusion, launcher, runtime
from ..cache import KernelBinary, default_cache
from ..errors import DeviceError, DTypeError, UnsupportedError, ValidationError
from .. import kernels
from ..kernels import pointwise
from .anchors import ANCHORS, Epilogue, Meta
from .ops import SCHEMAS
from .rules import SCALAR, check_dims, check_extent
from .tensor import Tensor, contiguous_strides

_STATES = ("new", "validated", "fused", "planned", "supported", "built")
WORKSPACE_ALIGN = 256
PREPARED_LIMIT = 64  # signatures (shapes, strides, workspace address) a built graph keeps planned


@dataclass
class Node:
    name: str
    op: str
    inputs: tuple
    params: tuple
    outputs: tuple
    roles: tuple = ()     # anchor ops: the role of each input ("x", "gamma", ...)
    attrs: tuple = ()     # anchor ops: (name, value) static attributes, sorted

    @property
    def output(self) -> Tensor:
        return self.outputs[0]


class _Launch(NamedTuple):
    function: object
    grid: tuple
    block: tuple
    slots: tuple          # per pointer argument: ("io", index) or ("ws",) (its view is in the pointers)
    tail: tuple           # the integer and float arguments
    shared_mem: int = 0
    deferred: bool = False  # the tail holds arguments resolved at launch (callsite.resolve)


class _GroupRun(NamedTuple):
    """A group's launches for one signature, and where its outputs land (io slot or view)."""
    launches: list        # (_Launch, pointers)
    outputs: list         # per output: ("io", index) or ("ws", view)


class Graph:
    def __init__(self, io_data_type="float32", intermediate_data_type="float32", compute_data_type="float32",
                 name: str = "graph", arch: str | None = None):
        self.io_data_type = dtypes.dtype(io_data_type, arg="io_data_type").name
        self.intermediate_data_type = dtypes.dtype(intermediate_data_type, arg="intermediate_data_type").name
        self.compute_data_type = dtypes.dtype(compute_data_type, arg="compute_data_type").name
        if self.compute_data_type != "float32":
            raise DTypeError(f"compute_data_type: {self.compute_data_type}; nvdnn computes in float32",
                             arg="compute_data_type")
        self.name = name
        self.arch = compiler.parse_arch(arch) if arch is not None else None
        self.tensors: dict[int, Tensor] = {}
        self.nodes: list[Node] = []
        self._names: dict[str, Tensor] = {}
        self._state = "new"
        self._reset_plans()

    def _reset_plans(self):
        self.groups: list[fusion.KernelGroup] = []
        self.candidates: list[list[pointwise.PointwiseSpec]] = []
        self.rejected: list[list[tuple[pointwise.PointwiseSpec, str]]] = []
        self.chosen: list[int] = []
        self.binaries: dict[pointwise.PointwiseSpec, KernelBinary] = {}
        self._prepared: dict = {}
        self._repeats: dict = {}  # a repeat execute's signature -> (io slot per pack entry, its runs)
        self._epilogue_of: dict = {}
        self._slot: dict = {}
        self._io: list[Tensor] = []

    # -- building ----------------------------------------------------------------------------------
    def _touch(self):
        if self._state != "new":
            self._state = "new"
            self._reset_plans()

    def _rename(self, tensor: Tensor, name: str):
        if not isinstance(name, str) or not name:
            raise ValidationError(f"tensor name: {name!r} is not a non-empty string", arg="name")
        if name in self._names and self._names[name] is not tensor:
            raise ValidationError(f"tensor name: '{name}' is already used in graph '{self.name}'", arg="name")
        self._names.pop(tensor.name, None)
        tensor.name = name
        self._names[name] = tensor

    def _new_tensor(self, dims, strides, data_type, name, uid, is_virtual) -> Tensor:
        if uid is None:
            uid = max(self.tensors, default=0) + 1
        if type(uid) is not int or uid < 0:
            raise ValidationError(f"uid: {uid!r} is not a non-negative int", arg="uid")
        if uid in self.tensors:
            raise ValidationError(f"uid: {uid} is already used by {self.tensors[uid]}", arg="uid")
        name = name if name is not None else f"t{uid}"
        if name in self._names:
            raise ValidationError(f"tensor name: '{name}' is already used in graph '{self.name}'", arg="name")
        tensor = Tensor(self, uid, name, dims, strides, data_type, is_virtual)
        self.tensors[uid] = tensor
        self._names[name] = tensor
        self._touch()
        return tensor

    def tensor(self, dims, strides=None, data_type=None, name: str | None = None, uid: int | None = None,
               is_virtual: bool = False, alignment: int = 16) -> Tensor:
        """An input (or output) tensor: dims in NCHW order, strides in elements (default: packed);
        ``alignment``: the bytes its arrays' addresses are a multiple of."""
        label = f"tensor '{name}'" if name else "tensor"
        if name is not None and (not isinstance(name, str) or not name):
            raise ValidationError(f"tensor name: {name!r} is not a non-empty string", arg="name")
        if not isinstance(dims, (list, tuple)) or (strides is not None and not isinstance(strides, (list, tuple))):
            raise ValidationError(f"{label}: dims and strides are sequences of ints, got dims={dims!r}, "
                                  f"strides={strides!r}", arg="dims")
        if alignment not in (1, 2, 4, 8, 16):
            raise ValidationError(f"{label}: alignment {alignment!r} is not 1, 2, 4, 8 or 16", arg="alignment")
        dims = tuple(dims)
        check_dims(label, dims)
        strides = contiguous_strides(dims) if strides is None else tuple(strides)
        if len(strides) != len(dims) or not all(type(s) is int for s in strides):
            raise ValidationError(f"{label}: strides {list(strides)} must be {len(dims)} ints, one per dim",
                                  arg="strides")
        check_extent(label, dims, strides)
        data_type = dtypes.dtype(data_type if data_type is not None else self.io_data_type, arg=label).name
        tensor = self._new_tensor(dims, strides, data_type, name, uid, is_virtual)
        tensor.alignment = alignment
        return tensor

    def tensor_like(self, array, name: str | None = None, uid: int | None = None) -> Tensor:
        """A tensor with the dims, strides, data type (and, for device arrays, the address
        alignment) of an array (CuPy, NumPy, DLPack)."""
        itemsize = array.dtype.itemsize
        data = getattr(array, "data", None)
        align = arrays.alignment(data.ptr) if hasattr(data, "ptr") else 16
        return self.tensor(dims=array.shape, strides=[s // itemsize for s in array.strides],
                           data_type=dtypes.of_array(array, arg=name or "array"), name=name, uid=uid,
                           alignment=align)

    def _node_name(self, op: str, name) -> str:
        node_name = name or f"{op}{len(self.nodes)}"
        if not isinstance(node_name, str) or not node_name:
            raise ValidationError(f"{op}: name {name!r} is not a non-empty string", arg="name")
        for other in self.nodes:
            if other.name == node_name:
                raise ValidationError(f"{op}: node name '{node_name}' is already used (by the node producing "
                                      f"'{other.output.name}')", arg="name")
        return node_name

    def _op(self, op: str, inputs, params=(), name: str | None = None, uid: int | None = None,
            out_name: str | None = None) -> Tensor:
        node_name = self._node_name(op, name)
        schema = SCHEMAS[op]
        slots = schema.params if schema.arity == 1 or len(inputs) == 2 else (("scalar", None, SCALAR),)
        if len(inputs) not in (1, schema.arity) or len(params) != len(slots):
            raise ValidationError(f"node '{node_name}' ({op}): takes {schema.arity} tensors and "
                                  f"{len(schema.params)} parameters (binary ops: a tensor or one scalar), got "
                                  f"{len(inputs)} tensors and {len(params)} parameters", arg=node_name)
        params = tuple(rule.check(value, f"node '{node_name}' ({op})", key)
                       for value, (key, _, rule) in zip(params, slots))
        for position, t in enumerate(inputs):
            if not isinstance(t, Tensor) or t.graph is not self:
                raise ValidationError(f"node '{node_name}' ({op}): input {position} is not a tensor of graph "
                                      f"'{self.name}'", arg=f"input{position}")
        shape = pointwise.broadcast_shape([t.dims for t in inputs], [t.name for t in inputs])
        if len(set(len(t.dims) for t in inputs)) > 1 or len(shape) != len(inputs[0].dims):
            ranks = ", ".join(f"'{t.name}' {list(t.dims)}" for t in inputs)
            raise ValidationError(f"node '{node_name}' ({op}): inputs must have the same rank, with 1 in "
                                  f"broadcast dims (cuDNN's rule); got {ranks}", arg="dims")
        out = self._new_tensor(shape, contiguous_strides(shape), self.intermediate_data_type,
                               out_name or (name if name and name not in self._names else f"{node_name}.out"), uid,
                               True)
        node = Node(node_name, op, tuple(inputs), params, (out,))
        self._touch()
        out.producer = node
        self.nodes.append(node)
        return out

    def _anchor(self, op: str, inputs: dict, attrs: dict, name: str | None = None, outs=None):
        """Add an anchor node (nvdnn.graph.anchors); returns its main output, or all its outputs
        when it has several. ``outs``: (uid, name) per output, to rebuild a described graph."""
        schema = ANCHORS[op]
        node_name = self._node_name(op, name)
        given = schema.given(inputs, f"node '{node_name}' ({op})")
        for role, t in given.items():
            if not isinstance(t, Tensor) or t.graph is not self:
                raise ValidationError(f"node '{node_name}' ({op}): '{role}' is not a tensor of graph '{self.name}'",
                                      arg=role)
        roles, tensors = list(given), list(given.values())
        attrs = schema.attributes(attrs, f"node '{node_name}' ({op})")
        try:
            metas = schema.output_metas(attrs, {r: Meta(t.dims, t.strides, t.data_type)
                                                for r, t in zip(roles, tensors)})
        except ValidationError as exc:
            raise ValidationError(f"node '{node_name}' ({op}): {exc}", arg=exc.arg) from None
        outputs = []
        for k, (role, meta) in enumerate(zip(schema.outputs, metas)):
            uid, out_name = outs[k] if outs else (None, None)
            if out_name is None:
                out_name = name if k == 0 and name and name not in self._names else f"{node_name}.{role}"
            outputs.append(self._new_tensor(meta.dims, meta.strides, meta.data_type or self.intermediate_data_type,
                                            out_name, uid, True))
        node = Node(node_name, op, tuple(tensors), (), tuple(outputs), tuple(roles), tuple(sorted(attrs.items())))
        self._touch()
        for t in outputs:
            t.producer = node
        self.nodes.append(node)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    # pointwise ops, NumPy names; binary ops take a scalar as second operand too
    def _unary(op):
        schema = SCHEMAS[op]

        def method(self, x, *args, name=None, **kwargs):
            names = [k for k, _, _ in schema.params]
            if len(args) > len(names):
                raise ValidationError(f"{op}: takes {len(names)} parameters ({names or 'none'}), got "
                                      f"{len(args)} positional", arg=op)
            values = {k: default for k, default, _ in schema.params}
            for key, value in list(zip(names, args)) + list(kwargs.items()):
                if key not in values:
                    raise ValidationError(f"{op}: unknown parameter '{key}' (takes {names or 'none'})", arg=key)
                values[key] = math.inf if (op == "relu" and key == "clip" and value is None) else value
            return self._op(op, (x,), tuple(values[k] for k in names), name)

        method.__name__ = op
        method.__doc__ = f"{op}(x{''.join(', ' + k for k, _, _ in schema.params)}) as a graph node."
        return method

    def _binary(op):
        def method(self, a, b, name=None):
            if isinstance(b, (int, float, np.number)) and not isinstance(b, bool):
                return self._op(op, (a,), (b,), name)
            return self._op(op, (a, b), (), name)

        method.__name__ = op
        method.__doc__ = f"{op}(a, b) as a graph node; b may be a tensor (broadcast) or a scalar."
        return method

    identity, neg, abs, exp, log, sqrt, rsqrt = map(_unary, ("identity", "neg", "abs", "exp", "log", "sqrt",
                                                             "rsqrt"))
    relu, silu, sigmoid, tanh, elu, softplus, scale = map(_unary, ("relu", "silu", "sigmoid", "tanh", "elu",
                                                                   "softplus", "scale"))
    add, sub, mul, div, maximum, minimum, power = map(_binary, ("add", "sub", "mul", "div", "maximum",
                                                                "minimum", "power"))
    del _unary, _binary

    def gelu(self, x, approximate="none", name=None):
        if approximate not in ("none", "tanh"):
            raise ValidationError(f"approximate: {approximate!r} is not 'none' or 'tanh'", arg="approximate")
        return self._op("gelu" if approximate == "none" else "gelu_tanh", (x,), (), name)

    # -- the five steps ----------------------------------------------------------------------------
    def validate(self) -> "Graph":
        """Check every rule; the error names the node, the tensor, the dim and the rule."""
        if not self.nodes:
            raise ValidationError(f"graph '{self.name}': has no operations", arg="graph")
        for node in self.nodes:
            allowed = pointwise.DTYPES + (ANCHORS[node.op].data_types if node.op in ANCHORS else ())
            for t in (*node.inputs, *node.outputs):
                if t.data_type not in allowed:
                    raise DTypeError(f"node '{node.name}' ({node.op}): tensor '{t.name}' is {t.data_type}; "
                                     f"its kernels take {', '.join(allowed)}", arg=t.name)
        outputs = [t for n in self.nodes for t in n.outputs if not t.is_virtual]
        if not outputs:
            raise ValidationError(f"graph '{self.name}': no output; mark one with set_output(True)", arg="outputs")
        for t in outputs:
            if t.producer.op not in ANCHORS and t.strides != contiguous_strides(t.dims):
                raise ValidationError(f"tensor '{t.name}': output strides {list(t.strides)} are not packed "
                                      f"(row-major {list(contiguous_strides(t.dims))}); pointwise kernels "
                                      "write packed outputs", arg=t.name)
        for t in self.tensors.values():
            if t.is_virtual and t.producer is None:
                raise ValidationError(f"tensor '{t.name}': virtual but no node produces it; "
                                      "create inputs with is_virtual=False", arg=t.name)
        self._state = "validated"
        return self

    def build_operation_graph(self) -> "Graph":
        """Partition into kernel groups (fusion)."""
        self._require("validated")
        consumers = {uid: [] for uid in self.tensors}
        for node in self.nodes:
            for position, t in enumerate(node.inputs):
                consumers[t.uid].append((node, position))
        self.groups = fusion.partition(self.nodes, consumers)
        self._epilogue_of = {}  # uid of a fused epilogue's end -> its anchor node, whose layout it has
        for group in self.groups:
            if group.anchor is not None and group.output is not group.anchor.output:
                self._epilogue_of[group.output.uid] = group.anchor
                group.output.strides = group.anchor.output.strides
        self._io = sorted((t for t in self.tensors.values() if not t.is_virtual), key=lambda t: t.uid)
        self._slot = {}
        for index, t in enumerate(self._io):
            self._slot[t] = self._slot[t.uid] = self._slot[t.name] = index
        self._state = "fused"
        return self

    def create_execution_plans(self) -> "Graph":
        """Candidate specs per kernel group: the heuristic choice first, then tile variants."""
        self._require("fused")
        self.candidates = []
        for group in self.groups:
            out = group.output
            align = 16 if out.is_virtual else out.alignment
            if group.anchor is None:
                base = self._plan(group, [self._operand(t) for t in group.inputs], out_align=align).spec
            else:
                base = kernels.tile_spec(self._anchor_plan(group, self._built_operands(group), align))
            tiles = group.anchor is None or ANCHORS[group.anchor.op].tiles
            variants = kernels.family(group.family).candidates(base) if tiles else []
            self.candidates.append(list(dict.fromkeys([base] + variants)))
        self._state = "planned"
        return self

    def check_support(self, _tuned: bool = True) -> "Graph":
        """Drop candidates this arch cannot run; raise, with each reason, if a group has none left."""
        self._require("planned")
        arch = self._arch()
        self.rejected = []
        for index, specs in enumerate(self.candidates):
            kept, dropped = [], []
            for spec in specs:
                reason = kernels.family(self.groups[index].family).unsupported_reason(spec, arch)
                (dropped.append((spec, reason)) if reason else kept.append(spec))
            if not kept:
                detail = "; ".join(f"{s.uri}: {r}" for s, r in dropped)
                raise UnsupportedError(f"group {index} ({self.groups[index].describe()}): no candidate runs on "
                                       f"{arch}: {detail}")
            self.candidates[index], _ = kept, self.rejected.append(dropped)
        self.chosen = [self._tuned_choice(i) if _tuned else 0 for i in range(len(self.groups))]
        self._state = "supported"
        return self

    def build_plans(self, policy: str = "heuristic") -> "Graph":
        """Compile through the cache: the chosen candidate per group, or every one (``"all"``)."""
        self._require("supported")
        if policy not in ("heuristic", "all"):
            raise ValidationError(f"policy: {policy!r} is not 'heuristic' or 'all'", arg="policy")
        arch, cache = self._arch(), default_cache()
        for index, specs in enumerate(self.candidates):
            for spec in (specs if policy == "all" else [specs[self.chosen[index]]]):
                for launch_spec in self._launch_specs(index, spec):
                    self.binaries[launch_spec] = cache.get(launch_spec, arch)
        self._prepared.clear()
        self._repeats.clear()
        self._state = "built"
        return self

    def build(self, policy: str = "heuristic") -> "Graph":
        """All five steps."""
        return (self.validate().build_operation_graph().create_execution_plans().check_support()
                .build_plans(policy))

    def get_execution_plan_count(self) -> int:
        """Plan i takes candidate i of every group (the last one where a group has fewer)."""
        self._require("supported")
        return max(len(c) for c in self.candidates)

    def build_plan_at_index(self, index: int) -> "Graph":
        self._require("supported")
        count = self.get_execution_plan_count()
        if type(index) is not int or not 0 <= index < count:
            raise ValidationError(f"index: {index!r} outside 0..{count - 1}", arg="index")
        self.chosen = [min(index, len(c) - 1) for c in self.candidates]
        return self.build_plans("heuristic")

    def execute_plan_at_index(self, variant_pack, workspace=None, index: int = 0, stream=None):
        self.build_plan_at_index(index)
        return self.execute(variant_pack, workspace, stream)

    def get_workspace_size(self) -> int:
        """Bytes of workspace an execute at the built dims needs: materialized virtual tensors and
        the scratch buffers of anchor kernels."""
        self._require("fused")
        plans = [None if g.anchor is None else self._anchor_plan(g, self._built_operands(g), tile=self._chosen_spec(i))
                 for i, g in enumerate(self.groups)]
        return self._workspace_layout(self._shapes([t.dims for t in self._io]), plans)[2]

    def _launch_specs(self, index: int, spec) -> tuple:
        """Every kernel candidate ``spec`` of group ``index`` launches (anchor plans: several)."""
        group = self.groups[index]
        if group.anchor is None:
            return (spec,)
        plan = self._anchor_plan(group, self._built_operands(group), tile=spec)
        return tuple(dict.fromkeys(launch.spec for launch in plan.launches))

    def _chosen_spec(self, index: int):
        return self.candidates[index][self.chosen[index]] if len(self.chosen) > index else None

    def explain(self) -> str:
        """Kernel groups, their candidates, the chosen plans and their spec uris."""
        lines = [f"graph '{self.name}' ({self._state}): {len(self.nodes)} ops in {len(self.groups)} kernels, "
                 f"workspace {self.get_workspace_size() if self.groups else 0} bytes"]
        for index, group in enumerate(self.groups):
            lines.append(f"  kernel {index}: {group.describe()}")
            for c, spec in enumerate(self.candidates[index] if index < len(self.candidates) else []):
                mark = "*" if self.chosen and self.chosen[index] == c else " "
                lines.append(f"    {mark} [{c}] {spec.uri}")
            for spec, reason in (self.rejected[index] if index < len(self.rejected) else []):
                lines.append(f"      dropped {spec.uri}: {reason}")
        return "\n".join(lines)

    # -- execution ---------------------------------------------------------------------------------
    def execute(self, variant_pack, workspace=None, stream=None, backend: str = "cuda"):
        """Run the built graph. Keys: tensors, uids or names; values: device arrays.

        No allocation and no host synchronization: capturable into a CUDA graph.
        ``backend="numpy"`` runs the float64 reference on NumPy arrays instead: inputs hold the
        tensors' data types as on the device, outputs those or float64 (the reference unrounded).
        """
        if backend == "numpy":
            return self._execute_numpy(variant_pack)
        if backend != "cuda":
            raise ValidationError(f"backend: {backend!r} is not 'cuda' or 'numpy'", arg="backend")
        key, values = self._repeat_key(variant_pack, workspace)
        repeat = self._repeats.get(key) if key is not None else None
        if repeat is not None:  # checked and planned before: place the arrays and launch
            order, runs = repeat
            bound = [None] * len(order)
            for slot, value in zip(order, values):
                bound[slot] = value
            for run in runs:
                _run_group(run, bound, stream)
            return
        try:
            bound = self._bind(variant_pack)
        except Exception as exc:
            if type(exc).__name__ == "CUDARuntimeError":
                raise DeviceError(f"execute: no usable CUDA device ({exc}); backend='numpy' runs anywhere",
                                  arg="device") from exc
            raise
        runs = self._launches(bound, workspace)
        for run in runs:
            _run_group(run, bound, stream)
        if key is not None and len(key) - 2 == len(self._io):  # every array named once: keep for repeats
            order = tuple(self._slot[k] for k in variant_pack)
            if len(set(order)) == len(order):
                if len(self._repeats) >= PREPARED_LIMIT:
                    self._repeats.pop(next(iter(self._repeats)))
                self._repeats[key] = (order, runs)

    def _repeat_key(self, variant_pack, workspace):
        """What decides a repeat execute's launches, read cheaply: each pack entry's name and its
        array's shape, strides, data type, 16-byte alignment and device, the workspace's address,
        the current device. (None, None) for packs of other arrays than CuPy's."""
        cp = arrays.cupy()
        try:
            key = [cp.cuda.runtime.getDevice(), None if workspace is None else workspace.data.ptr]
        except Exception:  # no usable device: the full path says so
            return None, None
        ndarray, values = cp.ndarray, []
        for name, value in variant_pack.items():
            if type(value) is not ndarray:
                return None, None
            data = value.data
            key.append((name, value.shape, value.strides, value.dtype, data.ptr & 15, data.device_id))
            values.append(value)
        return tuple(key), values

    def _launches(self, bound, workspace) -> list:
        """Per group its launches for these arrays: planned once per signature (shapes, strides,
        alignment)."""
        if self._state != "built":
            self._require("built")
        device = arrays.cupy().cuda.runtime.getDevice()
        key = (device, None if workspace is None else workspace.data.ptr,
               *[(a.shape, a.strides, a.dtype, a.data.ptr % 16, a.data.device_id) for a in bound])
        launches = self._prepared.get(key)
        if launches is None:
            if len(self._prepared) >= PREPARED_LIMIT:  # keyed by addresses: callers that allocate per
                self._prepared.pop(next(iter(self._prepared)))  # call must not pin every buffer
            launches = self._prepared[key] = self._prepare(bound, workspace, device)
        return launches

    def _bind(self, variant_pack) -> list:
        bound = [None] * len(self._io)
        cp = arrays.cupy()
        for key, value in variant_pack.items():
            index = self._slot.get(key) if not isinstance(key, Tensor) or key.graph is self else None
            if index is None:
                raise ValidationError(f"variant_pack: {key!r} is not an input or output of graph '{self.name}' "
                                      f"(known: {', '.join(t.name for t in self._io)})", arg="variant_pack")
            if type(value) is not cp.ndarray:
                if isinstance(value, np.ndarray):  # a copy would lose what execute writes
                    raise ValidationError(f"tensor '{self._io[index].name}': a NumPy array; execute takes device "
                                          "arrays (or use backend='numpy')", arg=self._io[index].name)
                value = arrays.to_device(value, self._io[index].name)[0]
            bound[index] = value
        for index, value in enumerate(bound):
            if value is None:
                raise ValidationError(f"variant_pack: no array for tensor '{self._io[index].name}'",
                                      arg=self._io[index].name)
        return bound

    def _check_arrays(self, bound, exact_outputs: bool = False) -> dict[int, tuple]:
        """Every array (one per io tensor, in slot order) against its tensor: its data type, its
        rank, and for outputs the shape their nodes make of the inputs; the dims of every tensor.
        The device and the NumPy backend check alike, except that the NumPy backend's outputs may
        be float64 (``exact_outputs``) to receive the reference unrounded."""
        for t, a in zip(self._io, bound):
            exact = exact_outputs and t.producer is not None and a.dtype == np.float64
            if not (exact or _holds(a, t.data_type)):
                raise DTypeError(f"tensor '{t.name}': array is {a.dtype}, the tensor is {t.data_type}", arg=t.name)
            if a.ndim != len(t.dims):
                raise ValidationError(f"tensor '{t.name}': array has {a.ndim} dims, the tensor {len(t.dims)}",
                                      arg=t.name)
        shapes = self._shapes([a.shape for a in bound])
        for t, a in zip(self._io, bound):
            if t.producer is not None and a.shape != shapes[t.uid]:
                raise ValidationError(f"tensor '{t.name}': array shape {a.shape} should be {shapes[t.uid]}, "
                                      "what its node makes of its inputs", arg=t.name)
        return shapes

    def _prepare(self, bound, workspace, device) -> list:
        """Check every array against its tensor, plan each group for these shapes, place the
        workspace, and bind every pointer."""
        for t, a in zip(self._io, bound):
            if a.data.device_id != device:
                raise DeviceError(f"tensor '{t.name}': array is on device {a.data.device_id}, the current device "
                                  f"is {device}", arg=t.name)
        shapes = self._check_arrays(bound)
        for t, a in zip(self._io, bound):
            if t.producer is None:
                continue
            want = self._out_strides(t, shapes, bound)
            if tuple(s // a.itemsize for s in a.strides) != want and a.size > 1:
                raise ValidationError(f"tensor '{t.name}': an output array must have strides {list(want)} (packed "
                                      f"in the layout its kernel writes), got {[s // a.itemsize for s in a.strides]}",
                                      arg=t.name)
        plans = []
        for index, group in enumerate(self.groups):
            spec = self.candidates[index][self.chosen[index]]
            result = group.output
            align = 16 if result.is_virtual else arrays.alignment(bound[self._slot[result]].data.ptr)
            if group.anchor is None:
                operands = [self._operand_now(t, bound, shapes) for t in group.inputs]
                launch = self._plan(group, operands, spec, align)
                got = [launch.spec]
            else:
                operands = {role: self._operand_now(t, bound, shapes) for role, t in group.roles.items()}
                launch = self._anchor_plan(group, operands, align, spec)
                got = [lp.spec for lp in launch.launches]
            missing = [s for s in got if s not in self.binaries]
            if missing and group.anchor is None:
                raise ValidationError(self._static_change(group, bound, got[0], spec), arg="dims")
            if missing:
                raise ValidationError(f"kernel {index} ({group.describe()}): these shapes need kernels the build "
                                      f"did not make ({missing[0].uri}); rebuild the graph for them", arg="dims")
            plans.append(launch)
        offsets, scratch, needed = self._workspace_layout(shapes, [p if g.anchor is not None else None
                                                                   for p, g in zip(plans, self.groups)])
        if needed and (workspace is None or workspace.nbytes < needed):
            have = "none" if workspace is None else f"{workspace.nbytes} bytes"
            raise ValidationError(f"workspace: this execute needs {needed} bytes, got {have} "
                                  "(get_workspace_size() for the built dims)", arg="workspace")

        def place(t):  # ("io", slot) and no view, or ("ws",) and a workspace view of the tensor
            if not t.is_virtual:
                return ("io", self._slot[t]), None
            size = math.prod(shapes[t.uid]) * dtypes.BY_NAME[t.data_type].itemsize
            return ("ws",), workspace[offsets[t.uid]:offsets[t.uid] + size].view(dtypes.BY_NAME[t.data_type].np)

        runs = []
        for index, (group, launch) in enumerate(zip(self.groups, plans)):
            placed = [place(t) for t in group.outputs]
            outputs = [slot if view is None else ("ws", view) for slot, view in placed]
            if group.anchor is None:
                pairs = [place(t) for t in (group.output, *group.inputs)]
                tail = launch.int_args + tuple(np.float32(p) for p in group.params)
                fn = runtime.function(self.binaries[launch.spec], device, dependent=launch.spec.dependent_launch)
                runs.append(_GroupRun([(_Launch(fn, launch.grid, launch.block, tuple(s for s, _ in pairs), tail),
                                        [v for _, v in pairs])], outputs))
                continue
            schema = ANCHORS[group.anchor.op]
            by_role = {**group.roles, schema.outputs[0]: group.output,
                       **dict(zip(schema.outputs[1:], group.anchor.outputs[1:])),
                       **{n.op: n.output for n in group.folded}}
            launches = []
            for lp in launch.launches:
                slots, pointers = [], []
                for role in lp.pointers:
                    if role.startswith("scratch"):
                        at = scratch[(index, int(role[len("scratch"):]))]
                        slots.append(("ws",)), pointers.append(workspace[at:])
                    else:
                        slot, view = place(by_role[role])
                        slots.append(slot), pointers.append(view)
                fn = runtime.function(self.binaries[lp.spec], device, lp.shared_mem, lp.spec.dependent_launch)
                grid = runtime.resident_grid(fn, lp.spec, lp.grid, lp.block, lp.shared_mem)
                launches.append((_Launch(fn, grid, lp.block, tuple(slots), lp.args, lp.shared_mem,
                                         launcher.has_deferred(lp.args)), pointers))
            runs.append(_GroupRun(launches, outputs))
        return runs

    def _operand_now(self, t: Tensor, bound, shapes) -> pointwise.Operand:
        if t.is_virtual:  # materialized in the workspace: packed in its layout, 256-byte aligned
            return pointwise.Operand(t.data_type, shapes[t.uid], self._out_strides(t, shapes, bound))
        a = bound[self._slot[t]]
        return pointwise.Operand(t.data_type, a.shape, tuple(s // a.itemsize for s in a.strides),
                                 arrays.alignment(a.data.ptr))

    def _out_strides(self, t: Tensor, shapes, bound) -> tuple:
        """The strides its kernel writes ``t`` with at these shapes: packed for pointwise kernels;
        an anchor's inferred layout for its outputs and for the end of its fused epilogue."""
        node = self._epilogue_of.get(t.uid, t.producer)
        if node.op not in ANCHORS:
            return contiguous_strides(shapes[t.uid])
        metas = {r: Meta(shapes[i.uid], tuple(self._operand_now(i, bound, shapes).strides), i.data_type)
                 for r, i in zip(node.roles, node.inputs)}
        index = node.outputs.index(t) if t in node.outputs else 0
        return ANCHORS[node.op].infer(dict(node.attrs), metas)[index].strides

    def _plan(self, group, operands, spec=None, out_align=16):
        out = group.output
        pattern = pointwise.Pattern.of(out.dims, [t.dims for t in group.inputs])
        try:
            return pointwise.plan(group.steps, operands, out.data_type, names=[t.name for t in group.inputs],
                                  out_align=out_align, tile=spec, pattern=pattern)
        except ValidationError as exc:
            raise ValidationError(f"kernel {self.groups.index(group)} ({group.describe()}): {exc}",
                                  arg=exc.arg) from None

    def _anchor_plan(self, group, operands: dict, out_align: int = 16, tile=None):
        """The family plan of an anchor group for these operands (role -> Operand)."""
        epilogue = Epilogue(tuple(group.steps), tuple(group.params), group.output.data_type, out_align, tile,
                            self.arch, tuple(n.op for n in group.folded))
        try:
            return ANCHORS[group.anchor.op].plan(dict(group.anchor.attrs), operands, epilogue)
        except ValidationError as exc:
            raise ValidationError(f"kernel {self.groups.index(group)} ({group.describe()}): {exc}",
                                  arg=exc.arg) from None

    def _built_operands(self, group) -> dict:
        return {role: self._operand(t) for role, t in group.roles.items()}

    def _static_change(self, group, bound, got, built) -> str:
        """Name the tensor and dim whose change alters the kernel: a last dim that breaks the
        built vector width, a dim that became (or stopped being) 1, or else strides/alignment."""
        arrays_of = [(t, bound[self._slot[t]]) for t in group.inputs + [group.output] if not t.is_virtual]
        change = f"changes the kernel ({built.uri} -> {got.uri}); rebuild the graph for this shape"
        for t, a in arrays_of:
            if got.vec < built.vec and a.ndim and a.shape[-1] != t.dims[-1] and a.shape[-1] % built.vec:
                return (f"tensor '{t.name}' dim {a.ndim - 1}: {a.shape[-1]} instead of the built {t.dims[-1]} is "
                        f"not a multiple of the built vector width {built.vec}: the vector width is static and "
                        + change)
        for t, a in arrays_of:
            for d, (size, built_size) in enumerate(zip(a.shape, t.dims)):
                if size != built_size and 1 in (size, built_size):
                    return (f"tensor '{t.name}' dim {d}: {size} instead of the built {built_size} changes the "
                            "broadcast pattern, which is static: " + change)
        for t, a in arrays_of:
            strides = tuple(s // a.itemsize for s in a.strides)
            if strides != t.strides or arrays.alignment(a.data.ptr) < t.alignment:
                return (f"tensor '{t.name}': strides {list(strides)} / address alignment "
                        f"{arrays.alignment(a.data.ptr)} differ from the built {list(t.strides)} / {t.alignment} "
                        f"and change the kernel ({built.uri} -> {got.uri}); rebuild the graph for these arrays")
        return f"the new shapes {change}"

    def _shapes(self, io_dims) -> dict[int, tuple]:
        """Dims of every tensor for the given io dims (virtual ones by broadcasting)."""
        shapes = {t.uid: tuple(d) for t, d in zip(self._io, io_dims) if t.producer is None}
        for node in self.nodes:
            if node.op in ANCHORS:
                metas = {r: Meta(shapes[t.uid], contiguous_strides(shapes[t.uid]), t.data_type)
                         for r, t in zip(node.roles, node.inputs)}
                for t, meta in zip(node.outputs, ANCHORS[node.op].output_metas(dict(node.attrs), metas)):
                    shapes[t.uid] = tuple(meta.dims)
            else:
                shapes[node.output.uid] = pointwise.broadcast_shape([shapes[t.uid] for t in node.inputs],
                                                                    [t.name for t in node.inputs])
        return shapes

    def _workspace_layout(self, shapes, plans) -> tuple[dict[int, int], dict, int]:
        """Byte offsets of the materialized virtual tensors (group outputs), of each anchor plan's
        scratch buffers ((group, k) -> offset), and the total."""
        offsets, scratch, total = {}, {}, 0

        def take(nbytes):
            nonlocal total
            at, total = total, total + -(-nbytes // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
            return at

        for index, group in enumerate(self.groups):
            for t in group.outputs:
                if t.is_virtual:
                    offsets[t.uid] = take(math.prod(shapes[t.uid]) * dtypes.BY_NAME[t.data_type].itemsize)
            for k, nbytes in enumerate(plans[index].scratch if plans[index] is not None else ()):
                scratch[(index, k)] = take(nbytes)
        return offsets, scratch, total

    def _execute_numpy(self, variant_pack):
        """Float64 NumPy reference of every node; results written into the pack's arrays, which
        are checked as the device path checks them (data types, ranks, shapes)."""
        if _STATES.index(self._state) < _STATES.index("fused"):
            self.validate().build_operation_graph()
        bound = [None] * len(self._io)
        for key, value in variant_pack.items():
            index = self._slot.get(key) if not isinstance(key, Tensor) or key.graph is self else None
            if index is None:
                raise ValidationError(f"variant_pack: {key!r} is not an input or output of graph '{self.name}'",
                                      arg="variant_pack")
            if not isinstance(value, np.ndarray):
                raise ValidationError(f"tensor '{self._io[index].name}': the numpy backend takes NumPy arrays, got "
                                      f"{type(value).__name__}", arg=self._io[index].name)
            bound[index] = value
        for t, value in zip(self._io, bound):
            if value is None:
                raise ValidationError(f"variant_pack: no array for tensor '{t.name}'", arg=t.name)
        self._check_arrays(bound, exact_outputs=True)
        values = {t.uid: a for t, a in zip(self._io, bound) if t.producer is None}
        for node in self.nodes:
            args = [_float64(values[t.uid], t.data_type) for t in node.inputs]
            if node.op in ANCHORS:
                results = ANCHORS[node.op].reference(dict(node.attrs), dict(zip(node.roles, args)))
                values.update((t.uid, np.asarray(r)) for t, r in zip(node.outputs, results))
            else:
                values[node.output.uid] = np.asarray(SCHEMAS[node.op].reference(*args, *node.params))
        for t, target in zip(self._io, bound):
            if t.producer is None:
                continue
            kind = dtypes.BY_NAME[t.data_type]
            with np.errstate(over="ignore"):  # a value beyond the type's range becomes inf, as on the device
                if _fp8_bytes(target, kind.name):  # quantized bytes
                    target[...] = values[t.uid].astype(kind.host).view(np.uint8)
                else:
                    target[...] = values[t.uid].astype(target.dtype)

    # -- blobs and CUDA graphs ---------------------------------------------------------------------
    def serialize(self, key: bytes | None = None) -> bytes:
        """The built graph as a plan blob (see nvdnn.plan): loads elsewhere without compiling.
        ``key`` (or NVDNN_PLAN_KEY_FILE): sign it with HMAC-SHA256."""
        from .. import plan
        return plan.serialize(self, key)

    @staticmethod
    def deserialize(blob: bytes, key: bytes | None = None) -> "Graph":
        """A built graph from a blob, verified in full first; compiles nothing. ``key`` (or
        NVDNN_PLAN_KEY_FILE): refuse the blob unless it carries that key's signature."""
        from .. import plan
        return plan.deserialize(blob, key)

    def capture(self, variant_pack, workspace=None) -> "CapturedGraph":
        """Capture one execute on these fixed buffers into a CUDA graph; replay it with ``.replay()``."""
        cp = arrays.cupy()
        bound = self._bind(variant_pack)
        self._launches(bound, workspace)  # plan and load modules outside the capture
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                self.execute(variant_pack, workspace, stream=stream)
            finally:
                cuda_graph = stream.end_capture()
        kernels = sum(len(run.launches) for run in self._launches(bound, workspace))
        return CapturedGraph(cuda_graph, stream, kernels, (bound, workspace))

    # -- helpers -----------------------------------------------------------------------------------
    def _operand(self, t: Tensor) -> pointwise.Operand:
        if t.is_virtual:  # materialized in the workspace: packed in its layout, 256-byte aligned
            return pointwise.Operand(t.data_type, t.dims, t.strides)
        return pointwise.Operand(t.data_type, t.dims, t.strides, t.alignment)

    def _arch(self, device: int | None = None) -> str:
        return self.arch if self.arch is not None else compiler.device_arch(device)

    def _require(self, state: str):
        if _STATES.index(self._state) < _STATES.index(state):
            steps = ("validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans")
            raise ValidationError(f"graph '{self.name}' is {self._state}; run {steps[_STATES.index(self._state)]}() "
                                  f"first (or build())", arg="graph")

    def _tuned_choice(self, index: int) -> int:
        from ..autotune import tuned_index
        return tuned_index(self.candidates[index], self._arch(), math.prod(self.groups[index].output.dims))

    def autotune(self, variant_pack, workspace=None, *, repeat: int = 20, warmup: int = 3) -> list[dict]:
        """Time every candidate on these buffers, keep the fastest, record all timings (see autotune)."""
        from ..autotune import autotune
        return autotune(self, variant_pack, workspace, repeat=repeat, warmup=warmup)


def _anchor_method(op: str):
    schema = ANCHORS[op]

    def method(self, *tensors, name=None, **kwargs):
        if len(tensors) > len(schema.roles):
            raise ValidationError(f"{op}: takes up to {len(schema.roles)} tensors ({', '.join(schema.roles)}), "
                                  f"got {len(tensors)}", arg=op)
        inputs = dict(zip(schema.roles, tensors))
        for key in [k for k in kwargs if k in schema.roles]:
            if key in inputs:
                raise ValidationError(f"{op}: '{key}' given twice", arg=key)
            inputs[key] = kwargs.pop(key)
        return self._anchor(op, inputs, kwargs, name)

    method.__name__ = op
    method.__doc__ = (f"{op}({', '.join(schema.inputs)}; {', '.join(f'{k}={v!r}' for k, v, _ in schema.attrs)}) "
                      f"as a graph node -> {', '.join(schema.outputs)} (optional inputs end in '?').")
    return method


for _op in ANCHORS:
    setattr(Graph, _op, _anchor_method(_op))
del _op


def _fp8_bytes(array, data_type: str) -> bool:
    """Whether ``array`` is the uint8 storage of a tensor of a type stored as bytes (fp8)."""
    return array.dtype == np.uint8 and dtypes.BY_NAME[data_type].storage_name == "numpy.uint8"


def _holds(array, data_type: str) -> bool:
    """Whether ``array`` holds ``data_type``: its own type, or uint8 bytes of a declared fp8 type."""
    if array.dtype == np.uint8:
        return _fp8_bytes(array, data_type)
    return array.dtype.name == dtypes.BY_NAME[data_type].numpy_name


def _float64(value, data_type: str) -> np.ndarray:
    """A NumPy array's values in float64; uint8 arrays of fp8 tensors are decoded (ml_dtypes)."""
    if _fp8_bytes(value, data_type):
        value = value.view(dtypes.BY_NAME[data_type].host)
    return np.asarray(value, dtype=np.float64)


def _run_group(run: _GroupRun, bound, stream=None) -> None:
    for launch, pointers in run.launches:
        args = [bound[s[1]] if s[0] == "io" else pointers[i] for i, s in enumerate(launch.slots)]
        callsite.launch(launch.function, launch.grid, launch.block, (*args, *launch.tail), launch.shared_mem, stream,
                        launch.deferred)


class CapturedGraph:
    """An execute captured into a CUDA graph on fixed buffers (kept alive here)."""

    def __init__(self, cuda_graph, stream, kernels: int, buffers):
        self.cuda_graph, self.stream, self.kernels, self._buffers = cuda_graph, stream, kernels, buffers

    def replay(self, stream=None) -> None:
        self.cuda_graph.launch(stream if stream is not None else self.stream)
