//! Every test file of the worker runs. gpu-worker sets `autotests = false` (its CPU tests
//! are modules of one binary, `tests/engine.rs`), so cargo no longer finds a new file in
//! `tests/` by itself: a file that is neither a `[[test]]` in its Cargo.toml nor a `mod`
//! of `engine.rs` would never compile, let alone run. A test here reads the three and names
//! any such file.

use std::collections::BTreeSet;
use std::path::Path;

/// The `.rs` files directly in `crate_dir/tests` that no `[[test]]` target of
/// `crate_dir/Cargo.toml` and no `mod NAME;` of `tests/engine.rs` takes in.
pub fn unrun(crate_dir: &Path) -> std::io::Result<Vec<String>> {
    let tests = crate_dir.join("tests");
    let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml"))?;
    let engine = std::fs::read_to_string(tests.join("engine.rs"))?;
    let targets: BTreeSet<&str> = manifest
        .lines()
        .filter_map(|line| line.trim().strip_prefix("path = \"tests/")?.strip_suffix(".rs\""))
        .collect();
    let modules: BTreeSet<&str> =
        engine.lines().filter_map(|line| line.trim().strip_prefix("mod ")?.strip_suffix(';')).collect();
    let mut unrun = Vec::new();
    for entry in std::fs::read_dir(&tests)? {
        let path = entry?.path();
        // Folders hold the modules test files include by path (`ranks/`, `reference/`).
        if path.is_dir() || path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let name = path.file_stem().and_then(|n| n.to_str()).unwrap_or_default();
        if !targets.contains(name) && !modules.contains(name) {
            unrun.push(format!("tests/{name}.rs"));
        }
    }
    unrun.sort();
    Ok(unrun)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_worker_test_file_runs() {
        let unrun = unrun(&crate::root().join("gpu-worker")).expect("gpu-worker's tests are readable");
        assert!(
            unrun.is_empty(),
            "{unrun:?} in gpu-worker never run: list each as a [[test]] in gpu-worker/Cargo.toml or add \
             `mod NAME;` to tests/engine.rs"
        );
    }

    #[test]
    fn a_file_nothing_takes_in_is_named() {
        // (Under target/, not a temporary directory: see imports.rs.)
        let dir = crate::root().join("target/xtask-tests/test-targets");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tests/ranks")).unwrap();
        std::fs::write(dir.join("Cargo.toml"), "[[test]]\nname = \"listed\"\npath = \"tests/listed.rs\"\n").unwrap();
        std::fs::write(dir.join("tests/engine.rs"), "//! one binary\n\nmod ops;\n").unwrap();
        for file in ["listed.rs", "ops.rs", "forgotten.rs", "ranks/mod.rs", "notes.md"] {
            std::fs::write(dir.join("tests").join(file), "").unwrap();
        }
        // engine.rs is not itself listed in this manifest: it is named too.
        assert_eq!(unrun(&dir).unwrap(), ["tests/engine.rs", "tests/forgotten.rs"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
