"""Graph execution: binding arrays to a built graph's tensors, planning its kernels for their
shapes (once per signature), placing the workspace, launching; the float64 NumPy backend; CUDA
graph capture. A mixin of Graph (graph.py holds building and the five steps)."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .. import arrays, callsite, dtypes, runtime
from ..errors import DeviceError, DTypeError, NvdnnError, ValidationError
from ..kernels import pointwise
from .anchors import ANCHORS, Epilogue, Meta
from .ops import SCHEMAS
from .tensor import Tensor, contiguous_strides

_STATES = ("new", "validated", "fused", "planned", "supported", "built")
WORKSPACE_ALIGN = 256
PREPARED_LIMIT = 64  # signatures (shapes, strides, workspace address) a built graph keeps planned


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


class Execution:
    """Graph's execute, its repeat path, the NumPy backend and capture."""

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
            order, runs, graphs = repeat
            bound = [None] * len(order)
            for slot, value in zip(order, values):
                bound[slot] = value
            if graphs is not None and _replayed(graphs, runs, bound, values, stream):
                return
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
                several = sum(len(run.launches) for run in runs) > 1
                self._repeats[key] = (order, runs, {} if several else None)

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
            got = tuple(s // a.itemsize for s in a.strides)
            if a.size > 1 and any(g != w for g, w, n in zip(got, want, a.shape) if n > 1):  # a dim of 1: any stride
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
                runs.append(_GroupRun([(_Launch(fn, launch.grid, launch.block, tuple(s for s, _ in pairs),
                                                _constants(fn, tail)),
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
                fn = runtime.function(self.binaries[lp.spec], device, lp.shared_mem, lp.spec.dependent_launch,
                                      lp.spec.cooperative)
                grid = runtime.resident_grid(fn, lp.spec, lp.grid, lp.block, lp.shared_mem)
                deferred = callsite.has_deferred(lp.args)
                launches.append((_Launch(fn, grid, lp.block, tuple(slots), _constants(fn, lp.args, deferred),
                                         lp.shared_mem, deferred), pointers))
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
                            self.arch, tuple(n.op for n in group.folded),
                            tuple(t.data_type for t in group.anchor.outputs),
                            dict(group.norm.attrs)["eps"] if group.norm is not None else None)
        schema = ANCHORS[group.anchor.op]
        try:
            plan = schema.plan(dict(group.anchor.attrs), operands, epilogue)
        except ValidationError as exc:
            raise ValidationError(f"kernel {self.groups.index(group)} ({group.describe()}): {exc}",
                                  arg=exc.arg) from None
        known = {*group.roles, *schema.outputs, *(n.op for n in group.folded)}
        for launch in plan.launches:   # execute binds pointers by these names: a stray one is a family bug
            stray = [r for r in launch.pointers if r not in known and not r.startswith("scratch")]
            if stray:
                raise NvdnnError(f"internal: {group.anchor.op}'s plan ({launch.spec.uri}) names pointers "
                                 f"{stray}, not roles of the op ({sorted(known)})")
        return plan

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


GRAPH_AFTER = 2   # executes of a several-kernel graph on the same arrays before they run as one CUDA graph
GRAPHS_KEPT = 8   # CUDA graphs a repeat signature keeps (by the arrays' addresses)


def _replayed(graphs: dict, runs, bound, values, stream) -> bool:
    """Run a several-kernel execute as one CUDA graph launch where the same arrays (addresses)
    came GRAPH_AFTER times: one launch from the host instead of one per kernel. False: launch
    the kernels one by one (not yet; inside a capture or a recorded functional call)."""
    if callsite.recording() is not None:
        return False
    cp = arrays.cupy()
    target = stream if stream is not None else cp.cuda.get_current_stream()
    addresses = tuple(v.data.ptr for v in values)
    found = graphs.get(addresses)
    if found is None:
        if len(graphs) >= GRAPHS_KEPT:
            graphs.pop(next(iter(graphs)))
        found = graphs[addresses] = [0, None]
    if found[1] is None:
        found[0] += 1
        if found[0] < GRAPH_AFTER or target.is_capturing():
            return False
        found[1] = _capture(runs, bound)
        if found[1] is None:
            found[0] = -(1 << 30)  # this driver would not capture it: launch one by one from now on
            return False
    elif target.is_capturing():
        return False
    found[1].launch(target)
    return True


def _capture(runs, bound):
    """The runs' launches recorded on a side stream as a CUDA graph (nothing runs); None where
    the capture fails."""
    cp = arrays.cupy()
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        side.begin_capture()
        try:
            for run in runs:
                _run_group(run, bound, side)
        except Exception:
            side.end_capture()
            return None
        return side.end_capture()


def _fp8_bytes(array, data_type: str) -> bool:
    """Whether ``array`` is the uint8 storage of a tensor of a type stored as bytes (fp8)."""
    return array.dtype == np.uint8 and dtypes.BY_NAME[data_type].storage_name == "numpy.uint8"


def _holds(array, data_type: str) -> bool:
    """Whether ``array`` holds ``data_type``: its own type, or uint8 bytes of a declared fp8 type."""
    if array.dtype == np.uint8:
        return _fp8_bytes(array, data_type)
    return array.dtype.name == dtypes.BY_NAME[data_type].numpy_name


def _float64(value, data_type: str) -> np.ndarray:
    """A NumPy array's values in float64; uint8 arrays of fp8 tensors are decoded (ml_dtypes);
    integer tensors (lengths, block tables, seeds) keep their exact values."""
    if not dtypes.BY_NAME[data_type].is_float:
        return np.asarray(value)
    if _fp8_bytes(value, data_type):
        value = value.view(dtypes.BY_NAME[data_type].host)
    return np.asarray(value, dtype=np.float64)


_SCALARS = (np.int32, np.uint32, np.int64, np.float32, np.float64)  # not np.uint64: an address stays visible


def _constants(fn, tail: tuple, deferred: bool = False) -> tuple:
    """A launch's scalar arguments as a CuPy launch takes them fastest (callsite.cupy_argument).
    Dependent launches pack NumPy scalars themselves; arguments resolved at launch stay."""
    if deferred or isinstance(fn, runtime.LaunchExFunction):
        return tail
    return tuple(callsite.cupy_argument(a) if type(a) in _SCALARS else a for a in tail)


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
