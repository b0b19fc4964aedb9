//! The demo's catalogue is data the demo asks for (`DEMO_CATALOGUE`), not the services' schema:
//! migrated databases hold no product; each worker writes its part at start-up when the setting is
//! on, keeping what is already there; and a database seeded by the earlier migrations loses the
//! demo's rows that nothing used or changed, and keeps the others.

use std::path::Path;

use messaging::{runtime::shutdown, service::Worker};
use shop_demo::{CATALOGUE, Demo};
use sqlx::PgPool;
use testkit::{
    TestEnv,
    shop::{Options, WAIT},
    wait_ready,
};
use tokio::net::TcpListener;
use uuid::Uuid;

/// The catalogue's SKUs that `table` (`stock` or `prices`) has a row for.
async fn stocked(pool: &PgPool, table: &'static str) -> Vec<String> {
    let skus: Vec<&str> = CATALOGUE.iter().map(|product| product.sku).collect();
    let statement = match table {
        "stock" => "select sku from stock where sku = any($1) order by sku",
        _ => "select sku from prices where sku = any($1) order by sku",
    };
    sqlx::query_scalar(statement).bind(skus).fetch_all(pool).await.expect(table)
}

/// Run `worker` on `env`'s database with `--demo-catalogue catalogue` until it is ready, then stop it.
async fn start_and_stop<H: messaging::handler::Handler>(env: &TestEnv, worker: Worker<Demo, H>, catalogue: bool) {
    let mut args = vec![worker.name.to_owned()];
    args.extend(Options::default().consumer_flags(env.database_url(worker.database), env.amqp_url()));
    args.extend(["--demo-catalogue".to_owned(), catalogue.to_string()]);
    let settings = worker.try_parse_from(args).expect("flags");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    let (trigger, stop) = shutdown::channel();
    let task = tokio::spawn(worker.run(settings, listener, stop));
    wait_ready(&base, WAIT, "(the worker in this test)").await;
    trigger.trigger();
    tokio::time::timeout(WAIT, task).await.expect("stops").expect("task").expect("runs");
}

#[tokio::test]
async fn the_catalogue_is_written_only_when_the_setting_asks_and_what_is_there_is_kept() {
    let env = TestEnv::new().await;
    let inventory = env.migrated_pool("inventory", &inventory_worker::MIGRATOR).await;
    let billing = env.migrated_pool("billing", &billing_worker::MIGRATOR).await;
    assert!(stocked(&inventory, "stock").await.is_empty(), "the migrations stock nothing");
    assert!(stocked(&billing, "prices").await.is_empty(), "the migrations price nothing");

    start_and_stop(&env, inventory_worker::worker(), false).await;
    start_and_stop(&env, billing_worker::worker(), false).await;
    assert!(stocked(&inventory, "stock").await.is_empty(), "off: no stock written");
    assert!(stocked(&billing, "prices").await.is_empty(), "off: no price written");

    start_and_stop(&env, inventory_worker::worker(), true).await;
    start_and_stop(&env, billing_worker::worker(), true).await;
    let mut all: Vec<String> = CATALOGUE.iter().map(|product| product.sku.to_owned()).collect();
    all.sort();
    assert_eq!(stocked(&inventory, "stock").await, all);
    assert_eq!(stocked(&billing, "prices").await, all);
    let sku_5: i32 = sqlx::query_scalar("select available from stock where sku = 'SKU-5'")
        .fetch_one(&inventory)
        .await
        .expect("SKU-5");
    assert_eq!(sku_5, 10, "the catalogue's stock for SKU-5");

    // A demo that has sold SKU-5 restarts: its stock is the books', not the catalogue's.
    sqlx::query("update stock set available = 3, settled = 7 where sku = 'SKU-5'")
        .execute(&inventory)
        .await
        .expect("sell");
    start_and_stop(&env, inventory_worker::worker(), true).await;
    let after: (i32, i32) = sqlx::query_as("select available, settled from stock where sku = 'SKU-5'")
        .fetch_one(&inventory)
        .await
        .expect("SKU-5");
    assert_eq!(after, (3, 7), "kept on a restart");
}

/// Apply `service`'s migrations below `before` (and messaging's), as an earlier release did.
async fn migrate_as_an_earlier_release(pool: &PgPool, service: &str, before: &str) {
    let earlier = std::env::temp_dir().join(format!("{service}-migrations-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&earlier).expect("folder");
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // messaging's own, all of them, and the service's up to `before`.
    for (folder, last) in
        [("crates/messaging-core/migrations".to_owned(), "9"), (format!("migrations/{service}"), before)]
    {
        for entry in std::fs::read_dir(workspace.join(folder)).expect("migrations") {
            let path = entry.expect("entry").path();
            let name = path.file_name().expect("name").to_string_lossy().into_owned();
            if name.as_str() < last {
                std::fs::copy(&path, earlier.join(&name)).expect("copy");
            }
        }
    }
    let migrator = sqlx::migrate::Migrator::new(earlier.as_path()).await.expect("earlier migrator");
    migrator.run(pool).await.expect("migrate as the earlier release");
    std::fs::remove_dir_all(&earlier).expect("clean up");
}

#[tokio::test]
async fn a_database_seeded_by_an_earlier_release_keeps_only_the_demo_rows_an_order_used_or_someone_changed() {
    let env = TestEnv::new().await;
    let inventory = env.pool("inventory").await;
    migrate_as_an_earlier_release(&inventory, "inventory", "0006").await;
    let billing = env.pool("billing").await;
    migrate_as_an_earlier_release(&billing, "billing", "0006").await;
    assert_eq!(stocked(&inventory, "stock").await.len(), CATALOGUE.len(), "that release seeded the catalogue");

    // SKU-1 was reserved and invoiced, SKU-2 is held by a running order, SKU-3 was reserved and
    // released (nothing held, but a reservation names it); the rest were never ordered.
    sqlx::query(
        "insert into reservations (id, order_id, lines, state) values
           (gen_random_uuid(), gen_random_uuid(), '[{\"sku\": \"SKU-1\", \"quantity\": 2}]', 'settled'),
           (gen_random_uuid(), gen_random_uuid(), '[{\"sku\": \"SKU-2\", \"quantity\": 1}]', 'held'),
           (gen_random_uuid(), gen_random_uuid(), '[{\"sku\": \"SKU-3\", \"quantity\": 1}]', 'released')",
    )
    .execute(&inventory)
    .await
    .expect("reservations");
    sqlx::query("update stock set available = available - 2, settled = 2 where sku = 'SKU-1'")
        .execute(&inventory)
        .await
        .expect("settle");
    sqlx::query("update stock set available = available - 1, reserved = 1 where sku = 'SKU-2'")
        .execute(&inventory)
        .await
        .expect("hold");
    // SKU-4 was restocked and never ordered; SKU-5's price was changed.
    sqlx::query("update stock set available = 5000 where sku = 'SKU-4'").execute(&inventory).await.expect("restock");
    sqlx::query("update prices set unit_price_cents = 80 where sku = 'SKU-5'")
        .execute(&billing)
        .await
        .expect("reprice");
    sqlx::query(
        "insert into invoices (id, order_id, total_cents, lines)
         values (gen_random_uuid(), gen_random_uuid(), 2598, '[{\"sku\": \"SKU-1\", \"quantity\": 2}]')",
    )
    .execute(&billing)
    .await
    .expect("invoice");

    // This release migrates forward.
    messaging::schema::migrate(&inventory, &inventory_worker::MIGRATOR).await.expect("migrate inventory");
    messaging::schema::migrate(&billing, &billing_worker::MIGRATOR).await.expect("migrate billing");
    assert_eq!(stocked(&inventory, "stock").await, ["SKU-1", "SKU-2", "SKU-3", "SKU-4"]);
    assert_eq!(stocked(&billing, "prices").await, ["SKU-1", "SKU-5"]);
    let sku_1: (i32, i32, i32) = sqlx::query_as("select available, reserved, settled from stock where sku = 'SKU-1'")
        .fetch_one(&inventory)
        .await
        .expect("SKU-1");
    assert_eq!(sku_1, (998, 0, 2), "a row kept is kept whole");
}
