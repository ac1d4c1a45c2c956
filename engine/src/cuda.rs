//! The CUDA backend (feature `cuda`): the [`Backend`] ops as NVRTC kernels from `kernels/*.cu`
//! (module list in [`crate::cuda_kernels`]), compiled at start-up for the device's arch and cached
//! per process.
//!
//! What lives where in this first version:
//! - Weights are uploaded once, on first use, and stay on the device (keyed by their host address
//!   and length, which are stable for an engine's lifetime). Types with a register decoder in
//!   `kernels/quant.cu` keep their ggml blocks; Q2_K and Q3_K are dequantized to f32 on upload.
//! - Activations and the KV cache stay on the host between ops: each op uploads its inputs, runs
//!   its kernel on the calling rank's own stream (one stream per rank thread, own buffers), and
//!   copies its output back. So taps, the canary and every fault run through the same model code
//!   as on the CPU. A custom op's output buffer is the caller's: its contents (the canary when
//!   tapped) go to the device with the inputs, and an element the kernel never writes comes back
//!   unchanged.
//! - The all-reduce is a device-side sum in fixed rank order over the ranks' partials.
//! - MoE routing stays on the host (the expert matmuls run on the device).
//!
//! A missing driver, device or NVRTC is an [`EngineError::Cuda`] from [`CudaBackend::new`], never
//! a CPU fallback. Errors after start-up (out of device memory) panic with a `cuda:` message,
//! since the [`Backend`] ops are infallible.

use crate::backend::{Backend, CommClock, CommStats, CpuBackend};
use crate::cuda_kernels::{type_suffix, GemvVariant, KernelId, GEMV_VARIANTS};
use crate::kernels::{GqaShape, Mat, MlaShape, QMat, RopeLayout, RopeStyle, WeightRef};
use crate::EngineError;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};
use references::GgmlType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

/// Runs `f`, turning a panic of cudarc's dynamic loader (no libcuda / libnvrtc) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, EngineError>) -> Result<T, EngineError> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    r.unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let first = msg.split(" - ").next().unwrap_or(&msg).to_string();
        Err(EngineError::Cuda(format!(
            "{what}: {first} (is this a GPU machine? set LD_LIBRARY_PATH=/usr/local/cuda/lib64 if NVRTC is not found)"
        )))
    })
}

fn drv(what: &str) -> impl Fn(DriverError) -> EngineError + '_ {
    move |e| EngineError::Cuda(format!("{what}: {e}"))
}

/// Unwraps a driver result inside an infallible op.
fn ok<T>(r: Result<T, DriverError>) -> T {
    r.unwrap_or_else(|e| panic!("cuda: {e}"))
}

/// The `-arch` NVRTC gets for a compute capability.
fn arch_name(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (9, 0) => "sm_90",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => Box::leak(format!("sm_{major}{minor}").into_boxed_str()),
    }
}

type PtxCache = Mutex<HashMap<(KernelId, &'static str), Ptx>>;

/// Compiles one module for `arch` (cached per process). A compile error names the kernel file.
pub fn compile(id: KernelId, arch: &'static str) -> Result<Ptx, EngineError> {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(p) = cache.lock().expect("ptx cache").get(&(id, arch)) {
        return Ok(p.clone());
    }
    let opts = CompileOptions {
        arch: Some(arch),
        include_paths: vec!["/usr/local/cuda/include".into()],
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    let ptx = guarded("NVRTC", || {
        compile_ptx_with_opts(id.full_source(), opts).map_err(|e| {
            let msg = match &e {
                CompileError::CompileError { log, .. } => log.to_string_lossy().trim().to_string(),
                other => other.to_string(),
            };
            EngineError::KernelCompile { kernel: id.file(), msg }
        })
    })?;
    cache.lock().expect("ptx cache").insert((id, arch), ptx.clone());
    Ok(ptx)
}

/// A weight resident on the device.
struct DevWeight {
    data: CudaSlice<u8>,
    /// The device layout's type (F32 for types dequantized on upload).
    ty: GgmlType,
    suffix: &'static str,
    row_bytes: usize,
}

/// Q8_0 rows as the device keeps them: each row's quant bytes (cols of them, 16-byte aligned
/// when the row is), then its f16 scales; the same bytes and row length as the ggml row.
fn repack_q8_0(bytes: &[u8], rows: usize, row_bytes: usize) -> Vec<u8> {
    let n_blocks = row_bytes / 34;
    let cols = n_blocks * 32;
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        let src = &bytes[r * row_bytes..(r + 1) * row_bytes];
        let dst = &mut out[r * row_bytes..(r + 1) * row_bytes];
        for (b, blk) in src.chunks_exact(34).enumerate() {
            dst[b * 32..b * 32 + 32].copy_from_slice(&blk[2..]);
            dst[cols + 2 * b..cols + 2 * b + 2].copy_from_slice(&blk[..2]);
        }
    }
    out
}

/// The device bytes of a ggml weight of a type with a register decoder.
fn device_layout(ty: GgmlType, bytes: &[u8], rows: usize, row_bytes: usize) -> std::borrow::Cow<'_, [u8]> {
    if ty == GgmlType::Q8_0 {
        std::borrow::Cow::Owned(repack_q8_0(bytes, rows, row_bytes))
    } else {
        std::borrow::Cow::Borrowed(bytes)
    }
}

/// The one-token GEMV's settings: rows per block step (by default 4 for Q8_0 and Q4_K, 2 for
/// F16/BF16, as measured on an H200), the Q4_K mode, and an optional cap on
/// blocks per SM (environment `LLMDIFF_GEMV_R`, `LLMDIFF_GEMV_Q4K_MODE`, `LLMDIFF_GEMV_BPS`,
/// for benchmarking variants; `LLMDIFF_GEMV=0` turns it off, back to the warp-per-row matvec).
#[derive(Clone, Copy, Debug)]
struct GemvConfig {
    on: bool,
    r: Option<usize>,
    q4k_mode: usize,
    bps: Option<u32>,
}

impl GemvConfig {
    fn from_env() -> GemvConfig {
        let get = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
        GemvConfig {
            on: get("LLMDIFF_GEMV") != Some(0),
            r: get("LLMDIFF_GEMV_R").filter(|r| [2, 4].contains(r)),
            q4k_mode: get("LLMDIFF_GEMV_Q4K_MODE").filter(|m| *m <= 1).unwrap_or(0),
            bps: get("LLMDIFF_GEMV_BPS").map(|b| b.max(1) as u32),
        }
    }
}

/// The GPU backend: one context on device 0, its kernels, a stream per rank thread, and the
/// resident weights.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    device: String,
    arch: &'static str,
    funcs: HashMap<String, CudaFunction>,
    streams: Mutex<HashMap<ThreadId, Arc<CudaStream>>>,
    weights: Mutex<HashMap<(usize, usize), Arc<DevWeight>>>,
    sms: u32,
    gemv: GemvConfig,
    /// Resident blocks per SM of a GEMV entry at a block size.
    occupancy: Mutex<HashMap<(String, u32), u32>>,
    /// Wall time in the all-reduce.
    clock: CommClock,
}

impl CudaBackend {
    /// Opens device 0 and compiles every kernel module for it.
    pub fn new() -> Result<CudaBackend, EngineError> {
        CudaBackend::on_device(0)
    }

    /// The number of CUDA devices (0 where there is no driver).
    pub fn device_count() -> usize {
        guarded("CUDA driver", || {
            CudaContext::device_count().map_err(drv("CUDA driver"))
        })
        .map_or(0, |n| n.max(0) as usize)
    }

    /// Opens device `ordinal` and compiles every kernel module for it.
    pub fn on_device(ordinal: usize) -> Result<CudaBackend, EngineError> {
        let ctx = guarded("CUDA driver", || {
            let n = CudaContext::device_count().map_err(drv("CUDA driver"))?;
            if (n.max(0) as usize) <= ordinal {
                return Err(EngineError::Cuda(format!("no CUDA device {ordinal} ({n} found)")));
            }
            CudaContext::new(ordinal).map_err(drv("CUDA device"))
        })?;
        // Every op synchronizes its own stream before returning; no cross-stream tracking needed.
        // SAFETY: no slice is shared between streams while work on it is in flight (weights are
        // uploaded and synchronized before any rank reads them).
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(drv("compute capability"))?;
        let arch = arch_name(major, minor);
        let device = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("SM count"))?
            .max(1) as u32;
        let mut funcs = HashMap::new();
        for id in KernelId::ALL {
            let ptx = compile(id, arch)?;
            let module = ctx
                .load_module(ptx)
                .map_err(drv(&format!("loading kernel module {}", id.file())))?;
            for f in id.functions() {
                let func = module
                    .load_function(&f)
                    .map_err(drv(&format!("kernel {f} in {}", id.file())))?;
                funcs.insert(f, func);
            }
        }
        Ok(CudaBackend {
            ctx,
            device,
            arch,
            funcs,
            streams: Mutex::new(HashMap::new()),
            weights: Mutex::new(HashMap::new()),
            sms,
            gemv: GemvConfig::from_env(),
            occupancy: Mutex::new(HashMap::new()),
            clock: CommClock::default(),
        })
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's name and the arch the kernels were compiled for.
    pub fn device(&self) -> (&str, &'static str) {
        (&self.device, self.arch)
    }

    fn func(&self, name: &str) -> &CudaFunction {
        self.funcs
            .get(name)
            .unwrap_or_else(|| panic!("cuda: kernel {name} is not in the module list"))
    }

    /// The calling thread's stream (each rank runs on its own thread, so its own stream).
    fn stream(&self) -> Arc<CudaStream> {
        let id = std::thread::current().id();
        let mut m = self.streams.lock().expect("stream map");
        m.entry(id).or_insert_with(|| ok(self.ctx.new_stream())).clone()
    }

    /// The device copy of a weight, uploaded on first use.
    fn weight(&self, w: WeightRef<'_>, s: &Arc<CudaStream>) -> Arc<DevWeight> {
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

    /// Launches the matvec (n = 1) or matmul (n > 1) kernel on device buffers.
    fn launch_linear(
        &self,
        s: &Arc<CudaStream>,
        w: &DevWeight,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) {
        self.launch_linear_with(s, w, rows, cols, x, n, out, None)
    }

    /// The GEMV variant a one-token product of `w` takes by default, if any.
    fn gemv_variant(&self, w: &DevWeight, cols: usize) -> Option<GemvVariant> {
        if !self.gemv.on {
            return None;
        }
        let ok_shape = match w.ty {
            GgmlType::F16 | GgmlType::BF16 => cols % 8 == 0,
            GgmlType::Q8_0 => w.row_bytes % 16 == 0 && cols % 32 == 0,
            GgmlType::Q4K => cols % 256 == 0 && w.row_bytes == cols / 256 * 144,
            _ => false,
        };
        if !ok_shape || cols == 0 {
            return None;
        }
        let units = cols / GemvVariant::unit_values(w.ty);
        let maxt = GemvVariant::max_threads(w.ty);
        let upt = [1usize, 2, 4]
            .into_iter()
            .find(|u| units.div_ceil(*u).div_ceil(32) * 32 <= maxt)?;
        let mode = if w.ty == GgmlType::Q4K { self.gemv.q4k_mode } else { 0 };
        let r = self.gemv.r.unwrap_or(match w.ty {
            GgmlType::Q8_0 | GgmlType::Q4K => 4,
            _ => 2,
        });
        GEMV_VARIANTS
            .iter()
            .copied()
            .find(|v| v.ty == w.ty && v.r == r && v.upt == upt && v.mode == mode)
    }

    /// Launches GEMV variant `v` (n = 1): block of ⌈units/UPT⌉ threads (whole warps), a grid of
    /// at most the resident blocks, each walking groups of R rows.
    #[allow(clippy::too_many_arguments)]
    fn launch_gemv(
        &self,
        s: &Arc<CudaStream>,
        w: &DevWeight,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        v: GemvVariant,
    ) {
        let units = cols / GemvVariant::unit_values(v.ty);
        let threads = (units.div_ceil(v.upt).div_ceil(32) * 32).max(32) as u32;
        assert!(
            threads as usize <= GemvVariant::max_threads(v.ty),
            "gemv: block too large"
        );
        let name = v.entry();
        let f = self.func(&name);
        let occ = {
            let mut m = self.occupancy.lock().expect("occupancy map");
            *m.entry((name, threads))
                .or_insert_with(|| ok(f.occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)).max(1))
        };
        let per_sm = self.gemv.bps.map_or(occ, |b| b.min(occ));
        let groups = rows.div_ceil(v.r);
        let grid = groups.min((self.sms * per_sm) as usize).max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c, rb) = (rows as i32, cols as i32, w.row_bytes as i32);
        let mut b = s.launch_builder(f);
        b.arg(&w.data).arg(x).arg(out).arg(&r).arg(&c).arg(&rb);
        // SAFETY: the arguments match gemv_* in kernels/quant.cu; W is rows·row_bytes in the
        // device layout, x has cols floats, out rows floats.
        ok(unsafe { b.launch(cfg) });
    }

    /// `launch_linear`, with the one-token GEMV variant forced (`Some`) or chosen by default.
    #[allow(clippy::too_many_arguments)]
    fn launch_linear_with(
        &self,
        s: &Arc<CudaStream>,
        w: &DevWeight,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
        force: Option<GemvVariant>,
    ) {
        if n == 1 {
            if let Some(v) = force.or_else(|| self.gemv_variant(w, cols)) {
                return self.launch_gemv(s, w, rows, cols, x, out, v);
            }
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
        // SAFETY: the arguments match matvec_*/matmul_* in kernels/quant.cu; buffers are sized
        // rows·row_bytes, n·cols and n·rows.
        ok(unsafe { b.launch(cfg) });
    }

    /// `Backend::linear`, with the one-token GEMV variant forced (`Some`) or chosen by default.
    fn linear_with(&self, x: &[f32], n: usize, w: WeightRef<'_>, out: &mut [f32], force: Option<GemvVariant>) {
        let (rows, cols) = (w.rows(), w.cols());

        assert_eq!(x.len(), n * cols, "linear: x is not [n, in]");
        assert_eq!(out.len(), n * rows, "linear: out is not [n, out]");
        if rows == 0 || n == 0 {
            return;
        }
        let s = self.stream();
        let dw = self.weight(w, &s);
        let xd = ok(s.clone_htod(x));
        // SAFETY: every element is written by the kernel before it is read back.
        let mut od = ok(unsafe { s.alloc::<f32>(n * rows) });
        self.launch_linear_with(&s, &dw, rows, cols, &xd, n, &mut od, force);
        self.download(&s, &od, out);
    }

    fn download(&self, s: &Arc<CudaStream>, src: &CudaSlice<f32>, dst: &mut [f32]) {
        ok(s.memcpy_dtoh(src, dst));
        ok(s.synchronize());
    }

    fn elementwise_cfg(len: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (len.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn describe(&self) -> String {
        format!(
            "cuda: simulated ranks, all on one GPU ({}), a stream each; fixed-order device-side all-reduce",
            self.device
        )
    }

    fn linear(&self, x: &[f32], n: usize, w: WeightRef<'_>, out: &mut [f32]) {
        self.linear_with(x, n, w, out, None)
    }

    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let d = weight.len();
        assert!(
            d > 0 && x.len() % d == 0 && x.len() == out.len(),
            "rms_norm: x is not [n, d]"
        );
        let s = self.stream();
        let xd = ok(s.clone_htod(x));
        let wd = ok(s.clone_htod(weight));
        // SAFETY: written whole by the kernel.
        let mut od = ok(unsafe { s.alloc::<f32>(x.len()) });
        let (di, n) = (d as i32, x.len() / d);
        let mut b = s.launch_builder(self.func("rms_norm"));
        b.arg(&xd).arg(&wd).arg(&mut od).arg(&di).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches rms_norm in kernels/ops.cu.
        ok(unsafe { b.launch(cfg) });
        self.download(&s, &od, out);
    }

    fn rope(&self, x: &mut [f32], layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle) {
        let width = layout.n_heads * layout.head_stride;
        let half = layout.rope_dim / 2;
        if width == 0 || half == 0 || x.is_empty() {
            return;
        }
        let n = x.len() / width;
        let s = self.stream();
        let mut xd = ok(s.clone_htod(x));
        let args = [
            n as i32,
            layout.n_heads as i32,
            layout.head_stride as i32,
            layout.offset as i32,
            layout.rope_dim as i32,
            pos0 as i32,
        ];
        let st = match style {
            RopeStyle::Norm => 0i32,
            RopeStyle::Neox => 1,
        };
        let mut b = s.launch_builder(self.func("rope"));
        b.arg(&mut xd);
        for a in &args {
            b.arg(a);
        }
        b.arg(&base).arg(&st);
        // SAFETY: matches rope in kernels/ops.cu; one thread per (row, head, pair).
        ok(unsafe { b.launch(Self::elementwise_cfg(n * layout.n_heads * half)) });
        self.download(&s, &xd, x);
    }

    fn swiglu(&self, gate: &mut [f32], up: &[f32]) {
        if gate.is_empty() {
            return;
        }
        let s = self.stream();
        let mut gd = ok(s.clone_htod(gate));
        let ud = ok(s.clone_htod(up));
        let len = gate.len() as i64;
        let mut b = s.launch_builder(self.func("swiglu"));
        b.arg(&mut gd).arg(&ud).arg(&len);
        // SAFETY: matches swiglu in kernels/ops.cu.
        ok(unsafe { b.launch(Self::elementwise_cfg(gate.len())) });
        self.download(&s, &gd, gate);
    }

    fn gqa_attention(&self, q: &[f32], k: &[f32], v: &[f32], pos0: usize, shape: GqaShape, out: &mut [f32]) {
        let slots = out.len() / shape.head_dim.max(1);
        if slots == 0 {
            return;
        }
        let n = slots / shape.n_heads;
        let s = self.stream();
        let (qd, kd, vd) = (ok(s.clone_htod(q)), ok(s.clone_htod(k)), ok(s.clone_htod(v)));
        // The caller's buffer, canary and all: an element the kernel skips comes back as it was.
        let mut od = ok(s.clone_htod(&*out));
        let args = [
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
        ];
        let mut b = s.launch_builder(self.func("gqa_attention"));
        b.arg(&qd).arg(&kd).arg(&vd).arg(&mut od);
        for a in &args {
            b.arg(a);
        }
        b.arg(&shape.scale);
        let cfg = LaunchConfig {
            grid_dim: (slots as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: ((shape.head_dim + pos0 + n) * 4) as u32,
        };
        // SAFETY: matches gqa_attention in kernels/attention.cu; the caches hold pos0 + n rows.
        ok(unsafe { b.launch(cfg) });
        self.download(&s, &od, out);
    }

    fn mla_attention(
        &self,
        q: &[f32],
        k_nope: &[f32],
        k_pe: &[f32],
        v: &[f32],
        pos0: usize,
        shape: MlaShape,
        out: &mut [f32],
    ) {
        let slots = out.len() / shape.v_dim.max(1);
        if slots == 0 {
            return;
        }
        let n = slots / shape.n_heads;
        let s = self.stream();
        let (qd, knd, kpd, vd) = (
            ok(s.clone_htod(q)),
            ok(s.clone_htod(k_nope)),
            ok(s.clone_htod(k_pe)),
            ok(s.clone_htod(v)),
        );
        let mut od = ok(s.clone_htod(&*out));
        let args = [
            pos0 as i32,
            shape.n_heads as i32,
            shape.nope as i32,
            shape.rope as i32,
            shape.v_dim as i32,
        ];
        let mut b = s.launch_builder(self.func("mla_attention"));
        b.arg(&qd).arg(&knd).arg(&kpd).arg(&vd).arg(&mut od);
        for a in &args {
            b.arg(a);
        }
        b.arg(&shape.scale);
        let cfg = LaunchConfig {
            grid_dim: (slots as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: ((shape.nope + shape.rope + pos0 + n) * 4) as u32,
        };
        // SAFETY: matches mla_attention in kernels/attention.cu.
        ok(unsafe { b.launch(cfg) });
        self.download(&s, &od, out);
    }

    fn all_reduce(&self, partials: &[Vec<f32>]) -> Vec<f32> {
        let t0 = std::time::Instant::now();
        let out = self.all_reduce_device(partials);
        self.clock.add(t0.elapsed(), std::time::Duration::ZERO);
        out
    }

    fn comm_stats(&self) -> Option<CommStats> {
        Some(self.clock.read())
    }

    fn reset_comm_stats(&self) {
        self.clock.reset()
    }

    fn embed_rows(&self, w: WeightRef<'_>, rows: &[Option<usize>], out: &mut [f32]) {
        self.embed_rows_device(w, rows, out)
    }
}

impl CudaBackend {
    /// The fixed-order device-side sum of the simulated ranks' partials.
    fn all_reduce_device(&self, partials: &[Vec<f32>]) -> Vec<f32> {
        let len = partials[0].len();
        let mut out = vec![0f32; len];
        if len == 0 {
            return out;
        }
        let s = self.stream();
        let flat: Vec<f32> = partials.iter().flat_map(|p| p.iter().copied()).collect();
        let pd = ok(s.clone_htod(&flat));
        // SAFETY: written whole by the kernel.
        let mut od = ok(unsafe { s.alloc::<f32>(len) });
        let (np, l) = (partials.len() as i32, len as i64);
        let mut b = s.launch_builder(self.func("all_reduce_sum"));
        b.arg(&pd).arg(&mut od).arg(&np).arg(&l);
        // SAFETY: matches all_reduce_sum in kernels/ops.cu; parts are back to back, len each.
        ok(unsafe { b.launch(Self::elementwise_cfg(len)) });
        self.download(&s, &od, &mut out);
        out
    }

    fn embed_rows_device(&self, w: WeightRef<'_>, rows: &[Option<usize>], out: &mut [f32]) {
        let cols = w.cols();
        if rows.is_empty() || cols == 0 {
            return;
        }
        let s = self.stream();
        let dw = self.weight(w, &s);
        let ids: Vec<i32> = rows.iter().map(|r| r.map_or(-1, |r| r as i32)).collect();
        let idd = ok(s.clone_htod(&ids));
        // SAFETY: written whole by the kernel (zeros for masked rows).
        let mut od = ok(unsafe { s.alloc::<f32>(rows.len() * cols) });
        let (nn, c, rb) = (rows.len() as i32, cols as i32, dw.row_bytes as i32);
        let mut b = s.launch_builder(self.func(&format!("gather_{}", dw.suffix)));
        b.arg(&dw.data).arg(&idd).arg(&mut od).arg(&nn).arg(&c).arg(&rb);
        let cfg = LaunchConfig {
            grid_dim: (rows.len().div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gather_* in kernels/quant.cu.
        ok(unsafe { b.launch(cfg) });
        self.download(&s, &od, out);
    }
}

/// One numerical check of a GPU kernel against the CPU engine's kernel on the same inputs.
#[derive(Clone, Debug)]
pub struct KernelCheck {
    /// `OP(vars)`, as llama.cpp's test-backend-ops prints a case.
    pub case: String,
    pub rel_l2: f64,
    pub max_abs: f64,
    pub tol: f64,
    pub pass: bool,
}

fn compare(case: String, gpu: &[f32], cpu: &[f32], tol: f64) -> KernelCheck {
    let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
    let mut nonfinite = false;
    for (&a, &b) in gpu.iter().zip(cpu) {
        if !a.is_finite() {
            nonfinite = true;
        }
        let d = (a as f64 - b as f64).abs();
        num += d * d;
        den += b as f64 * b as f64;
        max_abs = max_abs.max(d);
    }
    let rel_l2 = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    let pass = !nonfinite && rel_l2 <= tol && gpu.len() == cpu.len();
    KernelCheck {
        case,
        rel_l2,
        max_abs,
        tol,
        pass,
    }
}

/// Deterministic values in [-1, 1).
fn noise(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

impl CudaBackend {
    /// Runs every kernel against the CPU engine's on odd shapes (the fast/slow pairs of the
    /// CUDA backend): matmul/matvec and gather for every GPU weight type, RMSNorm, RoPE NORM and
    /// NEOX, SwiGLU, GQA and MLA attention in prefill and decode, and the all-reduce.
    pub fn self_check(&self) -> Vec<KernelCheck> {
        let cpu = CpuBackend;
        let mut out = Vec::new();
        let rows = 37;
        for ty in crate::cuda_kernels::GPU_TYPES {
            let cols = match ty {
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 291,
                GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => 512,
                _ => 320,
            };
            let wf = noise(rows * cols, 7 + ty as u64);
            let bytes = references::quant::quantize(ty, &wf).expect("quantize test weights");
            let q = QMat {
                ty,
                bytes: &bytes,
                rows,
                cols,
                row_bytes: bytes.len() / rows,
            };
            let w = if ty == GgmlType::F32 {
                WeightRef::F32(Mat { data: &wf, rows, cols })
            } else {
                WeightRef::Quant(q)
            };
            for n in [1usize, 5, 9, 17] {
                let x = noise(n * cols, 100 + n as u64);
                let (mut g, mut c) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                self.linear(&x, n, w, &mut g);
                cpu.linear(&x, n, w, &mut c);
                let name = type_suffix(ty).unwrap_or("?");
                out.push(compare(
                    format!("MUL_MAT(type={name},ne=[{cols},{rows}],n={n})"),
                    &g,
                    &c,
                    1e-5,
                ));
            }
            let ids = [Some(3), None, Some(36), Some(0), None];
            let (mut g, mut c) = (vec![1f32; ids.len() * cols], vec![1f32; ids.len() * cols]);
            self.embed_rows(w, &ids, &mut g);
            cpu.embed_rows(w, &ids, &mut c);
            out.push(compare(
                format!(
                    "GET_ROWS(type={},ne=[{cols},{rows}],n=5)",
                    type_suffix(ty).unwrap_or("?")
                ),
                &g,
                &c,
                0.0,
            ));
            // The test bytes die here; a later type's may reuse their address and length.
            self.weights.lock().expect("weight map").clear();
        }
        // Every compiled one-token GEMV variant, on shapes whose rows end in a partial warp of
        // units and whose row count is not a multiple of R.
        for ty in [GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4K] {
            let cols = match ty {
                GgmlType::Q8_0 => 768,
                GgmlType::Q4K => 1280,
                _ => 1032,
            };
            let wf = noise(rows * cols, 40 + ty as u64);
            let bytes = references::quant::quantize(ty, &wf).expect("quantize test weights");
            let w = WeightRef::Quant(QMat {
                ty,
                bytes: &bytes,
                rows,
                cols,
                row_bytes: bytes.len() / rows,
            });
            let x = noise(cols, 41);
            let mut c = vec![0f32; rows];
            cpu.linear(&x, 1, w, &mut c);
            for v in GEMV_VARIANTS.iter().filter(|v| v.ty == ty) {
                let mut g = vec![f32::NAN; rows];
                self.linear_with(&x, 1, w, &mut g, Some(*v));
                out.push(compare(
                    format!(
                        "GEMV(type={},ne=[{cols},{rows}],variant={})",
                        type_suffix(ty).unwrap_or("?"),
                        v.entry()
                    ),
                    &g,
                    &c,
                    1e-5,
                ));
            }
            self.weights.lock().expect("weight map").clear();
        }
        for (n, d) in [(1usize, 576usize), (7, 1000), (3, 64)] {
            let x = noise(n * d, 11);
            let wt = noise(d, 12);
            let (mut g, mut c) = (vec![0f32; n * d], vec![0f32; n * d]);
            self.rms_norm(&x, &wt, 1e-5, &mut g);
            cpu.rms_norm(&x, &wt, 1e-5, &mut c);
            out.push(compare(format!("RMS_NORM(ne=[{d},{n}])"), &g, &c, 1e-6));
        }
        for style in [RopeStyle::Norm, RopeStyle::Neox] {
            for (layout, pos0) in [
                (
                    RopeLayout {
                        n_heads: 3,
                        head_stride: 64,
                        offset: 0,
                        rope_dim: 64,
                    },
                    5usize,
                ),
                (
                    RopeLayout {
                        n_heads: 5,
                        head_stride: 40,
                        offset: 24,
                        rope_dim: 16,
                    },
                    1000,
                ),
            ] {
                let n = 6;
                let x = noise(n * layout.n_heads * layout.head_stride, 13);
                let (mut g, mut c) = (x.clone(), x.clone());
                self.rope(&mut g, layout, pos0, 10000.0, style);
                cpu.rope(&mut c, layout, pos0, 10000.0, style);
                out.push(compare(
                    format!(
                        "ROPE(style={style:?},heads={},stride={},off={},dim={},pos0={pos0})",
                        layout.n_heads, layout.head_stride, layout.offset, layout.rope_dim
                    ),
                    &g,
                    &c,
                    1e-5,
                ));
            }
        }
        {
            let gate = noise(1001, 14);
            let up = noise(1001, 15);
            let (mut g, mut c) = (gate.clone(), gate.clone());
            self.swiglu(&mut g, &up);
            cpu.swiglu(&mut c, &up);
            out.push(compare("SWIGLU(ne=[1001])".into(), &g, &c, 1e-6));
        }
        for (pos0, n) in [(0usize, 7usize), (7, 1), (30, 3)] {
            let t = pos0 + n;
            let s = GqaShape {
                n_heads: 6,
                n_kv_heads: 2,
                head_dim: 40,
                scale: 1.0 / 40f32.sqrt(),
            };
            let q = noise(n * 6 * 40, 16);
            let k = noise(t * 2 * 40, 17);
            let v = noise(t * 2 * 40, 18);
            let (mut g, mut c) = (vec![0f32; n * 240], vec![0f32; n * 240]);
            self.gqa_attention(&q, &k, &v, pos0, s, &mut g);
            cpu.gqa_attention(&q, &k, &v, pos0, s, &mut c);
            out.push(compare(
                format!("ATTN_GQA(H=6,KV=2,hd=40,pos0={pos0},n={n})"),
                &g,
                &c,
                1e-5,
            ));
            let m = MlaShape {
                n_heads: 3,
                nope: 24,
                rope: 8,
                v_dim: 20,
                scale: 0.2,
            };
            let q = noise(n * 3 * 32, 19);
            let kn = noise(t * 3 * 24, 20);
            let kp = noise(t * 8, 21);
            let v = noise(t * 3 * 20, 22);
            let (mut g, mut c) = (vec![0f32; n * 60], vec![0f32; n * 60]);
            self.mla_attention(&q, &kn, &kp, &v, pos0, m, &mut g);
            cpu.mla_attention(&q, &kn, &kp, &v, pos0, m, &mut c);
            out.push(compare(
                format!("ATTN_MLA(H=3,nope=24,rope=8,v=20,pos0={pos0},n={n})"),
                &g,
                &c,
                1e-5,
            ));
        }
        {
            let parts: Vec<Vec<f32>> = (0..8).map(|r| noise(999, 30 + r)).collect();
            let g = self.all_reduce(&parts);
            let c = cpu.all_reduce(&parts);
            out.push(compare("ALL_REDUCE(ranks=8,ne=[999])".into(), &g, &c, 0.0));
        }
        out
    }
}

/// A GEMV timing: weight bytes read per second, and the copy bandwidth of the same run.
#[derive(Clone, Debug)]
pub struct GemvBench {
    pub case: String,
    pub weight_bytes: usize,
    pub seconds: f64,
    pub gb_per_s: f64,
}

/// Random ggml blocks whose f16 scale fields are finite (so timings see ordinary arithmetic).
fn random_blocks(ty: GgmlType, n_bytes: usize) -> Vec<u8> {
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
        let suffix = type_suffix(ty).ok_or_else(|| EngineError::Cuda(format!("no GPU kernel for {ty:?}")))?;
        let row_bytes = cols / ty.block_elems() * ty.block_bytes();
        let w_bytes = rows * row_bytes;
        let copies = (512usize << 20).div_ceil(w_bytes).clamp(1, 64);
        let s = self.ctx.new_stream().map_err(drv("stream"))?;
        let host = random_blocks(ty, w_bytes);
        let host = device_layout(ty, &host, rows, row_bytes);
        let mut ws = Vec::new();
        for _ in 0..copies {
            ws.push(DevWeight {
                data: s.clone_htod(&*host).map_err(drv("upload"))?,
                ty,
                suffix,
                row_bytes,
            });
        }
        let x = s.clone_htod(&noise(n * cols, 3)).map_err(drv("upload"))?;
        let mut out = s.alloc_zeros::<f32>(n * rows).map_err(drv("alloc"))?;
        for w in ws.iter().take(3) {
            self.launch_linear(&s, w, rows, cols, &x, n, &mut out);
        }
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let t0 = s.record_event(flags).map_err(drv("event"))?;
        for i in 0..iters {
            self.launch_linear(&s, &ws[i % copies], rows, cols, &x, n, &mut out);
        }
        let t1 = s.record_event(flags).map_err(drv("event"))?;
        t1.synchronize().map_err(drv("sync"))?;
        let seconds = t0.elapsed_ms(&t1).map_err(drv("elapsed"))? as f64 / 1e3 / iters as f64;
        let kind = if n == 1 { "GEMV" } else { "GEMM" };
        Ok(GemvBench {
            case: format!("{kind}(type={suffix},rows={rows},cols={cols},n={n})"),
            weight_bytes: w_bytes,
            seconds,
            gb_per_s: w_bytes as f64 / seconds / 1e9,
        })
    }
}
