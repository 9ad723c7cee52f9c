"""KernelSpec serialization and validation, and the deviceless pointwise planner."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from nvdnn import codegen
from nvdnn.errors import DTypeError, ValidationError
from nvdnn.kernels import pointwise
from nvdnn.kernels.pointwise import Operand, PointwiseSpec, fast_divisor, plan
from nvdnn.spec import FAMILIES, KernelSpec

PRESET = pointwise.preset()
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


# -- to_dict / from_dict ----------------------------------------------------------------------------

def test_round_trip_of_every_preset_spec():
    for spec in PRESET:
        data = json.loads(json.dumps(spec.to_dict()))  # as a recording line stores it
        back = KernelSpec.from_dict(data)
        assert type(back) is PointwiseSpec
        assert back == spec and hash(back) == hash(spec), spec.uri
        assert back.uri == spec.uri and back.digest == spec.digest
        assert back.to_dict() == spec.to_dict()


def test_uri_and_digest_are_unique_across_the_preset():
    uris = [s.uri for s in PRESET]
    assert len(set(uris)) == len(uris)
    assert len({s.digest for s in PRESET}) == len(PRESET)
    assert all(u.startswith("pointwise/") and " " not in u for u in uris)


def test_pointwise_family_is_registered():
    assert FAMILIES["pointwise"] is PointwiseSpec


@pytest.fixture
def data(spec):
    """A mutable, JSON-shaped copy of the bf16 add+gelu spec."""
    return json.loads(json.dumps(spec.to_dict()))


def test_from_dict_accepts_the_unmodified_data(data, spec):
    assert KernelSpec.from_dict(data) == spec


@pytest.mark.parametrize("bad, arg", [
    (None, "spec"),
    ([], "spec"),
    ("pointwise", "spec"),
    ({"family": "pointwise"}, "spec"),
    ({"family": "pointwise", "fields": []}, "spec"),
])
def test_from_dict_rejects_malformed_data(bad, arg):
    with pytest.raises(ValidationError) as info:
        KernelSpec.from_dict(bad)
    assert info.value.arg == arg


def test_from_dict_rejects_unknown_family(data):
    for family in ("conv2d", "", None, "Pointwise"):
        data["family"] = family
        with pytest.raises(ValidationError, match="unknown family") as info:
            KernelSpec.from_dict(data)
        assert info.value.arg == "spec.family" and "pointwise" in str(info.value)


def test_from_dict_rejects_missing_field(data):
    del data["fields"]["vec"]
    with pytest.raises(ValidationError, match="vec") as info:
        KernelSpec.from_dict(data)
    assert info.value.arg == "spec.fields"


def test_from_dict_rejects_extra_field(data):
    data["fields"]["evil"] = "x"
    with pytest.raises(ValidationError, match="evil") as info:
        KernelSpec.from_dict(data)
    assert info.value.arg == "spec.fields"


def _set(path, value):
    def mutate(fields):
        target = fields
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


# Each would put text or a value into the rendered C source that validation must stop.
INJECTIONS = {
    "op-with-code": _set(["steps", 1, 0], "gelu(x);}//"),
    "op-unknown": _set(["steps", 1, 0], "system"),
    "rhs-with-code": _set(["steps", 0, 1], "x1; evil"),
    "rhs-on-unary": _set(["steps", 1, 1], "x1"),
    "rhs-missing-on-binary": _set(["steps", 0, 1], ""),
    "rhs-unused-input": _set(["steps", 0, 1], "x2"),
    "rhs-zero": _set(["steps", 0, 1], "x0"),
    "step-not-a-pair": _set(["steps", 0], ["add", "x1", "extra"]),
    "steps-a-string": _set(["steps"], "add"),
    "steps-empty": _set(["steps"], []),
    "input-dtype-pointer": _set(["inputs", 0], "float*"),
    "input-dtype-int": _set(["inputs", 1], "int32"),
    "output-dtype-code": _set(["output"], "float; evil"),
    "inputs-empty": _set(["inputs"], []),
    "access-with-code": _set(["access", 1], "vec;"),
    "zero-with-code": _set(["zero", 1], "1;"),
    "zero-wrong-length": _set(["zero", 1], "100"),
    "zero-on-linear": _set(["zero", 0], "10"),
    "access-mask-mismatch": _set(["access", 1], "bc"),
    "index-with-code": _set(["index"], "int32; evil"),
    "block-100": _set(["block"], 100),
    "block-string": _set(["block"], "256"),
    "unroll-3": _set(["unroll"], 3),
    "vec-3": _set(["vec"], 3),
    "vec-too-wide": _set(["vec"], 16),
    "ndim-9": _set(["ndim"], 9),
    "ndim-string": _set(["ndim"], "2"),
    "ndim-negative": _set(["ndim"], -1),
    "op-unhashable": _set(["steps", 1, 0], {"a": 1}),
}


@pytest.mark.parametrize("name", sorted(INJECTIONS))
def test_from_dict_rejects_bad_field_values(name, data, spec):
    INJECTIONS[name](data["fields"])
    with pytest.raises(ValidationError) as info:
        KernelSpec.from_dict(data)
    assert info.value.arg, "a ValidationError should name what was wrong"


@pytest.mark.parametrize("field, value", [("vec", True), ("unroll", True), ("vec", 8.0), ("block", 256.0)])
def test_from_dict_rejects_non_int_numbers(field, value, data):
    data["fields"][field] = value
    with pytest.raises(ValidationError):
        KernelSpec.from_dict(data)


def test_direct_construction_validates_too(spec):
    with pytest.raises(ValidationError):
        PointwiseSpec(**{**{k: v for k, v in spec.to_dict()["fields"].items()}, "block": 100})


def test_render_is_deterministic_and_names_the_spec(spec):
    source = codegen.render(spec)
    assert source == codegen.render(copy.deepcopy(spec))
    assert source.startswith(f"// nvdnn kernel {spec.uri}\n")
    assert "constexpr int VEC = 8;" in source and "typedef nvdnn::bfloat16 out_t;" in source


# -- the planner --------------------------------------------------------------------------------

def _contiguous(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.insert(0, acc)
        acc *= size
    return tuple(strides)


def op(dtype, shape, strides=None, align=16):
    return Operand(dtype, tuple(shape), _contiguous(shape) if strides is None else tuple(strides), align)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_contiguous_same_shape_inputs_are_linear(dtype):
    launch = plan([("add", "x1"), ("relu", "")], [op(dtype, (64, 4096)), op(dtype, (64, 4096))], dtype)
    spec = launch.spec
    assert spec.access == ("lin", "lin") and spec.zero == ("", "")
    assert spec.ndim == 0 and spec.vec == 16 // ITEMSIZE[dtype]
    assert spec.index == "int32"
    assert launch.n == 64 * 4096 and launch.int_args == (64 * 4096,)
    assert launch.block == (spec.block, 1, 1)
    assert launch.grid[0] * spec.block * spec.unroll * spec.vec >= launch.n


def test_mixed_dtypes_vectorize_by_the_widest():
    spec = plan([("add", "x1")], [op("bfloat16", (64, 1024)), op("float32", (64, 1024))], "bfloat16").spec
    assert spec.vec == 4 and spec.inputs == ("bfloat16", "float32")


def test_nhwc_bias_is_a_vector_operand():
    n, h, w, c = 2, 8, 8, 64
    launch = plan([("add", "x1"), ("gelu", "")], [op("bfloat16", (n * h * w, c)), op("bfloat16", (c,))],
                  "bfloat16")
    spec = launch.spec
    assert spec.access == ("lin", "vec") and spec.zero == ("", "10")
    assert spec.ndim == 2 and spec.vec == 8
    assert launch.int_args == (n * h * w * c, n * h * w, c, *fast_divisor(c))


def test_nchw_bias_is_a_broadcast_operand():
    n, c, h, w = 2, 64, 8, 8
    launch = plan([("add", "x1")], [op("float16", (n, c, h, w)), op("float16", (c, 1, 1))], "float16")
    spec = launch.spec
    assert spec.access == ("lin", "bc") and spec.zero == ("", "101")
    assert spec.ndim == 3 and spec.vec == 8  # H and W coalesce into one dim
    assert launch.int_args[:4] == (n * c * h * w, n, c, h * w)


@pytest.mark.parametrize("align, vec", [(16, 8), (8, 4), (4, 2), (2, 1)])
def test_pointer_alignment_limits_the_vector_width(align, vec):
    operands = [op("bfloat16", (64, 4096)), op("bfloat16", (64, 4096), align=align)]
    assert plan([("mul", "x1")], operands, "bfloat16").spec.vec == vec


@pytest.mark.parametrize("out_align, vec", [(16, 8), (4, 2), (2, 1)])
def test_output_alignment_limits_the_vector_width(out_align, vec):
    spec = plan([("relu", "")], [op("bfloat16", (64, 4096))], "bfloat16", out_align=out_align).spec
    assert spec.vec == vec


def test_odd_last_dim_with_a_broadcast_operand_is_scalar():
    spec = plan([("add", "x1")], [op("bfloat16", (64, 7)), op("bfloat16", (7,))], "bfloat16").spec
    assert spec.ndim == 2 and spec.access == ("lin", "vec") and spec.vec == 1


def test_odd_size_all_linear_still_vectorizes():
    spec = plan([("add", "x1")], [op("bfloat16", (64, 7)), op("bfloat16", (64, 7))], "bfloat16").spec
    assert spec.ndim == 0 and spec.vec == 8  # the n % VEC tail is handled in the kernel


def test_transposed_input_is_gathered():
    launch = plan([("add", "x1")], [op("float32", (64, 128)), op("float32", (64, 128), strides=(1, 64))],
                  "float32")
    spec = launch.spec
    assert spec.access == ("lin", "gat") and spec.zero == ("", "00") and spec.ndim == 2
    assert spec.vec == 4  # the gathered operand takes scalar loads; the others stay vectorized
    assert launch.int_args == (64 * 128, 64, 128, *fast_divisor(128), 1, 64)
    assert [type(a) for a in launch.int_args] == [np.int32] * 3 + [np.uint32] * 2 + [np.int32] * 2


def test_index_width_follows_the_size():
    small = plan([("neg", "")], [op("float32", (64, 4096))], "float32").spec
    huge = plan([("neg", "")], [op("float32", (1 << 16, 1 << 16))], "float32").spec
    assert small.index == "int32" and huge.index == "int64"
    edge = plan([("neg", "")], [op("float32", (1 << 15, 1 << 16))], "float32")  # 2^31 elements
    assert edge.spec.index == "int64"


def test_incompatible_shapes_name_the_operand():
    with pytest.raises(ValidationError) as info:
        plan([("add", "x1")], [op("float32", (64, 4096)), op("float32", (4095,))], "float32")
    assert info.value.arg == "x1"
    assert "x1" in str(info.value) and "(4095,)" in str(info.value) and "(64, 4096)" in str(info.value)
    with pytest.raises(ValidationError) as info:
        plan([("add", "x1")], [op("float32", (64, 4096)), op("float32", (3, 4096))], "float32",
             names=["input", "bias"])
    assert info.value.arg == "bias" and str(info.value).startswith("bias:")


@pytest.mark.parametrize("bad", [1, 2])
def test_incompatible_shapes_name_the_right_operand_of_three(bad):
    shapes = [(64, 4096), (4096,), (4096,)]
    shapes[bad] = (7,)
    with pytest.raises(ValidationError) as info:
        plan([("add", "x1"), ("add", "x2")], [op("float32", s) for s in shapes], "float32")
    assert info.value.arg == f"x{bad}" and str(info.value).startswith(f"x{bad}:")


@pytest.mark.parametrize("dtype", ["float8_e4m3", "int32", "int64"])
def test_unsupported_input_dtype_is_a_dtype_error(dtype):
    with pytest.raises(DTypeError) as info:
        plan([("add", "x1")], [op("float32", (64, 64)), op(dtype, (64, 64))], "float32")
    assert info.value.arg == "x1" and dtype in str(info.value)


@pytest.mark.parametrize("dtype", ["float8_e4m3", "int32"])
def test_unsupported_output_dtype_is_a_dtype_error(dtype):
    with pytest.raises(DTypeError) as info:
        plan([("relu", "")], [op("float32", (64, 64))], dtype)
    assert info.value.arg == "dtype" and dtype in str(info.value)
    assert isinstance(info.value, ValidationError) and isinstance(info.value, TypeError)


def test_plan_is_deterministic_and_preset_specs_replan(spec, make_spec):
    assert make_spec() == spec
    assert plan([("add", "x1"), ("gelu", "")], [op("bfloat16", (64, 4096)), op("bfloat16", (4096,))],
                "bfloat16").spec == spec


@pytest.mark.parametrize("d", [1, 2, 3, 7, 64, 1000, 4095, 4096, 65537, 2 ** 30 + 1, 2 ** 31 - 1])
def test_fast_divisor_matches_integer_division(d):
    mul, shr = fast_divisor(d)
    assert 0 < mul < 2 ** 32
    rng = np.random.default_rng(d)
    n = np.concatenate([rng.integers(0, 2 ** 31, 4096, dtype=np.uint64),
                        np.array([0, 1, d - 1, d, d + 1, 2 ** 31 - 1], dtype=np.uint64)])
    n = n[n < 2 ** 31]
    q = (((n * np.uint64(mul)) >> np.uint64(32)) + n) >> np.uint64(shr)  # the kernel's umulhi, add, shift
    assert (q == n // np.uint64(d)).all()


def test_a_wide_bias_takes_row_tiles_and_keeps_them_at_other_row_counts():
    steps = [("add", "x1"), ("gelu", "")]
    wide = plan(steps, [op("bfloat16", (16384, 4096)), op("bfloat16", (4096,))], "bfloat16")
    assert wide.spec.row_tiles and wide.spec.uri.endswith(".rows")
    assert wide.grid == (4096 // 8 // wide.spec.block, 16384 // wide.spec.unroll, 1)
    assert len(wide.int_args) == 3  # n, rows, cols: no divisor magic
    one_row = plan(steps, [op("bfloat16", (1, 4096)), op("bfloat16", (4096,))], "bfloat16",
                   tile=wide.spec, pattern=pointwise.Pattern.of((16384, 4096), [(16384, 4096), (1, 4096)]))
    assert one_row.spec == wide.spec and one_row.grid == (4096 // 8 // wide.spec.block, 1, 1)
    narrow = plan(steps, [op("bfloat16", (16384, 64)), op("bfloat16", (64,))], "bfloat16")
    assert not narrow.spec.row_tiles
    nchw = plan([("add", "x1")], [op("float16", (2, 64, 8, 8)), op("float16", (64, 1, 1))], "float16")
    assert all(not s.row_tiles for s in pointwise.candidates(nchw.spec))  # a per-channel scalar: no row


def test_row_tiles_refuse_operands_that_are_not_one_row():
    base = plan([("add", "x1")], [op("float32", (64, 128)), op("float32", (64, 128), strides=(1, 64))],
                "float32").spec
    with pytest.raises(ValidationError, match="row_tiles"):
        dataclasses.replace(base, row_tiles=True)


def test_from_dict_fills_a_later_field_with_its_default(data):
    """A recording made before a field existed loads as the kernel it described."""
    del data["fields"]["row_tiles"]
    assert KernelSpec.from_dict(data).row_tiles is False
