//! Device buffers as the ops see them: the accessors of a [`Buf`]'s device allocation
//! ([`crate::device_buf::DevBuf`]) and of the integer GEMV's x limbs beside it, new buffers from
//! the pool, and downloads through page-locked staging.

use super::*;

/// The largest download (values) staged through page-locked memory (`CudaBackend::staging`): 4 MiB.
pub(super) const STAGING_MAX: usize = 1 << 20;

/// The values in use of a device buffer, as a view (for NCCL).
pub(crate) fn dev_view(b: &Buf) -> cudarc::driver::CudaView<'_, f32> {
    dev(b).slice(..b.len())
}

pub(crate) fn dev_view_mut(b: &mut Buf) -> cudarc::driver::CudaViewMut<'_, f32> {
    let len = b.len();
    dev_mut(b).slice_mut(..len)
}

pub(super) fn dev(b: &Buf) -> &CudaSlice<f32> {
    match &b.repr {
        BufRepr::Dev(d) => &d.data,
        BufRepr::Host(_) => panic!("cuda: a host buffer given to a device op"),
    }
}

/// A device buffer to write: its limbs (see `DevBuf::limbs`) no longer describe it.
pub(super) fn dev_mut(b: &mut Buf) -> &mut CudaSlice<f32> {
    match &mut b.repr {
        BufRepr::Dev(d) => {
            d.limbs = None;
            &mut d.data
        }
        BufRepr::Host(_) => panic!("cuda: a host buffer given to a device op"),
    }
}

/// The limbs of `x` when it is one row of `cols` values written with them (see `DevBuf::limbs`).
pub(super) fn limbs_of(x: &Buf, cols: usize) -> Option<&CudaSlice<f32>> {
    match &x.repr {
        BufRepr::Dev(d) if d.len == cols => d.limbs.as_deref().map(|l| &*l.data),
        _ => None,
    }
}

/// Attaches limbs written by the op that just wrote `out` (after its `dev_mut`).
pub(super) fn attach_limbs(out: &mut Buf, limbs: Option<Buf>) {
    if let BufRepr::Dev(d) = &mut out.repr {
        d.limbs = limbs.map(|l| match l.repr {
            BufRepr::Dev(l) => Box::new(l),
            BufRepr::Host(_) => panic!("cuda: host limbs"),
        });
    }
}

impl CudaBackend {
    pub(super) fn new_buf(&self, len: usize) -> Buf {
        // SAFETY: the contents are unspecified by contract (Backend::alloc); at least one value
        // is allocated so every buffer has a device address.
        let cap = len.max(1);
        let data = match self.pool.take(cap) {
            Some(d) => d,
            None => {
                self.spoil("an allocation");
                ok(unsafe { self.stream.alloc::<f32>(cap) })
            }
        };
        Buf {
            repr: BufRepr::Dev(DevBuf {
                data: std::mem::ManuallyDrop::new(data),
                len,
                pool: self.pool.clone(),
                limbs: None,
            }),
        }
    }

    pub(super) fn download_staged(&self, b: &Buf, out: &mut Vec<f32>) {
        assert!(
            !self.capturing(),
            "cuda: a download while a decode graph is being recorded"
        );
        let len = b.len();
        out.clear();
        if len == 0 {
            return;
        }
        let src = dev(b).slice(..len);
        if len > STAGING_MAX {
            out.resize(len, 0.0);
            ok(self.stream.memcpy_dtoh(&src, &mut out[..]));
            ok(self.stream.synchronize());
            return;
        }
        let mut staging = self.staging.lock().expect("staging buffer");
        if staging.as_ref().is_none_or(|p| p.len() < len) {
            // SAFETY: only the first `len` values, just copied in, are read. Flags 0: cached
            // memory (write-combined memory is slow for the host to read).
            *staging = Some(ok(unsafe {
                self.ctx.alloc_pinned_with_flags::<f32>(len.next_power_of_two(), 0)
            }));
        }
        let pinned = staging.as_mut().expect("staging buffer");
        // A plain slice of the pinned memory: cudarc copies the destination's whole length, and
        // the driver sees the page-locked address either way.
        let dst = &mut ok(pinned.as_mut_slice())[..len];
        ok(self.stream.memcpy_dtoh(&src, dst));
        ok(self.stream.synchronize());
        out.extend_from_slice(dst);
    }
}
