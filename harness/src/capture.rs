//! Lockstep capture: the engine and the reference run in their own threads and send each tap
//! they record over a bounded channel; the comparator joins them on the key as they arrive.
//! The side that is ahead blocks once it is more than a layer ahead, so memory stays about two
//! layers of taps, whatever the model size.

use references::tap::{Site, Tap, TapKey};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One recorded tensor.
#[derive(Clone, Debug)]
pub struct Captured {
    pub key: TapKey,
    pub shape: [usize; 2],
    pub data: Vec<f32>,
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
    /// The key last asked for and when.
    asked: Cell<Option<(TapKey, Instant)>>,
    capture: Duration,
    wait: Duration,
}

impl ChannelTap {
    fn new(tx: SyncSender<Captured>, stop: Arc<AtomicBool>, filter: fn(&TapKey) -> bool) -> Self {
        ChannelTap {
            tx,
            stop,
            filter,
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
        let t1 = Instant::now();
        if let Some(t0) = self.asked_at(key) {
            self.capture += t1 - t0;
        }
        // A closed channel means the comparator stopped early: drop the tap.
        let _ = self.tx.send(Captured { key: *key, shape, data });
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
/// (reference taps arrive in execution order). `on_tap` returns false to stop capturing.
pub fn lockstep<E, R, TE, TR>(
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
    let mut etap = ChannelTap::new(etx, stop.clone(), engine_filter);
    let mut rtap = ChannelTap::new(rtx, stop.clone(), reference_filter);
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

fn drain(
    erx: &Receiver<Captured>,
    rrx: &Receiver<Captured>,
    stop: &AtomicBool,
    on_tap: &mut impl FnMut(Side, Captured) -> bool,
) -> Duration {
    let mut waited = Duration::ZERO;
    let (mut e_done, mut r_done) = (false, false);
    let (mut e_at, mut r_at) = (0u64, 0u64);
    let tick = Duration::from_millis(2);
    while !(e_done && r_done) {
        // Read the side that is behind; when level, poll both.
        let order: &[Side] = if !r_done && (e_done || e_at > r_at.saturating_add(1)) {
            &[Side::Reference]
        } else if !e_done && (r_done || r_at > e_at.saturating_add(1)) {
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
