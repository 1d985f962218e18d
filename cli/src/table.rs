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
