//! Every literal statement numbers its parameters in order (decision 0026): `$1` is the first a
//! reader meets, then `$2`, and the binds follow in the same order, so that a statement and its
//! binds read side by side. A statement composed from parts is built with `QueryBuilder`, which
//! numbers them itself.

use std::path::{Path, PathBuf};

/// Every `.rs` file of the workspace's crates and examples.
fn sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut found = Vec::new();
    let mut dirs = vec![root.join("crates"), root.join("examples")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                found.push(path);
            }
        }
    }
    found
}

/// The string literals of `code` outside comments (`//`, `/* */`), plain or raw (`r"…"`,
/// `r#"…"#`), each with the line it starts on.
fn literals(code: &str) -> Vec<(usize, String)> {
    let chars: Vec<char> = code.chars().collect();
    let (mut found, mut line, mut i) = (Vec::new(), 1, 0);
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        let after_word = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        match c {
            '\n' => line += 1,
            '/' if at(i + 1) == '/' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            '/' if at(i + 1) == '*' => {
                i += 2;
                while i < chars.len() && !(chars[i] == '*' && at(i + 1) == '/') {
                    line += usize::from(chars[i] == '\n');
                    i += 1;
                }
                i += 2;
                continue;
            }
            // A character literal: '"' or '\'' would otherwise open a string.
            '\'' if at(i + 1) == '"' && at(i + 2) == '\'' => i += 2,
            '\'' if at(i + 1) == '\\' && at(i + 3) == '\'' => i += 3,
            'r' if !after_word && (at(i + 1) == '"' || at(i + 1) == '#') => {
                let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
                if at(i + 1 + hashes) == '"' {
                    let close: Vec<char> = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
                    let (start, mut text) = (line, String::new());
                    i += 2 + hashes;
                    while i < chars.len() && !chars[i..].starts_with(&close) {
                        line += usize::from(chars[i] == '\n');
                        text.push(chars[i]);
                        i += 1;
                    }
                    found.push((start, text));
                    i += close.len();
                    continue;
                }
            }
            '"' => {
                let (start, mut text) = (line, String::new());
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    line += usize::from(chars[i] == '\n');
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    text.push(at(i));
                    i += 1;
                }
                found.push((start, text));
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// The parameters `text` names, in the order a reader meets them, each once.
fn parameters(text: &str) -> Vec<u32> {
    let mut order = Vec::new();
    for piece in text.split('$').skip(1) {
        let digits: String = piece.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(n) = digits.parse::<u32>()
            && !order.contains(&n)
        {
            order.push(n);
        }
    }
    order
}

#[test]
fn every_literal_statement_numbers_its_parameters_in_order() {
    let mut out_of_order = Vec::new();
    let files = sources();
    assert!(files.len() > 50, "the workspace's sources: {}", files.len());
    // Not this file, whose own check below holds a statement out of order on purpose.
    for path in files.into_iter().filter(|path| !path.ends_with("messaging/tests/statements.rs")) {
        let code = std::fs::read_to_string(&path).expect("a source file");
        // A dollar-quoted body (`$$ … $$`) is text: its `$n` are no parameters.
        for (line, text) in literals(&code).into_iter().filter(|(_, text)| !text.contains("$$")) {
            let order = parameters(&text);
            let numbered: Vec<u32> = (1..=order.len() as u32).collect();
            // A permutation of 1..=n out of order: a statement numbered by hand, not in order.
            let mut sorted = order.clone();
            sorted.sort_unstable();
            if sorted == numbered && order != numbered {
                out_of_order.push(format!("{}:{line}: {order:?}", path.display()));
            }
        }
    }
    assert!(out_of_order.is_empty(), "statements whose parameters are not in order:\n{}", out_of_order.join("\n"));
}

#[test]
fn the_scan_sees_a_statement_out_of_order_and_not_one_in_a_comment() {
    let code = "let c = '\"';\n// \"where a = $2 and b = $1\"\n/* \"$2 $1\" */ query(\"update t set a = $2\n where id = $1\")\n\
                r#\"a \"quoted\" $3 $1 $2\"#";
    let found = literals(code);
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(found[0].0, 3);
    assert_eq!(parameters(&found[0].1), [2, 1]);
    assert_eq!((found[1].0, parameters(&found[1].1)), (5, vec![3, 1, 2]));
}
