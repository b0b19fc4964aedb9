//! `db::Kept`, the connection a loop keeps between its transactions (the consumers', the relay's
//! claims) instead of handing it back to the pool after each: kept only after clean work, never
//! with a transaction left open, checked after a second idle (and only then), and let go when
//! connections are retired and it is on a node that refuses writes. Against a real Postgres,
//! through the pool the services open.
//!
//! Retiring connections is the process's, and lasts: the test that does it runs alone
//! ([`RETIREMENT`]), so that it cannot let go of another test's connection mid-way, and each
//! test opens a pool of its own after it.

use std::time::Duration;

use messaging::{
    outage,
    runtime::db::{self, Kept, Taken},
};
use sqlx::{Connection, PgConnection, PgPool, postgres::PgConnectOptions};
use testkit::{TestEnv, eventually, proxy::Proxy};
use tokio::sync::RwLock;

/// Held to read by every test of this file, to write by the one that retires connections.
static RETIREMENT: RwLock<()> = RwLock::const_new(());

/// A pool as the services open theirs, on the test's own database, of `size` connections at most.
async fn pool_of(env: &TestEnv, size: u32) -> PgPool {
    env.pool("kept").await.close().await;
    let options: PgConnectOptions = env.database_url("kept").parse().expect("database url");
    db::pool_options(size, Duration::from_secs(5), false).connect_lazy_with(options)
}

async fn pool(env: &TestEnv) -> PgPool {
    pool_of(env, 4).await
}

/// A pool of one connection, as the services open theirs, through a proxy that can stall; with
/// sqlx's check on every hand-out if `check_each_acquire` (the API's pool).
async fn proxied_pool(env: &TestEnv, check_each_acquire: bool) -> (Proxy, PgPool) {
    env.pool("kept").await.close().await;
    let (proxy, url) = Proxy::for_url(&env.database_url("kept")).await.expect("proxy");
    let options: PgConnectOptions = url.parse().expect("database url");
    (proxy, db::pool_options(1, Duration::from_secs(5), check_each_acquire).connect_lazy_with(options))
}

/// A connection from `kept`, and its server process's id.
async fn take(kept: &Kept) -> (Taken, i32) {
    let mut conn = kept.take().await.expect("take");
    let pid = backend(&mut conn).await;
    (conn, pid)
}

async fn backend(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("select pg_backend_pid()").fetch_one(conn).await.expect("backend pid")
}

/// Whether backend `pid` still runs, asked on a connection of its own.
async fn alive(env: &TestEnv, pid: i32) -> bool {
    let mut admin = PgConnection::connect(&env.database_url("kept")).await.expect("connect");
    sqlx::query_scalar("select exists (select 1 from pg_stat_activity where pid = $1)")
        .bind(pid)
        .fetch_one(&mut admin)
        .await
        .expect("pg_stat_activity")
}

#[tokio::test]
async fn a_kept_connection_stays_out_of_the_pool_and_serves_the_next_transaction() {
    let _alone = RETIREMENT.read().await;
    let env = TestEnv::new().await;
    let pool = pool_of(&env, 1).await;
    let kept = Kept::new(pool.clone());

    let (mut conn, pid) = take(&kept).await;
    let tx = conn.begin().await.expect("begin");
    tx.commit().await.expect("commit");
    kept.keep(conn);
    // Kept, not handed back: the pool's one connection is not to be had. Handed back, it would be,
    // after sqlx's round trip on return.
    let acquired = tokio::time::timeout(Duration::from_secs(1), pool.acquire()).await;
    assert!(acquired.is_err(), "the kept connection went back to the pool");

    let mut conn = kept.take().await.expect("take again");
    assert_eq!(backend(&mut conn).await, pid, "the kept connection serves the next transaction");
}

#[tokio::test]
async fn a_connection_dropped_inside_its_transaction_goes_back_without_it() {
    let _alone = RETIREMENT.read().await;
    let env = TestEnv::new().await;
    // One connection: the next take gets the same one, back from the pool.
    let pool = pool_of(&env, 1).await;
    sqlx::query("create table written (id int)").execute(&pool).await.expect("create table");
    let kept = Kept::new(pool.clone());

    // A transaction abandoned mid-way, as a handler's deadline abandons one: not kept.
    let (mut conn, pid) = take(&kept).await;
    let mut tx = conn.begin().await.expect("begin");
    sqlx::query("insert into written values (1)").execute(&mut *tx).await.expect("insert");
    drop(tx);
    drop(conn);

    let mut conn = kept.take().await.expect("take again");
    assert_eq!(backend(&mut conn).await, pid, "the same connection, back from the pool");
    // Inside the abandoned transaction still, this statement would see its id (assigned by the
    // insert) and its row.
    let open: bool = sqlx::query_scalar("select pg_current_xact_id_if_assigned() is not null")
        .fetch_one(&mut *conn)
        .await
        .expect("transaction id");
    assert!(!open, "the next statement ran inside the abandoned transaction");
    let rows: i64 = sqlx::query_scalar("select count(*) from written").fetch_one(&mut *conn).await.expect("count");
    assert_eq!(rows, 0, "the abandoned transaction's row was committed");
}

/// The relay's claims begin and commit with statements of their own, which sqlx does not track:
/// a claim dropped before its commit closes its connection, and the server rolls it back.
#[tokio::test]
async fn a_connection_marked_to_close_is_closed_with_its_transaction() {
    let _alone = RETIREMENT.read().await;
    let env = TestEnv::new().await;
    let pool = pool(&env).await;
    sqlx::query("create table written (id int)").execute(&pool).await.expect("create table");
    let kept = Kept::new(pool.clone());

    let (mut conn, pid) = take(&kept).await;
    conn.close_on_drop();
    sqlx::query("begin").execute(&mut *conn).await.expect("begin");
    sqlx::query("insert into written values (1)").execute(&mut *conn).await.expect("insert");
    drop(conn);

    eventually("the backend to end", Duration::from_secs(10), || async { (!alive(&env, pid).await).then_some(()) })
        .await;
    let rows: i64 = sqlx::query_scalar("select count(*) from written").fetch_one(&pool).await.expect("count");
    assert_eq!(rows, 0, "the dropped transaction's row was committed");
}

#[tokio::test]
async fn a_kept_connection_that_broke_while_idle_is_found_before_it_is_used() {
    let _alone = RETIREMENT.read().await;
    let env = TestEnv::new().await;
    let pool = pool(&env).await;
    let kept = Kept::new(pool.clone());

    let (conn, pid) = take(&kept).await;
    kept.keep(conn);
    let mut admin = PgConnection::connect(&env.database_url("kept")).await.expect("connect");
    sqlx::query("select pg_terminate_backend($1)").bind(pid).execute(&mut admin).await.expect("terminate");
    // Idle past the threshold after which a kept connection is checked before it is handed out.
    tokio::time::sleep(db::CHECK_IF_IDLE_FOR + Duration::from_millis(100)).await;

    let mut conn = kept.take().await.expect("take after the break");
    assert_ne!(backend(&mut conn).await, pid, "the broken connection was handed out");
}

/// The API's pool checks each connection it hands out, so that a request finds a stalled
/// database within 2 s; the status consumer's kept connection, on that pool, is checked only after
/// a second idle, as every loop's: its work has its own deadline. Taken again at once through a
/// stalled proxy, it comes back without waiting for an answer.
#[tokio::test]
async fn a_kept_connection_used_again_within_a_second_is_not_checked_even_on_a_pool_that_checks_each() {
    let _alone = RETIREMENT.read().await;
    let env = TestEnv::new().await;
    let (proxy, pool) = proxied_pool(&env, true).await;
    let kept = Kept::new(pool.clone());

    let (conn, pid) = take(&kept).await;
    kept.keep(conn);
    proxy.stall();
    let taken = tokio::time::timeout(Duration::from_millis(500), kept.take()).await;
    proxy.restore();
    let mut conn = taken.expect("the take waited for a check through the stalled proxy").expect("take");
    assert_eq!(backend(&mut conn).await, pid, "the kept connection serves the next transaction");
}

/// Leave `conn`'s session read-only, as a failover leaves the sessions of a demoted node.
async fn read_only(conn: &mut PgConnection) {
    sqlx::query("set default_transaction_read_only = on").execute(conn).await.expect("read-only session");
}

#[tokio::test]
async fn a_kept_connection_on_a_node_that_refuses_writes_is_let_go_when_connections_are_retired() {
    let _alone = RETIREMENT.write().await;
    let env = TestEnv::new().await;
    let pool = pool(&env).await;
    let kept = Kept::new(pool.clone());

    let (mut conn, pid) = take(&kept).await;
    read_only(&mut conn).await;
    kept.keep(conn);
    // As after a node refused a write: every connection opened before now may be on that node.
    outage::retire_connections();

    let mut conn = kept.take().await.expect("take after the retirement");
    assert_ne!(backend(&mut conn).await, pid, "a connection on a node that refuses writes was handed out");
}

#[tokio::test]
async fn a_kept_connection_on_a_node_that_writes_stays_when_connections_are_retired() {
    let _alone = RETIREMENT.write().await;
    let env = TestEnv::new().await;
    let kept = Kept::new(pool(&env).await);

    let (conn, pid) = take(&kept).await;
    kept.keep(conn);
    outage::retire_connections();

    let mut conn = kept.take().await.expect("take after the retirement");
    assert_eq!(backend(&mut conn).await, pid, "the retirement was another database's");
}

/// A retirement closes the connections of the pool whose node refuses writes, not every pool's:
/// the relay has one pool a database, and one read-only database must not make it reconnect to
/// the others (issue 56, row 4).
#[tokio::test]
async fn a_retirement_closes_only_the_connections_of_a_pool_on_a_node_that_refuses_writes() {
    let _alone = RETIREMENT.write().await;
    let (refusing, writing) = (TestEnv::new().await, TestEnv::new().await);
    let (refusing, writing) = (pool_of(&refusing, 1).await, pool_of(&writing, 1).await);
    let mut conn = refusing.acquire().await.expect("acquire");
    let refusing_pid = backend(&mut conn).await;
    read_only(&mut conn).await;
    drop(conn);
    let writing_pid = backend(&mut writing.acquire().await.expect("acquire")).await;

    outage::retire_connections();

    let mut conn = eventually("the read-only connection to be replaced", Duration::from_secs(10), || async {
        let mut conn = refusing.acquire().await.ok()?;
        (backend(&mut conn).await != refusing_pid).then_some(conn)
    })
    .await;
    let writes: bool = sqlx::query_scalar("select current_setting('transaction_read_only') = 'off'")
        .fetch_one(&mut *conn)
        .await
        .expect("ask");
    assert!(writes, "the new connection takes writes");
    let mut conn = writing.acquire().await.expect("acquire");
    assert_eq!(backend(&mut conn).await, writing_pid, "the pool whose node writes kept its connection");
}

/// sqlx counts a transaction only once its `BEGIN` is answered: a `begin` given up before then
/// queues no rollback, and the connection, back in the pool, would still be in the server's
/// transaction. `Taken::begin` closes it instead. The `BEGIN` is held up by a proxy that stops
/// forwarding (a stalled network), then let through.
#[tokio::test]
async fn a_begin_given_up_before_its_answer_closes_the_connection() {
    let _alone = RETIREMENT.read().await;
    let env = TestEnv::new().await;
    // One connection: the next take gets the same one if it went back to the pool.
    let (proxy, pool) = proxied_pool(&env, false).await;
    let kept = Kept::new(pool.clone());

    let mut conn = kept.take().await.expect("take");
    proxy.stall();
    let given_up = tokio::time::timeout(Duration::from_millis(300), conn.begin()).await.is_err();
    assert!(given_up, "the BEGIN was answered through a stalled proxy");
    drop(conn);
    proxy.restore();

    let mut conn = kept.take().await.expect("take again");
    // Inside a transaction, a savepoint is taken; outside one, Postgres refuses it.
    let inside = sqlx::query("savepoint probe").execute(&mut *conn).await.is_ok();
    assert!(!inside, "the next user of the pool ran inside the given-up transaction");
}
