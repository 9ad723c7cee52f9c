"""Whole-model presets for `nvdnn warm --preset <model>`: the kernels a model's layers need.

A model is a table of layers (op, tensors with symbolic dims, data type, layout, attributes,
the pointwise ops after it) and a few named parameters. Each layer is planned the way the
library plans it at run time: a one-node graph (plus its fused ops) built for the target arch
without a GPU, taken through validate .. check_support, and the kernels its heuristic plan
launches collected (with ``candidates=True``, every autotune candidate's too). A program that
later runs those layers on that arch finds each kernel in the cache.

Linear layers are declared as a program writes them (nn.Linear's packed (N, K) weight, used
as ``x @ w.T``), so the warmed GEMM is the one the program asks for. Layers whose op has no
kernel family yet are checked at run time against the anchor op table and reported as
skipped, one line per op, never dropped silently.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Callable

from . import compiler
from .errors import NvdnnError, ValidationError
from .model_params import Param
from .spec import KernelSpec


# -- describing a model ---------------------------------------------------------------------------

@dataclass(frozen=True)
class T:
    """A layer's tensor: dims (NCHW order for images) as ints or names of model values; its data
    type ("io": the model's) and layout: "packed", "NHWC", "io" (the model's image layout),
    "memory" (the packed array in the model's memory order: (N, H, W, C) for NHWC) or
    "transposed" (the transpose of a packed array: a linear layer's ``w.T``)."""
    dims: tuple
    dtype: str = "io"
    layout: str = "packed"


def act(*dims) -> T:
    """An activation tensor in the model's type and layout."""
    return T(dims, "io", "io")


def f32(*dims) -> T:
    """A packed float32 tensor (batch-norm statistics and parameters, saved norm statistics)."""
    return T(dims, "float32")


def io(*dims) -> T:
    """A packed tensor in the model's type."""
    return T(dims)


def weight(*dims) -> T:
    """A conv weight (K, C, R, S) in the model's type and image layout: KRSC for a channels-last
    model (PyTorch's channels_last converts weights too), KCRS for NCHW."""
    return T(dims, "io", "io")


def linear_weight(k, n) -> T:
    """A linear layer's weight as a program passes it to matmul: nn.Linear keeps it packed as
    (N, K) and multiplies by its transpose (``x @ w.T``), a (K, N) operand with unit stride along K."""
    return T((k, n), "io", "transposed")


@dataclass(frozen=True)
class Layer:
    """One row of a model table. ``op``: an anchor op (nvdnn.graph.anchors), a pointwise graph op
    (its first inputs are its operands), or an op with no family yet (skipped). ``then``: graph
    ops on the result, a name for a unary op ("relu") or (op, input role) for a binary one.
    ``count``: how often the model runs the layer (for the summary). ``only``: (parameter,
    value) pairs the row needs (e.g. ("training", True))."""
    name: str
    op: str
    inputs: tuple                     # ((role, T), ...): anchor roles, or positional for other ops
    attrs: tuple = ()                 # ((name, value), ...)
    then: tuple = ()
    count: int = 1
    only: tuple = ()
    out: str | None = None            # the result's data type where it is not the model's (a float32 GEMM)


def layer(name, op, inputs: dict, attrs: dict | None = None, then=(), count=1, only: dict | None = None,
          out: str | None = None) -> Layer:
    return Layer(name, op, tuple(inputs.items()), tuple((attrs or {}).items()), tuple(then), count,
                 tuple((only or {}).items()), out)


@dataclass(frozen=True)
class Model:
    name: str
    summary: str
    params: tuple                                     # Param rows
    layers: tuple                                     # Layer rows (symbolic)
    variants: Callable[[dict], list[dict]]            # parameters -> concrete value sets
    kernels: Callable[[dict], list] | None = None     # a variant -> the specs of its calls no graph op plans

    def parse(self, given: dict[str, str]) -> dict:
        known = {p.name: p for p in self.params}
        for key in given:
            if key not in known:
                raise ValidationError(f"--param {key}: unknown parameter of preset {self.name}; it takes "
                                      f"{', '.join(known)}", arg=key)
        return {p.name: p.parse(given.get(p.name, p.default), self.name) for p in self.params}

    def describe(self, width: int = 100) -> str:
        """For `nvdnn warm --help`: the summary, then each parameter with its default."""
        import textwrap
        params = "; ".join(f"{p.name}={p.default}: {p.help}" for p in self.params)
        return "\n".join([textwrap.fill(f"{self.name}: {self.summary}", width, initial_indent="  ",
                                         subsequent_indent="      "),
                          textwrap.fill(params, width, initial_indent="      ", subsequent_indent="      ")])


# -- ResNet-50 ------------------------------------------------------------------------------------
# torchvision's ResNet-50 (v1.5: the stride sits in each stage's first 3x3 conv), its convs as the
# graph op conv_fprop (what nvdnn.conv2d plans). Every conv is followed by a batch norm (inference
# form, float32 statistics and affine parameters); a bottleneck block ends in a residual add + ReLU,
# run on the blocks' packed arrays (NHWC memory as (N, H, W, C)), as a channels-last program calls
# nvdnn.elementwise.

# bn=separate: each step its own call (conv2d, batch_norm, add + ReLU, matmul), as a program calls
# them. bn=folded: one graph with each BN folded into its conv's weight and bias on the host (what
# examples/resnet50.py builds): conv + bias + ReLU, conv + bias + residual + ReLU (the fused add),
# the downsample conv + bias, the fc layer as a 1x1 conv. training=1 (with bn=separate): each
# conv's dgrad and wgrad too.
SEPARATE, FOLDED = {"bn": "separate"}, {"bn": "folded"}


def conv(name, x, w, y, attrs, count=1, only=None, dgrad=True) -> tuple:
    """A conv_fprop row and, where the model's ``training`` is on, its conv_dgrad and conv_wgrad
    rows (dy in y's dims; dgrad not for the stem, whose input image needs no gradient)."""
    train = {**(only or {}), "training": True}
    rows = (layer(name, "conv_fprop", {"x": act(*x), "w": weight(*w)}, attrs, count=count, only=only),)
    if dgrad:
        rows += (layer(f"{name} dgrad", "conv_dgrad", {"dy": act(*y), "w": weight(*w)}, {**attrs, "x_dims": x},
                       count=count, only=train),)
    return rows + (layer(f"{name} wgrad", "conv_wgrad", {"dy": act(*y), "x": act(*x)}, {**attrs, "w_dims": w},
                         count=count, only=train),)


RESNET50_STEM = (
    *conv("conv1", ("n", 3, 224, 224), (64, 3, 7, 7), ("n", 64, 112, 112), {"stride": 2, "padding": 3}, dgrad=False,
          only=SEPARATE),
    layer("bn1", "batch_norm", {"x": act("n", 64, 112, 112), "mean": f32(64), "var": f32(64), "gamma": f32(64),
                                "beta": f32(64)}, then=("relu",), only=SEPARATE),
    layer("conv1+bn1+relu", "conv_fprop", {"x": act("n", 3, 224, 224), "w": weight(64, 3, 7, 7), "bias": f32(64)},
          {"stride": 2, "padding": 3}, then=("relu",), only=FOLDED),
    layer("maxpool", "max_pool2d", {"x": act("n", 64, 112, 112)}, {"kernel": 3, "stride": 2, "padding": 1}),
)

# (blocks, width, output channels, input side, side): each stage's input channels are the last one's output
RESNET50_STAGES = ((3, 64, 256, 56, 56), (4, 128, 512, 56, 28), (6, 256, 1024, 28, 14), (3, 512, 2048, 14, 7))


def _bn(c, side, then=(), count="blocks", only=SEPARATE) -> dict:
    return dict(inputs={"x": act("n", c, side, side), "mean": f32(c), "var": f32(c), "gamma": f32(c),
                        "beta": f32(c)}, then=then, count=count, only=only)


# One bottleneck block; names: i the block's input channels, s its input side, w the width, o the
# output channels, t the output side, stride s/t. The first block of a stage ("first") has the
# stride and the downsample branch; the other blocks ("rest") have i = o and s = t.
RESNET50_BLOCK = (
    *conv("conv1", ("n", "i", "s", "s"), ("w", "i", 1, 1), ("n", "w", "s", "s"), {"stride": 1, "padding": 0},
          count="blocks", only=SEPARATE),
    layer("bn1", "batch_norm", **_bn("w", "s", ("relu",))),
    *conv("conv2", ("n", "w", "s", "s"), ("w", "w", 3, 3), ("n", "w", "t", "t"), {"stride": "stride", "padding": 1},
          count="blocks", only=SEPARATE),
    layer("bn2", "batch_norm", **_bn("w", "t", ("relu",))),
    *conv("conv3", ("n", "w", "t", "t"), ("o", "w", 1, 1), ("n", "o", "t", "t"), {"stride": 1, "padding": 0},
          count="blocks", only=SEPARATE),
    layer("bn3", "batch_norm", **_bn("o", "t")),
    *conv("downsample.conv", ("n", "i", "s", "s"), ("o", "i", 1, 1), ("n", "o", "t", "t"),
          {"stride": "stride", "padding": 0}, only={"block": "first", **SEPARATE}),
    layer("downsample.bn", "batch_norm", **_bn("o", "t", count=1, only={"block": "first", **SEPARATE})),
    layer("add+relu", "add", {"a": T(("n", "o", "t", "t"), "io", "memory"), "b": T(("n", "o", "t", "t"), "io",
                                                                                   "memory")},
          then=("relu",), count="blocks", only=SEPARATE),
    layer("conv1+bn1+relu", "conv_fprop", {"x": act("n", "i", "s", "s"), "w": weight("w", "i", 1, 1), "bias": f32("w")},
          {"stride": 1, "padding": 0}, then=("relu",), count="blocks", only=FOLDED),
    layer("conv2+bn2+relu", "conv_fprop", {"x": act("n", "w", "s", "s"), "w": weight("w", "w", 3, 3), "bias": f32("w")},
          {"stride": "stride", "padding": 1}, then=("relu",), count="blocks", only=FOLDED),
    layer("conv3+bn3+add+relu", "conv_fprop", {"x": act("n", "w", "t", "t"), "w": weight("o", "w", 1, 1),
                                               "bias": f32("o"), "residual": act("n", "o", "t", "t")},
          {"stride": 1, "padding": 0}, then=("relu",), count="blocks", only=FOLDED),
    layer("downsample.conv+bn", "conv_fprop", {"x": act("n", "i", "s", "s"), "w": weight("o", "i", 1, 1),
                                               "bias": f32("o")},
          {"stride": "stride", "padding": 0}, only={"block": "first", **FOLDED}),
)

RESNET50_HEAD = (
    layer("avgpool", "global_avg_pool2d", {"x": act("n", 2048, 7, 7)}),
    layer("fc", "matmul", {"a": io("n", 2048), "b": linear_weight(2048, 1000), "bias": io(1000)}, only=SEPARATE),
    layer("fc", "conv_fprop", {"x": act("n", 2048, 1, 1), "w": weight(1000, 2048, 1, 1), "bias": f32(1000)},
          only=FOLDED),
)


def _resnet50_layers() -> tuple:
    """The stem, each stage's first and other blocks (values bound per row), the head."""
    rows, channels = list(RESNET50_STEM), 64
    for stage, (blocks, width, out, side_in, side) in enumerate(RESNET50_STAGES, 1):
        for block, values in (("first", dict(i=channels, s=side_in, stride=side_in // side, blocks=1)),
                              ("rest", dict(i=out, s=side, stride=1, blocks=blocks - 1))):
            values |= dict(w=width, o=out, t=side, block=block)
            rows += [_bind(row, values, f"layer{stage}.{block}.") for row in RESNET50_BLOCK
                     if all(values.get(k, v) == v for k, v in row.only)]
        channels = out
    return tuple(rows + list(RESNET50_HEAD))


def _bind(row: Layer, values: dict, prefix: str) -> Layer:
    """A row with the names in ``values`` replaced (dims, attributes, count); others stay symbolic."""
    def sub(v):
        return values.get(v, v) if isinstance(v, str) else tuple(map(sub, v)) if isinstance(v, tuple) else v
    inputs = tuple((role, replace(t, dims=tuple(sub(d) for d in t.dims))) for role, t in row.inputs)
    return replace(row, name=prefix + row.name, inputs=inputs, attrs=tuple((k, sub(v)) for k, v in row.attrs),
                   count=sub(row.count), only=tuple((k, v) for k, v in row.only if k not in values))


def _resnet50_variants(p: dict) -> list[dict]:
    auto = {"float32": "NCHW", "float16": "NHWC", "bfloat16": "NHWC"}
    pairs = dict.fromkeys((dt, auto[dt] if lay == "auto" else lay) for dt in p["dtype"] for lay in p["layout"])
    return [{"n": n, "dtype": dt, "layout": lay, "bn": bn, "training": p["training"]}
            for (dt, lay), n, bn in itertools.product(pairs, p["batch"], p["bn"])]


RESNET50 = Model(
    "resnet50", "ResNet-50 inference: the convolutions (implicit GEMM on Hopper NHWC, else im2col gather + GEMM; "
    "1x1 stride 1: the GEMM alone), batch norm (+ReLU), residual add + ReLU, max pool, global average pool, "
    "the fc layer (x @ w.T + b); "
    "with bn=folded the convs carry the folded BN's bias, ReLU and the residual add; training=1 (bn=separate): "
    "the convolutions' dgrad and wgrad too",
    (Param("batch", "ints", "1,8,32,64", "batch sizes"),
     Param("dtype", "dtypes", "float16,bfloat16,float32", "data types"),
     Param("layout", "choices:auto,NHWC,NCHW", "auto",
           "image layouts, auto: NHWC for 16-bit types and NCHW for float32"),
     Param("bn", "choices:separate,folded", "separate,folded",
           "separate: conv, batch norm, add + ReLU, matmul as separate calls; folded: BN folded into each conv "
           "(conv + bias + ReLU, conv + bias + residual + ReLU, fc as a 1x1 conv), as examples/resnet50.py"),
     Param("training", "bool", "0", "also the convolutions' backward: dgrad (GEMM + col2im, or the forward over "
           "dy at stride 1) and wgrad (gather + split-K GEMM)")),
    _resnet50_layers(), _resnet50_variants)


# -- transformer and decode (their rows: models_transformer.py), recurrent (models_rnn.py) --------
from .models_rnn import RECURRENT  # noqa: E402
from .models_transformer import DECODE, TRANSFORMER  # noqa: E402

MODELS: dict[str, Model] = {m.name: m for m in (RESNET50, TRANSFORMER, DECODE, RECURRENT)}


# -- planning ------------------------------------------------------------------------------------

@dataclass
class ModelPlan:
    """What a model preset warms: its parameters, the (spec, arch) jobs, the ops it skipped
    (op -> (layers of one model instance, reason)) and the layers that failed to plan."""
    name: str
    params: dict
    variants: int = 0
    layers: int = 0
    jobs: dict = field(default_factory=dict)          # (spec, arch) -> None, in order
    skipped: dict = field(default_factory=dict)       # op -> (layers, reason)
    failed: list = field(default_factory=list)        # (layer, variant, error)

    def lines(self) -> list[str]:
        """The summary: one line for the preset, one per skipped op, one per failure."""
        shown = ", ".join(f"{k}={_show(v)}" for k, v in self.params.items())
        out = [f"{self.name} ({shown}): {self.layers} layers x {self.variants} variants -> "
               f"{len(self.jobs)} kernels"]
        out += [f"  {op}: {reason}, {n} layer{'s' if n != 1 else ''} skipped"
                for op, (n, reason) in self.skipped.items()]
        out += [f"  FAILED to plan {name} [{variant}]: {error}" for name, variant, error in self.failed]
        return out

    def as_dict(self) -> dict:
        return {"preset": self.name, "params": {k: _plain(v) for k, v in self.params.items()},
                "variants": self.variants, "layers": self.layers, "kernels": len(self.jobs),
                "skipped": [{"op": op, "layers": n, "reason": r} for op, (n, r) in self.skipped.items()],
                "plan_failures": [{"layer": n, "variant": v, "error": e} for n, v, e in self.failed]}


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(int(value) if isinstance(value, bool)
                                                                          else value)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def parse_params(items) -> dict[str, str]:
    """``--param KEY=VALUE`` strings -> {key: value}; each key once."""
    given: dict[str, str] = {}
    for item in items or ():
        key, sep, value = str(item).partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise ValidationError(f"--param {item}: expected KEY=VALUE, e.g. --param hidden=4096", arg="param")
        if key in given:
            raise ValidationError(f"--param {key}: given twice ({given[key]} and {value}); a list is one value "
                                  "with commas, e.g. batch=1,8", arg=key)
        given[key] = value.strip()
    return given


def resolve(row: Layer, values: dict) -> tuple:
    """A row's tensors for one variant: ((role, dims, strides, dtype), ...)."""
    from .graph.tensor import contiguous_strides, nhwc_strides
    out = []
    for role, t in row.inputs:
        try:
            dims = tuple(d if isinstance(d, int) else values[d] for d in t.dims)
        except KeyError as exc:
            raise ValidationError(f"layer {row.name}: '{role}' names {exc.args[0]!r}, which is not a model value",
                                  arg=role) from None
        layout = values.get("layout", "packed") if t.layout in ("io", "memory") else t.layout
        if t.layout == "memory" and layout == "NHWC":
            dims, layout = (dims[0], *dims[2:], dims[1]), "packed"
        strides = (nhwc_strides(list(dims)) if layout == "NHWC" else
                   contiguous_strides(dims[::-1])[::-1] if layout == "transposed" else contiguous_strides(dims))
        out.append((role, dims, tuple(strides), values["dtype"] if t.dtype == "io" else t.dtype))
    return tuple(out)


def missing_family(op: str) -> str | None:
    """Why ``op`` cannot be planned yet (read from the op tables now), or None."""
    from . import kernels
    from .graph.anchors import ANCHORS
    from .graph.ops import SCHEMAS
    if op in SCHEMAS:
        return None
    if op not in ANCHORS:
        return "no kernel family yet"
    if ANCHORS[op].family not in kernels.FAMILIES:
        return f"kernel family {ANCHORS[op].family!r} is not registered"
    return None


def arch_gap(op: str, arch: str) -> str | None:
    """Why ``op``'s family has no kernel at all for ``arch`` (its module's ``arch_reason``), or None."""
    from . import kernels
    from .graph.anchors import ANCHORS
    if op not in ANCHORS:
        return None
    check = getattr(kernels.family(ANCHORS[op].family), "arch_reason", None)
    return check(arch) if check is not None else None


def layer_graph(row: Layer, tensors: tuple, arch: str):
    """The graph a program builds for one layer on ``arch`` (the functional API's one-node graph),
    taken through check_support; no GPU needed."""
    from .graph import Graph
    from .graph.anchors import ANCHORS
    g = Graph(io_data_type=tensors[0][3], name=row.name, arch=arch)
    made = {role: g.tensor(dims=list(dims), strides=list(strides), data_type=dt, name=role)
            for role, dims, strides, dt in tensors}
    attrs = dict(row.attrs)
    if row.op in ANCHORS:
        schema = ANCHORS[row.op]
        if all(role in schema.roles for role in made):
            inputs = made
        else:  # an op registered after the table was written: its roles, in the table's order
            if len(made) > len(schema.roles):
                raise ValidationError(f"layer {row.name}: {row.op} takes {', '.join(schema.roles)}, the table gives "
                                      f"{', '.join(made)}", arg=row.op)
            inputs = dict(zip(schema.roles, made.values()))
        outs = g._anchor(row.op, inputs, attrs, name=row.op)
        outs = outs if isinstance(outs, tuple) else (outs,)
    else:
        operands = list(made.values())[:_arity(row.op)]
        outs = (getattr(g, row.op)(*operands, **attrs),)
    main = outs[0]
    for step in row.then:
        main = getattr(g, step)(main) if isinstance(step, str) else getattr(g, step[0])(main, made[step[1]])
    main.set_output(True)
    if row.out is not None:  # after set_output, which gives a float32 output the model's type
        main.set_data_type(row.out)
    for extra in outs[1:]:
        extra.set_output(True)
    return g.validate().build_operation_graph().create_execution_plans().check_support(_tuned=False)


def _arity(op: str) -> int:
    from .graph.ops import SCHEMAS
    return SCHEMAS[op].arity


def graph_specs(g, candidates: bool = False) -> list[KernelSpec]:
    """The kernels ``build_plans`` compiles for a supported graph: each group's heuristic
    candidate (or every candidate), with every launch of an anchor plan."""
    specs: dict = {}
    for index, cands in enumerate(g.candidates):
        for spec in (cands if candidates else cands[:1]):
            specs.update(dict.fromkeys(g._launch_specs(index, spec)))
    return list(specs)


def rows_for(model: Model, values: dict) -> list[Layer]:
    """The model's rows that apply to one variant."""
    return [row for row in model.layers if all(values.get(k) == v for k, v in row.only)]


def plan_model(name: str, given: dict[str, str], archs, *, candidates: bool = False) -> ModelPlan:
    """Plan every layer of model preset ``name`` (with parameters ``given``) for each arch."""
    model = MODELS.get(name)
    if model is None:
        raise ValidationError(f"preset: unknown model preset {name!r}; known: {', '.join(MODELS)}", arg="preset")
    params = model.parse(given)
    variants = model.variants(params)
    result = ModelPlan(name, params, len(variants))
    archs = [compiler.parse_arch(a) for a in archs]
    planned: dict = {}
    for values in variants:
        rows = rows_for(model, values)
        result.layers = max(result.layers, sum(row.count for row in rows))
        skipped: dict = {}
        for row in rows:
            reason = missing_family(row.op)
            if reason is not None:
                skipped[row.op] = (skipped.get(row.op, (0, reason))[0] + row.count, reason)
                continue
            row = _bind(row, values, "")   # names in attributes too (conv_dgrad's x_dims holds the batch)
            tensors = resolve(row, values)
            for arch in archs:
                reason = arch_gap(row.op, arch)
                if reason is not None:
                    label = f"{row.op} on {arch}"
                    skipped[label] = (skipped.get(label, (0, reason))[0] + row.count, reason)
                    continue
                key = (row.op, tensors, row.attrs, row.then, row.out, arch, candidates)
                if key not in planned:
                    try:
                        planned[key] = graph_specs(layer_graph(row, tensors, arch), candidates)
                    except Exception as exc:  # noqa: BLE001 - a family's bug is reported, warm goes on
                        planned[key] = []
                        exc = exc if isinstance(exc, NvdnnError) else f"{type(exc).__name__}: {exc}"
                        label = ", ".join(f"{k}={v}" for k, v in values.items() if k in ("n", "dtype", "layout",
                                                                                          "norm"))
                        result.failed.append((row.name, f"{label}, {arch}", str(exc)))
                result.jobs.update(dict.fromkeys((spec, arch) for spec in planned[key]))
        for op, (n, reason) in skipped.items():
            result.skipped[op] = (max(n, result.skipped.get(op, (0,))[0]), reason)
        if model.kernels is not None:
            result.jobs.update(dict.fromkeys((spec, arch) for spec in model.kernels(values) for arch in archs))
    return result
