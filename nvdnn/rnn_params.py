"""PyTorch's RNN parameter layout (nn.LSTM, nn.GRU), read in one place for the float64 reference
and the GPU calls, so both take a module's weights as they are and refuse the same mistakes.

Per layer and direction (forward, then ``_reverse``), in ``nn.LSTM._flat_weights`` order:

    weight_ih_l{k}  (gates * hidden, layer input)   layer input: input_size in layer 0,
                                                    directions * out_size after
    weight_hh_l{k}  (gates * hidden, out_size)      out_size: proj_size, or hidden without one
    bias_ih_l{k}    (gates * hidden,)               with bias only
    bias_hh_l{k}    (gates * hidden,)
    weight_hr_l{k}  (proj_size, hidden)             LSTM with a projection only

Gate rows are LSTM's i, f, g, o and GRU's r, z, n, ``hidden`` rows each. Nothing is read but
each array's shape and data type, so the values may be NumPy or CuPy arrays or torch tensors.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import DTypeError, ValidationError

GATES = {"lstm": 4, "gru": 3}
MODULES = {"lstm": "nn.LSTM", "gru": "nn.GRU"}
KEYS = ("w_ih", "w_hh", "b_ih", "b_hh", "w_hr")   # a layer direction's dict, in _flat_weights order
TORCH_NAMES = {"w_ih": "weight_ih", "w_hh": "weight_hh", "b_ih": "bias_ih", "b_hh": "bias_hh", "w_hr": "weight_hr"}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class RNNLayout:
    mode: str             # "lstm" | "gru"
    input_size: int
    hidden_size: int
    num_layers: int
    bidirectional: bool
    proj_size: int        # 0: no projection (LSTM only)
    bias: bool

    @property
    def gates(self) -> int:
        return GATES[self.mode]

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def out_size(self) -> int:
        """A direction's output and h: proj_size with a projection, else hidden_size."""
        return self.proj_size or self.hidden_size

    def layer_input_size(self, layer: int) -> int:
        return self.input_size if layer == 0 else self.out_size * self.directions

    def keys(self) -> tuple:
        """The parameters of one layer direction, in _flat_weights order."""
        return _keys(self.bias, bool(self.proj_size))

    def flat_order(self) -> list:
        """(layer, direction, key, PyTorch name) of every parameter, in _flat_weights order."""
        return _flat_order(self.num_layers, self.directions, self.keys())


def param_name(key: str, layer: int, direction: int) -> str:
    """PyTorch's name of a parameter: param_name("w_hh", 1, 1) is "weight_hh_l1_reverse"."""
    return f"{TORCH_NAMES[key]}_l{layer}" + ("_reverse" if direction else "")


def _keys(bias: bool, proj: bool) -> tuple:
    return ("w_ih", "w_hh") + (("b_ih", "b_hh") if bias else ()) + (("w_hr",) if proj else ())


def _flat_order(num_layers: int, directions: int, keys: tuple) -> list:
    return [(layer, direction, key, param_name(key, layer, direction))
            for layer in range(num_layers) for direction in range(directions) for key in keys]


def flatten(layout: RNNLayout, per_layer) -> list:
    """[layer][direction] dicts (parse_params' second result, or gradients shaped alike) as one
    list in _flat_weights order."""
    return [per_layer[layer][direction][key] for layer, direction, key, _ in layout.flat_order()]


def _count(value, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValidationError(f"{name}: {value!r}; needs an int >= {least}", arg=name)
    return int(value)


def _check_options(mode, input_size, num_layers, bidirectional, bias) -> None:
    if mode not in GATES:
        raise ValidationError(f"mode: {mode!r} is not one of {', '.join(GATES)}", arg="mode")
    _count(input_size, "input_size", 1)
    _count(num_layers, "num_layers", 1)
    for name, value in (("bidirectional", bidirectional), ("bias", bias)):
        if not isinstance(value, (bool, np.bool_)):
            raise ValidationError(f"{name}: {value!r}; needs True or False", arg=name)


def _module(mode, num_layers, bidirectional, bias) -> str:
    return f"{MODULES[mode]}(num_layers={num_layers}, bidirectional={bool(bidirectional)}, bias={bool(bias)})"


def _named(mode, params, num_layers, directions, bias, module: str) -> dict:
    """PyTorch name -> value, from a mapping by name or a sequence in _flat_weights order (whose
    length says whether it holds a projection)."""
    if isinstance(params, Mapping):
        named = dict(params)
    elif isinstance(params, (list, tuple)):
        plain = 2 + 2 * bool(bias)
        blocks = num_layers * directions
        if len(params) not in (blocks * plain, blocks * (plain + 1)):
            projected = f", or {blocks * (plain + 1)} with a projection (weight_hr)" if mode == "lstm" else ""
            raise ValidationError(f"params: {len(params)} tensors; {module} has {blocks * plain} "
                                  f"({', '.join(TORCH_NAMES[k] for k in _keys(bias, False))} per layer and "
                                  f"direction){projected}", arg="params")
        order = _flat_order(num_layers, directions, _keys(bias, len(params) > blocks * plain))
        named = {name: value for (_, _, _, name), value in zip(order, params)}
    else:
        raise ValidationError(f"params: a {type(params).__name__}; needs a sequence in _flat_weights order or a "
                              "mapping by PyTorch's parameter names (state_dict())", arg="params")
    proj = any(str(name).startswith("weight_hr_l") for name in named)
    expected = [name for *_, name in _flat_order(num_layers, directions, _keys(bias, proj))]
    for name in named:
        if mode == "gru" and str(name).startswith("weight_hr_l"):
            raise ValidationError(f"{name}: nn.GRU has no projection (proj_size is nn.LSTM's)", arg=str(name))
        if name not in expected:
            raise ValidationError(f"{name}: not a parameter of {module}, whose parameters are "
                                  f"{', '.join(expected)}", arg=str(name))
    for name in expected:
        if name not in named:
            raise ValidationError(f"{name}: missing; {module} has {len(expected)} parameters "
                                  f"({', '.join(expected)})", arg=name)
    return {name: named[name] for name in expected}


def _dtype_name(x) -> str:
    """An array's element type by name (NumPy / CuPy dtypes, or torch's "torch.float32")."""
    dtype = x.dtype
    return dtype.name if isinstance(dtype, np.dtype) else str(dtype).rsplit(".", 1)[-1]


def _check_dtypes(named: dict) -> None:
    first_name, first = None, None
    for name, value in named.items():
        kind = _dtype_name(value)
        if kind not in FLOAT_DTYPES:
            raise DTypeError(f"{name}: data type {kind}; RNN parameters take {', '.join(FLOAT_DTYPES)}", arg=name)
        if first is None:
            first_name, first = name, kind
        elif kind != first:
            raise DTypeError(f"{name}: data type {kind}, {first_name}'s is {first}; every parameter has one "
                             "floating type", arg=name)


def _hidden_size(mode, shapes: dict) -> int:
    shape = shapes["weight_ih_l0"]
    gates = GATES[mode]
    if len(shape) != 2 or shape[0] == 0 or shape[0] % gates:
        rows = "i, f, g, o" if mode == "lstm" else "r, z, n"
        raise ValidationError(f"weight_ih_l0: shape {shape}; needs 2 dims, dim 0 a positive multiple of {gates} "
                              f"(gate rows {rows}, hidden_size each)", arg="weight_ih_l0")
    return shape[0] // gates


def _proj_size(shapes: dict, hidden: int) -> int:
    shape = shapes.get("weight_hr_l0")
    if shape is None:
        return 0
    if not shape or not 0 < shape[0] < hidden:
        raise ValidationError(f"weight_hr_l0: shape {shape}; dim 0 is proj_size, which needs 0 < proj_size < "
                              f"hidden_size {hidden} (PyTorch's rule)", arg="weight_hr_l0")
    return shape[0]


def _expected(layout: RNNLayout, key: str, layer: int) -> list:
    """(size, its formula, what the dim is) of each dim of a parameter."""
    gates, hidden, proj, out = layout.gates, layout.hidden_size, layout.proj_size, layout.out_size
    rows = (gates * hidden, f"{gates} * hidden {hidden}",
            "gates * hidden_size, the hidden size weight_ih_l0 sets for every layer")
    if key in ("b_ih", "b_hh"):
        return [rows]
    if key == "w_hr":
        return [(proj, f"proj_size {proj}", "proj_size, which weight_hr_l0 sets for every layer"),
                (hidden, f"hidden {hidden}", "the hidden size")]
    if key == "w_hh":
        return [rows, (out, f"proj_size {proj}" if proj else f"{hidden}",
                       "the hidden size, or proj_size with a projection")]
    if layer == 0:
        return [rows, (layout.input_size, f"input_size {layout.input_size}", "input_size")]
    return [rows, (layout.layer_input_size(layer), f"{layout.directions} * {out}",
                   "the layer below's output: directions * (proj_size or hidden_size)")]


def _check_shape(name: str, shape: tuple, dims: list) -> None:
    needed = tuple(size for size, _, _ in dims)
    if shape == needed:
        return
    formula = ", ".join(text for _, text, _ in dims) + ("," if len(dims) == 1 else "")
    if len(shape) != len(dims):
        why = f"a {len(dims)}-dim tensor"
    else:
        k = next(k for k, (size, _, _) in enumerate(dims) if shape[k] != size)
        why = f"dim {k} is {dims[k][2]}"
    raise ValidationError(f"{name}: shape {shape}; needs ({formula}) = {needed} ({why})", arg=name)


def parse_params(mode: str, params, *, input_size: int, num_layers: int, bidirectional: bool,
                 bias: bool = True) -> tuple:
    """(RNNLayout, per_layer) of an nn.LSTM's / nn.GRU's parameters: ``params`` in
    ``module._flat_weights`` order, or a mapping by PyTorch's names (``module.state_dict()``);
    hidden_size from weight_ih_l0's rows, proj_size from weight_hr_l0. per_layer[layer][direction]
    is a dict over KEYS of the values as given (None: a bias or projection the module lacks).
    ValidationError (DTypeError for data types) names the parameter and the rule it breaks."""
    # here, not at the top: nvdnn.reference imports this module before nvdnn.graph, which functional_checks needs
    from .functional_checks import describe
    _check_options(mode, input_size, num_layers, bidirectional, bias)
    module = _module(mode, num_layers, bidirectional, bias)
    named = _named(mode, params, num_layers, 2 if bidirectional else 1, bias, module)
    shapes = {name: describe(value, name, typed=False).shape for name, value in named.items()}
    _check_dtypes(named)
    hidden = _hidden_size(mode, shapes)
    layout = RNNLayout(mode, int(input_size), hidden, int(num_layers), bool(bidirectional),
                       _proj_size(shapes, hidden), bool(bias))
    per_layer = [[dict.fromkeys(KEYS) for _ in range(layout.directions)] for _ in range(layout.num_layers)]
    for layer, direction, key, name in layout.flat_order():
        _check_shape(name, shapes[name], _expected(layout, key, layer))
        per_layer[layer][direction][key] = named[name]
    return layout, per_layer
