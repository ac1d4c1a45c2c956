//! An on-disk cache of compiled kernel modules (the CUDA backend's NVRTC output), so that a GPU
//! run does not spend its first ~30 s recompiling `kernels/*.cu` when nothing changed.
//!
//! An entry is keyed by everything the output depends on: the module's full source (common.cuh
//! included), the target arch, the compile options and the compiler's version. The key is a
//! 128-bit FNV-1a hash of those, written both in the file name and on the file's first line, which
//! is checked on load; a file that does not start with it (truncated, foreign, another format) is
//! a miss, never an error. Files are written to a temporary name and renamed into place, so
//! concurrent runs see either no entry or a whole one.
//!
//! Where: `LLMDIFF_KERNEL_CACHE` (a directory, or `0`/`off` for no cache), else
//! `$XDG_CACHE_HOME/llmdiff/kernels`, else `$HOME/.cache/llmdiff/kernels`. A cache that cannot be
//! created or written is skipped silently: it only saves time.

use std::path::{Path, PathBuf};

/// The first line's tag; bump it when the file layout changes.
const MAGIC: &str = "llmdiff-kernel-cache v1";

/// The cache directory from the environment (see the module docs), or None when off.
pub fn default_dir() -> Option<PathBuf> {
    dir_from(|k| std::env::var_os(k))
}

fn dir_from(get: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    if let Some(v) = get("LLMDIFF_KERNEL_CACHE") {
        return match v.to_str() {
            Some("0" | "off" | "") => None,
            _ => Some(PathBuf::from(v)),
        };
    }
    let base = get("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            get("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("llmdiff").join("kernels"))
}

/// The key of a compiled module: FNV-1a (128-bit) over each part, length-prefixed so that
/// parts cannot run into each other, as 32 hex digits.
pub fn key(parts: &[&str]) -> String {
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u128::from(b);
            h = h.wrapping_mul(PRIME);
        }
    };
    for p in parts {
        eat(&(p.len() as u64).to_le_bytes());
        eat(p.as_bytes());
    }
    format!("{h:032x}")
}

/// The entry's path: `<dir>/<name>-<key>.ptx` (`name`: the module's file, for people browsing).
fn path(dir: &Path, name: &str, key: &str) -> PathBuf {
    dir.join(format!("{name}-{key}.ptx"))
}

/// The cached text for (`name`, `key`), if a whole entry is there.
pub fn load(dir: &Path, name: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(path(dir, name, key)).ok()?;
    let (first, body) = text.split_once('\n')?;
    (first == format!("{MAGIC} {key}") && !body.is_empty()).then(|| body.to_string())
}

/// Stores `body` for (`name`, `key`); failures are ignored (the cache only saves time).
pub fn store(dir: &Path, name: &str, key: &str, body: &str) {
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!(".{name}-{key}.{}.tmp", std::process::id()));
    if std::fs::write(&tmp, format!("{MAGIC} {key}\n{body}")).is_ok()
        && std::fs::rename(&tmp, path(dir, name, key)).is_err()
    {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn keys_depend_on_every_part_and_on_their_boundaries() {
        let k = key(&["src", "sm_90a", "-std=c++17", "13.0"]);
        assert_eq!(k.len(), 32);
        assert_eq!(k, key(&["src", "sm_90a", "-std=c++17", "13.0"]));
        assert_ne!(k, key(&["src ", "sm_90a", "-std=c++17", "13.0"]));
        assert_ne!(k, key(&["src", "sm_89", "-std=c++17", "13.0"]));
        assert_ne!(k, key(&["src", "sm_90a", "-std=c++17", "12.8"]));
        assert_ne!(key(&["ab", "c"]), key(&["a", "bc"]));
    }

    #[test]
    fn round_trip_and_misses() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("nested").join("kernels");
        let k = key(&["x"]);
        assert_eq!(load(&dir, "quant.cu", &k), None);
        store(&dir, "quant.cu", &k, ".version 8.8\n.entry f()\n");
        assert_eq!(
            load(&dir, "quant.cu", &k).as_deref(),
            Some(".version 8.8\n.entry f()\n")
        );
        // Another key, another module name: misses.
        assert_eq!(load(&dir, "quant.cu", &key(&["y"])), None);
        assert_eq!(load(&dir, "ops.cu", &k), None);
        // A truncated or foreign file under the right name is a miss, not an error.
        let p = path(&dir, "quant.cu", &k);
        std::fs::write(&p, "llmdiff-kernel-cache v1 ").unwrap();
        assert_eq!(load(&dir, "quant.cu", &k), None);
        std::fs::write(&p, format!("{MAGIC} {}\n.ptx", key(&["other"]))).unwrap();
        assert_eq!(load(&dir, "quant.cu", &k), None);
        std::fs::write(&p, [0xffu8, 0xfe, 0x00]).unwrap();
        assert_eq!(load(&dir, "quant.cu", &k), None);
        // No temporary files are left behind.
        assert!(std::fs::read_dir(&dir)
            .unwrap()
            .all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tmp")));
    }

    #[test]
    fn an_unwritable_directory_is_skipped() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("not-a-dir");
        std::fs::write(&file, "x").unwrap();
        let k = key(&["x"]);
        store(&file.join("kernels"), "quant.cu", &k, "body");
        assert_eq!(load(&file.join("kernels"), "quant.cu", &k), None);
    }

    #[test]
    fn directory_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
        };
        assert_eq!(dir_from(env(&[("LLMDIFF_KERNEL_CACHE", "off"), ("HOME", "/h")])), None);
        assert_eq!(dir_from(env(&[("LLMDIFF_KERNEL_CACHE", "0")])), None);
        assert_eq!(
            dir_from(env(&[("LLMDIFF_KERNEL_CACHE", "/c"), ("HOME", "/h")])),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            dir_from(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])),
            Some(PathBuf::from("/x/llmdiff/kernels"))
        );
        assert_eq!(
            dir_from(env(&[("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/llmdiff/kernels"))
        );
        assert_eq!(dir_from(env(&[])), None);
    }
}
