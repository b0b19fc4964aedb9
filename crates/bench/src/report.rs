//! The table and the JSON summary.

use serde_json::{Value, json};

/// One measured figure.
struct Figure {
    section: &'static str,
    name: String,
    value: f64,
    unit: &'static str,
    note: String,
}

/// How a target's figure must compare with its bound.
#[derive(Clone, Copy)]
enum Bound {
    AtLeast,
    Below,
    AtMost,
}

/// One target: a figure against its bound.
struct Target {
    name: String,
    actual: f64,
    bound: f64,
    compare: Bound,
}

impl Target {
    fn met(&self) -> bool {
        match self.compare {
            Bound::AtLeast => self.actual >= self.bound,
            Bound::Below => self.actual < self.bound,
            Bound::AtMost => self.actual <= self.bound,
        }
    }

    fn operator(&self) -> &'static str {
        match self.compare {
            Bound::AtLeast => ">=",
            Bound::Below => "<",
            Bound::AtMost => "<=",
        }
    }
}

/// Everything a run measured.
#[derive(Default)]
pub struct Report {
    figures: Vec<Figure>,
    targets: Vec<Target>,
}

impl Report {
    /// Record a figure and print it at once (a long run shows progress).
    pub fn figure(&mut self, section: &'static str, name: &str, value: f64, unit: &'static str, note: &str) {
        println!("  {section:<8} {name:<52} {:>12} {unit:<6} {note}", shown(value, unit));
        self.figures.push(Figure { section, name: name.to_owned(), value, unit, note: note.to_owned() });
    }

    /// `actual >= bound`.
    pub fn at_least(&mut self, name: impl Into<String>, actual: f64, bound: f64) {
        self.targets.push(Target { name: name.into(), actual, bound, compare: Bound::AtLeast });
    }

    /// `actual < bound`.
    pub fn below(&mut self, name: impl Into<String>, actual: f64, bound: f64) {
        self.targets.push(Target { name: name.into(), actual, bound, compare: Bound::Below });
    }

    /// `actual <= bound`.
    pub fn at_most(&mut self, name: impl Into<String>, actual: f64, bound: f64) {
        self.targets.push(Target { name: name.into(), actual, bound, compare: Bound::AtMost });
    }

    /// The whole table, then the targets.
    pub fn print(&self) {
        println!("\n{:<8} {:<52} {:>12} {:<6} note", "section", "figure", "value", "unit");
        for f in &self.figures {
            println!("{:<8} {:<52} {:>12} {:<6} {}", f.section, f.name, shown(f.value, f.unit), f.unit, f.note);
        }
        println!("\ntargets");
        for t in &self.targets {
            let op = t.operator();
            let verdict = if t.met() { "met" } else { "NOT MET" };
            println!("  {:<58} {:>10.2} {op} {:<8.2} {verdict}", t.name, t.actual, t.bound);
        }
    }

    /// The same as JSON.
    pub fn json(&self) -> Value {
        let figures: Vec<Value> = self
            .figures
            .iter()
            .map(|f| json!({"section": f.section, "name": f.name, "value": f.value, "unit": f.unit, "note": f.note}))
            .collect();
        let targets: Vec<Value> = self
            .targets
            .iter()
            .map(|t| json!({"name": t.name, "actual": t.actual, "bound": t.bound, "operator": t.operator(), "met": t.met()}))
            .collect();
        json!({"figures": figures, "targets": targets})
    }
}

/// The `q` quantile (0..=1) of sorted samples.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[index]
}

/// A figure's value as printed: ratios (unit `x`) to two decimals, everything else to one.
fn shown(value: f64, unit: &str) -> String {
    if unit == "x" { format!("{value:.2}") } else { format!("{value:.1}") }
}
