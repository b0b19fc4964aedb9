//! Configuration shared by the binaries: flags with environment fallbacks (`clap`), so that every
//! binary's `--help` documents them, and connection URLs that never print their password.

use std::{fmt, str::FromStr, time::Duration};

use crate::runtime::duration::parse_duration;

/// A connection URL whose password is masked whenever it is printed or logged.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wrap a URL.
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL with its password, for the one place that connects.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl FromStr for SecretUrl {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for SecretUrl {
    /// `scheme://user:***@host/...`: the password (between `:` and `@` after the scheme) is masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let url = &self.0;
        let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
            return f.write_str(url);
        };
        let rest = &url[scheme_end..];
        let masked = match (rest.find('@'), rest.find(':')) {
            (Some(at), Some(colon)) if colon < at => {
                format!("{}{}:***{}", &url[..scheme_end], &rest[..colon], &rest[at..])
            }
            _ => url.clone(),
        };
        // libpq also takes the password as a query parameter.
        match masked.split_once('?') {
            Some((base, query)) => {
                let query: Vec<String> = query
                    .split('&')
                    .map(|pair| match pair.split_once('=') {
                        Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
                        _ => pair.to_owned(),
                    })
                    .collect();
                write!(f, "{base}?{}", query.join("&"))
            }
            None => f.write_str(&masked),
        }
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// The broker's nodes, as `AMQP_URL` names them: one URL, or several separated by commas, one for
/// each node of a cluster. A client connects to one; when that connection is lost it tries the
/// next, in turn ([`crate::runtime::broker::run_sessions`]).
///
/// Every entry is an `amqp://` or `amqps://` URL with a host, and all of them name the same user
/// and the same vhost: they are one broker reached at several addresses, not several brokers. Each
/// may carry its own TLS files in its query.
///
/// ```
/// use messaging::runtime::config::BrokerNodes;
///
/// let nodes: BrokerNodes = "amqp://shop:secret@rabbit-1:5672/shop,amqp://shop:secret@rabbit-2:5672/shop".parse()?;
/// assert_eq!(nodes.len(), 2);
/// assert_eq!(nodes.address(1), "rabbit-2:5672");
/// assert_eq!((nodes.vhost(), nodes.management_queues_path().as_str()), ("shop", "/api/queues/shop"));
/// let default: BrokerNodes = "amqp://guest:guest@localhost:5672".parse()?;
/// assert_eq!(default.management_queues_path(), "/api/queues/%2F");
/// assert_eq!(nodes.to_string(), "amqp://shop:***@rabbit-1:5672/shop,amqp://shop:***@rabbit-2:5672/shop");
///
/// let refused = "amqp://shop:secret@rabbit-1/shop,amqp://shop:secret@rabbit-2/billing".parse::<BrokerNodes>();
/// assert!(refused.unwrap_err().contains("vhost"));
/// # Ok::<(), String>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerNodes {
    urls: Vec<SecretUrl>,
    addresses: Vec<String>,
    vhost: String,
}

impl BrokerNodes {
    /// How many nodes are named (at least one).
    pub fn len(&self) -> usize {
        self.urls.len()
    }

    /// Never: a parsed list names at least one node.
    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }

    /// Node `index`'s URL (indices wrap around, so a caller can count attempts).
    pub fn url(&self, index: usize) -> &SecretUrl {
        &self.urls[index % self.urls.len()]
    }

    /// Node `index`'s `host:port`, as `/readyz` reports it (indices wrap around).
    pub fn address(&self, index: usize) -> &str {
        &self.addresses[index % self.addresses.len()]
    }

    /// The vhost every node's URL names (`/` for none), decoded.
    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    /// The management API's path of this vhost's queues (`/api/queues/<vhost, encoded>`).
    pub fn management_queues_path(&self) -> String {
        format!(
            "/api/queues/{}",
            percent_encoding::utf8_percent_encode(&self.vhost, percent_encoding::NON_ALPHANUMERIC)
        )
    }
}

impl FromStr for BrokerNodes {
    type Err = String;

    /// Refuses, naming the entry (its password masked): an empty entry, one that is not an
    /// `amqp://` or `amqps://` URL with a host, and one whose user or vhost differs from the
    /// first's.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (mut urls, mut addresses) = (Vec::new(), Vec::new());
        let mut first: Option<(String, String)> = None;
        for (position, entry) in (1..).zip(s.split(',').map(str::trim)) {
            let shown = SecretUrl::new(entry);
            let refuse = |why: &str| format!("AMQP_URL entry {position} ({shown}): {why}");
            if entry.is_empty() {
                return Err(refuse("empty (a stray comma?)"));
            }
            let parsed = url::Url::parse(entry).map_err(|error| refuse(&error.to_string()))?;
            let default_port = match parsed.scheme() {
                "amqp" => 5672,
                "amqps" => 5671,
                other => return Err(refuse(&format!("scheme {other}: not amqp or amqps"))),
            };
            let Some(host) = parsed.host_str().filter(|host| !host.is_empty()) else {
                return Err(refuse("no host"));
            };
            // As lapin reads it: an empty path is the default vhost, `/`.
            let vhost = match parsed.path().trim_start_matches('/') {
                "" => "/".to_owned(),
                path => percent_encoding::percent_decode_str(path).decode_utf8_lossy().into_owned(),
            };
            let user = (parsed.username().to_owned(), vhost);
            match &first {
                None => first = Some(user),
                Some((name, _)) if *name != user.0 => {
                    return Err(refuse(&format!("user {:?}, but entry 1 names user {name:?}", user.0)));
                }
                Some((_, vhost)) if *vhost != user.1 => {
                    return Err(refuse(&format!("vhost {:?}, but entry 1 names vhost {vhost:?}", user.1)));
                }
                Some(_) => {}
            }
            addresses.push(format!("{host}:{}", parsed.port().unwrap_or(default_port)));
            urls.push(SecretUrl::new(entry));
        }
        let vhost = first.map(|(_, vhost)| vhost).unwrap_or_else(|| "/".to_owned());
        Ok(Self { urls, addresses, vhost })
    }
}

impl fmt::Display for BrokerNodes {
    /// Every node's URL, passwords masked, separated by commas.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, url) in self.urls.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{url}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for BrokerNodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// Parses `AMQP_URL` for clap, whose own message for a refused value would print the value, and
/// so its passwords: the refusal names the entry, its password masked, and nothing else.
#[derive(Debug, Clone, Copy)]
struct NodesParser;

impl clap::builder::TypedValueParser for NodesParser {
    type Value = BrokerNodes;

    fn parse_ref(
        &self,
        _command: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<BrokerNodes, clap::Error> {
        use clap::error::ErrorKind;
        let value = value.to_str().ok_or_else(|| clap::Error::raw(ErrorKind::InvalidUtf8, "AMQP_URL: not UTF-8\n"))?;
        value.parse().map_err(|refusal| clap::Error::raw(ErrorKind::ValueValidation, format!("{refusal}\n")))
    }
}

/// `args` (a binary's command line, its name first) with a setting added for each one given in a
/// file: every flag whose environment variable is `NAME` also takes `NAME_FILE`, the path of a
/// file holding its value (a trailing newline is dropped), the way the official Postgres image
/// takes `POSTGRES_PASSWORD_FILE`. The value goes to the parser only, never to the environment,
/// the process's arguments or a log. `NAME_FILE` beside `NAME` or the flag itself is refused, as
/// is a file that cannot be read (the message names the file, never its content).
pub fn args_with_secret_files(
    command: &clap::Command,
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Result<Vec<std::ffi::OsString>, String> {
    let mut args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let set = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    for arg in command.get_arguments() {
        let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else { continue };
        let env = env.to_string_lossy();
        let file_env = format!("{env}_FILE");
        let Some(path) = set(&file_env) else { continue };
        if set(&env).is_some() {
            return Err(format!("{env} and {file_env} are both set: set one of them"));
        }
        let flag = format!("--{long}");
        let given = |arg: &std::ffi::OsString| {
            arg.to_str().is_some_and(|arg| arg == flag || arg.starts_with(&format!("{flag}=")))
        };
        if args.iter().skip(1).any(given) {
            return Err(format!("{flag} and {file_env} are both given: give one of them"));
        }
        let path = std::path::PathBuf::from(path);
        let value = std::fs::read_to_string(&path)
            .map_err(|error| format!("{file_env}={}: cannot read it: {error}", path.display()))?;
        let value = value.strip_suffix('\n').unwrap_or(&value);
        let value = value.strip_suffix('\r').unwrap_or(value);
        // Right after the binary's name, before any subcommand.
        args.insert(1.min(args.len()), format!("--{long}={value}").into());
    }
    Ok(args)
}

/// The broker connection, shared by every binary.
#[derive(Debug, Clone, clap::Args)]
pub struct BrokerArgs {
    /// RabbitMQ URL (AMQP 0-9-1); the vhost is the path, `%2f` for `/`. TLS: `amqps://`, with
    /// `?cacertfile=/run/ca.pem` (and `&certfile=...&keyfile=...` for a client certificate). A
    /// cluster: one URL per node, separated by commas (same user and vhost), tried in turn when a
    /// connection is lost.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@localhost:5672/%2f",
        value_parser = NodesParser
    )]
    pub amqp_url: BrokerNodes,
    /// How long a publish waits for the broker's confirm. Past it, the channel is given up and
    /// what it had not confirmed is retried: the outbox row stays unpublished, a consumer's
    /// delivery goes back to the broker unacked. Bounds the waits of a blocked connection (a
    /// resource alarm) and of a quorum queue without a majority.
    #[arg(long, env = "CONFIRM_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub confirm_timeout: Duration,
}

/// A wait that may be zero: `0`, or a duration as [`parse_duration`] reads it.
pub fn parse_wait(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" { Ok(Duration::ZERO) } else { parse_duration(s) }
}

/// A comma-separated list of delays such as `1s,5s,30s,2m,10m`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryDelays(pub Vec<Duration>);

impl FromStr for RetryDelays {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let delays = s.split(',').map(|part| parse_duration(part.trim())).collect::<Result<Vec<_>, _>>()?;
        if delays.is_empty() {
            return Err("at least one retry delay is needed".into());
        }
        Ok(Self(delays))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::duration::format_duration;

    #[test]
    fn secret_url_masks_password() {
        let url = SecretUrl::new("amqp://guest:hunter2@localhost:5672/%2f");
        assert_eq!(url.to_string(), "amqp://guest:***@localhost:5672/%2f");
        assert!(!format!("{url:?}").contains("hunter2"));
        assert_eq!(
            SecretUrl::new("postgres://postgres@localhost/accounts").to_string(),
            "postgres://postgres@localhost/accounts"
        );
        assert_eq!(
            SecretUrl::new("postgres://app@db/shop?sslmode=verify-full&password=hunter2").to_string(),
            "postgres://app@db/shop?sslmode=verify-full&password=***"
        );
    }

    #[test]
    fn broker_nodes_are_one_broker_at_several_addresses() {
        let one: BrokerNodes = "amqp://guest:guest@localhost/%2f".parse().expect("one node");
        assert_eq!((one.len(), one.address(0), one.address(1)), (1, "localhost:5672", "localhost:5672"));
        let three: BrokerNodes =
            " amqps://shop:pw@r1/shop?cacertfile=/ca.pem, amqps://shop:pw@r2:6000/shop ,amqps://shop:pw@r3/shop"
                .parse()
                .expect("three nodes");
        assert_eq!([three.address(0), three.address(1), three.address(5)], ["r1:5671", "r2:6000", "r3:5671"]);
        assert_eq!(three.url(4).expose(), "amqps://shop:pw@r2:6000/shop");
        assert!(!format!("{three} {three:?}").contains("pw"));
        // `/` is the default vhost however it is written.
        assert!("amqp://u:p@a:1,amqp://u:p@b:2/,amqp://u:p@c:3/%2f,amqp://u:p@d:4/%2F".parse::<BrokerNodes>().is_ok());
    }

    #[test]
    fn a_broker_node_list_that_is_not_one_broker_is_refused_naming_the_entry() {
        let refusal = |nodes: &str| nodes.parse::<BrokerNodes>().expect_err(nodes);
        assert_eq!(refusal("amqp://u:p@a/v,"), "AMQP_URL entry 2 (): empty (a stray comma?)");
        assert_eq!(refusal(""), "AMQP_URL entry 1 (): empty (a stray comma?)");
        assert!(refusal("amqp://u:p@a/v,b:5672").starts_with("AMQP_URL entry 2 (b:5672): "));
        assert_eq!(refusal("http://u:p@a/v"), "AMQP_URL entry 1 (http://u:***@a/v): scheme http: not amqp or amqps");
        assert_eq!(refusal("amqp:///v"), "AMQP_URL entry 1 (amqp:///v): no host");
        assert_eq!(
            refusal("amqp://u:secret@a/v,amqp://w:secret@b/v"),
            "AMQP_URL entry 2 (amqp://w:***@b/v): user \"w\", but entry 1 names user \"u\""
        );
        assert_eq!(
            refusal("amqp://u:p@a/v,amqp://u:p@b/%2f"),
            "AMQP_URL entry 2 (amqp://u:***@b/%2f): vhost \"/\", but entry 1 names vhost \"v\""
        );
    }

    #[test]
    fn retry_delays_parse_and_format_round_trip() {
        let delays: RetryDelays = "1s, 5s,30s,2m,10m,50ms,1h".parse().expect("valid");
        let names: Vec<_> = delays.0.iter().map(|d| format_duration(*d)).collect();
        assert_eq!(names, ["1s", "5s", "30s", "2m", "10m", "50ms", "1h"]);
        assert!("".parse::<RetryDelays>().is_err());
        assert!("0s".parse::<RetryDelays>().is_err());
        assert!("5".parse::<RetryDelays>().is_err());
        assert!("5 days".parse::<RetryDelays>().is_err());
    }
}
