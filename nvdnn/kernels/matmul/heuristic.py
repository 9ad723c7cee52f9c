"""The matmul heuristics: the wgmma tile by a wave model, the other kernels' tiles, and how many
K splits a plan takes (for the wgmma kernel a wave model of tiles x splits over the SMs)."""
from __future__ import annotations

from .specs import DEFAULT_SMS, MatmulSpec, _size, finish_fits

# wgmma tiles the heuristic weighs: (bm, bn, stages, consumer warpgroups) -> throughput of one
# block relative to 128 x 256 (H200, bf16, the tile sweep of session 7: 128 x 128 ran at about
# 0.93 of it, one warpgroup of 64 x 128 at 0.8, 64 x 64 at 0.55; for 64 columns two warpgroups
# of 256 or 128 rows ran 1.11x the 64 x 64 tile on ResNet-50's N = 64 convs, H100, session 11)
WGMMA_HEURISTIC = {(128, 256, 4, 2): 1.0, (256, 128, 4, 2): 1.0, (128, 192, 5, 2): 0.97, (128, 128, 5, 2): 0.93,
                   (64, 128, 6, 1): 0.8,
                   (256, 64, 5, 2): 0.61, (128, 64, 6, 2): 0.6, (64, 64, 6, 1): 0.55}


SMALL_B_BYTES = 1 << 24   # B of a small product (a weight of at most 16 MiB), see _small_product


def _small_product(geo, sms: int, width: int, bm: int) -> bool:
    """Tiles of ``bm`` x 128 would leave half the SMs without one, and B (``width`` bytes an
    element) is at most SMALL_B_BYTES: 64 x 64 tiles give twice the blocks, each streaming less
    (H100: bf16 32 x 768 x 768 5.6 us against 6.6, tf32 32 x 1000 x 2048 11.9 against 15.7, fp8
    128 x 4096 x 4096 8.6 against 14.1 on 128 x 128; a larger B splits 128-column tiles instead:
    bf16 8 x 4096 x 4096 ran 22.4 us on 64 x 64, 19.5 on 64 x 128)."""
    return 2 * -(-geo.m // bm) * -(-geo.n // 128) * geo.batch < sms and geo.n * geo.k * width <= SMALL_B_BYTES


def _rows_tile(geo, sms: int, width: int) -> tuple:
    """One warpgroup of 64 rows: 64 columns on a small product, 128 while those tiles fill a
    wave, else 256 (fewer, longer streams)."""
    if _small_product(geo, sms, width, 64):
        return (64, 64, 6, 1)
    tiles = -(-geo.m // 64) * -(-geo.n // 128) * geo.batch
    return (64, 128, 6, 1) if tiles <= sms else (64, 256, 4, 1)


def _wgmma_tile(geo, sms: int, bk: int = 64) -> tuple:
    """The tile of least modelled time: a tile's work over its relative throughput times the
    waves of the walk ``wgmma_walk`` would plan (whole tiles, the last wave's split over the
    SMs where that models faster; a long K split over the SMs counts its units' waves). Up to 64
    rows of A (decode: a weight streamed from memory; a weight gradient's few output channels)
    take one warpgroup of 64 rows (``_rows_tile``: 64, 128 or 256 columns)."""
    if geo.m <= 64:
        return _rows_tile(geo, sms, 128 // bk)
    slices = -(-geo.k // bk)

    def cost(tile):
        bm, bn = tile[0], tile[1]
        tiles = -(-geo.m // bm) * -(-geo.n // bn) * geo.batch
        splits = long_k_splits(tiles, slices, sms)
        if splits > 1:
            return -(-tiles * splits // sms) * (-(-slices // splits) + SPLIT_FIXED) * bm * bn / WGMMA_HEURISTIC[tile]
        whole, splits = tail_split(tiles, slices, 1, _partial_slices(bm, bn, geo.m), sms) if finish_fits(
            bm, bn, tile[3]) and tiles > sms else (tiles, 1)   # (fewer tiles: split once the tile is chosen)
        return walk_cost(tiles, slices, 1, _partial_slices(bm, bn, geo.m), sms, whole, splits) * bm * bn \
            / WGMMA_HEURISTIC[tile]
    return min(WGMMA_HEURISTIC, key=cost)


def _heuristic_tile(kernel, req, geo, promote, sms, precision: str) -> dict:
    if kernel == "wgmma" and not promote:
        bm, bn, stages, wm = _wgmma_tile(geo, sms, 128 // _size(req.a_dtype))
        tiles = -(-geo.m // bm) * -(-geo.n // bn) * geo.batch
        # Many waves of 128 x 256 tiles: pairs of blocks share B by multicast (H200, 8192^3: fp16
        # 0.91x cuBLAS against 0.88x alone, bias+GELU 1.58 ms against 1.69; equal at 4096^3)
        return dict(bm=bm, bn=bn, bk=128 // _size(req.a_dtype), stages=stages, wm=wm, wn=1, group_m=8,
                    cluster=2 if (bm, bn) == (128, 256) and tiles >= 8 * sms else 1)
    if kernel == "wgmma":
        width = _size(req.a_dtype)
        bk = 128 // width
        if geo.m <= 64 or (geo.m <= 128 and _small_product(geo, sms, width, 128)):  # one warpgroup of 64 rows
            bn = 64 if geo.m > 64 or _rows_tile(geo, sms, width)[1] == 64 else 128  # (two accumulator sets)
            return dict(bm=64, bn=bn, bk=bk, stages=6, wm=1, wn=1, group_m=8)
        if geo.n <= 128 or geo.m * geo.n * geo.batch <= 2048 * 2048:
            return dict(bm=128, bn=128, bk=bk, stages=5, wm=2, wn=1, group_m=8)
        # fp8 drained into float32 (two accumulator sets): many waves of 128 x 192 tiles, pairs
        # of blocks sharing B by multicast (H200 8192^3: 1303 TFLOP/s against 1268 alone)
        tiles = -(-geo.m // 128) * -(-geo.n // 192) * geo.batch
        return dict(bm=128, bn=192, bk=bk, stages=5, wm=2, wn=1, group_m=8, cluster=2 if tiles >= 8 * sms else 1)
    if kernel == "mma":
        if req.a_dtype == "float32":
            return mma_f32_tile(geo.m, geo.n, geo.k, precision)
        if geo.m * geo.n * geo.batch <= 256 * 256:
            return dict(bm=64, bn=64, bk=64, stages=4, wm=2, wn=2, group_m=8)
        return dict(bm=128, bn=128, bk=32, stages=4, wm=2, wn=4, group_m=8)
    return dict(bm=64, bn=64, bk=16, stages=1, wm=1, wn=1, group_m=8)


SPLIT_MIN_K = 2048
TARGET_CTAS = 2 * DEFAULT_SMS
# The wgmma walk's model (``walk_cost``, in K slices' time): slices a K range keeps at least (its
# pipeline fill hidden behind them), slices' worth of time a piece of work spends outside its K
# loop (the fill, the epilogue), the gain a split must model over whole tiles, and the most
# ranges a tile is cut into (the last of them reads every partial).
SPLIT_MIN_SLICES = 4
SPLIT_FIXED = 3
SPLIT_GAIN = 0.9
# slices' time a split walk pays beyond that for its finish (the arrival, the tile's serial read
# and epilogue after the other ranges), from the H100 sweep of session 14: at 0 the model split
# tiles that ran slower split than whole (dgrad 3x3 256->256 14x14: 27.7 us against 22.6;
# bert_large.qkv a.T@b 29.4 against 26.1), at 8 those stay whole and the measured gains stay
# split (vit_b16.up a.T@b 66.7 -> 57.3 us, llama7b.o@4096 3xTF32 1779 -> 1352). Charged to a
# walk of split tiles only (fewer tiles than SMs) too since session 15: a short K split ran
# slower than whole tiles (H100: bf16 32 x 768 x 768 8.3 us split, 6.6 whole; fp8 64 x 10240
# x 8192 42.4 against 34.8), a long one stays split (decode 32 x 8192 x 28672).
SPLIT_FINISH = 8
SPLIT_MAX = 32
# A long K over few output tiles (a conv's weight gradient: K = N * P * Q output pixels): the
# one-launch finish sums a tile's partials in one block, a serial read of splits x tile bytes
# at the end (H200, ResNet-50's 1x1 64->64 wgrad, 1 tile x 32 splits: 26 us against cuDNN's
# 12.6). From LONG_K_SLICES K slices on tiles filling at most a quarter of the SMs, the splits
# fill one wave of units and a second launch (MatmulReduceSpec) sums the partials over the GPU
# (not when promoting: fp8 and 3xTF32 keep the finish they were measured with).
LONG_K_SLICES = 384


def _partial_slices(bm: int, bn: int, m: int) -> float:
    """A float32 partial tile's bytes (rows past M are not written) over a K slice's operand
    bytes (128 bytes of K a row of A and of B): its write, or one read, in slices' time."""
    return min(bm, m) * bn * 4 / ((bm + bn) * 128)


def walk_cost(tiles: int, slices: int, per_step: int, partial: float, sms: int, whole: int, splits: int) -> float:
    """Modelled time of a wgmma walk (common/tile_scheduler.cuh's TileWalk), in slices: the
    waves of ``whole`` tiles, then the waves of the rest's ``splits`` K ranges a tile (a range's
    steps, the fixed costs, its partial written and on average one read back), then the split
    tiles' finish (SPLIT_FINISH, the tile's last range reading every partial)."""
    steps = -(-slices // per_step)
    rest = tiles - whole
    if splits == 1:
        return -(-tiles // sms) * (slices + SPLIT_FIXED)
    units = -(-rest * splits // sms) * (-(-steps // splits) * per_step + SPLIT_FIXED + 2 * partial)
    return whole // sms * (slices + SPLIT_FIXED) + units + SPLIT_FINISH + partial * splits


def tail_split(tiles: int, slices: int, per_step: int, partial: float, sms: int) -> tuple[int, int]:
    """(whole tiles, splits) of least ``walk_cost``: the whole waves of tiles stay whole and
    the last, partial wave's tiles are cut into K ranges over the SMs (split-K; on fewer tiles
    than SMs, all of them), each at least SPLIT_MIN_SLICES slices, a tile into at most
    SPLIT_MAX; (tiles, 1), every tile whole, unless that models SPLIT_GAIN of it. Decode
    9 x 11008 x 4096 on 64 x 128 tiles: 86 tiles of 64 slices in one wave of 67 slices' time;
    split in 3, 258 ranges in two waves of 25."""
    whole = tiles // sms * sms
    rest, steps = tiles - whole, -(-slices // per_step)
    if not rest:
        return tiles, 1
    most = min(sms // rest, steps * per_step // SPLIT_MIN_SLICES, SPLIT_MAX, steps) if whole else \
        min(SPLIT_MAX, steps * per_step // SPLIT_MIN_SLICES, steps)
    best = min(range(1, max(1, most) + 1), key=lambda s: (walk_cost(tiles, slices, per_step, partial, sms, whole, s), s))
    if best == 1 or walk_cost(tiles, slices, per_step, partial, sms, whole, best) > SPLIT_GAIN * walk_cost(
            tiles, slices, per_step, partial, sms, tiles, 1):
        return tiles, 1
    return whole, best


def long_k_splits(tiles: int, slices: int, sms: int) -> int:
    """Splits of a long K over few tiles (one wave of units, each at least SPLIT_MIN_SLICES
    slices), or 1 outside that regime."""
    if slices < LONG_K_SLICES or tiles * 4 > sms:
        return 1
    return max(1, min(sms // tiles, slices // SPLIT_MIN_SLICES))


def _spec_long_k_splits(spec: MatmulSpec, geo, sms: int) -> int:
    """``long_k_splits`` of a wgmma spec's tiles, or 1 where its partials must be finished in
    the launch: fp8 and 3xTF32 (promoting, measured with the finish), image rows (c_rows)."""
    if spec.scaled or spec.c_rows or spec.promote:
        return 1
    return long_k_splits(-(-geo.m // spec.bm) * -(-geo.n // spec.bn) * geo.batch, -(-geo.k // spec.bk), sms)


def sums_in_second_launch(spec: MatmulSpec, geo, sms: int = DEFAULT_SMS) -> bool:
    """Whether a wgmma plan's split partials are summed by a second launch (a long K over few
    tiles, ``long_k_splits``) rather than by the last split of each tile."""
    return _spec_long_k_splits(spec, geo, sms) > 1


def wgmma_walk(spec: MatmulSpec, geo, split_k: int | None, sms: int = DEFAULT_SMS) -> tuple[int, int]:
    """(whole tiles, splits of the others) of a wgmma plan's walk on ``spec``'s tiles (tile
    pairs for a 2-block cluster, which takes no split unless asked): ``split_k`` asked for (at
    most one a K step) or a long K's ``long_k_splits`` split every tile; else ``tail_split``
    where the tile has a finish variant (``specs.finish_fits``). (tiles, 1): every tile whole."""
    per_step = 2 if spec.promote else 1
    steps = -(-(-(-geo.k // spec.bk)) // per_step)
    tiles = -(-geo.m // (spec.bm * spec.cluster)) * -(-geo.n // spec.bn) * geo.batch
    if split_k is not None:
        return 0, max(1, min(int(split_k), steps))
    if spec.cluster > 1:
        return tiles, 1
    splits = _spec_long_k_splits(spec, geo, sms)
    if splits > 1:
        return 0, splits
    if not finish_fits(spec.bm, spec.bn, spec.wm):
        return tiles, 1
    return tail_split(tiles, steps * per_step, per_step, _partial_slices(spec.bm, spec.bn, geo.m), sms)


def split_count(spec: MatmulSpec, geo, split_k: int | None, sms: int = DEFAULT_SMS) -> int:
    """K ranges of the mma and SIMT kernels (the wgmma kernel's walk: ``wgmma_walk``): asked
    for (at most one a K slice), or when the output tiles fill less than half the GPU and K is
    long (each range keeps at least 512 of K; MMA_F32_MIN_CHUNK on float32 tiles of up to 64 rows)."""
    if split_k is not None:
        return max(1, min(int(split_k), -(-geo.k // spec.bk)))
    tiles = -(-geo.m // spec.bm) * -(-geo.n // spec.bn) * geo.batch
    # few float32 rows stream B: a K of MMA_F32_MIN_CHUNK a range already keeps the copies busy
    rows = spec.kernel == "mma" and spec.a_dtype == "float32" and spec.bm <= 64
    chunk = MMA_F32_MIN_CHUNK if rows else 512
    if geo.k < (2 * chunk if rows else SPLIT_MIN_K) or tiles * 2 > TARGET_CTAS:
        return 1
    return max(1, min(TARGET_CTAS // tiles, geo.k // chunk, 32))


# -- float32 on the mma kernel ------------------------------------------------------------------------
# The wgmma kernel reads float32 K-major only, and its 3xTF32 ("exact") reads hi / lo copies of
# both operands: an operand it cannot read as it lies is repacked first, in tf32 read, written and
# read again (3x its bytes), for 3xTF32 read, written as three planes and read (7x). The mma
# kernel reads both as they lie (3xTF32 split in registers) at a fraction of wgmma's tensor rate,
# and copies of fewer than 16 bytes (a prime K) slow its reads. ``mma_reads_in_place`` weighs the
# two rooflines; its rates are this kernel's on the H100 where the choice is close (session 15,
# forced tiles, 128 x 4096 x 4096: tf32 59 us, 73 TFLOP/s; 3xTF32 121 us, 106; at 512 rows it ran
# 91 and 115, where wgmma wins either way). Measured with it: tf32 16 x 28672 x 4096
# a @ b 493 -> 174 us, exact 32 x 8192 x 28672 2338 -> 425 us, exact 128 x 4096 x 4096 191 -> 121
# us; tf32 batched p @ v (48 x 512 x 64 x 512: half of mma's 128-column tiles padding) stays
# on wgmma (mma 48.3 us against 31.9).
MMA_TF32_TFLOPS = 70      # mma.sync tf32 products of this kernel
MMA_3XTF32_TFLOPS = 105   # the same counting 3xTF32's three products (more products a fragment load)
WGMMA_TF32_TFLOPS = 300   # wgmma tf32 (a tile of 64 rows: M / 64 of it for fewer rows)
COPY_TBS = 3.0            # bytes a second (TB/s) either kernel streams its operands at
MMA_F32_MIN_CHUNK = 256   # K of a split range on few rows (the copies stay busy from there)


def mma_reads_in_place(geo, precision: str, repacked: tuple[bool, bool], vec: int) -> bool:
    """Whether a float32 product runs faster on the mma kernel reading A and B in place (``vec``
    elements a copy) than on wgmma after its repacks (``repacked``: which operands tf32 would
    copy; 3xTF32 copies both)."""
    three = precision == "exact"
    if not (three or any(repacked)):
        return False
    passes = 3 if three else 1
    tile = mma_f32_tile(geo.m, geo.n, geo.k, precision)   # the products its tiles compute, padding included
    flops = 2 * geo.batch * -(-geo.m // tile["bm"]) * tile["bm"] * -(-geo.n // tile["bn"]) * tile["bn"] * geo.k * passes
    sizes = (4 * geo.m * geo.k * (geo.batch if geo.a[2] else 1), 4 * geo.n * geo.k * (geo.batch if geo.b[2] else 1))
    extra = sum(size * (6 if three else 2) for size, copied in zip(sizes, repacked) if copied or three)
    mma = max(flops / ((MMA_3XTF32_TFLOPS if three else MMA_TF32_TFLOPS) * 1e12),
              sum(sizes) / (COPY_TBS * 1e12 * min(1.0, vec / 4)))
    wgmma = max(2 * geo.batch * geo.m * geo.n * geo.k * passes / (WGMMA_TF32_TFLOPS * 1e12 * min(1.0, geo.m / 64)),
                (sum(sizes) + extra) / (COPY_TBS * 1e12))
    return mma < wgmma


def mma_f32_tile(m: int, n: int, k: int, precision: str) -> dict:
    """The mma tile of float32 A by rows: 16 or 32 rows by 128 columns in warps of 16 or 32 x 32
    (16 rows to 32 on a small weight of up to 2^22 elements, 32 to 128 on one: more blocks, each
    streaming less; H100, exact 77 x 3072 x 768 22.0 us against 28.2 on 64 x 64); else 64 x 128
    (tf32 warps of 32 x 64, to 128 rows; 3xTF32 holds 214-245 registers at 32 x 32 on sm_90, up
    to 255 on sm_80, so 64 x 64 past 64 rows); tf32 past 128 rows 128 x 128 (sm_80's GEMM)."""
    small = n * k <= 1 << 22
    if m <= 16 or (m <= 32 and small):
        return dict(bm=16, bn=128, bk=32, stages=4, wm=1, wn=4, group_m=8)
    if m <= 32 or (m <= 128 and small):
        return dict(bm=32, bn=128, bk=32, stages=4, wm=1, wn=4, group_m=8)
    if precision == "tf32":
        return dict(bm=64, bn=128, bk=32, stages=4, wm=2, wn=2, group_m=8) if m <= 128 else \
            dict(bm=128, bn=128, bk=32, stages=3, wm=2, wn=4, group_m=8)
    return dict(bm=64, bn=128, bk=32, stages=4, wm=2, wn=4, group_m=8) if m <= 64 else \
        dict(bm=64, bn=64, bk=32, stages=4, wm=2, wn=2, group_m=8)


# -- the skinny (decode) kernel --------------------------------------------------------------------
# At most SKINNY_MAX_ROWS rows of A against a weight read once: 2 * rows / width flops a weight
# byte, under the float32 FMA roofline of FMA_FLOPS_PER_BYTE (H200: 67 TFLOP/s over 4.8 TB/s), so
# the weight read is the time and float32 FMA keeps up (fp8 at 8 rows: 16, past it: the tensor
# cores). The kernel (kernels/matmul/skinny.py) holds its rows in registers in buckets of 1, 2, 4, 8.
SKINNY_MAX_ROWS = 8
SKINNY_ROWS = (1, 2, 4, 8)
FMA_FLOPS_PER_BYTE = 14
SKINNY_BLOCKS = 8            # blocks an SM the split aims at (all resident: bytes in flight, even shares)
SKINNY_MAX_SPLITS = 64


SKINNY_LANE_SUMS = 64       # N-major: float sums a lane holds (rows x 16 / width; fp8 at 8 rows spilled)


# Rows the skinny kernel takes by A's element width, as measured against the wgmma split-K on
# the H200 (sweep of 2026-12-05): float32 at 1-8 rows ran 1.0-4.3 TB/s, ahead of it; 16-bit at
# one row 0.76-1.08x cuBLAS, but at 4-8 rows only 0.8-2.7 TB/s (0.25-0.72x, the split-K did
# better); fp8 0.2-0.6x at every count (its per-element convert). Past these: the tensor cores.
SKINNY_ROWS_MEASURED = {4: 8, 2: 1, 1: 0}


def skinny_rows(rows: int, width: int, b_major: str) -> int:
    """The row bucket of the skinny kernel for ``rows`` (batch folded in) rows of A of ``width``
    bytes an element, or 0 when the product is not memory bound on float32 FMA, or past what
    the kernel was measured to win (SKINNY_ROWS_MEASURED), or (N-major) the bucket's sums
    would not fit a lane's registers: fp8 past 4 rows."""
    if rows > min(SKINNY_MAX_ROWS, SKINNY_ROWS_MEASURED.get(width, 0)) or 2 * rows / width > FMA_FLOPS_PER_BYTE:
        return 0
    bucket = next(r for r in SKINNY_ROWS if r >= rows)
    return 0 if b_major == "n" and bucket * 16 // width > SKINNY_LANE_SUMS else bucket


def skinny_tile(rows: int, b_major: str, vec: int) -> dict:
    """Columns a warp (K-major B: a lane holds cols x vec weights and cols x rows sums; fp8 at
    4 x 16 held 239 registers) and K vectors in flight."""
    if b_major == "n":
        return dict(cols=1, threads=256, unroll=1)
    return dict(cols=min(4, 32 // vec, 16 // rows), threads=256, unroll=2)


def skinny_splits(blocks: int, k: int, min_chunk: int, sms: int = DEFAULT_SMS) -> int:
    """K splits of a skinny launch of ``blocks`` column blocks: enough blocks for SKINNY_BLOCKS an
    SM, each split at least ``min_chunk`` of K."""
    if blocks >= SKINNY_BLOCKS * sms:
        return 1
    return max(1, min(-(-SKINNY_BLOCKS * sms // blocks), k // min_chunk, SKINNY_MAX_SPLITS))
