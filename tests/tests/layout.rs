//! The harness crate's layout stays in order: no import circle among its source files and no
//! source file over 1,200 lines.
//!
//! How the circles are found: every `crate::a::b…` and `super::…` path in a file's code (comments
//! and the file's `#[cfg(test)] mod tests` left out) is an edge from the file's module to the
//! deepest module of the crate the path names; a `mod x;` declaration is an edge from the parent to
//! `x`. A cycle in that graph is a circle: two files that need each other, directly or through
//! others. `main.rs` is its own crate and is left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 1200;

/// The module path of every `.rs` file under `src` (`lib.rs` is the root, `a/mod.rs` is `a`).
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap();
            let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            let last = parts.pop().unwrap();
            match last.as_str() {
                "main.rs" if parts.is_empty() => continue,
                "lib.rs" if parts.is_empty() => {}
                "mod.rs" => {}
                f => parts.push(f.trim_end_matches(".rs").to_string()),
            }
            out.insert(parts, p);
        }
    }
    out
}

/// The code of a file: comments dropped, the unit-test module cut off.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths in `code` after each `crate::` or `super::` (as segments, `super` kept), and the
/// modules declared with `mod x;`.
fn paths(code: &str) -> (Vec<Vec<String>>, Vec<String>) {
    let mut found = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !is_ident(bytes[i - 1]);
        let rest: String = bytes[i..bytes.len().min(i + 7)].iter().collect();
        if starts_word && (rest.starts_with("crate::") || rest.starts_with("super::")) {
            let mut j = i;
            while j < bytes.len() && (is_ident(bytes[j]) || bytes[j] == ':') {
                j += 1;
            }
            let s: String = bytes[i..j].iter().collect();
            let segs: Vec<String> = s.split("::").filter(|x| !x.is_empty()).map(String::from).collect();
            found.push(segs);
            i = j;
        } else {
            i += 1;
        }
    }
    let mods = code
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            l.strip_prefix("mod ")
                .and_then(|m| m.strip_suffix(';'))
                .map(|m| m.trim().to_string())
        })
        .collect();
    (found, mods)
}

/// Edges between modules of the crate under `src`.
fn graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mods = modules(src);
    let mut g: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (m, file) in &mods {
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        let (found, declared) = paths(&code);
        let entry = g.entry(m.clone()).or_default();
        for d in declared {
            let mut child = m.clone();
            child.push(d);
            entry.insert(child);
        }
        for segs in found {
            let mut base: Vec<String> = if segs[0] == "crate" { Vec::new() } else { m.clone() };
            let mut rest = &segs[..];
            if segs[0] == "crate" {
                rest = &segs[1..];
            }
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
            // The deepest module the path names.
            let mut target = base.clone();
            for s in rest {
                let mut next = target.clone();
                next.push(s.clone());
                if mods.contains_key(&next) {
                    target = next;
                } else {
                    break;
                }
            }
            if &target != m {
                entry.insert(target);
            }
        }
    }
    g
}

/// One cycle of `g`, if it has any (as module paths joined with `::`).
fn find_cycle(g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<String>> {
    // 0 unvisited, 1 on the stack, 2 done.
    fn visit(
        n: &Vec<String>,
        g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<String>> {
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|x| x == m).unwrap();
                    let mut c: Vec<String> = stack[at..].iter().map(|x| x.join("::")).collect();
                    c.push(m.join("::"));
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn src(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(krate).join("src")
}

#[test]
fn the_checker_finds_a_planted_circle() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("lib.rs"), "pub mod a;\npub mod b;\n").unwrap();
    std::fs::write(dir.path().join("a.rs"), "use crate::b::f;\n").unwrap();
    std::fs::write(dir.path().join("b.rs"), "pub fn f() { crate::a::g() }\n").unwrap();
    let c = find_cycle(&graph(dir.path())).expect("a <-> b is a circle");
    assert!(c.contains(&"a".to_string()) && c.contains(&"b".to_string()), "{c:?}");
    // A child reaching into its parent's own items is a circle too (the parent declares it).
    std::fs::write(dir.path().join("b.rs"), "pub fn f() {}\n").unwrap();
    std::fs::create_dir(dir.path().join("c")).unwrap();
    std::fs::write(dir.path().join("lib.rs"), "pub mod a;\npub mod b;\npub mod c;\n").unwrap();
    std::fs::write(dir.path().join("c/mod.rs"), "pub mod x;\npub fn h() {}\n").unwrap();
    std::fs::write(dir.path().join("c/x.rs"), "use super::h;\n").unwrap();
    assert!(find_cycle(&graph(dir.path())).is_some());
    // Siblings sharing a third module are fine.
    std::fs::write(dir.path().join("c/mod.rs"), "pub mod x;\npub mod y;\n").unwrap();
    std::fs::write(dir.path().join("c/y.rs"), "pub fn h() {}\n").unwrap();
    std::fs::write(
        dir.path().join("c/x.rs"),
        "use super::y::h;\n// crate::c::h in a comment\n",
    )
    .unwrap();
    assert_eq!(find_cycle(&graph(dir.path())), None);
}

#[test]
fn harness_has_no_import_circle() {
    let g = graph(&src("harness"));
    assert!(g.len() > 30, "found only {} modules", g.len());
    if let Some(c) = find_cycle(&g) {
        panic!("import circle in harness/src: {}", c.join(" -> "));
    }
}

#[test]
fn no_harness_or_reports_file_is_over_the_limit() {
    for krate in ["harness", "reports"] {
        for file in modules(&src(krate)).values() {
            let n = std::fs::read_to_string(file).unwrap().lines().count();
            assert!(n <= MAX_LINES, "{} has {n} lines (limit {MAX_LINES})", file.display());
        }
    }
}
