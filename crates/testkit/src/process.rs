//! The shop's real binaries as child processes: start, `kill -9`, SIGTERM, restart, and read
//! their logs. Crash tests need real processes: an in-process task cannot die mid-instruction.
//!
//! The binaries are looked up next to the running test (or `chaos`) executable, in the same
//! cargo target directory, or in `SHOP_BIN_DIR`. `cargo test --workspace` builds them (every
//! service crate has an integration test, which makes cargo build its binary); otherwise run
//! `cargo build --bins` first.

use std::{
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    time::Duration,
};

use tokio::process::{Child, Command};

/// Where a service binary is.
pub fn binary(name: &str) -> PathBuf {
    let dir = match std::env::var_os("SHOP_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().expect("current executable");
            let dir = exe.parent().expect("executable directory").to_owned();
            // Test executables live in `<target>/<profile>/deps`, binaries one level up.
            if dir.ends_with("deps") { dir.parent().expect("profile directory").to_owned() } else { dir }
        }
    };
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the services first (`cargo build --bins`; `cargo test --workspace` does it), \
         or point SHOP_BIN_DIR at their directory",
        path.display()
    );
    path
}

/// A free local port for a child to listen on (checked by binding it, then released). Taken below
/// Linux's ephemeral range (32768 to 60999), from which every outgoing connection draws its source
/// port: an ephemeral port released here could be taken by one of those before the child binds
/// it (seen in CI: a relay exited with "Address already in use", and the harness's readiness
/// probe on that port reached another test's service). Ports are handed out in turn from a
/// random start, so one process never gets the same port twice, and two processes rarely collide.
/// And above 26000: below it are ports that servers bind on and off while tests run beside them,
/// which a check by binding finds free between two binds (the same exit recurred in a 4.3 cell at
/// b4c3cd0, with the range still holding them): the demo's published ports (25432, 25673, 25674)
/// and the Erlang distribution ports of the brokers `.ci` starts (AMQP's port + 20000: 25672,
/// 25690, 25693, 25694).
///
/// A port handed out stays this process's until it exits, across processes too: a lock on a file
/// per port (`$TMPDIR/reliable-orders-ports`) that the kernel releases when the process ends.
/// Without it, a service that a test killed and starts again on its port (`Shop::restart`) found
/// it taken by another test binary walking the same range, which had found it free meanwhile (CI,
/// 8c0f1d3: "Address already in use", twice in one run).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 26_000;
    const COUNT: u32 = 6_700;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    if NEXT.load(Ordering::Relaxed) == u32::MAX {
        let _ = NEXT.compare_exchange(u32::MAX, fastrand::u32(0..COUNT), Ordering::Relaxed, Ordering::Relaxed);
    }
    for _ in 0..COUNT {
        let port = FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % COUNT;
        let port = u16::try_from(port).expect("below 32768");
        if let Some(reserved) = reserve(port)
            && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
        {
            RESERVED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(reserved);
            return port;
        }
    }
    panic!("no free port in {FIRST}..{}", FIRST + COUNT);
}

/// The locks of the ports [`free_port`] handed out, held until the process exits.
static RESERVED: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());

/// `port`'s lock file, locked by this process; `None` if another process holds it.
fn reserve(port: u16) -> Option<std::fs::File> {
    let dir = std::env::temp_dir().join("reliable-orders-ports");
    std::fs::create_dir_all(&dir).unwrap_or_else(|error| panic!("create {}: {error}", dir.display()));
    let path = dir.join(port.to_string());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|error| panic!("open {}: {error}", path.display()));
    file.try_lock().ok().map(|()| file)
}

/// Run `command` to its end and return its output, its stdin closed and stdout and stderr
/// captured; a panic if it has not ended within `limit` (a service that should have refused to
/// start and did not), which kills it.
pub async fn run_to_exit(mut command: Command, limit: Duration) -> std::process::Output {
    command.stdin(Stdio::null()).kill_on_drop(true);
    let shown = format!("{:?}", command.as_std().get_program());
    match tokio::time::timeout(limit, command.output()).await {
        Ok(output) => output.unwrap_or_else(|error| panic!("run {shown}: {error}")),
        Err(_) => panic!("{shown} did not end within {limit:?}"),
    }
}

/// Send `child` SIGTERM, as an orchestrator stops a process, and wait up to `timeout` for it to
/// exit; `None` if it had exited already or did not in time (it is then killed).
pub async fn terminate(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let pid = child.id()?;
    let sent = Command::new("kill").args(["-TERM", &pid.to_string()]).status().await;
    assert!(matches!(sent, Ok(status) if status.success()), "kill -TERM {pid}: {sent:?}");
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(status) => status.ok(),
        Err(_) => {
            let _ = child.kill().await;
            None
        }
    }
}

/// One running (or stopped) service process. Its stdout and stderr go to `<log_dir>/<name>.log`,
/// appended across restarts, and the failpoints it reaches to `<log_dir>/<name>.failpoints`
/// (`FAILPOINTS_REPORT`). Dropping it kills the process.
#[derive(Debug)]
pub struct Process {
    name: String,
    binary: PathBuf,
    env: Vec<(String, String)>,
    log: PathBuf,
    failpoints: PathBuf,
    child: Option<Child>,
    /// How many times it was started.
    pub starts: u32,
}

impl Process {
    /// Start `binary` (a name from [`binary`]) with `env` on top of this process's environment.
    pub fn spawn(name: &str, binary: PathBuf, env: Vec<(String, String)>, log_dir: &Path) -> Self {
        let mut process = Self {
            name: name.to_owned(),
            binary,
            env,
            log: log_dir.join(format!("{name}.log")),
            failpoints: log_dir.join(format!("{name}.failpoints")),
            child: None,
            starts: 0,
        };
        process.start();
        process
    }

    /// From its next start, run `binary` instead (another release's build of the service).
    pub fn replace_binary(&mut self, binary: PathBuf) {
        self.binary = binary;
    }

    /// The service's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Start it again (after a kill or an exit), with extra variables for this run only.
    pub fn start_with(&mut self, extra: &[(&str, &str)]) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("open log");
        let mut command = Command::new(&self.binary);
        // A setting given as a file (`NAME_FILE`) is not also inherited as `NAME` from the tests'
        // own environment (where DATABASE_URL and AMQP_URL name the servers).
        for (name, _) in &self.env {
            if let Some(given) = name.strip_suffix("_FILE") {
                command.env_remove(given);
            }
        }
        command
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(extra.iter().copied())
            .env("FAILPOINTS_REPORT", &self.failpoints)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .kill_on_drop(true);
        self.child = Some(command.spawn().unwrap_or_else(|e| panic!("start {}: {e}", self.binary.display())));
        self.starts += 1;
    }

    /// Start it again with its own environment.
    pub fn start(&mut self) {
        self.start_with(&[]);
    }

    /// `kill -9` and reap it.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// Send SIGTERM and wait up to `timeout` for it to exit; `None` if it did not (it is then
    /// killed).
    pub async fn terminate(&mut self, timeout: Duration) -> Option<ExitStatus> {
        terminate(&mut self.child.take()?, timeout).await
    }

    /// Whether it is running; an exit it made by itself is returned as `Err`.
    pub fn check_running(&mut self) -> Result<bool, ExitStatus> {
        let Some(child) = self.child.as_mut() else { return Ok(false) };
        match child.try_wait() {
            Ok(None) => Ok(true),
            Ok(Some(status)) => Err(status),
            Err(_) => Ok(false),
        }
    }

    /// Forget a process that exited by itself, so that it can be started again.
    pub fn take_exit(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref()?.id()
    }

    /// Its peak resident set size (`VmHWM`) in KiB, while it runs (Linux).
    pub fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        status.lines().find_map(|line| line.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse().ok())
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Times it reached (or paused at) the failpoint `name`, across its restarts.
    pub fn failpoint_hits(&self, name: &str) -> usize {
        messaging::runtime::failpoint::hits(&self.failpoints, name)
    }

    /// Times `needle` occurs in its log.
    pub fn log_count(&self, needle: &str) -> usize {
        self.log_text().matches(needle).count()
    }
}

#[cfg(test)]
mod tests {
    use super::{free_port, reserve};

    #[test]
    fn a_port_handed_out_stays_reserved_while_this_process_runs() {
        let port = free_port();
        assert!(reserve(port).is_none(), "port {port} was handed out, and its lock is held");
        assert_ne!(free_port(), port, "the next port is another");
    }
}
