//! `llmdiff kernels --bench`: the GEMV against the device's copy bandwidth (the default and every
//! compiled variant), the Q4_K GEMV's read bound, and the launch cost of each launch path.

use super::*;

/// A GEMV timing: weight bytes read per second, and the copy bandwidth of the same run.
#[derive(Clone, Debug)]
pub struct GemvBench {
    pub case: String,
    /// The forced GEMV variant's entry point (`None`: the default path).
    pub variant: Option<String>,
    pub weight_bytes: usize,
    pub seconds: f64,
    pub gb_per_s: f64,
    /// An integer-form GEMV's time with x's limbs made by a pre-pass before every launch (the
    /// launch `seconds` times is given them, made once, as a decode step's norm, SwiGLU or
    /// attention writes them). `None` for forms that read x as floats.
    pub seconds_with_prepass: Option<f64>,
}

/// Enough device copies of one random `[rows, cols]` weight of type `ty` (device layout) that
/// cycling through them exceeds L2, so every timed launch reads HBM.
pub(super) fn bench_weights(
    s: &Arc<CudaStream>,
    ty: GgmlType,
    rows: usize,
    cols: usize,
) -> Result<Vec<DevWeight>, EngineError> {
    let suffix = type_suffix(ty).ok_or_else(|| EngineError::Cuda(format!("no GPU kernel for {ty:?}")))?;
    let row_bytes = cols / ty.block_elems() * ty.block_bytes();
    let w_bytes = rows * row_bytes;
    let copies = (512usize << 20).div_ceil(w_bytes).clamp(1, 64);
    let host = random_blocks(ty, w_bytes);
    let host = device_layout(ty, &host, rows, row_bytes);
    (0..copies)
        .map(|_| {
            Ok(DevWeight {
                data: s.clone_htod(&*host).map_err(drv("upload"))?,
                ty,
                suffix,
                row_bytes,
            })
        })
        .collect()
}

/// The mean seconds of `launch(i)` for i in 0..iters, enqueued back to back on `s` between two
/// events.
pub(super) fn time_launches(
    s: &Arc<CudaStream>,
    iters: usize,
    mut launch: impl FnMut(usize),
) -> Result<f64, EngineError> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let t0 = s.record_event(flags).map_err(drv("event"))?;
    (0..iters).for_each(&mut launch);
    let t1 = s.record_event(flags).map_err(drv("event"))?;
    t1.synchronize().map_err(drv("sync"))?;
    Ok(t0.elapsed_ms(&t1).map_err(drv("elapsed"))? as f64 / 1e3 / iters as f64)
}

/// Random ggml blocks whose f16 scale fields are finite (so timings see ordinary arithmetic).
pub(super) fn random_blocks(ty: GgmlType, n_bytes: usize) -> Vec<u8> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut b: Vec<u8> = (0..n_bytes)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect();
    let f16_ok = 0x2C00u16.to_le_bytes(); // 0.0625
    let (block, fields): (usize, &[usize]) = match ty {
        GgmlType::F16 | GgmlType::BF16 => {
            for c in b.chunks_exact_mut(2) {
                c[1] &= 0x3B; // exponent below the all-ones pattern: finite
            }
            return b;
        }
        GgmlType::F32 => {
            for c in b.chunks_exact_mut(4) {
                c[3] &= 0x3F;
            }
            return b;
        }
        GgmlType::Q8_0 => (34, &[0]),
        GgmlType::Q4_0 => (18, &[0]),
        GgmlType::Q4_1 => (20, &[0, 2]),
        GgmlType::Q5_0 => (22, &[0]),
        GgmlType::Q5_1 => (24, &[0, 2]),
        GgmlType::Q4K => (144, &[0, 2]),
        GgmlType::Q5K => (176, &[0, 2]),
        GgmlType::Q6K => (210, &[208]),
        GgmlType::IQ4NL => (18, &[0]),
        GgmlType::IQ4XS => (136, &[0]),
        _ => return b,
    };
    for blk in b.chunks_exact_mut(block) {
        for &o in fields {
            blk[o..o + 2].copy_from_slice(&f16_ok);
        }
    }
    b
}

impl CudaBackend {
    /// Device-to-device copy bandwidth over `bytes`, counting bytes read plus bytes written
    /// (as PyTorch's and the H200 figure of ~4.3 TB/s do); best of `reps` timed copies.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64, EngineError> {
        let s = self.ctx.new_stream().map_err(drv("stream"))?;
        let src = s.alloc_zeros::<u8>(bytes).map_err(drv("alloc"))?;
        let mut dst = s.alloc_zeros::<u8>(bytes).map_err(drv("alloc"))?;
        let mut best = f64::MAX;
        for _ in 0..reps + 2 {
            let t0 = s
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("event"))?;
            s.memcpy_dtod(&src, &mut dst).map_err(drv("copy"))?;
            let t1 = s
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("event"))?;
            t1.synchronize().map_err(drv("sync"))?;
            best = best.min(t0.elapsed_ms(&t1).map_err(drv("elapsed"))? as f64 / 1e3);
        }
        Ok(2.0 * bytes as f64 / best)
    }

    /// Times `out[n, rows] = x · Wᵀ` for a `[rows, cols]` weight of type `ty` on device-resident
    /// buffers. Enough weight copies are cycled through to exceed L2 (so every launch reads
    /// HBM). Returns the mean over `iters` launches.
    pub fn bench_linear(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        n: usize,
        iters: usize,
    ) -> Result<GemvBench, EngineError> {
        let mut r = self.bench_linear_variants(ty, rows, cols, n, iters, &[None])?;
        Ok(r.remove(0))
    }

    /// [`CudaBackend::bench_linear`] for each of `variants` in turn on the same uploaded weights
    /// (`None`: the default path; `Some`: that one-token GEMV variant, n must be 1). A forced
    /// variant that cannot run the row ([`CudaBackend::gemv_fits`]) is skipped (no entry).
    pub fn bench_linear_variants(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        n: usize,
        iters: usize,
        variants: &[Option<GemvVariant>],
    ) -> Result<Vec<GemvBench>, EngineError> {
        let suffix = type_suffix(ty).ok_or_else(|| EngineError::Cuda(format!("no GPU kernel for {ty:?}")))?;
        let s = self.ctx.new_stream().map_err(drv("stream"))?;
        let ws = bench_weights(&s, ty, rows, cols)?;
        let (copies, w_bytes) = (ws.len(), rows * ws[0].row_bytes);
        let x = s.clone_htod(&noise(n * cols, 3)).map_err(drv("upload"))?;
        // x's limbs, made once: in a decode step the op before an integer-form GEMV writes them.
        let xq = (n == 1 && cols % 32 == 0).then(|| self.gemv_x_limbs(&s, &x, cols));
        let mut out = s.alloc_zeros::<f32>(n * rows).map_err(drv("alloc"))?;
        let mut res = Vec::new();
        for &v in variants {
            if let Some(v) = v {
                assert!(n == 1 && v.ty == ty, "bench: a GEMV variant of another type or n > 1");
                if !self.gemv_fits(v, cols) {
                    continue;
                }
            }
            let takes_limbs = n == 1
                && v.or_else(|| self.gemv_select(ty, ws[0].row_bytes, rows, cols))
                    .is_some_and(|v| v.takes_limbs());
            let mut time = |xq: Option<&CudaSlice<f32>>| {
                for w in ws.iter().take(3) {
                    self.launch_linear_with(&s, w, rows, cols, &x, xq, n, &mut out, v);
                }
                time_launches(&s, iters, |i| {
                    self.launch_linear_with(&s, &ws[i % copies], rows, cols, &x, xq, n, &mut out, v)
                })
            };
            let seconds = time(xq.as_ref().filter(|_| takes_limbs).map(dev))?;
            let seconds_with_prepass = if takes_limbs { Some(time(None)?) } else { None };
            let kind = if n == 1 { "GEMV" } else { "GEMM" };
            res.push(GemvBench {
                case: format!("{kind}(type={suffix},rows={rows},cols={cols},n={n})"),
                variant: v.map(|v| v.entry()),
                weight_bytes: w_bytes,
                seconds,
                gb_per_s: w_bytes as f64 / seconds / 1e9,
                seconds_with_prepass,
            });
        }
        Ok(res)
    }

    /// The loads of the Q4_K GEMV warp-rows R 8, NW 4 (the default's, but for launches of 8192
    /// rows or more of up to 255 units) with no arithmetic: the weights' (`gemvw_r8_w4`), those
    /// and x's limbs (`gemvw_r8_w4+x`), then the same weight bytes read as one stream (`linear`)
    /// (`gemv_read_probe` in kernels/gemv_rows.cu), on a `[rows, cols]` Q4_K weight as
    /// [`CudaBackend::bench_linear`] times it: what the access pattern alone costs, beside the
    /// copy bandwidth. `variant` names the pattern.
    pub fn bench_read_probe(&self, rows: usize, cols: usize, iters: usize) -> Result<Vec<GemvBench>, EngineError> {
        assert!(cols % 256 == 0, "read probe: Q4_K rows of whole super-blocks");
        let s = self.ctx.new_stream().map_err(drv("stream"))?;
        let ws = bench_weights(&s, GgmlType::Q4K, rows, cols)?;
        let (copies, row_bytes) = (ws.len(), ws[0].row_bytes);
        let w_bytes = rows * row_bytes;
        let grid = rows.div_ceil(8);
        let mut out = s.alloc_zeros::<u32>(4 * grid).map_err(drv("alloc"))?;
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c, rb) = (rows as i32, cols as i32, row_bytes as i32);
        let x = s.clone_htod(&noise(cols, 3)).map_err(drv("upload"))?;
        let xq = self.gemv_x_limbs(&s, &x, cols);
        let mut res = Vec::new();
        for (pattern, name) in [(0i32, "gemvw_r8_w4"), (1, "gemvw_r8_w4+x"), (2, "linear")] {
            // Launched as the GEMVs are (PDL when on): the probe triggers its successor at its
            // start and waits before its one store.
            let launch = |i: usize, out: &mut CudaSlice<u32>| {
                let mut a = RawArgs::default();
                a.buf(&ws[i % copies].data)
                    .buf(dev(&xq))
                    .i32(r)
                    .i32(c)
                    .i32(rb)
                    .i32(pattern)
                    .buf(out);
                // SAFETY: matches gemv_read_probe in kernels/gemv_rows.cu: W is rows·row_bytes Q4_K
                // bytes in the device layout (cols % 256 == 0), xq x's limbs (gemv_x_limbs of cols
                // values), out 4 words per block; it waits (griddep_wait) before writing.
                unsafe { self.launch_raw(&s, "gemv_read_probe", cfg, &mut a, self.pdl) };
            };
            (0..3).for_each(|i| launch(i, &mut out));
            let seconds = time_launches(&s, iters, |i| launch(i, &mut out))?;
            res.push(GemvBench {
                case: format!("READ(type=q4_k,rows={rows},cols={cols})"),
                variant: Some(name.to_string()),
                weight_bytes: w_bytes,
                seconds,
                gb_per_s: w_bytes as f64 / seconds / 1e9,
                seconds_with_prepass: None,
            });
        }
        Ok(res)
    }

    /// The per-launch cost of the launch paths, over `n` launches each (see [`LaunchCost`]).
    pub fn launch_cost(&self, n: usize) -> Result<LaunchCost, EngineError> {
        use std::time::Instant;
        let s = &self.stream;
        let one = LaunchConfig::for_num_elems(1);
        let nop = self.func("nop");
        let mut scratch = s.alloc_zeros::<u32>(1).map_err(drv("alloc"))?;
        let per = |d: std::time::Duration| d.as_secs_f64() * 1e6 / n as f64;
        let sync = || s.synchronize().map_err(drv("sync"));
        // Warm-up.
        for _ in 0..100 {
            // SAFETY: nop takes no arguments.
            unsafe { s.launch_builder(nop).launch(one) }.map_err(drv("launch"))?;
        }
        sync()?;
        let t0 = Instant::now();
        for _ in 0..n {
            // SAFETY: as above.
            unsafe { s.launch_builder(nop).launch(one) }.map_err(drv("launch"))?;
        }
        let builder_host = per(t0.elapsed());
        sync()?;
        let builder_total = per(t0.elapsed());
        let t0 = Instant::now();
        for _ in 0..n {
            let mut args: [*mut std::ffi::c_void; 0] = [];
            // SAFETY: the raw driver launch of nop (no arguments) on this context's stream.
            unsafe {
                cudarc::driver::result::launch_kernel(
                    nop.cu_function(),
                    (1, 1, 1),
                    (1, 1, 1),
                    0,
                    s.cu_stream(),
                    &mut args,
                )
            }
            .map_err(drv("launch"))?;
        }
        let raw_host = per(t0.elapsed());
        sync()?;
        let raw_total = per(t0.elapsed());
        // A kernel with arguments, as the model's element-wise ops are launched.
        let t0 = Instant::now();
        for i in 0..n {
            let (bits, len) = (i as u32, 1i64);
            let mut b = s.launch_builder(self.func("fill_u32"));
            b.arg(&mut scratch).arg(&bits).arg(&len);
            // SAFETY: matches fill_u32 in kernels/ops.cu; scratch holds one value.
            unsafe { b.launch(one) }.map_err(drv("launch"))?;
        }
        let args_host = per(t0.elapsed());
        sync()?;
        let args_total = per(t0.elapsed());
        // The same n nops recorded in one graph and replayed.
        s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv("capture"))?;
        for _ in 0..n {
            // SAFETY: as above.
            unsafe { s.launch_builder(nop).launch(one) }.map_err(drv("launch"))?;
        }
        let g = s
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(drv("capture"))?
            .ok_or_else(|| EngineError::Cuda("empty graph".into()))?;
        g.launch().map_err(drv("graph"))?;
        sync()?;
        let t0 = Instant::now();
        g.launch().map_err(drv("graph"))?;
        let graph_host = t0.elapsed().as_secs_f64() * 1e6;
        sync()?;
        let graph_total = per(t0.elapsed());
        Ok(LaunchCost {
            n,
            builder_host_us: builder_host,
            builder_total_us: builder_total,
            raw_host_us: raw_host,
            raw_total_us: raw_total,
            args_host_us: args_host,
            args_total_us: args_total,
            graph_launch_host_us: graph_host,
            graph_total_us: graph_total,
        })
    }
}

/// Per-launch costs in µs over `n` launches of an empty kernel: `*_host` is the time to enqueue
/// (the host's side), `*_total` until the stream is done (host and device, whichever is
/// slower). `builder`: cudarc's launch builder (the backend's path); `raw`: `cuLaunchKernel`
/// directly; `args`: the builder with three arguments (`fill_u32` of one value); `graph`: the n
/// launches recorded in one CUDA graph and replayed (`graph_launch_host_us` is the one
/// `cuGraphLaunch` call, whole).
#[derive(Clone, Debug)]
pub struct LaunchCost {
    pub n: usize,
    pub builder_host_us: f64,
    pub builder_total_us: f64,
    pub raw_host_us: f64,
    pub raw_total_us: f64,
    pub args_host_us: f64,
    pub args_total_us: f64,
    pub graph_launch_host_us: f64,
    pub graph_total_us: f64,
}
