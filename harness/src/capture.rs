//! Lockstep capture: the engine and the reference run in their own threads and send each tap
//! they record over a bounded channel; the comparator joins them on the key as they arrive.
//! The side that is ahead blocks once it is more than a layer ahead, so memory stays about two
//! layers of taps, whatever the model size. One exception: while the engine loads its weights
//! (before its first tap) the reference runs ahead, up to 1 GiB of taps held by the comparator,
//! so the load overlaps the reference's pass.
//!
//! A weight tap carries the rows it holds when the diff asked for a sample of them
//! ([`crate::weight_rows`]). [`StitchTap`] joins an engine's prefill and decode-step taps into
//! one prefill's before they go on.

use crate::weight_rows::WeightSampling;
use references::tap::{Site, Tap, TapKey};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One recorded tensor.
#[derive(Clone, Debug)]
pub struct Captured {
    pub key: TapKey,
    /// The whole tensor's shape, also where `rows` holds a sample of it.
    pub shape: [usize; 2],
    /// Every row, or the rows `rows` only (`[rows.len(), shape[1]]`).
    pub data: Vec<f32>,
    /// A weight taken on a sample of its rows ([`crate::weight_rows`]): which rows `data`
    /// holds, ascending; `None` for every row.
    pub rows: Option<Vec<usize>>,
}

impl Captured {
    /// A tensor with every row.
    pub fn whole(key: TapKey, shape: [usize; 2], data: Vec<f32>) -> Captured {
        Captured {
            key,
            shape,
            data,
            rows: None,
        }
    }
}

/// Which side sent a tap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Engine,
    Reference,
}

/// A tap that forwards copies over a channel until told to stop, timing what capture costs its
/// side: `capture` from the side asking for a key (`wants`) to that key's tap handed over (the
/// weight a side dequantizes for its tap, the copy), `wait` blocked on a full channel (the
/// comparator is behind).
pub struct ChannelTap {
    tx: SyncSender<Captured>,
    stop: Arc<AtomicBool>,
    filter: fn(&TapKey) -> bool,
    /// Which rows of a weight to ask for.
    sampling: Arc<WeightSampling>,
    /// The key last asked for and when.
    asked: Cell<Option<(TapKey, Instant)>>,
    capture: Duration,
    wait: Duration,
}

impl ChannelTap {
    fn new(
        tx: SyncSender<Captured>,
        stop: Arc<AtomicBool>,
        filter: fn(&TapKey) -> bool,
        sampling: Arc<WeightSampling>,
    ) -> Self {
        ChannelTap {
            tx,
            stop,
            filter,
            sampling,
            asked: Cell::new(None),
            capture: Duration::ZERO,
            wait: Duration::ZERO,
        }
    }

    /// When `key` was asked for, if it was the last key asked for (a side that plans its taps
    /// ahead asks for many keys at once: those are not timed).
    fn asked_at(&self, key: &TapKey) -> Option<Instant> {
        self.asked.take().filter(|(k, _)| k == key).map(|(_, t)| t)
    }
}

impl Tap for ChannelTap {
    fn wants(&self, key: &TapKey) -> bool {
        let yes = !self.stop.load(Ordering::Relaxed) && (self.filter)(key);
        if yes {
            self.asked.set(Some((*key, Instant::now())));
        }
        yes
    }
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]) {
        let t0 = self.asked_at(key).unwrap_or_else(Instant::now);
        let data = data.to_vec();
        self.asked.set(Some((*key, t0)));
        self.record_owned(key, data, shape);
    }
    fn record_owned(&mut self, key: &TapKey, data: Vec<f32>, shape: [usize; 2]) {
        self.send(Captured::whole(*key, shape, data));
    }
    fn weight_rows(&self, key: &TapKey, shape: [usize; 2]) -> Option<Vec<usize>> {
        self.sampling.rows(key, shape)
    }
    fn record_weight_rows(&mut self, key: &TapKey, rows: &[usize], data: Vec<f32>, shape: [usize; 2]) {
        self.send(Captured {
            key: *key,
            shape,
            data,
            rows: Some(rows.to_vec()),
        });
    }
}

impl ChannelTap {
    fn send(&mut self, c: Captured) {
        let t1 = Instant::now();
        if let Some(t0) = self.asked_at(&c.key) {
            self.capture += t1 - t0;
        }
        // A closed channel means the comparator stopped early: drop the tap.
        let _ = self.tx.send(c);
        self.wait += t1.elapsed();
    }
}

/// Everything the engine emits.
pub fn engine_filter(_: &TapKey) -> bool {
    true
}

/// The reference emits full tensors only.
pub fn reference_filter(key: &TapKey) -> bool {
    key.rank.is_none()
}

/// Progress of a side in execution order: embed < layer 0 < layer 1 < ... < output.
pub fn progress(key: &TapKey) -> u64 {
    match (key.site, key.layer) {
        (Site::Embed, _) => 0,
        (_, Some(l)) => 1 + l as u64,
        _ => u64::MAX,
    }
}

/// What a side returned and how long it ran.
pub struct SideResult<T> {
    pub result: T,
    pub seconds: f64,
    /// Of `seconds`: preparing and copying taps (see [`ChannelTap`]).
    pub capture_s: f64,
    /// Of `seconds`: blocked on a full channel.
    pub wait_s: f64,
}

/// Seconds the comparator spent waiting for taps (see [`lockstep`]).
pub struct DrainTimes {
    pub wait_s: f64,
}

/// Runs `engine` and `reference` concurrently, calling `on_tap` for every tap in arrival order
/// (reference taps arrive in execution order). `on_tap` returns false to stop capturing. Both
/// sides are asked for the weight rows `sampling` picks.
pub fn lockstep<E, R, TE, TR>(
    sampling: &WeightSampling,
    engine: E,
    reference: R,
    mut on_tap: impl FnMut(Side, Captured) -> bool,
) -> (SideResult<TE>, SideResult<TR>, DrainTimes)
where
    E: FnOnce(&mut dyn Tap) -> TE + Send,
    R: FnOnce(&mut dyn Tap) -> TR + Send,
    TE: Send,
    TR: Send,
{
    const CAPACITY: usize = 16;
    let stop = Arc::new(AtomicBool::new(false));
    let (etx, erx) = sync_channel(CAPACITY);
    let (rtx, rrx) = sync_channel(CAPACITY);
    let sampling = Arc::new(sampling.clone());
    let mut etap = ChannelTap::new(etx, stop.clone(), engine_filter, sampling.clone());
    let mut rtap = ChannelTap::new(rtx, stop.clone(), reference_filter, sampling);
    std::thread::scope(|s| {
        let eh = s.spawn(move || {
            let t0 = Instant::now();
            let result = engine(&mut etap);
            let (capture_s, wait_s) = (etap.capture.as_secs_f64(), etap.wait.as_secs_f64());
            drop(etap);
            SideResult {
                result,
                seconds: t0.elapsed().as_secs_f64(),
                capture_s,
                wait_s,
            }
        });
        let rh = s.spawn(move || {
            let t0 = Instant::now();
            let result = reference(&mut rtap);
            let (capture_s, wait_s) = (rtap.capture.as_secs_f64(), rtap.wait.as_secs_f64());
            drop(rtap);
            SideResult {
                result,
                seconds: t0.elapsed().as_secs_f64(),
                capture_s,
                wait_s,
            }
        });
        let wait = drain(&erx, &rrx, &stop, &mut on_tap);
        drop((erx, rrx));
        (
            eh.join().expect("engine thread panicked"),
            rh.join().expect("reference thread panicked"),
            DrainTimes {
                wait_s: wait.as_secs_f64(),
            },
        )
    })
}

/// How many bytes of the reference's taps the comparator may hold while the engine has not
/// sent its first tap (its load overlaps the reference's pass up to this much).
const READ_AHEAD_BYTES: usize = 1 << 30;

fn drain(
    erx: &Receiver<Captured>,
    rrx: &Receiver<Captured>,
    stop: &AtomicBool,
    on_tap: &mut impl FnMut(Side, Captured) -> bool,
) -> Duration {
    let mut waited = Duration::ZERO;
    let (mut e_done, mut r_done) = (false, false);
    let (mut e_at, mut r_at) = (0u64, 0u64);
    // Until the engine's first tap (it is loading its weights) the reference may run ahead, its
    // taps held by the comparator, up to READ_AHEAD_BYTES; then the two go in lockstep.
    let (mut e_started, mut ahead) = (false, 0usize);
    let tick = Duration::from_millis(2);
    while !(e_done && r_done) {
        let loading = !e_done && !e_started && ahead < READ_AHEAD_BYTES;
        // Read the side that is behind; when level (or the engine is still loading), poll both.
        let order: &[Side] = if !r_done && (e_done || e_at > r_at.saturating_add(1)) {
            &[Side::Reference]
        } else if !e_done && !loading && (r_done || r_at > e_at.saturating_add(1)) {
            &[Side::Engine]
        } else {
            &[Side::Reference, Side::Engine]
        };
        for &side in order {
            let (rx, done, at) = match side {
                Side::Engine => (erx, &mut e_done, &mut e_at),
                Side::Reference => (rrx, &mut r_done, &mut r_at),
            };
            if *done {
                continue;
            }
            let t0 = Instant::now();
            let got = if order.len() == 1 {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                rx.recv_timeout(tick)
            };
            waited += t0.elapsed();
            match got {
                Ok(c) => {
                    *at = (*at).max(progress(&c.key));
                    match side {
                        Side::Engine => e_started = true,
                        Side::Reference if !e_started => ahead += c.data.len() * 4,
                        Side::Reference => {}
                    }
                    if !on_tap(side, c) {
                        stop.store(true, Ordering::Relaxed);
                        // Keep draining so the producers never block, but stop calling back.
                        while erx.recv().is_ok() {}
                        while rrx.recv().is_ok() {}
                        return waited;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => *done = true,
            }
        }
    }
    waited
}

/// Collects the engine's taps over a prefill and decode steps and joins each key's rows, so the
/// result has the same `[n_tokens, width]` taps as one prefill. Weights are kept once, on the
/// rows `sampling` asks for (every row without one).
#[derive(Default)]
pub struct StitchTap {
    taps: BTreeMap<TapKey, Captured>,
    sampling: Option<WeightSampling>,
}

impl Tap for StitchTap {
    fn wants(&self, key: &TapKey) -> bool {
        // A weight once: the decode steps need not decode it again only to drop it.
        !(matches!(key.site, Site::Weight(_)) && self.taps.contains_key(key))
    }
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]) {
        match self.taps.get_mut(key) {
            Some(_) if matches!(key.site, Site::Weight(_)) => {}
            // DSA index scores are `[n, n]` (row t: keys 0..=t, zeros after): a decode step's row
            // is one key wider than the rows before it, which are padded with zeros to its width.
            Some(c) if key.site == Site::IndexerScore && shape[1] > c.shape[1] => {
                let (old, w) = (std::mem::take(&mut c.data), c.shape[1]);
                c.data = old
                    .chunks(w.max(1))
                    .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0.0, shape[1] - w)))
                    .chain(data.iter().copied())
                    .collect();
                c.shape = [c.shape[0] + shape[0], shape[1]];
            }
            Some(c) => {
                c.data.extend_from_slice(data);
                c.shape[0] += shape[0];
            }
            None => self.record_owned(key, data.to_vec(), shape),
        }
    }
    fn record_owned(&mut self, key: &TapKey, data: Vec<f32>, shape: [usize; 2]) {
        match self.taps.get_mut(key) {
            None => {
                self.taps.insert(*key, Captured::whole(*key, shape, data));
            }
            Some(_) => self.record(key, &data, shape),
        }
    }
    fn weight_rows(&self, key: &TapKey, shape: [usize; 2]) -> Option<Vec<usize>> {
        self.sampling.as_ref()?.rows(key, shape)
    }
    fn record_weight_rows(&mut self, key: &TapKey, rows: &[usize], data: Vec<f32>, shape: [usize; 2]) {
        self.taps.entry(*key).or_insert_with(|| Captured {
            key: *key,
            shape,
            data,
            rows: Some(rows.to_vec()),
        });
    }
}

impl StitchTap {
    /// A stitch that asks for the weight rows `sampling` picks (every row without one).
    pub fn new(sampling: Option<WeightSampling>) -> Self {
        StitchTap {
            taps: BTreeMap::new(),
            sampling,
        }
    }

    /// Sends the stitched taps on, in execution order.
    pub fn replay(self, tap: &mut dyn Tap) {
        for (k, c) in self.taps {
            if tap.wants(&k) {
                match c.rows {
                    Some(rows) => tap.record_weight_rows(&k, &rows, c.data, c.shape),
                    None => tap.record_owned(&k, c.data, c.shape),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StitchTap;
    use references::tap::{Site, Tap, TapKey, WeightKind};

    #[test]
    fn stitching_joins_activation_rows_and_keeps_a_weight_once_owned_or_borrowed() {
        let mut s = StitchTap::default();
        let act = TapKey::layer(0, Site::AttnOut);
        let w = TapKey::layer(0, Site::Weight(WeightKind::Q));
        s.record_owned(&act, vec![1.0, 2.0], [1, 2]);
        s.record(&act, &[3.0, 4.0], [1, 2]);
        s.record_owned(&act, vec![5.0, 6.0], [1, 2]);
        s.record_owned(&w, vec![7.0; 4], [2, 2]);
        s.record(&w, &[8.0; 4], [2, 2]);
        s.record_owned(&w, vec![9.0; 4], [2, 2]);
        let a = &s.taps[&act];
        assert_eq!(
            (a.shape, a.data.as_slice()),
            ([3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0][..])
        );
        let wt = &s.taps[&w];
        assert_eq!((wt.shape, wt.data.as_slice()), ([2, 2], &[7.0; 4][..]));
    }

    #[test]
    fn a_stitch_asks_for_sampled_weight_rows_and_passes_them_on_with_the_whole_shape() {
        let mut c = references::synth::preset("llama-tiny").unwrap().config;
        c.n_layers = 1;
        let sampling = crate::weight_rows::WeightSampling {
            full: false,
            tp: 1,
            config: c,
        };
        let mut s = StitchTap::new(Some(sampling.clone()));
        let w = TapKey::ranked(0, Site::Weight(WeightKind::Q), 0);
        let shape = [256, 2];
        let rows = s.weight_rows(&w, shape).expect("256 rows are sampled");
        assert_eq!(Some(rows.clone()), sampling.rows(&w, shape));
        let whole: Vec<f32> = (0..512).map(|i| i as f32).collect();
        references::tap::record_weight(&mut s, &w, shape, |r| {
            references::tap::select_rows(&whole, 2, r.expect("rows asked for"))
        });
        let mut out = references::tap::CollectTap::new(|_: &TapKey| true);
        s.replay(&mut out);
        // A CollectTap asks for no rows: it gets the sample as a [rows, 2] tensor.
        assert_eq!(out.recorded[0].shape, [rows.len(), 2]);
        assert_eq!(
            out.recorded[0].data[2..4],
            [rows[1] as f32 * 2.0, rows[1] as f32 * 2.0 + 1.0]
        );
    }
}
