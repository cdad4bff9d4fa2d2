//! Platforms: the ways a guest process runs under the syscall personality ([`crate::guestos`]).
//!
//! After gVisor's `pkg/sentry/platform`: the personality asks a platform to run a guest context until
//! its next syscall, fault or signal, to read and write its memory and to change its address space;
//! it never asks which platform it has. See docs/platforms.md.

pub mod systrap;
