//! Split GGUF models (gguf-split's layout): the first shard opens all of them, with every
//! tensor's bytes identical to the unsplit file's; naming a later shard says which file to name;
//! and the hostile cases (a missing shard, a shard of another model, overlapping tensor sets, a
//! count that does not add up) are refused with an error naming the file.

use references::gguf::{split_key, GgufFile, MetaValue};
use references::synth::{preset, write_model};
use references::writer::{split_path, write_split, GgufWriter, SplitLimit, TensorSpec};
use std::path::{Path, PathBuf};

/// llama-tiny (2 layers, 21 tensors) written whole to `dir/whole.gguf`, and split 8 tensors a
/// shard (3 shards) with the prefix `dir/split`.
fn setup(dir: &Path) -> (GgufFile, Vec<PathBuf>) {
    let spec = preset("llama-tiny").unwrap();
    let whole = dir.join("whole.gguf");
    write_model(
        &spec,
        0,
        std::io::BufWriter::new(std::fs::File::create(&whole).unwrap()),
        |_, _| {},
    )
    .unwrap();
    let file = GgufFile::open(&whole).unwrap();
    let paths = write_split(&file, SplitLimit::Tensors(8), &dir.join("split")).unwrap();
    (file, paths)
}

fn open_err(p: &Path) -> String {
    match GgufFile::open(p) {
        Ok(_) => panic!("{} opened", p.display()),
        Err(e) => e.to_string(),
    }
}

/// Writes a shard at `path` with `meta` and the tensors `names` of `src` (their bytes).
fn write_shard(path: &Path, meta: &[(String, MetaValue)], src: &GgufFile, names: &[&str]) {
    let ts: Vec<_> = names.iter().map(|n| src.tensor(n).unwrap().clone()).collect();
    let specs = ts.iter().map(|t| TensorSpec::new(&t.name, t.ty, &t.ne)).collect();
    let mut w = GgufWriter::new(std::fs::File::create(path).unwrap(), meta, specs).unwrap();
    for t in &ts {
        w.write_tensor(src.tensor_data(t)).unwrap();
    }
    w.finish().unwrap();
}

fn split_meta(no: u16, count: u16, total: i32) -> Vec<(String, MetaValue)> {
    vec![
        (split_key::NO.into(), MetaValue::U16(no)),
        (split_key::COUNT.into(), MetaValue::U16(count)),
        (split_key::TENSORS_COUNT.into(), MetaValue::I32(total)),
    ]
}

#[test]
fn the_first_shard_opens_all_with_identical_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, paths) = setup(dir.path());
    assert_eq!(paths.len(), 3);
    assert_eq!(paths[0], split_path(&dir.path().join("split"), 1, 3));
    assert!(paths[0].ends_with("split-00001-of-00003.gguf"));
    let split = GgufFile::open(&paths[0]).unwrap();
    assert_eq!(split.n_shards(), 3);
    assert_eq!(split.tensors().len(), whole.tensors().len());
    for t in whole.tensors() {
        let s = split.tensor(&t.name).unwrap();
        assert_eq!((s.ty, &s.ne), (t.ty, &t.ne));
        assert!(split.tensor_data(s) == whole.tensor_data(t), "{}", t.name);
    }
    assert_eq!(split.tensors().iter().map(|t| t.shard).max(), Some(2));
    // Every metadata key of the whole file is in the first shard.
    for (k, v) in whole.metadata() {
        assert_eq!(split.get(k), Some(v), "{k}");
    }
}

#[test]
fn a_later_shard_names_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let (_, paths) = setup(dir.path());
    let e = open_err(&paths[1]);
    assert!(
        e.contains("shard 2 of 3") && e.contains("split-00001-of-00003.gguf"),
        "{e}"
    );
}

#[test]
fn a_missing_shard_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, paths) = setup(dir.path());
    std::fs::remove_file(&paths[2]).unwrap();
    let e = open_err(&paths[0]);
    assert!(e.contains("split-00003-of-00003.gguf") && e.contains("missing"), "{e}");
}

#[test]
fn a_shard_of_another_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, paths) = setup(dir.path());
    // Another split model's second shard: a different tensor count.
    let names: Vec<&str> = whole.tensors()[8..16].iter().map(|t| t.name.as_str()).collect();
    write_shard(&paths[1], &split_meta(1, 3, 22), &whole, &names);
    let e = open_err(&paths[0]);
    assert!(
        e.contains("another model") && e.contains("split-00002-of-00003.gguf"),
        "{e}"
    );
    // Same counts, another architecture.
    let mut meta = split_meta(1, 3, 21);
    meta.insert(0, ("general.architecture".into(), MetaValue::String("qwen2".into())));
    write_shard(&paths[1], &meta, &whole, &names);
    let e = open_err(&paths[0]);
    assert!(e.contains("architecture") && e.contains("another model"), "{e}");
    // A different split.count, or shard number.
    write_shard(&paths[1], &split_meta(1, 4, 21), &whole, &names);
    assert!(open_err(&paths[0]).contains("split.count"));
    write_shard(&paths[1], &split_meta(2, 3, 21), &whole, &names);
    assert!(open_err(&paths[0]).contains("split.no"));
}

#[test]
fn overlapping_or_short_tensor_sets_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, paths) = setup(dir.path());
    // Shard 2 repeats a tensor of shard 1.
    let mut names: Vec<&str> = whole.tensors()[8..16].iter().map(|t| t.name.as_str()).collect();
    names[0] = whole.tensors()[0].name.as_str();
    write_shard(&paths[1], &split_meta(1, 3, 21), &whole, &names);
    let e = open_err(&paths[0]);
    assert!(
        e.contains("also in an earlier shard") && e.contains(&whole.tensors()[0].name),
        "{e}"
    );
    // Shard 2 lacks a tensor: the total falls short of split.tensors.count.
    let names: Vec<&str> = whole.tensors()[9..16].iter().map(|t| t.name.as_str()).collect();
    write_shard(&paths[1], &split_meta(1, 3, 21), &whole, &names);
    let e = open_err(&paths[0]);
    assert!(e.contains("hold 20 tensors") && e.contains("says 21"), "{e}");
}

#[test]
fn a_split_file_without_the_shard_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, paths) = setup(dir.path());
    let renamed = dir.path().join("model.gguf");
    std::fs::rename(&paths[0], &renamed).unwrap();
    let e = open_err(&renamed);
    assert!(
        e.contains("split.count is 3") && e.contains("NAME-00001-of-00003.gguf"),
        "{e}"
    );
}
