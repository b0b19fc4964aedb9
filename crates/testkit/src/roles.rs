//! Least privilege in tests: each service of a test's shop under its own database roles and
//! broker user, made by the scripts a DBA runs (`ops/postgres/roles.sql`, `ops/rabbitmq/users.sh`),
//! named after the test (`t_<id>_inventory`, `t-<id>-inventory-worker`) so that tests do not share
//! them. Every password is the role's own name: these servers are the test's.

use std::path::PathBuf;

use crate::{TestEnv, services::Service};

/// The scripts, from the repository's root.
fn script(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

/// `url` with `user` (and the same as password) instead of its own user, and `path` as its path.
pub fn as_user(url: &str, user: &str, path: Option<&str>) -> String {
    let mut parsed = url::Url::parse(url).expect("server URL");
    parsed.set_username(user).expect("user");
    parsed.set_password(Some(user)).expect("password");
    if let Some(path) = path {
        parsed.set_path(path);
    }
    parsed.to_string()
}

/// The accounts of one test's shop.
#[derive(Debug, Clone)]
pub struct Accounts {
    /// `t_<id>_`, in front of every database role.
    pub role_prefix: String,
    /// `t-<id>-`, in front of every broker user.
    pub user_prefix: String,
}

impl Accounts {
    /// The accounts of `env`'s shop, as [`provision`] made them.
    pub fn of(env: &TestEnv) -> Self {
        Self { role_prefix: format!("t_{}_", env.id()), user_prefix: format!("t-{}-", env.id()) }
    }

    /// The database role a service runs as (`t_<id>_inventory`; the relay's is `t_<id>_relay`).
    pub fn runtime_role(&self, database: &str) -> String {
        format!("{}{database}", self.role_prefix)
    }

    /// The database role a service migrates as.
    pub fn owner_role(&self, database: &str) -> String {
        format!("{}{database}_owner", self.role_prefix)
    }

    /// The relay's database role.
    pub fn relay_role(&self) -> String {
        format!("{}relay", self.role_prefix)
    }

    /// The deploy step's broker user (`t-<id>-topology`), which alone may declare the shared
    /// exchanges; its password is its name.
    pub fn topology_user(&self) -> String {
        format!("{}topology", self.user_prefix)
    }

    /// The books' reader's database role (read-only, in every database).
    pub fn books_role(&self) -> String {
        format!("{}books", self.role_prefix)
    }

    /// `url` (a database of this shop) through the read-only books role.
    pub fn books_url(&self, url: &str) -> String {
        as_user(url, &self.books_role(), None)
    }

    /// The broker user of `service` (`t-<id>-inventory-worker`).
    pub fn broker_user(&self, service: Service) -> String {
        format!("{}{}", self.user_prefix, service.binary())
    }

    /// The variables `service` runs with: its runtime and migration URLs, the relay's role, its
    /// broker user; `database_url` and `amqp_url` are the test's (possibly through proxies), whose
    /// user is replaced.
    pub fn service_env(&self, service: Service, database_url: &str, amqp_url: &str) -> Vec<(&'static str, String)> {
        let user = self.broker_user(service);
        let nodes: Vec<String> = amqp_url.split(',').map(|url| as_user(url, &user, None)).collect();
        let mut vars = vec![("AMQP_URL", nodes.join(","))];
        if service == Service::Relay {
            let role = self.relay_role();
            let urls: Vec<String> = database_url.split(',').map(|url| as_user(url, &role, None)).collect();
            vars.push(("DATABASE_URL", urls.join(",")));
            return vars;
        }
        let database = url::Url::parse(database_url).expect("database URL").path().trim_start_matches('/').to_owned();
        let service_name = database.trim_start_matches(&self.role_prefix).to_owned();
        vars.push(("DATABASE_URL", as_user(database_url, &self.runtime_role(&service_name), None)));
        vars.push(("MIGRATION_DATABASE_URL", as_user(database_url, &self.owner_role(&service_name), None)));
        vars.push(("OUTBOX_RELAY_ROLE", self.relay_role()));
        vars
    }
}

/// Make the roles, the databases and the broker users of `env`'s shop with the DBA's scripts.
pub async fn provision(env: &TestEnv) -> Accounts {
    let accounts = Accounts::of(env);
    let roles_sql = std::fs::read_to_string(script("ops/postgres/roles.sql")).expect("ops/postgres/roles.sql");
    for database in ["orders", "inventory", "billing"] {
        let service = accounts.runtime_role(database);
        let (owner, relay, books) = (accounts.owner_role(database), accounts.relay_role(), accounts.books_role());
        let variables = [
            ("service", service.as_str()),
            ("owner_password", owner.as_str()),
            ("runtime_password", service.as_str()),
            ("relay", relay.as_str()),
            ("relay_password", relay.as_str()),
            ("books", books.as_str()),
            ("books_password", books.as_str()),
        ];
        let output = env.psql("postgres", &variables, &roles_sql).await;
        assert!(output.status.success(), "roles.sql for {database}: {}", String::from_utf8_lossy(&output.stderr));
    }
    // users.sh speaks to the management API with curl: the URL without our query, its CA apart.
    let management = url::Url::parse(&env.servers.management).expect("management URL");
    let ca = management.query_pairs().find(|(key, _)| key == "cacertfile").map(|(_, value)| value.into_owned());
    let mut bare = messaging::runtime::tls::TlsFiles::strip(&management);
    bare.set_query(None);
    let mut command = tokio::process::Command::new("bash");
    command.arg(script("ops/rabbitmq/users.sh")).args(["apply", bare.as_str(), &env.vhost]);
    command.env("USER_PREFIX", &accounts.user_prefix);
    for service in Service::ALL {
        let variable = format!("{}_PASSWORD", service.binary().to_uppercase().replace('-', "_"));
        command.env(variable, accounts.broker_user(service));
    }
    // The operator's user and the deploy step's too, which the shop's services do not use.
    command.env("MSGCTL_PASSWORD", format!("{}msgctl", accounts.user_prefix));
    command.env("TOPOLOGY_PASSWORD", accounts.topology_user());
    if let Some(ca) = ca {
        command.env("CURL_CA_FILE", ca);
    }
    let output = command.output().await.expect("run ops/rabbitmq/users.sh");
    assert!(output.status.success(), "users.sh: {}", String::from_utf8_lossy(&output.stderr));
    apply_topology(env, &accounts).await;
    accounts
}

/// The deploy step that comes before the services (decision 0030): `msgctl topology apply` as the
/// deploy step's own broker user. No service's user may declare the shared exchanges.
pub async fn apply_topology(env: &TestEnv, accounts: &Accounts) {
    let user = accounts.topology_user();
    let nodes: Vec<String> = env.amqp_nodes().iter().map(|url| as_user(url, &user, None)).collect();
    let mut command = tokio::process::Command::new(crate::process::binary("msgctl"));
    command.args(["topology", "apply"]).env("AMQP_URL", nodes.join(",")).env("RUST_LOG", "off");
    let output = crate::process::run_to_exit(command, std::time::Duration::from_secs(60)).await;
    assert!(output.status.success(), "msgctl topology apply: {}", String::from_utf8_lossy(&output.stderr));
}
