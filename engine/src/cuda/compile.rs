//! Kernel modules for a device: the NVRTC `-arch` for its compute capability, the modules a model
//! needs ([`KernelId::for_types`]; every module where no types are given) compiled in parallel on
//! as many threads as the machine has cores, the on-disk cache of the compiled modules (CUBIN for
//! the device's real arch, else PTX), keyed by source, arch and options, so a second run loads
//! instead of compiling, and [`Kernels`], the backend's entry points by name, loading a module not
//! compiled up front on first use.

use super::{drv, guarded, CudaBackend};
use crate::cuda_kernels::KernelId;
use crate::options::CudaOptions;
use crate::EngineError;
use cudarc::driver::CudaFunction;
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// The `-arch` NVRTC gets for a compute capability. Hopper gets `sm_90a` (the arch-specific
/// target, which runs on compute capability 9.0 only), the target every Hopper figure was
/// measured with.
pub(super) fn arch_name(major: i32, minor: i32) -> &'static str {
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

/// The order modules are handed to the compile threads: the longest first, so the slowest never
/// starts last. About one unit per entry point of the quantized products; the attention modules
/// have few but large kernels (on one core: `attention_tiled` and `quant_rows_q4_k` ~5 s,
/// `attention` and `quant_q4_k` ~4 s).
fn cost_hint(id: KernelId) -> usize {
    match id {
        KernelId::AttentionTiled => 30,
        KernelId::Attention => 25,
        _ => id.functions().len(),
    }
}

/// The threads compiling `n` modules: one each, at most the machine's cores.
fn compile_threads(n: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    n.min(cores).max(1)
}

/// The kernel modules `ids` for `arch` (with the kernel trace compiled in when `trace`), in
/// `ids`' order. Each comes from this process's memo, else from the disk cache
/// `opts.kernel_cache`, else from NVRTC; the modules still to compile are compiled in parallel,
/// the longest first, on as many threads as the machine has cores (NVRTC programs are
/// independent), after one line to `opts.progress`, and written to the disk cache. A compile
/// error names the module and its files.
pub fn compile_modules(
    ids: &[KernelId],
    arch: &'static str,
    trace: bool,
    opts: &CudaOptions,
) -> Result<Vec<Ptx>, EngineError> {
    static MEMO: OnceLock<PtxCache> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    let mut out: Vec<Option<Ptx>> = ids
        .iter()
        .map(|&id| {
            let hit = memo.lock().expect("ptx memo").get(&(id, arch, trace)).cloned();
            hit.or_else(|| disk_cache::read(opts.kernel_cache.as_deref(), id, arch, trace))
        })
        .collect();
    let mut missing: Vec<usize> = (0..out.len()).filter(|&i| out[i].is_none()).collect();
    if !missing.is_empty() {
        missing.sort_by_key(|&i| std::cmp::Reverse(cost_hint(ids[i])));
        let threads = compile_threads(missing.len());
        // Load libnvrtc here, where a missing one is an error rather than a panic (`guarded`
        // swaps the process's panic hook, so the compile threads do not use it).
        guarded("NVRTC", || {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: two out-parameters of a pure query.
            unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
            Ok(())
        })?;
        if let Some(say) = opts.progress {
            let cache = match &opts.kernel_cache {
                Some(d) => format!("cached in {} for the next run", d.display()),
                None => "no kernel cache".to_string(),
            };
            let n = missing.len();
            let plural = |n: usize| if n == 1 { "" } else { "s" };
            say(&format!(
                "compiling {n} CUDA kernel module{} for {arch} on {threads} thread{} ({cache})",
                plural(n),
                plural(threads)
            ));
        }
        let next = AtomicUsize::new(0);
        let done: Mutex<Vec<(usize, Result<disk_cache::Code, EngineError>)>> = Mutex::default();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&i) = missing.get(k) else { break };
                    let code = compile_one(ids[i], arch, trace);
                    done.lock().expect("compile results").push((i, code));
                });
            }
        });
        let mut done = done.into_inner().expect("compile results");
        done.sort_by_key(|(i, _)| *i);
        for (i, code) in done {
            let code = code?;
            disk_cache::write(opts.kernel_cache.as_deref(), ids[i], arch, trace, &code);
            out[i] = Some(code.into_ptx());
        }
    }
    let mut memo = memo.lock().expect("ptx memo");
    Ok(ids
        .iter()
        .zip(out)
        .map(|(&id, ptx)| {
            let ptx = ptx.expect("every module compiled or cached");
            memo.insert((id, arch, trace), ptx.clone());
            ptx
        })
        .collect())
}

/// A device's kernel entry points by name: every module of [`KernelId::all`] is listed (so every
/// entry point has a home), those a model needs are loaded when the backend opens, and any other
/// is compiled and loaded on first use.
pub(super) struct Kernels {
    ids: Vec<KernelId>,
    /// Entry point → its module's index in `ids`.
    home: HashMap<String, usize>,
    loaded: Vec<OnceLock<HashMap<String, CudaFunction>>>,
    /// What a late compile needs: the disk cache and the progress line.
    cache: Option<PathBuf>,
    progress: Option<fn(&str)>,
    /// The device's opt-in dynamic shared memory per block, given to the kernels that stage in it.
    smem_max: usize,
}

impl Kernels {
    pub(super) fn new(opts: &CudaOptions, smem_max: usize) -> Kernels {
        let ids = KernelId::all();
        let mut home = HashMap::new();
        for (i, id) in ids.iter().enumerate() {
            for f in id.functions() {
                let before = home.insert(f, i);
                debug_assert!(before.is_none(), "an entry point in two modules");
            }
        }
        Kernels {
            loaded: ids.iter().map(|_| OnceLock::new()).collect(),
            ids,
            home,
            cache: opts.kernel_cache.clone(),
            progress: opts.progress,
            smem_max,
        }
    }

    /// The modules loaded so far.
    pub(super) fn loaded(&self) -> Vec<KernelId> {
        self.ids
            .iter()
            .zip(&self.loaded)
            .filter(|(_, l)| l.get().is_some())
            .map(|(&id, _)| id)
            .collect()
    }
}

impl CudaBackend {
    /// Compiles (or reads from the caches) and loads the modules of `ids` not loaded yet, the
    /// compiles in parallel.
    pub(super) fn load_modules(&self, ids: &[KernelId]) -> Result<(), EngineError> {
        let k = &self.funcs;
        let todo: Vec<KernelId> = ids
            .iter()
            .copied()
            .filter(|id| {
                k.ids
                    .iter()
                    .position(|x| x == id)
                    .is_some_and(|i| k.loaded[i].get().is_none())
            })
            .collect();
        if todo.is_empty() {
            return Ok(());
        }
        let opts = CudaOptions {
            kernel_cache: k.cache.clone(),
            progress: k.progress,
            ..CudaOptions::default()
        };
        let images = compile_modules(&todo, self.arch, self.trace.is_some(), &opts)?;
        let smem_max = k.smem_max;
        for (id, ptx) in todo.into_iter().zip(images) {
            let module = self
                .ctx
                .load_module(ptx)
                .map_err(drv(&format!("loading kernel module {}", id.file())))?;
            if let Some(t) = &self.trace {
                t.lock().expect("kernel trace").attach(&module, &self.stream)?;
            }
            let mut funcs = HashMap::new();
            for f in id.functions() {
                let func = module
                    .load_function(&f)
                    .map_err(drv(&format!("kernel {f} in {}", id.file())))?;
                // Dynamic shared memory: the whole opt-in limit for the kernels that stage in it
                // (the DSA kernels only past 48 KB: top_k over ~5000, or indexer q rows over 46 KB).
                let smem = (f.starts_with("gqa_attn_tiled_")
                    || f.starts_with("gqa_attn_tc_")
                    || f.starts_with("gemm2_q")
                    || f == "mla_attention_sparse"
                    || f == "index_scores")
                    .then_some(smem_max);
                if let Some(bytes) = smem {
                    // Static shared memory (the kernel trace's word, where compiled in) counts
                    // against the same limit.
                    let fixed = func
                        .get_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                        .map_err(drv(&format!("static shared memory of {f}")))?
                        .max(0) as usize;
                    let bytes = bytes.min(smem_max.saturating_sub(fixed));
                    func.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )
                    .map_err(drv(&format!("shared memory size of {f}")))?;
                }
                funcs.insert(f, func);
            }
            let i = k.ids.iter().position(|&x| x == id).expect("a listed module");
            // Another thread may have loaded it meanwhile: either copy serves.
            let _ = k.loaded[i].set(funcs);
        }
        Ok(())
    }

    /// Kernel `name`, its module compiled and loaded now if the model's weight types did not
    /// name it up front. A name in no module, or a module that fails to compile or load, is a
    /// panic that says which (the [`crate::Backend`] ops are infallible).
    pub(super) fn func(&self, name: &str) -> &CudaFunction {
        let k = &self.funcs;
        let Some(&i) = k.home.get(name) else {
            panic!("cuda: kernel {name} is in no kernel module (engine/src/cuda_kernels.rs lists them)")
        };
        if k.loaded[i].get().is_none() {
            if let Err(e) = self.load_modules(&[k.ids[i]]) {
                panic!(
                    "cuda: kernel {name} needs module {}, which was not loaded up front and fails to load now: {e}",
                    k.ids[i].file()
                )
            }
        }
        let m = k.loaded[i].get().expect("loaded above");
        m.get(name).expect("a module holds the entry points it lists")
    }
}

/// The NVRTC options of every module.
fn nvrtc_options(trace: bool) -> Vec<String> {
    let mut options = vec!["-std=c++17".to_string()];
    if trace {
        options.push("-DLLMDIFF_TRACE".into());
    }
    options
}

/// Compiles one module with NVRTC for the device's real architecture and returns its CUBIN (the
/// SASS NVRTC makes for a real `sm_XX` anyway), so loading it needs no driver JIT; where NVRTC
/// gives no CUBIN, its PTX. Thread-safe (NVRTC programs are independent); a panic (of cudarc's
/// loader) is an error.
fn compile_one(id: KernelId, arch: &'static str, trace: bool) -> Result<disk_cache::Code, EngineError> {
    use cudarc::nvrtc::{result, sys};
    let mut options = vec![
        "--include-path=/usr/local/cuda/include".to_string(),
        format!("--gpu-architecture={arch}"),
    ];
    options.extend(nvrtc_options(trace));
    let fail = |msg: String| EngineError::KernelCompile { kernel: id.file(), msg };
    let run = || {
        let src = std::ffi::CString::new(id.full_source()).map_err(|e| fail(e.to_string()))?;
        let prog = result::create_program(&src, None).map_err(|e| fail(e.to_string()))?;
        // SAFETY: `prog` was just created and is destroyed once, below; every buffer handed to
        // NVRTC is sized by the matching size query.
        let out = unsafe {
            let out = match result::compile_program(prog, &options) {
                Err(e) => {
                    let log = result::get_program_log(prog)
                        .map(|l| {
                            std::ffi::CStr::from_ptr(l.as_ptr())
                                .to_string_lossy()
                                .trim()
                                .to_string()
                        })
                        .unwrap_or_else(|_| e.to_string());
                    Err(fail(log))
                }
                Ok(()) => {
                    let mut size = 0usize;
                    let cubin = (sys::nvrtcGetCUBINSize(prog, &mut size).result().is_ok() && size > 0)
                        .then(|| {
                            let mut buf = vec![0u8; size];
                            sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
                                .result()
                                .ok()
                                .map(|_| buf)
                        })
                        .flatten();
                    match cubin {
                        Some(bin) => Ok(disk_cache::Code::Cubin(bin)),
                        None => result::get_ptx(prog)
                            .map(|image| {
                                let bytes: Vec<u8> = image.iter().map(|&c| c as u8).collect();
                                let text = bytes.split(|&b| b == 0).next().unwrap_or(&bytes);
                                disk_cache::Code::Ptx(String::from_utf8_lossy(text).into_owned())
                            })
                            .map_err(|e| fail(e.to_string())),
                    }
                }
            };
            let _ = result::destroy_program(prog);
            out
        };
        out
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
        .unwrap_or_else(|_| Err(EngineError::Cuda(format!("NVRTC panicked compiling {}", id.file()))))
}

/// The on-disk kernel cache: one file per module, named by the module and a SHA-256 of
/// everything that determines its code (its full source: its defines, `common.cuh` and its
/// files; NVRTC options, target arch, NVRTC version). A module is cached as the CUBIN NVRTC built for the real arch (`.cubin`, an
/// ELF image: a cached run skips both NVRTC and the driver's JIT), or as PTX (`.ptx`) where there
/// was no CUBIN. Best effort by design: a file that is missing, unreadable or not what its name
/// says is a miss and the module is compiled; a failed write only costs the next run the
/// compile. Files are written to a temporary name and renamed, so concurrent runs never read
/// half a file.
mod disk_cache {
    use super::{nvrtc_options, KernelId, Ptx};
    use sha2::{Digest, Sha256};
    use std::path::{Path, PathBuf};

    /// NVRTC's version, (0, 0) where it cannot be asked (then the compile fails anyway).
    fn nvrtc_version() -> (i32, i32) {
        std::panic::catch_unwind(|| {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: two out-parameters of a pure query.
            unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
            (major, minor)
        })
        .unwrap_or((0, 0))
    }

    /// The cache file of a module, without its extension.
    pub(super) fn path(dir: &Path, id: KernelId, arch: &str, trace: bool) -> PathBuf {
        let mut h = Sha256::new();
        h.update(id.full_source().as_bytes());
        for o in nvrtc_options(trace) {
            h.update(b"\0");
            h.update(o.as_bytes());
        }
        let (major, minor) = nvrtc_version();
        h.update(format!("\0{arch}\0nvrtc {major}.{minor}").as_bytes());
        let hex: String = h.finalize()[..12].iter().map(|b| format!("{b:02x}")).collect();
        dir.join(format!("{}-{arch}-{hex}", id.name()))
    }

    pub(super) fn read(dir: Option<&Path>, id: KernelId, arch: &str, trace: bool) -> Option<Ptx> {
        let base = path(dir?, id, arch, trace);
        if let Ok(bin) = std::fs::read(base.with_extension("cubin")) {
            // An ELF image (64-bit) or it is not ours.
            if bin.len() > 64 && bin.starts_with(b"\x7fELF\x02") {
                return Some(Ptx::from_binary(bin));
            }
        }
        let text = std::fs::read_to_string(base.with_extension("ptx")).ok()?;
        // NVRTC's PTX starts with its banner comment and names a `.version`; anything else is
        // not ours (or was cut short) and is compiled afresh.
        (text.contains(".version") && text.contains(".target") && text.trim_end().ends_with('}'))
            .then(|| Ptx::from_src(text))
    }

    /// Writes `code` (a CUBIN, or PTX text) for the module.
    pub(super) fn write(dir: Option<&Path>, id: KernelId, arch: &str, trace: bool, code: &Code) {
        let Some(dir) = dir else { return };
        let (bytes, ext) = match code {
            Code::Cubin(b) => (b.as_slice(), "cubin"),
            Code::Ptx(t) => (t.as_bytes(), "ptx"),
        };
        let target = path(dir, id, arch, trace).with_extension(ext);
        let tmp = target.with_extension(format!("tmp{}", std::process::id()));
        let ok = std::fs::create_dir_all(dir).is_ok()
            && std::fs::write(&tmp, bytes).is_ok()
            && std::fs::rename(&tmp, &target).is_ok();
        if !ok {
            let _ = std::fs::remove_file(&tmp);
        }
    }

    /// A compiled module's code as the cache stores it.
    pub(super) enum Code {
        Cubin(Vec<u8>),
        Ptx(String),
    }

    impl Code {
        /// The module image to load.
        pub(super) fn into_ptx(self) -> Ptx {
            match self {
                Code::Cubin(b) => Ptx::from_binary(b),
                Code::Ptx(t) => Ptx::from_src(t),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use references::GgmlType;

    /// CPU seconds of the calling thread (Linux: `/proc/thread-self/stat`, in USER_HZ = 100
    /// ticks), so a busy machine does not inflate the figure as it does wall time.
    fn thread_cpu_s() -> f64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let f: Vec<f64> = after.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
        // Fields 14 (utime) and 15 (stime) of the line; `after` starts at field 3.
        (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
    }

    /// Compiles every module for `LLMDIFF_NVRTC_ARCH` (default `sm_90a`) on one thread, no
    /// device needed (only libnvrtc: `LD_LIBRARY_PATH`), and prints each module's NVRTC time
    /// (the thread's CPU seconds, and wall) and CUBIN size, the total, and the critical path of the 8B Q4_K shape (its slowest
    /// module: what a first run waits for with a core per module). Checks every listed entry
    /// point is in its module's CUBIN and that the type gate keeps other types' out. Run with
    /// `cargo test -p engine --features cuda --lib nvrtc_compile_times -- --ignored --nocapture`.
    #[test]
    #[ignore = "needs libnvrtc; minutes of one core"]
    fn nvrtc_compile_times() {
        let arch: &'static str = std::env::var("LLMDIFF_NVRTC_ARCH")
            .map(|a| &*Box::leak(a.into_boxed_str()))
            .unwrap_or("sm_90a");
        let q4k_model = KernelId::for_types(&[GgmlType::F32, GgmlType::Q4K, GgmlType::Q6K]);
        let (mut total, mut critical) = (0.0f64, (0.0f64, String::new()));
        println!("{:<20} {:>8} {:>8} {:>10}", "module", "CPU s", "wall s", "CUBIN KB");
        for id in KernelId::all() {
            let (t, c) = (std::time::Instant::now(), thread_cpu_s());
            let code = compile_one(id, arch, false).unwrap_or_else(|e| panic!("{e}"));
            let (wall, secs) = (t.elapsed().as_secs_f64(), thread_cpu_s() - c);
            let disk_cache::Code::Cubin(bin) = code else {
                panic!("{}: no CUBIN for {arch}", id.name())
            };
            let has = |f: &str| {
                bin.windows(f.len() + 1)
                    .any(|w| &w[..f.len()] == f.as_bytes() && w[f.len()] == 0)
            };
            for f in id.functions() {
                assert!(has(&f), "{f} is not in {}'s CUBIN", id.name());
            }
            if let KernelId::Quant(t) = id {
                // Another type's products are gated out.
                let other = if t == GgmlType::Q4K {
                    "matvec_f32"
                } else {
                    "matvec_q4_k"
                };
                assert!(!has(other), "{other} is in {}", id.name());
            }
            let need = q4k_model.contains(&id);
            println!(
                "{:<20} {secs:>8.2} {wall:>8.2} {:>10.0}{}",
                id.name(),
                bin.len() as f64 / 1024.0,
                if need { "  (Q4_K model)" } else { "" }
            );
            total += secs;
            if need && secs > critical.0 {
                critical = (secs, id.name());
            }
        }
        println!(
            "all {} modules: {total:.2} CPU s of one core; the Q4_K model's {} modules: critical path {:.2} s ({})",
            KernelId::all().len(),
            q4k_model.len(),
            critical.0,
            critical.1
        );
    }

    #[test]
    fn compile_threads_are_bounded_by_the_modules_and_the_cores() {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        assert_eq!(compile_threads(1), 1);
        assert_eq!(compile_threads(0), 1);
        assert_eq!(compile_threads(1000), cores);
        // The longest modules go first.
        assert!(cost_hint(KernelId::QuantRows(GgmlType::Q4K)) > cost_hint(KernelId::Quant(GgmlType::Q5K)));
    }
}
