//! Checks of a service binary as shipped, shared by each service crate's `tests/binary.rs`.
//! Having such a test is also what makes `cargo test` build the binary the crash tests start.

use std::process::Command;

/// `--help` names every environment variable in `variables`.
pub fn assert_help_names(binary: &str, variables: &[&str]) {
    let output = Command::new(binary).arg("--help").output().expect("run --help");
    assert!(output.status.success(), "{output:?}");
    let help = String::from_utf8_lossy(&output.stdout);
    for variable in variables {
        assert!(help.contains(&format!("env: {variable}")), "--help does not name {variable}:\n{help}");
    }
}

/// A bad setting stops the binary at once, before it touches a server: exit 2, naming the flag.
pub fn assert_bad_setting_refused(binary: &str) {
    let output = Command::new(binary).env("HTTP_ADDR", "not-an-address").output().expect("run");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(error.contains("invalid value 'not-an-address' for '--http-addr"), "{error}");
}
