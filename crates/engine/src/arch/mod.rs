//! Architecture-specific guest layout and state (x86-64 only).
pub mod x86_64;
