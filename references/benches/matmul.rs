//! The reference matmul (`references::forward::ops::matmul_t`, f64 accumulation) in GFLOP/s on
//! SmolLM2-135M's shapes and the 8B llama's at 64 tokens, against this machine's f64 FMA peak
//! measured in the same run at the same thread count (independent FMA chains on every rayon
//! thread: the physical bound for f64 accumulation). After criterion's report a best-of-N table
//! prints the ratio for 1, 2, 4, ... threads up to every logical CPU, and how many of those are
//! physical cores (hyper-threads share one core's FMA units). `cargo bench -p references --bench
//! matmul -- NONE` prints only the tables; `MATMUL_THREADS=1,16` picks the thread counts.
//!
//! On a shared machine the wall clock counts the time other processes held the cores, so the
//! table also gives the share measured in CPU time (`clock_gettime`'s thread and process CPU
//! clocks, for the peak and the matmul alike): what the code achieves while it has the cores. On
//! an idle machine the two agree.

use criterion::{black_box, criterion_group, Criterion, Throughput};
use references::forward::ops::matmul_t;
use std::time::{Duration, Instant};

/// (name, k, m): the SmolLM2-135M projections (d 576, kv 192, ffn 1536) and a vocab chunk.
const SHAPES: [(&str, usize, usize); 5] = [
    ("q/o 576x576", 576, 576),
    ("k/v 576x192", 576, 192),
    ("gate/up 576x1536", 576, 1536),
    ("down 1536x576", 1536, 576),
    ("lm_head chunk 576x8192", 576, 8192),
];
/// The 8B llama's projections (d 4096, kv 1024, ffn 14336), in the thread tables only.
const SHAPES_8B: [(&str, usize, usize); 3] = [
    ("8B q/o 4096x4096", 4096, 4096),
    ("8B gate/up 4096x14336", 4096, 14336),
    ("8B down 14336x4096", 14336, 4096),
];
const N_TOKENS: usize = 64;

fn data(len: usize, seed: u32) -> Vec<f32> {
    (0..len).map(|i| ((i as u32 ^ seed) as f32 * 0.618).sin()).collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("reference-matmul");
    g.sample_size(20).measurement_time(Duration::from_secs(3));
    for (name, k, m) in SHAPES {
        let (x, w) = (data(N_TOKENS * k, 1), data(m * k, 2));
        g.throughput(Throughput::Elements((2 * N_TOKENS * k * m) as u64));
        g.bench_function(name, |b| {
            b.iter(|| matmul_t(black_box(&x), N_TOKENS, k, black_box(&w), m))
        });
    }
    g.finish();
}

/// Seconds for `iters` rounds of 16 independent 8-lane f64 FMAs on one thread.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn fma_loop_avx512(iters: usize) -> f64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_pd(1.0); 16];
    let (a, b) = (_mm512_set1_pd(0.999_999), _mm512_set1_pd(1e-9));
    let t0 = Instant::now();
    for _ in 0..iters {
        for r in acc.iter_mut() {
            *r = _mm512_fmadd_pd(*r, a, b);
        }
    }
    black_box(acc);
    t0.elapsed().as_secs_f64()
}

/// The f64 FMA peak in GFLOP/s over all rayon threads by the wall clock and by CPU time
/// (AVX-512 builds only; None elsewhere).
fn fma_peak_gflops() -> Option<(f64, f64)> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        let iters = 20_000_000;
        // SAFETY: the CPU supports AVX-512F and FMA, checked just above.
        let best = |_: rayon::BroadcastContext<'_>| {
            (0..5)
                .map(|_| {
                    let cpu0 = cpu_secs(true);
                    let wall = unsafe { fma_loop_avx512(iters) };
                    (wall, cpu_secs(true).map_or(wall, |c| c - cpu0.unwrap_or(0.0)))
                })
                .fold((f64::MAX, f64::MAX), |a, b| (a.0.min(b.0), a.1.min(b.1)))
        };
        let secs: Vec<(f64, f64)> = rayon::broadcast(best);
        let flops = (iters * 16 * 8 * 2) as f64;
        let sum = |f: fn(&(f64, f64)) -> f64| secs.iter().map(|s| flops / f(s)).sum::<f64>() / 1e9;
        return Some((sum(|s| s.0), sum(|s| s.1)));
    }
    None
}

/// CPU seconds so far of this thread (`thread`) or of the whole process (unix; None elsewhere).
fn cpu_secs(thread: bool) -> Option<f64> {
    #[cfg(unix)]
    {
        let clock = if thread {
            libc::CLOCK_THREAD_CPUTIME_ID
        } else {
            libc::CLOCK_PROCESS_CPUTIME_ID
        };
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid timespec to write.
        if unsafe { libc::clock_gettime(clock, &mut ts) } == 0 {
            return Some(ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9);
        }
    }
    let _ = thread;
    None
}

/// Physical cores (distinct core ids over packages) and logical CPUs, from Linux's sysfs.
fn cores() -> (Option<usize>, usize) {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut ids = std::collections::BTreeSet::new();
    for cpu in 0..logical {
        let base = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let read = |f: &str| std::fs::read_to_string(format!("{base}/{f}")).ok();
        if let (Some(p), Some(c)) = (read("physical_package_id"), read("core_id")) {
            ids.insert((p.trim().to_string(), c.trim().to_string()));
        }
    }
    ((!ids.is_empty()).then_some(ids.len()), logical)
}

fn thread_counts(logical: usize) -> Vec<usize> {
    if let Ok(v) = std::env::var("MATMUL_THREADS") {
        return v
            .split(',')
            .filter_map(|t| t.trim().parse().ok())
            .filter(|&t| t > 0)
            .collect();
    }
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |t| Some(t * 2))
        .take_while(|&t| t < logical)
        .collect();
    v.push(logical);
    v
}

fn table(threads: usize) {
    let peak = fma_peak_gflops();
    println!("\nreference matmul, {N_TOKENS} tokens, {threads} threads");
    match peak {
        Some((p, c)) => println!(
            "f64 FMA peak (measured now, {threads} threads): {p:.1} GFLOP/s by the wall clock, {c:.1} by CPU time"
        ),
        None => println!("f64 FMA peak: not measured (no AVX-512 here)"),
    }
    println!(
        "{:<24} {:>10} {:>10} {:>8} {:>12} {:>8}",
        "shape (k x m)", "ms", "GFLOP/s", "of peak", "CPU GFLOP/s", "of peak"
    );
    for (name, k, m) in SHAPES.iter().chain(&SHAPES_8B).copied() {
        let (x, w) = (data(N_TOKENS * k, 1), data(m * k, 2));
        let reps = if k * m > 10_000_000 { 3 } else { 20 };
        let (best, best_cpu) = (0..reps)
            .map(|_| {
                let (t0, cpu0) = (Instant::now(), cpu_secs(false));
                black_box(matmul_t(&x, N_TOKENS, k, &w, m));
                let wall = t0.elapsed().as_secs_f64();
                (wall, cpu_secs(false).map_or(wall, |c| c - cpu0.unwrap_or(0.0)))
            })
            .fold((f64::MAX, f64::MAX), |a, b| (a.0.min(b.0), a.1.min(b.1)));
        let gf = (2 * N_TOKENS * k * m) as f64 / best / 1e9;
        // CPU time of the process (the pool's threads): GFLOP/s per core, times the thread count.
        let gf_cpu = (2 * N_TOKENS * k * m) as f64 / best_cpu * threads as f64 / 1e9;
        let share = |g: f64, p: Option<f64>| p.map_or("-".into(), |p| format!("{:.0} %", 100.0 * g / p));
        println!(
            "{name:<24} {:>10.3} {gf:>10.1} {:>8} {gf_cpu:>12.1} {:>8}",
            best * 1e3,
            share(gf, peak.map(|p| p.0)),
            share(gf_cpu, peak.map(|p| p.1))
        );
    }
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let (physical, logical) = cores();
    println!(
        "\nCPUs: {logical} logical, {} physical cores",
        physical.map_or("?".to_string(), |p| p.to_string())
    );
    for t in thread_counts(logical) {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .expect("a rayon pool");
        pool.install(|| table(t));
    }
}
