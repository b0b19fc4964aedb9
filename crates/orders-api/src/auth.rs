//! Who may change an order (decision 0031): `POST /orders` and `POST /orders/{id}/cancel` take a
//! bearer token, a JWT signed by the shop's identity provider and checked here against a
//! configured key. Its `sub` is the customer: a customer places orders in its own name and
//! cancels only its own. A token whose `scope` holds `operator` is an operator's: it may cancel
//! any order, place one in any customer's name, and read the live page's data (`GET /overview`).
//!
//! The token travels only in the `Authorization` header, never a cookie, so that another site
//! cannot make a browser send it: a cross-site form's POST arrives without one and gets 401. The
//! reads (`GET /orders/{id}`, `GET /jobs/{id}`) stay open: their ids (UUID v7) are hard to guess,
//! and are handed only to whoever placed the order (decision 0031 says what that leaves).

use std::{fmt, str::FromStr, sync::Arc};

use axum::{
    extract::{FromRef, FromRequestParts},
    http::{header, request::Parts},
};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use crate::problem::ApiError;

/// The scope an operator's token holds (space-separated in `scope`, as RFC 8693 writes it).
pub const OPERATOR_SCOPE: &str = "operator";

/// How tokens are checked.
#[derive(Debug, Clone, clap::Args)]
pub struct AuthArgs {
    /// The key bearer tokens are checked against: for HS256 the shared secret (32 bytes at
    /// least), otherwise the identity provider's public key in PEM. Required: there is no way to
    /// take orders unauthenticated.
    #[arg(long, env = "AUTH_JWT_KEY", hide_env_values = true)]
    pub auth_jwt_key: JwtKey,
    /// The tokens' signature algorithm: HS256, RS256, ES256 or EdDSA. A token that names another
    /// in its header is refused (no `none`, no switching to HMAC with a public key).
    #[arg(long, env = "AUTH_JWT_ALGORITHM", default_value = "HS256", value_parser = ["HS256", "RS256", "ES256", "EdDSA"])]
    pub auth_jwt_algorithm: String,
    /// The issuer a token's `iss` must name (unset: not checked).
    #[arg(long, env = "AUTH_JWT_ISSUER")]
    pub auth_jwt_issuer: Option<String>,
    /// The audience a token's `aud` must name (unset: not checked).
    #[arg(long, env = "AUTH_JWT_AUDIENCE")]
    pub auth_jwt_audience: Option<String>,
}

/// A key that is never printed.
#[derive(Clone)]
pub struct JwtKey(String);

impl FromStr for JwtKey {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Debug for JwtKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JwtKey(***)")
    }
}

/// The checker of tokens, shared by the routes.
#[derive(Clone)]
pub struct Auth(Arc<(DecodingKey, Validation)>);

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Auth").field(&self.0.1.algorithms).finish()
    }
}

impl AuthArgs {
    /// The checker these settings describe, or why they describe none (a short secret, a PEM that
    /// does not parse), naming the setting.
    pub fn auth(&self) -> Result<Auth, String> {
        let key = self.auth_jwt_key.0.trim();
        let algorithm: Algorithm = self.auth_jwt_algorithm.parse().map_err(|_| {
            format!("AUTH_JWT_ALGORITHM: {} is not one of HS256, RS256, ES256, EdDSA", self.auth_jwt_algorithm)
        })?;
        // jsonwebtoken reads a private key's PEM as well, and would then refuse every token: only
        // the provider's public key is taken.
        let public = ["-----BEGIN PUBLIC KEY-----", "-----BEGIN RSA PUBLIC KEY-----"];
        if algorithm != Algorithm::HS256 && !public.iter().any(|label| key.starts_with(label)) {
            return Err(format!(
                "AUTH_JWT_KEY: expected the identity provider's public key for {algorithm:?}, in PEM \
                 (`-----BEGIN PUBLIC KEY-----`)"
            ));
        }
        let pem = |parsed: Result<DecodingKey, jsonwebtoken::errors::Error>| {
            parsed.map_err(|error| format!("AUTH_JWT_KEY: not a PEM public key for {algorithm:?}: {error}"))
        };
        let decoding = match algorithm {
            Algorithm::HS256 if key.len() < 32 => {
                return Err(format!(
                    "AUTH_JWT_KEY: an HS256 secret must be 32 bytes at least (RFC 7518, 3.2), this one has {}",
                    key.len()
                ));
            }
            Algorithm::HS256 => DecodingKey::from_secret(key.as_bytes()),
            Algorithm::RS256 => pem(DecodingKey::from_rsa_pem(key.as_bytes()))?,
            Algorithm::ES256 => pem(DecodingKey::from_ec_pem(key.as_bytes()))?,
            Algorithm::EdDSA => pem(DecodingKey::from_ed_pem(key.as_bytes()))?,
            other => return Err(format!("AUTH_JWT_ALGORITHM: {other:?} is not supported")),
        };
        let mut validation = Validation::new(algorithm);
        // Each claim named here must be present; `iss` and `aud` are only compared when present
        // unless they are named too.
        let mut required = vec!["exp", "sub"];
        validation.leeway = 30;
        validation.validate_nbf = true;
        if let Some(issuer) = &self.auth_jwt_issuer {
            validation.set_issuer(&[issuer]);
            required.push("iss");
        }
        match &self.auth_jwt_audience {
            Some(audience) => {
                validation.set_audience(&[audience]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        validation.set_required_spec_claims(&required);
        Ok(Auth(Arc::new((decoding, validation))))
    }
}

/// The claims read from a token.
#[derive(Debug, Deserialize)]
struct Claims {
    sub: String,
    #[serde(default)]
    scope: String,
}

/// Who sent a request, from its bearer token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A customer, by its id (the token's `sub`).
    Customer(String),
    /// An operator (a token whose `scope` holds `operator`), by its `sub`.
    Operator(String),
}

impl Caller {
    /// The token's subject.
    pub fn name(&self) -> &str {
        match self {
            Self::Customer(name) | Self::Operator(name) => name,
        }
    }

    /// Whether this caller may act for `customer_id`: the customer itself, or an operator.
    pub fn acts_for(&self, customer_id: &str) -> bool {
        match self {
            Self::Customer(own) => own == customer_id,
            Self::Operator(_) => true,
        }
    }

    /// An operator, or a 403 saying that only operators may.
    pub fn operator(&self, what: &str) -> Result<(), ApiError> {
        match self {
            Self::Operator(_) => Ok(()),
            Self::Customer(_) => {
                Err(ApiError::Forbidden(format!("{what} needs an operator's token (scope `operator`)")))
            }
        }
    }
}

impl Auth {
    /// The caller a request's `Authorization` header names, or a 401 saying what is wrong.
    pub fn caller(&self, authorization: Option<&str>) -> Result<Caller, ApiError> {
        let Some(authorization) = authorization else {
            return Err(ApiError::Unauthenticated(None));
        };
        let token = authorization
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or_else(|| ApiError::Unauthenticated(Some("expected `Authorization: Bearer <token>`".to_owned())))?;
        let (key, validation) = &*self.0;
        let claims = jsonwebtoken::decode::<Claims>(token, key, validation)
            .map_err(|error| ApiError::Unauthenticated(Some(format!("the bearer token is refused: {error}"))))?
            .claims;
        if claims.sub.trim().is_empty() {
            return Err(ApiError::Unauthenticated(Some("the bearer token names no subject (`sub`)".to_owned())));
        }
        Ok(match claims.scope.split(' ').any(|scope| scope == OPERATOR_SCOPE) {
            true => Caller::Operator(claims.sub),
            false => Caller::Customer(claims.sub),
        })
    }
}

impl<S> FromRequestParts<S> for Caller
where
    Auth: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        // A header that is not text is as good as none.
        let authorization = parts.headers.get(header::AUTHORIZATION).and_then(|value| value.to_str().ok());
        Auth::from_ref(state).caller(authorization)
    }
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::{EncodingKey, Header, encode};

    use super::*;

    const SECRET: &str = "a test secret of thirty-two bytes!!";

    fn args(key: &str) -> AuthArgs {
        AuthArgs {
            auth_jwt_key: JwtKey(key.to_owned()),
            auth_jwt_algorithm: "HS256".to_owned(),
            auth_jwt_issuer: None,
            auth_jwt_audience: None,
        }
    }

    fn token(claims: serde_json::Value, secret: &str) -> String {
        encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(secret.as_bytes())).expect("token")
    }

    fn bearer(token: &str) -> String {
        format!("Bearer {token}")
    }

    #[test]
    fn a_customer_s_and_an_operator_s_token_name_their_caller() {
        let auth = args(SECRET).auth().expect("auth");
        let exp = chrono::Utc::now().timestamp() + 60;
        let alice = token(serde_json::json!({"sub": "alice", "exp": exp}), SECRET);
        assert_eq!(auth.caller(Some(&bearer(&alice))).expect("alice"), Caller::Customer("alice".into()));
        let ops = token(serde_json::json!({"sub": "ops", "exp": exp, "scope": "read operator"}), SECRET);
        assert_eq!(auth.caller(Some(&bearer(&ops))).expect("ops"), Caller::Operator("ops".into()));
        assert!(Caller::Customer("alice".into()).acts_for("alice"));
        assert!(!Caller::Customer("alice".into()).acts_for("bob"));
        assert!(Caller::Operator("ops".into()).acts_for("bob"));
    }

    #[test]
    fn a_missing_expired_forged_or_unsigned_token_is_refused() {
        let auth = args(SECRET).auth().expect("auth");
        let exp = chrono::Utc::now().timestamp() + 60;
        let refused = |header: Option<&str>| matches!(auth.caller(header), Err(ApiError::Unauthenticated(_)));
        assert!(refused(None));
        assert!(refused(Some("Basic YWxpY2U6cGFzcw==")));
        let expired = token(serde_json::json!({"sub": "alice", "exp": exp - 3600}), SECRET);
        assert!(refused(Some(&bearer(&expired))));
        let forged = token(serde_json::json!({"sub": "alice", "exp": exp}), "another secret of thirty-two bytes!");
        assert!(refused(Some(&bearer(&forged))));
        let no_expiry = token(serde_json::json!({"sub": "alice"}), SECRET);
        assert!(refused(Some(&bearer(&no_expiry))));
        // `alg: none`, unsigned: the header's algorithm is never trusted.
        use base64::Engine as _;
        let b64 = |json: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json);
        let unsigned =
            format!("{}.{}.", b64(r#"{"alg":"none","typ":"JWT"}"#), b64(&format!(r#"{{"sub":"alice","exp":{exp}}}"#)));
        assert!(refused(Some(&bearer(&unsigned))));
    }

    /// The README's and `scripts/demo`'s tokens are valid for compose's key, and say who they say.
    #[test]
    fn the_demo_s_tokens_pass_compose_s_key() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let tokens = std::fs::read_to_string(root.join("ops/demo-tokens.env")).expect("ops/demo-tokens.env");
        let value = |name: &str| {
            let line = tokens.lines().find(|line| line.starts_with(&format!("{name}="))).expect(name);
            line[name.len() + 1..].trim_matches('"').to_owned()
        };
        let compose = std::fs::read_to_string(root.join("compose.yaml")).expect("compose.yaml");
        let key = value("DEMO_AUTH_JWT_KEY");
        assert!(compose.contains(&format!("AUTH_JWT_KEY: \"{key}\"")), "compose's AUTH_JWT_KEY is not the tokens' key");
        let auth = args(&key).auth().expect("the demo's key");
        let caller = |name: &str| auth.caller(Some(&bearer(&value(name)))).expect(name);
        assert_eq!(caller("DEMO_TOKEN"), Caller::Customer("demo".into()));
        assert_eq!(caller("DEMO_OPERATOR_TOKEN"), Caller::Operator("demo-operator".into()));
    }

    #[test]
    fn a_short_secret_or_a_bad_pem_is_refused_at_start_up_naming_the_setting() {
        assert!(args("short").auth().expect_err("short").contains("AUTH_JWT_KEY"));
        let rsa = AuthArgs { auth_jwt_algorithm: "RS256".to_owned(), ..args("not a pem") };
        assert!(rsa.auth().expect_err("pem").contains("AUTH_JWT_KEY"));
        let private = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----";
        let private = AuthArgs { auth_jwt_algorithm: "EdDSA".to_owned(), ..args(private) };
        assert!(private.auth().expect_err("a private key").contains("public key"));
    }

    /// A configured issuer and audience must be named by the token, not merely not contradicted;
    /// a token not valid yet (`nbf`) is refused.
    #[test]
    fn a_configured_issuer_and_audience_are_required_and_nbf_is_checked() {
        let auth = AuthArgs {
            auth_jwt_issuer: Some("https://id.example".to_owned()),
            auth_jwt_audience: Some("orders".to_owned()),
            ..args(SECRET)
        }
        .auth()
        .expect("auth");
        let exp = chrono::Utc::now().timestamp() + 60;
        let caller = |claims: serde_json::Value| auth.caller(Some(&bearer(&token(claims, SECRET))));
        let full = serde_json::json!({"sub": "alice", "exp": exp, "iss": "https://id.example", "aud": "orders"});
        assert_eq!(caller(full.clone()).expect("full"), Caller::Customer("alice".into()));
        for missing in ["iss", "aud"] {
            let mut claims = full.clone();
            claims.as_object_mut().expect("object").remove(missing);
            assert!(caller(claims).is_err(), "a token without {missing}");
        }
        let mut other = full.clone();
        other["aud"] = "billing".into();
        assert!(caller(other).is_err(), "another service's audience");
        let mut early = full;
        early["nbf"] = (exp + 3600).into();
        assert!(caller(early).is_err(), "not valid yet");
    }
}
