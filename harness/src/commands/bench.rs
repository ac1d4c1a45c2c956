//! `llmdiff bench`: best-of-N prefill and decode timings on one backend, with peak RSS, for
//! comparison with peers run on the same machine (tests/peers/bench_prefill.py runs them all).
//! Prefill is timed to every position's logits (`prefill_s`, as an HF forward) and, on the
//! engine, to the last token's only (`prefill_last_s`, as llama.cpp's prompt processing and
//! `generate`: lm_head on one row, one row brought back). Decode is timed per token in steady
//! state, after the warm-up steps that follow a prefill (see [`WARM_STEPS`]), and with them.
//! The last timed decode step's logits are then checked against a prefill of the prompt and the
//! decoded tokens, another path through other kernels (`decode_check`; exit 1 past
//! [`DECODE_CHECK_TOL`]): a GPU kernel that never writes its output still agrees with itself
//! between the decode graph and the op-by-op step, but not with this.

use crate::cli::{BackendArg, BenchArgs};
use crate::output::open_model;
use anyhow::bail;
use engine::Engine;
use references::forward::Reference;
use references::tap::NoTap;
use serde_json::json;
use std::process::ExitCode;
use std::time::Instant;

/// Peak resident set size of this process in KiB (VmHWM), where /proc has it.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Decode steps of a rep left out of the steady per-token time: after a prefill, the engine's
/// first decode step runs op by op and the second records the decode graph (CUDA); the rest replay
/// it. Both are reported: `decode_s_per_token` (steady) and `decode_s_per_token_with_warmup`.
const WARM_STEPS: usize = 2;

/// The largest rel_l2 between the last decode step's logits and a prefill's of the same tokens
/// (`decode_check`): 4× the logits' tolerance against the reference (2.5e-4, see
/// `compare::Tolerances`), which each side meets on its own. An output never written, a stale KV
/// row or a wrong token puts it near 1.
const DECODE_CHECK_TOL: f64 = 1e-3;

/// `decode_check`: the last decode step's logits `got` against a prefill's `want`.
fn check_decode(got: &[f32], want: &[f32]) -> serde_json::Value {
    let rel_l2 = if got.len() == want.len() {
        crate::compare::metrics(got, want).rel_l2
    } else {
        f64::INFINITY
    };
    json!({"rel_l2": rel_l2, "tolerance": DECODE_CHECK_TOL,
        "argmax_equal": engine::argmax(got) == engine::argmax(want), "pass": rel_l2 <= DECODE_CHECK_TOL})
}

/// `--trace`: after a prefill and the warm-up steps, one replayed decode step traced, written to
/// `path` as a Chrome trace; returns the summary (`crate::kernel_trace::summary`) with the step's
/// host wall time.
fn trace_step(e: &mut Engine, tokens: &[u32], path: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    e.prefill_last(tokens)?;
    let mut logits = Vec::new();
    for i in 0..=WARM_STEPS as u32 {
        e.decode_into(i, &mut NoTap, &mut logits)?;
    }
    if !e.kernel_trace_reset() {
        bail!("this backend keeps no kernel trace");
    }
    let t0 = Instant::now();
    e.decode_into(WARM_STEPS as u32 + 1, &mut NoTap, &mut logits)?;
    let wall = t0.elapsed().as_secs_f64();
    let (blocks, dropped) = e.kernel_trace_take().unwrap_or_default();
    if blocks.is_empty() {
        bail!("the kernel trace recorded no block");
    }
    let chrome = crate::kernel_trace::chrome_trace(&blocks);
    std::fs::write(path, serde_json::to_vec(&chrome)?)
        .map_err(|err| anyhow::anyhow!("writing {}: {err}", path.display()))?;
    let mut s = crate::kernel_trace::summary(&blocks, dropped);
    s["step_wall_s"] = json!(wall);
    s["file"] = json!(path.display().to_string());
    Ok(s)
}

/// The trace summary as a table: the launch shapes that cost the step the most first.
fn print_trace(t: &serde_json::Value) {
    let f = |v: &serde_json::Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.2}"));
    println!(
        "kernel trace of one decode step ({}): {} launches, {} blocks ({} dropped), {} µs from the first block's start \
         to the last one's end, {} µs of it with no traced block running; host wall {:.3} ms",
        t["file"].as_str().unwrap_or("?"),
        t["launches"],
        t["blocks"],
        t["dropped_blocks"],
        f(&t["span_us"]),
        f(&t["idle_us"]),
        t["step_wall_s"].as_f64().unwrap_or(f64::NAN) * 1e3
    );
    println!(
        "  {:<22} {:>6} {:>12} {:>10} {:>12} {:>14}",
        "launch[grid]", "count", "exposed µs", "each µs", "release µs", "after wait µs"
    );
    for r in t["by_launch"].as_array().into_iter().flatten() {
        println!(
            "  {:<22} {:>6} {:>12} {:>10} {:>12} {:>14}",
            r["launch"].as_str().unwrap_or("?"),
            r["count"],
            f(&r["exposed_us"]),
            f(&r["exposed_us_each"]),
            f(&r["release_us_mean"]),
            f(&r["after_wait_us_mean"])
        );
    }
}

pub fn run(a: &BenchArgs) -> anyhow::Result<ExitCode> {
    let backend = a.engine.backend_or(BackendArg::Reference);
    let (kind, mut opts) = a.engine.engine_options(backend)?;
    if a.json {
        opts.cuda.progress = None; // the kernel compile note: quiet under --json
    }
    opts.cuda.kernel_trace = a.trace.is_some();
    if a.n_prompt == 0 || a.reps == 0 {
        bail!("--n-prompt and --reps must be at least 1");
    }
    if a.trace.is_some() && (backend != BackendArg::Cuda || a.n_decode <= WARM_STEPS) {
        bail!("--trace needs --backend cuda and --n-decode over {WARM_STEPS} (it traces a replayed decode step)");
    }
    let file = open_model(&a.model)?;
    let vocab = references::ModelConfig::from_header(&file.header)?.vocab as u32;
    let tokens: Vec<u32> = (0..a.n_prompt as u32)
        .map(|i| (i.wrapping_mul(7919) + 100) % vocab)
        .collect();
    let best = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..a.reps {
            let t0 = Instant::now();
            f()?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let mut engine_backend = None;
    let mut comm = serde_json::Value::Null;
    let mut graphs = serde_json::Value::Null;
    let mut decode_check = serde_json::Value::Null;
    let mut trace = serde_json::Value::Null;
    // The token fed at decode step i.
    let decode_token = |i: u32| (i * 31 + 7) % vocab;
    // Prefill to the last token's logits only (as llama.cpp's prompt processing and `generate`):
    // engine backends; `prefill_s` is to every position's logits (as an HF forward).
    let mut prefill_last_s: Option<f64> = None;
    // Every decode step of a rep, warm-up included (the steady figure leaves out WARM_STEPS).
    let mut decode_with_warmup = f64::INFINITY;
    let warm_steps = if a.n_decode > WARM_STEPS { WARM_STEPS } else { 0 };
    let (prefill_s, decode_s) = match kind {
        None => {
            let r = Reference::new(&file)?;
            (
                best(&mut || r.forward(&tokens, &mut NoTap).map(|_| ()).map_err(Into::into))?,
                None,
            )
        }
        Some(_) => {
            let mut e = Engine::load(&file, opts)?;
            engine_backend = Some(e.backend_name());
            if e.backend_name() != "cpu" {
                eprintln!("backend: {}", e.backend_description());
            }
            e.reset_comm_stats();
            let prefill = best(&mut || e.prefill(&tokens, &mut NoTap).map(|_| ()).map_err(Into::into))?;
            let prefill_comm = e.comm_stats();
            prefill_last_s = Some(best(&mut || e.prefill_last(&tokens).map(|_| ()).map_err(Into::into))?);
            // A rep's decode: (the steady per-token time, the whole rep's wall, every step's
            // logits if `keep`, else the last step's only). The timed reps take each step's logits into one buffer, as
            // `generate` does (`Engine::decode_into`); kept, 48 fresh vocab-sized buffers cost
            // their page faults inside the timing.
            let decode_rep = |e: &mut Engine, keep: bool| -> anyhow::Result<(f64, f64, Vec<Vec<f32>>)> {
                e.prefill_last(&tokens)?;
                e.reset_comm_stats();
                let mut logits = Vec::with_capacity(a.n_decode);
                let mut step_logits = Vec::new();
                let t0 = Instant::now();
                let mut steady_t0 = t0;
                for i in 0..a.n_decode as u32 {
                    if i as usize == WARM_STEPS {
                        steady_t0 = Instant::now();
                    }
                    e.decode_into(decode_token(i), &mut NoTap, &mut step_logits)?;
                    if keep {
                        logits.push(std::mem::take(&mut step_logits));
                    }
                }
                let steady_steps = a.n_decode - warm_steps;
                let steady = steady_t0.elapsed().as_secs_f64() / steady_steps.max(1) as f64;
                let wall = t0.elapsed().as_secs_f64();
                if !keep {
                    logits.push(step_logits);
                }
                Ok((steady, wall, logits))
            };
            // On a device backend, decode is also timed with decode graphs off (one launch per
            // op), and the two runs' logits are compared.
            if a.n_decode > 0 && e.backend_name() != "cpu" {
                e.set_decode_graphs(false);
                let mut plain_best = f64::INFINITY;
                let mut plain_logits = Vec::new();
                for _ in 0..a.reps {
                    let (steady, _, l) = decode_rep(&mut e, true)?;
                    plain_best = plain_best.min(steady);
                    plain_logits = l;
                }
                e.set_decode_graphs(true);
                let (_, _, graph_logits) = decode_rep(&mut e, true)?;
                let max_abs = plain_logits
                    .iter()
                    .flatten()
                    .zip(graph_logits.iter().flatten())
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                let identical = plain_logits
                    .iter()
                    .flatten()
                    .zip(graph_logits.iter().flatten())
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                graphs = json!({"decode_plain_s_per_token": plain_best, "logits_bitwise_equal": identical,
                    "logits_max_abs_diff": max_abs, "steps_compared": plain_logits.len()});
            }
            let decode = if a.n_decode > 0 {
                let mut best_decode = f64::INFINITY;
                let mut last = Vec::new();
                for _ in 0..a.reps {
                    let (steady, wall, mut l) = decode_rep(&mut e, false)?;
                    last = l.pop().unwrap_or_default();
                    decode_with_warmup = decode_with_warmup.min(wall / a.n_decode as f64);
                    if steady < best_decode {
                        best_decode = steady;
                        // The all-reduce share of the best decode rep: whole calls (uploads of the
                        // partials, the collective, the download) and the collective alone.
                        if let Some(c) = e.comm_stats() {
                            comm["decode_allreduce_calls"] = json!(c.calls);
                            comm["decode_allreduce_s"] = json!(c.total_s);
                            comm["decode_collective_s"] = json!(c.collective_s);
                            comm["decode_allreduce_share"] = json!(c.total_s / wall);
                            comm["decode_collective_share"] = json!(c.collective_s / wall);
                        }
                    }
                }
                // The timed path against an independent one: the last step's logits against a
                // prefill of the prompt and every decoded token (GEMM and prefill attention in
                // place of GEMV and decode attention), so a fast wrong result does not pass as a
                // timing.
                let all: Vec<u32> = tokens
                    .iter()
                    .copied()
                    .chain((0..a.n_decode as u32).map(decode_token))
                    .collect();
                decode_check = check_decode(&last, &e.prefill_last(&all)?);
                if let Some(path) = &a.trace {
                    trace = trace_step(&mut e, &tokens, path)?;
                }
                Some(best_decode)
            } else {
                None
            };
            if let Some(c) = prefill_comm {
                // Summed over the reps; per rep below.
                let reps = a.reps as f64;
                comm["prefill_allreduce_s"] = json!(c.total_s / reps);
                comm["prefill_collective_s"] = json!(c.collective_s / reps);
            }
            (prefill, decode)
        }
    };
    let rss = peak_rss_kib();
    let doc = json!({
        "model": a.model.display().to_string(), "backend": backend.name(), "tp": a.engine.tp(),
        "injected": a.engine.injected(),
        "threads": rayon::current_num_threads(), "n_prompt": a.n_prompt, "prefill_s": prefill_s,
        "prefill_tok_s": a.n_prompt as f64 / prefill_s, "prefill_last_s": prefill_last_s,
        "prefill_last_tok_s": prefill_last_s.map(|s| a.n_prompt as f64 / s), "n_decode": a.n_decode,
        "decode_s_per_token": decode_s, "decode_tok_s": decode_s.map(|s| 1.0 / s),
        "decode_warm_steps": warm_steps,
        "decode_s_per_token_with_warmup": decode_s.map(|_| decode_with_warmup), "peak_rss_kib": rss,
        "model_bytes": file.file_size(), "engine_backend": engine_backend, "comm": comm,
        "decode_graphs": graphs, "decode_check": decode_check, "kernel_trace": trace,
    });
    if a.json {
        println!("{doc}");
    } else {
        println!(
            "prefill {} tokens: {:.3} s ({:.1} tok/s)",
            a.n_prompt,
            prefill_s,
            a.n_prompt as f64 / prefill_s
        );
        if let Some(p) = prefill_last_s {
            println!(
                "prefill {} tokens to the last token's logits: {:.3} s ({:.1} tok/s)",
                a.n_prompt,
                p,
                a.n_prompt as f64 / p
            );
        }
        if let Some(d) = decode_s {
            println!(
                "decode: {:.2} ms/token ({:.1} tok/s) after {warm_steps} warm-up steps; {:.2} ms/token with them",
                d * 1e3,
                1.0 / d,
                decode_with_warmup * 1e3
            );
        }
        if let Some(p) = graphs.get("decode_plain_s_per_token").and_then(|v| v.as_f64()) {
            println!(
                "decode without decode graphs: {:.2} ms/token; logits bitwise equal: {} (max abs diff {:.3e})",
                p * 1e3,
                graphs["logits_bitwise_equal"],
                graphs["logits_max_abs_diff"].as_f64().unwrap_or(f64::NAN)
            );
        }
        if let Some(r) = doc["decode_check"]["rel_l2"].as_f64() {
            println!(
                "decode check: the last step's logits against a prefill of the same tokens: rel_l2 {r:.2e} (tolerance {DECODE_CHECK_TOL:.0e})"
            );
        }
        if !trace.is_null() {
            print_trace(&trace);
        }
        if let Some(share) = comm.get("decode_allreduce_share").and_then(|v| v.as_f64()) {
            let coll = comm["decode_collective_share"].as_f64().unwrap_or(0.0);
            println!(
                "decode all-reduce: {:.1} % of decode wall time ({:.1} % in the collective itself)",
                share * 100.0,
                coll * 100.0
            );
        }
        if let Some(r) = rss {
            println!(
                "peak RSS {:.1} MiB (model file {:.1} MiB)",
                r as f64 / 1024.0,
                file.file_size() as f64 / (1 << 20) as f64
            );
        }
    }
    if doc["decode_check"]["pass"] == false {
        eprintln!(
            "bench: the decode steps' logits differ from a prefill's of the same tokens (rel_l2 {:.3e} > {DECODE_CHECK_TOL:.0e}): the decode timing is of a wrong result",
            doc["decode_check"]["rel_l2"].as_f64().unwrap_or(f64::NAN)
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};

    #[test]
    fn the_decode_check_fails_on_a_wrong_result() {
        let want: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.1).collect();
        let close: Vec<f32> = want.iter().map(|x| x * (1.0 + 1e-5)).collect();
        assert_eq!(check_decode(&close, &want)["pass"], true);
        // An output never written (zeros), a NaN, a shifted row: each fails.
        assert_eq!(check_decode(&vec![0.0; 1000], &want)["pass"], false);
        let mut nan = want.clone();
        nan[7] = f32::NAN;
        assert_eq!(check_decode(&nan, &want)["pass"], false);
        assert_eq!(check_decode(&want[1..], &want[..999])["pass"], false);
        assert_eq!(check_decode(&want[..10], &want)["pass"], false);
    }

    /// `llmdiff bench` on the tiny golden model on the CPU, with `extra` arguments.
    fn cpu_bench(extra: &[&str]) -> BenchArgs {
        let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../golden/deepseek-v3-tiny.f32.gguf");
        let argv = ["llmdiff", "bench", model, "--backend", "cpu"];
        let cli = <Cli as clap::Parser>::try_parse_from(argv.iter().chain(extra)).unwrap();
        let Command::Bench(a) = cli.command else {
            panic!("parsed as another command")
        };
        a
    }

    #[test]
    fn a_cpu_bench_passes_its_decode_check() {
        let a = cpu_bench(&["--n-prompt", "6", "--n-decode", "4", "--reps", "1", "--json"]);
        assert_eq!(run(&a).unwrap(), ExitCode::SUCCESS);
    }

    #[test]
    fn the_kernel_trace_is_refused_off_the_gpu() {
        let a = cpu_bench(&["--trace", "/nonexistent/t.json"]);
        let err = run(&a).unwrap_err().to_string();
        assert!(err.contains("--trace needs --backend cuda"), "{err}");
    }
}
