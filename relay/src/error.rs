//! The relay's error type, with stable codes.

/// What a relay operation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// A database or validation error from the `ferry` library.
    #[error(transparent)]
    Ferry(#[from] ferry::Error),
    /// Kafka client setup or a fatal client error.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// The producer failed fatally; the process should exit and be restarted.
    #[error("kafka producer failed fatally ({0}); restart the relay")]
    ProducerFatal(String),
    /// Unusable configuration.
    #[error("configuration: {0}")]
    Config(String),
    /// I/O (the HTTP listener).
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The demo or a check found lost records.
    #[error("{0}")]
    Lost(String),
}

impl RelayError {
    /// Stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            RelayError::Ferry(e) => e.code(),
            RelayError::Kafka(_) => "kafka",
            RelayError::ProducerFatal(_) => "kafka_fatal",
            RelayError::Config(_) => "config",
            RelayError::Io(_) => "io",
            RelayError::Lost(_) => "lost",
        }
    }
}
