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

/// The string literals of `code` outside comments, each with the line it starts on.
fn literals(code: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let (mut chars, mut line) = (code.chars().peekable(), 1);
    while let Some(c) = chars.next() {
        match c {
            '\n' => line += 1,
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        line += 1;
                        break;
                    }
                }
            }
            // A character literal: '"' or '\'' would otherwise open a string.
            '\'' => {
                let rest: String = chars.clone().take(3).collect();
                if rest.starts_with("\"'") {
                    chars.nth(1);
                } else if rest.starts_with("\\'") || rest.starts_with("\\\"") {
                    chars.nth(2);
                }
            }
            '"' => {
                let (start, mut text, mut escaped) = (line, String::new(), false);
                for c in chars.by_ref() {
                    if c == '\n' {
                        line += 1;
                    }
                    match (escaped, c) {
                        (false, '\\') => escaped = true,
                        (false, '"') => break,
                        _ => {
                            escaped = false;
                            text.push(c);
                        }
                    }
                }
                found.push((start, text));
            }
            _ => {}
        }
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
    let code = "let c = '\"';\n// \"where a = $2 and b = $1\"\nquery(\"update t set a = $2\n where id = $1\")";
    let found = literals(code);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, 3);
    assert_eq!(parameters(&found[0].1), [2, 1]);
}
