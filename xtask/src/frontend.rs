//! `cargo xtask build-frontend`: the browser app in target/site/.
//!
//! 1. cargo builds the Leptos app for wasm32, its final link with `--emit-relocs`, so the
//!    linker keeps the relocations a splitter needs to move code between modules.
//! 2. wasm-split (`wasm_split_cli_support`) cuts the module at the app's split points (the
//!    pages behind `#[lazy_route]` in `frontend/src/app.rs`): a main module with the layout
//!    and the first page, one chunk per page, chunks of code several pages share, and
//!    `__wasm_split.js`, which fetches a chunk the first time its page opens.
//! 3. wasm-bindgen (as a library, so the glue matches the wasm-bindgen in Cargo.lock) makes
//!    the main module's JS glue.
//! 4. index.html, which loads the glue and, once the app runs, prefetches every chunk.
//!
//! Everything but index.html lands in `assets/VERSION/`, VERSION a hash of the linked wasm
//! and the stylesheet: a tab opened before a rebuild keeps fetching its own build's chunks
//! (or gets a 404 once they are gone, never another build's), and the server may let
//! browsers cache those files for good. The site is built beside the old one and swapped in.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};

use crate::{cargo, root, status};

const WASM_TARGET: &str = "wasm32-unknown-unknown";
const WASM_PROFILE: &str = "wasm-release";
pub const SITE_DIR: &str = "target/site";
/// The module the main wasm imports its chunk loaders from (next to the glue).
const SPLIT_LINK: &str = "./__wasm_split.js";
const GLUE_NAME: &str = "distlab_frontend";

pub fn ensure_wasm_target() -> Result<()> {
    let out = Command::new("rustup").args(["target", "list", "--installed"]).output();
    match out {
        Ok(out) if String::from_utf8_lossy(&out.stdout).lines().any(|l| l.trim() == WASM_TARGET) => Ok(()),
        Ok(_) => {
            println!("xtask: installing the {WASM_TARGET} target");
            status(Command::new("rustup").args(["target", "add", WASM_TARGET]))
        }
        // No rustup: let cargo report a missing target if there is one.
        Err(_) => Ok(()),
    }
}

pub fn build() -> Result<ExitCode> {
    ensure_wasm_target()?;
    let root = root();
    // The flag reaches only the app's own crate, where the link happens: the dependencies
    // keep the fingerprints a plain wasm build or clippy gives them.
    status(
        cargo().args(["rustc", "-p", "distlab-frontend", "--target", WASM_TARGET, "--profile", WASM_PROFILE]).args([
            "--",
            "-C",
            "link-arg=--emit-relocs",
        ]),
    )?;
    let linked = root.join("target").join(WASM_TARGET).join(WASM_PROFILE).join("distlab-frontend.wasm");
    let input = std::fs::read(&linked).with_context(|| format!("cannot read {}", linked.display()))?;
    let frontend = root.join("frontend");
    let css = std::fs::read(frontend.join("style.css"))?;
    let version = format!("{:016x}", fnv1a(&[input.as_slice(), css.as_slice()].concat()));

    let site = root.join(SITE_DIR);
    let staging = sibling(&site, "new");
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    let assets = staging.join("assets").join(&version);
    std::fs::create_dir_all(&assets)?;
    // The URL of the glue: index.html imports it, and the chunk loader imports it again to
    // reach the running instance. One string for both: a second URL would be a second,
    // uninitialised instance of the module.
    let glue = format!("/assets/{version}/{GLUE_NAME}.js");

    let main_module = root.join("target").join("wasm-split").join("main.wasm");
    std::fs::create_dir_all(main_module.parent().expect("a file in a directory"))?;
    let mut options = wasm_split_cli_support::Options::new(&input);
    options.output_dir = &assets;
    options.main_out_path = &main_module;
    options.link_name = SPLIT_LINK;
    options.main_module = &glue;
    let split = wasm_split_cli_support::transform(options)
        .map_err(|e| anyhow::anyhow!("wasm-split on {}: {e:#}", linked.display()))?;

    wasm_bindgen_cli_support::Bindgen::new()
        .input_path(&main_module)
        .out_name(GLUE_NAME)
        .web(true)?
        // The library's default (true) leaves out the wasm URL: the page would stay blank.
        .omit_default_module_path(false)
        // The chunks link against the main module's exports that wasm-bindgen would drop.
        .keep_lld_exports(true)
        .typescript(false)
        .remove_name_section(true)
        .remove_producers_section(true)
        .generate(&assets)
        .with_context(|| format!("wasm-bindgen on {}", main_module.display()))?;

    let main_wasm = std::fs::read(assets.join(format!("{GLUE_NAME}_bg.wasm")))?;
    let mut chunks = Vec::new();
    for path in &split.split_modules {
        let chunk = without_names(&std::fs::read(path)?).with_context(|| format!("parsing {}", path.display()))?;
        std::fs::write(path, &chunk)?;
        let name = path.file_name().and_then(|n| n.to_str()).context("a chunk's file name")?;
        chunks.push((format!("/assets/{version}/{name}"), chunk));
    }
    chunks.sort();
    std::fs::write(assets.join("style.css"), css)?;
    let urls: Vec<&str> = chunks.iter().map(|(url, _)| url.as_str()).collect();
    let template = std::fs::read_to_string(frontend.join("index.html"))?;
    if !template.contains("{glue}") || !template.contains("{chunks}") {
        bail!("frontend/index.html must load {{glue}} and prefetch {{chunks}}");
    }
    let index = template
        .replace("{glue}", &glue)
        .replace("{style}", &format!("/assets/{version}/style.css"))
        .replace("{chunks}", &serde_json::to_string(&urls)?);
    std::fs::write(staging.join("index.html"), index)?;
    let style = format!("/assets/{version}/style.css");
    let pages = crate::docs_site::render(&root.join("docs"), &root.join("README.md"), &staging.join("docs"), &style)?;
    swap_in(&staging, &site)?;

    println!(
        "xtask: frontend in {}: {GLUE_NAME}_bg.wasm (loaded first) {} KB raw, {} KB gzip",
        site.display(),
        main_wasm.len() / 1024,
        gzip_len(&main_wasm)? / 1024
    );
    let (mut chunk_raw, mut chunk_gzip) = (0, 0);
    for (_, bytes) in &chunks {
        chunk_raw += bytes.len();
        chunk_gzip += gzip_len(bytes)?;
    }
    println!("xtask: {pages} documentation pages in {}", site.join("docs").display());
    println!(
        "xtask: {} chunks, prefetched once the first page runs: {} KB raw, {} KB gzip in all",
        chunks.len(),
        chunk_raw / 1024,
        chunk_gzip / 1024
    );
    Ok(ExitCode::SUCCESS)
}

/// `target/site.new` for `target/site`.
fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{suffix}"));
    dir.with_file_name(name)
}

/// Replaces `site` with the finished `staging` by two renames: a running server serves the
/// old build or the new one, never a half-written directory.
fn swap_in(staging: &Path, site: &Path) -> Result<()> {
    let old = sibling(site, "old");
    if old.exists() {
        std::fs::remove_dir_all(&old)?;
    }
    if site.exists() {
        std::fs::rename(site, &old).with_context(|| format!("moving {} aside", site.display()))?;
    }
    std::fs::rename(staging, site).with_context(|| format!("moving {} into place", staging.display()))?;
    if old.exists() {
        std::fs::remove_dir_all(&old)?;
    }
    Ok(())
}

/// A module without its `name` section: the function names the linker keeps for debuggers,
/// more than half of a chunk's bytes (wasm-bindgen drops the main module's).
fn without_names(wasm: &[u8]) -> Result<Vec<u8>> {
    let mut module = wasm_encoder::Module::new();
    for payload in wasmparser::Parser::new(0).parse_all(wasm) {
        let payload = payload?;
        if matches!(&payload, wasmparser::Payload::CustomSection(c) if c.name() == "name") {
            continue;
        }
        if let Some((id, range)) = payload.as_section() {
            let data = &wasm[range.start as usize..range.end as usize];
            module.section(&wasm_encoder::RawSection { id, data });
        }
    }
    Ok(module.finish())
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

fn gzip_len(bytes: &[u8]) -> Result<usize> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(bytes)?;
    Ok(gz.finish()?.len())
}
