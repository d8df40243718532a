//! `cargo xtask build-frontend`: the browser app in target/site/.
//!
//! 1. cargo builds the Leptos app for wasm32 with `--emit-relocs`, so the linker keeps the
//!    relocations a splitter needs to move code between modules.
//! 2. wasm-split (`wasm_split_cli_support`) cuts the module at the app's split points (the
//!    pages behind `#[lazy_route]` in `frontend/src/app.rs`): a main module with the layout
//!    and the first page, one chunk per page, chunks of code several pages share, and
//!    `__wasm_split.js`, which fetches a chunk the first time its page opens.
//! 3. wasm-bindgen (as a library, so the glue matches the wasm-bindgen in Cargo.lock) makes
//!    the main module's JS glue.
//! 4. index.html and style.css, with a content hash in their URLs.

use std::io::Write;
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};

use crate::{cargo, root, status};

const WASM_TARGET: &str = "wasm32-unknown-unknown";
const WASM_PROFILE: &str = "wasm-release";
pub const SITE_DIR: &str = "target/site";
/// The module the main wasm imports its chunk loaders from (it sits next to the glue).
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
    let mut wasm_build = cargo();
    wasm_build.args(["build", "-p", "distlab-frontend", "--target", WASM_TARGET, "--profile", WASM_PROFILE]);
    // With `--target`, RUSTFLAGS reach only the wasm, not build scripts or proc macros.
    let rustflags = std::env::var("RUSTFLAGS").unwrap_or_default();
    wasm_build.env("RUSTFLAGS", format!("{rustflags} -Clink-args=--emit-relocs").trim_start());
    status(&mut wasm_build)?;

    let linked = root.join("target").join(WASM_TARGET).join(WASM_PROFILE).join("distlab-frontend.wasm");
    let site = root.join(SITE_DIR);
    // A fresh directory: chunks of an earlier build must not linger beside the new ones.
    if site.exists() {
        std::fs::remove_dir_all(&site).with_context(|| format!("cannot clear {}", site.display()))?;
    }
    std::fs::create_dir_all(&site)?;

    let main_module = root.join("target").join("wasm-split").join("main.wasm");
    std::fs::create_dir_all(main_module.parent().expect("a file in a directory"))?;
    let input = std::fs::read(&linked).with_context(|| format!("cannot read {}", linked.display()))?;
    let frontend = root.join("frontend");
    let css = std::fs::read(frontend.join("style.css"))?;
    // A content hash in the URLs, so that a browser never mixes an old bundle with a new
    // page. The chunk loader imports the glue by the very URL index.html does: a second
    // URL would be a second, uninitialised instance of the module.
    let version = format!("{:016x}", fnv1a(&[input.as_slice(), css.as_slice()].concat()));
    let glue = format!("/{GLUE_NAME}.js?v={version}");
    let mut options = wasm_split_cli_support::Options::new(&input);
    options.output_dir = &site;
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
        .generate(&site)
        .with_context(|| format!("wasm-bindgen on {}", main_module.display()))?;

    let main_wasm = std::fs::read(site.join(format!("{GLUE_NAME}_bg.wasm")))?;
    let mut chunks = Vec::new();
    for path in &split.split_modules {
        let chunk = without_names(&std::fs::read(path)?).with_context(|| format!("reading {}", path.display()))?;
        std::fs::write(path, &chunk)?;
        chunks.push(chunk);
    }
    let index = std::fs::read_to_string(frontend.join("index.html"))?.replace("{version}", &version);
    std::fs::write(site.join("index.html"), index)?;
    std::fs::write(site.join("style.css"), css)?;

    println!(
        "xtask: frontend in {}: {GLUE_NAME}_bg.wasm (loaded first) {} KB raw, {} KB gzip",
        site.display(),
        main_wasm.len() / 1024,
        gzip_len(&main_wasm)? / 1024
    );
    let mut chunk_raw = 0;
    let mut chunk_gzip = 0;
    for bytes in &chunks {
        chunk_raw += bytes.len();
        chunk_gzip += gzip_len(bytes)?;
    }
    println!(
        "xtask: {} chunks, fetched after the first page or when their page opens: {} KB raw, {} KB gzip in all",
        chunks.len(),
        chunk_raw / 1024,
        chunk_gzip / 1024
    );
    Ok(ExitCode::SUCCESS)
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
