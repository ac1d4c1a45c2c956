//! The device allocation a [`crate::backend::Buf`] holds on the CUDA backend (feature `cuda`):
//! [`DevBuf`], an f32 allocation with its length in use and, for a decode row, the integer
//! GEMV's x limbs its writer made, and the per-device [`BufPool`] that recycles freed
//! allocations by capacity. It sits below the backends (it imports nothing of the crate), so
//! `backend.rs` can name it without reaching into `cuda/`; the ops on it live in `cuda/`.

use cudarc::driver::CudaSlice;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A device buffer of f32: `len` values in use, `data.len()` allocated (capacity; KV caches
/// grow into it). Dropping it returns its memory to its backend's [`BufPool`].
pub struct DevBuf {
    pub(crate) data: std::mem::ManuallyDrop<CudaSlice<f32>>,
    pub(crate) len: usize,
    pub(crate) pool: Arc<BufPool>,
    /// The integer GEMV's x limbs of these `len` values (the `gemv_x_limbs` layout), when the op
    /// that wrote them wrote those too (a decode row's RMSNorm, SwiGLU or split GQA attention: see
    /// `CudaBackend::limbs_out`), so the GEMV that reads this row skips its pre-pass. Every other
    /// write drops them: writes go through `dev_mut` (or set `len`), which clear this.
    pub(crate) limbs: Option<Box<DevBuf>>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: `data` is not used after this.
        let data = unsafe { std::mem::ManuallyDrop::take(&mut self.data) };
        self.pool.put(data);
    }
}

/// Freed device buffers kept for reuse, by capacity: a decode step allocates the same sizes as
/// the last one, so after the first step its buffers come from here instead of a driver call
/// each (launch overhead dominates small-model decode). Reuse is safe because all of a device's
/// work is on one stream, in issue order: work enqueued after the reuse runs after the work
/// that used the buffer before. At most `MAX_POOLED_BYTES` are kept; beyond that, buffers are
/// freed (stream-ordered).
#[derive(Default)]
pub struct BufPool {
    pub(crate) free: Mutex<PoolState>,
}

#[derive(Default)]
pub(crate) struct PoolState {
    pub(crate) by_capacity: HashMap<usize, Vec<CudaSlice<f32>>>,
    pub(crate) n_bytes: usize,
}

pub(crate) const MAX_POOLED_BYTES: usize = 2 << 30;

impl BufPool {
    pub(crate) fn take(&self, cap: usize) -> Option<CudaSlice<f32>> {
        let mut g = self.free.lock().expect("buffer pool");
        let s = g.by_capacity.get_mut(&cap)?.pop()?;
        g.n_bytes -= cap * 4;
        Some(s)
    }

    pub(crate) fn put(&self, s: CudaSlice<f32>) {
        let cap = s.len();
        let mut g = self.free.lock().expect("buffer pool");
        if g.n_bytes + cap * 4 <= MAX_POOLED_BYTES {
            g.n_bytes += cap * 4;
            g.by_capacity.entry(cap).or_default().push(s);
        }
    }
}

impl DevBuf {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub(crate) fn capacity(&self) -> usize {
        self.data.len()
    }
    pub(crate) fn set_len(&mut self, len: usize) {
        assert!(len <= self.data.len(), "cuda: set_len past the buffer's capacity");
        self.len = len;
        self.limbs = None;
    }
}
