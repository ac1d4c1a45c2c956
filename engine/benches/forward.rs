//! Engine throughput on the SmolLM2-135M-shaped synth (30 layers, d 576, 9/3 heads, vocab
//! 49152): prefill of 64 tokens, and decode steps over a 64-token cache, at TP 1 and TP 3.
//! The weights are Q8_0 (the synth's quantizer does not write Q4_1 yet); shards are f32 at TP 1
//! and 3, and quantized (the default storage) at TP 1.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use engine::{Engine, EngineOptions, WeightStorage};
use references::synth::{preset, write_model};
use references::tap::NoTap;
use references::{GgmlType, GgufFile};
use std::time::Duration;

fn model() -> (tempfile::TempDir, GgufFile) {
    let mut spec = preset("smollm2-135m").expect("preset");
    spec.weight_type = GgmlType::Q8_0;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("smollm2-synth.gguf");
    let f = std::fs::File::create(&path).expect("create");
    write_model(&spec, 1, std::io::BufWriter::new(f), |_, _| {}).expect("synth");
    let file = GgufFile::open(&path).expect("open");
    (dir, file)
}

fn bench(c: &mut Criterion) {
    let (_dir, file) = model();
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 7919 + 11) % 49152).collect();
    let mut g = c.benchmark_group("smollm2-135m-synth");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(10))
        .warm_up_time(Duration::from_secs(2));
    for (tp, storage) in [
        (1, WeightStorage::F32),
        (3, WeightStorage::F32),
        (1, WeightStorage::Quantized),
    ] {
        let opts = EngineOptions {
            tp,
            storage,
            ..Default::default()
        };
        let mut e = Engine::load(&file, opts).expect("load");
        let tag = format!("tp{tp}-{}", if storage == WeightStorage::F32 { "f32" } else { "quant" });
        g.throughput(Throughput::Elements(prompt.len() as u64));
        g.bench_function(format!("prefill64/{tag}"), |b| {
            b.iter(|| e.prefill(&prompt, &mut NoTap).expect("prefill"))
        });
        g.throughput(Throughput::Elements(1));
        g.bench_function(format!("decode/{tag}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for i in 0..iters {
                    if i % 64 == 0 {
                        e.prefill(&prompt, &mut NoTap).expect("prefill");
                    }
                    let t0 = std::time::Instant::now();
                    e.decode((i % 49152) as u32, &mut NoTap).expect("decode");
                    total += t0.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
