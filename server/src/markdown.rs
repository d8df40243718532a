//! Markdown a person wrote (an assignment's instructions) as HTML that is safe to show:
//! raw HTML in the text is shown as text, and a link or image may only point to http(s),
//! mailto, a path on this site or an anchor (no `javascript:` or `data:` URLs).

use pulldown_cmark::{html, CowStr, Event, Options, Parser, Tag};

/// `markdown` as HTML with no markup of the writer's own and no script URLs.
pub fn to_safe_html(markdown: &str) -> String {
    let events =
        Parser::new_ext(markdown, Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH).map(|event| match event {
            Event::Html(raw) | Event::InlineHtml(raw) => Event::Text(raw),
            Event::Start(Tag::Link { link_type, dest_url, title, id }) => {
                Event::Start(Tag::Link { link_type, dest_url: safe_url(dest_url), title, id })
            }
            Event::Start(Tag::Image { link_type, dest_url, title, id }) => {
                Event::Start(Tag::Image { link_type, dest_url: safe_url(dest_url), title, id })
            }
            other => other,
        });
    let mut out = String::new();
    html::push_html(&mut out, events);
    out
}

/// `url` when it has no scheme (a path here, an anchor) or is http(s) or mailto; else "#".
fn safe_url(url: CowStr<'_>) -> CowStr<'_> {
    let lower = url.trim().to_ascii_lowercase();
    // A scheme is whatever comes before a ':' that comes before any '/', '?' or '#'.
    let has_scheme = lower.find(':').is_some_and(|colon| lower.find(['/', '?', '#']).is_none_or(|cut| colon < cut));
    if !has_scheme || ["http:", "https:", "mailto:"].iter().any(|s| lower.starts_with(s)) {
        url
    } else {
        CowStr::Borrowed("#")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_and_script_urls_are_not_passed_through() {
        let html = to_safe_html("# Task\nRun **dp = 2**.\n\n<script>alert(1)</script>\n\nand <b onclick=x>this</b>");
        assert!(html.contains("<h1>Task</h1>") && html.contains("<strong>dp = 2</strong>"), "{html}");
        assert!(!html.contains("<script") && !html.contains("<b "), "{html}");
        assert!(html.contains("&lt;script&gt;") && html.contains("&lt;b onclick=x&gt;"), "{html}");
        for bad in ["javascript:alert(1)", "JavaScript:alert(1)", " data:text/html,x", "vbscript:x"] {
            let html = to_safe_html(&format!("[go]({bad}) ![img]({bad})"));
            assert!(!html.to_ascii_lowercase().contains("script:") && !html.contains("data:"), "{bad}: {html}");
        }
        for good in ["https://example.org/a", "/experiments/3", "#part-2", "docs/planner.html", "mailto:t@example.org"]
        {
            assert!(to_safe_html(&format!("[go]({good})")).contains(&format!("href=\"{good}\"")), "{good}");
        }
    }
}
