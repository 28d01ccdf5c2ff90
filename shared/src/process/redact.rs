//! Hiding secrets and taming untrusted text before it is printed.
//!
//! * [`redact`] hides the userinfo (`user:password@`) of every URL in a text, whatever the
//!   scheme and its case (`AMQP://fleet:secret@host` → `AMQP://***@host`). Every message,
//!   log line, metric label and API answer that may hold a URL passes through it; the log
//!   writer ([`crate::process::telemetry`]) applies it to every line as a last line of defence.
//! * [`escape_controls`] renders control characters (newline, ESC, NUL, …) as `\n`, `\u{1b}`,
//!   so a task's `kind`, id or error text cannot forge log lines or colour a terminal.

use std::borrow::Cow;

/// The text with the userinfo of every `scheme://userinfo@host` replaced by `***`.
///
/// A URL's authority runs from `://` to the first `/`, `?`, `#`, whitespace, quote, `<`, `>`
/// or `,`; if it holds an `@`, everything before the last `@` is hidden (RFC 3986 §3.2.1:
/// userinfo is deprecated for passwords, but AMQP and Redis URLs carry them).
pub fn redact(text: &str) -> Cow<'_, str> {
    if !text.contains("://") {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut changed = false;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| {
                matches!(
                    c,
                    '/' | '?' | '#' | '"' | '\'' | '<' | '>' | ',' | '`' | ')'
                ) || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                out.push_str("***");
                out.push_str(&authority[at..]);
                changed = true;
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    if changed {
        Cow::Owned(out)
    } else {
        Cow::Borrowed(text)
    }
}

/// The text with every control character (C0, DEL, C1) written as an escape: `\n`, `\r`,
/// `\t`, `\0`, otherwise `\u{XX}`. Printable text, including non-ASCII, is kept.
pub fn escape_controls(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\0' => out.push_str("\\0"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hides_userinfo_of_any_scheme() {
        assert_eq!(
            redact("AMQP://user:secret@h:5672/%2f"),
            "AMQP://***@h:5672/%2f"
        );
        assert_eq!(
            redact("url=redis://:pw@127.0.0.1:6379 and amqps://a:b@x"),
            "url=redis://***@127.0.0.1:6379 and amqps://***@x"
        );
        assert_eq!(redact("`amqp://u:p@h`: bad"), "`amqp://***@h`: bad");
        assert_eq!(redact("http://h/a@b"), "http://h/a@b");
        assert_eq!(redact("no url here"), "no url here");
        assert_eq!(redact("amqp://u:p@ss@h/"), "amqp://***@h/");
    }

    #[test]
    fn escapes_controls() {
        assert_eq!(
            escape_controls("echo\nFAKE\u{1b}[31m\0"),
            "echo\\nFAKE\\u{1b}[31m\\0"
        );
        assert_eq!(escape_controls("plain ünïcode"), "plain ünïcode");
    }
}
