//! The orders database keeps its states as text, not as Postgres enums: a job's state (held to
//! its names by a CHECK constraint), an order's status and a story event's kind (by the code).
//! Turning a column into an enum rewrites its table, which an upgrade must not do on a million
//! rows (`tests/upgrade.rs`). [`stored_as_text!`] makes such a type bind and decode as its name, so that
//! statements bind `JobState::Published` and rows decode into it; a name that is none of its
//! values fails to decode, naming it.

/// Implement sqlx's `Type`, `Encode`, `Decode` and `PgHasArrayType` for each type, over text,
/// through its `as_str` and its `TryFrom<String>`.
macro_rules! stored_as_text {
    ($($stored:ty),+ $(,)?) => {$(
        impl sqlx::Type<sqlx::Postgres> for $stored {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::Type<sqlx::Postgres>>::type_info()
            }

            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        impl sqlx::postgres::PgHasArrayType for $stored {
            fn array_type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::postgres::PgHasArrayType>::array_type_info()
            }
        }

        impl sqlx::Encode<'_, sqlx::Postgres> for $stored {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl sqlx::Decode<'_, sqlx::Postgres> for $stored {
            fn decode(value: sqlx::postgres::PgValueRef<'_>) -> Result<Self, sqlx::error::BoxDynError> {
                let name = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
                Ok(Self::try_from(name.to_owned())?)
            }
        }
    )+};
}

stored_as_text!(crate::jobs::JobState, crate::order::OrderStatus, crate::story::Kind);
