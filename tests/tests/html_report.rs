//! The HTML report in a real browser: diff-layers runs with an injected fault (an unwritten
//! attention output, an unsharded kv_b) and a synthetic 60-layer TP-8 run are rendered, opened in
//! headless Chromium, and checked: no script errors, every chart's SVG laid out with a nonzero
//! size, the diagnosis in the DOM, the tap table sortable. Screenshots are left in
//! `target/tmp/html-report/` for a person to look at. Skips, with a note, when `chromium` is not
//! installed (CI installs it).

use engine::FaultSpec;
use harness::compare::{ActDtype, Tolerances};
use harness::diff::{run_diff, DiffPlan};
use harness::output::open_model;
use harness::output::write_spec;
use references::synth::preset;
use reports::DiffRun;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser"].into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Runs chromium headless on `page` with `extra` flags; returns (stdout, stderr).
fn browse(bin: &str, page: &Path, extra: &[String]) -> (String, String) {
    let profile = tempfile::tempdir().expect("profile dir");
    let mut child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s).ok();
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut err, &mut s).ok();
        s
    });
    let t0 = Instant::now();
    loop {
        if child.try_wait().expect("wait chromium").is_some() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            child.kill().ok();
            child.wait().ok();
            panic!("chromium did not finish on {} within 120 s", page.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (out_t.join().unwrap(), err_t.join().unwrap())
}

/// The page with a check script: errors are collected from the first moment, and at the end every
/// chart's laid-out size, the diagnosis text and a sort of the tap table are written into the DOM
/// for `--dump-dom` to show.
fn instrument(html: &str) -> String {
    let head = "<head><script>window.__errors=[];window.addEventListener('error',function(e){window.__errors.push(String(e.message));});</script>";
    let check = r#"<script>(function(){
var sizes=[];document.querySelectorAll('section.chart svg').forEach(function(s){var r=s.getBoundingClientRect();
sizes.push(s.closest('section').id+'='+Math.round(r.width)+'x'+Math.round(r.height));});
var th=document.querySelector('#all-taps th:nth-child(5)');th.click();
var rows=document.querySelectorAll('#all-taps tbody tr'),v=function(r){var t=r.cells[4].textContent;return t==='NaN'||t==='inf'?Infinity:parseFloat(t);};
var sorted=v(rows[0])<=v(rows[rows.length-1]);
var ev=document.getElementById('evidence');var pre=document.createElement('pre');pre.id='llmdiff-check';
pre.textContent='CHARTS '+sizes.join(' ')+'\nERRORS '+window.__errors.length+' '+window.__errors.join(' | ')+'\nSORTED '+sorted+'\nEVIDENCE '+(ev?ev.textContent:'none');
document.body.appendChild(pre);})();</script></body>"#;
    html.replacen("<head>", head, 1).replacen("</body>", check, 1)
}

fn screens_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("html-report");
    std::fs::create_dir_all(&d).expect("screenshot dir");
    d
}

/// Renders `run`, opens it, checks the DOM and takes a screenshot; returns the screenshot path.
fn check_in_browser(bin: &str, name: &str, run: &DiffRun, expect_charts: &[&str]) -> PathBuf {
    let dir = screens_dir();
    let html = reports::render_diff(run);
    let page = dir.join(format!("{name}.html"));
    std::fs::write(&page, &html).unwrap();
    let checked = dir.join(format!("{name}.checked.html"));
    std::fs::write(&checked, instrument(&html)).unwrap();

    let (dom, log) = browse(bin, &checked, &["--dump-dom".into()]);
    let report = dom
        .split("<pre id=\"llmdiff-check\">")
        .nth(1)
        .and_then(|s| s.split("</pre>").next())
        .unwrap_or_else(|| {
            panic!(
                "{name}: the check script did not run; DOM tail: {}",
                &dom[dom.len().saturating_sub(500)..]
            )
        });
    println!("{name}:\n{report}");
    let console_errors: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("CONSOLE") && (l.contains("Uncaught") || l.contains("Error")))
        .collect();
    assert!(console_errors.is_empty(), "{name}: console errors: {console_errors:?}");
    assert!(report.contains("\nERRORS 0 "), "{name}: script errors: {report}");
    assert!(
        report.contains("\nSORTED true"),
        "{name}: the tap table did not sort: {report}"
    );
    let charts_line = report.lines().next().unwrap();
    for id in expect_charts {
        let size = charts_line
            .split(' ')
            .find_map(|kv| kv.strip_prefix(&format!("{id}=")))
            .unwrap_or_else(|| panic!("{name}: chart {id} missing: {charts_line}"));
        let (w, h) = size.split_once('x').unwrap();
        let (w, h): (f64, f64) = (w.parse().unwrap(), h.parse().unwrap());
        assert!(w > 50.0 && h > 50.0, "{name}: chart {id} laid out at {w}x{h}");
    }
    if let Some(d) = &run.diagnosis {
        let text = d
            .explanation
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;");
        assert!(report.contains(&text), "{name}: diagnosis not in the DOM: {report}");
    }

    let shot = dir.join(format!("{name}.png"));
    let _ = std::fs::remove_file(&shot);
    browse(
        bin,
        &page,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1400,2000".into(),
        ],
    );
    let bytes = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(bytes > 20_000, "{name}: screenshot {} is {bytes} bytes", shot.display());
    println!("{name}: screenshot {}", shot.display());
    shot
}

fn diff_run(model: &Path, tp: usize, fault: &str) -> DiffRun {
    let file = open_model(model).unwrap();
    let tokens: Vec<u32> = vec![
        107, 104, 111, 111, 114, 35, 122, 114, 117, 111, 103, 47, 35, 119, 107, 108,
    ];
    let plan = DiffPlan {
        file: &file,
        model_name: model.file_name().unwrap().to_string_lossy().into_owned(),
        tokens: tokens.clone(),
        engine: engine::EngineOptions {
            tp,
            faults: vec![fault.parse::<FaultSpec>().unwrap()],
            backend: engine::BackendKind::Cpu,
            ..engine::EngineOptions::default()
        },
        tolerances: Tolerances::default(),
        dtype: ActDtype::F32,
        stop_at_first: false,
        full_weights: false,
        decode_steps: 0,
        repro: format!("llmdiff diff-layers {} --tp {tp} --inject {fault}", model.display()),
    };
    run_diff(&plan).unwrap()
}

#[test]
fn reports_render_in_headless_chromium() {
    let Some(bin) = chromium() else {
        println!("SKIP: chromium is not installed (apt-get install -y chromium); the browser check did not run");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("deepseek-v3-mini.gguf");
    write_spec(&preset("deepseek-v3-mini").unwrap(), 0, &model, false).unwrap();
    let all = [
        "chart-layers",
        "chart-weights",
        "chart-heads",
        "chart-ranks",
        "chart-canary",
        "chart-routing",
    ];

    let run = diff_run(&model, 2, "phantom-attn-out@1:1");
    assert_eq!(run.diagnosis.as_ref().unwrap().class, "unwritten-output");
    check_in_browser(bin, "phantom-attn-out", &run, &all);

    let run = diff_run(&model, 2, "kv-b-unsharded@1");
    let heads = run.heads.as_ref().expect("a head matrix for an unsharded kv_b");
    let reading = reports::diff_page::read_heads(heads.n_heads, &heads.cosine, run.tp);
    assert!(reading.contains("match reference heads 0–3"), "{reading}");
    check_in_browser(bin, "kv-b-unsharded", &run, &all);

    let run = reports::sample::diverged_run(60, 8, 37);
    check_in_browser(bin, "synthetic-60-layers-tp8", &run, &all);
}
