//! A server that cannot work now (out of disk, memory or connections: SQLSTATE class 53) is an
//! outage, not the message's fault (decision 0003, amended by issue 56, row 4): the consumers hold
//! their deliveries without spending an attempt for longer than the whole retry ladder, the API
//! answers 503 with `Retry-After`, and once the server works again every order completes on its
//! first attempt, with nothing parked.
//!
//! The states are raised by the real server, from triggers on the tables the services write (a
//! disk that fills under the inventory's reservations, memory that runs out under the orders'
//! table), so that the services meet them exactly where a full disk would stop them.

use std::time::Duration;

use messaging::runtime::metrics::DELIVERIES_HELD;
use testkit::{
    eventually,
    shop::{Options, Service, Shop, WAIT},
};

/// Make every insert into `table` fail with SQLSTATE `code`, or (`None`) stop it.
async fn refuse_inserts(pool: &sqlx::PgPool, table: &str, code: Option<&str>) {
    let statements = match code {
        Some(code) => vec![
            format!(
                "create function refuse_{table}() returns trigger language plpgsql as \
                 $$ begin raise exception 'the server cannot now' using errcode = '{code}'; end $$"
            ),
            format!("create trigger refuse before insert on {table} for each row execute function refuse_{table}()"),
        ],
        None => vec![format!("drop trigger refuse on {table}"), format!("drop function refuse_{table}()")],
    };
    for statement in statements {
        // Identifiers and codes written in this file, never input.
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(pool).await.expect("the trigger");
    }
}

/// Inventory holds `job`'s delivery, and for four times the retry ladder (the shop's five attempts
/// 100 ms and 300 ms apart: about a second) the job is neither retried nor parked.
async fn assert_held_without_attempts(shop: &Shop, job: uuid::Uuid) {
    eventually("inventory to hold the order's delivery", WAIT, || async {
        (shop.metric(Service::Inventory, DELIVERIES_HELD).await >= 1).then_some(())
    })
    .await;
    let window = tokio::time::Instant::now() + Duration::from_secs(4);
    while tokio::time::Instant::now() < window {
        let state = shop.job(job).await;
        // `queued` until the relay's mark commits, which can come after inventory holds the
        // delivery; never `retry_wait` or `quarantined`.
        let waiting = matches!(state["state"].as_str(), Some("queued" | "published"));
        assert!(waiting, "a full disk spends no attempt: {state}");
        assert_eq!(state["attempt"], 1, "{state}");
        assert!(shop.metric(Service::Inventory, DELIVERIES_HELD).await >= 1, "held until the disk has room");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test]
async fn a_full_disk_holds_deliveries_without_spending_attempts_and_the_api_answers_503() {
    // Five attempts 100 ms and 300 ms apart: the whole ladder is spent in about a second.
    let mut shop = Shop::start(Options::default()).await;
    refuse_inserts(&shop.inventory, "reservations", Some("53100")).await;
    let job = shop.place(&[("SKU-2", 1)]).await;
    assert_held_without_attempts(&shop, job).await;

    // The orders database out of memory: the API refuses for now, and says when to come back.
    refuse_inserts(&shop.orders, "orders", Some("53200")).await;
    let refused = shop.try_place(&[("SKU-2", 1)]).await.expect("POST /orders");
    assert_eq!(refused.status, 503, "{}", String::from_utf8_lossy(&refused.body));
    assert!(refused.header("retry-after").is_some(), "a 503 says when to retry");
    // Counted for the API's 5xx alert (`/readyz` stays 200: the database answers reads).
    assert!(shop.metric(Service::Api, "http_responses_total{class=\"5xx\"}").await >= 1);

    refuse_inserts(&shop.orders, "orders", None).await;
    refuse_inserts(&shop.inventory, "reservations", None).await;
    let later = shop.place(&[("SKU-3", 1)]).await;
    for job in [job, later] {
        let done = shop.wait_for_state(job, "succeeded").await;
        assert_eq!(done["attempt"], 1, "no attempt spent on the outage: {done}");
    }
    assert_eq!(shop.metric(Service::Inventory, DELIVERIES_HELD).await, 0);
    shop.assert_books_balance().await;
}

/// A disk of its own for a database's tables: a tmpfs of `SIZE` mounted for a tablespace of the
/// test (`t_<id>_<name>`, dropped with the test's databases), into which every table and index of
/// the database is moved, and then filled to the last byte by a table of its own. Unmounted when
/// dropped.
struct SmallDisk {
    dir: std::path::PathBuf,
    pool: sqlx::PgPool,
}

impl SmallDisk {
    const SIZE: &str = "16m";

    /// Mount it, move `pool`'s database onto it, and fill it.
    async fn full(pool: &sqlx::PgPool, tablespace: String) -> Self {
        let dir = std::env::temp_dir().join(&tablespace);
        std::fs::create_dir_all(&dir).expect("the disk's mount point");
        let disk = Self { dir, pool: pool.clone() };
        let dir = disk.dir.to_str().expect("a path in UTF-8");
        run("mount", &["-t", "tmpfs", "-o", &format!("size={}", Self::SIZE), "tmpfs", dir]);
        run("chown", &["postgres:postgres", dir]);
        // Names and paths made by this test, never input.
        let statements = [
            format!("create tablespace {tablespace} location '{dir}'"),
            format!("alter table all in tablespace pg_default set tablespace {tablespace}"),
            format!("alter index all in tablespace pg_default set tablespace {tablespace}"),
            format!("create table filler (b text) tablespace {tablespace}"),
        ];
        for statement in statements {
            sqlx::query(sqlx::AssertSqlSafe(statement)).execute(pool).await.expect("the disk's tablespace");
        }
        // About 200 kB a row once compressed (hex digits): a few hundred rows fill it.
        let fill = "insert into filler select string_agg(md5(random()::text), '') from generate_series(1, 10000)";
        for _ in 0..1_000 {
            match sqlx::query(fill).execute(pool).await {
                Ok(_) => continue,
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("53100") => return disk,
                Err(error) => panic!("filling the disk: {error}"),
            }
        }
        panic!("a {} disk did not fill", Self::SIZE);
    }

    /// Give the database its room back: the filler's files are deleted at once.
    async fn free(&self) {
        sqlx::query("drop table filler").execute(&self.pool).await.expect("drop the filler");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // Lazily: the server may still hold files of a database being dropped.
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn run(program: &str, args: &[&str]) {
    let status = std::process::Command::new(program).args(args).status().expect(program);
    assert!(status.success(), "{program} {args:?}: {status} (the test needs root)");
}

/// The same as `a_full_disk_…`, on disks that really fill: the orders and the inventory databases
/// each on a tmpfs of their own, filled to the last byte, so that Postgres itself fails to extend
/// a table file (`could not extend file …: No space left on device`, SQLSTATE 53100).
#[tokio::test]
#[ignore = "mounts a tmpfs for a tablespace of the local Postgres (root, a server on this machine); CI runs it with --ignored"]
async fn disks_that_really_fill_hold_deliveries_and_the_api_answers_503_until_they_have_room() {
    let mut shop = Shop::start(Options::default()).await;
    let id = shop.env.id().to_owned();
    let orders_disk = SmallDisk::full(&shop.orders, format!("t_{id}_orders_disk")).await;
    let inventory_disk = SmallDisk::full(&shop.inventory, format!("t_{id}_inventory_disk")).await;

    let refused = shop.try_place(&[("SKU-2", 1)]).await.expect("POST /orders");
    assert_eq!(refused.status, 503, "the orders database is full: {}", String::from_utf8_lossy(&refused.body));
    assert!(refused.header("retry-after").is_some(), "a 503 says when to retry");

    orders_disk.free().await;
    let job = shop.place(&[("SKU-2", 1)]).await;
    assert_held_without_attempts(&shop, job).await;

    inventory_disk.free().await;
    let later = shop.place(&[("SKU-3", 1)]).await;
    for job in [job, later] {
        let done = shop.wait_for_state(job, "succeeded").await;
        assert_eq!(done["attempt"], 1, "no attempt spent on the full disk: {done}");
    }
    assert_eq!(shop.metric(Service::Inventory, DELIVERIES_HELD).await, 0);
    shop.assert_books_balance().await;
    shop.stop().await;
    drop((orders_disk, inventory_disk));
}
