//! Collects the engine's taps over a prefill and its decode steps (`diff-layers --decode-steps`)
//! and joins each key's rows, so the comparator sees the same `[n_tokens, width]` taps as one
//! prefill.

use crate::capture::Captured;
use references::tap::{Site, TapKey};
use std::collections::BTreeMap;

/// Collects the engine's taps over a prefill and decode steps and joins each key's rows, so the
/// result has the same `[n_tokens, width]` taps as one prefill. Weights are kept once.
#[derive(Default)]
pub struct StitchTap {
    taps: BTreeMap<TapKey, Captured>,
}

impl references::tap::Tap for StitchTap {
    fn wants(&self, key: &TapKey) -> bool {
        // A weight once: the decode steps need not decode it again only to drop it.
        !(matches!(key.site, Site::Weight(_)) && self.taps.contains_key(key))
    }
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]) {
        match self.taps.get_mut(key) {
            Some(_) if matches!(key.site, Site::Weight(_)) => {}
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
                self.taps.insert(*key, Captured { key: *key, shape, data });
            }
            Some(_) => self.record(key, &data, shape),
        }
    }
}

impl StitchTap {
    /// Sends the stitched taps on, in execution order.
    pub fn replay(self, tap: &mut dyn references::tap::Tap) {
        for (k, c) in self.taps {
            if tap.wants(&k) {
                tap.record_owned(&k, c.data, c.shape);
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
}
