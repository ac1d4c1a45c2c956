//! `llmdiff kernels`: the CUDA kernels on their own. `--check` compiles every module (a compile
//! error names the kernel file) and runs each kernel against the CPU engine's on odd shapes;
//! `--bench` times the quantized GEMV against the device-to-device copy bandwidth of the same run
//! (the default path, then every compiled one-token GEMV variant of the type on the same weights,
//! the default marked; for Q4_K also the attention and output-head shapes 4096×4096, 1024×4096
//! and 32000×4096 with the default, its warp-rows variant and the pair-unit ones (mode 3)), the default Q4_K GEMV's loads
//! alone, with x's, and the same bytes as one stream (the bound the access pattern sets), the
//! prefill GEMM (tensor cores, 512 tokens, Q4_K) beside the SIMT matmul in TFLOP/s, the prefill
//! GQA attention (512 tokens, 32/8 heads of 128 and 9/3 of 64) per-(token, head) beside tiled
//! (CUDA cores, tensor cores) in µs, decode GQA attention (one token after 512 and 4096
//! positions) per-(token, head) beside split at each chunk length, and the per-launch cost of
//! the launch paths (cudarc's builder, raw `cuLaunchKernel`, a graph).
//! Without the `cuda` feature it says so (exit 2).

use crate::cli::KernelsArgs;
use std::process::ExitCode;

#[cfg(not(feature = "cuda"))]
pub fn run(_a: &KernelsArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("llmdiff kernels needs a build with --features cuda (and a GPU to run on)")
}

#[cfg(feature = "cuda")]
pub fn run(a: &KernelsArgs) -> anyhow::Result<ExitCode> {
    use engine::cuda::CudaBackend;
    use engine::cuda_kernels::{KernelId, GEMV_VARIANTS};
    use references::GgmlType;
    use serde_json::json;

    if !a.check && !a.bench {
        anyhow::bail!("give --check and/or --bench");
    }
    let be = CudaBackend::new()?;
    let (device, arch) = be.device();
    eprintln!("device: {device} ({arch})");
    let mut doc = json!({"device": device, "arch": arch, "backend": "cuda"});
    let mut failed = 0;
    if a.check {
        let loaded = be.modules_loaded();
        let modules: Vec<_> = KernelId::all()
            .into_iter()
            .map(|id| json!({"module": id.file(), "functions": id.functions().len(), "compiled": loaded.contains(&id)}))
            .collect();
        for &id in &loaded {
            eprintln!("compiled {} ({} entry points)", id.file(), id.functions().len());
        }
        let checks = be.self_check();
        for c in &checks {
            if !c.pass {
                failed += 1;
            }
            if !a.json {
                println!(
                    "{:<4} {:<58} rel_l2 {:.2e}  max_abs {:.2e}  (tol {:.0e})",
                    if c.pass { "ok" } else { "FAIL" },
                    c.case,
                    c.rel_l2,
                    c.max_abs,
                    c.tol
                );
            }
        }
        doc["modules"] = json!(modules);
        doc["checks"] = json!(checks
            .iter()
            .map(|c| json!({"case": c.case, "rel_l2": c.rel_l2, "max_abs": c.max_abs, "tol": c.tol, "pass": c.pass}))
            .collect::<Vec<_>>());
        if !a.json {
            println!("{} of {} kernel checks pass", checks.len() - failed, checks.len());
        }
    }
    if a.bench {
        let copy = be.copy_bandwidth(1 << 30, 5)?;
        let pct_of_copy = |bytes: usize, seconds: f64| bytes as f64 / seconds / copy * 100.0;
        if !a.json {
            println!(
                "device-to-device copy: {:.0} GB/s (read + write, 1 GiB, best of 5)",
                copy / 1e9
            );
        }
        let mut rows_out = Vec::new();
        let mut ns = vec![1usize];
        if a.bench_tokens > 1 {
            ns.push(a.bench_tokens);
        }
        for ty in [
            GgmlType::Q4K,
            GgmlType::Q8_0,
            GgmlType::Q4_1,
            GgmlType::F16,
            GgmlType::Q6K,
        ] {
            // Q4_1 also on smollm2-135m's FFN shapes (its layers' type).
            // Q4_K also on the 8B's attention and output shapes.
            let shapes: &[(usize, usize)] = match ty {
                GgmlType::Q4_1 => &[(4096, 14336), (14336, 4096), (1536, 576), (576, 1536)],
                GgmlType::Q4K => &[(4096, 14336), (14336, 4096), (4096, 4096), (1024, 4096), (32000, 4096)],
                // Q6_K: the 8B's Q4_K_M FFN down, attn_v and output.
                GgmlType::Q6K => &[(4096, 14336), (1024, 4096), (32000, 4096)],
                _ => &[(4096, 14336), (14336, 4096)],
            };
            for &(rows, cols) in shapes {
                // The default path at each n, then (n = 1) every compiled GEMV variant of the type
                // on the same weights, the default's marked `*`.
                let default = be.gemv_default(ty, rows, cols).map(|v| v.entry());
                for &n in &ns {
                    let mut vs = vec![None];
                    let extra = ty == GgmlType::Q4K && cols == 4096 && rows != 14336;
                    if n == 1 && extra {
                        // The extra Q4_K shapes: the default variant and the integer-form ones (modes 2
                        // and 3).
                        vs.extend(
                            GEMV_VARIANTS
                                .iter()
                                .filter(|v| v.ty == ty && (Some(v.entry()) == default || v.mode >= 2))
                                .map(|v| Some(*v)),
                        );
                    } else if n == 1 {
                        vs.extend(GEMV_VARIANTS.iter().filter(|v| v.ty == ty).map(|v| Some(*v)));
                    }
                    for r in be.bench_linear_variants(ty, rows, cols, n, 200, &vs)? {
                        let frac = r.gb_per_s * 1e9 / copy;
                        let is_default = r.variant.is_some() && r.variant == default;
                        if !a.json {
                            let label = match &r.variant {
                                None if n == 1 => {
                                    format!("{} [default: {}]", r.case, default.as_deref().unwrap_or("matvec"))
                                }
                                None => r.case.clone(),
                                Some(v) => format!("{} {v}", if is_default { "  *" } else { "   " }),
                            };
                            let prepass = r
                                .seconds_with_prepass
                                .map(|p| {
                                    format!("  (x pre-pass each launch: {:>5.1} %)", pct_of_copy(r.weight_bytes, p))
                                })
                                .unwrap_or_default();
                            println!(
                                "{:<64} {:>8.2} µs  {:>7.0} GB/s of weights  {:>5.1} % of copy{prepass}",
                                label,
                                r.seconds * 1e6,
                                r.gb_per_s,
                                frac * 100.0
                            );
                        }
                        rows_out.push(json!({"case": r.case, "variant": r.variant, "default": is_default,
                            "weight_bytes": r.weight_bytes, "seconds": r.seconds, "gb_per_s": r.gb_per_s,
                            "fraction_of_copy": frac, "seconds_with_prepass": r.seconds_with_prepass,
                            "fraction_of_copy_with_prepass": r.seconds_with_prepass.map(|p| pct_of_copy(r.weight_bytes, p) / 100.0)}));
                    }
                }
            }
        }
        // The default Q4_K GEMV's loads alone (no arithmetic), with and without x's limb loads,
        // then the same bytes as one stream: the bound its access pattern sets, beside the copy
        // bandwidth.
        let mut probe_out = Vec::new();
        for (rows, cols) in [(4096usize, 14336usize), (14336, 4096)] {
            for r in be.bench_read_probe(rows, cols, 200)? {
                let frac = r.gb_per_s * 1e9 / copy;
                if !a.json {
                    println!(
                        "{:<44} {:<14} {:>8.2} µs  {:>7.0} GB/s of weights  {:>5.1} % of copy",
                        r.case,
                        r.variant.as_deref().unwrap_or(""),
                        r.seconds * 1e6,
                        r.gb_per_s,
                        frac * 100.0
                    );
                }
                probe_out.push(
                    json!({"case": r.case, "pattern": r.variant, "weight_bytes": r.weight_bytes,
                    "seconds": r.seconds, "gb_per_s": r.gb_per_s, "fraction_of_copy": frac}),
                );
            }
        }
        doc["read_probe"] = json!(probe_out);
        // Prefill-shaped products (512 tokens, the 8B's FFN and attention shapes, and its FFN down
        // in F16): the tensor-core GEMM beside the SIMT matmul.
        let mut gemm_out = Vec::new();
        for (ty, rows, cols) in [
            (GgmlType::Q4K, 4096usize, 14336usize),
            (GgmlType::Q4K, 14336, 4096),
            (GgmlType::Q4K, 4096, 4096),
            (GgmlType::F16, 4096, 14336),
            (GgmlType::Q6K, 4096, 14336),
        ] {
            let r = be.bench_gemm(ty, rows, cols, 512)?;
            if !a.json {
                let parts: Vec<String> = r
                    .paths
                    .iter()
                    .map(|(p, s, tf)| format!("{p} {:>8.1} µs {:>6.1} TFLOP/s", s * 1e6, tf))
                    .collect();
                println!("{:<44} {}", r.case, parts.join("   "));
            }
            let paths: Vec<_> = r
                .paths
                .iter()
                .map(|(p, s, tf)| json!({"path": p, "seconds": s, "tflops": tf}))
                .collect();
            gemm_out.push(json!({"case": r.case, "paths": paths}));
        }
        doc["gemm_bench"] = json!(gemm_out);
        // Prefill attention, 512 tokens, at the 8B's 32/8 heads of 128 and SmolLM2's 9/3 of 64: the
        // per-(token, head) kernel beside the tiled ones (CUDA cores, tensor cores).
        let mut attn_out = Vec::new();
        for (h, kv, hd) in [(32, 8, 128), (9, 3, 64)] {
            let r = be.bench_attention(512, h, kv, hd, 20)?;
            if !a.json {
                println!(
                    "{:<44} per-(token, head) {:>8.1} µs   tiled {:>8.1} µs   tensor-core {:>8.1} µs ({:.1}x faster than tiled)",
                    r.case,
                    r.old_s * 1e6,
                    r.tiled_s * 1e6,
                    r.tc_s * 1e6,
                    r.tiled_s / r.tc_s
                );
            }
            attn_out.push(
                json!({"case": r.case, "old_seconds": r.old_s, "tiled_seconds": r.tiled_s,
                "tc_seconds": r.tc_s}),
            );
        }
        doc["attention_bench"] = json!(attn_out);
        // Decode attention (the 8B's 32/8 heads of 128, one token after 512 and 4096 positions):
        // the per-(token, head) kernel beside the split one at each chunk length.
        let mut dec = Vec::new();
        for ctx in [512usize, 4096] {
            let r = be.bench_attention_decode(ctx, 32, 8, 128, 50)?;
            if !a.json {
                let parts: Vec<String> = r
                    .split_s
                    .iter()
                    .map(|(c, s)| format!("L={c} {:>6.1} µs ({:.1}x)", s * 1e6, r.old_s / s))
                    .collect();
                println!(
                    "{:<44} per-(token, head) {:>8.1} µs   split {}",
                    r.case,
                    r.old_s * 1e6,
                    parts.join("  ")
                );
            }
            let split: Vec<_> = r
                .split_s
                .iter()
                .map(|(c, s)| json!({"chunk": c, "seconds": s}))
                .collect();
            dec.push(json!({"case": r.case, "old_seconds": r.old_s, "split": split}));
        }
        doc["attention_decode_bench"] = json!(dec);
        let lc = be.launch_cost(5000)?;
        if !a.json {
            println!(
                "launch cost (µs per launch of an empty kernel, {} launches; host enqueue / until done): \
                 cudarc builder {:.2} / {:.2}, raw cuLaunchKernel {:.2} / {:.2}, builder with 3 args {:.2} / {:.2}, \
                 one CUDA graph of them {:.3} per node ({:.1} µs for the cuGraphLaunch call)",
                lc.n,
                lc.builder_host_us,
                lc.builder_total_us,
                lc.raw_host_us,
                lc.raw_total_us,
                lc.args_host_us,
                lc.args_total_us,
                lc.graph_total_us,
                lc.graph_launch_host_us
            );
        }
        doc["launch_cost_us"] = json!({"n": lc.n, "builder_host": lc.builder_host_us, "builder_total": lc.builder_total_us,
            "raw_host": lc.raw_host_us, "raw_total": lc.raw_total_us, "args_host": lc.args_host_us,
            "args_total": lc.args_total_us, "graph_launch_host": lc.graph_launch_host_us, "graph_total_per_node": lc.graph_total_us});
        doc["copy_gb_per_s"] = json!(copy / 1e9);
        doc["bench"] = json!(rows_out);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
