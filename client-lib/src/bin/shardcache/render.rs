//! Text rendering for the CLI: sizes, fractions, durations and aligned tables (laid out
//! by `comfy-table`). Pure functions of their input, so that the output is tested
//! without a daemon.

/// A size in bytes with a binary unit: `512 B`, `1.5 MiB`.
pub fn bytes(b: u64) -> String {
    const U: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// `n / d` as a percentage with one decimal, or `-` when `d` is 0.
pub fn percent(n: u64, d: u64) -> String {
    if d == 0 {
        return "-".into();
    }
    // Never round a partial amount up to 100 % (nor a nonzero one down to 0 %): "is it
    // all there" is what an operator reads from this.
    let p = 100.0 * n as f64 / d as f64;
    let p = if n < d { p.min(99.9) } else { p };
    let p = if n > 0 { p.max(0.1) } else { p };
    format!("{p:.1}%")
}

/// Seconds as the two largest units: `42s`, `5m 03s`, `1h 02m`, `3d 04h`.
pub fn duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if d > 0 {
        format!("{d}d {h:02}h")
    } else if h > 0 {
        format!("{h}h {m:02}m")
    } else if m > 0 {
        format!("{m}m {s:02}s")
    } else {
        format!("{s}s")
    }
}

/// How a column's cells are aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers.
    Right,
}

/// A table: columns as wide as their widest cell, two spaces between columns, no borders,
/// no trailing blanks (laid out by `comfy-table`; this only sets that style, the indent
/// and each column's alignment).
#[derive(Debug)]
pub struct Table {
    inner: comfy_table::Table,
    aligns: Vec<Align>,
    indent: usize,
}

impl Table {
    /// A table with a header row of these (header, alignment) columns.
    pub fn new(columns: &[(&str, Align)]) -> Self {
        let mut t = Self::headless(&columns.iter().map(|(_, a)| *a).collect::<Vec<_>>());
        t.inner.set_header(columns.iter().map(|(h, _)| *h));
        t.style();
        t
    }

    /// A table without a header row, its columns aligned as `aligns`.
    pub fn headless(aligns: &[Align]) -> Self {
        let mut inner = comfy_table::Table::new();
        inner.load_style(comfy_table::presets::NOTHING);
        Self {
            inner,
            aligns: aligns.to_vec(),
            indent: 0,
        }
    }

    /// Indents every line by `n` spaces.
    pub fn indent(mut self, n: usize) -> Self {
        self.indent = n;
        self
    }

    /// Adds a row (missing cells are empty).
    pub fn row(&mut self, cells: Vec<String>) {
        self.inner.add_row(cells);
        self.style();
    }

    /// True when no row was added.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// The rendered lines, each ending in a newline.
    pub fn render(&self) -> String {
        let pad = " ".repeat(self.indent);
        self.inner
            .lines()
            .map(|l| format!("{pad}{}\n", l.trim_end()))
            .collect()
    }

    /// Pads and aligns the columns that exist so far (comfy-table makes a column when
    /// the first header or row reaches it).
    fn style(&mut self) {
        let last = self.aligns.len().saturating_sub(1);
        for (i, (col, align)) in self.inner.column_iter_mut().zip(&self.aligns).enumerate() {
            // The gap is the padding on the right of every column but the last.
            col.set_padding((0, if i < last { 2 } else { 0 }));
            col.set_cell_alignment(match align {
                Align::Left => comfy_table::CellAlignment::Left,
                Align::Right => comfy_table::CellAlignment::Right,
            });
        }
    }
}

/// Lines of `label  value` pairs with the values aligned, indented by `indent`.
pub fn pairs(indent: usize, items: &[(&str, String)]) -> String {
    if items.is_empty() {
        return String::new();
    }
    let mut t = Table::headless(&[Align::Left, Align::Left]).indent(indent);
    for (k, v) in items {
        t.row(vec![(*k).to_owned(), v.clone()]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sizes_use_binary_units_with_one_decimal() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.0 KiB");
        assert_eq!(bytes(1536 << 10), "1.5 MiB");
        assert_eq!(bytes(5 << 30), "5.0 GiB");
        assert_eq!(bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn percentages_never_round_to_all_or_nothing_falsely() {
        assert_eq!(percent(1, 0), "-");
        assert_eq!(percent(0, 10), "0.0%");
        assert_eq!(percent(5, 10), "50.0%");
        assert_eq!(percent(10, 10), "100.0%");
        assert_eq!(percent(999_999, 1_000_000), "99.9%", "not all there");
        assert_eq!(percent(1, 1_000_000), "0.1%", "not nothing");
    }

    #[test]
    fn durations_show_the_two_largest_units() {
        assert_eq!(duration(0), "0s");
        assert_eq!(duration(59), "59s");
        assert_eq!(duration(61), "1m 01s");
        assert_eq!(duration(3 * 3600 + 120), "3h 02m");
        assert_eq!(duration(2 * 86400 + 5 * 3600 + 7), "2d 05h");
    }

    #[test]
    fn tables_align_columns_and_leave_no_trailing_blanks() {
        let mut t = Table::new(&[
            ("NAME", Align::Left),
            ("SIZE", Align::Right),
            ("PATH", Align::Left),
        ])
        .indent(2);
        t.row(vec!["a".into(), "1.0 MiB".into(), "/x".into()]);
        t.row(vec!["longer".into(), "7 B".into(), "/a/b/c".into()]);
        t.row(vec!["short".into()]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "  NAME       SIZE  PATH",
                "  a       1.0 MiB  /x",
                "  longer      7 B  /a/b/c",
                "  short",
            ]
        );
        // Every right-aligned cell ends in the same column.
        let end = |l: &str, cell: &str| l.find(cell).unwrap() + cell.len();
        assert_eq!(end(lines[1], "1.0 MiB"), end(lines[2], "7 B"));
        assert_eq!(end(lines[0], "SIZE"), end(lines[2], "7 B"));
        assert!(!t.is_empty());
    }

    #[test]
    fn pairs_align_their_values() {
        let text = pairs(
            2,
            &[
                ("a", "1".into()),
                ("longer", "2".into()),
                ("e", String::new()),
            ],
        );
        assert_eq!(text, "  a       1\n  longer  2\n  e\n");
        assert_eq!(pairs(2, &[]), "");
    }
}
