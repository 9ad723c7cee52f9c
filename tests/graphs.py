"""Graphs shared by the CPU and GPU tests (and the blob carried from the CPU to the GPU)."""
from __future__ import annotations

import nvdnn


def three_kernel_graph(arch=None, rows: int = 64, width: int = 4096, dtype: str = "bfloat16") -> nvdnn.Graph:
    """h = gelu(x + b) feeds three outputs, so it is materialized: 4 kernels, 3 outputs."""
    g = nvdnn.Graph(io_data_type=dtype, name="three_outputs", arch=arch)
    x = g.tensor(dims=[rows, width], name="x")
    b = g.tensor(dims=[1, width], name="b")
    r = g.tensor(dims=[rows, width], name="r")
    h = g.gelu(g.add(x, b))
    g.add(g.scale(h, 0.5), r, name="y").set_output(True)
    g.relu(h, name="z").set_output(True)
    g.tanh(g.sub(r, h), name="w").set_output(True)
    return g


def bias_gelu_graph(arch=None, rows: int = 64, width: int = 4096, dtype: str = "bfloat16") -> nvdnn.Graph:
    """One kernel: y = gelu(x + b)."""
    g = nvdnn.Graph(io_data_type=dtype, name="bias_gelu", arch=arch)
    x = g.tensor(dims=[rows, width], name="x")
    b = g.tensor(dims=[1, width], name="b")
    g.gelu(g.add(x, b), name="y").set_output(True)
    return g
