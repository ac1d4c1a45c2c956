//! Kernel modules for a device: the NVRTC `-arch` for its compute capability, each module of
//! [`KernelId::ALL`] compiled in parallel (one thread per module), and the on-disk cache of the
//! compiled modules (CUBIN for the device's real arch, else PTX), keyed by source, arch and
//! options, so a second run loads instead of compiling.

use super::guarded;
use crate::cuda_kernels::KernelId;
use crate::options::CudaOptions;
use crate::EngineError;
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
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

/// Every kernel module for `arch` (with the kernel trace compiled in when `trace`), in
/// [`KernelId::ALL`]'s order. Each comes from this process's memo, else from the disk cache
/// `opts.kernel_cache`, else from NVRTC; the modules still to compile are compiled in parallel,
/// one thread each (NVRTC programs are independent), and written to the disk cache. A compile
/// error names the kernel file.
pub fn compile_all(arch: &'static str, trace: bool, opts: &CudaOptions) -> Result<Vec<Ptx>, EngineError> {
    static MEMO: OnceLock<PtxCache> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    let mut out: Vec<Option<Ptx>> = KernelId::ALL
        .iter()
        .map(|&id| {
            let hit = memo.lock().expect("ptx memo").get(&(id, arch, trace)).cloned();
            hit.or_else(|| disk_cache::read(opts.kernel_cache.as_deref(), id, arch, trace))
        })
        .collect();
    let missing: Vec<usize> = (0..out.len()).filter(|&i| out[i].is_none()).collect();
    if !missing.is_empty() {
        if let Some(say) = opts.progress {
            let cache = match &opts.kernel_cache {
                Some(d) => format!("cached in {} for the next run", d.display()),
                None => "no kernel cache".to_string(),
            };
            say(&format!(
                "compiling {} CUDA kernel modules for {arch} on {} threads ({cache})",
                missing.len(),
                missing.len()
            ));
        }
        let compiled: Vec<Result<disk_cache::Code, EngineError>> = std::thread::scope(|s| {
            let jobs: Vec<_> = missing
                .iter()
                .map(|&i| s.spawn(move || compile_one(KernelId::ALL[i], arch, trace)))
                .collect();
            jobs.into_iter().map(|j| j.join().expect("NVRTC thread")).collect()
        });
        for (&i, code) in missing.iter().zip(compiled) {
            let code = code?;
            disk_cache::write(opts.kernel_cache.as_deref(), KernelId::ALL[i], arch, trace, &code);
            out[i] = Some(code.into_ptx());
        }
    }
    let mut memo = memo.lock().expect("ptx memo");
    Ok(KernelId::ALL
        .iter()
        .zip(out)
        .map(|(&id, ptx)| {
            let ptx = ptx.expect("every module compiled or cached");
            memo.insert((id, arch, trace), ptx.clone());
            ptx
        })
        .collect())
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
/// gives no CUBIN, its PTX.
fn compile_one(id: KernelId, arch: &'static str, trace: bool) -> Result<disk_cache::Code, EngineError> {
    use cudarc::nvrtc::{result, sys};
    let mut options = vec![
        "--include-path=/usr/local/cuda/include".to_string(),
        format!("--gpu-architecture={arch}"),
    ];
    options.extend(nvrtc_options(trace));
    let fail = |msg: String| EngineError::KernelCompile { kernel: id.file(), msg };
    guarded("NVRTC", || {
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
    })
}

/// The on-disk kernel cache: one file per module, named by the module and a SHA-256 of
/// everything that determines its code (source with `common.cuh`, NVRTC options, target arch,
/// NVRTC version). A module is cached as the CUBIN NVRTC built for the real arch (`.cubin`, an
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
        let stem = id.file().trim_end_matches(".cu");
        dir.join(format!("{stem}-{arch}-{hex}"))
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
