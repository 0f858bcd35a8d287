//! The `ferry` operator binary's library: the command line
//! ([`commands`]), the failure investigations ([`doctor`]) and the end-to-end
//! [`demo`]. The sidecar (`ferry-relay`) links none of it.

pub mod commands;
pub mod demo;
pub mod doctor;
pub mod error;

pub use error::CliError;

/// The README's Rust examples, compiled as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// The book's Rust examples (`docs/`), compiled as doctests, one chapter each.
#[cfg(doctest)]
pub mod book_doctests {
    #[doc = include_str!("../../docs/library/runs.md")]
    pub struct LibraryRuns;
    #[doc = include_str!("../../docs/library/handlers.md")]
    pub struct LibraryHandlers;
    #[doc = include_str!("../../docs/library/scheduling.md")]
    pub struct LibraryScheduling;
    #[doc = include_str!("../../docs/library/jobs.md")]
    pub struct LibraryJobs;
    #[doc = include_str!("../../docs/consumers.md")]
    pub struct Consumers;
}
