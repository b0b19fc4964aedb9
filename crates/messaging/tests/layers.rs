//! The library's layers depend one way (decision 0027). Each module of `messaging-core` and of
//! `messaging` has a floor; a file may name (in code or in a doc link) only modules on its own
//! floor's level or below, so that the library reads from the bottom up and has no circle. And
//! the bottom crate, with the shop's crates built on it alone (its contracts, its books, its demo
//! without the workers' flags), pulls in no HTTP server, command-line parser, telemetry SDK or
//! metrics library.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

/// `messaging-core`'s modules, bottom first.
const CORE: &[(&str, u8)] = &[
    ("contracts", 0),
    ("trace", 0),
    ("outage", 0),
    ("envelope", 1),
    ("endpoint", 2),
    ("handler", 2),
    ("outbox", 2),
    ("inbox", 2),
    ("schema", 3),
    ("lib", 9),
];

/// `messaging`'s own modules, above the core's (which it re-exports under their names).
const MESSAGING: &[(&str, u8)] = &[
    ("runtime", 10),
    ("topology", 11),
    ("publisher", 12),
    ("outbox_relay", 12),
    ("retention", 12),
    ("consumer", 13),
    ("service", 14),
    ("prelude", 15),
    ("lib", 15),
];

/// What neither crate, nor the shop's rules, may depend on: an HTTP server, a command-line parser,
/// a telemetry SDK or exporter, a metrics library, a log subscriber.
const ABOVE_THE_CORE: &[&str] = &[
    "axum",
    "hyper",
    "hyper-util",
    "tower-http",
    "clap",
    "opentelemetry_sdk",
    "opentelemetry-otlp",
    "prometheus-client",
    "tracing-subscriber",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir`, with the module it belongs to (its first path component).
fn files(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).expect("read the source folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let relative = path.strip_prefix(dir).expect("under dir");
                let first = relative.components().next().expect("a component").as_os_str().to_string_lossy();
                found.push((first.trim_end_matches(".rs").to_owned(), path));
            }
        }
    }
    found
}

/// The modules of this crate that `text` names: `crate::name`, and each name at the top of a
/// `crate::{a, b::c}` group.
fn named(text: &str) -> BTreeSet<String> {
    let word = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        match rest.strip_prefix('{') {
            Some(group) => names.extend(heads(group)),
            None => {
                names.insert(word(rest));
            }
        }
    }
    names
}

/// The first name of each path in a `{a, b::{c, d}, e}` group (`group` starts after its `{`).
fn heads(group: &str) -> Vec<String> {
    let (mut heads, mut word) = (Vec::new(), String::new());
    let (mut depth, mut expecting) = (0_usize, true);
    for c in group.chars() {
        if depth == 0 && expecting && (c.is_alphanumeric() || c == '_') {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            heads.push(std::mem::take(&mut word));
            expecting = false;
        }
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => expecting = true,
            _ => {}
        }
    }
    heads
}

/// The files under `crate_dir/src` that name a module of a higher floor, as `file -> module`. A
/// module's floor is looked up in `own` (the crate's modules), then in `below` (a crate it
/// re-exports).
fn upward(crate_dir: &str, own: &[(&str, u8)], below: &[(&str, u8)]) -> Vec<String> {
    let floor = |module: &str| own.iter().chain(below).find(|(name, _)| *name == module).map(|(_, floor)| *floor);
    let mut found = Vec::new();
    for (module, path) in files(&root().join(crate_dir).join("src")) {
        let mine = floor(&module).unwrap_or_else(|| panic!("{module} has no floor: give it one in this test"));
        let text = std::fs::read_to_string(&path).expect("read a source file");
        for name in named(&text) {
            if floor(&name).is_some_and(|theirs| theirs > mine) {
                found.push(format!("{} -> {name}", path.display()));
            }
        }
    }
    found
}

#[test]
fn the_names_a_group_imports_are_found() {
    let text = "use crate::{\n    envelope::{self, Incoming},\n    runtime::{db, trace},\n    topology,\n};\nx(crate::service::exit);";
    let names: Vec<String> = named(text).into_iter().collect();
    assert_eq!(names, ["envelope", "runtime", "service", "topology"]);
}

#[test]
fn no_module_of_the_core_names_one_above_it() {
    let up = upward("crates/messaging-core", CORE, &[]);
    assert!(up.is_empty(), "names pointing up: {up:#?}");
}

#[test]
fn no_module_of_messaging_names_one_above_it() {
    let up = upward("crates/messaging", MESSAGING, CORE);
    assert!(up.is_empty(), "names pointing up: {up:#?}");
}

/// The packages in `package`'s normal dependency tree, at its default features.
fn tree(package: &str) -> BTreeSet<String> {
    let output = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--locked", "-e", "normal", "--prefix", "none", "-p", package])
        .current_dir(root())
        .output()
        .expect("run cargo tree");
    assert!(output.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[test]
fn the_core_and_the_shop_s_rules_pull_in_no_server_parser_or_telemetry_sdk() {
    for package in ["messaging-core", "shop", "shop-books", "shop-demo"] {
        let packages = tree(package);
        assert!(packages.contains("sqlx"), "{package}'s tree was read: {packages:?}");
        let above: Vec<&&str> = ABOVE_THE_CORE.iter().filter(|name| packages.contains(**name)).collect();
        assert!(above.is_empty(), "{package} depends on {above:?}");
        assert!(!packages.contains("messaging"), "{package} depends on messaging, above the core");
    }
}

/// The consumer's machine decides; the session and its tasks do the I/O (decision 0035). Its files
/// name, outside their comments, no broker client, database driver, async runtime or log macro.
#[test]
fn the_consumer_machine_names_no_io() {
    let consumer = root().join("crates/messaging/src/consumer");
    let mut paths = vec![consumer.join("machine.rs")];
    paths.extend(files(&consumer.join("machine")).into_iter().map(|(_, path)| path));
    assert!(paths.len() > 5, "the machine's files were found: {paths:?}");
    let mut named = Vec::new();
    for path in &paths {
        let text = std::fs::read_to_string(path).expect("read a source file");
        let code = text.lines().filter(|line| !line.trim_start().starts_with("//"));
        for line in code {
            for io in ["lapin", "sqlx", "tokio", "tracing::"] {
                if line.contains(io) {
                    named.push(format!("{}: {io}: {line}", path.display()));
                }
            }
        }
    }
    assert!(named.is_empty(), "I/O named in the machine: {named:#?}");
}
