//! Text cut to a length: user input echoed in messages, and text the store keeps.

/// At most `max` characters of `s` (for echoing user input in messages and storing text).
pub fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}
