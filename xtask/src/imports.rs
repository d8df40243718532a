//! No import circle in any crate: a test reads every crate's sources, draws which file
//! imports which (`use crate::..`, `use super::..`, and `crate::a::b::` paths in the code),
//! and fails naming the files of any circle. A folder's `mod.rs` and its own files do not
//! count (the parent declares the children; children may use what it defines), nor do
//! tests. The rule keeps each layer readable on its own: the store never reaches the API,
//! a strategy never reaches the trainer, the spec never reaches the planner.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Module = Vec<String>;

/// The circles among `src`'s files, each as its files' module paths (`a/b`).
pub fn cycles(src: &Path) -> std::io::Result<Vec<Vec<String>>> {
    let mut files = BTreeMap::new();
    collect(src, &mut Vec::new(), &mut files)?;
    let edges: BTreeMap<Module, BTreeSet<Module>> = files
        .iter()
        .map(|(module, text)| {
            let deps = imported_paths(module, text)
                .into_iter()
                .filter_map(|path| resolve(&files, &path))
                .filter(|dep| !related(dep, module))
                .collect();
            (module.clone(), deps)
        })
        .collect();
    Ok(strongly_connected(&edges).into_iter().map(|c| c.iter().map(|m| m.join("/")).collect()).collect())
}

/// Every .rs file under `dir` as its module path, with its text before its tests.
fn collect(dir: &Path, at: &mut Module, files: &mut BTreeMap<Module, String>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_stem().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if path.is_dir() {
            at.push(name);
            collect(&path, at, files)?;
            at.pop();
        } else if path.extension().is_some_and(|e| e == "rs") {
            let module = match name.as_str() {
                "lib" | "main" if at.is_empty() => continue,
                "mod" => at.clone(),
                _ => [at.as_slice(), &[name]].concat(),
            };
            let text = std::fs::read_to_string(&path)?;
            let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default().to_string();
            files.insert(module, text);
        }
    }
    Ok(())
}

/// The module paths `text` (the file of `module`) names, from the crate root.
fn imported_paths(module: &Module, text: &str) -> Vec<Module> {
    let mut paths = Vec::new();
    for (prefix, base) in
        [("use crate::", Vec::new()), ("use super::", module[..module.len().saturating_sub(1)].to_vec())]
    {
        for (start, _) in text.match_indices(prefix) {
            let rest = &text[start + prefix.len()..];
            let tree = &rest[..rest.find(';').unwrap_or(rest.len())];
            expand(&base, tree, &mut paths);
        }
    }
    for (start, _) in text.match_indices("crate::") {
        if text[..start].ends_with("use ") {
            continue;
        }
        let rest = &text[start + "crate::".len()..];
        let path: Vec<String> = rest
            .split("::")
            .map_while(|seg| {
                let ident: String = seg.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                (ident.len() == seg.len() && !ident.is_empty()).then_some(ident)
            })
            .collect();
        paths.push(path);
    }
    paths
}

/// Adds the paths of a use tree (`a::b::{c, d::{e, f}}`) under `base`.
fn expand(base: &[String], tree: &str, out: &mut Vec<Module>) {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or_default();
        let segs: Module =
            path.split("::").map(str::trim).filter(|s| !s.is_empty() && *s != "self").map(String::from).collect();
        out.push([base, segs.as_slice()].concat());
        return;
    };
    let head: Module = tree[..open].split("::").map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let base = [base, head.as_slice()].concat();
    let (mut depth, mut from) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand(&base, &inner[from..i], out);
                from = i + 1;
            }
            _ => {}
        }
    }
    if !inner[from..].trim().is_empty() {
        expand(&base, &inner[from..], out);
    }
}

/// The file a path lives in: its longest prefix that is a file.
fn resolve(files: &BTreeMap<Module, String>, path: &[String]) -> Option<Module> {
    (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|prefix| files.contains_key(prefix))
}

/// A file and one above it in its own folders (or the same file).
fn related(a: &Module, b: &Module) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// Tarjan's strongly connected components with more than one file.
fn strongly_connected(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, (usize, usize)>,
        stack: Vec<&'a Module>,
        found: Vec<Vec<Module>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, v: &'a Module) {
        let n = w.index.len();
        w.index.insert(v, (n, n));
        w.stack.push(v);
        for u in w.edges.get(v).into_iter().flatten() {
            let low = match w.index.get(u) {
                None => {
                    visit(w, u);
                    w.index[u].1
                }
                Some(&(i, _)) if w.stack.contains(&u) => i,
                Some(_) => continue,
            };
            let entry = w.index.get_mut(v).expect("visited");
            entry.1 = entry.1.min(low);
        }
        let (i, low) = w.index[v];
        if i == low {
            let at = w.stack.iter().rposition(|m| *m == v).expect("on the stack");
            let component: Vec<Module> = w.stack.drain(at..).cloned().collect();
            if component.len() > 1 {
                w.found.push(component);
            }
        }
    }
    let mut walk = Walk { edges, index: BTreeMap::new(), stack: Vec::new(), found: Vec::new() };
    for v in edges.keys() {
        if !walk.index.contains_key(v) {
            visit(&mut walk, v);
        }
    }
    walk.found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_crate_has_an_import_circle() {
        let root = crate::root();
        for krate in ["common", "server", "gpu-worker", "frontend", "emulated-gpu", "xtask"] {
            let found = cycles(&root.join(krate).join("src")).expect("the sources read");
            assert!(found.is_empty(), "{krate}/src has import circles: {found:?}");
        }
    }

    #[test]
    fn a_circle_is_found() {
        // (Under target/, not a temporary directory: xtask's tests build with exactly the
        // dependencies of `cargo xtask`, so that they reuse its release build.)
        let dir = crate::root().join("target/xtask-tests/a_circle_is_found");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("store")).unwrap();
        std::fs::write(dir.join("store/queue.rs"), "use crate::api::{error::HttpError, x};").unwrap();
        std::fs::write(dir.join("store/mod.rs"), "pub mod queue;").unwrap();
        std::fs::write(dir.join("api.rs"), "use crate::store::{self, queue::Leased};").unwrap();
        std::fs::write(dir.join("lib.rs"), "mod api; mod store;").unwrap();
        let found = cycles(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(
            found[0].iter().collect::<BTreeSet<_>>(),
            ["api", "store/queue"].iter().map(|s| s.to_string()).collect::<Vec<_>>().iter().collect()
        );
    }
}
