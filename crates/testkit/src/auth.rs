//! Bearer tokens for the orders API in tests: every shop's API checks them against [`KEY`]
//! (`AUTH_JWT_KEY`, HS256), as it would a real identity provider's.

use jsonwebtoken::{EncodingKey, Header, encode};

/// The HS256 secret every test shop's API is given.
pub const KEY: &str = "testkit: an HS256 secret of 32 bytes or more";

/// A token for `customer`, valid for a day (a soak's length).
pub fn customer(customer: &str) -> String {
    sign(serde_json::json!({"sub": customer, "exp": in_a_day()}))
}

/// An operator's token (`scope` holds `operator`), valid for a day: it may place orders in any
/// customer's name, cancel any order and read `/overview`.
pub fn operator() -> String {
    sign(serde_json::json!({"sub": "testkit-operator", "scope": "operator", "exp": in_a_day()}))
}

/// The `Authorization` header's value for `token`: `Bearer <token>`.
pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// `claims` signed with [`KEY`].
pub fn sign(claims: serde_json::Value) -> String {
    encode(&Header::default(), &claims, &EncodingKey::from_secret(KEY.as_bytes())).expect("HS256 signs any claims")
}

fn in_a_day() -> i64 {
    chrono::Utc::now().timestamp() + 24 * 3600
}
