"""Graph tensors: logical dims in NCHW order, strides giving the physical layout (cuDNN's rule)."""
from __future__ import annotations


def contiguous_strides(dims) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(dims):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def nhwc_strides(dims) -> tuple[int, ...]:
    """Strides of NCHW-ordered ``dims`` stored channels-last (NHWC)."""
    if len(dims) < 3:
        return contiguous_strides(dims)
    n, c, *spatial = dims
    inner = contiguous_strides(spatial + [c])  # memory order: spatial..., C
    return (inner[0] * spatial[0], 1, *(s for s in inner[:-1]))


class Tensor:
    """A node of the graph's data: created by ``Graph.tensor`` or returned by an op.

    ``is_virtual`` tensors live inside fused kernels (or the workspace) and never reach the
    caller; ``set_output(True)`` makes one a result that ``execute`` writes to.
    """

    __slots__ = ("graph", "uid", "name", "dims", "strides", "data_type", "is_virtual", "alignment", "producer",
                 "follows_io")

    def __init__(self, graph, uid: int, name: str, dims, strides, data_type: str, is_virtual: bool,
                 alignment: int = 16, follows_io: bool = False):
        self.graph, self.uid, self.name = graph, uid, name
        self.dims, self.strides = tuple(dims), tuple(strides)
        self.data_type, self.is_virtual = data_type, is_virtual
        self.alignment = alignment  # bytes the arrays' addresses are a multiple of (16 allows 16-byte loads)
        self.producer = None
        self.follows_io = follows_io  # an op's output of no fixed type: an output of the graph takes the io type

    def set_output(self, is_output: bool = True) -> "Tensor":
        self.graph._touch()
        self.is_virtual = not is_output
        # an op's result follows the io data type; saved statistics (a fixed type) keep theirs
        if is_output and self.follows_io and self.data_type == self.graph.intermediate_data_type:
            self.data_type = self.graph.io_data_type
        return self

    def set_data_type(self, data_type) -> "Tensor":
        from ..dtypes import dtype
        self.graph._touch()
        self.data_type = dtype(data_type, arg=f"tensor '{self.name}'").name
        return self

    def set_alignment(self, alignment: int) -> "Tensor":
        from ..errors import ValidationError
        if alignment not in (1, 2, 4, 8, 16):
            raise ValidationError(f"tensor '{self.name}': alignment {alignment!r} is not 1, 2, 4, 8 or 16",
                                  arg=self.name)
        self.graph._touch()
        self.alignment = alignment
        return self

    def set_name(self, name: str) -> "Tensor":
        self.graph._rename(self, name)
        self.graph._touch()
        return self

    def get_dims(self) -> list[int]:
        return list(self.dims)

    def get_stride(self) -> list[int]:
        return list(self.strides)

    def get_data_type(self) -> str:
        return self.data_type

    def get_uid(self) -> int:
        return self.uid

    def __repr__(self) -> str:
        kind = "virtual" if self.is_virtual else "io"
        return f"Tensor('{self.name}', uid={self.uid}, dims={list(self.dims)}, {self.data_type}, {kind})"
