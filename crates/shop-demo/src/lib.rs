//! The demo's fault injection (`DEMO_FAULTS=1`, the README's demo) and catalogue, which the shop's
//! workers take as flags ([`Demo`]). Not the shop's contracts (`shop`), which production runs.
//!
//! A line whose SKU starts with `FLAKY` fails transiently on the first two attempts; one starting
//! with `POISON` fails on every attempt (a simulated handler bug), so its message is parked after
//! `MAX_ATTEMPTS`; one starting with `CRASH` makes the process exit at once, every time (a handler
//! that crashes), so its message is parked by the crash bound (`MAX_CRASHES`). Two fire in billing
//! alone, after inventory has reserved the order: billing declines an order with a `DECLINE` line
//! (a business refusal, `payment.declined`), and fails on every attempt at one with a `BILLPOISON`
//! line.
//!
//! Only a build with the feature `demo-faults` has them (decision 0025): the test kit, the demo's
//! image and `just dev` turn it on; a default build ignores `DEMO_FAULTS`.
//!
//! The demo's catalogue ([`CATALOGUE`]: `SKU-1`..`SKU-5` and the faults' SKUs) is written by the
//! workers at start-up when `DEMO_CATALOGUE` is on ([`Demo::catalogue`]), as compose, the test kit
//! and `just dev` set it; never by the services' migrations, so a real deployment starts with no
//! products but its own.

use messaging_core::handler::HandlerError;

/// The exit code of a worker that a `CRASH` SKU brings down (`EX_SOFTWARE`), distinct from a
/// panic's 101, so that a supervisor or a soak can tell the demo's crashes from real ones.
pub const CRASH_EXIT_CODE: i32 = 70;

/// The `DEMO_FAULTS` flag of a shop worker.
#[derive(Debug, Clone, Copy, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct DemoFaults {
    /// Demo fault injection: FLAKY* SKUs fail twice, POISON* SKUs always, CRASH* SKUs make the
    /// process exit; in billing, DECLINE* SKUs are declined and BILLPOISON* SKUs always fail
    /// (1/0, true/false).
    #[cfg_attr(feature = "clap", arg(long = "demo-faults", env = "DEMO_FAULTS", value_name = "DEMO_FAULTS", default_value = "false", action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new()))]
    pub enabled: bool,
}

/// A shop worker's demo settings: its faults, and whether it writes the demo's catalogue.
#[derive(Debug, Clone, Copy, Default)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct Demo {
    #[cfg_attr(feature = "clap", command(flatten))]
    #[allow(missing_docs)]
    pub faults: DemoFaults,
    /// Write the demo's catalogue (SKU-1..5 and the fault SKUs, with stock and prices) at start-up,
    /// keeping any row already there (1/0, true/false).
    #[cfg_attr(feature = "clap", arg(long = "demo-catalogue", env = "DEMO_CATALOGUE", value_name = "DEMO_CATALOGUE",
          default_value = "false", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new()))]
    pub catalogue: bool,
}

impl Demo {
    /// At inventory's start-up: its part of the catalogue ([`stock_catalogue`]), if asked.
    pub async fn stock(&self, pool: &sqlx::PgPool) -> sqlx::Result<()> {
        if self.catalogue { stock_catalogue(&mut *pool.acquire().await?).await } else { Ok(()) }
    }

    /// At billing's start-up: its part of the catalogue ([`price_catalogue`]), if asked.
    pub async fn prices(&self, pool: &sqlx::PgPool) -> sqlx::Result<()> {
        if self.catalogue { price_catalogue(&mut *pool.acquire().await?).await } else { Ok(()) }
    }
}

/// One product of the demo's catalogue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Product {
    /// Its SKU.
    pub sku: &'static str,
    /// The stock inventory starts it with.
    pub stock: i32,
    /// Its unit price in billing, in cents.
    pub unit_price_cents: i64,
}

/// The demo's catalogue: what the README's walkthrough, the demo's page and the test suites order.
pub const CATALOGUE: &[Product] = &[
    Product { sku: "SKU-1", stock: 1000, unit_price_cents: 1299 },
    Product { sku: "SKU-2", stock: 1000, unit_price_cents: 2500 },
    Product { sku: "SKU-3", stock: 500, unit_price_cents: 499 },
    Product { sku: "SKU-4", stock: 100, unit_price_cents: 10000 },
    Product { sku: "SKU-5", stock: 10, unit_price_cents: 75 },
    Product { sku: "FLAKY-1", stock: 1000, unit_price_cents: 1000 },
    Product { sku: "POISON-1", stock: 1000, unit_price_cents: 1000 },
    Product { sku: "CRASH-1", stock: 1000, unit_price_cents: 1000 },
    Product { sku: "DECLINE-1", stock: 1000, unit_price_cents: 1000 },
    Product { sku: "BILLPOISON-1", stock: 1000, unit_price_cents: 1000 },
];

/// Inventory's part of the catalogue: each product's stock, unless its SKU is already stocked (a
/// restart keeps what the demo has sold). The SKUs already there are left out before the insert,
/// so that a restart does not wait on an order holding one of their rows.
pub async fn stock_catalogue(conn: &mut sqlx::PgConnection) -> sqlx::Result<()> {
    let (skus, stock): (Vec<&str>, Vec<i32>) = CATALOGUE.iter().map(|p| (p.sku, p.stock)).unzip();
    sqlx::query(
        "insert into stock (sku, available)
         select sku, available from unnest($1::text[], $2::int[]) as product (sku, available)
          where not exists (select 1 from stock s where s.sku = product.sku)
         on conflict (sku) do nothing",
    )
    .bind(skus)
    .bind(stock)
    .execute(conn)
    .await
    .map(drop)
}

/// Billing's part of the catalogue: each product's price, unless its SKU already has one.
pub async fn price_catalogue(conn: &mut sqlx::PgConnection) -> sqlx::Result<()> {
    let (skus, prices): (Vec<&str>, Vec<i64>) = CATALOGUE.iter().map(|p| (p.sku, p.unit_price_cents)).unzip();
    sqlx::query(
        "insert into prices (sku, unit_price_cents)
         select sku, price from unnest($1::text[], $2::bigint[]) as product (sku, price)
          where not exists (select 1 from prices p where p.sku = product.sku)
         on conflict (sku) do nothing",
    )
    .bind(skus)
    .bind(prices)
    .execute(conn)
    .await
    .map(drop)
}

/// Whether this build has the demo's faults (the feature `demo-faults`, decision 0025).
pub const COMPILED_IN: bool = cfg!(feature = "demo-faults");

impl DemoFaults {
    /// The faults as this build has them: off in a build without the feature `demo-faults`,
    /// whatever `DEMO_FAULTS` says (with a warning if it asked for them). A worker calls this once,
    /// as it makes its handler.
    pub fn in_this_build(self) -> Self {
        if self.enabled && !COMPILED_IN {
            tracing::warn!("DEMO_FAULTS is on, but this build has no demo faults (the feature `demo-faults`): ignored");
        }
        Self { enabled: self.on() }
    }

    /// Whether the faults are on: asked for, and in this build.
    fn on(self) -> bool {
        self.enabled && COMPILED_IN
    }

    /// The fault the first faulty SKU among `skus` calls for on `attempt`, if faults are on. Never
    /// enable it in a test process with a `CRASH` SKU: the process would exit.
    pub fn apply<'a>(self, skus: impl IntoIterator<Item = &'a str>, attempt: u32) -> Result<(), HandlerError> {
        if !self.on() {
            return Ok(());
        }
        for sku in skus {
            if sku.starts_with("CRASH") {
                // Like a segfault or an OOM kill: no unwinding, no ack, nothing flushed but this line.
                eprintln!("demo fault: {sku} crashes the worker (attempt {attempt})");
                std::process::exit(CRASH_EXIT_CODE);
            }
            if sku.starts_with("POISON") {
                return Err(HandlerError::Transient(
                    format!("demo fault: {sku} always fails (attempt {attempt})").into(),
                ));
            }
            if sku.starts_with("FLAKY") && attempt <= 2 {
                return Err(HandlerError::Transient(
                    format!("demo fault: {sku} fails on attempt {attempt} of 3").into(),
                ));
            }
        }
        Ok(())
    }

    /// In billing: the fault of the first `BILLPOISON` SKU among `skus`, if faults are on. It fails
    /// every attempt, so the message is parked after `MAX_ATTEMPTS`, with the order's stock held.
    pub fn apply_in_billing<'a>(
        self,
        skus: impl IntoIterator<Item = &'a str>,
        attempt: u32,
    ) -> Result<(), HandlerError> {
        match skus.into_iter().find(|sku| sku.starts_with("BILLPOISON")) {
            Some(sku) if self.on() => Err(HandlerError::Transient(
                format!("demo fault: {sku} always fails in billing (attempt {attempt})").into(),
            )),
            _ => Ok(()),
        }
    }

    /// In billing: why the payment for `skus` is declined, if faults are on and one is a
    /// `DECLINE` SKU. A refusal is an outcome, not an error.
    pub fn declines<'a>(self, skus: impl IntoIterator<Item = &'a str>) -> Option<String> {
        let sku = skus.into_iter().find(|sku| sku.starts_with("DECLINE")).filter(|_| self.on())?;
        Some(format!("payment declined (demo fault: {sku} is always declined)"))
    }
}
