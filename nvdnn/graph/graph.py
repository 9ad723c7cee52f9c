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

import numpy as np

from .. import arrays, compiler, dtypes, fusion
from ..cache import KernelBinary, default_cache
from ..errors import DTypeError, UnsupportedError, ValidationError
from .. import kernels
from ..kernels import pointwise
from .anchors import ANCHORS, Meta
from .execution import _STATES, Execution
from .ops import SCHEMAS
from .rules import SCALAR, check_dims, check_extent
from .tensor import Tensor, contiguous_strides



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


class Graph(Execution):
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

    def _new_tensor(self, dims, strides, data_type, name, uid, is_virtual, follows_io=False) -> Tensor:
        if uid is None:
            uid = max(self.tensors, default=0) + 1
        if type(uid) is not int or uid < 0:
            raise ValidationError(f"uid: {uid!r} is not a non-negative int", arg="uid")
        if uid in self.tensors:
            raise ValidationError(f"uid: {uid} is already used by {self.tensors[uid]}", arg="uid")
        name = name if name is not None else f"t{uid}"
        if name in self._names:
            raise ValidationError(f"tensor name: '{name}' is already used in graph '{self.name}'", arg="name")
        tensor = Tensor(self, uid, name, dims, strides, data_type, is_virtual, follows_io=follows_io)
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
                               True, follows_io=True)
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
        except ValidationError as exc:  # the same class (a DTypeError stays one), named by the node
            raise type(exc)(f"node '{node_name}' ({op}): {exc}", arg=exc.arg) from None
        outputs = []
        for k, (role, meta) in enumerate(zip(schema.outputs, metas)):
            uid, out_name = outs[k] if outs else (None, None)
            if out_name is None:
                out_name = name if k == 0 and name and name not in self._names else f"{node_name}.{role}"
            outputs.append(self._new_tensor(meta.dims, meta.strides, meta.data_type or self.intermediate_data_type,
                                            out_name, uid, True, follows_io=meta.data_type is None))
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
        for node in self.nodes:  # layouts flow as fused (what execute plans): conv NHWC -> relu -> conv NHWC
            if node.op in ANCHORS:
                metas = {r: Meta(t.dims, t.strides, t.data_type) for r, t in zip(node.roles, node.inputs)}
                for t, meta in zip(node.outputs, ANCHORS[node.op].infer(dict(node.attrs), metas)):
                    t.strides = tuple(meta.strides)
            if node.output.uid in self._epilogue_of:
                node.output.strides = self._epilogue_of[node.output.uid].output.strides
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
            if group.anchor is not None and len(self.chosen) > index:  # a plan of several launches: each one
                plan = self._anchor_plan(group, self._built_operands(group), tile=self._chosen_spec(index))
                if len(plan.launches) > 1:
                    lines.append("      launches: " + " -> ".join(launch.spec.uri for launch in plan.launches))
        return "\n".join(lines)

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
