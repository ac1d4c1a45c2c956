//! The engine's fast dequantization path (filled in by the dequant work).
