"""Float64 NumPy references: the oracle of every GPU test and a CPU backend.

Names and signatures follow the functional API: ``nvdnn.reference.<op>`` takes the arguments
of ``nvdnn.<op>`` (less ``out``, ``dtype`` and ``stream``, which say where and in what type a
GPU result lands). Inputs of any float type are computed in float64; results are float64. NaN
and inf propagate as in PyTorch, except where an op defines otherwise (a fully masked softmax
row gives zeros).
"""
from .attention import decode_attention, scaled_dot_product_attention, scaled_dot_product_attention_backward, varlen
from .dropout import attention_dropout_mask, rnn_dropout_mask
from .conv import conv2d, conv2d_backward, conv2d_backward_data, conv2d_backward_weight, conv2d_output_size
from .matmul import matmul, matmul_backward, matmul_chain
from .norm import (causal_mask, cross_entropy, layer_norm, layer_norm_backward, log_softmax, log_softmax_backward,
                   rms_norm, rms_norm_backward, softmax, softmax_backward)
from .pointwise import (ACTIVATIONS, abs, activate, add, bias_act, cast, chain, div, elementwise, elu, exp, gelu,
                        identity, log, maximum, minimum, mul, neg, power, relu, rsqrt, scale, sigmoid, silu, softplus,
                        sqrt, sub, swish, tanh)
from .pool import (avg_pool2d, avg_pool2d_backward, global_avg_pool2d, max_pool2d, max_pool2d_backward,
                   max_pool2d_with_indices)
from .reduce import (amax, batch_norm, batch_norm_backward, batch_norm_training, group_norm, instance_norm, max,
                     mean, min, norm1, norm2, prod, sum)
from .rnn import gru, gru_backward, gru_cell, lstm, lstm_backward, lstm_cell
