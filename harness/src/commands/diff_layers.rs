//! `llmdiff diff-layers`: validate the arguments into a plan, run the diff, print the taps
//! around the divergence, the diagnosis and a reproduction command.

use crate::cli::{BackendArg, DiffLayersArgs};
use crate::commands::logits::input_tokens;
use crate::compare::{ActDtype, Baseline, Tolerances};
use crate::diff::{run_diff, run_diff_candidate, run_diff_candidate_range, run_diff_range, DiffPlan};
use crate::dump::Dump;
use crate::layer_range::{parse_range, LayerRange, ResidualFrom};
use crate::output::{open_model, shell_quote, term, write_atomic};
use anyhow::{bail, Context};
use reports::DiffRun;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

pub fn run(a: &DiffLayersArgs) -> anyhow::Result<ExitCode> {
    let file = open_model(&a.model)?;
    if !a.candidate.is_empty() {
        return run_candidate(a, &file);
    }
    let backend = a.engine.backend_or(BackendArg::Cpu);
    if backend == BackendArg::Reference {
        bail!("diff-layers compares an engine backend (cpu, cuda) with the reference; --backend reference has nothing to diff");
    }
    let (_, mut engine) = a.engine.engine_options(backend)?;
    if a.json {
        engine.cuda.progress = None; // the kernel compile note: quiet under --json
    }
    engine.n_layers = n_layers(a, &file)?;
    let tolerances = tolerances(a, &file)?;
    let tokens = input_tokens(&file, &a.input.as_input())?;
    let plan = DiffPlan {
        file: &file,
        model_name: a.model.display().to_string(),
        tokens: tokens.clone(),
        engine,
        tolerances,
        dtype: ActDtype::F32,
        stop_at_first: a.stop_at_first,
        full_weights: a.full_weights,
        decode_steps: a.decode_steps,
        repro: repro(a, &tokens, &file.header.allow_unknown),
    };
    let run = match layer_range(a, &file, ResidualFrom::Reference)? {
        Some(range) => run_diff_range(&plan, &range)?,
        None => run_diff(&plan)?,
    };
    emit(a, &run)
}

/// `--layers A..B` and `--residual-from`, checked against the model (`default`: the source when
/// --residual-from is not given).
fn layer_range(
    a: &DiffLayersArgs,
    file: &references::GgufFile,
    default: ResidualFrom,
) -> anyhow::Result<Option<LayerRange>> {
    let Some(s) = &a.layers else { return Ok(None) };
    let total = references::config::ModelConfig::from_header(&file.header)?.n_layers;
    let layers = parse_range(s, total).map_err(|e| anyhow::anyhow!(e))?;
    let from = match &a.residual_from {
        Some(f) => ResidualFrom::parse(f).map_err(|e| anyhow::anyhow!(e))?,
        None => default,
    };
    Ok(Some(LayerRange { layers, total, from }))
}

/// The repro command's `--layers` and `--residual-from`.
fn push_layers(repro: &mut String, a: &DiffLayersArgs) {
    if let Some(l) = &a.layers {
        repro.push_str(&format!(" --layers {}", shell_quote(l)));
    }
    if let Some(f) = &a.residual_from {
        repro.push_str(&format!(" --residual-from {}", shell_quote(f)));
    }
}

/// `--n-layers`, checked against the model: 1 to its layer count.
fn n_layers(a: &DiffLayersArgs, file: &references::GgufFile) -> anyhow::Result<Option<usize>> {
    let Some(n) = a.n_layers else { return Ok(None) };
    let total = references::config::ModelConfig::from_header(&file.header)?.n_layers;
    if n == 0 || n > total {
        bail!("--n-layers {n}: the model has {total} layers (1..={total} allowed)");
    }
    Ok(Some(n))
}

fn tolerances(a: &DiffLayersArgs, file: &references::GgufFile) -> anyhow::Result<Tolerances> {
    let mut tolerances = Tolerances::default();
    if let Some(p) = &a.tolerance_file {
        let text = crate::output::read_text(p)?;
        tolerances.load_json(&text).with_context(|| p.display().to_string())?;
    }
    for t in &a.tolerance {
        tolerances.set(t)?;
    }
    load_baselines(&mut tolerances, &a.baseline, file)?;
    Ok(tolerances)
}

/// `--baseline`: saved run documents are read; the `.safetensors` files together are one healthy
/// candidate's dump, diffed against the model with default settings first.
fn load_baselines(t: &mut Tolerances, paths: &[PathBuf], file: &references::GgufFile) -> anyhow::Result<()> {
    let (dumps, docs): (Vec<&PathBuf>, Vec<&PathBuf>) = paths
        .iter()
        .partition(|p| p.extension().is_some_and(|e| e == "safetensors"));
    let mut runs = Vec::new();
    for p in docs {
        let text = crate::output::read_text(p)?;
        let run: DiffRun = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("--baseline {}: not a run document ({e})", p.display()))?;
        run.validate()
            .map_err(|e| anyhow::anyhow!("--baseline {}: {e}", p.display()))?;
        if run.verdict != "agree" {
            bail!(
                "--baseline {}: that run diverged; a baseline must be healthy",
                p.display()
            );
        }
        runs.push((p.display().to_string(), run));
    }
    if !dumps.is_empty() {
        let owned: Vec<PathBuf> = dumps.iter().map(|p| p.to_path_buf()).collect();
        let dump = Dump::open(&owned)?;
        let plan = DiffPlan {
            file,
            model_name: String::new(),
            tokens: dump.tokens.clone(),
            engine: engine::EngineOptions {
                tp: dump.tp,
                ..engine::EngineOptions::default()
            },
            tolerances: Tolerances::default(),
            dtype: ActDtype::F32,
            stop_at_first: false,
            full_weights: false,
            decode_steps: 0,
            repro: String::new(),
        };
        let run = run_diff_candidate(&plan, &dump)?;
        let name = owned
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" ");
        runs.push((name, run));
    }
    for (name, run) in runs {
        for row in &run.taps {
            for h in row.local.iter().flat_map(|l| &l.heads) {
                t.add_head_baseline(&row.tap, h.head, h.rel_l2);
            }
            t.add_baseline(
                &row.tap,
                Baseline {
                    local: row.local.as_ref().map(|l| l.rel_l2).filter(|v| v.is_finite()),
                    end_to_end: if row.metrics.rel_l2.is_finite() {
                        row.metrics.rel_l2
                    } else {
                        0.0
                    },
                },
            );
        }
        t.name_baseline(name);
    }
    Ok(())
}

/// `--candidate`: the dump's tokens (checked against --prompt/--tokens when given), the dump's tp.
fn run_candidate(a: &DiffLayersArgs, file: &references::GgufFile) -> anyhow::Result<ExitCode> {
    let dump = Dump::open(&a.candidate)?;
    if !a.input.is_empty() {
        let given = input_tokens(file, &a.input.as_input())?;
        if given != dump.tokens {
            bail!(
                "--prompt/--tokens give {} tokens {:?} but the dump was run on {} tokens {:?}; drop --prompt/--tokens to use the dump's",
                given.len(),
                given,
                dump.tokens.len(),
                dump.tokens
            );
        }
    }
    let mut repro = format!("llmdiff diff-layers {}", shell_quote(&a.model.display().to_string()));
    for p in &a.candidate {
        repro.push_str(&format!(" --candidate {}", shell_quote(&p.display().to_string())));
    }
    for t in &a.tolerance {
        repro.push_str(&format!(" --tolerance {}", shell_quote(t)));
    }
    for b in &a.baseline {
        repro.push_str(&format!(" --baseline {}", shell_quote(&b.display().to_string())));
    }
    if let Some(n) = a.n_layers {
        repro.push_str(&format!(" --n-layers {n}"));
    }
    if a.full_weights {
        repro.push_str(" --full-weights");
    }
    push_layers(&mut repro, a);
    push_allow_unknown(&mut repro, &file.header.allow_unknown);
    let plan = DiffPlan {
        file,
        model_name: a.model.display().to_string(),
        tokens: dump.tokens.clone(),
        engine: engine::EngineOptions {
            tp: dump.tp,
            n_layers: n_layers(a, file)?,
            ..engine::EngineOptions::default()
        },
        tolerances: tolerances(a, file)?,
        dtype: ActDtype::F32,
        stop_at_first: a.stop_at_first,
        full_weights: a.full_weights,
        decode_steps: 0,
        repro,
    };
    let run = match layer_range(a, file, ResidualFrom::Candidate)? {
        Some(range) => run_diff_candidate_range(&plan, &dump, &range)?,
        None => run_diff_candidate(&plan, &dump)?,
    };
    emit(a, &run)
}

fn emit(a: &DiffLayersArgs, run: &DiffRun) -> anyhow::Result<ExitCode> {
    if let Some(p) = &a.json_out {
        write_atomic(p, serde_json::to_string_pretty(&run)?.as_bytes())?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&run)?);
    } else {
        print_summary(run);
    }
    if let Some(p) = &a.html {
        write_atomic(p, reports::render_diff(run).as_bytes())?;
        eprintln!("report: {}", p.display());
    }
    Ok(if run.verdict == "agree" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `--allow-unknown KEY` for each accepted name, so the repro command runs the same model.
fn push_allow_unknown(repro: &mut String, allow_unknown: &[String]) {
    for k in allow_unknown {
        repro.push_str(&format!(" --allow-unknown {}", shell_quote(k)));
    }
}

fn repro(a: &DiffLayersArgs, tokens: &[u32], allow_unknown: &[String]) -> String {
    let mut s = format!(
        "llmdiff diff-layers {} --tokens {}",
        shell_quote(&a.model.display().to_string()),
        tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")
    );
    s.push_str(&format!(
        " --backend {} --tp {}",
        a.engine.backend_or(BackendArg::Cpu).name(),
        a.engine.tp()
    ));
    for f in &a.engine.inject {
        s.push_str(&format!(" --inject {f}"));
    }
    if let Some(g) = a.engine.cuda_graphs {
        s.push_str(if g == crate::cli::OnOff::On {
            " --cuda-graphs on"
        } else {
            " --cuda-graphs off"
        });
    }
    if let Some(r) = a.engine.ranks {
        s.push_str(&format!(" --ranks {}", format!("{r:?}").to_lowercase()));
    }
    for t in &a.tolerance {
        s.push_str(&format!(" --tolerance {}", shell_quote(t)));
    }
    for b in &a.baseline {
        s.push_str(&format!(" --baseline {}", shell_quote(&b.display().to_string())));
    }
    if let Some(n) = a.n_layers {
        s.push_str(&format!(" --n-layers {n}"));
    }
    if a.decode_steps > 0 {
        s.push_str(&format!(" --decode-steps {}", a.decode_steps));
    }
    if a.full_weights {
        s.push_str(" --full-weights");
    }
    push_layers(&mut s, a);
    push_allow_unknown(&mut s, allow_unknown);
    s
}

/// The terminal view: the taps around the divergence, the diagnosis and the repro command.
pub fn print_summary(run: &DiffRun) {
    let color = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let paint = |code: &str, s: &str| {
        if color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    };
    println!(
        "{}: {} taps compared, {} {} TP {}, {} tokens{}",
        term(&run.model),
        run.taps.len(),
        if run.backend == "candidate" { "dump" } else { "engine" },
        run.backend,
        run.tp,
        run.tokens.len(),
        if run.injected.is_empty() {
            String::new()
        } else {
            term(&format!(", injected {}", run.injected.join(" ")))
        }
    );
    let first_idx = run
        .first_divergence
        .as_ref()
        .and_then(|f| run.taps.iter().position(|t| t.tap == f.tap));
    let shown: Vec<usize> = match first_idx {
        Some(i) => (i.saturating_sub(6)..(i + 4).min(run.taps.len())).collect(),
        None => (run.taps.len().saturating_sub(6)..run.taps.len()).collect(),
    };
    if let Some(r) = &run.layer_range {
        println!(
            "  layers {}..{} only, from the residual of {}; {}",
            r.start,
            r.end,
            term(&r.residual_from),
            if r.head {
                "then the output norm and head"
            } else {
                "no output norm or head (the verdict is on the range's layer taps)"
            }
        );
    }
    if let Some(d) = &run.dtype {
        println!(
            "  compute dtype {} ({}): local errors held to {} × u × rho, u = {:.1e}",
            term(&d.name),
            term(&d.source),
            d.safety,
            d.unit_roundoff
        );
    }
    println!(
        "\n  {:<26} {:>10} {:>10} {:>10} {:>8} {:>7} {:>10} {:>8}",
        "tap", "rel_l2", "cosine", "max_abs", "canary", "thresh", "local", "bound"
    );
    for i in shown {
        let t = &run.taps[i];
        // A selection tap shows the rule's overlap and its broken constraints instead.
        let (local, bound) = match (&t.local, &t.selection) {
            (_, Some(s)) => (
                format!("ovl {:.0}%", 100.0 * s.overlap),
                format!("{} viol", s.violations),
            ),
            (Some(l), None) => (format!("{:.3e}", l.rel_l2), format!("{:.1e}", l.bound)),
            (None, None) => ("-".to_string(), "-".to_string()),
        };
        let line = format!(
            "  {:<26} {:>10.3e} {:>10.6} {:>10.3e} {:>7.0}% {:>7.0e} {:>10} {:>8}",
            term(&t.tap),
            t.metrics.rel_l2,
            t.metrics.cosine,
            t.metrics.max_abs,
            t.metrics.canary_left * 100.0,
            t.threshold,
            local,
            bound
        );
        println!("{}", if t.over { paint("31", &line) } else { line });
    }
    println!();
    match (&run.first_divergence, &run.diagnosis) {
        (Some(f), Some(d)) => {
            println!(
                "{} first divergence at {}",
                paint("1;31", "DIVERGED:"),
                paint("1", &term(&f.tap))
            );
            println!(
                "  class: {} ({} confidence)",
                paint("1", &term(&d.class)),
                term(&d.confidence)
            );
            println!("  {}", term(&d.explanation));
            if let Some(p) = &run.head_profile {
                let over: Vec<String> = p
                    .heads
                    .iter()
                    .filter(|h| h.rel_l2 > h.bound)
                    .map(|h| {
                        format!(
                            "head {} rel_l2 {:.2e} (bound {:.1e}, scale {:.4})",
                            h.head, h.rel_l2, h.bound, h.scale
                        )
                    })
                    .collect();
                if !over.is_empty() {
                    println!("  per-head local error at {}: {}", term(&p.tap), term(&over.join("; ")));
                }
            }
            for iso in &run.isolation {
                println!(
                    "  isolation {}: end-to-end rel_l2 {:.2e}, reference op on the engine's inputs {:.2e} -> {}",
                    term(&iso.tap),
                    iso.end_to_end_rel_l2,
                    iso.isolated_rel_l2,
                    iso.verdict
                );
            }
        }
        (None, Some(d)) => {
            println!("{} no tap diverged, but:", paint("1;31", "DIVERGED:"));
            println!(
                "  class: {} ({} confidence)",
                paint("1", &term(&d.class)),
                term(&d.confidence)
            );
            println!("  {}", term(&d.explanation));
        }
        _ => println!(
            "{} every one of the {} compared taps within tolerance",
            paint("1;32", "AGREE:"),
            run.taps.len()
        ),
    }
    if !run.unmatched.is_empty() {
        println!("  taps without a counterpart: {}", term(&run.unmatched.join(", ")));
    }
    for w in &run.coverage_warnings {
        println!("  {} {}", paint("1;33", "warning:"), term(w));
    }
    if let Some(t) = &run.tp_layout {
        let counts: Vec<String> = t.compared.iter().map(|(k, v)| format!("{v} {k}")).collect();
        println!(
            "  TP {} dump: {} tensors, compared as {}; {} config values compared, {} drift",
            t.tp,
            t.tensors,
            term(&counts.join(", ")),
            t.config_keys,
            t.config_drift.len()
        );
        for line in t
            .config_drift
            .iter()
            .chain(&t.replica_disagreements)
            .chain(&t.partial_findings)
            .chain(&t.weight_findings)
        {
            println!("  {}", term(line));
        }
    }
    if !run.missing.is_empty() {
        println!(
            "  {} reference taps missing from the candidate (not compared): {}",
            run.missing.len(),
            term(&abbreviate(&run.missing, 12))
        );
    }
    println!("\n  reproduce: {}", term(&run.repro));
    let t = &run.timings_s;
    println!(
        "  time: engine {:.2}s (load {:.2}s, capture {:.2}s, waited {:.2}s), reference {:.2}s (capture {:.2}s, waited {:.2}s), compare {:.2}s (replays {:.2}s, waited {:.2}s), total {:.2}s",
        t.engine, t.engine_load, t.engine_capture, t.engine_wait, t.reference, t.reference_capture, t.reference_wait, t.compare,
        t.replay, t.compare_wait, t.total
    );
    if t.reference_weight_bytes > 0 {
        println!(
            "  the reference read {:.3} GB of weights ({:.3} GB a token)",
            t.reference_weight_bytes as f64 / 1e9,
            t.reference_weight_bytes as f64 / 1e9 / run.tokens.len().max(1) as f64
        );
    }
}

/// The first `n` items and a count of the rest.
fn abbreviate(items: &[String], n: usize) -> String {
    if items.len() <= n {
        items.join(", ")
    } else {
        format!("{}, ... ({} more)", items[..n].join(", "), items.len() - n)
    }
}
