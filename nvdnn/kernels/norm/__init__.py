"""Row normalizations: layer norm, RMS norm, softmax and log-softmax, forward and backward.

Every op works on rows: L elements (the normalized dims, or the softmax axis) of each of
``rows`` lead positions. A row is held in registers by a group of ``tpr`` threads, ``nv``
vectors of ``vec`` elements each, loaded once with 16-byte loads, reduced with warp shuffles
(plus one shared-memory step for groups wider than a warp) and written once. By row length:

  short  (a vector or a few per row): several rows per block, part of a warp per row;
  medium (up to 32 elements a thread, 1024 threads): one block (or a part of one) per row;
  long:  a row split across blocks: a thread-block cluster of up to 8 blocks that exchange
         their statistics through distributed shared memory (sm_90, forward), or two passes:
         "stats" writes per-block partial statistics (float32 scratch), "apply" combines them
         in order and writes the row (reads it twice). On sm_90 the cluster is persistent
         ("persist"): a grid of as many clusters as fit at once walks the rows, each block
         always holding the same chunk of them, and bulk copies bring its chunk of the next
         rows into shared memory while it combines and writes this one (see PERSIST_CLUSTERS).

Backward norm kernels loop over rows (a fixed grid) and keep each thread's dgamma / dbeta
column partials in registers; a second kernel sums those partials in a fixed order: no
atomics, bit-identical reruns. Softmax over an axis that is not the last (inner positions
after it) runs a column kernel: threads walk inner positions (coalesced) and loop over L.

Shapes are dynamic (kernel arguments); the spec holds dtypes, options, the tile and the
access class of each operand. Lead dims are coalesced jointly over the operands (up to three
remain, each operand with its own strides, 0 for broadcast); the row dims must form one evenly
strided run per operand. Outputs are written contiguous.
"""
from __future__ import annotations

from .. import Plan
from .layout import Tile
from .plans import (plan_cross_entropy, plan_layer_norm, plan_layer_norm_backward, plan_rms_norm,
                    plan_rms_norm_backward, plan_softmax, plan_softmax_backward)
from .rowspec import (BACKWARD_EPT, CLUSTERS, DTYPES, FORWARD_EPT, LABEL_DTYPES, NVS, PERSIST_CLUSTERS,
                      PERSIST_SHARED, PERSIST_STAGES, PERSISTENT_BLOCKS, TPRS, VECS, WIDE_ROW, RowSpec)
from .specs import (WGRAD_COLUMNS, WGRAD_SLICES, NormBackwardSpec, NormSpec, SoftmaxBackwardSpec, SoftmaxColumnsSpec,
                    SoftmaxSpec, WgradSpec)
from .tune import PRESET_ROWS, candidates, preset, unsupported_reason

__all__ = ["BACKWARD_EPT", "CLUSTERS", "DTYPES", "FORWARD_EPT", "LABEL_DTYPES", "NVS", "PERSIST_CLUSTERS",
           "PERSIST_SHARED", "PERSIST_STAGES", "PERSISTENT_BLOCKS", "PRESET_ROWS", "TPRS", "VECS", "WGRAD_COLUMNS",
           "WGRAD_SLICES", "WIDE_ROW", "NormBackwardSpec", "NormSpec", "Plan", "RowSpec", "SoftmaxBackwardSpec",
           "SoftmaxColumnsSpec", "SoftmaxSpec", "Tile", "WgradSpec", "candidates", "plan_cross_entropy",
           "plan_layer_norm", "plan_layer_norm_backward", "plan_rms_norm", "plan_rms_norm_backward", "plan_softmax",
           "plan_softmax_backward", "preset", "unsupported_reason"]
