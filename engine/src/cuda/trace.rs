//! The kernel trace (`bench --trace`): with `EngineOptions::kernel_trace`, the kernels are
//! compiled with `-DLLMDIFF_TRACE`, and thread 0 of every block of a kernel that opens with
//! `TRACE_BLOCK(tag)` (kernels/common.cuh: the GEMVs, the norms, SwiGLU, the split decode
//! attention, the x pre-pass, the embedding gather) writes its start, the return of its
//! programmatic-dependent-launch wait and its end, read from `%globaltimer` (one clock for every
//! SM), into a device buffer of [`TRACE_CAP`] records. Untraced builds compile none of it.
//!
//! A traced kernel keeps two more registers and issues one atomic per block, so a traced step is
//! a little slower than an untraced one; the trace says where its time goes, the bench's
//! untraced figures how long it takes.

use crate::backend::BlockTrace;
use crate::EngineError;
use cudarc::driver::{CudaModule, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Records the trace buffer holds (32 bytes each): an 8B decode step is ~200 000 blocks.
pub(super) const TRACE_CAP: u32 = 1 << 21;

/// The names of common.cuh's trace tags, by tag (2 and 3 are retired).
const TRACE_TAGS: [&str; 10] = [
    "?",
    "gemv",
    "?",
    "?",
    "attention",
    "rms_norm",
    "add_rms_norm",
    "swiglu",
    "x_limbs",
    "gather",
];

/// The device side of the trace: the records and their count.
pub(super) struct KernelTrace {
    rec: CudaSlice<u64>,
    n: CudaSlice<u32>,
}

fn drv(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> EngineError {
    move |e| EngineError::Cuda(format!("kernel trace: {what}: {e}"))
}

impl KernelTrace {
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<KernelTrace, EngineError> {
        Ok(KernelTrace {
            rec: stream
                .alloc_zeros::<u64>(4 * TRACE_CAP as usize)
                .map_err(drv("alloc"))?,
            n: stream.alloc_zeros::<u32>(1).map_err(drv("alloc"))?,
        })
    }

    /// Points a module's trace globals (common.cuh) at the buffer.
    pub(super) fn attach(&self, module: &Arc<CudaModule>, stream: &Arc<CudaStream>) -> Result<(), EngineError> {
        let rec = self.rec.device_ptr(stream).0;
        let n = self.n.device_ptr(stream).0;
        let words: [(&str, Vec<u8>); 3] = [
            ("llmdiff_trace_rec", rec.to_le_bytes().to_vec()),
            ("llmdiff_trace_n", n.to_le_bytes().to_vec()),
            ("llmdiff_trace_cap", TRACE_CAP.to_le_bytes().to_vec()),
        ];
        for (name, bytes) in words {
            let mut g = module.get_global(name, stream).map_err(drv("module global"))?;
            if g.len() != bytes.len() {
                return Err(EngineError::Cuda(format!("kernel trace: {name} is {} bytes", g.len())));
            }
            stream.memcpy_htod(&bytes, &mut g).map_err(drv("set global"))?;
        }
        stream.synchronize().map_err(drv("synchronize"))
    }

    /// Forgets every record (the next block takes slot 0).
    pub(super) fn reset(&mut self, stream: &Arc<CudaStream>) -> Result<(), EngineError> {
        stream.memset_zeros(&mut self.n).map_err(drv("reset"))
    }

    /// The records since the last reset (waits for the stream), and how many had no room.
    pub(super) fn take(&self, stream: &Arc<CudaStream>) -> Result<(Vec<BlockTrace>, usize), EngineError> {
        let n = stream.clone_dtoh(&self.n).map_err(drv("count"))?[0] as usize;
        let kept = n.min(TRACE_CAP as usize);
        if kept == 0 {
            return Ok((Vec::new(), n));
        }
        let words = stream.clone_dtoh(&self.rec.slice(..4 * kept)).map_err(drv("records"))?;
        Ok((words.chunks_exact(4).map(decode).collect(), n - kept))
    }
}

/// One record: start, wait (0: none), end, then tag | SM << 8 | block << 16 | grid << 40.
fn decode(w: &[u64]) -> BlockTrace {
    let meta = w[3];
    BlockTrace {
        kernel: TRACE_TAGS.get((meta & 0xff) as usize).copied().unwrap_or("?"),
        sm: ((meta >> 8) & 0xff) as u32,
        block: ((meta >> 16) & 0xff_ffff) as u32,
        grid: ((meta >> 40) & 0xff_ffff) as u32,
        start: w[0],
        wait: (w[1] != 0).then_some(w[1]),
        end: w[2],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_decodes_as_common_cuh_packs_it() {
        let meta = 4u64 | (131 << 8) | (70_000 << 16) | (3_584u64 << 40);
        let b = decode(&[100, 0, 250, meta]);
        assert_eq!(
            b,
            BlockTrace {
                kernel: "attention",
                block: 70_000,
                grid: 3_584,
                sm: 131,
                start: 100,
                wait: None,
                end: 250
            }
        );
        assert_eq!(decode(&[1, 5, 9, 1]).wait, Some(5));
        assert_eq!(decode(&[1, 5, 9, 200]).kernel, "?");
    }
}
