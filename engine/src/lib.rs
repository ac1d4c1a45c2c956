//! `engine`: the tensor-parallel engine that plays the deployment under test.
//!
//! It loads and shards weights per rank the way vLLM/Megatron do (column, row and vocab
//! parallel; MLA heads per rank; MoE), runs ranks with a deterministic all-reduce, and puts
//! attention and the MoE mix behind caller-allocated output buffers. Its dequantization and
//! kernels are its own, never the reference's; the fault-injection catalog lives here too.

pub mod dequant;
