//! The tables `messaging` itself needs in every service database (the outbox, the inbox, the
//! crash ledger), shipped inside this crate (`crates/messaging-core/migrations`) and applied by
//! [`migrate`] in the same run as the service's own migrations (decision 0006).
//!
//! Both sets share sqlx's one `_sqlx_migrations` table, so their versions must differ: messaging
//! owns versions 1 and 3 (kept from when every service carried a copy of these files, so that
//! existing databases recognise them) and numbers its later migrations from 101 on; a service
//! numbers its own by timestamp (`sqlx migrate add`'s default) or sequentially below 100, avoiding
//! 1 and 3. A clash is refused before anything is applied.

use futures_util::future::BoxFuture;
use sqlx::{
    PgPool,
    error::BoxDynError,
    migrate::{MigrateError, Migration, MigrationSource, Migrator},
};

/// messaging's own migrations.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// One migrator for a service database: messaging's migrations first (a service's tables may
/// refer to the outbox; messaging's never refer to a service's), then the service's, each set in
/// its own order. Strict like any sqlx migrator: a version recorded in the database but known to
/// neither set, or a file changed after it was applied, is an error. Fails, naming the version, if
/// the two sets share one.
pub async fn combined(service: &Migrator) -> Result<Migrator, MigrateError> {
    let ours: Vec<&Migration> = MIGRATOR.iter().collect();
    if let Some(clash) = service.iter().find(|theirs| ours.iter().any(|m| m.version == theirs.version)) {
        return Err(MigrateError::Source(
            format!(
                "migration version {} ({}) is messaging's own: renumber the service's migration \
                 (messaging owns 1, 3 and 101 on; see decision 0006)",
                clash.version, clash.description
            )
            .into(),
        ));
    }
    let all = ours.into_iter().chain(service.iter()).cloned().collect();
    Migrator::new(Migrations(all)).await
}

/// The versions of messaging's and `service`'s migrations that `pool`'s database has not applied
/// yet: read with `SELECT` alone, so a runtime role that may not migrate can still tell whether
/// it needs to.
pub async fn pending(pool: &PgPool, service: &Migrator) -> Result<Vec<i64>, MigrateError> {
    let applied: Vec<i64> =
        match sqlx::query_scalar("select version from _sqlx_migrations where success").fetch_all(pool).await {
            Ok(applied) => applied,
            // 42P01: no bookkeeping table yet, nothing applied.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Vec::new(),
            Err(error) => return Err(MigrateError::Execute(error)),
        };
    let all = combined(service).await?;
    Ok(all.iter().map(|migration| migration.version).filter(|version| !applied.contains(version)).collect())
}

/// Apply messaging's migrations and then `service`'s to `pool`'s database, in one run under
/// sqlx's advisory lock (several instances may start together). The service runtime does this at
/// start-up (`messaging::runtime::db::open`); a tool of its own calls it directly.
///
/// ```no_run
/// static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/billing");
///
/// # async fn up(pool: sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
/// messaging_core::schema::migrate(&pool, &MIGRATOR).await
/// # }
/// ```
pub async fn migrate(pool: &PgPool, service: &Migrator) -> Result<(), MigrateError> {
    combined(service).await?.run(pool).await
}

/// An already resolved list of migrations, as a source for [`Migrator::new`].
#[derive(Debug)]
struct Migrations(Vec<Migration>);

impl<'s> MigrationSource<'s> for Migrations {
    fn resolve(self) -> BoxFuture<'s, Result<Vec<Migration>, BoxDynError>> {
        Box::pin(async move { Ok(self.0) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::NOTIFY_CHANNEL;

    /// Databases migrated before these files moved here recorded them under these versions and
    /// checksums (SHA-384 of the file): changing a byte would make every such database refuse to
    /// start (`VersionMismatch`).
    #[test]
    fn legacy_versions_keep_the_checksums_existing_databases_recorded() {
        let recorded = [
            (1, "33f690411a99e7049e3149ed8aaf8d402a8559d80b2aa1e350715a08e6844e0d153f46ccb085b1d0f9b6dd3af913bd44"),
            (3, "83ea444943ca407c494cc59188cb397744499a4ece7f5954dff1840e66ac33f1aaee2ef070a48049eeffed21cc9bef1d"),
        ];
        for (version, checksum) in recorded {
            let migration = MIGRATOR.iter().find(|m| m.version == version).expect("legacy version present");
            let hex: String = migration.checksum.iter().map(|byte| format!("{byte:02x}")).collect();
            assert_eq!(hex, checksum, "migration {version} changed");
        }
        assert!(MIGRATOR.iter().all(|m| m.version == 1 || m.version == 3 || m.version >= 101));
    }

    #[test]
    fn the_outbox_trigger_notifies_the_channel_the_relay_listens_on() {
        let sql = MIGRATOR.iter().find(|m| m.version == 1).expect("migration 1").sql.as_str();
        assert!(sql.contains(&format!("pg_notify('{NOTIFY_CHANNEL}'")), "{sql}");
    }

    #[tokio::test]
    async fn a_service_migration_with_one_of_messagings_versions_is_refused() {
        let service = Migrator::new(Migrations(vec![Migration::new(
            3,
            "accounts".into(),
            sqlx::migrate::MigrationType::Simple,
            sqlx::SqlSafeStr::into_sql_str("select 1"),
            false,
        )]))
        .await
        .expect("migrator");
        let error = combined(&service).await.expect_err("clash");
        assert!(error.to_string().contains("migration version 3 (accounts) is messaging's own"), "{error}");
    }
}
