//! The orders domain, typed: what an accepted order is made of, each part parsed once at the edge
//! so that everything after it holds only valid values (parse, don't validate), and the statuses
//! an order moves through, with every allowed move in one place.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Longest customer id or SKU, in characters.
pub const MAX_ID_CHARS: usize = 200;
/// Most lines in one order.
pub const MAX_LINES: usize = 100;

/// Why a value is not one of the domain's. Its text says what the value must be; the caller says
/// where it was (`lines[2].sku must be …`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(String);

/// An identifier written by people (a customer id, a SKU): 1 to [`MAX_ID_CHARS`] characters, not
/// all blank, and no control characters (Postgres cannot store NUL in text; the others have no
/// place in an identifier).
fn name(value: String) -> Result<String, Invalid> {
    let valid =
        !value.trim().is_empty() && value.chars().count() <= MAX_ID_CHARS && !value.chars().any(char::is_control);
    if valid {
        Ok(value)
    } else {
        Err(Invalid(format!("must be 1 to {MAX_ID_CHARS} characters, not all blank, no control characters")))
    }
}

/// Who orders.
///
/// ```
/// use orders_api::order::CustomerId;
/// assert_eq!(CustomerId::parse("c-42".into()).unwrap().as_str(), "c-42");
/// assert!(CustomerId::parse("   ".into()).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomerId(String);

impl CustomerId {
    /// A customer id, if `value` is a valid one.
    pub fn parse(value: String) -> Result<Self, Invalid> {
        name(value).map(Self)
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A stock keeping unit.
///
/// ```
/// use orders_api::order::Sku;
/// assert_eq!(Sku::parse("SKU-1".into()).unwrap().as_str(), "SKU-1");
/// assert!(Sku::parse("SKU\u{0}1".into()).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sku(String);

impl Sku {
    /// A SKU, if `value` is a valid one.
    pub fn parse(value: String) -> Result<Self, Invalid> {
        name(value).map(Self)
    }

    /// The SKU.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How many of a SKU one line orders: 1 to 1000.
///
/// ```
/// use orders_api::order::Quantity;
/// assert_eq!(Quantity::parse(3).unwrap().get(), 3);
/// assert!(Quantity::parse(0).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity(i32);

impl Quantity {
    /// The quantities a line may order.
    pub const RANGE: std::ops::RangeInclusive<i32> = 1..=1000;

    /// A quantity, if `value` is in [`Self::RANGE`].
    pub fn parse(value: i32) -> Result<Self, Invalid> {
        if Self::RANGE.contains(&value) {
            Ok(Self(value))
        } else {
            Err(Invalid(format!("must be between {} and {}, got {value}", Self::RANGE.start(), Self::RANGE.end())))
        }
    }

    /// The number.
    pub fn get(self) -> i32 {
        self.0
    }
}

/// The `Idempotency-Key` a client sends with `POST /orders`: 1 to 255 visible ASCII characters.
///
/// ```
/// use orders_api::order::IdempotencyKey;
/// assert_eq!(IdempotencyKey::parse("order-7").unwrap().as_str(), "order-7");
/// assert!(IdempotencyKey::parse("").is_err());
/// assert!(IdempotencyKey::parse("with space").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// A key, if `value` is a valid one.
    pub fn parse(value: &str) -> Result<Self, Invalid> {
        if !value.is_empty() && value.len() <= 255 && value.bytes().all(|b| b.is_ascii_graphic()) {
            Ok(Self(value.to_owned()))
        } else {
            Err(Invalid("Idempotency-Key must be 1 to 255 visible ASCII characters".into()))
        }
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// One line of a valid order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// What.
    pub sku: Sku,
    /// How many.
    pub quantity: Quantity,
}

/// A valid order: a customer and 1 to [`MAX_LINES`] valid lines. The API makes one from each
/// request ([`crate::api::PlaceOrder::parse`]); nothing after it checks again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidOrder {
    customer_id: CustomerId,
    lines: Vec<Line>,
}

impl ValidOrder {
    /// An order of `lines` for `customer_id`, if it has 1 to [`MAX_LINES`] lines.
    pub fn new(customer_id: CustomerId, lines: Vec<Line>) -> Result<Self, Invalid> {
        if lines.is_empty() {
            return Err(Invalid("lines must not be empty".into()));
        }
        if lines.len() > MAX_LINES {
            return Err(Invalid(format!("at most {MAX_LINES} lines per order, got {}", lines.len())));
        }
        Ok(Self { customer_id, lines })
    }

    /// Who orders.
    pub fn customer_id(&self) -> &CustomerId {
        &self.customer_id
    }

    /// What.
    pub fn lines(&self) -> &[Line] {
        &self.lines
    }

    /// This order's `order.placed` body, under `ids`, cancelled at `deadline` if not ended by then.
    pub fn placed(&self, ids: &Accepted, deadline: chrono::DateTime<chrono::Utc>) -> shop::OrderPlaced {
        shop::OrderPlaced {
            deadline: Some(deadline),
            order_id: ids.order_id,
            job_id: ids.job_id,
            customer_id: self.customer_id.as_str().to_owned(),
            lines: self
                .lines
                .iter()
                .map(|line| shop::OrderLine { sku: line.sku.as_str().to_owned(), quantity: line.quantity.get() })
                .collect(),
        }
    }
}

/// The ids an accepted order is given: the `202` body of `POST /orders`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Accepted {
    /// Poll `/jobs/{jobId}`.
    pub job_id: Uuid,
    /// The order created.
    pub order_id: Uuid,
}

/// Where an order is (`orders.status`, and `status` in `GET /orders/{orderId}`).
///
/// ```text
/// accepted ──(inventory reserved it)──▶ reserved
/// accepted | reserved ──▶ failed (a step's message was parked)
/// failed ──(the parked message was redriven)──▶ accepted
/// accepted | reserved | failed ──▶ invoiced | rejected | declined | cancelled (the ends)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    /// Written with its job; no step has reported yet.
    Accepted,
    /// Inventory reserved every line.
    Reserved,
    /// Billing invoiced it (final).
    Invoiced,
    /// Inventory refused it (final).
    Rejected,
    /// A step's message was parked; a redrive starts it over. Not final: an operator may still
    /// redrive the message or abandon the order, and the customer may cancel it.
    Failed,
    /// Billing refused it (final): what it took is given back.
    Declined,
    /// Cancelled by the customer, its deadline or an operator (final): what it took is given back.
    Cancelled,
}

impl OrderStatus {
    /// Every status.
    pub const ALL: [Self; 7] =
        [Self::Accepted, Self::Reserved, Self::Invoiced, Self::Rejected, Self::Failed, Self::Declined, Self::Cancelled];
    /// The ends: an order in one never moves again (decision 0023).
    pub const FINAL: [Self; 4] = [Self::Invoiced, Self::Rejected, Self::Declined, Self::Cancelled];

    /// The name stored in `orders.status` and shown by the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Reserved => "reserved",
            Self::Invoiced => "invoiced",
            Self::Rejected => "rejected",
            Self::Failed => "failed",
            Self::Declined => "declined",
            Self::Cancelled => "cancelled",
        }
    }

    /// The statuses an order may move to `self` from: every move of an order, in one place. Late
    /// or reordered events are harmless, since an order never moves back but by a redrive.
    pub fn moves_from(self) -> &'static [Self] {
        match self {
            Self::Accepted => &[Self::Failed],
            Self::Reserved => &[Self::Accepted],
            // An outcome proves its step was applied, even after its job was quarantined (a copy
            // the broker parked after its commit, or a redriven one): the order takes it, as its
            // job does (`jobs::rejected`, `jobs::decide`).
            Self::Invoiced | Self::Rejected | Self::Declined | Self::Cancelled => {
                &[Self::Accepted, Self::Reserved, Self::Failed]
            }
            Self::Failed => &[Self::Accepted, Self::Reserved],
        }
    }
}

impl TryFrom<String> for OrderStatus {
    type Error = String;
    fn try_from(name: String) -> Result<Self, Self::Error> {
        Self::ALL
            .into_iter()
            .find(|status| status.as_str() == name)
            .ok_or_else(|| format!("unknown order status `{name}`"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_through_their_names_and_the_api() {
        for status in OrderStatus::ALL {
            assert_eq!(OrderStatus::try_from(status.as_str().to_owned()), Ok(status));
            assert_eq!(serde_json::to_value(status).expect("json"), status.as_str());
        }
        assert!(OrderStatus::try_from("shipped".to_owned()).is_err());
    }

    #[test]
    fn final_statuses_are_left_by_nothing_and_failed_by_a_redrive_or_an_end() {
        for status in OrderStatus::ALL {
            for from in status.moves_from() {
                assert_ne!(*from, status, "{status:?} moves from itself");
                assert!(!OrderStatus::FINAL.contains(from), "{status:?} leaves a final one");
            }
        }
        let from_failed: Vec<_> =
            OrderStatus::ALL.into_iter().filter(|s| s.moves_from().contains(&OrderStatus::Failed)).collect();
        assert_eq!(
            from_failed,
            [
                OrderStatus::Accepted,
                OrderStatus::Invoiced,
                OrderStatus::Rejected,
                OrderStatus::Declined,
                OrderStatus::Cancelled
            ]
        );
    }

    #[test]
    fn an_order_needs_one_to_a_hundred_lines() {
        let customer = CustomerId::parse("c".into()).expect("customer");
        let line = Line { sku: Sku::parse("SKU-1".into()).expect("sku"), quantity: Quantity::parse(1).expect("qty") };
        assert_eq!(ValidOrder::new(customer.clone(), vec![]), Err(Invalid("lines must not be empty".into())));
        assert!(ValidOrder::new(customer.clone(), vec![line.clone(); MAX_LINES]).is_ok());
        assert!(ValidOrder::new(customer, vec![line; MAX_LINES + 1]).is_err());
    }
}
