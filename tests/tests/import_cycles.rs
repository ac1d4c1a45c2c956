//! No import cycles among the files of a crate. Every crate's module tree is read from its roots
//! (`lib.rs`, `main.rs`) through its `mod` declarations (`foo.rs`, `foo/mod.rs`, `#[path]`, inline
//! `mod tests { .. }`), every `use` declaration (`crate::`, `self::`, `super::`, a child module's
//! name; `{..}` groups, globs, `as`) and every path written out in code (`crate::x::f()`,
//! `super::y::Z`) becomes an edge from the file that holds it to the file that defines what it
//! names (a `pub use` re-export is followed to its source), and the test fails on a cycle,
//! printing it with the lines that make it.
//!
//! Two kinds of reference are not edges: within one file, and from a module to one of its
//! ancestors (`use super::CudaBackend` in `cuda/gemv.rs`: a folder's files may use what its
//! `mod.rs` defines, which is how an `impl` is split over files). A parent that uses its child's
//! items is an edge, so a child and a sibling of its parent that use each other close a cycle.
//! Comments and strings are not read.
//!
//! Beside it: no Rust source file of a crate is over 1,200 lines (split by responsibility instead).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A token of Rust source, as much as module and `use` parsing needs.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    /// `::`
    PathSep,
    Punct(char),
}

/// Tokens with their 1-based line numbers; comments, numbers' suffixes, char literals and
/// lifetimes are dropped.
fn tokenize(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == 'r' && (c.get(i + 1) == Some(&'#') || c.get(i + 1) == Some(&'"')) && {
            // A raw string r"..", r#".."#: find the quote after the hashes.
            let mut j = i + 1;
            while c.get(j) == Some(&'#') {
                j += 1;
            }
            c.get(j) == Some(&'"')
        } {
            let mut j = i + 1;
            let mut hashes = 0;
            while c[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            let start = j;
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (0..hashes).all(|h| c.get(j + 1 + h) == Some(&'#')) {
                    break;
                }
                if c[j] == '\n' {
                    line += 1;
                }
                j += 1;
            }
            out.push((Tok::Str(c[start..j.min(c.len())].iter().collect()), line));
            i = j + 1 + hashes;
        } else if ch == '"' || (ch == 'b' && c.get(i + 1) == Some(&'"')) {
            let mut j = if ch == 'b' { i + 2 } else { i + 1 };
            let start = j;
            while j < c.len() && c[j] != '"' {
                if c[j] == '\\' {
                    j += 1;
                }
                if c.get(j) == Some(&'\n') {
                    line += 1;
                }
                j += 1;
            }
            out.push((Tok::Str(c[start..j.min(c.len())].iter().collect()), line));
            i = j + 1;
        } else if ch == '\'' {
            // A char literal ('a', '\n', '\u{..}') or a lifetime ('a): both are dropped.
            if c.get(i + 1) == Some(&'\\') {
                // Past the backslash and the escaped char ('\'', '\n', '\u{..}').
                let mut j = i + 3;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if ch.is_alphanumeric() || ch == '_' || ch == '$' {
            let start = i;
            i += 1;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push((Tok::Ident(c[start..i].iter().collect()), line));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::PathSep, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// One path a `use` declaration brings in: its segments (a trailing `self` removed; a glob's
/// `*` left out).
#[derive(Clone, Debug)]
struct UsePath {
    segs: Vec<String>,
    /// The name it is visible under (`as` or the last segment); `None` for a glob or `as _`.
    name: Option<String>,
}

/// Parses a use tree from `toks[*pos..]` up to (not including) the `;`, `,` or `}` that ends it.
fn parse_use_tree(toks: &[(Tok, usize)], pos: &mut usize, prefix: &[String], out: &mut Vec<UsePath>) {
    let mut segs = prefix.to_vec();
    if toks.get(*pos).map(|t| &t.0) == Some(&Tok::PathSep) {
        // `use ::foo`: an external crate.
        segs.push("::".into());
        *pos += 1;
    }
    loop {
        match toks.get(*pos).map(|t| &t.0) {
            Some(Tok::Ident(s)) => {
                segs.push(s.clone());
                *pos += 1;
                match toks.get(*pos).map(|t| &t.0) {
                    Some(Tok::PathSep) => *pos += 1,
                    Some(Tok::Ident(a)) if a == "as" => {
                        *pos += 1;
                        let alias = match toks.get(*pos).map(|t| &t.0) {
                            Some(Tok::Ident(n)) if n != "_" => Some(n.clone()),
                            _ => None,
                        };
                        *pos += 1;
                        push_path(segs, false, alias, true, out);
                        return;
                    }
                    _ => {
                        push_path(segs, false, None, false, out);
                        return;
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                *pos += 1;
                push_path(segs, true, None, false, out);
                return;
            }
            Some(Tok::Punct('{')) => {
                *pos += 1;
                loop {
                    match toks.get(*pos).map(|t| &t.0) {
                        Some(Tok::Punct('}')) => {
                            *pos += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *pos += 1,
                        None => return,
                        _ => parse_use_tree(toks, pos, &segs, out),
                    }
                }
            }
            _ => return,
        }
    }
}

fn push_path(mut segs: Vec<String>, glob: bool, alias: Option<String>, aliased: bool, out: &mut Vec<UsePath>) {
    if segs.last().map(String::as_str) == Some("self") {
        segs.pop();
    }
    let name = if glob {
        None
    } else if aliased {
        alias
    } else {
        segs.last().cloned()
    };
    out.push(UsePath { segs, name });
}

/// A module path from the crate root (`[]` is the root; `["cuda", "gemv"]` is `crate::cuda::gemv`).
type ModPath = Vec<String>;

/// One `use` declaration's path, or a path written out in code, and where it was written.
#[derive(Debug)]
struct UseDecl {
    module: ModPath,
    file: usize,
    line: usize,
    public: bool,
    path: UsePath,
}

/// A crate's module tree and `use` declarations.
#[derive(Default, Debug)]
struct Crate {
    /// Files, relative to the workspace root, and the module each one is.
    files: Vec<(PathBuf, ModPath)>,
    /// Every module (file or inline) → the index of the file it is in.
    modules: BTreeMap<ModPath, usize>,
    uses: Vec<UseDecl>,
}

impl Crate {
    /// Reads the module tree from the given root files (`lib.rs`, `main.rs`; each its own crate
    /// root, so pass one at a time unless they share nothing).
    fn load(root: &Path, crate_root: &Path) -> Result<Crate, String> {
        let mut krate = Crate::default();
        krate.load_file(root, crate_root, Vec::new(), true)?;
        Ok(krate)
    }

    fn load_file(&mut self, workspace: &Path, file: &Path, module: ModPath, mod_rs: bool) -> Result<(), String> {
        let src = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        let rel = file.strip_prefix(workspace).unwrap_or(file).to_path_buf();
        let file_idx = self.files.len();
        self.files.push((rel, module.clone()));
        self.modules.insert(module.clone(), file_idx);
        // Where a `mod foo;` here looks for foo.rs / foo/mod.rs.
        let dir = if mod_rs {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        let toks = tokenize(&src);
        // The brace stack: Some(name) for an inline module's braces.
        let mut stack: Vec<Option<String>> = Vec::new();
        let mut path_attr: Option<String> = None;
        let mut i = 0;
        while i < toks.len() {
            let here: ModPath = module.iter().cloned().chain(stack.iter().flatten().cloned()).collect();
            match &toks[i].0 {
                Tok::Punct('#') => {
                    // An attribute: remember a `#[path = ".."]`, skip the rest.
                    let mut j = i + 1;
                    if toks.get(j).map(|t| &t.0) == Some(&Tok::Punct('!')) {
                        j += 1;
                    }
                    if toks.get(j).map(|t| &t.0) == Some(&Tok::Punct('[')) {
                        let mut depth = 0;
                        let start = j;
                        while j < toks.len() {
                            match toks[j].0 {
                                Tok::Punct('[') => depth += 1,
                                Tok::Punct(']') => {
                                    depth -= 1;
                                    if depth == 0 {
                                        break;
                                    }
                                }
                                _ => {}
                            }
                            j += 1;
                        }
                        if let (Some(Tok::Ident(p)), Some(Tok::Punct('=')), Some(Tok::Str(s))) = (
                            toks.get(start + 1).map(|t| &t.0),
                            toks.get(start + 2).map(|t| &t.0),
                            toks.get(start + 3).map(|t| &t.0),
                        ) {
                            if p == "path" {
                                path_attr = Some(s.clone());
                            }
                        }
                        i = j + 1;
                        continue;
                    }
                    i += 1;
                }
                Tok::Ident(kw) if kw == "mod" => {
                    let (Some(Tok::Ident(name)), next) = (toks.get(i + 1).map(|t| &t.0), toks.get(i + 2).map(|t| &t.0))
                    else {
                        i += 1;
                        continue;
                    };
                    let mut child = here.clone();
                    child.push(name.clone());
                    match next {
                        Some(Tok::Punct(';')) => {
                            let (path, child_mod_rs) = if let Some(p) = path_attr.take() {
                                (file.parent().unwrap().join(p), true)
                            } else {
                                // Inline modules nest the directory too.
                                let mut d = dir.clone();
                                for m in stack.iter().flatten() {
                                    d.push(m);
                                }
                                let flat = d.join(format!("{name}.rs"));
                                if flat.is_file() {
                                    (flat, false)
                                } else {
                                    (d.join(name).join("mod.rs"), true)
                                }
                            };
                            self.load_file(workspace, &path, child, child_mod_rs)?;
                            i += 3;
                        }
                        Some(Tok::Punct('{')) => {
                            self.modules.insert(child, file_idx);
                            stack.push(Some(name.clone()));
                            path_attr = None;
                            i += 3;
                        }
                        _ => i += 1,
                    }
                }
                Tok::Ident(kw) if kw == "use" => {
                    let public = i > 0
                        && (toks[i - 1].0 == Tok::Ident("pub".into())
                            || (toks[i - 1].0 == Tok::Punct(')')
                                && toks[..i].iter().rev().take(6).any(|t| t.0 == Tok::Ident("pub".into()))));
                    let line = toks[i].1;
                    let mut pos = i + 1;
                    let mut paths = Vec::new();
                    parse_use_tree(&toks, &mut pos, &[], &mut paths);
                    for path in paths {
                        self.uses.push(UseDecl {
                            module: here.clone(),
                            file: file_idx,
                            line,
                            public,
                            path,
                        });
                    }
                    while pos < toks.len() && toks[pos].0 != Tok::Punct(';') {
                        pos += 1;
                    }
                    path_attr = None;
                    i = pos + 1;
                }
                Tok::Ident(kw)
                    if matches!(kw.as_str(), "crate" | "$crate" | "super" | "self")
                        && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::PathSep)
                        && (i == 0 || toks[i - 1].0 != Tok::PathSep) =>
                {
                    // A path written out in code: `crate::commands::gate::run(..)`.
                    let line = toks[i].1;
                    let mut segs = vec![kw.clone()];
                    let mut j = i + 1;
                    while toks.get(j).map(|t| &t.0) == Some(&Tok::PathSep) {
                        match toks.get(j + 1).map(|t| &t.0) {
                            Some(Tok::Ident(seg)) => segs.push(seg.clone()),
                            _ => break,
                        }
                        j += 2;
                    }
                    let path = UsePath { segs, name: None };
                    self.uses.push(UseDecl {
                        module: here.clone(),
                        file: file_idx,
                        line,
                        public: false,
                        path,
                    });
                    i = j;
                }
                Tok::Punct('{') => {
                    stack.push(None);
                    i += 1;
                }
                Tok::Punct('}') => {
                    stack.pop();
                    i += 1;
                }
                Tok::Punct(';') => {
                    path_attr = None;
                    i += 1;
                }
                _ => i += 1,
            }
        }
        Ok(())
    }

    fn is_module(&self, m: &[String]) -> bool {
        self.modules.contains_key(m)
    }

    /// The module a path written in `from` names, following `pub use` re-exports of an item.
    fn resolve(&self, from: &[String], segs: &[String], depth: usize) -> Option<ModPath> {
        let first = segs.first()?;
        let (mut base, mut i): (ModPath, usize) = match first.as_str() {
            "crate" | "$crate" => (Vec::new(), 1),
            "self" => (from.to_vec(), 1),
            "super" => {
                let mut b = from.to_vec();
                let mut i = 0;
                while segs.get(i).map(String::as_str) == Some("super") {
                    b.pop()?;
                    i += 1;
                }
                (b, i)
            }
            name => {
                let mut child = from.to_vec();
                child.push(name.to_string());
                if !self.is_module(&child) {
                    return None; // an external crate, a prelude name or a `use`d alias
                }
                (from.to_vec(), 0)
            }
        };
        while let Some(seg) = segs.get(i) {
            let mut child = base.clone();
            child.push(seg.clone());
            if !self.is_module(&child) {
                break;
            }
            base = child;
            i += 1;
        }
        if let (Some(item), true) = (segs.get(i), depth < 8) {
            // An item of `base`: where does base's own `pub use` (if any) get it from?
            for u in &self.uses {
                if u.public && u.module == base && u.path.name.as_deref() == Some(item) {
                    if let Some(target) = self.resolve(&u.module, &u.path.segs, depth + 1) {
                        return Some(target);
                    }
                }
            }
        }
        Some(base)
    }

    /// Edges between files: (from file, to file) → the first `use` line that makes it.
    fn edges(&self) -> BTreeMap<(usize, usize), usize> {
        let mut edges = BTreeMap::new();
        for u in &self.uses {
            let Some(target) = self.resolve(&u.module, &u.path.segs, 0) else {
                continue;
            };
            let to = self.modules[&target];
            let from_mod = &self.files[u.file].1;
            let to_mod = &self.files[to].1;
            // Same file, or a module using what an ancestor of it defines: not an edge.
            if to == u.file || (to_mod.len() < from_mod.len() && from_mod.starts_with(to_mod)) {
                continue;
            }
            edges.entry((u.file, to)).or_insert(u.line);
        }
        edges
    }

    /// Every cycle among the files, one per strongly connected component, printed as
    /// `a.rs:LINE -> b.rs:LINE -> a.rs`, where LINE is the `use` that leads to the next file, with
    /// every file of the component when the cycle does not pass through them all.
    fn cycles(&self) -> Vec<String> {
        let edges = self.edges();
        let n = self.files.len();
        let mut adj = vec![Vec::new(); n];
        for &(a, b) in edges.keys() {
            adj[a].push(b);
        }
        let mut out = Vec::new();
        for scc in tarjan(&adj) {
            if scc.len() < 2 {
                continue;
            }
            let set: BTreeSet<usize> = scc.iter().copied().collect();
            let start = *set.iter().next().unwrap();
            // The shortest way back to start within the component.
            let mut prev = vec![usize::MAX; n];
            let mut queue = std::collections::VecDeque::from([start]);
            let mut found = false;
            while let Some(a) = queue.pop_front() {
                for &b in &adj[a] {
                    if !set.contains(&b) {
                        continue;
                    }
                    if b == start {
                        prev[start] = a;
                        found = true;
                        break;
                    }
                    if prev[b] == usize::MAX {
                        prev[b] = a;
                        queue.push_back(b);
                    }
                }
                if found {
                    break;
                }
            }
            let mut cycle = vec![start];
            let mut at = prev[start];
            while at != start {
                cycle.push(at);
                at = prev[at];
            }
            cycle.push(start);
            cycle.reverse();
            let mut text = String::new();
            for w in cycle.windows(2) {
                text += &format!("{}:{} -> ", self.files[w[0]].0.display(), edges[&(w[0], w[1])]);
            }
            text += &self.files[start].0.display().to_string();
            if set.len() + 1 > cycle.len() {
                let knot: Vec<String> = set.iter().map(|&f| self.files[f].0.display().to_string()).collect();
                text += &format!(" (one of the cycles among {})", knot.join(", "));
            }
            out.push(text);
        }
        out
    }
}

/// Tarjan's strongly connected components.
fn tarjan(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct St<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut St, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on[v] = true;
        for &w in &s.adj[v] {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(comp);
        }
    }
    let n = adj.len();
    let mut s = St {
        adj,
        index: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: vec![],
        next: 0,
        out: vec![],
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Every `.rs` file under `dir`.
fn rs_files(dir: &Path, out: &mut BTreeSet<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.insert(p);
        }
    }
}

#[test]
fn no_import_cycles_among_a_crates_files() {
    let ws = workspace_root();
    let mut report = Vec::new();
    for krate in ["references", "engine", "harness", "reports", "tests"] {
        let src = ws.join(krate).join("src");
        let mut reached = BTreeSet::new();
        for root in ["lib.rs", "main.rs"] {
            let root = src.join(root);
            if !root.is_file() {
                continue;
            }
            let c = Crate::load(&ws, &root).unwrap_or_else(|e| panic!("{e}"));
            reached.extend(c.files.iter().map(|(p, _)| ws.join(p)));
            for cycle in c.cycles() {
                report.push(format!("{krate}: {cycle}"));
            }
        }
        // A file no `mod` reaches would be a file this test never read.
        let mut all = BTreeSet::new();
        rs_files(&src, &mut all);
        for f in all.difference(&reached) {
            report.push(format!(
                "{krate}: {} is not reached from the crate root by any `mod`",
                f.display()
            ));
        }
    }
    assert!(
        report.is_empty(),
        "import cycles among a crate's files:\n  {}",
        report.join("\n  ")
    );
}

/// A file over this many lines does more than one job: split it by responsibility.
const MAX_LINES: usize = 1200;

#[test]
fn no_source_file_is_over_the_line_limit() {
    let ws = workspace_root();
    let mut over = Vec::new();
    for krate in ["references", "engine", "harness", "reports", "tests"] {
        let mut files = BTreeSet::new();
        rs_files(&ws.join(krate), &mut files);
        for f in files {
            let n = std::fs::read_to_string(&f).unwrap().lines().count();
            if n > MAX_LINES {
                over.push(format!("{} ({n} lines)", f.display()));
            }
        }
    }
    assert!(
        over.is_empty(),
        "files over {MAX_LINES} lines:\n  {}",
        over.join("\n  ")
    );
}

/// The checker itself, on a crate written here: it must see a cycle through a `mod.rs` folder, a
/// `#[path]` module, a `{..}` group, a re-export and a path written out in code, and nothing where
/// a child uses its parent, a test module uses `super::*`, or a comment or string names a module.
#[test]
fn the_checker_finds_planted_cycles_and_only_those() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let w = |p: &str, s: &str| {
        let p = src.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    };
    w(
        "lib.rs",
        "//! root\npub mod backend;\npub mod rank;\npub mod cuda;\npub mod leaf;\npub use rank::Route;\n\
         #[cfg(test)]\nmod tests { use super::*; }\n",
    );
    // backend -> crate::Route (re-exported from rank) -> rank -> backend: a cycle.
    w(
        "backend.rs",
        "//! b\nuse crate::{leaf::X, Route};\npub trait Backend {}\n",
    );
    w(
        "rank.rs",
        "//! r\nuse crate::backend::Backend;\npub struct Route; // use crate::cuda::Nope;\n",
    );
    // cuda/mod.rs uses its child; the child uses its parent (no edge) and the #[path] file.
    w(
        "cuda/mod.rs",
        "//! c\nmod gemv;\n#[path = \"other_name.rs\"]\nmod attn;\nuse gemv::launch;\npub struct Cuda;\n",
    );
    w(
        "cuda/gemv.rs",
        "//! g\nuse super::{attn::Split, Cuda};\npub fn launch() { let _ = \"use crate::leaf;\"; }\n",
    );
    // The #[path] file closes a cycle with gemv.rs: attn -> gemv -> attn.
    w(
        "cuda/other_name.rs",
        "//! a\nuse super::gemv as g;\npub struct Split;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
    );
    w(
        "leaf.rs",
        "//! l\nuse std::fmt;\npub struct X<'a>(&'a u8, char);\nconst C: [char; 2] = ['{', '\\''];\nconst D: &str = r#\"}\"#;\n",
    );

    let c = Crate::load(dir.path(), &src.join("lib.rs")).unwrap();
    let names: BTreeSet<String> = c.files.iter().map(|(p, _)| p.display().to_string()).collect();
    assert_eq!(names.len(), 7, "{names:?}");
    assert!(names.contains("src/cuda/other_name.rs"), "{names:?}");
    let mut cycles = c.cycles();
    cycles.sort();
    assert_eq!(cycles.len(), 2, "{cycles:#?}");
    assert!(
        cycles[0].starts_with("src/backend.rs:2 -> src/rank.rs:2 -> src/backend.rs"),
        "{cycles:#?}"
    );
    assert!(
        cycles[1].contains("src/cuda/gemv.rs:2 -> src/cuda/other_name.rs:2 -> src/cuda/gemv.rs"),
        "{cycles:#?}"
    );

    // Without the two closing uses, the same crate is acyclic.
    w("rank.rs", "//! r\npub struct Route;\n");
    w("cuda/other_name.rs", "//! a\npub struct Split;\n");
    let c = Crate::load(dir.path(), &src.join("lib.rs")).unwrap();
    assert_eq!(c.cycles(), Vec::<String>::new());
    assert!(!c.edges().is_empty(), "the acyclic crate still has edges");
}
