//! The consumer's error types: what a handler returns, and what the runtime
//! can fail with, each with a stable code.

/// How a handler failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerClass {
    /// Retry in place with bounded backoff; the partition pauses meanwhile.
    Retryable,
    /// Never retry: dead-letter the record and move on.
    Terminal,
}

/// A handler's failure, with a safe code put on the dead-letter record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class:?} handler error {code}")]
pub struct HandlerError {
    /// Retry classification.
    pub class: HandlerClass,
    /// Safe machine code.
    pub code: String,
}

impl HandlerError {
    /// A retryable failure.
    pub fn retryable(code: impl Into<String>) -> Self {
        HandlerError {
            class: HandlerClass::Retryable,
            code: code.into(),
        }
    }

    /// A terminal failure.
    pub fn terminal(code: impl Into<String>) -> Self {
        HandlerError {
            class: HandlerClass::Terminal,
            code: code.into(),
        }
    }
}

impl From<ferry::Error> for HandlerError {
    /// Database errors from the handler's own writes: transient ones retry.
    fn from(e: ferry::Error) -> Self {
        if e.is_transient() {
            HandlerError::retryable(e.code())
        } else {
            HandlerError::terminal(e.code())
        }
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        ferry::Error::from(e).into()
    }
}

/// What the consumer runtime can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The database, or a fenced write refused (`lost_lease`).
    #[error(transparent)]
    Ferry(#[from] ferry::Error),
    /// Kafka.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// Unusable configuration.
    #[error("configuration: {0}")]
    Config(String),
}

impl ConsumerError {
    /// Stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            ConsumerError::Ferry(e) => e.code(),
            ConsumerError::Kafka(_) => "kafka",
            ConsumerError::Config(_) => "config",
        }
    }
}
