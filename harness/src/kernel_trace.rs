//! `bench --trace`: where one decode step's device time goes, from the engine's kernel trace
//! (`engine::BlockTrace`, a record per block of every traced kernel: start, the return of its
//! wait for the kernel before it, end). Blocks are grouped into launches, each launch is placed
//! against the one before it, and the step is written as a Chrome trace (chrome://tracing,
//! Perfetto): the launches on one track, every block on its SM's track.
//!
//! Per launch k, with end(k−1) the last block end of the launch before it:
//! - `exposed` = end(k) − end(k−1): how much later the step ends for having launch k; the
//!   launches' exposed times sum to the step's traced span;
//! - `release` = first wait return(k) − end(k−1): from the kernel before finishing to this one's
//!   first block going past its wait (completion, memory flush and the dependent launch's
//!   release; kernels that never wait have none);
//! - `after_wait` = end(k) − first wait return(k): the part of the launch that had to wait.

use engine::BlockTrace;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// One kernel launch's blocks, summarized.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub kernel: &'static str,
    pub grid: u32,
    /// Blocks traced (the grid's, unless the trace ran out of room).
    pub blocks: usize,
    pub start: u64,
    /// The first block's return from its wait, if any block waited.
    pub wait: Option<u64>,
    pub end: u64,
}

impl Launch {
    /// "kernel[grid]": launches of one kernel family with one grid are one shape of one op.
    pub fn label(&self) -> String {
        format!("{}[{}]", self.kernel, self.grid)
    }
}

/// The blocks grouped into launches, in launch order. A kernel launched early (programmatic
/// dependent launch) starts its blocks only once every block of the one before it has started,
/// so in start order a launch's blocks come together: a run of one (kernel, grid) of at most
/// `grid` blocks.
pub fn launches(blocks: &[BlockTrace]) -> Vec<Launch> {
    let mut sorted: Vec<&BlockTrace> = blocks.iter().collect();
    sorted.sort_by_key(|b| (b.start, b.end));
    let mut out: Vec<Launch> = Vec::new();
    for b in sorted {
        match out.last_mut() {
            Some(l) if l.kernel == b.kernel && l.grid == b.grid && l.blocks < b.grid as usize => {
                l.blocks += 1;
                l.end = l.end.max(b.end);
                l.wait = match (l.wait, b.wait) {
                    (Some(x), Some(y)) => Some(x.min(y)),
                    (x, y) => x.or(y),
                };
            }
            _ => out.push(Launch {
                kernel: b.kernel,
                grid: b.grid,
                blocks: 1,
                start: b.start,
                wait: b.wait,
                end: b.end,
            }),
        }
    }
    out
}

/// Each launch against the one before it (the module docs): its exposed time and its release,
/// in ns (the first launch is measured from its own start).
fn placed(ls: &[Launch]) -> Vec<(u64, Option<i64>)> {
    let mut prev_end = ls.first().map_or(0, |l| l.start);
    ls.iter()
        .map(|l| {
            let p = (
                l.end.saturating_sub(prev_end),
                l.wait.map(|w| w as i64 - prev_end as i64),
            );
            prev_end = prev_end.max(l.end);
            p
        })
        .collect()
}

/// Nanoseconds to microseconds.
fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

/// Time within [first start, last end] that no traced block was running: host work, untraced
/// kernels and copies, and launch gaps.
fn idle_ns(blocks: &[BlockTrace]) -> u64 {
    let mut iv: Vec<(u64, u64)> = blocks.iter().map(|b| (b.start, b.end.max(b.start))).collect();
    iv.sort_unstable();
    let (mut idle, mut reach) = (
        0,
        match iv.first() {
            Some(&(s, _)) => s,
            None => return 0,
        },
    );
    for (s, e) in iv {
        idle += s.saturating_sub(reach);
        reach = reach.max(e);
    }
    idle
}

/// Per launch shape ("kernel[grid]"), in order of total exposed time: launches, exposed time
/// (total and mean), mean release and mean after-wait (µs), plus the step's totals.
pub fn summary(blocks: &[BlockTrace], dropped: usize) -> Value {
    let ls = launches(blocks);
    #[derive(Default)]
    struct Acc {
        n: usize,
        exposed: u64,
        release: Vec<i64>,
        after: Vec<u64>,
    }
    let mut by: BTreeMap<String, Acc> = BTreeMap::new();
    for (l, (exposed, release)) in ls.iter().zip(placed(&ls)) {
        let a = by.entry(l.label()).or_default();
        a.n += 1;
        a.exposed += exposed;
        if let (Some(w), Some(r)) = (l.wait, release) {
            a.release.push(r);
            a.after.push(l.end.saturating_sub(w));
        }
    }
    let mean = |v: &[f64]| {
        if v.is_empty() {
            None
        } else {
            Some(v.iter().sum::<f64>() / v.len() as f64)
        }
    };
    let mut rows: Vec<Value> = by
        .into_iter()
        .map(|(label, a)| {
            let rel: Vec<f64> = a.release.iter().map(|&r| r as f64 / 1e3).collect();
            let aft: Vec<f64> = a.after.iter().map(|&x| us(x)).collect();
            json!({"launch": label, "count": a.n, "exposed_us": us(a.exposed),
                "exposed_us_each": us(a.exposed) / a.n as f64, "release_us_mean": mean(&rel),
                "after_wait_us_mean": mean(&aft)})
        })
        .collect();
    rows.sort_by(|x, y| y["exposed_us"].as_f64().partial_cmp(&x["exposed_us"].as_f64()).unwrap());
    let span = match (ls.first(), ls.iter().map(|l| l.end).max()) {
        (Some(f), Some(e)) => e.saturating_sub(f.start),
        _ => 0,
    };
    json!({"blocks": blocks.len(), "dropped_blocks": dropped, "launches": ls.len(), "span_us": us(span),
        "idle_us": us(idle_ns(blocks)), "by_launch": rows})
}

/// The step as a Chrome trace (JSON object format; times in µs from the first block's start):
/// process 0 holds the launches, process 1 a track per SM with its blocks.
pub fn chrome_trace(blocks: &[BlockTrace]) -> Value {
    let t0 = blocks.iter().map(|b| b.start).min().unwrap_or(0);
    let at = |t: u64| us(t.saturating_sub(t0));
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "launches"}}),
        json!({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "SMs"}}),
    ];
    let ls = launches(blocks);
    for (i, (l, (exposed, release))) in ls.iter().zip(placed(&ls)).enumerate() {
        events.push(
            json!({"name": l.label(), "ph": "X", "pid": 0, "tid": 0, "ts": at(l.start),
            "dur": us(l.end.saturating_sub(l.start)), "args": {"launch": i, "blocks": l.blocks,
            "release_us": release.map(|r| r as f64 / 1e3), "exposed_us": us(exposed)}}),
        );
    }
    for b in blocks {
        events.push(
            json!({"name": b.kernel, "ph": "X", "pid": 1, "tid": b.sm, "ts": at(b.start),
            "dur": us(b.end.saturating_sub(b.start)), "args": {"block": b.block, "grid": b.grid,
            "wait_us": b.wait.map(|w| us(w.saturating_sub(b.start)))}}),
        );
    }
    json!({"traceEvents": events, "displayTimeUnit": "ns"})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(kernel: &'static str, block: u32, grid: u32, start: u64, wait: Option<u64>, end: u64) -> BlockTrace {
        BlockTrace {
            kernel,
            block,
            grid,
            sm: block % 4,
            start,
            wait,
            end,
        }
    }

    /// A norm (1 block), a GEMV of 3 blocks started early under it, then the same GEMV again.
    fn step() -> Vec<BlockTrace> {
        vec![
            block("rms_norm", 0, 1, 0, Some(100), 1_000),
            block("gemv", 1, 3, 200, Some(1_500), 5_000),
            block("gemv", 0, 3, 150, Some(1_400), 4_000),
            block("gemv", 2, 3, 300, Some(1_600), 6_000),
            block("gemv", 0, 3, 5_500, Some(6_800), 9_000),
            block("gemv", 1, 3, 5_600, Some(6_900), 8_000),
            block("gemv", 2, 3, 5_700, Some(7_000), 8_500),
        ]
    }

    #[test]
    fn blocks_group_into_launches_by_start_order_and_grid() {
        let ls = launches(&step());
        assert_eq!(ls.len(), 3);
        assert_eq!((ls[0].kernel, ls[0].blocks, ls[0].end), ("rms_norm", 1, 1_000));
        assert_eq!(
            (ls[1].blocks, ls[1].start, ls[1].wait, ls[1].end),
            (3, 150, Some(1_400), 6_000)
        );
        assert_eq!(
            (ls[2].blocks, ls[2].start, ls[2].wait, ls[2].end),
            (3, 5_500, Some(6_800), 9_000)
        );
    }

    #[test]
    fn exposed_times_sum_to_the_span_and_releases_are_measured_from_the_previous_end() {
        let s = summary(&step(), 0);
        assert_eq!(s["span_us"], 9.0);
        assert_eq!(s["launches"], 3);
        let rows = s["by_launch"].as_array().unwrap();
        let total: f64 = rows.iter().map(|r| r["exposed_us"].as_f64().unwrap()).sum();
        assert!((total - 9.0).abs() < 1e-9, "{total}");
        let gemv = rows.iter().find(|r| r["launch"] == "gemv[3]").unwrap();
        assert_eq!(gemv["count"], 2);
        assert_eq!(gemv["exposed_us"], 8.0);
        // Releases: 1400 − 1000 and 6800 − 6000 ns.
        assert!((gemv["release_us_mean"].as_f64().unwrap() - 0.6).abs() < 1e-9);
        // After the wait: 6000 − 1400 and 9000 − 6800 ns.
        assert!((gemv["after_wait_us_mean"].as_f64().unwrap() - 3.4).abs() < 1e-9);
        assert_eq!(s["idle_us"], 0.0);
    }

    #[test]
    fn idle_time_is_where_no_block_runs() {
        let b = vec![
            block("gemv", 0, 1, 0, None, 100),
            block("rms_norm", 0, 1, 350, None, 400),
        ];
        assert_eq!(idle_ns(&b), 250);
        assert_eq!(idle_ns(&[]), 0);
    }

    #[test]
    fn the_chrome_trace_has_a_launch_track_and_a_track_per_sm() {
        let t = chrome_trace(&step());
        let ev = t["traceEvents"].as_array().unwrap();
        assert_eq!(ev.iter().filter(|e| e["pid"] == 0 && e["ph"] == "X").count(), 3);
        assert_eq!(ev.iter().filter(|e| e["pid"] == 1 && e["ph"] == "X").count(), 7);
        let first_gemv = ev.iter().find(|e| e["name"] == "gemv[3]").unwrap();
        assert_eq!(first_gemv["ts"], 0.15);
        assert_eq!(first_gemv["args"]["release_us"], 0.4);
    }
}
