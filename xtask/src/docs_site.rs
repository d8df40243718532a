//! The docs/ pages inside the built site: `cargo xtask build-frontend` renders each
//! docs/NAME.md to site/docs/NAME.html (links between the pages follow: `x.md#a` becomes
//! `x.html#a`) and copies the screenshots beside them, so the lab's pages can link to the
//! page that explains what they show (`/docs/pipeline-parallel.html`), served by the same
//! server with no Markdown at run time. The README, whose links lead to every page, is
//! the index (`/docs/`).

use std::path::Path;

use anyhow::{Context, Result};
use pulldown_cmark::{html, CowStr, Event, Options, Parser, Tag};

/// Renders every page of `docs` and the README (`readme`, as the index) into `out`
/// (created), styled by `style` (a URL); returns how many pages it wrote.
pub fn render(docs: &Path, readme: &Path, out: &Path, style: &str) -> Result<usize> {
    std::fs::create_dir_all(out)?;
    let index = std::fs::read_to_string(readme).with_context(|| format!("cannot read {}", readme.display()))?;
    std::fs::write(out.join("index.html"), page(&index, style))?;
    let mut pages = 1;
    for entry in std::fs::read_dir(docs).with_context(|| format!("cannot read {}", docs.display()))? {
        let path = entry?.path();
        let (Some(stem), Some(ext)) = (path.file_stem().and_then(|s| s.to_str()), path.extension()) else {
            continue;
        };
        if ext == "png" {
            std::fs::copy(&path, out.join(path.file_name().expect("a file")))?;
        } else if ext == "md" {
            let markdown = std::fs::read_to_string(&path)?;
            std::fs::write(out.join(format!("{stem}.html")), page(&markdown, style))?;
            pages += 1;
        }
    }
    Ok(pages)
}

/// One page: the Markdown as HTML in the lab's frame.
fn page(markdown: &str, style: &str) -> String {
    let title = markdown.lines().find_map(|l| l.strip_prefix("# ")).unwrap_or("distlab");
    let events = Parser::new_ext(markdown, Options::ENABLE_TABLES).map(|event| match event {
        Event::Start(Tag::Link { link_type, dest_url, title, id }) => {
            Event::Start(Tag::Link { link_type, dest_url: local_link(dest_url), title, id })
        }
        Event::Start(Tag::Image { link_type, dest_url, title, id }) => {
            Event::Start(Tag::Image { link_type, dest_url: local_link(dest_url), title, id })
        }
        other => other,
    });
    let mut body = String::new();
    html::push_html(&mut body, events);
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · distlab</title><link rel=\"stylesheet\" href=\"{style}\"></head>\n\
         <body class=\"docs-page\"><nav><a href=\"/\">distlab</a> · <a href=\"/docs/\">all pages</a></nav>\n\
         <main class=\"docs\">\n{body}</main></body></html>\n",
        escape(title)
    )
}

/// A link between the pages (`x.md`, `x.md#anchor`, from the README `docs/x.md`) to its
/// rendered page, a screenshot (`docs/x.png` from the README) beside it, the README
/// (`../README.md`) to the index; anything else as it is.
fn local_link(url: CowStr<'_>) -> CowStr<'_> {
    if url.contains("://") || url.starts_with('#') {
        return url;
    }
    let local = url.strip_prefix("docs/").unwrap_or(&url);
    let (file, anchor) = local.split_once('#').map_or((local, None), |(f, a)| (f, Some(a)));
    let target = match file.strip_suffix(".md") {
        Some("../README") => return "/docs/".into(),
        Some(name) if !name.contains('/') => format!("{name}.html"),
        _ if !file.contains('/') => file.to_string(),
        _ => return url,
    };
    match anchor {
        Some(a) => format!("{target}#{a}").into(),
        None => target.into(),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_between_pages_follow_the_rendering() {
        assert_eq!(&*local_link("memory.md".into()), "memory.html");
        assert_eq!(&*local_link("memory.md#activation-checkpointing".into()), "memory.html#activation-checkpointing");
        assert_eq!(&*local_link("../README.md#further-reading".into()), "/docs/");
        assert_eq!(&*local_link("pipeline.png".into()), "pipeline.png");
        assert_eq!(&*local_link("docs/pipeline.png".into()), "pipeline.png");
        assert_eq!(&*local_link("docs/gpu.md#what-ran-where".into()), "gpu.html#what-ran-where");
        assert_eq!(&*local_link("../gpu-worker/src/lib.rs".into()), "../gpu-worker/src/lib.rs");
        assert_eq!(&*local_link("https://example.org/a.md".into()), "https://example.org/a.md");
        assert_eq!(&*local_link("#spec-fields".into()), "#spec-fields");
    }

    #[test]
    fn a_page_has_its_title_and_its_tables() {
        let html = page("# Pipelines\n\n| a | b |\n| - | - |\n| 1 | 2 |\n\nSee [memory](memory.md).", "/s.css");
        assert!(html.contains("<title>Pipelines · distlab</title>"));
        assert!(html.contains("<table>"));
        assert!(html.contains("href=\"memory.html\""));
    }
}
