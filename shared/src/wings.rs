//! The check that the library's wings stay layered: no import circle between files of
//! different wings.
//!
//! A wing is an entry of `src/` — a folder (`task/`, `redis/`, …) or a one-file module
//! (`error.rs`, `tls.rs`, …). The test reads every source file, collects the wings its code
//! names through `crate::<wing>` (and the root re-exports, `crate::Store` → `redis`, read from
//! `lib.rs`), and fails on a circle in the graph of wings, naming a file behind each edge.
//!
//! Comment lines are skipped (a doc link is no import), and so are `#[cfg(test)] mod` blocks (a
//! test may reach up: the key-layout test of `names` runs the prelude in Redis through a
//! [`Store`](crate::Store), `tls`'s tests parse settings).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// Every `.rs` file under `dir` (also the probe module's source scan).
pub(crate) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file: no comment lines, no `#[cfg(test)] mod … { … }` (wherever it stands).
fn code(text: &str) -> String {
    let text: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("#[cfg(test)]\nmod ") {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        let Some(open) = rest.find(['{', ';']) else {
            break;
        };
        if rest[open..].starts_with(';') {
            // `mod x;`: a file of its own (read on its own, as part of this wing).
            rest = &rest[open + 1..];
            continue;
        }
        rest = &rest[block_end(&rest[open..]).map_or(rest.len(), |e| open + e)..];
    }
    out.push_str(rest);
    out
}

/// The length of the `{ … }` block `s` opens with, skipping strings and `'{'` / `'}'`.
fn block_end(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    let (mut depth, mut i, mut in_str) = (0usize, 0usize, false);
    while i < b.len() {
        match (in_str, b[i]) {
            (true, b'\\') => i += 1,
            (true, b'"') | (false, b'"') => in_str = !in_str,
            (false, b'\'') if b.get(i + 2) == Some(&b'\'') => i += 2,
            (false, b'{') => depth += 1,
            (false, b'}') => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segment of every path that follows `crate::` (inside `crate::{…}` groups too).
fn crate_refs(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group: split at commas outside nested braces.
            let mut depth = 0usize;
            let mut start = 0usize;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push(ident(group[start..j].trim()).to_string());
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident(group[start..j].trim()).to_string());
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest).to_string());
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// `pub use wing::…` lines of `lib.rs`: root name → wing.
fn root_aliases(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in lib.lines() {
        let Some(rest) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let wing = ident(rest).to_string();
        let names = rest[wing.len()..].trim_start_matches("::");
        let names = names.trim_end_matches(';');
        let names = names.trim_start_matches('{').trim_end_matches('}');
        for n in names.split(',') {
            let n = n.trim();
            let n = n.rsplit(" as ").next().unwrap_or(n).trim();
            let n = n.rsplit("::").next().unwrap_or(n);
            if !n.is_empty() {
                out.insert(n.to_string(), wing.clone());
            }
        }
    }
    out
}

fn graph(src: &Path) -> Graph {
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap_or_default();
    let aliases = root_aliases(&lib);
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let wing_of = |p: &Path| -> Option<String> {
        let rel = p.strip_prefix(src).ok()?;
        let first = rel.components().next()?.as_os_str().to_str()?;
        (first != "lib.rs").then(|| first.trim_end_matches(".rs").to_string())
    };
    let wings: BTreeSet<String> = files.iter().filter_map(|p| wing_of(p)).collect();
    let mut g = Graph::new();
    for p in &files {
        let Some(me) = wing_of(p) else { continue };
        let text = std::fs::read_to_string(p).unwrap_or_default();
        let shown = p.strip_prefix(src).unwrap_or(p).display().to_string();
        let edges = g.entry(me.clone()).or_default();
        for r in crate_refs(&code(&text)) {
            let to = aliases.get(&r).cloned().unwrap_or(r);
            if to != me && wings.contains(&to) {
                edges.entry(to).or_insert_with(|| shown.clone());
            }
        }
    }
    g
}

/// The edges between wings on a circle (empty when the wings are layered).
fn circles(g: &Graph) -> Vec<String> {
    let mut left: BTreeMap<&str, BTreeSet<&str>> = g
        .iter()
        .map(|(w, e)| (w.as_str(), e.keys().map(String::as_str).collect()))
        .collect();
    // Peel off wings that use no wing left (sinks) and wings no wing left uses (sources): what
    // stays lies on a circle.
    loop {
        let used: BTreeSet<&str> = left.values().flatten().copied().collect();
        let peel: Vec<&str> = left
            .iter()
            .filter(|(w, e)| e.iter().all(|t| !left.contains_key(t)) || !used.contains(*w))
            .map(|(w, _)| *w)
            .collect();
        if peel.is_empty() {
            break;
        }
        for w in peel {
            left.remove(w);
        }
    }
    let mut out = Vec::new();
    for (w, e) in &left {
        for t in e.iter().filter(|t| left.contains_key(*t)) {
            let file = g
                .get(*w)
                .and_then(|e| e.get(*t))
                .cloned()
                .unwrap_or_default();
            out.push(format!("{w} -> {t} (in {file})"));
        }
    }
    out
}

#[test]
fn no_circle_between_wings() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = graph(&src);
    assert!(g.len() >= 10, "expected the library's wings, read {g:?}");
    assert!(
        g.get("broker").is_some_and(|e| e.contains_key("redis")),
        "{g:?}"
    );
    let left = circles(&g);
    assert!(
        left.is_empty(),
        "import circle between wings:\n{}",
        left.join("\n")
    );
}

#[test]
fn a_circle_is_found() {
    let mut g = Graph::new();
    for (a, b) in [("task", "error"), ("redis", "task"), ("task", "redis")] {
        g.entry(a.into())
            .or_default()
            .insert(b.into(), format!("{a}/x.rs"));
    }
    let left = circles(&g);
    assert_eq!(
        left,
        [
            "redis -> task (in redis/x.rs)",
            "task -> redis (in task/x.rs)"
        ]
    );
    assert_eq!(
        crate_refs("use crate::{a::{B, C}, d as e};\nlet x = crate::f::g();"),
        ["a", "d", "f"]
    );
    let file = "use crate::a::X;\n#[cfg(test)]\nmod tests {\n    use crate::b::Y;\n    \
                fn f() { let _ = ('{', \"}}\"); }\n}\n// crate::c\nfn after() { crate::d::z(); }\n";
    assert_eq!(crate_refs(&code(file)), ["a", "d"]);
}
