//! Hostile GGUF input: targeted corruptions each give an error naming the offset, and a proptest
//! campaign over mutated and truncated files never panics or over-allocates.

use proptest::prelude::*;
use references::gguf::{value_type, GgufHeader, MetaValue};
use references::writer::{GgufWriter, TensorSpec};
use references::GgmlType;

fn sample() -> Vec<u8> {
    let md = vec![
        ("general.architecture".to_string(), MetaValue::String("llama".into())),
        ("general.alignment".into(), MetaValue::U32(32)),
        (
            "x.arr".into(),
            MetaValue::Array {
                elem_type: value_type::STRING,
                items: vec![MetaValue::String("ab".into()); 3],
            },
        ),
        ("x.f".into(), MetaValue::F32(0.5)),
    ];
    let specs = vec![
        TensorSpec::new("a", GgmlType::Q8_0, &[32, 2]),
        TensorSpec::new("b", GgmlType::F32, &[4]),
    ];
    let mut w = GgufWriter::new(Vec::new(), &md, specs).unwrap();
    w.write_tensor(&[0u8; 68]).unwrap();
    w.write_tensor(&[0u8; 16]).unwrap();
    w.finish().unwrap()
}

fn parse_err(bytes: &[u8]) -> String {
    GgufHeader::parse(bytes, "bad.gguf").unwrap_err().to_string()
}

#[test]
fn the_sample_parses() {
    let h = GgufHeader::parse(&sample(), "ok").unwrap();
    assert_eq!(h.tensors.len(), 2);
}

#[test]
fn targeted_corruptions_name_the_offset() {
    let good = sample();
    let mut b = good.clone();
    b[0] = b'X';
    assert!(parse_err(&b).contains("not a GGUF file"));
    let mut b = good.clone();
    b[4..8].copy_from_slice(&9u32.to_le_bytes());
    assert!(parse_err(&b).contains("version 9"));
    // A tensor count of 2^60 must be refused before any allocation.
    let mut b = good.clone();
    b[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(parse_err(&b).contains("tensor count"), "{}", parse_err(&b));
    let mut b = good.clone();
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(parse_err(&b).contains("metadata count"));
    // First key's string length.
    let mut b = good.clone();
    b[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    let e = parse_err(&b);
    assert!(e.contains("at byte 24") && e.contains("string length"), "{e}");
    // Truncated inside the data section.
    let e = parse_err(&good[..good.len() - 20]);
    assert!(e.contains("runs past the data section"), "{e}");
    // Truncated inside the header.
    let e = parse_err(&good[..40]);
    assert!(e.contains("cannot fit in the 16 bytes left"), "{e}");
    let e = parse_err(&good[..120]);
    assert!(e.contains("truncated") || e.contains("runs past the end"), "{e}");
}

#[test]
fn unknown_type_ids_are_named() {
    let good = sample();
    // Find tensor "b"'s type field: it follows the name (8+1 bytes), n_dims (4) and one dim (8).
    let pos = find(&good, b"\x01\x00\x00\x00\x00\x00\x00\x00b").unwrap() + 9 + 4 + 8;
    let mut b = good.clone();
    b[pos..pos + 4].copy_from_slice(&15u32.to_le_bytes());
    let e = parse_err(&b);
    assert!(e.contains("type id 15 (Q8_K)") && e.contains("tensor \"b\""), "{e}");
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random byte edits, u64 splices and truncations: parse must return, Ok or Err, never panic.
    #[test]
    fn mutated_files_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        splice in prop::option::of((any::<prop::sample::Index>(), any::<u64>())),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let mut b = sample();
        for (i, v) in edits {
            let at = i.index(b.len());
            b[at] = v;
        }
        if let Some((i, v)) = splice {
            let at = i.index(b.len() - 8);
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        if let Some(i) = cut {
            b.truncate(i.index(b.len()));
        }
        if let Ok(h) = GgufHeader::parse(&b, "fuzz") {
            for t in &h.tensors {
                prop_assert!(h.data_offset + t.offset + t.n_bytes <= b.len() as u64);
            }
        }
    }
}
