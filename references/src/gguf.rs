//! GGUF v2/v3 reader over a memory map, with zero-copy tensor views.
//!
//! GGUF files are hostile input: every count, string length, dims product and offset is checked
//! against the bytes that remain before it is used, so a crafted header gives a [`GgufError`]
//! naming the file and byte offset, never a panic or an allocation larger than the file.

use crate::ggml_type::GgmlType;
use memmap2::Mmap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The GGUF magic, `GGUF` read as little-endian bytes.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Default data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's limit on tensor rank.
pub const MAX_DIMS: u32 = 4;
/// Nested metadata arrays deeper than this are refused (a crafted file could otherwise recurse
/// once per 12 bytes).
const MAX_ARRAY_DEPTH: u32 = 4;

/// Why a GGUF file could not be read: the file, the byte offset where reading failed, and what
/// was wrong there.
#[derive(Debug, thiserror::Error)]
#[error("{file}: at byte {offset}: {msg}")]
pub struct GgufError {
    pub file: String,
    pub offset: u64,
    pub msg: String,
}

/// Metadata value types as GGUF numbers them.
pub mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Items all of `elem_type`; kept even when empty so a rewrite is byte-identical.
    Array {
        elem_type: u32,
        items: Vec<MetaValue>,
    },
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The GGUF value type id.
    pub fn type_id(&self) -> u32 {
        use value_type::*;
        match self {
            MetaValue::U8(_) => U8,
            MetaValue::I8(_) => I8,
            MetaValue::U16(_) => U16,
            MetaValue::I16(_) => I16,
            MetaValue::U32(_) => U32,
            MetaValue::I32(_) => I32,
            MetaValue::F32(_) => F32,
            MetaValue::Bool(_) => BOOL,
            MetaValue::String(_) => STRING,
            MetaValue::Array { .. } => ARRAY,
            MetaValue::U64(_) => U64,
            MetaValue::I64(_) => I64,
            MetaValue::F64(_) => F64,
        }
    }

    /// Any non-negative integer value, widened.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            MetaValue::Bool(v) => Some(v as u64),
            _ => None,
        }
    }

    /// Any integer value as i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// Any numeric value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array { items, .. } => Some(items),
            _ => None,
        }
    }
}

impl fmt::Display for MetaValue {
    /// Scalars print plainly; arrays longer than 8 items are summarized.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::U8(v) => write!(f, "{v}"),
            MetaValue::I8(v) => write!(f, "{v}"),
            MetaValue::U16(v) => write!(f, "{v}"),
            MetaValue::I16(v) => write!(f, "{v}"),
            MetaValue::U32(v) => write!(f, "{v}"),
            MetaValue::I32(v) => write!(f, "{v}"),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
            MetaValue::String(s) => write!(f, "{s:?}"),
            MetaValue::U64(v) => write!(f, "{v}"),
            MetaValue::I64(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
            MetaValue::Array { items, .. } => {
                const SHOWN: usize = 8;
                write!(f, "[")?;
                for (i, it) in items.iter().take(SHOWN).enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{it}")?;
                }
                if items.len() > SHOWN {
                    write!(f, ", ... ({} items)", items.len())?;
                }
                write!(f, "]")
            }
        }
    }
}

/// One entry of the tensor directory, validated against the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// ne[0] first; ne[0] is the contiguous axis.
    pub ne: Vec<u64>,
    /// Offset relative to the data section.
    pub offset: u64,
    pub n_bytes: u64,
    /// Which file of a split model holds the data (0: the first, or the only one).
    pub shard: usize,
}

impl TensorInfo {
    pub fn n_elems(&self) -> u64 {
        self.ne.iter().product()
    }
    /// Number of rows (everything but ne[0]).
    pub fn n_rows(&self) -> u64 {
        self.ne.iter().skip(1).product()
    }
}

/// The parsed header of a GGUF file: version, metadata (in file order), tensor directory and the
/// absolute offset of the data section.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    pub data_offset: u64,
    /// Unknown `{arch}.*` keys and tensors the user accepts (`--allow-unknown`): see
    /// [`crate::allowlist`]. Empty when parsed.
    pub allow_unknown: Vec<String>,
}

impl GgufHeader {
    /// Parses and validates a whole GGUF image. `file` only names the source in errors.
    pub fn parse(bytes: &[u8], file: &str) -> Result<GgufHeader, GgufError> {
        let mut c = Cursor { b: bytes, pos: 0, file };
        let magic = c.take(4)?;
        if magic != GGUF_MAGIC {
            return Err(c.err_at(0, format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")")));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.err_at(4, format!("unsupported GGUF version {version} (llmdiff reads 2 and 3)")));
        }
        let n_tensors = c.u64()?;
        let n_kv = c.u64()?;
        // A KV pair is at least 13 bytes (empty key, type, 1-byte value); a tensor info at least 24.
        c.check_count(n_kv, 13, "metadata count")?;
        let mut metadata = Vec::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key_pos = c.pos;
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            if metadata.iter().any(|(k, _)| *k == key) {
                return Err(c.err_at(key_pos, format!("duplicate metadata key {key:?}")));
            }
            metadata.push((key, v));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, MetaValue::U32(a))) if a.is_power_of_two() => *a as u64,
            Some((_, v)) => {
                return Err(c.err_at(
                    c.pos,
                    format!("general.alignment must be a power-of-two u32, got {v:?}"),
                ))
            }
        };
        c.check_count(n_tensors, 24, "tensor count")?;
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let at = c.pos;
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(c.err_at(at, format!("tensor {name:?}: n_dims {n_dims} outside 1..={MAX_DIMS}")));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(c.u64()?);
            }
            let type_id = c.u32()?;
            let offset = c.u64()?;
            raw.push((at, name, ne, type_id, offset));
        }
        let data_offset = align_up(c.pos as u64, alignment);
        if data_offset > bytes.len() as u64 && n_tensors > 0 {
            return Err(c.err_at(c.pos, "file ends before its data section".into()));
        }
        let data_len = (bytes.len() as u64).saturating_sub(data_offset);
        let mut tensors = Vec::with_capacity(raw.len());
        for (at, name, ne, type_id, offset) in raw {
            let bad = |msg: String| c.err_at(at, format!("tensor {name:?}: {msg}"));
            if tensors.iter().any(|t: &TensorInfo| t.name == name) {
                return Err(bad("duplicate tensor name".into()));
            }
            let ty = GgmlType::from_id(type_id).map_err(|t| bad(format!("unsupported {t}")))?;
            let n_elems = ne
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("dims {ne:?} overflow")))?;
            if ne[0] % ty.block_elems() as u64 != 0 {
                return Err(bad(format!(
                    "ne[0] = {} is not a multiple of the {} block size {}",
                    ne[0],
                    ty,
                    ty.block_elems()
                )));
            }
            let n_bytes = ty
                .bytes_for(n_elems)
                .ok_or_else(|| bad(format!("dims {ne:?} overflow")))?;
            if offset % alignment != 0 {
                return Err(bad(format!(
                    "offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            match offset.checked_add(n_bytes) {
                Some(end) if end <= data_len => {}
                _ => {
                    return Err(bad(format!(
                    "data [{offset}, +{n_bytes}) runs past the data section ({data_len} bytes from byte {data_offset})"
                )))
                }
            }
            tensors.push(TensorInfo {
                name,
                ty,
                ne,
                offset,
                n_bytes,
                shard: 0,
            });
        }
        Ok(GgufHeader {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            allow_unknown: Vec::new(),
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// An open GGUF file: the memory map and its parsed header. A split model (`split.count` > 1,
/// files `NAME-00001-of-0000N.gguf` as gguf-split and gguf-py write them) opens as one: the
/// header is the first file's metadata with every shard's tensors (each [`TensorInfo::shard`]
/// says which file holds it), and each shard stays memory-mapped on its own.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: GgufHeader,
    /// One map per file; `maps[0]` is `path`'s.
    maps: Vec<Mmap>,
    /// Each file's data-section offset.
    data_offsets: Vec<u64>,
    /// The source: a GGUF file (or split set), or an HF checkpoint folder read as its GGUF
    /// conversion ([`crate::hf`]).
    pub source: ModelSource,
}

/// Where a [`GgufFile`]'s header and tensors come from. Both present the same interface: the
/// GGUF metadata and tensors by GGUF name, memory-mapped.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    Gguf,
    /// An HF checkpoint folder; its `tokenizer.json` when it has one.
    HfFolder {
        tokenizer_json: Option<PathBuf>,
    },
}

/// Metadata keys of a split model (llama.cpp's gguf-split).
pub mod split_key {
    pub const NO: &str = "split.no";
    pub const COUNT: &str = "split.count";
    pub const TENSORS_COUNT: &str = "split.tensors.count";
}

/// `NAME-0000i-of-0000N.gguf` → (NAME prefix with its dash, i, N, digit widths).
fn split_name(path: &Path) -> Option<(String, usize, usize, usize, usize)> {
    let file = path.file_name()?.to_str()?;
    let stem = file.strip_suffix(".gguf")?;
    let (head, n) = stem.rsplit_once("-of-")?;
    let (prefix, i) = head.rsplit_once('-')?;
    let (iv, nv) = (i.parse().ok()?, n.parse().ok()?);
    Some((format!("{prefix}-"), iv, nv, i.len(), n.len()))
}

fn map_file(path: &Path) -> Result<(Mmap, GgufHeader), GgufError> {
    let name = path.display().to_string();
    let io_err = |e: std::io::Error| GgufError {
        file: name.clone(),
        offset: 0,
        msg: e.to_string(),
    };
    let file = File::open(path).map_err(io_err)?;
    // SAFETY: the map is read-only. A file truncated by another process while mapped would
    // fault; that is the usual caveat of mmap-based model loaders (llama.cpp has it too).
    let map = unsafe { Mmap::map(&file) }.map_err(io_err)?;
    let header = GgufHeader::parse(&map, &name)?;
    Ok((map, header))
}

impl GgufFile {
    /// Opens and validates `path`. Nothing is read beyond the header until a tensor is viewed.
    /// The first file of a split model opens every shard (validated: same split.count, shard
    /// numbers in order, same architecture where a shard names one, no tensor twice, the total
    /// equal to split.tensors.count); a later shard is refused, naming the file to open.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref().to_path_buf();
        let (map, mut header) = map_file(&path)?;
        let name = path.display().to_string();
        let err = |file: &str, msg: String| GgufError {
            file: file.to_string(),
            offset: 0,
            msg,
        };
        let count_of = |h: &GgufHeader, k: &str| h.get(k).and_then(|v| v.as_u64());
        let Some(count) = count_of(&header, split_key::COUNT) else {
            return Ok(GgufFile {
                path,
                maps: vec![map],
                data_offsets: vec![header.data_offset],
                header,
                source: ModelSource::Gguf,
            });
        };
        let no = count_of(&header, split_key::NO).unwrap_or(0);
        let names = split_name(&path);
        if no != 0 {
            let first = match &names {
                Some((prefix, _, n, wi, wn)) => {
                    path.with_file_name(format!("{prefix}{:0wi$}-of-{n:0wn$}.gguf", 1, wi = *wi, wn = *wn))
                }
                None => path.with_file_name("(its first shard)"),
            };
            return Err(err(
                &name,
                format!(
                    "this is shard {} of {count} of a split model: open the first shard, {}",
                    no + 1,
                    first.display()
                ),
            ));
        }
        if count <= 1 {
            return Ok(GgufFile {
                path,
                maps: vec![map],
                data_offsets: vec![header.data_offset],
                header,
                source: ModelSource::Gguf,
            });
        }
        let Some((prefix, i1, n, wi, wn)) = names else {
            return Err(err(
                &name,
                format!("split.count is {count}, but the name is not NAME-00001-of-{count:05}.gguf, so the other shards cannot be found"),
            ));
        };
        if i1 != 1 || n as u64 != count {
            return Err(err(
                &name,
                format!("the name says shard {i1} of {n}, the metadata shard 1 of {count}"),
            ));
        }
        let total = count_of(&header, split_key::TENSORS_COUNT)
            .ok_or_else(|| err(&name, format!("a split model without {}", split_key::TENSORS_COUNT)))?;
        let arch = header.get("general.architecture").cloned();
        let mut maps = vec![map];
        let mut data_offsets = vec![header.data_offset];
        let mut seen: std::collections::HashSet<String> = header.tensors.iter().map(|t| t.name.clone()).collect();
        for i in 1..count as usize {
            let p = path.with_file_name(format!("{prefix}{:0wi$}-of-{n:0wn$}.gguf", i + 1));
            let pname = p.display().to_string();
            if !p.exists() {
                return Err(err(&pname, format!("shard {} of {count} of {name} is missing", i + 1)));
            }
            let (m, h) = map_file(&p)?;
            let bad = |msg: String| Err(err(&pname, format!("shard {} of {name}: {msg}", i + 1)));
            if count_of(&h, split_key::COUNT) != Some(count) {
                return bad(format!(
                    "split.count is {:?}, the first shard's {count}",
                    h.get(split_key::COUNT)
                ));
            }
            if count_of(&h, split_key::NO) != Some(i as u64) {
                return bad(format!("split.no is {:?}, expected {i}", h.get(split_key::NO)));
            }
            if count_of(&h, split_key::TENSORS_COUNT) != Some(total) {
                return bad(format!(
                    "split.tensors.count is {:?}, the first shard's {total}: a shard of another model",
                    h.get(split_key::TENSORS_COUNT)
                ));
            }
            if let Some(a) = h.get("general.architecture") {
                if Some(a) != arch.as_ref() {
                    return bad(format!(
                        "architecture {a}, the first shard's {arch:?}: a shard of another model"
                    ));
                }
            }
            for t in &h.tensors {
                if !seen.insert(t.name.clone()) {
                    return bad(format!("tensor {:?} is also in an earlier shard", t.name));
                }
                header.tensors.push(TensorInfo { shard: i, ..t.clone() });
            }
            maps.push(m);
            data_offsets.push(h.data_offset);
        }
        if header.tensors.len() as u64 != total {
            return Err(err(
                &name,
                format!(
                    "the {count} shards hold {} tensors, split.tensors.count says {total}",
                    header.tensors.len()
                ),
            ));
        }
        Ok(GgufFile {
            path,
            header,
            maps,
            data_offsets,
            source: ModelSource::Gguf,
        })
    }

    /// A model whose header and maps were made elsewhere (an HF folder read as its GGUF
    /// conversion, `crate::hf`): `data_offsets[i]` is where map `i`'s tensor offsets start.
    pub(crate) fn from_parts(
        path: PathBuf,
        header: GgufHeader,
        maps: Vec<Mmap>,
        data_offsets: Vec<u64>,
        source: ModelSource,
    ) -> GgufFile {
        GgufFile {
            path,
            header,
            maps,
            data_offsets,
            source,
        }
    }

    /// Number of files (1 unless split).
    pub fn n_shards(&self) -> usize {
        self.maps.len()
    }

    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.header.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.header.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }

    /// The raw bytes of a tensor (zero-copy). Bounds were checked at open.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offsets[t.shard] + t.offset) as usize;
        &self.maps[t.shard][start..start + t.n_bytes as usize]
    }

    /// Tells the kernel the pages of `t` may be dropped from this process (they stay in the page
    /// cache and are re-read on the next access). Streaming forward passes call this after each
    /// layer, so resident memory stays about one layer, not the whole file.
    pub fn release(&self, t: &TensorInfo) {
        const PAGE: u64 = 4096;
        let data_offset = self.data_offsets[t.shard];
        let start = (data_offset + t.offset).div_ceil(PAGE) * PAGE;
        let end = (data_offset + t.offset + t.n_bytes) / PAGE * PAGE;
        if end > start {
            // SAFETY: the map is a private read-only file mapping; MADV_DONTNEED only drops this
            // process's copies of the pages, which read back identically from the file.
            let _ = unsafe {
                self.maps[t.shard].unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start as usize,
                    (end - start) as usize,
                )
            };
        }
    }

    /// The whole mapped (first) file.
    pub fn bytes(&self) -> &[u8] {
        &self.maps[0]
    }

    /// Bytes of all the files (of every shard of a split model).
    pub fn file_size(&self) -> u64 {
        self.maps.iter().map(|m| m.len() as u64).sum()
    }
}

pub(crate) fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Cursor<'a> {
    fn err_at(&self, offset: usize, msg: String) -> GgufError {
        GgufError {
            file: self.file.to_string(),
            offset: offset as u64,
            msg,
        }
    }

    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.err_at(
                self.pos,
                format!("truncated: need {n} bytes, {} left", self.remaining()),
            ));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }

    /// Refuses a count whose items, at `min_size` bytes each, could not fit in what is left.
    fn check_count(&self, n: u64, min_size: u64, what: &str) -> Result<(), GgufError> {
        if n.saturating_mul(min_size) > self.remaining() as u64 {
            return Err(self.err_at(
                self.pos,
                format!("{what} {n} cannot fit in the {} bytes left", self.remaining()),
            ));
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let at = self.pos;
        let len = self.u64()?;
        if len > self.remaining() as u64 {
            return Err(self.err_at(
                at,
                format!(
                    "string length {len} runs past the end ({} bytes left)",
                    self.remaining()
                ),
            ));
        }
        let bytes = self.take(len as usize)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| self.err_at(at, format!("string is not UTF-8: {e}")))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue, GgufError> {
        use value_type::*;
        let at = self.pos;
        Ok(match ty {
            U8 => MetaValue::U8(self.arr::<1>()?[0]),
            I8 => MetaValue::I8(self.arr::<1>()?[0] as i8),
            U16 => MetaValue::U16(u16::from_le_bytes(self.arr()?)),
            I16 => MetaValue::I16(i16::from_le_bytes(self.arr()?)),
            U32 => MetaValue::U32(self.u32()?),
            I32 => MetaValue::I32(i32::from_le_bytes(self.arr()?)),
            F32 => MetaValue::F32(f32::from_le_bytes(self.arr()?)),
            BOOL => match self.arr::<1>()?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.err_at(at, format!("bool value {b} is neither 0 nor 1"))),
            },
            STRING => MetaValue::String(self.string()?),
            U64 => MetaValue::U64(self.u64()?),
            I64 => MetaValue::I64(i64::from_le_bytes(self.arr()?)),
            F64 => MetaValue::F64(f64::from_le_bytes(self.arr()?)),
            ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err_at(at, format!("metadata arrays nested deeper than {MAX_ARRAY_DEPTH}")));
                }
                let elem_type = self.u32()?;
                let n = self.u64()?;
                let min_size = match elem_type {
                    U8 | I8 | BOOL => 1,
                    U16 | I16 => 2,
                    U32 | I32 | F32 => 4,
                    U64 | I64 | F64 | STRING => 8,
                    ARRAY => 12,
                    other => return Err(self.err_at(at, format!("unknown array element type {other}"))),
                };
                self.check_count(n, min_size, "array length")?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_type, depth + 1)?);
                }
                MetaValue::Array { elem_type, items }
            }
            other => return Err(self.err_at(at.saturating_sub(4), format!("unknown metadata value type {other}"))),
        })
    }
}
