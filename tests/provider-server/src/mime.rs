//! Just enough MIME: one header of a message, and the fields of a multipart/form-data body.

/// The value of header `name` (case-insensitive, unfolded, trimmed) in the message's
/// header section, or `""`.
pub(crate) fn header(raw: &str, name: &str) -> String {
    let head = raw.split("\r\n\r\n").next().unwrap_or("");
    let mut value: Option<String> = None;
    for line in head.split("\r\n") {
        if let Some(v) = value.as_mut() {
            if line.starts_with([' ', '\t']) {
                v.push_str(line.trim_start());
                continue;
            }
            break;
        }
        if let Some((n, v)) = line.split_once(':') {
            if n.trim().eq_ignore_ascii_case(name) {
                value = Some(v.trim().to_string());
            }
        }
    }
    value.unwrap_or_default()
}

/// The (name, content) of each part of a multipart/form-data body.
pub(crate) fn form_data(content_type: &str, body: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    let boundary = content_type
        .split(';')
        .find_map(|p| p.trim().strip_prefix("boundary="))
        .map(|b| b.trim_matches('"'))
        .filter(|_| content_type.starts_with("multipart/form-data"))
        .ok_or("the body must be multipart/form-data with a boundary")?;
    let delimiter = format!("--{boundary}");
    let mut parts = Vec::new();
    let mut rest = body;
    let mut first = true;
    while let Some(at) = find(rest, delimiter.as_bytes()) {
        let part = &rest[..at];
        rest = &rest[at + delimiter.len()..];
        if first {
            first = false;
            continue;
        }
        let part = part.strip_prefix(b"\r\n").unwrap_or(part);
        let part = part.strip_suffix(b"\r\n").unwrap_or(part);
        let split = find(part, b"\r\n\r\n").ok_or("a part without a blank line")?;
        let head = String::from_utf8_lossy(&part[..split]);
        let name = head
            .split(';')
            .find_map(|p| p.trim().strip_prefix("name="))
            .map(|n| {
                n.split(['\r', '\n'])
                    .next()
                    .unwrap_or("")
                    .trim_matches('"')
                    .to_string()
            })
            .ok_or("a part without a name")?;
        parts.push((name, part[split + 4..].to_vec()));
        if rest.starts_with(b"--") {
            break;
        }
    }
    Ok(parts)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
