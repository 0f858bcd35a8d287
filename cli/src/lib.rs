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
