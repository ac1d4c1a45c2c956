//! The one-token products (n = 1) and the weights they read: weights uploaded once in their
//! device layout (`repack_*`, [`DevWeight`]), the GEMV variant a launch takes
//! ([`CudaBackend::gemv_default`]: work split, rows per block, warps, mode), the x limbs of the
//! integer form, and the launches (x-stationary `gemv_*`, warp-rows `gemvw_*` over up to three
//! weights sharing x, the q/k/v launch whose store does RoPE and the KV append); products of
//! n > 1 tokens go on to the GEMM (`gemm.rs`) or the SIMT `matmul_*`.

use super::*;

/// Q4_K warp-rows launches of rows of 128..255 units and fewer rows than this take pair units
/// (mode 3; see `gemv_select`).
pub(super) const PAIR_BELOW_ROWS: usize = 8192;

/// Q4_K warp-rows launches of rows of 128..255 units and at least this many rows take NW 2.
pub(super) const NW2_ROWS: usize = 8192;

/// A one-row q/k/v GEMV's store (see `GemvRows`): NORM RoPE by the table `cs`, k and v appended to
/// their caches. The launch's parts are q, k, v from role `first` on (0: q first; 2: v alone, the
/// launch after a q + k one when v's type differs, as in Q4_K_M's promoted layers). `done` is set
/// when the launch took it (a warp-rows GEMV, of even R over even q and k row counts where it has
/// q or k rows); otherwise the caller still owes the RoPE and the appends.
pub(super) struct GemvEpi<'a> {
    pub(super) cs: &'a CudaSlice<f32>,
    pub(super) kc: &'a mut CudaSlice<f32>,
    pub(super) vc: &'a mut CudaSlice<f32>,
    pub(super) head_dim: usize,
    pub(super) rope_dim: usize,
    pub(super) slot: usize,
    pub(super) dpos: bool,
    pub(super) first: usize,
    pub(super) done: bool,
}

/// A weight resident on the device.
pub(super) struct DevWeight {
    pub(super) data: CudaSlice<u8>,
    /// The device layout's type (F32 for types dequantized on upload).
    pub(super) ty: GgmlType,
    pub(super) suffix: &'static str,
    pub(super) row_bytes: usize,
}

/// `GemvRows` in kernels/common.cuh, the output rows of a warp-rows GEMV: up to three weight
/// matrices of one type and width sharing x (q/k/v, gate/up), rows numbered one after another
/// (matrix 0 below `end[0]`, matrix 1 below `end[1]`, matrix 2 the rest); unused pointers are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct GemvRows {
    pub(super) w: [u64; 3],
    pub(super) out: [u64; 3],
    pub(super) end: [i32; 2],
    /// The q/k/v store (`GemvRows::store` in common.cuh; `cs` 0: plain stores): the RoPE angle
    /// table, the k and v caches, the position word (0: `kv_row`), then head_dim, rope_dim,
    /// kv_row and the total rows.
    pub(super) cs: u64,
    pub(super) kc: u64,
    pub(super) vc: u64,
    pub(super) pos_dev: u64,
    pub(super) rope: [i32; 4],
}

// SAFETY: #[repr(C)] plain integers laid out as the kernel's struct (three 8-byte pointers, three
// more, two ints, four pointers, four ints: 104 bytes, 8-byte aligned).
unsafe impl cudarc::driver::DeviceRepr for GemvRows {}

/// Rows of blocks as the device keeps them: in each row, every block's quant bytes back to back,
/// then every block's `header` leading bytes (its scales); the same bytes and row length as the
/// ggml row. Q8_0 (34-byte blocks, a 2-byte f16 d), Q4_1 (20, f16 d and m) and Q4_K (144, d,
/// dmin and 12 scale bytes) are kept so: a warp's quant loads are one contiguous, aligned run.
pub(super) fn repack_headers_last(bytes: &[u8], rows: usize, row_bytes: usize, block: usize, header: usize) -> Vec<u8> {
    let quants = block - header;
    let n_blocks = row_bytes / block;
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        let src = &bytes[r * row_bytes..(r + 1) * row_bytes];
        let dst = &mut out[r * row_bytes..(r + 1) * row_bytes];
        let (dst_q, dst_h) = dst.split_at_mut(n_blocks * quants);
        for ((blk, q), h) in src
            .chunks_exact(block)
            .zip(dst_q.chunks_exact_mut(quants))
            .zip(dst_h.chunks_exact_mut(header))
        {
            q.copy_from_slice(&blk[header..]);
            h.copy_from_slice(&blk[..header]);
        }
    }
    out
}

/// Q6_K rows as the device keeps them (`kernels/matmul.cu`, `deq8`): every super-block's 128 `ql` bytes
/// back to back, then every one's 64 `qh` bytes, then its 16 scales in unit order, then its f16
/// `d`; the same bytes and row length as the ggml row (210 per super-block). Unit i of a
/// super-block (n = i / 4, p = i / 2 % 2, is = i % 2) is `ql` bytes 16i .. 16i + 16 (positions
/// 128n + 32p + 16is + k from the low nibbles, 64 further on from the high ones); its two scale
/// bytes are ggml's sc[8n + is + 2p] and sc[8n + is + 2p + 4]. So a warp's quant loads are one
/// aligned 512-byte run, where the ggml blocks are only 2-byte aligned.
pub(super) fn repack_q6_k(bytes: &[u8], rows: usize, row_bytes: usize) -> Vec<u8> {
    let n_sb = row_bytes / 210;
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        let src = &bytes[r * row_bytes..(r + 1) * row_bytes];
        let dst = &mut out[r * row_bytes..(r + 1) * row_bytes];
        let (ql, rest) = dst.split_at_mut(128 * n_sb);
        let (qh, rest) = rest.split_at_mut(64 * n_sb);
        let (sc, d) = rest.split_at_mut(16 * n_sb);
        for (b, blk) in src.chunks_exact(210).enumerate() {
            ql[128 * b..128 * (b + 1)].copy_from_slice(&blk[..128]);
            qh[64 * b..64 * (b + 1)].copy_from_slice(&blk[128..192]);
            for i in 0..8 {
                let (n, p, is) = (i / 4, i / 2 % 2, i % 2);
                sc[16 * b + 2 * i] = blk[192 + 8 * n + is + 2 * p];
                sc[16 * b + 2 * i + 1] = blk[192 + 8 * n + is + 2 * p + 4];
            }
            d[2 * b..2 * b + 2].copy_from_slice(&blk[208..210]);
        }
    }
    out
}

/// The device bytes of a ggml weight of a type with a register decoder.
pub(super) fn device_layout(ty: GgmlType, bytes: &[u8], rows: usize, row_bytes: usize) -> std::borrow::Cow<'_, [u8]> {
    match ty {
        GgmlType::Q8_0 => std::borrow::Cow::Owned(repack_headers_last(bytes, rows, row_bytes, 34, 2)),
        GgmlType::Q4_1 => std::borrow::Cow::Owned(repack_headers_last(bytes, rows, row_bytes, 20, 4)),
        GgmlType::Q4K if row_bytes % 144 == 0 => {
            std::borrow::Cow::Owned(repack_headers_last(bytes, rows, row_bytes, 144, 16))
        }
        GgmlType::Q6K if row_bytes % 210 == 0 => std::borrow::Cow::Owned(repack_q6_k(bytes, rows, row_bytes)),
        _ => std::borrow::Cow::Borrowed(bytes),
    }
}

/// An integer-form GEMV's x limbs: borrowed from x's buffer, or made by the pre-pass for this
/// launch (pooled scratch, back to the pool when dropped after the launch is enqueued).
pub(super) enum XLimbs<'a> {
    Given(&'a CudaSlice<f32>),
    Made(Buf),
}

impl XLimbs<'_> {
    pub(super) fn get(&self) -> &CudaSlice<f32> {
        match self {
            XLimbs::Given(q) => q,
            XLimbs::Made(b) => dev(b),
        }
    }
}

/// The f32 words of the integer GEMV's x limbs for `cols` values: three int8 planes, a scale per
/// 32 values and a sum per 8 (`gemv_x_limbs` in kernels/ops.cu).
pub(super) fn limbs_words(cols: usize) -> usize {
    3 * cols / 4 + cols / 32 + cols / 8
}

impl CudaBackend {
    /// The device copy of a weight, uploaded on first use.
    pub(super) fn weight(&self, w: WeightRef<'_>, s: &Arc<CudaStream>) -> Arc<DevWeight> {
        let (key, rows, cols) = match w {
            WeightRef::F32(m) => ((m.data.as_ptr() as usize, m.data.len() * 4), m.rows, m.cols),
            WeightRef::Quant(q) => ((q.bytes.as_ptr() as usize, q.bytes.len()), q.rows, q.cols),
        };
        if let Some(d) = self.weights.lock().expect("weight map").get(&key) {
            return d.clone();
        }
        let dev = match w {
            WeightRef::F32(m) => {
                // SAFETY: an f32 slice viewed as its bytes (u8 has no alignment or validity needs).
                let bytes = unsafe { std::slice::from_raw_parts(m.data.as_ptr() as *const u8, m.data.len() * 4) };
                DevWeight {
                    data: ok(s.clone_htod(bytes)),
                    ty: GgmlType::F32,
                    suffix: "f32",
                    row_bytes: cols * 4,
                }
            }
            WeightRef::Quant(q) => match type_suffix(q.ty) {
                Some(suffix) => DevWeight {
                    data: ok(s.clone_htod(&*device_layout(q.ty, q.bytes, rows, q.row_bytes))),
                    ty: q.ty,
                    suffix,
                    row_bytes: q.row_bytes,
                },
                None => {
                    let mut f = vec![0f32; rows * cols];
                    crate::dequant::dequantize(q.ty, q.bytes, &mut f)
                        .expect("weight shard lengths are checked at load");
                    // SAFETY: as above.
                    let bytes = unsafe { std::slice::from_raw_parts(f.as_ptr() as *const u8, f.len() * 4) };
                    DevWeight {
                        data: ok(s.clone_htod(bytes)),
                        ty: GgmlType::F32,
                        suffix: "f32",
                        row_bytes: cols * 4,
                    }
                }
            },
        };
        ok(s.synchronize());
        let dev = Arc::new(dev);
        self.weights.lock().expect("weight map").insert(key, dev.clone());
        dev
    }

    /// The GEMV variant a one-token product of `w` takes by default, if any.
    pub(super) fn gemv_variant(&self, w: &DevWeight, rows: usize, cols: usize) -> Option<GemvVariant> {
        self.gemv_select(w.ty, w.row_bytes, rows, cols)
    }

    /// The GEMV variant a one-token product of a `[rows, cols]` weight of type `ty` (ggml row
    /// length, device layout) takes, if any (`None`: the warp-per-row matvec, also where
    /// `LLMDIFF_CUDA_DISABLE=gemv`).
    ///
    /// From the H200 sweep of every variant (`kernels --bench`): F16, BF16 and narrow Q8_0 rows
    /// take the x-stationary split (R 2 for F16/BF16, 4 for Q8_0, the smallest UPT whose block
    /// fits: 90–93 % and 71–78 % of copy bandwidth, where warp-rows reached 83–89 % and 63–68 %);
    /// Q8_0 rows from 128 units take warp-rows R 4, NW 4, U 1 in the integer form (84–95 % of
    /// copy); Q4_K and Q4_1 take warp-rows, which is as fast there (all splits within ~3 %) and
    /// lets `linear_many` put a layer's q/k/v or gate/up in one launch: Q4_K R 8, NW 4 (2 under
    /// 128 units, and under 256 in launches of 8192 rows or more), U 1, and pair units (mode 3,
    /// R 4, NW by the row's chunks of 2048 values) for rows of 128..255 units in launches under
    /// 8192 rows; Q4_1 R 8, NW 4, U 2 from 128 units, R 4, NW 4, U 1 from 64, else R 4, NW 2, U 2.
    /// Warp-rows from 128 units take the integer form (mode 2: dp4a on x in int8 limbs, 8–12 %
    /// faster on the 8B shapes, slower on smollm2's narrow rows), the rest mode 0. The nearest
    /// compiled variant is taken (R first, then NW, then U).
    pub fn gemv_default(&self, ty: GgmlType, rows: usize, cols: usize) -> Option<GemvVariant> {
        let row_bytes = cols / ty.block_elems() * ty.block_bytes();
        self.gemv_select(ty, row_bytes, rows, cols)
    }

    pub(super) fn gemv_select(&self, ty: GgmlType, row_bytes: usize, rows: usize, cols: usize) -> Option<GemvVariant> {
        if self.disable.gemv {
            return None;
        }
        let ok_shape = match ty {
            GgmlType::F16 | GgmlType::BF16 => cols % 8 == 0,
            GgmlType::Q8_0 => row_bytes % 16 == 0 && cols % 32 == 0,
            // Whole 8-byte quant loads: an even number of blocks per row.
            GgmlType::Q4_1 => cols % 64 == 0 && row_bytes == cols / 32 * 20,
            GgmlType::Q4K => cols % 256 == 0 && row_bytes == cols / 256 * 144,
            // 16-byte quant loads: a row of 210-byte super-blocks stays aligned when it holds a
            // multiple of 8 (4096 and 14336 wide rows do; 1536 wide ones take the generic matvec).
            GgmlType::Q6K => cols % 256 == 0 && row_bytes == cols / 256 * 210 && row_bytes % 16 == 0,
            _ => false,
        };
        if !ok_shape || cols == 0 {
            return None;
        }
        let units = cols / GemvVariant::unit_values(ty);
        let maxt = GemvVariant::max_threads(ty);
        // The smallest UPT whose x-stationary block (⌈units/UPT⌉ threads, whole warps) fits.
        let xs_upt = [1usize, 2, 4]
            .into_iter()
            .find(|u| units.div_ceil(*u).div_ceil(32) * 32 <= maxt);
        let kind = match ty {
            // Q6_K has warp-rows variants only.
            GgmlType::Q4K | GgmlType::Q4_1 | GgmlType::Q6K => GemvKind::Wr,
            // Wide Q8_0 rows: warp-rows R 4, NW 4, U 1 in the integer form ran at 84 and 95 % of
            // copy on the H200, x-stationary at 70 and 75 % (launches chained by PDL).
            GgmlType::Q8_0 if units >= 128 => GemvKind::Wr,
            // Wide F16 rows: warp-rows R 2, NW 4, U 1 read 100–103 % of copy at 14336×4096 and
            // 4096×14336 on the H200, x-stationary 93–95 %, and an 8-layer F16 8B-shaped model
            // decoded in 1.035 against 1.169 ms a token. BF16 was not measured so.
            GgmlType::F16 if units >= 256 => GemvKind::Wr,
            _ => GemvKind::Xs,
        };
        // How quants meet x: the integer form (mode 2) for Q4_K, Q4_1, Q8_0 and Q6_K warp-rows,
        // Q4_K's pair units (mode 3) for its narrow launches, else exact floats (mode 0).
        let mode = match (kind, ty) {
            // Q4_K launches of rows of 128..255 units and under 8192 rows (the 8B's q/k/v and o)
            // take pair units, R 4, NW 2: 47–48 % of copy at 4096×4096 against 44 %, and 8B decode
            // 1.982–1.986 ms against 1.990–1.995 in three interleaved runs.
            (GemvKind::Wr, GgmlType::Q4K) if (128..256).contains(&units) && rows < PAIR_BELOW_ROWS => 3,
            // Narrow rows (smollm2's) lose more to the pre-pass's launch than they gain.
            (GemvKind::Wr, GgmlType::Q4K | GgmlType::Q4_1 | GgmlType::Q8_0) if units >= 128 => 2,
            // Q6_K (H200): the integer form read 71 % of copy at 4096×14336 and 81 % at 32000×4096
            // (float form 61 and 70 %), but 18 % against 20–23 % at 1024×4096.
            (GemvKind::Wr, GgmlType::Q6K) if units >= 256 || rows >= 8192 => 2,
            _ => 0,
        };
        // Warp-rows (R, NW, U) by type and row length in units; pair units (mode 3): R 4, NW by
        // the row's chunks of 2048 values (`pair_nw`), U 1.
        let (wr_r, wr_nw, wr_u) = match ty {
            GgmlType::Q4K if mode == 3 => (4, pair_nw(cols), 1),
            GgmlType::Q4K => {
                // NW 2 under 128 units, and under 256 in launches of 8192 rows or more (the 8B's
                // gate/up and output head: 2.0 % off its decode step; its q/k/v and o lose with NW 2).
                let nw2 = units < 128 || (units < 256 && rows >= NW2_ROWS);
                (8, if nw2 { 2 } else { 4 }, 1)
            }
            GgmlType::Q4_1 if units >= 128 => (8, 4, 2),
            GgmlType::Q4_1 if units >= 64 => (4, 4, 1),
            // smollm2's rows (18 and 48 units): 0.67-0.68 ms a decode step against 0.81 at
            // (1, 4, 2) on the H200, in the graph.
            GgmlType::Q4_1 => (4, 2, 2),
            // R 8, U 2 read 93 % of copy at 4096×14336 against R 4, U 1's 86 %, but a 16-layer
            // Q8_0 model's decode step was the same under both, so R 4, U 1 stays.
            GgmlType::Q8_0 => (4, 4, 1),
            GgmlType::F16 => (2, 4, 1),
            // Q6_K (H200): R 4, NW 4 at 4096×14336 (U 2: 10 points less), R 8, NW 2 at
            // 32000×4096, R 8, NW 4 (float form) at 1024×4096; the others within 2 points.
            GgmlType::Q6K if units >= 256 => (4, 4, 1),
            GgmlType::Q6K => (8, if rows >= 8192 { 2 } else { 4 }, 1),
            _ => (4, if units >= 128 { 4 } else { 2 }, if units >= 256 { 2 } else { 1 }),
        };
        match kind {
            GemvKind::Xs => {
                let upt = xs_upt?;
                let r = match ty {
                    GgmlType::Q4K | GgmlType::Q8_0 | GgmlType::Q4_1 => 4,
                    _ => 2,
                };
                // R 6 and 8 exist for Q4_K at UPT 1 only, the integer form at fewer (R, UPT);
                // R 4, then mode 0, stand in.
                let find = |r: usize, m: usize| {
                    GEMV_VARIANTS
                        .iter()
                        .copied()
                        .find(|v| v.kind == GemvKind::Xs && v.ty == ty && v.mode == m && v.r == r && v.upt == upt)
                };
                find(r, mode)
                    .or_else(|| find(4, mode))
                    .or_else(|| find(r, 0))
                    .or_else(|| find(4, 0))
            }
            // The nearest compiled variant (R first, then NW, then U).
            GemvKind::Wr => GEMV_VARIANTS
                .iter()
                .copied()
                .filter(|v| v.kind == kind && v.ty == ty && v.mode == mode)
                .min_by_key(|v| (v.r.abs_diff(wr_r), v.nw.abs_diff(wr_nw), v.upt.abs_diff(wr_u))),
        }
    }

    /// Whether GEMV variant `v` can run a row of `cols` values (of a shape the GEMV takes): an
    /// x-stationary block must fit in its launch bound.
    pub fn gemv_fits(&self, v: GemvVariant, cols: usize) -> bool {
        let units = cols / GemvVariant::unit_values(v.ty);
        match v.kind {
            GemvKind::Xs => units.div_ceil(v.upt).div_ceil(32) * 32 <= GemvVariant::max_threads(v.ty),
            GemvKind::Wr => true,
        }
    }

    /// Launches GEMV variant `v` (n = 1). x-stationary: a block of ⌈units/UPT⌉ threads (whole
    /// warps), a grid of at most the resident blocks, each walking groups of R rows. The other
    /// kinds launch through [`CudaBackend::launch_gemv_rows`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gemv(
        &self,
        s: &Arc<CudaStream>,
        w: &DevWeight,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        v: GemvVariant,
    ) {
        if v.kind != GemvKind::Xs {
            return self.launch_gemv_rows(s, &mut [(w, out, rows)], cols, x, xq, v, None);
        }
        let name = v.entry();
        let units = cols / GemvVariant::unit_values(v.ty);
        let threads = (units.div_ceil(v.upt).div_ceil(32) * 32).max(32) as u32;
        assert!(
            threads as usize <= GemvVariant::max_threads(v.ty),
            "gemv: block too large"
        );
        let per_sm = self.blocks_per_sm(&name, threads, 0);
        let groups = rows.div_ceil(v.r);
        let cfg = LaunchConfig {
            grid_dim: (groups.min((self.sms * per_sm) as usize).max(1) as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c, rb) = (rows as i32, cols as i32, w.row_bytes as i32);
        let limbs = v.takes_limbs().then(|| self.x_limbs(s, x, cols, xq));
        let mut b = s.launch_builder(self.func(&name));
        b.arg(&w.data).arg(x);
        if let Some(q) = &limbs {
            b.arg(q.get());
        }
        b.arg(out).arg(&r).arg(&c).arg(&rb);
        // SAFETY: the arguments match gemv_* in kernels/gemv.cu; W is rows·row_bytes in the
        // device layout, x has cols floats, out rows floats; mode 2 gets xq, sized by gemv_x_limbs.
        ok(unsafe { b.launch(cfg) });
    }

    /// Launches warp-rows GEMV variant `v` over one to three weights of one type and width that
    /// share `x`, each `(weight, out, rows)`, in one launch (`GemvRows`): a block per R rows of
    /// their rows taken one after another.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gemv_rows(
        &self,
        s: &Arc<CudaStream>,
        parts: &mut [(&DevWeight, &mut CudaSlice<f32>, usize)],
        cols: usize,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<f32>>,
        v: GemvVariant,
        epi: Option<&mut GemvEpi<'_>>,
    ) {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        assert!(
            (1..=3).contains(&parts.len()) && v.kind == GemvKind::Wr,
            "gemv: one to three warp-rows parts"
        );
        let row_bytes = parts[0].0.row_bytes;
        let total: usize = parts.iter().map(|p| p.2).sum();
        // Part i takes slot `first + i` (q, k, v with a store; else 0, 1, 2), and end[j] counts the
        // rows of the slots up to j, so a lone v part (first 2) has end = [0, 0].
        let first = epi.as_ref().map_or(0, |e| e.first);
        assert!(first + parts.len() <= 3, "gemv: parts past the third slot");
        let mut m = GemvRows::default();
        let mut guards = Vec::with_capacity(2 * parts.len());
        let mut end = 0usize;
        for (i, (w, out, rows)) in parts.iter_mut().enumerate() {
            assert!(
                w.row_bytes == row_bytes && w.ty == v.ty,
                "gemv: parts differ in type or width"
            );
            assert!(out.len() >= *rows, "gemv: an output is shorter than its rows");
            let (wp, gw) = w.data.device_ptr(s);
            let (op, go) = out.device_ptr_mut(s);
            (m.w[first + i], m.out[first + i]) = (wp, op);
            guards.push(gw);
            guards.push(go);
            end += *rows;
            for e in first + i..2 {
                m.end[e] = end as i32;
            }
        }
        // RoPE pairs (rows 2i, 2i + 1 of q or k) must fall in one block; a lone v has none.
        let even = |r: i32| r % 2 == 0;
        let pairs_whole = m.end[1] == 0 || (v.r % 2 == 0 && even(m.end[0]) && even(m.end[1]));
        let epi = epi.filter(|_| pairs_whole);
        if let Some(e) = epi {
            let (cs, gc) = e.cs.device_ptr(s);
            let (kc, gk) = e.kc.device_ptr_mut(s);
            let (vc, gv) = e.vc.device_ptr_mut(s);
            guards.extend([gc, gk, gv]);
            (m.cs, m.kc, m.vc) = (cs, kc, vc);
            if e.dpos {
                let (pd, gp) = self.pos_dev.device_ptr(s);
                m.pos_dev = pd;
                guards.push(gp);
            }
            m.rope = [e.head_dim as i32, e.rope_dim as i32, e.slot as i32, total as i32];
            e.done = true;
        }
        let (threads, groups) = ((v.nw * 32) as u32, total.div_ceil(v.r) as u32);
        let cfg = LaunchConfig {
            grid_dim: (groups, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c, rb) = (total as i32, cols as i32, row_bytes as i32);
        // The integer forms' (warp-rows modes 2 and 3): x in int8 limbs, block
        // scales and Σx per 8, unless x came with them (`xq`, see DevBuf::limbs).
        let limbs = v.takes_limbs().then(|| self.x_limbs(s, x, cols, xq));
        if self.pdl {
            use cudarc::driver::DevicePtr;
            let (xp, gx) = x.device_ptr(s);
            let (mut ptrs, mut x_guards) = (vec![xp], vec![gx]);
            if let Some(q) = &limbs {
                let (qp, gq) = q.get().device_ptr(s);
                ptrs.push(qp);
                x_guards.push(gq);
            }
            let mut params: Vec<*mut std::ffi::c_void> = vec![(&mut m as *mut GemvRows).cast()];
            params.extend(ptrs.iter_mut().map(|p| (p as *mut u64).cast()));
            let mut ints = [r, c, rb];
            params.extend(ints.iter_mut().map(|v| (v as *mut i32).cast()));
            // SAFETY: gemvw_* take (GemvRows, x, [xq if takes_limbs], rows, cols,
            // row_bytes), sized as for the plain launch below; they wait (griddep_wait) before
            // reading x or xq or writing anything; `params` and the pointers they name outlive the
            // call, and `guards` keeps the buffers ordered on this stream.
            unsafe { self.launch_pdl(s, &v.entry(), cfg, &mut params) };
            drop((x_guards, guards));
            return;
        }
        let mut b = s.launch_builder(self.func(&v.entry()));
        b.arg(&m).arg(x);
        if let Some(q) = &limbs {
            b.arg(q.get());
        }
        b.arg(&r).arg(&c).arg(&rb);
        // SAFETY: the arguments match gemvw_* in kernels/gemv_rows.cu (modes 2 and 3 get xq, sized
        // by gemv_x_limbs): each part's W is rows·row_bytes in the device
        // layout and its out at least rows floats, x has cols floats; the pointers stay valid (and
        // ordered on this stream) while `guards` lives, past the launch.
        ok(unsafe { b.launch(cfg) });
        drop(guards);
    }

    /// Scratch for the limbs of an op's output when it is one row of `d` values (`len == d`) that
    /// an integer-form GEMV (modes 2 and 3) may read: d % 128 == 0 (the fused kernels' warps hold
    /// whole 32-value blocks) and d ≥ 2048 (narrower rows take the float GEMV by default, see
    /// `gemv_select`), unless the GEMV is disabled. None: no limbs.
    pub(super) fn limbs_out(&self, len: usize, d: usize) -> Option<Buf> {
        (!self.disable.gemv && len == d && d % 128 == 0 && d >= 2048).then(|| self.new_buf(limbs_words(d)))
    }

    /// The limbs an integer-form GEMV reads: those x came with (`xq`), else the pre-pass's.
    pub(super) fn x_limbs<'a>(
        &self,
        s: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        cols: usize,
        xq: Option<&'a CudaSlice<f32>>,
    ) -> XLimbs<'a> {
        match xq {
            Some(q) => XLimbs::Given(q),
            None => XLimbs::Made(self.gemv_x_limbs(s, x, cols)),
        }
    }

    /// The x pre-pass of the integer GEMV (modes 2 and 3, `gemv_x_limbs` in kernels/ops.cu):
    /// x's three int8 limb planes (cols bytes each), its scale per 32 values and Σx per 8 values
    /// (f32), in pooled scratch that goes back to the pool when dropped (after the launches that
    /// use it are enqueued on this stream).
    pub(super) fn gemv_x_limbs(&self, s: &Arc<CudaStream>, x: &CudaSlice<f32>, cols: usize) -> Buf {
        assert!(cols % 32 == 0 && x.len() >= cols, "gemv: x is not whole blocks of 32");
        let mut q = self.new_buf(limbs_words(cols));
        let c = cols as i32;
        let mut b = s.launch_builder(self.func("gemv_x_limbs"));
        b.arg(x).arg(dev_mut(&mut q)).arg(&c);
        let cfg = LaunchConfig {
            grid_dim: ((cols / 4).div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gemv_x_limbs in kernels/ops.cu: x has cols floats (cols % 32 == 0), q
        // 3·cols bytes then cols/32 + cols/8 floats (a whole pooled allocation, 16-byte aligned).
        ok(unsafe { b.launch(cfg) });
        q
    }

    /// Launches the matvec (n = 1) or matmul (n > 1) kernel on device buffers, or for n = 1 the
    /// one-token GEMV variant forced (`Some`) or chosen by default, if any.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_linear_with(
        &self,
        s: &Arc<CudaStream>,
        w: &DevWeight,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        xq: Option<&CudaSlice<f32>>,
        n: usize,
        out: &mut CudaSlice<f32>,
        force: Option<GemvVariant>,
    ) {
        if n == 1 {
            if let Some(v) = force.or_else(|| self.gemv_variant(w, rows, cols)) {
                return self.launch_gemv(s, w, rows, cols, x, xq, out, v);
            }
        }
        if let Some(plan) = self.gemm_plan(&[(w, rows)], cols, n) {
            return self.launch_gemm(s, &mut [(w, out, rows)], cols, x, n, plan);
        }
        let (kind, nt) = if n == 1 { ("matvec", 1) } else { ("matmul", 8) };
        let f = self.func(&format!("{kind}_{}", w.suffix));
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(4) as u32, n.div_ceil(nt) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c, rb, nn) = (rows as i32, cols as i32, w.row_bytes as i32, n as i32);
        let mut b = s.launch_builder(f);
        b.arg(&w.data).arg(x).arg(out).arg(&r).arg(&c).arg(&rb).arg(&nn);
        // SAFETY: the arguments match matvec_*/matmul_* in kernels/matmul.cu; buffers are sized
        // rows·row_bytes, n·cols and n·rows.
        ok(unsafe { b.launch(cfg) });
    }

    /// `Backend::linear`, with the one-token GEMV variant forced (`Some`) or chosen by default.
    pub(super) fn linear_with(&self, x: &Buf, n: usize, w: WeightRef<'_>, out: &mut Buf, force: Option<GemvVariant>) {
        let (rows, cols) = (w.rows(), w.cols());
        assert_eq!(x.len(), n * cols, "linear: x is not [n, in]");
        assert_eq!(out.len(), n * rows, "linear: out is not [n, out]");
        if rows == 0 || n == 0 {
            return;
        }
        let s = &self.stream;
        let dw = self.weight(w, s);
        self.launch_linear_with(s, &dw, rows, cols, dev(x), limbs_of(x, cols), n, dev_mut(out), force);
    }

    /// `Backend::linear_many`, with the one-token GEMV variant forced (`Some`, a warp-rows or
    /// tensor-core one) or chosen by default.
    /// `linear_many`, with GEMV variant `force` if given, and the q/k/v store `epi` if the launch
    /// can take it (see GemvEpi).
    pub(super) fn linear_many_with(
        &self,
        x: &Buf,
        n: usize,
        ws: &[WeightRef<'_>],
        outs: &mut [&mut Buf],
        force: Option<GemvVariant>,
        epi: Option<&mut GemvEpi<'_>>,
    ) {
        assert_eq!(ws.len(), outs.len(), "linear_many: one output per weight");
        let s = &self.stream;
        let cols = ws.first().map_or(0, |w| w.cols());
        let dws: Vec<Arc<DevWeight>> = ws.iter().map(|w| self.weight(*w, s)).collect();
        // One launch when the weights share a type and width and the GEMV for them (forced or by
        // default) is warp-rows or tensor-core; otherwise one product each.
        let same = dws.iter().all(|d| d.ty == dws[0].ty && d.row_bytes == dws[0].row_bytes);
        // n > 1: one x pre-pass for all the weights when the GEMM takes them all (see gemm.rs).
        if n > 1 && ws.len() > 1 && ws.iter().all(|w| w.cols() == cols) {
            let rows: Vec<(&DevWeight, usize)> = dws.iter().zip(ws).map(|(d, w)| (&**d, w.rows())).collect();
            if let Some(plan) = self.gemm_plan(&rows, cols, n) {
                assert_eq!(x.len(), n * cols, "linear_many: x is not [n, in]");
                let mut parts: Vec<gemm::GemmPart<'_>> = Vec::with_capacity(ws.len());
                for ((w, d), out) in ws.iter().zip(&dws).zip(outs.iter_mut()) {
                    assert_eq!(out.len(), n * w.rows(), "linear_many: out is not [n, out]");
                    parts.push((d, dev_mut(out), w.rows()));
                }
                return self.launch_gemm(s, &mut parts, cols, dev(x), n, plan);
            }
        }
        let v = (n == 1 && (2..=3).contains(&ws.len()) && same && ws.iter().all(|w| w.cols() == cols))
            .then(|| force.or_else(|| self.gemv_variant(&dws[0], ws.iter().map(|w| w.rows()).sum(), cols)))
            .flatten()
            .filter(|v| v.kind == GemvKind::Wr);
        let Some(v) = v else {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.linear_with(x, n, *w, out, force);
            }
            return;
        };
        assert_eq!(x.len(), cols, "linear_many: x is not [1, in]");
        let mut parts: Vec<(&DevWeight, &mut CudaSlice<f32>, usize)> = Vec::with_capacity(ws.len());
        for ((w, d), out) in ws.iter().zip(&dws).zip(outs.iter_mut()) {
            assert_eq!(out.len(), w.rows(), "linear_many: out is not [1, out]");
            parts.push((d, dev_mut(out), w.rows()));
        }
        self.launch_gemv_rows(s, &mut parts, cols, dev(x), limbs_of(x, cols), v, epi);
    }

    /// The two one-token GEMVs of a q/k/v whose v differs from q and k in type or width (q and k
    /// alike, all three of one width): the q + k variant, then v's, when both are warp-rows-like
    /// (`GemvRows`, so both can take the q/k/v store) and q + k's R is even (its RoPE pairs stay
    /// in a block); None otherwise, and for one type, which `linear_many` puts in one launch.
    pub(super) fn qk_then_v(&self, dws: &[Arc<DevWeight>; 3], ws: &[WeightRef<'_>; 3]) -> Option<[GemvVariant; 2]> {
        let alike = |a: &DevWeight, b: &DevWeight| a.ty == b.ty && a.row_bytes == b.row_bytes;
        let cols = ws[0].cols();
        if !alike(&dws[0], &dws[1]) || alike(&dws[0], &dws[2]) || ws.iter().any(|w| w.cols() != cols) {
            return None;
        }
        let rows_like = |v: &GemvVariant| v.kind == GemvKind::Wr;
        let qk = self
            .gemv_variant(&dws[0], ws[0].rows() + ws[1].rows(), cols)
            .filter(|v| rows_like(v) && v.r % 2 == 0)?;
        // (v alone has no RoPE pairs, so any R takes the store.)
        let v = self.gemv_variant(&dws[2], ws[2].rows(), cols).filter(rows_like)?;
        Some([qk, v])
    }

    /// The device copy of a small f32 parameter (a norm weight), uploaded on first use.
    pub(super) fn param(&self, v: &[f32]) -> Arc<DevWeight> {
        self.weight(
            WeightRef::F32(Mat {
                data: v,
                rows: 1,
                cols: v.len(),
            }),
            &self.stream,
        )
    }

    pub(super) fn qkv_rope_gemv(
        &self,
        x: &Buf,
        n: usize,
        ws: [WeightRef<'_>; 3],
        outs: [&mut Buf; 3],
        rope: QkRope<'_>,
        caches: [&mut Buf; 2],
    ) {
        let [q, k, v] = outs;
        let [kc, vc] = caches;
        let (hd, dim) = (rope.q.head_stride, rope.q.rope_dim);
        let (q_rows, k_rows, v_rows) = (ws[0].rows(), ws[1].rows(), ws[2].rows());
        // The GEMV's store rotates NORM pairs (rows 2i, 2i + 1 of a head) from each head's start.
        let store_fits = n == 1
            && !self.disable.qkv_store
            && rope.style == RopeStyle::Norm
            && (rope.q.offset, rope.k.offset) == (0, 0)
            && rope.k.head_stride == hd
            && rope.k.rope_dim == dim
            && hd % 2 == 0
            && dim % 2 == 0
            && dim > 0
            && dim <= hd
            && q_rows == rope.q.n_heads * hd
            && k_rows == rope.k.n_heads * hd;
        if store_fits {
            let dpos = self.kv_reserve(kc, k_rows, k_rows, rope.pos0, rope.pos0);
            self.kv_reserve(vc, v_rows, v_rows, rope.pos0, rope.pos0);
            let mut memo = self.rope_table.lock().expect("rope table");
            let cs = self.rope_table_for(&mut memo, 1, dim, rope.pos0, rope.base, rope.freqs);
            let mut epi = GemvEpi {
                cs: dev(cs),
                kc: dev_mut(kc),
                vc: dev_mut(vc),
                head_dim: hd,
                rope_dim: dim,
                slot: rope.pos0,
                dpos,
                first: 0,
                done: false,
            };
            let s = &self.stream;
            let dws = ws.map(|w| self.weight(w, s));
            if let Some([qk, vv]) = self.qk_then_v(&dws, &ws) {
                // q and k of one type, v of another (Q4_K_M's promoted layers: Q4_K q, k and Q6_K
                // v): a q + k launch, then v's, each with its part of the store.
                let (cols, xq) = (ws[0].cols(), limbs_of(x, ws[0].cols()));
                let mut qk_parts = [(&*dws[0], dev_mut(q), q_rows), (&*dws[1], dev_mut(k), k_rows)];
                self.launch_gemv_rows(s, &mut qk_parts, cols, dev(x), xq, qk, Some(&mut epi));
                assert!(epi.done, "linear_qkv_rope: the q + k launch declined the store");
                (epi.first, epi.done) = (2, false);
                let mut v_parts = [(&*dws[2], dev_mut(v), v_rows)];
                self.launch_gemv_rows(s, &mut v_parts, cols, dev(x), xq, vv, Some(&mut epi));
                assert!(epi.done, "linear_qkv_rope: the v launch declined the store");
                return;
            }
            self.linear_many_with(x, 1, &ws, &mut [&mut *q, &mut *k, &mut *v], None, Some(&mut epi));
            if epi.done {
                return;
            }
        } else {
            self.linear_many(x, n, &ws, &mut [&mut *q, &mut *k, &mut *v]);
        }
        self.rope_qk_cache(q, k, v, v_rows, rope, [kc, vc]);
    }
}

#[cfg(test)]
mod tests {
    use super::{repack_headers_last, repack_q6_k};
    use references::ggml_type::GgmlType;

    #[test]
    fn repack_puts_quants_first_then_headers_per_row() {
        // Two rows of two 5-byte blocks with 2-byte headers: [h h q q q].
        let rows: Vec<u8> = vec![1, 2, 10, 11, 12, 3, 4, 13, 14, 15, 5, 6, 20, 21, 22, 7, 8, 23, 24, 25];
        let out = repack_headers_last(&rows, 2, 10, 5, 2);
        assert_eq!(
            out,
            vec![10, 11, 12, 13, 14, 15, 1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 5, 6, 7, 8]
        );
    }

    #[test]
    fn q6_k_repack_decodes_as_the_gemv_units_read_it() {
        // Three rows of 2 super-blocks; every value decoded through the units of kernels/gemv.cu
        // (unit i = 4n + 2p + is of a super-block: ql bytes 16i.., qh bytes 32n + 16is.. at bits
        // 2p (low nibbles) and 4 + 2p (high), scale bytes 2i and 2i + 1, d after all scales).
        let (rows, cols) = (3usize, 512usize);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
            .collect();
        let bytes = references::quant::quantize(GgmlType::Q6K, &w).unwrap();
        let row_bytes = bytes.len() / rows;
        let mut want = vec![0f32; rows * cols];
        crate::dequant::dequantize(GgmlType::Q6K, &bytes, &mut want).unwrap();
        let dev = repack_q6_k(&bytes, rows, row_bytes);
        let nsb = cols / 256;
        for r in 0..rows {
            let row = &dev[r * row_bytes..(r + 1) * row_bytes];
            for sb in 0..nsb {
                let d = half::f16::from_le_bytes([row[208 * nsb + 2 * sb], row[208 * nsb + 2 * sb + 1]]).to_f32();
                for i in 0..8 {
                    let (n, p, is) = (i / 4, i / 2 % 2, i % 2);
                    for k in 0..16 {
                        let ql = row[128 * sb + 16 * i + k];
                        let qh = row[128 * nsb + 64 * sb + 32 * n + 16 * is + k];
                        let lo = (ql & 15) | ((qh >> (2 * p)) & 3) << 4;
                        let hi = (ql >> 4) | ((qh >> (4 + 2 * p)) & 3) << 4;
                        let sc = |b: usize| row[192 * nsb + 16 * sb + 2 * i + b] as i8 as f32;
                        let pos = r * cols + 256 * sb + 128 * n + 32 * p + 16 * is + k;
                        assert_eq!(d * sc(0) * (lo as f32 - 32.0), want[pos], "row {r} value {pos}");
                        assert_eq!(
                            d * sc(1) * (hi as f32 - 32.0),
                            want[pos + 64],
                            "row {r} value {}",
                            pos + 64
                        );
                    }
                }
            }
        }
    }
}
