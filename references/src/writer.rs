//! GGUF v3 writer. It streams: the header and tensor directory go first, then each tensor's
//! bytes in directory order, so a model larger than memory can be written one tensor at a time.
//! A file it writes, read back and written again, is byte-identical. [`write_split`] writes a
//! split model (gguf-split's layout).

use crate::ggml_type::GgmlType;
use crate::gguf::{align_up, value_type, GgufFile, MetaValue, DEFAULT_ALIGNMENT};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// What the directory says of one tensor before its bytes are written.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub ty: GgmlType,
    /// ne[0] first (the contiguous axis).
    pub ne: Vec<u64>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, ty: GgmlType, ne: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            ty,
            ne: ne.to_vec(),
        }
    }
    pub fn n_bytes(&self) -> u64 {
        let n: u64 = self.ne.iter().product();
        self.ty
            .bytes_for(n)
            .unwrap_or_else(|| panic!("{}: {:?} is not whole {} blocks", self.name, self.ne, self.ty))
    }
}

/// A GGUF file being written: construct with the metadata and directory, then call
/// [`GgufWriter::write_tensor`] once per tensor in order, then [`GgufWriter::finish`].
pub struct GgufWriter<W: Write> {
    w: W,
    specs: Vec<TensorSpec>,
    n_written: usize,
    pos: u64,
    alignment: u64,
}

impl<W: Write> GgufWriter<W> {
    pub fn new(mut w: W, metadata: &[(String, MetaValue)], specs: Vec<TensorSpec>) -> io::Result<Self> {
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, MetaValue::U32(a))) => *a as u64,
            _ => DEFAULT_ALIGNMENT,
        };
        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(specs.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut head, v);
        }
        let mut offset = 0u64;
        for s in &specs {
            put_str(&mut head, &s.name);
            head.extend_from_slice(&(s.ne.len() as u32).to_le_bytes());
            for d in &s.ne {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&s.ty.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset = align_up(offset + s.n_bytes(), alignment);
        }
        let pad = align_up(head.len() as u64, alignment) as usize - head.len();
        head.resize(head.len() + pad, 0);
        w.write_all(&head)?;
        Ok(GgufWriter {
            w,
            specs,
            n_written: 0,
            pos: 0,
            alignment,
        })
    }

    /// Writes the next tensor's bytes, then pads to the alignment.
    pub fn write_tensor(&mut self, data: &[u8]) -> io::Result<()> {
        let spec = self
            .specs
            .get(self.n_written)
            .ok_or_else(|| io::Error::other("more tensors written than the directory lists"))?;
        if data.len() as u64 != spec.n_bytes() {
            return Err(io::Error::other(format!(
                "tensor {}: {} bytes given, {} expected",
                spec.name,
                data.len(),
                spec.n_bytes()
            )));
        }
        self.w.write_all(data)?;
        let end = self.pos + data.len() as u64;
        let padded = align_up(end, self.alignment);
        self.w.write_all(&vec![0u8; (padded - end) as usize])?;
        self.pos = padded;
        self.n_written += 1;
        Ok(())
    }

    /// Writes the next tensor's bytes in pieces: `fill` gets the sink and must write exactly the
    /// tensor's byte count (checked), so a tensor larger than memory never has to be held whole.
    pub fn write_tensor_with<E: From<io::Error>>(
        &mut self,
        fill: impl FnOnce(&mut dyn Write) -> Result<(), E>,
    ) -> Result<(), E> {
        let spec = self
            .specs
            .get(self.n_written)
            .ok_or_else(|| io::Error::other("more tensors written than the directory lists"))?;
        let (name, want) = (spec.name.clone(), spec.n_bytes());
        let mut counted = Counting { w: &mut self.w, n: 0 };
        fill(&mut counted)?;
        let got = counted.n;
        if got != want {
            return Err(io::Error::other(format!("tensor {name}: {got} bytes written, {want} expected")).into());
        }
        let end = self.pos + got;
        let padded = align_up(end, self.alignment);
        self.w.write_all(&vec![0u8; (padded - end) as usize])?;
        self.pos = padded;
        self.n_written += 1;
        Ok(())
    }

    pub fn finish(mut self) -> io::Result<W> {
        if self.n_written != self.specs.len() {
            return Err(io::Error::other(format!(
                "{} of {} tensors written",
                self.n_written,
                self.specs.len()
            )));
        }
        self.w.flush()?;
        Ok(self.w)
    }
}

/// A writer that counts what passes through it.
struct Counting<'a, W: Write> {
    w: &'a mut W,
    n: u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.w.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }
}

/// Rewrites an open file: same metadata, directory and bytes, in llmdiff's canonical layout. A
/// split model is written as one file (without its `split.*` keys).
pub fn rewrite<W: Write>(src: &GgufFile, w: W) -> io::Result<W> {
    let specs = src
        .tensors()
        .iter()
        .map(|t| TensorSpec::new(&t.name, t.ty, &t.ne))
        .collect();
    let metadata: Vec<(String, MetaValue)> = match src.n_shards() {
        1 => src.metadata().to_vec(),
        _ => src
            .metadata()
            .iter()
            .filter(|(k, _)| !k.starts_with("split."))
            .cloned()
            .collect(),
    };
    let mut gw = GgufWriter::new(w, &metadata, specs)?;
    for t in src.tensors() {
        gw.write_tensor(src.tensor_data(t))?;
    }
    gw.finish()
}

/// The path of shard `i` (1-based) of `n` for output prefix `prefix` (`out` → `out-00001-of-00003.gguf`),
/// as llama.cpp's gguf-split names them.
pub fn split_path(prefix: &Path, i: usize, n: usize) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(format!("-{i:05}-of-{n:05}.gguf"));
    PathBuf::from(s)
}

/// How [`write_split`] cuts a model into shards (gguf-split's `--split-max-tensors` and
/// `--split-max-size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitLimit {
    /// At most this many tensors a shard.
    Tensors(usize),
    /// At most this many bytes of tensor data a shard (each tensor padded to the alignment, as
    /// gguf-split counts them); a tensor larger than the limit gets a shard of its own.
    Bytes(u64),
}

impl SplitLimit {
    /// The tensor ranges of each shard for tensors of these (padded) sizes: never empty.
    pub fn shards(self, sizes: &[u64]) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut start = 0;
        let mut bytes = 0u64;
        for (i, &n) in sizes.iter().enumerate() {
            let full = match self {
                SplitLimit::Tensors(max) => i - start >= max.max(1),
                SplitLimit::Bytes(max) => i > start && bytes + n > max,
            };
            if full {
                out.push(start..i);
                start = i;
                bytes = 0;
            }
            bytes += n;
        }
        out.push(start..sizes.len());
        out
    }
}

/// Writes `src` as a split model cut by `limit`, to [`split_path`]`(prefix, i, N)`, in
/// gguf-split's layout: the first shard carries all the metadata, every shard `split.no` (u16),
/// `split.count` (u16) and `split.tensors.count` (i32). Returns the paths written.
pub fn write_split(src: &GgufFile, limit: SplitLimit, prefix: &Path) -> io::Result<Vec<PathBuf>> {
    use crate::gguf::split_key;
    let tensors = src.tensors();
    let alignment = match src.metadata().iter().find(|(k, _)| k == "general.alignment") {
        Some((_, MetaValue::U32(a))) => *a as u64,
        _ => DEFAULT_ALIGNMENT,
    };
    let sizes: Vec<u64> = tensors
        .iter()
        .map(|t| align_up(TensorSpec::new(&t.name, t.ty, &t.ne).n_bytes(), alignment))
        .collect();
    let shards = limit.shards(&sizes);
    let n = shards.len();
    if n > u16::MAX as usize || tensors.len() > i32::MAX as usize {
        return Err(io::Error::other(format!(
            "{} tensors cannot be split into {n} shards (gguf-split's limit is 65535)",
            tensors.len()
        )));
    }
    let split_meta = |i: usize| {
        vec![
            (split_key::NO.to_string(), MetaValue::U16(i as u16)),
            (split_key::COUNT.to_string(), MetaValue::U16(n as u16)),
            (
                split_key::TENSORS_COUNT.to_string(),
                MetaValue::I32(tensors.len() as i32),
            ),
        ]
    };
    let mut paths = Vec::with_capacity(n);
    for (i, range) in shards.into_iter().enumerate() {
        let chunk = &tensors[range];
        let mut meta: Vec<(String, MetaValue)> = Vec::new();
        if i == 0 {
            meta.extend(src.metadata().iter().filter(|(k, _)| !k.starts_with("split.")).cloned());
        } else if let Some(a) = src.metadata().iter().find(|(k, _)| k == "general.alignment") {
            meta.push(a.clone());
        }
        meta.extend(split_meta(i));
        let specs = chunk.iter().map(|t| TensorSpec::new(&t.name, t.ty, &t.ne)).collect();
        let path = split_path(prefix, i + 1, n);
        let f = std::fs::File::create(&path)?;
        let mut gw = GgufWriter::new(io::BufWriter::new(f), &meta, specs)?;
        for t in chunk {
            gw.write_tensor(src.tensor_data(t))?;
        }
        gw.finish()?;
        paths.push(path);
    }
    Ok(paths)
}

/// A gguf-split size: a byte count, or with a suffix K, M or G (decimal: 10³, 10⁶, 10⁹, as
/// gguf-split reads `--split-max-size`), or Ki, Mi, Gi (binary); a trailing B is allowed.
/// None when it is not a positive size.
pub fn parse_size(s: &str) -> Option<u64> {
    let upper = s.trim().to_ascii_uppercase();
    let u = upper.strip_suffix('B').unwrap_or(&upper);
    let units: [(&str, u64); 6] = [
        ("KI", 1 << 10),
        ("MI", 1 << 20),
        ("GI", 1 << 30),
        ("K", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
    ];
    let (num, mult) = units
        .iter()
        .find_map(|(suffix, m)| u.strip_suffix(suffix).map(|n| (n, *m)))
        .unwrap_or((u, 1));
    num.trim().parse::<u64>().ok()?.checked_mul(mult).filter(|&n| n > 0)
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => b.push(*x),
        MetaValue::I8(x) => b.push(*x as u8),
        MetaValue::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => b.push(*x as u8),
        MetaValue::String(s) => put_str(b, s),
        MetaValue::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Array { elem_type, items } => {
            debug_assert!(items.iter().all(|i| i.type_id() == *elem_type));
            b.extend_from_slice(&elem_type.to_le_bytes());
            b.extend_from_slice(&(items.len() as u64).to_le_bytes());
            // Nested arrays carry their own element type and count, written by the recursion.
            for it in items {
                put_value(b, it);
            }
        }
    }
}

/// Shorthands for building metadata.
pub fn meta_str(k: &str, v: &str) -> (String, MetaValue) {
    (k.to_string(), MetaValue::String(v.to_string()))
}
pub fn meta_u32(k: &str, v: u32) -> (String, MetaValue) {
    (k.to_string(), MetaValue::U32(v))
}
pub fn meta_f32(k: &str, v: f32) -> (String, MetaValue) {
    (k.to_string(), MetaValue::F32(v))
}
pub fn meta_bool(k: &str, v: bool) -> (String, MetaValue) {
    (k.to_string(), MetaValue::Bool(v))
}
pub fn meta_str_array(k: &str, v: &[String]) -> (String, MetaValue) {
    let items = v.iter().map(|s| MetaValue::String(s.clone())).collect();
    (
        k.to_string(),
        MetaValue::Array {
            elem_type: value_type::STRING,
            items,
        },
    )
}
pub fn meta_i32_array(k: &str, v: &[i32]) -> (String, MetaValue) {
    let items = v.iter().map(|&x| MetaValue::I32(x)).collect();
    (
        k.to_string(),
        MetaValue::Array {
            elem_type: value_type::I32,
            items,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_gguf_split_reads_them() {
        assert_eq!(parse_size("4G"), Some(4_000_000_000));
        assert_eq!(parse_size("500M"), Some(500_000_000));
        assert_eq!(parse_size("2k"), Some(2_000));
        assert_eq!(parse_size("3GiB"), Some(3 << 30));
        assert_eq!(parse_size("1234"), Some(1234));
        for bad in ["", "0", "G", "4X", "-1M", "1.5G"] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn byte_limits_cut_before_the_tensor_that_overflows() {
        let sizes = [10, 10, 10, 50, 5, 5];
        assert_eq!(SplitLimit::Bytes(25).shards(&sizes), [0..2, 2..3, 3..4, 4..6]);
        assert_eq!(SplitLimit::Bytes(1000).shards(&sizes), [0..6]);
        assert_eq!(SplitLimit::Tensors(4).shards(&sizes), [0..4, 4..6]);
        assert_eq!(SplitLimit::Tensors(4).shards(&[]), [0..0]);
    }
}
