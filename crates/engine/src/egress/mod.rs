//! Network egress: each sandbox's policy and the broker that enforces it (docs/egress.md).
//!
//! The VMM processes stay in their empty network namespace under seccomp: they cannot open a
//! network socket of their own. A guest `connect` on a TCP socket, and a guest DNS query, become a
//! request on the sandbox's broker socket ([`wire`]); the broker ([`broker`]), on the trusted side
//! in the controller's process, checks the sandbox's [`policy`], resolves names itself, dials, and
//! passes the connected socket back. DNS is answered inside the engine ([`dns`]): nothing the guest
//! sends reaches a DNS server. With a recording open ([`tape`]) the broker relays and writes down
//! each flow, or serves a recorded one back instead of dialling.

pub mod broker;
pub mod dns;
pub mod policy;
pub mod special;
pub mod tape;
pub mod wire;

pub use broker::{LogEntry, Resolver, SandboxNet};
pub use policy::{Policy, RuleError};
