"""The GEMM core's shared device pieces (templates/common/) on their own, without a matmul
kernel around them: each compiles in a small harness for the arch it targets, and the wgmma
wrapper emits the tensor-core instruction it names for every transpose mode. These are the
pieces the convolution and attention families will include."""
from __future__ import annotations


import pytest

from nvdnn import codegen, compiler

from .sass import sass_text


def _compile(source: str, arch: str) -> bytes:
    return compiler.compile_cubin(source, name="piece.cu", options=compiler.options_for(arch)).cubin


def _render(text: str, **context) -> str:
    return codegen.environment().from_string(text).render(**context)




def test_tile_scheduler_compiles_alone():
    source = _render('''{% include "common/tile_scheduler.cuh" %}
extern "C" __global__ void walk(int* out, int tiles_m, int tiles_n, int whole, int splits, int steps, int tiles) {
  nvdnn::TileWalk walk(whole, splits, steps, tiles, blockIdx.x, gridDim.x);
  int sum = walk.rest();
  for (nvdnn::TilePiece p; walk.next_piece(p);) {
    int plane, tm, tn;
    nvdnn::tile_coords<8>(p.tile, tiles_m, tiles_n, plane, tm, tn);
    sum += ((plane * 131 + tm) * 131 + tn) * 7 + p.step0 + p.steps + p.part;
  }
  out[blockIdx.x] = sum;
}''')
    for arch in ("sm_80", "sm_90"):
        assert _compile(source, arch)


@pytest.mark.parametrize("trans", [None, (0, 0), (1, 0), (0, 1), (1, 1)])
def test_wgmma_wrapper_and_descriptors_emit_warpgroup_mma(trans):
    """tf32 (no transpose immediates) and bf16 with A / B K- or MN-major descriptors."""
    source = _render('''{% include "common/sm90_wgmma.cuh.j2" %}
{% from "common/sm90_wgmma.cuh.j2" import wgmma_function %}
{{ wgmma_function("mma", 64, kind, kind, k, trans) }}
{% macro desc(mn, offset) %}nvdnn::smem_desc_sw128{{ "_mn(tile + %d, 8192)" % offset if mn else "(tile + %d)" % offset }}{% endmacro %}
extern "C" __global__ void piece(float* y) {
  __shared__ __align__(1024) unsigned char tile[2 * 8192];
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  nvdnn::wgmma_fence();
  mma(d, {{ desc(trans and trans[0], 0) }}, {{ desc(trans and trans[1], 8192) }}, 0);
  nvdnn::wgmma_commit();
  nvdnn::wgmma_wait<0>();
  for (int i = 0; i < 32; ++i) y[threadIdx.x * 32 + i] = d[i];
}''', kind="tf32" if trans is None else "bf16", k=8 if trans is None else 16, trans=trans)
    sass = sass_text(_compile(source, "sm_90a"))
    assert "HGMMA" in sass and " STL" not in sass


def test_tf32_gemm_with_a_from_registers_keeps_its_mmas_asynchronous():
    """tf32's M-major A (NumPy's a @ b runs as b^T a^T on it): its fragments go from shared
    memory to registers (LDS) and into register-sourced HGMMAs, which ptxas would serialize
    (warning C7513) were fragments written while an MMA is in flight; nothing spills."""
    from nvdnn.kernels.matmul import plan_matmul
    from nvdnn.kernels.pointwise import Operand
    f32 = Operand("float32", (1024, 1024), (1024, 1))
    (launch,) = plan_matmul(f32, f32, precision="tf32", arch="sm_90", split_k=1).launches
    spec = launch.spec
    assert (spec.kernel, spec.a_major) == ("wgmma", "m")
    result = compiler.compile_cubin(codegen.render(spec), name="gemm.cu", options=compiler.options_for("sm_90a"))
    assert "C7513" not in result.log and result.spill_bytes == 0 and result.stack_bytes == 0
    sass = sass_text(result.cubin)
    assert "HGMMA" in sass and " LDS" in sass and " STL" not in sass


def test_tma_and_barrier_pieces_compile_alone():
    source = _render('''{% include "common/sm90_barrier.cuh" %}
{% include "common/sm90_tma.cuh" %}
extern "C" __global__ void piece(const __grid_constant__ nvdnn::TmaDesc map) {
  __shared__ __align__(1024) unsigned char tile[4 * 8192];
  __shared__ unsigned long long bar;
  if (threadIdx.x == 0) {
    nvdnn::mbar_init(&bar, 1);
    nvdnn::mbar_fence_init();
    nvdnn::mbar_expect_tx(&bar, sizeof(tile));
    nvdnn::tma_load_mn_chunks(tile, &map, 0, 0, 0, 4, 64, 8192, &bar);
    nvdnn::mbar_wait(&bar, 0);
  }
}''')
    assert _compile(source, "sm_90a")


def test_grid_finish_on_a_named_barrier_compiles_alone():
    """The split finish of common/grid_finish.cuh for a warp-specialized block: only the
    consumer warps arrive, on a named barrier; the count is one atomic, the reads bypass L1."""
    source = _render('''{% include "common/sm90_barrier.cuh" %}
{% include "common/grid_finish.cuh" %}
extern "C" __global__ void piece(float4* part, float* y, int splits) {
  if (threadIdx.x >= 128) return;  // a producer warpgroup that never arrives
  part[blockIdx.y * 128 + threadIdx.x] = make_float4(1.0f, 2.0f, 3.0f, 4.0f);
  if (!nvdnn::last_to_arrive_sync(&nvdnn::grid_counters[blockIdx.x], splits, threadIdx.x == 0,
                                  [] { nvdnn::named_barrier(3, 128); }))
    return;
  float s = 0.0f;
  for (int k = 0; k < splits; ++k) {
    const float4 v = nvdnn::ld_partial4(part + k * 128 + threadIdx.x);
    s += v.x + v.y + v.z + v.w;
  }
  y[threadIdx.x] = s;
}''')
    for arch in ("sm_80", "sm_90"):
        sass = sass_text(_compile(source, arch))
        assert "BAR.SYNC" in sass and "ATOMG.E.ADD" in sass and "LDG.E.128" in sass, arch
