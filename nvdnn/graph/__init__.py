"""The graph API: tensors, op nodes, the five build steps, execute, blobs, CUDA graphs."""
from .graph import CapturedGraph, Graph
from .tensor import Tensor

__all__ = ["CapturedGraph", "Graph", "Tensor"]
