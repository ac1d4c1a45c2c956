//! Single-thread dequantization throughput per type, reference (`references::dequant`) against the
//! engine's fast path (`engine::dequant`), on 4 Mi elements (`$LLMDIFF_BENCH_ELEMS` overrides).
//! Criterion reports elements/s (from mean times); a best-of-30 table follows it, the robust figure
//! on a shared machine. `cargo bench -p engine --bench dequant -- NONE` prints only the table.
//! Compare with gguf-py: `tests/peers/bench_gguf_py.py` (also best-of-N).

use criterion::{black_box, criterion_group, Criterion, Throughput};
use references::GgmlType;
use std::time::Duration;

/// 4 Mi elements, or `$LLMDIFF_BENCH_ELEMS` (rounded down to whole k-quant blocks).
fn n_elems() -> usize {
    let n = std::env::var("LLMDIFF_BENCH_ELEMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1usize << 22);
    (n / 256).max(1) * 256
}

/// Random blocks with sane f16 scales at the d/m offsets (no inf/NaN/subnormal slow paths).
fn make_src(ty: GgmlType, n_elems: usize) -> Vec<u8> {
    let mut state = 0x5EED_u64 ^ ty.id() as u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let n_bytes = ty.bytes_for(n_elems as u64).expect("whole blocks") as usize;
    let mut src: Vec<u8> = (0..n_bytes).map(|_| next() as u8).collect();
    let halves: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        GgmlType::IQ4NL | GgmlType::IQ4XS => &[0],
        GgmlType::IQ1S | GgmlType::IQ2XXS | GgmlType::IQ2XS | GgmlType::IQ2S => &[0],
        GgmlType::IQ3XXS | GgmlType::IQ3S => &[0],
        GgmlType::TQ1_0 => &[52],
        GgmlType::TQ2_0 => &[64],
        GgmlType::IQ1M => {
            // d is the top nibbles of the four u16 scale words (bytes 48..56): a small finite one.
            for b in src.chunks_exact_mut(56) {
                let d = half::f16::from_f32(0.01 + (b[0] % 16) as f32 * 1e-3).to_bits();
                for i in 0..4 {
                    b[49 + 2 * i] = (b[49 + 2 * i] & 0x0F) | ((((d >> (4 * i)) & 0xF) as u8) << 4);
                }
            }
            &[]
        }
        GgmlType::MXFP4 => {
            for b in src.chunks_exact_mut(17) {
                b[0] = 120 + b[0] % 8; // e8m0 scales near 1
            }
            &[]
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for c in src.chunks_exact_mut(2) {
                c[1] &= 0x3F; // small finite values
            }
            &[]
        }
        GgmlType::F32 => {
            for c in src.chunks_exact_mut(4) {
                c[3] &= 0x3F;
            }
            &[]
        }
    };
    for block in src.chunks_exact_mut(ty.block_bytes()) {
        for &off in halves {
            let v = half::f16::from_f32((next() % 1000) as f32 * 1e-4 - 0.05);
            block[off..off + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    src
}

fn bench(c: &mut Criterion) {
    let n = n_elems();
    let mut dst = vec![0.0f32; n];
    for ty in GgmlType::ALL.into_iter().chain(GgmlType::DEQUANT_ONLY) {
        let src = make_src(ty, n);
        let mut g = c.benchmark_group(format!("dequant/{}", ty.name()));
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function("reference", |b| {
            b.iter(|| references::dequant::dequantize(ty, black_box(&src), black_box(&mut dst)).unwrap())
        });
        g.bench_function("engine", |b| {
            b.iter(|| engine::dequant::dequantize(ty, black_box(&src), black_box(&mut dst)).unwrap())
        });
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}

/// Best-of-N wall time per call, printed as a table after criterion's (mean-based) report. On a
/// shared, loaded machine the minimum is the robust figure; tests/peers/bench_gguf_py.py reports
/// gguf-py's minimum the same way.
fn best_of_table() {
    let n = n_elems();
    let mut dst = vec![0.0f32; n];
    let reps = 30;
    println!("\nbest of {reps}, {n} elements, single thread:");
    println!(
        "{:7} {:>12} {:>12} {:>8}",
        "type", "ref Gelem/s", "fast Gelem/s", "fast/ref"
    );
    for ty in GgmlType::ALL.into_iter().chain(GgmlType::DEQUANT_ONLY) {
        let src = make_src(ty, n);
        let mut best = |f: &mut dyn FnMut(&[u8], &mut [f32])| {
            (0..reps)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f(black_box(&src), black_box(&mut dst));
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let r = best(&mut |s, d| references::dequant::dequantize(ty, s, d).unwrap());
        let e = best(&mut |s, d| engine::dequant::dequantize(ty, s, d).unwrap());
        println!(
            "{:7} {:>12.3} {:>12.3} {:>8.1}",
            ty.name(),
            n as f64 / r / 1e9,
            n as f64 / e / 1e9,
            r / e
        );
    }
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    best_of_table();
}
