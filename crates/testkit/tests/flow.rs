//! The whole order flow on real Postgres and RabbitMQ: API -> outbox -> relay -> inventory ->
//! billing -> status consumer, and the duplicate deliveries each inbox must absorb.

mod common;

use common::{Shop, count};
use shop::{InventoryReserved, OrderLine, OrderPlaced};
use testkit::eventually;
use testkit::shop::{Service, WAIT};
use uuid::Uuid;

/// A fresh order of `quantity` of one SKU, as the API would announce it.
fn one_line_order(customer_id: &str, sku: &str, quantity: i32) -> OrderPlaced {
    OrderPlaced {
        order_id: Uuid::now_v7(),
        job_id: Uuid::now_v7(),
        customer_id: customer_id.into(),
        lines: vec![OrderLine { sku: sku.into(), quantity }],
        deadline: None,
    }
}

async fn stock(shop: &Shop, sku: &str) -> (i32, i32) {
    sqlx::query_as("select available, reserved from stock where sku = $1")
        .bind(sku)
        .fetch_one(&shop.inventory)
        .await
        .expect("stock row")
}

#[tokio::test]
async fn valid_order_succeeds_with_invoice_and_exact_stock_change() {
    let mut shop = common::start().await;
    let (sku1_before, _) = stock(&shop, "SKU-1").await;
    let (sku3_before, _) = stock(&shop, "SKU-3").await;

    let job_id = shop.place(&[("SKU-1", 2), ("SKU-3", 1), ("SKU-1", 1)]).await;
    let job = shop.wait_for_state(job_id, "succeeded").await;

    let invoice_id: Uuid = job["resultKey"].as_str().expect("resultKey").parse().expect("invoice id is a UUID");
    let total: i64 = sqlx::query_scalar("select total_cents from invoices where id = $1")
        .bind(invoice_id)
        .fetch_one(&shop.billing)
        .await
        .expect("the invoice named by resultKey exists");
    assert_eq!(total, 3 * 1299 + 499, "sum of quantity x unit price");
    assert_eq!(job["attempt"], 1);
    assert!(job["publishedAt"].is_string(), "{job}");

    // Invoiced, the order's reservation is settled: the stock is sold, none is held.
    shop.settle(WAIT).await;
    assert_eq!(stock(&shop, "SKU-1").await, (sku1_before - 3, 0));
    assert_eq!(stock(&shop, "SKU-3").await, (sku3_before - 1, 0));
    let settled: (i32, i32, String) = sqlx::query_as(
        "select (select settled from stock where sku = 'SKU-1'), (select settled from stock where sku = 'SKU-3'),
                (select state from reservations)",
    )
    .fetch_one(&shop.inventory)
    .await
    .expect("settled stock");
    assert_eq!(settled, (3, 1, "settled".to_owned()));
    let order_url = format!("{}/orders/{}", shop.http(Service::Api), job["orderId"].as_str().expect("orderId"));
    let order = testkit::http::request("GET", &order_url, &[], None).await.expect("GET order").json();
    assert_eq!(order["status"], "invoiced", "{order}");
    assert_eq!(order["jobId"].as_str(), Some(job_id.to_string().as_str()));
    assert_eq!(
        order["lines"],
        serde_json::json!([{"sku": "SKU-1", "quantity": 2}, {"sku": "SKU-3", "quantity": 1}, {"sku": "SKU-1", "quantity": 1}])
    );
    shop.stop().await;
}

#[tokio::test]
async fn order_beyond_stock_or_of_unknown_sku_is_rejected_and_moves_nothing() {
    let mut shop = common::start().await;
    let before: Vec<(String, i32, i32)> = sqlx::query_as("select sku, available, reserved from stock order by sku")
        .fetch_all(&shop.inventory)
        .await
        .expect("stock");

    // SKU-5 has 10 in stock: the whole order is refused, including the line that would fit.
    let too_many = shop.place(&[("SKU-1", 1), ("SKU-5", 11)]).await;
    let unknown = shop.place(&[("SKU-2", 1), ("NOPE-9", 1)]).await;

    let job = shop.wait_for_state(too_many, "rejected").await;
    assert!(job["lastError"].as_str().expect("reason").contains("insufficient stock for SKU-5"), "{job}");
    let job = shop.wait_for_state(unknown, "rejected").await;
    assert!(job["lastError"].as_str().expect("reason").contains("unknown SKU NOPE-9"), "{job}");

    let after: Vec<(String, i32, i32)> = sqlx::query_as("select sku, available, reserved from stock order by sku")
        .fetch_all(&shop.inventory)
        .await
        .expect("stock");
    assert_eq!(before, after, "no stock moves");
    assert_eq!(count(&shop.inventory, "select count(*) from reservations").await, 0);
    assert_eq!(count(&shop.billing, "select count(*) from invoices").await, 0);
    shop.stop().await;
}

#[tokio::test]
async fn duplicate_order_placed_reserves_once_and_invoices_once() {
    let shop = common::start().await;
    let (before, _) = stock(&shop, "SKU-2").await;
    let placed = one_line_order("c-dup", "SKU-2", 4);
    shop.env.publish(&placed, placed.job_id, 2).await;

    let series = "inbox_duplicates_skipped_total{endpoint=\"inventory.order-placed\"}";
    eventually("inventory to skip the duplicate", WAIT, || async {
        (shop.metric(Service::Inventory, series).await == 1).then_some(())
    })
    .await;
    eventually("the order to be invoiced", WAIT, || async {
        (count(&shop.billing, "select count(*) from invoices").await == 1).then_some(())
    })
    .await;
    assert_eq!(count(&shop.inventory, "select count(*) from reservations").await, 1);
    assert_eq!(stock(&shop, "SKU-2").await, (before - 4, 4), "reserved once");
    assert_eq!(count(&shop.inventory, "select count(*) from inbox").await, 1);
    shop.stop().await;
}

#[tokio::test]
async fn duplicate_inventory_reserved_invoices_once() {
    let shop = common::start().await;
    let reserved = InventoryReserved {
        order_id: Uuid::now_v7(),
        job_id: Uuid::now_v7(),
        reservation_id: Uuid::now_v7(),
        lines: vec![OrderLine { sku: "SKU-4".into(), quantity: 2 }],
        deadline: None,
    };
    shop.env.publish(&reserved, reserved.job_id, 2).await;

    let series = "inbox_duplicates_skipped_total{endpoint=\"billing.inventory-reserved\"}";
    eventually("billing to skip the duplicate", WAIT, || async {
        (shop.metric(Service::Billing, series).await == 1).then_some(())
    })
    .await;
    let totals: Vec<i64> =
        sqlx::query_scalar("select total_cents from invoices").fetch_all(&shop.billing).await.expect("invoices");
    assert_eq!(totals, vec![2 * 10000], "one invoice, priced once");
    shop.stop().await;
}

/// The same order under two message ids (e.g. an upstream that wrote its outbox row twice): the
/// inbox cannot tell them apart, so each step's own key (`on conflict (order_id)`) does, and only
/// the first copy is announced downstream.
#[tokio::test]
async fn one_order_under_two_message_ids_is_reserved_invoiced_and_announced_once() {
    let shop = common::start().await;
    let (before, _) = stock(&shop, "SKU-3").await;
    let placed = one_line_order("c-twice", "SKU-3", 1);
    let reserved = InventoryReserved {
        order_id: Uuid::now_v7(),
        job_id: Uuid::now_v7(),
        reservation_id: Uuid::now_v7(),
        lines: vec![OrderLine { sku: "SKU-4".into(), quantity: 3 }],
        deadline: None,
    };
    for _ in 0..2 {
        shop.env.publish(&placed, placed.job_id, 1).await;
        shop.env.publish(&reserved, reserved.job_id, 1).await;
    }

    // Both copies of each were applied (an inbox row each), not skipped as duplicates; billing also
    // gets inventory's one `inventory.reserved` of the placed order.
    eventually("both copies of each to be applied", WAIT, || async {
        let inventory = count(&shop.inventory, "select count(*) from inbox").await;
        let billing = count(&shop.billing, "select count(*) from inbox").await;
        (inventory == 2 && billing == 3).then_some(())
    })
    .await;
    assert_eq!(count(&shop.inventory, "select count(*) from reservations").await, 1);
    assert_eq!(stock(&shop, "SKU-3").await, (before - 1, 1), "reserved once");
    assert_eq!(
        count(&shop.inventory, "select count(*) from outbox where message_type = 'inventory.reserved'").await,
        1,
        "announced once"
    );
    let invoiced = format!("select count(*) from invoices where order_id = '{}'", reserved.order_id);
    assert_eq!(count(&shop.billing, &invoiced).await, 1);
    let announced = format!("select count(*) from outbox where payload->>'orderId' = '{}'", reserved.order_id);
    assert_eq!(count(&shop.billing, &announced).await, 1, "invoice.created once");
    shop.stop().await;
}

/// An order that takes the last of a SKU's stock, under two message ids: the second copy finds
/// the stock short, but the order is reserved already, so it is neither refused nor announced.
#[tokio::test]
async fn an_order_that_took_the_last_stock_is_not_refused_under_its_second_message_id() {
    let shop = common::start().await;
    sqlx::query("update stock set available = 2, reserved = 0 where sku = 'SKU-5'")
        .execute(&shop.inventory)
        .await
        .expect("two left");
    let placed = one_line_order("c-last", "SKU-5", 2);
    shop.env.publish(&placed, placed.job_id, 1).await;
    eventually("the first copy to be applied", WAIT, || async {
        (count(&shop.inventory, "select count(*) from inbox").await == 1).then_some(())
    })
    .await;
    shop.env.publish(&placed, placed.job_id, 1).await;
    eventually("the second copy to be applied", WAIT, || async {
        (count(&shop.inventory, "select count(*) from inbox").await == 2).then_some(())
    })
    .await;
    assert_eq!(stock(&shop, "SKU-5").await, (0, 2), "reserved once");
    assert_eq!(count(&shop.inventory, "select count(*) from reservations").await, 1);
    let announced = |kind: &str| format!("select count(*) from outbox where message_type = '{kind}'");
    assert_eq!(count(&shop.inventory, &announced("inventory.reserved")).await, 1, "announced once");
    assert_eq!(count(&shop.inventory, &announced("inventory.rejected")).await, 0, "never refused");
    shop.stop().await;
}
