//! The CUDA backend (feature `cuda`): the [`Backend`] ops as NVRTC kernels from `kernels/*.cu`
//! (module list in [`crate::cuda_kernels`]), compiled at start-up for the device's arch and cached
//! per process. Settings come in as [`CudaOptions`]; [`backend_for`] builds the backend an engine
//! runs on (one GPU, or one rank per GPU over NCCL).
//!
//! Files: `mod.rs` (this: the backend, its start-up, launches and the [`Backend`] ops), `gemv.rs`
//! (device weights and repacking, GEMV variant choice and launches), `gemm.rs` (the prefill GEMM),
//! `attn.rs` (tiled prefill and split decode attention), `dsa.rs` (DSA: the sparse MLA attention
//! and the lightning indexer's LayerNorm, scores and fp8 rounding), `ops.rs` (norm, RoPE, KV-cache,
//! routing and gather helpers), `buffers.rs` (buffer accessors, pooled allocation, staged downloads),
//! `graph.rs` (decode graphs), `compile.rs` (NVRTC, in parallel, and the on-disk module cache),
//! `nccl.rs` (real ranks), `trace.rs` (the kernel trace), `check.rs`,
//! `check_gemv.rs` (`kernels --check`) and `bench.rs` (`kernels --bench`).
//!
//! What lives where:
//! - Weights are uploaded once, on first use, and stay on the device (keyed by their host address
//!   and length, which are stable for an engine's lifetime). Types with a register decoder in
//!   `kernels/matmul.cu` keep their ggml bytes (Q8_0, Q4_1 and Q4_K rows repacked for coalesced
//!   loads, same size); Q2_K and Q3_K are dequantized to f32 on upload. RMSNorm weights are cached the
//!   same way.
//! - Products of n > 1 tokens with Q4_K, Q8_0 or Q4_1 weights take the tensor-core GEMM of
//!   `kernels/gemm.cu` (split-f16 x, exact integer weights, f32 accumulation; `gemm.rs`,
//!   `LLMDIFF_CUDA_DISABLE=gemm` turns it off); weights that
//!   share x (`linear_many`) share its x pre-pass. Other types and shapes keep the SIMT `matmul_*`.
//! - One-token products (n = 1) take a GEMV of `kernels/gemv.cu`/`gemv_rows.cu` (`CudaBackend::gemv_default`;
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
//!   MLA and the shapes neither takes keep a block per (token, head). DSA's sparse MLA attention
//!   is that MLA kernel over each query's listed keys (`mla_attention_sparse`; `dsa.rs`).
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
//!   after a synchronization took 8.5 µs); a graph node costs ~0.7 µs.
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
use crate::cpu_ops::{GqaShape, Mat, MlaShape, QMat, QkRope, RopeFreqs, RopeLayout, RopeStyle, WeightRef};
use crate::cuda_kernels::{pair_nw, type_suffix, GemvKind, GemvVariant, KernelId, GEMV_VARIANTS};
use crate::moe_route::{route, Route};
use crate::options::{ComputeDtype, CudaDisable, CudaOptions};
use crate::EngineError;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use references::config::{Gating, MoeConfig};
use references::GgmlType;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

mod attn;
mod bench;
mod buffers;
mod check;
mod check_gemv;
mod compile;
mod dsa;
mod gemm;
mod gemv;
mod graph;
pub mod nccl;
mod ops;
mod trace;

pub use crate::device_buf::{BufPool, DevBuf};
pub use attn::{AttnBench, AttnDecodeBench};
pub use bench::{GemvBench, LaunchCost};
pub use check::{Case, KernelCheck};
pub use gemm::GemmBench;
pub use nccl::NcclBackend;

use self::compile::arch_name;
pub use self::compile::compile_modules;
#[allow(unused_imports)]
use self::{buffers::*, check::*, gemv::*, graph::*, ops::*};

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

/// The cuda backend for TP `tp` under `opts`: real ranks over NCCL ([`nccl`]) or
/// simulated ranks on one GPU, by [`CudaOptions::ranks`] and the device count; the kernel trace
/// runs on one GPU only.
pub fn backend_for(tp: usize, opts: &CudaOptions) -> Result<Box<dyn Backend>, EngineError> {
    let n = CudaBackend::device_count();
    if nccl::wants_real_ranks(opts.ranks, tp, n)? {
        if opts.kernel_trace {
            return Err(EngineError::Cuda(
                "the kernel trace runs on one GPU: use simulated ranks (--ranks simulated)".into(),
            ));
        }
        Ok(Box::new(nccl::NcclBackend::new(tp, opts)?))
    } else {
        Ok(Box::new(CudaBackend::on_device(0, opts)?))
    }
}

/// Dynamic shared memory a block may use without opting in.
const SMEM_DEFAULT_MAX: usize = 48 * 1024;

/// The GPU backend: one context on a device, its kernels, its stream, and the resident weights.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    device: String,
    arch: &'static str,
    /// The kernel entry points by name, their modules loaded up front or on first use (`compile.rs`).
    funcs: compile::Kernels,
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
    /// against 1.99 ms, smollm2 0.62 against 0.66 ms on the H200).
    staging: Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
    /// The kernel trace's buffer, when the kernels were compiled with it (`with_trace`).
    trace: Option<Mutex<trace::KernelTrace>>,
    /// The blocks a one-row (decode) norm is split over ([`NORM_SPLIT_DEFAULT`], 1 with
    /// `LLMDIFF_CUDA_DISABLE=norm-split`; `rms_norm` in kernels/ops.cu), and the arrival count the
    /// blocks of a split `add_rms_norm` share (0 between launches).
    norm_split: AtomicUsize,
    norm_arrive: Arc<CudaSlice<u32>>,
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

    /// Opens device `ordinal` and compiles the kernel modules of `opts.weight_types` (every module
    /// where it is `None`; any other is compiled on first use), with the kernel trace
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
        let d = opts.disable;
        let be = CudaBackend {
            ctx,
            device,
            arch,
            funcs: compile::Kernels::new(opts, attn_smem_max),
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
        };
        // The modules of the model's weight types (and those every model uses), or all of them.
        let wanted = match &opts.weight_types {
            Some(types) => KernelId::for_types(types),
            None => KernelId::all(),
        };
        be.load_modules(&wanted)?;
        Ok(be)
    }

    /// The kernel modules loaded so far (all of them after [`CudaBackend::new`]).
    pub fn modules_loaded(&self) -> Vec<KernelId> {
        self.funcs.loaded()
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's name and the arch the kernels were compiled for.
    pub fn device(&self) -> (&str, &'static str) {
        (&self.device, self.arch)
    }

    /// The device's stream.
    pub(crate) fn stream(&self) -> Arc<CudaStream> {
        self.stream.clone()
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

    /// GQA attention with a sliding window and/or a score soft-cap (gemma): the per-(token, head)
    /// kernel's masked form (`gqa_attention_masked` in kernels/attention.cu). Where its scores
    /// would not fit the default shared memory (contexts of about 12k positions), the CPU op on
    /// the downloaded q and caches instead. Never recorded (no device-position form).
    fn gqa_attention_masked(&self, q: &Buf, k: &Buf, v: &Buf, pos0: usize, shape: GqaShape, out: &mut Buf) {
        let slots = out.len() / shape.head_dim.max(1);
        let n = slots / shape.n_heads.max(1);
        if self.capturing() {
            self.spoil("masked attention");
        }
        let threads = attn_threads(slots, self.sms);
        let smem = (shape.head_dim + pos0 + n + attn_part(shape.head_dim, threads)) * 4;
        if smem > SMEM_DEFAULT_MAX {
            let mut o = vec![0f32; out.len()];
            let (qh, kh, vh) = (self.download(q), self.download(k), self.download(v));
            crate::cpu_ops::gqa_attention(&qh, &kh, &vh, pos0, shape, &mut o);
            let u = self.upload(&o);
            self.copy(&u, 0, out, 0, o.len());
            return;
        }
        let ints = [
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
        ];
        let window = shape.window.map_or(0, |w| w.max(1) as i32);
        let softcap = shape.softcap.unwrap_or(0.0);
        let mut b = self.stream.launch_builder(self.func("gqa_attention_masked"));
        b.arg(dev(q)).arg(dev(k)).arg(dev(v)).arg(dev_mut(out));
        for a in &ints {
            b.arg(a);
        }
        b.arg(&shape.scale).arg(&window).arg(&softcap);
        let cfg = LaunchConfig {
            grid_dim: (slots as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: matches gqa_attention_masked in kernels/attention.cu; the caches hold pos0 + n
        // rows; the dynamic shared memory is gqa_attention's (q, pos0 + n scores, the partial rows).
        ok(unsafe { b.launch(cfg) });
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
        self.download_staged(b, out)
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

    fn round_to(&self, b: &mut Buf, dtype: ComputeDtype) {
        let len = b.len() as i64;
        let code: i32 = match dtype {
            ComputeDtype::F32 => return,
            ComputeDtype::Bf16 => 1,
            ComputeDtype::F16 => 2,
        };
        if len == 0 {
            return;
        }
        // dev_mut drops the x limbs a norm or SwiGLU attached: they encode the unrounded values.
        let mut lb = self.stream.launch_builder(self.func("round_dtype"));
        lb.arg(dev_mut(b)).arg(&len).arg(&code);
        // SAFETY: matches round_dtype in kernels/ops.cu; the buffer holds len values.
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

    fn rope_qk_cache(
        &self,
        q: &mut Buf,
        k: &mut Buf,
        v: &Buf,
        v_width: usize,
        rope: QkRope<'_>,
        caches: [&mut Buf; 2],
    ) {
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
        self.launch_rope(q, rope.q, k, rope.pos0, rope.base, rope.style, rope.freqs, Some(append))
    }

    fn linear_qkv_rope(
        &self,
        x: &Buf,
        n: usize,
        ws: [WeightRef<'_>; 3],
        outs: [&mut Buf; 3],
        rope: QkRope<'_>,
        caches: [&mut Buf; 2],
    ) {
        self.qkv_rope_gemv(x, n, ws, outs, rope, caches)
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

    fn rope(&self, x: &mut Buf, layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle, freqs: RopeFreqs<'_>) {
        self.launch_rope(dev_mut(x), layout, None, pos0, base, style, freqs, None)
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
        freqs: RopeFreqs<'_>,
    ) {
        self.launch_rope(
            dev_mut(q),
            q_layout,
            Some((dev_mut(k), k_layout)),
            pos0,
            base,
            style,
            freqs,
            None,
        )
    }

    fn moe_route(&self, logits: &Buf, n_exp: usize, m: &MoeConfig, bias: Option<&[f32]>, scale: f32) -> Vec<Route> {
        self.moe_route_device(logits, n_exp, m, bias, scale)
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

    fn geglu(&self, gate: &mut Buf, up: &Buf) {
        if gate.is_empty() {
            return;
        }
        let len = gate.len() as i64;
        let mut b = self.stream.launch_builder(self.func("geglu"));
        b.arg(dev_mut(gate)).arg(dev(up)).arg(&len);
        // SAFETY: matches geglu in kernels/ops.cu: gate and up len floats.
        ok(unsafe { b.launch(Self::elementwise_cfg(len as usize)) });
    }

    fn softcap(&self, x: &mut Buf, cap: f32) {
        if x.is_empty() {
            return;
        }
        let len = x.len() as i64;
        let mut b = self.stream.launch_builder(self.func("softcap_f32"));
        b.arg(dev_mut(x)).arg(&cap).arg(&len);
        // SAFETY: matches softcap_f32 in kernels/ops.cu: x len floats.
        ok(unsafe { b.launch(Self::elementwise_cfg(len as usize)) });
    }

    fn scale(&self, x: &mut Buf, s: f32) {
        if x.is_empty() {
            return;
        }
        let len = x.len() as i64;
        let mut b = self.stream.launch_builder(self.func("scale_f32"));
        b.arg(dev_mut(x)).arg(&s).arg(&len);
        // SAFETY: matches scale_f32 in kernels/ops.cu: x len floats.
        ok(unsafe { b.launch(Self::elementwise_cfg(len as usize)) });
    }

    fn add_bias(&self, y: &mut Buf, bias: &[f32]) {
        if y.is_empty() || bias.is_empty() {
            return;
        }
        assert_eq!(y.len() % bias.len(), 0, "add_bias: y is not [n, bias.len()]");
        // The bias goes up once and stays (the weight cache, as the norms' weights).
        let bd = self.param(bias);
        let (len, width) = (y.len() as i64, bias.len() as i32);
        let mut b = self.stream.launch_builder(self.func("add_bias"));
        b.arg(dev_mut(y)).arg(&bd.data).arg(&width).arg(&len);
        // SAFETY: matches add_bias in kernels/ops.cu: y len floats, bias width floats, len % width == 0.
        ok(unsafe { b.launch(Self::elementwise_cfg(len as usize)) });
    }

    fn gqa_attention(&self, q: &Buf, k: &Buf, v: &Buf, pos0: usize, shape: GqaShape, out: &mut Buf) {
        let slots = out.len() / shape.head_dim.max(1);
        if slots == 0 {
            return;
        }
        if !shape.is_plain() {
            self.gqa_attention_masked(q, k, v, pos0, shape, out);
            return;
        }
        let n = slots / shape.n_heads;
        let capturing = self.capturing();
        // Prefill: the tiled kernel (attn.rs), unless recording or disabled.
        if !capturing {
            if let Some(entry) = self.attn_tiled_entry(n, shape) {
                self.launch_gqa_tiled(entry, dev(q), dev(k), dev(v), dev_mut(out), n, pos0, shape);
                return;
            }
        }
        // Decode: the split kernel (attn.rs; recorded too), unless disabled.
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

    fn mla_attention_sparse(
        &self,
        q: &Buf,
        k_nope: &Buf,
        k_pe: &Buf,
        v: &Buf,
        shape: MlaShape,
        keys: &Buf,
        top_k: usize,
        out: &mut Buf,
    ) {
        self.dsa_mla_sparse(q, k_nope, k_pe, v, shape, keys, top_k, out)
    }

    fn layer_norm(&self, x: &Buf, weight: &[f32], bias: &[f32], eps: f32, out: &mut Buf) {
        self.dsa_layer_norm(x, weight, bias, eps, out)
    }

    fn index_scores(&self, q: &Buf, k: &Buf, w: &Buf, pos0: usize, shape: crate::dsa::IndexShape, out: &mut Buf) {
        self.dsa_index_scores(q, k, w, pos0, shape, out)
    }

    fn fp8_groups(&self, x: &mut Buf, width: usize) {
        self.dsa_fp8_groups(x, width)
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
        self.record_begin(pos0, token)
    }

    fn graph_end(&self) -> Option<Box<dyn crate::backend::StepGraph>> {
        self.record_end()
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

#[cfg(test)]
mod tests {
    use super::RawArgs;

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
}
