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

#[cfg(test)]
mod tests {
    #[test]
    fn pads_columns() {
        let out = super::render(
            &["A", "BB"],
            vec![vec!["long".to_owned(), "x".to_owned()]].into_iter(),
        );
        assert_eq!(out, "A     BB\nlong  x\n");
    }
}
