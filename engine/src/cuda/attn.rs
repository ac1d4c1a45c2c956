//! GQA attention beside the per-(token, head) kernel: the tiled prefill kernel
//! (`gqa_attn_tiled_<HD>`) and the split-context decode kernel (`gqa_split_<HD>`, flash-decoding),
//! both in `kernels/attention.cu`: which calls take them, their launches, their checks against
//! the CPU engine, and their benchmarks beside the per-(token, head) kernel.
//!
//! Tiled prefill. Selection: [`Backend::gqa_attention`] with n > 1 new tokens making at least 32
//! rows (n · H/KV), not being recorded into a decode graph,
//! head_dim ≤ 256, n_heads a multiple of n_kv_heads and the block's shared memory within the
//! device's opt-in limit, unless `LLMDIFF_CUDA_DISABLE=attn-tiled`; short chunks and MLA keep the
//! per-(token, head) kernels. A block owns 64 (token, query
//! head) rows of one KV head, so the G = H/KV query heads that share a KV head read each K/V tile
//! once, and walks the causal prefix in 32-position tiles with an online softmax (running max;
//! the denominator summed in f64, the rest f32; see the kernel's comment). Two forms: on the CUDA
//! cores (`gqa_attn_tiled_<HD>`, any head_dim up to 256) and, where head_dim is a multiple of 8 up
//! to 128, on the tensor cores in 3xTF32 (`gqa_attn_tc_<HD>`, the default there; 2.5x the
//! CUDA-core form at the 8B shape on an H200; `LLMDIFF_CUDA_DISABLE=attn-tc` turns it off).
//!
//! Split decode. Selection: n = 1 (a decode step, op by op or recorded: `_dpos`), head_dim a
//! multiple of 4 up to 256, G = H/KV ≤ 16, KV ≤ 1024 and its shared memory within the default 48
//! KB, unless `LLMDIFF_CUDA_DISABLE=attn-split`. A block per (chunk of L positions, KV head) computes the G
//! heads' partial softmax (max, Σexp in f64, Σexp·v) over its chunk, and the last block of each
//! KV head to finish combines the chunks in a fixed order and writes the output row, with its
//! int8 limbs for the o-projection's integer GEMV when the row takes them. Where the caches'
//! capacity holds more than `s_max` chunks (the grid at [`SPLIT_THREADS_PER_SM`] threads a SM)
//! the `_runs_` entries take over: a block walks a run of chunks, loading the next one's rows
//! while it computes one, and merges them into its partials in order (8B shape at a 4000-token
//! context: decode 2.60 ms against 2.78 with a block per chunk, H200). L (32; the checks and
//! benches also run 16 and 64) and `s_max` depend on nothing but that setting,
//! the shape and the device, and the entry on the capacity, so a recorded step and an op-by-op
//! one at the same capacity combine the same chunks in the same order (bit for bit).
//! Each rank (`backend::current_rank`) has its own partials and counters ([`SplitScratch`]),
//! grown only outside a recording and never freed while the backend lives (a recorded graph
//! keeps their addresses).

use super::{compare, compare_nonfinite, dev, dev_mut, drv, noise, ok, Case, CudaBackend, KernelCheck, RawArgs};
use crate::backend::{Backend, Buf, CpuBackend};
use crate::cpu_ops::GqaShape;
use crate::EngineError;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Rows ((token, query head) pairs of one KV head) per block (`AT_R` in kernels/attention.cu).
const AT_R: usize = 64;
/// Positions per K/V tile (`AT_BK`).
const AT_BK: usize = 32;
/// Row stride of the P tile in floats (`AT_PS`).
const AT_PS: usize = 36;
/// Threads per block (`AT_THREADS`).
const AT_THREADS: u32 = 256;
/// Threads per block of the tensor-core entries (`TC_THREADS`; their rows and K/V tile are
/// `AT_R` and `AT_BK` too).
const TC_THREADS: u32 = 128;

/// Below this many rows (n · H/KV) the tiled kernel is not taken by default: its blocks would
/// be mostly empty and too few, each walking the whole prefix alone (a short chunk after a long
/// cache), where the per-(token, head) kernel has n·H blocks.
const AT_MIN_ROWS: usize = AT_R / 2;

/// Positions per warp of the split decode kernel (`AS_PPW`): a block of 32·L/4 threads.
const AS_PPW: usize = 4;
/// The split decode kernel's chunk lengths (positions per block; blocks of 128, 256, 512 threads)
/// and the default.
const SPLIT_CHUNKS: [usize; 3] = [16, 32, 64];
pub(super) const SPLIT_CHUNK_DEFAULT: usize = 32;
/// Most query heads per KV head the split kernel takes. Its block does the G heads' dot products
/// and rows one after another, and stages the G query rows and G·L scores in shared memory; at
/// G = 16 (e.g. 32 query heads on 2 KV heads), hd 256 and L 64 that is still within 48 KB, with
/// room for the warps' partial rows. Wider groups (MQA with many heads) keep the per-(token,
/// head) kernel, which has H blocks to spread anyway.
const SPLIT_MAX_GROUP: usize = 16;
/// KV heads a rank's counters cover.
const SPLIT_MAX_KV: usize = 1024;
/// The split kernel's dynamic shared memory budget in floats: 48 KB (no opt-in needed) less 256
/// bytes for its static shared memory (`as_last`).
const SPLIT_SMEM_FLOATS: usize = 12 * 1024 - 64;
/// Threads a SM the split kernel's grid is sized for once the context has more chunks than that
/// (a quarter of an H200 SM's 2048; 2 blocks at L = 32): past it each block walks a run of
/// chunks, loading the next chunk's rows while it computes one, where one block per chunk would
/// queue in waves, each waiting for its loads, and leave the combine more splits to walk.
const SPLIT_THREADS_PER_SM: usize = 512;

/// The attention kernels' settings: the tiled prefill kernel on (`LLMDIFF_CUDA_DISABLE=attn-tiled`
/// turns it off; an atomic so the bench can switch it), its tensor-core entries where they fit
/// (`attn-tc` turns them off; an atomic too), and the dynamic shared memory its entries were
/// allowed at load; the split decode kernel's chunk length (0 off with `attn-split`, else
/// [`SPLIT_CHUNK_DEFAULT`]; an atomic so the checks and bench can switch it) and each rank's
/// scratch for it.
pub(super) struct AttnState {
    on: AtomicBool,
    tc: AtomicBool,
    pub(super) smem_max: usize,
    split: AtomicUsize,
    scratch: Mutex<HashMap<usize, SplitScratch>>,
}

/// One rank's partials and counters for the split decode kernel (see `gqa_split` in
/// kernels/attention.cu). `part` only grows, outside a recording; the buffers it replaces are
/// kept in `retired` (a recorded graph may still hold their addresses), so nothing here is freed
/// before the backend is.
struct SplitScratch {
    /// One counter per KV head, zero between launches (each launch's last block resets it).
    cnt: CudaSlice<u32>,
    part: CudaSlice<f32>,
    retired: Vec<CudaSlice<f32>>,
}

impl AttnState {
    pub(super) fn new(disable: &crate::options::CudaDisable, smem_max: usize) -> AttnState {
        AttnState {
            on: AtomicBool::new(!disable.attn_tiled),
            tc: AtomicBool::new(!disable.attn_tc),
            smem_max,
            split: AtomicUsize::new(if disable.attn_split { 0 } else { SPLIT_CHUNK_DEFAULT }),
            scratch: Mutex::new(HashMap::new()),
        }
    }

    /// The split decode kernel's chunk length (0: off).
    pub(super) fn split_chunk(&self) -> usize {
        self.split.load(Ordering::Relaxed)
    }

    /// Sets the split decode kernel's chunk length (0: off), returning the previous one.
    pub(super) fn set_split(&self, chunk: usize) -> usize {
        self.split.swap(chunk, Ordering::Relaxed)
    }

    /// Sets on/off, returning the previous setting.
    pub(super) fn set(&self, on: bool) -> bool {
        self.on.swap(on, Ordering::Relaxed)
    }

    /// Sets whether the tensor-core entries are taken where they fit, returning the previous
    /// setting.
    pub(super) fn set_tc(&self, on: bool) -> bool {
        self.tc.swap(on, Ordering::Relaxed)
    }
}

/// The tiled entry for a head width (the smallest of 64, 128, 256 that holds it).
fn tiled_entry(hd: usize) -> Option<&'static str> {
    match hd {
        1..=64 => Some("gqa_attn_tiled_64"),
        65..=128 => Some("gqa_attn_tiled_128"),
        129..=256 => Some("gqa_attn_tiled_256"),
        _ => None,
    }
}

/// The tensor-core tiled entry for a head width (a multiple of 8 up to 128; the smaller of 64, 128
/// that holds it).
fn tc_entry(hd: usize) -> Option<&'static str> {
    match hd {
        _ if hd % 8 != 0 => None,
        8..=64 => Some("gqa_attn_tc_64"),
        72..=128 => Some("gqa_attn_tc_128"),
        _ => None,
    }
}

/// Threads and dynamic shared memory in bytes of a block of tiled entry `entry` (CUDA-core or
/// tensor-core) for head width `hd`. Tensor-core: Q (64 rows) and two stages of K and V (32 rows
/// each) at a row stride of the entry's width + 4 (see `gqa_tc` in kernels/attention.cu).
fn tiled_block(entry: &str, hd: usize) -> (u32, usize) {
    match entry {
        "gqa_attn_tc_64" => (TC_THREADS, (AT_R + 4 * AT_BK) * (64 + 4) * 4),
        "gqa_attn_tc_128" => (TC_THREADS, (AT_R + 4 * AT_BK) * (128 + 4) * 4),
        _ => (AT_THREADS, attn_tiled_smem(hd)),
    }
}

/// Dynamic shared memory in bytes of a tiled block for head width `hd`: Q (64 rows), K (32
/// rows) at a row stride of hd rounded up to 4, plus 4 when that is an even number of float4s;
/// V (32 rows) at hd rounded up to 4; P 64 × 36 (see kernels/attention.cu).
pub(super) fn attn_tiled_smem(hd: usize) -> usize {
    let hd4 = hd.div_ceil(4) * 4;
    let qs = if (hd4 / 4) % 2 == 1 { hd4 } else { hd4 + 4 };
    (AT_R * qs + AT_BK * qs + AT_BK * hd4 + AT_R * AT_PS) * 4
}

/// A launch shape of the split decode kernel for one GQA shape and chunk length.
#[derive(Clone, Copy, Debug)]
pub(super) struct SplitPlan {
    /// The kernel's entries: a chunk a block, plain and `_dpos`, then runs of chunks (`_runs_`),
    /// plain and `_dpos`.
    entries: [&'static str; 4],
    /// Positions per block (L).
    chunk: usize,
    threads: u32,
    /// Heads per round of the partial rows' reduction over the warps (`hr`).
    hr: usize,
    /// Most splits (blocks) per KV head (`s_max`): a longer context's chunks are dealt out in runs
    /// of ⌈chunks / s_max⌉ a block.
    s_max: usize,
    /// Dynamic shared memory in bytes.
    smem: usize,
}

/// The split decode kernel's launch shape for `shape` at chunk length `chunk`, if it takes the
/// shape (see the module docs): shared memory (floats) q G·hd, scores G·L, the runs' α
/// round_up(G, 4), then the larger of the warps' partial rows (warps·hr·hd) and the combine's
/// (round_up(2G, 4) + 4·R·G·hd/4, R = max(1, threads / (G·hd/4))), as `gqa_split_runs` in
/// kernels/attention.cu lays it out (`gqa_split` leaves out α); hr is as
/// many heads as fit in the 48 KB budget. `s_max` keeps the grid near [`SPLIT_THREADS_PER_SM`]
/// threads a SM on a device of `sms` SMs.
fn split_plan(shape: GqaShape, chunk: usize, sms: usize) -> Option<SplitPlan> {
    let (h, kv, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    if !SPLIT_CHUNKS.contains(&chunk) || kv == 0 || kv > SPLIT_MAX_KV || h % kv != 0 {
        return None;
    }
    let g = h / kv;
    if g > SPLIT_MAX_GROUP || hd == 0 || hd % 4 != 0 || hd > 256 {
        return None;
    }
    let nw = chunk / AS_PPW;
    let threads = 32 * nw;
    let ncol = g * hd / 4;
    let r = (threads / ncol).max(1);
    let comb = (2 * g).div_ceil(4) * 4 + 4 * r * ncol;
    let fixed = g * hd + g * chunk + g.div_ceil(4) * 4;
    let avail = SPLIT_SMEM_FLOATS.checked_sub(fixed)?;
    let hr = (avail / (nw * hd)).min(g);
    if hr == 0 || comb > avail {
        return None;
    }
    let entries = if hd <= 128 {
        [
            "gqa_split_128",
            "gqa_split_128_dpos",
            "gqa_split_runs_128",
            "gqa_split_runs_128_dpos",
        ]
    } else {
        [
            "gqa_split_256",
            "gqa_split_256_dpos",
            "gqa_split_runs_256",
            "gqa_split_runs_256_dpos",
        ]
    };
    Some(SplitPlan {
        entries,
        chunk,
        threads: threads as u32,
        hr,
        s_max: (sms * SPLIT_THREADS_PER_SM / (threads * kv)).max(1),
        smem: (fixed + (nw * hr * hd).max(comb)) * 4,
    })
}

/// Splits (blocks per KV head) of the split kernel at `n_ctx` positions: the chunks of L
/// positions, in runs of ⌈chunks / s_max⌉ (as `gqa_split` counts them).
fn split_count(n_ctx: usize, plan: &SplitPlan) -> usize {
    let chunks = n_ctx.div_ceil(plan.chunk);
    chunks.div_ceil(chunks.div_ceil(plan.s_max))
}

/// Floats of the split kernel's partials for `s_cap` splits: Σexp (f64) and the max per (split,
/// KV head, head), then from a multiple of 4 the partial rows (see `gqa_split`).
fn split_words(s_cap: usize, kv: usize, g: usize, hd: usize) -> usize {
    let n = s_cap * kv * g;
    (3 * n).div_ceil(4) * 4 + n * hd
}

/// A timing of the prefill attention: the per-(token, head) kernel and the tiled ones.
#[derive(Clone, Debug)]
pub struct AttnBench {
    pub case: String,
    /// Seconds per call, per-(token, head) kernel.
    pub old_s: f64,
    /// Seconds per call, tiled kernel on the CUDA cores.
    pub tiled_s: f64,
    /// Seconds per call, tiled kernel on the tensor cores (NaN where it does not take the shape).
    pub tc_s: f64,
}

/// A timing of decode attention (one new token after `ctx - 1` cached positions): the
/// per-(token, head) kernel, then the split one at each chunk length (NaN where it does not take
/// the shape). The split timings include its writing the output's limbs where the row takes them.
#[derive(Clone, Debug)]
pub struct AttnDecodeBench {
    pub case: String,
    /// Seconds per call, per-(token, head) kernel.
    pub old_s: f64,
    /// (chunk length, seconds per call) of the split kernel.
    pub split_s: Vec<(usize, f64)>,
}

impl CudaBackend {
    /// The tiled entry a GQA attention of n new tokens takes, if any (`None` when off, for n = 1,
    /// below [`AT_MIN_ROWS`] rows unless forced, and for shapes it does not take).
    pub(super) fn attn_tiled_entry(&self, n: usize, shape: GqaShape) -> Option<&'static str> {
        if n < 2 || !self.attn.on.load(Ordering::Relaxed) {
            return None;
        }
        let group = shape.n_heads / shape.n_kv_heads.max(1);
        if n * group < AT_MIN_ROWS {
            return None;
        }
        self.attn_tiled_fits(shape)
    }

    /// The tiled entry for a shape, if a tiled kernel takes it, whatever n and the on/off
    /// setting: the tensor-core one where it fits, unless `attn-tc` is disabled, else the CUDA-core
    /// one.
    pub(super) fn attn_tiled_fits(&self, shape: GqaShape) -> Option<&'static str> {
        let tc = self.attn.tc.load(Ordering::Relaxed);
        tc.then(|| self.attn_tiled_fits_as(shape, true))
            .flatten()
            .or_else(|| self.attn_tiled_fits_as(shape, false))
    }

    /// The tensor-core (`tc`) or CUDA-core tiled entry for a shape, if it takes it: H a multiple
    /// of KV, hd within the entry's width (tensor cores: a multiple of 8 up to 128; CUDA cores: up
    /// to 256), its shared memory within the limit.
    fn attn_tiled_fits_as(&self, shape: GqaShape, tc: bool) -> Option<&'static str> {
        if shape.n_kv_heads == 0 || shape.n_heads % shape.n_kv_heads != 0 {
            return None;
        }
        let e = if tc {
            tc_entry(shape.head_dim)?
        } else {
            tiled_entry(shape.head_dim)?
        };
        (tiled_block(e, shape.head_dim).1 <= self.attn.smem_max).then_some(e)
    }

    /// Launches tiled entry `entry` on q [n, H·hd], k/v [≥ pos0 + n, KV·hd], out [n, H·hd].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gqa_tiled(
        &self,
        entry: &'static str,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        pos0: usize,
        shape: GqaShape,
    ) {
        let group = shape.n_heads / shape.n_kv_heads;
        let blocks = (n * group).div_ceil(AT_R) * shape.n_kv_heads;
        if blocks == 0 {
            return;
        }
        let args = [
            n as i32,
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
        ];
        let mut b = self.stream.launch_builder(self.func(entry));
        b.arg(q).arg(k).arg(v).arg(out);
        for a in &args {
            b.arg(a);
        }
        b.arg(&shape.scale);
        let (threads, smem) = tiled_block(entry, shape.head_dim);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: matches gqa_attn_tiled_* and gqa_attn_tc_* in kernels/attention.cu: q and out
        // hold n·H·hd floats, k and v (pos0 + n)·KV·hd, H % KV == 0, hd within the entry's width
        // (a multiple of 8 for gqa_attn_tc_*), threads and shared memory as tiled_block (allowed
        // at load up to smem_max).
        ok(unsafe { b.launch(cfg) });
    }

    /// The split decode kernel's launch shape for `shape` under the current setting, if it is on
    /// and takes the shape.
    pub(super) fn attn_split_plan(&self, shape: GqaShape) -> Option<SplitPlan> {
        split_plan(shape, self.attn.split.load(Ordering::Relaxed), self.sms as usize)
    }

    /// A decode step's GQA attention (n = 1) on the split kernel, if it takes the shape: true when
    /// launched. While recording, the `_dpos` form; where this rank's scratch cannot serve the
    /// recording (it grows only outside one), the recording is spoiled (run once, not kept) and
    /// false sends the caller to the per-(token, head) kernel.
    pub(super) fn gqa_split(&self, q: &Buf, k: &Buf, v: &Buf, pos0: usize, shape: GqaShape, out: &mut Buf) -> bool {
        let Some(plan) = self.attn_split_plan(shape) else {
            return false;
        };
        if self.launch_gqa_split(&plan, q, k, v, out, pos0, self.capturing(), shape) {
            return true;
        }
        self.spoil("attention split scratch");
        false
    }

    /// Launches the split decode kernel on q [1, H·hd], k/v (at least pos0 + 1 rows of KV·hd; their
    /// capacity counts), out [1, H·hd]: the plain form at `pos0`, or with `dpos` the `_dpos` form,
    /// which reads the position word and has a grid for the caches' capacity (a recording; `pos0`
    /// is then only checked against the capacity). The partials are sized for the capacity in both
    /// forms, so an op-by-op step leaves the scratch that a recording at the same capacity needs.
    /// Where the row takes them (H·hd a multiple of 128 and wide enough, see `limbs_out`; G·hd a
    /// multiple of 32) the kernel also writes the row's limbs, attached to `out` as rms_norm does.
    /// False, with nothing launched, while recording if this rank's scratch is missing or too small.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gqa_split(
        &self,
        plan: &SplitPlan,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        out: &mut Buf,
        pos0: usize,
        dpos: bool,
        shape: GqaShape,
    ) -> bool {
        let (h, kv, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
        let g = h / kv;
        assert!(
            out.len() == h * hd && q.len() == h * hd,
            "gqa_split: q and out are not one row"
        );
        let cap_rows = dev(k).len().min(dev(v).len()) / (kv * hd);
        assert!(
            pos0 < cap_rows,
            "gqa_split: position {pos0} past the caches' {cap_rows} rows"
        );
        // Runs of chunks where the caches' capacity holds more chunks than s_max (a function of the
        // capacity, so a recording and an op-by-op step at the same capacity take the same entry).
        let cap_chunks = cap_rows.div_ceil(plan.chunk);
        let runs = cap_chunks > plan.s_max;
        let s_cap = cap_chunks.min(plan.s_max);
        let words = split_words(s_cap, kv, g, hd);
        let recording = self.capturing();
        let rank = crate::backend::current_rank();
        let mut map = self.attn.scratch.lock().expect("split scratch");
        let sc = match map.entry(rank) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(_) if recording => return false,
            std::collections::hash_map::Entry::Vacant(e) => e.insert(SplitScratch {
                cnt: ok(self.stream.alloc_zeros::<u32>(SPLIT_MAX_KV)),
                // SAFETY: the kernel writes every partial it reads (see gqa_split).
                part: ok(unsafe { self.stream.alloc::<f32>(words.next_power_of_two()) }),
                retired: Vec::new(),
            }),
        };
        if sc.part.len() < words {
            if recording {
                return false;
            }
            // SAFETY: as above.
            let grown = ok(unsafe { self.stream.alloc::<f32>(words.next_power_of_two()) });
            let old = std::mem::replace(&mut sc.part, grown);
            sc.retired.push(old);
        }
        if recording {
            self.limit_rows(cap_rows);
        }
        let xq = if (g * hd) % 32 == 0 {
            self.limbs_out(out.len(), h * hd)
        } else {
            None
        };
        let blocks = kv * if dpos { s_cap } else { split_count(pos0 + 1, plan) };
        let mut a = RawArgs::default();
        a.buf(dev(q)).buf(dev(k)).buf(dev(v)).buf(dev_mut(out));
        a.buf(&sc.part).buf(&sc.cnt).opt_buf(xq.as_ref().map(dev));
        if dpos {
            a.buf(&self.pos_dev);
        } else {
            a.i32(pos0 as i32);
        }
        a.i32(h as i32).i32(kv as i32).i32(hd as i32);
        a.f32(shape.scale)
            .i32(s_cap as i32)
            .i32(plan.s_max as i32)
            .i32(plan.hr as i32);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (plan.threads, 1, 1),
            shared_mem_bytes: plan.smem as u32,
        };
        // SAFETY: matches gqa_split_* in kernels/attention.cu: q and out hold H·hd floats, k and v
        // cap_rows ≥ pos0 + 1 rows of KV·hd (hd % 4 == 0, 16-byte aligned rows), part
        // split_words(s_cap, ..) floats, cnt SPLIT_MAX_KV ≥ KV zeroed counters (this rank's,
        // used by one launch at a time on this stream), xq limbs_words(H·hd) words or null; the
        // position word (dpos) holds a position < cap_rows (limit_rows while recording); shared
        // memory as split_plan; the kernel waits (griddep_wait) before touching memory.
        unsafe { self.launch_chained(plan.entries[2 * runs as usize + dpos as usize], cfg, &mut a) };
        drop(map);
        super::attach_limbs(out, xq);
        true
    }

    /// Sets the position word the `_dpos` kernels read.
    fn set_pos_word(&self, pos: usize) {
        let p = pos as i32;
        let mut b = self.stream.launch_builder(self.func("set_i32"));
        b.arg(&*self.pos_dev).arg(&p);
        // SAFETY: matches set_i32 in kernels/ops.cu; the position is pos_dev[0].
        ok(unsafe { b.launch(LaunchConfig::for_num_elems(1)) });
    }

    /// The split decode kernel against the CPU engine (tolerance 1e-5 as the other attention
    /// checks) at its chunk length (the default 32 where `attn-split` is disabled): heads/KV 4/4
    /// (G = 1), 6/2, 32/8 and 16/2 (G = 8) at hd 64, 128 and 68 over contexts 1, 2, 63, 64, 65,
    /// 1000 and 4097; hd 256 and 200 (two float4 columns a lane, the second partial), G = 16;
    /// chunk lengths 16 and 64; `sharp` cases (q ×8, keys scaled up along the positions, so the
    /// chunks' maxima differ widely); NaN in q, k or v and inf in v (`x=`: passes when the output
    /// is non-finite exactly where the CPU engine's is and the rest agrees); `s_max=3` cases, where
    /// blocks walk runs of chunks at any context (the device's own cap runs them only past ~1000
    /// positions at the 8B shape: the 4097 cases). The caches have 37
    /// rows of NaN past the context (a row the kernel must not read), the output is NaN-filled
    /// first (an element left unwritten fails). `form=op` is the plain kernel, run twice (the
    /// second must be bitwise the first: the counters were reset); `form=dpos` the `_dpos` form
    /// (position word, grid for the capacity), which must also be bitwise the plain one.
    pub(super) fn attn_split_checks(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let configured = self.attn.split.load(Ordering::Relaxed);
        let chunk0 = if configured == 0 {
            SPLIT_CHUNK_DEFAULT
        } else {
            configured
        };
        let mut cases: Vec<(usize, usize, usize, usize, usize, &'static str)> = Vec::new();
        for (h, kv) in [(4usize, 4usize), (6, 2), (32, 8), (16, 2)] {
            for hd in [64usize, 128, 68] {
                for ctx in [1usize, 2, 63, 64, 65, 1000, 4097] {
                    cases.push((h, kv, hd, ctx, chunk0, ""));
                }
            }
        }
        for (h, kv, hd, ctx) in [
            (16, 1, 256, 65),
            (16, 1, 256, 1000),
            (8, 2, 200, 1000),
            (16, 1, 128, 4097),
        ] {
            cases.push((h, kv, hd, ctx, chunk0, ""));
        }
        for chunk in [16usize, 64] {
            for (h, kv, hd, ctx) in [(32, 8, 128, 63), (32, 8, 128, 1000), (32, 8, 128, 4097), (6, 2, 68, 65)] {
                cases.push((h, kv, hd, ctx, chunk, ""));
            }
        }
        for (h, kv, hd, ctx) in [
            (32, 8, 128, 1000),
            (32, 8, 128, 4097),
            (6, 2, 68, 1000),
            (4, 4, 64, 4097),
        ] {
            cases.push((h, kv, hd, ctx, chunk0, "sharp"));
        }
        for x in ["nan_q", "nan_k", "nan_v", "inf_v"] {
            cases.push((32, 8, 128, 1000, chunk0, x));
        }
        cases.push((6, 2, 68, 65, chunk0, "nan_k"));
        // Runs of chunks a block at any context: the plan's split cap lowered to RUNS_S_MAX.
        const RUNS_S_MAX: usize = 3;
        let mut cases: Vec<_> = cases.into_iter().map(|c| (c, None)).collect();
        for (h, kv, hd, ctx, kind) in [
            (32usize, 8usize, 128usize, 65usize, ""),
            (32, 8, 128, 1000, ""),
            (6, 2, 68, 1000, ""),
            (16, 1, 256, 1000, ""),
            (8, 2, 200, 1000, ""),
            (32, 8, 128, 1000, "sharp"),
            (4, 4, 64, 4097, "sharp"),
            (32, 8, 128, 1000, "nan_q"),
            (32, 8, 128, 1000, "nan_k"),
            (32, 8, 128, 1000, "nan_v"),
            (32, 8, 128, 1000, "inf_v"),
        ] {
            cases.push(((h, kv, hd, ctx, chunk0, kind), Some(RUNS_S_MAX)));
        }
        const PAD: usize = 37;
        for ((h, kv, hd, ctx, chunk, kind), s_max) in cases {
            let s = GqaShape {
                window: None,
                softcap: None,
                n_heads: h,
                n_kv_heads: kv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let kvw = kv * hd;
            let pos0 = ctx - 1;
            let mut extra = if kind.is_empty() {
                String::new()
            } else if kind == "sharp" {
                ",sharp".into()
            } else {
                format!(",x={kind}")
            };
            if let Some(m) = s_max {
                extra += &format!(",s_max={m}");
            }
            let name = |form: &str| {
                Case::new("ATTN_GQA_SPLIT")
                    .p("H", h)
                    .p("KV", kv)
                    .p("hd", hd)
                    .p("ctx", ctx)
                    .p("L", format!("{chunk}{extra}"))
                    .p("form", form)
                    .to_string()
            };
            let Some(plan) = split_plan(s, chunk, self.sms as usize) else {
                for form in ["op", "dpos"] {
                    out.push(KernelCheck {
                        case: name(form),
                        rel_l2: f64::NAN,
                        max_abs: f64::NAN,
                        tol: 1e-5,
                        pass: false,
                    });
                }
                continue;
            };
            let plan = SplitPlan {
                s_max: s_max.unwrap_or(plan.s_max),
                ..plan
            };
            let seed = (h * 1000 + hd * 10 + ctx) as u64;
            let mut q = noise(h * hd, seed);
            let mut k = noise(ctx * kvw, seed + 1);
            let mut v = noise(ctx * kvw, seed + 2);
            match kind {
                "sharp" => {
                    q.iter_mut().for_each(|x| *x *= 8.0);
                    for (j, row) in k.chunks_exact_mut(kvw).enumerate() {
                        let f = 0.5 + j as f32 / ctx as f32;
                        row.iter_mut().for_each(|x| *x *= f);
                    }
                }
                "nan_q" => q[hd + 5] = f32::NAN,
                "nan_k" => k[(ctx / 2) * kvw + 3] = f32::NAN,
                "nan_v" => v[(ctx / 3) * kvw + kvw - 1] = f32::NAN,
                "inf_v" => v[(7 % ctx) * kvw + hd.min(kvw - 1)] = f32::INFINITY,
                _ => {}
            }
            k.extend(std::iter::repeat_n(f32::NAN, PAD * kvw));
            v.extend(std::iter::repeat_n(f32::NAN, PAD * kvw));
            let c = {
                let be = &CpuBackend;
                let mut o = be.alloc(h * hd);
                be.gqa_attention(&be.upload(&q), &be.upload(&k), &be.upload(&v), pos0, s, &mut o);
                be.download(&o)
            };
            let (qd, kd, vd) = (self.upload(&q), self.upload(&k), self.upload(&v));
            let run = |dpos: bool| {
                let mut o = self.upload(&vec![f32::NAN; h * hd]);
                if dpos {
                    self.set_pos_word(pos0);
                }
                let launched = self.launch_gqa_split(&plan, &qd, &kd, &vd, &mut o, pos0, dpos, s);
                assert!(launched, "gqa_split: not launched outside a recording");
                self.download(&o)
            };
            let (g1, g2, g3) = (run(false), run(false), run(true));
            let bitwise =
                |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            let check = |form: &str, g: &[f32], same: bool| {
                let mut r = if kind.starts_with("nan") || kind.starts_with("inf") {
                    compare_nonfinite(name(form), g, &c, 1e-5)
                } else {
                    compare(name(form), g, &c, 1e-5)
                };
                r.pass &= same;
                r
            };
            out.push(check("op", &g1, bitwise(&g1, &g2)));
            out.push(check("dpos", &g3, bitwise(&g1, &g3)));
        }
        out
    }

    /// The tiled kernels against the CPU engine (tolerance 1e-5 as the other attention checks),
    /// the CUDA-core one on every case (`ATTN_GQA_TILED`) and the tensor-core one on those of its
    /// widths, 40, 64, 96 and 128 (`ATTN_GQA_TC`): head widths 36, 37, 40, 64, 96, 128, 200, 256
    /// (every entry, odd widths, even and odd float4 counts, zero-padded tensor-core widths), n = 2, 7, 70, 130 (partial and several row tiles), pos0 = 0 and 300,
    /// heads/KV 6/2, 32/8, 5/1 and 4/4; output canary-filled with NaN first (an element
    /// left unwritten fails the check), and `sharp` cases with q ×8 and keys scaled up along
    /// the positions, so the running max moves from tile to tile.
    pub(super) fn attn_tiled_checks(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let spans = [
            (0usize, 2usize),
            (0, 7),
            (0, 70),
            (0, 130),
            (300, 2),
            (300, 7),
            (300, 70),
            (300, 130),
        ];
        let mut cases: Vec<(usize, usize, usize, usize, usize, bool)> = Vec::new();
        for hd in [40, 64, 128, 37] {
            for &(pos0, n) in &spans {
                cases.push((6, 2, hd, pos0, n, false));
            }
        }
        for hd in [128, 37] {
            for &(pos0, n) in &spans {
                cases.push((32, 8, hd, pos0, n, false));
            }
        }
        for hd in [64, 40] {
            for &(pos0, n) in &spans {
                cases.push((5, 1, hd, pos0, n, false));
            }
        }
        for (h, kv, hd, pos0, n) in [
            (4, 4, 36, 0, 70),
            (6, 2, 96, 300, 70),
            (6, 2, 200, 0, 130),
            (8, 2, 256, 300, 130),
            (8, 2, 256, 0, 7),
        ] {
            cases.push((h, kv, hd, pos0, n, false));
        }
        for (h, kv, hd, pos0, n) in [(32, 8, 128, 0, 130), (6, 2, 37, 300, 70), (5, 1, 64, 300, 130)] {
            cases.push((h, kv, hd, pos0, n, true));
        }
        for (h, kv, hd, pos0, n, sharp) in cases {
            let t = pos0 + n;
            let s = GqaShape {
                window: None,
                softcap: None,
                n_heads: h,
                n_kv_heads: kv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let seed = (h * 1000 + hd * 10 + n + pos0) as u64;
            let mut q = noise(n * h * hd, seed);
            let mut k = noise(t * kv * hd, seed + 1);
            let v = noise(t * kv * hd, seed + 2);
            if sharp {
                q.iter_mut().for_each(|x| *x *= 8.0);
                for (j, row) in k.chunks_exact_mut(kv * hd).enumerate() {
                    let f = 0.5 + j as f32 / t as f32;
                    row.iter_mut().for_each(|x| *x *= f);
                }
            }
            let c = {
                let be = &CpuBackend;
                let mut o = be.alloc(n * h * hd);
                be.gqa_attention(&be.upload(&q), &be.upload(&k), &be.upload(&v), pos0, s, &mut o);
                be.download(&o)
            };
            let (qd, kd, vd) = (self.upload(&q), self.upload(&k), self.upload(&v));
            // Both kernels, whatever the attn-tiled and attn-tc settings say and at any n: the
            // CUDA-core one must take every case, the tensor-core one those of its widths.
            for (tc, kind) in [(false, "TILED"), (true, "TC")] {
                let case = format!(
                    "ATTN_GQA_{kind}(H={h},KV={kv},hd={hd},pos0={pos0},n={n}{})",
                    if sharp { ",sharp" } else { "" }
                );
                let Some(entry) = self.attn_tiled_fits_as(s, tc) else {
                    if !tc {
                        out.push(KernelCheck {
                            case,
                            rel_l2: f64::NAN,
                            max_abs: f64::NAN,
                            tol: 1e-5,
                            pass: false,
                        });
                    }
                    continue;
                };
                let mut o = self.upload(&vec![f32::NAN; n * h * hd]);
                self.launch_gqa_tiled(entry, dev(&qd), dev(&kd), dev(&vd), dev_mut(&mut o), n, pos0, s);
                out.push(compare(case, &self.download(&o), &c, 1e-5));
            }
        }
        out
    }

    /// Times decode GQA attention (one new token, `ctx` positions in the cache) with `h` query
    /// heads, `kv` KV heads of width `hd`: the per-(token, head) kernel, then the split one at each
    /// chunk length, on the same device buffers; the mean of `iters` calls each, after two warm-up
    /// calls. Where the row takes limbs (32·128 = 4096 values does) the split timings include
    /// writing them, which saves the o-projection's x pre-pass.
    pub fn bench_attention_decode(
        &self,
        ctx: usize,
        h: usize,
        kv: usize,
        hd: usize,
        iters: usize,
    ) -> Result<AttnDecodeBench, EngineError> {
        assert!(ctx > 0, "bench_attention_decode: an empty context");
        let s = GqaShape {
            window: None,
            softcap: None,
            n_heads: h,
            n_kv_heads: kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let (q, k, v) = (
            self.upload(&noise(h * hd, 61)),
            self.upload(&noise(ctx * kv * hd, 62)),
            self.upload(&noise(ctx * kv * hd, 63)),
        );
        let mut o: Buf = self.alloc(h * hd);
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut time = |chunk: usize| -> Result<f64, EngineError> {
            let prev = self.attn.set_split(chunk);
            for _ in 0..2 {
                self.gqa_attention(&q, &k, &v, ctx - 1, s, &mut o);
            }
            let t0 = self.stream.record_event(flags).map_err(drv("event"))?;
            for _ in 0..iters {
                self.gqa_attention(&q, &k, &v, ctx - 1, s, &mut o);
            }
            let t1 = self.stream.record_event(flags).map_err(drv("event"))?;
            t1.synchronize().map_err(drv("sync"))?;
            self.attn.set_split(prev);
            Ok(t0.elapsed_ms(&t1).map_err(drv("elapsed"))? as f64 / 1e3 / iters as f64)
        };
        let old_s = time(0)?;
        let mut split_s = Vec::new();
        for chunk in SPLIT_CHUNKS {
            let t = if split_plan(s, chunk, self.sms as usize).is_some() {
                time(chunk)?
            } else {
                f64::NAN
            };
            split_s.push((chunk, t));
        }
        Ok(AttnDecodeBench {
            case: Case::new("ATTN_GQA_DECODE")
                .p("H", h)
                .p("KV", kv)
                .p("hd", hd)
                .p("ctx", ctx)
                .to_string(),
            old_s,
            split_s,
        })
    }

    /// Times GQA attention of `n` new tokens at pos0 = 0 (a prefill) with `h` query heads, `kv`
    /// KV heads of width `hd`: the per-(token, head) kernel, then the tiled one on the CUDA cores
    /// and on the tensor cores, on the same device buffers; the mean of `iters` calls each, after
    /// two warm-up calls.
    pub fn bench_attention(
        &self,
        n: usize,
        h: usize,
        kv: usize,
        hd: usize,
        iters: usize,
    ) -> Result<AttnBench, EngineError> {
        let s = GqaShape {
            window: None,
            softcap: None,
            n_heads: h,
            n_kv_heads: kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let (q, k, v) = (
            self.upload(&noise(n * h * hd, 51)),
            self.upload(&noise(n * kv * hd, 52)),
            self.upload(&noise(n * kv * hd, 53)),
        );
        let mut o: Buf = self.alloc(n * h * hd);
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        // The mean seconds a call with the tiled kernels on or off and the tensor-core ones on or
        // off; NaN where that setting would not take the kernel it is meant to time.
        let mut time = |on: bool, tc: bool| -> Result<f64, EngineError> {
            let (prev, prev_tc) = (self.attn.set(on), self.attn.set_tc(tc));
            let entry = self.attn_tiled_entry(n, s);
            let takes = !on || entry.is_some_and(|e| e.starts_with("gqa_attn_tc_") == tc);
            let mut run = || -> Result<f64, EngineError> {
                for _ in 0..2 {
                    self.gqa_attention(&q, &k, &v, 0, s, &mut o);
                }
                let t0 = self.stream.record_event(flags).map_err(drv("event"))?;
                for _ in 0..iters {
                    self.gqa_attention(&q, &k, &v, 0, s, &mut o);
                }
                let t1 = self.stream.record_event(flags).map_err(drv("event"))?;
                t1.synchronize().map_err(drv("sync"))?;
                Ok(t0.elapsed_ms(&t1).map_err(drv("elapsed"))? as f64 / 1e3 / iters as f64)
            };
            let t = if takes { run() } else { Ok(f64::NAN) };
            self.attn.set(prev);
            self.attn.set_tc(prev_tc);
            t
        };
        Ok(AttnBench {
            case: Case::new("ATTN_GQA")
                .p("H", h)
                .p("KV", kv)
                .p("hd", hd)
                .p("pos0", "0")
                .p("n", n)
                .to_string(),
            old_s: time(false, false)?,
            tiled_s: time(true, false)?,
            tc_s: time(true, true)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{split_count, split_plan, GqaShape};

    #[test]
    fn split_runs_start_past_s_max_chunks_and_cover_the_context() {
        // The 8B shape (32/8 heads of 128) at L = 32 on 132 SMs: 256-thread blocks, 33 splits a KV
        // head; a 513-token context is 17 chunks a block, 4097 tokens runs of 4 (33 splits).
        let shape = GqaShape {
            window: None,
            softcap: None,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            scale: 1.0,
        };
        let plan = split_plan(shape, 32, 132).expect("the 8B shape takes the split kernel");
        assert_eq!(plan.s_max, 33);
        assert_eq!(split_count(513, &plan), 17);
        assert_eq!(split_count(1056, &plan), 33);
        assert_eq!(split_count(4097, &plan), 33);
        for n_ctx in 1usize..20_000 {
            let chunks = n_ctx.div_ceil(plan.chunk);
            let (s, run) = (split_count(n_ctx, &plan), chunks.div_ceil(plan.s_max));
            assert!((1..=plan.s_max).contains(&s), "{n_ctx}: {s} splits");
            assert!(
                (s - 1) * run < chunks && chunks <= s * run,
                "{n_ctx}: the runs miss a chunk"
            );
        }
    }
}
