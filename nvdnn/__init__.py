"""nvdnn: cuDNN-style deep-learning primitives for NVIDIA GPUs, as Jinja-templated CUDA C
compiled at run time with NVRTC, cached by shape-aware specs and launched on CuPy arrays."""
from . import config, dtypes, errors, reference
from .cache import KernelCache, default_cache
from .graph import Graph, Tensor
from .dtypes import bfloat16, float8_e4m3, float8_e5m2, float16, float32, int32, int64
from .functional import (abs, add, bias_act, cast, div, elementwise, elu, exp, gelu, identity, log,
                         maximum, minimum, mul, neg, power, relu, rsqrt, scale, sigmoid, silu, softplus,
                         sqrt, sub, swish, tanh)
from .functional_conv import conv2d, conv2d_backward
from .functional_matmul import matmul
from .functional_matmul_backward import matmul_backward
from .functional_attention import scaled_dot_product_attention
from .functional_attention_backward import scaled_dot_product_attention_backward
from .functional_attention_decode import decode_attention
from .functional_rnn import gru, lstm
from .functional_rnn_backward import gru_backward, lstm_backward
from .functional_anchors import (amax, avg_pool2d, avg_pool2d_backward, batch_norm, batch_norm_backward,
                                 cross_entropy, global_avg_pool2d, group_norm, instance_norm, layer_norm,
                                 layer_norm_backward, log_softmax, log_softmax_backward, max, max_pool2d,
                                 max_pool2d_backward, mean, min, norm1, norm2, prod, rms_norm, rms_norm_backward,
                                 softmax, softmax_backward, sum)

__version__ = "0.1.0"

config.configure_logging()
