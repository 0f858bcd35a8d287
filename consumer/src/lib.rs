//! `ferry-consumer`: Kafka consumer-group consumers whose handler effects
//! commit at most once per group.
//!
//! Records commit in database transactions of consecutive records of one
//! partition (a micro-batch) or of one record: the partition lease is
//! checked at this member's generation, the ledger rows `(group, effect
//! key)` are inserted (a duplicate skips the handler), the handlers write
//! their effects, and `next_offset` is stored, all committed together.
//! Kafka offsets are committed afterwards too, for lag tools, but the offset
//! of record is the one stored with the effects.
//!
//! ```no_run
//! # async fn demo(ferry: ferry::Ferry) -> Result<(), ferry_consumer::ConsumerError> {
//! use ferry_consumer::{Consumer, Handler, HandlerError, Record};
//! use futures::future::BoxFuture;
//!
//! struct CountOrders;
//! impl Handler for CountOrders {
//!     fn handle<'a>(&'a self, r: &'a Record, tx: &'a mut ferry::Tx) -> BoxFuture<'a, Result<(), HandlerError>> {
//!         Box::pin(async move {
//!             let key = String::from_utf8_lossy(r.key.as_deref().unwrap_or_default()).into_owned();
//!             // A portable statement in the record's transaction (both engines);
//!             // engine-specific SQL can use `tx.conn()` with sqlx instead.
//!             let sql = "INSERT INTO order_counts (key, n) VALUES ($1, 1) ON CONFLICT (key) DO UPDATE SET n = order_counts.n + 1";
//!             tx.execute(sql, &[ferry::store::Arg::from(&key)]).await?;
//!             Ok(())
//!         })
//!     }
//! }
//!
//! Consumer::builder(ferry, "127.0.0.1:9092", "order-counter", &["orders"])
//!     .handler(CountOrders)
//!     .dead_letter_topic("orders.dlq")
//!     .run(async { tokio::signal::ctrl_c().await.ok(); })
//!     .await
//! # }
//! ```
#![forbid(unsafe_code)]
#![deny(clippy::print_stdout)]

pub mod error;
pub mod metrics;
pub mod process;
pub mod record;
pub mod runner;
pub mod store;

pub use error::{classify, ConsumerError, Fault, HandlerClass, HandlerError};
pub use process::{batchable_key, process_batch, process_record, BatchError, ProcessError, Processed};
pub use record::{Handler, Record};
pub use runner::{Assignment, Consumer, ConsumerBuilder, DEFAULT_MICRO_BATCH};
