//! `engine`: the tensor-parallel engine that plays the deployment under test.
//!
//! It loads and shards weights per rank the way vLLM/Megatron do (column, row and vocab
//! parallel; MLA heads per rank; MoE with every expert split over ranks; see [`weights`]), runs
//! ranks concurrently with a deterministic all-reduce ([`engine`]), and puts attention and the
//! MoE mix behind caller-allocated output buffers ([`rank`]). Its dequantization and CPU ops
//! ([`cpu_ops`]) are its own, never the reference's; the fault-injection catalog is [`fault`].
//! Model code runs over the [`backend::Backend`] trait: cpu, and cuda behind the feature `cuda`
//! (NVRTC kernels from `kernels/`, module list in [`cuda_kernels`]). It computes in f32 by default,
//! or at production precision, bf16 or f16 ([`ComputeDtype`]; the rules are in [`precision`]).

pub mod backend;
pub mod collective;
pub mod cpu_ops;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_kernels;
pub mod dequant;
#[cfg(feature = "cuda")]
pub mod device_buf;
pub mod dsa;
pub mod engine;
mod error;
pub mod fault;
pub mod fault_dequant;
pub mod moe_route;
pub mod options;
pub mod precision;
pub mod rank;
pub mod taps;
pub mod weights;

pub use backend::{Backend, BackendKind, BlockTrace, CommStats, CpuBackend};
pub use engine::{argmax, check_faults, valid_tp_degrees, Engine, EngineOptions};
pub use error::EngineError;
pub use fault::{Fault, FaultSpec};
pub use options::{ComputeDtype, CudaDisable, CudaOptions, RankMode};
pub use weights::{indexer_float_weight, WeightStorage};
