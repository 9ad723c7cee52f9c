"""The graph API: tensors, op nodes, the five build steps, execute, blobs, CUDA graphs."""
from .execution import CapturedGraph
from .graph import Graph
from .tensor import Tensor

__all__ = ["CapturedGraph", "Graph", "Tensor"]
