//! Row 16 of the hostile-input table, end to end: `llmdiff synth` killed with SIGKILL while it
//! writes leaves its temp file (named `.llmdiff-tmp-PID-…`), and the next write into that folder
//! removes it, so no orphan stays visible.

use harness::output::TEMP_PREFIX;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn hidden(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn row16_synth_killed_mid_write_leaves_no_orphan_after_the_next_run() {
    let dir = tempfile::tempdir().unwrap();
    let exe = env!("CARGO_BIN_EXE_llmdiff");
    let out = dir.path().join("m.gguf");
    let mut c = Command::new(exe)
        .args(["synth", "--preset", "smollm2-135m", "-o", out.to_str().unwrap()])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mine = format!("{TEMP_PREFIX}{}-", c.id());
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) && !hidden(dir.path()).iter().any(|n| n.starts_with(&mine)) {
        std::thread::sleep(Duration::from_millis(10));
    }
    c.kill().unwrap();
    // Not reaped yet: a zombie, as under a container init that does not reap; it counts as dead.
    std::thread::sleep(Duration::from_millis(100));
    assert!(!out.exists(), "synth finished before it could be killed");
    let left = hidden(dir.path());
    assert!(
        left.iter().any(|n| n.starts_with(&mine)),
        "no temp file while writing: {left:?}"
    );
    // The next run into the same folder (any atomic write) removes the dead writer's file.
    let st = Command::new(exe)
        .args([
            "synth",
            "--preset",
            "llama-tiny",
            "-o",
            dir.path().join("t.gguf").to_str().unwrap(),
        ])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    assert!(hidden(dir.path()).is_empty(), "left: {:?}", hidden(dir.path()));
    c.wait().unwrap();
}
