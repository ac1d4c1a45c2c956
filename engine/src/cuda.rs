//! The CUDA backend (feature `cuda`): the [`Backend`] ops as NVRTC kernels from `kernels/*.cu`
//! (module list in [`crate::cuda_kernels`]), compiled at start-up for the device's arch and cached
//! per process.
//!
//! What lives where:
//! - Weights are uploaded once, on first use, and stay on the device (keyed by their host address
//!   and length, which are stable for an engine's lifetime). Types with a register decoder in
//!   `kernels/quant.cu` keep their ggml bytes (Q8_0, Q4_1 and Q4_K rows repacked for coalesced
//!   loads, same size); Q2_K and Q3_K are dequantized to f32 on upload. RMSNorm weights are cached the
//!   same way.
//! - Products of n > 1 tokens with Q4_K, Q8_0 or Q4_1 weights take the tensor-core GEMM of
//!   `kernels/gemm.cu` (split-f16 x, exact integer weights, f32 accumulation; `gemm.rs`,
//!   `LLMDIFF_CUDA_DISABLE=gemm` turns it off); weights that
//!   share x (`linear_many`) share its x pre-pass. Other types and shapes keep the SIMT `matmul_*`.
//! - One-token products (n = 1) take a GEMV of `kernels/quant.cu` (`CudaBackend::gemv_default`;
//!   Q4_K/Q4_1 rows of 128 units or more in the integer form: dp4a on x in int8 limbs, which a
//!   decode row's norm, SwiGLU or split GQA attention writes beside the row, [`DevBuf`]'s
//!   `limbs`, else a pre-pass;
//!   `LLMDIFF_CUDA_DISABLE=gemv` turns it off).
//! - GQA attention of n > 1 new tokens (prefill, from 32 (token, query head) rows per KV head)
//!   takes the tiled kernel of `kernels/attention.cu` (a block per 64 rows of one KV head, K/V
//!   tiles staged once for the group's query heads, online softmax; on the tensor cores in 3xTF32
//!   where head_dim is a multiple of 8 up to 128; `attn.rs`, `LLMDIFF_CUDA_DISABLE=attn-tiled` turns
//!   it off, `attn-tc` keeps the CUDA-core form); GQA
//!   decode (n = 1, op by op and recorded) takes the split kernel (a block per chunk of positions,
//!   or run of chunks on long contexts, and KV head, the last block of a KV head combining the
//!   splits in a fixed order and writing
//!   the row's limbs for the o-projection; `LLMDIFF_CUDA_DISABLE=attn-split` turns it off);
//!   MLA and the shapes neither takes keep a block per (token, head).
//! - Activations, custom-op output buffers and the KV cache are device buffers ([`DevBuf`] inside
//!   a [`Buf`]); nothing crosses to the host between ops. Host traffic per step: the token ids
//!   (a prefill's row ids; a decode step's token as a kernel argument, or with its position in
//!   page-locked words a recorded step copies), the downloads of wanted taps (made at record
//!   time), the logits (through a page-locked staging buffer), and for MoE models the chosen
//!   experts and their weights (routing runs on the device, `moe_route`). A custom op's output
//!   buffer is the caller's, canary-filled on the device when tapped, so an element the kernel
//!   never writes keeps the canary.
//! - All of a device's work goes on one stream, in issue order: the simulated ranks enqueue their
//!   ops there in rank order from the driver thread ([`Backend::parallel_ranks`] is false), with
//!   their own buffers, and the all-reduce that follows needs no host synchronization (only
//!   downloads wait). The all-reduce is a device-side sum in fixed rank order.
//! - KV caches grow by doubling their device capacity (old rows copied on the device).
//! - Freed buffers go to a per-device pool by capacity and are reused (see [`BufPool`]), so a
//!   decode step makes no allocation calls after the first.
//! - Decode graphs ([`Backend::graph_begin`]/[`Backend::graph_end`]): a plain decode step's work
//!   is recorded by stream capture, its embedding included, and replayed as one `cuGraphLaunch`
//!   per token. While recording, RoPE, the KV append (also in the q/k/v GEMV's store) and GQA
//!   attention take their `*_dpos` forms, which read the position from a device word, and the
//!   gather reads the token from the next; the graph's first node copies both from page-locked
//!   host words a replay writes (`StepWords`; the split attention's grid and partials cover the
//!   KV cache's capacity; the per-(token, head) kernel's shared memory is sized for it); an
//!   allocation, a shifted KV slot or MLA attention during the recording
//!   makes it run once and not be kept. Host launch cost measured on an H200 is 3–4 µs per
//!   `cuLaunchKernel` back to back (cudarc's builder adds nothing measurable; the first launch
//!   after a synchronization took 8.5 µs in round 19); a graph node costs ~0.7 µs.
//! - A decode step's kernels are chained by programmatic dependent launch (off with
//!   `LLMDIFF_CUDA_DISABLE=pdl`): the warp-rows GEMVs (`launch_pdl`) and the one-token norms, SwiGLU
//!   and split attention (`launch_chained`; `pdl-chain` launches these plainly) start while
//!   the kernel before them runs and wait for it before reading what it wrote. A GQA layer's
//!   one-token q/k/v GEMV also rotates q and k and appends k and v to the KV cache in its store
//!   (`linear_qkv_rope`; off with `LLMDIFF_CUDA_DISABLE=qkv-store`).
//!
//! A missing driver, device or NVRTC is an [`EngineError::Cuda`] from [`CudaBackend::new`], never
//! a CPU fallback. Errors after start-up (out of device memory) panic with a `cuda:` message,
//! since the [`Backend`] ops are infallible.

use crate::backend::{Backend, BlockTrace, Buf, BufRepr, CommClock, CommStats, CpuBackend};
use crate::cuda_kernels::{
pair_nw, type_suffix, GemvKind, GemvVariant, KernelId, GEMV_VARIANTS};
use crate::kernels::{GqaShape, Mat, MlaShape, QMat, QkRope, RopeLayout, RopeStyle, WeightRef};
use crate::rank::{route, Route};
use crate::options::{CudaDisable, CudaOptions};
use crate::EngineError;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};
use references::config::{Gating, MoeConfig};
use references::GgmlType;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

#[path = "cuda_attn.rs"]
mod attn;
#[path = "cuda_gemm.rs"]
mod gemm;
pub use attn::{AttnBench, AttnDecodeBench};
pub use gemm::GemmBench;

#[path = "cuda_trace.rs"]
mod trace;

/// Q4_K warp-rows launches of rows of 128..255 units and fewer rows than this take pair units
/// (mode 3; see `gemv_select`).
const PAIR_BELOW_ROWS: usize = 8192;

/// Q4_K warp-rows launches of rows of 128..255 units and at least this many rows take NW 2.
const NW2_ROWS: usize = 8192;

/// A kernel's parameters for [`CudaBackend::launch_chained`], each held in 8 bytes: a device
/// pointer, or a 4-byte scalar in the low half (where the driver reads a 4-byte parameter).
#[derive(Default)]
pub(crate) struct RawArgs(Vec<u64>);

impl RawArgs {
    /// A buffer's device address. Holds no guard: the backend disables cudarc's per-slice event
    /// tracking, so a guard would record nothing.
    pub(crate) fn buf<T>(&mut self, b: &CudaSlice<T>) -> &mut Self {
        use cudarc::driver::DevicePtr;
        self.0.push(b.device_ptr(b.stream()).0);
        self
    }
    /// A buffer's address, or 0 (a null pointer) for `None`.
    pub(crate) fn opt_buf<T>(&mut self, b: Option<&CudaSlice<T>>) -> &mut Self {
        match b {
            Some(b) => self.buf(b),
            None => {
                self.0.push(0);
                self
            }
        }
    }
    pub(crate) fn i32(&mut self, v: i32) -> &mut Self {
        self.0.push(v as u32 as u64);
        self
    }
    pub(crate) fn f32(&mut self, v: f32) -> &mut Self {
        self.0.push(v.to_bits() as u64);
        self
    }
}

/// Heads per thread in `rope_qk` (`ROPE_HEADS` in kernels/ops.cu).
const ROPE_HEADS: usize = 4;

/// `rope_qk`'s cache append (see `Backend::rope_qk_cache`): the k cache, v and its cache, v's row
/// width, and the first row written: `slot`, or the position word when `dpos` (a recording).
struct KvAppend<'a> {
    kc: &'a mut CudaSlice<f32>,
    v: &'a CudaSlice<f32>,
    vc: &'a mut CudaSlice<f32>,
    v_width: usize,
    slot: usize,
    dpos: bool,
}

/// A one-row q/k/v GEMV's store (see `GemvRows`): NORM RoPE by the table `cs`, k and v appended to
/// their caches. The launch's parts are q, k, v from role `first` on (0: q first; 2: v alone, the
/// launch after a q + k one when v's type differs, as in Q4_K_M's promoted layers). `done` is set
/// when the launch took it (a warp-rows GEMV, of even R over even q and k row counts where it has
/// q or k rows); otherwise the caller still owes the RoPE and the appends.
struct GemvEpi<'a> {
    cs: &'a CudaSlice<f32>,
    kc: &'a mut CudaSlice<f32>,
    vc: &'a mut CudaSlice<f32>,
    head_dim: usize,
    rope_dim: usize,
    slot: usize,
    dpos: bool,
    first: usize,
    done: bool,
}

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

/// The `-arch` NVRTC gets for a compute capability. Hopper gets `sm_90a`: its arch-specific
/// instructions (wgmma, for the prefill GEMM's wg variant) run on compute capability 9.0, and
/// 9.0 is the only device that code meets.
fn arch_name(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (9, 0) => "sm_90a",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => Box::leak(format!("sm_{major}{minor}").into_boxed_str()),
    }
}

type PtxCache = Mutex<HashMap<(KernelId, &'static str, bool), Ptx>>;

/// Compiles one module for `arch`, with the kernel trace compiled in when `trace` (see
/// `cuda_trace.rs`; cached per process). A compile error names the kernel file.
pub fn compile(id: KernelId, arch: &'static str, trace: bool) -> Result<Ptx, EngineError> {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(p) = cache.lock().expect("ptx cache").get(&(id, arch, trace)) {
        return Ok(p.clone());
    }
    let mut options = vec!["-std=c++17".to_string()];
    if trace {
        options.push("-DLLMDIFF_TRACE".into());
    }
    let opts = CompileOptions {
        arch: Some(arch),
        include_paths: vec!["/usr/local/cuda/include".into()],
        options,
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
    cache.lock().expect("ptx cache").insert((id, arch, trace), ptx.clone());
    Ok(ptx)
}

/// The cuda backend for TP `tp` under `opts`: real ranks over NCCL ([`crate::cuda_nccl`]) or
/// simulated ranks on one GPU, by [`CudaOptions::ranks`] and the device count; the kernel trace
/// runs on one GPU only.
pub fn backend_for(tp: usize, opts: &CudaOptions) -> Result<Box<dyn Backend>, EngineError> {
    let n = CudaBackend::device_count();
    if crate::cuda_nccl::wants_real_ranks(opts.ranks, tp, n)? {
        if opts.kernel_trace {
            return Err(EngineError::Cuda(
                "the kernel trace runs on one GPU: use simulated ranks (--ranks simulated)".into(),
            ));
        }
        Ok(Box::new(crate::cuda_nccl::NcclBackend::new(tp, opts)?))
    } else {
        Ok(Box::new(CudaBackend::on_device(0, opts)?))
    }
}

/// A weight resident on the device.
struct DevWeight {
    data: CudaSlice<u8>,
    /// The device layout's type (F32 for types dequantized on upload).
    ty: GgmlType,
    suffix: &'static str,
    row_bytes: usize,
}

/// `GemvRows` in kernels/quant.cu, the output rows of a warp-rows GEMV: up to three weight
/// matrices of one type and width sharing x (q/k/v, gate/up), rows numbered one after another
/// (matrix 0 below `end[0]`, matrix 1 below `end[1]`, matrix 2 the rest); unused pointers are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GemvRows {
    w: [u64; 3],
    out: [u64; 3],
    end: [i32; 2],
    /// The q/k/v store (`GemvRows::store` in common.cuh; `cs` 0: plain stores): the RoPE angle
    /// table, the k and v caches, the position word (0: `kv_row`), then head_dim, rope_dim,
    /// kv_row and the total rows.
    cs: u64,
    kc: u64,
    vc: u64,
    pos_dev: u64,
    rope: [i32; 4],
}

// SAFETY: #[repr(C)] plain integers laid out as the kernel's struct (three 8-byte pointers, three
// more, two ints, four pointers, four ints: 104 bytes, 8-byte aligned).
unsafe impl cudarc::driver::DeviceRepr for GemvRows {}

/// Rows of blocks as the device keeps them: in each row, every block's quant bytes back to back,
/// then every block's `header` leading bytes (its scales); the same bytes and row length as the
/// ggml row. Q8_0 (34-byte blocks, a 2-byte f16 d), Q4_1 (20, f16 d and m) and Q4_K (144, d,
/// dmin and 12 scale bytes) are kept so: a warp's quant loads are one contiguous, aligned run.
fn repack_headers_last(bytes: &[u8], rows: usize, row_bytes: usize, block: usize, header: usize) -> Vec<u8> {
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

/// Q6_K rows as the device keeps them (`kernels/quant.cu`): every super-block's 128 `ql` bytes
/// back to back, then every one's 64 `qh` bytes, then its 16 scales in unit order, then its f16
/// `d`; the same bytes and row length as the ggml row (210 per super-block). Unit i of a
/// super-block (n = i / 4, p = i / 2 % 2, is = i % 2) is `ql` bytes 16i .. 16i + 16 (positions
/// 128n + 32p + 16is + k from the low nibbles, 64 further on from the high ones); its two scale
/// bytes are ggml's sc[8n + is + 2p] and sc[8n + is + 2p + 4]. So a warp's quant loads are one
/// aligned 512-byte run, where the ggml blocks are only 2-byte aligned.
fn repack_q6_k(bytes: &[u8], rows: usize, row_bytes: usize) -> Vec<u8> {
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
fn device_layout(ty: GgmlType, bytes: &[u8], rows: usize, row_bytes: usize) -> std::borrow::Cow<'_, [u8]> {
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

/// Threads per attention block (one block per token and head): 256, or 1024 when there are
/// fewer blocks than SMs (a decode step), so each block's walk over the positions is split
/// over more thread groups (`attn_weighted_sum`) instead of leaving SMs idle.
fn attn_threads(blocks: usize, sms: u32) -> u32 {
    if blocks < sms as usize {
        1024
    } else {
        256
    }
}

/// Floats of shared memory for the attention kernels' G partial output rows of `width`
/// (`attn_weighted_sum` in kernels/attention.cu), with `threads` per block.
fn attn_part(width: usize, threads: u32) -> usize {
    let t = threads as usize;
    let g = if t >= width { t / width.max(1) } else { 1 };
    g * width
}

/// A device buffer of f32: `len` values in use, `data.len()` allocated (capacity; KV caches
/// grow into it). Dropping it returns its memory to its backend's [`BufPool`].
pub struct DevBuf {
    data: std::mem::ManuallyDrop<CudaSlice<f32>>,
    len: usize,
    pool: Arc<BufPool>,
    /// The integer GEMV's x limbs of these `len` values (the `gemv_x_limbs` layout), when the op
    /// that wrote them wrote those too (a decode row's RMSNorm, SwiGLU or split GQA attention: see
    /// `CudaBackend::limbs_out`), so the GEMV that reads this row skips its pre-pass. Every other
    /// write drops them: writes go through `dev_mut` (or set `len`), which clear this.
    limbs: Option<Box<Buf>>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: `data` is not used after this.
        let data = unsafe { std::mem::ManuallyDrop::take(&mut self.data) };
        self.pool.put(data);
    }
}

/// Freed device buffers kept for reuse, by capacity: a decode step allocates the same sizes as
/// the last one, so after the first step its buffers come from here instead of a driver call
/// each (launch overhead dominates small-model decode). Reuse is safe because all of a device's
/// work is on one stream, in issue order: work enqueued after the reuse runs after the work
/// that used the buffer before. At most `MAX_POOLED_BYTES` are kept; beyond that, buffers are
/// freed (stream-ordered).
#[derive(Default)]
pub struct BufPool {
    free: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    by_capacity: HashMap<usize, Vec<CudaSlice<f32>>>,
    n_bytes: usize,
}

const MAX_POOLED_BYTES: usize = 2 << 30;

impl BufPool {
    fn take(&self, cap: usize) -> Option<CudaSlice<f32>> {
        let mut g = self.free.lock().expect("buffer pool");
        let s = g.by_capacity.get_mut(&cap)?.pop()?;
        g.n_bytes -= cap * 4;
        Some(s)
    }

    fn put(&self, s: CudaSlice<f32>) {
        let cap = s.len();
        let mut g = self.free.lock().expect("buffer pool");
        if g.n_bytes + cap * 4 <= MAX_POOLED_BYTES {
            g.n_bytes += cap * 4;
            g.by_capacity.entry(cap).or_default().push(s);
        }
    }
}

impl DevBuf {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub(crate) fn capacity(&self) -> usize {
        self.data.len()
    }
    pub(crate) fn set_len(&mut self, len: usize) {
        assert!(len <= self.data.len(), "cuda: set_len past the buffer's capacity");
        self.len = len;
        self.limbs = None;
    }
}

/// The state of a decode-graph recording (see [`Backend::graph_begin`]).
#[derive(Default)]
struct CaptureState {
    /// Work is being recorded, not run.
    active: bool,
    /// Why the recording cannot be replayed, if it cannot.
    spoiled: Option<&'static str>,
    /// The most KV rows any recorded attention or KV append can address (capacity, and the
    /// attention's shared memory).
    max_rows: usize,
}

/// A recorded decode step (CUDA graph) and what replaying it needs: the host words its first node
/// copies to the position and token words its kernels read.
struct CudaStepGraph {
    graph: cudarc::driver::CudaGraph,
    words: Arc<StepWords>,
    /// Where the first node copies the words to.
    _pos_dev: Arc<CudaSlice<i32>>,
    max_rows: usize,
}

// SAFETY: the graph is used only through its owner (the engine, one step at a time, `&mut`
// access); the CUDA objects it holds are not tied to the thread that made them.
unsafe impl Send for CudaStepGraph {}

impl crate::backend::StepGraph for CudaStepGraph {
    fn replay(&self, pos0: usize, token: u32) {
        self.words.set(pos0, token);
        ok(self.graph.launch());
    }
    fn fits(&self, pos0: usize) -> bool {
        pos0 < self.max_rows
    }
}

/// A decode step's position and token in page-locked host memory. A recorded step's first node
/// copies them to `CudaBackend::pos_dev`, so a replay writes them here and launches the graph:
/// no kernel launch of its own (one cost ~8 µs of host time a step on the H200, round 19).
/// Written only when no recorded step is running: the engine downloads each step's logits (a
/// synchronization) before the next step.
struct StepWords {
    /// Two ints; `ptr` is their address.
    _pinned: cudarc::driver::PinnedHostSlice<i32>,
    ptr: *mut i32,
}

// SAFETY: `ptr` points into `_pinned`, which lives as long as this; writes happen between steps
// only (see above).
unsafe impl Send for StepWords {}
unsafe impl Sync for StepWords {}

impl StepWords {
    fn new(ctx: &Arc<CudaContext>) -> Result<StepWords, DriverError> {
        // SAFETY: both words are written (zeros) before any use; flags 0: cached memory.
        let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<i32>(2, 0) }?;
        let ptr = pinned.as_mut_ptr()?;
        let words = StepWords { _pinned: pinned, ptr };
        words.set(0, 0);
        Ok(words)
    }

    fn set(&self, pos0: usize, token: u32) {
        // SAFETY: two ints at ptr, not read by the device now (see the type's doc).
        unsafe {
            std::ptr::write_volatile(self.ptr, pos0 as i32);
            std::ptr::write_volatile(self.ptr.add(1), token as i32);
        }
    }

    /// Records (the stream is capturing) the copy of both words to `dst` (two device ints).
    fn copy_to(&self, stream: &CudaStream, dst: u64) {
        // SAFETY: two ints at ptr, page-locked (so the copy may be recorded); dst holds two ints
        // that outlive the graph (CudaBackend::pos_dev).
        ok(unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, std::slice::from_raw_parts(self.ptr, 2), stream.cu_stream())
        });
    }
}

/// The largest download (values) staged through page-locked memory (`CudaBackend::staging`): 4 MiB.
const STAGING_MAX: usize = 1 << 20;

/// Dynamic shared memory a block may use without opting in.
const SMEM_DEFAULT_MAX: usize = 48 * 1024;

/// The values in use of a device buffer, as a view (for NCCL).
pub(crate) fn dev_view(b: &Buf) -> cudarc::driver::CudaView<'_, f32> {
    dev(b).slice(..b.len())
}

pub(crate) fn dev_view_mut(b: &mut Buf) -> cudarc::driver::CudaViewMut<'_, f32> {
    let len = b.len();
    dev_mut(b).slice_mut(..len)
}

fn dev(b: &Buf) -> &CudaSlice<f32> {
    match &b.repr {
        BufRepr::Dev(d) => &d.data,
        BufRepr::Host(_) => panic!("cuda: a host buffer given to a device op"),
    }
}

/// A device buffer to write: its limbs (see [`DevBuf::limbs`]) no longer describe it.
fn dev_mut(b: &mut Buf) -> &mut CudaSlice<f32> {
    match &mut b.repr {
        BufRepr::Dev(d) => {
            d.limbs = None;
            &mut d.data
        }
        BufRepr::Host(_) => panic!("cuda: a host buffer given to a device op"),
    }
}

/// The limbs of `x` when it is one row of `cols` values written with them (see [`DevBuf::limbs`]).
fn limbs_of(x: &Buf, cols: usize) -> Option<&CudaSlice<f32>> {
    match &x.repr {
        BufRepr::Dev(d) if d.len == cols => d.limbs.as_deref().map(dev),
        _ => None,
    }
}

/// Attaches limbs written by the op that just wrote `out` (after its `dev_mut`).
fn attach_limbs(out: &mut Buf, limbs: Option<Buf>) {
    if let BufRepr::Dev(d) = &mut out.repr {
        d.limbs = limbs.map(Box::new);
    }
}

/// An integer-form GEMV's x limbs: borrowed from x's buffer, or made by the pre-pass for this
/// launch (pooled scratch, back to the pool when dropped after the launch is enqueued).
enum XLimbs<'a> {
    Given(&'a CudaSlice<f32>),
    Made(Buf),
}

impl XLimbs<'_> {
    fn get(&self) -> &CudaSlice<f32> {
        match self {
            XLimbs::Given(q) => q,
            XLimbs::Made(b) => dev(b),
        }
    }
}

/// The f32 words of the integer GEMV's x limbs for `cols` values: three int8 planes, a scale per
/// 32 values and a sum per 8 (`gemv_x_limbs` in kernels/quant.cu).
fn limbs_words(cols: usize) -> usize {
    3 * cols / 4 + cols / 32 + cols / 8
}

/// The GPU backend: one context on a device, its kernels, its stream, and the resident weights.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    device: String,
    arch: &'static str,
    funcs: HashMap<String, CudaFunction>,
    /// The one stream all of this device's work goes on (see the module docs).
    stream: Arc<CudaStream>,
    weights: Mutex<HashMap<(usize, usize), Arc<DevWeight>>>,
    sms: u32,
    /// Default fast paths turned off (`LLMDIFF_CUDA_DISABLE`, see [`CudaDisable`]).
    disable: CudaDisable,
    /// The tensor-core GEMM's settings for n > 1 (see `gemm.rs`).
    gemm: gemm::GemmState,
    /// The tiled prefill and split decode attention's settings (see `attn.rs`).
    attn: attn::AttnState,
    /// Resident blocks per SM of a GEMV entry at a block size and dynamic shared memory.
    occupancy: Mutex<HashMap<(String, u32, u32), u32>>,
    /// Wall time in the all-reduce.
    clock: CommClock,
    /// Freed activation buffers for reuse.
    pool: Arc<BufPool>,
    /// Decode graphs on ([`CudaOptions::graphs_on`]).
    graphs_on: bool,
    /// Warp-rows GEMVs launched with programmatic dependent launch (`launch_pdl`; off with
    /// `LLMDIFF_CUDA_DISABLE=pdl`): 8B decode 2.11 against 2.23 ms on the H200, graph-replayed
    /// logits bitwise the op-by-op step's.
    pdl: bool,
    /// The norms, SwiGLU and the split attention launched the same way (`launch_chained`; off
    /// with `pdl` or `pdl-chain`).
    pdl_chain: bool,
    /// The decode graph being recorded, if any.
    capture: Mutex<CaptureState>,
    /// A decode step's position and token, read from here by a recorded step's kernels (the
    /// `*_dpos` kernels the position, the embedding gather the token), copied from `step_words`
    /// by the step's first node.
    pos_dev: Arc<CudaSlice<i32>>,
    step_words: Arc<StepWords>,
    /// The last RoPE angle table (`rope_table`), reused by every layer of a step.
    rope_table: Mutex<Option<(RopeKey, Buf)>>,
    /// Page-locked host memory that downloads of up to [`STAGING_MAX`] values land in (grown to
    /// the largest such download), so the copy is one DMA rather than the driver's staged copy
    /// through pageable memory (with the embedding recorded in the decode graph: 8B decode 1.97
    /// against 1.99 ms, smollm2 0.62 against 0.66 ms on the H200, round 19).
    staging: Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
    /// The kernel trace's buffer, when the kernels were compiled with it (`with_trace`).
    trace: Option<Mutex<trace::KernelTrace>>,
    /// The blocks a one-row (decode) norm is split over ([`NORM_SPLIT_DEFAULT`], 1 with
    /// `LLMDIFF_CUDA_DISABLE=norm-split`; `rms_norm` in kernels/ops.cu), and the arrival count the
    /// blocks of a split `add_rms_norm` share (0 between launches).
    norm_split: AtomicUsize,
    norm_arrive: Arc<CudaSlice<u32>>,
}

/// The blocks a one-row norm is split over by default (1 = one block). On the H200 8 took the 8B decode step from 1.915 to 1.901 ms, 4 to 1.909.
const NORM_SPLIT_DEFAULT: usize = 8;

/// What a RoPE angle table holds: rows at `pos0` (None: the position word of a recorded step,
/// recomputed at every replay) .. + n, `rope_dim`, `base` (bits). A table's values are a
/// function of its key alone, so a key match is always a valid reuse, except for the recorded
/// form, which `graph_begin` forgets so that each recording computes its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RopeKey {
    pos0: Option<usize>,
    n: usize,
    rope_dim: usize,
    base: u32,
}

impl CudaBackend {
    /// Opens device 0 with the default options and compiles every kernel module for it.
    pub fn new() -> Result<CudaBackend, EngineError> {
        CudaBackend::on_device(0, &CudaOptions::default())
    }

    /// The number of CUDA devices (0 where there is no driver).
    pub fn device_count() -> usize {
        guarded("CUDA driver", || {
            CudaContext::device_count().map_err(drv("CUDA driver"))
        })
        .map_or(0, |n| n.max(0) as usize)
    }

    /// Opens device `ordinal` and compiles every kernel module for it, with the kernel trace
    /// compiled in when `opts.kernel_trace` (see `trace.rs`; `Backend::kernel_trace_take` reads it).
    pub fn on_device(ordinal: usize, opts: &CudaOptions) -> Result<CudaBackend, EngineError> {
        let trace = opts.kernel_trace;
        let ctx = guarded("CUDA driver", || {
            let n = CudaContext::device_count().map_err(drv("CUDA driver"))?;
            if (n.max(0) as usize) <= ordinal {
                return Err(EngineError::Cuda(format!("no CUDA device {ordinal} ({n} found)")));
            }
            CudaContext::new(ordinal).map_err(drv("CUDA device"))
        })?;
        // All work goes on one stream (NCCL's streams join it explicitly); no per-slice tracking.
        // SAFETY: no slice is used on another stream while work on it is in flight (weights are
        // uploaded and synchronized before use; the NCCL path joins streams around the call).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("stream"))?;
        // Activations are allocated and freed per op from the stream-ordered pool; by default the
        // pool hands its memory back to the driver at every synchronization (each download), so
        // the next step pays for mapping it again. Keep it.
        // SAFETY: plain driver calls on this context's device; the value outlives the call.
        unsafe {
            use cudarc::driver::sys;
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS {
                let mut keep = u64::MAX;
                let _ = sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut keep as *mut u64 as *mut std::ffi::c_void,
                );
            }
        }
        let (major, minor) = ctx.compute_capability().map_err(drv("compute capability"))?;
        let arch = arch_name(major, minor);
        let device = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("SM count"))?
            .max(1) as u32;
        let pos_dev = Arc::new(stream.alloc_zeros::<i32>(2).map_err(drv("alloc"))?);
        let norm_arrive = Arc::new(stream.alloc_zeros::<u32>(1).map_err(drv("alloc"))?);
        let step_words = Arc::new(StepWords::new(&ctx).map_err(drv("page-locked alloc"))?);
        // The tiled prefill attention's and the v2 GEMM's blocks (static shared memory: none, or
        // 128 bytes): the opt-in limit.
        let attn_smem_max = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_or(48 << 10, |b| b.max(48 << 10) as usize);
        let trace = trace.then(|| trace::KernelTrace::new(&stream)).transpose()?;
        let mut funcs = HashMap::new();
        for id in KernelId::ALL {
            let ptx = compile(id, arch, trace.is_some())?;
            let module = ctx
                .load_module(ptx)
                .map_err(drv(&format!("loading kernel module {}", id.file())))?;
            if let Some(t) = &trace {
                t.attach(&module, &stream)?;
            }
            for f in id.functions() {
                let func = module
                    .load_function(&f)
                    .map_err(drv(&format!("kernel {f} in {}", id.file())))?;
                // Dynamic shared memory: the whole opt-in limit for the kernels that stage in it.
                let smem = (f.starts_with("gqa_attn_tiled_")
                    || f.starts_with("gqa_attn_tc_")
                    || f.starts_with("gemm2_q"))
                .then_some(attn_smem_max);
                if let Some(bytes) = smem {
                    // Static shared memory (the kernel trace's word, where compiled in) counts
                    // against the same limit.
                    let fixed = func
                        .get_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                        .map_err(drv(&format!("static shared memory of {f}")))?
                        .max(0) as usize;
                    let bytes = bytes.min(attn_smem_max.saturating_sub(fixed));
                    func.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )
                    .map_err(drv(&format!("shared memory size of {f}")))?;
                }
                funcs.insert(f, func);
            }
        }
        let d = opts.disable;
        Ok(CudaBackend {
            ctx,
            device,
            arch,
            funcs,
            stream,
            weights: Mutex::new(HashMap::new()),
            sms,
            disable: d,
            gemm: gemm::GemmState::new(!d.gemm, attn_smem_max),
            attn: attn::AttnState::new(&d, attn_smem_max),
            occupancy: Mutex::new(HashMap::new()),
            clock: CommClock::default(),
            pool: Arc::default(),
            graphs_on: opts.graphs_on(),
            pdl: !d.pdl,
            pdl_chain: !d.pdl && !d.pdl_chain,
            capture: Mutex::new(CaptureState::default()),
            pos_dev,
            step_words,
            rope_table: Mutex::new(None),
            staging: Mutex::new(None),
            trace: trace.map(Mutex::new),
            norm_split: AtomicUsize::new(if d.norm_split { 1 } else { NORM_SPLIT_DEFAULT }),
            norm_arrive,
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

    /// The device's stream.
    pub(crate) fn stream(&self) -> Arc<CudaStream> {
        self.stream.clone()
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

    /// The GEMV variant a one-token product of `w` takes by default, if any.
    fn gemv_variant(&self, w: &DevWeight, rows: usize, cols: usize) -> Option<GemvVariant> {
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

    fn gemv_select(&self, ty: GgmlType, row_bytes: usize, rows: usize, cols: usize) -> Option<GemvVariant> {
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
    fn launch_gemv(
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
        // SAFETY: the arguments match gemv_* in kernels/quant.cu; W is rows·row_bytes in the
        // device layout, x has cols floats, out rows floats; mode 2 gets xq, sized by gemv_x_limbs.
        ok(unsafe { b.launch(cfg) });
    }

    /// How many blocks of kernel `name` (of `threads` threads and `smem` bytes of dynamic shared
    /// memory) an SM holds at once (at least 1), asked of the driver once per shape.
    fn blocks_per_sm(&self, name: &str, threads: u32, smem: u32) -> u32 {
        let mut m = self.occupancy.lock().expect("occupancy map");
        *m.entry((name.to_string(), threads, smem)).or_insert_with(|| {
            ok(self
                .func(name)
                .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None))
            .max(1)
        })
    }

    /// Launches warp-rows GEMV variant `v` over one to three weights of one type and width that
    /// share `x`, each `(weight, out, rows)`, in one launch (`GemvRows`): a block per R rows of
    /// their rows taken one after another.
    #[allow(clippy::too_many_arguments)]
    fn launch_gemv_rows(
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
        // SAFETY: the arguments match gemvw_* in kernels/quant.cu (modes 2 and 3 get xq, sized
        // by gemv_x_limbs): each part's W is rows·row_bytes in the device
        // layout and its out at least rows floats, x has cols floats; the pointers stay valid (and
        // ordered on this stream) while `guards` lives, past the launch.
        ok(unsafe { b.launch(cfg) });
        drop(guards);
    }

    /// Launches kernel `name` with programmatic stream serialization (sm_90 programmatic dependent
    /// launch): it may start while the kernel before it on `s` still runs (the kernels before a
    /// GEMV call `griddep_launch` at their start) and issue its first weight loads, and waits
    /// (`griddep_wait`, kernels/common.cuh) before it reads what earlier kernels wrote or writes
    /// anything. A recorded decode graph keeps it as a programmatic edge.
    ///
    /// # Safety
    /// `params` point to the kernel's arguments, in order and of its types, alive for the call.
    unsafe fn launch_pdl(&self, s: &CudaStream, name: &str, cfg: LaunchConfig, params: &mut [*mut std::ffi::c_void]) {
        // SAFETY: the caller's contract.
        unsafe { self.launch_ex(s, name, cfg, params, true) }
    }

    /// Launches a one-token decode kernel that waits (`griddep_wait`) before it reads or writes
    /// anything: with programmatic dependent launch when on ([`CudaBackend::launch_pdl`]), so its
    /// blocks are placed while the GEMV before it finishes, plainly otherwise.
    ///
    /// # Safety
    /// `args` are the kernel's arguments, in order and of its types; the kernel calls
    /// `griddep_wait` before touching memory.
    pub(crate) unsafe fn launch_chained(&self, name: &str, cfg: LaunchConfig, args: &mut RawArgs) {
        // SAFETY: the caller's contract.
        unsafe { self.launch_raw(&self.stream, name, cfg, args, self.pdl_chain) }
    }

    /// [`CudaBackend::launch_ex`] with the arguments of a [`RawArgs`].
    ///
    /// # Safety
    /// As [`CudaBackend::launch_chained`], on stream `s`.
    unsafe fn launch_raw(&self, s: &CudaStream, name: &str, cfg: LaunchConfig, args: &mut RawArgs, pdl: bool) {
        let mut params: Vec<*mut std::ffi::c_void> = args.0.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        // SAFETY: the caller's contract; `params` point into `args`, alive for the call.
        unsafe { self.launch_ex(s, name, cfg, &mut params, pdl) }
    }

    /// `cuLaunchKernelEx` of kernel `name`, with programmatic stream serialization when `pdl`.
    ///
    /// # Safety
    /// As [`CudaBackend::launch_pdl`].
    unsafe fn launch_ex(
        &self,
        s: &CudaStream,
        name: &str,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
        pdl: bool,
    ) {
        use cudarc::driver::sys;
        // SAFETY: a plain C struct (an id and a union of plain values); all zeros is valid.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: s.cu_stream(),
            attrs: &mut attr,
            numAttrs: pdl as u32,
        };
        let f = self.func(name).cu_function();
        // SAFETY: the caller's contract on `params`; `lc` and `attr` outlive the call.
        ok(unsafe { sys::cuLaunchKernelEx(&lc, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result());
    }

    /// Scratch for the limbs of an op's output when it is one row of `d` values (`len == d`) that
    /// an integer-form GEMV (modes 2 and 3) may read: d % 128 == 0 (the fused kernels' warps hold
    /// whole 32-value blocks) and d ≥ 2048 (narrower rows take the float GEMV by default, see
    /// `gemv_select`), unless the GEMV is disabled. None: no limbs.
    fn limbs_out(&self, len: usize, d: usize) -> Option<Buf> {
        (!self.disable.gemv && len == d && d % 128 == 0 && d >= 2048).then(|| self.new_buf(limbs_words(d)))
    }

    /// The limbs an integer-form GEMV reads: those x came with (`xq`), else the pre-pass's.
    fn x_limbs<'a>(
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

    /// The x pre-pass of the integer GEMV (modes 2 and 3, `gemv_x_limbs` in kernels/quant.cu):
    /// x's three int8 limb planes (cols bytes each), its scale per 32 values and Σx per 8 values
    /// (f32), in pooled scratch that goes back to the pool when dropped (after the launches that
    /// use it are enqueued on this stream).
    fn gemv_x_limbs(&self, s: &Arc<CudaStream>, x: &CudaSlice<f32>, cols: usize) -> Buf {
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
        // SAFETY: matches gemv_x_limbs in kernels/quant.cu: x has cols floats (cols % 32 == 0), q
        // 3·cols bytes then cols/32 + cols/8 floats (a whole pooled allocation, 16-byte aligned).
        ok(unsafe { b.launch(cfg) });
        q
    }

    /// Launches the matvec (n = 1) or matmul (n > 1) kernel on device buffers, or for n = 1 the
    /// one-token GEMV variant forced (`Some`) or chosen by default, if any.
    #[allow(clippy::too_many_arguments)]
    fn launch_linear_with(
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
        // SAFETY: the arguments match matvec_*/matmul_* in kernels/quant.cu; buffers are sized
        // rows·row_bytes, n·cols and n·rows.
        ok(unsafe { b.launch(cfg) });
    }

    /// `Backend::linear`, with the one-token GEMV variant forced (`Some`) or chosen by default.
    fn linear_with(&self, x: &Buf, n: usize, w: WeightRef<'_>, out: &mut Buf, force: Option<GemvVariant>) {
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
    fn linear_many_with(
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
        // n > 1: one x pre-pass for all the weights when the GEMM takes them all (see cuda_gemm.rs).
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
    fn qk_then_v(&self, dws: &[Arc<DevWeight>; 3], ws: &[WeightRef<'_>; 3]) -> Option<[GemvVariant; 2]> {
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
    fn param(&self, v: &[f32]) -> Arc<DevWeight> {
        self.weight(
            WeightRef::F32(Mat {
                data: v,
                rows: 1,
                cols: v.len(),
            }),
            &self.stream,
        )
    }

    fn new_buf(&self, len: usize) -> Buf {
        // SAFETY: the contents are unspecified by contract (Backend::alloc); at least one value
        // is allocated so every buffer has a device address.
        let cap = len.max(1);
        let data = match self.pool.take(cap) {
            Some(d) => d,
            None => {
                self.spoil("an allocation");
                ok(unsafe { self.stream.alloc::<f32>(cap) })
            }
        };
        Buf {
            repr: BufRepr::Dev(DevBuf {
                data: std::mem::ManuallyDrop::new(data),
                len,
                pool: self.pool.clone(),
                limbs: None,
            }),
        }
    }

    /// The address of `pos_dev` (the position and token words), kept alive by the backend.
    fn pos_ptr(&self) -> u64 {
        use cudarc::driver::DevicePtr;
        self.pos_dev.device_ptr(&self.stream).0
    }

    /// True while a decode graph is being recorded.
    fn capturing(&self) -> bool {
        self.capture.lock().expect("capture state").active
    }

    /// Marks the recording in progress (if any) as not replayable.
    fn spoil(&self, why: &'static str) {
        let mut c = self.capture.lock().expect("capture state");
        if c.active && c.spoiled.is_none() {
            c.spoiled = Some(why);
        }
    }

    /// Lowers the recording's replayable KV rows to `rows`.
    fn limit_rows(&self, rows: usize) {
        let mut c = self.capture.lock().expect("capture state");
        c.max_rows = c.max_rows.min(rows);
    }

    /// The device weight, launch shape and split of `rms_norm`/`add_rms_norm` over `len` values
    /// of rows of `weight.len()`; None when there is nothing to do. One thread per float4 of the
    /// row (per value when d % 4 != 0), whole warps, at most 1024: a one-row decode norm is
    /// spread over the block, and over `norm_split` blocks where each takes whole warps of
    /// float4s (d % (128·split) == 0; else 1). Both kernels get the same block, so their sums
    /// agree bit for bit, split or not.
    fn norm_setup(&self, len: usize, weight: &[f32], out_len: usize) -> Option<(Arc<DevWeight>, LaunchConfig, i32)> {
        let d = weight.len();
        assert!(d > 0 && len % d == 0 && len == out_len, "rms_norm: x is not [n, d]");
        if len == 0 {
            return None;
        }
        let per_thread = if d % 4 == 0 { 4 } else { 1 };
        let threads = (d.div_ceil(per_thread).div_ceil(32) * 32).clamp(32, 1024) as u32;
        let s = self.norm_split.load(Ordering::Relaxed);
        let split = if len == d && d <= 4096 && d % (128 * s) == 0 {
            s
        } else {
            1
        };
        let cfg = LaunchConfig {
            grid_dim: (if split > 1 { split } else { len / d } as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        Some((self.param(weight), cfg, split as i32))
    }

    /// The RoPE angle table for rows `pos0 .. pos0 + n` (the position word when recording): the
    /// memo's when its key matches, else computed now by `rope_table` into the memo.
    fn rope_table_for<'m>(
        &self,
        memo: &'m mut Option<(RopeKey, Buf)>,
        n: usize,
        rope_dim: usize,
        pos0: usize,
        base: f32,
    ) -> &'m Buf {
        let capturing = self.capturing();
        let key = RopeKey {
            pos0: (!capturing).then_some(pos0),
            n,
            rope_dim,
            base: base.to_bits(),
        };
        if memo.as_ref().is_none_or(|(k, _)| *k != key) {
            let half = rope_dim / 2;
            let mut cs = self.new_buf(n * half * 2);
            let (n_i, dim, p) = (n as i32, rope_dim as i32, pos0 as i32);
            let mut b = self
                .stream
                .launch_builder(self.func(if capturing { "rope_table_dpos" } else { "rope_table" }));
            b.arg(dev_mut(&mut cs)).arg(&n_i).arg(&dim);
            if capturing {
                b.arg(&*self.pos_dev);
            } else {
                b.arg(&p);
            }
            b.arg(&base);
            // SAFETY: matches rope_table in kernels/ops.cu; cs holds n·half float2s.
            ok(unsafe { b.launch(Self::elementwise_cfg(n * half)) });
            *memo = Some((key, cs));
        }
        &memo.as_ref().expect("just set").1
    }

    /// RoPE on q and, when given, k (same rows and rope_dim) in one `rope_qk` launch.
    fn launch_rope(
        &self,
        q: &mut CudaSlice<f32>,
        ql: RopeLayout,
        k: Option<(&mut CudaSlice<f32>, RopeLayout)>,
        pos0: usize,
        base: f32,
        style: RopeStyle,
        append: Option<KvAppend<'_>>,
    ) {
        let q_width = ql.n_heads * ql.head_stride;
        let half = ql.rope_dim / 2;
        if q_width == 0 || half == 0 || q.is_empty() {
            return;
        }
        let n = q.len() / q_width;
        let kl = k.as_ref().map(|(_, l)| *l);
        if let Some(kl) = kl {
            assert_eq!(kl.rope_dim, ql.rope_dim, "rope_qk: q and k rotate the same dims");
        }
        let (kh, ks, ko) = kl.map_or((0, 0, 0), |l| (l.n_heads, l.head_stride, l.offset));
        let q_args = [ql.n_heads as i32, ql.head_stride as i32, ql.offset as i32];
        let k_args = [kh as i32, ks as i32, ko as i32];
        let (n_i, dim) = (n as i32, ql.rope_dim as i32);
        let st = match style {
            RopeStyle::Norm => 0i32,
            RopeStyle::Neox => 1,
        };
        let null = 0u64;
        let mut memo = self.rope_table.lock().expect("rope table");
        let cs = self.rope_table_for(&mut memo, n, ql.rope_dim, pos0, base);
        let mut b = self.stream.launch_builder(self.func("rope_qk"));
        b.arg(q);
        for a in &q_args {
            b.arg(a);
        }
        match k {
            Some((k, _)) => b.arg(k),
            // kh = 0: the kernel never reads k.
            None => b.arg(&null),
        };
        for a in &k_args {
            b.arg(a);
        }
        b.arg(&n_i).arg(&dim).arg(dev(cs)).arg(&st);
        let (vw, slot) = append.as_ref().map_or((0, 0), |a| (a.v_width as i32, a.slot as i32));
        let copies = append.as_ref().map_or(0, |a| n * (kh * ks + a.v_width));
        match append {
            Some(a) => {
                b.arg(a.kc).arg(a.v).arg(a.vc).arg(&vw).arg(&slot);
                match a.dpos {
                    true => b.arg(&*self.pos_dev),
                    false => b.arg(&null),
                }
            }
            // kc null: no copies, the rest unread.
            None => b.arg(&null).arg(&null).arg(&null).arg(&vw).arg(&slot).arg(&null),
        };
        let chunks = (ql.n_heads + kh).div_ceil(ROPE_HEADS);
        // SAFETY: matches rope_qk in kernels/ops.cu; one thread per (row, chunk of ROPE_HEADS
        // heads, pair), then (with a cache append) one per k and v value copied; q holds
        // n·q_width floats, k n·kh·ks, cs n·rope_dim/2 float2s; the caches were reserved for the
        // n rows at `slot` (or at the position word, within the recording's capacity).
        ok(unsafe { b.launch(Self::elementwise_cfg(n * chunks * half + copies)) });
    }

    /// Makes `cache` hold rows up to `pos0 + new_len / width` (growing it and keeping its first
    /// `pos0` rows), its length set to that and its limbs dropped. True when the append is being
    /// recorded for replay (no slot shift, whole rows): the caller's write must then take its row
    /// from the position word (`pos_dev`), and the recording's replayable rows shrink to fit.
    fn kv_reserve(&self, cache: &mut Buf, new_len: usize, width: usize, pos0: usize, slot0: usize) -> bool {
        let keep = pos0 * width;
        let total = keep + new_len;
        let cap = match &cache.repr {
            BufRepr::Dev(d) => d.data.len(),
            BufRepr::Host(v) => {
                assert!(v.is_empty(), "kv_write: a host cache");
                0
            }
        };
        if total > cap || cache.is_host() {
            let mut grown = self.new_buf(total.max(2 * cap).max(64 * width.max(1)));
            if keep > 0 {
                let kept = cache.len().min(keep);
                self.copy(cache, 0, &mut grown, 0, kept);
            }
            *cache = grown;
        }
        let capturing = self.capturing();
        if capturing && slot0 != pos0 {
            self.spoil("a shifted KV slot");
        }
        let BufRepr::Dev(d) = &mut cache.repr else {
            unreachable!("the cache is on the device here")
        };
        d.len = total;
        d.limbs = None;
        let dpos = capturing && slot0 == pos0 && width > 0 && new_len % width == 0;
        if dpos {
            self.limit_rows(d.data.len() / width + 1 - (new_len / width).max(1));
        }
        dpos
    }

    fn elementwise_cfg(len: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (len.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Uploads a small index array (routing, gathers).
    fn upload_i32(&self, v: &[i32]) -> CudaSlice<i32> {
        if v.is_empty() {
            return ok(self.stream.alloc_zeros::<i32>(1));
        }
        ok(self.stream.clone_htod(v))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn describe(&self) -> String {
        format!(
            "cuda: simulated ranks, all on one GPU ({}), one stream, device-resident activations and KV cache; fixed-order device-side all-reduce",
            self.device
        )
    }

    fn alloc(&self, len: usize) -> Buf {
        self.new_buf(len)
    }

    fn zeros(&self, len: usize) -> Buf {
        let mut b = self.new_buf(len);
        ok(self.stream.memset_zeros(dev_mut(&mut b)));
        b
    }

    fn parallel_ranks(&self) -> bool {
        false
    }

    fn upload(&self, data: &[f32]) -> Buf {
        let mut b = self.new_buf(data.len());
        if !data.is_empty() {
            ok(self
                .stream
                .memcpy_htod(data, &mut dev_mut(&mut b).slice_mut(..data.len())));
        }
        b
    }

    fn download(&self, b: &Buf) -> Vec<f32> {
        let mut out = Vec::new();
        self.download_into(b, &mut out);
        out
    }

    fn download_into(&self, b: &Buf, out: &mut Vec<f32>) {
        assert!(
            !self.capturing(),
            "cuda: a download while a decode graph is being recorded"
        );
        let len = b.len();
        out.clear();
        if len == 0 {
            return;
        }
        let src = dev(b).slice(..len);
        if len > STAGING_MAX {
            out.resize(len, 0.0);
            ok(self.stream.memcpy_dtoh(&src, &mut out[..]));
            ok(self.stream.synchronize());
            return;
        }
        let mut staging = self.staging.lock().expect("staging buffer");
        if staging.as_ref().is_none_or(|p| p.len() < len) {
            // SAFETY: only the first `len` values, just copied in, are read. Flags 0: cached
            // memory (write-combined memory is slow for the host to read).
            *staging = Some(ok(unsafe {
                self.ctx.alloc_pinned_with_flags::<f32>(len.next_power_of_two(), 0)
            }));
        }
        let pinned = staging.as_mut().expect("staging buffer");
        // A plain slice of the pinned memory: cudarc copies the destination's whole length, and
        // the driver sees the page-locked address either way.
        let dst = &mut ok(pinned.as_mut_slice())[..len];
        ok(self.stream.memcpy_dtoh(&src, dst));
        ok(self.stream.synchronize());
        out.extend_from_slice(dst);
    }

    fn fill(&self, b: &mut Buf, value: f32) {
        let len = b.len() as i64;
        if len == 0 {
            return;
        }
        let bits = value.to_bits();
        let mut lb = self.stream.launch_builder(self.func("fill_u32"));
        lb.arg(dev_mut(b)).arg(&bits).arg(&len);
        // SAFETY: matches fill_u32 in kernels/ops.cu; the buffer holds len values.
        ok(unsafe { lb.launch(Self::elementwise_cfg(len as usize)) });
    }

    fn copy(&self, src: &Buf, src_off: usize, dst: &mut Buf, dst_off: usize, len: usize) {
        if len == 0 {
            return;
        }
        assert!(
            src_off + len <= src.len() && dst_off + len <= dst.len(),
            "copy: out of range"
        );
        let sv = dev(src).slice(src_off..src_off + len);
        let mut dv = dev_mut(dst).slice_mut(dst_off..dst_off + len);
        ok(self.stream.memcpy_dtod(&sv, &mut dv));
    }

    fn copy_cols(&self, src: &Buf, src_width: usize, col0: usize, n_cols: usize, dst: &mut Buf) {
        let rows = src.len() / src_width.max(1);
        assert!(
            col0 + n_cols <= src_width && dst.len() == rows * n_cols,
            "copy_cols: bad shape"
        );
        if rows * n_cols == 0 {
            return;
        }
        let args = [rows as i32, src_width as i32, col0 as i32, n_cols as i32];
        let mut lb = self.stream.launch_builder(self.func("copy_cols"));
        lb.arg(dev(src)).arg(dev_mut(dst));
        for a in &args {
            lb.arg(a);
        }
        // SAFETY: matches copy_cols in kernels/ops.cu.
        ok(unsafe { lb.launch(Self::elementwise_cfg(rows * n_cols)) });
    }

    fn add_assign(&self, x: &mut Buf, a: &Buf, f16_round: bool) {
        assert_eq!(x.len(), a.len(), "add_assign: lengths differ");
        let len = x.len() as i64;
        if len == 0 {
            return;
        }
        let f = f16_round as i32;
        let mut lb = self.stream.launch_builder(self.func("add_assign"));
        lb.arg(dev_mut(x)).arg(dev(a)).arg(&len).arg(&f);
        // SAFETY: matches add_assign in kernels/ops.cu.
        ok(unsafe { lb.launch(Self::elementwise_cfg(len as usize)) });
    }

    fn gather_rows(&self, x: &Buf, width: usize, rows: &[usize]) -> Buf {
        let mut out = self.new_buf(rows.len() * width);
        if rows.is_empty() || width == 0 {
            return out;
        }
        let ids: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idd = self.upload_i32(&ids);
        let (n, w) = (rows.len() as i32, width as i32);
        let mut lb = self.stream.launch_builder(self.func("gather_rows_f32"));
        lb.arg(dev(x)).arg(&idd).arg(dev_mut(&mut out)).arg(&n).arg(&w);
        // SAFETY: matches gather_rows_f32 in kernels/ops.cu; ids index rows of x.
        ok(unsafe { lb.launch(Self::elementwise_cfg(rows.len() * width)) });
        out
    }

    fn add_rows_scaled(&self, out: &mut Buf, y: &Buf, width: usize, rows: &[usize], weights: &[f32]) {
        if rows.is_empty() || width == 0 {
            return;
        }
        let ids: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idd = self.upload_i32(&ids);
        let wd = ok(self.stream.clone_htod(weights));
        let (n, w) = (rows.len() as i32, width as i32);
        let mut lb = self.stream.launch_builder(self.func("add_rows_scaled"));
        lb.arg(dev_mut(out)).arg(dev(y)).arg(&idd).arg(&wd).arg(&n).arg(&w);
        // SAFETY: matches add_rows_scaled in kernels/ops.cu.
        ok(unsafe { lb.launch(Self::elementwise_cfg(width)) });
    }

    fn kv_write(&self, cache: &mut Buf, new: &Buf, width: usize, pos0: usize, slot0: usize) {
        let (keep, total) = (pos0 * width, pos0 * width + new.len());
        if self.kv_reserve(cache, new.len(), width, pos0, slot0) {
            let (len, w) = (new.len() as i64, width as i32);
            let mut b = self.stream.launch_builder(self.func("kv_append_dpos"));
            b.arg(dev_mut(cache))
                .arg(dev(new))
                .arg(&len)
                .arg(&w)
                .arg(&*self.pos_dev);
            // SAFETY: matches kv_append_dpos in kernels/ops.cu; rows up to the recorded capacity.
            ok(unsafe { b.launch(Self::elementwise_cfg(new.len())) });
            return;
        }
        if slot0 != pos0 && total > keep {
            // Rows nothing writes (the new token's own slot under an off-by-one mapping) are zero.
            ok(self.stream.memset_zeros(&mut dev_mut(cache).slice_mut(keep..total)));
        }
        self.copy(new, 0, cache, slot0 * width, new.len());
    }

    fn rope_qk_cache(&self, q: &mut Buf, k: &mut Buf, v: &Buf, v_width: usize, rope: QkRope, caches: [&mut Buf; 2]) {
        let [kc, vc] = caches;
        let k_width = rope.k.n_heads * rope.k.head_stride;
        let n = k.len() / k_width.max(1);
        let fits = n > 0
            && rope.q.rope_dim > 0
            && k_width > 0
            && v_width > 0
            && k.len() == n * k_width
            && v.len() == n * v_width
            && q.len() == n * rope.q.n_heads * rope.q.head_stride;
        if !fits {
            return crate::backend::rope_qk_then_append(self, q, k, v, v_width, rope, [kc, vc]);
        }
        let dpos = self.kv_reserve(kc, k.len(), k_width, rope.pos0, rope.pos0);
        self.kv_reserve(vc, v.len(), v_width, rope.pos0, rope.pos0);
        let append = KvAppend {
            kc: dev_mut(kc),
            v: dev(v),
            vc: dev_mut(vc),
            v_width,
            slot: rope.pos0,
            dpos,
        };
        let (q, k) = (dev_mut(q), Some((dev_mut(k), rope.k)));
        self.launch_rope(q, rope.q, k, rope.pos0, rope.base, rope.style, Some(append))
    }

    fn linear_qkv_rope(
        &self,
        x: &Buf,
        n: usize,
        ws: [WeightRef<'_>; 3],
        outs: [&mut Buf; 3],
        rope: QkRope,
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
            let cs = self.rope_table_for(&mut memo, 1, dim, rope.pos0, rope.base);
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

    fn linear(&self, x: &Buf, n: usize, w: WeightRef<'_>, out: &mut Buf) {
        self.linear_with(x, n, w, out, None)
    }

    fn linear_many(&self, x: &Buf, n: usize, ws: &[WeightRef<'_>], outs: &mut [&mut Buf]) {
        self.linear_many_with(x, n, ws, outs, None, None)
    }

    fn rms_norm(&self, x: &Buf, weight: &[f32], eps: f32, out: &mut Buf) {
        let Some((wd, cfg, split)) = self.norm_setup(x.len(), weight, out.len()) else {
            return;
        };
        let q = self.limbs_out(x.len(), weight.len());
        let mut a = RawArgs::default();
        a.buf(dev(x))
            .buf(&wd.data)
            .buf(dev_mut(out))
            .i32(weight.len() as i32)
            .f32(eps);
        a.opt_buf(q.as_ref().map(dev)).i32(split);
        // SAFETY: matches rms_norm in kernels/ops.cu (which waits first): x and out [n, d], weight
        // d; xq (one row of d % 128 == 0, see limbs_out) limbs_words(d) words, or null; split > 1
        // only for one row with d % (128·split) == 0, with that many blocks (norm_setup).
        unsafe { self.launch_chained("rms_norm", cfg, &mut a) };
        attach_limbs(out, q);
    }

    fn add_rms_norm(&self, x: &mut Buf, a: &Buf, f16_round: bool, weight: &[f32], eps: f32, out: &mut Buf) {
        assert_eq!(x.len(), a.len(), "add_rms_norm: lengths differ");
        let Some((wd, cfg, split)) = self.norm_setup(x.len(), weight, out.len()) else {
            return;
        };
        let q = self.limbs_out(x.len(), weight.len());
        let mut r = RawArgs::default();
        r.buf(dev_mut(x)).buf(dev(a)).buf(&wd.data).buf(dev_mut(out));
        r.i32(weight.len() as i32)
            .f32(eps)
            .i32(f16_round as i32)
            .opt_buf(q.as_ref().map(dev))
            .i32(split)
            .buf(&*self.norm_arrive);
        // SAFETY: matches add_rms_norm in kernels/ops.cu (which waits first): x, a and out [n, d],
        // weight d; xq and split as in rms_norm; `arrive` is this device's one u32, which every
        // split launch leaves at 0 (launches on the one stream, so never two at once).
        unsafe { self.launch_chained("add_rms_norm", cfg, &mut r) };
        attach_limbs(out, q);
    }

    fn rope(&self, x: &mut Buf, layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle) {
        self.launch_rope(dev_mut(x), layout, None, pos0, base, style, None)
    }

    fn rope_qk(
        &self,
        q: &mut Buf,
        q_layout: RopeLayout,
        k: &mut Buf,
        k_layout: RopeLayout,
        pos0: usize,
        base: f32,
        style: RopeStyle,
    ) {
        self.launch_rope(
            dev_mut(q),
            q_layout,
            Some((dev_mut(k), k_layout)),
            pos0,
            base,
            style,
            None,
        )
    }

    fn moe_route(&self, logits: &Buf, n_exp: usize, m: &MoeConfig, bias: Option<&[f32]>, scale: f32) -> Vec<Route> {
        let n = logits.len() / n_exp.max(1);
        let grouped = m.n_groups > 1 && m.n_groups_used < m.n_groups;
        // The kernel's limits (a lane per group, k in shared memory); beyond them, the host.
        if n == 0 || m.n_used > 64 || (grouped && m.n_groups > 32) {
            return route(&self.download(logits), n_exp, m, bias, scale);
        }
        let k = m.n_used;
        let scratch = self.new_buf(n * 2 * n_exp);
        let mut ids = ok(self.stream.alloc_zeros::<i32>(n * k));
        let mut wts = self.new_buf(n * k);
        let bias_buf = bias.map(|b| self.upload(b));
        let null = 0u64;
        let args = [
            n_exp as i32,
            k as i32,
            matches!(m.gating, Gating::Softmax) as i32,
            m.n_groups as i32,
            m.n_groups_used as i32,
            m.weights_norm as i32,
        ];
        let mut b = self.stream.launch_builder(self.func("moe_route"));
        b.arg(dev(logits));
        match &bias_buf {
            Some(bb) => b.arg(dev(bb)),
            None => b.arg(&null),
        };
        b.arg(dev(&scratch)).arg(&mut ids).arg(dev_mut(&mut wts));
        for a in &args {
            b.arg(a);
        }
        b.arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches moe_route in kernels/ops.cu: logits n·n_exp, bias n_exp (or null),
        // scratch 2·n·n_exp, ids and wts n·k; k ≤ 64, n_groups ≤ 32 when grouped.
        ok(unsafe { b.launch(cfg) });
        let ids = ok(self.stream.clone_dtoh(&ids));
        let wts = self.download(&wts);
        ids.chunks_exact(k)
            .zip(wts.chunks_exact(k))
            .map(|(e, w)| Route {
                experts: e.iter().map(|&x| x as usize).collect(),
                weights: w.to_vec(),
            })
            .collect()
    }

    fn swiglu(&self, gate: &mut Buf, up: &Buf) {
        if gate.is_empty() {
            return;
        }
        // A one-token row (the widest FFN the presets use is well under 2^16 values; a prefill's
        // [n, ffn] is wider or small): the same products and the row's limbs in one launch.
        if gate.len() < 1 << 16 {
            if let Some(q) = self.limbs_out(gate.len(), gate.len()) {
                let mut a = RawArgs::default();
                a.buf(dev_mut(gate)).buf(dev(up)).i32(gate.len() as i32).buf(dev(&q));
                // SAFETY: matches swiglu_limbs in kernels/ops.cu (which waits first): gate and up
                // len floats (len % 128 == 0, see limbs_out), xq limbs_words(len) words.
                unsafe { self.launch_chained("swiglu_limbs", Self::elementwise_cfg(gate.len() / 4), &mut a) };
                attach_limbs(gate, Some(q));
                return;
            }
        }
        let len = gate.len() as i64;
        let mut b = self.stream.launch_builder(self.func("swiglu"));
        b.arg(dev_mut(gate)).arg(dev(up)).arg(&len);
        // SAFETY: matches swiglu in kernels/ops.cu.
        ok(unsafe { b.launch(Self::elementwise_cfg(len as usize)) });
    }

    fn gqa_attention(&self, q: &Buf, k: &Buf, v: &Buf, pos0: usize, shape: GqaShape, out: &mut Buf) {
        let slots = out.len() / shape.head_dim.max(1);
        if slots == 0 {
            return;
        }
        let n = slots / shape.n_heads;
        let capturing = self.capturing();
        // Prefill: the tiled kernel (cuda_attn.rs), unless recording or disabled.
        if !capturing {
            if let Some(entry) = self.attn_tiled_entry(n, shape) {
                self.launch_gqa_tiled(entry, dev(q), dev(k), dev(v), dev_mut(out), n, pos0, shape);
                return;
            }
        }
        // Decode: the split kernel (cuda_attn.rs; recorded too), unless disabled.
        if n == 1 && self.gqa_split(q, k, v, pos0, shape, out) {
            return;
        }
        let threads = attn_threads(slots, self.sms);
        let args = [
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
        ];
        // Recorded for replay, the scores' shared memory covers every row the caches can hold
        // (up to the default limit): the position comes from the position word.
        let mut rows = pos0;
        if capturing {
            let kvw = (shape.n_kv_heads * shape.head_dim).max(1);
            let cap = dev(k).len().min(dev(v).len()) / kvw;
            let fixed = shape.head_dim + n + attn_part(shape.head_dim, threads);
            rows = cap.min((SMEM_DEFAULT_MAX / 4).saturating_sub(fixed));
            if rows < pos0 {
                self.spoil("attention shared memory");
                rows = pos0;
            }
            self.limit_rows(rows + 1 - n.max(1).min(rows + 1));
        }
        let mut b = self.stream.launch_builder(self.func(if capturing {
            "gqa_attention_dpos"
        } else {
            "gqa_attention"
        }));
        // The caller's buffer, canary and all: an element the kernel skips keeps what it held.
        b.arg(dev(q)).arg(dev(k)).arg(dev(v)).arg(dev_mut(out));
        if capturing {
            b.arg(&*self.pos_dev);
        } else {
            b.arg(&args[0]);
        }
        for a in &args[1..] {
            b.arg(a);
        }
        b.arg(&shape.scale);
        let cfg = LaunchConfig {
            grid_dim: (slots as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: ((shape.head_dim + rows + n + attn_part(shape.head_dim, threads)) * 4) as u32,
        };
        // SAFETY: matches gqa_attention in kernels/attention.cu; the caches hold pos0 + n rows.
        ok(unsafe { b.launch(cfg) });
    }

    fn mla_attention(&self, q: &Buf, k_nope: &Buf, k_pe: &Buf, v: &Buf, pos0: usize, shape: MlaShape, out: &mut Buf) {
        let slots = out.len() / shape.v_dim.max(1);
        if slots == 0 {
            return;
        }
        let n = slots / shape.n_heads;
        let threads = attn_threads(slots, self.sms);
        let args = [
            pos0 as i32,
            shape.n_heads as i32,
            shape.nope as i32,
            shape.rope as i32,
            shape.v_dim as i32,
        ];
        // No device-position form: a recording of it cannot be replayed.
        self.spoil("MLA attention");
        let mut b = self.stream.launch_builder(self.func("mla_attention"));
        b.arg(dev(q))
            .arg(dev(k_nope))
            .arg(dev(k_pe))
            .arg(dev(v))
            .arg(dev_mut(out));
        for a in &args {
            b.arg(a);
        }
        b.arg(&shape.scale);
        let cfg = LaunchConfig {
            grid_dim: (slots as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: ((shape.nope + shape.rope + pos0 + n + attn_part(shape.v_dim, threads)) * 4) as u32,
        };
        // SAFETY: matches mla_attention in kernels/attention.cu.
        ok(unsafe { b.launch(cfg) });
    }

    fn all_reduce(&self, partials: &[&Buf]) -> Vec<Buf> {
        let t0 = std::time::Instant::now();
        // Fixed order, as on the CPU: ((p0 + p1) + p2) + ...
        let mut sum = self.dup(partials[0]);
        for p in &partials[1..] {
            self.add_assign(&mut sum, p, false);
        }
        self.clock.add(t0.elapsed(), std::time::Duration::ZERO);
        vec![sum]
    }

    fn comm_stats(&self) -> Option<CommStats> {
        Some(self.clock.read())
    }

    fn reset_comm_stats(&self) {
        self.clock.reset()
    }

    fn kernel_trace_reset(&self) -> bool {
        // Stream-ordered: the work before it writes its records first.
        let Some(t) = &self.trace else { return false };
        t.lock().expect("trace").reset(&self.stream).is_ok()
    }

    fn kernel_trace_take(&self) -> Option<(Vec<BlockTrace>, usize)> {
        let t = self.trace.as_ref()?.lock().expect("trace");
        Some(t.take(&self.stream).unwrap_or_else(|e| panic!("{e}")))
    }

    fn graph_begin(&self, pos0: usize, token: u32) -> bool {
        if !self.graphs_on {
            return false;
        }
        // The step before this one was downloaded (synchronized): nothing reads the words now.
        self.step_words.set(pos0, token);
        let words_dst = self.pos_ptr();
        // The recording computes its own angle table (at the replayed position).
        *self.rope_table.lock().expect("rope table") = None;
        let mut c = self.capture.lock().expect("capture state");
        assert!(!c.active, "cuda: graph_begin while recording");
        ok(self
            .stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
        *c = CaptureState {
            active: true,
            spoiled: None,
            max_rows: usize::MAX,
        };
        // The step's first node: its position and token, as each replay sets them.
        self.step_words.copy_to(&self.stream, words_dst);
        true
    }

    fn graph_end(&self) -> Option<Box<dyn crate::backend::StepGraph>> {
        let state = std::mem::take(&mut *self.capture.lock().expect("capture state"));
        assert!(state.active, "cuda: graph_end without graph_begin");
        let graph = ok(self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)))?;
        // The recorded work is this step's: run it once.
        ok(graph.launch());
        if state.spoiled.is_some() || state.max_rows == usize::MAX {
            return None;
        }
        Some(Box::new(CudaStepGraph {
            graph,
            words: self.step_words.clone(),
            _pos_dev: self.pos_dev.clone(),
            max_rows: state.max_rows,
        }))
    }

    fn embed_rows(&self, w: WeightRef<'_>, rows: &[Option<usize>], out: &mut Buf) {
        let cols = w.cols();
        if rows.is_empty() || cols == 0 {
            return;
        }
        assert_eq!(out.len(), rows.len() * cols, "embed_rows: out is not [n, cols]");
        let ids: Vec<i32> = rows.iter().map(|r| r.map_or(-1, |r| r as i32)).collect();
        let idd = self.upload_i32(&ids);
        self.launch_gather(w, &idd.slice(..), rows.len(), 0, out);
    }

    /// The token is read from device memory (`pos_dev[1]`), so a recorded decode step gathers the
    /// token of each replay: set here when running op by op; a recorded step's first node copies
    /// it (with the position) from `step_words`, which `graph_begin` and each replay set.
    fn embed_token(&self, w: WeightRef<'_>, token: u32, vocab_start: usize, out: &mut Buf) {
        if w.cols() == 0 {
            return;
        }
        assert_eq!(out.len(), w.cols(), "embed_token: out is not [1, cols]");
        let tok = self.pos_dev.slice(1..2);
        if !self.capturing() {
            let t = token as i32;
            let mut b = self.stream.launch_builder(self.func("set_i32"));
            b.arg(&tok).arg(&t);
            // SAFETY: matches set_i32 in kernels/ops.cu; the view is one int.
            ok(unsafe { b.launch(LaunchConfig::for_num_elems(1)) });
        }
        self.launch_gather(w, &tok, 1, vocab_start, out);
    }
}

impl CudaBackend {
    /// Launches `gather_<type>` (kernels/quant.cu): the rows `ids[t] - start` of `w` (zeros where
    /// that is not one of its rows) into `out[t]`, t < n.
    fn launch_gather(
        &self,
        w: WeightRef<'_>,
        ids: &cudarc::driver::CudaView<'_, i32>,
        n: usize,
        start: usize,
        out: &mut Buf,
    ) {
        let dw = self.weight(w, &self.stream);
        let (nn, c, rb) = (n as i32, w.cols() as i32, dw.row_bytes as i32);
        // Starts and row counts past i32 cannot occur (vocab sizes are checked on load); saturate.
        let (st, nr) = (
            start.min(i32::MAX as usize) as i32,
            w.rows().min(i32::MAX as usize) as i32,
        );
        let mut b = self.stream.launch_builder(self.func(&format!("gather_{}", dw.suffix)));
        b.arg(&dw.data)
            .arg(ids)
            .arg(dev_mut(out))
            .arg(&nn)
            .arg(&c)
            .arg(&rb)
            .arg(&st)
            .arg(&nr);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gather_* in kernels/quant.cu: W holds rows() rows of row_bytes, ids n
        // ints, out n·cols floats.
        ok(unsafe { b.launch(cfg) });
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

/// [`compare`] for outputs that should hold NaN or inf: passes when `gpu` is non-finite exactly
/// where `cpu` is (and `cpu` somewhere is) and the finite rest agrees within `tol`.
fn compare_nonfinite(case: String, gpu: &[f32], cpu: &[f32], tol: f64) -> KernelCheck {
    let same = gpu.len() == cpu.len() && gpu.iter().zip(cpu).all(|(a, b)| a.is_finite() == b.is_finite());
    let (g, c): (Vec<f32>, Vec<f32>) = gpu
        .iter()
        .zip(cpu)
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .map(|(a, b)| (*a, *b))
        .unzip();
    let r = compare(case, &g, &c, tol);
    KernelCheck {
        pass: r.pass && same && cpu.iter().any(|v| !v.is_finite()),
        ..r
    }
}

/// Deterministic values in [-1, 1).
/// Test weights for the checks: noise of `[rows, cols]` quantized to `ty` (the bytes a
/// [`test_weight`] borrows).
fn test_bytes(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    references::quant::quantize(ty, &noise(rows * cols, seed)).expect("quantize test weights")
}

/// A quantized `[rows, cols]` weight over `bytes` (from [`test_bytes`]).
fn test_weight(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> WeightRef<'_> {
    WeightRef::Quant(QMat {
        ty,
        bytes,
        rows,
        cols,
        row_bytes: bytes.len() / rows,
    })
}

/// Noise of `cols` values scaled as `kind` says: `x1e4`, `x1e-30`, or `mixed` (×1e4, 1, 1e-30, 0
/// and 1e-3 in turn, so a block of 32 holds very different magnitudes); else plain noise.
fn scaled_test_x(kind: &str, cols: usize, seed: u64) -> Vec<f32> {
    let x = noise(cols, seed);
    match kind {
        "x1e4" => x.iter().map(|v| v * 1e4).collect(),
        "x1e-30" => x.iter().map(|v| v * 1e-30).collect(),
        "mixed" => x
            .iter()
            .enumerate()
            .map(|(i, v)| v * [1e4f32, 1.0, 1e-30, 0.0, 1e-3][i % 5])
            .collect(),
        _ => x,
    }
}

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
    /// One-row norms split over S blocks (`rms_norm_one` in kernels/ops.cu) against the unsplit
    /// launch, bit for bit: the add form's x, the normed row and its limbs (the integer GEMV's
    /// x), for S = 2 .. 32 and a width S does not divide into whole warps (which runs unsplit).
    /// Each split launch also must leave the arrival count at 0 for the next, so a later case
    /// would fail if one did not.
    fn check_norm_split(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let was = self.norm_split.load(Ordering::Relaxed);
        // x after the add (or as given), the normed row, and its limbs as bits (words that are
        // not floats).
        let run = |split: usize, add: Option<bool>, x: &[f32], a: &[f32], w: &[f32]| {
            self.norm_split.store(split, Ordering::Relaxed);
            let (mut xb, mut o) = (self.upload(x), self.alloc(x.len()));
            match add {
                Some(f16) => self.add_rms_norm(&mut xb, &self.upload(a), f16, w, 1e-5, &mut o),
                None => self.rms_norm(&xb, w, 1e-5, &mut o),
            }
            let limbs = limbs_of(&o, x.len()).map(|q| {
                let words = self.stream.clone_dtoh(q).expect("download limbs");
                words.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            });
            ([self.download(&xb), self.download(&o)].concat(), limbs)
        };
        for (d, add) in [
            (4096usize, Some(false)),
            (4096, Some(true)),
            (4096, None),
            (2048, Some(false)),
            (3072, Some(false)),
        ] {
            let (x, a, w) = (noise(d, 23), noise(d, 24), noise(d, 25));
            let (one, one_limbs) = run(1, add, &x, &a, &w);
            for split in [2usize, 4, 8, 16, 32] {
                let (got, limbs) = run(split, add, &x, &a, &w);
                let form = add.map_or("RMS_NORM".to_string(), |f| format!("ADD_RMS_NORM(f16={f})"));
                let c = compare(format!("{form}_SPLIT(ne=[{d},1],split={split})"), &got, &one, 0.0);
                out.push(KernelCheck {
                    pass: c.pass && limbs == one_limbs,
                    ..c
                });
            }
        }
        self.norm_split.store(was, Ordering::Relaxed);
        out
    }
}

/// Runs `f` (which uploads its inputs, runs ops and downloads a result) on the GPU and the CPU.
fn both(gpu: &dyn Backend, f: impl Fn(&dyn Backend) -> Vec<f32>) -> (Vec<f32>, Vec<f32>) {
    (f(gpu), f(&CpuBackend))
}

impl CudaBackend {
    /// Runs every kernel against the CPU engine's on odd shapes (the fast/slow pairs of the
    /// CUDA backend): matmul/matvec and gather for every GPU weight type, RMSNorm, RoPE NORM and
    /// NEOX, SwiGLU, GQA and MLA attention in prefill and decode (GQA prefill in both kernels:
    /// per (token, head) and tiled, `ATTN_GQA_TILED` cases), the all-reduce, and the data
    /// movement ops (fill, column copy, residual add with and without f16 rounding, KV-cache
    /// writes, row gather and scaled scatter-add).
    pub fn self_check(&self) -> Vec<KernelCheck> {
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
                let (g, c) = both(self, |be| {
                    let mut o = be.alloc(n * rows);
                    be.linear(&be.upload(&x), n, w, &mut o);
                    be.download(&o)
                });
                let name = type_suffix(ty).unwrap_or("?");
                out.push(compare(
                    format!("MUL_MAT(type={name},ne=[{cols},{rows}],n={n})"),
                    &g,
                    &c,
                    1e-5,
                ));
            }
            let ids = [Some(3), None, Some(36), Some(0), None];
            let (g, c) = both(self, |be| {
                let mut o = be.upload(&vec![1f32; ids.len() * cols]);
                be.embed_rows(w, &ids, &mut o);
                be.download(&o)
            });
            out.push(compare(
                format!(
                    "GET_ROWS(type={},ne=[{cols},{rows}],n=5)",
                    type_suffix(ty).unwrap_or("?")
                ),
                &g,
                &c,
                0.0,
            ));
            // A decode step's gather (the token read from device memory) of a shard starting at
            // token 5: rows 3 and 0, and tokens below and past the shard (zeros).
            let (g, c) = both(self, |be| {
                let mut all = Vec::new();
                for token in [8, 4, 5 + rows as u32, 5] {
                    let mut o = be.upload(&vec![1f32; cols]);
                    be.embed_token(w, token, 5, &mut o);
                    all.extend(be.download(&o));
                }
                all
            });
            out.push(compare(
                format!(
                    "GET_ROWS(type={},ne=[{cols},{rows}],token from the device,shard at 5)",
                    type_suffix(ty).unwrap_or("?")
                ),
                &g,
                &c,
                0.0,
            ));
            // The test bytes die here; a later type's may reuse their address and length.
            self.weights.lock().expect("weight map").clear();
        }
        // Every compiled x-stationary GEMV variant, on shapes whose rows end in a partial warp of
        // units and whose row count is not a multiple of R.
        for ty in [
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_1,
            GgmlType::Q4K,
        ] {
            let cols = match ty {
                GgmlType::Q8_0 => 768,
                // 19 pairs of blocks: 76 units, a partial second warp.
                GgmlType::Q4_1 => 1216,
                GgmlType::Q4K => 1280,
                _ => 1032,
            };
            let bytes = test_bytes(ty, rows, cols, 40 + ty as u64);
            let w = test_weight(ty, &bytes, rows, cols);
            let x = noise(cols, 41);
            let mut c = CpuBackend.alloc(rows);
            CpuBackend.linear(&Buf::host(x.clone()), 1, w, &mut c);
            let c = c.as_host().to_vec();
            let xd = self.upload(&x);
            for v in GEMV_VARIANTS.iter().filter(|v| v.ty == ty && v.kind == GemvKind::Xs) {
                let mut g = self.upload(&vec![f32::NAN; rows]);
                self.linear_with(&xd, 1, w, &mut g, Some(*v));
                out.push(compare(
                    format!(
                        "GEMV(type={},ne=[{cols},{rows}],variant={})",
                        type_suffix(ty).unwrap_or("?"),
                        v.entry()
                    ),
                    &self.download(&g),
                    &c,
                    1e-5,
                ));
            }
            self.weights.lock().expect("weight map").clear();
        }
        // Every warp-rows GEMV variant, x in shared memory or not, and every tensor-core one (and
        // the default selection), on shapes that end in a
        // partial chunk of 32 units, a partial last step of NW·32·U units, chunks wholly past the
        // end (skipped), rows not a multiple of R and fewer rows than R; Q4_K from 1 to 70
        // super-blocks per row, Q4_1 with even block counts (smollm2's widths among them).
        let wr_shapes: [(GgmlType, &[(usize, usize)]); 6] = [
            // Units: 8 (one partial chunk), 40, 152, 456, 560 (two steps at NW 4, U 4); pair units
            // (mode 3): 4, 20, 76, 228, 280 (3 to 9 chunks: two steps at NW 7, four at NW 2).
            (
                GgmlType::Q4K,
                &[(256, 37), (1280, 37), (4864, 37), (14592, 3), (17920, 37)],
            ),
            // Units: 4, 36, 96, 76, 524 (a partial chunk after 512).
            (
                GgmlType::Q4_1,
                &[(64, 37), (576, 37), (1536, 7), (1216, 37), (8384, 37)],
            ),
            // Units: 16, 48, 272.
            (GgmlType::Q8_0, &[(256, 37), (768, 3), (4352, 37)]),
            // Units: 1, 129, 257.
            (GgmlType::F16, &[(8, 37), (1032, 37), (2056, 3)]),
            (GgmlType::BF16, &[(8, 5), (1032, 37), (2056, 37)]),
            // Units: 64, 128, 448 (3.5 steps at NW 4, U 1): rows of a multiple of 8 super-blocks.
            (GgmlType::Q6K, &[(2048, 37), (4096, 3), (14336, 37)]),
        ];
        for (ty, shapes) in wr_shapes {
            for &(cols, rows) in shapes {
                let bytes = test_bytes(ty, rows, cols, 50 + ty as u64 + cols as u64);
                let w = test_weight(ty, &bytes, rows, cols);
                let x = noise(cols, 51 + cols as u64);
                let mut c = CpuBackend.alloc(rows);
                CpuBackend.linear(&Buf::host(x.clone()), 1, w, &mut c);
                let c = c.as_host().to_vec();
                let xd = self.upload(&x);
                let name = type_suffix(ty).unwrap_or("?");
                let wr = GEMV_VARIANTS
                    .iter()
                    .filter(|v| v.ty == ty && v.kind != GemvKind::Xs && self.gemv_fits(**v, cols))
                    .map(|v| (Some(*v), v.entry()));
                let default = (
                    None,
                    format!(
                        "default={}",
                        self.gemv_default(ty, rows, cols).map_or("matvec".into(), |v| v.entry())
                    ),
                );
                for (v, label) in wr.chain([default]) {
                    let mut g = self.upload(&vec![f32::NAN; rows]);
                    self.linear_with(&xd, 1, w, &mut g, v);
                    out.push(compare(
                        format!("GEMV(type={name},ne=[{cols},{rows}],variant={label})"),
                        &self.download(&g),
                        &c,
                        1e-5,
                    ));
                }
                self.weights.lock().expect("weight map").clear();
            }
        }
        // The integer form (modes 2 and 3) on x of very different magnitudes (×1e4, ×1e-30, and
        // mixed within a block of 32 with zeros: the limbs carry each x to 2^-22 of its block's
        // max), and on x with a NaN or an inf: the output is non-finite exactly where the CPU
        // engine's is. (Not below ~5e-32: there a block's scale is subnormal, see quant.cu.)
        for (ty, cols, rows) in [
            (GgmlType::Q4K, 1280, 37),
            (GgmlType::Q4_1, 1216, 37),
            (GgmlType::Q8_0, 768, 37),
            (GgmlType::Q6K, 2048, 37),
        ] {
            let bytes = test_bytes(ty, rows, cols, 70 + ty as u64);
            let w = test_weight(ty, &bytes, rows, cols);
            let name = type_suffix(ty).unwrap_or("?");
            for kind in ["x1e4", "x1e-30", "mixed", "nan", "inf"] {
                let mut x = scaled_test_x(kind, cols, 71);
                match kind {
                    "nan" => x[cols / 2] = f32::NAN,
                    "inf" => x[cols / 3] = f32::INFINITY,
                    _ => {}
                }
                let mut c = CpuBackend.alloc(rows);
                CpuBackend.linear(&Buf::host(x.clone()), 1, w, &mut c);
                let c = c.as_host().to_vec();
                let xd = self.upload(&x);
                for v in GEMV_VARIANTS
                    .iter()
                    .filter(|v| v.ty == ty && v.takes_limbs() && self.gemv_fits(**v, cols))
                {
                    let mut g = self.upload(&vec![0.0; rows]);
                    self.linear_with(&xd, 1, w, &mut g, Some(*v));
                    let g = self.download(&g);
                    let case = format!("GEMV(type={name},ne=[{cols},{rows}],x={kind},variant={})", v.entry());
                    out.push(if kind == "nan" || kind == "inf" {
                        let same = g.len() == c.len() && g.iter().zip(&c).all(|(a, b)| a.is_finite() == b.is_finite());
                        KernelCheck {
                            pass: same && c.iter().any(|v| !v.is_finite()),
                            ..compare(case, &[], &[], 0.0)
                        }
                    } else {
                        compare(case, &g, &c, 1e-5)
                    });
                }
            }
            self.weights.lock().expect("weight map").clear();
        }
        // The limbs a decode row's RMSNorm, add+RMSNorm, SwiGLU or GQA attention (the split kernel,
        // 32/8 heads of 128 over 300 positions) writes beside it (DevBuf::limbs): the GEMV that
        // reads them (the default, and the pair units' R 4 variant) gives bit for bit what it gives
        // after its own pre-pass, and a later write to the row (an add) drops them, so the next
        // GEMV sees the new values.
        let pair = GEMV_VARIANTS
            .iter()
            .copied()
            .find(|v| v.mode == 3 && v.r == 4 && v.nw == pair_nw(4096));
        for force in [None, pair] {
            let (ty, d, rows) = (GgmlType::Q4K, 4096, 37);
            let bytes = test_bytes(ty, rows, d, 90);
            let w = test_weight(ty, &bytes, rows, d);
            let (x, a, wn) = (noise(d, 91), noise(d, 92), noise(d, 93));
            let expect = self.limbs_out(d, d).is_some();
            let gemv = |b: &Buf| {
                let mut o = self.alloc(rows);
                self.linear_with(b, 1, w, &mut o, force);
                self.download(&o)
            };
            let attn_shape = GqaShape {
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: d / 32,
                scale: 1.0 / ((d / 32) as f32).sqrt(),
            };
            let ctx = 300;
            let (kc, vc) = (noise(ctx * d / 4, 94), noise(ctx * d / 4, 95));
            let label = force.map_or(String::new(), |v| format!(",variant={}", v.entry()));
            for producer in ["rms_norm", "add_rms_norm", "swiglu", "gqa_attention"] {
                let expect = expect && (producer != "gqa_attention" || self.attn_split_plan(attn_shape).is_some());
                let mut row = self.alloc(d);
                match producer {
                    "gqa_attention" => {
                        let (kd, vd) = (self.upload(&kc), self.upload(&vc));
                        self.gqa_attention(&self.upload(&x), &kd, &vd, ctx - 1, attn_shape, &mut row)
                    }
                    "rms_norm" => self.rms_norm(&self.upload(&x), &wn, 1e-5, &mut row),
                    "add_rms_norm" => {
                        self.add_rms_norm(&mut self.upload(&x), &self.upload(&a), false, &wn, 1e-5, &mut row)
                    }
                    _ => {
                        row = self.upload(&x);
                        self.swiglu(&mut row, &self.upload(&a));
                    }
                }
                let had = limbs_of(&row, d).is_some();
                let (g1, g2) = (gemv(&row), gemv(&self.upload(&self.download(&row))));
                self.add_assign(&mut row, &self.upload(&a), false);
                let dropped = limbs_of(&row, d).is_none();
                let (g3, g4) = (gemv(&row), gemv(&self.upload(&self.download(&row))));
                let same = |p: &[f32], q: &[f32]| p.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits());
                out.push(KernelCheck {
                    pass: had == expect && dropped && same(&g1, &g2) && same(&g3, &g4),
                    ..compare(
                        format!("GEMV_LIMBS(producer={producer},type=q4_k,ne=[{d},{rows}],fused={had}{label})"),
                        &g1,
                        &g2,
                        0.0,
                    )
                });
            }
            self.weights.lock().expect("weight map").clear();
        }
        // Q4_1 with an odd number of blocks per row (no GEMV: the warp-per-row matvec on the
        // repacked layout), one token.
        {
            let (ty, cols) = (GgmlType::Q4_1, 352);
            let bytes = test_bytes(ty, rows, cols, 42);
            let w = test_weight(ty, &bytes, rows, cols);
            let x = noise(cols, 43);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(rows);
                be.linear(&be.upload(&x), 1, w, &mut o);
                be.download(&o)
            });
            out.push(compare(
                format!("MUL_MAT(type=q4_1,ne=[{cols},{rows}],n=1,path=matvec)"),
                &g,
                &c,
                1e-5,
            ));
            self.weights.lock().expect("weight map").clear();
        }
        // Decode-sized rows (one block of 1024 threads, float4 and scalar paths, rows longer
        // than the block) next to the small shapes.
        for (n, d) in [
            (1usize, 576usize),
            (7, 1000),
            (3, 64),
            (1, 4096),
            (1, 8192),
            (1, 8196),
            (1, 4098),
            (1, 100),
            (3, 8200),
            (2, 4098),
        ] {
            let x = noise(n * d, 11);
            let wt = noise(d, 12);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * d);
                be.rms_norm(&be.upload(&x), &wt, 1e-5, &mut o);
                be.download(&o)
            });
            out.push(compare(format!("RMS_NORM(ne=[{d},{n}])"), &g, &c, 1e-6));
        }
        self.weights.lock().expect("weight map").clear();
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
                let (g, c) = both(self, |be| {
                    let mut b = be.upload(&x);
                    be.rope(&mut b, layout, pos0, 10000.0, style);
                    be.download(&b)
                });
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
        // Several products of one token in one warp-rows launch (q/k/v, gate/up): row counts that
        // split R-row blocks between matrices, then outputs back to back.
        for (ty, cols, rows_each) in [
            (GgmlType::Q4K, 512usize, vec![37usize, 5, 12]),
            (GgmlType::Q4_1, 576, vec![9, 40]),
            (GgmlType::Q8_0, 256, vec![3, 3, 64]),
        ] {
            let bytes: Vec<Vec<u8>> = (rows_each.iter().enumerate())
                .map(|(i, &r)| test_bytes(ty, r, cols, 80 + i as u64))
                .collect();
            let ws: Vec<WeightRef> = bytes
                .iter()
                .zip(&rows_each)
                .map(|(b, &r)| test_weight(ty, b, r, cols))
                .collect();
            let x = noise(cols, 90);
            let (g, c) = both(self, |be| {
                let mut os: Vec<Buf> = rows_each.iter().map(|&r| be.alloc(r)).collect();
                let mut refs: Vec<&mut Buf> = os.iter_mut().collect();
                be.linear_many(&be.upload(&x), 1, &ws, &mut refs);
                os.iter().flat_map(|o| be.download(o)).collect()
            });
            out.push(compare(
                format!(
                    "MUL_MAT_MANY(type={},cols={cols},rows={rows_each:?},n=1)",
                    type_suffix(ty).unwrap_or("?")
                ),
                &g,
                &c,
                1e-5,
            ));
            self.weights.lock().expect("weight map").clear();
        }
        // q/k/v with RoPE and the KV-cache append in the GEMV's store (linear_qkv_rope), after 7
        // cached rows: against the CPU engine, and bit for bit against the GPU's separate launches
        // (linear_many, rope_qk_cache). Q4_K rows of 4096 (the integer GEMV) with whole-head RoPE,
        // of 512 (the float GEMV) with a partial one; NEOX takes the separate launches. A Q6_K v
        // (Q4_K_M's promoted layers): at 4096 a q + k launch and a v launch share the store, at
        // 512 (no warp-rows Q6_K) the separate launches run.
        for (cols, hd, dim, style, v_ty, want_split) in [
            (4096usize, 64usize, 64usize, RopeStyle::Norm, GgmlType::Q4K, false),
            (512, 48, 32, RopeStyle::Norm, GgmlType::Q4K, false),
            (512, 32, 32, RopeStyle::Neox, GgmlType::Q4K, false),
            (4096, 64, 64, RopeStyle::Norm, GgmlType::Q6K, true),
            (4096, 128, 128, RopeStyle::Norm, GgmlType::Q6K, true),
            (512, 48, 32, RopeStyle::Norm, GgmlType::Q6K, false),
        ] {
            let (qh, kh, pos0) = (4usize, 2usize, 7usize);
            let rows = [qh * hd, kh * hd, kh * hd];
            let tys = [GgmlType::Q4K, GgmlType::Q4K, v_ty];
            let bytes = [0, 1, 2].map(|i| test_bytes(tys[i], rows[i], cols, 95 + i as u64));
            let ws = [0, 1, 2].map(|i| test_weight(tys[i], &bytes[i], rows[i], cols));
            let x = noise(cols, 98);
            let (old_k, old_v) = (noise(pos0 * rows[1], 99), noise(pos0 * rows[2], 100));
            let layout = |heads| RopeLayout {
                n_heads: heads,
                head_stride: hd,
                offset: 0,
                rope_dim: dim,
            };
            let rope = QkRope {
                q: layout(qh),
                k: layout(kh),
                pos0,
                base: 10000.0,
                style,
            };
            let run = |be: &dyn Backend, fused: bool| {
                let xb = be.upload(&x);
                let [mut q, mut k, mut v] = rows.map(|r| be.alloc(r));
                let (mut kc, mut vc) = (Buf::default(), Buf::default());
                be.kv_write(&mut kc, &be.upload(&old_k), rows[1], 0, 0);
                be.kv_write(&mut vc, &be.upload(&old_v), rows[2], 0, 0);
                if fused {
                    be.linear_qkv_rope(&xb, 1, ws, [&mut q, &mut k, &mut v], rope, [&mut kc, &mut vc]);
                } else {
                    be.linear_many(&xb, 1, &ws, &mut [&mut q, &mut k, &mut v]);
                    be.rope_qk_cache(&mut q, &mut k, &v, rows[2], rope, [&mut kc, &mut vc]);
                }
                [&q, &k, &v, &kc, &vc]
                    .iter()
                    .flat_map(|b| be.download(b))
                    .collect::<Vec<f32>>()
            };
            let ty = if v_ty == GgmlType::Q4K { "q4_k" } else { "q4_k+q6_k" };
            let case = format!("MUL_MAT_QKV_ROPE(type={ty},cols={cols},hd={hd},dim={dim},style={style:?},pos0={pos0})");
            let (g, c) = both(self, |be| run(be, true));
            out.push(compare(case.clone(), &g, &c, 1e-5));
            out.push(compare(format!("{case}_VS_SEPARATE"), &g, &run(self, false), 0.0));
            // The q + k and v launches are taken where expected (the cases above pass either way).
            let split = self.qk_then_v(&ws.map(|w| self.weight(w, &self.stream)), &ws).is_some();
            if split != want_split {
                out.push(KernelCheck {
                    case: format!("{case}_QK_THEN_V(taken={split})"),
                    rel_l2: f64::NAN,
                    max_abs: f64::NAN,
                    tol: 0.0,
                    pass: false,
                });
            }
            self.weights.lock().expect("weight map").clear();
        }
        // The residual add fused with the next norm: x after the add, then the normed rows; on
        // the GPU also against the add and the norm as two launches, bit for bit.
        for (d, n, f16) in [
            (4096usize, 2usize, false),
            (4098, 3, true),
            (576, 5, false),
            (4096, 1, false),
            (4096, 1, true),
            (576, 1, false),
            (8192, 1, false),
            (8196, 1, true),
        ] {
            let (x, a, wt) = (noise(n * d, 19), noise(n * d, 20), noise(d, 21));
            let (g, c) = both(self, |be| {
                let (mut xb, mut o) = (be.upload(&x), be.alloc(n * d));
                be.add_rms_norm(&mut xb, &be.upload(&a), f16, &wt, 1e-5, &mut o);
                [be.download(&xb), be.download(&o)].concat()
            });
            let case = format!("ADD_RMS_NORM(ne=[{d},{n}],f16={f16})");
            out.push(compare(case.clone(), &g, &c, 1e-6));
            let (mut xb, mut o) = (self.upload(&x), self.alloc(n * d));
            self.add_assign(&mut xb, &self.upload(&a), f16);
            self.rms_norm(&xb, &wt, 1e-5, &mut o);
            let two = [self.download(&xb), self.download(&o)].concat();
            out.push(compare(format!("{case}_VS_SEPARATE"), &g, &two, 0.0));
        }
        out.extend(self.check_norm_split());
        // q and k in one launch: 5 + 2 heads (a chunk spanning both), MLA-like offsets.
        for (ql, kl, pos0) in [
            (
                RopeLayout {
                    n_heads: 5,
                    head_stride: 24,
                    offset: 0,
                    rope_dim: 24,
                },
                RopeLayout {
                    n_heads: 2,
                    head_stride: 24,
                    offset: 0,
                    rope_dim: 24,
                },
                7usize,
            ),
            (
                RopeLayout {
                    n_heads: 3,
                    head_stride: 40,
                    offset: 24,
                    rope_dim: 16,
                },
                RopeLayout {
                    n_heads: 1,
                    head_stride: 16,
                    offset: 0,
                    rope_dim: 16,
                },
                513,
            ),
        ] {
            let n = 5;
            let xq = noise(n * ql.n_heads * ql.head_stride, 15);
            let xk = noise(n * kl.n_heads * kl.head_stride, 16);
            let (g, c) = both(self, |be| {
                let (mut q, mut k) = (be.upload(&xq), be.upload(&xk));
                be.rope_qk(&mut q, ql, &mut k, kl, pos0, 10000.0, RopeStyle::Neox);
                [be.download(&q), be.download(&k)].concat()
            });
            out.push(compare(
                format!(
                    "ROPE_QK(q={}x{}+{},k={}x{},dim={},pos0={pos0})",
                    ql.n_heads, ql.head_stride, ql.offset, kl.n_heads, kl.head_stride, ql.rope_dim
                ),
                &g,
                &c,
                1e-5,
            ));
        }
        // RoPE with the KV-cache append in one launch (rope_qk_cache), after 7 cached rows:
        // against the CPU engine, and bit for bit against the GPU's separate launches (rope_qk,
        // then kv_write twice). GQA-like (4 + 2 heads of 16, NORM; 1 and 3 rows) and a partial
        // rope (dims 8..24 of heads of 24, NEOX).
        for (hd, off, dim, style, n) in [
            (16usize, 0usize, 16usize, RopeStyle::Norm, 1usize),
            (16, 0, 16, RopeStyle::Norm, 3),
            (24, 8, 16, RopeStyle::Neox, 2),
        ] {
            let layout = |heads| RopeLayout {
                n_heads: heads,
                head_stride: hd,
                offset: off,
                rope_dim: dim,
            };
            let (ql, kl, vw, pos0) = (layout(4), layout(2), 20usize, 7usize);
            let (xq, xk, xv) = (noise(n * 4 * hd, 17), noise(n * 2 * hd, 18), noise(n * vw, 19));
            let (old_k, old_v) = (noise(pos0 * 2 * hd, 20), noise(pos0 * vw, 21));
            let run = |be: &dyn Backend, fused: bool| {
                let (mut q, mut k, v) = (be.upload(&xq), be.upload(&xk), be.upload(&xv));
                let (mut kc, mut vc) = (Buf::default(), Buf::default());
                be.kv_write(&mut kc, &be.upload(&old_k), 2 * hd, 0, 0);
                be.kv_write(&mut vc, &be.upload(&old_v), vw, 0, 0);
                if fused {
                    let rope = QkRope {
                        q: ql,
                        k: kl,
                        pos0,
                        base: 10000.0,
                        style,
                    };
                    be.rope_qk_cache(&mut q, &mut k, &v, vw, rope, [&mut kc, &mut vc]);
                } else {
                    be.rope_qk(&mut q, ql, &mut k, kl, pos0, 10000.0, style);
                    be.kv_write(&mut kc, &k, 2 * hd, pos0, pos0);
                    be.kv_write(&mut vc, &v, vw, pos0, pos0);
                }
                [be.download(&q), be.download(&k), be.download(&kc), be.download(&vc)].concat()
            };
            let case = format!("ROPE_QK_CACHE(hd={hd},off={off},dim={dim},style={style:?},n={n},pos0={pos0})");
            let (g, c) = both(self, |be| run(be, true));
            out.push(compare(case.clone(), &g, &c, 1e-5));
            out.push(compare(format!("{case}_VS_SEPARATE"), &g, &run(self, false), 0.0));
        }
        {
            let gate = noise(1001, 14);
            let up = noise(1001, 15);
            let (g, c) = both(self, |be| {
                let mut b = be.upload(&gate);
                be.swiglu(&mut b, &be.upload(&up));
                be.download(&b)
            });
            out.push(compare("SWIGLU(ne=[1001])".into(), &g, &c, 1e-6));
        }
        // The per-(token, head) kernel in prefill and decode (the tiled and split ones have their
        // own cases below).
        let tiled = self.attn.set(false);
        let split = self.attn.set_split(0);
        for (pos0, n, hd) in [
            (0usize, 7usize, 40usize),
            (7, 1, 40),
            (30, 3, 40),
            (517, 1, 128),
            (0, 70, 64),
            (300, 2, 37),
        ] {
            let t = pos0 + n;
            let s = GqaShape {
                n_heads: 6,
                n_kv_heads: 2,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let q = noise(n * 6 * hd, 16);
            let k = noise(t * 2 * hd, 17);
            let v = noise(t * 2 * hd, 18);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * 6 * hd);
                be.gqa_attention(&be.upload(&q), &be.upload(&k), &be.upload(&v), pos0, s, &mut o);
                be.download(&o)
            });
            out.push(compare(
                format!("ATTN_GQA(H=6,KV=2,hd={hd},pos0={pos0},n={n})"),
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
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * 60);
                let (qd, knd, kpd, vd) = (be.upload(&q), be.upload(&kn), be.upload(&kp), be.upload(&v));
                be.mla_attention(&qd, &knd, &kpd, &vd, pos0, m, &mut o);
                be.download(&o)
            });
            out.push(compare(
                format!("ATTN_MLA(H=3,nope=24,rope=8,v=20,pos0={pos0},n={n})"),
                &g,
                &c,
                1e-5,
            ));
        }
        self.attn.set(tiled);
        self.attn.set_split(split);
        {
            let parts: Vec<Vec<f32>> = (0..8).map(|r| noise(999, 30 + r)).collect();
            let (g, c) = both(self, |be| {
                let bufs: Vec<Buf> = parts.iter().map(|p| be.upload(p)).collect();
                let refs: Vec<&Buf> = bufs.iter().collect();
                be.download(&be.all_reduce(&refs)[0])
            });
            out.push(compare("ALL_REDUCE(ranks=8,ne=[999])".into(), &g, &c, 0.0));
        }
        // MoE routing: chosen experts and weights (ids as floats, then weights) against the host's
        // route(); DeepSeek-V3-like (sigmoid, bias, 8 groups keep 3, normalized, scaled) and a
        // softmax router without groups, over 7 tokens of random logits.
        for (n_exp, k, gating, groups, bias) in [
            (64usize, 6usize, Gating::Sigmoid, (8usize, 3usize), true),
            (37, 4, Gating::Softmax, (1, 1), false),
            (256, 8, Gating::Sigmoid, (8, 4), true),
        ] {
            let m = MoeConfig {
                n_experts: n_exp,
                n_used: k,
                n_shared: 0,
                expert_ffn: 4,
                n_dense_lead: 0,
                weights_scale: 2.5,
                weights_norm: bias,
                gating,
                n_groups: groups.0,
                n_groups_used: groups.1,
            };
            let logits: Vec<f32> = noise(7 * n_exp, 60 + k as u64).iter().map(|v| 4.0 * v).collect();
            let b = noise(n_exp, 70);
            let (g, c) = both(self, |be| {
                let routes = be.moe_route(&be.upload(&logits), n_exp, &m, bias.then_some(&b[..]), 2.5);
                let ids = routes.iter().flat_map(|r| r.experts.iter().map(|&e| e as f32));
                ids.chain(routes.iter().flat_map(|r| r.weights.iter().copied()))
                    .collect()
            });
            out.push(compare(
                format!(
                    "MOE_ROUTE(experts={n_exp},k={k},{gating:?},groups={}/{},bias={bias})",
                    groups.1, groups.0
                ),
                &g,
                &c,
                1e-6,
            ));
        }
        // Data movement: exact (tolerance 0); the canary must survive bit for bit.
        {
            let (g, c) = both(self, |be| {
                let mut b = be.upload(&noise(77, 50));
                be.fill(&mut b, references::tap::canary());
                be.download(&b)
            });
            let bits_ok = g.iter().all(|v| v.to_bits() == references::tap::canary().to_bits());
            out.push(KernelCheck {
                case: "FILL(canary,ne=[77])".into(),
                rel_l2: 0.0,
                max_abs: 0.0,
                tol: 0.0,
                pass: bits_ok && g.len() == c.len(),
            });
            let src = noise(9 * 13, 51);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(9 * 5);
                be.copy_cols(&be.upload(&src), 13, 7, 5, &mut o);
                be.download(&o)
            });
            out.push(compare("COPY_COLS(ne=[13,9],cols=7..12)".into(), &g, &c, 0.0));
            for f16_round in [false, true] {
                let (x, a) = (
                    noise(501, 52),
                    noise(501, 53).iter().map(|v| v * 3e3).collect::<Vec<_>>(),
                );
                let (g, c) = both(self, |be| {
                    let mut b = be.upload(&x);
                    be.add_assign(&mut b, &be.upload(&a), f16_round);
                    be.download(&b)
                });
                out.push(compare(format!("ADD(f16_round={f16_round},ne=[501])"), &g, &c, 0.0));
            }
            for (pos0, slot0, n) in [(0usize, 0usize, 5usize), (5, 5, 1), (5, 4, 1), (70, 70, 3)] {
                let width = 24;
                let old = noise(pos0.max(1) * width + 48, 54);
                let new = noise(n * width, 55);
                let (g, c) = both(self, |be| {
                    let mut cache = Buf::default();
                    if pos0 > 0 {
                        // A cache that held more rows than it keeps (a re-prefill truncates).
                        be.kv_write(&mut cache, &be.upload(&old), width, 0, 0);
                    }
                    be.kv_write(&mut cache, &be.upload(&new), width, pos0, slot0);
                    be.download(&cache)
                });
                out.push(compare(
                    format!("KV_WRITE(width={width},pos0={pos0},slot0={slot0},n={n})"),
                    &g,
                    &c,
                    0.0,
                ));
            }
            let x = noise(6 * 33, 56);
            let y = noise(4 * 33, 57);
            let (rows_, weights) = ([4usize, 0, 4, 2], [0.5f32, -1.25, 2.0, 0.75]);
            let (g, c) = both(self, |be| {
                let xd = be.upload(&x);
                let gathered = be.gather_rows(&xd, 33, &rows_);
                let mut o = be.dup(&xd);
                be.add_rows_scaled(&mut o, &be.upload(&y), 33, &rows_, &weights);
                let mut v = be.download(&gathered);
                v.extend(be.download(&o));
                v
            });
            out.push(compare("GATHER_SCATTER_ADD(ne=[33,6],rows=4)".into(), &g, &c, 0.0));
        }
        out.extend(self.gemm_checks());
        out.extend(self.attn_tiled_checks());
        out.extend(self.attn_split_checks());
        // The recorded step with the split decode attention (at its setting, the default where it
        // is off) and with the per-(token, head) kernel.
        let split = self.attn.split_chunk();
        for chunk in [if split == 0 { attn::SPLIT_CHUNK_DEFAULT } else { split }, 0] {
            self.attn.set_split(chunk);
            out.push(self.check_decode_graph(chunk));
        }
        self.attn.set_split(split);
        out
    }

    /// A decode step's position-dependent ops (RoPE, KV append, GQA attention) recorded as a
    /// graph at one position and replayed at the next, against the same ops launched one by one
    /// on this GPU: bit-exact (the same kernels, the position read from device memory), and the
    /// last value says whether the recorded side really was recorded and replayed (1).
    fn check_decode_graph(&self, split: usize) -> KernelCheck {
        let (hd, nh, nkv, pos0) = (64usize, 4usize, 2usize, 37usize);
        let (kw, qw) = (nkv * hd, nh * hd);
        let shape = GqaShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 0.125,
        };
        let layout = |h| RopeLayout {
            n_heads: h,
            head_stride: hd,
            offset: 0,
            rope_dim: hd,
        };
        let (pk, pv) = (noise(pos0 * kw, 60), noise(pos0 * kw, 61));
        let inputs: Vec<[Vec<f32>; 3]> = (0..2)
            .map(|i| [noise(qw, 62 + i), noise(kw, 64 + i), noise(kw, 66 + i)])
            .collect();
        let run = |record: bool| {
            let be: &dyn Backend = self;
            let (mut kc, mut vc) = (Buf::default(), Buf::default());
            be.kv_write(&mut kc, &be.upload(&pk), kw, 0, 0);
            be.kv_write(&mut vc, &be.upload(&pv), kw, 0, 0);
            let mut q = be.upload(&inputs[0][0]);
            let mut k = be.upload(&inputs[0][1]);
            let mut v = be.upload(&inputs[0][2]);
            let next: Vec<Buf> = inputs[1].iter().map(|x| be.upload(x)).collect();
            let mut o = be.alloc(qw);
            let step = |q: &mut Buf, k: &mut Buf, v: &Buf, kc: &mut Buf, vc: &mut Buf, o: &mut Buf, pos: usize| {
                be.rope(q, layout(nh), pos, 10000.0, RopeStyle::Norm);
                be.rope(k, layout(nkv), pos, 10000.0, RopeStyle::Norm);
                be.kv_write(kc, k, kw, pos, pos);
                be.kv_write(vc, v, kw, pos, pos);
                be.gqa_attention(q, kc, vc, pos, shape, o);
            };
            let recording = record && be.graph_begin(pos0, 0);
            step(&mut q, &mut k, &v, &mut kc, &mut vc, &mut o, pos0);
            let graph = if recording { be.graph_end() } else { None };
            let mut res = be.download(&o);
            be.copy(&next[0], 0, &mut q, 0, qw);
            be.copy(&next[1], 0, &mut k, 0, kw);
            be.copy(&next[2], 0, &mut v, 0, kw);
            match &graph {
                Some(g) => {
                    assert!(g.fits(pos0 + 1));
                    g.replay(pos0 + 1, 0);
                    kc.set_len((pos0 + 2) * kw);
                    vc.set_len((pos0 + 2) * kw);
                }
                None => step(&mut q, &mut k, &v, &mut kc, &mut vc, &mut o, pos0 + 1),
            }
            res.extend(be.download(&o));
            res.extend(be.download(&kc));
            res.extend(be.download(&vc));
            res.push(if graph.is_some() || !record { 1.0 } else { 0.0 });
            res
        };
        let (g, c) = (run(true), run(false));
        compare(
            format!(
                "DECODE_GRAPH(rope+kv_append+gqa,hd={hd},heads={nh}/{nkv},pos0={pos0},replayed at pos0+1,attn={})",
                if split == 0 {
                    "per-head".to_string()
                } else {
                    format!("split{split}")
                }
            ),
            &g,
            &c,
            0.0,
        )
    }
}

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
fn bench_weights(s: &Arc<CudaStream>, ty: GgmlType, rows: usize, cols: usize) -> Result<Vec<DevWeight>, EngineError> {
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
fn time_launches(s: &Arc<CudaStream>, iters: usize, mut launch: impl FnMut(usize)) -> Result<f64, EngineError> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let t0 = s.record_event(flags).map_err(drv("event"))?;
    (0..iters).for_each(&mut launch);
    let t1 = s.record_event(flags).map_err(drv("event"))?;
    t1.synchronize().map_err(drv("sync"))?;
    Ok(t0.elapsed_ms(&t1).map_err(drv("elapsed"))? as f64 / 1e3 / iters as f64)
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
    /// (`gemv_read_probe` in kernels/quant.cu), on a `[rows, cols]` Q4_K weight as
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
                // SAFETY: matches gemv_read_probe in kernels/quant.cu: W is rows·row_bytes Q4_K
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

#[cfg(test)]
mod tests {
    use super::{repack_headers_last, repack_q6_k, RawArgs};
    use references::ggml_type::GgmlType;

    #[test]
    fn raw_args_hold_4_byte_scalars_in_the_low_half() {
        // The driver reads a 4-byte parameter's 4 bytes at its pointer: on a little-endian host,
        // the low half of the 8-byte slot.
        let mut a = RawArgs::default();
        a.i32(-2).f32(1.5);
        let bytes: Vec<[u8; 8]> = a.0.iter().map(|v| v.to_ne_bytes()).collect();
        assert_eq!(i32::from_ne_bytes(bytes[0][..4].try_into().unwrap()), -2);
        assert_eq!(f32::from_ne_bytes(bytes[1][..4].try_into().unwrap()), 1.5);
    }

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
        // Three rows of 2 super-blocks; every value decoded through the units of kernels/quant.cu
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
