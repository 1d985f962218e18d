//! Plain, left-aligned tables for people (`--json` is for scripts).

/// Renders `rows` under `header`, columns padded to their widest cell.
pub fn render(header: &[&str], rows: impl Iterator<Item = Vec<String>>) -> String {
    let rows: Vec<Vec<String>> = std::iter::once(header.iter().map(|h| (*h).to_owned()).collect())
        .chain(rows)
        .collect();
    let mut widths = vec![0; header.len()];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// How long ago `unix_ms` was, seen at `now_ms`, for people: `12 s ago`,
/// `3 min ago`, `5 h ago`, `2 d ago` (`just now` under a second, `in the
/// future` for a clock that went back).
pub fn ago(unix_ms: u64, now_ms: u64) -> String {
    let Some(ms) = now_ms.checked_sub(unix_ms) else {
        return "in the future".to_owned();
    };
    let s = ms / 1000;
    match s {
        0 => "just now".to_owned(),
        1..=59 => format!("{s} s ago"),
        60..=3599 => format!("{} min ago", s / 60),
        3600..=86_399 => format!("{} h ago", s / 3600),
        _ => format!("{} d ago", s / 86_400),
    }
}

/// The time now, in ms since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `bytes` for people: `512 B`, `3.4 MiB`.
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes} B"),
        _ => format!("{value:.1} {}", UNITS[unit]),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ages_for_people() {
        let now = 1_000_000_000;
        assert_eq!(super::ago(now - 300, now), "just now");
        assert_eq!(super::ago(now - 12_000, now), "12 s ago");
        assert_eq!(super::ago(now - 180_000, now), "3 min ago");
        assert_eq!(super::ago(now - 5 * 3_600_000, now), "5 h ago");
        assert_eq!(super::ago(now - 2 * 86_400_000, now), "2 d ago");
        assert_eq!(super::ago(now + 1, now), "in the future");
    }

    #[test]
    fn sizes_for_people() {
        assert_eq!(super::size(512), "512 B");
        assert_eq!(super::size(3 * 1024 * 1024 + 400 * 1024), "3.4 MiB");
        assert_eq!(super::size(u64::MAX), "16777216.0 TiB");
    }

    #[test]
    fn pads_columns() {
        let out = super::render(
            &["A", "BB"],
            vec![vec!["long".to_owned(), "x".to_owned()]].into_iter(),
        );
        assert_eq!(out, "A     BB\nlong  x\n");
    }
}
