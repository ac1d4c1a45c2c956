//! Decode graphs: recording a plain decode step by stream capture ([`CudaBackend::record_begin`],
//! [`CudaBackend::record_end`]), what spoils a recording, and replay (the step's position and
//! token in page-locked words the graph's first node copies to the device).

use super::*;

/// The state of a decode-graph recording (see [`Backend::graph_begin`]).
#[derive(Default)]
pub(super) struct CaptureState {
    /// Work is being recorded, not run.
    pub(super) active: bool,
    /// Why the recording cannot be replayed, if it cannot.
    pub(super) spoiled: Option<&'static str>,
    /// The most KV rows any recorded attention or KV append can address (capacity, and the
    /// attention's shared memory).
    pub(super) max_rows: usize,
}

/// A recorded decode step (CUDA graph) and what replaying it needs: the host words its first node
/// copies to the position and token words its kernels read.
pub(super) struct CudaStepGraph {
    pub(super) graph: cudarc::driver::CudaGraph,
    pub(super) words: Arc<StepWords>,
    /// Where the first node copies the words to.
    pub(super) _pos_dev: Arc<CudaSlice<i32>>,
    pub(super) max_rows: usize,
}

// SAFETY: the graph is used only through its owner (the engine, one step at a time, `&mut`
// access); the CUDA objects it holds are not tied to the thread that made them.
unsafe impl Send for CudaStepGraph {}

impl crate::backend::StepGraph for CudaStepGraph {
    fn replay(&self, pos0: usize, token: u32) {
        self.words.set(pos0, token);
        ok(self.graph.launch());
    }
    fn fits(&self, pos0: usize) -> bool {
        pos0 < self.max_rows
    }
}

/// A decode step's position and token in page-locked host memory. A recorded step's first node
/// copies them to `CudaBackend::pos_dev`, so a replay writes them here and launches the graph:
/// no kernel launch of its own (one cost ~8 µs of host time a step on the H200).
/// Written only when no recorded step is running: the engine downloads each step's logits (a
/// synchronization) before the next step.
pub(super) struct StepWords {
    /// Two ints; `ptr` is their address.
    pub(super) _pinned: cudarc::driver::PinnedHostSlice<i32>,
    pub(super) ptr: *mut i32,
}

// SAFETY: `ptr` points into `_pinned`, which lives as long as this; writes happen between steps
// only (see above).
unsafe impl Send for StepWords {}
unsafe impl Sync for StepWords {}

impl StepWords {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<StepWords, DriverError> {
        // SAFETY: both words are written (zeros) before any use; flags 0: cached memory.
        let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<i32>(2, 0) }?;
        let ptr = pinned.as_mut_ptr()?;
        let words = StepWords { _pinned: pinned, ptr };
        words.set(0, 0);
        Ok(words)
    }

    pub(super) fn set(&self, pos0: usize, token: u32) {
        // SAFETY: two ints at ptr, not read by the device now (see the type's doc).
        unsafe {
            std::ptr::write_volatile(self.ptr, pos0 as i32);
            std::ptr::write_volatile(self.ptr.add(1), token as i32);
        }
    }

    /// Records (the stream is capturing) the copy of both words to `dst` (two device ints).
    pub(super) fn copy_to(&self, stream: &CudaStream, dst: u64) {
        // SAFETY: two ints at ptr, page-locked (so the copy may be recorded); dst holds two ints
        // that outlive the graph (CudaBackend::pos_dev).
        ok(unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, std::slice::from_raw_parts(self.ptr, 2), stream.cu_stream())
        });
    }
}

impl CudaBackend {
    /// The address of `pos_dev` (the position and token words), kept alive by the backend.
    pub(super) fn pos_ptr(&self) -> u64 {
        use cudarc::driver::DevicePtr;
        self.pos_dev.device_ptr(&self.stream).0
    }

    /// True while a decode graph is being recorded.
    pub(super) fn capturing(&self) -> bool {
        self.capture.lock().expect("capture state").active
    }

    /// Marks the recording in progress (if any) as not replayable.
    pub(super) fn spoil(&self, why: &'static str) {
        let mut c = self.capture.lock().expect("capture state");
        if c.active && c.spoiled.is_none() {
            c.spoiled = Some(why);
        }
    }

    /// Lowers the recording's replayable KV rows to `rows`.
    pub(super) fn limit_rows(&self, rows: usize) {
        let mut c = self.capture.lock().expect("capture state");
        c.max_rows = c.max_rows.min(rows);
    }

    pub(super) fn record_begin(&self, pos0: usize, token: u32) -> bool {
        if !self.graphs_on {
            return false;
        }
        // The step before this one was downloaded (synchronized): nothing reads the words now.
        self.step_words.set(pos0, token);
        let words_dst = self.pos_ptr();
        // The recording computes its own angle table (at the replayed position).
        *self.rope_table.lock().expect("rope table") = None;
        let mut c = self.capture.lock().expect("capture state");
        assert!(!c.active, "cuda: graph_begin while recording");
        ok(self
            .stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
        *c = CaptureState {
            active: true,
            spoiled: None,
            max_rows: usize::MAX,
        };
        // The step's first node: its position and token, as each replay sets them.
        self.step_words.copy_to(&self.stream, words_dst);
        true
    }

    pub(super) fn record_end(&self) -> Option<Box<dyn crate::backend::StepGraph>> {
        let state = std::mem::take(&mut *self.capture.lock().expect("capture state"));
        assert!(state.active, "cuda: graph_end without graph_begin");
        let graph = ok(self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)))?;
        // The recorded work is this step's: run it once.
        ok(graph.launch());
        if state.spoiled.is_some() || state.max_rows == usize::MAX {
            return None;
        }
        Some(Box::new(CudaStepGraph {
            graph,
            words: self.step_words.clone(),
            _pos_dev: self.pos_dev.clone(),
            max_rows: state.max_rows,
        }))
    }
}
