//! [`Millis`] as a column: a BIGINT (PostgreSQL) or INTEGER (SQLite) holding
//! milliseconds since the Unix epoch. Decoding a negative value fails with the
//! value named: instants are never negative.

use crate::time::Millis;

fn decoded(ms: i64) -> Result<Millis, sqlx::error::BoxDynError> {
    Millis::new(ms).map_err(|_| format!("corrupt instant {ms}: instants are never negative").into())
}

impl sqlx::Type<sqlx::Postgres> for Millis {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <i64 as sqlx::Type<sqlx::Postgres>>::type_info()
    }
}

impl<'q> sqlx::Encode<'q, sqlx::Postgres> for Millis {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <i64 as sqlx::Encode<'q, sqlx::Postgres>>::encode_by_ref(&self.get(), buf)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for Millis {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        decoded(<i64 as sqlx::Decode<'r, sqlx::Postgres>>::decode(value)?)
    }
}

impl sqlx::Type<sqlx::Sqlite> for Millis {
    fn type_info() -> sqlx::sqlite::SqliteTypeInfo {
        <i64 as sqlx::Type<sqlx::Sqlite>>::type_info()
    }
    fn compatible(ty: &sqlx::sqlite::SqliteTypeInfo) -> bool {
        <i64 as sqlx::Type<sqlx::Sqlite>>::compatible(ty)
    }
}

impl<'q> sqlx::Encode<'q, sqlx::Sqlite> for Millis {
    fn encode_by_ref(
        &self,
        buf: &mut Vec<sqlx::sqlite::SqliteArgumentValue<'q>>,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <i64 as sqlx::Encode<'q, sqlx::Sqlite>>::encode_by_ref(&self.get(), buf)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Sqlite> for Millis {
    fn decode(value: sqlx::sqlite::SqliteValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        decoded(<i64 as sqlx::Decode<'r, sqlx::Sqlite>>::decode(value)?)
    }
}
